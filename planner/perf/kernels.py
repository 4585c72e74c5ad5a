"""One training step as the list of CUDA kernels it launches, from the shared block enumeration.

Which ops a transformer block runs is its program's (planner.families.forms emit the ops; planner.perf.op_rules
turns each op kind into the kernels below: `program_forward`); this module holds the kernel rules (the
primitives), the backward, cast and recompute kernels derived from a block's forward, the loss, the
optimizer and the collectives (issue 33: it used to keep its own copy of each layer, which disagreed with
the modules in five places, tests/test_program.py).

Why a kernel list: a step's time is not FLOPs / peak. Much of a BERT step is memory-bound (LayerNorm,
softmax, dropout, GELU, residual adds, casts, eager attention over s² scores, the optimizer), and small
micro-batches are bound by how fast the CPU can launch kernels. Each `Kernel` carries what the roofline
(`planner.perf.roofline`) needs: FLOPs, bytes read and written (dtype-aware, from the same shapes that
`planner.memory.activations` uses), the compute dtype, its kind and, for matmuls, the GEMM shape.

Symbols: b batch, s sequence, n = b·s tokens, h hidden, i intermediate, a heads, d head_dim, kv = kv_heads·d,
V vocabulary. "low" is the matmul dtype (16-bit under AMP or pure 16-bit), "act" the residual stream's
(fp32 under fp32 and AMP).

Rules, each a small function below:
- Linear (`gemm`): Y[m,n] = X[m,k]·W[k,n] (+bias in the epilogue), 2·m·n·k FLOPs. Backward: dX = dY·Wᵀ and
  dW = Xᵀ·dY (two GEMMs of the forward's size, flops.BACKWARD_TO_FORWARD) and a bias-gradient reduction.
- Under autocast every Linear casts its input to 16-bit again (autocast_mode.cpp caches only leaf weights),
  and every weight/bias is cast once per forward; backward casts the weight gradients back to fp32.
- Elementwise / reduction ops (`elementwise`): read their inputs once, write their outputs once.
- Attention: eager = two bmm's (kind "attention", timed as GEMMs) plus the scale, mask, softmax and dropout
  passes over the b·a·s² scores; sdpa / flash = one fused kernel whose IO is q, k, v, o (+ the bias when a
  4-D mask is materialised) and whose backward runs 2.5× the forward FLOPs (the recomputed Q·Kᵀ; as
  FlopCounterMode's sdpa backward counts).
- Activation checkpointing re-runs each layer's forward kernels in backward (Llama/Mistral skip the
  trailing down projection and residual add: checkpoint early stop, see planner.perf.flops).
- Optimizer: torch.optim's foreach AdamW launches one multi_tensor_apply kernel per `_foreach_*` call and
  per chunk of tensors; fused AdamW one pass; for-loop the same ops per tensor. GradScaler's unscale_ is one
  more foreach pass over the gradients.
- Gradient reduction (DDP all-reduce per bucket, ZeRO/FSDP reduce-scatter and all-gather, DataParallel's
  copies): kernels of kind communication carrying the bytes each GPU sends; planner.perf.throughput times
  them with the ring formulas and the overlap rules.

Identical layers share one record with `count` = number of layers, so a model's list is ~100 records,
built per configuration in well under a millisecond.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Literal

from planner import caches
from planner.families import family
from planner.memory.activations import Ctx, attention_kernel, mask_materialised
from planner.models.blocks import Block, model_blocks
from planner.parallel import get as strategy_of
from planner.perf.flops import (
    BACKWARD_TO_FORWARD,
    attention_score_flops,
    matmul_flops,
)
from planner.spec import BYTES_PER_DTYPE, BatchNormSpec, DenseSpec, ModelSpec, TrainConfig, TransformerSpec

Kind = Literal["gemm", "attention", "memory_bound", "optimizer", "communication"]
KINDS: tuple[str, ...] = ("gemm", "attention", "memory_bound", "optimizer", "communication")
Phase = Literal["forward", "backward", "recompute", "step"]
F32, I64 = "float32", "int64"

# torch/csrc/.../ATen/native/cuda/MultiTensorApply.cuh: one foreach launch covers at most
# depth_to_max_tensors[depth-1] tensors and depth_to_max_blocks (320) chunks of kChunkSize (65536) elements.
FOREACH_MAX_TENSORS = (110, 64, 48, 36, 30)
FOREACH_MAX_BLOCKS = 320
FOREACH_CHUNK_ELEMENTS = 65536
# Optimizer state bytes per parameter (fp32 moments; bitsandbytes 8-bit AdamW 1 byte each; Adafactor's
# factored second moment ~0 per parameter).
STATE_BYTES: dict[str, int] = {"adamw": 8, "adam": 8, "sgd": 0, "sgd-momentum": 4, "adafactor": 0, "adamw-8bit": 2}


@dataclass(frozen=True)
class Kernel:
    """One CUDA kernel of a training step (or `count` identical ones)."""

    name: str
    kind: Kind
    flops: int
    bytes_read: int
    bytes_written: int
    dtype: str  # compute dtype: float32 runs on CUDA cores (TF32 tensor cores only when enabled)
    phase: Phase = "forward"
    count: int = 1  # occurrences per micro-step (phase forward/backward/recompute) or per optimizer step
    launches: int = 1  # CUDA launches per occurrence (foreach kernels over tensor lists)
    gemm: tuple[int, int, int, int] | None = None  # (batch, m, n, k) of a matmul, for tile/wave efficiency
    collective: str = ""  # communication kernels: a COLLECTIVE_OVERLAP key ("allreduce", "dp_reduce", ...)
    # What the kernel does for a parameter, so that a transform (LoRA's frozen base: planner.adapters.speed)
    # selects kernels by what they are, not by their names (issue 33): "weight_grad" (dW = Xᵀ·dY of a
    # parameter's matmul), "bias_grad", "table_grad" (an embedding table's gradient), "weight_cast" /
    # "bias_cast" (autocast's 16-bit copy of a parameter), "grad_cast" (its gradient cast back to fp32).
    param_work: str = ""
    block_role: str = ""  # the role (planner.models.blocks) of the block the kernel belongs to
    # An elementwise pass's operand dtypes, (read, written), where `elementwise` built it: whether ATen's CUDA
    # loop casts per element (`dynamic_cast`), and what its backward reads and writes.
    dtypes_rw: tuple[tuple[str, ...], tuple[str, ...]] = ((), ())
    # The backward kernels autograd runs for this op where the generic rule (backward_of) is not what runs
    # (GPT-2's Python gelu_new under autocast); None: the generic rule.
    grads: tuple[Kernel, ...] | None = None

    @property
    def dynamic_cast(self) -> bool:
        """An elementwise pass over operands of different floating dtypes (bf16 and fp32 under autocast):
        ATen's CUDA loop then casts each element as it loads and stores it (CUDALoops.cuh gpu_kernel_impl, the
        `needs_dynamic_casting` branch: launch_unrolled_kernel with LoadWithCast/StoreWithCast, no vector
        loads), except a float32 -> 16-bit copy (Copy.cu direct_copy_kernel_cuda: gpu_kernel_nocast)."""
        return needs_dynamic_cast(*self.dtypes_rw)

    @property
    def bytes(self) -> int:
        return self.bytes_read + self.bytes_written


def _with(k: Kernel, **changes: object) -> Kernel:
    """dataclasses.replace for a Kernel, ~10x faster (no __init__ re-run: the fields are already valid);
    the kernel list is rebuilt for every new shape class during a search."""
    new = object.__new__(Kernel)
    new.__dict__.update(k.__dict__)
    new.__dict__.update(changes)
    return new


def nbytes(dtype: str) -> int:
    return BYTES_PER_DTYPE[dtype]


# ------------------------------------------------------------------------------------- primitives


def gemm(name: str, m: int, n: int, k: int, dtype: str, batch: int = 1, bias: bool = False,
         kind: Kind = "gemm") -> Kernel:
    """(m×k)·(k×n) in `dtype`, `batch` times: 2·batch·m·n·k FLOPs; reads both operands, writes the output."""
    e = nbytes(dtype)
    out_e = 2 if dtype.startswith("float8") else e  # an FP8 GEMM (torch._scaled_mm, TE) writes bf16
    read = batch * (m * k + k * n) * e + (n * out_e if bias else 0)
    return Kernel(name, kind, batch * matmul_flops(m, n, k), read, batch * m * n * out_e, dtype,
                  gemm=(batch, m, n, k))


def elementwise(name: str, numel: int, reads: Iterable[str], writes: Iterable[str], dtype: str) -> Kernel:
    """A memory-bound pass over `numel` elements: one element of each dtype in `reads` read, of each in
    `writes` written (e.g. add of two fp32: reads=(f32, f32), writes=(f32,))."""
    r = sum(nbytes(d) for d in reads)
    w = sum(nbytes(d) for d in writes)
    return Kernel(name, "memory_bound", 0, numel * r, numel * w, dtype, dtypes_rw=(tuple(reads), tuple(writes)))


FLOATS = frozenset({"float32", "bfloat16", "float16"})


def needs_dynamic_cast(reads: tuple[str, ...], writes: tuple[str, ...]) -> bool:
    """Whether ATen's CUDA elementwise loop casts per element (mixed floating dtypes among the operands),
    i.e. takes the unrolled, unvectorized path; a float32 -> 16-bit copy has its own vectorized kernel."""
    floats = {d for d in (*reads, *writes) if d in FLOATS}
    if len(floats) < 2:
        return False
    return not (reads == (F32,) and len(writes) == 1 and writes[0] in ("bfloat16", "float16"))


def reduction(name: str, numel: int, out: int, dtype: str) -> Kernel:
    """Sum over rows (bias gradients): read numel, write out."""
    return Kernel(name, "memory_bound", 0, numel * nbytes(dtype), out * nbytes(dtype), dtype)


def is_fused_attention(k: Kernel) -> bool:
    """The one fused SDPA / flash kernel of an attention (`attention`: FLOPs, no GEMM shape). The eager path's
    kernels are also of kind "attention" (so that the breakdown groups them), but its scale, mask add, softmax,
    dropout and casts are elementwise passes with no FLOPs, its two bmm's GEMMs (issue 36: the backward rule of
    the fused kernel, reads + 2 × writes, was applied to those passes, about twice their bytes)."""
    return k.kind == "attention" and k.gemm is None and k.flops > 0


def backward_of(k: Kernel) -> list[Kernel]:
    """Backward kernels of one forward kernel: two GEMMs per GEMM (dX = dY·Wᵀ, dW = Xᵀ·dY), 2.5× a fused
    attention kernel's FLOPs over q, k, v, o, dO in and dq, dk, dv out; one pass reading the gradient and
    the saved input(s) and writing the input gradient for an elementwise op."""
    if k.gemm is not None:
        b, m, n, kk = k.gemm
        dx = gemm(f"{k.name}.grad_input", m, kk, n, k.dtype, b, kind=k.kind)
        dw = gemm(f"{k.name}.grad_weight", kk, n, m, k.dtype, b, kind=k.kind)
        dw = _with(dw, param_work="weight_grad" if k.kind == "gemm" else "")  # bmm: both operands activations
        return [_with(x, phase="backward", count=k.count) for x in (dx, dw)]
    if is_fused_attention(k):  # fused SDPA / flash: one backward kernel
        flops = BACKWARD_TO_FORWARD * k.flops + k.flops // 2
        return [_with(k, name=f"{k.name}.backward", flops=flops, bytes_read=k.bytes_read + 2 * k.bytes_written,
                        bytes_written=k.bytes_read, phase="backward")]
    if k.grads is not None:  # what autograd runs for this op, listed where the op's kernels are built
        return [_with(g, phase="backward", count=k.count) for g in k.grads]
    # elementwise: read dY and the saved input(s), write dX (the forward's output size)
    return [_with(k, name=f"{k.name}.backward", bytes_read=k.bytes_read + k.bytes_written,
                  bytes_written=k.bytes_read, phase="backward", dtypes_rw=backward_dtypes(k.dtypes_rw))]


def backward_dtypes(rw: tuple[tuple[str, ...], tuple[str, ...]]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """A pass's backward operand dtypes: a cast's is the reverse cast; any other reads the output's gradient
    and the saved inputs and writes the inputs' gradients."""
    reads, writes = rw
    if len(reads) == 1 and len(writes) == 1:
        return writes, reads
    return (*writes, *reads), reads


