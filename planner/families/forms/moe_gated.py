"""The gated pre-norm layer with a mixture-of-experts MLP (transformers 5 MixtralDecoderLayer,
Qwen2MoeDecoderLayer, Qwen3MoeDecoderLayer, OlmoeDecoderLayer; issue 35).

Attention is Llama's (planner/families/forms/pre_norm_gated.py), with the family's q/k RMSNorms where it has
them (Qwen3: per head over head_dim, `q_norm(q_proj(x).view(..., d))`; OLMoE: over the whole q and k
projections). The MLP of a sparse layer is the `*SparseMoeBlock`:

- the router (`*TopKRouter`): logits = F.linear(x, gate.weight) (E, h); softmax in fp32; top-k; the top-k
  weights renormalised where the family does (Mixtral always, Qwen/OLMoE when norm_topk_prob);
- the experts (`*Experts`, 3-D parameters gate_up_proj (E, 2i, h) and down_proj (E, h, i)) as transformers 5
  runs them by default, `grouped_mm_experts_forward` (transformers/integrations/moe.py;
  PreTrainedModel.get_correct_experts_implementation picks "grouped_mm" when nothing is asked): the
  token-expert pairs (S = tokens · top_k) sorted by expert and gathered (`permute`), one grouped GEMM for
  gate_up and one for down over all experts (`expert_gemm`, offsets per expert), silu(gate) · up between
  them, then weighted by the routing weights, put back in token order and summed over top-k (`unpermute`).
  `_grouped_mm` casts the input to the weights' dtype and is not autocast (its comment cites
  pytorch/pytorch#174763), so under `amp-*` the experts compute in the fp32 of the weights; under a
  framework whose own MoE casts them (`ctx.experts_16bit`: torchtitan's GroupedExperts `x.bfloat16()`,
  Megatron-Core's GroupedMLP / TEGroupedMLP on Float16Module's bf16 weights) they compute in 16 bits;
- Qwen2-MoE's shared expert (a SwiGLU MLP on every token) times sigmoid(shared_expert_gate(x)).

A dense layer (Qwen's mlp_only_layers / decoder_sparse_step) runs Llama's MLP. Under expert parallelism
(`ctx.ep` > 1) the pairs are dispatched to their experts' ranks and combined back by two all-to-alls; this
rank holds E / ep experts and (at load imbalance `ctx.moe_imbalance`) that share of the pairs times it.

Under tensor parallelism (`ctx.tp` > 1) the ops are one rank's, in Megatron-Core's layout (docs/moe.md,
"Tensor parallelism inside MoE layers"): attention and a shared expert column/row-parallel with the SP
all-gather and reduce-scatter around them; the norms, the router and the token-expert pairs on the rank's
rows (`ctx.rows`: n / tp under sequence parallelism); the routed experts whole (planner.pipeline.step splits
their states over ep · etp).
"""

from __future__ import annotations

from planner.families.forms import LayerArgs, layer_form
from planner.families.forms.common import (
    activation,
    add,
    attention_op,
    cp_exchange,
    linear,
    linear_params,
    mlp_ops,
    module_linear,
    rms_norm,
    tp_gather,
    tp_reduce,
)
from planner.ir.context import (
    F32,
    Ctx,
    attention_kernel,
    heads_per_rank,
    kv_heads_per_rank,
    mask_materialised,
    promote,
)
from planner.ir.ops import Op, Param
from planner.spec import TransformerSpec


def expert_pairs(spec: TransformerSpec, tokens: int, ep: int = 1, imbalance: float = 1.0) -> int:
    """Token-expert pairs one rank's experts compute: tokens · top_k over the whole group of `ep` ranks
    (each rank sends its tokens' pairs and receives ep · (its share)), times the hottest rank's share over the
    mean (`imbalance`, 1.0 balanced)."""
    pairs = tokens * spec.experts_per_token
    return int(round(pairs * imbalance)) if ep > 1 or imbalance != 1.0 else pairs


