"""Time of each kernel of a training step on one GPU: the roofline with the GPU's real limits.

    t(kernel) = max(FLOPs / (peak[dtype, unit] · gemm_efficiency · wave(shape)),
                    bytes / (HBM bandwidth · hbm_efficiency)) + kernel_gap_s

- peak: tensor cores for fp16/bf16 (TF32 for fp32 only when `allow_tf32`), CUDA cores (FP32 peak) for fp32;
  a GEMM on CUDA cores uses `cuda_core_gemm_efficiency` in place of `gemm_efficiency`.
- wave(shape): a GEMM runs as output tiles (128×128 or 256×128, the better of the two, as cuBLAS picks) spread
  over the SMs; a partial last wave costs a whole wave, and padding inside a tile is wasted:
  wave = m·n·batch / (ceil(tiles / SMs) · SMs · tile_m · tile_n). When the tiles do not fill one wave, cuBLAS
  splits K (split-K) over the idle SMs, as far as K allows (>= `split_k_min` per slice).
- on an architecture with a row in `arch_gemm_size` (Hopper), a 16-bit tensor-core GEMM of F FLOPs takes
  F / (peak · r_inf · wave) + F_1/2 / (peak · r_inf) instead (Hockney's law: r_inf sourced, F_1/2 fitted;
  see ARCH_GEMM_SIZE), so a 70B model's GEMMs reach the measured large-matmul ceiling and BERT's do not.
- fused attention (SDPA flash / memory-efficient): `fused_attention_efficiency` of the peak instead of the
  GEMM ceiling, the same wave rule over b·a·ceil(s/128) query tiles.
- memory-bound kernels: bytes at `hbm_efficiency` of the datasheet bandwidth.

The CPU side (planner.perf.host): eager PyTorch launches every kernel through Python, the dispatcher and
autograd, host = launches × `cpu_dispatch_s` × the instance's CPU factor; the GPU computes while Python
dispatches the next ops, but not perfectly (syncs, the queue running dry at small kernels), so

    micro-step = (GPU^p + host^p)^(1/p) + micro_step_overhead_s,   p = `host_overlap_power`

(data-loader hand-off, the sync, the Trainer's Python per step). The efficiencies are universal except on
architectures with a row in `arch_efficiencies` (fitted on real readings of that architecture); all are
overridable through `RooflineConstants` (planner.perf.throughput.ThroughputConstants inherits them).

The kernel list is built once per model and shape class (everything but the micro-batch) at b = 1 and b = 2;
every kernel's FLOPs, bytes and GEMM dimensions are affine in b, so any batch is a vector operation (numpy),
which keeps the estimate fast for the search.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from planner import caches
from planner.ir.context import Ctx
from planner.perf.kernels import KINDS, Kernel, is_fused_attention
from planner.perf.micro_step import micro_kernels
from planner.spec import GPU, ModelSpec, TrainConfig

TFLOP = 1e12
GB = 1e9
PHASES = ("forward", "backward", "recompute", "step")
ATTENTION_QUERY_TILE = 128  # FlashAttention-2 / mem-efficient forward: one CTA per 128 query rows per head


# FITTED by benchmarks/fit_roofline.py on the 24 single-GPU rows of sources dle-bert-1907 and dle-bert-2006 in
# results/public/throughput/runs.csv (NVIDIA DeepLearningExamples PyTorch BERT README, pytorch:19.07 and 20.06
# containers: BERT-large SQuAD and pre-training on V100 16/32 GB and A100 40 GB), grid-searched within the
# physically plausible ranges (GEMM <= 0.90 of dense peak, HBM <= 0.925 of datasheet bandwidth).
# - Those scripts' fp16 runs use apex AMP O2 with keep_batchnorm_fp32=False (run_squad.py @0663b67c; apex's
#   FusedAdam accepts no other mode): the whole model in fp16, LayerNorm and softmax included. The rows say so
#   (precision fp16); modeled as torch autocast instead (fp32 norms and softmax), the fit sat on both upper
#   bounds to absorb bytes those runs never moved.
# - Tensor-core and CUDA-core GEMMs reach different shares of their peaks (cuBLAS SGEMM runs close to the FP32
#   peak; tensor-core GEMMs are held back by operand bandwidth), so fp32 GEMMs without TF32 have their own
#   efficiency.
# Fit (after issue 24's host model): 7.0 % median |error| on the fit rows; 20.8 % on the 20 held-out single-GPU rows
# (dle-bert-2111, lambda-dlb, lambda-dlb-v2). tests/test_throughput.py checks that no step of 0.025 from these
# values fits better. Refitted in issue 36 after the eager attention's elementwise backward passes stopped
# being counted as the fused kernel's backward (planner.perf.kernels.is_fused_attention: NVIDIA's BERT is
# eager; the fit had made up for ~2x their bytes with HBM at 0.90): 0.625 / 0.90 / 0.90 -> 0.60 / 0.90 / 0.775,
# 6.9 % on the fit rows, 19.3 % on the held-out ones.
GEMM_EFFICIENCY = 0.60
HBM_EFFICIENCY = 0.775
CUDA_CORE_GEMM_EFFICIENCY = 0.90

# Per GPU architecture (compute-capability major) where readings exist, the same efficiencies plus TF32's, as
# (major, tensor-core 16-bit GEMM, CUDA-core fp32 GEMM, HBM, TF32 GEMM). FITTED by benchmarks/fit_readings.py
# on the shared H200 readings only (results/validation/h200/shared-2026-11-26/: the fit half of steps.jsonl,
# TF32 from the one TF32 row of its launch.jsonl: GPU-busy time of BERT-base b32 s512), never on the
# held-out readings of results/validation/*/measured-2026-11-26/ nor on public rows. Hopper's 16-bit GEMMs,
# and its streaming kernels, reach a smaller share of their (much higher) datasheet peaks than Volta/Ampere's;
# TF32 far less than the datasheet's TF32/FP16 ratio of 1/2 suggests. Architectures without a row use the
# universal values above (and TF32 at GEMM_EFFICIENCY, the figure before this table).
HOPPER = 9
# The host side of a step (planner.perf.host), FITTED by benchmarks/fit_readings.py on the same shared H200
# readings (their host's CPU, torch 2.11, transformers 5.17, eager): host seconds per CUDA launch the kernel
# list counts (it carries the ATen calls around each launch: the readings' profiles count 4-6 ATen calls per
# kernel, AMP's casts included, at ~3.7 us each, and ~20 us of host time per kernel), and the power of the
# overlap rule. Before this fit: 15 us per launch (ASSUMPTION) and p = infinity (max(gpu, host)).
CPU_DISPATCH_S = 20e-6
HOST_OVERLAP_POWER = 2.0
# Hopper's HBM efficiency (0.65, for vectorized passes) was refitted by benchmarks/fit_memory_passes.py together
# with the mixed passes' rate, F_1/2 and the host's two constants, which stayed (see ARCH_DYNAMIC_CAST).
ARCH_EFFICIENCIES: tuple[tuple[int, float, float, float, float], ...] = (
    (HOPPER, 0.45, 0.85, 0.65, 0.275),
)
# A 16-bit tensor-core GEMM's efficiency by its size, where an architecture has a row here (replacing that
# architecture's constant GEMM efficiency for such GEMMs): Hockney's (r_inf, n_1/2) model of a pipelined unit
# (Hockney & Jesshope, "Parallel Computers", 1981), with the GEMM's FLOPs as the length:
#     t = F / (peak · r_inf · wave(shape)) + F_1/2 / (peak · r_inf)
# i.e. efficiency r_inf · F / (F + F_1/2) for a GEMM that fills its waves (a GEMM too small to fill one wave
# pays its wave loss and the fixed cost once each, not their product). The fixed cost is per GEMM launch, so a
# tiny GEMM (a few KFLOP) also pays it whole: ~19 us where a bare launch would take ~5.
# - r_inf, SOURCED: the largest share of the dense peak a bf16 `torch.matmul` reaches on the GPU over a search
#   of shapes, Stas Bekman's "Maximum Achievable Matmul FLOPS" table (stas00/ml-engineering,
#   compute/accelerator/README.md, stored copy b9e29720eebd4aa946fa9678975385efbc90a777; figures in
#   results/public/gemm/mamf.csv): H100 SXM 792.1 of 989 TFLOPS (80.1 %, CUDA 12.1, best shape
#   6144x17920x2816); GH200 (the H100/H200 die) 83.0 %. Hopper: 0.80.
# - F_1/2 (the FLOPs at which a GEMM reaches half of r_inf: a fixed cost per GEMM of F_1/2 / (r_inf · peak)
#   seconds: prologue, pipeline fill, epilogue, the tail of the last wave, the clock's ramp, and what eager
#   PyTorch loses around each GEMM) FITTED by benchmarks/fit_gemm_size.py on the fit two thirds of the shared
#   H200 readings (results/validation/h200/shared-2026-11-26), r_inf held at the sourced value, jointly with
#   Hopper's HBM efficiency (fitted with the constant GEMM efficiency this replaces: 0.65 before, then 0.50, the
#   lower bound of the grid: the fit moves time from the GEMMs into the memory-bound kernels), every other
#   constant as benchmarks/fit_readings.py fitted it. F_1/2 = 15 GFLOP then; refitted to 10 GFLOP (13 us of
#   fixed cost on an H100/H200) with the mixed passes' rate by benchmarks/fit_memory_passes.py (see
#   ARCH_DYNAMIC_CAST; the readings barely tell 2.5-10 GFLOP apart, and the script keeps the largest of the
#   tied values). The small models' GEMMs (BERT-base b32 s512: 19-80 GFLOP) get 0.53-0.71; a 70B model's
#   (0.2-2 TFLOP each) 0.76-0.80, as the MAMF search says large GEMMs reach.
#   The 16-bit GEMM figure of ARCH_EFFICIENCIES (0.45) still times the step-level kernels (time_kernels).
# Architectures without a row keep their constant efficiency (V100/A100 fitted on BERT-large: 0.625).
ARCH_GEMM_SIZE: tuple[tuple[int, float, float], ...] = (
    (HOPPER, 0.80, 10e9),
)
# Elementwise passes over mixed floating dtypes (a bf16 and an fp32 operand under autocast; a 16-bit -> fp32
# copy): ATen's CUDA loop (CUDALoops.cuh gpu_kernel_impl, `needs_dynamic_casting`) runs them unrolled with a
# per-element cast on load and store and no vector loads (launch_unrolled_kernel with LoadWithCast/
# StoreWithCast; Copy.cu gives only fp32 -> 16-bit copies a vectorized kernel), so each thread keeps few bytes
# in flight and the pass is bound by the SMs, not the HBM: bytes per SM per clock. The held-out readings agree
# in kind: a GPT-2 AMP step (b32 x 1024: a quarter of its memory-bound bytes, over 40 % of their time, in such
# passes) is only 15 % slower on an H100 (3.35 TB/s) than on an H200 (4.8 TB/s); its fp32 step 4 %.
# FITTED by benchmarks/fit_memory_passes.py on the fit two thirds of the shared H200 readings
# (results/validation/h200/shared-2026-11-26/steps.jsonl), jointly with Hopper's HBM efficiency, F_1/2 and the
# host's dispatch cost and overlap (mean |log error| on the fit rows 0.058 -> 0.050): 5.0 bytes per SM-cycle,
# 1.31 TB/s on 132 SMs at 1,980 MHz, while vectorized passes reach 0.65 of the datasheet (3.1 TB/s on an
# H200; the fit without this rate sat at its grid's floor, 0.50, averaging the two kinds). Hopper only:
# no other architecture has readings (elsewhere these passes are timed as any other).
ARCH_DYNAMIC_CAST: tuple[tuple[int, float], ...] = (
    (HOPPER, 5.0),
)


class RooflineConstants(BaseModel):
    """The few universal efficiencies of the roofline, each with its source; override with model_copy."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    gemm_efficiency: float = Field(
        GEMM_EFFICIENCY, gt=0, le=1,
        description="fraction of the dense tensor-core peak a full-wave cuBLAS GEMM reaches (FITTED, see "
                    "GEMM_EFFICIENCY)")
    cuda_core_gemm_efficiency: float = Field(
        CUDA_CORE_GEMM_EFFICIENCY, gt=0, le=1,
        description="fraction of the FP32 CUDA-core peak an fp32 GEMM without TF32 reaches (FITTED, see "
                    "CUDA_CORE_GEMM_EFFICIENCY)")
    fused_attention_efficiency: float = Field(
        0.50, gt=0, le=1,
        description="fraction of peak of fused attention forward+backward (FlashAttention-2 paper, Dao 2023: "
                    "50-73% of A100 peak; the memory-efficient kernel is slower: lower end)")
    hbm_efficiency: float = Field(
        HBM_EFFICIENCY, gt=0, le=1,
        description="share of datasheet HBM bandwidth that streaming elementwise kernels reach (FITTED, see "
                    "HBM_EFFICIENCY)")
    tile_shapes: tuple[tuple[int, int], ...] = Field(
        ((128, 128), (256, 128)), description="GEMM output tiles (rows, cols) one SM computes per wave (cuBLAS/"
                                              "CUTLASS tensor-core kernels)")
    split_k_min: int = Field(256, gt=0, description="smallest K slice cuBLAS split-K gives one tile (ASSUMPTION)")
    kernel_gap_s: float = Field(
        3e-6, ge=0, description="GPU time per kernel beyond its roofline time: launch, ramp-up and tail "
                                "(~2-5 us back-to-back; ASSUMPTION)")
    cpu_dispatch_s: float = Field(
        CPU_DISPATCH_S, ge=0,
        description="host time per kernel launched by eager PyTorch with autograd (Python module call, "
                    "dispatcher, the ATen calls around it, autograd node) on the readings' host; scaled by the "
                    "instance's CPU (planner.perf.host; FITTED, see CPU_DISPATCH_S)")
    micro_step_overhead_s: float = Field(
        1e-3, ge=0,
        description="fixed host time per micro-step not hidden behind GPU work: data-loader hand-off, "
                    "loss.item() sync, Trainer Python (ASSUMPTION)")
    arch_efficiencies: tuple[tuple[int, float, float, float, float], ...] = Field(
        ARCH_EFFICIENCIES,
        description="per compute-capability major: (major, gemm, cuda-core gemm, hbm, tf32 gemm) efficiencies "
                    "replacing the universal ones on that architecture (FITTED, see ARCH_EFFICIENCIES)")
    arch_gemm_size: tuple[tuple[int, float, float], ...] = Field(
        ARCH_GEMM_SIZE,
        description="per compute-capability major: (major, asymptotic efficiency, FLOPs at half of it) of a "
                    "16-bit tensor-core GEMM, replacing that architecture's constant GEMM efficiency "
                    "(asymptote SOURCED, half-FLOPs FITTED, see ARCH_GEMM_SIZE)")
    host_overlap_power: float = Field(
        HOST_OVERLAP_POWER, ge=1,
        description="micro-step = (gpu^p + host^p)^(1/p): how well the GPU's work hides the host's dispatch "
                    "and back (FITTED, see HOST_OVERLAP_POWER)")
    arch_dynamic_cast: tuple[tuple[int, float], ...] = Field(
        ARCH_DYNAMIC_CAST,
        description="per compute-capability major: bytes per SM per clock an elementwise pass over mixed "
                    "floating dtypes moves at most (ATen's unrolled, per-element-cast loop; FITTED, see "
                    "ARCH_DYNAMIC_CAST); architectures without a row time those passes as any other")
    allow_tf32: bool = Field(
        False, description="fp32 matmuls on TF32 tensor cores; PyTorch default torch.backends.cuda.matmul."
                           "allow_tf32=False (float32_matmul_precision='highest')")


