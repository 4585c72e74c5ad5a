"""`planner.estimate`: one configuration in, the per-GPU memory by phase, the verdict, speed and cost out.

This module only orchestrates: each term is a small function in `planner.memory`, `planner.perf`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from planner import caches
from planner.errors import PlannerError
from planner.identity_cache import per_object
from planner.memory import band, model_states, optimizer, parallel, timeline
from planner.memory import batch as batch_mem
from planner.memory import stack as sw
from planner.parallel import get as strategy_of
from planner.spec import (
    Estimate,
    Instance,
    MemoryBytes,
    ModelSpec,
    PhasePeak,
    RuntimeConstants,
    SoftwareStack,
    Throughput,
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
class _ModelFacts:
    """What depends on the model alone (parameter counts, buffers, gradient shapes), computed once per model:
    a search evaluates thousands of configurations of a few models."""

    counts: dict[str, int]
    buffer_bytes: int
    gradient_shapes: tuple
    by_block: dict[str, int]
    # Gradient elements per block: `by_block`, except that a tied LM head's gradient is allocated at the head's
    # backward, not the embeddings' (`params.tied_gradient`).
    gradients_by_block: dict[str, int]
    optimizer: dict  # (optimizer, impl, param bytes, share) -> (state bytes, temporary bytes)


_MODEL_FACTS: dict[int, tuple] = caches.table("planner.estimate._MODEL_FACTS", scope="step",
    key="ModelSpec identity (per_object): its _ModelFacts")  # ModelSpec -> its _ModelFacts (`identity_cache.per_object`)


def _model_facts(spec: ModelSpec) -> _ModelFacts:
    return per_object(_MODEL_FACTS, spec, _make_model_facts)


def _make_model_facts(spec: ModelSpec) -> _ModelFacts:
    from planner.models.params import (
        count_buffers_bytes,
        count_parameters,
        model_gradient_tensor_shapes,
        parameters_by_block,
        tied_gradient,
    )

    by_block = parameters_by_block(spec)
    gradients = dict(by_block)
    tied = tied_gradient(spec)
    if tied is not None:
        emb, head, shape = tied
        gradients[emb] = gradients.get(emb, 0) - math.prod(shape)
        gradients[head] = gradients.get(head, 0) + math.prod(shape)
    return _ModelFacts(count_parameters(spec), count_buffers_bytes(spec), model_gradient_tensor_shapes(spec),
                       by_block, gradients, {})


def _optimizer_bytes(facts: _ModelFacts, cfg: TrainConfig, p_bytes: int, share: float) -> tuple[int, int]:
    """(state bytes, step temporary bytes): they read only the optimizer, its implementation, the parameter
    dtype and the share (`optimizer.optimizer_state_bytes`, `optimizer_temporary_bytes`)."""
    key = (cfg.optimizer, cfg.optimizer_impl, p_bytes, share)
    hit = facts.optimizer.get(key)
    if hit is None:
        shapes = facts.gradient_shapes
        hit = (optimizer.optimizer_state_bytes(shapes, cfg, p_bytes, share),
               optimizer.optimizer_temporary_bytes(shapes, cfg, p_bytes, share))
        facts.optimizer[key] = hit
    return hit


# What `activations.activation_blocks` reads of a TrainConfig (its `_ctx` and the checkpointing flag):
# tests/test_estimate_cache.py fails if another field changes its answer.
ACTIVATION_FIELDS = ("batch_size", "seq_len", "precision", "attention", "checkpointing", "lora_r", "lora_targets",
                     "lora_dropout", "base_dtype")
_ACTIVATIONS: dict[tuple, tuple] = caches.table("planner.estimate._ACTIVATIONS", scope="step",
    key="(model identity, TrainConfig's ACTIVATION_FIELDS, backend, flash) -> activation records")
ACTIVATION_CACHE_SIZE = 4096  # distinct (model, shape) entries kept


def _activations(spec: ModelSpec, cfg: TrainConfig, backend: str, flash_ok: bool) -> tuple:
    """`activation_blocks`, cached per model object and the fields it reads: a search evaluates one shape
    on many instance types and counts, and this is the costliest part of preparing an estimate."""
    from planner.memory.activations import activation_blocks

    key = (id(spec), *(getattr(cfg, f) for f in ACTIVATION_FIELDS), backend, flash_ok)
    hit = _ACTIVATIONS.get(key)
    if hit is None or hit[0] is not spec:
        if len(_ACTIVATIONS) >= ACTIVATION_CACHE_SIZE:
            _ACTIVATIONS.clear()
        records = tuple(activation_blocks(spec, cfg, backend=backend, flash_ok=flash_ok))
        if cfg.lora:  # a frozen base saves less; the adapters add their own (planner.adapters.activations)
            from planner.adapters.activations import lora_activations
            from planner.adapters.lora import plan

            records = lora_activations(spec, cfg, records, plan(spec, cfg), backend)
        hit = _ACTIVATIONS[key] = (spec, records)
    return hit[1]


_BLOCKS: dict[tuple, tuple] = caches.table("planner.estimate._BLOCKS", scope="step",
    key="(model identity, shape fields, shares) -> per-block memory")


def _block_memory(model: ModelSpec, activations: tuple, config: TrainConfig,
                  share: parallel.Sharding) -> tuple[timeline.BlockMemory, ...]:
    """Each block (and the final "loss" entry of `activations`) as resident on this GPU; cached per model,
    activation records (one object per shape, `_activations`), dtypes and sharding: a search meets one shape
    on many instance types and counts."""
    p_bytes = model_states.parameter_dtype_bytes(config.precision)
    g_bytes = model_states.gradient_dtype_bytes(config.precision)
    lora = _lora_key(config)
    key = (id(model), id(activations), p_bytes, g_bytes, share, lora)
    hit = _BLOCKS.get(key)
    if hit is not None and hit[0] is model and hit[1] is activations:
        return hit[2]
    blocks = _resident_blocks(model, activations, p_bytes, g_bytes, share, _lora_bytes(model, config))
    if len(_BLOCKS) >= ACTIVATION_CACHE_SIZE:
        _BLOCKS.clear()
    _BLOCKS[key] = (model, activations, blocks)
    return blocks


def _lora_key(config: TrainConfig) -> tuple | None:
    """The TrainConfig fields a LoRA plan reads (None: full fine-tuning)."""
    return (config.lora_r, config.lora_targets, config.base_dtype) if config.lora else None


def _lora_bytes(model: ModelSpec, config: TrainConfig) -> dict[str, tuple[int, int]] | None:
    """Block -> (parameter bytes, gradient bytes) of a LoRA run (planner.adapters.lora); None without one."""
    if not config.lora:
        return None
    from planner.adapters.lora import plan

    return {name: (b.param_bytes, b.grad_bytes) for name, b in plan(model, config).blocks.items()}


def _resident_blocks(model: ModelSpec, activations: tuple, p_bytes: int, g_bytes: int,
                     share: parallel.Sharding, lora: dict[str, tuple[int, int]] | None = None
                     ) -> tuple[timeline.BlockMemory, ...]:
    facts = _model_facts(model)
    out = []
    for act in activations:  # every block in forward order, then "loss"
        full_p = facts.by_block.get(act.block, 0) * p_bytes
        full_g = facts.gradients_by_block.get(act.block, 0) * g_bytes
        if lora is not None:
            full_p, full_g = lora.get(act.block, (0, 0))
        resident_p, resident_g = int(full_p * share.parameters), int(full_g * share.gradients)
        # ZeRO-3/FSDP all-gathers a unit's full parameters while it runs (and prefetches the next one).
        gathered = 2 * (full_p - resident_p) if share.parameters < 1 else 0
        transient_g = full_g - resident_g if share.gradients < 1 else 0
        saved_casts = 0 if act.checkpointed else act.weight_cast_bytes
        out.append(timeline.BlockMemory(
            name=act.block,
            param_bytes=resident_p,
            grad_bytes=resident_g,
            gathered_param_bytes=gathered,
            transient_grad_bytes=transient_g,
            kept_bytes=act.kept_total_bytes,
            saved_bytes=act.saved_bytes + act.weight_cast_bytes,
            forward_transient_bytes=act.forward_transient_bytes,
            backward_transient_bytes=act.backward_transient_bytes,
            checkpointed=act.checkpointed,
            forward_cache_bytes=max(act.autocast_cache_bytes - saved_casts, 0),
            retained_bytes=act.retained_output_bytes,
        ))
    return tuple(out)


@dataclass(frozen=True)
class _Prepared:
    spec: ModelSpec | None  # None for a traced model (user code, HF config outside the families)
    inst: Instance
    cfg: TrainConfig
    world: int
    rt: RuntimeConstants
    counts: dict[str, int]
    step: timeline.StepMemory
    activations: tuple  # planner.memory.activations.BlockActivations per block, then "loss"
    share: parallel.Sharding
    fragmentation_given: bool  # the user (runtime override) or calibration set `fragmentation`
    throughput_scale: float | None  # measured/predicted speed of this GPU family (`planner calibrate`)
    name: str = ""
    notes: tuple[str, ...] = ()
    stack: SoftwareStack | None = None
    context: tuple[int, int, int, str] = (0, 0, 0, "")  # (point, low, high, why) of the CUDA context
    given: frozenset[str] = frozenset()  # runtime fields the user fixed (no band on them)
    fragmentation_range: tuple[float, ...] = ()  # calibrated [min, max] reserved/allocated - 1
    traced: Any = None  # planner.program.trace.StepTrace of a traced model (its events feed the allocator)


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
_RUNTIME: dict[tuple, tuple] = caches.table("planner.estimate._RUNTIME", scope="step",
    key="(GPU, transformer layers, attention, calibration) -> runtime constants and stack")


def _prepare(model, config, instance, runtime, backend, model_options, stack=None) -> _Prepared:
    """Everything `estimate` needs before the verdict: resolved inputs and the step's memory per block."""
    from planner.memory.runtime import (
        calibrated_values,
        calibration_entry,
        load_calibration,
        runtime_constants,
    )
    spec = _resolve_model(model, model_options)
    inst = _resolve_instance(instance)
    cfg = parallel.resolve_parallelism(config, inst)
    calibration = load_calibration()  # read once: the runtime constants and the throughput scale use it
    families = [t.family for t in spec.transformers]
    key = (id(inst.gpu), tuple(families), cfg.attention, id(calibration))
    hit = _RUNTIME.get(key) if stack is None and runtime is None else None
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
        if stack is None and runtime is None:
            if len(_RUNTIME) >= ACTIVATION_CACHE_SIZE:
                _RUNTIME.clear()
            _RUNTIME[key] = (inst.gpu, calibration, (rt, view, cfg.attention))
    check_supported(spec, cfg, inst)
    world = parallel.world_size(cfg, inst)
    share = parallel.sharding(cfg, world)
    # A flat fragmentation is honoured only when given: explicit RuntimeConstants, an override, calibration.
    fragmentation_given = (isinstance(runtime, RuntimeConstants) or "fragmentation" in (runtime or {})
                           or "fragmentation" in calibrated_values(calibration, inst.gpu.family))

    facts = _model_facts(spec)
    counts = dict(facts.counts)
    total_params = counts["total"]
    p_bytes = model_states.parameter_dtype_bytes(cfg.precision)

    activations = _activations(spec, cfg, backend, inst.gpu.flash_attention)
    block_mem = _block_memory(spec, activations, cfg, share)

    full_grad_bytes = model_states.gradient_bytes(total_params, cfg)
    # optimizers keep states only for tensors with a .grad (facts.gradient_shapes)
    if cfg.lora:  # only the adapters train (planner.adapters.lora): their fp32 gradients and states
        from planner.adapters.lora import ADAPTER_BYTES, lora_counts, plan

        lora = plan(spec, cfg)
        counts = lora_counts(spec, lora)
        full_grad_bytes = lora.trainable * ADAPTER_BYTES
        states = optimizer.optimizer_state_bytes(lora.shapes, cfg, ADAPTER_BYTES, share.optimizer_states)
        opt_temp = optimizer.optimizer_temporary_bytes(lora.shapes, cfg, ADAPTER_BYTES, share.optimizer_states)
    else:
        states, opt_temp = _optimizer_bytes(facts, cfg, p_bytes, share.optimizer_states)
    micro_batch = batch_mem.micro_batch_bytes(spec, cfg)
    step = timeline.StepMemory(
        blocks=block_mem,
        module_buffer_bytes=facts.buffer_bytes,
        ddp_bucket_bytes=parallel.ddp_bucket_bytes(cfg, full_grad_bytes),
        workspace_bytes=rt.cublas_workspace_bytes,
        batch_bytes=micro_batch,
        optimizer_state_bytes=states,
        optimizer_temporary_bytes=opt_temp,
        grads_resident=cfg.grad_accum > 1 or sw.zero_grad_keeps_gradients(view.stack, cfg.parallelism,
                                                                           cfg.optimizer_impl),
        extra_forward_bytes=parallel.dataparallel_gpu0_extra(spec, cfg, inst.gpus),
    )
    scale = calibration_entry(calibration, inst.gpu.family).get("throughput_scale")
    return _Prepared(spec, inst, cfg, world, rt, counts, step, tuple(activations), share, fragmentation_given,
                     scale, spec.name, (*_notes(spec, cfg), *inst.gpu.assumptions, *inst.assumptions), view.stack, view.context, view.given,
                     view.fragmentation_range)


