"""Ops every layer form shares: the linear op, embeddings, the final norm, the pooler, the task heads, the
loss, and the multimodal model's nn.Linear / nn.BatchNorm1d blocks.

Sources: transformers 5 modeling_bert / modeling_roberta / modeling_distilbert / modeling_gpt2 /
modeling_llama (module names, registration order, which ops run); what each op saves and launches is the
interpreters' business (planner.memory.op_saved, planner.perf.op_rules).
"""

from __future__ import annotations

from typing import Any

from planner.families.traits import Family, Linear
from planner.ir.context import (
    F32,
    I64,
    Ctx,
    autocast_fp32_op,
    ffn_per_rank,
    heads_per_rank,
    kv_heads_per_rank,
    mask_materialised,
    promote,
    vocab_per_rank,
)
from planner.ir.ops import Op, Param
from planner.models.blocks import Block
from planner.spec import BatchNormSpec, DenseSpec, ModelSpec, TransformerSpec


def width(spec: TransformerSpec, w: str, ctx: Ctx | None = None) -> int:
    """A traits.Width in elements, on one tensor-parallel rank of `ctx` (Megatron-Core's layout: the
    column-parallel q/k/v and up/gate outputs and the vocabulary split over tp, the hidden size whole)."""
    if w == "h":
        return spec.hidden_size
    if ctx is not None and ctx.tp > 1:
        if w == "i":
            return ffn_per_rank(spec, ctx)
        q, kv = heads_per_rank(spec, ctx) * spec.head_dim, kv_heads_per_rank(spec, ctx) * spec.head_dim
        if w == "q":
            return q
        if w == "kv":
            return kv
        if w == "qkv":
            return q + 2 * kv
        return spec.num_labels if w == "labels" else vocab_per_rank(spec, ctx)
    if w == "i":
        return spec.intermediate_size
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    if w == "q":
        return q
    if w == "kv":
        return kv
    if w == "qkv":
        return q + 2 * kv
    return spec.num_labels if w == "labels" else spec.vocab_size


def has_bias(spec: TransformerSpec, lin: Linear) -> bool:
    b = lin.bias
    return b == "yes" or (b == "attention" and spec.attention_bias) or (b == "mlp" and spec.mlp_bias)


def linear_params(prefix: str, n_in: int, n_out: int, bias: bool, conv1d: bool = False,
                  weight: bool = True) -> tuple[Param, ...]:
    """nn.Linear: weight (out, in) [+ bias (out,)]; GPT-2's Conv1D stores the weight transposed (in, out).
    `weight=False`: the weight is tied to another module's (an LM decoder tied to the token table)."""
    w = [Param(f"{prefix}weight", (n_in, n_out) if conv1d else (n_out, n_in))] if weight else []
    return tuple(w + ([Param(f"{prefix}bias", (n_out,))] if bias else []))


def linear(name: str, rows: int, n_in: int, n_out: int, in_dtype: str, ctx: Ctx, params: tuple[Param, ...],
           **attrs: Any) -> Op:
    """A Linear on `rows` rows of `in_dtype`. attrs for the saved rule: `input` (the saved input's name),
    `consumers`/`consumer` (Linears reading one new tensor: under autocast each saves its own cast),
    `saves_input` False when another op already counts that storage, `as_is` when the input is saved as it
    is (never cast); `bias` whether the GEMM adds a bias."""
    bias = any(p.name.endswith("bias") for p in params) if "bias" not in attrs else attrs.pop("bias")
    return Op("linear", name, {"input": (rows, n_in), "output": (rows, n_out)}, params,
              {"input": in_dtype, "compute": ctx.low, "output": ctx.low},
              {"input": f"{name}.input", "consumers": 1, "consumer": 0, "saves_input": True, "bias": bias} | attrs)


