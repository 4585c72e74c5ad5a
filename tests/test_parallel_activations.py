"""Activations per rank under tensor / sequence / context parallelism, and selective recomputation (issue 34).

Checked against real PyTorch where one process can show it: a tensor-parallel rank of a Llama layer is, for
its activations, the layer with heads / tp, key/value heads / tp and ffn / tp (what Megatron-Core's
ColumnParallelLinear / RowParallelLinear leave on one rank; the all-reduce of the row-parallel output keeps its
shape), so the module is built by hand with those sizes and its saved storages counted with saved-tensor hooks,
against the planner's per-rank layer. Selective recomputation is checked against torch.utils.checkpoint applied
to the core-attention function and to the MLP. Sequence parallelism's Megatron rule (the column-parallel
linears save the local n/tp shard and gather it again in backward) has no single-process module: it is checked
against Korthikanti et al. 2022's Table 2 formulas, which count exactly that, on a GPT-3-style layer.
"""

from __future__ import annotations

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.checkpoint import checkpoint

from planner.ir.context import rank_context
from planner.ir.transforms import recompute_of, selective_layer
from planner.memory.activations import activation_blocks
from planner.spec import TrainConfig
from tests.saved_tensors import model

B, S, H, HEADS, KV, FFN = 2, 16, 64, 8, 4, 176


def _key(t: torch.Tensor) -> int:
    return StorageWeakRef(t.untyped_storage()).cdata


def _rank_layer(tp: int, attention: str):
    """The Llama decoder layer one tensor-parallel rank runs (heads, kv heads and ffn over tp; head_dim kept)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    cfg = LlamaConfig(hidden_size=H, num_attention_heads=HEADS // tp, num_key_value_heads=max(1, KV // tp),
                      head_dim=H // HEADS, intermediate_size=FFN // tp, num_hidden_layers=2, vocab_size=100)
    cfg._attn_implementation = attention
    torch.manual_seed(0)
    layer = LlamaDecoderLayer(cfg, layer_idx=1).train()
    rope = LlamaRotaryEmbedding(cfg)
    return layer, rope


def _measure(layer, rope, masked: bool) -> int:
    """Bytes of the storages the layer's forward saves (parameters and the inputs it is given, cos/sin and
    the mask, excluded; the hidden state counts: in a model it is the previous layer's new output)."""
    x = torch.randn(B, S, H, requires_grad=True)
    pos = torch.arange(S).unsqueeze(0)
    cos, sin = rope(x, pos)
    mask = None
    if masked:
        mask = torch.full((S, S), float("-inf")).triu(1)[None, None].expand(B, 1, S, S).contiguous()
    excluded = {_key(p) for p in layer.parameters()} | {_key(cos), _key(sin)} | ({_key(mask)} if masked else set())
    seen: set[int] = set()
    total = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        k = _key(t)
        if k not in excluded and k not in seen:
            seen.add(k)
            total[0] += t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = layer(x, attention_mask=mask, position_embeddings=(cos, sin))
    (out[0] if isinstance(out, tuple) else out).sum().backward()  # the saved graph is complete
    return total[0]


def _planner_layer(tp: int, attention: str, padded: bool, **cfg) -> int:
    spec = model("llama", "causal-lm", hidden=H, heads=HEADS, kv_heads=KV, intermediate=FFN, layers=2)
    config = TrainConfig(batch_size=B, seq_len=S, precision="fp32", attention=attention, tp=tp, sp=False, **cfg)
    blocks = activation_blocks(spec, config, "cpu", padded=padded)
    layer = next(b for b in blocks if b.block.endswith("layer.1"))
    return layer.kept_bytes


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_tensor_parallel_rank_saves_what_the_rank_module_saves(tp, attention):
    """Column-parallel q/k/v and gate/up (heads, kv heads, ffn over tp), row-parallel o_proj and down (their
    outputs whole), norms and adds on the full sequence: the planner's rank equals the rank's module."""
    layer, rope = _rank_layer(tp, attention)
    masked = attention == "eager"  # HF always builds the 4-D mask for a decoder's eager path
    assert _planner_layer(tp, attention, masked) == _measure(layer, rope, masked)


