"""Predicted training speed: time of one optimizer step, samples and tokens per second, MFU.

One optimizer step = `grad_accum` micro-steps, then the gradient exchange, then the optimizer:

    step = grad_accum * (compute + overhead) + exposed communication + optimizer

- compute = executed FLOPs of one micro-step (planner.perf.flops: forward + backward + recompute) /
  (peak for the precision * efficiency(x)), with x = tokens per micro-step on one GPU and
  efficiency(x) = eff_max * x / (x + x_half), x_half = tokens_half_per_tflop * peak: small micro-batches
  leave the GPU under-occupied (launch latency, small GEMM tiles), large ones saturate at eff_max, which
  also absorbs the memory-bound non-matmul work (norms, softmax, dropout, GELU) that flops do not count.
- gradient all-reduce (DDP), once per optimizer step (no_sync on the other micro-steps): a ring moves
  2(n-1)/n x gradient bytes over the bus bandwidth inside the instance, and 2(N-1)/N x bytes over the
  network between N instances; `allreduce_overlap` of it hides behind the last micro-step's backward.
  ZeRO-1/2: reduce-scatter of gradients (overlapped like DDP) + all-gather of updated parameters
  (exposed). ZeRO-3/FSDP: every micro-step all-gathers parameters for forward and again for backward and
  reduce-scatters gradients, overlapped by `allreduce_overlap`. DataParallel (dp): every micro-step
  broadcasts parameters to the replicas and reduces gradients to GPU 0, not overlapped.
- optimizer: memory-bound, bytes read+written per parameter / (HBM bandwidth * hbm_efficiency), on
  1/n of the parameters under ZeRO/FSDP.
- fp32 matmuls use TF32 tensor cores only when `allow_tf32` (PyTorch's default
  torch.backends.cuda.matmul.allow_tf32 = False, i.e. float32 matmul precision "highest"), so fp32 runs at
  the CUDA-core FP32 peak by default.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from planner.errors import PlannerError
from planner.models.blocks import Block, model_blocks
from planner.models.params import count_parameters
from planner.perf.flops import step_flops, tokens_per_sample
from planner.spec import DenseSpec, Instance, ModelSpec, Throughput, TrainConfig, TransformerSpec

GB = 1e9
TFLOP = 1e12

# ---- the defaults, each with its reason ----------------------------------------------------------

# Tensor-core efficiency ceilings per GPU family (fraction of the dense datasheet peak that a whole
# transformer training step reaches at large micro-batches, non-matmul work included).
# V100: FITTED to NVIDIA DeepLearningExamples PyTorch BERT-large SQuAD fine-tuning, 1x V100 16G, mixed
# precision, batch 4 and 10 at seq 384 (35.88 and 45.2 sequences/s); the pre-training rows, the FP32
# rows and the 8-GPU rows of the same README are held out and checked in tests/test_throughput.py.
# Others: ASSUMPTIONS, not fitted: A100/H100 from the typical 40-55% MFU of well-tuned BERT/GPT training
# in bf16 (e.g. NVIDIA Megatron-LM reports 40-50%+ model FLOPs utilisation on A100/H100 at scale), lowered
# for plain PyTorch/HF; T4 and L4 are power-capped (70-72 W) far below their peak clocks; A10G/L40S in
# between. Replace with `planner calibrate` readings.
EFF_MAX_TENSOR: dict[str, float] = {
    "V100": 0.32, "T4": 0.30, "A10G": 0.45, "L4": 0.30, "L40S": 0.35, "A100": 0.50, "H100": 0.45, "H200": 0.45,
}
# CUDA-core FP32 efficiency ceilings. V100 FITTED to the same README's 1-GPU FP32 fine-tuning row
# (8.96 sequences/s at batch 4); others ASSUMED equal to V100's (SGEMM reaches a similar share of peak).
EFF_MAX_FP32: dict[str, float] = {
    "V100": 0.45, "T4": 0.40, "A10G": 0.45, "L4": 0.40, "L40S": 0.45, "A100": 0.46, "H100": 0.46, "H200": 0.46,
}
EFF_MAX_DEFAULT = 0.40
# Tokens per micro-step at which efficiency is half its ceiling, per TFLOP/s of peak: a GPU with more
# throughput needs proportionally more rows in its GEMMs to fill its SMs. FITTED on V100 (x_half ~ 340
# tokens at 125 TFLOP/s, from the two mixed-precision fine-tuning batch sizes); ASSUMED to scale with the
# peak elsewhere.
TOKENS_HALF_PER_TFLOP = 2.7


class ThroughputConstants(BaseModel):
    """Every constant of the throughput model; override any field with `model_copy(update={...})`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    eff_max_tensor: dict[str, float] = Field(
        default_factory=lambda: dict(EFF_MAX_TENSOR),
        description="fraction of tensor-core peak at large micro-batches, per GPU family (see EFF_MAX_TENSOR)")
    eff_max_fp32: dict[str, float] = Field(
        default_factory=lambda: dict(EFF_MAX_FP32),
        description="fraction of CUDA-core FP32 peak at large micro-batches, per GPU family (see EFF_MAX_FP32)")
    eff_max_default: float = Field(EFF_MAX_DEFAULT, gt=0, le=1, description="for a family missing above")
    tokens_half_per_tflop: float = Field(
        TOKENS_HALF_PER_TFLOP, gt=0,
        description="tokens per micro-step giving half the ceiling, per TFLOP/s of peak (fitted on V100)")
    allow_tf32: bool = Field(
        False, description="fp32 matmuls on TF32 tensor cores; PyTorch default torch.backends.cuda.matmul."
                           "allow_tf32=False (float32_matmul_precision='highest')")
    causal_fraction: float = Field(
        1.0, gt=0, le=1,
        description="share of the s^2 attention FLOPs executed for causal models; 1.0 counts them full "
                    "(FlopCounterMode convention); a causal flash kernel computes ~0.5")
    hbm_efficiency: float = Field(
        0.80, gt=0, le=1,
        description="share of datasheet HBM bandwidth that streaming elementwise kernels reach "
                    "(STREAM-like copies reach ~80-90% on V100/A100; ASSUMPTION)")
    optimizer_passes: dict[str, float] = Field(
        default_factory=lambda: {"fused": 1.0, "foreach": 2.0, "for-loop": 2.0},
        description="memory traffic relative to one fused read+write pass: torch.optim's foreach "
                    "implementation runs several _foreach_* kernels over the same tensors (ASSUMPTION 2x)")
    kernel_launch_s: float = Field(
        5e-6, gt=0, description="CPU cost of one CUDA kernel launch from PyTorch (~5 us; ASSUMPTION)")
    for_loop_kernels_per_tensor: int = Field(
        10, gt=0, description="kernels the for-loop optimizer launches per parameter tensor (AdamW ~10)")
    grad_scaler_bytes_per_param: float = Field(
        8.0, ge=0, description="fp16 GradScaler unscale_: read + write each fp32 gradient once")
    allreduce_overlap: float = Field(
        0.5, ge=0, le=1,
        description="share of the gradient all-reduce hidden behind backward by DDP's bucketing "
                    "(bucket_cap_mb=25: all but the last buckets overlap; ASSUMPTION)")
    network_efficiency_efa: float = Field(
        0.8, gt=0, le=1, description="share of the instance's network Gbps NCCL reaches over EFA (ASSUMPTION)")
    network_efficiency_tcp: float = Field(
        0.4, gt=0, le=1,
        description="share of network Gbps NCCL reaches over TCP sockets without EFA; 'up to' figures are "
                    "burst rates (ASSUMPTION)")
    micro_step_overhead_s: float = Field(
        0.005, ge=0,
        description="fixed time per micro-step not hidden behind GPU work: Python, data loading hand-off, "
                    "loss.item()/logging, launch latency (ASSUMPTION ~5 ms, HF Trainer order)")
    dp_replicate_overhead_s: float = Field(
        0.01, ge=0,
        description="DataParallel's per-micro-step thread start/replicate/gather cost beyond its copies "
                    "(ASSUMPTION)")

    def eff_max(self, family: str, tensor_cores: bool) -> float:
        table = self.eff_max_tensor if tensor_cores else self.eff_max_fp32
        return table.get(family, self.eff_max_default)


