"""What a collective costs beyond its bytes, and how much of ZeRO-3/FSDP's per-unit traffic compute hides.

Three mechanisms that make ZeRO-3, FSDP and DataParallel differ from DDP and ZeRO-2 beyond their volume
(planner.perf.kernels.communication_kernels says which collectives each strategy issues):

- latency per NCCL call: NCCL's own cost model (NVIDIA/nccl src/graph/tuning.cc, `ncclTopoTuneModel`) prices
  a ring collective at baseLat + intra-node steps x hwLat(NVLink or PCI) + inter-node steps x hwLat(NET),
  with steps 2(n-1) for an all-reduce, n-1 for an all-gather or reduce-scatter, n for a broadcast or reduce
  (Ring/Simple protocol, the one large messages use). DDP pays it once per 25 MB bucket; FSDP once per
  wrapped unit per collective, ZeRO-3 once per fetched sub-module: hundreds of calls per micro-step.
- overlap of the per-unit collectives (`prefetch_hidden`), unit by unit: the next unit's all-gather is
  issued on its own stream while this unit computes (FSDP1 forward: the CPU runs ahead and reaches the next
  unit's pre-forward all-gather, at most two in flight with `limit_all_gathers`; FSDP1 backward_prefetch=
  BACKWARD_PRE, its default; FSDP2's implicit prefetch, one unit ahead in forward and backward; ZeRO-3's
  `stage3_prefetch_bucket_size`), and unit k's reduce-scatter runs while unit k-1's backward computes. With
  n equal units of collective time u and compute time v, the phase takes u + (n-1) max(u, v) + v (one NCCL
  stream per process group serialises the collectives; PyTorch FSDP paper, Zhao et al. 2023, sec. 3.3.2,
  "Backward Prefetching", and torch/distributed/fsdp/_runtime_utils.py `_prefetch_handle`): the first
  unit's collective is exposed, the rest hide up to the phase's compute, `shard_overlap` of them at most
  (1.0: the pipeline bound itself, no further loss assumed). The backward all-gathers and reduce-scatters
  share backward's compute.
- what the overlap costs compute (`overlap_contention_s`): a collective running beside compute holds one
  thread block per NCCL channel (NCCL docs, NCCL_MIN_NCHANNELS / NCCL_MAX_NCHANNELS: "the number of
  CUDA blocks NCCL uses"), each on an SM the compute kernels then lack, so the hidden seconds slow compute by
  channels / SMs of themselves (16 / 108 = 15 % on an A100): nccl_channels from the GPU's row
  (planner/data/gpus.json "runtime", an ASSUMPTION there) over its sm_count.
- DataParallel's one process (`dataparallel_host_launches`): parallel_apply runs each replica's forward in a
  Python thread; the per-op host work holds the GIL, so the replicas' forward dispatch is serialised
  (`dp_gil_share` of it: ASSUMPTION), while backward runs in autograd's per-device C++ threads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from planner.perf.constants import ThroughputConstants
    from planner.spec import Instance

# collective -> ring steps as a function of ranks (NCCL tuning.cc `nsteps`)
_STEPS = {"allreduce": 2, "reduce_scatter": 1, "all_gather": 1, "fsdp_all_gather": 1,
          "fsdp_all_gather_backward": 1, "fsdp_reduce_scatter": 1}


def nccl_latency_s(collective: str, instance: Instance, instances: int, c: ThroughputConstants) -> float:
    """Seconds of fixed latency of ONE NCCL call of `collective` over `instances` x instance.gpus ranks, as
    NCCL's tuning model prices a Ring/Simple collective (module docstring). Broadcast/reduce (DataParallel):
    baseLat + one hop, the ring case with the same channels in tuning.cc."""
    ranks, nodes = instance.gpus * instances, instances
    if ranks <= 1:
        return 0.0
    intra = c.nccl_hop_latency_nvlink_s if instance.gpu.nvlink_gbs > 0 else c.nccl_hop_latency_pci_s
    if collective in ("dp_broadcast", "dp_reduce"):
        return c.nccl_base_latency_s + intra
    return ring_latency_s(collective, ranks, nodes, intra, c)


def ring_latency_s(collective: str, ranks: int, nodes: int, intra_hop_s: float, c: ThroughputConstants) -> float:
    """NCCL's Ring/Simple latency of ONE call over `ranks` GPUs on `nodes` instances (module docstring):
    baseLat + intra-node steps x `intra_hop_s` + inter-node steps x hwLat(NET). Model-parallel groups
    (planner.perf.model_parallel: tensor-parallel inside one instance) call it with their own group size."""
    mult = _STEPS.get(collective)
    if mult is None or ranks <= 1:
        return 0.0
    steps, inter = mult * (ranks - 1), mult * (max(nodes, 1) - 1)
    return c.nccl_base_latency_s + (steps - inter) * intra_hop_s + inter * c.nccl_hop_latency_net_s


def prefetch_hidden(seconds: float, launches: int, budget_s: float, c: ThroughputConstants) -> float:
    """Seconds of a ZeRO-3/FSDP phase's per-unit collectives (`seconds` over `launches` units) hidden behind
    `budget_s` of that phase's compute, unit by unit (module docstring): all but the first unit's share,
    `shard_overlap` of it at most, never more than the compute it runs beside."""
    hideable = seconds * (1 - 1 / max(launches, 1))
    return max(0.0, min(c.shard_overlap * hideable, budget_s))


def overlap_contention_s(hidden_s: float, instance: Instance) -> float:
    """Seconds compute loses to the SMs NCCL's thread blocks hold while `hidden_s` of collectives run beside it:
    channels / SMs of them (module docstring); 0 where the GPU row gives neither figure."""
    gpu = instance.gpu
    if not gpu.sm_count or not gpu.nccl_channels:
        return 0.0
    return hidden_s * min(gpu.nccl_channels / gpu.sm_count, 1.0)


def dataparallel_host_launches(launches: float, backward_launches: float, world: int,
                               c: ThroughputConstants) -> float:
    """Launches' worth of host time of one DataParallel micro-step: every replica's forward ops dispatched
    one thread at a time under the GIL (`dp_gil_share` of each), backward's in parallel C++ threads."""
    forward = launches - backward_launches
    return launches + (world - 1) * forward * c.dp_gil_share


