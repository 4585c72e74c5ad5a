"""What a LoRA step saves for backward: the model's program under the LoRA transform
(planner.ir.transforms.lora_layers), read by the saved-memory interpreter (planner.memory.op_saved).

Why a transform and not new formulas: the frozen layers run the same ops; only what autograd keeps changes.
PyTorch saves a matmul's input only to compute its weight's gradient (derivatives.yaml `mm`: `self` is
saved when `mat2` requires grad), so a frozen Linear/Conv1D without an adapter saves nothing of its own, and
a frozen norm weight drops the normalized tensor kept for the weight's gradient (RMSNorm's `weight * x`).
Measured on real peft modules (tests/test_lora_activations.py); the rules (the transform's docstring says
which op carries each):
- an input that only frozen, unadapted linears read is no longer saved;
- an adapted linear's LoRA path (peft tuners/lora/layer.py `Linear.forward`: `x = _cast_input_dtype(x, fp32)`,
  `lora_B(lora_A(dropout(x))) * scaling`) saves lora_A's input (x itself in fp32; a new fp32 copy of a 16-bit
  x; under autocast a 16-bit cast per adapter, as autocast caches only leaf casts), the dropout mask when
  p > 0 (lora_A then saves the dropout output, one per adapter), and lora_B's input (tokens × r);
- blocks before the first adapter see no tensor that requires grad and save nothing, and the first adapted
  layer's input norm saves nothing, unless the input embeddings' output requires grad
  (`enable_input_require_grads`: `prepare_model_for_kbit_training` calls it for QLoRA, transformers' Trainer
  for checkpointed PEFT models);
- a 4-bit base keeps no 16-bit weight casts: bitsandbytes dequantizes each weight into a temporary in the
  forward and again in the backward (the transform's `dequantize` ops), freed after each matmul.
Backward temporaries of the frozen layers stay those of full training (an over-estimate: no weight gradients).
"""

from __future__ import annotations

from planner import caches
from planner.adapters.lora import LoraPlan, alpha, compute_dtype
from planner.identity_cache import per_object
from planner.ir.context import Ctx
from planner.ir.ops import Program
from planner.ir.transforms import Adapters, lora_layers
from planner.memory.activations import BlockActivations, Saved, _ctx, alloc_bytes
from planner.memory.op_saved import op_saved, weight_cast
from planner.models.blocks import model_blocks
from planner.spec import ModelSpec, TrainConfig, TransformerSpec


def base_is_low(config: TrainConfig) -> bool:
    """A 16-bit base under autocast to that same dtype (--base-dtype bf16 with amp-bf16): no weight casts."""
    return config.precision.startswith("amp-") and config.base_dtype == config.precision.removeprefix("amp-")


def input_requires_grad(config: TrainConfig) -> bool:
    """Whether the embeddings' output requires grad: `enable_input_require_grads`, which only checkpointing
    calls. transformers 5.24 `_activation_checkpointing_enable` calls it for every text model; peft 0.21.2
    `PeftModel.__init__` calls it only `if getattr(model, "is_gradient_checkpointing", True)` and not for a
    quantized base; `prepare_model_for_kbit_training` (peft/utils/other.py) only under
    `use_gradient_checkpointing`. So QLoRA without checkpointing leaves the embeddings' output without a
    gradient, as LoRA does (checked on a tiny Llama on the CPU: tests/test_lora_loading.py)."""
    return config.checkpointing


def adapters_of(model: ModelSpec, config: TrainConfig, lora: LoraPlan) -> Adapters:
    """The LoRA transform's record of a run (planner.ir.transforms.Adapters) from its plan, cached per model
    and the fields it reads."""
    key = (id(lora), config.lora_dropout, config.lora_alpha, config.checkpointing, config.precision,
           config.base_dtype)
    table = per_object(_ADAPTERS, model, lambda m: {})
    hit = table.get(key)
    if hit is None or hit[0] is not lora:
        hit = table[key] = (lora, _adapters(model, config, lora))
    return hit[1]


_ADAPTERS: dict[int, dict] = caches.table("planner.adapters.activations._ADAPTERS", scope="model",
    key="ModelSpec identity (per_object) -> {(LoraPlan identity, LoRA fields): (plan, Adapters)}")


def _adapters(model: ModelSpec, config: TrainConfig, lora: LoraPlan) -> Adapters:
    from planner.adapters.targets import model_linears

    blocks = [b.name for b in model_blocks(model)]
    first = next((name for name in blocks if lora.blocks[name].adapted or lora.blocks[name].experts), None)
    return Adapters(
        r=config.lora_r or 0, dropout=config.lora_dropout, scaling=alpha(config) / (config.lora_r or 1),
        adapted=frozenset(m.name for b in lora.blocks.values() for m in b.adapted),
        quantized=frozenset(m.name for b in lora.blocks.values() for m in b.quantized),
        trained=frozenset(m.name for ms in model_linears(model).values() for m in ms if m.head),
        first=first, input_grads=input_requires_grad(config), base_low=base_is_low(config),
        dequant_bytes=4 if compute_dtype(config) == "fp32" else 2,
        experts=frozenset(w.name for b in lora.blocks.values() for w in b.experts))


