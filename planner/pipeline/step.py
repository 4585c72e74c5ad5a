"""Step 2 of the estimate pipeline, step: one training step's memory by block (`timeline.StepMemory`), from
the analytic families (planner.memory.activations reading planner.families) or from the tracer
(planner.program); both front ends produce the same `_Prepared` record for the verdict.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from planner import caches
from planner.errors import PlannerError
from planner.identity_cache import per_object
from planner.ir.context import Ctx
from planner.memory import batch as batch_mem
from planner.memory import events, framework_layout, model_states, optimizer, parallel, timeline
from planner.memory import stack as sw
from planner.memory.experts import expert_sharding, local_parameters, split_shapes
from planner.parallel import get as strategy_of
from planner.perf.model_parallel import fsdp_gathers_once
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
    # Routed-expert parameters per block (mixture-of-experts layers; planner.memory.experts splits them)
    experts_by_block: dict[str, int] | None = None


_MODEL_FACTS: dict[int, tuple] = caches.table("planner.pipeline.step._MODEL_FACTS", scope="step",
    key="ModelSpec identity (identity_cache.per_object): its _ModelFacts")


def _model_facts(spec: ModelSpec) -> _ModelFacts:
    return per_object(_MODEL_FACTS, spec, _make_model_facts)


def _make_model_facts(spec: ModelSpec) -> _ModelFacts:
    from planner.models.blocks import model_blocks
    from planner.models.params import (
        count_buffers_bytes,
        count_parameters,
        expert_parameters,
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
    experts = {b.name: e for b in model_blocks(spec) if (e := expert_parameters(b))}
    return _ModelFacts(count_parameters(spec), count_buffers_bytes(spec), model_gradient_tensor_shapes(spec),
                       by_block, gradients, {}, experts)


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
                     "lora_dropout", "base_dtype", "recompute", "recompute_modules", "fp8_recipe", "fp8_param_gather",
                     "compile", "tp", "sp", "cp", "ep", "etp", "moe_imbalance")
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
    ep_etp = config.ep * config.etp
    key = (id(model), id(activations), p_bytes, g_bytes, share, lora, lay, ep_etp)
    hit = _BLOCKS.get(key)
    if hit is not None and hit[0] is model and hit[1] is activations:
        return hit[2]
    blocks = _resident_blocks(model, activations, p_bytes, g_bytes, share, _lora_bytes(model, config), lay,
                              ep_etp=ep_etp)
    if len(_BLOCKS) >= ACTIVATION_CACHE_SIZE:
        _BLOCKS.clear()
    _BLOCKS[key] = (model, activations, blocks)
    return blocks


def _lora_key(config: TrainConfig) -> tuple | None:
    """The TrainConfig fields a LoRA plan reads (None: full fine-tuning)."""
    return (config.lora_r, config.lora_targets, config.base_dtype) if config.lora else None


def _lora_bytes(model: ModelSpec, config: TrainConfig) -> dict[str, tuple[int, ...]] | None:
    """Block -> (parameter bytes, gradient bytes, parameters, trainable parameters) of a LoRA run
    (planner.adapters.lora), then the same four of its routed experts and their adapters (what expert
    parallelism splits); None without one."""
    if not config.lora:
        return None
    from planner.adapters.lora import expert_bytes, plan

    lora = plan(model, config)
    experts = _model_facts(model).experts_by_block or {}
    return {name: (b.param_bytes, b.grad_bytes, b.trainable + b.frozen, b.trainable,
                   *expert_bytes(b, experts.get(name, 0), lora.base_dtype))
            for name, b in lora.blocks.items()}


def _resident_blocks(model: ModelSpec, activations: tuple, p_bytes: int, g_bytes: int,
                     share: parallel.Sharding, lora: dict[str, tuple[int, ...]] | None = None,
                     lay: framework_layout.StateLayout | None = None,
                     counts: tuple[dict[str, int], dict[str, int]] | None = None, ep_etp: int = 1,
                     tp_cp: int = 1) -> tuple[timeline.BlockMemory, ...]:
    """`counts`: (parameters, trained parameters) per block on this rank where tensor parallelism divides
    them (planner.memory.stages; a mixture-of-experts layer's routed experts whole); None: the model's own.
    `ep_etp`: the ranks a mixture-of-experts layer's experts are split over (issue 35): this rank's experts
    are laid out over the expert data-parallel group (`tp_cp`: the tensor x context degrees, outside it)."""
    facts = _model_facts(model)
    by_block, trained_by = counts or (facts.by_block, facts.gradients_by_block)
    root = _fsdp1_root_blocks(model, lay, share)
    out = []
    for act in activations:  # every block in forward order, then "loss"
        n_params = by_block.get(act.block, 0)
        n_trained = trained_by.get(act.block, 0)
        experts = (facts.experts_by_block or {}).get(act.block, 0) if ep_etp > 1 else 0
        parts = [(n_params - experts, n_trained - experts, share)]
        if experts:  # this rank's experts, laid out over the expert data-parallel group (memory/experts.py)
            local = experts // ep_etp
            parts.append((local, local, expert_sharding(share, ep_etp, tp_cp)))
        sized = [(n_p, n_t, n_p * p_bytes, n_t * g_bytes, sh) for n_p, n_t, sh in parts]
        if lora is not None:  # the LoRA plan's bytes; under expert parallelism its experts split as above
            full_p, full_g, n_p, n_t, e_p, e_g, e_n, e_t = lora.get(act.block, (0,) * 8)
            sized = [(n_p, n_t, full_p, full_g, share)]
            if experts:
                sized = [(n_p - e_n, n_t - e_t, full_p - e_p, full_g - e_g, share),
                         (e_n // ep_etp, e_t // ep_etp, e_p // ep_etp, e_g // ep_etp,
                          expert_sharding(share, ep_etp, tp_cp))]
        laid_parts, synced_parts = [], []
        for n_p, n_t, full_p, full_g, sh in sized:
            laid = lay.block_bytes(sh.parameters, sh.gradients, n_p, full_p, n_t, full_g) if lay else None
            laid_parts.append(laid or sh.block_bytes(full_p, full_g))
            synced_parts.append(lay.synced_grad_bytes(sh.gradients, n_p, n_t, full_g) if laid else -1)
        resident_p, resident_g, gathered, transient_g = (sum(x) for x in zip(*laid_parts, strict=True))
        # FSDP1 no_sync() accumulation: the block's gradient at the optimizer step (timeline.BlockMemory)
        synced = -1 if max(synced_parts) < 0 else sum(
            s if s >= 0 else lp[1] for s, lp in zip(synced_parts, laid_parts, strict=True))
        in_root = act.block in root and n_params > 0
        if in_root and lay is not None and gathered and lay.units_in_flight > 1 and not lay.legacy:
            gathered //= lay.units_in_flight  # the root is one unit, gathered once (not a prefetch window)
        # reshard_after_forward=False: the block's own unit, held from its forward to its backward (the prefetch
        # window's second unit is the next block's, held from its own forward)
        held = bool(gathered) and lay is not None and not lay.reshard_after_forward and not in_root
        if held:
            gathered //= 2 if lay.legacy else max(lay.units_in_flight, 1)
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
            root_unit=in_root, gathered_until_backward=held, synced_grad_bytes=synced,
        ))
    return tuple(out)


def _fsdp1_root_blocks(model: ModelSpec, lay: framework_layout.StateLayout | None,
                       share: parallel.Sharding) -> frozenset[str]:
    """The blocks FSDP1's root unit holds when the layers are the wrapped units (Accelerate's and Lightning's
    transformer-layer auto-wrap): everything but the layers. FSDP1 does not reshard the root after forward
    ("Do not free the root's parameters in the post-forward for FULL_SHARD with the intention that they are
    immediately used for backward": torch/distributed/fsdp/_runtime_utils.py `_post_forward_reshard`), so it stays
    unsharded to its post-backward at the end of backward; each block's part of its gradient (the head's first)
    waits in autograd's buffer for the flat parameter's split backward, which the embeddings' gradient completes
    (timeline._rows). Empty when nothing is
    sharded (world size 1: FSDP1 runs NO_SHARD) or under FSDP2 (every module resharded)."""
    if lay is None or not lay.fsdp1_root or share.parameters >= 1:
        return frozenset()
    from planner.models.blocks import model_blocks

    return frozenset(b.name for b in model_blocks(model) if b.role != "layer")


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
    dims: Any = None  # planner.parallel.dims.ParallelDims (resolve built it)
    # every pipeline stage's step under tensor/pipeline parallelism (`step` is the worst one's); () otherwise
    stages: tuple[StageStep, ...] = ()
    reported: TrainConfig | None = None  # the configuration the Estimate shows (Resolved.reported; None: cfg)


@dataclass(frozen=True)
class StageStep:
    """One pipeline rank's step: its blocks and layers, parameters per rank, the micro-batches in flight, and
    its StepMemory (its shards, its in-flight activations)."""

    stage: int
    blocks: tuple[str, ...]
    layers: tuple[int, ...]
    parameters: int
    in_flight: float
    step: timeline.StepMemory

    @property
    def activation_bytes(self) -> int:
        return sum(b.kept_bytes for b in self.step.blocks)

    @property
    def peak_allocated(self) -> int:
        return timeline.peaks(self.step)[1].total


IN_FLIGHT = events.IN_FLIGHT  # the pseudo-block holding the other micro-batches' saved activations


def _stage_steps(spec: ModelSpec, cfg: TrainConfig, dims: Any, share: parallel.Sharding,
                 lay: framework_layout.StateLayout, activations: tuple, template: timeline.StepMemory,
                 ctx: Ctx | None = None) -> tuple[StageStep, ...]:
    """Each pipeline rank's step under tensor and pipeline parallelism (planner.memory.stages): its blocks with
    their tensor-parallel shards, sharded over the data-parallel group as `share` says; the optimizer states of
    its shards; and, ahead of its blocks, the saved activations of the other micro-batches its schedule keeps
    in flight (the timeline walks one micro-batch's forward and backward through the rank's blocks)."""
    from planner.memory import stages as st
    from planner.models.blocks import model_blocks
    from planner.models.params import tied_gradient

    t = spec.transformers[0]
    blocks = {b.name: b for b in model_blocks(spec)}
    megatron = lay.kind == "megatron"
    shapes = {n: st.rank_tensor_shapes(b, dims.tp, megatron=megatron) for n, b in blocks.items()}
    tied = tied_gradient(spec)
    if tied is not None:  # a tied LM head: the table's gradient appears at the head (pipeline: its own copy)
        emb, head, shape = tied
        table = (st.vocab_rows(t.vocab_size, dims.tp, megatron), *shape[1:])
        if dims.pp > 1:  # Megatron: the last stage keeps a copy of the word embeddings, its gradient all-
            shapes[head] = [*shapes[head], table]  # reduced with the first's (LanguageModule shared_embedding)
    params = {n: sum(math.prod(x) for x in v) for n, v in shapes.items()}
    trained = dict(params)
    if tied is not None and dims.pp == 1:
        n = math.prod(table)
        trained[emb], trained[head] = trained[emb] - n, trained[head] + n
    # a mixture-of-experts layer's routed experts: whole in `shapes` (the module's (E, ...) tensors), this
    # rank holding E / (ep · etp) of them over the expert data-parallel group (planner.memory.experts)
    ep_etp = 1 if cfg.lora else cfg.ep * cfg.etp
    experts = {n: e for n, e in (_model_facts(spec).experts_by_block or {}).items()} if ep_etp > 1 else {}
    local = {n: p - experts.get(n, 0) + experts.get(n, 0) // ep_etp for n, p in params.items()}
    local_trained = {n: p - experts.get(n, 0) + experts.get(n, 0) // ep_etp for n, p in trained.items()}
    e_share = expert_sharding(share, ep_etp, dims.tp * dims.cp)
    layer_index = {b.name: b.index for b in blocks.values() if b.role == "layer"}
    # the activation records are already one rank's, AMP weight casts included: the layer forms emit the
    # rank's Linears (planner.memory.activations.linear_params at ctx.tp)
    names = [a.block for a in activations]
    ocfg = _optimizer_config(cfg, lay)
    p_bytes = lay.state_param_bytes
    out = []
    gathers_once = fsdp_gathers_once(cfg, dims)
    for sb in st.stages(names, layer_index, t.num_layers, dims):
        held = set(sb.blocks)
        acts = tuple(a for a in activations if a.block in held)
        block_mem = _resident_blocks(spec, acts, lay.param_bytes, lay.grad_bytes, share, None, lay,
                                     counts=(params, trained), ep_etp=ep_etp, tp_cp=dims.tp * dims.cp)
        k = st.in_flight(dims, sb.stage, cfg.grad_accum)
        extra = int(round((k - 1) * sum(b.kept_bytes for b in block_mem)))
        if extra > 0:
            block_mem = (timeline.BlockMemory(IN_FLIGHT, 0, 0, 0, 0, extra, extra, 0, 0, False), *block_mem)
        if gathers_once:  # FSDP2 under PP: the stage unsharded for the whole step (`_unsharded_stage`)
            block_mem = _unsharded_stage(block_mem, sum(local.get(n, 0) for n in sb.blocks),
                                         sum(local_trained.get(n, 0) for n in sb.blocks), lay)
        rank_shapes = [x for n in sb.blocks for x in shapes.get(n, ())]
        n_trained = sum(local_trained.get(n, 0) for n in sb.blocks)
        states, temps = _rank_optimizer_bytes(rank_shapes, ocfg, p_bytes, share, e_share, ep_etp if experts else 1)
        n_experts = sum(experts.get(n, 0) for n in sb.blocks) // ep_etp
        extra_states, extra_temp = _framework_state_bytes(lay, n_trained - n_experts, share)
        if n_experts:  # Megatron's / DeepSpeed's fp32 masters of the rank's experts, over their own group
            more = _framework_state_bytes(lay, n_experts, e_share)
            extra_states, extra_temp = extra_states + more[0], extra_temp + more[1]
        buffers = template.module_buffer_bytes
        if ctx is not None and ctx.fp8:  # the FP8 state of this rank's layers only
            buffers += _fp8_buffer_bytes(spec, ctx, held) - _fp8_buffer_bytes(spec, ctx)
        step = replace(template, blocks=block_mem, optimizer_state_bytes=states + extra_states,
                       module_buffer_bytes=buffers,
                       optimizer_temporary_bytes=temps + extra_temp,
                       optimizer_tensors=_megatron_optimizer_tensors(
                           rank_shapes, ocfg, lay, share.optimizer_states, e_share.optimizer_states,
                           ep_etp if experts else 1),
                       ddp_bucket_bytes=_gradient_buffer_bytes(lay, cfg, model_states.gradient_bytes(n_trained, cfg)),
                       grads_resident=template.grads_resident or cfg.grad_accum > 1,
                       **_loop_fields(cfg, sum(b.retained_bytes for b in block_mem)))
        out.append(StageStep(sb.stage, sb.blocks, sb.layers, sum(local.get(n, 0) for n in sb.blocks), k, step))
    return tuple(out)


def _megatron_optimizer_tensors(shapes: list, cfg: TrainConfig, lay: framework_layout.StateLayout, share: float,
                                expert_share: float, ep_etp: int) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """A Megatron pipeline rank's optimizer tensors for the allocator replay, bytes each: per parameter tensor its
    fp32 master shard and Adam's two states, and (bf16 main gradients) the fp32 copy of its gradient shard made
    for the step; None for other frameworks and optimizers (the trace's own split).

    Megatron-Core (NVIDIA/Megatron-LM @d98e8a64) keeps them per parameter: megatron/core/optimizer/
    distrib_optimizer.py `shard_main_param = shard_model_param.clone().float()` for each parameter's range of
    the rank's shard, `shard_main_param.grad = shard_model_grad.float()` in `_copy_model_grads_to_main_grads`;
    Adam (optimizer/__init__.py: TE's or apex's FusedAdam) keeps its states per main parameter. As one tensor of
    each total, the replay could place none of them in the activation segments step 1 freed. ASSUMPTION: each
    parameter's shard is its share of it (the distributed optimizer cuts the flat buffer into contiguous ranges,
    so most parameters sit whole on one rank: same totals, pieces up to 1 / share larger). A mixture-of-experts
    rank's routed experts (`ep_etp` > 1: the 3-D shapes, E / ep_etp of them here) are one weight per local expert
    (TEGroupedMLP's GroupedLinear `weight{i}`), their states sharded over the expert data-parallel group
    (`expert_share`)."""
    if lay.kind != "megatron" or cfg.optimizer not in ("adam", "adamw"):
        return None
    dense, experts = split_shapes(tuple(shapes), ep_etp) if ep_etp > 1 else (list(shapes), [])
    pieces = [(math.prod(s), share) for s in dense] + [(math.prod(s[1:]), expert_share) for s in experts
                                                       for _ in range(s[0])]
    per = (lay.master_bytes, lay.state_param_bytes, lay.state_param_bytes)
    states = tuple(int(n * b * f) for n, f in pieces for b in per if b and int(n * b * f) > 0)
    temps = tuple(int(n * lay.step_grad_bytes * f) for n, f in pieces
                  if lay.step_grad_bytes and int(n * lay.step_grad_bytes * f) > 0)
    return states, temps


def _rank_optimizer_bytes(shapes: list, cfg: TrainConfig, p_bytes: int, share: parallel.Sharding,
                          e_share: parallel.Sharding, ep_etp: int) -> tuple[int, int]:
    """(optimizer states, step temporaries) of one rank's parameter shapes: the dense ones sharded over the
    data-parallel group as `share` says, a mixture-of-experts model's routed experts (the 3-D shapes, whole
    in `shapes`; `ep_etp` > 1) E / (ep · etp) of them over the expert data-parallel group (`e_share`)."""
    if ep_etp <= 1:
        return (optimizer.optimizer_state_bytes(shapes, cfg, p_bytes, share.optimizer_states),
                optimizer.optimizer_temporary_bytes(shapes, cfg, p_bytes, share.optimizer_states))
    dense, experts = split_shapes(tuple(shapes), ep_etp)
    return (optimizer.optimizer_state_bytes(dense, cfg, p_bytes, share.optimizer_states)
            + optimizer.optimizer_state_bytes(experts, cfg, p_bytes, e_share.optimizer_states),
            max(optimizer.optimizer_temporary_bytes(dense, cfg, p_bytes, share.optimizer_states),
                optimizer.optimizer_temporary_bytes(experts, cfg, p_bytes, e_share.optimizer_states)))


UNSHARDED = "unsharded stage (FSDP2 under PP)"  # the pseudo-block of a stage kept unsharded for the step


def _unsharded_stage(blocks: tuple, n_params: int, n_trained: int, lay: framework_layout.StateLayout) -> tuple:
    """A stage's blocks when FSDP2 runs under pipeline parallelism (planner.perf.model_parallel.
    fsdp_gathers_once: no reshard after forward, no reshard after backward and no gradient sync before the
    step's last micro-batch): every unit's parameters are all-gathered at the first micro-batch's forward and
    stay unsharded until the step's last backward, and its gradients accumulate unsharded over the micro-
    batches (FSDP2 keeps them in reduce_dtype: pytorch/pytorch test/distributed/_composable/fsdp
    test_fully_shard_mixed_precision, `set_requires_gradient_sync(False)` with reduce_dtype=float32 leaves an
    fp32 unsharded `.grad`). One pseudo-block holds them both for the whole step, ASSUMPTION on the safe side:
    the sharded parameters and gradients stay counted besides (the sharded gradient appears only at the
    last reduce-scatter, while the unsharded ones are being freed). The per-unit gather window and unsharded
    gradient of each block are then already inside it (set to 0)."""
    gather = lay.gather_bytes or lay.param_bytes  # the historical (autocast) layout gathers in its own dtype
    grad = max(lay.unsharded_grad_bytes, lay.reduce_comm_bytes)
    held = timeline.BlockMemory(UNSHARDED, n_params * gather, n_trained * grad, 0, 0, 0, 0, 0, 0, False)
    return (held, *(b._replace(gathered_param_bytes=0, transient_grad_bytes=0) for b in blocks))


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
    engine.py _configure_basic_optimizer builds FusedAdam for Adam/AdamW without CPU offload) -- unless the
    ds_config has no "optimizer" block, where the script's own optimizer (`--optimizer-impl`) steps
    DeepSpeed's partitions (`_deepspeed_partition_shapes`)."""
    if lay.kind in ("megatron", "deepspeed") and cfg.optimizer in ("adam", "adamw") and not (
            lay.kind == "deepspeed" and cfg.deepspeed is not None and cfg.deepspeed.client_optimizer):
        return cfg.model_copy(update={"optimizer_impl": "fused"})
    return cfg


