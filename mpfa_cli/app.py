"""The `mpfa` Typer application: every command, registered from its command group's module."""
from __future__ import annotations

from typing import Annotated

import typer

from .commands import (accuracy as accuracy_commands, bench as bench_commands, catalog as catalog_commands,
                       logits as logits_commands, profile as profile_commands)
from .commands import common, results as results_commands
from .commands.extensions import load_extensions

app = typer.Typer(
    help="Benchmark and profile LLM serving across attention backends (FA3 in BF16 or FP8, FA4-BF16, FlashInfer-FP8, MpFA).",
    no_args_is_help=True, pretty_exceptions_enable=False, add_completion=False,
)


def _print_version(asked: bool) -> None:
    """`mpfa --version`: the installed version, and the git revision of a checkout."""
    if not asked:
        return
    from importlib.metadata import version

    from .harness.environment import git_revision

    revision = git_revision()
    print(f"mpfa {version('mpfa')}" + (f" (git {revision})" if revision else ""))
    raise typer.Exit()


@app.callback()
@common.cli_errors
def main(debug: Annotated[bool, typer.Option("--debug/--no-debug", help="On an error, print the Python traceback "
                                             "before the one-line message.")] = False,
         version: Annotated[bool, typer.Option("--version", is_eager=True, callback=_print_version,
                                               help="Print the version and exit.")] = False) -> None:
    """The global options; then the modules $MPFA_EXTENSIONS names, which may register backends."""
    common.set_debug(debug)
    load_extensions()


app.command()(bench_commands.bench)
app.command()(results_commands.runs)
app.command()(results_commands.show)
app.command()(results_commands.compare)
app.command()(results_commands.export)
app.command("import")(results_commands.import_runs)
app.command()(results_commands.plot)
app.command()(results_commands.gate)
app.command()(results_commands.report)
app.add_typer(profile_commands.profile_app, name="profile")
app.command()(logits_commands.logits)
app.command("serve-sim")(bench_commands.serve_sim)
app.command()(catalog_commands.backends)
app.command()(catalog_commands.scenarios)
app.command()(catalog_commands.metrics)
app.add_typer(accuracy_commands.accuracy_app, name="accuracy")
