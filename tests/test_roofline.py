"""The roofline's rules (planner.perf.roofline) and the GPU facts it reads, against first principles and the
datasheets: tile waves, the unit each dtype runs on, fused attention, and the SM/clock facts."""

from __future__ import annotations

import numpy as np
import pytest

from planner.hardware import get_gpu, gpu_table, list_gpus
from planner.perf.roofline import RooflineConstants, peak_for, wave_efficiency

C = RooflineConstants()

# FP32 lanes per SM by compute capability: CUDA C Programming Guide, "Arithmetic Instructions" throughput
# table (32-bit floating-point add, multiply, multiply-add: 64 per clock per SM on 7.0, 7.5 and 8.0; 128 on
# 8.6, 8.9 and 9.0).
FP32_LANES = {(7, 0): 64, (7, 5): 64, (8, 0): 64, (8, 6): 128, (8, 9): 128, (9, 0): 128,
              (12, 0): 128}  # sm120 (Blackwell RTX PRO): 128 FP32 lanes per SM, as Ada
# A10G: the row's FP32 peak is the A10's datasheet figure (72 SMs at 1695 MHz); 80 SMs at 1710 MHz give
# 35.0 TFLOP/s. NVIDIA publishes no A10G datasheet: the row stays as it is and is left out here.
NO_DATASHEET = ("A10G",)


@pytest.mark.parametrize("gpu_id", list_gpus())
def test_fp32_peak_is_sms_times_lanes_times_clock(gpu_id):
    """Datasheet FP32 peak = SMs x FP32 lanes per SM x 2 (an FMA) x boost clock: the SM counts and clocks
    agree with the peaks taken from the datasheets (within 1 %)."""
    gpu = get_gpu(gpu_id)
    if gpu.sm_count is None or gpu.boost_clock_mhz is None:  # unpublished: null in gpus.json, with its note
        assert gpu_table()[gpu_id].get("notes") or gpu_table()[gpu_id].get("null_notes") or \
            any("null" in s.lower() or "not published" in s.lower() for s in gpu.sources), gpu_id
        pytest.skip("SM count or clock not published")
    assert gpu.l2_mib and gpu.pcie_gbs
    if gpu.family in NO_DATASHEET:
        pytest.skip("no datasheet")
    derived = gpu.sm_count * FP32_LANES[tuple(gpu.compute_capability)] * 2 * gpu.boost_clock_mhz * 1e6 / 1e12
    assert derived == pytest.approx(gpu.peak_tflops["fp32"], rel=0.01)


def test_a_partial_last_wave_costs_a_whole_wave():
    sms = 80
    one = np.array([1.0])
    full = wave_efficiency(one, np.array([128.0 * 80]), np.array([128.0]), np.array([64.0]), sms, C)
    assert full[0] == pytest.approx(1.0)
    # one more 128-row tile than SMs: two waves, 81 of 160 tile slots used (256x128 tiles do no better)
    over = wave_efficiency(one, np.array([128.0 * 81]), np.array([128.0]), np.array([64.0]), sms, C)
    assert over[0] == pytest.approx(81 / 160)
    # a 100-row GEMM pads its tile: 100/128 of it is useful
    pad = wave_efficiency(np.array([80.0]), np.array([100.0]), np.array([128.0]), np.array([64.0]), sms, C)
    assert pad[0] == pytest.approx(100 / 128)


