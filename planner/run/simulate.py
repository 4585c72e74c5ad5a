"""A run of varying lengths, end to end: the steps' lengths (`lengths`), each distinct length's step prepared
as `planner.estimate` prepares one, the allocator across the run (`replay`), the verdict from the run's
peak, and speed from each step's time at its own length.

Why a separate module: `estimate` stays one step; this adds the run on top of its result (`apply_run`),
so the one-step figures (`memory_bytes`) stay the fixed-length step at `--seq-len` and `run` says what the
run adds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from planner import caches
from planner.errors import PlannerError
from planner.run import lengths as lens
from planner.run import replay as rr
from planner.spec import Estimate, RunSummary, Throughput

# Default number of steps: start here and double while the reserved peak was set in the second half of the
# steps simulated ("enough that the peak stops moving"), up to the cap.
DEFAULT_MIN_STEPS = 50
DEFAULT_MAX_STEPS = 800


@dataclass(frozen=True)
class RunRequest:
    """What `--lengths`, `--padding`, `--run-steps` and `--run-seed` ask for."""

    lengths: lens.Lengths
    padding: str = "longest"
    steps: int | None = None  # None: until the peak stops moving
    seed: int = 0
    order: str = "drawn"  # "longest-first": the longest batch moved to the front (a fix `explain` weighs)
    cap: int | None = None  # every batch truncated to this length (a fix `explain` weighs)
    buckets: int | None = None  # every batch padded up to one of this many equal-width buckets (a fix)


def request(lengths: str, *, padding: str = "longest", steps: int | None = None, seed: int = 0) -> RunRequest:
    """The flags, checked (`lengths` parsed once per text: a file is read once per process)."""
    from planner.io import number

    if padding not in lens.PADDINGS:
        raise PlannerError("--padding", padding, lens.PADDINGS)
    if steps is not None:
        steps = int(number(steps, "--run-steps", low=1, high=lens.MAX_RUN_STEPS, integer=True))
    seed = int(number(seed, "--run-seed", low=0, high=2**32 - 1, integer=True))
    return RunRequest(_parsed(lengths), padding, steps, seed)


_PARSED: dict[str, tuple] = caches.table("planner.run.simulate._PARSED", scope="model",
    key="--lengths text -> parsed lengths")


def _parsed(text: str) -> lens.Lengths:
    from planner.io import file_version

    key = file_version(text) if not str(text).startswith("uniform") else None
    hit = _PARSED.get(text)
    if hit is not None and hit[0] == key:
        return hit[1]
    got = lens.parse_lengths(text)
    if len(_PARSED) > 64:
        _PARSED.clear()
    _PARSED[text] = (key, got)
    return got


def plan(req: RunRequest, batch_size: int, seq_len: int, steps: int) -> lens.RunPlan:
    """The steps' padded lengths, with the fixes `explain` weighs applied."""
    p = lens.plan_steps(req.lengths, batch_size=batch_size, steps=steps, seed=req.seed, seq_len=seq_len,
                        padding=req.padding)
    padded = list(p.padded)
    if req.cap is not None:
        padded = [min(n, req.cap) for n in padded]
    if req.buckets:
        width = -(-seq_len // req.buckets)
        padded = [min(-(-n // width) * width, seq_len) for n in padded]
    if req.order == "longest-first" and padded:
        k = max(range(len(padded)), key=padded.__getitem__)
        padded.insert(0, padded.pop(k))
    real = p.real_tokens
    if real is not None and req.cap is not None:  # truncated tokens are not trained on
        real = tuple(min(r, batch_size * req.cap) for r in real)
    return lens.RunPlan(tuple(padded), real, p.truncated_samples)


@dataclass(frozen=True)
class EstimateSteps:
    """The estimate pipeline's own steps that a run repeats at each length: prepare a step, scale its speed
    by the calibration, find its timeline peaks and its band terms. planner.estimate passes them in (it
    imports this module), so the run never imports the estimate back."""

    prepare: Callable[..., Any]
    calibrated: Callable[..., Throughput]
    timeline_peaks: Callable[..., Any]
    band_terms: Callable[..., tuple]


class StepsAt:
    """One step per length, prepared as `estimate` prepares the step at --seq-len (the same config with
    another `seq_len`), its allocator trace and its speed; each made once per run."""

    def __init__(self, prep, runtime: Any, backend: str, model_options: dict | None, stack: Any,
                 steps: EstimateSteps) -> None:
        self.base, self.runtime, self.backend, self.options, self.stack = prep, runtime, backend, model_options, stack
        self.steps = steps
        self._preps: dict[int, Any] = {}
        self._traces: dict[int, Any] = {}
        self._speeds: dict[int, Throughput] = {}

    def prep(self, length: int):
        hit = self._preps.get(length)
        if hit is None:
            b = self.base
            cfg = b.cfg.model_copy(update={"seq_len": length})
            hit = self._preps[length] = self.steps.prepare(b.spec, cfg, b.inst, self.runtime, self.backend, self.options,
                                                 self.stack)
        return hit

    def trace(self, length: int):
        from planner.memory import reserved

        hit = self._traces.get(length)
        if hit is None:
            p = self.prep(length)
            hit = self._traces[length] = reserved._trace(
                p.spec, p.cfg, p.step, p.activations, p.share.parameters, p.share.gradients,
                p.share.optimizer_states, self.backend, p.inst.gpu.flash_attention)
        return hit

    def throughput(self, length: int) -> Throughput:
        from planner.perf.throughput import predict_throughput

        hit = self._speeds.get(length)
        if hit is None:
            p = self.prep(length)
            hit = self._speeds[length] = self.steps.calibrated(predict_throughput(p.spec, p.cfg, p.inst, ctx=p.ctx),
                                                                p.throughput_scale)
        return hit


@dataclass(frozen=True)
class _Run:
    plan: lens.RunPlan
    program: rr.RunProgram
    result: object  # allocator.ReplayResult
    converged: bool


def _steps_for(at: StepsAt, req: RunRequest, batch_size: int, seq_len: int,
               expandable: bool) -> _Run:
    """Replay the run; without --run-steps, double the steps until the reserved peak stops moving."""
    n = req.steps or DEFAULT_MIN_STEPS
    while True:
        p = plan(req, batch_size, seq_len, n)
        program, r = _replayed(at, p.padded, expandable)
        peak_step = program.step_of_event(r.peak_event) if r.peak_event >= 0 else 0
        converged = peak_step < n // 2
        if req.steps or converged or n >= DEFAULT_MAX_STEPS:
            return _Run(p, program, r, converged)
        n = min(2 * n, DEFAULT_MAX_STEPS)


def _replayed(at: StepsAt, padded: tuple[int, ...], expandable: bool):
    """(the run's program, its replay), kept on the first step's trace: a search meets one run on many
    instance types and counts of one GPU, and the traces already stand for everything but the lengths."""
    trace = at.trace(padded[0])
    runs = trace.__dict__.setdefault("_runs", {})
    key = (padded, expandable)
    hit = runs.get(key)
    if hit is None:
        program = rr.lay_out(_sections(at, padded))
        if len(runs) >= RUNS_PER_TRACE:
            runs.clear()
        hit = runs[key] = (program, rr.replay(program, expandable_segments=expandable))
    return hit


RUNS_PER_TRACE = 8  # runs kept per first-step trace (a run's program holds ~40 bytes per event)


def _sections(at: StepsAt, padded: tuple[int, ...]) -> list[rr.Section]:
    """The first step's section at the first length, then each later step's steady section at its own."""
    first = _split(at, padded[0])[0]
    return [first] + [_split(at, n)[1] for n in padded[1:]]


def _split(at: StepsAt, length: int) -> tuple[rr.Section, rr.Section]:
    trace = at.trace(length)
    hit = trace.__dict__.get("_run_sections")
    if hit is None:
        hit = trace.__dict__["_run_sections"] = rr.split_trace(trace)
    return hit


def simulate(at: StepsAt, req: RunRequest, *, batch_size: int, seq_len: int, expandable: bool,
             capacity: int | None = None) -> tuple[_Run, object]:
    """(the run without a capacity, the replay with it when the run's peak exceeds it: the OOM retry)."""
    run = _steps_for(at, req, batch_size, seq_len, expandable)
    capped = run.result
    if capacity is not None and run.result.peak_reserved > capacity:
        capped = rr.replay(run.program, capacity_bytes=capacity, expandable_segments=expandable)
    return run, capped


def apply_run(est: Estimate, prep, req: RunRequest, at: StepsAt, *, expandable: bool,
              with_throughput: bool, dataset_size: int | None, spot: bool) -> Estimate:
    """`est` (the step at --seq-len) with the run: `run`, and the verdict, band and headroom of its peak;
    throughput and cost from each step's time at its own length."""
    from planner.memory import band

    cfg = est.config
    lens.check_against_seq_len(req.lengths, cfg.seq_len)
    m = est.memory_bytes
    capacity = est.gpu_memory_bytes - m.cuda_context - m.nccl
    run, capped = simulate(at, req, batch_size=cfg.batch_size, seq_len=cfg.seq_len, expandable=expandable,
                           capacity=capacity)
    r, p = run.result, run.plan
    distinct = sorted(set(p.padded))
    allocated = max(at.steps.timeline_peaks(at.prep(n).step)[1].total for n in distinct)
    reserved = max(r.peak_reserved, allocated)
    peak_step = run.program.step_of_event(r.peak_event) if r.peak_event >= 0 else -1
    device = m.cuda_context + m.nccl + reserved
    terms = at.steps.band_terms(prep, allocated, reserved, m.nccl, replayed=True)
    low, _, high = band.totals(terms)
    verdict = band.verdict(low, high, est.gpu_memory_bytes)
    padded_tokens = sum(p.padded) * cfg.batch_size
    real = sum(p.real_tokens) if p.real_tokens is not None else None
    throughput, cost = est.throughput, est.cost
    mean_time = real_rate = None
    if with_throughput and est.throughput is not None:
        throughput = _run_throughput(at, p, est.throughput, cfg.grad_accum, cfg.batch_size)
        mean_time, real_rate = throughput.step_time_s, throughput.tokens_per_s
        cost = _cost(est, throughput, dataset_size, spot)
    summary = RunSummary(
        lengths=req.lengths.text, padding=req.padding if not req.lengths.uniform else "given", seed=req.seed,
        steps=len(p.padded), steps_converged=run.converged,
        peak_allocated_bytes=allocated, peak_reserved_bytes=reserved, peak_device_bytes=device,
        peak_step=peak_step + 1, peak_step_length=p.padded[peak_step] if peak_step >= 0 else 0,
        peak_allocation=run.program.tensor_name(r.peak_tensor) if r.peak_tensor >= 0 else "",
        fixed_peak_reserved_bytes=m.peak_reserved, growth_bytes=reserved - m.peak_reserved,
        growth_ratio=reserved / m.peak_reserved - 1 if m.peak_reserved else 0.0,
        longest=max(p.padded), mean_length=sum(p.padded) / len(p.padded), padded_tokens=padded_tokens,
        real_tokens=real, padding_waste=1 - real / padded_tokens if real is not None else None,
        truncated_samples=p.truncated_samples, oom_retry=capped.oom_retry, oom_after_retry=capped.oom,
        expandable_segments=expandable, events=run.program.n_events, mean_step_time_s=mean_time,
        real_tokens_per_s=real_rate)
    return est.model_copy(update={
        "run": summary, "verdict": verdict, "fits": verdict == "fits", "headroom_bytes": est.gpu_memory_bytes - device,
        "peak_device_low_bytes": low, "peak_device_high_bytes": high, "band": terms, "throughput": throughput,
        "cost": cost})


def _run_throughput(at: StepsAt, p: lens.RunPlan, fixed: Throughput, grad_accum: int,
                    batch_size: int) -> Throughput:
    """Each micro-step timed at its own length (attention grows with s²); tokens/s counts real tokens (padded
    ones for uniform lengths). An optimizer step is `grad_accum` micro-steps of the run's mean time."""
    times: dict[int, Throughput] = {n: at.throughput(n) for n in set(p.padded)}
    steps = len(p.padded)
    total = sum(times[n].step_time_s for n in p.padded)
    mean = total / steps
    # flops of a step = mfu · time · peak, so the run's MFU is the time-weighted mean
    mfu = sum(times[n].mfu * times[n].step_time_s for n in p.padded) / total
    keys = set().union(*(t.breakdown_s for t in times.values()))
    breakdown = {k: sum(times[n].breakdown_s.get(k, 0.0) for n in p.padded) / steps for k in keys}
    samples = fixed.global_batch_size / mean
    real = sum(p.real_tokens) if p.real_tokens is not None else sum(p.padded) * batch_size
    tokens_per_sample = real / (steps * batch_size)
    del grad_accum  # each prepared length's step time already holds its grad_accum micro-steps
    return fixed.model_copy(update={"step_time_s": mean, "samples_per_s": samples,
                                    "tokens_per_s": samples * tokens_per_sample, "mfu": mfu,
                                    "breakdown_s": breakdown})


def _cost(est: Estimate, throughput: Throughput, dataset_size: int | None, spot: bool):
    from planner.hardware import get_instance
    from planner.perf.cost import predict_cost

    if est.cost is None:
        return None
    try:
        return predict_cost(throughput, get_instance(est.instance), instances=est.config.instances,
                            dataset_size=dataset_size, spot=spot, region=est.cost.price_region)
    except PlannerError:
        return est.cost


def with_fix(req: RunRequest, **change) -> RunRequest:
    """`req` with a fix applied (see `RunRequest`)."""
    return replace(req, **change)