# ------------------------------------------------------------------------------ peak per dtype


def peak_key(gpu: GPU, dtype: str, allow_tf32: bool) -> str:
    """Which of the GPU's peaks a kernel computing in `dtype` runs at: tensor cores for 16-bit, FP32 CUDA cores
    for fp32 (TF32 tensor cores when allowed and present). A dtype the GPU lacks (bf16 on V100) falls back to
    fp32."""
    key = {"float16": "fp16", "bfloat16": "bf16", "float8_e4m3fn": "fp8"}.get(dtype, "fp32")
    if key == "fp32" and allow_tf32 and "tf32" in gpu.peak_tflops:
        key = "tf32"
    return key if key in gpu.peak_tflops else "fp32"


def peak_for(gpu: GPU, dtype: str, allow_tf32: bool) -> float:
    """TFLOP/s for a kernel computing in `dtype` (`peak_key`)."""
    return gpu.peak_tflops[peak_key(gpu, dtype, allow_tf32)]


# ------------------------------------------------------------------------------ the kernel table


@dataclass(frozen=True)
class KernelTable:
    """A micro-step's kernels as affine functions of the micro-batch b: value(b) = base + per_b · b."""

    names: tuple[str, ...]
    kind: np.ndarray  # index into KINDS
    phase: np.ndarray  # index into PHASES
    count: np.ndarray
    launches: np.ndarray
    dtype: tuple[str, ...]
    is_gemm: np.ndarray  # timed with the tile/wave rule (GEMMs and eager attention bmm's)
    is_fused_attention: np.ndarray
    base: np.ndarray  # columns: flops, bytes, batch, m, n, k
    per_b: np.ndarray
    peaks_cache: dict = field(default_factory=dict, compare=False, repr=False)
    # the block role of each kernel (planner.models.blocks: "layer", "embeddings", "head", ...; "" for the
    # loss); empty for a traced model's table. The model-parallel speed (planner.perf.model_parallel) splits
    # layers over pipeline stages and puts the rest on the first or last one.
    roles: tuple[str, ...] = ()
    # elementwise passes over mixed floating dtypes (planner.perf.kernels.Kernel.dynamic_cast); empty: none
    dynamic_cast: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool), compare=False)

    def at(self, b: int) -> np.ndarray:
        return self.base + self.per_b * b


