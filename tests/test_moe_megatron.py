"""Megatron-Core's MoE layer as it saves tensors for backward (issue 35: the published Megatron runs called OOM).

`Framework.fused_moe` (planner/parallel/frameworks.py) carries Megatron-Core's fused MoE kernels. No
Megatron-Core or Transformer Engine runs on this CPU machine, so each rule is checked against the source lines
it transcribes, quoted here (NVIDIA/Megatron-LM @d98e8a64ddf34856e74b24714e3bedb2f5a39553; NVIDIA/
TransformerEngine as cited in the framework record), on a tiny Qwen3-MoE and gpt-oss program:

- router, TE FusedTopkScoreFunction.forward: `ctx.save_for_backward(routing_map, intermediate_output)`
  (E bools and E fp32 a token) besides the gating Linear's input;
- permutation, TE make_row_id_map: "row_id_map ... of shape [num_tokens, num_experts * 2 + 1]" (int32);
  MoEAlltoAllTokenDispatcher unpermutes with no probs: `unpermute(permutated_local_input_tokens,
  self.reversed_local_input_permutation_mapping, restore_shape=..., fused=self.config.moe_permute_fusion)`;
- activation, fused_bias_swiglu.py WeightedSwiGLUFunction: `ctx.save_for_backward(input_for_backward, weights)`;
- selective recompute (experts.py TEGroupedMLP.forward): `self.activation_checkpoint =
  tensor_parallel.CheckpointWithoutOutput()` ... `discard_output_and_register_recompute(output)`; moe_layer.py
  `outputs = tensor_parallel.checkpoint(custom_forward, False, hidden_states, ...)` for "moe".

The saved-tensor-hook check of the unfused ops (transformers' modules) is tests/test_moe.py's; the CUDA grouped
GEMM saving its input only is the derivative formula both paths share (tests/test_moe_frameworks.py).
"""

from __future__ import annotations

import pytest

from planner.families.forms import model_program
from planner.ir.context import Ctx
from planner.ir.transforms import recompute_selected
from planner.memory.op_saved import op_saved
from planner.models import hf_config
from planner.parallel.frameworks import FRAMEWORKS
from planner.spec import TrainConfig
from tests.test_moe import TINY

NBYTES = {"bfloat16": 2, "float32": 4, "int32": 4, "int64": 8, "bool": 1, "float8_e4m3fn": 1}


def _layer(model_type: str, fused: bool, precision: str = "bf16", ep: int = 1):
    spec = hf_config.spec_from_hf_config(TINY[model_type], name=model_type)
    ctx = Ctx(2, 24, precision, "flash", "cuda", False, True, experts_16bit=True,
              fused_moe=fused, fused_router=fused, ep=ep)
    program = model_program(spec, ctx)
    layer = next(b for b in program.blocks if b.role == "layer")
    return spec.transformers[0], ctx, program, layer


def _bytes(ops, ctx) -> int:
    """What a layer keeps after its forward: the saved tensors of every op not recomputed, and the checkpoints'."""
    return sum(t.numel * NBYTES[t.dtype] for op in ops if not op.attrs.get("checkpointed")
               for t in op_saved(op, ctx))


def test_only_megatron_runs_fused_moe_and_cites_its_source():
    """Megatron and NeMo AutoModel (whose DeepEP experts call Megatron's permutation and weighted SwiGLU) run the
    fused permutation and activation; only Megatron runs TE's fused router."""
    assert {n for n, f in FRAMEWORKS.items() if f.fused_moe} == {"megatron", "nemo-automodel"}
    assert {n for n, f in FRAMEWORKS.items() if f.fused_router} == {"megatron"}
    text = " ".join(FRAMEWORKS["megatron"].sources)
    for quote in ("save_for_backward(input_for_backward, weights)", "num_experts * 2 + 1",
                  "save_for_backward(routing_map, intermediate_output)"):
        assert quote in text


