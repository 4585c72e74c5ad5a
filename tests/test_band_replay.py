"""The reserved pool's band around the allocator replay (planner.memory.band): narrow where GPU readings check
the replay, flat where none does, and the narrow margin recomputed from the readings themselves
(benchmarks/replay_band.py prints every group)."""

from __future__ import annotations

import importlib
import sys
import tempfile
from pathlib import Path

import pytest

from planner import estimate
from planner.memory import band
from planner.spec import TrainConfig

GiB = 2**30
BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _scorecard():
    sys.path.insert(0, str(BENCH))
    return importlib.import_module("readings_scorecard")


def test_the_margin_is_the_largest_miss_of_the_readings_each_way():
    """Every H200 step reading's real pool lies within the margin of the replay's, and the margin is the largest
    miss each way rounded up to the percent: not widened beyond what the readings show, nor narrowed under
    one of them. The H100 readings are held out of it and must fall inside. The readings at both ends: QLoRA
    Llama-2-7B with checkpointing (real pool above the replay's) and the multimodal BERT in AMP with
    checkpointing (below); BART-base traced from its config is re-estimated too (it was the low end)."""
    sc = _scorecard()
    traced = importlib.import_module("traced_readings")
    rows = sc.steps_folder(sc.SHARED, (sc.SHARED_FIT, sc.SHARED_HELD))
    rows += sc.steps_folder(sc.HELD_OUT[0], sc.H200)
    rows += sc.lora_rows(sc.HELD_OUT[0])
    rows += [r for r in sc.loop_load_rows(sc.DAY2) if "empty_cache" not in r.label]  # not modelled (docs)
    misses = [r.pool_miss for r in rows if r.pool_miss is not None]
    bart = next(r for r in sc._jsonl(sc.HELD_OUT[0] / "traced.jsonl") if r["model"].startswith("bart")
                and r["precision"] == "amp-bf16")
    with tempfile.TemporaryDirectory() as tmp:
        e = traced.estimate_row(bart, "ml.p5e.48xlarge", Path(tmp), "loss-only")
    misses.append((traced.measured_peaks(bart)[1] - e.memory_bytes.peak_reserved) / e.memory_bytes.peak_allocated)
    assert len(misses) > 70
    low, high = band.REPLAY_POOL_MARGIN
    assert -low <= min(misses) and max(misses) <= high
    assert low < -min(misses) + 0.01 and high < max(misses) + 0.01
    # The H100 folder is held out of the margin: the same steps on another GPU must lie inside it.
    h100 = [r.pool_miss for r in sc.steps_folder(sc.HELD_OUT[1], sc.H100) if r.pool_miss is not None]
    assert len(h100) > 20
    assert all(-low <= m <= high for m in h100)


@pytest.mark.parametrize("torch_version,given,world,keys,why", [
    ((2, 11), True, 1, (), None),
    ((2, 0), True, 1, ("expandable_segments",), None),
    ((2, 11), False, 1, (), "not given"),
    ((1, 13), True, 1, (), "no reading of that era"),
    ((2, 11), True, 4, (), "other streams"),
    ((2, 11), True, 1, ("max_split_size_mb",), "max_split_size_mb"),
])
def test_where_the_readings_check_the_replay(torch_version, given, world, keys, why):
    got = band.replay_unchecked(torch_version, given, world, keys)
    assert (got is None) if why is None else (why in got)


def test_checked_is_narrow_and_unchecked_keeps_the_flat_high_end():
    alloc, reserved = 10 * GiB, int(10.3 * GiB)
    checked = band.reserved_pool_term(alloc, reserved, replayed=True)
    assert checked.high == reserved - alloc + int(alloc * band.REPLAY_POOL_MARGIN[1])
    assert checked.low == max(reserved - alloc - int(alloc * band.REPLAY_POOL_MARGIN[0]), 0)
    flat = band.reserved_pool_term(alloc, reserved, replayed=True, unchecked="4 GPUs")
    assert flat.high == int(alloc * band.FLAT_POOL_HIGH_FRACTION) > checked.high and flat.low == checked.low
    assert "4 GPUs" in flat.basis


def test_an_estimate_says_which_band_it_got():
    """The same one-GPU step: narrow with a named torch 2 stack; flat without one, on torch 1.x, with an
    allocator option no reading has, and on several GPUs."""
    cfg = TrainConfig(batch_size=8, seq_len=128, precision="amp-bf16", parallelism="single")

    def pool(stack, instance="ml.g5.xlarge", config=cfg):
        e = estimate("bert-base-uncased", config, instance, with_throughput=False, stack=stack)
        return next(t for t in e.band if t.name == "reserved_pool"), e

    narrow, e = pool({"torch": "2.4"})
    assert narrow.high - narrow.point == int(e.memory_bytes.peak_allocated * band.REPLAY_POOL_MARGIN[1])
    for stack in (None, {"torch": "1.13"}, {"torch": "2.4", "alloc_conf": "max_split_size_mb:128"}):
        wide, e = pool(stack)
        assert wide.high >= int(e.memory_bytes.peak_allocated * band.FLAT_POOL_HIGH_FRACTION)
        assert "not checked" in wide.basis
    ddp, _ = pool({"torch": "2.4"}, "ml.g5.12xlarge", cfg.model_copy(update={"parallelism": "ddp"}))
    assert "GPUs" in ddp.basis
