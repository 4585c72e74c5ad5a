"""Elementwise passes as ATen runs them on CUDA: GPT-2's Python gelu_new kernel by kernel (forward and what
autograd runs backward), and which passes mix floating dtypes (ATen's per-element-cast loop, timed by the
SMs on Hopper: planner.perf.roofline.ARCH_DYNAMIC_CAST).

The reference is the planner's tracer: the real transformers module and the real autograd engine under
FakeTensorMode, with CUDA's autocast policy (`backend="cuda"`: `pow` on the fp32 list, as
torch/include/ATen/autocast_mode.h lists it)."""

from __future__ import annotations

import pytest
import torch
from transformers.activations import NewGELUActivation

from planner.hardware import get_instance
from planner.perf.kernels import F32, backward_of, elementwise, needs_dynamic_cast, python_gelu
from planner.perf.roofline import ARCH_DYNAMIC_CAST, HOPPER, mixed_pass_bandwidth, time_kernels
from planner.perf.throughput import ThroughputConstants
from planner.program.speed import cuda_rows, traced_dynamic_cast
from planner.program.trace import trace_step
from planner.spec import TrainConfig

D, B, S = 16, 2, 8
N = B * S * 4 * D  # the activation's elements


class UpGeluDown(torch.nn.Module):
    """GPT-2's MLP: a projection up, gelu_new, a projection down."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.act, self.down = torch.nn.Linear(D, 4 * D), NewGELUActivation(), torch.nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.up(x)))


def _traced_gelu(precision: str) -> dict[str, list[tuple[int, bool]]]:
    """(bytes, mixed dtypes) of each kernel the traced step runs on the activation's elements: the forward's
    in the `act` module; the backward's from the gradient that arrives through the down projection (under
    autocast its input cast's backward, a bf16 -> fp32 copy, comes first and is the projection's)."""
    trace = trace_step(UpGeluDown, lambda b, s: torch.randn(b, s, D), TrainConfig(batch_size=B, seq_len=S,
                       precision=precision), loss_fn=lambda out, _: out.float().pow(2).mean(), backend="cuda")
    rows = cuda_rows([o for o in trace.ops if o.kernel and o.phase in ("forward", "backward")])
    on_act = [(op, row) for op, row in rows if row[0] == "memory_bound"
              and any(m.shape == (B, S, 4 * D) for m in op.outputs)]
    fwd = [(int(row[4]), traced_dynamic_cast(op)) for op, row in on_act if op.phase == "forward" and op.module == "act"]
    bwd = [(int(row[4]), traced_dynamic_cast(op)) for op, row in on_act if op.phase == "backward"]
    if precision != "fp32":
        bwd = bwd[1:]
    return {"forward": fwd, "backward": bwd}


def _planned_gelu(precision: str) -> dict[str, list[tuple[int, bool]]]:
    low = F32 if precision == "fp32" else "bfloat16"
    fwd = python_gelu("act", N, low, F32)
    bwd = [b for k in reversed(fwd) for b in backward_of(k)]
    return {phase: [(k.bytes, k.dynamic_cast) for k in ks] for phase, ks in (("forward", fwd), ("backward", bwd))}


@pytest.mark.parametrize("precision", ["amp-bf16", "fp32"])
def test_python_gelu_is_what_autograd_runs(precision):
    """Kernel count, bytes and the mixed-dtype passes, forward and backward, equal the traced step's."""
    traced, planned = _traced_gelu(precision), _planned_gelu(precision)
    for phase in ("forward", "backward"):
        assert len(planned[phase]) == len(traced[phase]), phase
        assert sum(b for b, _ in planned[phase]) == sum(b for b, _ in traced[phase]), phase
        assert sum(m for _, m in planned[phase]) == sum(m for _, m in traced[phase]), phase
    if precision == "amp-bf16":  # 70 + 112 bytes an element; the one-pass-per-op rule said 62 + 94
        assert sum(b for b, _ in planned["forward"] + planned["backward"]) == 182 * N


@pytest.mark.parametrize(("reads", "writes", "mixed"), [
    (("bfloat16",), ("float32",), True),  # a 16-bit -> fp32 copy: the generic cast loop
    (("float32",), ("bfloat16",), False),  # fp32 -> 16-bit: Copy.cu's vectorized gpu_kernel_nocast
    (("float32",), ("float16",), False),
    (("bfloat16", "float32"), ("float32",), True),  # x + m under autocast
    (("float32", "float32"), ("float32",), False),
    (("bfloat16",), ("bfloat16", "bool"), False),  # dropout's mask is not a floating operand
    (("bool",), ("float32",), False),
])
def test_which_passes_cast_per_element(reads, writes, mixed):
    assert needs_dynamic_cast(reads, writes) is mixed


