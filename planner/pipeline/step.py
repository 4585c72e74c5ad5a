"""Step 2 of the estimate pipeline, step: one training step's memory by block (`timeline.StepMemory`), from
the analytic families (planner.memory.activations reading planner.families) or from the tracer
(planner.program); both front ends produce the same `_Prepared` record for the verdict.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from planner import caches
from planner.identity_cache import per_object
from planner.ir.context import Ctx
from planner.memory import batch as batch_mem
from planner.memory import framework_layout, model_states, optimizer, parallel, timeline
from planner.memory import stack as sw
from planner.parallel import get as strategy_of
from planner.pipeline.resolve import (
    _resolve_model,
    resolve,
)
from planner.spec import (
    Instance,
    ModelSpec,
    RuntimeConstants,
    SoftwareStack,
    TrainConfig,
)


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


_MODEL_FACTS: dict[int, tuple] = caches.table("planner.pipeline.step._MODEL_FACTS", scope="step",
    key="ModelSpec identity (identity_cache.per_object): its _ModelFacts")


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
_ACTIVATIONS: dict[tuple, tuple] = caches.table("planner.pipeline.step._ACTIVATIONS", scope="step",
    key="(model identity, TrainConfig's ACTIVATION_FIELDS, backend, flash) -> activation records")
ACTIVATION_CACHE_SIZE = 4096  # distinct (model, shape) entries kept


def _activations(spec: ModelSpec, cfg: TrainConfig, ctx: Ctx) -> tuple:
    """`activation_blocks` under the resolved context record `ctx`, cached per model object and the fields it
    reads: a search evaluates one shape on many instance types and counts, and this is the costliest part of
    preparing an estimate."""
    from planner.memory.activations import activation_blocks

    backend = ctx.backend
    key = (id(spec), *(getattr(cfg, f) for f in ACTIVATION_FIELDS), ctx)
    hit = _ACTIVATIONS.get(key)
    if hit is None or hit[0] is not spec:
        if len(_ACTIVATIONS) >= ACTIVATION_CACHE_SIZE:
            _ACTIVATIONS.clear()
        records = tuple(activation_blocks(spec, cfg, ctx=ctx))
        if cfg.lora:  # a frozen base saves less; the adapters add their own (planner.adapters.activations)
            from planner.adapters.activations import lora_activations
            from planner.adapters.lora import plan

            records = lora_activations(spec, cfg, records, plan(spec, cfg), backend, ctx=ctx)
        hit = _ACTIVATIONS[key] = (spec, records)
    return hit[1]


_BLOCKS: dict[tuple, tuple] = caches.table("planner.pipeline.step._BLOCKS", scope="step",
    key="(model identity, shape fields, shares) -> per-block memory")


def _block_memory(model: ModelSpec, activations: tuple, config: TrainConfig,
                  share: parallel.Sharding, lay: framework_layout.StateLayout | None = None
                  ) -> tuple[timeline.BlockMemory, ...]:
    """Each block (and the final "loss" entry of `activations`) as resident on this GPU; cached per model,
    activation records (one object per shape, `_activations`), dtypes and sharding: a search meets one shape
    on many instance types and counts."""
    lay = lay or framework_layout.layout(config)
    p_bytes, g_bytes = lay.param_bytes, lay.grad_bytes
    lora = _lora_key(config)
    key = (id(model), id(activations), p_bytes, g_bytes, share, lora, lay)
    hit = _BLOCKS.get(key)
    if hit is not None and hit[0] is model and hit[1] is activations:
        return hit[2]
    blocks = _resident_blocks(model, activations, p_bytes, g_bytes, share, _lora_bytes(model, config), lay)
    if len(_BLOCKS) >= ACTIVATION_CACHE_SIZE:
        _BLOCKS.clear()
    _BLOCKS[key] = (model, activations, blocks)
    return blocks


def _lora_key(config: TrainConfig) -> tuple | None:
    """The TrainConfig fields a LoRA plan reads (None: full fine-tuning)."""
    return (config.lora_r, config.lora_targets, config.base_dtype) if config.lora else None


def _lora_bytes(model: ModelSpec, config: TrainConfig) -> dict[str, tuple[int, int, int, int]] | None:
    """Block -> (parameter bytes, gradient bytes, parameters, trainable parameters) of a LoRA run
    (planner.adapters.lora); None without one."""
    if not config.lora:
        return None
    from planner.adapters.lora import plan

    return {name: (b.param_bytes, b.grad_bytes, b.trainable + b.frozen, b.trainable)
            for name, b in plan(model, config).blocks.items()}


def _resident_blocks(model: ModelSpec, activations: tuple, p_bytes: int, g_bytes: int,
                     share: parallel.Sharding, lora: dict[str, tuple[int, int, int, int]] | None = None,
                     lay: framework_layout.StateLayout | None = None) -> tuple[timeline.BlockMemory, ...]:
    facts = _model_facts(model)
    out = []
    for act in activations:  # every block in forward order, then "loss"
        n_params = facts.by_block.get(act.block, 0)
        n_trained = facts.gradients_by_block.get(act.block, 0)
        full_p, full_g = n_params * p_bytes, n_trained * g_bytes
        if lora is not None:
            full_p, full_g, n_params, n_trained = lora.get(act.block, (0, 0, 0, 0))
        laid = lay.block_bytes(share.parameters, share.gradients, n_params, full_p, n_trained, full_g) if lay else None
        resident_p, resident_g, gathered, transient_g = laid or share.block_bytes(full_p, full_g)
        saved_casts = 0 if act.checkpointed else act.weight_cast_bytes
        cache = max(act.autocast_cache_bytes - saved_casts, 0) if lay is None or lay.autocast_cache else 0
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
            forward_cache_bytes=cache,
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
    ctx: Ctx | None = None  # the context record resolve built (planner.pipeline.resolve.Resolved.ctx)


def _loop_fields(cfg: TrainConfig, outputs: int) -> dict[str, Any]:
    """The StepMemory fields of `--loop` and `--load` (planner.memory.loops); `outputs`: the 16-bit bytes of
    the outputs the loop holds (the blocks' retained bytes)."""
    from planner.memory import loops

    rule = loops.rule(cfg.loop)
    if cfg.lora:
        from planner.adapters.lora import DTYPE_BYTES, base_dtype

        stored = DTYPE_BYTES.get(base_dtype(cfg), 4)  # nf4: quantized while loading, never cast
    else:
        stored = model_states.parameter_dtype_bytes(cfg.precision)
    return {"outputs_die": rule.outputs_die, "grads_die": rule.grads_die,
            "build_ratio": loops.build_ratio(cfg.load, stored),
            "outputs_fp32_bytes": 2 * outputs if rule.outputs_to_fp32 and cfg.precision.startswith("amp-") else 0}


def _framework_state_bytes(lay: framework_layout.StateLayout, trained: int, share: parallel.Sharding
                           ) -> tuple[int, int]:
    """(optimizer states, step temporaries) a framework adds for `trained` parameters: Megatron's and
    DeepSpeed's fp32 master weights beside the states, DeepSpeed's fp32 gradient partition at the step."""
    return (int(trained * lay.master_bytes * share.optimizer_states),
            int(trained * lay.step_grad_bytes * share.optimizer_states))


def _gradient_buffer_bytes(lay: framework_layout.StateLayout, cfg: TrainConfig, full_grad_bytes: int) -> int:
    """The framework's own gradient buffers where they replace DDP's buckets, else DDP's buckets."""
    return lay.bucket_bytes() if lay.replace_ddp_buckets else parallel.ddp_bucket_bytes(cfg, full_grad_bytes)


def _optimizer_config(cfg: TrainConfig, lay: framework_layout.StateLayout) -> TrainConfig:
    """Megatron and DeepSpeed step Adam with fused multi-tensor kernels whatever the loop would pick
    (megatron/core/optimizer/__init__.py imports Transformer Engine's / apex's FusedAdam; deepspeed/runtime/
    engine.py _configure_basic_optimizer builds FusedAdam for Adam/AdamW without CPU offload)."""
    if lay.kind in ("megatron", "deepspeed") and cfg.optimizer in ("adam", "adamw"):
        return cfg.model_copy(update={"optimizer_impl": "fused"})
    return cfg


def _prepare(model, config, instance, runtime, backend, model_options, stack=None,
             calibration: dict[str, Any] | None = None) -> _Prepared:
    """Everything `estimate` needs before the verdict: resolved inputs and the step's memory per block.
    `calibration` None reads the calibration file (planner.memory.runtime.load_calibration)."""
    spec = _resolve_model(model, model_options)
    r = resolve(spec, config, instance, runtime, stack, calibration, backend)
    inst, cfg, world, share, rt, view = r.inst, r.cfg, r.world, r.share, r.rt, r.view

    facts = _model_facts(spec)
    counts = dict(facts.counts)
    total_params = counts["total"]
    lay = framework_layout.layout(cfg)
    p_bytes = lay.state_param_bytes

    # a 16-bit model without autocast (FSDP's policy, Megatron, DeepSpeed) saves what pure 16-bit training does
    act_cfg, act_ctx = (cfg, r.ctx) if lay.activation_precision == cfg.precision else (
        cfg.model_copy(update={"precision": lay.activation_precision}),
        replace(r.ctx, precision=lay.activation_precision))
    activations = _activations(spec, act_cfg, act_ctx)
    block_mem = _block_memory(spec, activations, cfg, share, lay)

    full_grad_bytes = model_states.gradient_bytes(total_params, cfg)
    # optimizers keep states only for tensors with a .grad (facts.gradient_shapes)
    if cfg.lora:  # only the adapters train (planner.adapters.lora): their fp32 gradients and states
        from planner.adapters.lora import ADAPTER_BYTES, lora_counts, plan

        lora = plan(spec, cfg)
        counts = lora_counts(spec, lora)
        full_grad_bytes = lora.trainable * ADAPTER_BYTES
        states = optimizer.optimizer_state_bytes(lora.shapes, cfg, ADAPTER_BYTES, share.optimizer_states)
        opt_temp = optimizer.optimizer_temporary_bytes(lora.shapes, cfg, ADAPTER_BYTES, share.optimizer_states)
        trained = lora.trainable
    else:
        states, opt_temp = _optimizer_bytes(facts, _optimizer_config(cfg, lay), p_bytes, share.optimizer_states)
        trained = sum(facts.gradients_by_block.values()) or total_params
    extra_states, extra_temp = _framework_state_bytes(lay, trained, share)
    states, opt_temp = states + extra_states, opt_temp + extra_temp
    micro_batch = batch_mem.micro_batch_bytes(spec, cfg)
    step = timeline.StepMemory(
        blocks=block_mem,
        module_buffer_bytes=facts.buffer_bytes,
        ddp_bucket_bytes=_gradient_buffer_bytes(lay, cfg, full_grad_bytes),
        workspace_bytes=rt.cublas_workspace_bytes,
        batch_bytes=micro_batch,
        optimizer_state_bytes=states,
        optimizer_temporary_bytes=opt_temp,
        grads_resident=cfg.grad_accum > 1 or lay.grads_resident or sw.zero_grad_keeps_gradients(
            view.stack, cfg.parallelism, cfg.optimizer_impl),
        extra_forward_bytes=parallel.dataparallel_gpu0_extra(spec, cfg, inst.gpus),
        **_loop_fields(cfg, sum(b.retained_bytes for b in block_mem)),
    )
    return _Prepared(spec, inst, cfg, world, rt, counts, step, tuple(activations), share, r.fragmentation_given,
                     r.throughput_scale, spec.name, (*_notes(spec, cfg), *inst.gpu.assumptions, *inst.assumptions),
                     view.stack, view.context, view.given,
                     view.fragmentation_range, ctx=r.ctx)


def _prepare_traced(ref: str, config: TrainConfig, instance: Instance | str, runtime, backend: str,
                    model_options: dict[str, Any] | None, inputs: str | None, loss: str | None,
                    stack: SoftwareStack | dict[str, Any] | None = None,
                    calibration: dict[str, Any] | None = None) -> _Prepared:
    """`_prepare` for a traced model: the same step memory, with each block's saved / kept bytes, transients
    and parameters measured by the tracer (blocks = the module's top-level children, then the loss)."""
    from planner.program.sources import model_trace

    r = resolve(None, config, instance, runtime, stack, calibration, backend)
    inst, cfg, world, share, rt, view = r.inst, r.cfg, r.world, r.share, r.rt, r.view
    fragmentation_given = r.fragmentation_given

    def trace(checkpointing: bool):
        return model_trace(ref, cfg.model_copy(update={"checkpointing": checkpointing}), options=model_options,
                          inputs=inputs, loss=loss, backend=backend, flash_ok=inst.gpu.flash_attention)

    full = trace(False)
    kept = trace(True) if cfg.checkpointing else full
    kept_by = {b.name: b.saved_bytes + b.retained_bytes for b in kept.blocks}
    from planner.adapters.lora import ADAPTER_BYTES  # fp32 adapters: one constant for both front ends

    lay = framework_layout.layout(cfg)  # the framework's dtypes (the trace itself runs as --precision says)
    p_bytes, g_bytes = lay.param_bytes, lay.grad_bytes
    blocks = []
    for b in full.blocks:
        # with adapters only the trainable parameters get gradients (fp32 adapters: planner.adapters.traced)
        trained = full.block_trainable.get(b.name, 0) if full.block_trainable else b.parameters
        full_p, full_g = b.parameters * p_bytes, trained * (ADAPTER_BYTES if full.block_trainable else g_bytes)
        laid = lay.block_bytes(share.parameters, share.gradients, b.parameters, full_p, trained, full_g)
        resident_p, resident_g, gathered, transient_g = laid or share.block_bytes(full_p, full_g)
        keep = kept_by.get(b.name, b.saved_bytes + b.retained_bytes) - b.retained_bytes
        blocks.append(timeline.BlockMemory(
            name=b.name, param_bytes=resident_p, grad_bytes=resident_g,
            gathered_param_bytes=gathered, transient_grad_bytes=transient_g,
            kept_bytes=keep, saved_bytes=b.saved_bytes, forward_transient_bytes=b.forward_transient_bytes,
            backward_transient_bytes=b.backward_transient_bytes, checkpointed=keep < b.saved_bytes,
            retained_bytes=b.retained_bytes))
    total = full.parameters["total"]
    shapes = list(full.gradient_shapes)
    opt_bytes = ADAPTER_BYTES if full.block_trainable else lay.state_param_bytes  # adapters are fp32 whatever the precision
    trained_total = full.parameters.get("trainable", total)
    extra_states, extra_temp = _framework_state_bytes(lay, trained_total, share)
    dp_extra = 0
    one_process = strategy_of(cfg.parallelism).one_process
    if one_process:  # the whole batch and every replica's outputs on GPU 0: the analytic model's formula
        dp_extra = parallel.dataparallel_gpu0_extra_bytes(full.batch_bytes, sum(b.retained_bytes for b in full.blocks),
                                                          inst.gpus)
    step = timeline.StepMemory(
        blocks=tuple(blocks),
        module_buffer_bytes=full.buffer_bytes,
        ddp_bucket_bytes=_gradient_buffer_bytes(lay, cfg, model_states.gradient_bytes(trained_total, cfg)),
        workspace_bytes=rt.cublas_workspace_bytes,
        batch_bytes=full.batch_bytes,
        optimizer_state_bytes=optimizer.optimizer_state_bytes(shapes, cfg, opt_bytes, share.optimizer_states)
        + extra_states,
        optimizer_temporary_bytes=optimizer.optimizer_temporary_bytes(shapes, _optimizer_config(cfg, lay), opt_bytes,
                                                                      share.optimizer_states) + extra_temp,
        grads_resident=cfg.grad_accum > 1 or lay.grads_resident or sw.zero_grad_keeps_gradients(
            view.stack, cfg.parallelism, cfg.optimizer_impl),
        extra_forward_bytes=dp_extra,
        **_loop_fields(cfg, sum(b.retained_bytes for b in blocks)),
    )
    notes = ["traced on CPU fake tensors, mapped to what CUDA does; throughput from the traced ops",
             *full.notes, *_notes(None, cfg), *inst.gpu.assumptions, *inst.assumptions]
    if cfg.checkpointing and not kept.checkpointed:
        notes.append("checkpointing: the module offers none; activations are the full forward's")
    if not fragmentation_given and (one_process or min(share.parameters, share.gradients,
                                                        share.optimizer_states) < 1):
        notes.append(f"peak reserved = allocated × (1 + {rt.fragmentation}): the traced allocator replay covers "
                     "replicated single/DDP steps only")
    return _Prepared(None, inst, cfg, world, rt, dict(full.parameters), step, (), share, fragmentation_given,
                     r.throughput_scale, full.name, tuple(notes), view.stack, view.context, view.given,
                     view.fragmentation_range,
                     kept, ctx=r.ctx)


def _notes(spec: ModelSpec | None, cfg: TrainConfig) -> list[str]:
    """Notes on the configuration (spec None: a traced model, no model-specific notes)."""
    notes = []
    lay = framework_layout.layout(cfg)
    if strategy_of(cfg.parallelism).ddp_buckets and not cfg.gradient_as_bucket_view and not lay.replace_ddp_buckets:
        notes.append("DDP keeps gradient buckets as large as the gradients; gradient_as_bucket_view=True "
                     "would save them")
    layout_line = framework_layout.describe(lay)
    if layout_line and (cfg.framework != "pytorch" or strategy_of(cfg.parallelism).sharding.parameters):
        notes.append(layout_line)
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
