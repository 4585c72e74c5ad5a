"""Step 3 of the estimate pipeline, verdict: the allocator replay (or the given fragmentation), the phases,
the band of the whole-device peak, speed (roofline) and cost, from a prepared step of either front end.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from planner import caches
from planner.errors import PlannerError
from planner.memory import band, timeline
from planner.memory import stack as sw
from planner.parallel import get as strategy_of
from planner.pipeline.step import ACTIVATION_CACHE_SIZE, UNSHARDED, _Prepared
from planner.spec import (
    Estimate,
    Instance,
    MemoryBytes,
    ModelSpec,
    ParallelLayout,
    ParallelStage,
    PhasePeak,
    Throughput,
    TrainConfig,
)


def _finish(prep: _Prepared, dataset_size: int | None, spot: bool, with_throughput: bool,
            expandable_segments: bool, backend: str, region: str | None = None) -> Estimate:
    """The verdict, phases, speed and cost from the prepared step (analytic or traced)."""
    from planner.memory.reserved import replay_step
    from planner.memory.runtime import nccl_bytes

    spec, inst, cfg, world, rt = prep.spec, prep.inst, prep.cfg, prep.world, prep.rt
    # DataParallel is one process but still moves tensors between its GPUs through NCCL.
    nccl = nccl_bytes(rt, inst.gpus if strategy_of(cfg.parallelism).one_process else world)
    if prep.dims is not None and not prep.dims.plain:  # one communicator per tensor/context/pipeline/data group
        from planner.memory.runtime import nccl_group_bytes

        d = prep.dims
        nccl = nccl_group_bytes(rt, (d.tp, d.cp, d.pp, d.dp))
    gpu_memory = inst.gpu.reported_memory_bytes or inst.gpu.memory_bytes
    capacity = gpu_memory - rt.cuda_context_bytes - nccl
    replays: dict[int, Any] = {}  # id(a stage's step) -> its allocator replay

    def replay_of(stage_step: timeline.StepMemory) -> Any:
        if id(stage_step) not in replays:
            replays[id(stage_step)] = replay_step(
                spec, cfg, stage_step, prep.activations, parameter_share=prep.share.parameters,
                gradient_share=prep.share.gradients, state_share=prep.share.optimizer_states,
                capacity_bytes=capacity, expandable_segments=expandable_segments or prep.stack.expandable_segments,
                max_split_size=prep.stack.max_split_size, backend=backend, flash_ok=inst.gpu.flash_attention)
        return replays[id(stage_step)]

    replay_stages = (prep.stages and spec is not None and not prep.fragmentation_given
                     and len(prep.stages) <= REPLAY_STAGES)
    if replay_stages:  # the worst rank is the one whose device peak (reserved) is highest, not allocated
        def device_peak(s: Any) -> tuple[int, bool]:
            return max(replay_of(s.step).peak_reserved, _timeline_peaks(s.step)[1].total), s.step is prep.step
        prep = replace(prep, step=max(prep.stages, key=device_peak).step)
    counts, step = prep.counts, prep.step
    states = step.optimizer_state_bytes
    micro_batch = step.batch_bytes
    block_mem = step.blocks
    peaks, top = _timeline_peaks(step)
    peak_allocated = top.total
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
                             expandable_segments=expandable_segments or prep.stack.expandable_segments,
                             loop=cfg.loop)
        peak_reserved = max(alloc.peak_reserved, peak_allocated)
    else:
        alloc = replay_of(step)
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
                                           region, ctx=prep.ctx, dims=prep.dims)

    layout = None
    if prep.stages:
        def replay(stage_step: timeline.StepMemory) -> int:  # the allocator replay of another stage's step
            return replay_of(stage_step).peak_reserved

        layout = _parallel_layout(prep, alloc, peak_allocated, peak_reserved, peak_device, low, high, gpu_memory,
                                  replay if alloc is not None and spec is not None else None)
    return Estimate(
        model=prep.name,
        instance=inst.name,
        gpu=inst.gpu.name,
        config=prep.reported or cfg,
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
        parallel=layout,
    )


# Pipeline stages up to which every stage goes through the allocator replay (beyond: the worst one only, the
# others scaled from it). ASSUMPTION: 8 stages keep an estimate under a second for a 70B model on 2 cores.
REPLAY_STAGES = 8


def _parallel_layout(prep: _Prepared, alloc: Any, allocated: int, reserved: int, device: int, low: int, high: int,
                     gpu_memory: int, replay: Any = None) -> ParallelLayout:
    """The layout and every pipeline stage's memory. The worst stage (prep.step) went through the allocator
    replay, and so does every other stage when there are at most REPLAY_STAGES (`replay`: a stage's step ->
    its reserved peak); otherwise a stage's reserved pool is its allocated peak times the worst stage's
    reserved/allocated ratio. A stage's band is the worst's shifted by the difference (the context and NCCL
    terms are the same on every rank)."""
    d = prep.dims
    ratio = reserved / allocated if allocated else 1.0
    rows = []
    worst = 0
    for s in prep.stages:
        is_worst = s.step is prep.step
        if is_worst:
            worst = s.stage
        peak = _timeline_peaks(s.step)[1].total
        replayed = is_worst and alloc is not None
        if is_worst:
            stage_reserved = reserved
        elif replay is not None and len(prep.stages) <= REPLAY_STAGES:
            stage_reserved, replayed = max(replay(s.step), peak), True
        else:
            stage_reserved = max(int(peak * ratio), peak)
        stage_device = device + stage_reserved - reserved
        lo, hi = low + stage_device - device, high + stage_device - device
        rows.append(ParallelStage(
            stage=s.stage, layers=s.layers, blocks=s.blocks, parameters=s.parameters,
            parameter_bytes=sum(b.param_bytes for b in s.step.blocks if b.name != UNSHARDED),
            gradient_bytes=sum(b.grad_bytes for b in s.step.blocks if b.name != UNSHARDED),
            unsharded_bytes=sum(b.param_bytes + b.grad_bytes for b in s.step.blocks if b.name == UNSHARDED),
            optimizer_bytes=s.step.optimizer_state_bytes, activation_bytes=s.activation_bytes,
            in_flight_micro_batches=s.in_flight, peak_allocated_bytes=peak, peak_device_bytes=stage_device,
            peak_device_low_bytes=lo, peak_device_high_bytes=hi, verdict=band.verdict(lo, hi, gpu_memory),
            replayed=replayed))
    return ParallelLayout(world=d.world, dp=d.dp, dp_replicate=d.dp_replicate, dp_shard=d.dp_shard, tp=d.tp,
                          cp=d.cp, pp=d.pp, vp=d.vp, sp=d.sp, schedule=d.schedule,
                          micro_batches=prep.cfg.grad_accum, worst_stage=worst, stages=tuple(rows))


_PEAKS: dict[timeline.StepMemory, tuple[dict[str, timeline.Point], timeline.Point]] = caches.table(
    "planner.pipeline.verdict._PEAKS", scope="step", key="StepMemory -> its timeline peaks")


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
    torch = sw.parse_version("torch", prep.stack.torch) if prep.stack else None
    unchecked = band.replay_unchecked(torch, bool(prep.stack and prep.stack.given), prep.world,
                                      _alloc_keys(prep.stack)) if replayed else None
    terms = (
        band.exact("tensors", allocated - workspace, "exact: parameters, gradients, optimizer states, "
                   "activations, batch and temporaries, checked against real modules"),
        band.workspace_term(workspace, "cublas_workspace_bytes" in prep.given),
        band.reserved_pool_term(allocated, reserved, given="fragmentation" in prep.given, replayed=replayed,
                                calibrated_range=prep.fragmentation_range or None, unchecked=unchecked),
        band.context_term(*prep.context),
        band.nccl_term(nccl, "nccl_bytes_per_peer" in prep.given),
    )
    _, point, _ = band.totals(terms)
    return (*terms, band.legacy_gap_term(point, torch, calibrated=bool(prep.fragmentation_range)))


def _alloc_keys(stack) -> tuple[str, ...]:
    """The PYTORCH_CUDA_ALLOC_CONF keys the stack sets (checked when the stack was resolved)."""
    if stack is None or not stack.alloc_conf:
        return ()
    from planner.alloc_conf import parse_alloc_conf

    return tuple(parse_alloc_conf(stack.alloc_conf, stack.torch))


def _speed_and_cost(spec: ModelSpec | None, cfg: TrainConfig, inst: Instance, dataset_size: int | None, spot: bool,
                    scale: float | None, traced: Any = None, region: str | None = None, ctx: Any = None,
                    dims: Any = None):
    """Throughput (the analytic kernel list, or a traced model's own ops), and cost at the instance's price
    (the refreshed cache when present, else the embedded table; `predict_cost` records which, with its date)."""
    from planner.perf.cost import predict_cost
    from planner.perf.throughput import predict_throughput

    if spec is None:
        from planner.program.speed import traced_throughput

        throughput = _calibrated(traced_throughput(traced, cfg, inst), scale)
    else:
        throughput = _calibrated(predict_throughput(spec, cfg, inst, ctx=ctx, dims=dims), scale)
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
