"""The README and docs drive one CLI: every `mpfa …` command in their code names a command that exists, with options
it has, and none runs a module (`python -m mpfa…`) or a script (`python profiles/…`)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import typer

from mpfa.mpfa_cli.app import app

ROOT = Path(__file__).parents[3]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CODE = re.compile(r"```[^\n]*\n(.*?)```|`([^`\n]+)`", re.S)  # fenced blocks, then inline spans
COMMAND = re.compile(r"(?:^|[\s$(])mpfa ((?:[a-z][\w-]*(?: |$))+)(.*)", re.M)  # `mpfa WORD… [ARGS]`
OPTION = re.compile(r"(?<![\w-])(--?[a-zA-Z][\w-]*)")
MPFA = typer.main.get_command(app)


def documented_commands() -> list[tuple[str, str]]:
    """(document, command line) of every `mpfa …` in a code block or span of README.md and docs/*.md."""
    found = []
    for path in DOCS:
        for block, span in CODE.findall(path.read_text()):
            for match in COMMAND.finditer(block or span):
                found.append((path.name, match.group(0).strip()))
    return found


def resolve(words: list[str]) -> tuple[int, object]:
    """How many of `words` (after `mpfa`) name commands, and the command they reach; `prefill|decode` (`\\|` in a
    table) names either, each of which must exist."""
    command, used = MPFA, 0
    for word in words:
        subcommands = getattr(command, "commands", None)
        if subcommands is None or word.startswith("-"):
            break
        alternatives = re.split(r"\\?\|", word)
        assert all(name in subcommands for name in alternatives), f"no command `mpfa {' '.join(words[:used + 1])}`"
        command = subcommands[alternatives[0]]
        used += 1
    return used, command


@pytest.mark.parametrize(("document", "line"), documented_commands(), ids=lambda value: value[:60])
def test_a_documented_command_exists_with_its_options(document, line):
    words = line.split(" #")[0].split()[1:]  # a shell comment is not part of the command
    used, command = resolve(words)
    assert used, line
    known = {name for param in command.params for name in (*param.opts, *param.secondary_opts)} | {"--help"}
    assert not [option for option in OPTION.findall(" ".join(words[used:])) if option not in known], line


@pytest.mark.parametrize("document", DOCS, ids=lambda path: path.name)
def test_docs_run_no_module_and_no_script(document):
    text = document.read_text()
    assert "python -m mpfa" not in text and "python profiles/" not in text