def _row(k: Kernel) -> list[float]:
    g = k.gemm or (0, 0, 0, 0)
    return [float(k.flops), float(k.bytes), *map(float, g)]


def build_table(model: ModelSpec, config: TrainConfig, *, causal_fraction: float = 1.0,
                flash_ok: bool = True, ctx: Ctx | None = None) -> KernelTable:
    """Kernels at b = 1 and b = 2, paired by name, as affine coefficients (`ctx`: the pipeline's context
    record, at those two batch sizes)."""
    one = micro_kernels(model, config.model_copy(update={"batch_size": 1}), causal_fraction=causal_fraction,
                        flash_ok=flash_ok, ctx=ctx)
    two = micro_kernels(model, config.model_copy(update={"batch_size": 2}), causal_fraction=causal_fraction,
                        flash_ok=flash_ok, ctx=ctx)
    if [k.name for k in one] != [k.name for k in two]:  # pragma: no cover - a kernel list that is not affine
        raise ValueError("kernel list changes shape with the batch size")
    v1 = np.array([_row(k) for k in one])
    v2 = np.array([_row(k) for k in two])
    per_b = v2 - v1
    return KernelTable(
        names=tuple(k.name for k in one),
        kind=np.array([KINDS.index(k.kind) for k in one]),
        phase=np.array([PHASES.index(k.phase) for k in one]),
        count=np.array([k.count for k in one], dtype=float),
        launches=np.array([k.launches for k in one], dtype=float),
        dtype=tuple(k.dtype for k in one),
        is_gemm=np.array([k.gemm is not None for k in one]),
        is_fused_attention=np.array([is_fused_attention(k) for k in one]),
        base=v1 - per_b, per_b=per_b, roles=tuple(k.block_role for k in one),
        dynamic_cast=np.array([k.dynamic_cast for k in one], dtype=bool))