def _checkpointed_attention(name: str, inner: str) -> None:
    """Register an attention function that runs `inner` under torch.utils.checkpoint (non-reentrant), i.e.
    Megatron's selective recomputation of core attention."""
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.models.llama.modeling_llama import eager_attention_forward

    fn = eager_attention_forward if inner == "eager" else ALL_ATTENTION_FUNCTIONS[inner]

    def run(module, q, k, v, mask, **kw):
        return checkpoint(lambda q_, k_, v_: fn(module, q_, k_, v_, mask, **kw), q, k, v, use_reentrant=False)

    AttentionInterface.register(name, run)


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_selective_core_attention_equals_torch_checkpoint(tp, attention):
    _checkpointed_attention(f"ckpt_{attention}", attention)
    layer, rope = _rank_layer(tp, f"ckpt_{attention}")
    masked = attention == "eager"
    planned = _planner_layer(tp, attention, masked, recompute="selective", recompute_modules=("core_attn",))
    assert planned == _measure(layer, rope, masked)
    assert planned < _planner_layer(tp, attention, masked)


@pytest.mark.parametrize("tp", [1, 2])
def test_selective_mlp_equals_torch_checkpoint(tp):
    layer, rope = _rank_layer(tp, "sdpa")
    mlp = layer.mlp.forward
    layer.mlp.forward = lambda x: checkpoint(mlp, x, use_reentrant=False)
    planned = _planner_layer(tp, "sdpa", False, recompute="selective", recompute_modules=("mlp",))
    assert planned == _measure(layer, rope, False)


# ------------------------------------------------------------------ Korthikanti et al. 2022, Table 2


def _gpt3_layer_bytes(t: int, sp: bool, selective: bool, *, s=64, b=2, h=128, a=8) -> tuple[int, int]:
    """(planner's per-layer bytes, sum of the raw storages) of a GPT-3-style layer (GPT-2's form with GeLU,
    dropout 0.1, 16-bit, eager attention, CUDA)."""
    spec = model("gpt2", "causal-lm", hidden=h, heads=a, layers=2, activation_function="gelu",
                 resid_pdrop=0.1, attn_pdrop=0.1, embd_pdrop=0.1)
    cfg = TrainConfig(batch_size=b, seq_len=s, precision="fp16", attention="eager", tp=t, sp=sp,
                      recompute="selective" if selective else None,
                      recompute_modules=("core_attn",) if selective else ())
    layer = activation_blocks(spec, cfg, "cuda", padded=False)[2]
    return layer.kept_bytes, sum(x.nbytes for x in layer.kept_tensors)


@pytest.mark.parametrize("t", [1, 2, 4])
@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("selective", [False, True])
def test_gpt3_layer_matches_korthikanti_table2(t, sp, selective):
    """Table 2 (arXiv 2205.05198): sbh(10 + 24/t + 5as/(ht)) with TP, sbh(34/t + 5as/(ht)) with TP + SP, the
    5as/(ht) term gone under selective recomputation of core attention. The one difference, stated: the two
    LayerNorms' fp32 mean and rstd (2 · 2 · 4 bytes per row), which the paper leaves out."""
    from planner.probes.korthikanti import load_formulas

    s, b, h, a = 64, 2, 128, 8
    if sp and t == 1:
        pytest.skip("sequence parallelism needs tp > 1")
    technique = ("tp+sp" if sp else "tp" if t > 1 else "none") if not selective else \
        ("tp+sp+selective" if sp else "tp+selective")
    paper = load_formulas()[technique].bytes(s, b, h, a, t)
    rows = s * b // t if sp else s * b
    stats = 2 * 2 * 4 * rows
    _, raw = _gpt3_layer_bytes(t, sp, selective, s=s, b=b, h=h, a=a)
    assert raw == paper + stats


