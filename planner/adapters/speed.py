"""The kernels of a LoRA / QLoRA micro-step: the full-training list (`planner.perf.kernels.training_kernels`)
with what a frozen base does not run taken out and what the adapters and a 4-bit base add put in.

- A frozen linear back-propagates only to its input: no weight-gradient GEMM (dW = Xᵀ·dY), no bias
  gradient, and under AMP no cast of a weight gradient back to fp32; frozen embeddings compute no gradient.
  A sequence-classification head trained in full (peft's SEQ_CLS modules_to_save) keeps all of them.
- Each adapter (peft lora.Linear): under AMP its input cast to 16-bit, the dropout when p > 0, lora_A
  (tokens × r × k) and lora_B (tokens × m × r) GEMMs, the scale-and-add into the base output; their backward
  (both gradients of each GEMM: the adapters train).
- Fused experts with an adapter (peft ParamWrapper, `--lora-targets ... experts`): each forward merges the
  local expert stack, W' = baddbmm(W, lhs, rhs) (one batched GEMM of rank r per expert, reading W and writing
  W' whole); the backward computes W''s gradient (the grouped GEMM's weight gradient over the token-expert
  pairs, which a frozen expert skips) and the factors' two gradients from it (two batched GEMMs of rank r).
- A 4-bit weight (bitsandbytes gemm_4bit's dequantize + F.linear path for training-sized inputs) is
  dequantized in the forward and again in the backward: a memory-bound pass reading the packed weight and its
  constants and writing the 16-bit weight; no AMP weight cast.
The adapters' and dequantizations' kernels are the LoRA program's ops (`program_kernels`, issue 33); the
frozen base's are the full-training list's, selected by what they do (`Kernel.param_work`).
"""

from __future__ import annotations

from planner.adapters.activations import base_is_low
from planner.adapters.lora import LoraPlan
from planner.perf.kernels import Kernel, Shapes, _fold, _with, backward_of, gemm, nbytes
from planner.spec import ModelSpec, TrainConfig

# What a frozen parameter does not need (planner.perf.kernels.Kernel.param_work): kernels are selected by what
# they do, not by regular expressions over their names (issue 33).
_FROZEN_GRADS = frozenset({"weight_grad", "bias_grad", "grad_cast"})
_CASTS = frozenset({"weight_cast", "bias_cast"})


def _trained_head(k: Kernel, lora: LoraPlan) -> bool:
    head = next((b for n, b in lora.blocks.items() if n.endswith(".head")), None)
    return head is not None and head.trainable > 0 and k.block_role == "head" and not head.adapted


def program_kernels(model: ModelSpec, config: TrainConfig, sh: Shapes, lora: LoraPlan) -> list[Kernel]:
    """The adapters' and the 4-bit weights' kernels, read from the LoRA run's program
    (planner.ir.transforms.lora_layers, the one the memory model reads): each adapter op's forward kernels
    (planner.perf.op_rules: lora_A's input cast under AMP and GEMM, lora_B's GEMM, the dropout, the
    scale-and-add) and their backward (the adapters train: both gradients of each GEMM); each `dequantize`
    op's pass, again in backward where a gradient flows through its Linear. The adapters' fp32 weights'
    AMP casts are not counted (as `adapter_kernels` did not)."""
    from planner.adapters.activations import lora_program
    from planner.ir.interpret import apply, load_rules

    load_rules()
    out: list[Kernel] = []
    for block in lora_program(model, config, lora, sh).blocks:
        for op in block.ops:
            if op.kind == "dequantize":
                fwd = apply("kernels", op, sh)
                out += fwd
                if not op.attrs.get("no_grad"):
                    out += [_with(k, name=f"{k.name}.backward", phase="backward") for k in fwd]
            elif op.attrs.get("adapter"):
                fwd = apply("kernels", op, sh)
                out += fwd + [b for k in reversed(fwd) for b in backward_of(k)]
            elif op.kind == "expert_gemm" and op.attrs.get("merged") and not op.attrs.get("no_grad"):
                out += expert_merge_kernels(op, config.lora_r or 1)
    return out


def expert_merge_kernels(op, r: int) -> list[Kernel]:
    """The kernels LoRA on one fused expert weight adds (see the module docstring): the forward merge (E local
    experts, each (out × r)·(r × in) added to W: reads W and the factors, writes W'), the weight gradient of
    the grouped GEMM (Xᵀ·dY over the S pairs, writing dW' whole), and the merge's backward (the factors'
    gradients, two batched GEMMs reading dW')."""
    experts, (rows, n_in), n_out = op.shapes["experts"][0], op.shapes["input"], op.shapes["output"][1]
    dtype = op.dtypes["compute"]
    e, stack = nbytes(dtype), experts * n_in * n_out
    merge = gemm(f"{op.name}.lora_merge", n_out, n_in, r, dtype, experts)
    merge = _with(merge, bytes_read=merge.bytes_read + stack * e)  # baddbmm also reads W
    grad_w = _with(gemm(f"{op.name}.grad_merged_weight", n_in, n_out, rows, dtype), bytes_written=stack * e,
                   phase="backward")
    return [merge, grad_w] + backward_of(merge)


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
    return _fold(out + program_kernels(model, config, sh, lora))