# ---- precision -----------------------------------------------------------------------------------

PEAK_KEY: dict[str, str] = {"fp32": "fp32", "amp-fp16": "fp16", "fp16": "fp16", "amp-bf16": "bf16", "bf16": "bf16"}
# Parameter/gradient element size: AMP keeps fp32 parameters and gradients; pure fp16/bf16 do not.
PARAM_BYTES: dict[str, int] = {"fp32": 4, "amp-fp16": 4, "amp-bf16": 4, "fp16": 2, "bf16": 2}
# Optimizer state bytes per parameter (fp32 moments; bitsandbytes 8-bit AdamW 1 byte each; Adafactor's
# factored second moment is ~0 per parameter).
STATE_BYTES: dict[str, int] = {"adamw": 8, "adam": 8, "sgd": 0, "sgd-momentum": 4, "adafactor": 0, "adamw-8bit": 2}


def peak_tflops(instance: Instance, precision: str, constants: ThroughputConstants) -> tuple[float, bool]:
    """(peak TFLOP/s used, whether on tensor cores) for a precision on this GPU."""
    gpu = instance.gpu
    key = PEAK_KEY[precision]
    if key == "fp32" and constants.allow_tf32 and "tf32" in gpu.peak_tflops:
        return gpu.peak_tflops["tf32"], True
    if key not in gpu.peak_tflops:
        allowed = [p for p, k in PEAK_KEY.items() if k in gpu.peak_tflops]
        raise PlannerError("--precision", precision, f"on {gpu.name} one of {', '.join(allowed)} (no {key})")
    return gpu.peak_tflops[key], key != "fp32"


