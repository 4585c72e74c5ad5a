"""What a LoRA step saves for backward: the full-training records (`planner.memory.activations`) with the
frozen base's rules applied, and the adapters' own tensors added.

Why a transform and not new formulas: the frozen layers run the same ops; only what autograd keeps changes.
PyTorch saves a matmul's input only to compute its weight's gradient (derivatives.yaml `mm`: `self` is
saved when `mat2` requires grad), so a frozen Linear/Conv1D without an adapter saves nothing of its own, and
a frozen norm weight drops the normalized tensor kept for the weight's gradient (RMSNorm's `weight * x`).
Measured on real peft modules (tests/test_lora_activations.py); the rules:
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
  forward and again in the backward (`dequant_bytes`), freed after each matmul.
Backward temporaries of the frozen layers stay those of full training (an over-estimate: no weight gradients).
"""

from __future__ import annotations

import math
import re

from planner.adapters import nf4
from planner.adapters.lora import LoraPlan, compute_dtype
from planner.adapters.targets import LinearModule
from planner.memory.activations import (
    BOOL,
    F32,
    LOW_DTYPE,
    BlockActivations,
    Saved,
    alloc_bytes,
)
from planner.models.blocks import model_blocks
from planner.spec import ModelSpec, TrainConfig, TransformerSpec

# Saved-tensor groups that are only the input of linear modules: group name -> module name suffixes.
LINEAR_INPUTS: dict[str, dict[str, tuple[str, ...]]] = {
    "llama": {"self_attn.input": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
              "attention.context": ("self_attn.o_proj",), "mlp.input": ("mlp.gate_proj", "mlp.up_proj"),
              "mlp.product": ("mlp.down_proj",), "lm_head.input": ("lm_head",)},
    "gpt2": {"attn.c_attn.input": ("attn.c_attn",), "attention.context": ("attn.c_proj",),
             "mlp.input": ("mlp.c_fc",), "mlp.act_output": ("mlp.c_proj",), "lm_head.input": ("lm_head",)},
    "bert": {"layer.input": ("attention.self.query", "attention.self.key", "attention.self.value"),
             "attention.context": ("attention.output.dense",), "mlp.input": ("intermediate.dense",),
             "mlp.act_output": ("output.dense",), "pooler.dense": ("pooler.dense",),
             "lm.transform.dense.input": ("transform.dense", "lm_head.dense"), "lm.decoder.input": ("decoder",)},
    "distilbert": {"layer.input": ("attention.q_lin", "attention.k_lin", "attention.v_lin"),
                   "attention.context": ("attention.out_lin",), "mlp.input": ("ffn.lin1",),
                   "mlp.act_output": ("ffn.lin2",), "lm.transform.dense.input": ("vocab_transform",),
                   "lm.decoder.input": ("vocab_projector",)},
}
LINEAR_INPUTS["mistral"] = LINEAR_INPUTS["llama"]
LINEAR_INPUTS["roberta"] = LINEAR_INPUTS["bert"]
# The normalized tensor an RMSNorm saves only for its weight's gradient (`activations.rmsnorm_saved`).
WEIGHT_ONLY_SUFFIX = ".normalized"
# The norm at the start of a pre-norm layer: it sees the layer input, which needs no gradient in the first.
INPUT_NORM = {"llama": "input_layernorm.", "mistral": "input_layernorm.", "gpt2": "ln_1."}
# The group of linears that read a layer's input: in the first adapted layer their input needs no gradient.
INPUT_GROUP = {"llama": "self_attn.input", "mistral": "self_attn.input", "gpt2": "attn.c_attn.input",
               "bert": "layer.input", "roberta": "layer.input", "distilbert": "layer.input"}


def _group(name: str, groups: dict[str, tuple[str, ...]]) -> str | None:
    for g in groups:
        if name == g or name.startswith(g + ".cast") or name.startswith(g + "."):
            return g
    return None


_IN_LAYER = re.compile(r"\.(?:layer|layers|h)\.\d+\.(.+)$")


def _relative(name: str) -> str:
    """A layer's module name without the layer's own path ("model.layers.3.mlp.up_proj" -> "mlp.up_proj"), so
    that "output.dense" does not also match "attention.output.dense"."""
    hit = _IN_LAYER.search(name)
    return hit.group(1) if hit else name