def memory_timeline(model: ModelSpec | str, config: TrainConfig, instance: Instance | str, *,
                    runtime: RuntimeConstants | dict[str, Any] | None = None, backend: str = "cuda",
                    model_options: dict[str, Any] | None = None,
                    stack: SoftwareStack | dict[str, Any] | None = None) -> list[timeline.Point]:
    """The allocated bytes by category at each block of one step (what `--plot` draws)."""
    return timeline.simulate(_prepare(model, config, instance, runtime, backend, model_options, stack).step)


def estimate(
    model: ModelSpec | str,
    config: TrainConfig,
    instance: Instance | str,
    *,
    runtime: RuntimeConstants | dict[str, Any] | None = None,
    backend: str = "cuda",
    model_options: dict[str, Any] | None = None,
    dataset_size: int | None = None,
    spot: bool = False,
    with_throughput: bool = True,
    expandable_segments: bool = False,
    inputs: str | None = None,
    loss: str | None = None,
    stack: SoftwareStack | dict[str, Any] | None = None,
    region: str | None = None,
    run: Any = None,
) -> Estimate:
    """Per-GPU memory of one training step by phase, the OOM verdict, throughput and cost.

    `config.batch_size` is the micro-batch of one GPU. `runtime` overrides the GPU family's runtime
    constants (a RuntimeConstants or a dict of its fields). `peak_reserved` comes from replaying the step's
    tensors through the caching-allocator model (`planner.memory.reserved`) unless a fragmentation is given
    (explicit RuntimeConstants, a `fragmentation` override, or calibration): then allocated × (1 + it).
    `expandable_segments`: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True. A `model` of the form
    `file.py:build` is the user's own module, traced (`planner.program`) with `inputs` (`file.py:batch`) and
    `loss` (`file.py:fn`); so is a config.json whose model_type is none of the six hand-modelled families.
    `stack`: the software stack (a SoftwareStack or a dict with any of torch, cuda,
    transformers, alloc_conf; None = the DLC `probe launch` would use): it decides the CUDA context, the
    workspaces, `config.attention` "auto" and expandable segments. `verdict` comes from the band of the
    whole-device peak (`planner.memory.band`): `fits` only when its high end is under the GPU's memory.
    `region`: where the instance is priced (None: us-east-1); no price there leaves the cost out.
    `run`: a `planner.run.simulate.RunRequest` (--lengths): the run of varying lengths replayed step after
    step; `run` then holds its peaks and the verdict follows them (`planner.run.simulate.apply_run`).
    """
    from planner.models.user_module import is_reference, refuse_inputs_unless_own
    from planner.program.sources import is_traced_config, require_tracing_libraries
    from planner.spec import MAX_DATASET_SIZE

    if dataset_size is not None and not 1 <= dataset_size <= MAX_DATASET_SIZE:
        raise PlannerError("--dataset-size", dataset_size, f"an integer >= 1 and <= {MAX_DATASET_SIZE:,} (2^53)")
    refuse_inputs_unless_own(model, inputs, loss)
    if is_reference(model) or is_traced_config(model):
        if run is not None:
            raise PlannerError("--lengths", run.lengths.text, "runs of varying length for catalog models and "
                               "config.json files of the modelled families (a traced module is one step)")
        require_tracing_libraries(str(model))
        prep = _prepare_traced(str(model), config, instance, runtime, backend, model_options, inputs, loss, stack)
    else:
        prep = _prepare(model, config, instance, runtime, backend, model_options, stack)
    est = _finish(prep, dataset_size, spot, with_throughput, expandable_segments, backend, region)
    if run is None:
        return est
    from planner.run.simulate import StepsAt, apply_run

    return apply_run(est, prep, run, StepsAt(prep, runtime, backend, model_options, stack, run_steps()),
                     expandable=expandable_segments or prep.stack.expandable_segments,
                     with_throughput=with_throughput, dataset_size=dataset_size, spot=spot)


