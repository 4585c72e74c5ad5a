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

from planner.ir.context import I64, Ctx
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
    if not a["saves_input"] or a.get("frozen"):
        return []  # a frozen weight needs no input for its gradient (LoRA: planner.ir.transforms.lora_layers)
    numel = a.get("saved_numel") or math.prod(op.shapes["input"])
    if a.get("as_is"):
        return [Saved(a["input"], numel, op.dtypes["input"])]
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
    """A frozen weight (LoRA) drops the normalized tensor, kept only for the weight's gradient."""
    rows, width = op.shapes["input"]
    out = act.rmsnorm_saved(op.name, rows, width, op.dtypes["input"], ctx, op.attrs["input_is_new"])
    return [t for t in out if not t.name.endswith(".normalized")] if op.attrs.get("frozen") else out


@register("saved", "activation")
def activation_saved(op: Op, ctx: Ctx) -> list[Saved]:
    return act.activation_saved(op.name, op.attrs["act"], math.prod(op.shapes["input"]), op.dtypes["input"], ctx)[0]


@register("saved", "gated_mul")
def gated_mul_saved(op: Op, ctx: Ctx) -> list[Saved]:
    """act(gate) · up saves both factors."""
    n = math.prod(op.shapes["input"])
    return [Saved("mlp.act_output", n, op.dtypes["input"]), Saved("mlp.up", n, op.dtypes["other"])]


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
    return act.eager_attention_saved(op.attrs["spec"], ctx, op.dtypes["q"], op.attrs["masked"]) + _context(op, ctx)


@register("saved", "attention_math")
def math_saved(op: Op, ctx: Ctx) -> list[Saved]:
    return act.math_attention_saved(op.attrs["spec"], ctx, op.attrs["masked"], op.attrs.get("v_storage", 0)) \
        + _context(op, ctx)


@register("saved", "attention_efficient", "attention_flash", "attention_cpu_flash")
def fused_saved(op: Op, ctx: Ctx) -> list[Saved]:
    """q, k, v as they reach the kernel: three projections, views of GPT-2's one c_attn output (one storage),
    or Llama's k, v at kv-head size unless a 4-D mask (or equal head counts) makes HF repeat them."""
    spec, masked = op.attrs["spec"], op.attrs["masked"]
    n, low = ctx.n, ctx.low
    H = spec.num_heads * spec.head_dim
    layout = op.attrs["qkv"]
    if layout == "fused":
        qkv = [Saved("attention.qkv", n * 3 * spec.hidden_size, low)]
    elif layout == "gqa":
        kv = H if masked or spec.num_kv_heads == spec.num_heads else spec.num_kv_heads * spec.head_dim
        qkv = [Saved("attention.q", n * H, low), Saved("attention.k", n * kv, low), Saved("attention.v", n * kv, low)]
    else:
        qkv = [Saved(f"attention.{x}", n * spec.hidden_size, low) for x in "qkv"]
    return act.fused_attention_saved(spec, ctx, op.kind.removeprefix("attention_"), qkv, masked)


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
    """The inputs a checkpointed layer keeps (`activations.checkpoint_inputs`)."""
    return act.checkpoint_inputs(op.attrs["spec"], ctx, op.attrs["index"])


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
    """Under autocast a Linear's matmul saves its weight's 16-bit cast (for the input's gradient): none when
    the input needs no gradient or the weight is not cast (a 4-bit or 16-bit base: `casts_weight` False)."""
    if not ctx.amp or op.kind != "linear" or op.attrs.get("no_grad") or not op.attrs.get("casts_weight", True):
        return []
    return [Saved(f"{op.name}.weight.cast", op.shapes["input"][1] * op.shapes["output"][1], ctx.low)]


