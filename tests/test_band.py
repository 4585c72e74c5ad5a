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
    for b in range(8, 129, 8):
        e = estimate("roberta-base", cfg.model_copy(update={"batch_size": b}), "ml.p3.2xlarge",
                     with_throughput=False)
        verdicts.append(e.verdict)
        if e.headroom_bytes >= 0 and e.verdict != "fits":
            assert e.verdict == "tight"
    assert "tight" in verdicts and verdicts.index("tight") > 0  # fits, then tight, then oom as batch grows
    seq = [v for i, v in enumerate(verdicts) if i == 0 or v != verdicts[i - 1]]
    assert seq in (["fits", "tight", "oom"], ["fits", "tight"])
