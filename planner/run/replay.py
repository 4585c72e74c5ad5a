"""The allocator across a run: every step's allocations and frees at that step's shape, one after another,
through the same caching-allocator model, with nothing released between steps (no `empty_cache`).

Why: a step's trace (`events.step_events`) is the model's load, the FIRST step (its optimizer step creates
the states, which land in the activations' freed segments) and one steady step. A run is the load and first
step at the first batch's length, then the steady step once per later batch at its own length. The
allocator's state (segments, split blocks, both pools, expandable segments) carries over from step to step,
so a long batch after short ones may find only blocks split for the short shapes and need new segments: the
run's reserved peak grows above the fixed-length step's.

The run is laid out as one compact program (tensor sizes by id, ranges of ids allocated or freed) and replayed
by the existing replays, unchanged: `replay_kernel` (compiled) or `allocator.run` (`fast_run`, and
`run_reference` for expandable segments). What a steady step leaves allocated at its end (the gradients, when
`zero_grad(set_to_none=True)` frees them before the next forward) is freed before the next step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from planner.memory import allocator, compiled, events

# Runs replay in Python until this process has replayed this many run events (~1 µs each), then switch to
# the compiled kernel (loading it costs ~0.6 s, ~600,000 events' worth): one `planner estimate` of a
# 40-step BERT-base run (~70,000 events) stays in Python, a search over runs switches.
COMPILE_RUN_EVENTS = 600_000
_python_events = [0]


@dataclass(frozen=True)
class Section:
    """Part of a step's trace as a program of its own: tensor ids 0..len(sizes)-1, ranges in order."""

    sizes: np.ndarray  # int64 (object when a size does not fit in int64)
    starts: np.ndarray
    stops: np.ndarray
    allocs: np.ndarray  # bool
    trace: events.Trace  # where its tensors' names come from
    first_id: int  # tensor id in `trace` of this section's tensor 0

    @property
    def n_tensors(self) -> int:
        return len(self.sizes)

    @property
    def n_events(self) -> int:
        return int((self.stops - self.starts).sum())


def _program(trace: events.Trace) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    sizes = list(trace.iter_sizes())
    dtype = np.int64 if not sizes or max(sizes) < compiled.INT64_LIMIT else object
    laid = trace.__dict__.get("_laid")
    if laid is not None:
        starts, stops, allocs = (np.asarray(x) for x in laid.arrays)
    else:
        prog = trace.program
        starts = np.array([p[0] for p in prog], np.int64)
        stops = np.array([p[1] for p in prog], np.int64)
        allocs = np.array([p[2] for p in prog], np.bool_)
    return np.array(sizes, dtype=dtype), starts.astype(np.int64), stops.astype(np.int64), allocs.astype(np.bool_)


def split_trace(trace: events.Trace) -> tuple[Section, Section]:
    """(load and first step, steady step) of a trace laid out with `first_step=True`. The steady section frees
    at its end what it left allocated (the gradients `zero_grad(set_to_none=True)` frees), so it can follow
    itself at any shape."""
    at = trace.steady
    if at < 0:
        raise ValueError("a run needs a trace with its first step (events.step_events(first_step=True))")
    sizes, starts, stops, allocs = _program(trace)
    lens = stops - starts
    ends = np.cumsum(lens)
    k = int(np.searchsorted(ends, at, side="right"))  # ranges [0, k) end at or before the boundary
    before = int(ends[k - 1]) if k else 0
    f_starts, f_stops, f_allocs = starts[:k], stops[:k], allocs[:k]
    s_starts, s_stops, s_allocs = starts[k:].copy(), stops[k:], allocs[k:]
    if before < at:  # a range straddles the boundary: split it
        cut = int(starts[k]) + at - before
        f_starts = np.append(f_starts, starts[k])
        f_stops = np.append(f_stops, cut)
        f_allocs = np.append(f_allocs, allocs[k])
        s_starts[0] = cut
    first_tensors = int((f_stops - f_starts)[f_allocs].sum())
    if len(s_starts) and int(s_starts[~s_allocs].min(initial=first_tensors)) < first_tensors:
        raise ValueError("the steady step frees a tensor of the first step: it cannot be repeated")
    first = Section(sizes[:first_tensors], f_starts, f_stops, f_allocs, trace, 0)
    n = len(sizes) - first_tensors
    s_starts, s_stops = s_starts - first_tensors, s_stops - first_tensors
    freed = np.zeros(n, np.bool_)
    for a, b in zip(s_starts[~s_allocs].tolist(), s_stops[~s_allocs].tolist(), strict=True):
        freed[a:b] = True
    left = np.flatnonzero(~freed)
    if len(left):  # free them in id order, one range per run of consecutive ids
        breaks = np.flatnonzero(np.diff(left) != 1) + 1
        runs = np.split(left, breaks)
        s_starts = np.append(s_starts, [r[0] for r in runs])
        s_stops = np.append(s_stops, [r[-1] + 1 for r in runs])
        s_allocs = np.append(s_allocs, np.zeros(len(runs), np.bool_))
    steady = Section(sizes[first_tensors:], s_starts.astype(np.int64), s_stops.astype(np.int64),
                     s_allocs.astype(np.bool_), trace, first_tensors)
    return first, steady