def _finish(prep: _Prepared, dataset_size: int | None, spot: bool, with_throughput: bool,
            expandable_segments: bool, backend: str, region: str | None = None) -> Estimate:
    """The verdict, phases, speed and cost from the prepared step (analytic or traced)."""
    from planner.memory.reserved import replay_step
    from planner.memory.runtime import nccl_bytes

    spec, inst, cfg, world, rt, counts, step = (prep.spec, prep.inst, prep.cfg, prep.world, prep.rt, prep.counts,
                                                prep.step)
    states = step.optimizer_state_bytes
    micro_batch = step.batch_bytes
    block_mem = step.blocks
    peaks, top = _timeline_peaks(step)

    peak_allocated = top.total
    # DataParallel is one process but still moves tensors between its GPUs through NCCL.
    nccl = nccl_bytes(rt, inst.gpus if strategy_of(cfg.parallelism).one_process else world)
    gpu_memory = inst.gpu.reported_memory_bytes or inst.gpu.memory_bytes
    alloc = None
    replicated = prep.share.parameters == prep.share.gradients == prep.share.optimizer_states == 1
    if prep.fragmentation_given or (spec is None and (prep.traced is None or not replicated
                                                      or strategy_of(cfg.parallelism).one_process)):
        peak_reserved = int(peak_allocated * (1 + rt.fragmentation))
    elif spec is None:  # a traced model: its own storage events through the allocator model
        from planner.program.replay import replay_trace

        alloc = replay_trace(prep.traced, ddp_bucket_bytes=step.ddp_bucket_bytes,
                             bucket_cap_bytes=int(cfg.bucket_cap_mb * 2**20), workspace_bytes=step.workspace_bytes,
                             capacity_bytes=gpu_memory - rt.cuda_context_bytes - nccl,
                             expandable_segments=expandable_segments or prep.stack.expandable_segments)
        peak_reserved = max(alloc.peak_reserved, peak_allocated)
    else:
        alloc = replay_step(spec, cfg, step, prep.activations, parameter_share=prep.share.parameters,
                            gradient_share=prep.share.gradients, state_share=prep.share.optimizer_states,
                            capacity_bytes=gpu_memory - rt.cuda_context_bytes - nccl,
                            expandable_segments=expandable_segments or prep.stack.expandable_segments,
                            backend=backend,
                            flash_ok=inst.gpu.flash_attention)
        # The allocator's reserved peak, never under the allocated peak of the timeline.
        peak_reserved = max(alloc.peak_reserved, peak_allocated)
    peak_device = rt.cuda_context_bytes + nccl + peak_reserved
    # The verdict uses what the driver reports as total (V100-16GB: 16160 MiB), not the marketed size.
    usable = gpu_memory - rt.cuda_context_bytes - nccl
    headroom = gpu_memory - peak_device
    terms = _band_terms(prep, peak_allocated, peak_reserved, nccl, replayed=alloc is not None)
    low, _, high = band.totals(terms)
    verdict = band.verdict(low, high, gpu_memory)

    memory = MemoryBytes(
        parameters=sum(b.param_bytes for b in block_mem),
        gradients=sum(b.grad_bytes for b in block_mem),
        optimizer_states=states,
        activations=sum(b.kept_bytes for b in block_mem),
        batch=micro_batch,
        buffers=top.bytes["buffers"],
        peak_allocated=peak_allocated,
        peak_reserved=peak_reserved,
        cuda_context=rt.cuda_context_bytes,
        nccl=nccl,
        peak_device=peak_device,
    )
    phases = tuple(PhasePeak(phase=name, allocated=p.total, detail=dict(p.bytes)) for name, p in peaks.items())

    throughput = cost = None
    if with_throughput and (spec is not None or prep.traced is not None):
        throughput, cost = _speed_and_cost(spec, cfg, inst, dataset_size, spot, prep.throughput_scale, prep.traced,
                                            region)

    return Estimate(
        model=prep.name,
        instance=inst.name,
        gpu=inst.gpu.name,
        config=cfg,
        world_size=world,
        parameters=counts,
        memory_bytes=memory,
        phases=phases,
        peak_phase=top.phase,
        gpu_memory_bytes=gpu_memory,
        usable_memory_bytes=usable,
        fits=verdict == "fits",
        headroom_bytes=headroom,
        verdict=verdict,
        peak_device_low_bytes=low,
        peak_device_high_bytes=high,
        runtime=rt,
        stack=prep.stack,
        band=terms,
        allocator=alloc,
        throughput=throughput,
        cost=cost,
        notes=prep.notes,
    )


