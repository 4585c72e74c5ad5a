"""Issue 35's framework rules for MoE and FP8 (the three planner errors the published runs showed):

1. the routed experts' compute dtype follows `--framework`: transformers' grouped_mm casts its input to the
   weights' dtype and is not autocast (fp32 under amp-*), checked on the installed module under CPU autocast;
   torchtitan's `_run_experts_grouped_mm` casts to bf16 (its source function, quoted, checked the same way) and
   Megatron-Core computes on Float16Module's bf16 weights: the program's expert GEMMs, their saved inputs and
   the GEMM kernels' dtype;
2. gpt-oss's attention: transformers has no SDPA path for its sinks (`--attention sdpa` is one line, exit 2);
   a framework with its own fused attention (torchtitan's FlexAttention, Megatron's TE) resolves `auto` to the
   fused kernel, transformers' default stays eager;
3. Transformer Engine's FP8 weight copies under Megatron (`is_first_microbatch`): one cached FP8 weight and
   transpose per Linear of the rank's layers (a module buffer), none saved per micro-batch; without the cache
   one copy per Linear per forward at the tensor-parallel rank's widths.
"""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from planner.estimate import estimate
from planner.families.forms import model_program
from planner.ir.context import Ctx
from planner.models import hf_config
from planner.models.catalog import get_model
from planner.parallel.frameworks import FRAMEWORKS
from planner.spec import TrainConfig
from tests.test_moe import TINY


def _saved_dtypes(fn, *args) -> list[tuple[tuple[int, ...], object]]:
    import torch

    saved: list[tuple[tuple[int, ...], object]] = []

    def pack(t):
        saved.append((tuple(t.shape), t.dtype))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args).float().sum().backward()
    return saved


def test_transformers_grouped_experts_compute_in_the_weights_dtype_under_autocast():
    """The installed transformers' Qwen3-MoE experts (grouped_mm path) under bf16 autocast with fp32 weights save
    their (pairs, hidden) input in fp32: `_grouped_mm` casts the input to the weights' dtype (transformers
    integrations/moe.py, citing pytorch/pytorch#174763)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    conf = transformers.AutoConfig.for_model("qwen3_moe", **{k: v for k, v in TINY["qwen3_moe"].items()
                                                            if k != "model_type"})
    # what PreTrainedModel.get_correct_experts_implementation picks when nothing is asked (a standalone block
    # has no model to pick it)
    conf._experts_implementation = "grouped_mm"
    block = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock(conf)
    x = torch.randn(2, 6, conf.hidden_size, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        saved = _saved_dtypes(block, x)
    pairs = 2 * 6 * conf.num_experts_per_tok
    gemm_inputs = [d for s, d in saved if s == (pairs, conf.hidden_size)]
    assert gemm_inputs and all(d == torch.float32 for d in gemm_inputs)


def _torchtitan_run_experts_grouped_mm(w1, w2, w3, x, num_tokens_per_expert):
    """pytorch/torchtitan torchtitan/models/moe/moe.py `_run_experts_grouped_mm` (@6404b932), quoted."""
    import torch
    import torch.nn.functional as F

    offsets = torch.cumsum(num_tokens_per_expert, dim=0, dtype=torch.int32)
    h = F.silu(torch._grouped_mm(x.bfloat16(), w1.bfloat16().transpose(-2, -1), offs=offsets))
    h = h * torch._grouped_mm(x.bfloat16(), w3.bfloat16().transpose(-2, -1), offs=offsets)
    return torch._grouped_mm(h, w2.bfloat16().transpose(-2, -1), offs=offsets).type_as(x)


def test_torchtitan_experts_compute_in_bf16():
    """torchtitan's grouped experts with fp32 weights and input save bf16 GEMM inputs (pairs × hidden, pairs ×
    width): the planner's torchtitan (and Megatron) record says experts_16bit."""
    torch = pytest.importorskip("torch")
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch._grouped_mm not in this torch")
    e, h, i, pairs = 4, 32, 16, 24
    w1, w3 = (torch.randn(e, i, h, requires_grad=True) for _ in range(2))
    w2 = torch.randn(e, h, i, requires_grad=True)
    x = torch.randn(pairs, h, requires_grad=True)
    counts = torch.tensor([8, 8, 0, 8])
    try:
        saved = _saved_dtypes(_torchtitan_run_experts_grouped_mm, w1, w2, w3, x, counts)
    except (RuntimeError, NotImplementedError) as exc:  # a torch whose CPU has no grouped_mm kernel
        pytest.skip(f"torch._grouped_mm on CPU: {exc}")
    inputs = [d for s, d in saved if s in ((pairs, h), (pairs, i))]
    assert inputs and all(d == torch.bfloat16 for d in inputs)
    assert FRAMEWORKS["torchtitan"].experts_16bit and FRAMEWORKS["megatron"].experts_16bit
    assert not any(FRAMEWORKS[f].experts_16bit for f in ("pytorch", "accelerate", "lightning", "deepspeed"))