@dataclass(frozen=True)
class RunProgram:
    """A run as one program: the sections of its steps laid end to end, tensor ids made distinct."""

    sizes: np.ndarray
    starts: np.ndarray
    stops: np.ndarray
    allocs: np.ndarray
    step_events: np.ndarray  # events at the end of each step (cumulative)
    step_tensors: np.ndarray  # tensors allocated by the end of each step (cumulative)
    sections: tuple[Section, ...]

    @property
    def n_events(self) -> int:
        return int(self.step_events[-1]) if len(self.step_events) else 0

    def events(self) -> list[tuple[int, int]]:
        """(tensor_id, nbytes) per event, nbytes == 0 a free: what `allocator.run` reads."""
        out: list[tuple[int, int]] = []
        sizes = self.sizes.tolist()
        for a, b, alloc in zip(self.starts.tolist(), self.stops.tolist(), self.allocs.tolist(), strict=True):
            if alloc:
                out.extend(zip(range(a, b), sizes[a:b], strict=True))
            else:
                out.extend((tid, 0) for tid in range(a, b))
        return out

    def step_of_event(self, event: int) -> int:
        """0-based step of event index `event`."""
        return int(np.searchsorted(self.step_events, event, side="right"))

    def tensor_name(self, tid: int) -> str:
        """The name of run tensor `tid` in its step's trace."""
        k = int(np.searchsorted(self.step_tensors, tid, side="right"))
        sec = self.sections[k]
        local = tid - (int(self.step_tensors[k - 1]) if k else 0)
        return events.tensor_name(sec.trace, sec.first_id + local)


def lay_out(sections: list[Section]) -> RunProgram:
    """The sections one after another, each section's tensor ids shifted past the previous ones'."""
    t_counts = np.array([s.n_tensors for s in sections], np.int64)
    t_offsets = np.cumsum(t_counts) - t_counts
    e_counts = np.array([s.n_events for s in sections], np.int64)
    objects = any(s.sizes.dtype == object for s in sections)
    sizes = np.concatenate([s.sizes.astype(object) if objects else s.sizes for s in sections])
    lens = [len(s.starts) for s in sections]
    shift = np.repeat(t_offsets, lens)
    starts = np.concatenate([s.starts for s in sections]) + shift
    stops = np.concatenate([s.stops for s in sections]) + shift
    allocs = np.concatenate([s.allocs for s in sections])
    return RunProgram(sizes, starts, stops, allocs, np.cumsum(e_counts), np.cumsum(t_counts), tuple(sections))


def replay(program: RunProgram, *, capacity_bytes: int | None = None, expandable_segments: bool = False,
           compiled_ok: bool | None = None) -> allocator.ReplayResult:
    """The run through the allocator model: the compiled kernel when it is loaded or the run is long enough to
    pay for loading it (`COMPILE_RUN_EVENTS`); `allocator.run` otherwise, and always for expandable segments
    (only the block-object model has them). `compiled_ok`: force (True) or forbid (False) the kernel."""
    if not expandable_segments and program.sizes.dtype != object:
        use = compiled_ok
        if use is None:
            use = compiled.kernel_ready() or (_python_events[0] + program.n_events >= COMPILE_RUN_EVENTS
                                              and compiled.warm())
        if use:
            fast = compiled.replay_arrays(program.sizes, program.starts, program.stops, program.allocs,
                                          capacity_bytes=capacity_bytes)
            if fast is not None:
                return fast
    _python_events[0] += program.n_events
    return allocator.run(program.events(), capacity_bytes=capacity_bytes,
                         expandable_segments=expandable_segments)[0]