def test_resolve_carries_fused_moe_from_the_framework():
    from planner.models.catalog import get_model
    from planner.pipeline.resolve import resolve

    spec = get_model("qwen3-30b-a3b")
    for fw, parallelism in (("megatron", "ddp"), ("pytorch", "fsdp"), ("torchtitan", "fsdp"),
                            ("nemo-automodel", "fsdp")):
        cfg = TrainConfig(batch_size=1, seq_len=512, precision="bf16", parallelism=parallelism, framework=fw, ep=8)
        ctx = resolve(spec, cfg, "ml.p5.48xlarge", None, None, {}, "cuda").ctx
        assert ctx.fused_moe is (fw in ("megatron", "nemo-automodel"))
        assert ctx.fused_router is (fw == "megatron")


@pytest.mark.parametrize("model_type", ["qwen3_moe", "gpt_oss"])
def test_fused_ops_save_what_megatron_and_te_save(model_type):
    t, ctx, _, layer = _layer(model_type, True)
    n, e, k, h, i = ctx.n, t.num_experts, t.experts_per_token, t.hidden_size, t.moe_intermediate_size
    s = n * k
    ops = {op.name: op for op in layer.ops}
    router = next(op for op in layer.ops if op.kind == "router")
    got = [(x.numel, x.dtype) for x in op_saved(router, ctx)]
    assert got == [(n * h, "bfloat16"), (n * e, "bool"), (n * e, "float32")]
    assert [(x.numel, x.dtype) for x in op_saved(ops["mlp.experts.permute"], ctx)] == [(n * (2 * e + 1), "int32")]
    assert op_saved(ops["mlp.experts.unpermute"], ctx) == []
    assert [(x.numel, x.dtype) for x in op_saved(ops["mlp.experts.act"], ctx)] == [(2 * s * i, "bfloat16"),
                                                                                   (s, "float32")]
    if "mlp.experts.gate_mul_up" in ops:
        assert op_saved(ops["mlp.experts.gate_mul_up"], ctx) == []
    # the grouped GEMMs save their inputs as before (TE GroupedLinear: the input for the weight gradient)
    assert [(x.numel, x.dtype) for x in op_saved(ops["mlp.experts.gate_up"], ctx)] == [(s * h, "bfloat16")]
    assert [(x.numel, x.dtype) for x in op_saved(ops["mlp.experts.down"], ctx)] == [(s * i, "bfloat16")]


@pytest.mark.parametrize("model_type", ["qwen3_moe", "gpt_oss"])
def test_fused_layer_saves_less_than_transformers_ops_by_the_dropped_tensors(model_type):
    """The fused layer drops, per the quoted lines: the sort's and gather's int64 indices, the unpermute's
    S·h expert output, weights and inverse index, and the activation's own tensors beyond its input and probs."""
    t, ctx, _, fused = _layer(model_type, True)
    _, ctx0, _, eager = _layer(model_type, False)
    assert _bytes(fused.ops, ctx) < _bytes(eager.ops, ctx0)
    s, h = ctx.n * t.experts_per_token, t.hidden_size
    unperm = next(op for op in eager.ops if op.name == "mlp.experts.unpermute")
    assert sum(x.numel for x in op_saved(unperm, ctx0)) >= s * h


def test_ep_with_several_local_experts_keeps_the_chunk_sort_maps():
    t, ctx, _, layer = _layer("qwen3_moe", True, ep=2)
    perm = next(op for op in layer.ops if op.name == "mlp.experts.permute")
    s = ctx.n * t.experts_per_token
    assert [(x.numel, x.dtype) for x in op_saved(perm, ctx)][1:] == [(s, "int32"), (s, "int32")]