def _tp(ctx: Ctx, split: str) -> dict:
    """The `tp` attribute of a Linear on a tensor-parallel rank ("column", "row" or "replicated", as
    common.module_linear sets it: the saved rule reads "column" under SP); none without tensor parallelism."""
    return {"tp": split} if ctx.tp > 1 else {}


def _latent_attention(a: LayerArgs) -> list[Op]:
    """DeepseekV3Attention (multi-head latent attention): q = q_b(norm(q_a(x))) (or q_proj(x)); the latent
    [kv, k_rope] = kv_a_proj_with_mqa(x), kv = kv_b(norm(kv)) split into k_nope and v per head; rotary on
    q's and k's rope parts; attention over q/k heads of nope + rope and v heads of v_head_dim; o_proj.
    ASSUMPTION: the attention op is the one of heads of head_size (nope + rope) for q, k, v and output, so the
    value and the output are counted at the q/k head width (192 where DeepSeek's v head is 128).

    On a tensor-parallel rank, Megatron-Core's MLASelfAttention (megatron/core/transformer/
    multi_latent_attention.py @d98e8a64, `_qkv_down_projection` and `get_query_key_value_tensors`): the down
    projections q_a and kv_a and their norms are duplicated (TELinear `parallel_mode='duplicated'`), run on
    the rank's sequence-parallel rows; the compressed q and kv (and k's rope part) are all-gathered before the
    column-parallel up projections q_b and kv_b (heads / tp); o_proj is row-parallel. q_proj (no q_lora_rank)
    is column-parallel on the gathered hidden states."""
    spec, ctx = a.spec, a.ctx
    n, rows, h, low, act = ctx.n, ctx.rows, spec.hidden_size, ctx.low, ctx.act
    H, d, rope, v = heads_per_rank(spec, ctx), spec.head_dim, spec.qk_rope_head_dim, spec.v_head_dim
    ql, kvl, b = spec.q_lora_rank, spec.kv_lora_rank, spec.attention_bias
    nope = d - rope
    pre = a.prefix + "self_attn."
    ops: list[Op] = []
    if ql:
        ops.append(linear("self_attn.q_a_proj", rows, h, ql, act, ctx, linear_params(pre + "q_a_proj.", h, ql, b),
                          input="self_attn.input", consumers=2, consumer=0, **_tp(ctx, "replicated")))
        ops.append(rms_norm("self_attn.q_a_layernorm", a.prefix, rows, ql, low))
        ops += tp_gather("self_attn.q_b_proj", ql, promote(low, act), ctx)
        ops.append(linear("self_attn.q_b_proj", n, ql, H * d, promote(low, act), ctx,
                          linear_params(pre + "q_b_proj.", ql, H * d, False), **_tp(ctx, "column")))
    else:
        ops += tp_gather("self_attn", h, act, ctx)
        ops.append(linear("self_attn.q_proj", n, h, H * d, act, ctx, linear_params(pre + "q_proj.", h, H * d, False),
                          input="self_attn.input", consumers=2, consumer=0, **_tp(ctx, "column")))
    ops.append(linear("self_attn.kv_a_proj_with_mqa", rows, h, kvl + rope, act, ctx,
                      linear_params(pre + "kv_a_proj_with_mqa.", h, kvl + rope, b), input="self_attn.input",
                      consumers=2, consumer=1, **_tp(ctx, "replicated")))
    ops.append(rms_norm("self_attn.kv_a_layernorm", a.prefix, rows, kvl, low))
    ops += tp_gather("self_attn.kv_b_proj", kvl + rope, promote(low, act), ctx)  # kv and k's rope part
    ops.append(linear("self_attn.kv_b_proj", n, kvl, H * (nope + v), promote(low, act), ctx,
                      linear_params(pre + "kv_b_proj.", kvl, H * (nope + v), False), **_tp(ctx, "column")))
    ops.append(Op("rotary", "rotary", {"q": (n, H * rope), "k": (n, rope), "tables": (ctx.chunk, rope)}, (),
                  {"input": low, "tables": act}, {"first": a.index == 0}))
    masked = mask_materialised(spec, ctx)
    kernel = attention_kernel(spec, ctx, masked)
    ops += cp_exchange(spec, ctx, low)
    ops.append(attention_op(spec, ctx, kernel, masked, low, "gqa"))
    ops.append(linear("self_attn.o_proj", n, H * v, h, low, ctx, linear_params(pre + "o_proj.", H * v, h, b),
                      saves_input=False, **_tp(ctx, "row")))
    return ops


