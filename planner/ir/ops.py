"""The op vocabulary and the program: what one block of a model runs, as a list of ops.

Why: one transformer layer used to be written five times (saved tensors, kernels, parameter and FLOP
counts, parameter tensors, LoRA's regular expressions over kernel names) and the copies disagreed (issue 33).
A layer form (planner.families.forms) now emits the block's ops once; each interpreter (parameters, FLOPs,
saved memory, kernels) is a registry of rules keyed by op kind (planner.ir.interpret), in the manner of
torch/utils/flop_counter.py's `register_flop_formula`.

An op names its kind, its module path inside the block (`name`), the shapes of its inputs and outputs
(`shapes`: "input"/"output" and kind-specific entries, in elements), the parameter tensors it owns (`params`,
with the names `module.named_parameters()` gives them), the dtypes it reads, computes in and writes
(`dtypes`), and kind-specific attributes (`attrs`: the activation function, the dropout probability, which
consumer of a shared input it is, ...). What it saves for backward and its transients are the memory
interpreter's rules for its kind, given the op and the context record (planner.ir.context).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, NamedTuple

# Every op kind, with what it is. A kind added here needs a rule in every interpreter
# (tests/test_program.py fails otherwise).
OP_KINDS: dict[str, str] = {
    "linear": "x·Wᵀ + b: nn.Linear, and GPT-2's Conv1D (addmm with the weight stored transposed)",
    "embedding": "a table look-up (index_select) of one row per token; its indices are saved",
    "index": "an int64 index tensor the forward makes (position ids, gathered token types): saved, no FLOPs",
    "layer_norm": "nn.LayerNorm: saves its input and per-row mean and rstd",
    "rms_norm": "HF's Python RMSNorm (LlamaRMSNorm): x.to(fp32) · rsqrt(mean(x²) + eps), weight ·",
    "activation": "the MLP nonlinearity (attrs act: gelu, gelu_new, relu, silu, ...)",
    "gated_mul": "SwiGLU's act(gate) · up",
    "dropout": "F.dropout in training (attrs p)",
    "residual_add": "the residual stream's add (elementwise)",
    "tanh": "an elementwise tanh / ReLU in a head (attrs act)",
    "rotary": "rotary position embedding of q and k (cos and sin saved once per model)",
    "attention_mask": "building HF's 4-D mask from the 2-D one, once per forward",
    "attention_eager": "HF eager attention: q·kᵀ, scale, (+mask), softmax, dropout, ·v",
    "attention_math": "SDPA's math path (composite of bmm, softmax, dropout)",
    "attention_efficient": "SDPA's memory-efficient kernel (xformers-style, any dtype, additive bias)",
    "attention_flash": "SDPA's flash backend or FlashAttention-2 (16-bit, no bias)",
    "attention_cpu_flash": "SDPA's CPU flash kernel",
    "first_token": "hidden[:, 0]: a view whose backward writes a zero n·h gradient",
    "cross_entropy": "log_softmax + nll_loss over the logits",
    "batch_norm": "nn.BatchNorm1d on per-sample features",
    "checkpoint": "the inputs a checkpointed block keeps (torch.utils.checkpoint non-reentrant)",
    # Mixture-of-experts (issue 35; planner/families/forms/moe_gated.py, transformers' grouped_mm experts)
    "router": "an MoE router: logits = x·Wᵀ (E experts), softmax in fp32, top-k, top-k weights renormalised",
    "permute": "token-expert pairs sorted by expert and gathered (tokens·top_k rows of the hidden state)",
    "expert_gemm": "one grouped GEMM over every local expert (torch grouped_mm with per-expert offsets)",
    "unpermute": "expert outputs times their routing weights, put back in token order, summed over top-k",
    "aten": "one ATen op of a traced model (planner.program.lower): its saved storages, FLOPs and bytes as the "
            "tracer measured them",
    "scale": "x · a constant (LoRA's `lora_B(lora_A(dropout(x))) * scaling`, added to the base output)",
    # Collectives and quantisation: in the vocabulary for the transforms that emit them (parallel sharding;
    # QLoRA's dequantize, emitted by planner.ir.transforms.lora_layers).
    "all_reduce": "NCCL all-reduce", "all_gather": "NCCL all-gather", "reduce_scatter": "NCCL reduce-scatter",
    "all_to_all": "NCCL all-to-all", "send_recv": "NCCL point-to-point",
    "quantize": "to a low-bit storage (NF4; FP8 later)", "dequantize": "from a low-bit storage to 16-bit",
}


class Param(NamedTuple):
    """One parameter tensor as `module.named_parameters()` names it (tied tensors appear once, with the
    module that registers them first)."""

    name: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(slots=True)
class Op:
    """One op. Treated as immutable (a transform makes new ops); not a frozen dataclass only because the
    memory model builds a layer's ops for every new shape, and frozen initialisation is several times slower."""

    kind: str
    name: str
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    params: tuple[Param, ...] = ()
    dtypes: dict[str, str] = field(default_factory=dict)
    attrs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in OP_KINDS:
            raise ValueError(f"op {self.name!r}: unknown kind {self.kind!r}")


def weight_matmul(op: Op) -> tuple[int, int] | None:
    """(in, out) features of an op that multiplies by a weight autocast casts to 16 bits: a Linear, or an MoE
    router's F.linear(x, gate.weight) (NeMo's FakeBalancedGate has no weight); None for any other op. What the
    cast's kernels (the speed), its saved copy (the memory) and the block's matmul record read."""
    if op.kind == "linear":
        return op.shapes["input"][1], op.shapes["output"][1]
    if op.kind == "router" and op.params:
        return op.shapes["input"][1], op.shapes["logits"][1]
    return None


@dataclass(frozen=True)
class ProgramBlock:
    """One block of planner.models.blocks (same name, same order), as the ops its forward runs."""

    name: str
    role: str
    ops: tuple[Op, ...]


@dataclass(frozen=True)
class Program:
    blocks: tuple[ProgramBlock, ...]

    def block(self, name: str) -> ProgramBlock:
        return next(b for b in self.blocks if b.name == name)

    @property
    def params(self) -> list[Param]:
        return [p for b in self.blocks for op in b.ops for p in op.params]
