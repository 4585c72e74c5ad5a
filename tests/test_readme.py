"""The README's test command is what CI runs: keep them in step."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def readme_command(label: str) -> str:
    text = (ROOT / "README.md").read_text()
    m = re.search(rf"<!-- {label} -->\s*```(?:bash|sh)?\n(.+?)\n```", text, re.S)
    assert m, f"README has no {label} block"
    return m.group(1).strip()


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    assert readme_command("test-command") in ci


def test_readme_main_command_is_the_search():
    assert "planner search --instance ml.p3.16xlarge" in readme_command("main-command")
