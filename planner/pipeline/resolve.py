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
from planner.parallel import dims as layout
from planner.parallel.frameworks import check as check_framework
from planner.parallel.frameworks import get as get_framework
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


def resolve_recompute(config: TrainConfig) -> TrainConfig:
    """`config` with `checkpointing` saying whether whole layers are recomputed: `--recompute full` is
    `--checkpointing` (and `--recompute none` or `selective` turns it off), so every reader of the flag (memory,
    speed, FLOPs, the program report) sees one answer; `recompute` None keeps what `checkpointing` says."""
    from planner.ir.transforms import RECOMPUTE_MODULES, TORCHTITAN_OP

    unknown = [m for m in config.recompute_modules if m not in RECOMPUTE_MODULES]
    if unknown:
        raise PlannerError("--recompute-modules", unknown[0], f"one of {', '.join(RECOMPUTE_MODULES)} (op: "
                           "torchtitan's per-op policy)")
    if TORCHTITAN_OP in config.recompute_modules and len(config.recompute_modules) > 1:
        raise PlannerError("--recompute-modules", ",".join(config.recompute_modules),
                           "op alone (torchtitan's per-op policy), or Megatron's module names")
    if config.recompute_modules and config.recompute != "selective":
        raise PlannerError("--recompute-modules", ",".join(config.recompute_modules), "only with --recompute selective")
    if config.recompute is None:
        return config
    full = config.recompute == "full"
    return config if config.checkpointing == full else config.model_copy(update={"checkpointing": full})


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
    if config.attention == "sdpa" and model is not None and _has_attention_sinks(model):
        raise PlannerError("--attention", "sdpa", "eager or flash for a model with attention sinks (gpt-oss): "
                           "transformers has no SDPA path for them (GptOssPreTrainedModel._supports_sdpa = False); "
                           "flash stands for the fused kernels with sinks (FlashAttention 3/4, FlexAttention, "
                           "Transformer Engine)")
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


def _has_attention_sinks(model: ModelSpec) -> bool:
    """Whether one of the model's transformers has gpt-oss's attention sinks (planner.families traits)."""
    from planner.families import family

    return any(family(t.family).attention_sinks for t in model.transformers)


def _with_stack(families: list[str], cfg: TrainConfig, inst: Instance, stack, runtime, calibration,
                rt: RuntimeConstants) -> tuple[TrainConfig, RuntimeConstants, _StackView]:
    """Resolve the stack and what it decides: attention "auto", the context (lazy vs eager loading) and the
    cuBLAS workspaces of that torch version, unless the user fixed them; and what the band needs."""
    from planner.memory.runtime import CUBLAS_HANDLES_PER_TRAINING_PROCESS, calibration_entry

    st = sw.resolve_stack(stack, inst.gpu)
    if cfg.attention == "auto":
        attention = sw.model_default_attention(st, families)
        if (attention == "eager" and get_framework(cfg.framework).fused_attention and inst.gpu.flash_attention
                and cfg.precision != "fp32"):
            attention = "flash"  # the framework's own fused attention (gpt-oss's sinks included), not HF's eager
        cfg = cfg.model_copy(update={"attention": attention})
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
    # how the world splits into data, tensor, context and pipeline groups (issue 34), checked once
    dims: layout.ParallelDims | None = None
    # the configuration an Estimate reports: `cfg` except under --precision fp8, which computes as amp-bf16
    # plus the FP8 rules carried by `ctx` (planner.ir.fp8), and reports "fp8" with its recipe
    reported: TrainConfig | None = None


# torch.nn.functional.cross_entropy calls ATen's composite `cross_entropy_loss` with label_smoothing from torch
# 1.10 (the release that added the argument: pytorch.org/docs/1.10.0 torch.nn.functional.cross_entropy; the op is
# aten/src/ATen/native/LossNLL.cpp). ASSUMPTION: 1.8 and 1.9 not checked; before 1.10 the whole-loss fp32 rule
# applies, which saves less but makes a larger forward copy. Ctx.cross_entropy_composite.
CROSS_ENTROPY_COMPOSITE_SINCE = "1.10"


