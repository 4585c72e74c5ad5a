"""The band's torch 1.x gap term (planner.memory.band.legacy_gap_term): fitted to the published whole-GPU peaks
of lambda-dlb-logs and nothing else, zero where no reading shows a gap, and it can only widen the band."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from planner import estimate
from planner.memory import band
from planner.probes.public import MIB, load_public_memory
from planner.spec import TrainConfig

FIT_SOURCE = "lambda-dlb-logs"


def _public_common():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "public_common.py"
    spec = importlib.util.spec_from_file_location("public_common", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_constant_is_the_largest_gap_its_source_shows():
    """Recomputed from the committed rows: the fraction is the largest measured / point - 1 (to 0.01), so it
    covers every reading it was fitted on and is not tuned beyond them."""
    common = _public_common()
    rows = [r for r in load_public_memory() if r.source_id == FIT_SOURCE and r.peak_kind == "nvidia-smi"]
    assert len(rows) >= 5
    gaps = []
    for row in rows:
        est, used = common.run_estimate(row, with_throughput=False)
        assert used != "none" and est["stack"]["torch"].startswith("1."), row.id  # the fit is torch 1.x only
        gaps.append(row.peak_mib * MIB / est["memory_bytes"]["peak_device"] - 1)
        assert est["peak_device_low_bytes"] <= row.peak_mib * MIB <= est["peak_device_high_bytes"], row.id
    assert max(gaps) <= band.LEGACY_GAP_HIGH_FRACTION < max(gaps) + 0.01


@pytest.mark.parametrize("torch_version,calibrated,widens", [((1, 4), False, True), ((1, 12), False, True),
                                                              ((1, 13), False, False), ((2, 8), False, False),
                                                              ((1, 4), True, False), (None, False, False)])
def test_the_gap_applies_to_uncalibrated_torch_1x_only(torch_version, calibrated, widens):
    t = band.legacy_gap_term(10 * 2**30, torch_version, calibrated)
    assert t.point == 0 and t.low == 0
    assert (t.high > 0) is widens
    if widens:
        assert t.high == int(10 * 2**30 * band.LEGACY_GAP_HIGH_FRACTION)


def test_an_old_stack_widens_the_band_and_never_moves_the_point():
    """Same job, torch 1.7 vs torch 2.8 stack given: the old stack's high end is at least the gap above its point;
    the modern stack carries a zero gap term. A near-capacity fit on the old stack is no longer a sure fit."""
    cfg = TrainConfig(batch_size=128, seq_len=128, precision="amp-fp16")
    head = {"head": "sequence-classification", "num_labels": 2}
    old = estimate("roberta-base", cfg, "ml.p3.2xlarge", stack={"torch": "1.7", "cuda": "11.0"}, model_options=head)
    new = estimate("roberta-base", cfg, "ml.p3.2xlarge", stack={"torch": "2.8", "cuda": "12.9"}, model_options=head)
    gap_old = {t.name: t for t in old.band}["unexplained_gap"]
    gap_new = {t.name: t for t in new.band}["unexplained_gap"]
    assert gap_new.high == 0 and gap_old.high > 0
    assert old.peak_device_high_bytes - old.memory_bytes.peak_device >= gap_old.high
    assert old.peak_device_low_bytes <= old.memory_bytes.peak_device <= old.peak_device_high_bytes
    assert old.verdict == "tight" and not old.fits and new.verdict == "fits"