def module_linear(spec: TransformerSpec, lin: Linear, prefix: str, rows: int, in_dtype: str, ctx: Ctx,
                  **attrs: Any) -> Op:
    """A family record's Linear (traits.Linear) as an op, its parameters named under `prefix`."""
    n_in, n_out = width(spec, lin.n_in, ctx), width(spec, lin.n_out, ctx)
    bias = True if lin.conv1d else has_bias(spec, lin)
    if ctx.tp > 1:  # which way tensor parallelism splits it (Megatron-Core ColumnParallelLinear / RowParallel)
        attrs["tp"] = "column" if lin.n_in == "h" and lin.n_out in ("q", "kv", "qkv", "i", "vocab") else \
            "row" if lin.n_out == "h" and lin.n_in in ("q", "i") else "replicated"
    return linear(lin.name, rows, n_in, n_out, in_dtype, ctx,
                  linear_params(prefix + lin.name + ".", n_in, n_out, bias, lin.conv1d), **attrs)


def layer_norm(name: str, prefix: str, rows: int, w: int, in_dtype: str, ctx: Ctx, op_name: str = ""
               ) -> tuple[Op, str]:
    """nn.LayerNorm (module `prefix + name`; the op named `op_name` or `name`) and the dtype it returns (fp32
    under CUDA autocast: layer_norm is on its fp32 list)."""
    out = F32 if ctx.amp and autocast_fp32_op("layer_norm", ctx.backend) else in_dtype
    return Op("layer_norm", op_name or name, {"input": (rows, w), "output": (rows, w)},
              (Param(f"{prefix}{name}.weight", (w,)), Param(f"{prefix}{name}.bias", (w,))),
              {"input": in_dtype, "compute": out, "output": out}), out


def rms_norm(name: str, prefix: str, rows: int, w: int, in_dtype: str, **attrs: Any) -> Op:
    """HF's RMSNorm (computed in fp32, returned in the input's dtype)."""
    return Op("rms_norm", name, {"input": (rows, w), "output": (rows, w)}, (Param(f"{prefix}{name}.weight", (w,)),),
              {"input": in_dtype, "compute": F32, "output": in_dtype}, {"input_is_new": True} | attrs)


def dropout(name: str, numel: int, dtype: str, p: float) -> Op:
    return Op("dropout", name, {"input": (numel,), "output": (numel,)}, (), {"input": dtype, "output": dtype},
              {"p": p})


def add(name: str, numel: int, a: str, b: str, out: str) -> Op:
    return Op("residual_add", name, {"input": (numel,), "output": (numel,)}, (),
              {"input": a, "other": b, "output": out})


def attention_op(spec: TransformerSpec, ctx: Ctx, kernel: str, masked: bool, q_dtype: str, qkv: str,
                 **attrs: Any) -> Op:
    """One attention call; its kind is the kernel that runs (planner.ir.context.attention_kernel). `qkv`
    says how q, k, v reach a fused kernel: "separate" (three n·H projections), "fused" (views of GPT-2's one
    n·3h c_attn output), "gqa" (Llama: k, v at kv-head size unless repeated)."""
    heads, kv = heads_per_rank(spec, ctx), kv_heads_per_rank(spec, ctx)
    n, H = ctx.n, heads * spec.head_dim
    s2 = ctx.b * heads * ctx.chunk * ctx.kv_s
    return Op(f"attention_{kernel}", "attention", {"q": (n, H), "k": (n, kv * spec.head_dim),
              "scores": (s2,), "output": (n, H)}, (), {"q": q_dtype, "compute": ctx.low, "output": ctx.low},
              {"spec": spec, "masked": masked, "qkv": qkv, "heads": heads, "kv_heads": kv} | attrs)


# ------------------------------------------------------------------------------ model parallelism


def tp_gather(name: str, width_: int, dtype: str, ctx: Ctx) -> list[Op]:
    """Sequence parallelism's all-gather of the residual stream (rows -> n) before a column-parallel linear
    (Megatron-Core `gather_from_sequence_parallel_region`; its backward a reduce-scatter); nothing without SP.
    Without SP a column-parallel linear's input gradient is all-reduced in backward (`copy_to_tensor_model_
    parallel_region`): an all_reduce op whose `phase` is backward, so the speed model can time it."""
    if ctx.tp <= 1:
        return []
    if ctx.sp:
        # `regather`: Megatron's column-parallel linear saved only the local shard, so backward all-gathers it
        # again before the weight gradient (layers.py backward `dist_all_gather_func(..., input, ...)`)
        return [Op("all_gather", f"{name}.sp_all_gather", {"input": (ctx.rows, width_), "output": (ctx.n, width_)},
                   (), {"input": dtype, "output": dtype}, {"group": "tp", "phase": "forward",
                                                           "backward": "reduce_scatter",
                                                           "regather": not ctx.sp_saves_gathered})]
    return [Op("all_reduce", f"{name}.tp_grad_all_reduce", {"input": (ctx.n, width_), "output": (ctx.n, width_)},
               (), {"input": dtype, "output": dtype}, {"group": "tp", "phase": "backward"})]


