"""Which parameters of a LoRA / QLoRA run train, and how the frozen ones are stored, block by block.

What peft and transformers do, and so what is counted:
- `get_peft_model` freezes every base parameter and adds, to each targeted Linear/Conv1D of fan-in k and
  fan-out m, lora_A (r × k) and lora_B (m × r), no bias (peft tuners/lora/layer.py `update_layer`):
  r·(k + m) trainable parameters. A sequence-classification head is trained in full through peft's SEQ_CLS
  task (`modules_to_save` = classifier / score): a trainable copy beside the frozen original.
- Adapters are fp32: created in the default dtype, left so on a 4-bit base (not a float weight), and cast
  up from 16-bit by `autocast_adapter_dtype=True` (peft's default). Their gradients are fp32 too.
- The frozen base: `--base-dtype auto` stores it in the dtype the precision implies (fp32 for fp32 and AMP,
  16-bit for pure 16-bit training). fp32/bf16/fp16 store every frozen parameter in that dtype.
- nf4 (QLoRA): transformers replaces every Linear/Conv1D except the output embeddings and the module of the
  last parameter (`get_keys_to_not_convert`) by bitsandbytes' Linear4bit (storage: `nf4.weight_bytes`);
  a sequence-classification head stays unquantized too: transformers' skip key for a biased head is
  "classifier.bias", which matches no module, and peft's SEQ_CLS cannot train a 4-bit head, so QLoRA
  classification recipes pass llm_int8_skip_modules=["classifier"] (or "score");
  `prepare_model_for_kbit_training` then casts every other 16-bit parameter (embeddings, norms, biases, the
  head) to fp32.
Gradients and optimizer states exist only for the trainable parameters (`shapes`).
tests/test_lora.py builds the real modules (meta device; bitsandbytes on the CPU) and compares.
"""

from __future__ import annotations

from dataclasses import dataclass

from planner import caches
from planner.adapters import nf4
from planner.adapters.targets import (
    ExpertWeight,
    LinearModule,
    adapted,
    adapted_experts,
    default_targets,
    is_expert_target,
    model_linears,
)
from planner.errors import PlannerError
from planner.identity_cache import per_object
from planner.models.blocks import model_blocks
from planner.models.params import block_parameters
from planner.spec import ModelSpec, TrainConfig

Shape = tuple[int, ...]
ADAPTER_BYTES = 4  # fp32 adapters (peft autocast_adapter_dtype=True)
DEFAULT_ALPHA = 8.0  # peft LoraConfig.lora_alpha default
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def base_dtype(config: TrainConfig) -> str:
    """The frozen base's storage: the given one, or what the precision implies (transformers loads the model
    in the dtype the training precision wants: fp32 for fp32 and AMP, the 16-bit type for pure 16-bit)."""
    if config.base_dtype != "auto":
        return config.base_dtype
    return config.precision if config.precision in ("bf16", "fp16") else "fp32"


def compute_dtype(config: TrainConfig) -> str:
    """The dtype a 4-bit layer dequantizes to and multiplies in (bnb_4bit_compute_dtype): the precision's
    16-bit type; fp32 for fp32 training."""
    return {"amp-bf16": "bf16", "bf16": "bf16", "amp-fp16": "fp16", "fp16": "fp16"}.get(config.precision, "fp32")


def alpha(config: TrainConfig) -> float:
    return DEFAULT_ALPHA if config.lora_alpha is None else config.lora_alpha


@dataclass(frozen=True)
class BlockLora:
    """One block of a LoRA run: counts, device bytes of its parameters and gradients, trainable shapes."""

    trainable: int
    frozen: int
    param_bytes: int
    grad_bytes: int
    shapes: tuple[Shape, ...]  # trainable tensors, in registration order (what the optimizer keeps states for)
    adapted: tuple[LinearModule, ...]
    quantized: tuple[LinearModule, ...]
    experts: tuple[ExpertWeight, ...] = ()  # fused expert weights with an adapter (peft target_parameters)
    expert_shapes: tuple[Shape, ...] = ()  # their adapters' shapes (lora_A, lora_B of each), also in `shapes`