# ----------------------------------------------------------------------------------------- layers


# One micro-batch's sizes, dtypes and kernel choice: the memory model's context (activations.Ctx), always on
# CUDA here (kernels are timed on the GPU). One class for both, so the two interpreters read the same record.
Shapes = Ctx


def cuda_shapes(b: int, s: int, precision: str, attention: str, padded: bool, flash_ok: bool = True) -> Ctx:
    """The context of a micro-batch of `b` samples of `s` tokens on CUDA."""
    return Ctx(b, s, precision, attention, "cuda", padded, flash_ok)


def shapes_for(model: ModelSpec, config: TrainConfig, ctx: Ctx | None, padded: bool | None,
               flash_ok: bool) -> Ctx:
    """The speed interpreter's context at `config.batch_size`: the pipeline's record (planner.pipeline.resolve
    builds it once; here at this micro-batch and on CUDA, where kernels are timed), or, for callers without
    one (tests, tools), built from `config`. Always the whole model's (Ctx.whole_model): the speed model's
    kernel table is one GPU's whole micro-step, which planner.perf.model_parallel splits per rank once; the
    per-rank kernels of each op (the op rules under a sharded record) are the program report's."""
    if ctx is not None:
        ctx = ctx.whole_model()
        return ctx if ctx.b == config.batch_size and ctx.backend == "cuda" else replace(
            ctx, b=config.batch_size, backend="cuda")
    return cuda_shapes(config.batch_size, config.seq_len, config.precision, config.attention,
                       model.inputs.attention_mask if padded is None else padded, flash_ok)


