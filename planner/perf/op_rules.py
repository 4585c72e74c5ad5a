"""The FLOP and kernel interpreters of a program: per op kind, its forward matmul FLOPs (counted as
torch.utils.flop_counter.FlopCounterMode counts them: matrix products only, 2·m·n·k) and its CUDA kernels
(forward and backward, with their bytes and launches), built from planner.perf.kernels' primitives.

`tests/test_program.py` checks a program's FLOPs against planner.perf.flops and its kernels against
planner.perf.kernels for every catalog model, and lists where the old kernel list disagreed with the module.
"""

from __future__ import annotations

import math

from planner.ir.context import F32, Ctx
from planner.ir.interpret import register
from planner.ir.ops import Op
from planner.perf import kernels as K
from planner.perf.flops import attention_score_flops, matmul_flops
from planner.perf.kernels import Kernel

# ----------------------------------------------------------------------------------------- FLOPs


@register("flops", "linear")
def linear_flops(op: Op, ctx: Ctx) -> int:
    rows, n_in = op.shapes["input"]
    return matmul_flops(rows, op.shapes["output"][1], n_in)


@register("flops", "router")
def router_flops(op: Op, ctx: Ctx) -> int:
    """The gate's logits: (n × h)·(h × E); none for NeMo's FakeBalancedGate (no weight)."""
    if op.attrs.get("fake"):
        return 0
    rows, h = op.shapes["input"]
    return matmul_flops(rows, op.shapes["logits"][1], h)


@register("flops", "expert_gemm")
def expert_gemm_flops(op: Op, ctx: Ctx) -> int:
    """A grouped GEMM: each of the S token-expert pairs times its expert's (in × out) matrix, 2·S·in·out in
    all however the pairs split over the experts (FlopCounterMode's _grouped_mm formula)."""
    rows, n_in = op.shapes["input"]
    return matmul_flops(rows, op.shapes["output"][1], n_in)


@register("flops", "attention_eager", "attention_math", "attention_efficient", "attention_flash",
          "attention_cpu_flash")
def attention_flops(op: Op, ctx: Ctx) -> int:
    """Q·Kᵀ and P·V, counted full for causal models (FlopCounterMode's convention); on a model-parallel rank
    its heads and its s / cp queries against all s keys."""
    spec = op.attrs["spec"]
    flops = attention_score_flops(spec, ctx.b, ctx.chunk)
    return flops * op.attrs["heads"] * ctx.cp // spec.num_heads if ctx.sharded else flops


@register("flops", "embedding", "index", "layer_norm", "rms_norm", "activation", "gated_mul", "dropout",
          "residual_add", "tanh", "rotary", "attention_mask", "first_token", "cross_entropy", "batch_norm",
          "checkpoint", "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv", "quantize",
          "dequantize", "permute", "unpermute", "scale")
def no_matmul_flops(op: Op, ctx: Ctx) -> int:
    """Memory-bound ops: no matrix product (FlopCounterMode counts none)."""
    return 0


# --------------------------------------------------------------------------------------- kernels


@register("kernels", "linear")
def linear_kernels(op: Op, ctx: Ctx) -> list[Kernel]:
    """The autocast input cast and the GEMM (bias added in the epilogue)."""
    rows, n_in = op.shapes["input"]
    return K.linear(op.name, rows, op.shapes["output"][1], n_in, op.dtypes["input"], ctx, op.attrs["bias"],
                    fp8_recipe=op.attrs.get("fp8"))


@register("flops", "aten")
def traced_flops(op: Op, ctx: Ctx) -> int:
    """A traced op's FLOPs, torch.utils.flop_counter's formula as the tracer counted it."""
    return op.attrs["flops"]


@register("kernels", "aten")
def traced_kernels(op: Op, ctx: Ctx) -> list[Kernel]:
    """A traced op that launches a kernel is one kernel (planner.program.speed's rule: every tensor argument
    read once, every output written once), in its own phase."""
    if not op.attrs["kernel"]:
        return []
    return [Kernel(op.name, op.attrs["kernel_kind"], op.attrs["flops"], op.attrs["bytes"], 0, op.dtypes["compute"],
                   op.attrs["phase"])]