_TABLES: OrderedDict[tuple, tuple[ModelSpec, KernelTable]] = caches.adopt(
    "planner.perf.roofline._TABLES", OrderedDict(), scope="model",
    key="(model identity, TrainConfig's shape fields, causal fraction, flash) -> kernel table, in use order")
TABLE_CACHE_SIZE = 256
TIMES_CACHE_SIZE = 512  # (micro-batch, GPU) timings kept per table
# TrainConfig fields that do not change a micro-step's kernel list (the batch size scales it, see KernelTable).
NOT_SHAPE = frozenset({"batch_size", "grad_accum", "instances", "parallelism", "gradient_as_bucket_view",
                       "bucket_cap_mb", "optimizer", "optimizer_impl"})


@caches.lru(1, scope="facts", key="none: TrainConfig's fields a kernel table depends on")
def _shape_fields() -> tuple[str, ...]:
    """The shape class: every other TrainConfig field, in a fixed order."""
    return tuple(sorted(f for f in TrainConfig.model_fields if f not in NOT_SHAPE))


def kernel_table(model: ModelSpec, config: TrainConfig, *, causal_fraction: float = 1.0,
                 flash_ok: bool = True, ctx: Ctx | None = None) -> KernelTable:
    """`build_table`, cached per model object and shape class (the config without its batch size). `ctx`: the
    context record the pipeline resolved (its flash and padding decide; its batch size does not)."""
    if ctx is not None:
        flash_ok = ctx.flash_ok
    # what of the record a table reads besides the config's shape fields (the batch size scales it)
    record = (ctx.s, ctx.precision, ctx.attention, ctx.padded) if ctx is not None else model.inputs.attention_mask
    key = (id(model), *(getattr(config, f) for f in _shape_fields()), causal_fraction, flash_ok, record)
    hit = _TABLES.get(key)
    if hit is not None and hit[0] is model:
        _TABLES.move_to_end(key)
        return hit[1]
    table = build_table(model, config, causal_fraction=causal_fraction, flash_ok=flash_ok, ctx=ctx)
    _TABLES[key] = (model, table)
    if len(_TABLES) > TABLE_CACHE_SIZE:
        _TABLES.popitem(last=False)
    return table