@dataclass(frozen=True)
class LoraPlan:
    blocks: dict[str, BlockLora]
    targets: tuple[str, ...]
    base_dtype: str

    @property
    def trainable(self) -> int:
        return sum(b.trainable for b in self.blocks.values())

    @property
    def frozen(self) -> int:
        return sum(b.frozen for b in self.blocks.values())

    @property
    def shapes(self) -> tuple[Shape, ...]:
        return tuple(s for b in self.blocks.values() for s in b.shapes)

    @property
    def adapted_modules(self) -> int:
        return sum(len(b.adapted) for b in self.blocks.values())

    @property
    def adapted_experts(self) -> int:
        return sum(len(b.experts) for b in self.blocks.values())

    def shapes_split(self, ep_etp: int) -> tuple[list[Shape], list[Shape]]:
        """(the adapters' shapes outside the experts, one rank's expert adapters' shapes) under expert
        parallelism over `ep_etp` ranks: a rank adapts only the experts it holds (ParamWrapper reads the
        local (E / ep, ·, ·) stack), so its lora_A / lora_B are r · E / ep wide."""
        dense: list[Shape] = []
        local: list[Shape] = []
        for b in self.blocks.values():
            k, n = 2 * len(b.adapted), len(b.expert_shapes)  # `shapes`: Linear adapters, experts', head's
            dense += list(b.shapes[:k]) + list(b.shapes[k + n:])
            for a, bb in zip(b.expert_shapes[::2], b.expert_shapes[1::2], strict=True):
                rows = a[0] // ep_etp
                local += [(rows, a[1]), (bb[0], rows)]
        return dense, local


def expert_bytes(block: BlockLora, experts: int, base: str) -> tuple[int, int, int, int]:
    """(parameter bytes, gradient bytes, parameters, trainable) of one block's routed experts under LoRA:
    `experts` frozen expert parameters in the base's storage (fp32 on a 4-bit base: not nn.Linear, so never
    quantized, and cast up by prepare_model_for_kbit_training) and their fp32 adapters."""
    frozen_bytes = 4 if base == "nf4" else DTYPE_BYTES[base]
    adapters = sum(_numel(s) for s in block.expert_shapes)
    return experts * frozen_bytes + adapters * ADAPTER_BYTES, adapters * ADAPTER_BYTES, experts + adapters, adapters


def check(config: TrainConfig) -> None:
    """What peft accepts, as one-line errors naming the flag (pydantic checks the ranges)."""
    if not config.lora:
        for flag, value, unset in (("--lora-alpha", config.lora_alpha, None), ("--lora-targets", config.lora_targets,
                                   ()), ("--lora-dropout", config.lora_dropout, 0.0),
                                   ("--base-dtype", config.base_dtype, "auto")):
            if value != unset:
                raise PlannerError(flag, value, "only with adapters: give --lora-r too")
        return
    if config.lora_alpha is not None and config.lora_alpha <= 0:
        raise PlannerError("--lora-alpha", config.lora_alpha, "a number > 0")
    if config.base_dtype == "fp32" and config.precision in ("bf16", "fp16"):
        raise PlannerError("--base-dtype", "fp32", f"a 16-bit base with --precision {config.precision}")
    if config.base_dtype == "nf4" and config.precision in ("bf16", "fp16"):
        raise PlannerError("--base-dtype", "nf4", f"--precision amp-{config.precision} or fp32 (QLoRA trains under "
                           "autocast: prepare_model_for_kbit_training leaves norms, embeddings and the head fp32)")
    if config.base_dtype in ("bf16", "fp16") and config.precision == "fp32":
        raise PlannerError("--base-dtype", config.base_dtype, "fp32 or nf4 with --precision fp32 (or use AMP)")
    if config.lora_dropout and any(is_expert_target(t) for t in config.lora_targets):
        raise PlannerError("--lora-dropout", config.lora_dropout, "0 with experts in --lora-targets (peft 0.21's "
                           "ParamWrapper, which adapts fused experts, has no dropout)")


def _block(block, modules: list[LinearModule], targets: list[LinearModule], r: int, dtype: str,
           frozen_bytes: int, experts: list[ExpertWeight] | None = None) -> BlockLora:
    """One block's counts and bytes. Fused expert weights are not nn.Linear: bitsandbytes leaves them in the
    load dtype, so on a 4-bit base `prepare_model_for_kbit_training` casts them to fp32 with every other
    16-bit parameter (peft utils/other.py: `param.data.to(torch.float32)` unless Params4bit); their adapters
    (peft ParamWrapper.update_layer) are lora_A (r·E, in) and lora_B (out, r·E)."""
    own = block_parameters(block)
    quantized = [m for m in modules if dtype == "nf4" and not m.output and not m.last and not m.head]
    head = [m for m in modules if m.head]
    experts = experts or []
    shapes: list[Shape] = []
    for m in targets:
        shapes += [(r, m.n_in), (m.n_out, r)]
    expert_shapes: list[Shape] = []
    for w in experts:
        expert_shapes += [(r * w.experts, w.n_in), (w.n_out, r * w.experts)]
    shapes += expert_shapes
    for m in head:  # the SEQ_CLS head's trainable copy (modules_to_save)
        shapes += [(m.n_out, m.n_in)] + ([(m.n_out,)] if m.bias else [])
    trainable = sum(_numel(s) for s in shapes)
    frozen = own  # every base parameter, the SEQ_CLS head's original included
    q_weights = sum(m.weight_numel for m in quantized)
    stored = sum(nf4.weight_bytes(m.weight_numel) for m in quantized)
    param_bytes = (frozen - q_weights) * frozen_bytes + stored + trainable * ADAPTER_BYTES
    return BlockLora(trainable, frozen, param_bytes, trainable * ADAPTER_BYTES, tuple(shapes), tuple(targets),
                     tuple(quantized), tuple(experts), tuple(expert_shapes))


