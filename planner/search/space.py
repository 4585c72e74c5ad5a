"""The search space: which values of each TrainConfig field a search may try.

A `SpaceSpec` is what the user asked for (a sweep file's `space:` or the `--batch-sizes ...` flags); a
field left out means "the default". `resolve_space` turns it into a concrete `SearchSpace` for one
model and one instance: defaults the hardware or the model cannot run (bf16 on a V100, FlashAttention on
a T4, sequences longer than the model's positions) are dropped there, so a search does not spend
thousands of trials learning what is known up front. Values the user asked for explicitly are kept, and
the objective records them as infeasible with the reason.

Each dimension is named after the TrainConfig field it sets (`batch_size`, `seq_len`, ...); a dimension
with one value is fixed, not searched.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, field_validator

from planner.errors import PlannerError
from planner.memory.loops import DEFAULT_LOOP, LOAD_NAMES, LOOP_NAMES
from planner.parallel import known
from planner.search.limits import MAX_GRAD_ACCUM, MAX_SEARCH_INSTANCES, MAX_SPACE_VALUE
from planner.spec import (
    ATTENTIONS,
    BASE_DTYPES,
    FRAMEWORKS,
    OPTIMIZER_IMPLS,
    OPTIMIZERS,
    PARALLELISMS,
    PRECISIONS,
    Attention,
    BaseDtype,
    Framework,
    Instance,
    Load,
    Loop,
    ModelSpec,
    OptimizerImpl,
    OptimizerName,
    Parallelism,
    Precision,
    TrainConfig,
)

# Dimension name (a TrainConfig field, or `instance` for the instance type) -> SpaceSpec field that lists
# its values. One study searches all of them jointly (planner/search/study.py says why).
DIMENSIONS: dict[str, str] = {
    "instance": "instance_types",
    "instances": "instance_counts",
    "batch_size": "batch_sizes",
    "seq_len": "seq_lens",
    "precision": "precisions",
    "checkpointing": "checkpointing",
    "grad_accum": "grad_accums",
    "optimizer": "optimizers",
    "optimizer_impl": "optimizer_impls",
    "attention": "attentions",
    "parallelism": "parallelisms",
    # LoRA / QLoRA (planner.adapters), searched where a sweep lists several; a target set is one string,
    # "q_proj,v_proj" or "all-linear" ("" = peft's default for the model type)
    "lora_r": "lora_ranks",
    "lora_targets": "lora_target_sets",
    "base_dtype": "base_dtypes",
    # the training loop and load path (planner.memory.loops): the user's, one value unless a sweep lists several
    "loop": "loops",
    "load": "loads",
    # whose layouts apply (planner.parallel.frameworks); a strategy a framework lacks is an infeasible point
    "framework": "frameworks",
    # tensor, pipeline and context parallel degrees (issue 34): searched by default only for a model too big
    # for data parallelism (MODEL_PARALLEL_MIN_PARAMS), over valid factorizations (`model_parallel_defaults`);
    # a point whose degrees do not divide the job is pruned before the objective (SearchSpace.point)
    "tp": "tp_sizes",
    "pp": "pp_sizes",
    "cp": "cp_sizes",
}
# Flag of each SpaceSpec field, so an error names what the user typed.
FLAGS: dict[str, str] = {field: "--" + field.replace("_", "-") for field in DIMENSIONS.values()}
FLAGS["instance_types"] = "--instance"
FLAGS["loops"], FLAGS["loads"] = "--loop", "--load"

# Defaults. Powers of two up to 512 cover the micro-batches of a BERT-size model on 16-80 GB GPUs up to
# past the memory edge (so the edge lies inside the space); with a recipe's global batch only those that
# can reach it (<= the global batch) are kept. 128-512 are BERT's usual lengths. Every data-parallel
# strategy is tried (on one GPU they all collapse to `single`); instance counts default to one instance,
# so the price is one instance's unless a sweep asks (`space.instance_counts`, `--max-instances`).
DEFAULTS: dict[str, tuple[Any, ...]] = {
    "instance_counts": (1,),
    "batch_sizes": (1, 2, 4, 8, 16, 32, 64, 128, 256, 512),
    "seq_lens": (128, 256, 512),
    "precisions": ("fp32", "amp-fp16", "amp-bf16"),  # pure fp16/bf16 (no fp32 master) only when asked
    "checkpointing": (False, True),
    "grad_accums": (1, 2, 4, 8),  # searched only when the recipe gives no global batch
    "optimizers": ("adamw",),
    "optimizer_impls": ("foreach", "fused"),
    "attentions": ("sdpa", "flash"),
    "parallelisms": ("ddp", "zero1", "zero2", "zero3", "fsdp", "dp"),
    "lora_ranks": (None,),  # full fine-tuning unless a sweep asks for adapters
    "lora_target_sets": ("",),
    "base_dtypes": ("auto",),
    "loops": (DEFAULT_LOOP,),
    "loads": ("direct",),
    "frameworks": ("pytorch",),
    "tp_sizes": (1,),  # widened by `model_parallel_defaults` for a model above MODEL_PARALLEL_MIN_PARAMS
    "pp_sizes": (1,),
    "cp_sizes": (1,),  # context parallelism only when a sweep asks: it pays off at long sequences only
}
# From this many parameters a search tries tensor and pipeline parallelism by default: the planner's data-
# parallel model covers models up to ~8B (issue 34), and from 13B on the jobs run with TP/PP (Megatron-Core,
# NeMo, SageMaker HyperPod recipes), so below it the default search keeps its space (and its speed).
MODEL_PARALLEL_MIN_PARAMS = 10e9
# Pipeline degrees searched by default: divisors of the layer count up to this (Megatron's published
# layouts use PP <= 16 up to 462B: the README's weak-scaling table, results/public/megatron/).
MAX_DEFAULT_PP = 16
# The LoRA dimensions' values when a sweep asks for no adapters (TrainConfig's defaults).
LORA_UNSET: dict[str, Any] = {"lora_r": None, "lora_targets": "", "base_dtype": "auto"}
# Dimensions not reported as constants at these values: no adapters, and the default loop and load.
QUIET_DEFAULTS: dict[str, Any] = {**LORA_UNSET, "framework": "pytorch", "loop": DEFAULT_LOOP, "load": "direct",
                                  "tp": 1, "pp": 1, "cp": 1}
# Numeric dimensions, sampled as an index into their sorted values (see SearchSpace.parameters).
ORDINAL: tuple[str, ...] = ("instances", "batch_size", "seq_len", "grad_accum", "tp", "pp", "cp")
INDEX_SUFFIX = "_index"
# TrainConfig fields a sweep may fix besides the dimensions (e.g. gradient_as_bucket_view: true).
FIXABLE: tuple[str, ...] = tuple(f for f in TrainConfig.model_fields if f not in DIMENSIONS)
# `fixed.instances` (and `--instances N`) stays accepted: it fixes the instance-count dimension.
FIXED_DIMENSIONS: tuple[str, ...] = ("instances", "lora_r", "lora_targets", "base_dtype", "framework", "loop",
                                     "load", "tp", "pp", "cp")


def _unique(values: tuple[Any, ...]) -> tuple[Any, ...]:
    if not values:
        raise ValueError("at least one value")
    return tuple(dict.fromkeys(values))


class SpaceSpec(BaseModel):
    """The values asked for; None = the default for the model and instance types. Whole numbers are strict:
    `lora_ranks: [true]` is no rank (pydantic's lax mode reads true as 1)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    instance_counts: tuple[Annotated[int, Field(strict=True, ge=1, le=MAX_SEARCH_INSTANCES)], ...] | None = None
    batch_sizes: tuple[Annotated[int, Field(strict=True, ge=1, le=MAX_SPACE_VALUE)], ...] | None = None
    seq_lens: tuple[Annotated[int, Field(strict=True, ge=1, le=MAX_SPACE_VALUE)], ...] | None = None
    precisions: tuple[Precision, ...] | None = None
    checkpointing: tuple[Annotated[bool, Field(strict=True)], ...] | None = None  # not 0/1 or "yes"
    grad_accums: tuple[Annotated[int, Field(strict=True, ge=1, le=MAX_GRAD_ACCUM)], ...] | None = None
    optimizers: tuple[OptimizerName, ...] | None = None
    optimizer_impls: tuple[OptimizerImpl, ...] | None = None
    attentions: tuple[Attention, ...] | None = None
    parallelisms: tuple[Parallelism, ...] | None = None
    lora_ranks: tuple[Annotated[int, Field(strict=True, ge=1, le=MAX_SPACE_VALUE)] | None, ...] | None = None
    lora_target_sets: tuple[str, ...] | None = None
    base_dtypes: tuple[BaseDtype, ...] | None = None
    loops: tuple[Loop, ...] | None = None
    loads: tuple[Load, ...] | None = None
    frameworks: tuple[Framework, ...] | None = None
    tp_sizes: tuple[Annotated[int, Field(strict=True, ge=1, le=MAX_SPACE_VALUE)], ...] | None = None
    pp_sizes: tuple[Annotated[int, Field(strict=True, ge=1, le=MAX_SPACE_VALUE)], ...] | None = None
    cp_sizes: tuple[Annotated[int, Field(strict=True, ge=1, le=MAX_SPACE_VALUE)], ...] | None = None

    @field_validator("*")
    @classmethod
    def _non_empty(cls, v: tuple[Any, ...] | None) -> tuple[Any, ...] | None:
        return None if v is None else _unique(v)

    def explicit(self) -> set[str]:
        return {name for name in type(self).model_fields if getattr(self, name) is not None}

    def merged(self, override: SpaceSpec) -> SpaceSpec:
        """This spec with the fields `override` sets replaced (flags over a sweep file)."""
        return self.model_copy(update={k: getattr(override, k) for k in override.explicit()})


@dataclass(frozen=True)
class Point:
    """One point of the joint space: the instance type and its TrainConfig, or why it has none."""

    instance: str
    config: TrainConfig | None
    reason: str = ""
    values: tuple[tuple[str, Any], ...] = ()  # the point's dimension values (what a config-less point records)


class SearchSpace(BaseModel):
    """A concrete joint space: instance types × every TrainConfig dimension, each with >= 1 value.

    With `global_batch_size` set (the recipe's), gradient accumulation is not a dimension: it is derived,
    grad_accum = global batch / (micro-batch × GPUs per instance × instances), and a point where that is
    not a whole number has no config (`Point.reason` says why)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    instance_types: tuple[str, ...]
    gpus: dict[str, int]  # GPUs per instance of each type
    instance_counts: tuple[PositiveInt, ...]
    batch_sizes: tuple[PositiveInt, ...]
    seq_lens: tuple[PositiveInt, ...]
    precisions: tuple[Precision, ...]
    checkpointing: tuple[bool, ...]
    grad_accums: tuple[PositiveInt, ...]
    optimizers: tuple[OptimizerName, ...]
    optimizer_impls: tuple[OptimizerImpl, ...]
    attentions: tuple[Attention, ...]
    parallelisms: tuple[Parallelism, ...]
    lora_ranks: tuple[PositiveInt | None, ...] = (None,)
    lora_target_sets: tuple[str, ...] = ("",)
    base_dtypes: tuple[BaseDtype, ...] = ("auto",)
    loops: tuple[Loop, ...] = (DEFAULT_LOOP,)
    loads: tuple[Load, ...] = ("direct",)
    frameworks: tuple[Framework, ...] = ("pytorch",)
    tp_sizes: tuple[PositiveInt, ...] = (1,)
    pp_sizes: tuple[PositiveInt, ...] = (1,)
    cp_sizes: tuple[PositiveInt, ...] = (1,)
    # the model's sizes the parallel degrees must divide (layers, heads, kv_heads); empty: none known
    model_sizes: dict[str, int] = Field(default_factory=dict)
    global_batch_size: PositiveInt | None = None
    fixed: dict[str, Any] = Field(default_factory=dict)  # other TrainConfig fields
    dropped: dict[str, tuple[Any, ...]] = Field(default_factory=dict)  # defaults left out, per field

    def values(self) -> dict[str, tuple[Any, ...]]:
        """Dimension name -> its values, searched or not (grad_accum is absent when derived)."""
        out = {dim: getattr(self, field) for dim, field in DIMENSIONS.items()}
        if self.global_batch_size is not None:
            del out["grad_accum"]
        return out

    def searched(self) -> dict[str, tuple[Any, ...]]:
        """The dimensions with more than one value: what the sampler chooses."""
        return {dim: vals for dim, vals in self.values().items() if len(vals) > 1}

    def parameters(self) -> dict[str, tuple[Any, ...]]:
        """Optuna parameter name -> its choices. Numeric dimensions are sampled as the index into their
        sorted values (`batch_size_index`), an ordered integer, so TPE can learn "larger batches run
        faster until memory runs out" instead of treating 64 and 128 as unrelated categories
        (benchmarks/search_benchmark.py: reaches the grid optimum in fewer trials, on every seed)."""
        out: dict[str, tuple[Any, ...]] = {}
        for dim, vals in self.searched().items():
            if dim in ORDINAL:
                out[f"{dim}{INDEX_SUFFIX}"] = tuple(range(len(vals)))
            else:
                out[dim] = vals
        return out

    def decode(self, params: dict[str, Any]) -> dict[str, Any]:
        """Sampled parameters -> dimension values (an index becomes the value it points at)."""
        out: dict[str, Any] = {}
        values = self.values()
        for name, value in params.items():
            if name.endswith(INDEX_SUFFIX):
                dim = name[: -len(INDEX_SUFFIX)]
                out[dim] = values[dim][value]
            else:
                out[name] = value
        return out

    def constants(self) -> dict[str, Any]:
        """Dimensions with one value plus the fixed TrainConfig fields."""
        out = {dim: vals[0] for dim, vals in self.values().items() if len(vals) == 1
               and not (dim in QUIET_DEFAULTS and vals[0] == QUIET_DEFAULTS[dim])}  # nothing to report
        return {**out, **self.fixed}

    @property
    def size(self) -> int:
        return math.prod(len(v) for v in self.values().values())

    def point(self, values: dict[str, Any]) -> Point:
        """The instance type and TrainConfig of one point: dimension values over the constants.

        On one GPU every data-parallel strategy is plain training, so it becomes `single` (one cached
        estimate instead of six)."""
        merged = {**self.constants(), **values}
        instance = merged.pop("instance")
        if isinstance(merged.get("lora_targets"), str):  # one searched target set, "q_proj,v_proj"
            merged["lora_targets"] = tuple(t for t in merged["lora_targets"].split(",") if t)
        gpus = self.gpus[instance] * merged.get("instances", 1)
        if gpus == 1 and merged.get("parallelism") in PARALLELISMS:
            merged["parallelism"] = "single"

        strategy = known(merged.get("parallelism", "auto"))  # None for auto: every GPU
        if strategy is not None:  # the GPUs that train: one for `single` on a 4-GPU instance, not four
            gpus = strategy.world_size(self.gpus[instance], merged.get("instances", 1))
        split = merged.get("tp", 1) * merged.get("pp", 1) * merged.get("cp", 1)
        if split > 1:
            reason = self._layout_reason(instance, merged, gpus, strategy)
            if reason:
                return Point(instance, None, reason, tuple(sorted(merged.items(), key=lambda kv: kv[0])))
            gpus //= split  # the data-parallel replicas: each micro-batch spreads over tp x pp x cp GPUs
        if self.global_batch_size is not None:
            per_step = merged["batch_size"] * gpus
            accum, rest = divmod(self.global_batch_size, per_step)
            if rest or not accum:
                reason = (f"global batch {self.global_batch_size} is not a whole number of steps of micro-batch "
                          f"{merged['batch_size']} × {gpus} GPU{'s' if gpus > 1 else ''} = {per_step} samples")
                return Point(instance, None, reason, tuple(sorted(merged.items(), key=lambda kv: kv[0])))
            if accum > MAX_GRAD_ACCUM:  # the estimate's own limit: this micro-batch cannot reach the global batch
                reason = (f"global batch {self.global_batch_size} needs {accum:,} micro-steps of micro-batch "
                          f"{merged['batch_size']} × {gpus} GPU{'s' if gpus > 1 else ''}; at most "
                          f"{MAX_GRAD_ACCUM:,} (PLANNER_MAX_GRAD_ACCUM)")
                return Point(instance, None, reason, tuple(sorted(merged.items(), key=lambda kv: kv[0])))
            merged["grad_accum"] = accum
        return Point(instance, TrainConfig(**merged))

    def _layout_reason(self, instance: str, merged: dict[str, Any], gpus: int, strategy: Any) -> str:
        """Why a point's tensor/pipeline/context degrees cannot run on its job ("" when they can): TP inside
        one instance, one process per GPU, and the layout record's own rules (planner.parallel.dims.build:
        the degrees divide the GPUs, the heads, the layers and the sequence). Checked here, before the
        objective, so a search spends no estimate on a layout that cannot exist."""
        tp = merged.get("tp", 1)
        if tp > self.gpus[instance]:
            return f"tensor parallelism {tp} spans more than the {self.gpus[instance]} GPUs of one {instance}"
        if strategy is not None and (strategy.one_process or strategy.uses_one_gpu):
            return f"{strategy.name} runs one process; tensor/pipeline parallelism needs one per GPU"
        from planner.parallel.dims import build

        sizes = self.model_sizes
        try:
            build(TrainConfig(**{k: v for k, v in merged.items() if k in TrainConfig.model_fields}), gpus,
                  layers=sizes.get("layers"), heads=sizes.get("heads"), kv_heads=sizes.get("kv_heads"),
                  seq_len=merged.get("seq_len"))
        except PlannerError as e:
            return str(e)
        return ""

    def config(self, values: dict[str, Any]) -> TrainConfig:
        """The TrainConfig of one point (PlannerError when the global batch cannot be hit exactly)."""
        point = self.point(values)
        if point.config is None:
            raise PlannerError("recipe.global_batch_size", self.global_batch_size, point.reason)
        return point.config


def _literal_values(name: str) -> tuple[str, ...]:
    table = {"precisions": PRECISIONS, "optimizers": OPTIMIZERS, "attentions": ATTENTIONS,
             "base_dtypes": ("auto", *BASE_DTYPES), "frameworks": FRAMEWORKS,
             "parallelisms": ("auto", *PARALLELISMS), "optimizer_impls": OPTIMIZER_IMPLS, "loops": LOOP_NAMES,
             "loads": LOAD_NAMES}
    return table[name]


# The largest value of each integer dimension (planner.search.limits).
INT_LIMITS = {"batch_sizes": MAX_SPACE_VALUE, "seq_lens": MAX_SPACE_VALUE, "grad_accums": MAX_GRAD_ACCUM,
              "instance_counts": MAX_SEARCH_INSTANCES, "lora_ranks": MAX_SPACE_VALUE, "tp_sizes": MAX_SPACE_VALUE,
              "pp_sizes": MAX_SPACE_VALUE, "cp_sizes": MAX_SPACE_VALUE}
# A LoRA target set is itself comma-separated (q_proj,v_proj): several sets to explore are split by ";".
SET_SEPARATOR = ";"


def parse_flag_list(field: str, text: str | None, flag: str | None = None) -> tuple[Any, ...] | None:
    """'1,2,4' -> (1, 2, 4) for the flag of `field` (or `flag`, when another spelling was given); None stays
    None. Errors name the flag."""
    if text is None:
        return None
    flag = flag or FLAGS[field]
    if field == "lora_target_sets":  # "q_proj,v_proj;all-linear": two sets; spaces around names dropped
        sets = tuple(",".join(n.strip() for n in t.split(",") if n.strip()) for t in text.split(SET_SEPARATOR))
        if not all(sets):
            raise PlannerError(flag, text, "module names separated by commas (q_proj,v_proj) or all-linear; "
                               "several sets to explore separated by ;")
        return sets
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise PlannerError(flag, text, "a comma-separated list with at least one value")
    if field in INT_LIMITS:
        high = INT_LIMITS[field]
        out = []
        for item in items:
            try:
                value = int(item)
            except ValueError:
                raise PlannerError(flag, item, "positive integers, e.g. 1,2,4,8") from None
            if value <= 0:
                raise PlannerError(flag, item, "positive integers, e.g. 1,2,4,8")
            if value > high:
                raise PlannerError(flag, item, f"integers from 1 to {high:,}")
            out.append(value)
        return tuple(out)
    if field == "checkpointing":
        table = {"on": True, "true": True, "yes": True, "1": True, "off": False, "false": False, "no": False,
                 "0": False}
        if items == ["both"]:
            return (False, True)
        bad = [i for i in items if i.lower() not in table]
        if bad:
            raise PlannerError(flag, bad[0], "on, off (or true, false), or both")
        return tuple(table[i.lower()] for i in items)
    allowed = _literal_values(field)
    for item in items:
        if item not in allowed:
            from planner.errors import unknown

            raise unknown(flag, item, allowed)
    return tuple(items)


def space_from_flags(**texts: str | None) -> SpaceSpec:
    """SpaceSpec from the `--batch-sizes`-style flags (keyword = SpaceSpec field)."""
    return SpaceSpec(**{field: parse_flag_list(field, text) for field, text in texts.items()})


def gpu_can_run(instance: Instance, dimension: str, value: Any) -> bool:
    gpu = instance.gpu
    if dimension == "precision":
        return gpu.bf16 or "bf16" not in value
    if dimension == "attention":
        return gpu.flash_attention or value != "flash"
    if dimension == "tp":  # tensor-parallel groups stay inside one instance (planner.perf.model_parallel)
        return value <= instance.gpus
    return True


def dropped_reason(field: str, global_batch_size: int | None) -> str:
    """Why `resolve_space` left a field's default values out, in words (the same rules as there)."""
    if field == "batch_sizes":
        return f"above the global batch {global_batch_size:,}" if global_batch_size else "too large"
    if field == "seq_lens":
        return "longer than the model's positions"
    if field == "attentions":
        return "no GPU here has FlashAttention: sm80 or later"
    if field == "parallelisms":
        return "one process: it cannot split a model too big for data parallelism"
    return "no GPU here runs them"