def _consumers(group: str, suffixes: tuple[str, ...], modules: list[LinearModule]) -> list[LinearModule]:
    out = []
    for m in modules:
        rel = _relative(m.name)
        if any(rel == s or (rel == m.name and rel.endswith("." + s)) for s in suffixes):
            out.append(m)
    return out


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


def adapter_saved(module: LinearModule, numel: int, src: str, config: TrainConfig, backend: str,
                  tokens: int, input_grad: bool = True) -> list[Saved]:
    """What one adapted linear's LoRA path saves, for an input of `numel` elements of dtype `src`.

    lora_A saving the fp32 input itself (no dropout, no autocast) is counted once per group by the caller.
    `input_grad` False (the first adapted layer's input): no dropout mask and no lora_A weight cast, which
    only the input's gradient would need.
    """
    amp = config.precision.startswith("amp-")
    low = LOW_DTYPE[config.precision] if amp else F32
    r = config.lora_r or 0
    name = f"lora.{module.name.rsplit('.', 2)[-1]}"
    out: list[Saved] = []
    if config.lora_dropout > 0:
        if input_grad:
            out.append(Saved(f"{name}.dropout_mask", numel, BOOL if backend == "cuda" else F32))
        out.append(Saved(f"{name}.A_input", numel, low))
    elif amp or src != F32:
        out.append(Saved(f"{name}.A_input", numel, low))
    out.append(Saved(f"{name}.B_input", tokens * r, low))
    if amp:  # autocast's 16-bit casts of lora_A and lora_B weights, saved by their matmuls
        if input_grad:
            out.append(Saved(f"{name}.A_weight_cast", r * module.n_in, low))
        out.append(Saved(f"{name}.B_weight_cast", r * module.n_out, low))
    return out


def transform_block(saved: list[Saved], spec: TransformerSpec, modules: list[LinearModule],
                    adapted: list[LinearModule], config: TrainConfig, backend: str, tokens: int,
                    first_grad: bool) -> tuple[list[Saved], list[LinearModule]]:
    """One block's saved tensors under LoRA (see the module docstring), and the frozen linears whose AMP
    weight cast is not saved (they read the first adapted layer's input, which needs no gradient).
    `first_grad`: this is the first block with an adapter and its input needs no gradient."""
    groups = LINEAR_INPUTS[spec.family]
    frozen_norms = spec.norm == "rmsnorm"
    out: list[Saved] = []
    found: dict[str, list[Saved]] = {}
    norm = INPUT_NORM.get(spec.family)
    for t in saved:
        g = _group(t.name, groups)
        if g is not None:
            found.setdefault(g, []).append(t)
            continue
        if frozen_norms and t.name.endswith(WEIGHT_ONLY_SUFFIX):
            continue
        if first_grad and norm is not None and t.name.startswith(norm):
            continue
        if t.name.startswith("rotary.") and base_is_low(config):  # Llama's cos/sin come in the model's dtype
            t = Saved(t.name, t.numel, LOW_DTYPE[config.precision])
        out.append(t)
    done: set[str] = set()
    no_grad: list[LinearModule] = []
    for g, tensors in found.items():
        readers = _consumers(g, groups[g], modules)
        takers = [m for m in readers if m in adapted]
        grad = not (first_grad and g == INPUT_GROUP[spec.family])
        if not grad:
            no_grad += readers
        src = next((t.dtype for t in tensors if ".cast" not in t.name), F32)
        if takers and not config.precision.startswith("amp-") and src == F32 and config.lora_dropout == 0:
            out.append(Saved(g, tensors[0].numel, F32))  # lora_A saves x itself, one storage for all
        for m in takers:
            out += adapter_saved(m, tensors[0].numel, src, config, backend, tokens, grad)
            done.add(m.name)
    for m in adapted:  # adapted linears whose input the records do not list on its own (fused attention)
        if m.name not in done:
            out += adapter_saved(m, tokens * m.n_in, LOW_DTYPE[config.precision], config, backend, tokens)
    return out, no_grad


# The gated MLP's tensors made from the 4-bit gate/up projections' outputs (llama, mistral), saved for backward.
FOUR_BIT_MLP = {"llama": ("mlp.act.input", "mlp.up", "mlp.act_output"),
                "mistral": ("mlp.act.input", "mlp.up", "mlp.act_output")}


