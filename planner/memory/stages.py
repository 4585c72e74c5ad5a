"""What one rank of a tensor/pipeline-parallel job holds: each block's parameter shards under tensor
parallelism, the blocks of each pipeline stage, and the micro-batches whose activations a stage keeps at its
peak under each schedule (issue 34). Pure arithmetic on the model's blocks and a `ParallelDims`.

Tensor parallelism (Megatron-LM, Shoeybi et al. 2019 §3; Megatron-Core megatron/core/tensor_parallel/layers.py;
torch/distributed/tensor/parallel/style.py, the plan torchtitan applies to Llama in
torchtitan/models/llama3/infra/parallelize.py apply_tp):
- column-parallel linears (q, k, v, MLP up/gate; GPT-2's c_attn, c_fc) split the output dimension: weight and
  bias divided by tp (ColwiseParallel: Shard(0) of nn.Linear's weight);
- row-parallel linears (attention output, MLP down) split the input dimension: the weight divided by tp, the
  bias replicated (RowwiseParallel: weight Shard(1), bias Replicate; Megatron's RowParallelLinear adds the
  bias after the all-reduce);
- key/value heads: divided by tp when tp divides them; when tp is a multiple of them each rank holds one head,
  replicated tp / kv times (Megatron-Core's GQA with num_query_groups < tp; torch's plan cannot, so dims.py
  lets only Megatron's rule through and says so);
- the token embedding and the LM head are vocabulary-parallel: rows divided by tp (VocabParallelEmbedding,
  the LM head a ColumnParallelLinear; torchtitan: RowwiseParallel on tok_embeddings, ColwiseParallel on
  output). Megatron pads the vocabulary to a multiple of 128 · tp first (megatron/training/tokenizer/
  tokenizer.py _vocab_size_with_padding, --make-vocab-size-divisible-by 128); DTensor shards unevenly, the
  first ranks holding ceil(V / tp) rows (torch/distributed/tensor/placement_types.py Shard._split_tensor);
- norms, positions, token types, poolers and classifiers are replicated. Sequence parallelism does not shard
  a norm's weight either: Megatron-Core keeps LayerNorm parameters whole on each rank and only marks them
  `sequence_parallel` so their gradients are all-reduced over the TP group
  (megatron/core/transformer/transformer_layer.py, megatron/core/distributed/finalize_model_grads.py
  _allreduce_layernorm_grads), and torchtitan's SequenceParallel style shards activations only.

Pipeline parallelism (Megatron-Core megatron/core/transformer/transformer_block.py get_num_layers_to_build,
megatron/core/pipeline_parallel/schedules.py): pp · vp model chunks of layers / (pp · vp) layers each, or as
the framework splits layers that do not divide (planner.parallel.layer_split, `ParallelDims.chunks`); chunk c
runs on rank c mod pp, so rank i holds chunks i, i + pp, ... (vp of them). The embedding is on the first chunk
(rank 0), the final norm, the LM head and the loss on the last (rank pp - 1).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from planner.models.blocks import Block
from planner.models.params import block_tensor_shapes
from planner.parallel.dims import ParallelDims
from planner.parallel.layer_split import chunk_of_layer
from planner.spec import TransformerSpec

Shape = tuple[int, ...]

# Megatron pads the vocabulary to a multiple of this × tp (megatron/training/arguments.py
# --make-vocab-size-divisible-by, default 128).
MEGATRON_VOCAB_MULTIPLE = 128


def vocab_rows(vocab: int, tp: int, megatron: bool = False) -> int:
    """Rows of the token table (and LM head) one TP rank holds."""
    if megatron:
        multiple = MEGATRON_VOCAB_MULTIPLE * tp
        return -(-vocab // multiple) * multiple // tp
    return -(-vocab // tp)


def kv_heads_per_rank(kv_heads: int, tp: int) -> int:
    """Key/value heads one rank computes: kv / tp, or one replicated head when tp exceeds them."""
    return kv_heads // tp if kv_heads % tp == 0 else 1


def rank_tensor_shapes(block: Block, tp: int, *, megatron: bool = False) -> list[Shape]:
    """The parameter tensors of `block` on one tensor-parallel rank (see the module doc); tp 1: the block's own
    shapes (planner.models.params.block_tensor_shapes). A layer's are its form's parameters as the form emits
    one rank's ops (planner.families.forms.layer_parameter_shapes at `tp`; a mixture-of-experts layer's
    experts whole: planner.pipeline.step splits them over ep · etp)."""
    shapes = block_tensor_shapes(block)
    layer = block.layer
    if tp == 1 or not isinstance(layer, TransformerSpec):
        return shapes
    if block.role == "layer":  # the layer form's ops on one rank (issue 33: no per-form copy here)
        from planner.families.forms import layer_parameter_shapes

        return list(layer_parameter_shapes(layer, tp, block.index))
    if block.role in ("embeddings", "head"):  # vocabulary-sized tensors split by rows, the rest replicated
        v, rows = layer.vocab_size, vocab_rows(layer.vocab_size, tp, megatron)
        return [((rows, *s[1:]) if s and s[0] == v else s) for s in shapes]
    return shapes


def rank_parameters(block: Block, tp: int, *, megatron: bool = False) -> int:
    """Parameter elements of `block` on one tensor-parallel rank."""
    return sum(math.prod(s) for s in rank_tensor_shapes(block, tp, megatron=megatron))


def stage_of(names: Sequence[str], layer_index: dict[str, int], layers: int, dims: ParallelDims) -> list[int]:
    """The pipeline rank of each block name (in forward order; "loss" and anything after the last layer on the
    last rank, anything before the first layer on the first)."""
    chunk = chunk_of_layer(dims.chunks or (layers // (dims.pp * dims.vp),) * (dims.pp * dims.vp))
    out, seen_layer = [], False
    for name in names:
        i = layer_index.get(name)
        if i is not None:
            seen_layer = True
            out.append(chunk[i] % dims.pp)
        else:
            out.append(dims.pp - 1 if seen_layer else 0)
    return out


def in_flight(dims: ParallelDims, stage: int, micro_batches: int) -> float:
    """Micro-batches whose activations pipeline rank `stage` holds at its peak, in units of one micro-batch
    through every layer the rank holds (its vp chunks).

    - 1F1B (megatron/core/pipeline_parallel/schedules.py forward_backward_pipelining_without_interleaving:
      num_warmup_microbatches = min(pp - rank - 1, m), then one more forward before the first backward):
      min(pp - i, m).
    - interleaved 1F1B (forward_backward_pipelining_with_interleaving: warm-up of (pp - rank - 1) · 2 +
      (vp - 1) · pp chunk-micro-batches, capped at m · vp, plus the one in flight): (that + 1) / vp. On the
      first rank it is pp · (1 + (pp - 1) / (pp · vp)), the factor of megatron/training/
      theoretical_memory_usage.py compute_activation_memory ("interleaved_schedule_memory_penalty").
    - GPipe (all forwards, then all backwards: Huang et al. 2019): m.
    - zero-bubble (Qi et al. 2023, ZB-H1: "the same peak memory as 1F1B"): as 1F1B, or as interleaved with vp.
    - no pipeline: one.
    """
    p, v, m = dims.pp, dims.vp, micro_batches
    if p == 1:
        return 1.0
    if dims.schedule == "gpipe":
        return float(m)
    if v > 1:
        chunks = min((p - stage - 1) * 2 + (v - 1) * p + 1, m * v)
        return chunks / v
    return float(min(p - stage, m))


@dataclass(frozen=True)
class StageBlocks:
    """One pipeline rank: the blocks it holds and the layers among them."""

    stage: int
    blocks: tuple[str, ...]
    layers: tuple[int, ...]


def stages(names: Sequence[str], layer_index: dict[str, int], layers: int, dims: ParallelDims
           ) -> tuple[StageBlocks, ...]:
    """Every pipeline rank's blocks, in forward order."""
    where = stage_of(names, layer_index, layers, dims)
    return tuple(StageBlocks(s, tuple(n for n, w in zip(names, where, strict=True) if w == s),
                             tuple(layer_index[n] for n, w in zip(names, where, strict=True)
                                   if w == s and n in layer_index))
                 for s in range(dims.pp))
