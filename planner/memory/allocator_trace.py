"""The planner's allocator model against PyTorch's own allocator, on the allocator's own record of a real run.

`torch.cuda.memory._record_memory_history()` makes the CUDA caching allocator log every action it takes
(`TraceEntry` in c10/cuda/CUDACachingAllocator.h, returned by `torch.cuda.memory._snapshot()["device_traces"]`):
each allocation with its requested size ("alloc": `record_trace(TraceEntry::ALLOC, block->ptr, orig_size, ...)`),
each free ("free_requested", then "free_completed" once the block can be reused), and every segment it asks
cudaMalloc for ("segment_alloc", the segment's size) or gives back ("segment_free"). Fed the same allocations
and frees in the same order, the planner's model (`planner.memory.allocator`) must ask for the same segments,
in the same order: that checks its rules against the real allocator's decisions on real workloads, segment
for segment, with nothing about the model's own event order in between (issue 36, item 1: the allocator
against its own source). `benchmarks/gpu_session.py`'s `memtrace` section records such traces and
`benchmarks/memtrace_replay.py` prints this check for each.

An entry here is `(action, addr, size)`; the actions are torch's names. One stream, the default allocator
and an empty cache when recording began are assumed (what `gpu_session` records: a one-GPU training loop in a
fresh process); `empty_cache` (a run of "segment_free") is replayed as the allocator's release of every
segment that is one whole free block, and the segments given back are compared too. A trace with an OOM,
expandable segments' mappings or a free of a block it never saw allocated is refused rather than compared
wrongly.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from planner.errors import PlannerError
from planner.memory import allocator

ACTIONS = ("alloc", "free_requested", "free_completed", "segment_alloc", "segment_free", "segment_map",
           "segment_unmap", "oom", "snapshot")
Entry = tuple[str, int, int]  # (action, address, size)


@dataclass(frozen=True)
class TraceCheck:
    """The real allocator's segments and blocks against the model's, for one recorded run (bytes)."""

    allocations: int
    real_segments: tuple[int, ...]  # segment_alloc sizes, in order
    model_segments: tuple[int, ...]  # the model's new segments for the same requests, in order
    real_peak_reserved: int
    model_peak_reserved: int
    first_difference: int  # index of the first segment that differs (-1: none)
    first_misplaced: int  # index of the first allocation the model puts at another address (-1: none)
    # allocations before the first empty_cache at which the model gives back other segments (-1: none)
    first_release_difference: int = -1

    @property
    def same(self) -> bool:
        return self.first_difference < 0 and self.first_misplaced < 0 and self.first_release_difference < 0


def entries_of(trace: Iterable[dict]) -> list[Entry]:
    """`(action, addr, size)` from `_snapshot()["device_traces"][device]` dicts (other keys dropped)."""
    out: list[Entry] = []
    for i, e in enumerate(trace):
        action = e.get("action") if isinstance(e, dict) else None
        if action not in ACTIONS:
            raise PlannerError("memory trace", f"entry {i}", f"an action among {', '.join(ACTIONS)}")
        out.append((action, int(e.get("addr", 0)), int(e.get("size", 0))))
    return out


@dataclass(frozen=True)
class Request:
    """One allocation or free of the trace, as the model replays it; or (`released`) an `empty_cache`."""

    tid: int
    nbytes: int  # 0: a free (or a release)
    addr: int  # where the real allocator put (or freed) the block
    segment: int  # the base of the segment the real allocator made for this allocation (-1: none)
    released: tuple[int, ...] = ()  # an empty_cache: the bases of the segments the real allocator gave back


def requests_of(entries: Sequence[Entry]) -> list[Request]:
    """The trace's allocations and frees in order. A block is free for reuse at "free_completed" (with one
    stream it follows "free_requested" at once); a trace recorded without completions frees at the request.
    The allocator records a new segment ("segment_alloc") before the allocation that needed it."""
    completes = any(a == "free_completed" for a, _, _ in entries)
    frees = "free_completed" if completes else "free_requested"
    live: dict[int, int] = {}
    out: list[Request] = []
    segment = -1
    n = 0
    for i, (action, addr, size) in enumerate(entries):
        if action == "segment_free":  # consecutive ones are one release_cached_blocks (empty_cache)
            if out and out[-1].released and entries[i - 1][0] == "segment_free":
                out[-1] = Request(-1, 0, 0, -1, (*out[-1].released, addr))
            else:
                out.append(Request(-1, 0, 0, -1, (addr,)))
        elif action == "segment_alloc":
            segment = addr
        elif action == "alloc":
            if addr in live:
                raise PlannerError("memory trace", f"entry {i}", f"an address freed before it is allocated again "
                                   f"({addr:#x} is live)")
            live[addr] = n
            out.append(Request(n, max(size, 1), addr, segment))
            n, segment = n + 1, -1
        elif action == frees:
            tid = live.pop(addr, None)
            if tid is None:
                raise PlannerError("memory trace", f"entry {i}", f"a free of a live block ({addr:#x} is not)")
            out.append(Request(tid, 0, addr, -1))
        elif action == "oom":
            raise PlannerError("memory trace", f"entry {i}", "a trace without an OOM (the allocator's retry "
                               "frees cached segments mid-request, which the check does not replay)")
        elif action in ("segment_map", "segment_unmap"):
            raise PlannerError("memory trace", f"entry {i}", "a trace of the default allocator (this one maps "
                               "expandable segments, which the check does not replay)")
    return out


def check(entries: Sequence[Entry]) -> TraceCheck:
    """Replay the trace's requests through the model (module doc). Each segment the model makes takes the
    address the real allocator gave the segment of the same request (a fresh one where the real allocator
    made none), so that the model's ties between equal free blocks, broken by address as the real
    allocator's are (`BlockComparatorSize`), see the same addresses."""
    requests = requests_of(entries)
    real = [size for action, _, size in entries if action == "segment_alloc"]
    a = allocator.CachingAllocator(None, False, None, allocator.ADDR_BITS)
    fresh = 1 + max((r.addr for r in requests), default=0) + sum(real)  # beyond every real address
    live: dict[int, object] = {}
    model: list[int] = []
    misplaced = -1
    allocs = 0
    released_differs = -1
    peak = 0
    for r in requests:
        if r.released:  # empty_cache: every segment that is one whole free block goes back
            before = set(a.segments)
            a.empty_cache()
            if released_differs < 0 and sorted(before - set(a.segments)) != sorted(r.released):
                released_differs = allocs
            continue
        if not r.nbytes:
            a.free(live.pop(r.tid))
            continue
        # the real segment's address while the caches agree (after a differing release it may be one the
        # model still holds)
        real_base = r.segment >= 0 and released_differs < 0
        a.next_addr = r.segment if real_base else fresh
        block, new = a.malloc(r.nbytes)
        if new:
            model.append(new)
            peak = max(peak, a.reserved)
            if not real_base:
                fresh += new
        live[r.tid] = block
        if misplaced < 0 and block.addr != r.addr:
            misplaced = allocs
        allocs += 1
    first = next((i for i, (x, y) in enumerate(zip(real, model, strict=False)) if x != y), -1)
    if first < 0 and len(real) != len(model):
        first = min(len(real), len(model))
    return TraceCheck(allocs, tuple(real), tuple(model), _peak_reserved(entries), peak, first, misplaced,
                      released_differs)


def _peak_reserved(entries: Sequence[Entry]) -> int:
    """The real allocator's reserved peak: its segments' running total."""
    held = peak = 0
    for action, _, size in entries:
        if action == "segment_alloc":
            held += size
            peak = max(peak, held)
        elif action == "segment_free":
            held -= size
    return peak
