"""Sweep files: one YAML document that says what to search (model, instances, space, constraints, objective).

```yaml
name: bert-large-instances          # default study name
model: bert-large-uncased
model_options: {head: sequence-classification, num_labels: 2}
instance: [ml.p3.2xlarge, ml.g5.2xlarge]   # one name, a list, "A,B" or "all"
recipe:                             # the training job: what the user cannot trade away
  global_batch_size: 256            # samples per optimizer step; accumulation is derived from it
  seq_len: 512                      # or a list to explore, e.g. [256, 512]
  dataset_size: 1000000             # samples per epoch
  epochs: 3
stack: {torch: "2.8", alloc_conf: "expandable_segments:True"}   # passed to every estimate (optional)
runtime: {cuda_context_mib: 500, fragmentation: 0.1}   # as estimate's --cuda-context-mib, --fragmentation
fixed: {gradient_as_bucket_view: true}   # other TrainConfig fields, held constant; {framework: deepspeed,
                                         # ds_config: ds.json} reads a DeepSpeed config next to the file
space: {batch_sizes: [8, 16, 32], precisions: [amp-fp16], instance_counts: [1, 2, 4]}  # left out = default
constraints: {max_memory_fraction: 0.95, accept_tight: false}
objective: {target: cost, spot: false}     # cost ($/job), time (hours/job), throughput, pareto
search: {trials: 200, sampler: tpe, seed: 0}
```

Without a `recipe.global_batch_size`, accumulation is searched (`space.grad_accums`) and the older
`constraints.global_batch_size` / `global_batch_tolerance` still apply.

Every error names the file and the field (`sweeps/x.yaml: space.batch_sizes.0='a' ...`).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from planner.errors import PlannerError
from planner.search.limits import DEFAULT_TRIALS as _DEFAULT_TRIALS
from planner.search.limits import (
    MAX_DATASET_SIZE,
    MAX_EPOCHS,
    MAX_GLOBAL_BATCH,
    MAX_SEED,
    MAX_SPACE_VALUE,
    MAX_TRIALS,
)
from planner.search.space import SpaceSpec

if TYPE_CHECKING:  # pragma: no cover
    from planner.spec import ModelSpec

Sampler = Literal["tpe", "grid", "random"]
Target = Literal["throughput", "cost", "time", "pareto"]
TARGETS: tuple[str, ...] = ("throughput", "cost", "time", "pareto")

# The reference job (the multimodal classifier fine-tuned with batch 64 at sequence 512,
# 100 tabular features). Its dataset size is not given. ASSUMPTION: 100,000 samples, a mid-size
# fine-tuning set; override with --dataset-size. Epochs: 3, the middle of the 2-4 that BERT's authors
# recommend for fine-tuning (Devlin et al. 2019, arXiv:1810.04805, appendix A.3); override with --epochs.
REFERENCE_GLOBAL_BATCH_SIZE = 64
REFERENCE_SEQ_LEN = 512
REFERENCE_DATASET_SIZE = 100_000
REFERENCE_EPOCHS = 3

# The fraction of GPU memory a configuration may use: 5% stays free for what no model sees (other
# processes, allocator growth between steps). Override with --max-memory-fraction.
DEFAULT_MAX_MEMORY_FRACTION = 0.95
# TPE trials per instance type when no count is given: benchmarks/search_benchmark.py shows TPE
# reaching >= 99% of the exhaustive grid's optimum on the default space within this budget.
DEFAULT_TRIALS = _DEFAULT_TRIALS  # planner.search.limits: one number for the search, the sweep and --help


GlobalBatch = Annotated[int, Field(strict=True, ge=1, le=MAX_GLOBAL_BATCH)]
SeqLen = Annotated[int, Field(strict=True, ge=1, le=MAX_SPACE_VALUE)]
DatasetSize = Annotated[int, Field(strict=True, ge=1, le=MAX_DATASET_SIZE)]


class _Strict(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Recipe(_Strict):
    """The training job as the user runs it: a global batch and sequence length the model was tuned with
    (not free choices for the sampler), and how many samples it sees (dataset_size × epochs)."""

    global_batch_size: GlobalBatch | None = None  # samples per optimizer step over every GPU
    seq_len: SeqLen | tuple[SeqLen, ...] | None = None  # a list: explored, best at the longest
    dataset_size: DatasetSize | None = None  # samples per epoch
    epochs: float = Field(1.0, gt=0, le=MAX_EPOCHS, allow_inf_nan=False)  # limits: planner.search.limits
    # A run of varying lengths (planner.run): every estimate's memory constraint is then the run's peak.
    lengths: str | None = None  # uniform:MIN-MAX[:STEP] or a file of per-sample token lengths
    padding: str = "longest"  # with a file: longest | bucketed | max | exact
    run_steps: int | None = None  # None: until the peak stops moving
    run_seed: int = 0

    @model_validator(mode="after")
    def _run_fields_need_lengths(self) -> Recipe:
        """padding, run_steps and run_seed shape a run of varying lengths: without `lengths` they would
        change nothing, so they are refused (as `--padding` without `--lengths` is)."""
        if self.lengths is None:
            for name, unset in (("padding", "longest"), ("run_steps", None), ("run_seed", 0)):
                if getattr(self, name) != unset:
                    raise ValueError(f"{name} only with lengths (a run of varying lengths)")
        return self

    def run_request(self):
        """The run every estimate replays (planner.run.simulate.RunRequest), or None."""
        if self.lengths is None:
            return None
        from planner.run.simulate import request

        return request(self.lengths, padding=self.padding, steps=self.run_steps, seed=self.run_seed)

    def seq_lens(self) -> tuple[int, ...] | None:
        if self.seq_len is None:
            return None
        return (self.seq_len,) if isinstance(self.seq_len, int) else tuple(self.seq_len)


class StackSpec(_Strict):
    """The software stack every estimate of the sweep assumes (planner.spec.SoftwareStack; unset fields:
    the defaults `planner estimate` uses, i.e. the DLC for the GPU)."""

    torch: str | None = None  # "X.Y"
    cuda: str | None = None
    transformers: str | None = None
    alloc_conf: str | None = None  # PYTORCH_CUDA_ALLOC_CONF

    def given(self) -> dict[str, str] | None:
        out = {k: v for k, v in self.model_dump().items() if v is not None}
        return out or None


class RuntimeSpec(_Strict):
    """Runtime overrides every estimate of the sweep gets, as `estimate --cuda-context-mib / --fragmentation`."""

    cuda_context_mib: float | None = None
    fragmentation: float | None = None

    def overrides(self) -> dict[str, Any] | None:
        from planner.memory.runtime import overrides_from_flags

        return overrides_from_flags(self.cuda_context_mib, self.fragmentation)


class Constraints(_Strict):
    """What a configuration must satisfy to count as feasible."""

    max_memory_fraction: float = Field(DEFAULT_MAX_MEMORY_FRACTION, gt=0, le=1)
    # The memory verdict has a band (planner.spec.Verdict): "tight" means the band straddles the GPU's
    # memory. It is infeasible (not a sure fit) unless accepted.
    accept_tight: bool = False
    global_batch_size: GlobalBatch | None = None  # = micro-batch × grad_accum × GPUs × instances
    global_batch_tolerance: float = Field(0.0, ge=0, lt=1)  # relative: 0.1 accepts 90..110% of the target
    min_seq_len: SeqLen | None = None


class ObjectiveSpec(_Strict):
    """throughput: maximise samples/s. cost: minimise $ per job (the recipe's dataset_size × epochs; $ per
    million samples without a dataset size). time: minimise hours per job. pareto: both time and cost,
    with a multi-objective sampler; the front is the answer. None: cost over several instance types,
    throughput on one."""

    target: Target | None = None
    dataset_size: DatasetSize | None = None  # samples per epoch
    spot: bool = False


class SearchOptions(_Strict):
    trials: Annotated[int, Field(ge=1, le=MAX_TRIALS)] | None = None  # None: DEFAULT_TRIALS for tpe/random, the whole grid for grid
    sampler: Sampler | None = None  # None: tpe, or grid when the space has no more points than trials
    seed: int = Field(0, ge=0, le=MAX_SEED)


class Sweep(_Strict):
    name: str = Field("search", pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    description: str = ""
    model: str = "multimodal-bert"
    model_options: dict[str, Any] = Field(default_factory=dict)
    # With model: FILE.py:build (the user's own module, traced): FILE.py:batch and, optionally, FILE.py:fn.
    inputs: str | None = None
    loss: str | None = None
    instance: str | tuple[str, ...] = "ml.p3.16xlarge"
    region: str = "us-east-1"  # where the instances are priced (planner.prices)
    recipe: Recipe = Recipe()
    stack: StackSpec = StackSpec()
    runtime: RuntimeSpec = RuntimeSpec()
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

    def target(self) -> str:
        """The objective: the sweep's, else cost over several instance types and throughput on one."""
        if self.objective.target is not None:
            return self.objective.target
        return "cost" if len(self.instance_names()) > 1 else "throughput"

    def dataset_size(self) -> int | None:
        """Samples per epoch: the recipe's, else the older objective.dataset_size."""
        return self.recipe.dataset_size or self.objective.dataset_size

    def seq_space(self) -> SpaceSpec:
        """The space with the recipe's sequence length(s) in place of `space.seq_lens`."""
        lens = self.recipe.seq_lens()
        return self.space if lens is None else self.space.model_copy(update={"seq_lens": lens})

    def estimate_kwargs(self) -> dict[str, Any]:
        """Keyword arguments every estimate of this sweep gets (beyond the configuration): the stack, the region."""
        stack = self.stack.given()
        out: dict[str, Any] = {"stack": stack} if stack else {}
        if self.region != "us-east-1":
            out["region"] = self.region
        run = self.recipe.run_request()
        if run is not None:
            out["run"] = run
        runtime = self.runtime.overrides()
        if runtime:
            out["runtime"] = runtime
        if self.traced():  # estimate() builds and traces it itself, once per shape class
            out |= {"model_options": dict(self.model_options), "inputs": self.inputs, "loss": self.loss}
        return out

    def traced(self) -> bool:
        """Whether the model is traced (user code `FILE.py:build`, a config.json outside the families) rather
        than described by the analytic core."""
        from planner.models.user_module import is_reference
        from planner.program.sources import is_traced_config

        return is_reference(self.model) or is_traced_config(self.model)

    def definition(self) -> dict[str, Any]:
        """What decides a trial's value on one instance type: runs with the same definition may share a
        study. The sampler, seed and trial count are left out (they change the path, not the values)."""
        unused = {k for k in ("inputs", "loss") if getattr(self, k) is None}  # older definitions stay equal
        if self.runtime == RuntimeSpec():
            unused.add("runtime")
        no_run = set() if self.recipe.lengths is not None else {"lengths", "padding", "run_steps", "run_seed"}
        return self.model_dump(mode="json", exclude={"name": True, "description": True, "search": True,
                                                     "instance": True, **dict.fromkeys(unused, True),
                                                     "recipe": no_run}) | {
            "instances": self.instance_names(), "target": self.target()}

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
        what = {type(None): "(empty)", list: "(a list)", str: "(a single text value)"}.get(type(data), type(data).__name__)
        raise PlannerError(source, what, "a YAML mapping of sweep fields (name:, model:, instance:, "
                           "recipe:, space:, ...; see sweeps/)")
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
    if isinstance(data, dict):
        data = {**data, **{k: _relative_to(path, data[k]) for k in ("model", "inputs", "loss")
                           if isinstance(data.get(k), str)}}
    if isinstance(data, dict) and isinstance(data.get("fixed"), dict) and isinstance(data["fixed"].get("ds_config"),
                                                                                      str):
        # fixed: {ds_config: ds.json}, next to the sweep
        from planner.parallel.ds_config import read_ds_config

        fixed = dict(data["fixed"])
        ds_path = fixed.pop("ds_config")
        if not Path(ds_path).exists() and (path.parent / ds_path).exists():
            ds_path = str(path.parent / ds_path)
        fixed["deepspeed"] = read_ds_config(ds_path, f"{path}: fixed.ds_config").model_dump()
        data = {**data, "fixed": fixed}
    sweep = parse_sweep(data, str(path))
    if "name" not in data:  # a file's stem names its study
        sweep = sweep.model_copy(update={"name": path.stem})
    return sweep


