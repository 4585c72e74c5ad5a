"""Reserved memory of one step: the per-tensor trace (`events`) replayed through the allocator model
(`allocator`), cached, as the `AllocatorReplay` record an `Estimate` carries.

Why a cache: a search evaluates many configurations that share one step (they differ in instance count,
price, spot...), and a replay costs milliseconds in pure Python (~1 µs per event, `allocator.fast_run`;
~0.03 µs once the process uses the compiled kernel, `compiled`), building the trace ~0.3 ms. The key is
everything the trace depends on (the model object, `TRACE_FIELDS` of the config, the step's block bytes, the
shares); the replays hang on the cached trace, so a hit hashes no event list. The replay runs
without a capacity first (cacheable across GPUs of one family), and again with the capacity only when the
unlimited peak does not fit, to model the OOM retry (`release_cached_blocks`).
"""

from __future__ import annotations

from planner import caches
from planner.memory import allocator, compiled, events, model_states, timeline
from planner.spec import AllocatorReplay, ModelSpec, TrainConfig

# Distinct steps kept: a cached BERT-base step holds ~95 KB (its compact trace and int64 arrays; measured with
# tracemalloc over benchmarks/estimate_benchmark.py's configurations), so at most ~200 MB.
REPLAY_CACHE_SIZE = 2048
# Replay the first step (optimizer states allocated after backward) before the steady one: ~2x the events,
# and the main source of reserved > allocated (events.step_events). False: steady step only (faster).
REPLAY_FIRST_STEP = True


# What the trace reads of a TrainConfig besides the step's block bytes: the activation records' fields
# (estimate.ACTIVATION_FIELDS), the parameter dtype, the optimizer's tensors, the DDP bucket size.
TRACE_FIELDS = ("batch_size", "seq_len", "precision", "attention", "checkpointing", "optimizer", "optimizer_impl",
                "bucket_cap_mb", "lora_r", "lora_targets", "lora_dropout", "base_dtype",
                "loop", "load", "recompute", "recompute_modules", "fp8_recipe", "fp8_param_gather", "compile",
                "tp", "sp", "cp")


class _Entry:
    """One step's trace and its replays by (capacity, expandable), kept with the model object (so its id
    stays its own). Replays are looked up here, never by hashing the trace's thousands of events."""

    __slots__ = ("spec", "trace", "replays")

    def __init__(self, spec: ModelSpec, trace: events.Trace) -> None:
        self.spec, self.trace = spec, trace
        self.replays: dict[tuple[int | None, bool, int | None], allocator.ReplayResult] = {}


_TRACES: dict[tuple, _Entry] = caches.table("planner.memory.reserved._TRACES", scope="step",
    key="(model, TRACE_FIELDS, step, shares, backend) -> trace and its replays")


def _entry(spec: ModelSpec, cfg: TrainConfig, step: timeline.StepMemory, activations: tuple,
           parameter_share: float, gradient_share: float, state_share: float, backend: str,
           flash_ok: bool) -> _Entry:
    """Cached by the model object, the config fields the trace reads, the step and the rest."""
    key = (id(spec), *(getattr(cfg, f) for f in TRACE_FIELDS), step, parameter_share, gradient_share, state_share,
           backend, flash_ok, REPLAY_FIRST_STEP)
    hit = _TRACES.get(key)
    if hit is not None and hit.spec is spec:
        return hit
    trace = _build_trace(spec, cfg, step, activations, parameter_share, gradient_share, state_share, backend)
    if len(_TRACES) >= REPLAY_CACHE_SIZE:
        _TRACES.clear()
    hit = _TRACES[key] = _Entry(spec, trace)
    return hit


def _trace(spec: ModelSpec, cfg: TrainConfig, step: timeline.StepMemory, activations: tuple,
           parameter_share: float, gradient_share: float, state_share: float, backend: str,
           flash_ok: bool) -> events.Trace:
    """The step's per-tensor trace (cached, see `_entry`)."""
    return _entry(spec, cfg, step, activations, parameter_share, gradient_share, state_share, backend,
                  flash_ok).trace


def _build_trace(spec: ModelSpec, cfg: TrainConfig, step: timeline.StepMemory, activations: tuple,
                 parameter_share: float, gradient_share: float, state_share: float, backend: str) -> events.Trace:
    tensors = events.model_block_tensors(spec, activations, cfg, parameter_share, gradient_share, backend)
    in_flight = events.in_flight_tensors(step, tensors)
    if in_flight is not None:  # a pipeline rank's other micro-batches, tensor by tensor
        tensors = {**tensors, events.IN_FLIGHT: in_flight}
    p_bytes = model_states.parameter_dtype_bytes(cfg.precision)
    states, temps = (step.optimizer_tensors if step.optimizer_tensors is not None
                     else _optimizer_tensors(spec, cfg, p_bytes, state_share))
    return events.step_events(step, tensors, state_sizes=states, temp_sizes=temps,
                              bucket_cap_bytes=int(cfg.bucket_cap_mb * events.MiB), first_step=REPLAY_FIRST_STEP)