def efficiency(tokens: float, peak: float, eff_max: float, constants: ThroughputConstants) -> float:
    """eff_max * x / (x + x_half), x_half = tokens_half_per_tflop * peak: rises with x, saturates at eff_max."""
    x_half = constants.tokens_half_per_tflop * peak
    return eff_max * tokens / (tokens + x_half)


# ---- communication -------------------------------------------------------------------------------


def resolve_parallelism(config: TrainConfig, instance: Instance) -> str:
    """'auto' -> 'single' on one GPU in all, else 'ddp'."""
    if config.parallelism != "auto":
        return config.parallelism
    return "single" if instance.gpus * config.instances == 1 else "ddp"


def world_size(parallelism: str, instance: Instance, instances: int) -> int:
    return 1 if parallelism == "single" else instance.gpus * instances


def network_gbs(instance: Instance, constants: ThroughputConstants, efa: bool | None = None) -> float:
    """Achievable GB/s between instances: Gbps / 8 * efficiency (EFA or TCP)."""
    if efa is None:
        efa = _instance_has_efa(instance)
    eff = constants.network_efficiency_efa if efa else constants.network_efficiency_tcp
    return instance.network_gbps / 8 * eff


def _instance_has_efa(instance: Instance) -> bool:
    from planner.hardware import instance_table

    return bool(instance_table().get(instance.name, {}).get("efa", False))


def allreduce_seconds(nbytes: float, instance: Instance, instances: int, constants: ThroughputConstants) -> float:
    """Hierarchical ring all-reduce of `nbytes` per GPU: 2(g-1)/g * B / busbw inside, 2(N-1)/N * B / net."""
    g, n = instance.gpus, instances
    t = 0.0
    if g > 1:
        t += 2 * (g - 1) / g * nbytes / (instance.allreduce_bandwidth_gbs * GB)
    if n > 1:
        t += 2 * (n - 1) / n * nbytes / (network_gbs(instance, constants) * GB)
    return t


def half_collective_seconds(nbytes: float, instance: Instance, instances: int,
                            constants: ThroughputConstants) -> float:
    """Reduce-scatter or all-gather: half the traffic of an all-reduce, (n-1)/n * B."""
    return allreduce_seconds(nbytes, instance, instances, constants) / 2


# ---- optimizer -----------------------------------------------------------------------------------


def parameter_tensors(block: Block) -> int:
    """How many parameter tensors a block holds (launch overhead of the for-loop optimizer)."""
    layer = block.layer
    if isinstance(layer, DenseSpec):
        return 2 if layer.bias else 1
    if not isinstance(layer, TransformerSpec):
        return 2  # BatchNorm weight + bias
    norm = 2 if layer.norm == "layernorm" else 1
    if block.role == "layer":
        mlp = 3 if layer.family in ("llama", "mistral") else 2
        return 4 * (2 if layer.attention_bias else 1) + mlp * (2 if layer.mlp_bias else 1) + 2 * norm
    if block.role == "embeddings":
        return 1 + (layer.position_table > 0) + (layer.type_vocab_size > 0) + (norm if layer.family in (
            "bert", "roberta", "distilbert") else 0)
    return 2 if block.role in ("pooler", "head") else norm


