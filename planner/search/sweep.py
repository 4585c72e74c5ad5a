"""Sweep files: one YAML document that says what to search (model, instances, space, constraints, objective).

```yaml
name: bert-large-instances          # default study name
model: bert-large-uncased
model_options: {head: sequence-classification, num_labels: 2}
instance: [ml.p3.2xlarge, ml.g5.2xlarge]   # one name, a list, "A,B" or "all"
fixed: {instances: 1}               # other TrainConfig fields, held constant
space: {batch_sizes: [8, 16, 32], seq_lens: [128, 512], precisions: [amp-fp16]}  # left out = default
constraints: {max_memory_fraction: 0.95, global_batch_size: 256, global_batch_tolerance: 0.0,
              min_seq_len: 128}
objective: {target: cost, dataset_size: 1000000, spot: false}
search: {trials: 200, sampler: tpe, seed: 0}
```

Every error names the file and the field (`sweeps/x.yaml: space.batch_sizes.0='a' ...`).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, ValidationError

from planner.errors import PlannerError
from planner.search.space import SpaceSpec

Sampler = Literal["tpe", "grid", "random"]
Target = Literal["throughput", "cost"]

# The fraction of GPU memory a configuration may use: 5% stays free for what no model sees (other
# processes, allocator growth between steps). Override with --max-memory-fraction.
DEFAULT_MAX_MEMORY_FRACTION = 0.95
# TPE trials per instance type when no count is given: benchmarks/search_benchmark.py shows TPE
# reaching >= 99% of the exhaustive grid's optimum on the default space within this budget.
DEFAULT_TRIALS = 100


class _Strict(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Constraints(_Strict):
    """What a configuration must satisfy to count as feasible."""

    max_memory_fraction: float = Field(DEFAULT_MAX_MEMORY_FRACTION, gt=0, le=1)
    global_batch_size: PositiveInt | None = None  # = micro-batch × grad_accum × GPUs × instances
    global_batch_tolerance: float = Field(0.0, ge=0, lt=1)  # relative: 0.1 accepts 90..110% of the target
    min_seq_len: PositiveInt | None = None


class ObjectiveSpec(_Strict):
    """throughput: maximise samples/s of the job. cost: minimise $/epoch (or $ per million samples
    when no dataset size is given)."""

    target: Target = "throughput"
    dataset_size: PositiveInt | None = None  # samples per epoch
    spot: bool = False


class SearchOptions(_Strict):
    trials: PositiveInt | None = None  # None: DEFAULT_TRIALS for tpe/random, the whole grid for grid
    sampler: Sampler | None = None  # None: tpe, or grid when the space has no more points than trials
    seed: int = 0


class Sweep(_Strict):
    name: str = Field("search", pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    description: str = ""
    model: str = "multimodal-bert"
    model_options: dict[str, Any] = Field(default_factory=dict)
    instance: str | tuple[str, ...] = "ml.p3.16xlarge"
    fixed: dict[str, Any] = Field(default_factory=dict)
    space: SpaceSpec = SpaceSpec()
    constraints: Constraints = Constraints()
    objective: ObjectiveSpec = ObjectiveSpec()
    search: SearchOptions = SearchOptions()

    def instance_names(self) -> list[str]:
        """Resolved instance names ("all" = every instance in the catalog), in the given order."""
        from planner.hardware import get_instance, list_instances

        items = [self.instance] if isinstance(self.instance, str) else list(self.instance)
        names: list[str] = []
        for item in items:
            for part in (p.strip() for p in item.split(",")):
                if not part:
                    continue
                found = list_instances() if part.lower() == "all" else [get_instance(part).name]
                names += [n for n in found if n not in names]
        if not names:
            raise PlannerError("--instance", self.instance, "one or more instance names, or all")
        return names

    def definition(self) -> dict[str, Any]:
        """What decides a trial's value on one instance type: runs with the same definition may share a
        study. The sampler, seed and trial count are left out (they change the path, not the values)."""
        return self.model_dump(mode="json", exclude={"name", "description", "search", "instance"})

    def fingerprint(self) -> str:
        """8 hex digits of the definition, for default study names."""
        text = json.dumps(self.definition(), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:8]

    def with_overrides(self, **updates: Any) -> Sweep:
        """This sweep with top-level or nested (`constraints={...}`) fields replaced, re-validated."""
        data = self.model_dump()
        for key, value in updates.items():
            if isinstance(value, dict) and isinstance(data.get(key), dict) and key not in ("model_options", "fixed"):
                data[key] = {**data[key], **value}
            else:
                data[key] = value
        return Sweep.model_validate(data)


def _validation_error(source: str, exc: ValidationError) -> PlannerError:
    first = exc.errors()[0]
    loc = ".".join(str(x) for x in first["loc"]) or "(document)"
    more = f" (+{len(exc.errors()) - 1} more)" if len(exc.errors()) > 1 else ""
    return PlannerError(f"{source}: {loc}", first.get("input"), first["msg"] + more)


def parse_sweep(data: Any, source: str = "sweep") -> Sweep:
    """A Sweep from parsed YAML; errors name `source` and the field."""
    if not isinstance(data, dict):
        raise PlannerError(f"{source}: (document)", type(data).__name__, "a YAML mapping of sweep fields")
    try:
        sweep = Sweep.model_validate(data)
    except ValidationError as exc:
        raise _validation_error(source, exc) from None
    check_sweep(sweep, source)
    return sweep


def load_sweep(path: str | Path) -> Sweep:
    """Read and validate a YAML sweep file; every error names the file and the field."""
    from planner.io import read_yaml

    path = Path(path)
    if not path.is_file():
        raise PlannerError("--sweep", str(path), "an existing YAML sweep file")
    data = read_yaml(path, "--sweep", expect=None)  # binary, non-UTF-8, bad or too deep YAML: one line
    sweep = parse_sweep(data, str(path))
    if "name" not in data:  # a file's stem names its study
        sweep = sweep.model_copy(update={"name": path.stem})
    return sweep


def check_sweep(sweep: Sweep, source: str | None = None) -> None:
    """Resolve the model, its options and the instances now, so that a typo fails before any trial.

    With a `source` (a file), the error names the file's field; without, the flag's own error stands.
    """
    from planner.models.catalog import cached_model

    for field, call in (("model", lambda: cached_model(sweep.model, sweep.model_options)),
                        ("instance", sweep.instance_names)):
        try:
            call()
        except PlannerError as exc:
            if source is None:
                raise
            raise PlannerError(f"{source}: {field}", exc.value, f"{exc.field}: {exc.allowed}") from None
        except ValidationError as exc:
            raise _validation_error(f"{source or 'flags'}: {field}", exc) from None


# The default of `planner search`: the seed's multimodal BERT; sweeps/multimodal-bert-p3.yaml holds the
# same definition (a test keeps them equal), so the command works without the repository's files.
DEFAULT_SWEEP = Sweep(
    name="multimodal-bert-p3",
    description="The seed's multimodal BERT (TabAE + BERT-base + merge) with DDP on ml.p3.16xlarge.",
    model="multimodal-bert",
    model_options={"text_model": "bert-base-uncased", "tab_in": 100, "tab_out": 128, "text_out": 128,
                   "num_classes": 2, "binary": True},
    instance="ml.p3.16xlarge",
)