def test_split_k_fills_idle_sms_when_k_is_long():
    """One 128x128 output tile with K = 8192 is split over min(SMs, K / split_k_min) slices."""
    eff = wave_efficiency(np.array([1.0]), np.array([128.0]), np.array([128.0]), np.array([8192.0]), 80, C)
    splits = min(80, 8192 // C.split_k_min)
    assert eff[0] == pytest.approx(splits / 80)


def test_tensor_cores_for_16_bit_cuda_cores_for_fp32():
    v100, a100 = get_gpu("V100-16GB"), get_gpu("A100-40GB")
    assert peak_for(v100, "float16", False) == v100.peak_tflops["fp16"]
    assert peak_for(a100, "bfloat16", False) == a100.peak_tflops["bf16"]
    assert peak_for(a100, "float32", False) == a100.peak_tflops["fp32"]
    assert peak_for(a100, "float32", True) == a100.peak_tflops["tf32"]
    assert peak_for(v100, "float32", True) == v100.peak_tflops["fp32"]  # no TF32 before Ampere


def test_fused_attention_is_faster_than_eager_on_long_sequences():
    """Eager attention writes and re-reads b·a·s² scores several times; the fused kernel does not."""
    from planner.hardware import get_instance
    from planner.models.catalog import get_model
    from planner.perf.throughput import predict_throughput
    from planner.spec import TrainConfig

    spec = get_model("bert-base-uncased", num_labels=2)
    inst = get_instance("ml.p4d.24xlarge")
    runs = {a: predict_throughput(spec, TrainConfig(batch_size=8, seq_len=512, precision="amp-bf16", attention=a,
                                                    parallelism="single"), inst) for a in ("eager", "sdpa")}
    eager, fused = runs["eager"], runs["sdpa"]
    assert fused.samples_per_s > eager.samples_per_s
    assert fused.breakdown_s["attention"] < eager.breakdown_s["attention"]


def test_explain_names_what_bounds_the_step():
    """A memory-bound step (eager attention over long sequences on an L40S) and a launch-bound one (one short
    sequence per GPU): the Verdict step says which, from the breakdown."""
    from planner.estimate import estimate
    from planner.explain import explain
    from planner.spec import TrainConfig

    opts = {"num_labels": 2}
    memory = estimate("distilbert-base-uncased", TrainConfig(batch_size=16, seq_len=512, precision="amp-fp16",
                                                              attention="eager"), "ml.g6e.xlarge", model_options=opts)
    lines = explain(memory, model_options=opts)[-1].lines
    assert any("memory-bound: a GPU with more HBM bandwidth helps more" in line for line in lines)
    launch = estimate("distilbert-base-uncased", TrainConfig(batch_size=1, seq_len=16, precision="amp-bf16"),
                      "ml.p4d.24xlarge", model_options=opts)
    assert any("launch overhead" in line for line in explain(launch, model_options=opts)[-1].lines)


def test_explain_says_how_long_the_gpus_wait_for_the_slowest_only_when_there_are_several():
    from planner.estimate import estimate
    from planner.explain import explain
    from planner.spec import TrainConfig

    cfg = TrainConfig(batch_size=8, seq_len=512, precision="amp-fp16")
    for instance, expected in (("ml.p3.16xlarge", True), ("ml.p3.2xlarge", False)):
        est = estimate("bert-base-uncased", cfg, instance)
        text = " ".join(explain(est)[-1].lines)
        share = est.throughput.breakdown_s["slowest_gpu_wait_s"] / est.throughput.step_time_s
        assert ("waiting for the slowest" in text) is expected
        if expected:
            assert f"{share:.0%} of the step is the faster GPUs waiting" in text


def test_explain_names_the_units_a_flop_bound_step_runs_on():
    """fp32 matmuls run on CUDA cores unless TF32 is on and the GPU has it: the advice names FP32 FLOP/s then,
    and tensor-core FLOP/s for 16-bit or TF32 steps."""
    from planner.estimate import estimate
    from planner.explain import explain
    from planner.spec import TrainConfig

    def advice(instance, **cfg):
        est = estimate("bert-large-uncased", TrainConfig(batch_size=8, seq_len=512, **cfg), instance)
        return " ".join(line for line in explain(est)[-1].lines if "bound by FLOPs" in line or "helps most" in line)

    assert "FP32 FLOP/s" in advice("ml.p3.2xlarge", precision="fp32") and "no TF32" in advice(
        "ml.p3.2xlarge", precision="fp32")
    assert "--tf32 puts them" in advice("ml.p4d.24xlarge", precision="fp32")
    assert "tensor-core FLOP/s" in advice("ml.p4d.24xlarge", precision="fp32", tf32=True)
    assert "tensor-core FLOP/s" in advice("ml.p3.2xlarge", precision="amp-fp16")
