"""Llama's gated pre-norm layer (transformers LlamaDecoderLayer; Mistral's is the same): RMSNorm -> q, k, v
(GQA: k, v at kv-head width) -> rotary -> attention -> o_proj -> +x -> RMSNorm -> gate, up -> silu(gate)·up
-> down -> +residual. No dropout (attention_dropout 0 by default is still honoured by the attention op).

On a tensor-parallel rank (ctx.tp > 1) the ops are that rank's (Megatron-Core's layout): q, k, v and gate, up
column-parallel (heads / tp, ffn / tp), o_proj and down row-parallel, followed by the all-reduce (or, with
sequence parallelism, a reduce-scatter, the norms and adds then on n / tp rows, and an all-gather before each
column-parallel pair)."""

from __future__ import annotations

from planner.families.forms import LayerArgs, layer_form
from planner.families.forms.common import (
    add,
    attention_op,
    cp_exchange,
    mlp_ops,
    module,
    module_linear,
    rms_norm,
    tp_gather,
    tp_reduce,
)
from planner.ir.context import attention_kernel, heads_per_rank, kv_heads_per_rank, mask_materialised, promote
from planner.ir.ops import Op


@layer_form("pre_norm_gated", norms_registered_last=True)  # LlamaDecoderLayer: attn, mlp, then norms
def gated_layer(a: LayerArgs) -> list[Op]:
    spec, ctx = a.spec, a.ctx
    n, rows, h, low, act = ctx.n, ctx.rows, spec.hidden_size, ctx.low, ctx.act
    q, k, v, o, gate, up, down = a.traits.layer_linears
    norm1, norm2 = a.traits.layer_norm_names
    ops = [rms_norm(norm1, a.prefix, rows, h, act)]
    ops += tp_gather("self_attn", h, act, ctx)
    ops += [module_linear(spec, lin, a.prefix, n, act, ctx, input="self_attn.input", consumers=3, consumer=j,
                          attention_input=True)
            for j, lin in enumerate((q, k, v))]
    d = spec.head_dim
    ops.append(Op("rotary", "rotary", {"q": (n, heads_per_rank(spec, ctx) * d),
                                       "k": (n, kv_heads_per_rank(spec, ctx) * d),
                                       "tables": (ctx.chunk, d)}, (), {"input": low, "tables": act},
                  {"first": a.index == 0}))
    masked = mask_materialised(spec, ctx)
    kernel = attention_kernel(spec, ctx, masked)
    ops += cp_exchange(spec, ctx, low)
    ops.append(attention_op(spec, ctx, kernel, masked, promote(low, act), "gqa"))
    ops.append(module_linear(spec, o, a.prefix, n, low, ctx, saves_input=False))
    ops += tp_reduce("self_attn.o_proj", h, low, ctx)
    resid = promote(low, act)
    ops.append(add("attention.residual_add", rows * h, low, act, resid))
    ops.append(rms_norm(norm2, a.prefix, rows, h, act))
    ops += module("mlp", tp_gather("mlp", h, act, ctx)
                  + mlp_ops(spec, a.traits, ctx, a.prefix, act, (gate, up), down)
                  + tp_reduce("mlp.down_proj", h, low, ctx))
    ops.append(add("mlp.residual_add", rows * h, low, resid, resid))
    return ops
