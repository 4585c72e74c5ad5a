"""Megatron-Core's fused kernels (planner.perf.fused): what `--framework megatron` runs between the GEMMs."""

from __future__ import annotations

import pytest

from planner.models.catalog import cached_model
from planner.perf.kernels import training_kernels
from planner.perf.micro_step import micro_kernels
from planner.spec import TrainConfig

B, S = 2, 256


def _config(framework: str) -> TrainConfig:
    return TrainConfig(batch_size=B, seq_len=S, precision="amp-bf16", attention="flash", framework=framework)


@pytest.mark.parametrize("name", ["gpt2", "llama-3-8b"])
def test_gemms_and_attention_are_the_eager_ones(name):
    """Only the memory-bound kernels change: every GEMM and the fused attention are eager PyTorch's."""
    model = cached_model(name)
    eager = [k for k in micro_kernels(model, _config("pytorch")) if k.kind in ("gemm", "attention")]
    mega = [k for k in micro_kernels(model, _config("megatron")) if k.kind in ("gemm", "attention")]
    assert [(k.name, k.flops, k.count, k.gemm) for k in mega] == [(k.name, k.flops, k.count, k.gemm) for k in eager]


@pytest.mark.parametrize("name", ["gpt2", "llama-3-8b"])
def test_no_casts_and_a_bf16_residual_stream(name):
    """Float16Module: no autocast weight, input or gradient casts; the layer's kernels move bf16."""
    ks = micro_kernels(cached_model(name), _config("megatron"))
    assert not [k for k in ks if k.param_work in ("weight_cast", "bias_cast", "grad_cast", "bias_grad")]
    assert not [k for k in ks if "input_cast" in k.name]
    assert all(k.dtype == "bfloat16" for k in ks if k.kind == "memory_bound" and k.block_role == "layer")


def _layer_bytes_per_token(ks, phase):
    return sum(k.bytes for k in ks if k.kind == "memory_bound" and k.block_role == "layer"
               and k.phase == phase) / (B * S)


def test_gpt_layer_bytes_follow_the_fused_kernels():
    """GPT-2 form, per token and layer, written out: two norms (x in, y out, 2 B each, fp32 mean/rstd), two
    bias-dropout-adds (x and residual in, y and a 1-byte mask out), bias-GELU over the intermediate width."""
    model = cached_model("gpt2")
    t = model.transformers[0]
    h, i = t.hidden_size, t.intermediate_size
    ks = micro_kernels(model, _config("megatron"))
    forward = 2 * (2 * h + 2 * h + 8) + 2 * (4 * h + 2 * h + h) + (2 * i + 2 * i)
    # backward: norms read dy, x, stats and write dx, plus the residual gradient's add (2 in, 1 out); dropout
    # reads dy and the mask; GELU reads dy and x, writes dx
    backward = 2 * (4 * h + 8 + 2 * h) + 2 * 6 * h + 2 * (2 * h + h + 2 * h) + 6 * i
    assert _layer_bytes_per_token(ks, "forward") == pytest.approx(forward)
    assert _layer_bytes_per_token(ks, "backward") == pytest.approx(backward)


def test_gated_layer_has_fused_rope_and_swiglu():
    model = cached_model("llama-3-8b")
    t = model.transformers[0]
    ks = micro_kernels(model, _config("megatron"))
    names = {k.name for k in ks}
    assert {"layer.fused_rope.q", "layer.fused_rope.k", "layer.mlp.fused_bias_swiglu",
            "layer.mlp.fused_bias_swiglu.backward"} <= names
    swiglu = next(k for k in ks if k.name == "layer.mlp.fused_bias_swiglu")
    assert swiglu.bytes == B * S * t.intermediate_size * 3 * 2  # gate and up in, their product out, bf16


@pytest.mark.parametrize("name", ["gpt2", "llama-3-8b"])
def test_fused_step_moves_fewer_bytes(name):
    """The point of the fusions: the same step moves far fewer bytes than eager autocast's."""
    model = cached_model(name)
    eager = sum(k.bytes * k.count for k in micro_kernels(model, _config("pytorch")) if k.kind == "memory_bound")
    mega = sum(k.bytes * k.count for k in micro_kernels(model, _config("megatron")) if k.kind == "memory_bound")
    assert mega < 0.6 * eager


def test_default_framework_is_untouched():
    """--framework pytorch keeps the eager list exactly."""
    model = cached_model("gpt2")
    config = _config("pytorch")
    assert micro_kernels(model, config) == training_kernels(model, config)


def test_a_classifier_keeps_its_own_loss():
    """The fused vocabulary-parallel cross-entropy is a language model's loss; a classifier's stays as it was."""
    model = cached_model("bert-base-uncased", {"head": "sequence-classification"})
    assert model.transformers[0].head == "sequence-classification"
    eager = [k for k in micro_kernels(model, _config("pytorch")) if k.block_role == "" and k.kind == "memory_bound"]
    mega = [k for k in micro_kernels(model, _config("megatron")) if k.block_role == "" and k.kind == "memory_bound"]
    assert mega == eager and mega
    assert not [k for k in micro_kernels(model, _config("megatron")) if "cross_entropy" in k.name]


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "gpt-oss-20b"])
def test_moe_layers_keep_their_router_permutation_and_expert_kernels(name):
    """Megatron-Core's dense fused list has no router, permutation, expert activation or combine: a
    mixture-of-experts layer keeps those kernels (the fused ones where Megatron fuses them: one weighted-SwiGLU
    pass, one unpermutation pass), in bf16 (Float16Module), and no dense fused SwiGLU runs where every layer is
    sparse (before, the dense layer's SwiGLU over intermediate_size stood in for the experts and their routing)."""
    cfg = TrainConfig(batch_size=B, seq_len=S, precision="fp8", fp8_recipe="current", attention="flash",
                      framework="megatron", parallelism="ddp")  # FP8 computes as amp-bf16: an fp32 eager stream
    from planner.models.catalog import get_model
    from planner.pipeline.resolve import resolve

    model = get_model(name)
    r = resolve(model, cfg, "ml.p5.48xlarge", None, None, {}, "cuda")
    ks = [k for k in micro_kernels(model, r.cfg, ctx=r.ctx) if k.kind == "memory_bound" and k.block_role == "layer"]
    names = {k.name for k in ks}
    assert {"layer.mlp.experts.act", "layer.mlp.experts.unpermute", "layer.mlp.experts.permute.gather"} <= names
    assert not any("fused_bias_swiglu" in n for n in names)
    assert not [k.name for k in ks if k.name.startswith("layer.mlp.experts.") and k.dtype == "float32"]
    act = next(k for k in ks if k.name == "layer.mlp.experts.act")
    t = model.transformers[0]
    pairs = B * S * t.experts_per_token
    assert act.bytes_written == pairs * t.moe_intermediate_size * 2  # one pass writing the weighted product