def tp_reduce(name: str, width_: int, dtype: str, ctx: Ctx) -> list[Op]:
    """A row-parallel linear's partial sums combined: all-reduce (n rows stay), or with SP a reduce-scatter
    to n / tp rows (Megatron-Core `reduce_from_tensor_model_parallel_region` /
    `reduce_scatter_to_sequence_parallel_region`; the latter's backward an all-gather)."""
    if ctx.tp <= 1:
        return []
    if ctx.sp:
        return [Op("reduce_scatter", f"{name}.sp_reduce_scatter", {"input": (ctx.n, width_),
                   "output": (ctx.rows, width_)}, (), {"input": dtype, "output": dtype},
                   {"group": "tp", "phase": "forward", "backward": "all_gather"})]
    return [Op("all_reduce", f"{name}.tp_all_reduce", {"input": (ctx.n, width_), "output": (ctx.n, width_)}, (),
               {"input": dtype, "output": dtype}, {"group": "tp", "phase": "forward"})]


def cp_exchange(spec: TransformerSpec, ctx: Ctx, dtype: str) -> list[Op]:
    """Context parallelism's ring exchange of keys and values: cp - 1 steps, each sending this rank's local
    k and v chunk to the next rank (TransformerEngine `AttnFuncWithCPAndKVP2P`, Megatron-Core's default
    cp_comm_type "p2p"); backward sends them again with their gradients. Each rank saves only its own chunk
    (the ring's received chunks are freed after each step)."""
    if ctx.cp <= 1:
        return []
    kv = kv_heads_per_rank(spec, ctx) * spec.head_dim
    return [Op("send_recv", "attention.cp_ring", {"input": (ctx.n, 2 * kv), "output": (ctx.n, 2 * kv)}, (),
               {"input": dtype, "output": dtype}, {"group": "cp", "steps": ctx.cp - 1, "phase": "forward"})]


def activation(name: str, act: str, numel: int, dtype: str, ctx: Ctx) -> tuple[Op, str]:
    """The MLP nonlinearity and the dtype of its output: GPT-2's Python gelu_new runs its tanh branch in
    fp32 under CUDA autocast (pow is on the fp32 list), so its output is promoted."""
    out = dtype
    if act in ("gelu_new", "gelu_fast") and ctx.amp and autocast_fp32_op("pow", ctx.backend):
        out = promote(dtype, F32)
    return Op("activation", name, {"input": (numel,), "output": (numel,)}, (), {"input": dtype, "output": out},
              {"act": act}), out


def module(name: str, ops: list[Op]) -> list[Op]:
    """`ops` tagged as one module of the layer (attrs `megatron_module`: Megatron's module name, which
    selective recomputation selects by: planner.ir.transforms.selective_layer; not `module`, which names the
    torch module an op's parameters belong to, as LoRA's transform reads it)."""
    return [Op(op.kind, op.name, op.shapes, op.params, op.dtypes, op.attrs | {"megatron_module": name})
            for op in ops]