def lora_program(model: ModelSpec, config: TrainConfig, lora: LoraPlan, ctx: Ctx) -> Program:
    """The program of `model` for `ctx` under the LoRA / QLoRA run `config` (planner.ir.transforms.lora_layers),
    cached per model, context and the LoRA fields."""
    from planner.families.forms import model_program

    key = (ctx, config.lora_r, config.lora_targets, config.lora_dropout, config.lora_alpha, config.base_dtype,
           config.checkpointing)
    table = per_object(_LORA_PROGRAMS, model, lambda m: {})
    hit = table.get(key)
    if hit is None:
        hit = table[key] = lora_layers(model_program(model, ctx), adapters_of(model, config, lora), ctx)
    return hit


_LORA_PROGRAMS: dict[int, dict] = caches.table("planner.adapters.activations._LORA_PROGRAMS", scope="step",
    key="ModelSpec identity (per_object) -> {(Ctx, LoRA fields): Program}")


def dequant_bytes(ops, backend: str) -> int:
    """The largest dequantization temporary of a block: the weight in the compute dtype plus the fp32 absmax
    of its blocks (bitsandbytes gemm_4bit's dequantize + F.linear path, taken for training-sized inputs; the
    backward dequantizes the weight again for the input's gradient): the block's `dequantize` ops."""
    from planner.adapters import nf4

    sizes = [op.shapes["output"][0] * op.attrs["bytes_per_element"] - (-op.shapes["output"][0] // nf4.BLOCKSIZE) * 4
             for op in ops if op.kind == "dequantize"]
    return max(sizes, default=0)


def _total(tensors: list[Saved], backend: str) -> int:
    return sum(alloc_bytes(t.nbytes, backend) for t in tensors)  # type: ignore[arg-type]


def lora_activations(model: ModelSpec, config: TrainConfig, records: tuple, lora: LoraPlan,
                     backend: str = "cuda", ctx: Ctx | None = None) -> tuple[BlockActivations, ...]:
    """The records of `activations.activation_blocks` for a LoRA run of `model`: each transformer block's
    saved tensors and weight casts are its ops' under the LoRA transform (`lora_program`); the checkpoint
    inputs, the autocast cache (none for a 4-bit or 16-bit base: nothing is cast) and the transients
    (plus the block's largest dequantized weight) are the full-training records'. `ctx`: the context record
    `records` were made for (default: `activation_blocks`' own for `config` and `backend`)."""
    if ctx is None:
        ctx = _ctx(config, backend, model.inputs.attention_mask, True)  # type: ignore[arg-type]
    from planner.families import family
    from planner.families.forms import base_prefix, block_ops
    from planner.ir.ops import ProgramBlock
    from planner.ir.transforms import lora_program_block

    adapters = adapters_of(model, config, lora)
    blocks = model_blocks(model)
    first = next((i for i, b in enumerate(blocks) if b.name == adapters.first), None) \
        if adapters.first is not None else None
    # identical layers (same spec, same adapters and 4-bit modules relative to the layer, same place relative
    # to the first adapter) save the same: transform one, copy the rest (as activation_blocks does)
    same: dict[tuple, BlockActivations] = {}
    out = []
    for i, rec in enumerate(records):
        block = blocks[i] if i < len(blocks) else None
        if block is None or not isinstance(block.layer, TransformerSpec):
            out.append(rec)  # the loss; dense and batchnorm blocks of the multimodal model: as in full training
            continue
        key = None
        if block.role == "layer":
            prefix = base_prefix(model, block, block.layer) + family(block.layer.family).layer_prefix.format(
                i=block.index)
            key = (id(block.layer), block.index == 0, i == first, first is None or i < first,
                   frozenset(m[len(prefix):] for m in adapters.adapted if m.startswith(prefix)),
                   frozenset(m[len(prefix):] for m in adapters.quantized if m.startswith(prefix)))
            hit = same.get(key)
            if hit is not None:
                out.append(hit.renamed(rec.block))
                continue
        ops = lora_program_block(ProgramBlock(block.name, block.role, tuple(block_ops(block, model, ctx))), i, first,
                                 adapters, ctx).ops
        # in forward order (as saved-tensor hooks see them): each op's saved tensors, an adapter's weight cast
        # just before its input's; the frozen base's casts are the record's weight casts, as in full training
        saved = [t for op in ops for t in (weight_cast(op, ctx) if op.attrs.get("adapter") else [])
                 + op_saved(op, ctx)]
        casts = [t for op in ops if not op.attrs.get("adapter") for t in weight_cast(op, ctx)]
        bl = lora.blocks[rec.block]
        uncast = bool(bl.quantized) or base_is_low(config)  # a 4-bit layer dequantizes; a 16-bit base is used as is
        dq = dequant_bytes(ops, ctx.backend)
        kept = rec.kept_tensors if rec.checkpointed else tuple(saved)
        out.append(BlockActivations(
            rec.block, _total(saved, ctx.backend), _total(list(kept), ctx.backend), _total(casts, ctx.backend),
            rec.forward_transient_bytes + dq, rec.backward_transient_bytes + dq, rec.checkpointed,
            rec.retained_output_bytes, 0 if uncast else rec.autocast_cache_bytes, tuple(saved), tuple(kept),
            () if uncast else rec.cache_tensors))
        if key is not None:
            same[key] = out[-1]
    return tuple(out)