# ------------------------------------------------------------------------------ timing


def wave_efficiency(batch: np.ndarray, m: np.ndarray, n: np.ndarray, k: np.ndarray, sms: int,
                    c: RooflineConstants) -> np.ndarray:
    """Useful share of the SM-tiles a GEMM occupies: the best tile shape, split-K when one wave is not full."""
    best = np.zeros_like(m, dtype=float)
    m, n = np.maximum(m, 1), np.maximum(n, 1)
    for tm, tn in c.tile_shapes:
        tiles = batch * np.ceil(m / tm) * np.ceil(n / tn)
        split = np.clip(np.minimum(np.floor(sms / np.maximum(tiles, 1)), np.floor(k / c.split_k_min)), 1, None)
        units = tiles * split
        waves = np.ceil(units / sms)
        eff = batch * m * n * split / (waves * sms * tm * tn)
        best = np.maximum(best, eff)
    return np.clip(best, 1e-6, 1.0)


@dataclass(frozen=True)
class KernelTimes:
    """Per-kernel seconds (per occurrence × count) of one micro-step, and what bounds each."""

    seconds: np.ndarray  # roofline time × count, without the gap
    gap: np.ndarray  # kernel_gap_s × launches × count
    memory_bound: np.ndarray  # bytes time >= FLOPs time
    launches: float  # CUDA launches of one micro-step


