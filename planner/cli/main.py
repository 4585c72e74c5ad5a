"""The `planner` command: each sub-command lives in its own module and registers itself here."""

from __future__ import annotations

import sys
from typing import Any

import typer
from typer.core import TyperGroup

try:  # typer >= 0.17 parses with its own copy of click
    from typer._click import exceptions as click
    from typer.exceptions import Abort
except ImportError:  # pragma: no cover
    from click import exceptions as click  # type: ignore[no-redef]
    from click.exceptions import Abort  # type: ignore[no-redef,assignment]

from planner._startup import restore_interrupts
from planner.cli import (
    catalog_cmd,
    estimate_cmd,
    models_cmd,
    prices_cmd,
    probe_cmd,
    report_cmd,
    search_cmd,
)
from planner.cli.help_text import keep_words_whole


class OneLineErrors(TyperGroup):
    """A flag click cannot parse (`--batch-size inf`) is one line on stderr and exit 2, like every other bad
    input, instead of a usage box; help (`planner`, `planner probe`) is unchanged."""

    def main(self, args: Any = None, prog_name: str | None = None, complete_var: str | None = None,
             standalone_mode: bool = True, **extra: Any) -> Any:
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click.NoArgsIsHelpError as exc:  # `planner`, `planner probe`: the help, plain like --help
            try:
                print(exc.ctx.get_help() if exc.ctx is not None else exc.format_message(), flush=True)
            except BrokenPipeError:  # `planner | head`
                _silence_stdout()
            sys.exit(exc.exit_code)
        except click.UsageError as exc:
            where = f" (see `{exc.ctx.command_path} --help`)" if exc.ctx is not None else ""
            print(f"error: {' '.join(exc.format_message().split())}{where}", file=sys.stderr)
            sys.exit(2)
        except Abort:
            print("Aborted!", file=sys.stderr)
            sys.exit(1)
        except BrokenPipeError:  # `planner models | head`: the reader left; say nothing more
            _silence_stdout()
            sys.exit(0)
        sys.exit(rv if isinstance(rv, int) else 0)


def _silence_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush does not raise a second BrokenPipeError."""
    import os

    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):  # pragma: no cover - stdout already closed or not a real file
        pass


# Help as plain text (click's formatter), at most 80 columns: rich's help panels cut long flag names to fit
# their columns (`--global-batch-si…`) and draw boxes that break when piped; the plain layout puts a long
# flag's help on the next line instead and never cuts a word or a number.
HELP_SETTINGS = {"max_content_width": 80}
keep_words_whole()

app = typer.Typer(
    name="planner",
    cls=OneLineErrors,
    help="Will it fit, how fast, how much: capacity planning for training on Amazon SageMaker.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings=HELP_SETTINGS,
)

for module in (estimate_cmd, models_cmd, catalog_cmd, search_cmd, prices_cmd, probe_cmd, report_cmd):
    module.register(app)


restore_interrupts()  # Ctrl-C was quiet while these modules imported (planner/_startup.py); now KeyboardInterrupt


# The collector's youngest generation is collected after this many net allocations (Python's default: 700).
# An estimate makes ~10^4 short-lived objects that reference counting frees anyway; at 700 a search collects
# a few times per estimate and walks whatever happens to be alive each time (~4 % of its estimates' time,
# benchmarks/search_benchmark.py); cyclic garbage waits a little longer to be freed.
GC_FIRST_GENERATION = 10_000


def claim_process() -> None:
    """What the `planner` command does to the process it owns, and a library user's process never gets: the
    collector runs less often, and loading the compiled replay freezes what is alive (`compiled._freeze`).
    Benchmarks call it too, to time what the command runs."""
    import gc

    from planner.memory import compiled

    compiled.FREEZE_ON_LOAD = True
    gc.set_threshold(GC_FIRST_GENERATION, *gc.get_threshold()[1:])


def main() -> None:
    claim_process()
    try:
        app()
    except SystemExit as exc:  # typer ends every command so
        leave_now(exc.code)
        raise


def leave_now(code: object) -> None:
    """End the command's own process without the interpreter's teardown (issue 38).

    Why: after an estimate of a traced model, Python's exit frees the modules of torch and transformers
    object by object and runs torch's C++ destructors: about 1.4 s of CPU after the answer is printed
    (0.6 s after `import torch` alone), a sixth of T5-base's first estimate. What the teardown does that
    matters is done here first: the exit functions (`atexit`: logging's flush, temporary files,
    multiprocessing) and stdout and stderr flushed. Only in the process the command owns
    (`_startup.started_as_command`: never a library user's or a test's), with no other thread running
    (they would be cut short), for an integer exit status, and with no profiler or tracer attached
    (`python -m cProfile -m planner ...` writes its profile after the command returns; coverage too);
    anything else (a flush that fails: a reader that left) returns, and the interpreter exits as it always
    did."""
    import atexit
    import os
    import threading

    from planner._startup import started_as_command

    if not (started_as_command(sys.argv) and (code is None or isinstance(code, int))
            and threading.active_count() == 1 and hasattr(atexit, "_run_exitfuncs")
            and sys.getprofile() is None and sys.gettrace() is None):
        return
    try:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    except Exception:  # noqa: BLE001 - the interpreter's own exit says it, as before
        return
    os._exit(code or 0)


if __name__ == "__main__":  # pragma: no cover
    main()
