"""The Optuna objective: a trial's params -> (instance type, TrainConfig) -> `planner.estimate` -> value(s).

Feasibility is expressed as Optuna constraints (`trial.set_constraint`, which the TPE sampler reads;
a value > 0 means infeasible), so the sampler learns where the memory edge lies instead of seeing
infeasible configurations as merely bad values. Every trial sets the same three keys:

- `supported`: 0, or SUPPORTED_VIOLATION when the estimate rejects the combination (bf16 on a V100,
  flash attention on a T4, a sequence beyond the model's positions): PlannerError's message is the reason;
- `memory`: (peak - max_memory_fraction × GPU memory) in GiB, where peak is the high end of the estimate's
  band (a sure fit); with `accept_tight` the low end. A `tight` or `oom` verdict is never <= 0 unless
  accepted;
- `global_batch`: 0 when micro × accum × GPUs × instances hits the recipe's global batch exactly (accum is
  derived; a point that cannot hit it gets 1 and no estimate), or, without a recipe batch, the older
  relative-tolerance form |gbs - target| / target - tolerance.

Values: throughput = samples/s (maximise); cost = $ per job; time = hours per job; pareto = (hours, $) per
job (both minimised). A job is the recipe's dataset_size × epochs samples, else one million samples.

Every trial keeps its evidence as user attrs, grouped so that storing a trial is one write: `reason` (why
infeasible; absent when feasible), `config` (resolved, with instance and world size), `memory_bytes`
(every term, GPU memory, limit, band, verdict), `throughput`, `cost`.
The estimate of a configuration is cached per (instance type, config): TPE proposes the same point of a
discrete space many times, and the per-trial path is then a dictionary lookup.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from planner.errors import PlannerError
from planner.search.space import INDEX_SUFFIX, Point, SearchSpace
from planner.search.sweep import Constraints, ObjectiveSpec, Recipe
from planner.spec import Estimate, Instance, ModelSpec, TrainConfig

GIB = 1024**3
# Constraint value of a combination the estimate rejects: far beyond any memory overshoot in GiB, so
# TPE ranks it below every configuration that merely does not fit.
SUPPORTED_VIOLATION = 1000.0
# Constraint value of a point that cannot hit the recipe's global batch: infeasible, with no estimate.
GLOBAL_BATCH_VIOLATION = 1.0
# Memory overshoot recorded for a `tight` verdict whose band end is under the limit (cannot happen with a
# consistent estimate, but the verdict decides): the smallest positive value that reads as infeasible.
TIGHT_VIOLATION_GIB = 1e-6
# Samples in a "job" when the recipe gives no dataset size: cost reads as $ per million samples.
SAMPLES_PER_MILLION = 1_000_000

EstimateFn = Callable[..., Estimate]
DIRECTIONS = {"throughput": ["maximize"], "cost": ["minimize"], "time": ["minimize"],
              "pareto": ["minimize", "minimize"]}


def default_estimate() -> EstimateFn:
    from planner.estimate import estimate

    return estimate


@dataclass(frozen=True)
class Evaluation:
    """What one configuration scores: the objective value(s), the constraints and the evidence."""

    values: tuple[float, ...]
    feasible: bool
    reason: str
    constraints: dict[str, float]
    attrs: dict[str, Any] = field(default_factory=dict)

    @property
    def value(self) -> float:
        return self.values[0]


def _reason(exc: Exception) -> str:
    if isinstance(exc, ValidationError):
        from planner.errors import one_line

        return one_line(exc)
    return str(exc).replace("\n", " ")


def check_values(space: SearchSpace, model: ModelSpec | str) -> None:
    """Every value of every dimension, before the study is created: a value that no configuration can use
    (a LoRA target the model lacks, target sets or base storage without ranks, a sequence beyond the model's
    positions, a value TrainConfig refuses) is one line naming it, not a study of infeasible trials."""
    from planner.adapters.targets import adapted
    from planner.search.space import DIMENSIONS, FLAGS, LORA_UNSET

    values = space.values()
    where = {dim: f"{FLAGS[DIMENSIONS[dim]]} (space.{DIMENSIONS[dim]})" for dim in DIMENSIONS}
    where["seq_len"] = "--seq-len (recipe.seq_len)"
    ranks = [r for r in values["lora_r"] if r is not None]
    if not ranks:
        for dim in ("lora_targets", "base_dtype"):
            asked = [v for v in values[dim] if v != LORA_UNSET[dim]]
            if asked:
                raise PlannerError(where[dim], asked[0], "only with adapters: give lora_ranks (--lora-ranks) too")
    base = {dim: vals[0] for dim, vals in values.items()} | ({"lora_r": ranks[0]} if ranks else {})
    limit = getattr(model, "max_positions", None)
    for dim, vals in values.items():
        if dim == "instance":
            continue
        for value in vals:
            if dim in LORA_UNSET and value == LORA_UNSET[dim]:
                continue
            try:
                point = space.point({**base, dim: value})
            except ValidationError as exc:
                raise PlannerError(where[dim], value, exc.errors()[0]["msg"]) from None
            if dim == "seq_len" and limit is not None and value > limit:
                raise PlannerError(where[dim], value, f"at most {limit:,}: {getattr(model, 'name', 'the model')} "
                                   f"has {limit:,} positions")
            if dim == "lora_targets" and point.config is not None and not isinstance(model, str):
                try:
                    adapted(model, point.config.lora_targets)
                except PlannerError as exc:
                    raise PlannerError(where[dim], value, f"{exc.value}: {exc.allowed}") from None


class Objective:
    """Callable objective over a joint space (instance types × configurations); `estimate_fn` is
    injectable for tests, `estimate_kwargs` are passed to every estimate (e.g. a software stack)."""

    def __init__(self, model: ModelSpec | str, instances: Instance | list[Instance], space: SearchSpace, *,
                 constraints: Constraints | None = None, objective: ObjectiveSpec | None = None,
                 recipe: Recipe | None = None, target: str | None = None, estimate_fn: EstimateFn | None = None,
                 estimate_kwargs: dict[str, Any] | None = None):
        types = [instances] if isinstance(instances, Instance) else list(instances)
        self.model = model
        self.instances = {i.name: i for i in types}
        self.space = space
        self.constraints = constraints or Constraints()
        self.spec = objective or ObjectiveSpec()
        self.recipe = recipe or Recipe()
        self.target = target or self.spec.target or ("cost" if len(types) > 1 else "throughput")
        self.dataset_size = self.recipe.dataset_size or self.spec.dataset_size
        self.epochs = self.recipe.epochs if self.dataset_size is not None else 1.0
        self.estimate_fn = estimate_fn or default_estimate()
        self.estimate_kwargs = dict(estimate_kwargs or {})
        self.directions = DIRECTIONS[self.target]
        self._parameters = space.parameters()
        self._cache: dict[tuple[str, TrainConfig | None, str], Evaluation] = {}
        self.evaluations = 0  # estimate calls, i.e. cache misses
        try:
            space.point({dim: values[0] for dim, values in space.searched().items()})
        except ValidationError as exc:
            from planner.errors import one_line

            raise PlannerError("fixed", space.fixed, one_line(exc)) from None
        check_values(space, model)

    @property
    def direction(self) -> str:
        """The first objective's direction (the only one unless pareto)."""
        return self.directions[0]

    @property
    def worst(self) -> tuple[float, ...]:
        """The values recorded for a configuration with no estimate."""
        return tuple(0.0 if d == "maximize" else math.inf for d in self.directions)

    def __call__(self, trial: Any) -> float | tuple[float, ...]:
        params = {}
        for name, choices in self._parameters.items():
            if name.endswith(INDEX_SUFFIX):
                params[name] = trial.suggest_int(name, 0, len(choices) - 1)
            else:
                params[name] = trial.suggest_categorical(name, choices)
        result = self.evaluate_point(self.space.point(self.space.decode(params)))
        for key, value in result.constraints.items():
            trial.set_constraint(key, value)
        for key, value in result.attrs.items():
            trial.set_user_attr(key, value)
        return result.values if len(result.values) > 1 else result.values[0]

    def evaluate(self, config: TrainConfig, instance: str | None = None) -> Evaluation:
        """One configuration on one instance type (the only one when not named)."""
        name = instance or next(iter(self.instances))
        return self.evaluate_point(Point(name, config))

    def evaluate_point(self, point: Point) -> Evaluation:
        key = (point.instance, point.config, point.reason)
        cached = self._cache.get(key)
        if cached is None:
            cached = self._cache[key] = self._evaluate(point)
        return cached

    def _no_estimate(self, point: Point, reason: str, constraints: dict[str, float]) -> Evaluation:
        config = point.config.model_dump(mode="json") if point.config is not None else dict(point.values)
        attrs = {"reason": reason, "config": config | {"instance": point.instance}}
        return Evaluation(self.worst, False, reason, constraints, attrs)

    def _evaluate(self, point: Point) -> Evaluation:
        if point.config is None:
            return self._no_estimate(point, point.reason, {"supported": 0.0, "memory": 0.0,
                                                           "global_batch": GLOBAL_BATCH_VIOLATION})
        self.evaluations += 1
        try:
            est = self.estimate_fn(self.model, point.config, self.instances[point.instance],
                                   dataset_size=self.dataset_size, spot=self.spec.spot, **self.estimate_kwargs)
        except (PlannerError, ValidationError) as exc:
            return self._no_estimate(point, _reason(exc), {"supported": SUPPORTED_VIOLATION, "memory": 0.0,
                                                           "global_batch": 0.0})
        return self._score(est)

    def _memory(self, est: Estimate, limit: int) -> tuple[float, str]:
        """The memory constraint in GiB and, when violated, why."""
        mem = est.memory_bytes
        high = est.peak_device_high_bytes or mem.peak_device
        low = est.peak_device_low_bytes or mem.peak_device
        accept = self.constraints.accept_tight
        peak = low if accept else high
        over = (peak - limit) / GIB
        frac = self.constraints.max_memory_fraction
        if est.verdict == "oom" or (est.verdict == "tight" and not accept):
            over = max(over, TIGHT_VIOLATION_GIB)
        if over <= 0:
            return over, ""
        band = f"{low / GIB:.2f}-{high / GIB:.2f} GiB" if high != low else f"{peak / GIB:.2f} GiB"
        why = f"peak {band} > {frac:g} × {est.gpu_memory_bytes / GIB:.2f} GiB GPU memory"
        if est.verdict == "tight" and not accept:
            why = f"verdict tight: {why} (not a sure fit; --accept-tight allows it)"
        return over, why

    def _score(self, est: Estimate) -> Evaluation:
        reasons: list[str] = []
        mem = est.memory_bytes
        limit = int(self.constraints.max_memory_fraction * est.gpu_memory_bytes)
        over, why = self._memory(est, limit)
        if why:
            reasons.append(why)
        constraints = {"supported": 0.0, "memory": over, "global_batch": 0.0}
        gbs = global_batch_size(est)
        if self.space.global_batch_size is None and self.constraints.global_batch_size is not None:
            target, tol = self.constraints.global_batch_size, self.constraints.global_batch_tolerance
            constraints["global_batch"] = abs(gbs - target) / target - tol
            if constraints["global_batch"] > 0:
                reasons.append(f"global batch {gbs} is not within {tol:.0%} of {target}")
        elif self.space.global_batch_size is not None and gbs != self.space.global_batch_size:
            # the recipe's global batch is kept exactly; a point whose estimate trains another is refused, named
            constraints["global_batch"] = GLOBAL_BATCH_VIOLATION
            reasons.append(f"global batch {gbs} (micro-batch {est.config.batch_size} x accumulation "
                           f"{est.config.grad_accum} x {est.world_size} GPUs), not the recipe's "
                           f"{self.space.global_batch_size}")
        cost = self._job_cost(est)
        values = self._values(est, cost)
        if values is None:
            constraints["supported"] = SUPPORTED_VIOLATION
            reasons.append(f"no price for {est.instance}, so no cost to minimise")
            values = self.worst
        feasible = all(v <= 0 for v in constraints.values())
        attrs: dict[str, Any] = {"reason": "; ".join(reasons)} if reasons else {}
        attrs |= {
            "config": est.config.model_dump(mode="json") | {"world_size": est.world_size, "instance": est.instance}
            | self._lora_targets(est),
            "memory_bytes": mem.model_dump() | _run_peaks(est) | {"gpu_memory": est.gpu_memory_bytes, "usable": est.usable_memory_bytes,
                                                "headroom": est.headroom_bytes, "limit": limit,
                                                "peak_phase": est.peak_phase, "verdict": est.verdict,
                                                "peak_device_low": est.peak_device_low_bytes or mem.peak_device,
                                                "peak_device_high": est.peak_device_high_bytes or mem.peak_device},
            "throughput": est.throughput.model_dump(exclude={"breakdown_s"}) if est.throughput else {},
            "cost": cost,
        }
        if est.run is not None:  # the run's peak is what the memory constraint read (the verdict's band)
            attrs["run"] = est.run.model_dump(include={"steps", "peak_reserved_bytes", "peak_device_bytes",
                                                       "peak_step", "peak_step_length", "growth_bytes"})
        return Evaluation(values, feasible, "; ".join(reasons), constraints, attrs)

    def _lora_targets(self, est: Estimate) -> dict[str, Any]:
        """An adapter run's targets as resolved (peft's default for the model type named, never ""), so
        best.json and the table say which modules were adapted."""
        if not est.config.lora or est.config.lora_targets or isinstance(self.model, str):
            return {}
        from planner.adapters.lora import plan

        return {"lora_targets": list(plan(self.model, est.config).targets)}

    def _job_cost(self, est: Estimate) -> dict[str, Any]:
        """The estimate's cost with the job's figures (hours and $ for dataset_size × epochs samples)."""
        if est.cost is None:
            return {}
        from planner.perf.cost import per_job

        return per_job(est.cost, self.epochs).model_dump(exclude={"price_source"})

    def _values(self, est: Estimate, cost: dict[str, Any]) -> tuple[float, ...] | None:
        if self.target == "throughput":
            return (est.throughput.samples_per_s,) if est.throughput else None
        if not cost or est.throughput is None or est.throughput.samples_per_s <= 0:
            return None
        if cost.get("usd_per_job") is not None:
            hours, usd = cost["hours_per_job"], cost["usd_per_job"]
        else:  # no dataset size: per million samples
            hours = SAMPLES_PER_MILLION / est.throughput.samples_per_s / 3600.0
            usd = cost["usd_per_million_samples"]
        return {"cost": (usd,), "time": (hours,), "pareto": (hours, usd)}[self.target]


def _run_peaks(est: Estimate) -> dict[str, int]:
    """With a run of varying lengths (recipe.lengths) a row's peaks are the run's: what its verdict read."""
    if est.run is None:
        return {}
    return {"peak_reserved": est.run.peak_reserved_bytes, "peak_device": est.run.peak_device_bytes}


def global_batch_size(est: Estimate) -> int:
    """Samples per optimizer step of the whole job: micro-batch × grad_accum × data-parallel ranks (the GPUs
    over tensor × context × pipeline degrees: each micro-batch spreads over tp · cp · pp GPUs)."""
    if est.throughput is not None:
        return est.throughput.global_batch_size
    c = est.config
    return c.batch_size * c.grad_accum * (est.world_size // (c.tp * c.cp * c.pp))
