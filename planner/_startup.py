"""Ctrl-C while the `planner` command is still importing (pydantic, typer, rich, the commands: about a
second) ends it quietly with the shell's 130, not an import traceback. `planner.cli.main` puts Python's
own handler back once imported, so `handles_errors` answers an interrupt while a command runs.

Only when the process is the command (the `planner` console script, or `python -m planner`, whose package
import runs while sys.argv[0] is still "-m"): a library user or a test importing `planner` keeps its own
handler. Standard library only (and planner.env, which is too), so it can run before anything heavy is imported."""

from __future__ import annotations

import os
import signal
import sys
import threading


def interrupted_while_starting(signum: int, frame: object) -> None:
    sys.stderr.write("interrupted\n")
    sys.stderr.flush()
    os._exit(130)  # nothing has been written yet: no cleanup to run


def started_as_command(argv: list[str]) -> bool:
    arg0 = argv[0] if argv else ""
    name = os.path.basename(arg0)
    return arg0 == "-m" or name == "planner" or (name == "__main__.py" and
                                                  os.path.basename(os.path.dirname(arg0)) == "planner")


def quiet_interrupts_while_starting() -> None:
    if started_as_command(sys.argv) and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, interrupted_while_starting)


def check_environment_or_exit() -> None:
    """The command with a bad PLANNER_* setting: one line and exit 2 before anything reads it (a library user
    gets the PlannerError from the import instead)."""
    if not started_as_command(sys.argv):
        return
    from planner.env import check_environment

    problem = check_environment()
    if problem is not None:
        sys.stderr.write(f"error: {problem}\n")
        sys.stderr.flush()
        os._exit(2)


def restore_interrupts() -> None:
    """Python's KeyboardInterrupt again, if `quiet_interrupts_while_starting` had replaced it."""
    if threading.current_thread() is threading.main_thread() and \
            signal.getsignal(signal.SIGINT) is interrupted_while_starting:
        signal.signal(signal.SIGINT, signal.default_int_handler)