_PEAKS: dict[timeline.StepMemory, tuple[dict[str, timeline.Point], timeline.Point]] = caches.table("planner.estimate._PEAKS", scope="step",
    key="StepMemory -> its timeline peaks")


def _timeline_peaks(step: timeline.StepMemory) -> tuple[dict[str, timeline.Point], timeline.Point]:
    """(peak point per phase, the highest point) of the step's block timeline, cached per step: a search
    meets one step on many instance types and counts. Callers copy what they keep (`Point.bytes` is a dict)."""
    hit = _PEAKS.get(step)
    if hit is None:
        if len(_PEAKS) >= ACTIVATION_CACHE_SIZE:
            _PEAKS.clear()
        hit = _PEAKS[step] = timeline.peaks(step)
    return hit


def _band_terms(prep: _Prepared, allocated: int, reserved: int, nccl: int, replayed: bool = False) -> tuple:
    """The whole-device peak term by term, each with its band (planner.memory.band)."""
    workspace = prep.step.workspace_bytes
    terms = (
        band.exact("tensors", allocated - workspace, "exact: parameters, gradients, optimizer states, "
                   "activations, batch and temporaries, checked against real modules"),
        band.workspace_term(workspace, "cublas_workspace_bytes" in prep.given),
        band.reserved_pool_term(allocated, reserved, given="fragmentation" in prep.given, replayed=replayed,
                                calibrated_range=prep.fragmentation_range or None),
        band.context_term(*prep.context),
        band.nccl_term(nccl, "nccl_bytes_per_peer" in prep.given),
    )
    torch = sw.parse_version("torch", prep.stack.torch) if prep.stack else None
    _, point, _ = band.totals(terms)
    return (*terms, band.legacy_gap_term(point, torch, calibrated=bool(prep.fragmentation_range)))