def context(spec: ModelSpec | None, cfg: TrainConfig, instance: Instance, backend: str = "cuda",
            dims: layout.ParallelDims | None = None, torch_version: str | None = None) -> Ctx:
    """The context record of a resolved configuration (attention never "auto"): the batch is padded when the
    model takes an attention mask (a traced model: not, its own batch decides), flash kernels when the GPU
    runs them (sm80+), and this rank's tensor/sequence/context-parallel degrees (`dims`), with what the
    framework's column-parallel linears save under sequence parallelism."""
    from planner.memory.framework_layout import layout
    from planner.parallel.frameworks import get as framework

    fw = framework(cfg.framework)
    # the routed experts compute in 16 bits when the framework's MoE casts them, or when its layout holds 16-bit
    # weights (an FSDP policy's gathered units, DeepSpeed's and Megatron's 16-bit engines): transformers'
    # grouped_mm computes in the weights' dtype
    experts_16bit = fw.experts_16bit or (cfg.precision != "fp32"
                                         and layout(cfg).activation_precision != cfg.precision)
    padded = spec.inputs.attention_mask if spec is not None else False
    tp, sp, cp = (dims.tp, dims.sp, dims.cp) if dims is not None else (1, False, 1)
    return Ctx(cfg.batch_size, cfg.seq_len, cfg.precision, cfg.attention, backend,  # type: ignore[arg-type]
               padded, instance.gpu.flash_attention, tp=tp, sp=sp, cp=cp,
               fp8=cfg.fp8_recipe if cfg.precision == FP8_COMPUTE else None, fp8_gather=cfg.fp8_param_gather,
               compile=cfg.compile, sp_saves_gathered=fw.sp_saves_gathered_input,
               ep=cfg.ep, moe_imbalance=cfg.moe_imbalance, etp=cfg.etp, experts_16bit=experts_16bit,
               fp8_weight_cache=fw.te_weight_cache, fused_moe=fw.fused_moe, fused_router=fw.fused_router,
               fused_norms=fw.fused_norms, loss_fp32=fw.loss_fp32, fused_loss=fw.fused_loss,
               fused_linears=fw.kernels == "megatron", fused_glu=fw.fused_glu,
               cross_entropy_composite=torch_version is None or sw.parse_version("torch", torch_version)
               >= sw.parse_version("torch", CROSS_ENTROPY_COMPOSITE_SINCE))


def model_parallel_asked(cfg: TrainConfig) -> bool:
    """Any tensor, context or pipeline parallelism (or their options) in the configuration."""
    return (cfg.tp > 1 or cfg.cp > 1 or cfg.pp > 1 or cfg.vp > 1 or cfg.pp_schedule is not None
            or bool(cfg.sp))


def parallel_dims(spec: ModelSpec | None, cfg: TrainConfig, world: int) -> layout.ParallelDims:
    """The layout of a resolved configuration over `world` GPUs (planner.parallel.dims.build), checked against
    the model's layers, heads, key/value heads, MLP width and sequence. Model parallelism is modelled for one
    transformer of the hand-modelled families, trained in full: a traced module, a multimodal model or LoRA
    with --tp/--cp/--pp is refused, naming the flag."""
    if model_parallel_asked(cfg):
        flag = "--tp" if cfg.tp > 1 else "--cp" if cfg.cp > 1 else "--pp" if cfg.pp > 1 else \
            "--vp" if cfg.vp > 1 else "--pp-schedule" if cfg.pp_schedule else "--sp"
        value = getattr(cfg, flag[2:].replace("-", "_"))
        if spec is None or len(spec.components) != 1 or len(spec.transformers) != 1:
            raise PlannerError(flag, value, "1 here: tensor, context and pipeline parallelism are modelled for "
                               "one transformer of the catalog or a config.json of the modelled families")
        if cfg.lora:
            raise PlannerError(flag, value, "1 with LoRA (adapters under model parallelism are not modelled)")
        if strategies.get(cfg.parallelism).one_process:
            raise PlannerError("--parallelism", cfg.parallelism, "ddp, zero1-3, fsdp or hsdp with model "
                               "parallelism (nn.DataParallel is one process)")
    return layout.for_model(spec, cfg, world)


# --precision fp8 computes as this precision, its Linears in FP8 (planner.ir.fp8)
FP8_COMPUTE = "amp-bf16"