def _expert_ops(experts_16bit: bool, precision: str = "amp-bf16"):
    spec = hf_config.spec_from_hf_config(TINY["qwen3_moe"], name="qwen3_moe")
    ctx = Ctx(2, 24, precision, "sdpa", "cuda", False, experts_16bit=experts_16bit)
    layer = next(b for b in model_program(spec, ctx).blocks if b.role == "layer")
    return spec, ctx, [op for op in layer.ops if op.kind == "expert_gemm"]


@pytest.mark.parametrize("precision,weights,framework", [("amp-bf16", "float32", "bfloat16"),
                                                          ("bf16", "bfloat16", "bfloat16"),
                                                          ("fp32", "float32", "float32")])
def test_expert_gemms_dtype_saved_bytes_and_kernels_follow_the_framework(precision, weights, framework):
    """transformers: the weights' dtype (fp32 under AMP); torchtitan/Megatron: the 16-bit compute dtype. The
    gate_up GEMM saves its (pairs, hidden) input cast in that dtype and its kernel runs in it."""
    from planner.memory.op_saved import op_saved
    from planner.perf.op_rules import expert_gemm_kernels

    for flag, want in ((False, weights), (True, framework)):
        spec, ctx, ops = _expert_ops(flag, precision)
        t = spec.transformers[0]
        assert [op.dtypes["compute"] for op in ops] == [want, want]
        (saved,) = op_saved(ops[0], ctx)
        assert (saved.numel, saved.dtype) == (ctx.n * t.experts_per_token * t.hidden_size, want)
        assert expert_gemm_kernels(ops[0], ctx)[-1].dtype == want


def test_resolve_sets_the_experts_rule_from_the_framework():
    from planner.pipeline.resolve import resolve

    spec = get_model("qwen3-30b-a3b")
    # accelerate's FSDP1 policy gathers bf16 units: transformers' grouped_mm computes in them; Lightning's
    # bf16-mixed gathers fp32 units (policy-fp32) and the plain loop keeps fp32 weights under autocast
    for fw, parallelism, want in (("pytorch", "fsdp", False), ("torchtitan", "fsdp", True),
                                  ("megatron", "ddp", True), ("accelerate", "fsdp", True),
                                  ("lightning", "fsdp", False), ("accelerate", "ddp", False),
                                  ("deepspeed", "zero2", True)):
        cfg = TrainConfig(batch_size=1, seq_len=512, precision="amp-bf16", parallelism=parallelism, framework=fw,
                          ep=8)
        assert resolve(spec, cfg, "ml.p5.48xlarge", None, None, {}, "cuda").ctx.experts_16bit is want


# --------------------------------------------------------------------------------- gpt-oss attention

runner = CliRunner()


def test_gpt_oss_has_no_sdpa_path_in_transformers():
    transformers = pytest.importorskip("transformers")
    cls = transformers.models.gpt_oss.modeling_gpt_oss.GptOssPreTrainedModel
    assert cls._supports_sdpa is False and cls._supports_flash_attn and cls._supports_flex_attn


def test_sdpa_on_gpt_oss_is_one_line_exit_2():
    from planner.cli.main import app

    res = runner.invoke(app, ["estimate", "--model", "gpt-oss-20b", "--instance", "ml.p5.48xlarge", "--ep", "8",
                              "--precision", "bf16", "--attention", "sdpa", "--seq-len", "512"])
    assert res.exit_code == 2, res.output
    assert "--attention" in res.output and "sinks" in res.output and len(res.output.strip().splitlines()) == 1


@pytest.mark.parametrize("framework,parallelism,want", [("pytorch", "fsdp", "eager"), ("torchtitan", "fsdp", "flash"),
                                                        ("megatron", "ddp", "flash")])
def test_gpt_oss_attention_auto_follows_the_framework(framework, parallelism, want):
    """transformers runs gpt-oss eager by default (stacks.json); torchtitan (FlexAttention with sinks) and Megatron
    (TE fused attention, softmax offset) run a fused kernel, which saves no s × s scores."""
    cfg = TrainConfig(batch_size=1, seq_len=2048, precision="bf16", parallelism=parallelism, framework=framework,
                      ep=8)
    e = estimate("gpt-oss-20b", cfg, "ml.p5.48xlarge")
    assert e.config.attention == want
    if want == "flash":
        eager = estimate("gpt-oss-20b", cfg.model_copy(update={"attention": "eager"}), "ml.p5.48xlarge")
        assert e.memory_bytes.activations < eager.memory_bytes.activations


# ------------------------------------------------------------------------ Transformer Engine's FP8 weights

_L8 = dict(batch_size=1, seq_len=2048, parallelism="ddp", tp=2, pp=2, grad_accum=8)


