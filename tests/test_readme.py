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


def test_ci_runs_the_test_command_in_a_fresh_virtualenv():
    """A dependency missing from pyproject.toml must fail CI: the command runs in a new venv, not the system
    Python (which may already hold the package), and the venv is made before the command runs."""
    ci = (ROOT / ".ci" / "run").read_text()
    command = readme_command("test-command")
    made = re.search(r"python3 -m venv \"?\$\w+\"?", ci)
    activated = re.search(r"^\. \"?\$\w+\"?/bin/activate", ci, re.M)
    assert made and activated, ".ci/run must create and activate a fresh virtualenv"
    assert "--system-site-packages" not in ci
    assert made.start() < activated.start() < ci.index(command)


def test_test_extra_lists_what_the_tests_import():
    """Every third-party module the tests import (directly, or through benchmarks they run) comes from a
    distribution listed in the dependencies or the [test] extra; scipy is pandas' Spearman correlation, which
    benchmarks/public_speed.py uses and no file imports by name."""
    import ast
    import sys
    import tomllib
    from importlib.metadata import packages_distributions

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    listed = {re.split(r"[<>=\[ ;]", d, maxsplit=1)[0].lower().replace("_", "-")
              for d in project["dependencies"] + project["optional-dependencies"]["test"]}
    assert "scipy" in listed
    local = {p.stem for d in ("tests", "benchmarks", "jobs", "examples") for p in (ROOT / d).glob("*.py")}
    local |= {"planner", "tests", "benchmarks", "jobs", "examples"}
    optional = {"flash_attn", "sagemaker"}  # probed with find_spec/try by the code that uses them
    dists = packages_distributions()
    missing = set()
    for path in [*(ROOT / "tests").glob("*.py"), *(ROOT / "benchmarks").glob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else [])
            for name in names:
                top = name.split(".")[0]
                if top in sys.stdlib_module_names or top in local or top in optional:
                    continue
                if not {d.lower().replace("_", "-") for d in dists.get(top, [top])} & listed:
                    missing.add(f"{top} ({path.name})")
    # numpy comes with pandas, click with typer: transitive, but every test environment has them
    missing = {m for m in missing if m.split()[0] not in {"numpy", "click", "botocore"}}
    assert not missing, f"imported by tests but not in pyproject.toml: {sorted(missing)}"


def test_readme_fits_a_newcomer_and_its_links_resolve():
    """At most 300 lines, the two commands within the first 60 (one screen), and every link to docs/ (and from
    docs/ back) names a file that exists."""
    text = (ROOT / "README.md").read_text()
    lines = text.splitlines()
    assert len(lines) <= 300
    head = "\n".join(lines[:60])
    assert "<!-- main-command -->" in head and "<!-- test-command -->" in head
    assert readme_command("test-command") in head and readme_command("main-command") in head
    for page in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]:
        for target in re.findall(r"\]\(([^)#:]+)\)", page.read_text()):
            assert (page.parent / target).exists(), f"{page.name}: link to {target} resolves to nothing"