def model_sizes(model: ModelSpec | str) -> dict[str, int]:
    """The sizes a parallel layout must divide (transformer layers, attention heads, key/value heads), from
    a hand-modelled model's first transformer; {} for a traced model's reference."""
    ts = getattr(model, "transformers", None)
    if not ts:
        return {}
    t = ts[0]
    return {"layers": sum(x.num_layers for x in ts), "heads": t.num_heads,
            "kv_heads": getattr(t, "num_kv_heads", None) or t.num_heads}


def model_parallel_defaults(model: ModelSpec | str, types: list[Instance], frameworks: tuple[str, ...] = ("pytorch",),
                            split: dict[str, Any] | None = None) -> dict[str, tuple[int, ...]]:
    """Default tensor and pipeline degrees of a search: (1,) below MODEL_PARALLEL_MIN_PARAMS parameters;
    above it, TP from the divisors of the largest GPUs-per-instance that divide the heads (and divide or are
    divided by the key/value heads: planner.parallel.dims.build's rule), PP up to MAX_DEFAULT_PP where at least
    one searched framework's own split places the layers (`pipeline_degrees`). Which of them fit a given type
    and instance count is `SearchSpace.point`'s check."""
    sizes = model_sizes(model)
    if not sizes or not isinstance(model, ModelSpec):
        return {}
    from planner.models.params import count_parameters

    if count_parameters(model)["total"] < MODEL_PARALLEL_MIN_PARAMS:
        return {}
    g = max(i.gpus for i in types)
    heads, kv = sizes["heads"], sizes["kv_heads"]
    tp = tuple(d for d in range(1, g + 1) if g % d == 0 and heads % d == 0 and (kv % d == 0 or d % kv == 0))
    return {"tp_sizes": tp, "pp_sizes": pipeline_degrees(sizes["layers"], frameworks, split or {})}