def _layer_weights_per_rank(tp: int) -> int:
    """Llama-3-8B's Linear weight elements per layer on one TP rank, from its config: q, o (h × h), k, v
    (h × kv·d), gate, up, down (h × i), each split over tp."""
    t = get_model("llama-3-8b").transformers[0]
    h, kv = t.hidden_size, t.num_kv_heads * t.head_dim
    return (2 * h * h + 2 * h * kv + 3 * h * t.intermediate_size) // tp


def test_megatron_keeps_one_cached_fp8_weight_per_linear_of_the_rank():
    """Megatron passes TE `is_first_microbatch`: the FP8 weight and its transpose are one workspace per Linear
    (2 B per weight element of the rank's shard, its stage's 16 layers), held for the run, and no layer saves an
    FP8 weight per micro-batch in flight."""
    bf16 = estimate("llama-3-8b", TrainConfig(precision="amp-bf16", framework="megatron", **_L8), "ml.p5.48xlarge")
    fp8 = estimate("llama-3-8b", TrainConfig(precision="fp8", fp8_recipe="current", framework="megatron", **_L8),
                   "ml.p5.48xlarge")
    layers = get_model("llama-3-8b").transformers[0].num_layers // 2
    assert fp8.memory_bytes.buffers - bf16.memory_bytes.buffers == layers * 2 * _layer_weights_per_rank(2)
    assert FRAMEWORKS["megatron"].te_weight_cache and not FRAMEWORKS["pytorch"].te_weight_cache


def test_fp8_weight_copies_without_the_cache_are_the_tp_ranks():
    """Without `is_first_microbatch` each forward saves its FP8 weight and transpose: 2 B per weight element of the
    rank's (tp-split) Linears per layer, and nothing is cached."""
    from planner.memory.activations import fp8_weight_workspace_bytes, weight_casts
    from planner.models.blocks import model_blocks

    spec = get_model("llama-3-8b")
    layer = next(b for b in model_blocks(spec) if b.role == "layer")
    for tp in (1, 2, 4):
        ctx = Ctx(1, 2048, "amp-bf16", "flash", "cuda", False, tp=tp, sp=tp > 1, fp8="current")
        assert sum(s.numel for s in weight_casts(layer, ctx)) == 2 * _layer_weights_per_rank(tp)
        assert fp8_weight_workspace_bytes(layer, ctx) == 0
        cached = Ctx(1, 2048, "amp-bf16", "flash", "cuda", False, tp=tp, sp=tp > 1, fp8="current",
                     fp8_weight_cache=True)
        assert weight_casts(layer, cached) == []
        assert fp8_weight_workspace_bytes(layer, cached) == 2 * _layer_weights_per_rank(tp)


def test_megatron_fp8_runs_the_experts_in_fp8_with_cached_weights():
    """Under a TE recipe, Megatron-Core's TEGroupedMLP (TE GroupedLinear in the same fp8_autocast) runs the routed
    experts' GEMMs in FP8 and saves their FP8 inputs (1 B per element); its cached FP8 weights are the rank's
    E / ep experts' 3 · h · i elements × 2 B per sparse layer beside the Linears'. transformers' grouped_mm (and
    torchao, which converts nn.Linear only) keep them 16-bit."""
    from planner.ir.transforms import for_context
    from planner.memory.activations import fp8_weight_workspace_bytes, linear_params
    from planner.memory.op_saved import op_saved
    from planner.models.blocks import model_blocks
    from planner.perf.op_rules import expert_gemm_kernels

    spec = hf_config.spec_from_hf_config(TINY["qwen3_moe"], name="qwen3_moe")
    t = spec.transformers[0]
    for megatron in (True, False):
        ctx = Ctx(2, 24, "amp-bf16", "flash", "cuda", False, ep=2, fp8="current", experts_16bit=megatron,
                  fp8_weight_cache=megatron)
        layer = next(b for b in model_program(spec, ctx).blocks if b.role == "layer")
        gemms = [op for op in for_context(layer.ops, ctx, "layer") if op.kind == "expert_gemm"]
        if not megatron:
            assert all("fp8" not in op.attrs for op in gemms)
            continue
        (saved,) = op_saved(gemms[0], ctx)
        assert (saved.numel, saved.dtype) == (ctx.n * t.experts_per_token * t.hidden_size, "float8_e4m3fn")
        assert expert_gemm_kernels(gemms[0], ctx)[-1].dtype == "float8_e4m3fn"
        block = next(b for b in model_blocks(spec) if b.role == "layer")
        linears = sum(w for w, _ in linear_params(block, ctx))
        experts = t.num_experts // 2 * 3 * t.moe_intermediate_size * t.hidden_size
        assert fp8_weight_workspace_bytes(block, ctx) == 2 * (linears + experts)