def gpu_key(gpu: GPU) -> tuple:
    """What the timing reads of a GPU (a GPU changed with model_copy but keeping its name is another GPU)."""
    return (gpu.name, tuple(sorted(gpu.peak_tflops.items())), gpu.memory_bandwidth_gbs, gpu.sm_count,
            gpu.boost_clock_mhz, tuple(gpu.compute_capability))


def _peaks(table: KernelTable, gpu: GPU, allow_tf32: bool) -> np.ndarray:
    """FLOP/s of each kernel's unit on this GPU, cached per table and GPU."""
    key = (gpu_key(gpu), allow_tf32)
    hit = table.peaks_cache.get(key)
    if hit is None:
        hit = np.array([peak_for(gpu, d, allow_tf32) for d in table.dtype]) * TFLOP
        table.peaks_cache[key] = hit
    return hit


def on_cuda_cores(gpu: GPU, dtype: str, allow_tf32: bool) -> bool:
    """The kernel computes on FP32 CUDA cores (no tensor-core peak applies: `peak_key` took fp32)."""
    return peak_key(gpu, dtype, allow_tf32) == "fp32"


UNITS = ("tensor", "cuda_core", "tf32")  # which efficiency a kernel's compute time uses


def unit_of(gpu: GPU, dtype: str, allow_tf32: bool) -> int:
    """Index into UNITS: 16-bit tensor cores, FP32 CUDA cores, or TF32 tensor cores (`peak_key`)."""
    key = peak_key(gpu, dtype, allow_tf32)
    return 1 if key == "fp32" else 2 if key == "tf32" else 0


