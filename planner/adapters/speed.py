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
  W' whole), twice (the parametrization's registration computes it once more to check it: see
  `expert_merge_kernels`); the backward computes W''s gradient (the grouped GEMM's weight gradient over the token-expert
  pairs, which a frozen expert skips) and the factors' two gradients from it (two batched GEMMs of rank r).
- A 4-bit weight (bitsandbytes gemm_4bit's dequantize + F.linear path for training-sized inputs) is
  dequantized in the forward and again in the backward: a memory-bound pass reading the packed weight and its
  constants and writing the 16-bit weight; no AMP weight cast. With double quantization each dequantization is
  three launches (issue 36, bitsandbytes 0.50.2 as installed): backends/cuda/ops.py `_dequant_linear_fallback`
  (l. 904-916: `_dequantize_blockwise_impl` of the 8-bit absmax, `absmax_dq + absmax_offset`,
  `_dequantize_4bit_impl`, then `F.linear`), which `gemm_4bit` takes on sm90 for every training shape
  (`_gemm_4bit_use_custom_cuda`: M > 512 tokens, or N·K >= 4 Mi with n_blocks < num_sms // 2 ... ; M > 1536
  always, l. 954); the backward's functional.py `dequantize_4bit` (l. 1052-1056: `dequantize_blockwise`,
  `absmax += offset`, the 4-bit kernel) likewise.
- `Linear4bit.forward` (bitsandbytes nn/modules.py l. 626-637) casts its input to the compute dtype and its
  output back to the input's dtype: under `prepare_model_for_kbit_training` (fp32 norms and embeddings) and
  autocast the input is fp32, so each 4-bit Linear adds a 16-bit -> fp32 cast of its output, and in backward
  the fp32 -> 16-bit cast of that gradient.
- Under activation checkpointing, what the checkpointed layer recomputes includes the adapters' forward and
  each 4-bit Linear's dequantization and output cast, and each adapted expert stack's merge (peft's and
  bitsandbytes' forward simply run again: ParamWrapper.forward merges W' on every call),
  up to the last op of the layer that saves a tensor (non-reentrant checkpoint's early stop,
  torch/utils/checkpoint.py `_StopRecomputationError`); which ops save one is the saved interpreter's
  (planner.memory.op_saved), the rule the memory model reads.
