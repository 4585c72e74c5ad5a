"""How a parallelism strategy places model states on GPUs.

Under DataParallel and DDP every GPU holds a FULL replica of parameters, gradients and optimizer states;
only ZeRO/FSDP-style sharding divides them (dividing them by the GPU count under DDP is a common mistake).
ZeRO stages (Rajbhandari et al. 2020, §5): 1 shards optimizer states, 2 also gradients, 3 also parameters.
`fsdp` is PyTorch FSDP FULL_SHARD, i.e. ZeRO-3 semantics.
"""

from __future__ import annotations

from dataclasses import dataclass

from planner import parallel as strategies
from planner.ir.context import LOW_DTYPE
from planner.memory import batch as batch_mem
from planner.spec import BYTES_PER_DTYPE, Instance, ModelSpec, TrainConfig, TransformerSpec

ZERO_STAGE = {name: s.sharding.zero_stage for name, s in strategies.STRATEGIES.items()}


def world_size(config: TrainConfig, instance: Instance) -> int:
    """GPUs that train together: one for `single`, all GPUs of all instances otherwise (`config` resolved:
    planner.pipeline.resolve.resolve_parallelism)."""
    return strategies.get(config.parallelism).world_size(instance.gpus, config.instances)


@dataclass(frozen=True)
class Sharding:
    """Fraction of each model state that one GPU keeps."""

    parameters: float
    gradients: float
    optimizer_states: float

    def block_bytes(self, full_params: int, full_grads: int) -> tuple[int, int, int, int]:
        """A block's (resident parameters, resident gradients, gathered parameters, transient gradients) on
        one GPU, from its unsharded bytes: ZeRO-3/FSDP all-gathers a unit's full parameters while it runs
        (and prefetches the next one: twice the missing share), and holds its unsharded gradients until the
        reduce-scatter. Both front ends (analytic and traced) lay blocks out with it."""
        resident_p, resident_g = int(full_params * self.parameters), int(full_grads * self.gradients)
        gathered = 2 * (full_params - resident_p) if self.parameters < 1 else 0
        transient = full_grads - resident_g if self.gradients < 1 else 0
        return resident_p, resident_g, gathered, transient


def sharding(config: TrainConfig, world: int, degree: int | None = None) -> Sharding:
    """Each GPU's share of the states: 1/`degree` of what the strategy shards, where `degree` is the GPUs one
    replica's states are divided over (planner.parallel.dims: dp_shard, the data-parallel size over tensor,
    context and pipeline groups, and within one replica group under HSDP); None: `world` (data parallelism
    alone). Megatron's distributed optimizer (--distributed-optimizer) shards the optimizer states (its fp32
    master weights among them) over the data-parallel group: 6 + 12/DP bytes per parameter (NVIDIA/Megatron-LM
    docs/source/api-guide/dist_optimizer.md)."""
    shards = strategies.get(config.parallelism).sharding
    part = 1.0 / (degree or world)
    return Sharding(
        parameters=part if shards.parameters else 1.0,
        gradients=part if shards.gradients else 1.0,
        optimizer_states=part if shards.optimizer_states or config.distributed_optimizer else 1.0,
    )


def ddp_bucket_bytes(config: TrainConfig, gradient_bytes: int) -> int:
    """DDP's Reducer allocates flat buckets covering every gradient when the model is wrapped
    (torch/csrc/distributed/c10d/reducer.cpp `initialize_buckets`); with gradient_as_bucket_view=True the
    .grad tensors are views into them, so no second copy. ZeroRedundancyOptimizer (zero1) runs over DDP."""
    if strategies.get(config.parallelism).ddp_buckets and not config.gradient_as_bucket_view:
        return gradient_bytes
    return 0


def dataparallel_output_bytes_per_sample(model: ModelSpec, config: TrainConfig) -> int:
    """Bytes of one sample's model output that nn.DataParallel gathers onto GPU 0: the logits the head
    returns (ModelOutput.logits; LM heads seq_len × vocab, classifiers num_labels), in the matmul dtype as
    the activations model keeps them (activations.head_output_bytes): 16-bit under AMP, since autocast runs
    the head's Linear in 16 bits (checked on transformers' GPT2LMHeadModel and BertForSequenceClassification
    under CPU autocast: bf16 logits; the tracer records the same). A dense last layer (the multimodal merge):
    its out_features in that dtype; a base model: 8 bytes (ASSUMPTION, not modelled)."""
    low = BYTES_PER_DTYPE[LOW_DTYPE[config.precision]]
    last = model.components[-1].layers[-1]
    if isinstance(last, TransformerSpec):
        if last.head in ("causal-lm", "masked-lm"):
            return config.seq_len * last.vocab_size * low
        return last.num_labels * low if last.head == "sequence-classification" else 8
    return getattr(last, "out_features", 0) * low or 8


def dataparallel_replica_io_bytes(model: ModelSpec, config: TrainConfig) -> int:
    """Bytes one replica's micro-batch moves through GPU 0 under nn.DataParallel: its inputs scattered from
    GPU 0 and its outputs gathered back (torch/nn/parallel/data_parallel.py `scatter`, `gather`)."""
    return (batch_mem.batch_bytes(model, config.batch_size, config.seq_len)
            + config.batch_size * dataparallel_output_bytes_per_sample(model, config))


def dataparallel_gpu0_extra(model: ModelSpec, config: TrainConfig, gpus: int) -> int:
    """`dataparallel_gpu0_extra_bytes` of a hand-modelled model (0 unless the strategy is one process)."""
    if not strategies.get(config.parallelism).one_process:
        return 0
    return dataparallel_gpu0_extra_bytes(batch_mem.batch_bytes(model, config.batch_size, config.seq_len),
                                         config.batch_size * dataparallel_output_bytes_per_sample(model, config),
                                         gpus)


def dataparallel_gpu0_extra_bytes(replica_batch_bytes: int, replica_output_bytes: int, gpus: int) -> int:
    """nn.DataParallel's extra on GPU 0, for both front ends (the analytic model: the batch tensors and the
    head's fp32 output; the tracer: the inputs it fed and the outputs the loop keeps): the whole batch is on
    GPU 0 before `scatter` (the other replicas' micro-batches beside its own), and every replica's outputs
    are gathered back onto GPU 0 (torch/nn/parallel/data_parallel.py `scatter`, `gather`)."""
    return replica_batch_bytes * (gpus - 1) + replica_output_bytes * gpus