def _attention(a: LayerArgs) -> list[Op]:
    """The attention of one rank: under tensor parallelism q, k, v column-parallel (heads / tp, kv heads /
    tp) and o_proj row-parallel, as Llama's (forms/pre_norm_gated.py; module_linear reads the rank's
    widths). The q/k norms of the rank's heads; OLMoE's norm over the whole q and k projections keeps its
    whole weight (replicated) and normalises the rank's shard (ASSUMPTION: Megatron-Core has no whole-width
    q/k norm; computing it exactly would all-reduce its statistics over the TP group, not counted)."""
    if a.traits.latent_attention:
        return _latent_attention(a)
    spec, ctx = a.spec, a.ctx
    n, h, low, act = ctx.n, spec.hidden_size, ctx.low, ctx.act
    q, k, v, o = a.traits.layer_linears[:4]
    ops = tp_gather("self_attn", h, act, ctx)
    ops += [module_linear(spec, lin, a.prefix, n, act, ctx, input="self_attn.input", consumers=3, consumer=j,
                          attention_input=True) for j, lin in enumerate((q, k, v))]
    d = spec.head_dim
    heads, kv_heads = heads_per_rank(spec, ctx), kv_heads_per_rank(spec, ctx)
    qw, kw = heads * d, kv_heads * d
    rope_in = low
    if a.traits.qk_norm != "none":
        per_head = a.traits.qk_norm == "head"
        for name, width, whole, nh in (("q_norm", qw, h, heads), ("k_norm", kw, spec.num_kv_heads * d, kv_heads)):
            rows, w = (n * nh, d) if per_head else (n, width)
            norm = rms_norm(f"self_attn.{name}", a.prefix, rows, w, low)
            # OlmoeAttention: q_norm = RMSNorm(hidden_size), k_norm over the kv projection: whole weights
            if not per_head and (name == "q_norm" or ctx.tp > 1):
                norm = Op(norm.kind, norm.name, norm.shapes, (Param(f"{a.prefix}self_attn.{name}.weight", (whole,)),),
                          norm.dtypes, norm.attrs)
            ops.append(norm)
        rope_in = promote(low, act)  # weight (fp32 under AMP) · normed.to(bf16) promotes
    ops.append(Op("rotary", "rotary", {"q": (n, qw), "k": (n, kw), "tables": (ctx.chunk, d)}, (),
                  {"input": rope_in, "tables": act}, {"first": a.index == 0}))
    masked = mask_materialised(spec, ctx)
    kernel = attention_kernel(spec, ctx, masked)
    ops += cp_exchange(spec, ctx, low)  # context parallelism's K/V ring, as Llama's (nothing at cp 1)
    attn = attention_op(spec, ctx, kernel, masked, promote(rope_in, act), "gqa")
    if a.traits.attention_sinks:  # gpt-oss: one learned sink logit per head, joined to each softmax row
        attn = Op(attn.kind, attn.name, attn.shapes, (Param(f"{a.prefix}self_attn.sinks", (heads,)),),
                  attn.dtypes, attn.attrs | {"sinks": True})
    ops.append(attn)
    ops.append(module_linear(spec, o, a.prefix, n, low, ctx, saves_input=False))
    return ops