def check_sweep(sweep: Sweep, source: str | None = None) -> None:
    """Resolve the model, its options and the instances now, so that a typo fails before any trial.

    With a `source` (a file), the error names the file's field; without, the flag's own error stands.
    """
    where = f"{source}: " if source else ""
    if sweep.recipe.global_batch_size is not None and sweep.constraints.global_batch_size is not None:
        raise PlannerError(f"{where}constraints.global_batch_size", sweep.constraints.global_batch_size,
                           "left out when recipe.global_batch_size is given (the recipe's is exact)")
    if sweep.recipe.seq_len is not None and sweep.space.seq_lens is not None:
        raise PlannerError(f"{where}space.seq_lens", list(sweep.space.seq_lens),
                           "left out when recipe.seq_len is given (give the recipe a list to explore)")

    def stack() -> None:
        from planner.hardware import get_instance
        from planner.memory.stack import resolve_stack

        if sweep.stack.given():
            for name in sweep.instance_names():
                resolve_stack(sweep.stack.given(), get_instance(name).gpu)

    for field, call in (("model", lambda: sweep_model(sweep)),
                        ("instance", sweep.instance_names), ("stack", stack),
                        ("recipe.lengths", sweep.recipe.run_request), ("runtime", sweep.runtime.overrides)):
        try:
            call()
        except PlannerError as exc:
            if source is None:
                raise
            raise PlannerError(f"{source}: {field}", exc.value, f"{exc.field}: {exc.allowed}") from None
        except ValidationError as exc:
            raise _validation_error(f"{source or 'flags'}: {field}", exc) from None


