"""How a parallelism strategy places model states on GPUs.

Under DataParallel and DDP every GPU holds a FULL replica of parameters, gradients and optimizer states;
only ZeRO/FSDP-style sharding divides them (seed note 000 divided by 8 GPUs: that is wrong).
ZeRO stages (Rajbhandari et al. 2020, §5): 1 shards optimizer states, 2 also gradients, 3 also parameters.
`fsdp` is PyTorch FSDP FULL_SHARD, i.e. ZeRO-3 semantics.
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.errors import PlannerError
from planner.spec import Instance, TrainConfig

ZERO_STAGE = {"single": 0, "dp": 0, "ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3, "fsdp": 3}


def resolve_parallelism(config: TrainConfig, instance: Instance) -> TrainConfig:
    """`auto` means DDP on several GPUs, plain single-GPU training on one."""
    p = config.parallelism
    gpus = instance.gpus * config.instances
    if p == "auto":
        p = "single" if gpus == 1 else "ddp"
    if p == "dp" and config.instances > 1:
        raise PlannerError("--parallelism", p, "nn.DataParallel runs in one process on one instance; "
                           "use ddp, zero1-3 or fsdp with --instances > 1")
    if p == "single" and config.instances > 1:
        raise PlannerError("--parallelism", p, "single uses one GPU; use ddp, zero1-3 or fsdp with --instances > 1")
    return config.model_copy(update={"parallelism": p})


def world_size(config: TrainConfig, instance: Instance) -> int:
    """GPUs that train together: one for `single`, all GPUs of all instances otherwise."""
    return 1 if config.parallelism == "single" else instance.gpus * config.instances


@dataclass(frozen=True)
class Sharding:
    """Fraction of each model state that one GPU keeps."""

    parameters: float
    gradients: float
    optimizer_states: float


def sharding(config: TrainConfig, world: int) -> Sharding:
    stage = ZERO_STAGE[config.parallelism]
    part = 1.0 / world
    return Sharding(
        parameters=part if stage >= 3 else 1.0,
        gradients=part if stage >= 2 else 1.0,
        optimizer_states=part if stage >= 1 else 1.0,
    )
