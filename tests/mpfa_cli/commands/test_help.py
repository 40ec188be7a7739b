"""Every option of every command has help text, booleans read --flag/--no-flag (no `<bool>` type) and defaults are
shown; a word where run ids go is refused with a message about flags."""
from __future__ import annotations

from collections.abc import Iterator

import pytest
import typer
from typer.core import TyperOption
from typer.testing import CliRunner

from mpfa.mpfa_cli.app import app

MPFA = typer.main.get_command(app)  # the Click command tree, built once: each build takes tens of milliseconds


def command_paths(command=MPFA, path: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    """The path of every command: the groups (`mpfa`, `mpfa accuracy`) and the leaves (`accuracy task` included)."""
    yield path
    for name, sub in getattr(command, "commands", {}).items():
        yield from command_paths(sub, (*path, name))


def commands() -> list[tuple[str, ...]]:
    """The path of every leaf command."""
    return [path for path in command_paths() if not hasattr(command_at(path), "commands")]


def command_at(path: tuple[str, ...]):
    command = MPFA
    for name in path:
        command = command.commands[name]
    return command


def options(path: tuple[str, ...]) -> list[TyperOption]:
    return [p for p in command_at(path).params if isinstance(p, TyperOption)]


@pytest.mark.parametrize("path", commands(), ids=" ".join)
def test_every_option_has_help_and_every_boolean_a_negation(path):
    assert not [o.opts for o in options(path) if not o.help]
    assert not [o.opts for o in options(path) if o.is_flag and not o.secondary_opts]


@pytest.mark.parametrize("path", commands(), ids=" ".join)
def test_help_shows_the_defaults(path):
    result = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    shown = [o for o in options(path) if o.default not in (None, False) and o.show_default is not False]
    assert result.output.count("[default: ") >= len(shown)


@pytest.mark.parametrize("path", list(command_paths()), ids=lambda path: " ".join(("mpfa", *path)))
def test_help_shows_booleans_as_flag_and_negation_without_a_type(path):
    result = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "100"})
    assert result.exit_code == 0, result.output
    assert "<bool>" not in result.output
    for flag in options(path):
        if flag.is_flag:
            assert all(name in result.output for name in (*flag.opts, *flag.secondary_opts))


@pytest.mark.parametrize("args", [["compare", "--wide"], ["export", "--requests"], ["plot", "--accuracy"]], ids=" ".join)
def test_a_flag_given_a_value_is_refused_with_a_message_about_flags(args):
    result = CliRunner().invoke(app, [*args, "true"], env={"COLUMNS": "200"})
    assert result.exit_code == 2
    assert "'true' is not a run id (flags take no value: --flag or --no-flag, not --flag true)" in result.output
