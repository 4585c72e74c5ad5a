"""Time terms of tensor, sequence, context and pipeline parallelism, and where their groups sit (issue 34).

Pure functions over the layout record (planner.parallel.dims.ParallelDims), the model's sizes and the
instance; planner.perf.throughput composes them into a step:

    step = (m + bubble) x (t_stage + TP + CP + P2P exposed) + exposed data-parallel collectives
           + the slowest GPU's wait + the optimizer on this rank's shard

Where each rank sits: Megatron-Core numbers ranks in the order tp-cp-ep-dp-pp (NVIDIA/Megatron-LM
megatron/core/parallel_state.py @d98e8a6, `initialize_model_parallel(order="tp-cp-ep-dp-pp")`): a TP group
is tp consecutive ranks, a CP group strides tp, a DP group strides tp·cp, pipeline neighbours are tp·cp·dp
ranks apart; gradients reduce over DP x CP (`dp_cp_ranks`). So a TP group stays inside one instance while
tp <= GPUs per instance (TP above that is refused here: every layer would all-reduce over EFA, a layout
nobody runs), a CP ring crosses instances when
tp·cp > GPUs per instance, pipeline sends cross instances when tp·cp·dp >= GPUs per instance, and a DP group
has min(dp·cp, GPUs / tp) members per instance (`dp_group_links`).

Bandwidths: inside an instance every ring (all-reduce, all-gather, reduce-scatter, the CP ring's and the
pipeline's point-to-point sends) runs at the instance's NCCL bus bandwidth (`allreduce_bandwidth_gbs`: what
nccl-tests calls busbw, the per-GPU rate of a ring; NVIDIA/nccl-tests doc/PERFORMANCE.md @dcf8189:
busbw = algbw x 2(n-1)/n for an all-reduce, x (n-1)/n for all-gather and reduce-scatter). Between instances
a GPU gets its share of the instance's network, network_gbs / GPUs per instance, since all the instance's
groups send at once through the same NICs. A DP group with d_in members per instance and d_out instances runs NCCL's hierarchical ring:
(d_in-1)/d_in of the traffic on NVLink, then each member sends its 1/d_in slice across at network / (GPUs /
d_in) (`dp_group_links`): with plain data parallelism (d_in = GPUs) this is planner.perf.throughput's
allreduce_seconds unchanged, with TP = 8 on 8-GPU instances a DP group has one GPU per instance, which gets
1/8 of the instance's network.

Overlap assumptions (what hides behind compute and what does not):
- TP collectives are exposed: Megatron-Core runs them on the compute stream between the GEMMs unless
  `--tp-comm-overlap` (TransformerEngine userbuffers) is on, which is off by default (megatron/core/
  model_parallel_config.py @d98e8a6: `tp_comm_overlap: bool = False`). `tp_overlap` in `tp_exposed_s` says how much of
  them a run with it on hides (0 by default).
- CP's ring exchange of K/V hides behind the attention of the chunk in hand: TransformerEngine's
  AttnFuncWithCPAndKVP2P computes block i while sending block i+1, so cp-1 sends each hide up to attention/cp
  (`cp_exposed_s`).
- Pipeline point-to-point sends: exposed under 1F1B and GPipe (the non-interleaved schedule waits on its
  send/recv pairs); hidden behind the other chunks' compute under the interleaved schedule, whose
  `overlap_p2p_comm` Megatron-LM turns on by default (megatron/training/arguments.py @d98e8a6,
  `--no-overlap-p2p-communication` store_false; Megatron-Core's own ModelParallelConfig default is False).
- Data-parallel collectives: planner.perf.throughput's strategy collectives (DDP's bucketed all-reduce hidden
  up to `allreduce_overlap` behind backward, as Megatron's `--overlap-grad-reduce` does; ZeRO/FSDP prefetch),
  over the DP group's links instead of the whole instance's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from planner.errors import PlannerError
from planner.parallel.dims import ParallelDims, for_model
from planner.perf.collectives import ring_latency_s
from planner.perf.constants import ThroughputConstants
from planner.perf.kernels import F32, KINDS, Kernel
from planner.perf.roofline import PHASES, KernelTable
from planner.spec import Instance, ModelSpec, TrainConfig

GB = 1e9
SCHEDULES = ("1f1b", "gpipe", "interleaved-1f1b", "zero-bubble")


# ---- the layout record, until the pipeline resolves it -----------------------------------------------


def has_model_parallelism(config: TrainConfig) -> bool:
    """Whether `config` asks for any tensor, context or pipeline split (else the data-parallel model of
    planner.perf.throughput runs unchanged)."""
    return config.tp > 1 or config.cp > 1 or config.pp > 1


def parallel_dims(model: ModelSpec, config: TrainConfig, instance: Instance) -> ParallelDims:
    """The layout record of `config` over GPUs per instance x --instances (planner.parallel.dims.for_model,
    as the pipeline builds it), for callers of the speed model outside the pipeline, which passes its own."""
    return for_model(model, config, instance.gpus * config.instances)


def _kv_heads(t) -> int:
    return getattr(t, "num_kv_heads", None) or t.num_heads


@dataclass(frozen=True)
class LayerShape:
    """What the model-parallel terms read of a model: hidden size, key/value width (kv heads x head dim),
    transformer layers and the bytes of one activation element as the collectives move it."""

    hidden: int
    kv_width: int
    head_dim: int
    layers: int
    elem_bytes: int
    # TP collective pairs (an all-gather and a reduce-scatter under SP, an all-reduce without) per layer
    # forward, the mean over the layers: 2 for a dense layer (attention, MLP), 1 for a mixture-of-experts
    # layer without a shared expert (`tp_pairs`)
    tp_pairs: float = 2.0
    # routed-expert parameters one rank holds (E / (ep · etp) of each sparse layer's), which tensor
    # parallelism does not divide (issue 35); 0 for a dense model
    local_experts: int = 0


def tp_pairs(model: ModelSpec) -> float:
    """Mean TP collective pairs per layer forward. Megatron-Core (Korthikanti et al. 2022 §4.2.2): the
    attention and a dense MLP each gather before their column-parallel Linears and reduce after their
    row-parallel one. A sparse MoE layer's routed experts take the rank's sequence-parallel tokens and return
    them through the EP all-to-all (megatron/core/transformer/moe/token_dispatcher.py @d98e8a64,
    MoEAlltoAllTokenDispatcher: its only TP-side collectives run over the expert-TP group, --etp, 1 here),
    so such a layer has the attention's pair, plus its shared expert's (shared_experts.py SharedExpertMLP:
    gather before linear_fc1, reduce-scatter after linear_fc2)."""
    from planner.families import family

    pairs = layers = 0
    for t in model.transformers:
        shared = bool(t.moe and family(t.family).shared_expert and t.shared_expert_intermediate_size)
        for i in range(t.num_layers):
            pairs += 2 if not (t.moe and t.sparse_layer(i)) or shared else 1
            layers += 1
    return pairs / layers if layers else 2.0


def layer_shape(model: ModelSpec, config: TrainConfig) -> LayerShape:
    t = model.transformers[0]
    head_dim = getattr(t, "head_dim", None) or t.hidden_size // t.num_heads
    # 16-bit activations on the wire under bf16/fp16 and AMP (the linears' outputs are 16-bit); fp32 else
    elem = 4 if config.precision == "fp32" else 2
    local = 0
    if config.ep * config.etp > 1 and not config.lora:
        from planner.models.blocks import model_blocks
        from planner.models.params import expert_parameters

        local = sum(expert_parameters(b) for b in model_blocks(model)) // (config.ep * config.etp)
    return LayerShape(hidden=t.hidden_size, kv_width=_kv_heads(t) * head_dim, head_dim=head_dim,
                      layers=sum(x.num_layers for x in model.transformers), elem_bytes=elem,
                      tp_pairs=tp_pairs(model) if any(x.moe for x in model.transformers) else 2.0,
                      local_experts=local)


# ---- rings ---------------------------------------------------------------------------------------------


def ring_allreduce_s(nbytes: float, ranks: int, bus_gbs: float) -> float:
    """Ring all-reduce of `nbytes` per rank: 2(n-1)/n x bytes at the bus bandwidth (nccl-tests busbw)."""
    return 0.0 if ranks <= 1 else 2 * (ranks - 1) / ranks * nbytes / (bus_gbs * GB)


def ring_half_s(nbytes: float, ranks: int, bus_gbs: float) -> float:
    """Ring all-gather or reduce-scatter of a `nbytes` full tensor: (n-1)/n x bytes at the bus bandwidth."""
    return 0.0 if ranks <= 1 else (ranks - 1) / ranks * nbytes / (bus_gbs * GB)


def per_gpu_network_gbs(instance: Instance, network_gbs: float) -> float:
    """A GPU's share of its instance's achievable network (all GPUs send at once through the same NICs)."""
    return network_gbs / max(instance.gpus, 1)


# ---- tensor (and sequence) parallelism -----------------------------------------------------------------


def tp_group_bus_gbs(instance: Instance, tp: int) -> float:
    """Bus bandwidth of a TP group: NVLink/NVSwitch inside one instance. TP beyond one instance is refused
    (module docstring)."""
    if tp > instance.gpus:
        raise PlannerError("--tp", tp, f"at most the {instance.gpus} GPUs of one {instance.name}: tensor-parallel "
                                       "groups stay inside an instance (NVLink)")
    return instance.allreduce_bandwidth_gbs


def tp_layer_collectives(b: int, s: int, shape: LayerShape, tp: int, cp: int,
                         sp: bool) -> tuple[tuple[str, float], ...]:
    """Forward collectives of one transformer layer on one TP rank as (collective, full tensor bytes).
    Megatron's tensor parallelism (Shoeybi et al. 2019 §3, Fig. 3; Korthikanti et al. 2022 §4.2.2): the
    attention block and the MLP each end in a row-parallel linear whose output [s/cp, b, h] is all-reduced
    (operator g), 2 all-reduces per layer forward and 2 in backward (operator f). With sequence parallelism
    each all-reduce becomes an all-gather before the column-parallel linear and a reduce-scatter after the
    row-parallel one: 2 all-gathers + 2 reduce-scatters, the same bytes on the wire (an all-reduce is a
    reduce-scatter then an all-gather). Backward mirrors forward."""
    if tp <= 1:
        return ()
    payload = b * (s // cp) * shape.hidden * shape.elem_bytes
    if sp:
        return (("all_gather", payload), ("reduce_scatter", payload)) * 2
    return (("allreduce", payload),) * 2


def tp_seconds_per_layer(b: int, s: int, shape: LayerShape, tp: int, cp: int, sp: bool, instance: Instance,
                         c: ThroughputConstants) -> float:
    """Seconds of one layer's forward TP collectives (backward moves the same; a recomputed forward again),
    each with NCCL's Ring latency over tp ranks on NVLink."""
    bus = tp_group_bus_gbs(instance, tp)
    hop = c.nccl_hop_latency_nvlink_s if instance.gpu.nvlink_gbs > 0 else c.nccl_hop_latency_pci_s
    total = 0.0
    for collective, nbytes in tp_layer_collectives(b, s, shape, tp, cp, sp):
        wire = ring_allreduce_s if collective == "allreduce" else ring_half_s
        total += wire(nbytes, tp, bus) + ring_latency_s(collective, tp, 1, hop, c)
    return total * shape.tp_pairs / 2  # a mixture-of-experts layer may have one pair (`tp_pairs`)