def sweep_model(sweep: Sweep) -> ModelSpec | str:
    """What a search estimates: the ModelSpec of a catalog model or config.json, or, for a traced model (user
    code, a config.json outside the families), its reference string, which `estimate` traces once per shape
    class (`planner.program.sources`). User code is imported here, so a bad reference fails before any trial."""
    if not sweep.traced():
        from planner.models.catalog import cached_model
        from planner.models.user_module import refuse_inputs_unless_own

        refuse_inputs_unless_own(sweep.model, sweep.inputs, sweep.loss)

        return cached_model(sweep.model, sweep.model_options)
    from planner.models.user_module import is_reference, load_function
    from planner.program.sources import require_tracing_libraries

    if is_reference(sweep.model) and sweep.inputs is None:  # one line at once, before torch loads
        raise PlannerError("--inputs", None, f"FILE.py:FUNCTION (a batch(batch_size, seq_len) function) for "
                           f"model {sweep.model}")
    require_tracing_libraries(sweep.model)  # before the user's file is imported: all that is missing, once
    if is_reference(sweep.model):
        from planner.models.user_module import check_build

        load_function(sweep.model, "--model")
        load_function(sweep.inputs, "--inputs")
        check_build(sweep.model, sweep.model_options)
        if sweep.loss is not None:
            load_function(sweep.loss, "--loss")
    else:
        from planner.models.user_module import refuse_inputs_unless_own

        refuse_inputs_unless_own(sweep.model, sweep.inputs, sweep.loss)
    return sweep.model