def _deepspeed_partition_shapes(cfg: TrainConfig, lay: framework_layout.StateLayout, n_trained: int,
                                share: float) -> tuple[tuple[int], ...] | None:
    """The tensors a client optimizer steps under DeepSpeed ZeRO: not the model's parameters but this rank's
    flat fp32 partition, one tensor per parameter group at stages 1-2 (deepspeed/runtime/zero/
    stage_1_and_2.py `single_partition_of_fp32_groups`) and sub-groups of at most `sub_group_size` elements
    at stage 3 (stage3.py `fp32_partitioned_groups_flat`), so a for-loop Adam's temporaries are the size of
    the partition (stanford_alpaca-style configs: `denom` of the whole 1/N fp32 partition). The Trainer's
    second group (biases and norms, no weight decay) is left out: a few MB. None: the model's own tensors."""
    ds = cfg.deepspeed
    if lay.kind != "deepspeed" or ds is None or not ds.client_optimizer or cfg.parallelism not in (
            "zero1", "zero2", "zero3"):
        return None
    local = max(int(n_trained * share), 1)
    if cfg.parallelism != "zero3":
        return ((local,),)
    full, rest = divmod(local, ds.sub_group_size)
    return tuple([(ds.sub_group_size,)] * full + ([(rest,)] if rest else []))


