"""A pure model of PyTorch's CUDA caching allocator: replay alloc/free events, report reserved memory.

Why: `torch.cuda.max_memory_reserved` (what the process holds from the driver) exceeds the allocated peak
because the allocator carves tensors out of cached segments, splits them, and never gives them back during
training. The gap depends on the sizes and order of the requests, not on a flat percentage.

Rules, from c10/cuda/CUDACachingAllocator.cpp (pytorch/pytorch, commit 001074d2; function names given so
they can be found in any recent release):
- `round_size`: every request is rounded up to kMinBlockSize = 512 B (roundup_power2_divisions off: default).
- `get_pool`: requests <= kSmallSize = 1 MiB use the small pool, larger ones the large pool.
- `get_allocation_size`: a new segment (cudaMalloc) is kSmallBuffer = 2 MiB for small requests,
  kLargeBuffer = 20 MiB for requests < kMinLargeAlloc = 10 MiB, otherwise the request rounded up to
  kRoundLarge = 2 MiB.
- `get_free_block`: best fit, the smallest cached free block of the pool that is >= the request (the pool's
  std::set is ordered by (stream, size, address): `BlockComparatorSize`); with max_split_size set, a request
  below it does not take a block >= max_split_size, and a larger request only takes a block < size + 20 MiB.
- `should_split`: the remainder of the chosen block becomes a free block when remaining >= kMinBlockSize
  (small pool, or expandable segments), or when size < max_split_size and remaining > kSmallSize (large
  pool); otherwise the whole block is handed out (and counted as allocated).
- `free_block` / `try_merge_blocks`: a freed block merges with free neighbours of the same segment.
- Cached blocks are never released during training, except on the OOM path of `malloc`: when cudaMalloc
  fails, `release_available_cached_blocks` (a no-op unless max_split_size is set) then
  `release_cached_blocks` (what `empty_cache` does: cudaFree every cached segment that is not split, i.e.
  wholly free) and one retry (`alloc_block(params, true)`); if that fails too it is an OOM.
- Expandable segments (`PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`, Note [Expandable Segments]): one
  segment per pool that grows at its end by pages of 20 MiB (large pool) or 2 MiB (small pool); blocks are
  split down to 512 B. On OOM the fully free pages at the segment's end are unmapped (approximation: the
  real allocator also unmaps free pages inside the segment).

One stream is assumed (training on the default stream); `recordStream` and CUDA graphs are not modelled.
Events are `(tensor_id, nbytes)`: nbytes > 0 allocates tensor_id, nbytes == 0 frees it.

Three implementations of the same rules: `CachingAllocator` / `run_reference` (block objects, one method per
C++ function: the readable model, and the only one with expandable segments), `fast_run` (plain ints, what
`run` uses otherwise; tests/test_allocator_fast.py checks both give the same ReplayResult) and
`replay_kernel` (compiled with Numba, on a compact trace; what a process that replays many steps switches to,
`compiled`; checked against `fast_run` the same way). A replay cannot
skip repeated transformer layers: the free blocks after a layer are never those after the previous one
(benchmarks/layer_periodicity.py: 0 of 6,400 layer windows), because each layer's leftovers in the 2 MiB and
20 MiB segments shift the next layer's placements.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Sequence
from dataclasses import dataclass
from operator import itemgetter

KiB, MiB = 1024, 1024 * 1024
K_MIN_BLOCK_SIZE = 512  # kMinBlockSize: all sizes are rounded to at least 512 bytes
K_SMALL_SIZE = 1 * MiB  # kSmallSize: largest "small" allocation
K_SMALL_BUFFER = 2 * MiB  # kSmallBuffer: small allocations are packed in 2 MiB segments
K_MIN_LARGE_ALLOC = 10 * MiB  # kMinLargeAlloc: allocations between 1 and 10 MiB may use kLargeBuffer
K_LARGE_BUFFER = 20 * MiB  # kLargeBuffer: such allocations are packed in 20 MiB segments
K_ROUND_LARGE = 2 * MiB  # kRoundLarge: larger allocations are rounded up to 2 MiB
# Expandable segments map physical memory in 2 MiB pages for the small pool, 20 MiB for the large pool.
EXPANDABLE_PAGE_SMALL = K_SMALL_BUFFER
EXPANDABLE_PAGE_LARGE = K_LARGE_BUFFER

Event = tuple[int, int]  # (tensor_id, nbytes); nbytes == 0 frees tensor_id


@dataclass(frozen=True)
class ReplayResult:
    """What the replay of one step says (bytes)."""

    peak_allocated: int  # max of allocated block bytes (torch.cuda.max_memory_allocated)
    peak_reserved: int  # max of segment bytes (torch.cuda.max_memory_reserved)
    segments: int  # segments held when the reserved peak was reached
    peak_event: int  # index of the event whose new segment set the reserved peak (-1: none)
    peak_tensor: int  # its tensor_id (-1: none)
    peak_event_bytes: int  # its request, bytes
    peak_segment_bytes: int  # the segment it created, bytes
    oom_retry: bool  # a cudaMalloc would have exceeded capacity: cached segments were released and retried
    oom: bool  # still over capacity after the retry: this step raises torch.OutOfMemoryError
    expandable_segments: bool = False


def round_size(nbytes: int) -> int:
    """`round_size`: up to a multiple of kMinBlockSize (at least one block)."""
    if nbytes < K_MIN_BLOCK_SIZE:
        return K_MIN_BLOCK_SIZE
    return -(-nbytes // K_MIN_BLOCK_SIZE) * K_MIN_BLOCK_SIZE


def allocation_size(nbytes: int) -> int:
    """`get_allocation_size`: the cudaMalloc size of a new segment for a (rounded) request."""
    if nbytes <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if nbytes < K_MIN_LARGE_ALLOC:
        return K_LARGE_BUFFER
    return -(-nbytes // K_ROUND_LARGE) * K_ROUND_LARGE


# A free block's sort key is size << addr_bits | address: (size, address) order as one int. 128 bits at least,
# so absurd requests (10^20 samples: > 2^64 bytes) still fit below the size bits; `run` widens it further to
# every address its events can reach.
ADDR_BITS = 128


class _Block:
    __slots__ = ("size", "addr", "seg", "prev", "next", "free", "small")

    def __init__(self, size: int, addr: int, seg: int, small: bool) -> None:
        self.size, self.addr, self.seg, self.small = size, addr, seg, small
        self.prev: _Block | None = None
        self.next: _Block | None = None
        self.free = True


@dataclass(frozen=True)
class Snapshot:
    """The allocator after events that allocate only tensors the step never frees (parameters, buffers,
    buckets, optimizer states): their blocks never change again, so only the free tails of their segments
    matter. Restoring it replaces replaying those events (see `replay`)."""

    tails: tuple[tuple[int, int, int, bool], ...]  # free blocks: (size, addr, segment, small)
    segments: tuple[tuple[int, int], ...]  # (segment, bytes)
    next_addr: int
    allocated: int
    peaks: tuple  # the replay loop's peak variables
    fast: bool = False  # made by `fast_run` (segments SEGMENT_GAP apart): only it restores such a snapshot
    pools: tuple[tuple[int, bool], ...] = ()  # (segment, small pool) for `fast_run`


class CachingAllocator:
    """The allocator's state; `malloc`/`free` follow the C++ functions of the same names (see module doc)."""

    def __init__(self, capacity_bytes: int | None = None, expandable_segments: bool = False,
                 max_split_size: int | None = None, addr_bits: int = ADDR_BITS) -> None:
        self.bits = addr_bits
        self.capacity = capacity_bytes
        self.expandable = expandable_segments
        self.max_split = max_split_size
        self.free_keys: dict[bool, list[int]] = {True: [], False: []}  # pool -> sorted size << ADDR_BITS | addr
        self.free_at: dict[int, _Block] = {}  # addr -> free block
        self.segments: dict[int, int] = {}  # segment id (its base address) -> bytes
        self.tail: dict[bool, _Block | None] = {True: None, False: None}  # expandable: last block per pool
        self.next_addr = 0
        self.allocated = self.reserved = 0
        self.oom_retry = self.oom = False

    # ---- free-block index (BlockPool.blocks)
    def _insert(self, b: _Block) -> None:
        b.free = True
        insort(self.free_keys[b.small], b.size << self.bits | b.addr)
        self.free_at[b.addr] = b

    def _remove(self, b: _Block) -> None:
        keys = self.free_keys[b.small]
        del keys[bisect_left(keys, b.size << self.bits | b.addr)]
        del self.free_at[b.addr]
        b.free = False

    def _best_fit(self, size: int, small: bool) -> _Block | None:
        """`get_free_block`: the smallest cached block >= size, with the max_split_size limits."""
        keys = self.free_keys[small]
        i = bisect_left(keys, size << self.bits)
        if i == len(keys):
            return None
        key = keys[i]
        ms = self.max_split
        if ms is not None and not small:
            bsize = key >> self.bits
            if size < ms <= bsize:
                return None
            if size >= ms and bsize >= size + K_LARGE_BUFFER:
                return None
        return self.free_at[key & ((1 << self.bits) - 1)]

    def _should_split(self, b: _Block, size: int) -> bool:
        remaining = b.size - size
        if b.small or self.expandable:
            return remaining >= K_MIN_BLOCK_SIZE
        return (self.max_split is None or size < self.max_split) and remaining > K_SMALL_SIZE

    # ---- new memory (alloc_block / release_cached_blocks)
    def _fits(self, extra: int) -> bool:
        return self.capacity is None or self.reserved + extra <= self.capacity

    def _release_cached(self) -> None:
        """`release_cached_blocks`: cudaFree every segment that is one whole free block."""
        if self.expandable:
            for small in (True, False):
                self._unmap_tail(small)
            return
        for b in [b for b in self.free_at.values() if b.prev is None and b.next is None]:
            self._remove(b)
            self.reserved -= self.segments.pop(b.seg)

    def empty_cache(self) -> None:
        """`torch.cuda.empty_cache()` (`emptyCache` -> `release_cached_blocks`): give back every cached segment
        that is one whole free block (the model's OOM retry does the same)."""
        self._release_cached()

    def _page(self, small: bool) -> int:
        return EXPANDABLE_PAGE_SMALL if small else EXPANDABLE_PAGE_LARGE

    def _unmap_tail(self, small: bool) -> None:
        """Expandable: unmap the whole free pages at the end of the pool's segment."""
        t = self.tail[small]
        if t is None or not t.free:
            return
        pages = t.size // self._page(small) * self._page(small)
        if pages:
            self._remove(t)
            t.size -= pages
            self.segments[t.seg] -= pages
            self.reserved -= pages
            if t.size:
                self._insert(t)
            else:
                self.tail[small] = t.prev
                if t.prev is not None:
                    t.prev.next = None

    def _new_memory(self, size: int, small: bool) -> tuple[_Block, int]:
        """cudaMalloc a segment (or map pages at the end of the expandable one); OOM retry as in `malloc`."""
        if self.expandable:
            t = self.tail[small]
            have = t.size if t is not None and t.free else 0
            page = self._page(small)
            grow = -(-(size - have) // page) * page
        else:
            grow = allocation_size(size)
        if not self._fits(grow):
            self.oom_retry = True
            self._release_cached()
            if self.expandable:  # the tail may have shrunk: recompute the pages needed
                t = self.tail[small]
                have = t.size if t is not None and t.free else 0
                grow = -(-(size - have) // page) * page
            if not self._fits(grow):
                self.oom = True  # torch raises here; we go on to report how much the step needs
        self.reserved += grow
        if self.expandable:
            t = self.tail[small]
            if t is not None and t.free:
                self._remove(t)
                t.size += grow
                self.segments[t.seg] += grow
                return t, grow
            seg = t.seg if t is not None else self.next_addr
            if t is None:
                self.segments[seg] = 0
                self.next_addr += 1 << 48  # 256 TiB of address space per expandable segment
                addr = seg
            else:
                addr = t.addr + t.size
            self.segments[seg] += grow
            b = _Block(grow, addr, seg, small)
            b.prev = t
            if t is not None:
                t.next = b
            self.tail[small] = b
            b.free = False
            return b, grow
        seg = self.next_addr
        self.next_addr += grow
        self.segments[seg] = grow
        b = _Block(grow, seg, seg, small)
        b.free = False
        return b, grow

    # ---- the public operations
    def malloc(self, nbytes: int) -> tuple[_Block, int]:
        """Returns the block and the bytes of new memory this request made the allocator reserve."""
        size = round_size(nbytes)
        small = size <= K_SMALL_SIZE
        b = self._best_fit(size, small)
        grown = 0
        if b is not None:
            self._remove(b)
        else:
            b, grown = self._new_memory(size, small)
        if self._should_split(b, size):
            rest = _Block(b.size - size, b.addr + size, b.seg, small)
            rest.prev, rest.next = b, b.next
            if b.next is not None:
                b.next.prev = rest
            elif self.expandable and self.tail[small] is b:
                self.tail[small] = rest
            b.next = rest
            b.size = size
            self._insert(rest)
        self.allocated += b.size
        return b, grown

    def free(self, b: _Block) -> None:
        """`free_block`: merge with free neighbours of the same segment, then cache."""
        self.allocated -= b.size
        p, n = b.prev, b.next
        if p is not None and p.free:
            self._remove(p)
            p.size += b.size
            p.next = n
            if n is not None:
                n.prev = p
            elif self.expandable and self.tail[b.small] is b:
                self.tail[b.small] = p
            b = p
        if n is not None and n.free:
            self._remove(n)
            b.size += n.size
            b.next = n.next
            if n.next is not None:
                n.next.prev = b
            elif self.expandable and self.tail[b.small] is n:
                self.tail[b.small] = b
        self._insert(b)

    def snapshot(self, peaks: tuple) -> Snapshot:
        """See `Snapshot`: valid only while every allocated block is permanent (not expandable, no OOM)."""
        tails = tuple((b.size, b.addr, b.seg, b.small) for b in self.free_at.values())
        return Snapshot(tails, tuple(self.segments.items()), self.next_addr, self.allocated, peaks)

    @classmethod
    def restore(cls, snap: Snapshot, capacity_bytes: int | None = None,
                max_split_size: int | None = None, addr_bits: int = ADDR_BITS) -> CachingAllocator:
        a = cls(capacity_bytes, False, max_split_size, addr_bits)
        a.segments = dict(snap.segments)
        a.reserved = sum(a.segments.values())
        a.next_addr, a.allocated = snap.next_addr, snap.allocated
        for size, addr, seg, small in snap.tails:
            b = _Block(size, addr, seg, small)
            if addr != seg:  # its left neighbour: a permanent block, never freed (merges never reach it)
                b.prev = _Block(0, addr - 1, seg, small)
                b.prev.free = False
            a._insert(b)
        return a


def replay(events: Sequence[Event], *, capacity_bytes: int | None = None, expandable_segments: bool = False,
           max_split_size: int | None = None) -> ReplayResult:
    """Replay `events` through a fresh allocator; peaks, the segment that set the reserved peak, OOM flags.

    `capacity_bytes`: what the allocator may reserve (GPU memory minus CUDA context and NCCL buffers); None
    means unlimited. `expandable_segments`: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True.
    `max_split_size`: PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb (bytes here); None = unlimited (default).
    """
    return run(events, capacity_bytes=capacity_bytes, expandable_segments=expandable_segments,
               max_split_size=max_split_size)[0]


def run(events: Sequence[Event], *, capacity_bytes: int | None = None, expandable_segments: bool = False,
        max_split_size: int | None = None, start: Snapshot | None = None,
        snapshot_at: int = 0) -> tuple[ReplayResult, Snapshot | None]:
    """`replay`, resumable: `start` is a `Snapshot` standing for events[:snapshot_at] (they are skipped);
    without it and with `snapshot_at` > 0, the state after events[:snapshot_at] comes back as a Snapshot
    (None if those events are not all permanent allocations, under expandable segments, or after an OOM
    retry). Returns (result, snapshot or None).

    Without expandable segments this is `fast_run` (the same rules on plain ints, several times faster);
    `run_reference` is the block-object replay it is tested against."""
    if not expandable_segments:
        return fast_run(events, capacity_bytes=capacity_bytes, max_split_size=max_split_size, start=start,
                        snapshot_at=snapshot_at)
    return run_reference(events, capacity_bytes=capacity_bytes, expandable_segments=expandable_segments,
                         max_split_size=max_split_size, start=start, snapshot_at=snapshot_at)


def run_reference(events: Sequence[Event], *, capacity_bytes: int | None = None, expandable_segments: bool = False,
                  max_split_size: int | None = None, start: Snapshot | None = None,
                  snapshot_at: int = 0) -> tuple[ReplayResult, Snapshot | None]:
    """`run` through `CachingAllocator` (block objects, one method per C++ function): the readable model."""
    snap = None
    # addresses never exceed all requests rounded up to new segments, plus expandable address space
    bound = sum(n for _, n in events) + len(events) * K_LARGE_BUFFER + (1 << 50)
    bits = max(ADDR_BITS, bound.bit_length() + 1)
    if start is not None:
        a = CachingAllocator.restore(start, capacity_bytes, max_split_size, bits)
        peak_alloc, peak_res, segments, peak_event, peak_tensor, peak_req, peak_seg = start.peaks
        first = snapshot_at
    else:
        a = CachingAllocator(capacity_bytes, expandable_segments, max_split_size, bits)
        peak_alloc = peak_res = segments = peak_req = peak_seg = 0
        peak_event = peak_tensor = -1
        first = 0
    live: dict[int, _Block] = {}
    malloc, free = a.malloc, a.free
    take_snapshot = start is None and snapshot_at > 0 and not expandable_segments
    end = _last_alloc(events)
    for i in range(first, end):
        if take_snapshot and i == snapshot_at:
            take_snapshot = False
            if not a.oom_retry:
                snap = a.snapshot((peak_alloc, peak_res, segments, peak_event, peak_tensor, peak_req, peak_seg))
        tid, nbytes = events[i]
        if nbytes:
            b, grown = malloc(nbytes)
            live[tid] = b
            if a.allocated > peak_alloc:
                peak_alloc = a.allocated
            if grown and a.reserved > peak_res:
                peak_res = a.reserved
                segments = len(a.segments)
                peak_event, peak_tensor, peak_req, peak_seg = i, tid, nbytes, grown
        else:
            free(live.pop(tid))
    if take_snapshot and end == snapshot_at and not a.oom_retry:
        snap = a.snapshot((peak_alloc, peak_res, segments, peak_event, peak_tensor, peak_req, peak_seg))
    # What follows the last allocation only frees: it changes no peak.
    return ReplayResult(peak_alloc, peak_res, segments, peak_event, peak_tensor, peak_req, peak_seg, a.oom_retry,
                        a.oom, expandable_segments), snap


@dataclass(frozen=True)
class Segment:
    """One segment the allocator holds (what `torch.cuda.memory_snapshot()` lists per segment)."""

    size: int  # bytes reserved from the driver (mapped bytes under expandable segments)
    allocated: int  # bytes of its blocks handed out
    small: bool  # the small pool (requests <= 1 MiB)


def segments_after(events: Sequence[Event], *, expandable_segments: bool = False) -> list[Segment]:
    """Every segment held after all `events` (frees included), by the reference model: the layout a
    `torch.cuda.memory_snapshot()` taken at the same point shows (tests compare it with the shared
    Llama-2-7B reading). A report of the state, no rule of its own: the replays need no twin of it."""
    bound = sum(n for _, n in events) + len(events) * K_LARGE_BUFFER + (1 << 50)
    a = CachingAllocator(None, expandable_segments, None, max(ADDR_BITS, bound.bit_length() + 1))
    live: dict[int, _Block] = {}
    for tid, nbytes in events:
        if nbytes:
            live[tid] = a.malloc(nbytes)[0]
        else:
            a.free(live.pop(tid))
    used: dict[int, int] = {}
    for b in live.values():
        used[b.seg] = used.get(b.seg, 0) + b.size
    pool = {b.seg: b.small for b in (*live.values(), *a.free_at.values())}
    return [Segment(size, used.get(seg, 0), pool.get(seg, False)) for seg, size in sorted(a.segments.items())]


def _last_alloc(events: Sequence[Event]) -> int:
    for i in range(len(events) - 1, -1, -1):
        if events[i][1]:
            return i + 1
    return 0


# `fast_run` leaves this many unused bytes between segments, so a free block that ends where the next segment
# begins is never taken for its neighbour (blocks merge only within a segment). Order, all the rules use of an
# address, is unchanged.
SEGMENT_GAP = K_MIN_BLOCK_SIZE


def fast_run(events: Sequence[Event], *, capacity_bytes: int | None = None, max_split_size: int | None = None,
             start: Snapshot | None = None, snapshot_at: int = 0) -> tuple[ReplayResult, Snapshot | None]:
    """`run_reference` without expandable segments, on ints: the same choices, the same results.

    Why: a search replays thousands of steps of ~4,000 events; block objects, one method call per rule and
    a linked list cost ~2 µs per event. Here a free block is two dict entries (start -> size, end -> start)
    and a key `size << bits | addr` in its pool's sorted list (best fit = `bisect`, ties to the lower address
    as `BlockComparatorSize`); a live tensor is (addr, size, pool). Merging looks up the free block ending at
    the freed block's start and the one starting at its end; `SEGMENT_GAP` keeps segments apart.
    An allocation freed by the very next event (a transient) changes nothing when a cached block fits (split
    then merged back): only the allocated peak moves, and no state is touched."""
    if start is not None and not start.fast:
        return run_reference(events, capacity_bytes=capacity_bytes, max_split_size=max_split_size, start=start,
                             snapshot_at=snapshot_at)
    # Every address this run can reach stays under `bound`; keys only as wide as that compare and shift
    # faster than `ADDR_BITS`-wide ones (~20 % of the replay on BERT steps).
    bound = (sum(map(itemgetter(1), events)) + len(events) * (K_LARGE_BUFFER + SEGMENT_GAP)
             + (start.next_addr if start is not None else 0))
    bits = max(32, bound.bit_length() + 1)
    mask = (1 << bits) - 1
    keys_small: list[int] = []
    keys_large: list[int] = []
    by_start: dict[int, int] = {}  # free block: addr -> size
    by_end: dict[int, int] = {}  # free block: addr + size -> addr
    seg_size: dict[int, int] = {}  # segment base -> bytes
    seg_small: dict[int, bool] = {}
    # Segments that are one whole free block: what release_cached_blocks frees on an OOM retry. Kept as the
    # free blocks change, so that a step far over capacity (an OOM retry at every new segment) does not scan
    # every segment each time (issue 37: explain of Llama-2-7B over a run of lengths spent 70% of its time
    # in that scan). A whole free block can only be a segment's base entry in `by_start`.
    whole: set[int] = set()
    if start is not None:
        for size, addr, _seg, small in start.tails:
            (keys_small if small else keys_large).append(size << bits | addr)
            by_start[addr] = size
            by_end[addr + size] = addr
        keys_small.sort()
        keys_large.sort()
        seg_size.update(start.segments)
        seg_small.update(start.pools)
        whole.update(b for b, sz in seg_size.items() if by_start.get(b) == sz)
        next_addr, allocated = start.next_addr, start.allocated
        reserved = sum(seg_size.values())
        peak_alloc, peak_res, segments, peak_event, peak_tensor, peak_req, peak_seg = start.peaks
        first = snapshot_at
    else:
        next_addr = allocated = reserved = 0
        peak_alloc = peak_res = segments = peak_req = peak_seg = 0
        peak_event = peak_tensor = -1
        first = 0
    oom_retry = oom = False
    ms = max_split_size
    cap = capacity_bytes
    live: dict[int, tuple[int, int, bool]] = {}
    take_snapshot = start is None and snapshot_at > 0
    snap = None
    end = _last_alloc(events)
    n_events = len(events)
    small_max, large_buffer, min_large, round_large = K_SMALL_SIZE, K_LARGE_BUFFER, K_MIN_LARGE_ALLOC, K_ROUND_LARGE
    i = first
    while i < end:
        if take_snapshot and i == snapshot_at:
            take_snapshot = False
            if not oom_retry:
                snap = _fast_snapshot(by_start, seg_size, seg_small, next_addr, allocated, bits,
                                      (peak_alloc, peak_res, segments, peak_event, peak_tensor, peak_req, peak_seg))
        tid, nbytes = events[i]
        if not nbytes:  # free: merge with the free neighbours of the same segment, then cache
            addr, size, small = live.pop(tid)
            allocated -= size
            keys = keys_small if small else keys_large
            stop = addr + size
            p = by_end.pop(addr, None)
            if p is not None:
                psize = by_start.pop(p)
                del keys[bisect_left(keys, psize << bits | p)]
                addr = p
                size += psize
            nsize = by_start.pop(stop, None)
            if nsize is not None:
                del by_end[stop + nsize]
                del keys[bisect_left(keys, nsize << bits | stop)]
                size += nsize
            by_start[addr] = size
            by_end[addr + size] = addr
            insort(keys, size << bits | addr)
            if seg_size.get(addr) == size:
                whole.add(addr)
            i += 1
            continue
        size = ((nbytes + 511) >> 9) << 9  # round_size
        small = size <= small_max
        keys = keys_small if small else keys_large
        j = bisect_left(keys, size << bits)
        bsize = 0
        if j < len(keys):
            key = keys[j]
            bsize = key >> bits
            if ms is not None and not small and ((size < ms <= bsize) or (size >= ms and bsize >= size + large_buffer)):
                bsize = 0  # get_free_block's max_split_size limits: no cached block
        # should_split: small pool: remainder >= kMinBlockSize; large: size < max_split and remainder > kSmallSize
        transient = i + 1 < n_events and events[i + 1][0] == tid and not events[i + 1][1]
        if bsize:
            rest = bsize - size
            split = rest >= 512 if small else (rest > small_max and (ms is None or size < ms))
            took = size if split else bsize
            if allocated + took > peak_alloc:
                peak_alloc = allocated + took
            if transient:  # split and merged back (or handed out whole and returned): nothing changes
                i += 2
                continue
            addr = key & mask
            del keys[j]
            del by_start[addr]
            del by_end[addr + bsize]
            whole.discard(addr)
        else:  # alloc_block: a new segment (get_allocation_size), the OOM retry when over capacity
            if small:
                grow = K_SMALL_BUFFER
            elif size < min_large:
                grow = large_buffer
            else:
                grow = -(-size // round_large) * round_large
            if cap is not None and reserved + grow > cap:
                oom_retry = True
                # release_cached_blocks: cudaFree every segment that is one whole free block
                for base in whole:
                    s = seg_size.pop(base)
                    del by_start[base]
                    del by_end[base + s]
                    k2 = keys_small if seg_small.pop(base) else keys_large
                    del k2[bisect_left(k2, s << bits | base)]
                    reserved -= s
                whole.clear()
                if reserved + grow > cap:
                    oom = True
            addr = next_addr
            next_addr += grow + SEGMENT_GAP
            seg_size[addr] = grow
            seg_small[addr] = small
            reserved += grow
            bsize = grow
            rest = grow - size
            split = rest >= 512 if small else (rest > small_max and (ms is None or size < ms))
            took = size if split else bsize
            if allocated + took > peak_alloc:
                peak_alloc = allocated + took
            if reserved > peak_res:
                peak_res = reserved
                segments = len(seg_size)
                peak_event, peak_tensor, peak_req, peak_seg = i, tid, nbytes, grow
            if transient:  # the new segment, wholly free again
                by_start[addr] = grow
                by_end[addr + grow] = addr
                insort(keys, grow << bits | addr)
                whole.add(addr)
                i += 2
                continue
        if split:
            r = addr + size
            by_start[r] = rest
            by_end[r + rest] = r
            insort(keys, rest << bits | r)
        allocated += took
        live[tid] = (addr, took, small)
        i += 1
    if take_snapshot and end == snapshot_at and not oom_retry:
        snap = _fast_snapshot(by_start, seg_size, seg_small, next_addr, allocated, bits,
                              (peak_alloc, peak_res, segments, peak_event, peak_tensor, peak_req, peak_seg))
    return ReplayResult(peak_alloc, peak_res, segments, peak_event, peak_tensor, peak_req, peak_seg, oom_retry,
                        oom, False), snap


def _fast_snapshot(by_start: dict[int, int], seg_size: dict[int, int], seg_small: dict[int, bool], next_addr: int,
                   allocated: int, bits: int, peaks: tuple) -> Snapshot:
    bases = sorted(seg_size)
    segment_of = {addr: bases[bisect_left(bases, addr + 1) - 1] for addr in by_start}
    tails = tuple((size, addr, segment_of[addr], seg_small[segment_of[addr]]) for addr, size in by_start.items())
    return Snapshot(tails, tuple(seg_size.items()), next_addr, allocated, peaks, fast=True,
                    pools=tuple(seg_small.items()))