def _prepare_traced(ref: str, config: TrainConfig, instance: Instance | str, runtime, backend: str,
                    model_options: dict[str, Any] | None, inputs: str | None, loss: str | None,
                    stack: SoftwareStack | dict[str, Any] | None = None) -> _Prepared:
    """`_prepare` for a traced model: the same step memory, with each block's saved / kept bytes, transients
    and parameters measured by the tracer (blocks = the module's top-level children, then the loss)."""
    from planner.memory.runtime import (
        calibrated_values,
        calibration_entry,
        load_calibration,
        runtime_constants,
    )
    from planner.program.sources import model_trace

    inst = _resolve_instance(instance)
    cfg = parallel.resolve_parallelism(config, inst)
    calibration = load_calibration()
    rt = runtime if isinstance(runtime, RuntimeConstants) else runtime_constants(inst.gpu, runtime or None,
                                                                                 calibration=calibration)
    # A traced module has no model type to look up: "auto" resolves to the SDPA default of current stacks.
    cfg, rt, view = _with_stack([], cfg, inst, stack, runtime, calibration, rt)
    check_supported(None, cfg, inst)
    world = parallel.world_size(cfg, inst)
    share = parallel.sharding(cfg, world)
    fragmentation_given = (isinstance(runtime, RuntimeConstants) or "fragmentation" in (runtime or {})
                           or "fragmentation" in calibrated_values(calibration, inst.gpu.family))

    def trace(checkpointing: bool):
        return model_trace(ref, cfg.model_copy(update={"checkpointing": checkpointing}), options=model_options,
                          inputs=inputs, loss=loss, backend=backend, flash_ok=inst.gpu.flash_attention)

    full = trace(False)
    kept = trace(True) if cfg.checkpointing else full
    kept_by = {b.name: b.saved_bytes + b.retained_bytes for b in kept.blocks}
    p_bytes = model_states.parameter_dtype_bytes(cfg.precision)
    g_bytes = model_states.gradient_dtype_bytes(cfg.precision)
    blocks = []
    for b in full.blocks:
        # with adapters only the trainable parameters get gradients (fp32 adapters: planner.adapters.traced)
        trained = full.block_trainable.get(b.name, 0) if full.block_trainable else b.parameters
        full_p, full_g = b.parameters * p_bytes, trained * (4 if full.block_trainable else g_bytes)
        resident_p, resident_g = int(full_p * share.parameters), int(full_g * share.gradients)
        keep = kept_by.get(b.name, b.saved_bytes + b.retained_bytes) - b.retained_bytes
        blocks.append(timeline.BlockMemory(
            name=b.name, param_bytes=resident_p, grad_bytes=resident_g,
            gathered_param_bytes=2 * (full_p - resident_p) if share.parameters < 1 else 0,
            transient_grad_bytes=full_g - resident_g if share.gradients < 1 else 0,
            kept_bytes=keep, saved_bytes=b.saved_bytes, forward_transient_bytes=b.forward_transient_bytes,
            backward_transient_bytes=b.backward_transient_bytes, checkpointed=keep < b.saved_bytes,
            retained_bytes=b.retained_bytes))
    total = full.parameters["total"]
    shapes = list(full.gradient_shapes)
    opt_bytes = 4 if full.block_trainable else p_bytes  # adapters are fp32 whatever the precision
    dp_extra = 0
    if strategy_of(cfg.parallelism).one_process:  # the whole batch and every replica's outputs on GPU 0 (parallel.dataparallel_gpu0_extra)
        dp_extra = full.batch_bytes * (inst.gpus - 1) + sum(b.retained_bytes for b in full.blocks) * inst.gpus
    step = timeline.StepMemory(
        blocks=tuple(blocks),
        module_buffer_bytes=full.buffer_bytes,
        ddp_bucket_bytes=parallel.ddp_bucket_bytes(cfg, model_states.gradient_bytes(full.parameters.get(
            "trainable", total), cfg)),
        workspace_bytes=rt.cublas_workspace_bytes,
        batch_bytes=full.batch_bytes,
        optimizer_state_bytes=optimizer.optimizer_state_bytes(shapes, cfg, opt_bytes, share.optimizer_states),
        optimizer_temporary_bytes=optimizer.optimizer_temporary_bytes(shapes, cfg, opt_bytes,
                                                                      share.optimizer_states),
        grads_resident=cfg.grad_accum > 1 or sw.zero_grad_keeps_gradients(view.stack, cfg.parallelism,
                                                                           cfg.optimizer_impl),
        extra_forward_bytes=dp_extra,
    )
    notes = ["traced on CPU fake tensors, mapped to what CUDA does; throughput from the traced ops",
             *full.notes, *_notes(None, cfg), *inst.gpu.assumptions, *inst.assumptions]
    if cfg.checkpointing and not kept.checkpointed:
        notes.append("checkpointing: the module offers none; activations are the full forward's")
    scale = calibration_entry(calibration, inst.gpu.family).get("throughput_scale")
    if not fragmentation_given and (strategy_of(cfg.parallelism).one_process or min(share.parameters, share.gradients,
                                                                   share.optimizer_states) < 1):
        notes.append(f"peak reserved = allocated × (1 + {rt.fragmentation}): the traced allocator replay covers "
                     "replicated single/DDP steps only")
    return _Prepared(None, inst, cfg, world, rt, dict(full.parameters), step, (), share, fragmentation_given,
                     scale, full.name, tuple(notes), view.stack, view.context, view.given, view.fragmentation_range,
                     kept)