def linear(name: str, rows: int, out: int, inp: int, in_dtype: str, sh: Shapes, bias: bool = True,
           batch: int = 1, fp8_recipe: str | None = None) -> list[Kernel]:
    """nn.Linear on `rows` rows: the autocast input cast (when the input is not 16-bit) + the GEMM; an FP8
    Linear (`fp8_recipe`, planner.ir.fp8) scales and casts its input and weight first and runs the GEMM at the
    FP8 peak."""
    ks = []
    if sh.amp and in_dtype != sh.low:
        ks.append(elementwise(f"{name}.input_cast", batch * rows * inp, (in_dtype,), (sh.low,), sh.low))
    if fp8_recipe is None:
        ks.append(gemm(name, rows, out, inp, sh.low, batch, bias))
        return ks
    weight_dtype = F32 if sh.amp else sh.low  # fp32 master under autocast, the gathered 16-bit unit otherwise
    ks += fp8_casts(f"{name}.input", batch * rows * inp, sh.low, fp8_recipe)
    if not sh.fp8_gather:  # FSDP2's FP8 all-gather casts the shard before gathering (negligible)
        ks += [_with(k, param_work="weight_cast") for k in fp8_casts(f"{name}.weight", out * inp, weight_dtype,
                                                                      fp8_recipe)]
    ks.append(gemm(name, rows, out, inp, FP8_DTYPE, batch, bias))
    return ks


FP8_DTYPE = "float8_e4m3fn"


def fp8_casts(name: str, numel: int, dtype: str, recipe: str) -> list[Kernel]:
    """Scaling and casting one GEMM operand to FP8 (memory-bound). Dynamic scaling (torchao tensorwise /
    rowwise, TE current): an amax reduction (one read) then the scaled cast (read, write 1 B). TE delayed
    scaling uses the previous steps' amax: one fused cast that also records the amax. TE writes the
    transposed copy too (cast_transpose, for the backward's column-major operand on Hopper): 2 B written.
    Each kernel's backward pass (backward_of) stands for the backward's casts of the output gradient and
    torchao's recasts of input and weight."""
    te = recipe in ("delayed", "current", "mxfp8")
    writes = (FP8_DTYPE, FP8_DTYPE) if te else (FP8_DTYPE,)
    cast = elementwise(f"{name}.fp8_cast", numel, (dtype,), writes, FP8_DTYPE)
    if recipe == "delayed":
        return [cast]
    return [reduction(f"{name}.amax", numel, 1, dtype), cast]


def layernorm(name: str, rows: int, width: int, dtype: str, sh: Shapes) -> Kernel:
    """native_layer_norm (fp32 under CUDA autocast): reads x, weight and bias, writes y and fp32 mean/rstd
    per row (CUDA keeps the statistics in fp32: layer_norm_kernel.cu)."""
    d = F32 if sh.amp else dtype
    w = F32 if sh.amp or sh.precision == "fp32" else sh.low  # parameters: fp32 unless pure 16-bit
    k = elementwise(name, rows * width, (d,), (d,), d)
    return _with(k, bytes_read=k.bytes_read + 2 * width * nbytes(w), bytes_written=k.bytes_written + 2 * rows * 4)


def rmsnorm(name: str, rows: int, width: int, dtype: str) -> list[Kernel]:
    """HF LlamaRMSNorm in Python: x.to(fp32) → pow(2) → mean → +eps, rsqrt → x·rsqrt → .to(dtype) → weight·."""
    n = rows * width
    ks = [] if dtype == F32 else [elementwise(f"{name}.to_fp32", n, (dtype,), (F32,), F32)]
    ks += [elementwise(f"{name}.pow", n, (F32,), (F32,), F32), reduction(f"{name}.mean", n, rows, F32),
           elementwise(f"{name}.rsqrt", rows, (F32,), (F32,), F32),
           elementwise(f"{name}.mul", n, (F32, F32), (F32,), F32)]
    if dtype != F32:
        ks.append(elementwise(f"{name}.to_dtype", n, (F32,), (dtype,), dtype))
    ks.append(elementwise(f"{name}.weight", n, (dtype,), (dtype,), dtype))
    return ks


