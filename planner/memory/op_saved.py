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
from planner.ir.ops import Op
from planner.memory import activations as act
from planner.memory.activations import Saved


@register("saved", "linear")
def linear_saved(op: Op, ctx: Ctx) -> list[Saved]:
    """A Linear saves its input (one storage shared by the Linears reading it; under autocast each its own
    16-bit cast: `activations.linear_inputs`). The multimodal model's dense blocks keep their own rule
    (`activations.dense_block_saved`: what precedes them decides)."""
    a = op.attrs
    if "block" in a:
        return act.dense_block_saved(a["block"], a["model"], ctx)
    if not a["saves_input"]:
        return []
    if a.get("input_discarded") and not (ctx.amp and op.dtypes["input"] != ctx.low):
        return []  # the norm output it saved is freed and rebuilt in backward (selective "layernorm")
    numel = math.prod(op.shapes["input"])
    if a.get("tp") == "column" and ctx.sp and not ctx.sp_saves_gathered:
        numel //= ctx.tp  # Megatron saves the local sequence shard and all-gathers it again in backward
    saved_fp8 = fp8.input_saved(a["fp8"]) if a.get("fp8") else None
    if saved_fp8 is not None:  # Transformer Engine: each Linear saves its own FP8 copy of its input
        name = f"{a['input']}.fp8{a['consumer']}" if a["consumers"] > 1 else f"{a['input']}.fp8"
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
    by its caller, as in eager) and the fp32 rstd per row (planner.ir.transforms, the compile rules)."""
    rows, width = op.shapes["input"]
    dtype = op.dtypes["input"]
    if op.attrs.get("fused"):
        stats = [Saved(f"{op.name}.rsqrt", rows, F32)]
        if op.attrs.get("block_input"):  # the block's input itself, in its dtype
            return ([Saved(f"{op.name}.input", rows * width, dtype)]
                    if dtype != F32 or op.attrs["input_is_new"] else []) + stats
        # after a residual add: recomputed from the block input and the branch's last matmul output (16-bit)
        return [Saved(f"{op.name}.branch_output", rows * width, ctx.low)] + stats
    return act.rmsnorm_saved(op.name, rows, width, dtype, ctx, op.attrs["input_is_new"])


@register("saved", "activation")
def activation_saved(op: Op, ctx: Ctx) -> list[Saved]:
    return act.activation_saved(op.name, op.attrs["act"], math.prod(op.shapes["input"]), op.dtypes["input"], ctx)[0]


@register("saved", "gated_mul")
def gated_mul_saved(op: Op, ctx: Ctx) -> list[Saved]:
    """act(gate) · up saves both factors; fused (torch.compile), act(gate) is recomputed from the gate the
    activation saves, so only `up` stays."""
    n = math.prod(op.shapes["input"])
    up = Saved("mlp.up", n, op.dtypes["other"])
    return [up] if op.attrs.get("fused") else [Saved("mlp.act_output", n, op.dtypes["input"]), up]


@register("saved", "dropout")
def dropout_saved(op: Op, ctx: Ctx) -> list[Saved]:
    """The mask (CUDA) or noise (CPU); a pooled classifier's dropout output is saved by its Linear."""
    return act.dropout_saved(f"{op.name}_mask", math.prod(op.shapes["input"]), op.dtypes["input"], op.attrs["p"],
                             ctx.backend)


@register("saved", "residual_add", "embedding", "attention_mask", "all_reduce", "all_gather", "reduce_scatter",
          "all_to_all", "send_recv", "quantize", "dequantize")
def nothing_saved(op: Op, ctx: Ctx) -> list[Saved]:
    """Adds save nothing; a look-up saves its indices, which are the batch's own tensors or an `index` op's;
    the mask is built from the batch (kept by the checkpoint op when a layer is checkpointed); collectives and
    quantisation are not emitted yet."""
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
    """The eager and math paths' transpose().contiguous() copy of the context, saved by the output Linear."""
    return [Saved("attention.context", math.prod(op.shapes["output"]), ctx.low)]


@register("saved", "attention_eager")
def eager_saved(op: Op, ctx: Ctx) -> list[Saved]:
    return act.eager_attention_saved(op.attrs["spec"], ctx, op.dtypes["q"], op.attrs["masked"],
                                     op.attrs.get("heads")) + _context(op, ctx)


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
    raise ValueError(f"recompute region {region!r}: known core_attn, mlp, layernorm")


def op_saved(op: Op, ctx: Ctx) -> list[Saved]:
    from planner.ir.interpret import apply

    return apply("saved", op, ctx)


