"""The parallelism strategies, one record each, and the one place "auto" and the world size are resolved.

Adding a strategy: one `Strategy` record here (and its name in spec.Parallelism, the flag's choices).
"""

from __future__ import annotations

from planner.errors import PlannerError
from planner.parallel.strategy import Collective, Sharding, Strategy

# "auto": plain training on one GPU in all, DDP on several (what `torchrun` + DDP gives by default).
AUTO = "auto"
AUTO_ONE_GPU = "single"
AUTO_MULTI_GPU = "ddp"


def _zero3_units(n_tensors: int, layers: int | None) -> int:
    """ZeRO-3 fetches each sub-module's parameters when it runs: about one module per two parameter tensors
    (weight + bias; ASSUMPTION)."""
    return max(1, n_tensors // 2)


def _fsdp_units(n_tensors: int, layers: int | None) -> int:
    """FSDP wraps each transformer layer plus the root unit holding the rest (transformer_auto_wrap_policy),
    one flat all-gather per unit. Without a layer count (traced models): about a dozen tensors a layer
    (GPT-2 12, BERT 16, Llama 9)."""
    return (layers if layers else max(1, n_tensors // 12)) + 1


_ALLREDUCE = Collective("ddp.allreduce", "allreduce", per_micro_step=False, launches="buckets")
_ZERO_ALLGATHER = Collective("zero.all_gather", "all_gather", per_micro_step=False, launches="one", payload="params")
_FSDP = (Collective("fsdp.all_gather.forward", "fsdp_all_gather", per_micro_step=True, launches="units",
                    payload="params"),
         Collective("fsdp.all_gather.backward", "fsdp_all_gather_backward", per_micro_step=True, launches="units",
                    payload="params"),
         Collective("fsdp.reduce_scatter", "fsdp_reduce_scatter", per_micro_step=True, launches="units"))

STRATEGIES: dict[str, Strategy] = {s.name: s for s in (
    Strategy("single", "one GPU", uses_one_gpu=True, rank=0,
             notes="One GPU holds everything."),
    Strategy("dp", "nn.DataParallel", one_process=True, rank=5,
             communication=(
                 Collective("dp.replicate.broadcast", "dp_broadcast", per_micro_step=True, launches="dp_chunks"),
                 Collective("dp.backward.reduce_add", "dp_reduce", per_micro_step=True, launches="dp_chunks"),
                 Collective("dp.flatten", "dp_flatten", per_micro_step=True, launches="none", payload="flatten"),
                 Collective("dp.scatter_gather", "dp_io", per_micro_step=True, launches="none", payload="dp_io"),
                 Collective("dp.replicate", "dp_replicate", per_micro_step=True, launches="none", payload="none")),
             notes="One process over one instance's GPUs: inputs scattered from and outputs gathered to GPU 0."),
    Strategy("ddp", "DistributedDataParallel", ddp_buckets=True, rank=1, communication=(_ALLREDUCE,),
             notes="One process per GPU, each with a full replica; gradients all-reduced in buckets."),
    Strategy("zero1", "ZeRO-1", Sharding(optimizer_states=True), ddp_buckets=True, loop_zero_grad=False, rank=2,
             communication=(Collective("zero.allreduce", "allreduce", per_micro_step=False, launches="buckets"),
                            _ZERO_ALLGATHER),
             notes="ZeroRedundancyOptimizer over DDP: optimizer states sharded."),
    Strategy("zero2", "ZeRO-2", Sharding(optimizer_states=True, gradients=True), loop_zero_grad=False, rank=3,
             communication=(Collective("zero.reduce_scatter", "reduce_scatter", per_micro_step=True, launches="one"),
                            _ZERO_ALLGATHER),
             notes="Optimizer states and gradients sharded."),
    Strategy("zero3", "ZeRO-3", Sharding(True, True, True), loop_zero_grad=False, rank=4, communication=_FSDP,
             units=_zero3_units, notes="Every model state sharded; parameters all-gathered per module."),
    Strategy("fsdp", "FSDP FULL_SHARD", Sharding(True, True, True), loop_zero_grad=False, rank=4,
             communication=_FSDP, units=_fsdp_units, fsdp=True,
             notes="PyTorch FSDP FULL_SHARD: ZeRO-3 semantics, one flat all-gather per wrapped unit."),
    # HSDP: fully_shard(mesh=2-D DeviceMesh (dp_replicate, dp_shard)) shards over the inner dimension and
    # replicates over the outer (torch/distributed/fsdp/_fully_shard/_fully_shard.py: "a 2D mesh ... HSDP";
    # torchtitan parallel_dims dp_replicate × dp_shard). The states are divided by dp_shard only
    # (planner.memory.parallel.sharding); the gradients' shards are all-reduced across the replicas.
    Strategy("hsdp", "HSDP (FSDP in each replica group)", Sharding(True, True, True), loop_zero_grad=False, rank=4,
             communication=(*_FSDP, Collective("hsdp.replicate.allreduce", "allreduce", per_micro_step=False,
                                               launches="units")),
             units=_fsdp_units, fsdp=True,
             notes="FSDP inside each group of --dp-replicas; the groups hold replicas, their gradient shards "
                   "all-reduced across groups."),
)}


def get(name: str) -> Strategy:
    """The record of a resolved strategy name. "auto" is a programming error, not bad input: the pipeline
    resolves it once (planner.pipeline.resolve.resolve_parallelism) before any interpreter reads it."""
    if name == AUTO:
        raise ValueError('parallelism "auto" reached a strategy lookup unresolved; resolve the configuration '
                         "first (planner.pipeline.resolve.resolve_parallelism)")
    try:
        return STRATEGIES[name]
    except KeyError:
        raise PlannerError("--parallelism", name, ", ".join(STRATEGIES)) from None


def known(name: str | None) -> Strategy | None:
    """The record of `name`, or None for "auto", None and names that are no strategy."""
    return STRATEGIES.get(name) if name else None


def resolve_name(name: str, gpus_in_all: int) -> str:
    """`auto` → `single` on one GPU in all, else `ddp`; any other name unchanged."""
    if name != AUTO:
        return name
    return AUTO_ONE_GPU if gpus_in_all == 1 else AUTO_MULTI_GPU


def sharded_names() -> tuple[str, ...]:
    """The strategies that divide some model state over the GPUs."""
    return tuple(n for n, s in STRATEGIES.items() if s.shards)


def is_default(name: str | None) -> bool:
    """A name that says nothing beyond the default: absent, "auto", or the one-GPU strategy."""
    return name in (None, AUTO, AUTO_ONE_GPU)