@register("kernels", "layer_norm")
def layer_norm_kernels(op: Op, ctx: Ctx) -> list[Kernel]:
    rows, width = op.shapes["input"]
    return [K.layernorm(op.name, rows, width, op.dtypes["input"], ctx)]


@register("kernels", "rms_norm")
def rms_norm_kernels(op: Op, ctx: Ctx) -> list[Kernel]:
    """transformers' RMSNorm in Python (K.rmsnorm); Transformer Engine's RMSNorm (ctx.fused_norms: NeMo
    AutoModel's `rms_norm: te`, Megatron's TENorm) is one kernel reading x and writing y and the fp32 rstd
    per row (its backward one pass too: kernels.backward_of)."""
    rows, width = op.shapes["input"]
    if ctx.fused_norms and not op.attrs.get("fused"):
        d = op.dtypes["input"]
        k = K.elementwise(f"{op.name}.te_rmsnorm", rows * width, (d,), (d,), d)
        return [K._with(k, bytes_written=k.bytes_written + 4 * rows)]
    return K.rmsnorm(op.name, rows, width, op.dtypes["input"])


@register("kernels", "dropout")
def dropout_kernels(op: Op, ctx: Ctx) -> list[Kernel]:
    return K.dropout(op.name, math.prod(op.shapes["input"]), op.dtypes["input"], op.attrs["p"])


@register("kernels", "activation")
def activation_kernels(op: Op, ctx: Ctx) -> list[Kernel]:
    if op.attrs.get("weighted"):  # the fused weighted SwiGLU / quick-GeGLU (Megatron's kernel, NeMo's compiled
        # one; planner.memory.op_saved.fused_moe_act_saved): one pass reading the gate and up halves and the
        # pairs' fp32 probabilities, writing the weighted product
        n, d = math.prod(op.shapes["input"]), op.dtypes["input"]
        k = K.elementwise(op.name, n, (d, d), (d,), d)
        return [K._with(k, bytes_read=k.bytes_read + 4 * op.attrs["weighted"])]
    if op.attrs.get("fused_glu"):  # Megatron's fused SwiGLU (op_saved.fused_glu_saved): one pass reading the
        # gate and up halves, writing the product (the product op itself runs no kernel: `fused_into_act`)
        n, d = math.prod(op.shapes["input"]), op.dtypes["input"]
        return [K.elementwise(op.name, n, (d, d), (d,), d)]
    if op.attrs["act"] == "clamped_swiglu":  # gpt-oss: two clamps, α·, sigmoid, ·, +1, ·: seven passes
        n, d = math.prod(op.shapes["input"]), op.dtypes["input"]
        return [K.elementwise(f"{op.name}.{k}", n, (d,) * (2 if k.startswith("mul") else 1), (d,), d)
                for k in ("clamp_gate", "clamp_up", "scale", "sigmoid", "mul_glu", "add_one", "mul_out")]
    return K.activation(op.name, op.attrs["act"], math.prod(op.shapes["input"]), op.dtypes["input"], ctx)


@register("kernels", "gated_mul", "residual_add", "tanh")
def elementwise_kernels(op: Op, ctx: Ctx) -> list[Kernel]:
    """One pass: reads its input(s), writes its output (none when fused into the weighted activation's)."""
    if op.attrs.get("fused_into_act"):
        return []
    reads = (op.dtypes["input"],) + ((op.dtypes["other"],) if "other" in op.dtypes else ())
    return [K.elementwise(op.name, math.prod(op.shapes["input"]), reads, (op.dtypes["output"],), op.dtypes["output"])]


@register("kernels", "scale")
def scale_add_kernels(op: Op, ctx: Ctx) -> list[Kernel]:
    """LoRA's `result + lora_B(...) * scaling`: one pass reading both, writing the sum (as
    planner.adapters.speed counts it)."""
    n = math.prod(op.shapes["input"])
    return [K.elementwise(op.name, n, (op.dtypes["input"], op.dtypes["other"]), (op.dtypes["output"],),
                          op.dtypes["output"])]