@pytest.mark.parametrize("fused", [True, False])
def test_moe_act_recompute_frees_the_activation_output_fc2_saved(fused):
    t, ctx, program, layer = _layer("qwen3_moe", fused)
    s, i = ctx.n * t.experts_per_token, t.moe_intermediate_size
    sel = next(b for b in recompute_selected(program, ["moe_act"]).blocks if b.name == layer.name)
    keep = next(op for op in sel.ops if op.kind == "checkpoint")
    assert [(x.numel, x.dtype) for x in op_saved(keep, ctx)] == (
        [(2 * s * i, "bfloat16")] + ([(s, "float32")] if fused else []))
    down = next(op for op in sel.ops if op.name == "mlp.experts.down")
    assert op_saved(down, ctx) == []
    if fused:  # the fused activation already saved exactly its input and probs: only fc2's input goes
        assert _bytes(layer.ops, ctx) - _bytes(sel.ops, ctx) == s * i * 2


def test_moe_recompute_keeps_only_the_blocks_input():
    t, ctx, program, layer = _layer("qwen3_moe", True)
    sel = next(b for b in recompute_selected(program, ["moe", "moe_act"]).blocks if b.name == layer.name)
    keeps = [op for op in sel.ops if op.kind == "checkpoint"]
    assert [op.attrs["region"] for op in keeps] == ["moe"]
    assert [(x.numel, x.dtype) for x in op_saved(keeps[0], ctx)] == [(ctx.n * t.hidden_size, "bfloat16")]
    assert all(op.attrs.get("recomputed") for op in sel.ops if op.attrs.get("moe_block"))
    moe_bytes = sum(x.numel * NBYTES[x.dtype] for op in layer.ops if op.attrs.get("moe_block")
                    for x in op_saved(op, ctx))
    assert _bytes(layer.ops, ctx) - _bytes(sel.ops, ctx) == moe_bytes - ctx.n * t.hidden_size * 2


def test_shared_experts_recompute_keeps_the_shared_experts_input():
    t, ctx, program, layer = _layer("qwen2_moe", True)
    sel = next(b for b in recompute_selected(program, ["shared_experts"]).blocks if b.name == layer.name)
    (keep,) = [op for op in sel.ops if op.kind == "checkpoint"]
    assert keep.attrs["region"] == "shared_experts"
    assert [(x.numel, x.dtype) for x in op_saved(keep, ctx)] == [(ctx.n * t.hidden_size, "bfloat16")]
    assert all(op.attrs.get("recomputed") for op in sel.ops if op.attrs.get("shared_experts"))
    assert not any(op.attrs.get("recomputed") for op in sel.ops if op.kind == "router")


def test_layernorm_recompute_discards_the_routers_copy_of_the_norm_output():
    """transformer_layer.py: 'layernorm' recomputes the pre-MLP norm too (`recompute_pre_mlp_layernorm`);
    the router's gating Linear saved that output, which CheckpointWithoutOutput frees."""
    t, ctx, program, layer = _layer("qwen3_moe", True)
    sel = next(b for b in recompute_selected(program, ["layernorm"]).blocks if b.name == layer.name)
    router = next(op for op in sel.ops if op.kind == "router")
    assert router.attrs.get("input_discarded")
    assert [(x.numel, x.dtype) for x in op_saved(router, ctx)] == [(ctx.n * t.num_experts, "bool"),
                                                                   (ctx.n * t.num_experts, "float32")]


def test_te_rmsnorm_saves_its_input_and_rstd_only():
    """TE ops/basic/rmsnorm.py RMSNorm.op_forward: `ctx.save_for_backward(x, rstdevs)`: the 16-bit input and one
    fp32 rstd a row, where transformers' RMSNorm saves an fp32 copy of the input, the rstd and the normalised
    tensor (Qwen3's per-head q/k norms included)."""
    from planner.ir.context import Ctx as C

    spec = hf_config.spec_from_hf_config(TINY["qwen3_moe"], name="qwen3_moe")
    base = dict(experts_16bit=True, fused_moe=True)
    for fused, want in ((True, lambda r, w: [(r * w, "bfloat16"), (r, "float32")]),
                        (False, lambda r, w: [(r * w, "float32"), (r, "float32"), (r * w, "bfloat16")])):
        ctx = C(2, 24, "bf16", "flash", "cuda", False, True, fused_norms=fused, **base)
        layer = next(b for b in model_program(spec, ctx).blocks if b.role == "layer")
        norms = [op for op in layer.ops if op.kind == "rms_norm"]
        assert {op.name for op in norms} >= {"input_layernorm", "self_attn.q_norm", "post_attention_layernorm"}
        for op in norms:
            rows, width = op.shapes["input"]
            assert [(x.numel, x.dtype) for x in op_saved(op, ctx)] == want(rows, width), op.name
    # the frameworks that run TE's RMSNorm: Megatron-Core's TE layer spec, NeMo AutoModel's `rms_norm: te`
    assert {n for n, f in FRAMEWORKS.items() if f.fused_norms} == {"megatron", "nemo-automodel"}


