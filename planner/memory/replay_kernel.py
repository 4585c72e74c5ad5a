"""`allocator.fast_run`'s rules compiled with Numba, on a compact `events.Trace` (ranges of tensor ids).

Why: a search replays one step per distinct configuration, ~4,000 events each (~12,000 for a 7B model); in
CPython that is ~1 µs per event (3-5 ms a step), here ~30 ns. Only `planner.memory.compiled` imports this
module (importing Numba and loading the compiled code takes ~0.6 s, so it is done only when enough replays are
coming).

The state is the classic one: blocks in arrays (address, size, neighbours in their segment, free?, pool). The
free blocks of each pool are indexed by size class, as TLSF allocators do (16 classes per power of two, a
doubly linked list per class, a bit per non-empty class): best fit (`get_free_block`: the smallest
cached block >= the request, ties to the lower address as `BlockComparatorSize`) scans the request's class for
the smallest fitting (size, address), else takes the smallest of the next non-empty class, whose blocks are
all larger. Inserting and removing a block are O(1), where a sorted list shifts; a step of a 7B model keeps
~400 free blocks. The rules and their sources are those of `planner.memory.allocator` (module doc);
tests/test_replay_kernel.py and tests/test_allocator_fast.py check that both give the same `ReplayResult`
on random streams and on every catalog model's step.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from planner.memory.allocator import (
    K_LARGE_BUFFER,
    K_MIN_BLOCK_SIZE,
    K_MIN_LARGE_ALLOC,
    K_ROUND_LARGE,
    K_SMALL_BUFFER,
    K_SMALL_SIZE,
)

RESULT_FIELDS = 9  # peak_allocated, peak_reserved, segments, peak_event, peak_tensor, request, segment, retry, oom
SUB = 16  # size classes per power of two of (size / 512)
N_CLASSES = SUB + 52 * SUB  # sizes below 2^63 bytes


@njit(cache=True)
def _size_class(size):
    """Class of a block size (a multiple of 512): exact below 8 KiB, then 16 classes per power of two."""
    u = size >> 9
    if u < SUB:
        return u
    level = 0
    while u >= 2 * SUB:
        u >>= 1
        level += 1
    return SUB + level * SUB + (u - SUB)


@njit(cache=True)
def _lowest_bit(x):
    """Index of the lowest set bit of 0 < x < 2^32 (a binary search over halves of the word)."""
    n = 0
    for shift in (16, 8, 4, 2, 1):
        if x & ((1 << shift) - 1) == 0:
            n += shift
            x >>= shift
    return n


@njit(cache=True)
def replay_program(sizes, starts, stops, allocs, capacity, max_split):
    """The replay of a compact trace: `sizes[tid]`; ranges [starts[k], stops[k]) allocated or freed in order
    (`allocs[k]`). `capacity` < 0: unlimited; `max_split` < 0: no max_split_size. Returns int64[RESULT_FIELDS]
    in `ReplayResult` order (flags as 0/1)."""
    n_tensors = sizes.shape[0]
    max_blocks = 2 * n_tensors + 2  # each allocation adds at most a segment block and a remainder
    b_addr = np.empty(max_blocks, np.int64)
    b_size = np.empty(max_blocks, np.int64)
    b_prev = np.empty(max_blocks, np.int64)
    b_next = np.empty(max_blocks, np.int64)
    b_free = np.zeros(max_blocks, np.bool_)
    b_pool = np.empty(max_blocks, np.int64)
    fnext = np.empty(max_blocks, np.int64)
    fprev = np.empty(max_blocks, np.int64)
    head = np.full((2, N_CLASSES), -1, np.int64)
    n_words = (N_CLASSES + 31) // 32
    nonempty = np.zeros((2, n_words), np.int64)  # a bit per class with a free block
    n_blocks = 0
    seg_first = np.empty(n_tensors + 1, np.int64)  # a segment's first block (it keeps its id: merges go left)
    seg_size = np.empty(n_tensors + 1, np.int64)
    seg_alive = np.zeros(n_tensors + 1, np.bool_)
    n_segs = 0
    alive_segs = 0

    # The free lists' helpers are closures over the state: Numba inlines them, where functions taking the
    # arrays as arguments pay a reference count per array per call (the whole replay ran ~2.3x slower).
    def push(pool, block):
        """Cache a free block (at the head of its class's list)."""
        c = _size_class(b_size[block])
        h = head[pool, c]
        fnext[block] = h
        fprev[block] = -1
        if h >= 0:
            fprev[h] = block
        else:
            nonempty[pool, c >> 5] |= 1 << (c & 31)
        head[pool, c] = block

    def unlink(pool, block):
        """Take a block off its class's list (before its size changes: the size names the class)."""
        p = fprev[block]
        n = fnext[block]
        if p >= 0:
            fnext[p] = n
        else:
            c = _size_class(b_size[block])
            head[pool, c] = n
            if n < 0:
                nonempty[pool, c >> 5] &= ~(1 << (c & 31))
        if n >= 0:
            fprev[n] = p

    def best_fit(pool, size):
        """The free block of the smallest (size, address) with size >= `size`, or -1."""
        c = _size_class(size)
        best = -1
        b = head[pool, c]
        while b >= 0:
            s = b_size[b]
            if s >= size and (best < 0 or s < b_size[best] or (s == b_size[best] and b_addr[b] < b_addr[best])):
                best = b
            b = fnext[b]
        if best >= 0:
            return best
        # the next non-empty class: its smallest block (every block there is larger than the request)
        c += 1
        word = c >> 5
        bits = nonempty[pool, word] & ~((1 << (c & 31)) - 1) if word < n_words else 0
        while bits == 0:
            word += 1
            if word >= n_words:
                return -1
            bits = nonempty[pool, word]
        b = head[pool, word * 32 + _lowest_bit(bits)]
        best = b
        b = fnext[b]
        while b >= 0:
            s = b_size[b]
            if s < b_size[best] or (s == b_size[best] and b_addr[b] < b_addr[best]):
                best = b
            b = fnext[b]
        return best

    live = np.full(n_tensors, -1, np.int64)
    next_addr = 0
    allocated = 0
    reserved = 0
    peak_alloc = 0
    peak_res = 0
    segments = 0
    peak_event = -1
    peak_tensor = -1
    peak_req = 0
    peak_seg = 0
    oom_retry = False
    oom = False
    event = -1
    for op in range(starts.shape[0]):
        for tid in range(starts[op], stops[op]):
            event += 1
            if not allocs[op]:  # free_block: merge with free neighbours of the same segment, then cache
                b = live[tid]
                live[tid] = -1
                allocated -= b_size[b]
                pool = b_pool[b]
                prev = b_prev[b]
                nxt = b_next[b]
                if prev >= 0 and b_free[prev]:
                    unlink(pool, prev)
                    b_size[prev] += b_size[b]
                    b_next[prev] = nxt
                    if nxt >= 0:
                        b_prev[nxt] = prev
                    b = prev
                if nxt >= 0 and b_free[nxt]:
                    unlink(pool, nxt)
                    b_free[nxt] = False
                    b_size[b] += b_size[nxt]
                    after = b_next[nxt]
                    b_next[b] = after
                    if after >= 0:
                        b_prev[after] = b
                b_free[b] = True
                push(pool, b)
                continue
            nbytes = sizes[tid]
            size = (nbytes + K_MIN_BLOCK_SIZE - 1) // K_MIN_BLOCK_SIZE * K_MIN_BLOCK_SIZE  # round_size
            small = size <= K_SMALL_SIZE
            pool = 0 if small else 1
            block = best_fit(pool, size)  # get_free_block
            if block >= 0:
                bsize = b_size[block]
                if max_split >= 0 and not small and (
                        (size < max_split <= bsize) or (size >= max_split and bsize >= size + K_LARGE_BUFFER)):
                    block = -1
                else:
                    unlink(pool, block)
                    b_free[block] = False
            grow = 0
            if block < 0:  # alloc_block: a new segment (get_allocation_size), the OOM retry over capacity
                if small:
                    grow = K_SMALL_BUFFER
                elif size < K_MIN_LARGE_ALLOC:
                    grow = K_LARGE_BUFFER
                else:
                    grow = (size + K_ROUND_LARGE - 1) // K_ROUND_LARGE * K_ROUND_LARGE
                if capacity >= 0 and reserved + grow > capacity:
                    oom_retry = True
                    for s in range(n_segs):  # release_cached_blocks: every segment that is one free block
                        if seg_alive[s]:
                            f = seg_first[s]
                            if b_free[f] and b_next[f] < 0:
                                unlink(b_pool[f], f)
                                b_free[f] = False
                                seg_alive[s] = False
                                alive_segs -= 1
                                reserved -= seg_size[s]
                    if reserved + grow > capacity:
                        oom = True
                block = n_blocks
                n_blocks += 1
                b_addr[block] = next_addr
                b_size[block] = grow
                b_prev[block] = -1
                b_next[block] = -1
                b_pool[block] = pool
                next_addr += grow
                seg_first[n_segs] = block
                seg_size[n_segs] = grow
                seg_alive[n_segs] = True
                n_segs += 1
                alive_segs += 1
                reserved += grow
            rest = b_size[block] - size
            if small:  # should_split
                split = rest >= K_MIN_BLOCK_SIZE
            else:
                split = rest > K_SMALL_SIZE and (max_split < 0 or size < max_split)
            if split:
                r = n_blocks
                n_blocks += 1
                b_addr[r] = b_addr[block] + size
                b_size[r] = rest
                b_pool[r] = pool
                b_prev[r] = block
                nxt = b_next[block]
                b_next[r] = nxt
                if nxt >= 0:
                    b_prev[nxt] = r
                b_next[block] = r
                b_size[block] = size
                b_free[r] = True
                push(pool, r)
            allocated += b_size[block]
            live[tid] = block
            if allocated > peak_alloc:
                peak_alloc = allocated
            if grow > 0 and reserved > peak_res:
                peak_res = reserved
                segments = alive_segs
                peak_event = event
                peak_tensor = tid
                peak_req = nbytes
                peak_seg = grow
    out = np.empty(RESULT_FIELDS, np.int64)
    out[0] = peak_alloc
    out[1] = peak_res
    out[2] = segments
    out[3] = peak_event
    out[4] = peak_tensor
    out[5] = peak_req
    out[6] = peak_seg
    out[7] = 1 if oom_retry else 0
    out[8] = 1 if oom else 0
    return out
