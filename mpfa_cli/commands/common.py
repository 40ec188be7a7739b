"""What every command group shares: the consoles, the one-line error handling, the database option and parsers
of comma-separated option values."""
from __future__ import annotations

import functools
import os
import sys
import traceback
from pathlib import Path
from typing import Annotated, Callable, NoReturn, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.panel import Panel
from rich.table import Table
from rich.text import Text
from typer import rich_utils
from typer.core import TyperOption
from typer.exceptions import TyperException

from ..errors import UserError
from ..results.store import ResultStore

console = Console()
err_console = Console(stderr=True)

DB_HELP = ("Results database, in a folder that exists (default: $MPFA_DB, else ~/.local/share/mpfa/results.db, whose "
           "folder is created).")
DbOption = Annotated[Optional[Path], typer.Option("--db", metavar="FILE", help=DB_HELP)]
# The options of the commands that start servers (`bench`, `logits`, `accuracy serve`).
EngineOption = Annotated[str, typer.Option(help="auto (sglang with a GPU, else sim), sim, sglang.")]
PortOption = Annotated[Optional[int], typer.Option(help="Preferred server port (another is picked if it is in use).")]
TimeScaleOption = Annotated[float, typer.Option(help="Simulator only: multiply modelled times by this.")]
ReadyTimeoutOption = Annotated[Optional[float], typer.Option(help="Seconds to wait for each server to get ready.")]
ServerArgOption = Annotated[Optional[list[str]], typer.Option("--server-arg", help="Extra server flag, SGLang's or serve-sim's (repeatable).")]
RunDirOption = Annotated[Optional[Path], typer.Option(help="Where server logs go (default: beside the database).")]
# The side-by-side commands (`logits`, `accuracy serve`): one server URL per backend.
# `accuracy serve` / `emulate`: cells with their own question counts instead of every task at every length.
CellsOption = Annotated[Optional[str], typer.Option(help="Comma-separated task@length=N (task=N for squad, social_iqa): these cells only, each with its own number of questions; replaces --tasks, --lengths and --limit.")]
UrlsOption = Annotated[Optional[str], typer.Option(help="Servers someone else started: comma-separated URLs, one per backend in --backend order.")]
PrefillKernelOption = Annotated[Optional[str], typer.Option("--prefill-kernel", help="MpFA prefill kernel: fp8, exact or mma-sync (default: the best for the model's shape; also $MPFA_PREFILL_KERNEL).")]

# Typer releases without Rich type display (the GPU host's pinned stack has one) keep their own help.
_typer_display_type = getattr(TyperOption, "display_type_rich", None)
# Typer's placeholders for an option without a metavar, as words ("<list[str]>" reads as Python, not as a value).
_PLACEHOLDERS = {"<str>": "TEXT", "<int>": "INTEGER", "<float>": "NUMBER", "<path>": "PATH", "<list[str]>": "TEXT",
                 "<list[int]>": "INTEGER", "<list[path]>": "PATH"}


def _flag_display_type(option: TyperOption, ctx: typer.Context) -> str | None:
    """A flag takes no value, so its help shows no type: `--wide/--narrow`, not `--wide --narrow <bool>` (Typer's
    Rich help prints every option's type, flags' included); other types read as words (`_PLACEHOLDERS`)."""
    if option.is_flag:
        return None
    shown = _typer_display_type(option, ctx)
    return _PLACEHOLDERS.get(str(shown).lower(), shown)


NAMES_WIDTH = 22  # an option's names wrap at this width (`--allow-missing /` over `--no-allow-missing`)