def _fsdp_local_shapes(spec: ModelSpec, facts: _ModelFacts, cfg: TrainConfig, lay: framework_layout.StateLayout,
                       share: float) -> tuple[tuple[int], ...] | None:
    """The tensors an optimizer steps under FSDP: this rank's shards, so a for-loop Adam's temporaries are a
    shard's size, not a whole parameter's. FSDP2 shards each parameter (a DTensor of 1/N of its rows); FSDP1
    steps one flat parameter per unit (torch/distributed/fsdp/_flat_param.py FlatParameter), the root unit
    (every block outside the layers: embeddings, final norm, head) first in `model.parameters()`, then each
    layer's. Only a for-loop Adam's temporaries read tensor sizes (optimizer.optimizer_temporary_bytes). None
    where parameters are not sharded by FSDP (DeepSpeed: `_deepspeed_partition_shapes`)."""
    if cfg.optimizer not in ("adam", "adamw") or cfg.optimizer_impl != "for-loop" or lay.kind == "deepspeed" \
            or not strategy_of(cfg.parallelism).fsdp or (share >= 1 and not lay.fsdp1_root):
        return None
    if not lay.fsdp1_root:
        return tuple((max(math.ceil(math.prod(s) * share), 1),) for s in facts.gradient_shapes)
    from planner.models.blocks import model_blocks

    roles = {b.name: b.role for b in model_blocks(spec)}
    root = sum(n for name, n in facts.by_block.items() if roles.get(name) != "layer")
    units = [root] + [n for name, n in facts.by_block.items() if roles.get(name) == "layer"]
    return tuple((max(int(n * share), 1),) for n in units if n)