def check_fp8_and_compile(config: TrainConfig, instance: Instance, torch_version: str) -> TrainConfig:
    """`config` with its FP8 recipe resolved (the framework's default), after the checks: FP8 tensor cores
    (sm89+; MXFP8 sm100+), and torch.compile on torch 2.0 or later. Raises PlannerError naming the flag."""
    from planner.ir import fp8

    gpu = instance.gpu
    cc = tuple(gpu.compute_capability)
    if config.compile and sw.parse_version("torch", torch_version) < sw.parse_version("torch", "2.0"):
        raise PlannerError("--compile", f"with torch {torch_version}",
                           "torch 2.0 or later (torch.compile first shipped in 2.0); use --torch-version 2.0+ "
                           "or drop --compile")
    if config.precision != "fp8":
        if config.fp8_recipe is not None:
            raise PlannerError("--fp8-recipe", config.fp8_recipe, "--precision fp8 with it (or leave it out)")
        if config.fp8_param_gather:
            raise PlannerError("--fp8-param-gather", "on", "--precision fp8 with it (or leave it out)")
        return config
    if config.fp8_param_gather and not strategies.get(config.parallelism).fsdp:
        raise PlannerError("--fp8-param-gather", "on", f"--parallelism fsdp or zero3 (FSDP2 all-gathers the "
                           f"weights), not {config.parallelism}")
    if cc < fp8.FP8_MIN_CC:
        raise PlannerError("--precision", "fp8",
                           f"{gpu.family} (sm{cc[0]}{cc[1]}) has no FP8 tensor cores (sm89+); use an instance type "
                           f"whose GPU has them: {', '.join(fp8_instances())}")
    recipe = config.fp8_recipe or fp8.default_recipe(config.framework)
    if recipe == "mxfp8" and cc < fp8.MXFP8_MIN_CC:
        raise PlannerError("--fp8-recipe", "mxfp8", f"Blackwell (sm100+); {gpu.family} is sm{cc[0]}{cc[1]}: use "
                           "tensorwise, rowwise, delayed or current")
    if config.fp8_param_gather and fp8.library(recipe) != "torchao":
        raise PlannerError("--fp8-param-gather", "on", f"a torchao recipe (tensorwise or rowwise), not {recipe} "
                           "(FSDP2's FP8 all-gather is torchao's enable_fsdp_float8_all_gather)")
    if config.lora:
        raise PlannerError("--precision", "fp8", "full training (no --lora-r): FP8 with adapters is not modelled")
    return config.model_copy(update={"fp8_recipe": recipe})


def fp8_instances() -> list[str]:
    """Instance types whose GPU has FP8 tensor cores (sm89+), for the error line."""
    from planner.hardware import get_instance, list_instances
    from planner.ir import fp8

    names = [n for n in list_instances() if tuple(get_instance(n).gpu.compute_capability) >= fp8.FP8_MIN_CC]
    return names[:6] + (["..."] if len(names) > 6 else [])



def check_experts(spec: ModelSpec | None, cfg: TrainConfig, world: int) -> None:
    """The expert layout where the model is known (issue 35): --ep must divide the experts, ep · etp · pp the
    GPUs, and a model without experts takes neither (planner.parallel.dims.build holds the rules)."""
    if spec is None and (cfg.ep > 1 or cfg.etp > 1):  # a traced model: its experts are not known here
        raise PlannerError("--ep" if cfg.ep > 1 else "--etp", cfg.ep if cfg.ep > 1 else cfg.etp,
                           "1 for a model of your own (expert parallelism needs a config.json or catalog model)")
    # the expert layout's own rules (--ep divides the experts, ep · etp · pp the GPUs, top-k at most the
    # experts) are checked with the rest of the layout: parallel_dims passes the experts to dims.build


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
    cfg = resolve_recompute(resolve_parallelism(config, inst))
    if calibration is None:
        calibration = load_calibration()  # read once: the runtime constants and the throughput scale use it
    families = [t.family for t in spec.transformers] if spec is not None else []
    cached = spec is not None and stack is None and runtime is None
    # the framework and fp32 decide attention "auto" too (a framework's own fused attention: _with_stack)
    key = (id(inst.gpu), tuple(families), cfg.attention, id(calibration), cfg.framework, cfg.precision == "fp32")
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
    reported = None
    if cfg.precision == "fp8" or cfg.compile or cfg.fp8_recipe is not None or cfg.fp8_param_gather:
        cfg = check_fp8_and_compile(cfg, inst, view.stack.torch)
        if cfg.precision == "fp8":
            reported, cfg = cfg, cfg.model_copy(update={"precision": FP8_COMPUTE})
    check_supported(spec, cfg, inst)
    world = parallel.world_size(cfg, inst)
    check_experts(spec, cfg, world)
    dims = parallel_dims(spec, cfg, world)
    layout.check_attention(dims, cfg.attention, cfg.framework)
    share = parallel.sharding(cfg, world, dims.dp_shard)
    # A flat fragmentation is honoured only when given: explicit RuntimeConstants, an override, calibration.
    fragmentation_given = (isinstance(runtime, RuntimeConstants) or "fragmentation" in (runtime or {})
                           or "fragmentation" in calibrated_values(calibration, inst.gpu.family))
    scale = calibration_entry(calibration, inst.gpu.family).get("throughput_scale")
    if reported is not None:  # what the stack decided (attention), as --precision fp8
        reported = cfg.model_copy(update={"precision": "fp8"})
    return Resolved(inst, cfg, world, share, rt, view, fragmentation_given, scale,
                    context(spec, cfg, inst, backend, dims, view.stack.torch), dims, reported)