def test_context_parallel_rank_holds_its_chunk():
    """Context parallelism with a fused kernel (TransformerEngine's p2p ring): a rank saves exactly what a
    sequence of s / cp saves (its own q, k, v, output and rows), while its attention FLOPs span all s keys."""
    from planner.families.forms import model_program
    from planner.ir.interpret import apply, load_rules

    load_rules()
    spec = model("llama", "causal-lm", hidden=H, heads=HEADS, kv_heads=KV, intermediate=FFN, layers=2)
    cp = activation_blocks(spec, TrainConfig(batch_size=B, seq_len=4 * S, precision="bf16", attention="flash",
                                             cp=4), "cuda", padded=False)
    short = activation_blocks(spec, TrainConfig(batch_size=B, seq_len=S, precision="bf16", attention="flash"),
                              "cuda", padded=False)
    assert [x.saved_bytes for x in cp[1:-1]] == [x.saved_bytes for x in short[1:-1]]
    ctx = rank_context(B, 4 * S, "bf16", "flash", "cuda", False, cp=4)
    one = rank_context(B, S, "bf16", "flash", "cuda", False)
    att = [op for op in model_program(spec, ctx).blocks[1].ops if op.kind == "attention_flash"][0]
    att1 = [op for op in model_program(spec, one).blocks[1].ops if op.kind == "attention_flash"][0]
    assert apply("flops", att, ctx) == 4 * apply("flops", att1, one)
    assert any(op.kind == "send_recv" for op in model_program(spec, ctx).blocks[1].ops)


def test_tensor_parallel_collectives_are_ops():
    """A TP rank's layer carries its collectives for the speed model: with SP an all-gather before each
    column-parallel pair and a reduce-scatter after each row-parallel linear; without SP two all-reduces
    (forward) and two backward all-reduces of the column-parallel inputs' gradients."""
    from planner.families.forms import model_program

    spec = model("llama", "causal-lm", hidden=H, heads=HEADS, kv_heads=KV, intermediate=FFN, layers=2)
    sp = [op.kind for op in model_program(spec, rank_context(B, S, "bf16", "sdpa", "cuda", False, tp=2)).blocks[1].ops
          if op.attrs.get("group") == "tp"]
    assert sp == ["all_gather", "reduce_scatter", "all_gather", "reduce_scatter"]
    no_sp = model_program(spec, rank_context(B, S, "bf16", "sdpa", "cuda", False, tp=2, sp=False)).blocks[1].ops
    assert [(op.kind, op.attrs["phase"]) for op in no_sp if op.attrs.get("group") == "tp"] == [
        ("all_reduce", "backward"), ("all_reduce", "forward"), ("all_reduce", "backward"), ("all_reduce", "forward")]


def test_vocabulary_parallel_loss_and_head():
    """The LM head's logits and Megatron's vocabulary-parallel cross-entropy hold V / tp columns per rank
    (cross_entropy.py saves the local softmax, the target mask and the masked targets)."""
    spec = model("llama", "causal-lm", hidden=H, heads=HEADS, kv_heads=KV, intermediate=FFN, layers=2, vocab=1000)
    one = activation_blocks(spec, TrainConfig(batch_size=B, seq_len=S, precision="bf16"), "cpu", padded=False)
    four = activation_blocks(spec, TrainConfig(batch_size=B, seq_len=S, precision="bf16", tp=4, sp=False), "cpu",
                             padded=False)
    names = {t.name: t for t in four[-1].tensors}
    assert names["loss.softmax"].numel * 4 == next(t for t in one[-1].tensors if t.name == "loss.log_softmax").numel
    assert {"loss.target_mask", "loss.masked_target"} <= set(names)


