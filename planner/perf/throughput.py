"""Predicted training speed: time of one optimizer step, samples and tokens per second, MFU.

One optimizer step = `grad_accum` micro-steps, then the gradient exchange, then the optimizer:

    step = grad_accum * micro-step + exposed communication + optimizer

- micro-step: the op-level roofline of planner.perf.roofline over the kernel list of planner.perf.kernels
  (every forward, backward and recompute kernel timed as max(FLOPs / (peak x GEMM efficiency x tile waves),
  bytes / (HBM bandwidth x streaming efficiency)) + a per-kernel gap), never shorter than the CPU's
  launches x dispatch cost, plus the per-micro-step host time (data-loader hand-off, loss.item() sync).
- gradient all-reduce (DDP), once per optimizer step (no_sync on the other micro-steps): a ring moves
  2(n-1)/n x gradient bytes over the bus bandwidth inside the instance, and 2(N-1)/N x bytes over the
  network between N instances; `allreduce_overlap` of it hides behind the last micro-step's backward.
  ZeRO-1/2: reduce-scatter of gradients (overlapped like DDP) + all-gather of updated parameters
  (exposed). ZeRO-3/FSDP: every micro-step all-gathers parameters for forward and again for backward and
  reduce-scatters gradients, one NCCL call per unit (FSDP2 under pipeline parallelism: once per step,
  `_sharded_dp_times`; HSDP: in its shard group, the shard all-reduced across replica groups); the first unit of each phase waits, the rest hides
  behind that phase's compute unit by unit (the next unit prefetched beside this one), compute slowed by
  the SMs NCCL's blocks hold meanwhile (planner.perf.collectives). Every NCCL call also pays NCCL's own latency model
  (planner.perf.collectives). DataParallel (dp): every micro-step broadcasts parameters from GPU 0 to the
  replicas, scatters the inputs and gathers the outputs through GPU 0, reduces gradients onto GPU 0 (with
  their flatten copies), none of it overlapped; its replicas' forward ops are dispatched by Python threads
  under one GIL (the host time per op x replicas), and the optimizer runs on GPU 0 alone.
- the slowest GPU: a synchronous data-parallel step ends when its slowest GPU is done. GPUs of one model
  differ in speed (clocks under power and thermal limits; variability across nominally identical GPUs is
  several percent: Sinha et al., "Not All GPUs Are Created Equal", SC22), so n GPUs wait
  `rank_speed_spread` x e(n) of the compute time for the slowest, e(n) the expected maximum of n standard
  normals (0 for one GPU, 0.56 for 2, 1.03 for 4, 1.42 for 8), at most `slowest_gpu_wait_cap` (8 %: the
  whole-cluster variation Sinha et al. measured, reached just beyond 8 GPUs). Counted as communication: in a
  profile the faster GPUs' wait shows as time inside the collective.
- optimizer: its kernels (foreach / fused / for-loop, GradScaler's unscale_) on this GPU's parameters
  (1/n under ZeRO/FSDP), memory-bound, same roofline.
- fp32 matmuls use TF32 tensor cores only when `allow_tf32` (PyTorch's default
  torch.backends.cuda.matmul.allow_tf32 = False, i.e. float32 matmul precision "highest"), so fp32 runs at
  the CUDA-core FP32 peak by default.

`breakdown_s` also gives the host's dispatch time (`host_dispatch_s`: the step is host-bound where it exceeds
`compute_s`, the GPU's; see planner.perf.host.bound_by; planner.perf.host: launches x per-launch cost x the instance's CPU factor, overlapped with
the GPU's work as a p-norm, not a max).

`breakdown_s` splits the step by kernel kind (gemm, attention, memory_bound, optimizer, communication) and
launch_overhead (per-kernel gaps, CPU-bound time beyond the GPU's and host time per micro-step): the six sum
to `step_time_s`. `bytes_bound_s` is the time in kernels whose bytes, not FLOPs, bound them (what
`planner explain` names); the communication kind = the exposed collectives (`communication_s`) + the wait
for the slowest GPU (`slowest_gpu_wait_s`).
The older keys (compute_s, recompute_s, overhead_s, communication_s, communication_total_s, optimizer_s) stay.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from planner import caches
from planner.errors import PlannerError
from planner.families.forms import parameter_tensors
from planner.identity_cache import per_object
from planner.ir.context import Ctx
from planner.memory.parallel import dataparallel_replica_io_bytes
from planner.models.params import count_parameters
from planner.parallel import frameworks
from planner.parallel import get as strategy_of
from planner.perf import model_parallel as mp
from planner.perf.collectives import (
    dataparallel_host_launches,
    nccl_latency_s,
    overlap_contention_s,
    prefetch_hidden,
)
from planner.perf.constants import ThroughputConstants  # noqa: F401  (re-exported)
from planner.perf.flops import BACKWARD_TO_FORWARD, tokens_per_sample
from planner.perf.host import host_seconds, overlapped
from planner.perf.kernels import (
    COLLECTIVE_OVERLAP,
    F32,
    KINDS,
    Kernel,
    communication_kernels,
    optimizer_kernels,
)
from planner.perf.roofline import (
    PHASES,
    KernelTable,
    by_kind,
    gpu_key,
    kernel_table,
    time_kernels,
    time_table,
)
from planner.spec import GPU, Instance, ModelSpec, Throughput, TrainConfig

GB = 1e9
TFLOP = 1e12


# ---- precision -----------------------------------------------------------------------------------

PEAK_KEY: dict[str, str] = {"fp32": "fp32", "amp-fp16": "fp16", "fp16": "fp16", "amp-bf16": "bf16", "bf16": "bf16",
                             "fp8": "bf16"}  # fp8: MFU against the bf16 peak, as torchtitan reports it
# Parameter/gradient element size: AMP keeps fp32 parameters and gradients; pure fp16/bf16 do not.
PARAM_BYTES: dict[str, int] = {"fp32": 4, "amp-fp16": 4, "amp-bf16": 4, "fp16": 2, "bf16": 2, "fp8": 4}


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


# ---- communication -------------------------------------------------------------------------------


@caches.lru(None, scope="model", key="the number of ranks")
def expected_max_normal(n: int) -> float:
    """E[max of n independent standard normals] (0 for n = 1): how far, in standard deviations, the slowest
    of n GPUs lies behind their mean. Numerical integral of x * n * pdf(x) * cdf(x)^(n-1)."""
    if n <= 1:
        return 0.0
    x = np.linspace(-12.0, 12.0, 24001)
    pdf = np.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)
    cdf = np.cumsum(pdf) * (x[1] - x[0])
    return float(np.trapezoid(x * n * pdf * cdf ** (n - 1), x))


def optimizer_impl(config: TrainConfig) -> str:
    """The optimizer kernels the framework runs: Megatron-Core steps Adam/AdamW with a fused multi-tensor kernel
    whatever `--optimizer-impl` says (megatron/core/optimizer/__init__.py imports TransformerEngine's or apex's
    FusedAdam), as the memory side already assumes (planner.pipeline.step._optimizer_config)."""
    if config.optimizer in ("adam", "adamw") and frameworks.get(config.framework).kernels == "megatron":
        return "fused"
    return config.optimizer_impl


def slowest_gpu_share(n: int, c: ThroughputConstants) -> float:
    """Share of the compute time n synchronous GPUs wait for the slowest: rank_speed_spread x E[max of n
    standard normals] (independent Gaussian per-GPU speed), capped at `slowest_gpu_wait_cap` (the whole-cluster
    variation measured by Sinha et al. SC22: a Gaussian tail grows without bound, real GPUs' speeds do not)."""
    return min(c.rank_speed_spread * expected_max_normal(n), c.slowest_gpu_wait_cap)


def world_size(parallelism: str, instance: Instance, instances: int) -> int:
    return strategy_of(parallelism).world_size(instance.gpus, instances)


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


# ---- the prediction ------------------------------------------------------------------------------


_DEFAULT: list[ThroughputConstants] = caches.adopt("planner.perf.throughput._DEFAULT", [], scope="facts",
                                                    key="none: the default constants, made once")


def _default_constants() -> ThroughputConstants:
    """ThroughputConstants() made once (frozen, so it can be shared): a search predicts thousands of steps."""
    if not _DEFAULT:
        _DEFAULT.append(ThroughputConstants())
    return _DEFAULT[0]


def predict_throughput(model: ModelSpec, config: TrainConfig, instance: Instance,
                       constants: ThroughputConstants | None = None, *, ctx: Ctx | None = None,
                       dims: mp.ParallelDims | None = None) -> Throughput:
    """Step time and its breakdown, job-wide samples/s and tokens/s, and MFU (see the module docstring).
    `config` is resolved (planner.pipeline.resolve.resolve_parallelism): a parallelism of "auto" is refused.
    `ctx` and `dims`: the context record and the layout the pipeline resolved with it (None: built here from
    `config`, the model and the GPU, for callers outside the pipeline)."""
    c = constants or _default_constants()
    if config.tf32 and not c.allow_tf32:
        c = c.model_copy(update={"allow_tf32": True})
    table = kernel_table(model, config, causal_fraction=c.causal_fraction, flash_ok=instance.gpu.flash_attention,
                         ctx=ctx)
    n_params, n_tensors = parameter_counts(model)
    gather_params = n_params  # ZeRO-3/FSDP gather every parameter, frozen ones too
    if config.lora:  # only the adapters have gradients to reduce and an optimizer step
        from planner.adapters.lora import plan

        lora = plan(model, config)
        n_params, n_tensors = lora.trainable, len(lora.shapes)
    if config.ep * config.etp > 1 and not config.lora:  # a rank's model holds its experts only
        from planner.memory.experts import local_parameters
        from planner.models.blocks import model_blocks
        from planner.models.params import expert_parameters

        experts = sum(expert_parameters(b) for b in model_blocks(model))
        n_params = gather_params = local_parameters(n_params, experts, config.ep * config.etp)
    layers = sum(t.num_layers for t in model.transformers) or None
    one_process = strategy_of(config.parallelism).one_process
    io = dataparallel_replica_io_bytes(model, config) if one_process else 0
    shape = None
    # Megatron's distributed optimizer (reduce-scatter, the step on a 1/DP shard, all-gather) is timed by the
    # model-parallel step, also on a layout without TP, CP or PP
    if (mp.has_model_parallelism(config) or config.distributed_optimizer) and model.transformers:
        dims, shape = dims or mp.parallel_dims(model, config, instance), mp.layer_shape(model, config)
    elif config.parallelism == "hsdp":  # plain HSDP: its shard and replicate groups (_sharded_dp_times)
        dims = dims or mp.parallel_dims(model, config, instance)
    else:
        dims = None
    return table_throughput(table, n_params, n_tensors, tokens_per_sample(model, config.seq_len), config, instance,
                            c, layers=layers, dp_io_bytes=io, gather_params=gather_params, dims=dims, shape=shape,
                            expert_exchange_s=expert_exchange_seconds(model, config, instance, c))


def expert_exchange_seconds(model: ModelSpec, config: TrainConfig, instance: Instance,
                            c: ThroughputConstants) -> float:
    """Seconds of one micro-step's expert-parallel all-to-alls on the hottest rank (issue 35): per sparse
    layer, the dispatch of the token-expert pairs to their experts' ranks and the combine back in forward,
    the same two exchanges of their gradients in backward, and the forward's again when checkpointing
    re-runs the layer. Each moves the rank's pairs (its tokens · top_k · the load imbalance; its tokens the
    sequence-parallel share under TP, the chunk under CP) of hidden-state rows
    (planner.perf.collectives.all_to_all_seconds). Under expert-tensor parallelism (--etp) the etp ranks of a
    group also all-gather their dispatched pairs and reduce-scatter the experts' output, in forward and
    backward (planner/families/forms/moe_gated.py `_expert_ops`): rings inside the instance (Megatron-Core
    places the expert-TP group innermost). Exposed: transformers' experts and the planner's probe run them
    in line (Megatron-Core's overlap of the all-to-all with expert compute is not modelled)."""
    if config.ep <= 1 and config.etp <= 1:
        return 0.0
    from planner.families.forms.moe_gated import expert_pairs
    from planner.perf.collectives import all_to_all_seconds

    act = 2 if config.precision in ("fp16", "bf16") else 4  # the residual stream's dtype (ctx.act)
    # the tokens one rank routes: its context-parallel chunk, and its sequence-parallel share under TP
    # (planner.ir.context.Ctx.rows; sequence parallelism is on with TP unless --no-sp)
    sp = config.tp > 1 and (config.sp is None or config.sp)
    rank_tokens = config.batch_size * (config.seq_len // config.cp) // (config.tp if sp else 1)
    total = 0.0
    for t in model.transformers:
        sparse = sum(t.sparse_layer(i) for i in range(t.num_layers))
        if not sparse:
            continue
        pairs = expert_pairs(t, rank_tokens, config.ep, config.moe_imbalance)
        passes = 2 + config.checkpointing  # forward, backward, the checkpointed forward again
        if config.ep > 1:
            one = all_to_all_seconds(pairs * t.hidden_size * act, config.ep, instance.gpus,
                                     instance.allreduce_bandwidth_gbs, network_gbs(instance, c) / instance.gpus, c)
            total += sparse * one * 2 * passes  # dispatch and combine
        if config.etp > 1:  # the all-gather of the group's pairs and the reduce-scatter of their outputs
            gathered = pairs * config.etp * t.hidden_size * act
            total += sparse * 2 * mp.ring_half_s(gathered, config.etp, instance.allreduce_bandwidth_gbs) * passes
    return total


def table_throughput(table: KernelTable, n_params: int, n_tensors: int, tokens: int, config: TrainConfig,
                     instance: Instance, constants: ThroughputConstants | None = None, *,
                     layers: int | None = None, dp_io_bytes: int = 0, gather_params: int | None = None,
                     dims: mp.ParallelDims | None = None, shape: mp.LayerShape | None = None,
                     expert_exchange_s: float = 0.0) -> Throughput:
    """`predict_throughput` from a micro-step's kernel table, whoever built it (the analytic kernel list, or
    a traced model's own ops: planner.program.speed), the parameter and parameter-tensor counts and the
    tokens per sample. `layers` (FSDP's wrapped units; None: guessed from the tensors) and `dp_io_bytes`
    (one replica's inputs + outputs, through GPU 0 under DataParallel) only matter to those strategies.
    `dims` and `shape`: a tensor/context/pipeline-parallel layout and the model's sizes
    (`_model_parallel_throughput`); None or a data-parallel-only layout: the model below."""
    c = constants or ThroughputConstants()
    if config.tf32 and not c.allow_tf32:
        c = c.model_copy(update={"allow_tf32": True})
    parallelism = config.parallelism  # resolved by the pipeline (planner.pipeline.resolve); "auto" is refused
    strategy = strategy_of(parallelism)
    if strategy.one_process and config.instances > 1:
        raise PlannerError("--parallelism", parallelism, "ddp, zero1-3 or fsdp across instances (DataParallel is one process)")
    n_inst = 1 if strategy.uses_one_gpu else config.instances
    world = world_size(parallelism, instance, n_inst)
    gpu = instance.gpu
    peak, _ = peak_tflops(instance, config.precision, c)
    if dims is None and mp.has_model_parallelism(config):  # a traced model: no layers to split or stage
        raise PlannerError("--tp/--cp/--pp", f"{config.tp}×{config.cp}×{config.pp}",
                           "1×1×1 for a traced model (tensor, context and pipeline parallelism need a model given "
                           "as a catalog name or a config.json)")
    if dims is not None and shape is not None and (not dims.plain or config.distributed_optimizer):
        return _model_parallel_throughput(table, n_params, n_tensors, tokens, config, instance, c, dims, shape,
                                          gather_params, peak, expert_exchange_s)

    m = _micro_sums(table, config.batch_size, gpu, c)
    launches = m.launches
    if strategy.one_process and world > 1:  # one process: the replicas' forward dispatch shares the GIL
        launches = dataparallel_host_launches(m.launches, m.backward_launches, world, c)
    p = c.host_overlap_power
    host = host_seconds(launches, c.cpu_dispatch_s, instance)
    micro = overlapped(m.gpu_s, host, p) + c.micro_step_overhead_s
    # the all-reduce overlaps backward's wall time: GPU time and the CPU's launches side by side
    backward = overlapped(m.backward_gpu_s, host_seconds(m.backward_launches, c.cpu_dispatch_s, instance), p)
    forward = overlapped(m.gpu_s - m.backward_gpu_s,
                         host_seconds(m.launches - m.backward_launches, c.cpu_dispatch_s, instance), p)

    sharded = strategy.shards
    # bytes each collective moves per parameter: the framework's reduce and gather dtypes
    # (planner.memory.framework_layout: 16-bit gathers under an FSDP policy, DeepSpeed or Megatron)
    from planner.memory.framework_layout import layout as state_layout

    lay = state_layout(config)
    # ZeRO-3/FSDP gather every parameter (frozen ones too); ZeRO-1/2 gather only what the optimizer updated
    gathered = gather_params if gather_params is not None and strategy.sharding.parameters else n_params
    reduced = gathered if (lay.frozen_grads and sharded) else n_params  # FSDP1 flat gradients cover frozen ones
    grad_bytes = reduced * lay.reduce_comm_bytes
    param_bytes = gathered * lay.gather_comm_bytes
    if parallelism == "hsdp" and dims is not None:
        # HSDP: reduce-scatter in the shard group, all-reduce of the shard across the replicas (_sharded_dp_times)
        comm_total, exposed = _sharded_dp_times(config, dims, instance, c, grad_bytes, param_bytes, config.grad_accum,
                                                shard_units(parallelism, n_tensors, layers), backward, forward,
                                                instance, n_inst)
    else:
        comm_total, exposed = _communication_times(
            (parallelism, world, grad_bytes, config.grad_accum, config.bucket_cap_mb,
             shard_units(parallelism, n_tensors, layers), dp_io_bytes,
             None if param_bytes == grad_bytes else param_bytes, lay.accumulate_unsharded, lay.reshard_after_forward),
            backward, forward, instance, n_inst, c)

    local_params = n_params // world if sharded else n_params
    local_tensors = max(1, n_tensors // world) if sharded else n_tensors
    opt_secs, opt_gap, opt_mem, opt_launches = _optimizer_times(
        local_params, local_tensors, config.precision, config.optimizer, optimizer_impl(config), gpu, c)
    optimizer_gpu = opt_secs + opt_gap
    optimizer = overlapped(optimizer_gpu, host_seconds(opt_launches, c.cpu_dispatch_s, instance), p)
    # every GPU waits for the slowest one of the `world` (module docstring)
    slowest_wait = config.grad_accum * micro * slowest_gpu_share(world, c)
    exposed_total = exposed + slowest_wait + config.grad_accum * expert_exchange_s
    step = config.grad_accum * micro + exposed_total + optimizer

    # model FLOPs (MFU's, no recompute) = forward + backward = (1 + BACKWARD_TO_FORWARD) x forward matmuls,
    # as planner.perf.flops.step_flops counts them
    model_flops = (1 + BACKWARD_TO_FORWARD) * m.forward_matmul_flops
    samples_per_step = world * config.batch_size * config.grad_accum
    samples_per_s = samples_per_step / step
    mfu = model_flops * config.grad_accum / (peak * TFLOP * step)
    kinds = {k: config.grad_accum * v for k, v in m.by_kind.items()}
    kinds["optimizer"] += opt_secs
    kinds["communication"] = exposed_total
    launch_overhead = step - sum(kinds.values())
    breakdown: dict[str, Any] = {
        **kinds,
        "launch_overhead": launch_overhead,
        "bytes_bound_s": config.grad_accum * m.memory_bound_s + opt_mem,
        "compute_s": config.grad_accum * m.gpu_s,
        "recompute_s": config.grad_accum * m.recompute_s,
        "overhead_s": config.grad_accum * (micro - m.gpu_s),
        "communication_s": exposed,
        "communication_total_s": comm_total,
        "slowest_gpu_wait_s": slowest_wait,
        **({"expert_all_to_all_s": config.grad_accum * expert_exchange_s} if expert_exchange_s else {}),
        "optimizer_s": optimizer,
        "host_dispatch_s": config.grad_accum * host,
    }
    return Throughput(
        step_time_s=step,
        samples_per_s=samples_per_s,
        tokens_per_s=samples_per_s * tokens,
        mfu=mfu,
        global_batch_size=samples_per_step,
        breakdown_s=breakdown,
        gpus=world,
    )


def _model_parallel_throughput(table: KernelTable, n_params: int, n_tensors: int, tokens: int,
                               config: TrainConfig, instance: Instance, c: ThroughputConstants,
                               dims: mp.ParallelDims, shape: mp.LayerShape, gather_params: int | None,
                               peak: float, expert_exchange_s: float = 0.0) -> Throughput:
    """One optimizer step under tensor, context and pipeline parallelism (planner.perf.model_parallel has
    each term, its source and its overlap assumption):

        step = (m + bubble) x (t_stage + TP + CP + P2P exposed) + DP exposed + slowest-GPU wait + optimizer
               + micro_step_overhead_s once

    m = micro-batches per pipeline per step (`grad_accum`; Megatron's num_microbatches = global batch /
    (micro-batch x dp)); t_stage = the slowest stage's kernels per micro-batch on one rank (the first stage
    holds the embedding, the last the LM head and the loss), its host dispatch overlapped as in the
    data-parallel model; bubble = bubble_fraction x m micro-batch times. The host's per-micro-step overhead
    (loss sync, data hand-off) is paid once per step: Megatron's schedules sync once per step, not per
    micro-batch. MFU and tokens count the whole model's work: dp x m micro-batches per step over all GPUs.
    The communication kind of the breakdown holds the exposed collectives, the pipeline's bubble and the wait
    for the slowest GPU: in a profile each shows as time inside a collective or a receive."""
    strategy = strategy_of(config.parallelism)
    if strategy.one_process or strategy.uses_one_gpu:
        raise PlannerError("--parallelism", config.parallelism,
                           "ddp, zero1-3 or fsdp with --tp/--cp/--pp (one process per GPU)")
    gpu, b, s, m, p = instance.gpu, config.batch_size, config.seq_len, config.grad_accum, c.host_overlap_power
    per_stage = {}
    ranks = dims.rank_layers(shape.layers)  # layers per pipeline rank (uneven where the framework splits so)
    kinds_of = (("only", ranks[0]),) if dims.pp == 1 else (
        ("first", ranks[0]), ("last", ranks[-1]), *((("middle", max(ranks[1:-1])),) if dims.pp > 2 else ()))
    for stage, n_layers in kinds_of:
        st = mp.stage_table(table, dims, stage, shape.layers, n_layers)
        sums = _micro_sums(st, b, gpu, c)
        host = host_seconds(sums.launches, c.cpu_dispatch_s, instance)
        per_stage[stage] = (overlapped(sums.gpu_s, host, p), sums, st, host, n_layers)
    micro, sums, st, host, layers_here = max(per_stage.values(), key=lambda v: v[0])
    net = network_gbs(instance, c)
    recomputed = config.checkpointing or config.recompute == "full"
    tp_fwd = mp.tp_seconds_per_layer(b, s, shape, dims.tp, dims.cp, dims.sp, instance, c)
    tp_s = mp.tp_exposed_s(tp_fwd, layers_here, 3 if recomputed else 2)
    att_f, att_b = mp.attention_seconds(st, time_table(st, b, gpu, c).seconds)
    cp_total, cp_s = mp.cp_exposed_s(mp.cp_kv_bytes(b, s, shape, dims.tp, dims.cp), dims.cp,
                                     mp.cp_link_gbs(instance, dims, net), att_f / layers_here,
                                     att_b / layers_here, layers_here)
    p2p_total = p2p_s = 0.0
    if dims.pp > 1:
        across = dims.tp * dims.cp * dims.dp >= instance.gpus
        p2p_total = mp.p2p_seconds_per_micro_batch(mp.p2p_bytes(b, s, shape, dims.tp, dims.cp, dims.sp),
                                                   mp.p2p_link_gbs(instance, dims, net), dims.vp, c, across)
        p2p_s = 0.0 if dims.schedule == "interleaved-1f1b" else p2p_total
    # the slowest stage's share of the sparse layers' all-to-alls (issue 35), by its share of the layers
    ex_s = expert_exchange_s * layers_here / shape.layers if shape.layers else expert_exchange_s / dims.pp
    per_micro = micro + tp_s + cp_s + p2p_s + ex_s
    bubble = mp.bubble_fraction(dims.schedule, dims.pp, m, dims.vp) * m if dims.pp > 1 else 0.0
    pipeline = (m + bubble) * per_micro

    # data parallelism over the DP group's links, on this rank's share of the model
    from planner.memory.framework_layout import layout as state_layout

    lay = state_layout(config)
    split = dims.tp * dims.pp
    experts = shape.local_experts  # a mixture-of-experts rank's routed experts: not split by tp
    rank_params = max(1, (n_params - experts) // split + experts // dims.pp)
    rank_tensors = max(1, n_tensors // dims.pp)
    rank_gathered = max(1, ((gather_params or n_params) - experts) // split + experts // dims.pp
                        ) if strategy.sharding.parameters else rank_params
    grad_bytes, param_bytes = rank_params * lay.reduce_comm_bytes, rank_gathered * lay.gather_comm_bytes
    comm_total = exposed = 0.0
    group_ranks = mp.dp_cp_ranks(dims)  # gradients reduce over data- x context-parallel ranks
    if group_ranks > 1:
        d_in, d_out, gbps = mp.dp_group_links(instance, dims)
        group = instance.model_copy(update={"gpus": d_in, "network_gbps": gbps})
        backward = overlapped(sums.backward_gpu_s, host_seconds(sums.backward_launches, c.cpu_dispatch_s, instance), p)
        forward = overlapped(sums.gpu_s - sums.backward_gpu_s,
                             host_seconds(sums.launches - sums.backward_launches, c.cpu_dispatch_s, instance), p)
        if config.distributed_optimizer:
            comm_total, exposed = communication_seconds(
                mp.distributed_optimizer_kernels(grad_bytes, rank_params * lay.gather_comm_bytes,
                                                 mp.megatron_buckets(rank_params, group_ranks)),
                backward, group, d_out, c, forward_s=forward)
        else:
            comm_total, exposed = _sharded_dp_times(config, dims, instance, c, grad_bytes, param_bytes, m,
                                                    shard_units(config.parallelism, rank_tensors,
                                                                max(1, round(layers_here))),
                                                    backward, forward, group, d_out)
    sharded = strategy.shards or config.distributed_optimizer
    local_params = rank_params // group_ranks if sharded else rank_params
    local_tensors = max(1, rank_tensors // group_ranks) if sharded else rank_tensors
    opt_secs, opt_gap, opt_mem, opt_launches = _optimizer_times(
        local_params, local_tensors, config.precision, config.optimizer, optimizer_impl(config), gpu, c)
    optimizer = overlapped(opt_secs + opt_gap, host_seconds(opt_launches, c.cpu_dispatch_s, instance), p)
    slowest_wait = m * micro * slowest_gpu_share(dims.world, c)
    step = pipeline + exposed + slowest_wait + optimizer + c.micro_step_overhead_s

    whole = _micro_sums(table, b, gpu, c)  # the whole model's micro-batch: MFU's model FLOPs
    model_flops = (1 + BACKWARD_TO_FORWARD) * whole.forward_matmul_flops * m * dims.dp
    samples_per_step = dims.dp * b * m
    waits = m * (tp_s + cp_s + p2p_s + ex_s) + bubble * per_micro + exposed + slowest_wait
    kinds = {k: m * v for k, v in sums.by_kind.items()}
    kinds["optimizer"] += opt_secs
    kinds["communication"] = waits
    breakdown: dict[str, Any] = {
        **kinds,
        "launch_overhead": step - sum(kinds.values()),
        "bytes_bound_s": m * sums.memory_bound_s + opt_mem,
        "compute_s": m * sums.gpu_s,
        "recompute_s": m * sums.recompute_s,
        "overhead_s": m * (micro - sums.gpu_s) + c.micro_step_overhead_s,
        "communication_s": exposed + m * (tp_s + cp_s + p2p_s + ex_s),
        "communication_total_s": comm_total + m * (mp.tp_exposed_s(tp_fwd, layers_here, 3 if recomputed else 2)
                                                   + cp_total + p2p_total + ex_s),
        "slowest_gpu_wait_s": slowest_wait,
        "optimizer_s": optimizer,
        "host_dispatch_s": m * host,
        "tp_communication_s": m * tp_s,
        "cp_communication_s": m * cp_s,
        "pp_p2p_s": m * p2p_s,
        "pp_bubble_s": bubble * per_micro,
        "dp_communication_s": exposed,
        **({"expert_all_to_all_s": m * ex_s} if ex_s else {}),
    }
    samples_per_s = samples_per_step / step
    return Throughput(
        step_time_s=step,
        samples_per_s=samples_per_s,
        tokens_per_s=samples_per_s * tokens,
        mfu=model_flops / (peak * TFLOP * step * dims.world),
        global_batch_size=samples_per_step,
        breakdown_s=breakdown,
        gpus=dims.world,
    )


@dataclass(frozen=True)
class _MicroSums:
    """What a step's time reads of one micro-step's kernel times: sums over the table, the same on every
    instance count and type of one GPU, so computed once per table, micro-batch, GPU and constants."""

    gpu_s: float  # roofline seconds + launch gaps
    launches: float
    backward_gpu_s: float
    backward_launches: float
    forward_matmul_flops: float  # at this micro-batch (MFU's model FLOPs)
    by_kind: dict[str, float]
    memory_bound_s: float
    recompute_s: float


def _micro_sums(table: KernelTable, b: int, gpu: GPU, c: ThroughputConstants) -> _MicroSums:
    key = ("sums", b, gpu_key(gpu), c)
    hit = table.peaks_cache.get(key)
    if hit is None:
        times = time_table(table, b, gpu, c)
        back = table.phase != PHASES.index("forward")
        fwd = ~back
        matmul = (table.kind == KINDS.index("gemm")) | (table.kind == KINDS.index("attention"))
        hit = _MicroSums(
            gpu_s=float(times.seconds.sum() + times.gap.sum()),
            launches=times.launches,
            backward_gpu_s=float(times.seconds[back].sum() + times.gap[back].sum()),
            backward_launches=float((table.launches * table.count)[back].sum()),
            forward_matmul_flops=float((table.at(b)[:, 0] * table.count)[fwd & matmul].sum()),
            by_kind=by_kind(table, times.seconds),
            memory_bound_s=float(times.seconds[times.memory_bound].sum()),
            recompute_s=float(times.seconds[table.phase == PHASES.index("recompute")].sum()),
        )
        table.peaks_cache[key] = hit  # beside its times (time_table bounds the cache's size)
    return hit


_OPTIMIZER_TIMES: dict[tuple, tuple[float, float, float, float]] = caches.table("planner.perf.throughput._OPTIMIZER_TIMES", scope="model",
    key="(shard size, tensors, precision, optimizer, impl, GPU, constants) -> timings")
OPTIMIZER_TIMES_CACHE_SIZE = 4096  # (shard size, optimizer, GPU) timings kept: a search meets a few dozen


def _optimizer_times(n_params: int, n_tensors: int, precision: str, optimizer: str, impl: str, gpu: GPU,
                     c: ThroughputConstants) -> tuple[float, float, float, float]:
    """`time_kernels` of the optimizer step's kernels, once per shard size, optimizer, GPU and constants."""
    key = (n_params, n_tensors, precision, optimizer, impl, gpu_key(gpu), c)
    hit = _OPTIMIZER_TIMES.get(key)
    if hit is None:
        if len(_OPTIMIZER_TIMES) >= OPTIMIZER_TIMES_CACHE_SIZE:
            _OPTIMIZER_TIMES.clear()
        hit = _OPTIMIZER_TIMES[key] = time_kernels(
            optimizer_kernels(n_params, n_tensors, precision, optimizer, impl), gpu, c)
    return hit


_COMM_TIMES: dict[tuple, tuple[float, float]] = caches.table("planner.perf.throughput._COMM_TIMES", scope="model",
    key="(strategy, sizes, phase times, instance figures, constants) -> timings")
COMM_TIMES_CACHE_SIZE = 4096  # (strategy, sizes, phase times, instance) timings kept


def _sharded_dp_times(config: TrainConfig, dims: mp.ParallelDims, instance: Instance, c: ThroughputConstants,
                      grad_bytes: int, param_bytes: int, m: int, units: int, backward: float, forward: float,
                      group: Instance, d_out: int) -> tuple[float, float]:
    """(total, exposed) seconds of the data-parallel collectives of one step under TP/CP/PP:
    - how often: per micro-batch (`m` times: DDP's and ZeRO's rules, FSDP1, ZeRO-3), or, for FSDP2 under
      pipeline parallelism (planner.perf.model_parallel.fsdp_gathers_once), one forward all-gather of each
      unit per step (hidden unit by unit behind the first micro-batch's forward), no backward all-gather (the
      parameters stay unsharded) and one reduce-scatter after the last micro-batch's backward;
    - where: HSDP's gathers and reduce-scatters over the shard group (dp_shard x cp), then the all-reduce of
      the rank's gradient shard (grad bytes / dp_shard·cp) over the replicate group, each group with its own
      links (model_parallel.hsdp_groups); the other strategies over the whole DP x CP group (`group`,
      `d_out`)."""
    once = mp.fsdp_gathers_once(config, dims)
    hsdp = config.parallelism == "hsdp" and dims.dp_replicate > 1
    ranks, grp, outs = mp.dp_cp_ranks(dims), group, d_out
    if hsdp:
        (s_in, s_out, s_gbps), _ = mp.hsdp_groups(instance, dims)
        ranks, outs = dims.dp_shard * dims.cp, s_out
        grp = instance.model_copy(update={"gpus": s_in, "network_gbps": s_gbps})
    kernels = communication_kernels("fsdp" if config.parallelism == "hsdp" else config.parallelism, ranks, grad_bytes, 1 if once else m,
                                    config.bucket_cap_mb, units, 0, None if param_bytes == grad_bytes else param_bytes)
    from planner.memory.framework_layout import layout as state_layout

    if once or not state_layout(config).reshard_after_forward:  # kept unsharded: no backward all-gather
        kernels = tuple(k for k in kernels if k.collective != "fsdp_all_gather_backward")
    total, exposed = communication_seconds(kernels, backward, grp, outs, c, forward_s=forward) if ranks > 1 else (0, 0)
    if hsdp:
        _, (r_in, r_out, r_gbps) = mp.hsdp_groups(instance, dims)
        shard = max(1, dims.dp_shard * dims.cp)
        rgrp = instance.model_copy(update={"gpus": r_in, "network_gbps": r_gbps})
        ar = Kernel("hsdp.replicate.allreduce", "communication", 0, grad_bytes // shard, grad_bytes // shard, F32,
                    "step", count=1 if once else m, launches=units, collective="allreduce")
        t, e = communication_seconds((ar,), backward, rgrp, r_out, c, forward_s=forward)
        total, exposed = total + t, exposed + e
    return total, exposed


def _communication_times(args: tuple, backward_s: float, forward_s: float, instance: Instance, n_inst: int,
                         c: ThroughputConstants) -> tuple[float, float]:
    """`communication_seconds` of `communication_kernels(*args)`, once per arguments, phase times, instance
    figures and constants: a search meets the same few thousand again and again."""
    key = (args, backward_s, forward_s, instance.name, gpu_key(instance.gpu), instance.gpu.nvlink_gbs, instance.gpus,
           instance.allreduce_bandwidth_gbs, instance.network_gbps, n_inst, c)
    hit = _COMM_TIMES.get(key)
    if hit is None:
        if len(_COMM_TIMES) >= COMM_TIMES_CACHE_SIZE:
            _COMM_TIMES.clear()
        hit = _COMM_TIMES[key] = communication_seconds(communication_kernels(*args), backward_s, instance, n_inst,
                                                       c, forward_s=forward_s)
    return hit


_PARAMS: dict[int, tuple] = caches.table("planner.perf.throughput._PARAMS", scope="model",
    key="ModelSpec identity (per_object): (parameters, parameter tensors)")  # ModelSpec -> (parameters, parameter tensors) (`per_object`)


def parameter_counts(model: ModelSpec) -> tuple[int, int]:
    """(parameters, parameter tensors) of a model, once per model object. The tensors are the program's
    (planner.families.forms.parameter_tensors, the module's `named_parameters()`): this used to count them
    by its own rule, which gave GPT-2 198 tensors (four attention projections where GPT2Attention has c_attn
    and c_proj) against the module's 148, and two for every head (BERT's masked-LM head has five)."""
    return per_object(_PARAMS, model, lambda m: (count_parameters(m)["total"], len(parameter_tensors(m))))


def shard_units(parallelism: str, n_tensors: int, layers: int | None) -> int:
    """NCCL calls per ZeRO-3/FSDP collective: FSDP wraps each transformer layer, plus the root unit holding
    the rest (transformer_auto_wrap_policy), one flat all-gather per unit; ZeRO-3 fetches each sub-module's
    parameters when it runs, about one module per two parameter tensors (weight + bias; ASSUMPTION). Without
    a layer count (traced models): about a dozen tensors a layer (GPT-2 12, BERT 16, Llama 9)."""
    return strategy_of(parallelism).units(n_tensors, layers)


def collective_seconds(k: Kernel, instance: Instance, n_inst: int, c: ThroughputConstants) -> float:
    """Seconds of one communication kernel, all its launches (module docstring: ring all-reduce, half of it
    for reduce-scatter and all-gather, each NCCL call's latency; DataParallel's broadcast and reduce at the
    bus bandwidth, its scatter/gather through GPU 0 from each other replica, its flatten copies at HBM
    speed, its fixed cost)."""
    latency = k.launches * nccl_latency_s(k.collective, instance, n_inst, c)
    if k.collective == "allreduce":
        return allreduce_seconds(k.bytes_read, instance, n_inst, c) + latency
    if k.collective in ("reduce_scatter", "all_gather", "fsdp_all_gather", "fsdp_all_gather_backward",
                        "fsdp_reduce_scatter"):
        return half_collective_seconds(k.bytes_read, instance, n_inst, c) + latency
    bus = max(instance.allreduce_bandwidth_gbs, 1e-9) * GB
    if k.collective in ("dp_broadcast", "dp_reduce"):
        return k.bytes_read / bus + latency
    if k.collective == "dp_io":
        return (instance.gpus - 1) * k.bytes_read / bus
    if k.collective == "dp_flatten":
        return (k.bytes_read + k.bytes_written) / (instance.gpu.memory_bandwidth_gbs * GB * c.hbm_efficiency)
    if k.collective == "dp_replicate":
        return c.dp_replicate_overhead_s
    raise ValueError(f"collective {k.collective!r}")


def communication_seconds(kernels: tuple[Kernel, ...], backward_s: float, instance: Instance, n_inst: int,
                          c: ThroughputConstants, forward_s: float = 0.0) -> tuple[float, float]:
    """(total, exposed) seconds of the communication kernels of one optimizer step: "backward" collectives
    hide up to allreduce_overlap of themselves behind backward's wall time; "forward_prefetch" and
    "backward_prefetch" ones (ZeRO-3/FSDP, per micro-step) hide behind that phase of each micro-step as
    planner.perf.collectives.prefetch_hidden says, the backward ones sharing backward's time, and slow that
    compute by the SMs their NCCL blocks hold (collectives.overlap_contention_s); "exposed" ones nothing
    (kernels.COLLECTIVE_OVERLAP)."""
    total = exposed = 0.0
    budget = {"forward_prefetch": forward_s, "backward_prefetch": backward_s}
    spent = {"forward_prefetch": 0.0, "backward_prefetch": 0.0}
    for k in kernels:
        t = collective_seconds(k, instance, n_inst, c) * k.count
        overlap = COLLECTIVE_OVERLAP[k.collective]
        total += t
        if overlap == "backward":
            exposed += t - min(c.allreduce_overlap * t, backward_s)
        elif overlap in budget:
            hidden = prefetch_hidden(t, k.launches, budget[overlap] * k.count - spent[overlap], c)
            spent[overlap] += hidden
            exposed += t - hidden + overlap_contention_s(hidden, instance)
        else:
            exposed += t
    return total, exposed