def mlp_ops(spec: TransformerSpec, traits: Family, ctx: Ctx, prefix: str, in_dtype: str,
            up: tuple[Linear, ...], down: Linear) -> list[Op]:
    """Feed-forward: up (gate and up for SwiGLU, both reading the same input) -> act -> (· up) -> down."""
    n, i = ctx.n, width(spec, "i", ctx)
    gated = len(up) == 2
    ops = [module_linear(spec, lin, prefix, n, in_dtype, ctx, input="mlp.input", consumers=len(up), consumer=k,
                         fc1=True) for k, lin in enumerate(up)]
    act, act_out = activation("mlp.act", spec.hidden_act, n * i, ctx.low, ctx)
    # Megatron-Core's fused SwiGLU (ctx.fused_glu, `bias_swiglu_impl`): one function saving the fc1 output only
    fused_glu = gated and ctx.fused_glu and spec.hidden_act == "silu"
    if fused_glu:
        act = Op(act.kind, act.name, act.shapes, act.params, act.dtypes, act.attrs | {"fused_glu": True})
    ops.insert(1 if gated else len(ops), act)  # SwiGLU: act(gate(x)) runs before up(x)
    if gated:
        ops.append(Op("gated_mul", "mlp.gate_mul_up", {"input": (n * i,), "output": (n * i,)}, (),
                      {"input": act_out, "other": ctx.low, "output": promote(act_out, ctx.low)},
                      {"fused_into_act": True} if fused_glu else {}))
        ops.append(module_linear(spec, down, prefix, n, promote(act_out, ctx.low), ctx, input="mlp.product",
                                 as_is=True))
    else:
        relu = spec.hidden_act == "relu"  # relu saves its output, which the down projection saves too
        ops.append(module_linear(spec, down, prefix, n, act_out, ctx, input="mlp.act_output", as_is=relu))
    return ops


# ------------------------------------------------------------------------------------ other blocks


def embedding_ops(spec: TransformerSpec, traits: Family, ctx: Ctx, base: str, token_types_in_batch: bool
                  ) -> list[Op]:
    """Token (and learned position, token-type) look-ups, their adds, the encoders' LayerNorm, dropout, and
    HF's 4-D mask when it is built. The token-type table is looked up whenever the module has one
    (BertEmbeddings / RobertaEmbeddings call it unconditionally, with the buffered or gathered ids when the
    batch has none), not only when the batch carries token_type_ids."""
    n, s, h, act = ctx.n, ctx.chunk, spec.hidden_size, ctx.act
    lookups = [("word", traits.word_table, width(spec, "vocab", ctx))]
    index: list[Op] = []
    if traits.position_ids == "from_input_ids":
        index.append(Op("index", "embeddings.position_ids", {"output": (n,)}, (), {"output": I64}))
    if spec.position_table:
        lookups.append(("position", traits.position_table_name, spec.position_table))
    if spec.type_vocab_size:
        lookups.append(("token_type", traits.token_type_table, spec.type_vocab_size))
    params = {t: Param(f"{base}{name}.weight", (rows, h)) for t, name, rows in lookups}
    ops = list(index)
    token_types = {"gathered": n, "buffer": s}.get(traits.token_types)
    if token_types and not token_types_in_batch:
        ops.append(Op("index", "embeddings.token_type_ids", {"output": (token_types,)}, (), {"output": I64}))
    if traits.position_ids == "arange":
        ops.append(Op("index", "embeddings.position_ids", {"output": (s,)}, (), {"output": I64}))
    if ctx.tp > 1:
        # Vocabulary-parallel look-up: ids outside this rank's rows are shifted and zeroed into a new index
        # tensor, which the look-up saves for its backward (Megatron-Core VocabParallelEmbedding.forward:
        # `masked_input = input_.clone() - self.vocab_start_index; masked_input[input_mask] = 0`; DTensor's
        # MaskPartial does the same), then the partial rows are all-reduced (reduce-scattered under SP).
        ops.append(Op("index", "embeddings.masked_input", {"output": (n,)}, (), {"output": I64}))
    for t, _, rows in lookups:
        ops.append(Op("embedding", f"embeddings.{t}", {"input": (n,), "table": (rows, h), "output": (n, h)},
                      (params[t],), {"input": I64, "output": act}))
    ops += [add(f"embeddings.add{j}", n * h, act, act, act) for j in range(len(lookups) - 1)]
    ops += tp_reduce("embeddings", h, act, ctx)
    n = ctx.rows  # what follows (the encoders' norm and dropout) holds the residual stream's rows
    if traits.embedding_norm:
        norm_prefix = base + traits.embedding_norm_name.rsplit(".", 1)[0] + "." if "." in traits.embedding_norm_name \
            else base
        op, _ = layer_norm(traits.embedding_norm_name.rsplit(".", 1)[-1], norm_prefix, n, h, act, ctx)
        ops.append(Op(op.kind, "embeddings.LayerNorm", op.shapes, op.params, op.dtypes, op.attrs))
    if traits.embedding_dropout:
        ops.append(dropout("embeddings.dropout", n * h, act, spec.embedding_dropout))
    if mask_materialised(spec, ctx):
        ops.append(Op("attention_mask", "attention_mask.build", {"output": (ctx.b * s * ctx.s,)}, (),
                      {"input": "bool", "output": act}, {"spec": spec}))
    return _registration_order(ops, traits)


