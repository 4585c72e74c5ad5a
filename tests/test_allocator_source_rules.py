"""The allocator replay against the rules of PyTorch's own allocator, each transcribed with its source.

Source: pytorch/pytorch c10/cuda/CUDACachingAllocator.cpp at commit 001074d25084fdb87a799823e395a50f5ec044d3
(the version planner/memory/allocator.py models; `git grep -n` of the quoted fragment finds the line). The
real allocator could not be built here (docs/allocator.md says what blocked it), so these boundary cases
stand in for the harness: each one fails if the replay departs from the quoted line. tests/test_allocator.py
holds the first rules (512 B rounding, 2 MiB/20 MiB segments, merging, the OOM retry).
"""

from __future__ import annotations

import pytest

from planner.memory.allocator import CachingAllocator, replay

MiB = 1024 * 1024
K_LARGE_BUFFER = 20 * MiB


def test_get_pool_boundary_is_inclusive_at_1_mib():
    """`get_pool`: "if (size <= kSmallSize) { return small_blocks; } else { return large_blocks; }" with
    "constexpr size_t kSmallSize = 1048576"."""
    assert replay([(0, MiB)]).peak_reserved == 2 * MiB  # small pool: a kSmallBuffer segment
    assert replay([(0, MiB + 512)]).peak_reserved == K_LARGE_BUFFER  # large pool


def test_get_allocation_size_boundary_at_10_mib():
    """`get_allocation_size`: "} else if (size < kMinLargeAlloc) { return kLargeBuffer; } else { return
    kRoundLarge * ((size + kRoundLarge - 1) / kRoundLarge);" with kMinLargeAlloc = 10485760 and
    kRoundLarge = 2097152."""
    assert replay([(0, 10 * MiB - 512)]).peak_reserved == K_LARGE_BUFFER
    assert replay([(0, 10 * MiB)]).peak_reserved == 10 * MiB
    assert replay([(0, 10 * MiB + 1)]).peak_reserved == 12 * MiB


def test_should_split_large_needs_more_than_1_mib_left():
    """`should_split`: "return (size < CUDAAllocatorConfig::max_split_size()) && (remaining > kSmallSize);"
    (strictly more than 1 MiB left) for the large pool."""
    a = CachingAllocator()
    b, _ = a.malloc(19 * MiB)  # remaining exactly 1 MiB: not split
    assert b.size == 20 * MiB
    a = CachingAllocator()
    b, _ = a.malloc(19 * MiB - 512)  # remaining 1 MiB + 512: split
    assert b.size == 19 * MiB - 512


def test_should_split_small_pool_and_expandable_down_to_512_bytes():
    """`should_split`: "if (block->pool->is_small || CUDAAllocatorConfig::expandable_segments()) { return
    remaining >= kMinBlockSize;"."""
    a = CachingAllocator()
    b, _ = a.malloc(MiB)  # small pool: 2 MiB segment, remainder 1 MiB >= 512: split
    c, grown = a.malloc(MiB - 512)
    assert b.size == MiB and grown == 0 and c.addr == b.addr + MiB
    a = CachingAllocator(expandable_segments=True)
    b, _ = a.malloc(20 * MiB - 512)  # expandable large pool: a 512 B remainder is still split off
    assert b.size == 20 * MiB - 512


def test_pools_never_share_blocks():
    """`get_free_block` searches `*p.pool` only (the pool `get_pool` chose): a free large block does not
    serve a small request."""
    r = replay([(0, 30 * MiB), (0, 0), (1, 4096)])
    assert r.segments == 2 and r.peak_reserved == 30 * MiB + 2 * MiB


def test_best_fit_ties_go_to_the_lowest_address():
    """`BlockComparatorSize`: blocks ordered by stream, then size, then "return (uintptr_t)a->ptr <
    (uintptr_t)b->ptr;"; `get_free_block` takes "pool.blocks.lower_bound(&p.search_key)"."""
    a = CachingAllocator()
    x, _ = a.malloc(12 * MiB)
    y, _ = a.malloc(12 * MiB)
    a.free(y)
    a.free(x)
    z, grown = a.malloc(12 * MiB)
    assert grown == 0 and z.addr == min(x.addr, y.addr)


