"""Turn the shared `estimate` flags into a TrainConfig (used by estimate, explain and probe)."""

from __future__ import annotations

from typing import Any

from planner.errors import PlannerError
from planner.parallel import known, resolve_name
from planner.spec import MAX_BATCH, TrainConfig


def build_config(*, instance_gpus: int, batch_size: int | None, global_batch_size: int | None, seq_len: int,
                 precision: str, optimizer: str, optimizer_impl: str, parallelism: str, checkpointing: bool,
                 attention: str, grad_accum: int, instances: int, **extra: Any) -> TrainConfig:
    """`--global-batch-size` = micro-batch × grad-accum × GPUs × instances; it must divide evenly."""
    if batch_size is None and global_batch_size is None:
        raise PlannerError("--batch-size", None, "give --batch-size (per GPU) or --global-batch-size")
    if global_batch_size is not None:
        if global_batch_size <= 0:
            raise PlannerError("--global-batch-size", global_batch_size, "a positive integer")
        # "auto" by the one rule (planner.parallel.resolve_name); None: a name TrainConfig refuses below
        strategy = known(resolve_name(parallelism, instance_gpus * instances))
        gpus = strategy.world_size(instance_gpus, instances) if strategy else instance_gpus * instances
        # tensor, context and pipeline groups hold one replica between them: the batch is split over the
        # data-parallel rest (Megatron: global = micro-batch × micro-batches × DP); a product that does not
        # divide the GPUs is refused when the layout is checked (planner.parallel.dims)
        model_parallel = extra.get("tp", 1) * extra.get("cp", 1) * extra.get("pp", 1)
        if model_parallel > 1 and gpus % model_parallel == 0:
            gpus //= model_parallel
            if batch_size is not None and grad_accum == 1 and global_batch_size % (batch_size * gpus) == 0:
                # both given: the micro-batches per step follow (Megatron's num_microbatches)
                grad_accum = global_batch_size // (batch_size * gpus)
        per_step = max(grad_accum, 1) * gpus
        if global_batch_size % per_step:
            raise PlannerError("--global-batch-size", global_batch_size,
                               f"a multiple of grad-accum × data-parallel GPUs = {per_step}")
        derived = global_batch_size // per_step
        if derived > MAX_BATCH:
            raise PlannerError("--global-batch-size", global_batch_size,
                               f"at most {MAX_BATCH:,} samples per GPU × grad-accum × GPUs = {MAX_BATCH * per_step:,}")
        if batch_size is not None and batch_size != derived:
            raise PlannerError("--batch-size", batch_size,
                               f"{derived} (from --global-batch-size {global_batch_size}), or leave it out")
        batch_size = derived
    return TrainConfig(batch_size=batch_size, seq_len=seq_len, precision=precision, optimizer=optimizer,
                       optimizer_impl=optimizer_impl, parallelism=parallelism, checkpointing=checkpointing,
                       attention=attention, grad_accum=grad_accum, instances=instances, **extra)