def test_a_cast_backward_is_the_reverse_cast():
    up = elementwise("x.to_fp32", 1024, ("bfloat16",), (F32,), F32)
    down = elementwise("x.to_bf16", 1024, (F32,), ("bfloat16",), "bfloat16")
    assert up.dynamic_cast and not backward_of(up)[0].dynamic_cast
    assert not down.dynamic_cast and backward_of(down)[0].dynamic_cast


def test_mixed_passes_are_bound_by_the_sms_on_hopper():
    """A mixed pass takes as long on an H100 as on an H200 (same SMs and clock), a vectorized one scales with
    the HBM; an architecture without a fitted rate times both alike."""
    c = ThroughputConstants()
    assert dict(ARCH_DYNAMIC_CAST).get(HOPPER)
    h100, h200 = get_instance("ml.p5.48xlarge").gpu, get_instance("ml.p5e.48xlarge").gpu
    mixed = elementwise("add", 1 << 26, ("bfloat16", F32), (F32,), F32)
    plain = elementwise("add", 1 << 26, (F32, F32), (F32,), F32)

    def seconds(k, gpu):
        return time_kernels([k], gpu, c)[0]

    assert seconds(mixed, h100) == pytest.approx(seconds(mixed, h200))
    assert seconds(plain, h100) / seconds(plain, h200) == pytest.approx(4800 / 3350)
    assert seconds(mixed, h200) > seconds(plain, h200) * mixed.bytes / plain.bytes
    a100 = get_instance("ml.p4d.24xlarge").gpu
    assert mixed_pass_bandwidth(a100, c) is None
    assert seconds(mixed, a100) / seconds(plain, a100) == pytest.approx(mixed.bytes / plain.bytes)


def test_pass_readings_compare_each_pass_with_its_kind(tmp_path):
    """benchmarks/passes_readings.py reads gpu_session's passes.jsonl: each pass timed as the planner times
    it, mixed passes flagged. Rows made at half and twice the planner's time must read -50 % and +100 %."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import passes_readings

    h200 = get_instance("ml.p5e.48xlarge").gpu
    rows = []
    for op, reads, writes, factor in (("add", ["bfloat16", "float32"], "float32", 2.0),
                                      ("copy", ["float32"], "bfloat16", 0.5)):
        k = elementwise(op, 1 << 24, tuple(reads), (writes,), writes)
        secs = time_kernels([k], h200, ThroughputConstants())[0] * factor
        rows.append({"status": "ok", "op": op, "reads": reads, "writes": writes, "numel": 1 << 24,
                     "bytes": k.bytes, "seconds": secs, "bytes_per_s": k.bytes / secs})
    (tmp_path / "env.json").write_text(json.dumps({"gpu": "NVIDIA H200"}))
    (tmp_path / "passes.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = passes_readings.compare(tmp_path)
    assert [r["mixed"] for r in out] == [True, False]
    assert [round(r["error"], 6) for r in out] == [-0.5, 1.0]


@pytest.mark.parametrize(("precision", "checkpointing", "recast"), [
    ("amp-bf16", True, True), ("amp-bf16", False, False), ("fp32", True, False)])
def test_checkpointing_under_autocast_casts_the_weights_again(precision, checkpointing, recast):
    """The recomputation runs in an autocast region of its own whose cast cache starts empty, so each layer
    casts its weights to 16 bits again: as many recompute casts as forward casts of the layers, and none
    without autocast or without recomputation."""
    from planner.models.catalog import cached_model
    from planner.perf.kernels import training_kernels

    cfg = TrainConfig(batch_size=2, seq_len=128, precision=precision, checkpointing=checkpointing)
    ks = training_kernels(cached_model("bert-base-uncased"), cfg)
    casts = {ph: sum(k.count for k in ks if k.phase == ph and k.param_work in ("weight_cast", "bias_cast")
                     and k.block_role == "layer") for ph in ("forward", "recompute")}
    assert casts["recompute"] == (casts["forward"] if recast else 0)
    assert casts["forward"] == (0 if precision == "fp32" else 12 * 12)  # 6 Linears, weight and bias, 12 layers