def dropout(name: str, numel: int, dtype: str, p: float) -> list[Kernel]:
    """CUDA native_dropout: reads x, writes y and a 1-byte mask (nothing when p == 0)."""
    return [elementwise(name, numel, (dtype,), (dtype, "bool"), dtype)] if p > 0 else []


def activation(name: str, act: str, numel: int, dtype: str, sh: Shapes) -> list[Kernel]:
    """The MLP nonlinearity: one kernel for the C implementations; GPT-2's Python gelu_new is six
    (pow, mul, add, mul, tanh, add, mul·0.5, mul), fp32 under CUDA autocast."""
    if act in ("gelu_new", "gelu_fast"):
        return python_gelu(name, numel, dtype, F32 if sh.amp else dtype)
    return [elementwise(name, numel, (dtype,), (dtype,), dtype)]


def python_gelu(name: str, numel: int, low: str, d: str) -> list[Kernel]:
    """transformers' NewGELUActivation, 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))), op by op: under CUDA
    autocast (`d` fp32, x 16-bit) `pow` is on the fp32 list, so x is first cast to fp32 (its own copy kernel)
    and everything after it is fp32; `x + …` and `0.5x · (…)` mix a 16-bit and an fp32 operand. The backward is
    what autograd runs (its formulas in tools/autograd/derivatives.yaml): both products of the last mul, the
    16-bit gradients cast back (the engine casts each input's gradient to that input's dtype), tanh_backward,
    the scalar products, pow's x²·3·grad (three kernels), and two adds that sum x's three gradients; the
    generic one-pass-per-op rule undercounted it by about a fifth under autocast."""
    one, x, cast = (d,), (low,), low != d
    fwd = [elementwise(f"{name}.half", numel, x, x, low)]
    if cast:
        fwd.append(elementwise(f"{name}.to_fp32", numel, x, one, d))
    fwd += [elementwise(f"{name}.pow", numel, one, one, d), elementwise(f"{name}.mul", numel, one, one, d),
            elementwise(f"{name}.add", numel, (low, d), one, d), elementwise(f"{name}.mul2", numel, one, one, d),
            elementwise(f"{name}.tanh", numel, one, one, d), elementwise(f"{name}.add1", numel, one, one, d),
            elementwise(f"{name}.mul3", numel, (low, d), one, d)]
    back = [elementwise(f"{name}.mul3.grad_half", numel, (d, d), one, d)]
    back += [elementwise(f"{name}.mul3.grad_half_cast", numel, one, x, low)] if cast else []
    back += [elementwise(f"{name}.mul3.grad_factor", numel, (d, low), one, d),
             elementwise(f"{name}.half.grad", numel, x, x, low),
             elementwise(f"{name}.tanh.grad", numel, (d, d), one, d),
             elementwise(f"{name}.mul2.grad", numel, one, one, d)]
    back += [elementwise(f"{name}.add.grad_cast", numel, one, x, low)] if cast else []
    back += [elementwise(f"{name}.mul.grad", numel, one, one, d),
             elementwise(f"{name}.pow.grad_square", numel, one, one, d),
             elementwise(f"{name}.pow.grad_times3", numel, one, one, d),
             elementwise(f"{name}.pow.grad", numel, (d, d), one, d)]
    back += [elementwise(f"{name}.to_fp32.grad", numel, one, x, low)] if cast else []
    back += [elementwise(f"{name}.grad_sum{i}", numel, (low, low), x, low) for i in (1, 2)]
    return [_with(fwd[0], grads=tuple(back)), *(_with(k, grads=()) for k in fwd[1:])]


def attention(spec: TransformerSpec, sh: Shapes, causal_fraction: float, heads: int | None = None) -> list[Kernel]:
    """Eager: QKᵀ bmm, scale, (+mask), softmax, dropout, (16-bit cast), P·V bmm, transpose copy.
    Fused (sdpa/flash): one kernel, its FLOPs as flops.attention_score_flops and its IO q, k, v, o.
    On a model-parallel rank: `heads` of one tensor-parallel rank, and the local s / cp queries against all
    s keys under context parallelism (planner.ir.context.Ctx.kv_s)."""
    b, s, a, d, low = sh.b, sh.chunk, heads or spec.num_heads, spec.head_dim, sh.low
    ctx = sh
    masked = mask_materialised(spec, ctx)
    kv_s = sh.kv_s
    s2 = b * a * s * kv_s
    half = attention_score_flops(spec, b, s, causal_fraction) // 2
    if sh.sharded:
        half = half * a * sh.cp // spec.num_heads
    if attention_kernel(spec, ctx, masked) == "eager":
        qk = _with(gemm("attention.scores", s, kv_s, d, low, b * a, kind="attention"), flops=half)
        pv = _with(gemm("attention.context", s, d, kv_s, low, b * a, kind="attention"), flops=half)
        soft = F32 if sh.amp or family(spec.family).fp32_softmax else low
        # q, k, v arrive as (b, a, s, d) views of the projections: bmm needs contiguous copies of each
        ks = [elementwise(f"attention.{t}_copy", sh.n * a * d, (low,), (low,), low) for t in ("q", "k", "v")]
        ks += [qk, elementwise("attention.scale", s2, (low,), (low,), low)]
        if masked:  # the 4-D mask is (b, 1, s, kv_s), broadcast over the heads: one b·s·kv_s read from HBM
            # (each sample's s·kv_s slice, 1 MiB fp32 at 512 tokens, is re-read by every head from L2), where
            # counting it per element read b·heads·s·kv_s of it (issue 36)
            add = elementwise("attention.mask_add", s2, (low,), (sh.act,), sh.act)
            ks.append(_with(add, bytes_read=add.bytes_read + b * s * kv_s * nbytes(sh.act)))
        ks.append(elementwise("attention.softmax", s2, (sh.act if masked else low,), (soft,), soft))
        ks += [_with(k, kind="attention") for k in dropout("attention.dropout", s2, soft, spec.attention_dropout)]
        if soft != low:
            ks.append(elementwise("attention.probs_cast", s2, (soft,), (low,), low))
        ks += [pv, elementwise("attention.transpose_copy", sh.n * a * d, (low,), (low,), low)]
        return [_with(k, kind="attention") for k in ks]
    e = nbytes(low)
    io_in = 3 * sh.n * a * d * e + (b * s * kv_s * e if masked else 0)
    io_out = sh.n * a * d * e + b * a * s * 4  # output + fp32 logsumexp
    return [Kernel("attention.fused", "attention", 2 * half, io_in, io_out, low, gemm=None)]