def tp_exposed_s(per_layer_forward_s: float, layers: int, passes: float, tp_overlap: float = 0.0) -> float:
    """Exposed TP time of one micro-batch on one stage: forward + backward (+ a recomputed forward:
    `passes` = 2 or 3) over the stage's layers, less what `--tp-comm-overlap` would hide (off by default)."""
    return per_layer_forward_s * layers * passes * (1 - tp_overlap)


# ---- context parallelism -------------------------------------------------------------------------------


def cp_kv_bytes(b: int, s: int, shape: LayerShape, tp: int, cp: int) -> float:
    """Bytes of the K and V chunk a CP rank sends to the next one at each ring step: [b, s/cp, kv_heads/tp,
    head_dim] x 2 (keys and values; TE AttnFuncWithCPAndKVP2P). Key/value heads fewer than tp are
    replicated, one per rank."""
    kv_per_rank = max(shape.kv_width // tp, shape.head_dim)
    return 2 * b * (s // cp) * kv_per_rank * shape.elem_bytes


def cp_link_gbs(instance: Instance, dims: ParallelDims, network_gbs: float) -> float:
    """A CP ring's per-GPU bandwidth: NVLink while the tp·cp ranks of a CP ring's span fit one instance,
    else the GPU's share of the network (module docstring)."""
    if dims.tp * dims.cp <= instance.gpus:
        return instance.allreduce_bandwidth_gbs
    return per_gpu_network_gbs(instance, network_gbs)


def cp_exposed_s(kv_bytes: float, cp: int, link_gbs: float, attention_forward_s: float,
                 attention_backward_s: float, layers: int) -> tuple[float, float]:
    """(total, exposed) seconds of CP's ring exchange for one micro-batch on one stage. Forward: cp-1 sends
    of K/V per layer, each hidden behind the attention of one block (attention / cp); backward: K/V and
    their gradients dK/dV travel, twice the bytes, behind backward's attention blocks. `attention_*_s` are
    the stage's attention seconds per layer on this rank (already / cp)."""
    if cp <= 1:
        return 0.0, 0.0
    send = kv_bytes / (link_gbs * GB)
    fwd_block, bwd_block = attention_forward_s / cp, attention_backward_s / cp
    total = (cp - 1) * 3 * send * layers
    exposed = (cp - 1) * (max(0.0, send - fwd_block) + max(0.0, 2 * send - bwd_block)) * layers
    return total, exposed


# ---- pipeline parallelism ------------------------------------------------------------------------------


def bubble_fraction(schedule: str, p: int, m: int, v: int = 1) -> float:
    """Idle time of a pipeline over the ideal time of its m micro-batches:
    - 1F1B and GPipe: (p-1)/m (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
      Clusters Using Megatron-LM", §2.2.1: bubble time fraction = (p-1)/m, the same for both schedules; 1F1B
      only bounds the micro-batches in flight);
    - interleaved 1F1B with v virtual stages per rank: (p-1)/(v·m) (ibid. §2.2.2);
    - zero-bubble: 0, ASSUMING Qi et al. 2023 ("Zero Bubble Pipeline Parallelism", ICLR 2024) ZB-H2 or
      ZB-V: the backward split into input- and weight-gradient passes whose weight passes fill the bubble,
      with m >= 2p micro-batches, the optimizer step's synchronisation bypassed and about twice 1F1B's
      activations in flight; ZB-H1 (1F1B's memory) leaves about a third of 1F1B's bubble, not modelled."""
    if p <= 1:
        return 0.0
    if schedule not in SCHEDULES:
        raise PlannerError("--pp-schedule", schedule, ", ".join(SCHEDULES))
    if schedule == "zero-bubble":
        return 0.0
    if schedule == "interleaved-1f1b":
        return (p - 1) / (v * m)
    return (p - 1) / m


def p2p_bytes(b: int, s: int, shape: LayerShape, tp: int, cp: int, sp: bool) -> float:
    """Bytes of one pipeline send (activations forward, their gradient backward): the [s/cp (/tp with SP), b,
    h] tensor between stages (Megatron-Core megatron/core/pipeline_parallel/schedules.py @d98e8a6,
    get_tensor_shapes: seq_length // cp, // tp under sequence_parallel)."""
    seq = s // cp // (tp if sp else 1)
    return b * seq * shape.hidden * shape.elem_bytes


def p2p_link_gbs(instance: Instance, dims: ParallelDims, network_gbs: float) -> float:
    """Per-GPU bandwidth between pipeline neighbours: tp·cp·dp ranks apart (order tp-cp-ep-dp-pp), so on
    the network once that reaches the GPUs of an instance, NVLink before."""
    if dims.tp * dims.cp * dims.dp >= instance.gpus:
        return per_gpu_network_gbs(instance, network_gbs)
    return instance.allreduce_bandwidth_gbs


def p2p_seconds_per_micro_batch(nbytes: float, link_gbs: float, v: int, c: ThroughputConstants,
                                across: bool) -> float:
    """Seconds one stage spends receiving one micro-batch's activations and sending its gradients: two
    transfers per model chunk (v chunks per rank under the interleaved schedule), each with one hop's
    latency."""
    hop = c.nccl_hop_latency_net_s if across else c.nccl_hop_latency_nvlink_s
    return 2 * v * (nbytes / (link_gbs * GB) + c.nccl_base_latency_s + hop)


# ---- data parallelism over model-parallel groups ------------------------------------------------------


def dp_cp_ranks(dims: ParallelDims) -> int:
    """Ranks that hold the same parameters and reduce their gradients together: data-parallel x context-
    parallel (CP ranks see other tokens of the same weights). Megatron-Core's DDP and distributed optimizer
    run over `dp_cp_group` (megatron/core/distributed/distributed_data_parallel.py @d98e8a6:
    data_parallel_world_size = dp_cp_group.size()); torchtitan's FSDP shards over dp_shard x cp."""
    return dims.dp * dims.cp


def dp_group_links(instance: Instance, dims: ParallelDims) -> tuple[int, int, float]:
    """(members per instance d_in, instances d_out, the network Gbps the group's ring sees) of one DP x CP
    group (`dp_cp_ranks`): its ranks stride tp, so d_in = min(dp·cp, GPUs / tp); the group's d_in members
    share the instance's network with the GPUs / d_in other groups' members, so its hierarchical ring
    crosses at network x d_in / GPUs (module docstring)."""
    g, ranks = instance.gpus, dp_cp_ranks(dims)
    d_in = max(1, min(ranks, g // dims.tp))
    d_out = max(1, ranks // d_in)
    return d_in, d_out, instance.network_gbps * d_in / g


def megatron_buckets(params: int, dp: int) -> int:
    """Buckets of Megatron-Core's DDP: bucket_size = max(40,000,000, 1,000,000 x dp) parameters when none
    is given (megatron/core/distributed/distributed_data_parallel.py @d98e8a6: "sane default based on
    dp_group size", so that large DP groups are not latency-bound)."""
    return max(1, math.ceil(params / max(40_000_000, 1_000_000 * dp)))


def distributed_optimizer_kernels(grad_bytes: float, param_bytes: float, buckets: int) -> tuple[Kernel, ...]:
    """Megatron's distributed optimizer over a DP group (`--use-distributed-optimizer`; NVIDIA/Megatron-LM
    docs/source/api-guide/dist_optimizer.md: "reduce-scatter the grads" once the step's micro-batches have
    accumulated into the contiguous grad buffer, the optimizer updates its shard, then "all-gather the
    params"): one reduce-scatter of the gradients per step, bucketed, hidden behind the last backward like
    DDP's all-reduce (`--overlap-grad-reduce`); one all-gather of the updated 16-bit parameters, exposed
    (`--overlap-param-gather` is off by default). `buckets`: `megatron_buckets`."""
    return (Kernel("distopt.reduce_scatter", "communication", 0, int(grad_bytes), int(grad_bytes), F32, "step",
                   launches=buckets, collective="reduce_scatter"),
            Kernel("distopt.all_gather", "communication", 0, int(param_bytes), int(param_bytes), F32, "step",
                   launches=buckets, collective="all_gather"))


def fsdp_gathers_once(config: TrainConfig, dims: ParallelDims) -> bool:
    """Whether FSDP/HSDP gathers each unit's parameters ONCE per optimizer step and reduce-scatters its
    gradients once, instead of per micro-batch: FSDP2 (`fully_shard`, the pytorch and torchtitan frameworks)
    under pipeline parallelism.
    - torchtitan does not reshard after forward when PP is on (pytorch/torchtitan
      torchtitan/models/llama3/infra/parallelize.py apply_fsdp: `reshard_after_forward_policy == "default"`:
      "if pp_enabled: # For PP, do not reshard after forward to avoid per-microbatch all-gathers, which can
      be expensive and non-overlapped; reshard_after_forward = False");
    - torch.distributed.pipelining runs every backward of an FSDPModule stage with
      `set_is_last_backward(False)`, `set_reshard_after_backward(False)` and
      `set_requires_gradient_sync(False)` (torch/distributed/pipelining/stage.py
      `_PipelineStageBase.backward_maybe_with_nosync`, lines 843-847 of torch 2.13.0 as installed), and the
      schedule's REDUCE_GRAD action, "scheduled after all microbatches W, B actions", sets all three True
      and runs FSDP's post-backward (the same file, lines 1165-1177): gradients accumulate unsharded and are
      reduce-scattered once, after the last micro-batch.
    So the stage's unsharded parameters (and its unsharded gradients) stay in memory across the step
    (planner.pipeline.step adds them to the stage) and the collectives are counted once per step.
    ZeRO-3 (DeepSpeed refuses ZeRO-3 with its pipeline engine) and FSDP1 (no pipelining integration) keep
    the per-micro-batch rule."""
    from planner.parallel import frameworks
    from planner.parallel import get as strategy_of

    fw = frameworks.get(config.framework)
    return dims.pp > 1 and strategy_of(config.parallelism).fsdp and fw.fsdp == "fsdp2"


def hsdp_groups(instance: Instance, dims: ParallelDims) -> tuple[tuple[int, int, float], tuple[int, int, float]]:
    """HSDP's two groups as `dp_group_links` gives them, (members per instance, instances, network Gbps):
    the shard group (dp_shard x cp ranks, striding tp: FSDP2 on the (dp_replicate, dp_shard) mesh,
    torchtitan's ParallelDims with dp_shard innermost) where parameters are gathered and gradients
    reduce-scattered, and the replicate group (dp_replicate ranks, striding tp·cp·dp_shard) where each
    rank's gradient shard is all-reduced (pytorch/pytorch torch/distributed/fsdp/_fully_shard/
    _fsdp_collectives.py foreach_reduce: reduce-scatter over the shard group, then `all_reduce` of the
    reduce-scatter output over the replicate group). The replicate group's members sit on different
    instances once tp·cp·dp_shard >= GPUs per instance, each one GPU's share of the network."""
    g = instance.gpus
    shard_ranks = dims.dp_shard * dims.cp
    s_in = max(1, min(shard_ranks, g // dims.tp))
    s_out = max(1, shard_ranks // s_in)
    shard = (s_in, s_out, instance.network_gbps * s_in / g)
    span = dims.tp * shard_ranks  # ranks between two replicas
    r_in = max(1, min(dims.dp_replicate, g // span)) if span < g else 1
    r_out = max(1, dims.dp_replicate // r_in)
    replicate = (r_in, r_out, instance.network_gbps * r_in / g)
    return shard, replicate


# ---- compute per stage ---------------------------------------------------------------------------------


_FIRST = ("embeddings",)  # blocks on the first pipeline stage besides its layers
_LAST = ("final_norm", "pooler", "head", "dense", "batchnorm", "")  # the last stage's ("": the loss)


def stage_table(table: KernelTable, dims: ParallelDims, stage: str, layers: int,
                stage_layers: float | None = None) -> KernelTable:
    """The kernels one rank of a `stage` ("first", "last", "middle" or "only" without PP) runs per micro-batch,
    from the whole model's table on one GPU:
    - layers: the rank's `stage_layers` of the model's `layers` (count x stage_layers / layers; None: 1/pp of
      them; an uneven split, planner.parallel.layer_split, gives each rank its own count; ASSUMPTION: every
      layer of the table costs the mean, so a stage of DeepSeek-V3's dense layers is timed as the others); FLOPs and bytes of GEMMs and attention / (tp·cp) (column/row-
      parallel linears and heads split by TP, the sequence by CP), the GEMM's row dimension / (tp·cp) for
      the wave rule (ASSUMPTION: which GEMM dimension TP splits hardly moves the tile count at these sizes);
      memory-bound kernels / cp, and / tp too under sequence parallelism (norms, dropouts, residuals on
      s/tp tokens); without SP they are counted replicated (an upper bound: the activation's and the weight
      casts' share inside the split blocks is also / tp in reality).
    - the first stage: the embedding (/ cp: every TP rank produces the full [s, b, h] lookup);
    - the last stage: final norm (/ tp under SP), the LM head and the loss, vocabulary-parallel (/ tp·cp).
    A table without block roles (a traced model) is treated as all layers."""
    share = 1 / dims.pp if stage_layers is None or stage_layers * dims.pp == layers else stage_layers / layers
    key = ("stage", stage, dims.tp, dims.cp, dims.pp, dims.sp, layers, share)
    hit = table.peaks_cache.get(key)
    if hit is not None:
        return hit
    roles = table.roles or ("layer",) * len(table.names)
    tp, cp = dims.tp, dims.cp
    heavy = (table.kind == KINDS.index("gemm")) | (table.kind == KINDS.index("attention"))
    split = np.where(heavy, tp * cp, cp * (tp if dims.sp else 1)).astype(float)
    keep = np.ones(len(roles))
    count = table.count.astype(float).copy()
    for i, role in enumerate(roles):
        if role == "layer":
            count[i] = count[i] * share
        elif role in _FIRST:
            keep[i] = 1.0 if stage in ("first", "only") else 0.0
            split[i] = cp
        else:  # the last stage's blocks; the head's GEMMs and the loss are vocabulary-parallel
            keep[i] = 1.0 if stage in ("last", "only") else 0.0
            split[i] = tp * cp if (heavy[i] or role in ("head", "")) else cp * (tp if dims.sp else 1)
    base, per_b = table.base.copy(), table.per_b.copy()
    for arr in (base, per_b):
        arr[:, 0] /= split
        arr[:, 1] /= split
        arr[:, 3] = np.where(table.is_gemm, arr[:, 3] / split, arr[:, 3])
    out = KernelTable(names=table.names, kind=table.kind, phase=table.phase, count=count * keep,
                      launches=table.launches, dtype=table.dtype, is_gemm=table.is_gemm,
                      is_fused_attention=table.is_fused_attention, base=base, per_b=per_b, roles=table.roles,
                      dynamic_cast=table.dynamic_cast)
    table.peaks_cache[key] = out
    return out


def attention_seconds(table: KernelTable, seconds: np.ndarray) -> tuple[float, float]:
    """(forward, backward) seconds of a stage table's attention kernels, all its layers together."""
    att = table.kind == KINDS.index("attention")
    fwd = table.phase == PHASES.index("forward")
    back = table.phase == PHASES.index("backward")
    return float(seconds[att & fwd].sum()), float(seconds[att & back].sum())