def _numel(shape: Shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def plan(model: ModelSpec, config: TrainConfig) -> LoraPlan:
    """The LoRA plan of `model` under `config` (which must have `lora_r`), cached per model and LoRA fields."""
    key = (config.lora_r, config.lora_targets, base_dtype(config))
    plans: dict[tuple, LoraPlan] = per_object(_PLANS, model, lambda m: {})
    hit = plans.get(key)
    if hit is None:
        hit = plans[key] = _plan(model, config)
    return hit


_PLANS: dict[int, tuple] = caches.table("planner.adapters.lora._PLANS", scope="model",
    key="ModelSpec identity (per_object): {LoRA fields: LoraPlan}")  # ModelSpec -> {LoRA fields: LoraPlan} (`per_object`)


def _plan(model: ModelSpec, config: TrainConfig) -> LoraPlan:
    assert config.lora_r is not None
    targets = config.lora_targets or default_targets(model)
    chosen = adapted(model, targets)
    experts = adapted_experts(model, targets)
    linears = model_linears(model)
    dtype = base_dtype(config)
    # nf4: prepare_model_for_kbit_training casts what is not 4-bit to fp32; otherwise the base dtype.
    frozen_bytes = 4 if dtype == "nf4" else DTYPE_BYTES[dtype]
    blocks = {b.name: _block(b, linears[b.name], chosen[b.name], config.lora_r, dtype, frozen_bytes,
                             experts[b.name]) for b in model_blocks(model)}
    return LoraPlan(blocks, targets, dtype)


def lora_counts(model: ModelSpec, lora: LoraPlan) -> dict[str, int]:
    """`Estimate.parameters` of a LoRA run: each component's parameters (base + adapters), then "total",
    "trainable" and "frozen" (total = trainable + frozen, as peft's `get_nb_trainable_parameters` counts)."""
    out: dict[str, int] = {c.name: 0 for c in model.components}
    for block in model_blocks(model):
        b = lora.blocks[block.name]
        out[block.component] += b.trainable + b.frozen
    return out | {"total": lora.trainable + lora.frozen, "trainable": lora.trainable, "frozen": lora.frozen}


def describe(lora: LoraPlan, config: TrainConfig) -> str:
    """One line for the notes: rank, targets, how many adapters, the base's storage."""
    base = {"nf4": "4-bit NF4 (bitsandbytes, double quantization)", "fp32": "fp32", "bf16": "bf16",
            "fp16": "fp16"}[lora.base_dtype]
    experts = f" and {lora.adapted_experts} fused expert weights" if lora.adapted_experts else ""
    return (f"LoRA r={config.lora_r}, alpha={alpha(config):g}, dropout={config.lora_dropout:g} on "
            f"{lora.adapted_modules} modules{experts} ({','.join(lora.targets)}); trainable {lora.trainable:,} of "
            f"{lora.trainable + lora.frozen:,}; frozen base stored {base}, adapters fp32")


def op_parameter_bytes(op, adapters, config: TrainConfig) -> int:
    """Device bytes of the parameters one op of a LoRA program owns (planner.ir.transforms.lora_layers),
    stored as `_block` stores them: adapters fp32; a 4-bit weight in bitsandbytes' NF4 storages; a module
    trained in full (SEQ_CLS head) twice, the frozen original and its fp32 trainable copy; every other
    parameter in the frozen base's dtype (fp32 for what a 4-bit base keeps unquantized)."""
    from planner.ir.transforms import module_of

    dtype = base_dtype(config)
    frozen_bytes = 4 if dtype == "nf4" else DTYPE_BYTES[dtype]
    if op.attrs.get("adapter"):
        return sum(p.numel for p in op.params) * ADAPTER_BYTES
    if op.kind == "expert_gemm":  # fused experts: frozen in the base's storage, their adapters (if any) fp32
        return sum(p.numel * (ADAPTER_BYTES if ".lora_" in p.name else frozen_bytes) for p in op.params)
    module = module_of(op) if op.kind == "linear" else None
    total = 0
    for p in op.params:
        if module in adapters.quantized and p.name.endswith(".weight") and p.name.startswith(f"{module}."):
            total += nf4.weight_bytes(p.numel)
        else:
            total += p.numel * (frozen_bytes + (ADAPTER_BYTES if module in adapters.trained else 0))
    return total