# Small kernels HF's masking_utils launches to build a 4-D mask (arange, comparisons, and/where, padding
# index), once per forward; the mask itself is b·s² elements in the model's dtype.
MASK_BUILD_LAUNCHES = 8


def attention_mask(spec: TransformerSpec, sh: Shapes) -> list[Kernel]:
    """Building the 4-D additive mask once per forward, when HF materialises it (mask_materialised)."""
    if not mask_materialised(spec, sh):
        return []
    k = elementwise("attention_mask.build", sh.b * sh.chunk * sh.s, ("bool",), (sh.act,), sh.act)
    return [_with(k, launches=MASK_BUILD_LAUNCHES)]


def recompute_of(spec: TransformerSpec, forward: list[Kernel]) -> list[Kernel]:
    """What checkpoint re-runs: the whole forward, less Llama/Mistral's trailing down projection and residual
    add (early stop once every saved tensor is recovered: nothing saves their outputs)."""
    ks = forward
    if family(spec.family).early_stop_skips_mlp_out:
        ks = [k for k in ks if ".mlp.down" not in k.name and ".mlp.residual_add" not in k.name]
    return [_with(k, name=f"{k.name}.recompute", phase="recompute") for k in ks]


def embedding_backward(spec: TransformerSpec, sh: Shapes, forward: list[Kernel]) -> list[Kernel]:
    """embedding_dense_backward per table: zero the V×h gradient, then scatter-add n rows into it."""
    w, h = sh.act, spec.hidden_size
    rows = {"word": spec.vocab_size, "position": spec.position_table, "token_type": spec.type_vocab_size}
    out = []
    for k in forward:
        table = k.name.removeprefix("embeddings.")
        if table == "attention_mask.build":
            continue  # built from the inputs: no gradient
        if table in rows:
            out.append(Kernel(f"{k.name}.backward", "memory_bound", 0, sh.n * (h * nbytes(w) + 8),
                              rows[table] * h * nbytes(w) + sh.n * h * nbytes(w), w, "backward",
                              param_work="table_grad"))
        else:
            out += backward_of(k)
    return out


def loss(spec: TransformerSpec, sh: Shapes) -> list[Kernel]:
    """cross_entropy = log_softmax + nll_loss over the logits (fp32 under autocast; the causal-LM loss
    upcasts with logits.float() first). Backward: nll_loss_backward writes the dense gradient, then
    log_softmax_backward."""
    rows = sh.n if spec.head in ("masked-lm", "causal-lm") else sh.b
    width = spec.vocab_size if spec.head in ("masked-lm", "causal-lm") else spec.num_labels
    if spec.head == "base":
        return []
    d = F32 if sh.amp or sh.low == F32 or spec.head == "causal-lm" else sh.low
    ks = []
    if d != sh.low:
        ks.append(elementwise("loss.logits_float", rows * width, (sh.low,), (d,), d))
    ks += [elementwise("loss.log_softmax", rows * width, (d,), (d,), d),
           _with(reduction("loss.nll_loss", rows, 1, d), bytes_read=rows * (nbytes(d) + 8))]
    return ks


def dense_block(block: Block, sh: Shapes) -> list[Kernel]:
    """nn.Linear / nn.BatchNorm1d on one feature vector per sample (the multimodal model's parts)."""
    layer = block.layer
    if isinstance(layer, BatchNormSpec):
        return [elementwise(f"{block.name}", sh.b * layer.num_features, (sh.act,), (sh.act,), sh.act)]
    assert isinstance(layer, DenseSpec)
    return linear(block.name, sh.b, layer.out_features, layer.in_features, sh.act, sh, layer.bias)


# ------------------------------------------------------------------------------------ the step


def _weights(block: Block, sh: Shapes | None = None) -> list[tuple[int, int]]:
    from planner.memory.activations import linear_params

    return linear_params(block, sh)


def amp_weight_casts(block: Block, sh: Shapes) -> tuple[list[Kernel], list[Kernel]]:
    """Autocast casts each weight and bias to 16-bit once per forward; backward casts their 16-bit
    gradients back to fp32 (the cast's backward) before AccumulateGrad."""
    if not sh.amp or (sh.fp8 and block.role == "layer"):  # FP8 Linears cast their weights themselves
        return [], []
    fwd, bwd = [], []
    for j, (w, bias) in enumerate(_weights(block, sh)):
        for name, numel in ((f"weight{j}", w), (f"bias{j}", bias)):
            if numel:
                part = "weight_cast" if name.startswith("weight") else "bias_cast"
                fwd.append(_with(elementwise(f"{block.name}.{name}.cast", numel, (F32,), (sh.low,), sh.low),
                                 param_work=part))
                bwd.append(_with(elementwise(f"{block.name}.{name}.grad_cast", numel, (sh.low,), (F32,), F32),
                                   phase="backward", param_work="grad_cast"))
    return fwd, bwd


def bias_grads(forward: list[Kernel]) -> list[Kernel]:
    """Bias gradients: a column sum of dY for each GEMM that adds a bias (addmm's backward)."""
    out = []
    for k in forward:
        if k.gemm is not None and k.kind == "gemm":
            b, m, n, kk = k.gemm
            if k.bytes_read > b * (m * kk + kk * n) * nbytes(k.dtype):
                out.append(_with(reduction(f"{k.name}.grad_bias", m * n, n, k.dtype), phase="backward",
                                   count=k.count, param_work="bias_grad"))
    return out