def test_torchtitan_grouped_experts_save_what_the_planners_expert_ops_save():
    """torchtitan's `_run_experts_grouped_mm` (quoted in tests/test_moe_frameworks.py) under saved-tensor hooks, in
    bf16: its separate w1 / w3 GEMMs save the same bytes as transformers' fused gate_up op list the planner uses for
    `--framework torchtitan` (fused_moe False): x (S·h), and four S·i tensors (w1's output, silu's output, w3's
    output, the product) against gate_up's 2·S·i output, act(gate) and the product. The hooks see autograd's
    saved tensors, which do not depend on the kernel: on CPU `torch._grouped_mm` may run per expert, on CUDA as
    one grouped GEMM; both save their inputs (and int32 offsets, counted at the permutation)."""
    torch = pytest.importorskip("torch")
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch._grouped_mm not in this torch")
    from tests.test_moe_frameworks import _torchtitan_run_experts_grouped_mm

    spec = hf_config.spec_from_hf_config(TINY["qwen3_moe"], name="qwen3_moe")
    t = spec.transformers[0]
    ctx = Ctx(1, 8, "bf16", "flash", "cuda", False, True, experts_16bit=True)
    layer = next(b for b in model_program(spec, ctx).blocks if b.role == "layer")
    ops = [op for op in layer.ops if op.name in ("mlp.experts.gate_up", "mlp.experts.act",
                                                 "mlp.experts.gate_mul_up", "mlp.experts.down")]
    ours = sum(x.numel * NBYTES[x.dtype] for op in ops for x in op_saved(op, ctx))
    e, h, i = t.num_experts, t.hidden_size, t.moe_intermediate_size
    pairs = ctx.n * t.experts_per_token
    w1, w3 = (torch.randn(e, i, h, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    w2 = torch.randn(e, h, i, dtype=torch.bfloat16, requires_grad=True)
    x = torch.randn(pairs, h, dtype=torch.bfloat16, requires_grad=True)
    counts = torch.full((e,), pairs // e, dtype=torch.int64)
    counts[0] += pairs - int(counts.sum())
    params = {w.untyped_storage().data_ptr() for w in (w1, w2, w3)}
    seen: dict[int, int] = {}

    def pack(tensor):
        s = tensor.untyped_storage()
        if s.data_ptr() not in params and tensor.dtype != torch.int32:  # offsets: the permutation's
            seen[s.data_ptr()] = s.nbytes()
        return tensor

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda z: z):
            _torchtitan_run_experts_grouped_mm(w1, w2, w3, x, counts).float().sum().backward()
    except (RuntimeError, NotImplementedError) as exc:  # a torch whose CPU has no grouped_mm kernel
        pytest.skip(f"torch._grouped_mm on CPU: {exc}")
    assert sum(seen.values()) == ours == (pairs * h + 4 * pairs * i) * 2


def test_moe_recompute_counts_the_blocks_matmuls_again():
    """"moe" re-runs the router, the routed experts (top-k of E per token) and a shared expert; "moe_act" no
    matmul; a dense model nothing."""
    from planner.models.catalog import get_model
    from planner.perf.flops import matmul_flops, step_flops

    m = get_model("qwen3-30b-a3b")
    t = m.transformers[0]

    def recompute(mods):
        return step_flops(m, TrainConfig(batch_size=1, seq_len=512, recompute="selective",
                                         recompute_modules=mods)).recompute

    base = recompute(("moe_act",))
    tokens = 512
    per_layer = matmul_flops(tokens, t.num_experts, t.hidden_size) + 3 * matmul_flops(
        tokens * t.experts_per_token, t.moe_intermediate_size, t.hidden_size)
    assert recompute(("moe_act", "moe")) - base == t.num_layers * per_layer
    assert recompute(("moe_act", "shared_experts")) == base  # Qwen3-MoE has no shared expert
    dense = get_model("llama-3-8b")
    assert step_flops(dense, TrainConfig(batch_size=1, seq_len=512, recompute="selective",
                                         recompute_modules=("moe",))).recompute == step_flops(
        dense, TrainConfig(batch_size=1, seq_len=512, recompute="selective", recompute_modules=("moe_act",))).recompute


@pytest.mark.parametrize("model,modules", [("qwen3-30b-a3b", ("moe_act", "layernorm")), ("gpt-oss-20b", ("moe",))])
def test_program_report_and_memory_model_agree_under_megatron_moe_recompute(model, modules):
    """One GPU: `program.blocks[]` saved bytes sum to `memory_bytes.activations` (ARCHITECTURE.md's invariant)
    with the fused MoE ops and a MoE recompute module."""
    import planner
    from planner.estimate import program

    cfg = TrainConfig(batch_size=1, seq_len=1024, precision="bf16", framework="megatron", parallelism="single",
                      recompute="selective", recompute_modules=modules, attention="flash")
    est = planner.estimate(model, cfg, "ml.p5.48xlarge")
    saved = sum(o["saved_bytes"] for b in program(model, est)["blocks"] for o in b["ops"])
    assert saved == est.memory_bytes.activations


class _TeCrossEntropy:
    """Transformer Engine's fused cross-entropy as its source writes it (transformer_engine/pytorch/
    cross_entropy.py CrossEntropyFunction and triton/cross_entropy.py @02965d2e), with torch ops for the Triton
    kernels: the forward fills `m_d_X_y` (n_rows * 3 fp32: row max, sum of exponentials, target logit) and
    saves the logits as they are with it; the backward writes the gradient into the logits in place
    (`tl.store(X_ptr + X_offsets, grad_input.to(input_dtype))`)."""

    @staticmethod
    def build():
        import torch

        class Fn(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x, target):
                b, s, v = x.shape
                rows = x.detach().reshape(b * s, v).float()
                m = rows.max(-1).values
                d = torch.exp(rows - m[:, None]).sum(-1)
                x_y = rows.gather(1, target.reshape(-1, 1)).squeeze(1)
                m_d_x_y = torch.stack((m, d, x_y)).reshape(-1)  # n_rows * 3 fp32, as the kernel's buffer
                ctx.save_for_backward(x.detach(), target, m_d_x_y)
                return (-(x_y - m - torch.log(d))).mean()

            @staticmethod
            def backward(ctx, grad):
                x, target, m_d_x_y = ctx.saved_tensors
                b, s, v = x.shape
                m, d, _ = m_d_x_y.reshape(3, -1)
                rows = x.view(b * s, v)
                p = torch.exp(rows.float() - m[:, None]) / d[:, None]
                p[torch.arange(b * s), target.reshape(-1)] -= 1
                rows.copy_((p * grad / (b * s)).to(x.dtype))  # in place, as the Triton kernel stores it
                return x, None

        return Fn


def test_te_fused_cross_entropy_saves_only_its_row_statistics_beyond_the_logits():
    """Megatron (Megatron-Bridge's `cross_entropy_fusion_impl = "te"`): the loss keeps the logits the model
    returned (no new storage) and 3 fp32 a row; its gradient is the logits' own storage. The planner's loss
    under Megatron's context saves those 3n fp32 only, where transformers' loss saves an fp32 n·V log-softmax."""
    torch = pytest.importorskip("torch")
    from torch.multiprocessing.reductions import StorageWeakRef

    from planner.memory.activations import loss_saved

    spec = hf_config.spec_from_hf_config(TINY["qwen3_moe"], name="qwen3_moe")
    t = spec.transformers[-1]
    ctx = Ctx(2, 24, "bf16", "flash", "cuda", False, True, fused_loss=True)
    logits = torch.randn(ctx.b, ctx.chunk, t.vocab_size, dtype=torch.bfloat16, requires_grad=True)
    target = torch.randint(0, t.vocab_size, (ctx.b, ctx.chunk))
    model_output = logits * 1.0  # the logits the model returns (a non-leaf, as the LM head's output)
    saved: dict[int, int] = {}

    def pack(x):
        saved[StorageWeakRef(x.untyped_storage()).cdata] = x.untyped_storage().nbytes()
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        loss = _TeCrossEntropy.build().apply(model_output, target)
    new = {k: n for k, n in saved.items() if k != StorageWeakRef(model_output.untyped_storage()).cdata}
    got = sum(new.values()) - target.untyped_storage().nbytes()  # the labels are the batch's own tensor
    assert got == sum(x.numel * NBYTES[x.dtype] for x in loss_saved(t, ctx)) == 3 * ctx.n * 4
    loss.backward()
    assert logits.grad is not None
    eager = loss_saved(t, Ctx(2, 24, "bf16", "flash", "cuda", False, True))
    assert max(x.numel for x in eager) == ctx.n * t.vocab_size


def test_only_megatron_runs_te_fused_cross_entropy_and_cites_it():
    assert {n for n, f in FRAMEWORKS.items() if f.fused_loss} == {"megatron"}
    text = " ".join(FRAMEWORKS["megatron"].sources)
    for quote in ("cross_entropy_fusion_impl = \\\"te\\\"", "ctx.save_for_backward(_input.detach())",
                  "n_rows * 3"):
        assert quote.replace("\\", "") in text.replace("\\", "")


@pytest.mark.parametrize("model_type", ["qwen3_moe", "llama"])
def test_megatron_fp8_saves_one_fp8_copy_for_linear_qkv_and_linear_fc1(model_type):
    """Megatron-Core's TE layer spec (gpt_layer_specs.py get_gpt_layer_with_transformer_engine_spec @d98e8a64:
    `linear_qkv=TELayerNormColumnParallelLinear`, the dense MLP's `linear_fc1` the same) runs q, k, v as one
    GEMM and gate, up as one: TE's LayerNormLinear quantizes its normalised input once and saves that FP8 copy
    (`ln_out`) for the weight gradient. transformers' q/k/v and gate/up are separate Linears, each casting and
    saving its own FP8 copy under Transformer Engine or torchao."""
    from planner.memory.activations import layer_saved

    if model_type == "llama":
        from planner.models.catalog import get_model

        t = get_model("llama-3-8b").transformers[0]
    else:
        t = hf_config.spec_from_hf_config(TINY[model_type], name=model_type).transformers[0]
    counts = {}
    for fused in (False, True):
        ctx = Ctx(2, 24, "bf16", "flash", "cuda", False, True, experts_16bit=True, fused_moe=True,
                  fused_router=True, fused_norms=True, fp8="current", fp8_weight_cache=True, fused_linears=fused)
        saved = layer_saved(t, ctx, 0)
        counts[fused] = {p: [x for x in saved if x.name.startswith(p) and ".fp8" in x.name]
                         for p in ("self_attn.input", "mlp.input")}
    n, h = 2 * 24, t.hidden_size
    assert [(x.numel, x.dtype) for x in counts[True]["self_attn.input"]] == [(n * h, "float8_e4m3fn")]
    assert len(counts[False]["self_attn.input"]) == 3
    if model_type == "llama":  # a dense gated MLP: gate and up read one input
        assert [(x.numel, x.dtype) for x in counts[True]["mlp.input"]] == [(n * h, "float8_e4m3fn")]
        assert len(counts[False]["mlp.input"]) == 2