def optimizer_seconds(n_params: float, n_tensors: int, instance: Instance, config: TrainConfig,
                      constants: ThroughputConstants) -> float:
    """Bytes moved by one optimizer step / achievable HBM bandwidth (+ launches of a for-loop optimizer).

    bytes/param = parameter read + write, gradient read, each state read + write, (+ GradScaler unscale);
    times the implementation's number of passes.
    """
    p = PARAM_BYTES[config.precision]
    state = STATE_BYTES[config.optimizer]
    per_param = 2 * p + p + 2 * state
    per_param *= constants.optimizer_passes.get(config.optimizer_impl, 1.0)
    if config.precision in ("amp-fp16", "fp16"):
        per_param += constants.grad_scaler_bytes_per_param
    t = n_params * per_param / (instance.gpu.memory_bandwidth_gbs * GB * constants.hbm_efficiency)
    if config.optimizer_impl == "for-loop":
        t += n_tensors * constants.for_loop_kernels_per_tensor * constants.kernel_launch_s
    return t


# ---- the prediction ------------------------------------------------------------------------------


def predict_throughput(model: ModelSpec, config: TrainConfig, instance: Instance,
                       constants: ThroughputConstants | None = None) -> Throughput:
    """Step time and its breakdown, job-wide samples/s and tokens/s, and MFU (see the module docstring)."""
    c = constants or ThroughputConstants()
    parallelism = resolve_parallelism(config, instance)
    if parallelism == "dp" and config.instances > 1:
        raise PlannerError("--parallelism", "dp", "ddp, zero1-3 or fsdp across instances (DataParallel is one process)")
    n_inst = 1 if parallelism == "single" else config.instances
    world = world_size(parallelism, instance, n_inst)

    flops = step_flops(model, config, causal_fraction=c.causal_fraction)
    peak, tensor = peak_tflops(instance, config.precision, c)
    tokens = config.batch_size * tokens_per_sample(model, config.seq_len)
    eff = efficiency(tokens, peak, c.eff_max(instance.gpu.family, tensor), c)
    rate = peak * TFLOP * eff
    micro_compute = flops.executed / rate
    last_backward = (flops.backward + flops.recompute) / rate

    blocks = model_blocks(model)
    n_params = count_parameters(model)["total"]
    n_tensors = sum(parameter_tensors(b) for b in blocks)
    sharded = parallelism in ("zero1", "zero2", "zero3", "fsdp")
    grad_bytes = n_params * PARAM_BYTES[config.precision]

    comm_total = 0.0
    exposed = 0.0
    if world > 1:
        if parallelism == "ddp":
            comm_total = allreduce_seconds(grad_bytes, instance, n_inst, c)
            exposed = comm_total - min(c.allreduce_overlap * comm_total, last_backward)
        elif parallelism in ("zero1", "zero2"):
            rs = half_collective_seconds(grad_bytes, instance, n_inst, c)
            ag = half_collective_seconds(grad_bytes, instance, n_inst, c)
            comm_total = rs + ag
            exposed = rs - min(c.allreduce_overlap * rs, last_backward) + ag
        elif parallelism in ("zero3", "fsdp"):
            per_micro = 3 * half_collective_seconds(grad_bytes, instance, n_inst, c)
            comm_total = config.grad_accum * per_micro
            exposed = config.grad_accum * per_micro * (1 - c.allreduce_overlap)
        elif parallelism == "dp":
            per_micro = 2 * grad_bytes / (max(instance.allreduce_bandwidth_gbs, 1e-9) * GB)
            per_micro += c.dp_replicate_overhead_s
            comm_total = exposed = config.grad_accum * per_micro

    local_params = n_params / world if sharded else n_params
    optimizer = optimizer_seconds(local_params, n_tensors, instance, config, c)
    compute = config.grad_accum * micro_compute
    overhead = config.grad_accum * c.micro_step_overhead_s
    step = compute + overhead + exposed + optimizer

    samples_per_step = world * config.batch_size * config.grad_accum
    samples_per_s = samples_per_step / step
    mfu = flops.model * config.grad_accum / (peak * TFLOP * step)
    breakdown: dict[str, Any] = {
        "compute_s": compute,
        "recompute_s": config.grad_accum * flops.recompute / rate,
        "overhead_s": overhead,
        "communication_s": exposed,
        "communication_total_s": comm_total,
        "optimizer_s": optimizer,
    }
    return Throughput(
        step_time_s=step,
        samples_per_s=samples_per_s,
        tokens_per_s=samples_per_s * tokens_per_sample(model, config.seq_len),
        mfu=mfu,
        global_batch_size=samples_per_step,
        breakdown_s=breakdown,
    )
