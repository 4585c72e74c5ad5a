"""GPT-2's pre-norm block with Conv1D projections (transformers GPT2Block): ln_1 -> c_attn (one fused
n·3h projection; q, k, v are views of it) -> attention -> c_proj -> dropout -> +x -> ln_2 -> c_fc ->
gelu_new -> c_proj -> dropout -> +residual.

On a tensor-parallel rank: c_attn and c_fc column-parallel, the two c_proj row-parallel (then all-reduce, or
with sequence parallelism reduce-scatter: dropout, adds and norms on n / tp rows), as Megatron's GPT layer."""

from __future__ import annotations

from planner.families.forms import LayerArgs, layer_form
from planner.families.forms.common import (
    add,
    attention_op,
    cp_exchange,
    dropout,
    layer_norm,
    mlp_ops,
    module,
    module_linear,
    tp_gather,
    tp_reduce,
    width,
)
from planner.ir.context import attention_kernel, mask_materialised, promote
from planner.ir.ops import Op


@layer_form("pre_norm_conv1d")
def gpt2_layer(a: LayerArgs) -> list[Op]:
    spec, ctx = a.spec, a.ctx
    n, rows, h, low, act = ctx.n, ctx.rows, spec.hidden_size, ctx.low, ctx.act
    c_attn, c_proj, c_fc, mlp_proj = a.traits.layer_linears
    ln1, ln2 = a.traits.layer_norm_names
    ln, ln_dtype = layer_norm(ln1, a.prefix, rows, h, act, ctx)
    ops = [ln, *tp_gather("attn", h, ln_dtype, ctx),
           module_linear(spec, c_attn, a.prefix, n, ln_dtype, ctx, input="attn.c_attn.input", attention_input=True)]
    masked = mask_materialised(spec, ctx)
    kernel = attention_kernel(spec, ctx, masked)
    ops += cp_exchange(spec, ctx, low)
    ops.append(attention_op(spec, ctx, kernel, masked, low, "fused", v_storage=n * width(spec, "qkv", ctx)))
    ops.append(module_linear(spec, c_proj, a.prefix, n, low, ctx, saves_input=False))
    ops += tp_reduce("attn.c_proj", h, low, ctx)
    ops.append(dropout("attn.resid_dropout", rows * h, low, spec.hidden_dropout))
    resid = promote(low, act)
    ops.append(add("attention.residual_add", rows * h, low, act, resid))
    ln, ln_dtype = layer_norm(ln2, a.prefix, rows, h, resid, ctx)
    ops.append(ln)
    ops += module("mlp", tp_gather("mlp", h, ln_dtype, ctx)
                  + mlp_ops(spec, a.traits, ctx, a.prefix, ln_dtype, (c_fc,), mlp_proj)
                  + tp_reduce("mlp.c_proj", h, low, ctx))
    ops.append(dropout("mlp.dropout", rows * h, low, spec.hidden_dropout))
    ops.append(add("mlp.residual_add", rows * h, low, resid, resid))
    return ops