# `named_parameters()` order inside a layer (a module's own parameters, then its children in __init__ order),
# by module path: attention (gpt-oss's own `sinks` first, then q, k, v, o, the q/k norms), the MLP (router and
# experts, the experts first in Qwen3MoeSparseMoeBlock; Qwen2's shared expert and its gate; a dense layer's
# gate, up, down), the two norms last.
_ORDER = ("self_attn.sinks", "self_attn.q_proj.", "self_attn.q_a_proj.", "self_attn.q_a_layernorm.",
          "self_attn.q_b_proj.", "self_attn.kv_a_proj_with_mqa.", "self_attn.kv_a_layernorm.", "self_attn.kv_b_proj.",
          "self_attn.k_proj.", "self_attn.v_proj.", "self_attn.o_proj.",
          "self_attn.q_norm.", "self_attn.k_norm.", "mlp.ROUTER", "mlp.experts.", "mlp.shared_expert.",
          "mlp.shared_experts.", "mlp.shared_expert_gate.", "mlp.gate_proj.", "mlp.up_proj.", "mlp.down_proj.", "input_layernorm.",
          "post_attention_layernorm.")


def registration_order(params: list[Param], prefix: str, router: str, experts_first: bool) -> list[Param]:
    """The layer's parameter tensors in the order the module registers them (the program lists them in run
    order); planner.models.params reads this order (Adafactor and the optimizers' tensor lists follow it)."""
    order = [x.replace("mlp.ROUTER", router + ".") for x in _ORDER]
    if experts_first:
        i = order.index(router + ".")
        order[i], order[i + 1] = order[i + 1], order[i]

    def rank(p: Param) -> int:
        name = p.name[len(prefix):]
        return next(i for i, x in enumerate(order) if name.startswith(x))

    return sorted(params, key=rank)


def router_op(spec: TransformerSpec, a: LayerArgs, x_dtype: str, consumers: int, consumer: int) -> Op:
    """The router on the rank's rows (the sequence-parallel shard under TP: Megatron-Core's MoELayer routes
    the local tokens, megatron/core/transformer/moe/moe_layer.py @d98e8a64 `route`; its weight replicated)."""
    ctx = a.ctx
    e, k, rows = spec.num_experts, spec.experts_per_token, ctx.rows
    name = a.traits.router_name
    fake = spec.fake_balanced_gate  # NeMo's FakeBalancedGate: no parameters, no graph (TransformerSpec)
    params = () if fake else (Param(f"{a.prefix}{name}.weight", (e, spec.hidden_size)),)
    if a.traits.router_bias and not fake:
        params += (Param(f"{a.prefix}{name}.bias", (e,)),)
    return Op("router", name, {"input": (rows, spec.hidden_size), "logits": (rows, e), "topk": (rows, k)},
              params, {"input": x_dtype, "compute": ctx.low, "probs": F32},
              {"renormalise": spec.norm_topk_prob, "consumers": consumers, "consumer": consumer,
               "input_name": "mlp.input", "topk_then_softmax": a.traits.topk_then_softmax,
               "bias": a.traits.router_bias and not fake, "fake": fake})