def _relative_to(path: Path, ref: str | None) -> str | None:
    """A `FILE.py:FUNCTION` reference of a sweep file: FILE relative to the working directory, else to the
    sweep file's folder (so a sweep and its model file can travel together)."""
    from planner.models.user_module import REFERENCE

    m = REFERENCE.match(ref) if ref else None
    if m is None or Path(m["file"]).expanduser().exists():
        return ref
    beside = path.parent / m["file"]
    return f"{beside}:{m['fn']}" if beside.is_file() else ref


# The default of `planner search`: the multimodal BERT (text + tabular); sweeps/multimodal-bert-p3.yaml holds the
# same definition (a test keeps them equal), so the command works without the repository's files.
DEFAULT_SWEEP = Sweep(
    name="multimodal-bert-p3",
    description="The reference multimodal BERT (TabAE + BERT-base + merge) with DDP on ml.p3.16xlarge.",
    model="multimodal-bert",
    model_options={"text_model": "bert-base-uncased", "tab_in": 100, "tab_out": 128, "text_out": 128,
                   "num_classes": 2, "binary": True},
    instance="ml.p3.16xlarge",
    recipe=Recipe(global_batch_size=REFERENCE_GLOBAL_BATCH_SIZE, seq_len=REFERENCE_SEQ_LEN,
                  dataset_size=REFERENCE_DATASET_SIZE, epochs=REFERENCE_EPOCHS),
)