def pipeline_degrees(layers: int, frameworks: tuple[str, ...], split: dict[str, Any]) -> tuple[int, ...]:
    """The pipeline degrees 1..MAX_DEFAULT_PP whose split of `layers` at least one of `frameworks` accepts, by
    its own rule (planner.parallel.layer_split.chunk_layers, with the search's fixed uneven-split fields and
    `vp`): the divisors of the layers under an even split (plain PyTorch, Accelerate, DeepSpeed, and Megatron
    without --first/--last-stage-layers), every degree up to the layers under torchtitan and NeMo AutoModel,
    whose splitters give the first stages one layer more, and under Megatron with the uneven flags the degrees
    that leave the middle ranks an equal share."""
    from planner.parallel.frameworks import get as framework
    from planner.parallel.layer_split import chunk_layers, split_kwargs

    vp = int(split.get("vp") or 1)
    kwargs = split_kwargs(split)
    rules = {framework(f).pipeline_split for f in frameworks}
    out = [1]
    for pp in range(2, min(layers, MAX_DEFAULT_PP) + 1):
        for rule in sorted(rules):
            try:
                chunk_layers(rule, layers, pp, vp, **kwargs)
            except PlannerError:
                continue
            out.append(pp)
            break
    return tuple(out)


def resolve_space(spec: SpaceSpec, model: ModelSpec | str, instances: Instance | list[Instance], *,
                  min_seq_len: int | None = None, fixed: dict[str, Any] | None = None,
                  global_batch_size: int | None = None) -> SearchSpace:
    """The concrete joint space for `model` over `instances` (one type or several).

    A default value that none of the instance types or the model can run is dropped (and listed in
    `dropped`): bf16 when every GPU is a V100, FlashAttention without an sm80+ GPU, sequences beyond the
    model's positions. Values given explicitly are kept, so the objective
    records them as infeasible with the reason; so is a value that only some of the types can run.
    `min_seq_len` filters the sequence lengths either way (it is a requirement, not a preference).
    `global_batch_size` (the recipe's) makes accumulation derived and drops default micro-batches above it.
    """
    types = [instances] if isinstance(instances, Instance) else list(instances)
    fixed = dict(fixed or {})
    values: dict[str, tuple[Any, ...]] = {"instance_types": tuple(i.name for i in types)}
    dropped: dict[str, tuple[Any, ...]] = {}
    frameworks = ((fixed["framework"],) if "framework" in fixed else  # as the loop below: fixed wins
                  spec.frameworks if spec.frameworks is not None else DEFAULTS["frameworks"])
    wide = model_parallel_defaults(model, types, tuple(frameworks), fixed)
    for dim, field in DIMENSIONS.items():
        if dim == "instance":
            continue
        asked = getattr(spec, field)
        chosen = asked if asked is not None else wide.get(field, DEFAULTS[field])
        if dim in fixed and dim in FIXED_DIMENSIONS:
            value = fixed.pop(dim)
            if dim == "lora_targets" and isinstance(value, list | tuple):  # fixed: {lora_targets: [q_proj, v_proj]}
                value = ",".join(value)
            chosen, asked = (value,), True
        if asked is None:
            keep = tuple(v for v in chosen if any(gpu_can_run(i, dim, v) for i in types))
            if dim == "parallelism" and wide:  # one process (DataParallel) cannot split a model over its GPUs
                keep = tuple(v for v in keep if not (known(v) and known(v).one_process))
            limit = getattr(model, "max_positions", None)  # None: no limit known (a traced model's reference)
            if dim == "seq_len" and limit is not None:
                keep = tuple(v for v in keep if v <= limit)
                if not keep:  # every default is too long: search the model's own limit
                    keep = (limit,)
            if dim == "batch_size" and global_batch_size is not None:
                keep = tuple(v for v in keep if v <= global_batch_size) or (1,)
            if len(keep) < len(chosen):
                dropped[field] = tuple(v for v in chosen if v not in keep)
            chosen = keep
        values[field] = tuple(sorted(chosen)) if dim in ORDINAL else chosen
    if min_seq_len is not None:
        if min_seq_len <= 0:
            raise PlannerError("--min-seq-len", min_seq_len, "a positive integer")
        keep = tuple(v for v in values["seq_lens"] if v >= min_seq_len)
        if not keep:
            raise PlannerError("--min-seq-len", min_seq_len,
                               f"at most the longest searched sequence length, {max(values['seq_lens'])} "
                               f"(--seq-lens {','.join(map(str, values['seq_lens']))})")
        values["seq_lens"] = keep
    bad = sorted(set(fixed) - set(FIXABLE))
    if bad:
        hint = "a dimension: set it in space" if bad[0] in DIMENSIONS else f"one of {', '.join(FIXABLE)}"
        raise PlannerError(f"fixed.{bad[0]}", fixed[bad[0]], hint)
    return SearchSpace(**values, gpus={i.name: i.gpus for i in types}, global_batch_size=global_batch_size,
                       fixed=fixed, dropped=dropped, model_sizes=model_sizes(model))
