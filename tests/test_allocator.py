"""The caching-allocator model against the rules of c10/cuda/CUDACachingAllocator.cpp (see its module doc)."""

from __future__ import annotations

from planner.memory.allocator import CachingAllocator, replay

MiB = 1024 * 1024


def test_rounding_to_512_bytes():
    a = CachingAllocator()
    b, grown = a.malloc(1)
    assert b.size == 512 and grown == 2 * MiB  # small request: a 2 MiB small-pool segment
    b2, _ = a.malloc(513)
    assert b2.size == 1024


def test_just_over_small_takes_a_20_mib_segment():
    r = replay([(0, MiB + 1)])
    assert r.peak_reserved == 20 * MiB and r.segments == 1
    assert r.peak_allocated == MiB + 512


def test_from_10_mib_own_segment_rounded_to_2_mib():
    assert replay([(0, 12 * MiB)]).peak_reserved == 12 * MiB
    assert replay([(0, 25 * MiB + 1)]).peak_reserved == 26 * MiB
    # just under kMinLargeAlloc still carves from a 20 MiB segment
    assert replay([(0, 10 * MiB - 512)]).peak_reserved == 20 * MiB


def test_small_requests_share_a_2_mib_segment():
    events = [(i, 100 * 1024) for i in range(20)]  # 20 × 100 KiB = 2000 KiB < 2 MiB
    r = replay(events)
    assert r.peak_reserved == 2 * MiB and r.segments == 1
    r = replay(events + [(20, 100 * 1024)])  # 2100 KiB: a second small segment
    assert r.peak_reserved == 4 * MiB and r.segments == 2


def test_split_leaves_the_remainder_free_and_reusable():
    a = CachingAllocator()
    b, grown = a.malloc(4 * MiB)
    assert grown == 20 * MiB and b.size == 4 * MiB  # split: remainder 16 MiB > 1 MiB
    c, grown = a.malloc(6 * MiB)
    assert grown == 0 and c.addr == b.addr + 4 * MiB  # carved from the remainder, no new segment


def test_large_remainder_up_to_1_mib_is_not_split():
    a = CachingAllocator()
    b, _ = a.malloc(19 * MiB + 512)  # remaining = 1 MiB - 512 <= kSmallSize: whole block handed out
    assert b.size == 20 * MiB and a.allocated == 20 * MiB


def test_best_fit_reuses_the_smallest_free_block():
    a = CachingAllocator()
    big, _ = a.malloc(30 * MiB)
    small, _ = a.malloc(12 * MiB)
    a.free(big)
    a.free(small)
    c, grown = a.malloc(11 * MiB)  # fits both free segments: the 12 MiB one is the best fit
    assert grown == 0 and c.seg == small.seg


def test_freed_neighbours_merge():
    a = CachingAllocator()
    x, _ = a.malloc(3 * MiB)
    y, _ = a.malloc(3 * MiB)
    a.free(x)
    a.free(y)
    assert list(a.free_at) == [x.seg] and a.free_at[x.seg].size == 20 * MiB  # one whole 20 MiB block again


def test_cached_segments_are_kept_without_pressure():
    r = replay([(0, 12 * MiB), (0, 0), (1, 14 * MiB)])  # 12 MiB cached, 14 MiB does not fit it
    assert r.peak_reserved == 26 * MiB and not r.oom_retry


def test_oom_retry_frees_cached_segments():
    events = [(0, 12 * MiB), (0, 0), (1, 14 * MiB)]
    r = replay(events, capacity_bytes=20 * MiB)
    assert r.oom_retry and not r.oom and r.peak_reserved == 14 * MiB
    r = replay([(0, 12 * MiB), (1, 14 * MiB)], capacity_bytes=20 * MiB)  # both live: a real OOM
    assert r.oom_retry and r.oom


def test_split_segments_are_not_released():
    # a 20 MiB segment with one live 2 MiB block stays even under pressure
    events = [(0, 2 * MiB), (1, 19 * MiB), (1, 0), (2, 22 * MiB)]  # 19 MiB > the 18 MiB remainder
    assert replay(events).peak_reserved == 62 * MiB
    r = replay(events, capacity_bytes=42 * MiB)  # the cached 20 MiB goes, the split 20 MiB stays
    assert r.oom_retry and not r.oom and r.peak_reserved == 42 * MiB
    assert replay(events, capacity_bytes=41 * MiB).oom


def test_expandable_segments_round_to_pages():
    events = [(0, 12 * MiB), (1, 14 * MiB), (2, 3 * MiB)]
    r = replay(events, expandable_segments=True)
    assert r.segments == 1 and r.peak_reserved == 40 * MiB  # 29 MiB allocated in 20 MiB pages
    assert replay(events).peak_reserved == 12 * MiB + 14 * MiB + 20 * MiB


def test_reserved_never_under_allocated():
    events = [(i, (i * 7919) % (13 * MiB) + 1) for i in range(60)] + [(i, 0) for i in range(0, 60, 3)]
    events += [(100 + i, (i * 104729) % (25 * MiB) + 1) for i in range(30)]
    for expandable in (False, True):
        r = replay(events, expandable_segments=expandable)
        assert r.peak_reserved >= r.peak_allocated > 0