def shared_expert_ops(a: LayerArgs, x_dtype: str, readers: int, gathered_input: bool) -> list[Op]:
    """The shared expert (a SwiGLU MLP on every token; Qwen2MoeSparseMoeBlock runs it first, DeepseekV3MoE
    last: the same ops). On a tensor-parallel rank Megatron-Core's SharedExpertMLP (megatron/core/transformer/
    moe/shared_experts.py @d98e8a64: an MLP built with `tp_group=pg_collection.tp`; under sequence
    parallelism `gather_from_sequence_parallel_region` before linear_fc1 and
    `reduce_scatter_to_sequence_parallel_region` after linear_fc2): gate/up column-parallel (width / tp),
    down row-parallel. `gathered_input`: its gate/up read the all-gathered tensor, not the block's input (a
    DTensor plan saving the gathered rows); otherwise they are readers 1 and 2 of the block's input, whose
    local shard Megatron's column-parallel Linear saves."""
    spec, ctx = a.spec, a.ctx
    n, h = ctx.n, spec.hidden_size
    si = -(-spec.shared_expert_intermediate_size // ctx.tp)
    name = a.traits.shared_experts_name
    pre = f"{a.prefix}{name}."
    reads = ({"input": f"{name}.input", "consumers": 2} if gathered_input
             else {"input": "mlp.input", "consumers": readers})
    ops = tp_gather(name, h, x_dtype, ctx)
    ops += [linear(f"{name}.{p}", n, h, si, x_dtype, ctx, linear_params(pre + p + ".", h, si, False),
                   consumer=j if gathered_input else 1 + j, **reads, **_tp(ctx, "column"))
            for j, p in enumerate(("gate_proj", "up_proj"))]
    act_op, act_out = activation(f"{name}.act", spec.hidden_act, n * si, ctx.low, ctx)
    ops.insert(len(ops) - 1, act_op)  # act(gate(x)) runs before up(x)
    ops.append(Op("gated_mul", f"{name}.gate_mul_up", {"input": (n * si,), "output": (n * si,)}, (),
                  {"input": act_out, "other": ctx.low, "output": promote(act_out, ctx.low)}))
    ops.append(linear(f"{name}.down_proj", n, si, h, promote(act_out, ctx.low), ctx,
                      linear_params(pre + "down_proj.", si, h, False), input=f"{name}.product", as_is=True,
                      **_tp(ctx, "row")))
    return ops + tp_reduce(f"{name}.down_proj", h, ctx.low, ctx)


def _expert_ops(a: LayerArgs, s: int, x_dtype: str, wd: str) -> list[Op]:
    """The rank's local experts on its `s` dispatched token-expert pairs: gate_up grouped GEMM, the gate,
    down. Under expert-tensor parallelism (`ctx.etp` > 1) each expert's width is split over the etp ranks of
    its group, which all-gather their dispatched pairs first and reduce-scatter the down projection's
    partial sums after (Megatron-Core megatron/core/transformer/moe/token_dispatcher.py @d98e8a64,
    MoEAlltoAllTokenDispatcher `dispatch_postprocess`: `gather_from_sequence_parallel_region(...,
    group=self.tp_group)` with tp_group = pg_collection.expt_tp; `combine_preprocess`:
    `reduce_scatter_to_sequence_parallel_region`): s · etp pairs through GEMMs of width / etp, the same
    FLOPs, the gathered input saved by the first GEMM. The parameters stay the module's (E, ...) tensors;
    planner.pipeline.step splits their states over ep · etp."""
    spec, ctx = a.spec, a.ctx
    h, e, etp = spec.hidden_size, spec.num_experts, ctx.etp
    i, local, rows = -(-spec.moe_intermediate_size // etp), e // ctx.ep, s * etp
    full_i = spec.moe_intermediate_size
    ops: list[Op] = []
    if etp > 1:
        ops.append(Op("all_gather", "mlp.experts.etp_all_gather", {"input": (s, h), "output": (rows, h)}, (),
                      {"input": x_dtype, "output": x_dtype}, {"group": "etp", "phase": "forward",
                                                              "backward": "reduce_scatter"}))
    pre, t = f"{a.prefix}mlp.experts.", a.traits.experts_transposed
    up_params = (Param(pre + "gate_up_proj", (e, h, 2 * full_i) if t else (e, 2 * full_i, h)),)
    down_params = (Param(pre + "down_proj", (e, full_i, h) if t else (e, h, full_i)),)
    if a.traits.expert_bias:
        up_params += (Param(pre + "gate_up_proj_bias", (e, 2 * full_i)),)
        down_params += (Param(pre + "down_proj_bias", (e, h)),)
    ops.append(Op("expert_gemm", "mlp.experts.gate_up", {"input": (rows, h), "output": (rows, 2 * i),
                                                          "experts": (local,)},
                  up_params, {"input": x_dtype, "compute": wd, "output": wd}, {}))
    # Megatron-Core's fused weighted SwiGLU / quick-GeGLU and NeMo AutoModel's compiled one (ctx.fused_moe) save
    # the fc1 output and the pairs' probabilities only: `weighted` (the pairs) on the activation,
    # `fused_into_act` on the product
    fused = {"weighted": rows} if ctx.fused_moe else {}
    if a.traits.clamped_swiglu:  # gpt-oss: clamp, sigmoid(α·gate), (up + 1)·glu on interleaved halves
        ops.append(Op("activation", "mlp.experts.act", {"input": (rows * i,), "output": (rows * i,)}, (),
                      {"input": wd, "output": wd}, {"act": "clamped_swiglu", "moe_act": True} | fused))
        act_out = wd
    else:
        act_op, act_out = activation("mlp.experts.act", spec.hidden_act, rows * i, wd, ctx)
        ops.append(Op(act_op.kind, act_op.name, act_op.shapes, act_op.params, act_op.dtypes,
                      act_op.attrs | {"moe_act": True} | fused))
        ops.append(Op("gated_mul", "mlp.experts.gate_mul_up", {"input": (rows * i,), "output": (rows * i,)}, (),
                      {"input": act_out, "other": wd, "output": promote(act_out, wd)},
                      {"moe_act": True} | ({"fused_into_act": True} if ctx.fused_moe else {})))
    ops.append(Op("expert_gemm", "mlp.experts.down", {"input": (rows, i), "output": (rows, h), "experts": (local,)},
                  down_params, {"input": promote(act_out, wd), "compute": wd, "output": wd}, {}))
    if etp > 1:
        ops.append(Op("reduce_scatter", "mlp.experts.etp_reduce_scatter", {"input": (rows, h), "output": (s, h)},
                      (), {"input": wd, "output": wd}, {"group": "etp", "phase": "forward",
                                                        "backward": "all_gather"}))
    return ops


def moe_ops(a: LayerArgs, x_dtype: str) -> list[Op]:
    """The sparse MoE block (see the module docstring); `x_dtype` the post-attention norm's output. On a
    tensor-parallel rank the block reads the rank's rows (n / tp under sequence parallelism, which
    Megatron-Core requires of MoE with TP in training: moe_layer.py `forward` raises otherwise): the router
    and the experts' token-expert pairs are the local tokens' (the all-to-all runs over the EP group; no
    attention-TP collective touches the routed experts: token_dispatcher.py MoEAlltoAllTokenDispatcher
    gathers over the expert-TP group only, `_expert_ops`), the shared expert is tensor-parallel
    (`shared_expert_ops`)."""
    spec, ctx = a.spec, a.ctx
    n, h, e = ctx.rows, spec.hidden_size, spec.num_experts
    ep, imbalance = ctx.ep, ctx.moe_imbalance
    s = expert_pairs(spec, n, ep, imbalance)
    local = e // ep
    # the experts' compute dtype: transformers' grouped_mm casts the input to the weights' dtype (fp32 under fp32
    # and AMP, 16-bit in pure 16-bit or under an FSDP policy); torchtitan and Megatron-Core compute in 16 bits
    wd = ctx.low if ctx.experts_16bit else ctx.act
    shared = a.traits.shared_expert and spec.shared_expert_intermediate_size > 0
    gated = shared and a.traits.shared_expert_gate
    # the shared expert's gate/up read the all-gathered rows, which a DTensor plan saves (not the block input)
    apart = shared and ctx.tp > 1 and ctx.sp and ctx.sp_saves_gathered
    # Linears reading the block's input (each its own cast under autocast): router, shared gate/up, its gate
    readers = 1 + (2 if shared and not apart else 0) + (1 if gated else 0)
    ops: list[Op] = []
    if shared:
        ops += shared_expert_ops(a, x_dtype, readers, apart)
    shared_ops = len(ops)
    fused = {"fused_moe": True} if ctx.fused_moe else {}  # not `fused`: torch.compile's pointwise fusion
    router = router_op(spec, a, x_dtype, readers, 0)
    routed = fused if ctx.fused_router else {}  # TE's fused top-k (Megatron) or the framework's eager router
    ops.append(Op(router.kind, router.name, router.shapes, router.params, router.dtypes, router.attrs | routed))
    ops.append(Op("permute", "mlp.experts.permute", {"input": (n, h), "output": (s, h)}, (),
                  {"input": x_dtype, "output": x_dtype},
                  {"experts": local, "ep": ep, "bias_index": a.traits.expert_bias, "all_experts": e} | fused))
    if ep > 1:
        ops.append(Op("all_to_all", "mlp.experts.dispatch", {"input": (s, h), "output": (s, h)}, (),
                      {"input": x_dtype, "output": x_dtype}, {"ep": ep}))
    ops += _expert_ops(a, s, x_dtype, wd)
    if ep > 1:
        ops.append(Op("all_to_all", "mlp.experts.combine", {"input": (s, h), "output": (s, h)}, (),
                      {"input": wd, "output": wd}, {"ep": ep}))
    # Qwen2/Qwen3/OLMoE cast the top-k weights back to the logits' dtype; Mixtral keeps them fp32.
    weights = F32 if a.traits.topk_fp32 else ctx.low
    ops.append(Op("unpermute", "mlp.experts.unpermute", {"input": (s, h), "output": (n, h)}, (),
                  {"input": wd, "weights": weights, "output": promote(wd, weights)}, dict(fused)))
    if shared and not gated:  # DeepseekV3MoE: routed + shared_experts(residuals)
        ops.append(add("mlp.shared_add", n * h, promote(wd, weights), ctx.low, promote(promote(wd, weights), ctx.low)))
    if gated:
        ops.append(linear("mlp.shared_expert_gate", n, h, 1, x_dtype, ctx,
                          linear_params(f"{a.prefix}mlp.shared_expert_gate.", h, 1, False), input="mlp.input",
                          consumers=readers, consumer=readers - 1, **_tp(ctx, "replicated")))
        ops.append(Op("tanh", "mlp.shared_expert_gate.sigmoid", {"input": (n,), "output": (n,)}, (),
                      {"input": ctx.low, "output": ctx.low}, {"act": "sigmoid", "saves_output": True}))
        ops.append(Op("gated_mul", "mlp.shared_expert.scale", {"input": (n * h,), "output": (n * h,)}, (),
                      {"input": ctx.low, "other": ctx.low, "output": ctx.low}, {"broadcast": n}))
        ops.append(add("mlp.shared_add", n * h, x_dtype, ctx.low, promote(x_dtype, ctx.low)))
    # Megatron's selective recompute modules (planner.ir.transforms.selective_layer): "moe" is every op of the
    # block (moe_layer.py `moe_layer_recompute`: the MoELayer checkpointed on its input), "shared_experts" the
    # shared expert's (`shared_experts_recompute`), "moe_act" the experts' activation (TEGroupedMLP)
    return [Op(op.kind, op.name, op.shapes, op.params, op.dtypes,
               op.attrs | {"moe_block": True} | ({"shared_experts": True} if j < shared_ops else {}))
            for j, op in enumerate(ops)]


@layer_form("moe_gated")
def moe_layer(a: LayerArgs) -> list[Op]:
    """One decoder layer; on a tensor-parallel rank (ctx.tp > 1) that rank's ops, as Llama's
    (forms/pre_norm_gated.py): the norms and residual adds on the rank's rows, an all-gather (SP) before the
    column-parallel attention and dense MLP, a reduce-scatter (or all-reduce) after their row-parallel
    Linears; the sparse block as `moe_ops` says."""
    spec, ctx = a.spec, a.ctx
    rows, h, low, act = ctx.rows, spec.hidden_size, ctx.low, ctx.act
    norm1, norm2 = a.traits.layer_norm_names
    ops = [rms_norm(norm1, a.prefix, rows, h, act)]
    ops += _attention(a)
    ops += tp_reduce("self_attn.o_proj", h, low, ctx)
    resid = promote(low, act)
    ops.append(add("attention.residual_add", rows * h, low, act, resid))
    ops.append(rms_norm(norm2, a.prefix, rows, h, act))
    if spec.sparse_layer(a.index):
        ops += moe_ops(a, act)
        out = ops[-1].dtypes["output"]
    else:
        gate, up, down = a.traits.layer_linears[4:7]
        ops += (tp_gather("mlp", h, act, ctx) + mlp_ops(spec, a.traits, ctx, a.prefix, act, (gate, up), down)
                + tp_reduce("mlp.down_proj", h, low, ctx))
        out = low
    ops.append(add("mlp.residual_add", rows * h, out, resid, resid))
    return ops