The adapters' and dequantizations' kernels are the LoRA program's ops (`program_kernels`, issue 33); the
frozen base's are the full-training list's, selected by what they do (`Kernel.param_work`).
"""

from __future__ import annotations

from planner.adapters.activations import base_is_low
from planner.adapters.lora import LoraPlan
from planner.ir.ops import Op
from planner.perf.kernels import Kernel, Shapes, _fold, _with, backward_of, elementwise, gemm, nbytes
from planner.spec import ModelSpec, TrainConfig

# bitsandbytes 0.50.2 dequantization of a double-quantized 4-bit weight: the 8-bit absmax's blockwise
# dequantization, the offset add, the 4-bit kernel (module docstring).
NESTED_DEQUANTIZE_LAUNCHES = 3

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
    op's pass, again in backward where a gradient flows through its Linear; a 4-bit Linear's output cast back
    to its input's dtype; under full recomputation each of these forward kernels again in the recomputed part
    of a checkpointed layer (module docstring). The adapters' fp32 weights' AMP casts are not counted (as
    `adapter_kernels` did not)."""
    from planner.adapters.activations import lora_program
    from planner.ir.interpret import apply, load_rules
    from planner.ir.transforms import recompute_of

    load_rules()
    full_recompute = recompute_of(config)[0] == "full"
    out: list[Kernel] = []
    for block in lora_program(model, config, lora, sh).blocks:
        last_saving = _last_saving(block.ops, sh) if full_recompute and block.role == "layer" else -1
        quantized = False
        feeds = None  # the op whose output the next Linear reads (not a dequantization or an adapter op)
        for i, op in enumerate(block.ops):
            fwd: list[Kernel] = []
            grad = not op.attrs.get("no_grad")
            reads, feeds = feeds, (feeds if op.kind == "dequantize" or op.attrs.get("adapter") else op)
            if op.kind == "dequantize":
                fwd = [_with(k, launches=k.launches * NESTED_DEQUANTIZE_LAUNCHES) for k in apply("kernels", op, sh)]
                bwd = [_with(k, name=f"{k.name}.backward", phase="backward") for k in fwd] if grad else []
                quantized = True
            elif op.attrs.get("adapter"):
                fwd = apply("kernels", op, sh)
                bwd = [b for k in reversed(fwd) for b in backward_of(k)]
            elif op.kind == "expert_gemm" and op.attrs.get("merged") and grad:
                merge = expert_merge_kernels(op, config.lora_r or 1)  # its forward and backward both
                out += merge
                if i <= last_saving:  # the recomputed forward merges the stack again (peft's ParamWrapper)
                    out += [_with(k, name=f"{k.name}.recompute", phase="recompute") for k in merge
                            if k.phase == "forward"]
                continue
            elif op.kind == "linear" and quantized:
                quantized = False
                fwd = _output_cast(op, sh, reads)
                bwd = [b for k in fwd for b in backward_of(k)] if grad and op.attrs.get("input_grad", True) else []
            else:
                continue
            out += fwd + bwd
            if i <= last_saving:
                out += [_with(k, name=f"{k.name}.recompute", phase="recompute") for k in fwd]
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
    # peft 0.21.2 registers the parametrization anew on every forward (tuners/lora/layer.py ParamWrapper.
    # _activate_lora, l. 2594: nn.utils.parametrize.register_parametrization), and torch's registration
    # computes it once to check its shape and dtype (torch 2.13 torch/nn/utils/parametrize.py
    # ParametrizationList.__init__, l. 237: `Z = self()` unless `unsafe`): two baddbmm per forward, the
    # first one's W' discarded (tests/test_moe_lora.py counts them on the real module).
    check = _with(merge, name=f"{op.name}.lora_merge_check")
    grad_w = _with(gemm(f"{op.name}.grad_merged_weight", n_in, n_out, rows, dtype), bytes_written=stack * e,
                   phase="backward")
    return [check, merge, grad_w] + backward_of(merge)


def _output_cast(op: Op, sh: Shapes, reads: Op | None) -> list[Kernel]:
    """`Linear4bit.forward`'s `.to(inp_dtype)`: the compute-dtype output cast back to an input of another dtype
    (fp32 under prepare_model_for_kbit_training and autocast); nothing when they agree. The gated MLP's down
    projection reads the fp32 product of the 4-bit gate and up projections (`lora_layers` keeps them fp32), so
    its input is cast to the compute dtype too, which the full-training list (a 16-bit product) lacks."""
    src = op.dtypes["input"]
    extra: list[Kernel] = []
    if reads is not None and reads.kind == "gated_mul" and reads.dtypes["output"] != src:
        src = reads.dtypes["output"]
        rows, n_in = op.shapes["input"]
        if sh.amp and src != sh.low:
            extra.append(elementwise(f"{op.name}.input_cast", rows * n_in, (src,), (sh.low,), sh.low))
    if not sh.amp or src == sh.low:
        return extra
    rows, n_out = op.shapes["output"]
    return extra + [elementwise(f"{op.name}.output_cast", rows * n_out, (sh.low,), (src,), src)]


def _last_saving(ops: tuple[Op, ...], sh: Shapes) -> int:
    """Index of the last op of a checkpointed layer that saves a tensor for backward: non-reentrant
    checkpointing stops recomputing there (torch/utils/checkpoint.py, early stop)."""
    from planner.ir.interpret import apply

    return max((i for i, op in enumerate(ops) if not op.attrs.get("no_grad") and apply("saved", op, sh)), default=-1)


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
