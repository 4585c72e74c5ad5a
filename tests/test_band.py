"""The verdict band (issue 8, item 4): properties of the pure arithmetic and of `estimate`'s use of it."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from planner.estimate import estimate
from planner.memory import band
from planner.spec import TrainConfig

FAST = settings(max_examples=25, deadline=None)
GiB = 1 << 30
sizes = st.integers(0, 40 * GiB)


@st.composite
def terms(draw):
    out = [band.exact("tensors", draw(sizes), "exact")]
    allocated = out[0].point + draw(st.integers(0, GiB))
    reserved = allocated + draw(st.integers(0, allocated // 2 + 1))
    out.append(band.reserved_pool_term(allocated, reserved, given=draw(st.booleans()), replayed=draw(st.booleans()),
                                       calibrated_range=draw(st.none() | st.tuples(st.floats(0, 0.5),
                                                                                   st.floats(0, 0.5)))))
    out.append(band.workspace_term(draw(st.integers(0, 64 << 20)), draw(st.booleans())))
    out.append(band.nccl_term(draw(st.integers(0, 400 << 20)), draw(st.booleans())))
    p = draw(st.integers(0, 2 * GiB))
    out.append(band.context_term(p, p - draw(st.integers(0, p)), p + draw(st.integers(0, GiB)), "x"))
    return out


@FAST
@given(terms(), st.integers(1, 80 * GiB))
def test_band_contains_the_point_and_the_verdict_follows_its_ends(ts, capacity):
    for t in ts:
        assert 0 <= t.low <= t.point <= t.high, t
    low, point, high = band.totals(ts)
    assert low <= point <= high
    v = band.verdict(low, high, capacity)
    if high <= capacity:
        assert v == "fits"  # never tight (nor oom) when the high end is under capacity
    if low <= capacity:
        assert v != "oom"  # never oom when the low end is under capacity
    if v == "tight":
        assert low <= capacity < high
        assert band.tight_terms(ts, point, capacity)  # the text can always name a reason


def test_flat_pool_band_is_allocated_to_1_3x_allocated():
    t = band.reserved_pool_term(10 * GiB, 11 * GiB)
    assert (t.low, t.point, t.high) == (0, GiB, 3 * GiB)


def test_calibration_narrows_the_pool_band():
    wide = band.reserved_pool_term(10 * GiB, 11 * GiB)
    narrow = band.reserved_pool_term(10 * GiB, 11 * GiB, calibrated_range=(0.08, 0.12))
    assert narrow.high - narrow.low < wide.high - wide.low
    assert narrow.low <= narrow.point <= narrow.high


MODELS = st.sampled_from(["bert-base-uncased", "roberta-base", "gpt2", "distilbert-base-uncased"])


@FAST
@given(MODELS, st.integers(1, 256), st.sampled_from([128, 256, 512]), st.sampled_from(["fp32", "amp-fp16"]),
       st.sampled_from(["ml.p3.2xlarge", "ml.g5.2xlarge", "ml.p3.16xlarge"]),
       st.sampled_from([None, {"torch": "1.12"}, {"torch": "2.3", "transformers": "4.40"}]))
def test_estimate_band_properties(model, batch, seq, precision, instance, stack):
    est = estimate(model, TrainConfig(batch_size=batch, seq_len=seq, precision=precision), instance, stack=stack,
                   with_throughput=False)
    m = est.memory_bytes
    assert est.peak_device_low_bytes <= m.peak_device <= est.peak_device_high_bytes
    assert band.totals(est.band) == (est.peak_device_low_bytes, m.peak_device, est.peak_device_high_bytes)
    assert est.fits == (est.verdict == "fits")
    if est.peak_device_high_bytes <= est.gpu_memory_bytes:
        assert est.verdict == "fits"
    if est.peak_device_low_bytes <= est.gpu_memory_bytes:
        assert est.verdict != "oom"
    # activations and the other tensors are exact: the band is all runtime terms
    tensors = {t.name: t for t in est.band}["tensors"]
    assert tensors.low == tensors.high


def test_a_sure_fit_is_rarer_than_a_point_fit():
    """Near the limit the point estimate fits but the high end does not: tight, not fits."""
    cfg = TrainConfig(batch_size=1, seq_len=512, precision="amp-fp16")
    verdicts = []
    for b in range(1, 41):  # every batch: the tight region is only a few batches wide
        e = estimate("roberta-base", cfg.model_copy(update={"batch_size": b}), "ml.p3.2xlarge",
                     with_throughput=False)
        verdicts.append(e.verdict)
        if e.headroom_bytes >= 0 and e.verdict != "fits":
            assert e.verdict == "tight"
    assert "tight" in verdicts and verdicts.index("tight") > 0  # fits, then tight, then oom as batch grows
    seq = [v for i, v in enumerate(verdicts) if i == 0 or v != verdicts[i - 1]]
    assert seq in (["fits", "tight", "oom"], ["fits", "tight"])


def test_calibration_readings_narrow_the_band_for_that_family_and_stack(tmp_path, monkeypatch):
    """`planner calibrate` writes context_range / fragmentation_range; they replace the wide default bands,
    for that family only and for stacks with the same module loading as the probe runs."""
    import json

    from planner.probes.calibrate import fit, sample_of

    cfg = TrainConfig(batch_size=16, seq_len=256, precision="amp-fp16")
    monkeypatch.setenv("PLANNER_CALIBRATION", str(tmp_path / "none.json"))
    before = estimate("bert-base-uncased", cfg, "ml.p3.2xlarge", with_throughput=False)
    records = [{"device": "cuda", "status": "ok", "gpu_name": "Tesla V100-SXM2-16GB", "record_id": str(i),
                "world_size": 1, "config": {"parallelism": "single"},
                "versions": {"torch": "2.8.0+cu129", "cuda": "12.9"},
                "summary": {"cuda_context": ctx, "peak_reserved": int(10e9 * (1 + f)), "peak_allocated": int(10e9)}}
               for i, (ctx, f) in enumerate([(420 << 20, 0.06), (450 << 20, 0.09), (430 << 20, 0.08)])]
    entry = fit([sample_of(r, None) for r in records])
    assert entry["module_loading"] == "lazy"
    assert entry["context_range"] == [420 << 20, 450 << 20]
    (tmp_path / "cal.json").write_text(json.dumps({"families": {"V100": entry}}))
    monkeypatch.setenv("PLANNER_CALIBRATION", str(tmp_path / "cal.json"))
    after = estimate("bert-base-uncased", cfg, "ml.p3.2xlarge", with_throughput=False)

    def width(e, name):
        t = {t.name: t for t in e.band}[name]
        return t.high - t.low

    assert width(after, "cuda_context") < width(before, "cuda_context")
    assert width(after, "reserved_pool") < width(before, "reserved_pool")
    assert after.peak_device_high_bytes - after.peak_device_low_bytes < \
        before.peak_device_high_bytes - before.peak_device_low_bytes
    # an eager-loading stack is not what the probes measured: its band stays the published eager range
    eager = estimate("bert-base-uncased", cfg, "ml.p3.2xlarge", stack={"torch": "1.12"}, with_throughput=False)
    assert width(eager, "cuda_context") >= (1400 - 1000) * 2**20
    other = estimate("bert-base-uncased", cfg, "ml.g5.xlarge", with_throughput=False)  # another family
    assert "not calibrated" in {t.name: t for t in other.band}["cuda_context"].basis


def test_explain_has_the_beyond_tensors_step_naming_the_stack():
    from planner.explain import explain

    est = estimate("roberta-base", TrainConfig(batch_size=8, seq_len=128), "ml.p3.2xlarge",
                   stack={"torch": "1.12"}, with_throughput=False)
    steps = {s.title: s.lines for s in explain(est)}
    lines = " ".join(steps["What the GPU holds beyond your tensors"])
    assert "torch 1.12" in lines and "eager module loading" in lines
    assert "Reserved pool" in lines and "verdict" in lines


def test_a_malformed_calibration_range_is_bad_input(tmp_path, monkeypatch):
    import json

    import pytest

    from planner.errors import PlannerError

    (tmp_path / "cal.json").write_text(json.dumps({"families": {"V100": {"cuda_context_bytes": 4e8,
                                                                          "context_range": "wide"}}}))
    monkeypatch.setenv("PLANNER_CALIBRATION", str(tmp_path / "cal.json"))
    with pytest.raises(PlannerError, match="context_range"):
        estimate("bert-base-uncased", TrainConfig(batch_size=8, seq_len=128), "ml.p3.2xlarge", with_throughput=False)