_OPTIMIZER_TENSORS: dict[tuple, tuple] = caches.table("planner.memory.reserved._OPTIMIZER_TENSORS", scope="step",
    key="(gradient shapes, optimizer, dtypes, share) -> optimizer tensors")


def _optimizer_tensors(spec: ModelSpec, cfg: TrainConfig, p_bytes: int, share: float) -> tuple:
    """`events.optimizer_tensor_sizes`, once per model and optimizer (of `cfg` it reads only these two)."""
    from planner.models.params import model_gradient_tensor_shapes

    lora = (cfg.lora_r, cfg.lora_targets) if cfg.lora else None
    key = (id(spec), cfg.optimizer, cfg.optimizer_impl, p_bytes, share, lora)
    hit = _OPTIMIZER_TENSORS.get(key)
    if hit is None or hit[0] is not spec:
        if len(_OPTIMIZER_TENSORS) >= REPLAY_CACHE_SIZE:
            _OPTIMIZER_TENSORS.clear()
        if cfg.lora:  # only the fp32 adapters have optimizer states (planner.adapters.lora)
            from planner.adapters.lora import ADAPTER_BYTES, plan

            shapes, p_bytes = plan(spec, cfg).shapes, ADAPTER_BYTES
        else:
            shapes = model_gradient_tensor_shapes(spec)
        hit = _OPTIMIZER_TENSORS[key] = (spec, events.optimizer_tensor_sizes(shapes, cfg, p_bytes, share))
    return hit[1]


_PREFIXES: dict[tuple, allocator.Snapshot] = caches.table("planner.memory.reserved._PREFIXES", scope="step",
    key="(trace, capacity, expandable) -> allocator snapshot after the first step")


def _replay(trace: events.Trace, capacity: int | None, expandable: bool,
            max_split: int | None = None) -> allocator.ReplayResult:
    """The compiled kernel when the process uses it (`compiled`); otherwise in Python, where without a capacity
    (no OOM path) the permanent prefix (parameters, buffers, buckets, states) is replayed once per model and
    optimizer and restored from a snapshot afterwards."""
    if not expandable:
        fast = compiled.replay(trace, capacity_bytes=capacity, max_split_size=max_split)
        if fast is not None:
            return fast
    if capacity is not None or expandable or max_split is not None:
        return allocator.replay(trace.events, capacity_bytes=capacity, expandable_segments=expandable,
                                max_split_size=max_split)
    n = events.permanent_prefix(trace)
    key = trace.sizes[:n]  # the prefix allocates tensors 0..n-1 in order: their sizes are its events
    snap = _PREFIXES.get(key)
    if snap is not None:
        return allocator.run(trace.events, start=snap, snapshot_at=n)[0]
    result, snap = allocator.run(trace.events, snapshot_at=n)
    if snap is not None:
        if len(_PREFIXES) >= REPLAY_CACHE_SIZE:
            _PREFIXES.clear()
        _PREFIXES[key] = snap
    return result


def replay_step(spec: ModelSpec, cfg: TrainConfig, step: timeline.StepMemory, activations: tuple, *,
                parameter_share: float = 1.0, gradient_share: float = 1.0, state_share: float = 1.0,
                capacity_bytes: int | None = None, expandable_segments: bool = False,
                max_split_size: int | None = None, backend: str = "cuda", flash_ok: bool = True) -> AllocatorReplay:
    """The step's allocator replay; `capacity_bytes` is what the allocator may reserve (GPU memory less the
    CUDA context and NCCL buffers); `max_split_size`: PYTORCH_CUDA_ALLOC_CONF max_split_size_mb, in bytes."""
    entry = _entry(spec, cfg, step, activations, parameter_share, gradient_share, state_share, backend, flash_ok)
    trace = entry.trace
    ms = max_split_size
    r = entry.replays.get((None, expandable_segments, ms))
    if r is None:
        r = entry.replays[None, expandable_segments, ms] = _replay(trace, None, expandable_segments, ms)
    if capacity_bytes is not None and r.peak_reserved > capacity_bytes:
        hit = entry.replays.get((capacity_bytes, expandable_segments, ms))
        if hit is None:
            hit = entry.replays[capacity_bytes, expandable_segments, ms] = _replay(trace, capacity_bytes,
                                                                                   expandable_segments, ms)
        r = hit
    name = events.tensor_name(trace, r.peak_tensor) if r.peak_tensor >= 0 else ""
    return AllocatorReplay(peak_allocated=r.peak_allocated, peak_reserved=r.peak_reserved, segments=r.segments,
                           peak_allocation=name, peak_allocation_bytes=r.peak_event_bytes,
                           peak_segment_bytes=r.peak_segment_bytes, oom_retry=r.oom_retry,
                           oom_after_retry=r.oom, expandable_segments=expandable_segments,
                           events=trace.n_events)


def clear_caches() -> None:
    """Forget cached traces, trace structures and replays (benchmarks; tests that change module constants)."""
    for c in caches.registered().values():
        if c.scope == "step" and c.name.startswith(("planner.memory.reserved.", "planner.memory.events.")):
            c.clear()
