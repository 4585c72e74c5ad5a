"""Work done in a forked child while this process goes on: a value computed by the child from the state of
the parent at the fork, sent back pickled through a pipe (issue 38).

Why: the tracer's optimizer step (AdamW's foreach ops over every parameter tensor, traced on stand-ins:
`trace.optimizer_step`) depends only on the parameters' and gradients' metadata, which are known as soon as
the model is built; traced in a child on the second core while the parent traces the forward and backward,
it costs the first estimate of T5-base none of its ~0.7 s of wall time. The child runs the same function on
the same inputs as the parent would (a copy of its memory), so its answer is the same; anything unusual (no
fork on this platform, one CPU, the child failing, dying or taking longer than `TIMEOUT_S`) gives None and
the caller computes the value itself.

The child ends with `os._exit`: it runs no exit function and flushes none of the parent's buffered output.
"""

from __future__ import annotations

import os
import pickle
import select
import signal
import sys
import time
from collections.abc import Callable, Hashable
from typing import Any

# False: compute everything in this process (the reference the tests compare against).
ENABLED = True
# Seconds the parent waits for a child's answer before computing it itself (the optimizer step of an 8B
# model traces in a few seconds; a child that hangs must not hang the estimate).
TIMEOUT_S = 60.0

_PENDING: dict[Hashable, tuple[int, int]] = {}  # key -> (child pid, read end of its pipe)


def available() -> bool:
    """Forking helps only where a second, idle CPU runs the child (Linux's fork; macOS forks unsafely with threads
    its frameworks started), and is safe only with no other Python thread running (a lock one holds at the
    fork stays held in the child: `planner search`'s progress bar refreshes from a thread)."""
    import threading

    if not (ENABLED and hasattr(os, "fork") and sys.platform.startswith("linux")
            and threading.active_count() == 1):
        return False
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover
        cpus = os.cpu_count() or 1
    if cpus < 2:
        return False
    return not LOAD_AWARE or os.getloadavg()[0] < cpus - 1


# Fork only while the machine's load average leaves a CPU free for the child beside this process (on a busy
# machine the child only competes with the parent: T5-base's estimate at load 3.7 on 2 CPUs took as long
# with the child and 0.2-0.4 s more CPU, its pages copied on write). False: wherever there are 2 CPUs.
LOAD_AWARE = True


def start(key: Hashable, compute: Callable[[], Any]) -> bool:
    """Fork a child that computes `compute()` and sends it back; `collect(key)` reads it. False where no
    child was started (then the caller computes the value when it needs it)."""
    if key in _PENDING or not available():
        return False
    try:
        read, write = os.pipe()
    except OSError:  # pragma: no cover - out of file descriptors
        return False
    try:
        pid = os.fork()
    except OSError:  # pragma: no cover - out of processes or memory
        os.close(read)
        os.close(write)
        return False
    if pid == 0:  # the child: compute, send, leave without the parent's exit functions or buffers
        code = 1
        try:
            import gc

            gc.disable()  # the copy of the parent's memory stays shared (a collection would touch all of it)
            os.close(read)
            payload = pickle.dumps(compute(), protocol=pickle.HIGHEST_PROTOCOL)
            with os.fdopen(write, "wb") as out:
                out.write(payload)
            code = 0
        except BaseException:  # noqa: BLE001 - the parent computes the value itself
            pass
        os._exit(code)
    os.close(write)
    _PENDING[key] = (pid, read)
    return True


def collect(key: Hashable, timeout: float | None = None) -> Any:
    """The value the child for `key` computed; None where none was started, or it failed, died or took
    longer than `timeout` seconds (TIMEOUT_S) from now."""
    entry = _PENDING.pop(key, None)
    if entry is None:
        return None
    pid, read = entry
    deadline = time.monotonic() + (TIMEOUT_S if timeout is None else timeout)
    chunks: list[bytes] = []
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([read], [], [], left)[0]:
                _kill(pid)
                return None
            chunk = os.read(read, 1 << 20)
            if not chunk:
                break
            chunks.append(chunk)
    except (OSError, InterruptedError):  # pragma: no cover
        _kill(pid)
        return None
    finally:
        os.close(read)
    try:
        _, status = os.waitpid(pid, 0)
    except ChildProcessError:  # pragma: no cover - reaped elsewhere
        status = 0
    if status != 0 or not chunks:
        return None
    try:
        return pickle.loads(b"".join(chunks))
    except Exception:  # noqa: BLE001 - a cut payload: compute it here
        return None


def discard(key: Hashable) -> None:
    """End the child for `key` if its answer is not wanted (the guess it was started on was wrong)."""
    entry = _PENDING.pop(key, None)
    if entry is not None:
        pid, read = entry
        os.close(read)
        _kill(pid)


def pending() -> list[Hashable]:
    return list(_PENDING)


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:  # pragma: no cover - ended already
        pass
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:  # pragma: no cover
        pass
