"""Every option of every command has help text, booleans read --flag/--no-flag and defaults are shown."""
from __future__ import annotations

from collections.abc import Iterator

import pytest
import typer
from typer.core import TyperOption
from typer.testing import CliRunner

from mpfa.cli.app import app



def commands(command=typer.main.get_command(app), path: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    """The path of every leaf command, `accuracy task` included."""
    if hasattr(command, "commands"):
        for name, sub in command.commands.items():
            yield from commands(sub, (*path, name))
    else:
        yield path


def command_at(path: tuple[str, ...]):
    command = typer.main.get_command(app)
    for name in path:
        command = command.commands[name]
    return command


def options(path: tuple[str, ...]) -> list[TyperOption]:
    return [p for p in command_at(path).params if isinstance(p, TyperOption)]


@pytest.mark.parametrize("path", list(commands()), ids=" ".join)
def test_every_option_has_help_and_every_boolean_a_negation(path):
    assert not [o.opts for o in options(path) if not o.help]
    assert not [o.opts for o in options(path) if o.is_flag and not o.secondary_opts]


@pytest.mark.parametrize("path", list(commands()), ids=" ".join)
def test_help_shows_the_defaults(path):
    result = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    shown = [o for o in options(path) if o.default not in (None, False) and o.show_default is not False]
    assert result.output.count("[default: ") >= len(shown)

