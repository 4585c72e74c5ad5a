"""The saved-memory interpreter of a program: per op kind, the storages the op saves for backward
(`Saved` records, planner.memory.activations), given the op and the context record.

Each rule is the formula planner.memory.activations already had for that piece of a layer (linear inputs and
their autocast casts, LayerNorm / RMSNorm, the activation functions, dropout, each attention kernel, the
embeddings' index tensors, the heads, the loss), now keyed by op kind (planner.ir.interpret), so that a layer
form's op list decides what a block saves. `tests/test_program.py` checks that a program's saved storages
equal `activations.block_saved` for every catalog model and many shapes, precisions, kernels and both
backends, and that every op kind has a rule.
"""

from __future__ import annotations

import math

from planner.ir import fp8
from planner.ir.context import F32, I64, Ctx
from planner.ir.interpret import register
from planner.ir.ops import Op, weight_matmul
from planner.memory import activations as act
from planner.memory.activations import Saved


@register("saved", "linear")
def linear_saved(op: Op, ctx: Ctx) -> list[Saved]:
    """A Linear saves its input (one storage shared by the Linears reading it; under autocast each its own
    16-bit cast: `activations.linear_inputs`). The multimodal model's dense blocks keep their own rule
    (`activations.dense_block_saved`: what precedes them decides). `saves_input` False (another op saves that
    16-bit tensor: the attention output the projection reads) still saves its own FP8 copy under Transformer
    Engine, which quantizes the input inside the module and saves the quantized copy (linear.py _Linear.forward)."""
    a = op.attrs
    if "block" in a:
        return act.dense_block_saved(a["block"], a["model"], ctx)
    te_fp8 = bool(a.get("fp8")) and fp8.input_saved(a["fp8"]) is not None
    if (not a["saves_input"] and not te_fp8) or a.get("frozen"):
        return []  # a frozen weight needs no input for its gradient (LoRA: planner.ir.transforms.lora_layers)
    if a.get("input_discarded") and not (ctx.amp and op.dtypes["input"] != ctx.low):
        return []  # the norm output it saved is freed and rebuilt in backward (selective "layernorm")
    numel = a.get("saved_numel") or math.prod(op.shapes["input"])
    if a.get("tp") == "column" and ctx.sp and not ctx.sp_saves_gathered:
        numel //= ctx.tp  # Megatron saves the local sequence shard and all-gathers it again in backward
    saved_fp8 = fp8.input_saved(a["fp8"]) if a.get("fp8") else None
    if saved_fp8 is not None:  # Transformer Engine: each Linear saves its own FP8 copy of its input
        # Megatron-Core's TE layer spec runs q/k/v as one linear_qkv and gate/up as one linear_fc1
        # (ctx.fused_linears): one FP8 copy of their shared input, kept by the first of them
        fused = ctx.fused_linears and a["consumers"] > 1 and (a.get("attention_input") or a.get("fc1"))
        if fused and a["consumer"] > 0:
            return []
        name = f"{a['input']}.fp8{a['consumer']}" if a["consumers"] > 1 and not fused else f"{a['input']}.fp8"
        out = [Saved(name, numel, fp8.F8)]
        if a["fp8"] == "mxfp8":
            out.append(Saved(f"{name}.scale", -(-numel // fp8.MX_BLOCK), "uint8"))
        return out
    if a.get("as_is"):
        return [Saved(a["input"], numel, op.dtypes["input"])]
    if ctx.compile and a["consumers"] > 1:  # the graph's CSE merges the Linears' identical autocast casts
        return act.linear_inputs(a["input"], numel, op.dtypes["input"], ctx, 1) if a["consumer"] == 0 else []
    tensors = act.linear_inputs(a["input"], numel, op.dtypes["input"], ctx, a["consumers"])
    if len(tensors) == a["consumers"] and a["consumers"] > 1:
        return [tensors[a["consumer"]]]
    return tensors if a["consumer"] == 0 else []


@register("saved", "layer_norm")
def layer_norm_saved(op: Op, ctx: Ctx) -> list[Saved]:
    rows, width = op.shapes["input"]
    return act.layernorm_saved(op.name, rows, width, op.dtypes["input"], ctx)[0]


@register("saved", "rms_norm")
def rms_norm_saved(op: Op, ctx: Ctx) -> list[Saved]:
    """Eager: `activations.rmsnorm_saved`. Fused (torch.compile): the min-cut partitioner recomputes the
    normalisation in backward, so the norm keeps its input in its own dtype (unless an fp32 input is owned
    by its caller, as in eager) and the fp32 rstd per row (planner.ir.transforms, the compile rules). A frozen
    weight (LoRA) drops the normalized tensor, kept only for the weight's gradient."""
    rows, width = op.shapes["input"]
    dtype = op.dtypes["input"]
    if op.attrs.get("fused"):
        stats = [Saved(f"{op.name}.rsqrt", rows, F32)]
        if op.attrs.get("block_input"):  # the block's input itself, in its dtype
            return ([Saved(f"{op.name}.input", rows * width, dtype)]
                    if dtype != F32 or op.attrs["input_is_new"] else []) + stats
        # after a residual add: recomputed from the block input and the branch's last matmul output (16-bit)
        return [Saved(f"{op.name}.branch_output", rows * width, ctx.low)] + stats
    if ctx.fused_norms:  # TE's RMSNorm (Megatron): `ctx.save_for_backward(x, rstdevs)`, x in its own dtype
        return ([Saved(f"{op.name}.input", rows * width, dtype)] if dtype != F32 or op.attrs["input_is_new"]
                else []) + [Saved(f"{op.name}.rsqrt", rows, F32)]
    out = act.rmsnorm_saved(op.name, rows, width, dtype, ctx, op.attrs["input_is_new"])
    return [t for t in out if not t.name.endswith(".normalized")] if op.attrs.get("frozen") else out


@register("saved", "activation")
def activation_saved(op: Op, ctx: Ctx) -> list[Saved]:
    if op.attrs.get("weighted"):  # Megatron's fused weighted SwiGLU / quick-GeGLU: its input and the probs
        return fused_moe_act_saved(op)
    if op.attrs.get("fused_glu"):  # Megatron's fused SwiGLU of a dense MLP: the fc1 output (gate and up)
        return fused_glu_saved(op)
    if op.attrs["act"] == "clamped_swiglu":
        return clamped_swiglu_saved(op)
    return act.activation_saved(op.name, op.attrs["act"], math.prod(op.shapes["input"]), op.dtypes["input"], ctx)[0]


@register("saved", "gated_mul")
def gated_mul_saved(op: Op, ctx: Ctx) -> list[Saved]:
    """act(gate) · up saves both factors; fused (torch.compile), act(gate) is recomputed from the gate the
    activation saves, so only `up` stays. A broadcast product (Qwen2-MoE's sigmoid(gate) (n, 1) times the
    shared expert's output) adds only the wide factor: the narrow one is the sigmoid's saved output."""
    n = math.prod(op.shapes["input"])
    if op.attrs.get("fused_into_act"):  # part of Megatron's fused weighted SwiGLU: the activation saves for both
        return []
    if "broadcast" in op.attrs:
        return [Saved(f"{op.name}.other", n, op.dtypes["other"])]
    up = Saved("mlp.up", n, op.dtypes["other"])
    return [up] if op.attrs.get("fused") else [Saved("mlp.act_output", n, op.dtypes["input"]), up]


@register("saved", "dropout")
def dropout_saved(op: Op, ctx: Ctx) -> list[Saved]:
    """The mask (CUDA) or noise (CPU); a pooled classifier's dropout output is saved by its Linear."""
    return act.dropout_saved(f"{op.name}_mask", math.prod(op.shapes["input"]), op.dtypes["input"], op.attrs["p"],
                             ctx.backend)


@register("saved", "residual_add", "embedding", "attention_mask", "all_reduce", "all_gather", "reduce_scatter",
          "all_to_all", "send_recv", "quantize", "dequantize", "scale")
def nothing_saved(op: Op, ctx: Ctx) -> list[Saved]:
    """Adds save nothing; a look-up saves its indices, which are the batch's own tensors or an `index` op's;
    the mask is built from the batch (kept by the checkpoint op when a layer is checkpointed); collectives save
    nothing; a dequantized 4-bit weight is a transient, made again in backward; a multiply by a Python scalar
    (LoRA's scaling) saves nothing."""
    return []


@register("saved", "index")
def index_saved(op: Op, ctx: Ctx) -> list[Saved]:
    """An int64 index tensor the forward makes and an embedding look-up saves."""
    return [Saved(op.name, math.prod(op.shapes["output"]), I64)]


@register("saved", "rotary")
def rotary_saved(op: Op, ctx: Ctx) -> list[Saved]:
    """q·cos + rotate_half(q)·sin saves cos and sin (s·d each), shared by all layers: counted on the first."""
    if not op.attrs["first"]:
        return []
    s, d = op.shapes["tables"]
    return [Saved("rotary.cos", s * d, op.dtypes["tables"]), Saved("rotary.sin", s * d, op.dtypes["tables"])]


def _context(op: Op, ctx: Ctx) -> list[Saved]:
    """The eager and math paths' transpose().contiguous() copy of the context, saved by the output Linear
    (not when that Linear is frozen: LoRA)."""
    if op.attrs.get("context_frozen"):
        return []
    return [Saved("attention.context", math.prod(op.shapes["output"]), ctx.low)]


@register("saved", "attention_eager")
def eager_saved(op: Op, ctx: Ctx) -> list[Saved]:
    out = act.eager_attention_saved(op.attrs["spec"], ctx, op.dtypes["q"], op.attrs["masked"],
                                    op.attrs.get("heads")) + _context(op, ctx)
    if op.attrs.get("sinks"):
        out += _sinks_saved(op, ctx)
    return out


def _sinks_saved(op: Op, ctx: Ctx) -> list[Saved]:
    """gpt-oss's eager attention (modeling_gpt_oss.eager_attention_forward) joins a sink column to the scores
    before the softmax (cat), subtracts the row max (`max(dim)` saves its int64 indices) and drops the column
    after: one more softmax column and the indices, b · heads · s each."""
    spec = op.attrs["spec"]
    rows = ctx.b * spec.num_heads * ctx.s
    return [Saved("attention.sink_column", rows, F32), Saved("attention.row_max_indices", rows, I64)]


@register("saved", "attention_math")
def math_saved(op: Op, ctx: Ctx) -> list[Saved]:
    return act.math_attention_saved(op.attrs["spec"], ctx, op.attrs["masked"], op.attrs.get("v_storage", 0),
                                    op.attrs.get("heads")) + _context(op, ctx)


@register("saved", "attention_efficient", "attention_flash", "attention_cpu_flash")
def fused_saved(op: Op, ctx: Ctx) -> list[Saved]:
    """q, k, v as they reach the kernel: three projections, views of GPT-2's one c_attn output (one storage),
    or Llama's k, v at kv-head size unless a 4-D mask (or equal head counts) makes HF repeat them. Widths are
    the op's (one tensor-parallel rank's heads)."""
    spec, masked = op.attrs["spec"], op.attrs["masked"]
    n, low = ctx.n, ctx.low
    H, KV = op.shapes["q"][1], op.shapes["k"][1]
    layout = op.attrs["qkv"]
    if layout == "fused":
        qkv = [Saved("attention.qkv", n * (H + 2 * KV), low)]
    elif layout == "gqa":
        kv = H if masked or KV == H else KV
        qkv = [Saved("attention.q", n * H, low), Saved("attention.k", n * kv, low), Saved("attention.v", n * kv, low)]
    else:
        qkv = [Saved(f"attention.{x}", n * H, low) for x in "qkv"]
    return act.fused_attention_saved(spec, ctx, op.kind.removeprefix("attention_"), qkv, masked,
                                     op.attrs.get("heads"))


@register("saved", "first_token")
def first_token_saved(op: Op, ctx: Ctx) -> list[Saved]:
    """What the Linear reading hidden[:, 0] saves (`activations.first_token_input`)."""
    rows, h = op.shapes["input"]
    if ctx.amp:
        return [Saved(f"{op.attrs['consumer']}.cast", ctx.b * h, ctx.low)]
    return [Saved(f"{op.attrs['consumer']}.last_hidden_state", rows * h, ctx.act)]


@register("saved", "tanh")
def tanh_saved(op: Op, ctx: Ctx) -> list[Saved]:
    """tanh and ReLU save their output."""
    return [Saved(op.name, math.prod(op.shapes["output"]), op.dtypes["output"])]


@register("saved", "cross_entropy")
def loss_saved(op: Op, ctx: Ctx) -> list[Saved]:
    return act._loss(op.attrs["model"], ctx)


@register("saved", "batch_norm")
def batch_norm_saved(op: Op, ctx: Ctx) -> list[Saved]:
    return act.dense_block_saved(op.attrs["block"], op.attrs["model"], ctx)


@register("saved", "checkpoint")
def checkpoint_saved(op: Op, ctx: Ctx) -> list[Saved]:
    """The inputs a checkpointed layer keeps (`activations.checkpoint_inputs`), or those of one region that
    selective recomputation re-runs (planner.ir.transforms.selective_layer): `region_inputs`."""
    if op.attrs.get("region") == "op":
        return op_policy_kept(op.attrs["input"], op.attrs["ops"], ctx)
    if "region" in op.attrs:
        return region_inputs(op.attrs["region"], op.attrs["ops"], ctx)
    return act.checkpoint_inputs(op.attrs["spec"], ctx, op.attrs["index"])


def op_policy_kept(first: Op, ops: tuple[Op, ...], ctx: Ctx) -> list[Saved]:
    """What a layer keeps under torchtitan's per-op policy: its input (what the layer's first op reads: the
    residual stream's rows) and the outputs the policy caches: the kept mm outputs and each fused attention
    call's output and logsumexp (SDPA's outputs; its Philox seed and offset are CPU scalars)."""
    out = [Saved("checkpoint.hidden_states", math.prod(first.shapes["input"]), first.dtypes["input"])]
    for op in ops:
        if op.kind == "linear":
            out.append(Saved(f"{op.name}.output", math.prod(op.shapes["output"]), op.dtypes["output"]))
        else:
            out.append(Saved("attention.output", math.prod(op.shapes["output"]), ctx.low))
            out.append(act.attention_lse(op.kind.removeprefix("attention_"), ctx, op.attrs.get("heads")
                                         or op.attrs["spec"].num_heads))
    return out


def region_inputs(region: str, ops: tuple[Op, ...], ctx: Ctx) -> list[Saved]:
    """What a recomputed region keeps for backward: its inputs (torch.utils.checkpoint non-reentrant saves
    them through `_NoopSaveInputs`; Megatron's `CheckpointFunction` with `save_for_backward(*args)`).

    - core_attn: q, k and v as they reach the attention function (k, v at key/value-head width: HF repeats
      them inside; q and k in the rotary output's dtype; GPT-2's one c_attn storage), and its output, which the
      output projection saves anyway (the eager and math paths' context copy). The scores, softmax, dropout
      mask and logsumexp are recomputed: Korthikanti et al. 2022 §5's 5·a·s/h term goes.
    - mlp: the MLP's input (what its first Linear reads: under SP Megatron's local n/tp shard).
    - layernorm: the norm's input (the residual stream); its statistics and output are rebuilt.
    """
    first = ops[0]
    if region == "core_attn":
        n, low = ctx.n, ctx.low
        H, KV = first.shapes["q"][1], first.shapes["k"][1]
        qd = first.dtypes["q"]
        layout = first.attrs["qkv"]
        if layout == "fused":
            qkv = [Saved("attention.qkv", n * (H + 2 * KV), low)]
        elif layout == "gqa":
            qkv = [Saved("attention.q", n * H, qd), Saved("attention.k", n * KV, qd), Saved("attention.v", n * KV, low)]
        else:
            qkv = [Saved(f"attention.{x}", n * H, low) for x in "qkv"]
        out = "attention.output" if first.kind in ("attention_efficient", "attention_flash", "attention_cpu_flash") \
            else "attention.context"
        return qkv + [Saved(out, n * H, low)]
    if region == "mlp":
        lin = next(o for o in ops if o.kind == "linear")
        numel = math.prod(lin.shapes["input"])
        if lin.attrs.get("tp") == "column" and ctx.sp and not ctx.sp_saves_gathered:
            numel //= ctx.tp
        return [Saved("mlp.checkpoint.input", numel, lin.dtypes["input"])]
    if region == "layernorm":
        return [Saved(f"{first.name}.checkpoint.input", math.prod(first.shapes["input"]), first.dtypes["input"])]
    if region == "moe":  # the MoE block's input (what its router reads: the rank's rows)
        router = next(o for o in ops if o.kind == "router")
        return [Saved("moe.checkpoint.input", math.prod(router.shapes["input"]), router.dtypes["input"])]
    if region == "shared_experts":  # the shared expert's input (its first Linear's; the local shard under SP)
        lin = next(o for o in ops if o.kind == "linear")
        numel = math.prod(lin.shapes["input"])
        if lin.attrs.get("tp") == "column" and ctx.sp and not ctx.sp_saves_gathered:
            numel //= ctx.tp
        return [Saved("shared_experts.checkpoint.input", numel, lin.dtypes["input"])]
    if region == "moe_act":  # the activation's inputs: the gate_up output (2n), and the probabilities when fused
        n, d = math.prod(first.shapes["input"]), first.dtypes["input"]
        out = [Saved("moe_act.checkpoint.gate_up", 2 * n, d)]
        if first.attrs.get("weighted"):
            out.append(Saved("moe_act.checkpoint.probs", first.attrs["weighted"], F32))
        return out
    raise ValueError(f"recompute region {region!r}: known core_attn, mlp, layernorm, moe, shared_experts, moe_act")


def clamped_swiglu_saved(op: Op) -> list[Saved]:
    """gpt-oss's expert gate (GptOssExperts._apply_gate) on n = pairs · i elements: both clamps save the
    gate_up output (their inputs are views of it: 2n), sigmoid its output, gate · sigmoid both factors (the
    clamped gate), (up + 1) · glu both factors: four new n-element tensors besides the 2n storage."""
    n, d = math.prod(op.shapes["input"]), op.dtypes["input"]
    return [Saved(f"{op.name}.gate_up", 2 * n, d), Saved(f"{op.name}.gate_clamped", n, d),
            Saved(f"{op.name}.sigmoid", n, d), Saved(f"{op.name}.up_plus_one", n, d), Saved(f"{op.name}.glu", n, d)]


def fused_glu_saved(op: Op) -> list[Saved]:
    """Megatron-Core's fused SwiGLU of a dense MLP (MLP.forward under bias_activation_fusion: `bias_swiglu_impl`,
    megatron/core/fusions/fused_bias_swiglu.py SwiGLUFunction.forward `ctx.save_for_backward(input_for_backward)`
    with fp8_input_store off, the default): the fc1 output, gate and up halves (2n) in its own dtype; silu(gate)
    and the product are rebuilt in backward (the product op adds nothing: `fused_into_act`)."""
    n, d = math.prod(op.shapes["input"]), op.dtypes["input"]
    return [Saved(f"{op.name}.input", 2 * n, d)]


def fused_moe_act_saved(op: Op) -> list[Saved]:
    """Megatron-Core's fused expert activation (TEGroupedMLP with bias_activation_fusion:
    `weighted_bias_swiglu_impl` / `weighted_bias_quick_geglu_impl`, megatron/core/fusions/fused_bias_swiglu.py
    WeightedSwiGLUFunction `ctx.save_for_backward(input_for_backward, weights)`, fused_bias_geglu.py the same
    with its linear offset): the fc1 output (gate and up halves, 2n) and the pairs' probabilities (fp32, one a
    pair); the activation output, the product and the weighting are rebuilt in backward."""
    n, d = math.prod(op.shapes["input"]), op.dtypes["input"]
    return [Saved(f"{op.name}.input", 2 * n, d), Saved(f"{op.name}.probs", op.attrs["weighted"], F32)]


# ------------------------------------------------------------------------------ mixture of experts
# transformers 5 *TopKRouter.forward and integrations/moe.py grouped_mm_experts_forward, op by op; what each
# ATen op saves is its derivatives.yaml formula (softmax its output, topk its indices, index its indices,
# mul both factors, grouped_mm its input and offsets).


@register("saved", "router")
def router_saved(op: Op, ctx: Ctx) -> list[Saved]:
    """F.linear(x, gate.weight) saves x (its own 16-bit cast under autocast: one of the block input's
    readers); softmax(dtype=float) its fp32 output; topk its int64 indices; the renormalising division
    (`top /= top.sum(-1, keepdim=True)`) the top-k values and their sums."""
    n, h = op.shapes["input"]
    a = op.attrs
    tensors = act.linear_inputs(a["input_name"], n * h, op.dtypes["input"], ctx, a["consumers"])
    if a.get("frozen"):  # LoRA: the router weight needs no gradient, so F.linear keeps no x for it
        out = []
    elif a.get("input_discarded") and not (ctx.amp and op.dtypes["input"] != ctx.low):
        out = []  # the norm output it saved is freed and rebuilt in backward (selective "layernorm")
    elif len(tensors) == a["consumers"] and a["consumers"] > 1:
        out = [tensors[a["consumer"]]]
    else:
        out = tensors if a["consumer"] == 0 else []
    if a.get("fake"):  # FakeBalancedGate reads only x.size(0): none of its own; x kept once for the other readers
        return out if a["consumers"] > 1 and len(tensors) != a["consumers"] else []
    rows, k = op.shapes["topk"]
    if a.get("fused_moe"):  # TE's FusedTopkScoreFunction: `ctx.save_for_backward(routing_map, intermediate_output)`
        e = op.shapes["logits"][1]  # (transformer_engine/pytorch/router.py; Megatron's moe_router_fusion)
        return out + [Saved(f"{op.name}.routing_map", rows * e, "bool"), Saved(f"{op.name}.intermediate", rows * e, F32)]
    if a.get("topk_then_softmax"):  # gpt-oss: top-k of the logits, then a softmax over those k (logits' dtype)
        return out + [Saved(f"{op.name}.topk_indices", rows * k, I64),
                      Saved(f"{op.name}.scores", rows * k, op.dtypes["compute"])]
    out += [Saved(f"{op.name}.probs", math.prod(op.shapes["logits"]), F32),
            Saved(f"{op.name}.topk_indices", rows * k, I64)]
    if a["renormalise"]:
        out += [Saved(f"{op.name}.topk_values", rows * k, F32), Saved(f"{op.name}.topk_sum", rows, F32)]
    return out


@register("saved", "permute")
def permute_saved(op: Op, ctx: Ctx) -> list[Saved]:
    """`hidden_states[perm // top_k]` saves its index, `sample_weights[perm]` the sort's permutation (S int64
    each); the per-expert offsets (int32, one per local expert) are saved by the grouped GEMMs."""
    pairs = op.shapes["output"][0]
    if op.attrs.get("fused_moe"):  # TE's mask-map permutation (Megatron's moe_permute_fusion): its int32 row-id map
        # [tokens, 2E + 1] (transformer_engine/pytorch/triton/permutation.py make_row_id_map), which the
        # unpermutation reuses; with several local experts behind an all-to-all, sort_chunks_by_idxs keeps one
        # int32 index a pair in dispatch and one in combine (ASSUMPTION: TE moe_sort_chunks_by_index's map)
        tokens, e = op.shapes["input"][0], op.attrs["all_experts"]
        out = [Saved(f"{op.name}.row_id_map", tokens * (2 * e + 1), "int32")]
        if op.attrs["ep"] > 1 and op.attrs["experts"] > 1:
            out += [Saved(f"{op.name}.sort_chunks", pairs, "int32"), Saved(f"{op.name}.unsort_chunks", pairs, "int32")]
        return out
    out = [Saved(f"{op.name}.token_index", pairs, I64), Saved(f"{op.name}.perm", pairs, I64),
           Saved(f"{op.name}.offsets", op.attrs["experts"], "int32")]
    if op.attrs.get("bias_index") and not op.attrs.get("frozen_bias"):  # `*_proj_bias[expert_ids_g]`: the
        # sorted expert ids, one storage for both; a frozen bias (LoRA) needs no indices for its gradient
        out.append(Saved(f"{op.name}.expert_ids", pairs, I64))
    return out


@register("saved", "expert_gemm")
def expert_gemm_saved(op: Op, ctx: Ctx) -> list[Saved]:
    """grouped_mm(input.to(weight.dtype), weight) saves its input: the gathered pairs (gate_up) or the
    gated product (down), as a new cast when the input is not already in the weights' dtype."""
    rows, n_in = op.shapes["input"]
    if op.attrs.get("input_discarded"):  # selective "moe_act": the activation output it saved is freed after fc2
        return []
    saved_fp8 = fp8.input_saved(op.attrs["fp8"]) if op.attrs.get("fp8") else None
    if saved_fp8 is not None:  # TE's GroupedLinear saves its FP8 copy of the input (te grouped_linear.py)
        out = [Saved(f"{op.name}.input.fp8", rows * n_in, fp8.F8)]
        if op.attrs["fp8"] == "mxfp8":
            out.append(Saved(f"{op.name}.input.fp8.scale", -(-rows * n_in // fp8.MX_BLOCK), "uint8"))
        return out
    dtype = op.dtypes["compute"]
    if op.attrs.get("frozen"):  # LoRA on a frozen expert weight: no gradient of it, so no input kept
        return []
    name = f"{op.name}.input" + (".cast" if op.dtypes["input"] != dtype else "")
    out = [Saved(name, rows * n_in, dtype)]
    if op.attrs.get("merged"):  # LoRA on the experts (planner.ir.transforms._expert_gemm): W' and the factors
        out.append(Saved(f"{op.name}.merged_weight", op.attrs["merged"], dtype))
        if op.attrs.get("factor_cast"):
            out.append(Saved(f"{op.name}.lora_factors.cast", op.attrs["factor_cast"], dtype))
    return out


@register("saved", "unpermute")
def unpermute_saved(op: Op, ctx: Ctx) -> list[Saved]:
    """`proj_out * sample_weights_g` saves both (S·h and S), `weighted_out[inv_perm]` its index (S int64);
    the sum over top-k saves nothing."""
    pairs, h = op.shapes["input"]
    if op.attrs.get("fused_moe"):  # TE's fused unpermutation without merging probs: the permutation's row-id map
        return []
    return [Saved(f"{op.name}.expert_output", pairs * h, op.dtypes["input"]),
            Saved(f"{op.name}.weights", pairs, op.dtypes["weights"]), Saved(f"{op.name}.inv_perm", pairs, I64)]


@register("saved", "aten")
def traced_saved(op: Op, ctx: Ctx) -> list[Saved]:
    """A traced op's saved storages, as the tracer measured them (planner.program.lower)."""
    return list(op.attrs["saved"])


def op_saved(op: Op, ctx: Ctx) -> list[Saved]:
    """What `op` saves for backward: its kind's rule, or nothing when no input or parameter of it needs a
    gradient (`no_grad`, set by a transform: LoRA's frozen blocks before the first adapter)."""
    from planner.ir.interpret import apply

    if op.attrs.get("no_grad"):
        return []
    return apply("saved", op, ctx)


def weight_cast(op: Op, ctx: Ctx) -> list[Saved]:
    """Under autocast a Linear's (or an MoE router's) matmul saves its weight's 16-bit cast (for the input's gradient): none when
    the input needs no gradient or the weight is not cast (a 4-bit or 16-bit base: `casts_weight` False)."""
    if not ctx.amp or op.attrs.get("no_grad") or not op.attrs.get("casts_weight", True):
        return []
    shape = weight_matmul(op)  # a Linear, or an MoE router's F.linear(x, gate.weight): E × h
    return [] if shape is None else [Saved(f"{op.name}.weight.cast", shape[0] * shape[1], ctx.low)]


