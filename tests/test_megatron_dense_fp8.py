"""A dense Megatron-Core layer under Transformer Engine FP8 and its pipeline's allocator replay (issue 35: the
Megatron-Bridge Llama-3-70B FP8 row, 64 H100s, called OOM while it ran).

- Megatron-Core's fused SwiGLU (megatron/core/fusions/fused_bias_swiglu.py @d98e8a64, SwiGLUFunction.forward):
  `input_for_backward = input.to(torch.float8_e4m3fn) if fp8_input_store else input;
  ctx.save_for_backward(input_for_backward)` with `activation_func_fp8_input_store` False by default. Written
  below as the source writes it and measured with saved-tensor hooks.
- TE's Linear saves the FP8 copy of its input that its own quantizer made (transformer_engine/pytorch/module/
  linear.py `_Linear.forward`, `inputmat.update_usage(rowwise_usage=False)`), also where another op saves the
  16-bit tensor (linear_proj after the attention): no CPU run of TE, checked against the rule's source quote.
- The in-flight micro-batches of a pipeline rank go through the allocator replay as their per-op tensors.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from planner.families.forms import model_program
from planner.ir.context import Ctx
from planner.memory import events
from planner.memory.op_saved import op_saved
from planner.models import hf_config
from planner.parallel.frameworks import FRAMEWORKS

NBYTES = {"bfloat16": 2, "float32": 4, "float8_e4m3fn": 1}
LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 256, "hidden_size": 64,
         "intermediate_size": 160, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "hidden_act": "silu", "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}


class SwiGLUFunction(torch.autograd.Function):
    """Megatron-Core's SwiGLUFunction (fused_bias_swiglu.py @d98e8a64), fp8_input_store False."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        y1, y2 = torch.chunk(x, 2, -1)
        return F.silu(y1) * y2

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        y1, y2 = torch.chunk(x, 2, -1)
        s = torch.sigmoid(y1)
        return torch.cat((g * s * (1 + y1 * (1 - s)) * y2, g * F.silu(y1)), -1)


def _hooked_bytes(fn, x) -> int:
    seen: dict[int, int] = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(x).sum().backward()
    return sum(seen.values())


def _layer(fused_glu: bool, fp8: str | None = None):
    spec = hf_config.spec_from_hf_config(LLAMA, name="tiny-llama")
    ctx = Ctx(2, 24, "fp8" if fp8 else "bf16", "flash", "cuda", False, True, fp8=fp8, fused_glu=fused_glu,
              fused_linears=True, fused_norms=True)
    program = model_program(spec, ctx)
    return ctx, next(b for b in program.blocks if b.role == "layer")


def _saved(op, ctx) -> int:
    return sum(t.numel * NBYTES[t.dtype] for t in op_saved(op, ctx))


