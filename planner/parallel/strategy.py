"""What one parallelism strategy is, as a record: the traits every interpreter reads instead of its name.

A strategy is how a training step is spread over GPUs: which model states each GPU keeps a shard of, how many
processes drive the GPUs, which buffers the wrapper adds, which collectives it issues per step, and what the
training loop's `zero_grad()` still governs. Memory (planner.memory), speed (planner.perf), the explanation and
the probe job all read these fields, so a new strategy is one record in `planner/parallel/registry.py`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal


@dataclass(frozen=True)
class Sharding:
    """Which model states are divided over the data-parallel GPUs (ZeRO stages, Rajbhandari et al. 2020 §5:
    1 shards optimizer states, 2 also gradients, 3 also parameters). `tensor` and `pipeline` are the degrees
    of tensor and pipeline parallelism, 1 for every strategy modelled so far: room for Megatron-style
    strategies, which divide every state (and the activations) by those degrees as well."""

    optimizer_states: bool = False
    gradients: bool = False
    parameters: bool = False
    tensor: int = 1
    pipeline: int = 1

    @property
    def zero_stage(self) -> int:
        """0-3: the ZeRO stage these flags amount to."""
        return 3 if self.parameters else 2 if self.gradients else 1 if self.optimizer_states else 0

    @property
    def any(self) -> bool:
        return self.optimizer_states or self.gradients or self.parameters


# How many NCCL calls a collective is issued as, and how many bytes it moves: names the speed model resolves
# (planner.perf.kernels.comm_kernels) against the step's gradient bytes, bucket cap and wrapped units.
Launches = Literal["buckets", "units", "dp_chunks", "one", "none"]
# "params": the parameters all-gathered (ZeRO/FSDP), in the framework's gather dtype, frozen ones included
Payload = Literal["grads", "params", "flatten", "dp_io", "none"]


@dataclass(frozen=True)
class Collective:
    """One communication kernel of a step: its kernel name, the collective the speed model times, whether it
    runs every micro-step (else once per optimizer step), how it is split into NCCL calls and what it moves."""

    name: str
    collective: str
    per_micro_step: bool
    launches: Launches
    payload: Payload = "grads"


def _one_unit(n_tensors: int, layers: int | None) -> int:
    return 1


@dataclass(frozen=True)
class Strategy:
    """One parallelism strategy and every trait the planner reads from it (module docstring)."""

    name: str
    label: str  # how the explanation names it
    sharding: Sharding = field(default_factory=Sharding)
    uses_one_gpu: bool = False  # `single`: world size 1 whatever the instance holds
    one_process: bool = False  # nn.DataParallel: one process drives every GPU of one instance
    ddp_buckets: bool = False  # DDP's Reducer keeps flat gradient buckets (reducer.cpp initialize_buckets)
    # the training loop's zero_grad() decides whether gradients stay allocated between steps (stacks.json
    # zero_grad); ZeRO/FSDP keep their own gradient buffers (ASSUMPTION, see stacks.json)
    loop_zero_grad: bool = True
    communication: tuple[Collective, ...] = ()
    # NCCL calls per sharded-parameter collective (FSDP's wrapped units, ZeRO-3's fetched modules), from
    # (parameter tensors, transformer layers or None)
    units: Callable[[int, int | None], int] = _one_unit
    rank: int = 0  # simplicity: lower is simpler to run; a search prefers it among equals
    # PyTorch's FSDP wrapper: which one (FSDP1/FSDP2) and its mixed precision are the framework's
    # (planner.parallel.frameworks)
    fsdp: bool = False
    notes: str = ""

    @property
    def shards(self) -> bool:
        """Some model state is divided over the GPUs (ZeRO-1..3, FSDP)."""
        return self.sharding.any

    def world_size(self, gpus_per_instance: int, instances: int) -> int:
        """GPUs that train together: one for a one-GPU strategy, all GPUs of all instances otherwise."""
        return 1 if self.uses_one_gpu else gpus_per_instance * instances

    def gpus_per_instance(self, gpus_per_instance: int) -> int:
        """GPUs this strategy uses on each instance."""
        return 1 if self.uses_one_gpu else gpus_per_instance
