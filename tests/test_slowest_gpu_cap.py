"""The wait for the slowest GPU: spread x E[max of n normals], capped at the whole-cluster variation that Sinha et
al. (SC22) measured (planner.perf.throughput.slowest_gpu_share)."""

from __future__ import annotations

import pytest

from planner.perf.throughput import ThroughputConstants, expected_max_normal, slowest_gpu_share


def test_up_to_one_instance_the_gaussian_rule_is_untouched():
    """The fitted runs (4 and 8 GPUs) stay below the cap: their wait is what it was."""
    c = ThroughputConstants()
    for n in (1, 2, 4, 8):
        assert slowest_gpu_share(n, c) == pytest.approx(c.rank_speed_spread * expected_max_normal(n), rel=1e-12)
        assert slowest_gpu_share(n, c) < c.slowest_gpu_wait_cap


def test_thousands_of_gpus_wait_no_more_than_the_cap():
    c = ThroughputConstants()
    assert c.rank_speed_spread * expected_max_normal(6144) > c.slowest_gpu_wait_cap  # the tail would exceed it
    assert slowest_gpu_share(6144, c) == c.slowest_gpu_wait_cap
    shares = [slowest_gpu_share(n, c) for n in (1, 2, 8, 16, 64, 1024, 16384)]
    assert shares == sorted(shares)  # never shrinks with more GPUs


def test_the_cap_can_be_lifted():
    c = ThroughputConstants(slowest_gpu_wait_cap=1.0)
    assert slowest_gpu_share(6144, c) == pytest.approx(c.rank_speed_spread * expected_max_normal(6144))