def _registration_order(ops: list[Op], traits: Family) -> list[Op]:
    """RobertaEmbeddings registers its position table after the LayerNorm: move that parameter so the
    program's parameter list is in `module.parameters()` order (the ops stay in run order)."""
    if not traits.positions_after_norm:
        return ops
    pos = next((op for op in ops if op.name == "embeddings.position"), None)
    norm = next((op for op in ops if op.name == "embeddings.LayerNorm"), None)
    if pos is None or norm is None:
        return ops
    moved = Op(pos.kind, pos.name, pos.shapes, (), pos.dtypes, pos.attrs | {"table_after": "embeddings.LayerNorm"})
    norm2 = Op(norm.kind, norm.name, norm.shapes, norm.params + pos.params, norm.dtypes,
               norm.attrs | {"owns_position_table": True})
    return [moved if op is pos else norm2 if op is norm else op for op in ops]


def final_norm_ops(spec: TransformerSpec, traits: Family, ctx: Ctx, base: str) -> list[Op]:
    """The decoders' final norm: the layer form decides (GPT2Model builds nn.LayerNorm ln_f, LlamaModel
    LlamaRMSNorm norm), as for the layers' own norms."""
    if traits.gated_mlp:
        return [rms_norm(traits.final_norm_name, base, ctx.rows, spec.hidden_size, ctx.act)]
    return [layer_norm(traits.final_norm_name, base, ctx.rows, spec.hidden_size, ctx.act, ctx)[0]]


def first_token(ctx: Ctx, spec: TransformerSpec, consumer: str) -> Op:
    """hidden[:, 0] for a Linear (`consumer`): without autocast the Linear saves the view, which keeps the
    whole n·h hidden state; under autocast a 16-bit copy of b·h."""
    return Op("first_token", f"{consumer}.first_token", {"input": (ctx.n, spec.hidden_size),
              "output": (ctx.b, spec.hidden_size)}, (), {"input": ctx.act, "output": ctx.act}, {"consumer": consumer})


def pooler_ops(spec: TransformerSpec, ctx: Ctx, base: str) -> list[Op]:
    """BertPooler: dense(hidden[:, 0]) -> tanh."""
    h, b = spec.hidden_size, ctx.b
    x = F32 if ctx.amp else ctx.act
    return [first_token(ctx, spec, "pooler.dense"),
            linear("pooler.dense", b, h, h, x, ctx, linear_params(f"{base}pooler.dense.", h, h, True),
                   saves_input=False),
            Op("tanh", "pooler.tanh", {"input": (b * h,), "output": (b * h,)}, (), {"input": ctx.low,
               "output": ctx.low}, {"act": "tanh", "saves_output": True})]


def classifier_dropout(spec: TransformerSpec) -> float:
    return spec.classifier_dropout if spec.classifier_dropout is not None else spec.hidden_dropout


