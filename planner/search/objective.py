"""The Optuna objective: a trial's params -> TrainConfig -> `planner.estimate` -> value and constraints.

Feasibility is expressed as Optuna constraints (`trial.set_constraint`, which the TPE sampler reads;
a value > 0 means infeasible), so the sampler learns where the memory edge lies instead of seeing
infeasible configurations as merely bad values:

- `supported`: 0, or SUPPORTED_VIOLATION when the estimate rejects the combination (bf16 on a V100,
  flash attention on a T4, a sequence beyond the model's positions): PlannerError's message is the reason;
- `memory`: (peak_device - max_memory_fraction × GPU memory) in GiB; <= 0 fits;
- `global_batch` (only with a target): |micro × accum × GPUs × instances - target| / target - tolerance.

Every trial keeps its evidence as user attrs, grouped so that storing a trial takes a handful of
writes: `reason` (why infeasible; absent when feasible), `config` (resolved), `memory_bytes` (every
memory term, GPU memory, limit, headroom), `throughput`, `cost`.
The estimate of a configuration is cached: TPE proposes the same point of a discrete space many times.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from planner.errors import PlannerError
from planner.search.space import INDEX_SUFFIX, SearchSpace
from planner.search.sweep import Constraints, ObjectiveSpec
from planner.spec import Estimate, Instance, ModelSpec, TrainConfig

GIB = 1024**3
# Constraint value of a combination the estimate rejects: far beyond any memory overshoot in GiB, so
# TPE ranks it below every configuration that merely does not fit.
SUPPORTED_VIOLATION = 1000.0

EstimateFn = Callable[..., Estimate]


def default_estimate() -> EstimateFn:
    from planner.estimate import estimate

    return estimate


@dataclass(frozen=True)
class Evaluation:
    """What one configuration scores: the objective value, the constraints and the evidence."""

    value: float
    feasible: bool
    reason: str
    constraints: dict[str, float]
    attrs: dict[str, Any] = field(default_factory=dict)


def _reason(exc: Exception) -> str:
    if isinstance(exc, ValidationError):
        from planner.cli.common import one_line

        return one_line(exc)
    return str(exc).replace("\n", " ")


class Objective:
    """Callable objective for one model on one instance type; `estimate_fn` is injectable for tests."""

    def __init__(self, model: ModelSpec, instance: Instance, space: SearchSpace, *,
                 constraints: Constraints | None = None, objective: ObjectiveSpec | None = None,
                 estimate_fn: EstimateFn | None = None):
        self.model = model
        self.instance = instance
        self.space = space
        self.constraints = constraints or Constraints()
        self.target = objective or ObjectiveSpec()
        self.estimate_fn = estimate_fn or default_estimate()
        self.direction = "maximize" if self.target.target == "throughput" else "minimize"
        self._parameters = space.parameters()
        self._cache: dict[TrainConfig, Evaluation] = {}
        self.evaluations = 0  # estimate calls, i.e. cache misses
        try:
            space.config({dim: values[0] for dim, values in space.searched().items()})
        except ValidationError as exc:
            from planner.cli.common import one_line

            raise PlannerError("fixed", space.fixed, one_line(exc)) from None

    @property
    def worst(self) -> float:
        """The value recorded for a configuration with no estimate."""
        return 0.0 if self.direction == "maximize" else math.inf

    def __call__(self, trial: Any) -> float:
        params = {}
        for name, choices in self._parameters.items():
            if name.endswith(INDEX_SUFFIX):
                params[name] = trial.suggest_int(name, 0, len(choices) - 1)
            else:
                params[name] = trial.suggest_categorical(name, choices)
        result = self.evaluate(self.space.config(self.space.decode(params)))
        for key, value in result.constraints.items():
            trial.set_constraint(key, value)
        for key, value in result.attrs.items():
            trial.set_user_attr(key, value)
        return result.value

    def evaluate(self, config: TrainConfig) -> Evaluation:
        cached = self._cache.get(config)
        if cached is None:
            cached = self._cache[config] = self._evaluate(config)
        return cached

    def _evaluate(self, config: TrainConfig) -> Evaluation:
        self.evaluations += 1
        try:
            est = self.estimate_fn(self.model, config, self.instance, dataset_size=self.target.dataset_size,
                                   spot=self.target.spot)
        except (PlannerError, ValidationError) as exc:
            reason = _reason(exc)
            constraints = {"supported": SUPPORTED_VIOLATION, "memory": 0.0}
            if self.constraints.global_batch_size is not None:
                constraints["global_batch"] = 0.0
            attrs = {"reason": reason, "config": config.model_dump(mode="json")}
            return Evaluation(self.worst, False, reason, constraints, attrs)
        return self._score(est)

    def _score(self, est: Estimate) -> Evaluation:
        reasons: list[str] = []
        mem = est.memory_bytes
        limit = int(self.constraints.max_memory_fraction * est.gpu_memory_bytes)
        constraints = {"supported": 0.0, "memory": (mem.peak_device - limit) / GIB}
        if mem.peak_device > limit or not est.fits:
            reasons.append(f"peak {mem.peak_device / GIB:.2f} GiB > {self.constraints.max_memory_fraction:g} × "
                           f"{est.gpu_memory_bytes / GIB:.2f} GiB GPU memory")
        gbs = global_batch_size(est)
        if self.constraints.global_batch_size is not None:
            target, tol = self.constraints.global_batch_size, self.constraints.global_batch_tolerance
            constraints["global_batch"] = abs(gbs - target) / target - tol
            if constraints["global_batch"] > 0:
                reasons.append(f"global batch {gbs} is not within {tol:.0%} of {target}")
        value = self._value(est)
        if value is None:
            constraints["supported"] = SUPPORTED_VIOLATION
            reasons.append(f"no price for {est.instance}, so no cost to minimise")
            value = self.worst
        feasible = all(v <= 0 for v in constraints.values())
        attrs: dict[str, Any] = {"reason": "; ".join(reasons)} if reasons else {}
        attrs |= {
            "config": est.config.model_dump(mode="json") | {"world_size": est.world_size},
            "memory_bytes": mem.model_dump() | {"gpu_memory": est.gpu_memory_bytes, "usable": est.usable_memory_bytes,
                                                "headroom": est.headroom_bytes, "limit": limit,
                                                "peak_phase": est.peak_phase},
            "throughput": est.throughput.model_dump(exclude={"breakdown_s"}) if est.throughput else {},
            "cost": est.cost.model_dump(exclude={"price_source"}) if est.cost else {},
        }
        return Evaluation(value, feasible, "; ".join(reasons), constraints, attrs)

    def _value(self, est: Estimate) -> float | None:
        if self.target.target == "throughput":
            return est.throughput.samples_per_s if est.throughput else None
        if est.cost is None:
            return None
        if self.target.dataset_size is not None and est.cost.usd_per_epoch is not None:
            return est.cost.usd_per_epoch
        return est.cost.usd_per_million_samples


def global_batch_size(est: Estimate) -> int:
    """Samples per optimizer step of the whole job: micro-batch × grad_accum × data-parallel ranks."""
    if est.throughput is not None:
        return est.throughput.global_batch_size
    c = est.config
    return c.batch_size * c.grad_accum * est.world_size