def _units(table: KernelTable, gpu: GPU, allow_tf32: bool) -> np.ndarray:
    key = ("units", gpu_key(gpu), allow_tf32)
    hit = table.peaks_cache.get(key)
    if hit is None:
        hit = table.peaks_cache[key] = np.array([unit_of(gpu, d, allow_tf32) for d in table.dtype], dtype=int)
    return hit


def efficiencies(gpu: GPU, c: RooflineConstants) -> tuple[float, float, float, float]:
    """(16-bit GEMM, CUDA-core GEMM, HBM, TF32 GEMM) efficiencies on this GPU: its architecture's row of
    `arch_efficiencies` when it has one (fitted on real readings of that architecture), else the universal
    ones, TF32 at the 16-bit GEMM figure."""
    major = gpu.compute_capability[0]
    for row in c.arch_efficiencies:
        if row[0] == major:
            return row[1], row[2], row[3], row[4]
    return c.gemm_efficiency, c.cuda_core_gemm_efficiency, c.hbm_efficiency, c.gemm_efficiency


def mixed_pass_bandwidth(gpu: GPU, c: RooflineConstants) -> float | None:
    """Bytes/s an elementwise pass over mixed floating dtypes reaches on this GPU at most (its SMs × clock ×
    the architecture's bytes per SM-cycle, ARCH_DYNAMIC_CAST), or None where the architecture has no row or
    the GPU's SM count or clock is unknown."""
    if not (gpu.sm_count and gpu.boost_clock_mhz):
        return None
    for major, per_cycle in c.arch_dynamic_cast:
        if major == gpu.compute_capability[0]:
            return gpu.sm_count * gpu.boost_clock_mhz * 1e6 * per_cycle
    return None


def gemm_size_law(gpu: GPU, c: RooflineConstants) -> tuple[float, float] | None:
    """(asymptotic efficiency, FLOPs at half of it) of this GPU's 16-bit tensor-core GEMMs, or None where its
    architecture has no row in `arch_gemm_size` (the constant efficiency applies)."""
    major = gpu.compute_capability[0]
    for row in c.arch_gemm_size:
        if row[0] == major:
            return row[1], row[2]
    return None


def gemm_size_efficiency(flops: np.ndarray, r_inf: float, f_half: float) -> np.ndarray:
    """Hockney's r_inf · F / (F + F_1/2): a GEMM of F FLOPs pays a fixed cost worth F_1/2 FLOPs at r_inf."""
    flops = np.maximum(flops, 1.0)
    return r_inf * flops / (flops + f_half)