def head_ops(spec: TransformerSpec, traits: Family, ctx: Ctx, root: str) -> list[Op]:
    """The task head (transformers *ForSequenceClassification / *ForMaskedLM / *ForCausalLM), parameters
    named from the model's root."""
    b, n, h, low, act = ctx.b, ctx.n, spec.hidden_size, ctx.low, ctx.act
    x = F32 if ctx.amp else act
    if spec.head == "sequence-classification":
        p = classifier_dropout(spec)
        lins = traits.classifier_linears
        form = traits.classifier
        if form == "score_all_tokens":
            return [module_linear(spec, lins[0], root, n, act, ctx, input="score.input")]
        if form == "pooled":
            return [dropout("head.dropout", b * h, low, p),
                    module_linear(spec, lins[0], root, b, low, ctx, input="classifier.input", as_is=True,
                                  saves_input=p > 0)]
        dense, out = lins
        ops: list[Op] = []
        if p > 0 and form == "dense_tanh":
            ops += [dropout("head.dropout", b * h, act, p),
                    module_linear(spec, dense, root, b, act, ctx, input="classifier.dense.input")]
        else:
            ops += [first_token(ctx, spec, dense.name), module_linear(spec, dense, root, b, x, ctx, saves_input=False)]
        kind = "tanh" if form == "dense_tanh" else "relu"
        ops.append(Op("tanh", f"classifier.{kind}", {"input": (b * h,), "output": (b * h,)}, (),
                      {"input": low, "output": low}, {"act": kind, "saves_output": True}))
        ops.append(dropout("classifier.dropout", b * h, low, p))
        ops.append(module_linear(spec, out, root, b, low, ctx, input="classifier.out_proj.input", as_is=True,
                                 saves_input=p > 0))
        return ops
    if spec.head == "masked-lm":
        dense, decoder = traits.lm_head_linears
        untied = not spec.tie_word_embeddings
        norm_prefix = traits.lm_head_norm.rsplit(".", 1)
        act_op, act_out = activation("lm.transform.act", spec.hidden_act, n * h, low, ctx)
        ln, ln_dtype = layer_norm(norm_prefix[-1], (root + norm_prefix[0] + ".") if len(norm_prefix) == 2 else root,
                                  n, h, act_out, ctx)
        ln = Op(ln.kind, "lm.transform.LayerNorm", ln.shapes, ln.params, ln.dtypes, ln.attrs)
        vocab = width(spec, "vocab", ctx)
        own_bias = Param(root + traits.lm_head_bias, (vocab,))
        dec_params = linear_params(root + decoder.name + ".", h, vocab,
                                   untied and traits.lm_head != "transform_projector", weight=untied)
        if traits.lm_head == "transform_projector":  # DistilBERT: vocab_projector's own bias, after its weight
            dec = linear("lm.decoder", n, h, vocab, ln_dtype, ctx, dec_params + (own_bias,),
                         input="lm.decoder.input")
            first: tuple[Param, ...] = ()
        else:  # BERT / RoBERTa: the head's own bias (V,) registered first, then dense, norm, decoder
            dec = linear("lm.decoder", n, h, vocab, ln_dtype, ctx, dec_params, input="lm.decoder.input",
                         bias=True)
            first = (own_bias,)
        dense_op = module_linear(spec, dense, root, n, act, ctx, input="lm.transform.dense.input")
        dense_op = Op(dense_op.kind, "lm.transform.dense", dense_op.shapes, first + dense_op.params, dense_op.dtypes,
                      dense_op.attrs | {"bias": True})
        return [dense_op, act_op, ln, dec]
    if spec.head == "causal-lm":
        lin = traits.lm_head_linears[0]
        untied = not spec.tie_word_embeddings
        op = module_linear(spec, lin, root, n, act, ctx, input="lm_head.input")
        return [*tp_gather("lm_head", h, act, ctx), op if untied else Op(op.kind, op.name, op.shapes, (), op.dtypes,
                                                                          op.attrs)]
    return []


def loss_ops(model: ModelSpec, ctx: Ctx) -> list[Op]:
    """The loss after the head (one cross_entropy op; its saved tensors are the memory rule's)."""
    if model.loss == "none" or (model.loss != "multimodal" and not model.transformers):
        return []
    return [Op("cross_entropy", "loss", {}, (), {}, {"model": model})]


def dense_ops(block: Block, model: ModelSpec, ctx: Ctx, prefix: str) -> list[Op]:
    """The multimodal model's nn.Linear and nn.BatchNorm1d blocks (jobs/modeling.MultimodalBert)."""
    layer = block.layer
    if isinstance(layer, BatchNormSpec):
        f = layer.num_features
        return [Op("batch_norm", block.name, {"input": (ctx.b, f), "output": (ctx.b, f)},
                   (Param(f"{prefix}weight", (f,)), Param(f"{prefix}bias", (f,))), {"input": ctx.act},
                   {"block": block, "model": model})]
    assert isinstance(layer, DenseSpec)
    return [linear(block.name, ctx.b, layer.in_features, layer.out_features, ctx.act, ctx,
                   linear_params(prefix, layer.in_features, layer.out_features, layer.bias),
                   block=block, model=model)]
