"""The context record every interpreter of a program reads: one micro-batch's sizes, the precision and its
dtypes, the attention kernel asked for, and the device rules where CUDA and CPU differ (which ops autocast
runs in fp32, which SDPA kernel runs, what dtype a norm's statistics have, when HF builds a 4-D mask).

Moved here from planner.memory.activations (issue 33) so that the layer forms (planner.families.forms),
which decide an op's dtypes and its attention kernel while they emit a program, read the same rules as the
memory and speed interpreters, from below both. planner.memory.activations re-exports every name.

Symbols: b batch, s sequence, n = b·s tokens; "low" is the dtype of matmul outputs (bf16/fp16 under AMP or
pure 16-bit, fp32 otherwise); "act" the dtype of the residual stream (fp32 for fp32 and AMP, 16-bit for pure
16-bit).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from planner.families import family
from planner.spec import Backend, TransformerSpec

F32, BOOL, I64 = "float32", "bool", "int64"

# "fp8": everything but the FP8 Linears computes as amp-bf16 (planner.ir.fp8)
LOW_DTYPE = {"fp32": F32, "amp-fp16": "float16", "amp-bf16": "bfloat16", "fp16": "float16", "bf16": "bfloat16",
             "fp8": "bfloat16"}


# FlashAttention-2 (and SDPA's flash backend) supports head_dim <= 256 (sdp_utils.cpp check_head_dim_size_flash).
FLASH_MAX_HEAD_DIM = 256


@dataclass(frozen=True)
class Ctx:
    """Everything the formulas need about one micro-batch, precision, kernel choice and backend, on one rank.

    Model parallelism (issue 34; set from the layout, planner.parallel.dims, by the pipeline's resolve): `tp`
    tensor-parallel ranks split the heads, the feed-forward width and the vocabulary (the layer forms emit one
    rank's ops: planner.families.forms.common `width`); with `sp` (sequence parallelism) the residual stream,
    its norms, dropouts and adds hold `rows` = n / tp tokens; `cp` context-parallel ranks split the sequence:
    `s` stays the sample's whole sequence, `chunk` = s / cp is what this rank holds (`n` = b · chunk tokens),
    attention's keys and values spanning all s (`kv_s`). tp = cp = 1, sp False: one GPU's whole micro-batch,
    as before issue 34.
    """

    b: int
    s: int  # tokens of one sample (the whole sequence; this rank holds `chunk` of them under CP)
    precision: str
    attention: str
    backend: Backend
    padded: bool  # the batch has padding, so HF materialises a 4-D attention mask
    flash_ok: bool = True  # the GPU runs FlashAttention-2 kernels (sm80+)
    # Model-parallel degrees of this rank's shard (planner.parallel.dims, set once by planner.pipeline.resolve):
    tp: int = 1  # tensor-parallel ranks sharing one layer
    sp: bool = False  # sequence parallelism: the residual stream split over the tp ranks
    cp: int = 1  # context-parallel ranks sharing one sequence
    # FP8 (planner.ir.fp8): the recipe whose rules the transformer layers' Linears follow (None: no FP8; the
    # precision above is then the 16-bit one FP8 training computes everything else in), and whether FSDP2
    # all-gathers their weights in FP8.
    fp8: str | None = None
    fp8_gather: bool = False
    # torch.compile (planner.ir.transforms.compile_ops): Inductor's fusion and the min-cut partitioner's rules
    compile: bool = False
    # SP: what a column-parallel linear saves of its all-gathered input. False: its local n/tp shard, gathered
    # again in backward (Megatron-Core, megatron/core/tensor_parallel/layers.py
    # LinearWithGradAccumulationAndAsyncCommunication: `ctx.save_for_backward(input, weight)` before the
    # all-gather; backward `dist_all_gather_func(all_gather_buffer, input, ...)`; Korthikanti et al. 2022
    # §4.2.2). True: the gathered n rows (DTensor's ColwiseParallel after PrepareModuleInput(Shard(1) ->
    # Replicate()), as torchtitan's Llama plan runs it: the mm saves its replicated input).
    sp_saves_gathered: bool = False

    @property
    def chunk(self) -> int:
        """Tokens of one sample on this rank: s / cp (context parallelism's local chunk)."""
        return self.s // self.cp
    # Mixture-of-experts layers (issue 35): the expert-parallel degree this rank's experts are split over
    # (each rank holds experts / ep and computes the token-expert pairs sent to them) and the hottest rank's
    # share of pairs over the mean (--moe-imbalance). Dense models never read them.
    ep: int = 1
    moe_imbalance: float = 1.0
    # expert-tensor parallelism (--etp): each expert's width split over etp ranks, which all-gather the
    # dispatched pairs of their group (Megatron-Core MoEAlltoAllTokenDispatcher over `expt_tp`)
    etp: int = 1
    # whether the routed experts' grouped GEMMs run in the 16-bit compute dtype (`low`): the framework's own MoE
    # casts them (planner.parallel.frameworks.Framework.experts_16bit: torchtitan, Megatron-Core) or its layout
    # holds 16-bit weights (an FSDP policy, DeepSpeed's engine), which transformers' grouped_mm computes in;
    # False: the weights' dtype as transformers does with fp32 weights (fp32 under amp-*)
    experts_16bit: bool = False
    # Transformer Engine's FP8 weight workspace cached per module across a step's micro-batches (Megatron
    # passes `is_first_microbatch`; planner.parallel.frameworks.Framework.te_weight_cache): the FP8 weight and
    # its transpose are one persistent copy per Linear, not one saved per micro-batch
    fp8_weight_cache: bool = False
    # the framework's fused MoE kernels (planner.parallel.frameworks.Framework.fused_moe: Megatron-Core's and NeMo
    # AutoModel's permutation and weighted SwiGLU): what the permutation and expert activation save
    fused_moe: bool = False
    # TE's fused top-k router (Framework.fused_router, Megatron-Core's moe_router_fusion): what the router saves
    fused_router: bool = False
    # Transformer Engine's fused RMSNorm (Framework.fused_norms, Megatron): its input and the fp32 rstd saved
    fused_norms: bool = False
    # the causal LM's logits upcast to fp32 before cross-entropy (transformers' ForCausalLMLoss `logits.float()`;
    # Framework.loss_fp32): log_softmax's saved output in fp32; False: in the logits' dtype (`cross_entropy_saved`)
    loss_fp32: bool = True
    # F.cross_entropy is ATen's composite `cross_entropy_loss` (torch >= 1.10; aten/src/ATen/native/LossNLL.cpp):
    # log_softmax(self, dim, self.scalar_type()) keeps the logits' own dtype (an explicit dtype, which autocast's
    # fp32_set_opt_dtype policy leaves alone: ATen/autocast_mode.h), then nll_loss, which CUDA autocast runs in fp32
    # (AT_FORALL_FP32) on an fp32 copy that it saves. False (older torch, or CPU autocast, whose fp32 list holds
    # cross_entropy_loss itself): the whole loss on an fp32 copy of the logits. `activations.cross_entropy_saved`.
    cross_entropy_composite: bool = True
    # Transformer Engine's fused cross-entropy (Framework.fused_loss, Megatron): the logits kept as they are (the
    # model's output) and three fp32 statistics a row saved; the gradient written into the logits in place
    fused_loss: bool = False
    # Megatron-Core's TE layer spec (Framework.kernels "megatron"): q, k, v are one linear_qkv and a gated MLP's
    # gate and up one linear_fc1, each one GEMM on one copy of its input (under FP8, one FP8 copy saved)
    fused_linears: bool = False
    # Megatron-Core's fused SwiGLU of a dense MLP (Framework.fused_glu, `bias_swiglu_impl`): the fc1 output saved,
    # nothing for silu(gate) or the product
    fused_glu: bool = False

    @property
    def n(self) -> int:
        """Tokens of the micro-batch on this rank (b · chunk)."""
        return self.b * self.chunk

    @property
    def rows(self) -> int:
        """Rows of the residual stream on this rank: n, or n / tp under sequence parallelism."""
        return self.n // self.tp if self.sp else self.n

    @property
    def kv_s(self) -> int:
        """Keys each query attends over: the whole sequence (context parallelism exchanges the other ranks'
        keys and values in a ring)."""
        return self.s

    def whole_model(self) -> Ctx:
        """This micro-batch on one GPU without model parallelism (the whole sequence, every head): what the
        speed model's kernel table is built from, planner.perf.model_parallel `stage_table` then dividing
        it per rank, so that the split is made once."""
        if not (self.sharded or self.sp):
            return self
        return replace(self, tp=1, sp=False, cp=1)

    @property
    def sharded(self) -> bool:
        """Any model-parallel split of the layer's activations (tp or cp above 1)."""
        return self.tp > 1 or self.cp > 1

    @property
    def amp(self) -> bool:
        return self.precision.startswith("amp-")

    @property
    def low(self) -> str:
        return LOW_DTYPE[self.precision]

    @property
    def act(self) -> str:
        return F32 if self.precision in ("fp32", "amp-fp16", "amp-bf16", "fp8") else LOW_DTYPE[self.precision]


def rank_context(b: int, seq_len: int, precision: str, attention: str, backend: Backend, padded: bool,
                 flash_ok: bool = True, *, tp: int = 1, sp: bool | None = None, cp: int = 1,
                 sp_saves_gathered: bool = False) -> Ctx:
    """The context record of one rank, sequence parallelism on by default with TP (as Megatron-Core recipes
    run it; TrainConfig.sp None)."""
    return Ctx(b, seq_len, precision, attention, backend, padded, flash_ok, tp=tp,
               sp=(tp > 1) if sp is None else (sp and tp > 1), cp=cp, sp_saves_gathered=sp_saves_gathered)


def heads_per_rank(spec: TransformerSpec, ctx: Ctx) -> int:
    """Attention heads one tensor-parallel rank holds (heads / tp: planner.parallel.dims checks it divides)."""
    return max(1, spec.num_heads // ctx.tp)


def kv_heads_per_rank(spec: TransformerSpec, ctx: Ctx) -> int:
    """Key/value heads one TP rank holds: kv_heads / tp, or one replicated head when there are fewer key/value
    heads than ranks (each rank keeps the head its query heads read)."""
    kv = spec.num_kv_heads
    return kv // ctx.tp if kv % ctx.tp == 0 else 1


def ffn_per_rank(spec: TransformerSpec, ctx: Ctx) -> int:
    """The feed-forward width of one TP rank (column-parallel up/gate, row-parallel down)."""
    return -(-spec.intermediate_size // ctx.tp)


def vocab_per_rank(spec: TransformerSpec, ctx: Ctx) -> int:
    """Rows of the vocabulary-parallel embedding and LM head on one TP rank: ceil(V / tp), the largest shard
    (Megatron pads V to a multiple of 128 · tp first, `make_vocab_size_divisible_by`; the padding is < 128
    rows per rank and is not counted)."""
    return -(-spec.vocab_size // ctx.tp)


def promote(a: str, b: str) -> str:
    """Type promotion between the floating dtypes we meet: fp32 wins, otherwise both are the same 16-bit."""
    return F32 if F32 in (a, b) else a


def norm_stats_dtype(dtype: str, backend: Backend) -> str:
    """dtype of the per-row (LayerNorm) / per-feature (BatchNorm) statistics a norm saves: CUDA allocates
    them in the accumulate type, fp32 (layer_norm_kernel.cu, Normalization.cuh); the CPU kernels in the
    input's dtype (measured)."""
    return F32 if backend == "cuda" else dtype


def autocast_fp32_op(op: str, backend: Backend) -> bool:
    """Whether autocast runs `op` in fp32 (casting 16-bit inputs up).

    CUDA: AT_FORALL_FP32 / AT_FORALL_FP32_SET_OPT_DTYPE in ATen/autocast_mode.h (softmax, log_softmax,
    layer_norm, pow, rsqrt, sum, nll_loss, binary_cross_entropy_with_logits, ...). cross_entropy_loss is not
    on it: its composite runs log_softmax in the logits' dtype and nll_loss in fp32 (`Ctx.cross_entropy_composite`).
    CPU: its own, shorter fp32 list: of the ops our models use only the losses (cross_entropy_loss, nll_loss,
    binary_cross_entropy_with_logits); softmax, layer_norm, pow stay 16-bit (measured on torch 2.13).
    """
    cuda = {"softmax", "log_softmax", "layer_norm", "pow", "rsqrt", "sum", "nll_loss", "bce_with_logits"}
    cpu = {"cross_entropy", "nll_loss", "bce_with_logits"}
    return op in (cuda if backend == "cuda" else cpu)


def sdpa_kernel(ctx: Ctx, dtype: str, dropout_p: float, masked: bool, head_dim: int,
                mask_requires_grad: bool = False) -> str:
    """Which kernel `F.scaled_dot_product_attention` runs in training: "math", "cpu_flash", "flash",
    "efficient".

    CPU (sdp_utils_cpp.cpp): the CPU flash kernel refuses dropout (check_for_dropout), so training with
    attention dropout falls back to the math path. CUDA (sdp_utils.cpp priority flash > efficient > math):
    flash needs 16-bit, no explicit mask, head_dim <= 256 and sm80+; otherwise the memory-efficient kernel
    (any dtype, additive bias, dropout). attention="flash" means FlashAttention-2: always the flash kernel
    (HF's FA2 path unpads instead of masking). Where a recent torch prefers cuDNN attention (sm90+), that
    kernel saves the same q, k, v, output and fp32 row statistics as flash, so the flash formula applies.

    A mask that requires grad (T5's learned position bias, `create_position_bias_mask` in transformers'
    sdpa_attention.py) runs the math path on CUDA (`sdpa_math_for_mask_grad`). The fused choice is made
    before anything else, so this holds for attention="flash" too: HF's FA2 cannot take a bias at all.
    """
    if ctx.backend == "cpu":
        return "math" if dropout_p > 0 else "cpu_flash"
    if masked and mask_requires_grad and sdpa_math_for_mask_grad(ctx.backend):
        return "math"
    if ctx.attention == "flash":
        return "flash"
    if not masked and dtype != F32 and ctx.flash_ok and head_dim <= FLASH_MAX_HEAD_DIM:
        return "flash"
    return "efficient"


def sdpa_math_for_mask_grad(backend: Backend) -> bool:
    """Whether SDPA runs its math path when the additive mask requires grad.

    CUDA: measured on an H200, torch 2.11 (shared readings h200-2026-11-26, traced-memory-sites.txt): in
    T5-base fp32, the 24 calls whose mask carries the learned position bias (encoder and decoder
    self-attention) hold exactly the math path's saved tensors at line 158 of sdpa_attention.py (scaled q
    and k, softmax, dropout mask, dropped probabilities and the folded v, 504 MiB each at b16 s512), while
    the 12 cross-attention calls, whose zero bias needs no grad, hold only the memory-efficient output and
    logsumexp. cuDNN refuses such a mask by source (sdp_utils_cpp.h `check_attn_mask_shape`:
    `if (attn_mask.value().requires_grad()) return false;`). CPU: its flash kernel refuses it the same way.
    """
    return True


def math_sdpa_dtype(dtype: str, backend: Backend) -> str:
    """Compute dtype of SDPA's math path: it upcasts 16-bit q/k/v to fp32 on both devices (attention.cpp
    `_scaled_dot_product_attention_math`: `query_.to(at::kFloat)` unless
    `allowFP16BF16ReductionMathSDP()`, off by default; the same composite runs on CPU and CUDA; measured on
    CPU, and the H200 T5 readings hold fp32 softmax and probabilities under AMP bf16)."""
    return F32 if dtype != F32 else dtype


def attention_kernel(spec: TransformerSpec, ctx: Ctx, masked: bool) -> str:
    """"eager" or the SDPA kernel (see `sdpa_kernel`) for this layer."""
    if ctx.attention == "eager":
        return "eager"
    return sdpa_kernel(ctx, ctx.low, spec.attention_dropout, masked, spec.head_dim)


def mask_materialised(spec: TransformerSpec, ctx: Ctx) -> bool:
    """Whether HF builds a 4-D mask (masking_utils): always for decoders in eager, and for Mistral once
    s >= sliding_window; otherwise only when the batch has padding (an all-ones mask is skipped for SDPA:
    `_ignore_causal_mask_sdpa`, `_ignore_bidirectional_mask_sdpa`). FlashAttention-2 takes the 2-D mask and
    unpads instead."""
    if ctx.attention == "flash" and ctx.backend == "cuda":
        return False
    traits = family(spec.family)
    if traits.decoder and ctx.attention == "eager":
        return True
    window = spec.hf_config.get("sliding_window") if traits.sliding_window else None
    if window and ctx.s >= window:
        return True  # a sliding window needs an explicit mask once s reaches it (local_attention_size)
    return ctx.padded


def mask_bytes_dtype(ctx: Ctx) -> str:
    """HF's 4-D mask: bool for SDPA, additive in the model's dtype for eager."""
    return BOOL if ctx.attention != "eager" else ctx.act