@register("kernels", "rotary")
def rotary_kernels(op: Op, ctx: Ctx) -> list[Kernel]:
    """RoPE on q and k: q·cos + cat(-x2, x1)·sin, five passes each; then repeat_kv copies k and v to all
    heads when the kv heads are fewer."""
    low = op.dtypes["input"]
    n, q = op.shapes["q"]
    kv = op.shapes["k"][1]
    ks = []
    for t, w in (("q", q), ("k", kv)):
        ks += [K.elementwise(f"rope.{t}.mul_cos", n * w, (low, low), (low,), low),
               K.elementwise(f"rope.{t}.neg", n * w // 2, (low,), (low,), low),
               K.elementwise(f"rope.{t}.cat", n * w, (low,), (low,), low),
               K.elementwise(f"rope.{t}.mul_sin", n * w, (low, low), (low,), low),
               K.elementwise(f"rope.{t}.add", n * w, (low, low), (low,), low)]
    if kv != q:
        ks += [K.elementwise(f"repeat_kv.{t}", n * q, (low,), (low,), low) for t in ("k", "v")]
    return ks


@register("kernels", "attention_eager", "attention_math", "attention_efficient", "attention_flash",
          "attention_cpu_flash")
def attention_kernels(op: Op, ctx: Ctx) -> list[Kernel]:
    return K.attention(op.attrs["spec"], ctx, 1.0, op.attrs.get("heads"))


@register("kernels", "attention_mask")
def mask_kernels(op: Op, ctx: Ctx) -> list[Kernel]:
    return K.attention_mask(op.attrs["spec"], ctx)


@register("kernels", "embedding")
def embedding_kernels(op: Op, ctx: Ctx) -> list[Kernel]:
    """index_select: reads n ids and n rows, writes n rows."""
    n, h = op.shapes["output"]
    w = op.dtypes["output"]
    k = K.elementwise(op.name, n * h, (w,), (w,), w)
    return [K._with(k, bytes_read=n * h * K.nbytes(w) + n * 8)]


@register("kernels", "cross_entropy")
def loss_kernels(op: Op, ctx: Ctx) -> list[Kernel]:
    model = op.attrs["model"]
    if model.loss == "multimodal" or not model.transformers:
        return []
    return K.loss(model.transformers[-1], ctx)


@register("kernels", "batch_norm")
def batch_norm_kernels(op: Op, ctx: Ctx) -> list[Kernel]:
    return K.dense_block(op.attrs["block"], ctx)


@register("kernels", "router")
def router_kernels(op: Op, ctx: Ctx) -> list[Kernel]:
    """The gate GEMM (no bias; the autocast input cast), softmax to fp32 over E, top-k, and the
    renormalising sum and division. NeMo's FakeBalancedGate: its uniform weights and round-robin indices
    (`torch.ones`, `torch.arange(...) % E`), two writes of rows × k."""
    rows, h = op.shapes["input"]
    if op.attrs.get("fake"):
        k = op.shapes["topk"][1]
        return [K.elementwise(f"{op.name}.weights", rows * k, (), (ctx.low,), ctx.low),
                K.elementwise(f"{op.name}.indices", rows * k, (), ("int64",), "int64")]
    e = op.shapes["logits"][1]
    k = op.shapes["topk"][1]
    ks = K.linear(op.name, rows, e, h, op.dtypes["input"], ctx, op.attrs.get("bias", False))
    ks.append(K.elementwise(f"{op.name}.softmax", rows * e, (ctx.low,), (F32,), F32))
    ks.append(K.elementwise(f"{op.name}.topk", rows * e, (F32,), (F32, "int64"), F32))
    if op.attrs["renormalise"]:
        ks.append(K.elementwise(f"{op.name}.renormalise", rows * k, (F32,), (F32,), F32))
    return ks


@register("kernels", "permute")
def permute_kernels(op: Op, ctx: Ctx) -> list[Kernel]:
    """Sort the S expert ids, gather S rows of the hidden state (a read and a write of S·h), and the
    per-expert histogram and offsets."""
    pairs, h = op.shapes["output"]
    d = op.dtypes["input"]
    return [K.elementwise(f"{op.name}.sort", pairs, ("int64",), ("int64", "int64"), "int64"),
            K.elementwise(f"{op.name}.gather", pairs * h, (d,), (d,), d),
            K.elementwise(f"{op.name}.histc", pairs, ("int64",), (), "int64")]


@register("kernels", "expert_gemm")
def expert_gemm_kernels(op: Op, ctx: Ctx) -> list[Kernel]:
    """The input cast to the weights' dtype (when it differs) and one grouped GEMM over the local experts,
    timed as one GEMM of S rows that reads every local expert's weights once."""
    rows, n_in = op.shapes["input"]
    n_out = op.shapes["output"][1]
    experts = op.shapes["experts"][0]
    dtype = op.dtypes["compute"]
    ks = []
    if op.dtypes["input"] != dtype:
        ks.append(K.elementwise(f"{op.name}.input_cast", rows * n_in, (op.dtypes["input"],), (dtype,), dtype))
    recipe = op.attrs.get("fp8")
    if recipe:  # TE's GroupedLinear: the input and the local experts' weights scaled and cast, an FP8 GEMM
        ks += K.fp8_casts(f"{op.name}.input", rows * n_in, dtype, recipe)
        ks += [K._with(k, param_work="weight_cast")
               for k in K.fp8_casts(f"{op.name}.weight", experts * n_in * n_out, dtype, recipe)]
        dtype = K.FP8_DTYPE
    g = K.gemm(op.name, rows, n_out, n_in, dtype)
    e = K.nbytes(dtype)
    ks.append(K._with(g, bytes_read=(rows * n_in + experts * n_in * n_out) * e))
    return ks


@register("kernels", "unpermute")
def unpermute_kernels(op: Op, ctx: Ctx) -> list[Kernel]:
    """Expert outputs times their weights, the scatter back to token order, the sum over top-k. Fused (TE's
    unpermutation without merging probabilities, Megatron-Core's and NeMo's `moe_permute_fusion`; the weights
    were applied in the activation): one kernel reading the S expert rows and writing each token's sum."""
    pairs, h = op.shapes["input"]
    rows = op.shapes["output"][0]
    d, w, out = op.dtypes["input"], op.dtypes["weights"], op.dtypes["output"]
    if op.attrs.get("fused_moe"):
        return [K._with(K.reduction(op.name, pairs * h, rows * h, out), bytes_read=pairs * h * K.nbytes(d))]
    return [K.elementwise(f"{op.name}.weight", pairs * h, (d,), (out,), out),
            K.elementwise(f"{op.name}.scatter", pairs * h, (out,), (out,), out),
            K._with(K.reduction(f"{op.name}.sum", pairs * h, rows * h, out), bytes_read=pairs * h * K.nbytes(out)
                    + pairs * K.nbytes(w))]


@register("kernels", "dequantize")
def dequantize_kernels(op: Op, ctx: Ctx) -> list[Kernel]:
    """bitsandbytes' dequantization of one 4-bit weight (gemm_4bit's dequantize + F.linear path): reads the
    packed weight and its constants, writes the weight in the compute dtype (the backward dequantizes again:
    planner.adapters.speed.program_kernels)."""
    from planner.adapters import nf4

    numel = op.shapes["output"][0]
    return [Kernel(op.name, "memory_bound", 0, nf4.weight_bytes(numel), numel * op.attrs["bytes_per_element"],
                   op.dtypes["output"])]


@register("kernels", "index", "first_token", "checkpoint", "all_reduce", "all_gather", "reduce_scatter",
          "all_to_all", "send_recv", "quantize")
def no_forward_kernels(op: Op, ctx: Ctx) -> list[Kernel]:
    """Views and index tensors made inside other kernels (first_token's backward kernel is added by the
    backward rule of planner.perf.kernels); collectives and quantisation are not emitted yet."""
    return []