def _speed_and_cost(spec: ModelSpec | None, cfg: TrainConfig, inst: Instance, dataset_size: int | None, spot: bool,
                    scale: float | None, traced: Any = None, region: str | None = None):
    """Throughput (the analytic kernel list, or a traced model's own ops), and cost at the instance's price
    (the refreshed cache when present, else the embedded table; `predict_cost` records which, with its date)."""
    from planner.perf.cost import predict_cost
    from planner.perf.throughput import predict_throughput

    if spec is None:
        from planner.program.speed import traced_throughput

        throughput = _calibrated(traced_throughput(traced, cfg, inst), scale)
    else:
        throughput = _calibrated(predict_throughput(spec, cfg, inst), scale)
    try:
        cost = predict_cost(throughput, inst, instances=cfg.instances, dataset_size=dataset_size, spot=spot,
                            region=region)
    except PlannerError as exc:  # no price known for this instance type; a corrupt prices cache stays an error
        if exc.field != "--instance":
            raise
        cost = None
    return throughput, cost


def _calibrated(throughput: Throughput, scale: float | None) -> Throughput:
    """Scale speed by the measured/predicted median of this GPU family (`planner calibrate`), if any."""
    if not scale or scale == 1:
        return throughput
    t = throughput
    return t.model_copy(update={"step_time_s": t.step_time_s / scale, "samples_per_s": t.samples_per_s * scale,
                                "tokens_per_s": t.tokens_per_s * scale, "mfu": t.mfu * scale,
                                "breakdown_s": t.breakdown_s | {"calibration_scale": scale}})