@pytest.mark.parametrize("max_split_mb", [40, 100])
def test_max_split_size_rules(max_split_mb):
    """`get_free_block`: "// Do not return an oversized block for a large request: if ((p.size() <
    CUDAAllocatorConfig::max_split_size()) && ((*it)->size >= CUDAAllocatorConfig::max_split_size())) return
    false;" and "// Allow oversized block size to be rounded up but within a limit: if ((p.size() >=
    max_split_size()) && ((*it)->size >= p.size() + kLargeBuffer)) return false;"; `should_split` never
    splits a request >= max_split_size."""
    ms = max_split_mb * MiB
    oversize = ms + 30 * MiB
    # a request below max_split_size does not take a cached oversize block: a new segment
    r = replay([(0, oversize), (0, 0), (1, 12 * MiB)], max_split_size=ms)
    assert r.segments == 2 and r.peak_reserved == oversize + 12 * MiB
    # a request >= max_split_size takes it when within kLargeBuffer of it, whole (not split)
    a = CachingAllocator(max_split_size=ms)
    b, _ = a.malloc(oversize)
    a.free(b)
    c, grown = a.malloc(ms + 12 * MiB)  # >= max_split_size and oversize < request + 20 MiB
    assert grown == 0 and c.size == oversize
    a.free(c)
    d, grown = a.malloc(ms)  # >= max_split_size but oversize >= request + 20 MiB: a new segment
    assert grown > 0


def test_expandable_segments_page_per_pool():
    """`find_expandable_block`: "auto segment_size = pool->is_small ? kSmallBuffer : kLargeBuffer;": the
    small pool maps 2 MiB pages, the large pool 20 MiB pages."""
    assert replay([(0, 4096)], expandable_segments=True).peak_reserved == 2 * MiB
    assert replay([(0, 21 * MiB)], expandable_segments=True).peak_reserved == 40 * MiB
    r = replay([(0, 4096), (1, 21 * MiB)], expandable_segments=True)
    assert r.peak_reserved == 42 * MiB and r.segments == 2


def test_garbage_collection_threshold_acts_only_with_a_memory_fraction():
    """`get_free_block` / `malloc`: "if (C10_UNLIKELY(set_fraction &&
    CUDAAllocatorConfig::garbage_collection_threshold() > 0.0))" and `garbage_collect_cached_blocks`:
    "size_t gc_threshold = ... garbage_collection_threshold() * allowed_memory_maximum". Without
    `torch.cuda.set_per_process_memory_fraction` (`set_fraction` false) the setting changes nothing, and a
    training step never calls it: the planner accepts the setting and predicts the same step."""
    from planner.estimate import estimate
    from planner.spec import TrainConfig

    cfg = TrainConfig(batch_size=2, seq_len=128, precision="amp-bf16")
    plain = estimate("gpt2", cfg, "ml.g5.xlarge", with_throughput=False)
    gc = estimate("gpt2", cfg, "ml.g5.xlarge", with_throughput=False,
                  stack={"alloc_conf": "garbage_collection_threshold:0.6"})
    assert gc.memory_bytes.peak_reserved == plain.memory_bytes.peak_reserved


def test_max_split_size_mb_reaches_the_estimate_replay():
    """PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:N (CUDAAllocatorConfig: the value in MiB, kept as
    `val * 1024 * 1024`) is replayed by the estimate, not only parsed: the step's trace replayed with that
    limit gives the estimate's reserved peak."""
    from planner.estimate import _prepare, estimate
    from planner.memory.reserved import _build_trace
    from planner.spec import SoftwareStack, TrainConfig

    cfg = TrainConfig(batch_size=8, seq_len=1024, precision="amp-bf16")
    conf = "max_split_size_mb:64"
    assert SoftwareStack(torch="2.8", cuda="12.8", transformers="4.46", alloc_conf=conf).max_split_size == 64 * MiB
    e = estimate("gpt2", cfg, "ml.g5.xlarge", with_throughput=False, stack={"alloc_conf": conf})
    prep = _prepare("gpt2", cfg, "ml.g5.xlarge", None, "cuda", None)
    trace = _build_trace(prep.spec, prep.cfg, prep.step, prep.activations, 1.0, 1.0, 1.0, "cuda")
    limited = replay(trace.events, max_split_size=64 * MiB).peak_reserved
    assert e.allocator.peak_reserved == limited != replay(trace.events).peak_reserved
