"""The post-norm encoder layer (transformers BertLayer, RobertaLayer; DistilBERT's TransformerBlock):
Q, K, V Linear -> attention -> output dense -> dropout -> LayerNorm(+x) -> up -> act -> down -> dropout ->
LayerNorm(+residual). DistilBERT has no dropout after its attention output projection (family trait).

On a tensor-parallel rank: Q, K, V and up column-parallel, the output dense and down row-parallel (Megatron's
BERT layer); with sequence parallelism the layer's input and both LayerNorms hold n / tp rows."""

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
)
from planner.ir.context import attention_kernel, mask_materialised, promote
from planner.ir.ops import Op


@layer_form("post_norm_encoder")
def encoder_layer(a: LayerArgs) -> list[Op]:
    spec, ctx, lins = a.spec, a.ctx, a.traits.layer_linears
    n, rows, h, low, act = ctx.n, ctx.rows, spec.hidden_size, ctx.low, ctx.act
    q, k, v, out, up, down = lins
    ops = tp_gather("attention", h, act, ctx)
    ops += [module_linear(spec, lin, a.prefix, n, act, ctx, input="layer.input", consumers=3, consumer=j,
                          attention_input=True)
            for j, lin in enumerate((q, k, v))]
    masked = mask_materialised(spec, ctx)
    kernel = attention_kernel(spec, ctx, masked)
    ops += cp_exchange(spec, ctx, low)
    ops.append(attention_op(spec, ctx, kernel, masked, low, "separate"))
    ops.append(module_linear(spec, out, a.prefix, n, low, ctx, saves_input=False))
    ops += tp_reduce("attention.output.dense", h, low, ctx)
    if a.traits.attention_output_dropout:
        ops.append(dropout("attention.output.dropout", rows * h, low, spec.hidden_dropout))
    resid = promote(low, act)
    ops.append(add("attention.residual_add", rows * h, low, act, resid))
    norm1, norm2 = a.traits.layer_norm_names
    ln, ln_dtype = layer_norm(norm1, a.prefix, rows, h, resid, ctx)
    ops.append(ln)
    ops += module("mlp", tp_gather("mlp", h, ln_dtype, ctx)
                  + mlp_ops(spec, a.traits, ctx, a.prefix, ln_dtype, (up,), down)
                  + tp_reduce("output.dense", h, low, ctx))
    ops.append(dropout("output.dropout", rows * h, low, spec.hidden_dropout))
    ops.append(add("mlp.residual_add", rows * h, low, resid, resid))
    ops.append(layer_norm(norm2, a.prefix, rows, h, resid, ctx)[0])
    return ops