def first_token_backward(block: Block, sh: Shapes) -> list[Kernel]:
    """hidden[:, 0] (BERT pooler, RoBERTa/DistilBERT classifier heads) is a view, but its backward
    (select_backward) writes a zero n×h gradient and copies the b×h rows into it."""
    layer = block.layer
    if not isinstance(layer, TransformerSpec):
        return []
    first = block.role == "pooler" or (block.role == "head" and layer.head == "sequence-classification"
                                       and family(layer.family).classifier in ("dense_tanh", "pre_classifier_relu"))
    if not first:
        return []
    e, h = nbytes(sh.act), layer.hidden_size
    return [Kernel(f"{block.role}.first_token.backward", "memory_bound", 0, sh.b * h * e, sh.n * h * e, sh.act,
                   "backward", launches=2)]


def program_forward(block: Block, model: ModelSpec, sh: Shapes, causal_fraction: float) -> list[Kernel]:
    """Forward kernels of a transformer block, read from its program (planner.families.forms: the ops the
    layer form emits, each timed by its kind's rule in planner.perf.op_rules; issue 33). The attention op's
    kernels take the causal fraction counted, a speed constant, so they are made here."""
    from planner.families.forms import block_ops, load_forms
    from planner.ir.interpret import apply, load_rules

    load_rules()
    load_forms()
    out: list[Kernel] = []
    chain: list[Kernel] = []  # kernels of consecutive ops torch.compile fuses (planner.ir.transforms)
    for op in block_ops(block, model, sh):  # this block only: the caller asks for one layer of a stack
        if op.kind.startswith("attention_") and op.kind != "attention_mask":
            ks = attention(op.attrs["spec"], sh, causal_fraction, op.attrs.get("heads"))
        else:
            ks = apply("kernels", op, sh)
        if op.attrs.get("fused"):
            chain += ks
            continue
        out += fused(chain) + ks
        chain = []
    return out + fused(chain)


def fused(chain: list[Kernel]) -> list[Kernel]:
    """One Inductor kernel for a run of pointwise kernels (torch.compile): it reads what the run reads from
    outside (each kernel's reads less what the kernel before it wrote) and writes the run's last output; one
    launch. Empty for an empty run."""
    if not chain:
        return []
    read = chain[0].bytes_read + sum(max(0, k.bytes_read - p.bytes_written)
                                     for p, k in zip(chain, chain[1:], strict=False))
    return [_with(chain[-1], name=f"{chain[0].name}.fused", kind="memory_bound", flops=0, bytes_read=read,
                  bytes_written=chain[-1].bytes_written, launches=1, gemm=None)]


def block_kernels(block: Block, model: ModelSpec, sh: Shapes, config: TrainConfig,
                  causal_fraction: float) -> list[Kernel]:
    """Forward, backward and recompute kernels of one block (count 1; the caller folds identical layers)."""
    layer = block.layer
    if isinstance(layer, TransformerSpec):
        fwd = program_forward(block, model, sh, causal_fraction)
    else:
        fwd = dense_block(block, sh)
    fwd = [_with(k, name=f"{block.role}.{k.name}" if block.role != "embeddings" else k.name) for k in fwd]
    if isinstance(layer, TransformerSpec) and block.role == "embeddings":
        bwd = embedding_backward(layer, sh, fwd)
    else:
        bwd = [b for k in reversed(fwd) for b in backward_of(k)]
    bwd += bias_grads(fwd) + first_token_backward(block, sh)
    casts, cast_grads = amp_weight_casts(block, sh)
    ks = casts + fwd + bwd + cast_grads
    from planner.ir.transforms import recompute_of as recompute_mode

    mode, modules = recompute_mode(config)
    if mode == "full" and block.role == "layer" and isinstance(layer, TransformerSpec):
        # the recomputation runs in an autocast region of its own (torch/utils/checkpoint.py restores the
        # forward's autocast state around it), whose cast cache starts empty: the outermost region's exit
        # cleared the forward's (torch/amp/autocast_mode.py __exit__: clear_autocast_cache), so every weight
        # is cast to 16 bits again
        ks += recompute_of(layer, fwd) + [_with(k, name=f"{k.name}.recompute", phase="recompute") for k in casts]
    if mode == "selective" and block.role == "layer" and isinstance(layer, TransformerSpec):
        ks += selective_recompute(block, model, sh, causal_fraction, modules)
    return [_with(k, block_role=block.role) for k in ks]


def selective_recompute(block: Block, model: ModelSpec, sh: Shapes, causal_fraction: float,
                        modules: tuple[str, ...]) -> list[Kernel]:
    """The forward kernels of the ops selective recomputation re-runs in backward (planner.ir.transforms
    .selective_layer), as checkpointing's are counted: phase "recompute", timed like the forward."""
    from planner.families.forms import block_ops, load_forms
    from planner.ir.interpret import apply, load_rules
    from planner.ir.transforms import selective_layer

    load_rules()
    load_forms()
    out: list[Kernel] = []
    for op in selective_layer(block_ops(block, model, sh), modules):
        if not op.attrs.get("recomputed"):
            continue
        if op.kind.startswith("attention_") and op.kind != "attention_mask":
            ks = attention(op.attrs["spec"], sh, causal_fraction, op.attrs.get("heads"))
        else:
            ks = apply("kernels", op, sh)
        out += [_with(k, name=f"{block.role}.{k.name}.recompute", phase="recompute") for k in ks]
    return out


def foreach_launches(tensors: int, elements: int, depth: int) -> int:
    """Launches of one `_foreach_*` call over `tensors` tensors of `elements` in all, with `depth` tensor
    lists (MultiTensorApply.cuh: a launch holds <= max_tensors[depth] tensors and <= 320 chunks of 65536)."""
    if tensors == 0:
        return 0
    by_tensors = math.ceil(tensors / FOREACH_MAX_TENSORS[min(depth, 5) - 1])
    by_chunks = math.ceil(elements / FOREACH_CHUNK_ELEMENTS / FOREACH_MAX_BLOCKS)
    return max(by_tensors, by_chunks, 1)


