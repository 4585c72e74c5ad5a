"""Issue 27: every command's --help fits 80 columns, as a terminal and as a pipe, and shows each flag whole:
no name cut to `--global-batch-si…`, no flag, default or number broken across lines."""

from __future__ import annotations

import re

import pytest
import typer
from typer.testing import CliRunner

from planner.cli.main import app


def _commands() -> list[tuple[list[str], object]]:
    """Every command and group as (argv prefix, click command), walked from the app itself, so a command
    added later is checked too."""
    root = typer.main.get_command(app)
    out = []

    def walk(cmd: object, path: list[str]) -> None:
        out.append((path, cmd))
        for name, sub in sorted(getattr(cmd, "commands", {}).items()):
            walk(sub, [*path, name])

    walk(root, [])
    return out


COMMANDS = _commands()


def test_every_command_is_walked():
    names = {" ".join(p) for p, _ in COMMANDS}
    assert {"estimate", "explain", "search", "probe run", "probe launch", "report", "prices"} <= names


@pytest.mark.parametrize("path,cmd", COMMANDS, ids=[" ".join(p) or "planner" for p, _ in COMMANDS])
@pytest.mark.parametrize("columns", ["80", "200"])
def test_help_fits_80_columns_and_names_every_flag_whole(path, cmd, columns):
    result = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": columns, "TERM": "dumb"})
    assert result.exit_code == 0, result.output
    text = result.output
    lines = text.splitlines()
    assert all(len(line) <= 80 for line in lines), [line for line in lines if len(line) > 80]
    assert "…" not in text and not re.search(r"[╭│╰]", text)  # nothing cut, no boxes to break in a pipe
    for param in getattr(cmd, "params", []):
        for name in [*getattr(param, "opts", []), *getattr(param, "secondary_opts", [])]:
            if name.startswith("-"):
                assert re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", text), f"{name} not whole in help"
    # a word or number broken at the line's end: 'no-gradient-as-' + 'bucket-view', '2,0' + '48', '65,' + '536'
    broken = [a for a, b in zip(lines, lines[1:], strict=False)
              if (re.search(r"\w-$", a) and b.strip()[:1].isalnum())
              or (re.search(r"\d,?$", a) and b.strip()[:1].isdigit())]
    assert not broken, broken


@pytest.mark.parametrize("path", [[], ["probe"]])
def test_a_group_without_a_command_prints_its_help(path):
    """`planner` and `planner probe` alone show the same plain help as --help (rich's error box printed nothing
    once the rich help was off)."""
    alone = CliRunner().invoke(app, path, env={"COLUMNS": "80"})
    helped = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "80"})
    assert "Commands:" in alone.output and alone.output.strip() == helped.output.strip()