def _notes(spec: ModelSpec | None, cfg: TrainConfig) -> list[str]:
    """Notes on the configuration (spec None: a traced model, no model-specific notes)."""
    notes = []
    if strategy_of(cfg.parallelism).ddp_buckets and not cfg.gradient_as_bucket_view:
        notes.append("DDP keeps gradient buckets as large as the gradients; gradient_as_bucket_view=True "
                     "would save them")
    if strategy_of(cfg.parallelism).one_process:
        notes.append("nn.DataParallel: GPU 0 also holds the whole batch and the gathered outputs; DDP is "
                     "faster and balanced")
    if spec is not None and cfg.checkpointing and not spec.transformers:
        notes.append("checkpointing applies to transformer layers; this model has none")
    if spec is not None and cfg.lora:
        from planner.adapters.lora import describe, plan

        notes.append(describe(plan(spec, cfg), cfg))
        if cfg.base_dtype == "nf4" and not cfg.checkpointing:
            notes.append("QLoRA: peft's prepare_model_for_kbit_training turns gradient checkpointing on by "
                         "default; this estimate has it off (--checkpointing to match)")
    return notes


def clear_caches() -> None:
    """Forget every cached intermediate of one configuration (benchmarks of a cold start; tests): the tables
    of scope "step" (planner.caches). Per-model tables (kernel tables, blocks) and data files stay warm, as in
    a search; `planner.caches.clear()` empties those too."""
    from planner.memory import reserved  # noqa: F401  (its tables exist once it is imported)

    caches.clear("step")


def run_steps():
    """This pipeline's steps as a run repeats them at each length (planner.run.simulate.EstimateSteps)."""
    from planner.run.simulate import EstimateSteps

    return EstimateSteps(prepare=_prepare, calibrated=_calibrated, timeline_peaks=_timeline_peaks,
                         band_terms=_band_terms)