def test_megatron_fused_swiglu_saves_what_the_source_saves():
    """The planner's SwiGLU (activation + product) under fused_glu equals what SwiGLUFunction saves, measured;
    the eager rule (silu's input, its output and `up`) is 1.5x that, as the eager ops save."""
    ctx, layer = _layer(True)
    n, i = ctx.n, LLAMA["intermediate_size"]
    fc1 = torch.randn(n, 2 * i, dtype=torch.bfloat16, requires_grad=True)
    measured = _hooked_bytes(SwiGLUFunction.apply, fc1)
    planned = sum(_saved(op, ctx) for op in layer.ops if op.kind in ("activation", "gated_mul"))
    assert planned == measured == n * 2 * i * 2

    eager_ctx, eager = _layer(False)
    gate, up = (torch.randn(n, i, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    eager_measured = _hooked_bytes(lambda g: F.silu(g) * up, gate)
    eager_planned = sum(_saved(op, eager_ctx) for op in eager.ops if op.kind in ("activation", "gated_mul"))
    assert eager_planned == eager_measured == 3 * n * i * 2


def test_megatron_record_cites_the_fused_swiglu_and_te_linear_rules():
    assert {n for n, f in FRAMEWORKS.items() if f.fused_glu} == {"megatron"}
    text = " ".join(FRAMEWORKS["megatron"].sources)
    for quote in ("ctx.save_for_backward(input_for_backward)", "activation_func_fp8_input_store: bool = False",
                  "bias_activation_fusion: bool = True", "update_usage(rowwise_usage=False)"):
        assert quote in text


@pytest.mark.parametrize("recipe, proj_bytes", [("current", 1), ("delayed", 1), ("tensorwise", 0)])
def test_attention_projection_saves_its_own_fp8_input_under_te(recipe, proj_bytes):
    """Under Transformer Engine o_proj keeps an FP8 copy (1 B an element of n x heads·d) besides the attention's
    bf16 output; torchao saves the high-precision input, which the attention already holds."""
    ctx, layer = _layer(True, recipe)
    o = next(op for op in layer.ops if op.name.endswith("o_proj"))
    assert _saved(o, ctx) == proj_bytes * ctx.n * LLAMA["hidden_size"]


def test_in_flight_micro_batches_are_replayed_as_their_tensors():
    """The in-flight pseudo-block splits into copies of the rank's own per-micro-batch tensors, and the row's
    replayed pool is no longer a second segment the size of that block."""
    import planner
    from planner.probes.public_moe_fp8 import load_published

    row = next(r for r in load_published("fp8") if r.id == "mb-2511-h100-l3-70b-fp8cs")
    est = planner.estimate(row.model_ref(Path(__file__).resolve().parents[1]), row.train_config(), row.instance)
    stage = est.parallel.stages[est.parallel.worst_stage]
    per_micro_batch = stage.activation_bytes / stage.in_flight_micro_batches
    pool = est.memory_bytes.peak_reserved - est.memory_bytes.peak_allocated
    assert pool < per_micro_batch * (stage.in_flight_micro_batches - 1) / 2

    kept = (5, 7, 11)
    tensors = {"a": events.BlockTensors("a", saved=kept)}
    from planner.memory.timeline import BlockMemory

    blocks = (BlockMemory(events.IN_FLIGHT, 0, 0, 0, 0, 2 * 23 + 12, 2 * 23 + 12, 0, 0, False),
              BlockMemory("a", 0, 0, 0, 0, 23, 23, 0, 0, False))

    class Step:  # the two fields in_flight_tensors reads
        pass

    step = Step()
    step.blocks = blocks  # type: ignore[attr-defined]
    got = events.in_flight_tensors(step, tensors)  # type: ignore[arg-type]
    assert got is not None and got.saved == kept * 2 + (5, 7)
    assert sum(events.split(blocks[0].kept_bytes, got.saved)) == blocks[0].kept_bytes


def test_megatron_pipeline_rank_replays_its_optimizer_tensors_per_parameter():
    """A Megatron pipeline rank's optimizer states and fp32 gradient copies reach the replay per parameter shard
    (distrib_optimizer.py `shard_model_param.clone().float()`, `shard_model_grad.float()`), their sum within the
    step's totals; another framework's are left to the trace's own split."""
    import planner
    from planner.pipeline import step as pipeline_step
    from planner.probes.public_moe_fp8 import load_published

    row = next(r for r in load_published("fp8") if r.id == "mb-2511-h100-l3-70b-fp8cs")
    seen = []
    real = pipeline_step._megatron_optimizer_tensors

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        seen.append(out)
        return out

    pipeline_step._megatron_optimizer_tensors = spy
    try:
        est = planner.estimate(row.model_ref(Path(__file__).resolve().parents[1]), row.train_config(), row.instance)
    finally:
        pipeline_step._megatron_optimizer_tensors = real
    assert seen and all(s is not None for s in seen)
    states, temps = seen[0]
    stage = est.parallel.stages[0]
    assert 0 < sum(states) <= stage.optimizer_bytes
    # bf16 main gradients (grad_reduce_in_fp32 false): one fp32 copy of each parameter's shard at the step
    assert len(temps) * 3 == len(states) and sum(temps) * 3 == pytest.approx(sum(states), rel=1e-6)
    from types import SimpleNamespace

    deepspeed = SimpleNamespace(kind="deepspeed", master_bytes=4, state_param_bytes=4, step_grad_bytes=4)
    assert real([(8, 4)], row.train_config(), deepspeed, 0.5, 1.0, 1) is None


def test_llama_70b_fp8_layer_saves_the_hand_count_from_the_sources():
    """One Llama-3-70B layer of the Megatron-Bridge FP8 row (TP 4, SP, 8,192 tokens) saves what the TE / Megatron
    sources listed in docs/fp8-and-compile.md add up to: the two norms' bf16 inputs (local rows) and fp32 rstd,
    `linear_qkv`'s and `linear_fc1`'s local FP8 `ln_out`, the fused attention's q, k, v, output (bf16) and fp32
    softmax statistics, `linear_proj`'s FP8 input, the fused SwiGLU's bf16 fc1 output, `linear_fc2`'s FP8 input."""
    import json

    import planner
    from planner.probes.public_moe_fp8 import load_published

    root = Path(__file__).resolve().parents[1]
    row = next(r for r in load_published("fp8") if r.id == "mb-2511-h100-l3-70b-fp8cs")
    cfg = json.loads((root / row.model).read_text())
    est = planner.estimate(row.model_ref(root), row.train_config(), row.instance)
    s, h, i, tp = row.seq_len * row.micro_batch, cfg["hidden_size"], cfg["intermediate_size"], row.tp
    d = h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] // tp * d, cfg["num_key_value_heads"] // tp * d
    rows = s // tp  # sequence parallel: the residual stream's local rows
    norms = 2 * (rows * h * 2 + rows * 4)
    fp8_ln_out = 2 * rows * h * 1
    attention = (2 * s * q + 2 * s * kv) * 2 + cfg["num_attention_heads"] // tp * s * 4
    proj, swiglu, fc2 = s * q * 1, s * 2 * (i // tp) * 2, s * (i // tp) * 1
    from planner.estimate import program

    layer = next(b for b in program(row.model_ref(root), est)["blocks"] if b["name"] == "model.layer.1")
    assert sum(op["saved_bytes"] for op in layer["ops"]) == norms + fp8_ln_out + attention + proj + swiglu + fc2
