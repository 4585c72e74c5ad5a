"""Step 1 of the estimate pipeline, resolve: the model and instance named, "auto" and the world size
(planner.parallel), the software stack and the runtime constants, with the calibration passed in.

Both front ends (planner.pipeline.step: analytic and traced) start here, so what "auto" means, which stack an
estimate assumes and whether a flat fragmentation was given are decided once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from planner import caches
from planner import parallel as strategies
from planner.errors import PlannerError
from planner.ir.context import Ctx
from planner.memory import parallel
from planner.memory import stack as sw
from planner.parallel.frameworks import check as check_framework
from planner.spec import (
    Instance,
    ModelSpec,
    RuntimeConstants,
    SoftwareStack,
    TrainConfig,
)


def _resolve_model(model: ModelSpec | str, options: dict[str, Any] | None) -> ModelSpec:
    if isinstance(model, ModelSpec):
        return model
    from planner.models.catalog import cached_model

    return cached_model(model, options)


def _resolve_instance(instance: Instance | str) -> Instance:
    if isinstance(instance, Instance):
        return instance
    from planner.hardware import get_instance

    return get_instance(instance)


def resolve_parallelism(config: TrainConfig, instance: Instance) -> TrainConfig:
    """`config` with its parallelism resolved: "auto" means DDP on several GPUs, plain single-GPU training on
    one (planner.parallel.resolve_name), and the strategy checked against the instances and the framework.
    The one place an estimate resolves "auto": every interpreter below the pipeline reads the resolved name
    (planner.parallel.get refuses "auto"; tests/test_structure.py fails on a call of resolve_name there)."""
    p = strategies.resolve_name(config.parallelism, instance.gpus * config.instances)
    s = strategies.get(p)
    if s.one_process and config.instances > 1:
        raise PlannerError("--parallelism", p, "nn.DataParallel runs in one process on one instance; "
                           "use ddp, zero1-3 or fsdp with --instances > 1")
    if s.uses_one_gpu and config.instances > 1:
        raise PlannerError("--parallelism", p, "single uses one GPU; use ddp, zero1-3 or fsdp with --instances > 1")
    check_framework(config.framework, p)
    return config.model_copy(update={"parallelism": p})


def check_supported(model: ModelSpec | None, config: TrainConfig, instance: Instance) -> None:
    """What the GPU and the model allow (model None: a traced model, GPU checks only); raises PlannerError
    naming the flag."""
    gpu = instance.gpu
    if "bf16" in config.precision and not gpu.bf16:
        raise PlannerError("--precision", config.precision,
                           f"{gpu.family} (sm{gpu.compute_capability[0]}{gpu.compute_capability[1]}) has no bf16; "
                           f"use fp32, amp-fp16 or fp16 on {instance.name}, or an instance type whose GPU has "
                           "bf16 (A10G, L4, A100, H100 and later: e.g. --instance ml.g5.2xlarge)")
    if config.attention == "flash":
        if not gpu.flash_attention:
            raise PlannerError("--attention", "flash",
                               f"FlashAttention needs sm80+, {gpu.family} is sm{gpu.compute_capability[0]}"
                               f"{gpu.compute_capability[1]}; use sdpa or eager")
        if config.precision == "fp32":
            raise PlannerError("--attention", "flash", "FlashAttention runs in fp16/bf16 only; use --precision "
                               "amp-fp16, amp-bf16, fp16 or bf16, or --attention sdpa")
    limit = model.max_positions if model is not None else None
    if model is not None and limit is not None and config.seq_len > limit:
        raise PlannerError("--seq-len", config.seq_len, f"{model.name} has {limit} positions; use <= {limit}")
    if config.optimizer_impl == "fused" and config.optimizer not in ("adam", "adamw", "sgd", "sgd-momentum"):
        raise PlannerError("--optimizer-impl", "fused", "fused kernels exist for adam, adamw, sgd, sgd-momentum")
    from planner.adapters.lora import check as check_lora

    check_lora(config)
    if config.lora and model is None:
        from planner.adapters.traced import check_traced

        check_traced(config)


@dataclass(frozen=True)
class _StackView:
    """What the stack decided for one estimate (see `_with_stack`)."""

    stack: SoftwareStack
    context: tuple[int, int, int, str]
    given: frozenset[str]
    fragmentation_range: tuple[float, ...]


def _calibrated_range(entry: dict[str, Any], key: str, family: str) -> list[float] | None:
    """A [min, max] pair of the calibration file (`planner calibrate`), checked."""
    value = entry.get(key)
    if value is None:
        return None
    if (not isinstance(value, list | tuple) or len(value) != 2
            or not all(isinstance(v, int | float) and not isinstance(v, bool) and v >= 0 for v in value)):
        raise PlannerError(f"calibration file: families.{family}.{key}", value, "[min, max], two numbers >= 0")
    return [float(min(value)), float(max(value))]


def _with_stack(families: list[str], cfg: TrainConfig, inst: Instance, stack, runtime, calibration,
                rt: RuntimeConstants) -> tuple[TrainConfig, RuntimeConstants, _StackView]:
    """Resolve the stack and what it decides: attention "auto", the context (lazy vs eager loading) and the
    cuBLAS workspaces of that torch version, unless the user fixed them; and what the band needs."""
    from planner.memory.runtime import CUBLAS_HANDLES_PER_TRAINING_PROCESS, calibration_entry

    st = sw.resolve_stack(stack, inst.gpu)
    if cfg.attention == "auto":
        cfg = cfg.model_copy(update={"attention": sw.model_default_attention(st, families)})
    given = frozenset(RuntimeConstants.model_fields) if isinstance(runtime, RuntimeConstants) \
        else frozenset(runtime or ())
    cal = calibration_entry(calibration, inst.gpu.family)
    # Calibration readings narrow the band only for stacks like the ones they were taken on (probe jobs run
    # DLCs, lazy loading, when the file does not say).
    if (cal.get("module_loading") or "lazy") != ("lazy" if sw.lazy_loading(st) else "eager"):
        cal = {}
    ctx = sw.context_band(st, inst.gpu.family, rt.cuda_context_bytes, overridden="cuda_context_bytes" in given,
                          calibrated="cuda_context_bytes" in cal,
                          calibrated_range=_calibrated_range(cal, "context_range", inst.gpu.family))
    update: dict[str, Any] = {}
    if "cublas_workspace_bytes" not in given:
        ws = sw.cublas_workspace_bytes(st, inst.gpu.compute_capability, CUBLAS_HANDLES_PER_TRAINING_PROCESS)
        if sw.workspace_rule(st)["in_allocator"]:
            update["cublas_workspace_bytes"] = ws
        else:  # before torch 1.13 cuBLAS allocates its workspace itself: device memory outside the allocator
            update["cublas_workspace_bytes"] = 0
            if "cuda_context_bytes" not in given:  # a measured context (device - reserved) already holds it
                ctx = (ctx[0] + ws, ctx[1] + ws, ctx[2] + ws, ctx[3] + f"; + cuBLAS's own workspaces "
                       f"({ws / 2**20:.1f} MiB, outside the allocator before torch 1.13)")
    if ctx[0] != rt.cuda_context_bytes:
        update["cuda_context_bytes"] = ctx[0]
    if update:
        rt = rt.model_copy(update=update | {"source": rt.source + f"; stack: {sw.describe(st)}"})
    frag_range = _calibrated_range(cal, "fragmentation_range", inst.gpu.family) or (
        (cal["fragmentation"], cal["fragmentation"]) if "fragmentation" in cal else ())
    return cfg, rt, _StackView(st, ctx, given, tuple(frag_range))


# (GPU, model's transformer layers, attention, calibration) -> the runtime constants and what the default stack
# decides (`_with_stack`): the same for every estimate of a search on one GPU, so made once (all immutable).
_RUNTIME: dict[tuple, tuple] = caches.table("planner.pipeline.resolve._RUNTIME", scope="step",
    key="(GPU, transformer layers, attention, calibration) -> runtime constants and stack")
RUNTIME_CACHE_SIZE = 4096  # (GPU, layers, attention, calibration) entries kept: a search meets a few dozen


@dataclass(frozen=True)
class Resolved:
    """What both front ends start from: the configuration after "auto" (strategy and attention), the world
    and each GPU's share of the model states, the runtime constants and what the stack decided, whether a
    flat fragmentation was given, the calibrated speed scale, and the context record (planner.ir.context.Ctx:
    one micro-batch's sizes, precision and dtypes, attention kernel, backend and device rules), built here once
    and passed to the memory and speed interpreters (issue 33 item 5: each used to build its own)."""

    inst: Instance
    cfg: TrainConfig
    world: int
    share: parallel.Sharding
    rt: RuntimeConstants
    view: _StackView
    fragmentation_given: bool  # the user (runtime override) or calibration set `fragmentation`
    throughput_scale: float | None  # measured/predicted speed of this GPU family (`planner calibrate`)
    ctx: Ctx  # the resolved configuration's context record


def context(spec: ModelSpec | None, cfg: TrainConfig, instance: Instance, backend: str = "cuda") -> Ctx:
    """The context record of a resolved configuration (attention never "auto"): the batch is padded when the
    model takes an attention mask (a traced model: not, its own batch decides), flash kernels when the GPU
    runs them (sm80+)."""
    padded = spec.inputs.attention_mask if spec is not None else False
    return Ctx(cfg.batch_size, cfg.seq_len, cfg.precision, cfg.attention, backend,  # type: ignore[arg-type]
               padded, instance.gpu.flash_attention, cfg.ep, cfg.moe_imbalance)


def check_experts(spec: ModelSpec | None, cfg: TrainConfig, world: int) -> None:
    """The expert layout where the model is known (issue 35): --ep must divide the experts, ep · etp · pp the
    GPUs, and a model without experts takes neither (planner.parallel.dims.build holds the rules)."""
    moe = [t for t in spec.transformers if t.moe] if spec is not None else []
    if moe and cfg.lora:
        raise PlannerError("--lora-r", cfg.lora_r, "none for a mixture-of-experts model (LoRA on its attention "
                           "or experts is not modelled yet)")
    if not moe and cfg.ep == 1 and cfg.etp == 1:
        return
    from planner.parallel import dims

    if spec is None:  # a traced model: its experts are not known here
        raise PlannerError("--ep" if cfg.ep > 1 else "--etp", cfg.ep if cfg.ep > 1 else cfg.etp,
                           "1 for a model of your own (expert parallelism needs a config.json or catalog model)")
    dims.build(cfg, world, experts=moe[0].num_experts if moe else None,
               top_k=moe[0].experts_per_token if moe else None)


def resolve(spec: ModelSpec | None, config: TrainConfig, instance: Instance | str, runtime, stack,
            calibration: dict[str, Any] | None, backend: str = "cuda") -> Resolved:
    """Resolve one configuration for `spec` (None: a traced model, which has no model type to look up, so
    attention "auto" is the SDPA default of current stacks). `calibration` None reads the calibration file
    (planner.memory.runtime.load_calibration: once per file version); pass a dict to decide it yourself."""
    from planner.memory.runtime import (
        calibrated_values,
        calibration_entry,
        load_calibration,
        runtime_constants,
    )

    inst = _resolve_instance(instance)
    cfg = resolve_parallelism(config, inst)
    if calibration is None:
        calibration = load_calibration()  # read once: the runtime constants and the throughput scale use it
    families = [t.family for t in spec.transformers] if spec is not None else []
    cached = spec is not None and stack is None and runtime is None
    key = (id(inst.gpu), tuple(families), cfg.attention, id(calibration))
    hit = _RUNTIME.get(key) if cached else None
    if hit is not None and hit[0] is inst.gpu and hit[1] is calibration:
        rt, view, attention = hit[2]
        if attention != cfg.attention:
            cfg = cfg.model_copy(update={"attention": attention})
    else:
        if isinstance(runtime, RuntimeConstants):
            rt = runtime
        else:
            rt = runtime_constants(inst.gpu, runtime or None, calibration=calibration)
        cfg, rt, view = _with_stack(families, cfg, inst, stack, runtime, calibration, rt)
        if cached:
            if len(_RUNTIME) >= RUNTIME_CACHE_SIZE:
                _RUNTIME.clear()
            _RUNTIME[key] = (inst.gpu, calibration, (rt, view, cfg.attention))
    check_supported(spec, cfg, inst)
    world = parallel.world_size(cfg, inst)
    check_experts(spec, cfg, world)
    share = parallel.sharding(cfg, world)
    # A flat fragmentation is honoured only when given: explicit RuntimeConstants, an override, calibration.
    fragmentation_given = (isinstance(runtime, RuntimeConstants) or "fragmentation" in (runtime or {})
                           or "fragmentation" in calibrated_values(calibration, inst.gpu.family))
    scale = calibration_entry(calibration, inst.gpu.family).get("throughput_scale")
    return Resolved(inst, cfg, world, share, rt, view, fragmentation_given, scale, context(spec, cfg, inst, backend))