def time_table(table: KernelTable, b: int, gpu: GPU, c: RooflineConstants) -> KernelTimes:
    """Roofline time of every kernel of a micro-step at micro-batch b (cached on the table per b, GPU and
    constants: a search times one micro-step on many instance counts)."""
    key = ("times", b, gpu_key(gpu), c)
    hit = table.peaks_cache.get(key)
    if hit is None:
        if len(table.peaks_cache) >= TIMES_CACHE_SIZE:
            table.peaks_cache.clear()
        hit = table.peaks_cache[key] = _time_table(table, b, gpu, c)
    return hit


def _time_table(table: KernelTable, b: int, gpu: GPU, c: RooflineConstants) -> KernelTimes:
    v = table.at(b)
    flops, nbytes = v[:, 0], v[:, 1]
    peaks = _peaks(table, gpu, c.allow_tf32)
    sms = gpu.sm_count or 0
    gemm, cuda_core, hbm, tf32 = efficiencies(gpu, c)
    unit = _units(table, gpu, c.allow_tf32)
    base = np.choose(unit, (gemm, cuda_core, tf32)).astype(float)
    law = gemm_size_law(gpu, c)
    sized = table.is_gemm & (unit == 0) if law is not None else np.zeros_like(table.is_gemm)
    if law is not None:  # 16-bit tensor-core GEMMs: r_inf, plus a fixed cost worth F_1/2 (ARCH_GEMM_SIZE)
        base[sized] = law[0]
    eff = base.copy()
    if sms:
        g = table.is_gemm
        eff[g] = base[g] * wave_efficiency(v[g, 2], v[g, 3], v[g, 4], v[g, 5], sms, c)
    eff = np.where(table.is_fused_attention, c.fused_attention_efficiency, eff)
    compute = flops / (peaks * eff)
    if law is not None:
        compute = compute + np.where(sized, law[1] / (peaks * law[0]), 0.0)
    memory = nbytes / (gpu.memory_bandwidth_gbs * GB * hbm)
    mixed = mixed_pass_bandwidth(gpu, c)
    if mixed is not None and table.dynamic_cast.any():
        memory = np.where(table.dynamic_cast, nbytes / min(gpu.memory_bandwidth_gbs * GB * hbm, mixed), memory)
    per = np.maximum(compute, memory)
    arrays = (per * table.count, c.kernel_gap_s * table.launches * table.count, memory >= compute)
    for a in arrays:  # shared through the cache: read-only
        a.flags.writeable = False
    return KernelTimes(*arrays, float((table.launches * table.count).sum()))


def time_kernels(kernels: tuple[Kernel, ...] | list[Kernel], gpu: GPU, c: RooflineConstants
                 ) -> tuple[float, float, float, float]:
    """Step-level kernels (optimizer, scaler): (roofline seconds, gap seconds, memory-bound seconds,
    launches). They are memory-bound passes: bytes / achievable bandwidth."""
    secs = gap = mem = launches = 0.0
    gemm, cuda_core, hbm, tf32 = efficiencies(gpu, c)
    bandwidth = gpu.memory_bandwidth_gbs * GB * hbm
    mixed = mixed_pass_bandwidth(gpu, c)
    mixed_bandwidth = bandwidth if mixed is None else min(bandwidth, mixed)
    for k in kernels:
        t_mem = k.bytes / (mixed_bandwidth if k.dynamic_cast else bandwidth)
        eff = (gemm, cuda_core, tf32)[unit_of(gpu, k.dtype, c.allow_tf32)]
        t_fl = k.flops / (peak_for(gpu, k.dtype, c.allow_tf32) * TFLOP * eff) if k.flops else 0.0
        t = max(t_mem, t_fl) * k.count
        secs += t
        mem += t if t_mem >= t_fl else 0.0
        gap += c.kernel_gap_s * k.launches * k.count
        launches += k.launches * k.count
    return secs, gap, mem, launches


def by_kind(table: KernelTable, values: np.ndarray) -> dict[str, float]:
    """Sum of `values` per kernel kind (KINDS)."""
    sums = np.bincount(table.kind, weights=values, minlength=len(KINDS))
    return {kind: float(sums[j]) for j, kind in enumerate(KINDS)}