def _options_panel(*, name: str, params: list, ctx: typer.Context, markup_mode: str, console: Console) -> None:
    """Typer's options panel in three columns: an option's names (its short form and negation wrap under it), the
    placeholder of its value, its help. Typer's own gives the short form and the negation columns of their own,
    which at 80 columns leave the help ~25 and cut long option names, words and defaults short with '…'."""
    if not params:
        return
    table = Table(highlight=True, show_header=False, expand=True, box=None, padding=(0, 1))
    table.add_column(overflow="fold", max_width=NAMES_WIDTH)  # the names: never cut, folded
    table.add_column(overflow="fold", style=rich_utils.STYLE_TYPES)
    table.add_column(ratio=1, overflow="fold")
    for param in params:
        names = ", ".join(param.opts) if isinstance(param, TyperOption) else param.display_name_raw
        if getattr(param, "secondary_opts", None):
            names += " / " + ", ".join(param.secondary_opts)
        if param.required:
            names = f"{rich_utils.REQUIRED_SHORT_STRING} {names}"
        help_parts = rich_utils._get_parameter_help(param=param, ctx=ctx, markup_mode=markup_mode)
        for part in help_parts.renderables:  # a word longer than the column (a path) folds instead of being cut
            if isinstance(part, Text):
                part.overflow = "fold"
        table.add_row(rich_utils.highlighter(names), param.display_type_rich(ctx=ctx) or "", help_parts)
    console.print(Panel(table, border_style=rich_utils.STYLE_OPTIONS_PANEL_BORDER, title=name,
                        title_align=rich_utils.ALIGN_OPTIONS_PANEL))


if _typer_display_type is not None:
    TyperOption.display_type_rich = _flag_display_type
    rich_utils._print_options_panel = _options_panel


def cli_errors(fn: Callable) -> Callable:
    """Every error ends in one line on stderr and a non-zero exit: a `UserError` (bad input, an unusable
    environment) with its own exit code, Ctrl-C with 130, anything unexpected with 1, naming the exception. The
    global `--debug` prints the traceback before that line."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            result = fn(*args, **kwargs)
            sys.stdout.flush()  # here, where a closed pipe is caught, not at exit
            return result
        except BrokenPipeError:
            _reader_gone()
        except (typer.Exit, typer.Abort, TyperException):
            raise  # Typer's own ends: usage errors (exit 2) and explicit exits
        except UserError as exc:
            _fail(str(exc), exc.exit_code)
        except KeyboardInterrupt:
            _fail("interrupted", 130, prefix="")
        except Exception as exc:
            first_line = next(iter(str(exc).splitlines()), "")
            hint = "" if debug_requested() else " (run `mpfa --debug ...` for the traceback)"
            _fail(f"unexpected {type(exc).__name__}: {first_line}{hint}", 1)

    return wrapper


def _reader_gone() -> NoReturn:
    """The reader of stdout left (`mpfa export | head -c 100`): stop quietly with the shell's SIGPIPE status, 141;
    stdout goes to /dev/null so the interpreter's last flush has nowhere to fail."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    raise typer.Exit(141)


_debug = False  # the global --debug, set by the app's callback before any command runs


def set_debug(enabled: bool) -> None:
    global _debug
    _debug = enabled


def debug_requested() -> bool:
    """Whether the command line began `mpfa --debug`."""
    return _debug


def _fail(message: str, exit_code: int, prefix: str = "[bold red]error:[/] ") -> NoReturn:
    """Print the error (after its traceback, with --debug) and exit with `exit_code`."""
    if debug_requested():
        traceback.print_exc()
    err_console.print(prefix + escape(message), highlight=False, soft_wrap=True)
    raise typer.Exit(exit_code) from None


def open_store(db: Path | None) -> ResultStore:
    return ResultStore(db)


def number_list(text: str | None, flag: str, kind: type = int) -> list | None:
    """`8,16` -> [8, 16]; None when the flag was not given."""
    if text is None:
        return None
    try:
        return [kind(v) for v in text.split(",")]
    except ValueError:
        raise UserError(f"{flag}: expected comma-separated {kind.__name__} values, got '{text}'") from None


def progress_line(line: str) -> None:
    """A profiler's progress line, on stderr."""
    err_console.print(line, highlight=False)