def test_recompute_modes():
    assert recompute_of(TrainConfig(batch_size=1, seq_len=8)) == ("none", ())
    assert recompute_of(TrainConfig(batch_size=1, seq_len=8, checkpointing=True)) == ("full", ())
    assert recompute_of(TrainConfig(batch_size=1, seq_len=8, recompute="selective")) == ("selective", ("core_attn",))
    from planner.pipeline.resolve import resolve_recompute

    assert resolve_recompute(TrainConfig(batch_size=1, seq_len=8, recompute="full")).checkpointing
    assert recompute_of(resolve_recompute(TrainConfig(batch_size=1, seq_len=8, recompute="full"))) == ("full", ())


def test_selective_layernorm_discards_the_norm_output():
    """Megatron's output-discarding "layernorm" recompute: each pre-norm keeps its input only; the Linears
    reading its output no longer keep it."""
    from planner.families.forms import model_program

    spec = model("llama", "causal-lm", hidden=H, heads=HEADS, kv_heads=KV, intermediate=FFN, layers=2)
    ops = selective_layer(model_program(spec, rank_context(B, S, "bf16", "sdpa", "cuda", False)).blocks[2].ops,
                          ("layernorm",))
    assert [op.name for op in ops if op.attrs.get("recomputed")] == ["input_layernorm", "post_attention_layernorm"]
    assert sum(bool(op.attrs.get("input_discarded")) for op in ops) == 5  # q, k, v; gate, up


def test_selective_recompute_is_timed():
    """Recomputed ops run again in backward: kernels of phase "recompute", and FLOPs counted."""
    from planner.perf.flops import step_flops
    from planner.perf.kernels import training_kernels

    spec = model("llama", "causal-lm", hidden=H, heads=HEADS, kv_heads=KV, intermediate=FFN, layers=2)
    base = TrainConfig(batch_size=B, seq_len=S, precision="bf16", attention="sdpa")
    sel = base.model_copy(update={"recompute": "selective", "recompute_modules": ("core_attn", "mlp")})
    again = [k for k in training_kernels(spec, sel) if k.phase == "recompute"]
    assert not [k for k in training_kernels(spec, base) if k.phase == "recompute"]
    assert any("attention" in k.name for k in again) and any("mlp" in k.name for k in again)
    assert step_flops(spec, sel).recompute > step_flops(spec, base).recompute


@pytest.mark.parametrize("kw", [dict(recompute="selective", recompute_modules=("attention",)),
                                dict(recompute="full", recompute_modules=("core_attn",))])
def test_recompute_modules_bad_input(kw):
    from planner.errors import PlannerError
    from planner.pipeline.resolve import resolve_recompute

    with pytest.raises(PlannerError, match="--recompute-modules"):
        resolve_recompute(TrainConfig(batch_size=1, seq_len=8, **kw))