def all_to_all_seconds(nbytes: float, ep: int, gpus_per_node: int, intra_gbs: float, net_gbs_per_gpu: float,
                       c: ThroughputConstants) -> float:
    """Seconds of one all-to-all over an expert-parallel group of `ep` ranks, each sending `nbytes` in all
    (a 1/ep share of it stays on the rank). The group's ranks are contiguous (Megatron-Core's and
    torchtitan's expert mesh is the innermost dimension), so min(ep, gpus_per_node) of them share a node:
    the share bound for the rest of the node moves over NVLink at `intra_gbs` (ASSUMPTION: NCCL's
    all-to-all reaches its all-reduce bus bandwidth inside an NVSwitch node), the share bound for other
    nodes over the node's network, `net_gbs_per_gpu` being each GPU's part of it; both run at once, so the
    slower one decides. Plus one NCCL call's base latency and a hop."""
    if ep <= 1 or nbytes <= 0:
        return 0.0
    inside = min(ep, gpus_per_node)
    intra = nbytes * (inside - 1) / ep / (max(intra_gbs, 1e-9) * 1e9)
    inter = nbytes * (ep - inside) / ep / (max(net_gbs_per_gpu, 1e-9) * 1e9) if ep > inside else 0.0
    hop = c.nccl_hop_latency_net_s if ep > inside else c.nccl_hop_latency_nvlink_s
    return max(intra, inter) + c.nccl_base_latency_s + hop