# AdamW foreach (torch/optim/adam.py `_multi_tensor_adam`, decoupled weight decay, capturable=False):
# (name, tensor lists read, written, depth); p param, g grad, m exp_avg, v exp_avg_sq, t temporary.
ADAMW_FOREACH_OPS: tuple[tuple[str, str, str], ...] = (
    ("mul_(params, 1 - lr*wd)", "p", "p"),
    ("lerp_(exp_avg, grads, 1 - beta1)", "mg", "m"),
    ("mul_(exp_avg_sq, beta2)", "v", "v"),
    ("addcmul_(exp_avg_sq, grads, grads)", "vg", "v"),
    ("sqrt(exp_avg_sq)", "v", "t"),
    ("div_(sqrt, bias_correction2_sqrt)", "t", "t"),
    ("add_(sqrt, eps)", "t", "t"),
    ("addcdiv_(params, exp_avg, sqrt, -step_size)", "pmt", "p"),
)
# One fused pass (torch._fused_adamw_, apex FusedAdam): read p, g, m, v; write p, m, v.
FUSED_OPS: dict[str, tuple[str, str]] = {
    "adamw": ("pgmv", "pmv"), "adam": ("pgmv", "pmv"), "sgd": ("pg", "p"), "sgd-momentum": ("pgm", "pm"),
    "adafactor": ("pgv", "pv"), "adamw-8bit": ("pgmv", "pmv"),
}


@caches.lru(None, scope="model", key="(parameters, tensors, precision, optimizer, impl, ...)")
def optimizer_kernels(n_params: int, n_tensors: int, precision: str, optimizer: str, impl: str
                      ) -> tuple[Kernel, ...]:
    """The optimizer step's kernels on `n_params` parameters in `n_tensors` tensors (the local shard under
    ZeRO/FSDP), plus GradScaler's unscale_ (fp16 only: one foreach pass reading and writing every gradient).

    Element sizes: p and g are the parameter dtype (fp32 under AMP), m and v `STATE_BYTES`/2 each.
    """
    p_bytes = 4 if precision in ("fp32", "amp-fp16", "amp-bf16", "fp8") else 2
    state = STATE_BYTES[optimizer]
    size = {"p": p_bytes, "g": p_bytes, "m": state / 2, "v": state / 2, "t": 4}
    ks: list[Kernel] = []
    if precision in ("amp-fp16", "fp16"):
        ks.append(Kernel("grad_scaler.unscale_", "optimizer", 0, n_params * p_bytes, n_params * p_bytes, F32,
                         "step", launches=foreach_launches(n_tensors, n_params, 1)))
    adam = optimizer in ("adamw", "adam") and impl != "fused"
    ops = ADAMW_FOREACH_OPS if adam else (("fused", *FUSED_OPS[optimizer]),)
    for name, reads, writes in ops:
        r = round(n_params * sum(size[x] for x in reads))
        w = round(n_params * sum(size[x] for x in writes))
        depth = len(set(reads + writes))
        if impl == "for-loop":
            launches, count = 1, n_tensors  # one kernel per tensor per op
        else:
            launches, count = foreach_launches(n_tensors, n_params, depth), 1
        ks.append(Kernel(f"optimizer.{name}", "optimizer", 0, r // count, w // count, F32, "step", count=count,
                         launches=launches))
    return tuple(ks)


# How each collective overlaps compute (planner.perf.throughput.communication_seconds times them):
# "backward": hidden behind backward up to `allreduce_overlap` of it (DDP buckets, ZeRO-1/2 reduce-scatter);
# "forward_prefetch" / "backward_prefetch": ZeRO-3/FSDP's per-unit collectives, the next unit's fetched while
# this one computes: all but one unit's share hides, unit by unit, behind the compute beside it (never
# more than that phase's compute; planner.perf.collectives.prefetch_hidden); "exposed": not hidden (ZeRO's
# post-step all-gather, every DataParallel copy: replicate runs before forward, the gradient reduce after the whole backward).
COLLECTIVE_OVERLAP = {"allreduce": "backward", "reduce_scatter": "backward", "all_gather": "exposed",
                      "fsdp_all_gather": "forward_prefetch", "fsdp_all_gather_backward": "backward_prefetch",
                      "fsdp_reduce_scatter": "backward_prefetch", "dp_broadcast": "exposed",
                      "dp_reduce": "exposed", "dp_io": "exposed", "dp_flatten": "exposed",
                      "dp_replicate": "exposed"}
# torch.cuda.comm.broadcast_coalesced / reduce_add_coalesced (DataParallel's replicate and its backward)
# flatten tensors into buffers of at most buffer_size = 10485760 bytes: one NCCL call per buffer.
DP_COALESCE_BYTES = 10485760


