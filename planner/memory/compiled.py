"""When to replay a step with the compiled kernel (`replay_kernel`, Numba) instead of `allocator.fast_run`.

Why a policy: the kernel replays a step ~35x faster (~0.12 ms against ~4 ms for BERT-base), but importing
Numba and loading the compiled code costs ~0.6 s per process (~3 s the first time after an install, while Numba
compiles and caches it). A single
`planner estimate` replays one or two steps (~5 ms in Python), so it never loads the kernel; a process that
has replayed `COMPILE_AFTER` steps in Python (a search, a sweep, a benchmark) is likely to replay many more,
and switches. Both give the same `ReplayResult` (tests/test_replay_kernel.py), so the switch changes speed only.

`PLANNER_COMPILED_REPLAY`: `0` never loads the kernel, `1` loads it at the first replay; unset: the policy.
Without Numba (or on a broken install) every replay stays in Python.
"""

from __future__ import annotations

import gc

from planner.memory.allocator import K_LARGE_BUFFER, ReplayResult
from planner.memory.events import Trace

COMPILE_AFTER = 100  # Python replays before the kernel is loaded: ~0.4 s of replays against ~0.6 s of loading
INT64_LIMIT = 1 << 62  # every address the kernel computes must stay below this

_state = {"python_replays": 0, "kernel": None, "unavailable": False}


def _mode() -> str:
    from planner.env import choice

    return choice("PLANNER_COMPILED_REPLAY")


def _load():
    """The kernel, or None when Numba is missing or cannot compile it here."""
    if _state["kernel"] is None and not _state["unavailable"]:
        try:
            from planner.memory.replay_kernel import replay_program
        except (ImportError, OSError):  # no Numba, or an llvmlite whose library does not load: Python replays
            _state["unavailable"] = True
            return None
        import numpy as np

        one = np.ones(1, np.int64)
        try:  # loads the machine code: from Numba's cache, or compiling it
            replay_program(one, one - 1, one, one.astype(np.bool_), -1, -1)
        except Exception:  # noqa: BLE001 - a cache Numba cannot read back, a compiler failure: Python replays,
            _state["unavailable"] = True  # which give the same results, only slower
            return None
        _state["kernel"] = replay_program
        if FREEZE_ON_LOAD:
            _freeze()
    return _state["kernel"]


# Whether loading the kernel also freezes the objects alive at that moment (`_freeze`): set by the `planner`
# command, which owns its process; left off for a library user, whose process this module does not own.
FREEZE_ON_LOAD = False


def _freeze() -> None:
    """Numba, llvmlite and the SciPy they import, and loading the machine code, leave ~1.7 x 10^5 objects that
    live as long as the process; every full collection would scan them again (~45 ms each, ~15 % of a search's
    estimates). `gc.freeze` moves every object alive now to the generation collections skip. The trade: one of
    them that later becomes cyclic garbage is never collected, so it is done once, right after a full
    collection, in a process the command owns."""
    gc.collect()
    gc.freeze()


def kernel_ready() -> bool:
    """Whether replays in this process now go through the kernel (loading it if the policy says so)."""
    mode = _mode()
    if mode == "0":
        return False
    if _state["kernel"] is not None:
        return True
    if mode == "1" or _state["python_replays"] >= COMPILE_AFTER:
        return _load() is not None
    return False


def warm() -> bool:
    """Load the kernel now (benchmarks, long searches): True when it is available."""
    if _mode() == "0":
        return False
    return _load() is not None


def _arrays(trace: Trace):
    """The trace as int64 arrays, cached on it; None when its numbers do not fit in int64."""
    import numpy as np

    hit = trace.__dict__.get("_int64_arrays", False)
    if hit is not False:
        return hit
    n = trace.n_tensors
    try:
        sizes = np.fromiter(trace.iter_sizes(), np.int64, n)
    except OverflowError:
        sizes = None
    out = None
    # every address stays below the sum of the segments: each its request rounded up, plus < 20 MiB
    if sizes is not None and (not n or n * (int(sizes.max()) + K_LARGE_BUFFER) < INT64_LIMIT):
        laid = trace.__dict__.get("_laid")  # laid out as arrays already (`events.step_events`)
        program = laid.arrays if laid is not None else None
        if program is None:
            program = (np.array([p[0] for p in trace.program], dtype=np.int64),
                       np.array([p[1] for p in trace.program], dtype=np.int64),
                       np.array([p[2] for p in trace.program], dtype=np.bool_))
        out = (sizes, *program)
    trace.__dict__["_int64_arrays"] = out
    return out


def kernel_replay(trace: Trace, *, capacity_bytes: int | None = None,
                  max_split_size: int | None = None) -> ReplayResult | None:
    """The trace's replay through the kernel whatever the policy (loading it); None when Numba is missing or
    the trace's numbers do not fit in int64."""
    kernel = _load()
    arrays = _arrays(trace) if kernel is not None else None
    if arrays is None or (capacity_bytes or 0) >= INT64_LIMIT or (max_split_size or 0) >= INT64_LIMIT:
        return None
    out = kernel(*arrays, -1 if capacity_bytes is None else capacity_bytes,
                 -1 if max_split_size is None else max_split_size).tolist()
    return ReplayResult(*out[:7], bool(out[7]), bool(out[8]), False)


def replay_arrays(sizes, starts, stops, allocs, *, capacity_bytes: int | None = None,
                  max_split_size: int | None = None) -> ReplayResult | None:
    """A program already as int64 arrays (a run of steps, `planner.run.replay`) through the kernel whatever
    the policy (loading it); None when Numba is missing or the numbers do not fit in int64."""
    kernel = _load()
    if kernel is None or (capacity_bytes or 0) >= INT64_LIMIT or (max_split_size or 0) >= INT64_LIMIT:
        return None
    n = len(sizes)
    if n and n * (int(sizes.max()) + K_LARGE_BUFFER) >= INT64_LIMIT:
        return None
    out = kernel(sizes, starts, stops, allocs, -1 if capacity_bytes is None else capacity_bytes,
                 -1 if max_split_size is None else max_split_size).tolist()
    return ReplayResult(*out[:7], bool(out[7]), bool(out[8]), False)


def replay(trace: Trace, *, capacity_bytes: int | None = None,
           max_split_size: int | None = None) -> ReplayResult | None:
    """The trace's replay through the kernel when the policy has it loaded; None otherwise (the caller replays
    in Python, and this counts it towards `COMPILE_AFTER`)."""
    if kernel_ready():
        result = kernel_replay(trace, capacity_bytes=capacity_bytes, max_split_size=max_split_size)
        if result is not None:
            return result
    _state["python_replays"] += 1
    return None
