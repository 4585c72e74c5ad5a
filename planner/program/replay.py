"""The traced step's own storage events replayed through the caching-allocator model (`memory.allocator`).

Why: for a traced model the allocation trace is measured, op by op, so the reserved peak need not assume a
flat fragmentation. The trace is one *first* step; the steady state the estimate describes differs in what
already exists when the step begins, so the events are reordered into:
  1. permanent storages: parameters, buffers, DDP's gradient buckets (`events.buckets`, same rule as the
     analytic replay), the cuBLAS workspace, the optimizer states (allocated inside the traced first
     `optimizer.step()`, moved to the front: in the steady state they exist from the start);
  2. the input batch, then every other allocation and free in traced order.
Storages the device does not hold (host RNG state, 0 bytes) are skipped: the allocator reads 0 as a free.
"""

from __future__ import annotations

from planner.memory import allocator, events
from planner.program.records import StepTrace
from planner.spec import AllocatorReplay

PERMANENT = ("parameter", "buffer")


def steady_state_events(trace: StepTrace, *, bucket_sizes: tuple[int, ...] = (), workspace_bytes: int = 0
                        ) -> tuple[tuple[tuple[int, int], ...], dict[int, str]]:
    """(tensor_id, nbytes) events (nbytes 0 frees) and a name per id, in steady-state order (module doc)."""
    names: dict[int, str] = {}
    first: list[tuple[int, int]] = []
    states: list[tuple[int, int]] = []
    rest: list[tuple[int, int]] = []
    skipped: set[int] = set()
    for e in trace.events:
        if e.action == "alloc" and e.nbytes <= 0:
            skipped.add(e.storage)
            continue
        if e.storage in skipped:
            continue
        names[e.storage] = e.category
        if e.action == "alloc" and e.category in PERMANENT:
            first.append((e.storage, e.nbytes))
        elif e.action == "alloc" and e.category == "optimizer_state":
            states.append((e.storage, e.nbytes))
        else:
            rest.append((e.storage, e.nbytes if e.action == "alloc" else 0))
    next_id = max(names, default=0) + 1
    extra = []
    for size in (*bucket_sizes, workspace_bytes):
        if size > 0:
            names[next_id] = "ddp_bucket" if len(extra) < len(bucket_sizes) else "cublas_workspace"
            extra.append((next_id, size))
            next_id += 1
    return tuple(first + extra + states + rest), names


def replay_trace(trace: StepTrace, *, ddp_bucket_bytes: int = 0, bucket_cap_bytes: int = 25 * events.MiB,
                 workspace_bytes: int = 0, capacity_bytes: int | None = None,
                 expandable_segments: bool = False) -> AllocatorReplay:
    """The allocator's peaks for the traced step (the OOM retry when `capacity_bytes` is exceeded)."""
    buckets = events.buckets(ddp_bucket_bytes, bucket_cap_bytes) if ddp_bucket_bytes else ()
    evs, names = steady_state_events(trace, bucket_sizes=buckets, workspace_bytes=workspace_bytes)
    r = allocator.replay(evs, expandable_segments=expandable_segments)
    if capacity_bytes is not None and r.peak_reserved > capacity_bytes:
        r = allocator.replay(evs, capacity_bytes=capacity_bytes, expandable_segments=expandable_segments)
    return AllocatorReplay(peak_allocated=r.peak_allocated, peak_reserved=r.peak_reserved, segments=r.segments,
                           peak_allocation=names.get(r.peak_tensor, "") if r.peak_tensor >= 0 else "",
                           peak_allocation_bytes=r.peak_event_bytes, peak_segment_bytes=r.peak_segment_bytes,
                           oom_retry=r.oom_retry, oom_after_retry=r.oom, expandable_segments=expandable_segments,
                           events=len(evs))
