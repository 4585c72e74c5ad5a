"""Issue 38: the `planner` command ends its process without the interpreter's teardown (`cli.main.leave_now`),
having run what the teardown runs that matters: the exit functions, and stdout and stderr flushed. A library
user's process (this test's) is never ended."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# The console script's name makes the process the command (planner._startup.started_as_command); an exit
# function writes a file, as logging's flush or a temporary folder's removal would act at exit.
STARTER = """
import atexit, sys
from pathlib import Path
marker = sys.argv.pop(1)
atexit.register(lambda: Path(marker).write_text("ran"))


class Teardown:  # freed only by the interpreter's teardown (module globals cleared)
    def __del__(self):
        Path(marker + ".teardown").write_text("ran")


kept = Teardown()
from planner.cli.main import main
main()
"""


def _run(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, Path]:
    script = tmp_path / "planner"
    script.write_text(STARTER)
    marker = tmp_path / "marker"
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, str(script), str(marker), *args], capture_output=True, text=True,
                          env=env, timeout=120, cwd=tmp_path)
    return proc, marker


def test_the_command_runs_exit_functions_and_writes_everything(tmp_path):
    proc, marker = _run(tmp_path, "models", "--json")
    assert proc.returncode == 0, proc.stderr
    import json

    rows = json.loads(proc.stdout)  # the whole answer reached the pipe (flushed before the process ended)
    assert len(rows) > 5
    assert marker.read_text() == "ran"
    assert not Path(f"{marker}.teardown").exists()  # the teardown was skipped


def test_a_plain_python_exit_tears_down(tmp_path):
    """The check above can fail: the same script, not named as the command, is torn down at exit."""
    script = tmp_path / "other.py"
    script.write_text(STARTER.replace("from planner.cli.main import main\nmain()", ""))
    marker = tmp_path / "marker"
    subprocess.run([sys.executable, str(script), str(marker)], check=True, timeout=60)
    assert marker.read_text() == "ran" and Path(f"{marker}.teardown").read_text() == "ran"


def test_the_command_keeps_its_exit_status(tmp_path):
    proc, marker = _run(tmp_path, "estimate", "-m", "no-such-model")
    assert proc.returncode == 2
    assert proc.stderr.startswith("error:") and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert marker.read_text() == "ran"


def test_a_library_process_is_not_ended():
    from planner.cli.main import leave_now

    leave_now(0)  # pytest is not the command: returns, and this test goes on
    leave_now("a message")


def test_a_profiled_command_writes_its_profile(tmp_path):
    """`python -m cProfile -o FILE -m planner ...` (as the tracer's cost was found): cProfile writes after
    the command returns, so a command with a profiler attached exits as the interpreter does."""
    out = tmp_path / "planner.prof"
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-m", "cProfile", "-o", str(out), "-m", "planner", "models", "--json"],
                          capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert out.stat().st_size > 0