def test_torchtitan_op_policy():
    """torchtitan's per-op selective checkpointing (`_save_list`: aten.mm, except every second one, and the
    fused SDPA kernels): a Llama layer keeps its input, q_proj, v_proj, gate_proj and down_proj outputs and
    the attention output and logsumexp; k_proj, o_proj and up_proj run again, attention does not."""
    from planner.families.forms import model_program
    from planner.perf.flops import attention_score_flops, step_flops
    from planner.perf.kernels import training_kernels

    spec = model("llama", "causal-lm", hidden=H, heads=HEADS, kv_heads=KV, intermediate=FFN, layers=2)
    ctx = rank_context(B, S, "bf16", "flash", "cuda", False)
    ops = selective_layer(model_program(spec, ctx).blocks[2].ops, ("op",))
    kept = [o.name for o in ops[0].attrs["ops"]]
    assert kept == ["self_attn.q_proj", "self_attn.v_proj", "attention", "mlp.gate_proj", "mlp.down_proj"]
    again = {o.name for o in ops if o.attrs.get("recomputed") and o.kind == "linear"}
    assert again == {"self_attn.k_proj", "self_attn.o_proj", "mlp.up_proj"}
    cfg = TrainConfig(batch_size=B, seq_len=S, precision="bf16", attention="flash", recompute="selective",
                      recompute_modules=("op",))
    layer = activation_blocks(spec, cfg, "cuda", padded=False)[2]
    n = B * S
    expect = (n * H * 2 + n * H * 2 + n * (H // 2) * 2 + n * H * 2 + B * HEADS * S * 4 + n * FFN * 2 + n * H * 2)
    assert sum(t.nbytes for t in layer.kept_tensors) == expect
    gemms = [k for k in training_kernels(spec, cfg) if k.phase == "recompute" and k.kind in ("gemm", "attention")]
    assert {k.name.split(".recompute")[0].removeprefix("layer.") for k in gemms} == again
    fused_qk = attention_score_flops(spec.transformers[0], B, S) // 2  # flash backward's Q·Kᵀ, counted as before
    assert step_flops(spec, cfg).recompute == 2 * (2 * n * (H * (H // 2) + H * H + H * FFN) + fused_qk)


def test_torchtitan_saves_the_gathered_input_under_sp():
    """torchtitan's plan (PrepareModuleInput Shard(1) -> Replicate, then ColwiseParallel) makes the q/k/v mm save
    the all-gathered n rows; Megatron's linear saves its n/tp shard (the framework record decides)."""
    from planner.pipeline.resolve import resolve

    spec = model("llama", "causal-lm", hidden=H, heads=HEADS, kv_heads=KV, intermediate=FFN, layers=2)
    sizes = {}
    for fw in ("megatron", "torchtitan"):
        cfg = TrainConfig(batch_size=B, seq_len=S, precision="bf16", attention="sdpa", tp=4, framework=fw,
                          parallelism="ddp")
        ctx = resolve(spec, cfg, "ml.p5.48xlarge", None, None, {}).ctx  # the record an estimate reads
        assert (ctx.tp, ctx.sp) == (4, True)
        layer = activation_blocks(spec, cfg, ctx=ctx)[2]
        sizes[fw] = next(t.numel for t in layer.tensors if t.name == "self_attn.input")
    assert sizes == {"megatron": B * S * H // 4, "torchtitan": B * S * H}


def test_torchtitan_op_policy_against_torch_selective_checkpoint():
    """The same policy run by torch.utils.checkpoint's selective checkpointing on the rank's Llama layer (CPU:
    SDPA's CPU flash op stands for the CUDA flash op of torchtitan's list): the outputs of the ops the policy
    keeps (their sizes read from the real calls' arguments: mm (m, k)·(k, n) -> m·n; SDPA -> q's size and an
    fp32 logsumexp per query row and head) plus the checkpoint's saved input equal the planner's kept bytes."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    aten = torch.ops.aten
    kept: list[int] = []
    mm = [0]

    def policy(ctx, func, *args, **kwargs):
        keep = False
        if func == aten.mm.default:
            mm[0] += 1
            keep = mm[0] % 2 == 1
            size = args[0].shape[0] * args[1].shape[1] * args[0].element_size()
        elif func == aten._scaled_dot_product_flash_attention_for_cpu.default:
            q = args[0]
            keep, size = True, q.numel() * q.element_size() + q.shape[0] * q.shape[1] * q.shape[2] * 4
        if keep and not ctx.is_recompute:
            kept.append(size)
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    layer, rope = _rank_layer(2, "sdpa")
    forward = layer.forward

    def run(*a, **k):
        mm[0] = 0
        return checkpoint(forward, *a, use_reentrant=False,
                          context_fn=lambda: create_selective_checkpoint_contexts(policy), **k)

    layer.forward = run
    inputs = _measure(layer, rope, False)  # the checkpoint's saved input (the region's own saves are hidden)
    planned = _planner_layer(2, "sdpa", False, recompute="selective", recompute_modules=("op",))
    assert len(kept) == 5  # q_proj, v_proj, attention, gate_proj, down_proj
    assert planned == inputs + sum(kept)