def _traced_optimizer_temporaries(shapes, cfg: TrainConfig, lay: framework_layout.StateLayout, opt_bytes: int,
                                  share: float, trained: int) -> int:
    """`optimizer_temporary_bytes` of a traced model: its tensors, or DeepSpeed's flat partitions."""
    flat = _deepspeed_partition_shapes(cfg, lay, trained, share)
    if flat is not None:
        return optimizer.optimizer_temporary_bytes(flat, cfg, opt_bytes)
    return optimizer.optimizer_temporary_bytes(shapes, _optimizer_config(cfg, lay), opt_bytes, share)
def _fp8_buffer_bytes(spec: ModelSpec, ctx: Ctx, held: set[str] | None = None) -> int:
    """FP8 module state for the whole run (planner.ir.fp8) of the layers in `held` (every layer when None; a
    pipeline rank's under PP): delayed scaling's amax histories, and Transformer Engine's cached FP8 weights
    where the framework passes `is_first_microbatch` (planner.memory.activations.fp8_weight_workspace_bytes)."""
    if not ctx.fp8:
        return 0
    from planner.ir import fp8
    from planner.memory.activations import fp8_weight_workspace_bytes, linear_params
    from planner.models.blocks import model_blocks

    layers = [b for b in model_blocks(spec) if b.role == "layer" and (held is None or b.name in held)]
    linears = sum(len(linear_params(b)) for b in layers)
    return fp8.amax_history_bytes(ctx.fp8, linears) + sum(fp8_weight_workspace_bytes(b, ctx) for b in layers)


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
    if facts.experts_by_block:  # a mixture-of-experts model: what one token's forward reads (issue 35)
        from planner.models.params import active_parameters

        counts["active"] = active_parameters(spec)
    lay = framework_layout.layout(cfg)
    p_bytes = lay.state_param_bytes

    # a 16-bit model without autocast (FSDP's policy, Megatron, DeepSpeed) saves what pure 16-bit training does
    act_cfg, act_ctx = (cfg, r.ctx) if lay.activation_precision == cfg.precision else (
        cfg.model_copy(update={"precision": lay.activation_precision}),
        replace(r.ctx, precision=lay.activation_precision))
    activations = _activations(spec, act_cfg, act_ctx)
    block_mem = _block_memory(spec, activations, cfg, share, lay)

    ep_etp = cfg.ep * cfg.etp
    expert_total = sum((facts.experts_by_block or {}).values()) if ep_etp > 1 and not cfg.lora else 0
    full_grad_bytes = model_states.gradient_bytes(local_parameters(total_params, expert_total, ep_etp), cfg)
    # optimizers keep states only for tensors with a .grad (facts.gradient_shapes)
    if cfg.lora:  # only the adapters train (planner.adapters.lora): their fp32 gradients and states
        from planner.adapters.lora import ADAPTER_BYTES, lora_counts, plan

        lora = plan(spec, cfg)
        counts = lora_counts(spec, lora) | ({"active": counts["active"]} if "active" in counts else {})
        full_grad_bytes = lora.trainable * ADAPTER_BYTES
        states = optimizer.optimizer_state_bytes(lora.shapes, cfg, ADAPTER_BYTES, share.optimizer_states)
        opt_temp = optimizer.optimizer_temporary_bytes(lora.shapes, cfg, ADAPTER_BYTES, share.optimizer_states)
        trained = lora.trainable
        if ep_etp > 1 and lora.adapted_experts:  # a rank adapts only its experts (LoraPlan.shapes_split)
            dense, local = lora.shapes_split(ep_etp)
            e_share = expert_sharding(share, ep_etp)
            full_grad_bytes = sum(math.prod(s) for s in dense + local) * ADAPTER_BYTES
            states = (optimizer.optimizer_state_bytes(dense, cfg, ADAPTER_BYTES, share.optimizer_states)
                      + optimizer.optimizer_state_bytes(local, cfg, ADAPTER_BYTES, e_share.optimizer_states))
            opt_temp = max(optimizer.optimizer_temporary_bytes(dense, cfg, ADAPTER_BYTES, share.optimizer_states),
                           optimizer.optimizer_temporary_bytes(local, cfg, ADAPTER_BYTES, e_share.optimizer_states))
    elif expert_total:  # experts' states over the expert data-parallel group (planner.memory.experts)
        dense, local = split_shapes(facts.gradient_shapes, ep_etp)
        opt_cfg, e_share = _optimizer_config(cfg, lay), expert_sharding(share, ep_etp)
        states = (optimizer.optimizer_state_bytes(dense, opt_cfg, p_bytes, share.optimizer_states)
                  + optimizer.optimizer_state_bytes(local, opt_cfg, p_bytes, e_share.optimizer_states))
        opt_temp = max(optimizer.optimizer_temporary_bytes(dense, opt_cfg, p_bytes, share.optimizer_states),
                       optimizer.optimizer_temporary_bytes(local, opt_cfg, p_bytes, e_share.optimizer_states))
        trained = sum(facts.gradients_by_block.values()) - expert_total
        local_trained = expert_total // ep_etp
    else:
        states, opt_temp = _optimizer_bytes(facts, _optimizer_config(cfg, lay), p_bytes, share.optimizer_states)
        trained = sum(facts.gradients_by_block.values()) or total_params
        flat = _deepspeed_partition_shapes(cfg, lay, trained, share.optimizer_states)
        flat = flat if flat is not None else _fsdp_local_shapes(spec, facts, cfg, lay, share.parameters)
        if flat is not None:
            opt_temp = optimizer.optimizer_temporary_bytes(flat, cfg, p_bytes)
    extra_states, extra_temp = _framework_state_bytes(lay, trained, share)
    if expert_total:
        more = _framework_state_bytes(lay, local_trained, expert_sharding(share, ep_etp))
        extra_states, extra_temp = extra_states + more[0], extra_temp + more[1]
    states, opt_temp = states + extra_states, opt_temp + extra_temp
    micro_batch = batch_mem.micro_batch_bytes(spec, cfg)
    step = timeline.StepMemory(
        blocks=block_mem,
        module_buffer_bytes=facts.buffer_bytes + _fp8_buffer_bytes(spec, r.ctx),
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
    stage_steps: tuple[StageStep, ...] = ()
    if r.dims is not None and r.dims.model_parallel > 1:  # tensor, context or pipeline parallelism
        stage_steps = _stage_steps(spec, cfg, r.dims, share, lay, tuple(activations), step, r.ctx)
        step = max(stage_steps, key=lambda s: s.peak_allocated).step  # the worst rank decides the verdict
    elif r.dims is not None and r.dims.dp_replicate > 1:  # HSDP: one stage, the layout still reported
        layers = tuple(range(spec.transformers[0].num_layers)) if len(spec.transformers) == 1 else ()
        stage_steps = (StageStep(0, tuple(a.block for a in activations), layers, total_params, 1.0, step),)
    return _Prepared(spec, inst, cfg, world, rt, counts, step, tuple(activations), share, r.fragmentation_given,
                     r.throughput_scale, spec.name, (*_notes(spec, cfg), *inst.gpu.assumptions, *inst.assumptions),
                     view.stack, view.context, view.given,
                     view.fragmentation_range, ctx=r.ctx, dims=r.dims, stages=stage_steps, reported=r.reported)


def _prepare_traced(ref: str, config: TrainConfig, instance: Instance | str, runtime, backend: str,
                    model_options: dict[str, Any] | None, inputs: str | None, loss: str | None,
                    stack: SoftwareStack | dict[str, Any] | None = None,
                    calibration: dict[str, Any] | None = None) -> _Prepared:
    """`_prepare` for a traced model: the same step memory, with each block's saved / kept bytes, transients
    and parameters measured by the tracer (blocks = the module's top-level children, then the loss)."""
    from planner.program.sources import model_trace

    r = resolve(None, config, instance, runtime, stack, calibration, backend)
    if r.reported is not None:
        raise PlannerError("--precision", "fp8", "a model the planner lays out (catalog name or config.json); "
                           "FP8 on a traced model is not modelled")
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
        synced = lay.synced_grad_bytes(share.gradients, b.parameters, trained, full_g) if laid else -1
        keep = kept_by.get(b.name, b.saved_bytes + b.retained_bytes) - b.retained_bytes
        blocks.append(timeline.BlockMemory(
            name=b.name, param_bytes=resident_p, grad_bytes=resident_g,
            gathered_param_bytes=gathered, transient_grad_bytes=transient_g,
            kept_bytes=keep, saved_bytes=b.saved_bytes, forward_transient_bytes=b.forward_transient_bytes,
            backward_transient_bytes=b.backward_transient_bytes, checkpointed=keep < b.saved_bytes,
            retained_bytes=b.retained_bytes, synced_grad_bytes=synced))
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
        optimizer_temporary_bytes=_traced_optimizer_temporaries(shapes, cfg, lay, opt_bytes, share.optimizer_states,
                                                                trained_total) + extra_temp,
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
                     kept, ctx=r.ctx, dims=r.dims)


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
    if cfg.pp > 1 and fsdp_gathers_once(cfg, cfg):  # TrainConfig carries pp, as the layout record does
        notes.append("FSDP2 under pipeline parallelism: each stage's parameters are gathered once per step "
                     "and kept unsharded with their gradients until the last micro-batch (one reduce-scatter "
                     "per step)")
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
    if spec is not None and any(t.use_cache for t in spec.transformers):  # planner.memory.kv_cache
        notes.append("use_cache: the forward returns every layer's K and V; what autograd does not save already "
                     "(all of it under a checkpoint wrapper) lives as long as the loop keeps the outputs")
    if cfg.fp8_recipe is not None:  # --precision fp8, computed as amp-bf16 (planner.pipeline.resolve)
        from planner.ir import fp8

        lib = "torchao float8" if fp8.library(cfg.fp8_recipe) == "torchao" else "Transformer Engine"
        keeps = ("saves bf16 inputs; no 16-bit weight copies (cast to FP8 per GEMM)" if lib.startswith("torchao")
                 else "saves FP8 inputs and each FP8 weight with its transpose")
        notes.append(f"FP8 ({cfg.fp8_recipe}, {lib}): the layers' Linear GEMMs at the FP8 peak plus casting "
                     f"kernels; the LM head, norms and attention in bf16; {keeps}"
                     + ("; FSDP all-gathers FP8 weights" if cfg.fp8_param_gather else ""))
    if cfg.compile:
        notes.append("torch.compile: pointwise ops fused into one kernel per chain; the min-cut partitioner "
                     "recomputes norms and activations in backward instead of saving them")
    return notes
