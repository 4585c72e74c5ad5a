"""The kernels of a LoRA / QLoRA micro-step: the full-training list (`planner.perf.kernels.training_kernels`)
with what a frozen base does not run taken out and what the adapters and a 4-bit base add put in.

- A frozen linear back-propagates only to its input: no weight-gradient GEMM (dW = Xᵀ·dY), no bias
  gradient, and under AMP no cast of a weight gradient back to fp32; frozen embeddings compute no gradient.
  A sequence-classification head trained in full (peft's SEQ_CLS modules_to_save) keeps all of them.
- Each adapter (peft lora.Linear): under AMP its input cast to 16-bit, the dropout when p > 0, lora_A
  (tokens × r × k) and lora_B (tokens × m × r) GEMMs, the scale-and-add into the base output; their backward
  (both gradients of each GEMM: the adapters train).
- A 4-bit weight (bitsandbytes gemm_4bit's dequantize + F.linear path for training-sized inputs) is
  dequantized in the forward and again in the backward: a memory-bound pass reading the packed weight and its
  constants and writing the 16-bit weight; no AMP weight cast.
"""

from __future__ import annotations

from planner.adapters import nf4
from planner.adapters.activations import base_is_low
from planner.adapters.lora import LoraPlan
from planner.adapters.targets import LinearModule
from planner.models.blocks import model_blocks
from planner.perf.kernels import F32, Kernel, Shapes, _fold, _with, backward_of, elementwise, gemm
from planner.spec import ModelSpec, TrainConfig

# What a frozen parameter does not need (planner.perf.kernels.Kernel.param_work): kernels are selected by what
# they do, not by regular expressions over their names (issue 33).
_FROZEN_GRADS = frozenset({"weight_grad", "bias_grad", "grad_cast"})
_CASTS = frozenset({"weight_cast", "bias_cast"})


def _trained_head(k: Kernel, lora: LoraPlan) -> bool:
    head = next((b for n, b in lora.blocks.items() if n.endswith(".head")), None)
    return head is not None and head.trainable > 0 and k.block_role == "head" and not head.adapted


def adapter_kernels(m: LinearModule, sh: Shapes, config: TrainConfig) -> list[Kernel]:
    """Forward and backward kernels of one LoRA adapter on `sh.n` rows."""
    r, rows, low = config.lora_r or 0, sh.n, sh.low
    name = f"lora.{m.name.rsplit('.', 1)[-1]}"
    fwd: list[Kernel] = []
    if sh.amp:
        fwd.append(elementwise(f"{name}.input_cast", rows * m.n_in, (F32,), (low,), low))
    if config.lora_dropout > 0:
        fwd.append(elementwise(f"{name}.dropout", rows * m.n_in, (F32,), (F32, "bool"), F32))
    fwd += [gemm(f"{name}.A", rows, r, m.n_in, low), gemm(f"{name}.B", rows, m.n_out, r, low),
            elementwise(f"{name}.scale_add", rows * m.n_out, (low, low), (low,), low)]
    return fwd + [b for k in reversed(fwd) for b in backward_of(k)]


def dequant_kernels(m: LinearModule, sh: Shapes) -> list[Kernel]:
    """bitsandbytes' dequantization of one 4-bit weight, forward and backward."""
    out_bytes = m.weight_numel * (2 if sh.low != F32 else 4)
    k = Kernel(f"nf4.{m.name.rsplit('.', 1)[-1]}.dequantize", "memory_bound", 0, nf4.weight_bytes(m.weight_numel),
               out_bytes, sh.low)
    return [k, _with(k, name=f"{k.name}.backward", phase="backward")]


def lora_kernels(model: ModelSpec, config: TrainConfig, kernels: list[Kernel], sh: Shapes,
                 lora: LoraPlan) -> list[Kernel]:
    """`kernels` (one micro-step of full training, folded) as the LoRA run of `lora` runs them."""
    out = []
    for k in kernels:
        if (k.param_work in _FROZEN_GRADS and not _trained_head(k, lora)) or k.param_work == "table_grad":
            continue
        if lora.base_dtype == "nf4" and k.param_work == "weight_cast" and k.block_role == "layer":
            continue
        if base_is_low(config) and k.param_work in _CASTS:
            continue
        out.append(k)
    for block in model_blocks(model):
        b = lora.blocks[block.name]
        for m in b.adapted:
            out += adapter_kernels(m, sh, config)
        for m in b.quantized:
            out += dequant_kernels(m, sh)
    return _fold(out)
