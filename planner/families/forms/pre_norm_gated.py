"""Llama's gated pre-norm layer (transformers LlamaDecoderLayer; Mistral's is the same): RMSNorm -> q, k, v
(GQA: k, v at kv-head width) -> rotary -> attention -> o_proj -> +x -> RMSNorm -> gate, up -> silu(gate)·up
-> down -> +residual. No dropout (attention_dropout 0 by default is still honoured by the attention op)."""

from __future__ import annotations

from planner.families.forms import LayerArgs, layer_form
from planner.families.forms.common import add, attention_op, mlp_ops, module_linear, rms_norm
from planner.ir.context import attention_kernel, mask_materialised, promote
from planner.ir.ops import Op


@layer_form("pre_norm_gated", norms_registered_last=True)  # LlamaDecoderLayer: attn, mlp, then norms
def gated_layer(a: LayerArgs) -> list[Op]:
    spec, ctx = a.spec, a.ctx
    n, h, low, act = ctx.n, spec.hidden_size, ctx.low, ctx.act
    q, k, v, o, gate, up, down = a.traits.layer_linears
    norm1, norm2 = a.traits.layer_norm_names
    ops = [rms_norm(norm1, a.prefix, n, h, act)]
    ops += [module_linear(spec, lin, a.prefix, n, act, ctx, input="self_attn.input", consumers=3, consumer=j,
                          attention_input=True)
            for j, lin in enumerate((q, k, v))]
    d = spec.head_dim
    ops.append(Op("rotary", "rotary", {"q": (n, spec.num_heads * d), "k": (n, spec.num_kv_heads * d),
                                       "tables": (ctx.s, d)}, (), {"input": low, "tables": act},
                  {"first": a.index == 0}))
    masked = mask_materialised(spec, ctx)
    kernel = attention_kernel(spec, ctx, masked)
    ops.append(attention_op(spec, ctx, kernel, masked, promote(low, act), "gqa"))
    ops.append(module_linear(spec, o, a.prefix, n, low, ctx, saves_input=False))
    resid = promote(low, act)
    ops.append(add("attention.residual_add", n * h, low, act, resid))
    ops.append(rms_norm(norm2, a.prefix, n, h, act))
    ops += mlp_ops(spec, a.traits, ctx, a.prefix, act, (gate, up), down)
    ops.append(add("mlp.residual_add", n * h, low, resid, resid))
    return ops
