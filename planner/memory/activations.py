"""Bytes that autograd saves for backward, per block, for the Hugging Face models and the multimodal model.

Why this is not one formula: what a forward saves depends on the exact ops the modeling code runs, the
attention kernel, the precision (and which ops autocast keeps in fp32) and the device's kernels. So each
tensor group has its own small function below, returning the *storages* it saves (`Saved`: name, element
count, dtype). Which groups a transformer block has is its program's: the layer forms
(planner.families.forms) emit the block's ops and planner.memory.op_saved maps each op kind to the functions
below (`block_saved`, `layer_saved`; issue 33). A block's `saved_bytes` is their sum, each storage counted once, rounded the way the CUDA
caching allocator rounds allocations. `tests/saved_tensors.py` measures the same thing on the real modules
(saved-tensor hooks under FakeTensorMode) and `tests/test_activations.py` checks these functions against it.

Symbols: b batch, s sequence, n = b·s tokens, h hidden, H = heads·head_dim (= h here), KV = kv_heads·head_dim,
i intermediate, V vocabulary, a heads. "low" is the dtype of matmul outputs (bf16/fp16 under AMP or pure 16-bit,
fp32 otherwise); "act" the dtype of the residual stream (fp32 for fp32 and AMP, 16-bit for pure 16-bit).

For comparison, Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models")
count 34·s·b·h + 5·a·s²·b bytes per layer for 16-bit eager attention. Our BERT layer on CUDA in pure
16-bit gives exactly that plus the LayerNorm statistics (2·2·n·4 bytes, fp32 on CUDA): 3 q/k/v copies,
context, 2 LayerNorm inputs, the LayerNorm output fed to the MLP, the layer input (2 bytes each), two 1-byte
dropout masks, GELU input and output (2·4h·2) = 34; softmax output, probs after dropout (2 each) and a
1-byte mask = 5 per attention score. Where HF differs: under AMP every Linear saves its own 16-bit cast of
its input (Q, K and V three casts), the residual stream and LayerNorm inputs stay fp32, scores that meet
an fp32 mask are promoted to fp32; GPT-2's Python `gelu_new` saves 4 tensors of n·i instead of 1; Llama's
RMSNorm saves fp32 copies; fused SDPA kernels save no s² tensor at all.

Besides `saved_bytes` / `kept_bytes`, each block reports its AMP cast cache (`autocast_cache_bytes`:
alive until autocast exits, checkpointed or not), the logits the model returns (`retained_output_bytes`; on a
layer, the KV cache it returns with `use_cache`, beyond what it saves: planner.memory.kv_cache)
and unsaved temporaries: `backward_transient_bytes` of transformer layers is op-by-op
(`layer_backward_transient`, equal to the traced autograd peak: tests/test_backward_transients.py); the
other blocks' and every `forward_transient_bytes` are rough estimates (`_transients`).
Module-level constants (CUDA_ALLOCATION_ROUND_BYTES, EFFICIENT_LSE_ALIGN, ...) can be overridden by
assignment; every function reads them at call time.

CUDA is the default backend. `backend="cpu"` reproduces the CPU kernels so the tests can compare with
real modules on this CPU-only machine; every CPU/CUDA difference is one named function:
`dropout_saved`, `norm_stats_dtype`, `autocast_fp32_op`, `sdpa_kernel`, `math_sdpa_dtype`,
`sdpa_bias`, `attention_lse` and `alloc_bytes`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from planner.errors import PlannerError
from planner.families import family
from planner.ir import fp8

# The context record and the CUDA/CPU rules live in planner.ir.context (issue 33: the layer forms read them
# too); re-exported here for the formulas below and their callers.
from planner.ir.context import (  # noqa: E402, F401
    BOOL,
    F32,
    FLASH_MAX_HEAD_DIM,
    I64,
    LOW_DTYPE,
    Ctx,
    attention_kernel,
    autocast_fp32_op,
    ffn_per_rank,
    heads_per_rank,
    mask_bytes_dtype,
    mask_materialised,
    math_sdpa_dtype,
    norm_stats_dtype,
    promote,
    rank_context,
    sdpa_kernel,
    sdpa_math_for_mask_grad,
    vocab_per_rank,
)
from planner.memory import kv_cache
from planner.models.blocks import Block, model_blocks
from planner.spec import (
    BYTES_PER_DTYPE,
    Backend,
    BatchNormSpec,
    DenseSpec,
    ModelSpec,
    TrainConfig,
    TransformerSpec,
)

# Allocation granularity of the CUDA caching allocator, bytes (c10/cuda/CUDACachingAllocator.cpp,
# kMinBlockSize = 512): torch.cuda.memory_allocated counts every tensor rounded up to it.
CUDA_ALLOCATION_ROUND_BYTES = 512
# Memory-efficient SDPA pads its logsumexp rows to kAlignLSE = 32 queries (aten/src/ATen/native/transformers/
# cuda/mem_eff_attention/kernel_forward.h; attention.cu `_efficient_attention_forward` allocates
# logsumexp {B, num_heads, ceil_div(max_seqlen_q, kAlignLSE) * kAlignLSE} fp32).
EFFICIENT_LSE_ALIGN = 32
# Memory-efficient SDPA pads an unaligned bias's last dim (attention.cpp `preprocess_mask`,
# mem_eff_alignment = 8; `pad_bias` pads by alignment - last % alignment and slices back).
EFFICIENT_BIAS_ALIGN = 8


# ----------------------------------------------------------------------------------------- records


@dataclass(frozen=True)
class Saved:
    """One storage saved for backward: `numel` elements of `dtype`."""

    name: str
    numel: int
    dtype: str

    @property
    def nbytes(self) -> int:
        return self.numel * BYTES_PER_DTYPE[self.dtype]


@dataclass(frozen=True)
class BlockActivations:
    block: str  # Block.name from planner.models.blocks.model_blocks, plus one final "loss" entry
    saved_bytes: int  # bytes this block's forward saves for backward, no checkpointing
    kept_bytes: int  # what stays after the forward: == saved_bytes, or the checkpoint inputs when checkpointed
    weight_cast_bytes: int  # AMP: 16-bit weight copies saved for backward (0 in fp32 / pure 16-bit)
    forward_transient_bytes: int  # estimate: peak extra temporaries inside the forward that are not saved
    backward_transient_bytes: int  # estimate: peak extra temporaries while back-propagating through the block
    checkpointed: bool
    # Added: tensors the model returns that the caller keeps through backward (HF ModelOutput.logits; a layer's
    # KV cache under use_cache, planner.memory.kv_cache).
    retained_output_bytes: int = 0
    # Added: AMP's cast cache for this block (16-bit weights and biases), alive from the block's forward
    # until the autocast context exits, checkpointed or not (see `autocast_cache`). 0 without AMP.
    autocast_cache_bytes: int = 0
    # Added: the storages behind saved_bytes / kept_bytes, for explanations and tests.
    tensors: tuple[Saved, ...] = field(default=(), repr=False, compare=False)
    kept_tensors: tuple[Saved, ...] = field(default=(), repr=False, compare=False)
    # Added: the AMP cast cache's storages (`autocast_cache`: weightK.cast / biasK.cast), for the event trace.
    cache_tensors: tuple[Saved, ...] = field(default=(), repr=False, compare=False)
    # Added: the real tensors behind backward_transient_bytes (allocator bytes, allocation order), for the
    # event trace (`layer_backward_tensors`, `_transients`); () when unknown: one tensor of the total.
    backward_tensors: tuple[int, ...] = field(default=(), repr=False, compare=False)

    @property
    def kept_total_bytes(self) -> int:
        """What autograd holds after the forward: kept activations plus weight casts unless recomputed."""
        return self.kept_bytes + (0 if self.checkpointed else self.weight_cast_bytes)

    def renamed(self, block: str) -> BlockActivations:
        """This record for another block whose tensors are the same (a model's identical layers): its fields
        copied, at an eighth of `dataclasses.replace`'s cost (a search makes one per layer per new shape)."""
        clone = object.__new__(BlockActivations)
        clone.__dict__.update(self.__dict__, block=block)
        return clone


# ------------------------------------------------------------------------- CUDA vs CPU, one each


def alloc_bytes(nbytes: int, backend: Backend) -> int:
    """Bytes one tensor takes: CUDA's caching allocator rounds to 512 B blocks; CPU storages are exact."""
    if backend == "cuda" and nbytes > 0:
        return -(-nbytes // CUDA_ALLOCATION_ROUND_BYTES) * CUDA_ALLOCATION_ROUND_BYTES
    return nbytes


def dropout_saved(name: str, numel: int, dtype: str, p: float, backend: Backend) -> list[Saved]:
    """What `F.dropout(x, p, training=True)` saves.

    CUDA: `native_dropout` (Dropout.cpp `is_fused_kernel_acceptable`) saves a 1-byte bool mask.
    CPU: `_dropout_impl` multiplies by a noise tensor of x's dtype (bernoulli_ then div_), and `mul` saves it.
    p == 0 returns x unchanged and saves nothing. The output is a new tensor either way (when p > 0).
    """
    if p <= 0:
        return []
    return [Saved(name, numel, BOOL if backend == "cuda" else dtype)]


def attention_lse(kernel: str, ctx: Ctx, heads: int) -> Saved:
    """Fused kernels save the fp32 logsumexp of each query row: b·a·s, padded to 32 rows by the
    memory-efficient kernel (EFFICIENT_LSE_ALIGN)."""
    rows = math.ceil(ctx.chunk / EFFICIENT_LSE_ALIGN) * EFFICIENT_LSE_ALIGN if kernel == "efficient" else ctx.chunk
    return Saved("attention.logsumexp", ctx.b * heads * rows, F32)


def sdpa_bias(kernel: str, ctx: Ctx, dtype: str) -> list[Saved]:
    """The additive bias a fused kernel saves, once per layer (SDPA converts HF's bool mask per call:
    attention.cpp `convert_boolean_attn_mask`, into the query dtype).

    CPU flash saves it as is (b·s·s). CUDA memory-efficient pads the last dim to a multiple of 8 when s is
    not one (`preprocess_mask`), so the saved storage is b·s·(s + 8 - s % 8). Flash takes no mask.
    """
    kv_s = ctx.kv_s  # keys: the whole sequence under context parallelism (== s otherwise)
    if kernel == "cpu_flash":
        return [Saved("attention.bias", ctx.b * ctx.chunk * kv_s, dtype)]
    if kernel == "efficient":
        last = kv_s if kv_s % EFFICIENT_BIAS_ALIGN == 0 else kv_s + EFFICIENT_BIAS_ALIGN - kv_s % EFFICIENT_BIAS_ALIGN
        return [Saved("attention.bias", ctx.b * ctx.chunk * last, dtype)]
    return []


# ------------------------------------------------------------------------------- shared pieces


def linear_inputs(name: str, numel: int, dtype: str, ctx: Ctx, consumers: int = 1) -> list[Saved]:
    """Inputs saved by `consumers` Linear layers reading the same new tensor of `dtype`.

    Without autocast they all save that one storage. Under autocast each Linear casts its input to 16-bit
    again (only leaf parameters are cached, autocast_mode.cpp `cached_cast`): one copy per consumer, unless
    the input already is 16-bit, in which case the storage itself is saved once.
    """
    if ctx.amp and dtype != ctx.low:
        return [Saved(f"{name}.cast{i}" if consumers > 1 else f"{name}.cast", numel, ctx.low)
                for i in range(consumers)]
    return [Saved(name, numel, dtype)]


def layernorm_saved(name: str, tokens: int, width: int, dtype: str, ctx: Ctx) -> tuple[list[Saved], str]:
    """nn.LayerNorm: saves its input and fp32-or-input-dtype mean and rstd per row; returns the output dtype.
    Under CUDA autocast layer_norm runs in fp32, so a 16-bit input is saved as an fp32 copy."""
    op_dtype = F32 if ctx.amp and autocast_fp32_op("layer_norm", ctx.backend) else dtype
    stats = norm_stats_dtype(op_dtype, ctx.backend)
    return ([Saved(f"{name}.input", tokens * width, op_dtype), Saved(f"{name}.mean", tokens, stats),
             Saved(f"{name}.rstd", tokens, stats)], op_dtype)


def rmsnorm_saved(name: str, tokens: int, width: int, dtype: str, ctx: Ctx, input_is_new: bool = True
                  ) -> list[Saved]:
    """HF LlamaRMSNorm: x.to(fp32); x * rsqrt(mean(x²) + eps); weight * that.to(input_dtype).

    Saved: the fp32 x (x itself when already fp32, then owned by the caller unless `input_is_new`), the fp32
    rsqrt (one per row), and the normalised tensor in the input dtype (a new storage: the fp32 product, or
    its 16-bit cast). The output (weight * normalised) is saved by whoever consumes it.
    """
    out: list[Saved] = []
    if dtype != F32:
        out.append(Saved(f"{name}.input_fp32", tokens * width, F32))
    elif input_is_new:
        out.append(Saved(f"{name}.input", tokens * width, F32))
    out += [Saved(f"{name}.rsqrt", tokens, F32), Saved(f"{name}.normalized", tokens * width, dtype)]
    return out


def activation_saved(name: str, act: str, numel: int, dtype: str, ctx: Ctx) -> tuple[list[Saved], str]:
    """The MLP nonlinearity on an up-projection output of `dtype`: what it saves (input included) and the
    dtype of its output. The output itself is saved by the down-projection (planner.families.forms.common.mlp_ops).

    gelu / gelu_pytorch_tanh / silu: the C kernels save their input. relu: saves its output (which the
    down-projection saves too). gelu_new (GPT-2, transformers NewGELUActivation) is Python:
    0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))) saves x (for pow), tanh's output, 0.5·x and (1 + tanh);
    under CUDA autocast `pow` runs in fp32, so x is saved as an fp32 copy and the tanh branch is fp32.
    """
    if act in ("gelu", "gelu_pytorch_tanh", "silu", "swish", "gelu_python", "gelu_accurate"):
        return [Saved(f"{name}.input", numel, dtype)], dtype
    if act == "relu":
        return [], dtype
    if act in ("gelu_new", "gelu_fast"):
        branch = F32 if ctx.amp and autocast_fp32_op("pow", ctx.backend) else dtype
        return ([Saved(f"{name}.x_for_pow", numel, branch), Saved(f"{name}.tanh", numel, branch),
                 Saved(f"{name}.half_x", numel, dtype), Saved(f"{name}.one_plus_tanh", numel, branch)],
                promote(dtype, branch))
    raise ValueError(f"activation {act!r}: no saved-tensor formula (known: gelu, gelu_new, relu, silu)")


# ------------------------------------------------------------------------------------- attention


def _eager_softmax_dtype(score_dtype: str, name: str, ctx: Ctx) -> str:
    """Llama's eager path asks softmax for fp32; BERT/GPT-2 call softmax plainly, which CUDA autocast
    still runs in fp32."""
    if family(name).fp32_softmax:
        return F32
    return F32 if ctx.amp and autocast_fp32_op("softmax", ctx.backend) else score_dtype


def eager_attention_saved(spec: TransformerSpec, ctx: Ctx, q_dtype: str, masked: bool, heads: int | None = None
                          ) -> list[Saved]:
    """HF `eager_attention_forward`: matmul(q, kᵀ)·scale (+ mask) -> softmax -> dropout -> matmul(·, v).

    q, k, v arrive as (b, a, s, d) views of the projections, so `matmul` copies them into contiguous bmm
    operands (3·n·H, 16-bit under AMP). Scores meeting HF's additive mask (in the model's dtype: fp32 under
    AMP) are promoted to fp32. Saved: the softmax output (b·a·s²), the dropout mask and the dropped
    probabilities (a new tensor; under AMP a 16-bit cast when they are fp32). GPT-2 casts the probs back to
    v's dtype before dropout, Llama after an fp32 softmax (`.to(query.dtype)`).
    """
    b, s, a = ctx.b, ctx.chunk, heads or spec.num_heads  # heads: one tensor-parallel rank's; CP: its chunk
    H = a * spec.head_dim
    s2 = b * a * s * ctx.kv_s
    low = ctx.low
    out = [Saved("attention.q", ctx.n * H, low), Saved("attention.k", ctx.n * H, low),
           Saved("attention.v", ctx.n * H, low)]
    scores = promote(low, ctx.act) if masked else low
    soft = _eager_softmax_dtype(scores, spec.family, ctx)
    out.append(Saved("attention.softmax", s2, soft))
    probs, probs_new = soft, False
    cast = family(spec.family).probs_cast
    if cast == "value" and soft != low:
        probs, probs_new = low, True  # attn_weights.type(value.dtype)
    if cast == "query" and soft != q_dtype:
        probs, probs_new = q_dtype, True  # .to(query.dtype)
    p = spec.attention_dropout
    out += dropout_saved("attention.dropout_mask", s2, probs, p, ctx.backend)
    if p > 0:
        probs_new = True
    if ctx.amp and probs != low:
        out.append(Saved("attention.probs.cast", s2, low))  # matmul casts fp32 probs to 16-bit
    elif probs_new:
        out.append(Saved("attention.probs", s2, probs))
    return out


def math_attention_saved(spec: TransformerSpec, ctx: Ctx, masked: bool, v_storage: int = 0,
                         heads: int | None = None) -> list[Saved]:
    """SDPA's math fallback (CPU training with dropout): q·√scale and kᵀ·√scale copies, v, softmax, dropout
    noise and dropped probs, all in `math_sdpa_dtype` (fp32 for 16-bit inputs on CPU). The bool mask is
    added in place and not saved.

    v is reshaped for bmm: a copy of n·H, except when b == 1 and no upcast is needed, where the reshape
    is a view and bmm saves the projection's whole storage (`v_storage` elements: n·3h for GPT-2's fused
    c_attn output).
    """
    b, s, a = ctx.b, ctx.chunk, heads or spec.num_heads
    H = a * spec.head_dim
    s2 = b * a * s * ctx.kv_s
    cd = math_sdpa_dtype(ctx.low, ctx.backend)
    v = v_storage if b == 1 and cd == ctx.low and v_storage else ctx.n * H
    out = [Saved("attention.q", ctx.n * H, cd), Saved("attention.k", ctx.n * H, cd),
           Saved("attention.v", v, cd), Saved("attention.softmax", s2, cd)]
    p = spec.attention_dropout
    out += dropout_saved("attention.dropout_mask", s2, cd, p, ctx.backend)
    if p > 0:
        out.append(Saved("attention.probs", s2, cd))
    return out


def fused_attention_saved(spec: TransformerSpec, ctx: Ctx, kernel: str, qkv: list[Saved], masked: bool,
                          heads: int | None = None) -> list[Saved]:
    """Flash / memory-efficient / CPU-flash SDPA: saves q, k, v as passed (`qkv`, storages decided by the
    caller), the output (b·s·H, which the output projection saves too: one storage), the fp32 logsumexp
    and, with a mask, the per-layer converted bias. No s² tensor; dropout is regenerated from the Philox
    seed/offset, which are CPU scalars outside CUDA-graph capture (0 GPU bytes).

    Context parallelism (TransformerEngine `AttnFuncWithCPAndKVP2P`, Megatron-Core's default "p2p" ring):
    each rank saves its own q, k, v chunk, its output and its rows' logsumexp, and sends k, v round the ring
    again in backward, so the saved bytes are those of the local chunk (s = seq_len / cp here)."""
    a = heads or spec.num_heads
    out = list(qkv)
    out.append(Saved("attention.output", ctx.n * a * spec.head_dim, ctx.low))
    out.append(attention_lse(kernel, ctx, a))
    if ctx.attention == "flash" and ctx.backend == "cuda" and spec.attention_dropout > 0:
        out.append(Saved("attention.rng_state", 2, I64))  # flash_attn keeps its Philox state on the device
    if masked:
        out += sdpa_bias(kernel, ctx, ctx.low)
    return out


# ---------------------------------------------------------------------------------------- layers


def layer_saved(spec: TransformerSpec, ctx: Ctx, index: int) -> list[Saved]:
    """What one transformer layer saves: its layer form's ops (planner.families.forms), each op's storages by
    its kind's rule (planner.memory.op_saved, which calls the piece functions above). Issue 33: the three
    per-form functions that composed the pieces here were a second copy of each layer."""
    from planner.families.forms import LayerArgs, load_forms
    from planner.ir.interpret import apply, load_rules

    load_rules()
    traits = family(spec.family)
    ops = load_forms()[traits.layer](LayerArgs(spec, traits, ctx, index, ""))
    if ctx.fp8 or ctx.compile:
        from planner.ir.transforms import for_context

        ops = for_context(ops, ctx, "layer")
    return [t for op in ops for t in apply("saved", op, ctx)]


def selective_kept(spec: TransformerSpec, ctx: Ctx, index: int, modules: tuple[str, ...]) -> list[Saved] | None:
    """What one layer keeps after its forward when the `modules` are recomputed (planner.ir.transforms
    .selective_layer: the kept inputs of each recomputed region and the storages of every other op); None
    when none of the modules is in this layer (moe_act in a dense model, say)."""
    from planner.families.forms import LayerArgs, load_forms
    from planner.ir.interpret import apply, load_rules
    from planner.ir.transforms import selective_layer

    load_rules()
    traits = family(spec.family)
    ops = selective_layer(load_forms()[traits.layer](LayerArgs(spec, traits, ctx, index, "")), modules)
    if not any(op.attrs.get("recomputed") for op in ops):
        return None
    return [t for op in ops if not op.attrs.get("checkpointed") for t in apply("saved", op, ctx)]


def checkpoint_inputs(spec: TransformerSpec, ctx: Ctx, index: int) -> list[Saved]:
    """What a checkpointed layer keeps: the tensors HF passes it positionally, which non-reentrant
    `torch.utils.checkpoint` saves (`_NoopSaveInputs`; transformers GradientCheckpointingLayer, whose
    checkpoint defaults to use_reentrant=False in modeling_utils `_activation_checkpointing_enable`).

    The hidden states (n·h, the residual dtype), and for BERT-like encoders and GPT-2, which pass the 4-D
    mask positionally, that mask (shared by all layers: counted on the first). Llama passes it by keyword.
    """
    out = [Saved("checkpoint.hidden_states", ctx.rows * spec.hidden_size, ctx.act)]  # SP: the local n / tp rows
    if index == 0 and family(spec.family).mask_positional and mask_materialised(spec, ctx):
        out.append(Saved("checkpoint.attention_mask", ctx.b * ctx.chunk * ctx.s, mask_bytes_dtype(ctx)))
    return out


# ------------------------------------------------------------------------------ other transformer blocks


def first_token_input(name: str, spec: TransformerSpec, ctx: Ctx) -> list[Saved]:
    """A Linear applied to hidden[:, 0]: without autocast it saves that *view*, which keeps the whole last
    hidden state (n·h) alive; under autocast it saves a 16-bit copy of just b·h."""
    if ctx.amp:
        return [Saved(f"{name}.cast", ctx.b * spec.hidden_size, ctx.low)]
    return [Saved(f"{name}.last_hidden_state", ctx.n * spec.hidden_size, ctx.act)]


def loss_saved(spec: TransformerSpec, ctx: Ctx) -> list[Saved]:
    """HF losses. cross_entropy = log_softmax (saves its output) + nll_loss (saves the target and a
    1-element total_weight). The dtype: the causal LM loss (loss_utils.ForCausalLMLoss) upcasts logits to
    fp32 first (`logits.float()`) and saves its shifted labels (a new n int64 tensor); the masked-LM and
    classification heads call CrossEntropyLoss on the logits as they are (`cross_entropy_saved`: under CUDA
    autocast a 16-bit log-softmax and nll_loss's fp32 copy of it). Decoder classifiers first pick each row's last token
    with `logits[arange(b), last_non_pad_token]`, whose backward saves both index vectors (2·b int64).

    Tensor parallelism: the logits hold V / tp columns per rank and the loss is Megatron-Core's
    vocabulary-parallel cross-entropy (megatron/core/tensor_parallel/cross_entropy.py
    `_VocabParallelCrossEntropy.forward`: `ctx.save_for_backward(exp_logits, target_mask, masked_target_1d)`:
    the local softmax, n·V/tp, in the logits' dtype, fp32 here as HF upcasts them, a bool mask of the
    targets outside this rank's rows and the shifted targets, n int64); torchtitan's `loss_parallel` saves
    the same local log-softmax through DTensor.
    """
    n, b = ctx.n, ctx.b
    if spec.head == "causal-lm" and ctx.fused_loss:
        # Transformer Engine's fused cross-entropy (Megatron, Framework.fused_loss): the logits themselves (the
        # model's output, counted there) and the m / d / x_y statistics, three fp32 a row; labels come shifted
        return [Saved("loss.row_statistics", 3 * n, F32)]
    if spec.head == "causal-lm":
        # pad(labels, (0, 1))[..., 1:].contiguous(): a copy, except for b == 1 where the slice already is
        # contiguous and the padded b·(s+1) tensor is what nll_loss saves
        labels = b * (ctx.chunk + 1) if b == 1 else n
        if ctx.tp > 1:
            return [Saved("loss.softmax", n * vocab_per_rank(spec, ctx), F32), Saved("loss.target_mask", n, BOOL),
                    Saved("loss.masked_target", n, I64), Saved("loss.shift_labels", labels, I64)]
        # a framework whose loss takes the logits as they are (Framework.loss_fp32 False): cross_entropy on the
        # logits' dtype (`cross_entropy_saved`)
        logits = F32 if ctx.loss_fp32 else ctx.low
        return cross_entropy_saved("loss", n * spec.vocab_size, logits, ctx) + [Saved("loss.shift_labels", labels, I64)]
    if spec.head == "masked-lm":
        return cross_entropy_saved("loss", n * vocab_per_rank(spec, ctx), ctx.low, ctx)
    if spec.head == "sequence-classification":
        out = cross_entropy_saved("loss", b * spec.num_labels, ctx.low, ctx)
        if family(spec.family).classifier == "score_all_tokens":
            out.append(Saved("loss.pooling_indices", 2 * b, I64))
        return out
    return []


def cross_entropy_saved(prefix: str, numel: int, logits: str, ctx: Ctx) -> list[Saved]:
    """What `F.cross_entropy` saves for backward on `numel` logits of dtype `logits`.

    Without autocast, or on fp32 logits: log_softmax's output in the logits' dtype (nll_loss saves the same
    storage) and nll_loss's 1-element total_weight. Under CUDA autocast on 16-bit logits (ATen's composite,
    `Ctx.cross_entropy_composite`): log_softmax keeps the 16-bit dtype (LossNLL.cpp passes
    `self.scalar_type()`, which autocast's fp32_set_opt_dtype leaves alone) and saves its output; nll_loss is
    on CUDA's fp32 list, so autocast hands it an fp32 copy of those log-probabilities, which it saves. Measured
    on an H200 (shared readings, BERT-base MLM b32 × 512 AMP): the saved bytes exceed the fp32-only count by
    exactly the 16-bit n·V, and the forward's peak is its end (no unsaved copy). CPU autocast casts the whole
    loss (cross_entropy_loss is on its fp32 list), as older torch's Python composite did: one fp32 log-softmax.
    """
    if ctx.amp and logits != F32:
        if ctx.backend == "cuda" and ctx.cross_entropy_composite:
            return [Saved(f"{prefix}.log_softmax", numel, logits), Saved(f"{prefix}.nll_loss.input", numel, F32),
                    Saved(f"{prefix}.total_weight", 1, F32)]
        logits = F32
    return [Saved(f"{prefix}.log_softmax", numel, logits), Saved(f"{prefix}.total_weight", 1, logits)]


def loss_transients(saved: list[Saved], ctx: Ctx, upcast: bool) -> tuple[int, tuple[int, ...]]:
    """The loss's temporaries: (forward, backward tensors), allocator-rounded.

    Forward: an fp32 copy of the logits made before log_softmax and not saved: transformers' ForCausalLMLoss
    `logits.float()` on 16-bit logits (`upcast`), or autocast's whole-loss cast (CPU, older torch). fp32
    logits and the composite's nll_loss copy (saved) make none. Measured on an H200 (shared readings,
    forward peak minus its end): BERT MLM fp32 and AMP 0 (48 MiB of other temporaries), GPT-2 fp32 0, GPT-2 AMP
    the fp32 n·V. Backward: nll_loss_backward's gradient (the size of its input) and, while it lives,
    log_softmax's input gradient (derivatives.yaml: each allocates its output): two of the log-softmax's size,
    as traced. Under the composite, autograd frees nll_loss's saved fp32 copy once its node has run, so the
    peak is the saved tensors plus nll_loss's fp32 gradient alone (the 16-bit gradients that follow are
    smaller): H200 BERT MLM AMP, backward peak minus forward end = the fp32 n·V, fp32 = twice it."""
    if not saved:
        return 0, ()
    lsm = next((t for t in saved if t.name.endswith(".log_softmax")), None)
    nll = next((t for t in saved if t.name.endswith(".nll_loss.input")), None)
    if lsm is None:  # not a cross-entropy (BCE only): the rough rule
        return _transients(saved, ctx)
    if nll is not None:
        return 0, (alloc_bytes(nll.nbytes, ctx.backend),)
    grad = alloc_bytes(lsm.nbytes, ctx.backend)
    fwd = grad if upcast or (ctx.amp and lsm.dtype == F32 and ctx.low != F32) else 0
    return fwd, (grad, grad)


def head_output_bytes(spec: TransformerSpec, ctx: Ctx) -> int:
    """Logits the model returns (ModelOutput.logits), alive through backward while the caller holds the
    output: n·V (LM heads) or b·labels, in the matmul dtype."""
    rows = ctx.n if spec.head in ("causal-lm", "masked-lm") else ctx.b
    width = vocab_per_rank(spec, ctx) if spec.head in ("causal-lm", "masked-lm") else spec.num_labels
    if spec.head == "base":
        return 0
    return rows * width * BYTES_PER_DTYPE[ctx.low]


# ---------------------------------------------------------------------------------- weight casts


def linear_params(block: Block, ctx: Ctx | None = None) -> list[tuple[int, int]]:
    """(weight, bias) element counts of each matmul a block runs. Autocast casts both to 16-bit and caches
    the casts until the autocast context exits; the matmul saves the weight's cast for backward.

    The block's program's `linear` ops and a mixture-of-experts layer's router, on this rank
    (planner.families.forms.block_linears; issue 33: the per-form lists here, and the tensor-parallel rank's
    list, were other copies of each layer): with `ctx.tp` > 1 the forms emit one rank's widths (column-
    parallel weights and biases / tp, row-parallel weights / tp with their bias whole, the vocabulary / tp).
    The multimodal model's nn.Linear and BatchNorm1d blocks read their spec."""
    layer = block.layer
    if isinstance(layer, DenseSpec):
        return [(layer.in_features * layer.out_features, layer.out_features if layer.bias else 0)]
    if isinstance(layer, BatchNormSpec):
        return []
    from planner.families.forms import block_linears

    return block_linears(block, ctx.tp if ctx is not None else 1)


def weight_casts(block: Block, ctx: Ctx) -> list[Saved]:
    """16-bit weight copies the block's matmuls save under autocast (0 without autocast). Under FP8 a layer's
    Linears are torchao / Transformer Engine modules that cast their weights themselves: no 16-bit copy;
    Transformer Engine saves the FP8 weight and its transpose instead (planner.ir.fp8.weight_copies), at this
    tensor-parallel rank's widths; when the framework passes TE `is_first_microbatch` (`ctx.fp8_weight_cache`:
    Megatron-Core) the saved copy is the module's cached workspace, one per Linear for the run
    (`fp8_weight_workspace_bytes`), not a copy per micro-batch: nothing here."""
    if ctx.fp8 and block.role == "layer":
        per = fp8.weight_copies(ctx.fp8)
        if not per or ctx.fp8_weight_cache:
            return []
        return [Saved(f"weight{k}.fp8", math.ceil(w * per), fp8.F8)
                for k, (w, _) in enumerate(linear_params(block, ctx))]
    if not ctx.amp:
        return []
    return [Saved(f"weight{k}.cast", w, ctx.low) for k, (w, _) in enumerate(linear_params(block, ctx))]


def fp8_weight_workspace_bytes(block: Block, ctx: Ctx) -> int:
    """Transformer Engine's cached FP8 weights of a layer's Linears (the FP8 weight and its transpose, at this
    rank's widths), kept by each module from the step's first micro-batch for the run when the framework
    passes `is_first_microbatch` (`ctx.fp8_weight_cache`; TE linear.py `get_weight_workspace(cache_name=
    "weight")`); 0 otherwise (torchao recasts; TE without the cache saves a copy per forward: `weight_casts`)."""
    if not (ctx.fp8 and ctx.fp8_weight_cache and block.role == "layer"):
        return 0
    per = fp8.weight_copies(ctx.fp8)
    weights = sum(w for w, _ in linear_params(block, ctx)) + fp8_expert_weights(block, ctx)
    return math.ceil(weights * per)


def fp8_expert_weights(block: Block, ctx: Ctx) -> int:
    """Weight elements of the rank's routed experts in a sparse layer whose grouped GEMMs run in FP8
    (planner.ir.transforms.fp8_experts): E / ep experts, gate/up (2·i) and down (i) by h, each expert's width
    over etp; TE's GroupedLinear caches each expert's FP8 weight as te.Linear does (`weight{i}` workspaces)."""
    from planner.ir.transforms import fp8_experts

    spec = block.layer
    if not (isinstance(spec, TransformerSpec) and spec.moe and spec.sparse_layer(block.index) and fp8_experts(ctx)):
        return 0
    width = -(-spec.moe_intermediate_size // ctx.etp)
    return spec.num_experts // ctx.ep * 3 * width * spec.hidden_size


def autocast_cache(block: Block, ctx: Ctx) -> list[Saved]:
    """Every parameter cast autocast caches for this block: weights and biases. They stay alive until the
    autocast context exits (autocast_mode.cpp: the cache is cleared when the outermost autocast exits), even
    for checkpointed layers, whose casts are not saved: under AMP + checkpointing the end of the forward
    holds all layers' casts. FP8 layers' Linears cast their own weights (no autocast cache for them)."""
    if not ctx.amp or (ctx.fp8 and block.role == "layer"):
        return []
    out = []
    for k, (w, bias) in enumerate(linear_params(block, ctx)):
        out.append(Saved(f"weight{k}.cast", w, ctx.low))
        if bias:
            out.append(Saved(f"bias{k}.cast", bias, ctx.low))
    return out


# ------------------------------------------------------------------------------ multimodal parts


def dense_block_saved(block: Block, model: ModelSpec, ctx: Ctx) -> list[Saved]:
    """nn.Linear / nn.BatchNorm1d blocks of the multimodal model (jobs/modeling.MultimodalBert).

    BatchNorm1d(tabular) saves its input (the batch's features: not an activation) and save_mean /
    save_invstd (f each, see `norm_stats_dtype`). TabAE.1 saves the BatchNorm output (b·f), TabAE.2 the TabAE.1 output (already
    16-bit under AMP), TextBertBase's Linear the pooled vector (the pooler's tanh output, already saved;
    DistilBERT has no pooler: hidden[:, 0], see `first_token_input`), merge the concatenation (b·(t+o)).
    """
    layer = block.layer
    b, low, act = ctx.b, ctx.low, ctx.act
    if isinstance(layer, BatchNormSpec):
        stats = norm_stats_dtype(act, ctx.backend)  # batch_norm is on no autocast list: runs in act dtype
        return [Saved("batchnorm.save_mean", layer.num_features, stats),
                Saved("batchnorm.save_invstd", layer.num_features, stats)]
    assert isinstance(layer, DenseSpec)
    comp = next(c for c in model.components if c.name == block.component)
    prev = comp.layers[block.index - 1] if block.index > 0 else None
    if block.component == "merge" and block.index == 0:
        return [Saved("merge.concat", b * layer.in_features, low)]
    if isinstance(prev, BatchNormSpec):
        return linear_inputs(f"{block.name}.input", b * layer.in_features, act, ctx)
    if isinstance(prev, TransformerSpec):
        if prev.pooler:
            return []  # the pooler's tanh output, saved by the pooler block
        return first_token_input(block.name, prev, ctx)
    if prev is None:
        return linear_inputs(f"{block.name}.input", b * layer.in_features, act, ctx)
    return [Saved(f"{block.name}.input", b * layer.in_features, low)]


def multimodal_loss_saved(model: ModelSpec, ctx: Ctx) -> list[Saved]:
    """cross_entropy(merge logits) + BCE-with-logits(TabAE logits) (binary) or cross_entropy(TabAE logits).

    Cross-entropy: `cross_entropy_saved` on the b·C logits. BCE-with-logits saves its
    input (the TabAE logits, b) and target (labels.to(logits dtype), b), as fp32 copies under autocast.
    """
    b = ctx.b
    dtype = F32 if ctx.amp or ctx.low == F32 else ctx.low
    merge = model.components[-1].layers[-1]
    tab = next(c for c in model.components if c.name == "TabAE").layers[-1]
    assert isinstance(merge, DenseSpec) and isinstance(tab, DenseSpec)
    out = cross_entropy_saved("loss", b * merge.out_features, ctx.low, ctx)
    if tab.out_features == 1:
        # under autocast both arguments are cast to fp32 copies (BCE-with-logits is on both fp32 lists)
        out += [Saved("loss.bce.input", b, dtype), Saved("loss.bce.target", b, dtype)]
    else:
        out += cross_entropy_saved("loss.tab", b * tab.out_features, ctx.low, ctx)
    return out


# ------------------------------------------------------------------------------------ transients


def _transients(saved: list[Saved], ctx: Ctx) -> tuple[int, tuple[int, ...]]:
    """Rough peaks of unsaved temporaries (transformer layers' backward: `layer_backward_transient`; the
    loss's backward, 2·n·V = nll_loss's and log_softmax's gradients, equals the trace): in the forward, the largest saved
    tensor's producer output before the next op consumes it (one extra copy of the largest tensor); in
    backward, the gradient of the largest saved tensor plus that of its input (two copies, two tensors)."""
    largest = max((alloc_bytes(t.nbytes, ctx.backend) for t in saved), default=0)
    return largest, (largest, largest) if largest else ()


def layer_backward_transient(spec: TransformerSpec, saved: list[Saved], ctx: Ctx) -> int:
    """Peak temporaries while back-propagating through one transformer layer: the sum of
    `layer_backward_tensors` (CUDA-real, checked op by op against the dispatch trace:
    tests/test_backward_transients.py)."""
    return sum(layer_backward_tensors(spec, saved, ctx))


def layer_backward_tensors(spec: TransformerSpec, saved: list[Saved], ctx: Ctx) -> tuple[int, ...]:
    """The temporaries alive at the peak of one transformer layer's backward, each one real tensor
    (allocator-rounded bytes), in the order the backward allocates them.

    Why tensors and not their total: the allocator replays each request on its own (`events.step_events`);
    one request of the total needs one free block of that size, where the real tensors fit in holes, which
    is what a run whose batches change length sees (issue 23: with one tensor per layer the run's growth was
    over-predicted 2-4x).

    output_grad + the larger of attention and MLP, where
    - output_grad = n·h in the residual stream's dtype: the gradient of the layer's output (the residual
      stream's gradient), alive through the whole layer until its input gradient replaces it;
    - attention = 2·largest saved (the gradient of the probabilities from the P·V bmm and that of the scores
      from dropout's / softmax's backward: `_softmax_backward_data` and `native_dropout_backward` allocate
      their output on CUDA too) + eager only: the bmm's other gradient, grad_v = n·H in the matmul dtype
      (derivatives.yaml `bmm`: self: grad.bmm(mat2ᵀ), mat2: selfᵀ.bmm(grad): both are allocated). With SDPA
      and an MLP wider than the attention the two tensors of the largest saved size are the MLP's: the
      down-projection's input gradient (`mm`) and `gelu_backward`'s output (n·ff each, as traced);
    - MLP with GPT-2's Python GELU (gelu_new, 0.5·x·(1 + tanh(c·(x + 0.044715·x³)))): its autograd graph
      of mul / pow / tanh backward formulas keeps 6 tensors of n·ff alive at once (device-independent
      formulas in derivatives.yaml; the trace measures 6): 4 in the tanh branch's dtype, 2 in the
      up-projection's (under autocast the fp32 branch's gradients are cast back by `_to_copy`'s backward);
    - Llama-style layers: the gated MLP (3·n·ff) or the Python RMSNorm (4-5·n·h in fp32), whichever is larger.
    All are CUDA-real: the ops are the same ATen ops with device-independent autograd formulas, and each
    CUDA kernel allocates exactly its output (no CPU-only scratch is counted: the tracer maps CPU to CUDA).
    """
    largest = max((alloc_bytes(t.nbytes, ctx.backend) for t in saved), default=0)
    width = heads_per_rank(spec, ctx) * spec.head_dim  # one tensor-parallel rank's heads and ffn
    ffn = ffn_per_rank(spec, ctx)
    out_grad = alloc_bytes(ctx.rows * spec.hidden_size * BYTES_PER_DTYPE[ctx.act], ctx.backend)
    attention: tuple[int, ...] = (largest, largest)
    if ctx.attention == "eager":  # bmm's two gradients, then softmax's
        attention = (largest, alloc_bytes(ctx.n * width * BYTES_PER_DTYPE[ctx.low], ctx.backend), largest)
    mlp: tuple[int, ...] = ()
    if spec.hidden_act in ("gelu_new", "gelu_fast"):
        branch = F32 if ctx.amp and autocast_fp32_op("pow", ctx.backend) else ctx.low
        numel = ctx.n * ffn
        low = alloc_bytes(numel * BYTES_PER_DTYPE[ctx.low], ctx.backend)
        mlp = (low, *[alloc_bytes(numel * BYTES_PER_DTYPE[branch], ctx.backend)] * (GELU_NEW_BACKWARD_TENSORS - 2),
               low)
    if family(spec.family).gated_mlp:
        up = alloc_bytes(ctx.n * ffn * BYTES_PER_DTYPE[ctx.low], ctx.backend)
        mlp = (up,) * GATED_MLP_BACKWARD_TENSORS
        norm = (alloc_bytes(ctx.rows * spec.hidden_size * BYTES_PER_DTYPE[F32], ctx.backend),) \
            * (RMSNORM_BACKWARD_TENSORS - (ctx.act == F32))
        if sum(norm) > sum(mlp):
            mlp = norm
    return (out_grad, *(attention if sum(attention) >= sum(mlp) else mlp))


# Llama-style layers (LlamaMLP: down(act(gate(x)) * up(x)); LlamaRMSNorm in Python, computed in fp32): the
# families whose record says gated_mlp (planner.families).
# Gated MLP backward: down_proj's input gradient (mm) then mul's two gradients (grad·up, grad·act(gate)):
# 3 tensors of n·ff in the matmul dtype alive at once (derivatives.yaml `mul`; measured by the trace).
GATED_MLP_BACKWARD_TENSORS = 3
# LlamaRMSNorm backward (mul / rsqrt / mean / pow formulas on the fp32 upcast): 5 fp32 tensors of n·h alive
# at once for a 16-bit input, one fewer when the input already is fp32 (no cast to undo) (measured by the
# trace; it sets the layer's peak in pure bf16 with SDPA).
RMSNORM_BACKWARD_TENSORS = 5


# Tensors of n·ff alive at the peak of NewGELUActivation's backward (measured by the dispatch trace of
# transformers' GPT-2 MLP, tests/test_events_dispatch.py; the autograd formulas are device-independent).
GELU_NEW_BACKWARD_TENSORS = 6


# -------------------------------------------------------------------------------------------- API


def _ctx(config: TrainConfig, backend: Backend, padded: bool, flash_ok: bool) -> Ctx:
    """The context of `config` for callers without the pipeline's record: one rank's shard under the config's
    tp, sp and cp (and its expert layout); --precision fp8 as the pipeline computes it (amp-bf16 with FP8
    Linears: planner.pipeline.resolve)."""
    import dataclasses

    recipe = None
    precision = config.precision
    if precision == "fp8":
        from planner.ir.fp8 import default_recipe

        recipe, precision = config.fp8_recipe or default_recipe(config.framework), "amp-bf16"
    ctx = rank_context(config.batch_size, config.seq_len, precision, config.attention, backend, padded,
                       flash_ok, tp=config.tp, sp=config.sp, cp=config.cp)
    return dataclasses.replace(ctx, fp8=recipe, fp8_gather=config.fp8_param_gather, compile=config.compile,
                               ep=config.ep, moe_imbalance=config.moe_imbalance,
                               etp=config.etp)


def _total(tensors: list[Saved], backend: Backend) -> int:
    return sum(alloc_bytes(t.nbytes, backend) for t in tensors)


def block_saved(block: Block, model: ModelSpec, ctx: Ctx) -> list[Saved]:
    """Storages the forward of one block saves (no checkpointing)."""
    layer = block.layer
    if not isinstance(layer, TransformerSpec):
        return dense_block_saved(block, model, ctx)
    if block.role == "layer":
        return layer_saved(layer, ctx, block.index)
    from planner.families.forms import block_ops, load_forms
    from planner.ir.interpret import apply, load_rules

    load_rules()
    load_forms()
    return [t for op in block_ops(block, model, ctx) for t in apply("saved", op, ctx)]


def activation_blocks(model: ModelSpec, config: TrainConfig, backend: Backend = "cuda", *,
                      padded: bool | None = None, flash_ok: bool = True, ctx: Ctx | None = None
                      ) -> list[BlockActivations]:
    """Per block (planner.models.blocks order) + a final "loss" entry: bytes saved for backward by one
    micro-batch (config.batch_size × config.seq_len) under config.precision / attention / checkpointing.

    `ctx`: the context record the pipeline resolved (planner.pipeline.resolve.Resolved.ctx); when given, it
    decides sizes, dtypes, kernel and backend, and `backend`, `padded` and `flash_ok` are not read. Without it
    (tests, tools): `padded`: whether batches contain padding, so HF materialises a 4-D attention mask
    (default: when the model takes an attention_mask). An all-ones mask is dropped by HF's SDPA path, which
    lets CUDA pick the flash kernel and saves no bias. `flash_ok`: the GPU runs flash kernels (sm80+).
    """
    if ctx is None:
        ctx = _ctx(config, backend, model.inputs.attention_mask if padded is None else padded, flash_ok)
    backend = ctx.backend
    if ctx.attention == "flash" and backend == "cuda" and ctx.low == F32:
        raise PlannerError("attention", "flash", "fp16, bf16, amp-fp16 or amp-bf16 precision (FlashAttention-2 "
                           "has no fp32 kernel); use sdpa or eager with fp32")
    from planner.ir.transforms import recompute_of

    mode, modules = recompute_of(config)
    out: list[BlockActivations] = []
    # A model's transformer layers share one spec, and a layer's tensors depend on its index only through
    # "is it the first" (Llama's first layer, the checkpointed mask) and, in a mixture-of-experts model, "is its
    # MLP sparse" (DeepSeek-V3's first_k_dense_replace dense layers, Qwen2-MoE's mlp_only_layers): compute one
    # of each, copy the rest. (Keyed on "first" alone, every DeepSeek-V3 MoE layer had copied dense layer 1.)
    same_layer: dict[tuple[int, bool, bool], BlockActivations] = {}
    for block in model_blocks(model):
        is_layer = block.role == "layer" and isinstance(block.layer, TransformerSpec)
        if is_layer:
            key = (id(block.layer), block.index == 0, block.layer.sparse_layer(block.index))  # type: ignore[union-attr]
            hit = same_layer.get(key)
            if hit is not None:
                out.append(hit.renamed(block.name))
                continue
        saved = block_saved(block, model, ctx)
        casts = weight_casts(block, ctx)
        ckpt = mode == "full" and is_layer
        kept = checkpoint_inputs(block.layer, ctx, block.index) if ckpt else saved  # type: ignore[arg-type]
        if mode == "selective" and is_layer:
            some = selective_kept(block.layer, ctx, block.index, modules)  # type: ignore[arg-type]
            ckpt, kept = (True, some) if some is not None else (False, saved)
        fwd, bwd = _transients(saved, ctx)
        if is_layer:
            bwd = layer_backward_tensors(block.layer, saved, ctx)  # type: ignore[arg-type]
        retained = head_output_bytes(block.layer, ctx) if block.role == "head" else 0  # type: ignore[arg-type]
        if is_layer and block.layer.use_cache:  # type: ignore[union-attr]  # the KV cache it returns (kv_cache.py)
            extra = kv_cache.extra_tensors(block.layer, ctx, ((t.name, t.numel) for t in kept))  # type: ignore[arg-type]
            retained = _total([Saved(name, n, ctx.low) for name, n in extra], backend)
        cache = autocast_cache(block, ctx)
        out.append(BlockActivations(block.name, _total(saved, backend), _total(kept, backend),
                                    _total(casts, backend), fwd, sum(bwd), ckpt, retained,
                                    _total(cache, backend), tuple(saved), tuple(kept), tuple(cache), bwd))
        if is_layer:
            same_layer[key] = out[-1]
    loss = _loss(model, ctx)
    last = model.transformers[-1] if model.transformers else None
    upcast = (model.loss != "multimodal" and last is not None and last.head == "causal-lm" and ctx.loss_fp32
              and ctx.low != F32)
    fwd, bwd = loss_transients(loss, ctx, upcast)
    out.append(BlockActivations("loss", _total(loss, backend), _total(loss, backend), 0, fwd, sum(bwd), False, 0, 0,
                                tuple(loss), tuple(loss), (), bwd))
    return out


def _loss(model: ModelSpec, ctx: Ctx) -> list[Saved]:
    if model.loss == "multimodal":
        return multimodal_loss_saved(model, ctx)
    if model.loss == "none" or not model.transformers:
        return []
    return loss_saved(model.transformers[-1], ctx)


def saved_activation_bytes(model: ModelSpec, config: TrainConfig, backend: Backend = "cuda", **kwargs: bool) -> int:
    """Everything autograd holds after one micro-batch's forward: kept activations + AMP weight casts
    (casts of checkpointed layers are recomputed, not kept)."""
    return sum(b.kept_total_bytes for b in activation_blocks(model, config, backend, **kwargs))