def four_bit_outputs(saved: list[Saved], spec: TransformerSpec, quantized: tuple, config: TrainConfig) -> list[Saved]:
    """A 4-bit linear returns its output in its INPUT's dtype (bitsandbytes 0.50.2 nn/modules.py
    `Linear4bit.forward`: `x = x.to(self.compute_dtype)` ... `return bnb.matmul_4bit(...).to(inp_dtype)`), and
    autocast does not touch it. Under AMP the MLP's input is fp32 (the residual stream starts at the fp32
    embeddings and the norm weights are fp32 after `prepare_model_for_kbit_training`), so the gate and up
    outputs, and SiLU's output made from the fp32 gate, are fp32 where full AMP training has them in 16 bits.
    The attention's q, k, v are fp32 too but SDPA saves its autocast casts, as in full training. Measured with
    saved-tensor hooks on a tiny Llama with bitsandbytes NF4 layers on the CPU (tests/test_lora_loading.py)."""
    names = FOUR_BIT_MLP.get(spec.family, ())
    if not names or not config.precision.startswith("amp-"):
        return saved
    four_bit = {m.name.rsplit(".", 1)[-1] for m in quantized}
    if not {"gate_proj", "up_proj"} <= four_bit:
        return saved
    return [Saved(t.name, t.numel, F32) if t.name in names else t for t in saved]


def dequant_bytes(modules: list[LinearModule], config: TrainConfig) -> int:
    """The largest dequantization temporary of a block: the weight in the compute dtype plus the fp32
    absmax of its blocks (bitsandbytes gemm_4bit's dequantize + F.linear path, taken for training-sized
    inputs; the backward dequantizes the weight again for the input's gradient)."""
    width = 4 if compute_dtype(config) == "fp32" else 2
    return max((m.weight_numel * width + math.ceil(m.weight_numel / nf4.BLOCKSIZE) * 4 for m in modules),
               default=0)


def _total(tensors: list[Saved], backend: str) -> int:
    return sum(alloc_bytes(t.nbytes, backend) for t in tensors)  # type: ignore[arg-type]


def lora_activations(model: ModelSpec, config: TrainConfig, records: tuple, lora: LoraPlan,
                     backend: str = "cuda") -> tuple[BlockActivations, ...]:
    """The records of `activations.activation_blocks` for a LoRA run of `model` (see the module docstring)."""
    blocks = {b.name: b for b in model_blocks(model)}
    single = len(model.components) == 1
    from planner.adapters.targets import block_linears

    first = next((i for i, b in enumerate(blocks.values()) if lora.blocks[b.name].adapted), None)
    grads_in = input_requires_grad(config)
    out = []
    for i, rec in enumerate(records):
        block = blocks.get(rec.block)
        if block is None or not isinstance(block.layer, TransformerSpec):
            out.append(rec)  # the loss; dense and batchnorm blocks of the multimodal model: as in full training
            continue
        tokens = config.batch_size * config.seq_len
        bl = lora.blocks[rec.block]
        no_grad: list[LinearModule] = []
        before = first is None or (i < first and not grads_in)
        if before:
            saved: list[Saved] = []
        elif block.role == "embeddings":
            saved = [t for t in rec.tensors if not t.dtype == "int64"] if grads_in else []
        else:
            saved, no_grad = transform_block(list(rec.tensors), block.layer, block_linears(block, single),
                                             list(bl.adapted), config, backend, tokens, i == first and not grads_in)
            saved = four_bit_outputs(saved, block.layer, bl.quantized, config)
        # no 16-bit weight copies: a 4-bit layer dequantizes instead, a base already in autocast's dtype is used
        # as it is (autocast casts only what is not)
        uncast = bool(bl.quantized) or base_is_low(config)
        low = 2 if config.precision.startswith("amp-") else 0
        unsaved_casts = sum(alloc_bytes(m.weight_numel * low, backend) for m in no_grad)  # type: ignore[arg-type]
        casts = 0 if uncast or before else rec.weight_cast_bytes - unsaved_casts
        cache = 0 if uncast else rec.autocast_cache_bytes
        dq = dequant_bytes(list(bl.quantized), config)
        kept = rec.kept_tensors if rec.checkpointed else tuple(saved)
        out.append(BlockActivations(
            rec.block, _total(saved, backend), _total(list(kept), backend), casts,
            rec.forward_transient_bytes + dq, rec.backward_transient_bytes + dq, rec.checkpointed,
            rec.retained_output_bytes, cache, tuple(saved), tuple(kept), () if uncast else rec.cache_tensors))
    return tuple(out)