def communication_kernels(parallelism: str, world: int, grad_bytes: int, grad_accum: int,
                          bucket_cap_mb: float, units: int = 1, dp_io_bytes: int = 0,
                          param_bytes: int | None = None, reduce_once: bool = False,
                          gather_backward: bool = True) -> tuple[Kernel, ...]:
    """The gradient / parameter exchange of one optimizer step as kernels of kind communication, with the
    bytes each GPU sends (`bytes_read`) per occurrence, `count` occurrences per optimizer step and `launches`
    NCCL calls per occurrence (each pays NCCL's latency: planner.perf.collectives.nccl_latency_s).

    DDP: one all-reduce of all gradients per optimizer step (no_sync on the other micro-steps), launched
    per bucket (`launches` = ceil(bytes / bucket_cap_mb)). ZeRO-1 is torch's ZeroRedundancyOptimizer over
    DDP (as planner.memory.parallel models it): DDP's all-reduce, then each rank sends its updated shard to the
    others (docs: "each rank will broadcast its parameters to all other peers"), an all-gather's volume,
    exposed. ZeRO-2: gradients are partitioned, so they are reduce-scattered after EVERY backward, not once per
    optimizer step (DeepSpeed issue #2252, maintainer: "gradient reduction is required after every backward
    because of gradient partitioning"), + the all-gather of updated parameters: with one micro-step the same
    volume as DDP's all-reduce (reduce-scatter + all-gather = all-reduce).
    ZeRO-3/FSDP FULL_SHARD: per micro-step, an all-gather of the parameters in forward and again in backward
    (FSDP's default reshard_after_forward=True frees them after each unit's forward; ZeRO-3 releases them
    likewise), and a reduce-scatter of the gradients instead of an all-reduce: 3 halves of an all-reduce, 1.5x
    DDP's traffic (Rajbhandari et al. 2020, §7.2.2), with no all-gather after the step (parameters stay
    sharded). Each is issued per unit (`units`: FSDP's wrapped modules, ZeRO-3's fetched sub-modules).
    `gather_backward` False: FSDP with reshard_after_forward off (TrainConfig.reshard_after_forward, the
    framework's default) keeps each unit unsharded from its forward to its backward, so the backward all-gather
    is not issued (pytorch/pytorch torch/distributed/fsdp/_fully_shard/_fully_shard.py fully_shard docstring:
    "If False, then this keeps the unsharded parameters in memory after forward and avoids the all-gather in
    backward"; FSDP1 SHARD_GRAD_OP likewise).
    `reduce_once`: FSDP1 under `no_sync()` for gradient accumulation (frameworks.Framework.
    no_sync_accumulation: Accelerate): the gradients accumulate unsharded and are reduce-scattered once, at
    the last micro-step ("FSDP will accumulate the full model gradients (instead of gradient shards) until the
    eventual sync", torch FullyShardedDataParallel.no_sync); the parameters are still gathered every
    micro-step (FULL_SHARD frees them after forward and after backward also under no_sync: torch/distributed/
    fsdp/_runtime_utils.py `_should_free_in_backward`).
    DataParallel (torch.nn.DataParallel, one process): per micro-step, replicate() broadcasts the parameters
    from GPU 0 to the others (broadcast_coalesced), the inputs are scattered from and the outputs gathered to
    GPU 0 (`dp_io_bytes` per replica, through GPU 0's links one replica after another), and backward's
    ReduceAddCoalesced reduces every replica's gradients onto GPU 0 (nccl.reduce, torch/nn/parallel/comm.py
    reduce_add): a broadcast and a reduce of the parameter bytes, each ~ bytes / bus bandwidth (NCCL's
    broadcast and reduce move the whole buffer through every GPU's link, not 1/n of it as a ring all-reduce's
    steps do), in buffers of DP_COALESCE_BYTES; both flatten the tensors into those buffers on the GPU (a
    read and a write of the bytes each: `dp_flatten` reads and writes 2x them); plus its fixed thread/replicate cost."""
    strategy = strategy_of(parallelism)
    if world <= 1 or strategy.uses_one_gpu:
        return ()
    calls = {"buckets": max(1, math.ceil(grad_bytes / (bucket_cap_mb * 2**20))), "units": max(1, units),
             "dp_chunks": max(1, math.ceil(grad_bytes / DP_COALESCE_BYTES)), "one": 1, "none": 0}
    # `param_bytes`: what the all-gathers move (the framework's gather dtype, frozen parameters included);
    # None: as many bytes as the gradients (every parameter trains, gathered in its own dtype)
    params = grad_bytes if param_bytes is None else param_bytes
    payload = {"grads": grad_bytes, "params": params, "flatten": 2 * grad_bytes, "dp_io": dp_io_bytes, "none": 0}
    return tuple(Kernel(c.name, "communication", 0, payload[c.payload], payload[c.payload], F32, "step",
                        count=grad_accum if c.per_micro_step and not (reduce_once and c.collective ==
                                                                     "fsdp_reduce_scatter") else 1,
                        launches=calls[c.launches],
                        collective=c.collective)
                 for c in strategy.communication
                 if gather_backward or c.collective != "fsdp_all_gather_backward")


def _fold(kernels: list[Kernel]) -> list[Kernel]:
    """Merge identical records (same layer repeated) into one with a summed count."""
    seen: dict[tuple, Kernel] = {}
    for k in kernels:
        key = (k.name, k.kind, k.phase, k.flops, k.bytes_read, k.bytes_written, k.dtype, k.launches, k.gemm)
        first = seen.get(key)
        seen[key] = k if first is None else _with(first, count=first.count + k.count)
    return list(seen.values())


def training_kernels(model: ModelSpec, config: TrainConfig, *, causal_fraction: float = 1.0,
                     flash_ok: bool = True, padded: bool | None = None, ctx: Ctx | None = None) -> list[Kernel]:
    """Forward, backward and recompute kernels of one micro-step training every parameter, identical layers
    folded (`count`). Adapters (LoRA) reshape this list: planner.perf.micro_step.micro_kernels. `ctx`: the
    pipeline's context record (`shapes_for`)."""
    sh = shapes_for(model, config, ctx, padded, flash_ok)
    out: list[Kernel] = []
    done: set[tuple[int, bool]] = set()
    for block in model_blocks(model):
        layer = block.layer
        if block.role == "layer" and isinstance(layer, TransformerSpec):
            # the layers of a stack are alike but for a mixture-of-experts model's dense ones (DeepSeek-V3's
            # first_k_dense_replace, Qwen2-MoE's mlp_only_layers): one record per kind, counted as many times as
            # the stack has layers of that kind (the first layer's alone had stood for all of DeepSeek-V3's 61)
            sparse = layer.sparse_layer(block.index)
            if (id(layer), sparse) not in done:
                done.add((id(layer), sparse))
                n = sum(1 for i in range(layer.num_layers) if layer.sparse_layer(i) == sparse)
                out += [_with(k, count=k.count * n) for k in block_kernels(block, model, sh, config, causal_fraction)]
            continue
        out += block_kernels(block, model, sh, config, causal_fraction)
    if model.loss != "none" and model.transformers and model.loss != "multimodal":
        fwd = loss(model.transformers[-1], sh)
        out += fwd + [b for k in reversed(fwd) for b in backward_of(k)]
    return _fold(out)
