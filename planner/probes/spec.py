"""The probe request: what `planner probe` asks `jobs/probe.py` to build, run and measure.

A request carries the model spec (`ModelSpec.model_dump(mode="json")`, which `jobs/modeling.py` turns back
into a torch module), the resolved training config, how many GPUs/processes, the planner's predictions
(`estimate`, so a result can be compared later even without the planner) and where it came from (study,
trial). Its `request_id` hashes what determines the measurement (model, config, GPUs, steps, seed; not the
predictions nor the study), so the same candidate always maps to the same id, job name and result file.
"""

from __future__ import annotations

import hashlib
import json
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from planner.errors import PlannerError
from planner.parallel import get as strategy_of
from planner.parallel import resolve_name
from planner.spec import ModelSpec, TrainConfig

REQUEST_SCHEMA = "planner.probe-request/1"
PROBE_VERSION = 1  # bump when jobs/probe.py measures differently, so old results get new ids
DEFAULT_WARMUP_STEPS = 1  # the first step allocates optimizer states and cuBLAS workspaces
DEFAULT_MEASURE_STEPS = 3  # steady-state steps timed after warm-up (median)
# A probe measures a few steps; ASSUMPTION: 1,000 is far more than a steady reading needs and still ends well
# inside the job's MaxRuntimeInSeconds for any model that fits.
MAX_PROBE_STEPS = 1000


class ProbeRequest(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", protected_namespaces=())

    model: dict[str, Any]  # ModelSpec.model_dump(mode="json")
    config: dict[str, Any]  # TrainConfig.model_dump(mode="json"), parallelism resolved
    instance: str | None = None
    gpu: str | None = None  # the GPU the prediction is for
    gpus_per_instance: int = Field(1, ge=1)
    world_size: int = Field(1, ge=1)
    warmup_steps: int = Field(DEFAULT_WARMUP_STEPS, ge=0, le=MAX_PROBE_STEPS)
    measure_steps: int = Field(DEFAULT_MEASURE_STEPS, ge=1, le=MAX_PROBE_STEPS)
    seed: int = 0
    lr: float = 1e-4
    estimate: dict[str, Any] | None = None  # Estimate.to_json() at request time
    estimate_error: str | None = None  # why there is no estimate (the estimator failed on this candidate)
    study: str | None = None
    trial: int | None = None
    model_options: dict[str, Any] = Field(default_factory=dict)
    # A run of varying lengths (planner.run): each step's padded length, replayed in order by the job (the
    # same sequence the planner's run replays: `planner.run.simulate.plan`). Empty: every step at seq_len.
    step_lengths: tuple[Annotated[int, Field(ge=1)], ...] = Field((), max_length=MAX_PROBE_STEPS)
    # Decoder layers in each of the pp × vp pipeline stages where the framework's split is not an even one
    # (planner.parallel.layer_split: torchtitan's and NeMo AutoModel's leftover layers); the job builds its
    # stages from it (jobs/parallel_layout.py stage_layers). Empty: an even split.
    stage_layers: tuple[Annotated[int, Field(ge=0)], ...] = ()

    @property
    def request_id(self) -> str:
        ident = {"probe_version": PROBE_VERSION, "model": self.model, "config": self.config,
                 "instance": self.instance, "gpus_per_instance": self.gpus_per_instance,
                 "world_size": self.world_size, "warmup_steps": self.warmup_steps,
                 "measure_steps": self.measure_steps, "seed": self.seed, "lr": self.lr}
        if self.step_lengths:  # only then: the ids of fixed-length requests stay what they were
            ident["step_lengths"] = list(self.step_lengths)
        if self.stage_layers:  # only then: the ids of evenly split requests stay what they were
            ident["stage_layers"] = list(self.stage_layers)
        blob = json.dumps(ident, sort_keys=True, separators=(",", ":"), default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    @property
    def model_name(self) -> str:
        return str(self.model.get("name", "model"))

    @property
    def train_config(self) -> TrainConfig:
        return TrainConfig.model_validate(self.config)

    @property
    def model_spec(self) -> ModelSpec:
        return ModelSpec.model_validate(self.model)

    @property
    def user_code(self) -> dict[str, Any] | None:
        """The user's own module (`--model FILE.py:build`): references, options and shipped sources."""
        code = self.model.get("user_code")
        return code if isinstance(code, dict) else None

    def to_json(self) -> dict[str, Any]:
        """What jobs/probe.py reads (plain JSON; the probe does not need pydantic)."""
        out = {"schema": REQUEST_SCHEMA, "request_id": self.request_id}
        out.update(self.model_dump(mode="json"))
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ProbeRequest:
        data = {k: v for k, v in data.items() if k not in ("schema", "request_id")}
        return cls.model_validate(data)


# ------------------------------------------------------------------ seams to the other modules
# Each is a small function so tests can replace it, and so a module still being written does not
# break probe commands that do not need it.


def resolve_model(model: ModelSpec | str | dict, options: dict[str, Any] | None = None) -> ModelSpec:
    if isinstance(model, ModelSpec):
        return model
    if isinstance(model, dict):  # a ModelSpec stored as JSON (e.g. in a trial's user attrs)
        return ModelSpec.model_validate(model)
    from planner.models.catalog import get_model  # type: ignore[import-not-found]

    return get_model(model, **(options or {}))


def resolve_instance(instance: Any) -> Any:
    if not isinstance(instance, str):
        return instance
    from planner.hardware import get_instance  # type: ignore[import-not-found]

    return get_instance(instance)


def predict(model: ModelSpec | str, config: TrainConfig, instance: Any, **user: Any) -> Any:
    """planner.estimate(...) -> Estimate (`user`: model_options, inputs, loss of a traced user module)."""
    from planner.estimate import estimate

    return estimate(model, config, instance, **user)  # type: ignore[attr-defined]


def resolve_parallelism(config: TrainConfig, gpus: int) -> str:
    """What `auto` means when no estimate is at hand: one GPU alone, DDP over several."""
    return resolve_name(config.parallelism, gpus * config.instances)


def world_size(parallelism: str, gpus_per_instance: int, instances: int) -> tuple[int, int]:
    """(gpus used per instance, world size): `single` uses one GPU, `dp` one process over all GPUs."""
    strategy = strategy_of(parallelism)
    return strategy.gpus_per_instance(gpus_per_instance), strategy.world_size(gpus_per_instance, instances)


def make_request(model: ModelSpec | str | dict, config: TrainConfig, instance: Any, *,
                 estimate: Any = None, with_estimate: bool = True, study: str | None = None,
                 trial: int | None = None, model_options: dict[str, Any] | None = None,
                 warmup_steps: int = DEFAULT_WARMUP_STEPS, measure_steps: int = DEFAULT_MEASURE_STEPS,
                 seed: int = 0, inputs: str | None = None, loss: str | None = None,
                 step_lengths: tuple[int, ...] = ()) -> ProbeRequest:
    """A request for one candidate; the estimate (if any) fixes the resolved parallelism.

    `model` as `FILE.py:build` is the user's own module: the request carries the source of the files that
    `model`, `inputs` and `loss` name (planner.models.user_module.probe_model), and the estimate traces it."""
    from planner.models.user_module import is_reference, probe_model

    check_split(config)
    user = is_reference(model)
    spec_json = (probe_model(str(model), inputs=inputs, loss=loss, options=model_options) if user
                 else resolve_model(model, model_options).model_dump(mode="json"))
    if any(layer.get("fake_balanced_gate") for c in spec_json.get("components") or () for layer in c.get("layers") or ()):
        raise PlannerError("fake_balanced_gate", True, "false for a probe: the probe job builds the model's real "
                           "router (NeMo's FakeBalancedGate is a benchmark of NeMo AutoModel's own MoE layer)")
    inst = resolve_instance(instance)
    estimate_error = None
    if estimate is None and with_estimate:
        try:
            estimate = (predict(str(model), config, inst, model_options=model_options, inputs=inputs, loss=loss)
                        if user else predict(resolve_model(model, model_options), config, inst))
        except (PlannerError, ValidationError):
            raise  # bad input (e.g. seq_len beyond the model's positions): the user must fix it
        except Exception as exc:  # noqa: BLE001 - a broken estimator must not stop a measurement
            estimate, estimate_error = None, f"{type(exc).__name__}: {exc}"[:500]
    gpus = int(getattr(inst, "gpus", 1) or 1)
    est_json: dict[str, Any] | None = None
    if estimate is not None:
        est_json = estimate.to_json() if hasattr(estimate, "to_json") else dict(estimate)
        resolved = TrainConfig.model_validate(est_json.get("config") or config.model_dump())
    else:
        resolved = config.model_copy(update={"parallelism": resolve_parallelism(config, gpus)})
    per_instance, world = world_size(resolved.parallelism, gpus, resolved.instances)
    if est_json and est_json.get("world_size") and not strategy_of(resolved.parallelism).uses_one_gpu:
        world = int(est_json["world_size"])
        per_instance = max(1, world // resolved.instances)
    chunks = check_layout(resolved, world, spec_json)
    gpu = getattr(getattr(inst, "gpu", None), "name", None)
    return ProbeRequest(model=spec_json, config=resolved.model_dump(mode="json"),
                        instance=getattr(inst, "name", inst if isinstance(inst, str) else None), gpu=gpu,
                        gpus_per_instance=per_instance, world_size=world, warmup_steps=warmup_steps,
                        measure_steps=measure_steps, seed=seed, estimate=est_json, estimate_error=estimate_error,
                        study=study, trial=trial,
                        model_options=dict(model_options or {}), step_lengths=tuple(step_lengths),
                        stage_layers=chunks if len(set(chunks)) > 1 else ())


def check_layout(config: TrainConfig, world: int, spec_json: dict[str, Any]) -> tuple[int, ...]:
    """A model-parallel layout that cannot exist is refused here, before any job (planner.parallel.dims names
    the rule), with the model's facts as the estimate reads them (`dims.for_model`: layers, heads, MLP width,
    and a mixture-of-experts model's experts, so `--ep` reaches the job); the user's own module: the degrees
    alone. A data-parallel config passes unchanged (every degree 1). Returns the layers of each pipeline
    stage as the framework splits them (() without a pipeline or a known layer count). Only a first or last
    stage can be left without a decoder layer (torchtitan's split: it still holds the embedding or the head),
    so every stage the job builds has parameters."""
    from planner.parallel.dims import build, for_model

    if isinstance(spec_json.get("user_code"), dict):
        build(config, world, seq_len=config.seq_len)
        return ()
    return tuple(for_model(ModelSpec.model_validate(spec_json), config, world).chunks)


def check_split(config: TrainConfig) -> None:
    """Megatron's uneven first/last stages, embedding/loss accounting and layouts are refused with one line
    naming the flag: they exist only under --framework megatron, and the probe job runs pipelines with
    torch.distributed.pipelining, not Megatron-Core (jobs/probe.py refuses the megatron framework's
    model-parallel layouts), so a probe would measure an even split instead of the one asked for."""
    from planner.parallel.layer_split import SPLIT_FIELDS, given_split

    given = given_split({f: getattr(config, f) for f in SPLIT_FIELDS})
    if given:
        field, value = next(iter(given.items()))
        raise PlannerError(SPLIT_FIELDS[field][1], value, "not in a probe: Megatron-LM's split; the probe job runs "
                           "torch.distributed.pipelining stages, not Megatron-Core (estimate it instead)")


# ------------------------------------------------------------------------ candidates from a study
# planner.search keeps a study `S` in results/S/journal.log (older searches: results/S/study.db, one Optuna
# study per instance type named `S@<instance>`), with the sweep definition (model, model_options, ...) in the study's user attr
# `planner:definition` and each trial's resolved config in the trial's user attr `config`.

CONFIG_KEYS = tuple(TrainConfig.model_fields)
DEFINITION_ATTR = "planner:definition"


def _trial_key(trial: Any, direction: Any) -> float:
    value = trial.value if trial.value is not None else float("inf")
    return -float(value) if str(getattr(direction, "name", direction)).upper().endswith("MAXIMIZE") else float(value)


def _feasible(trial: Any) -> bool:
    constraints = getattr(trial, "constraints", None)
    if constraints is None:
        constraints = (getattr(trial, "system_attrs", {}) or {}).get("constraints") or []
    if isinstance(constraints, dict):
        constraints = list(constraints.values())
    return all(float(c) <= 0 for c in constraints)


def trial_candidate(trial: Any, definition: dict[str, Any], instance: str) -> dict[str, Any]:
    """model / instance / config of a finished trial (config from user attrs, else from params)."""
    attrs = dict(getattr(trial, "user_attrs", {}) or {})
    params = dict(getattr(trial, "params", {}) or {})
    cfg = dict(attrs.get("config") or {})
    for k in CONFIG_KEYS:
        if k not in cfg and k in params:
            cfg[k] = params[k]
    cfg = {k: v for k, v in cfg.items() if k in CONFIG_KEYS}
    model = definition.get("model") or attrs.get("model")
    if not model or "batch_size" not in cfg or "seq_len" not in cfg:
        raise PlannerError("--study", f"trial {trial.number}",
                           "trials with a config (batch_size, seq_len) in a study whose definition names the model")
    return {"model": model, "instance": instance, "config": TrainConfig.model_validate(cfg),
            "model_options": definition.get("model_options") or {}, "trial": trial.number,
            "feasible": _feasible(trial), "inputs": definition.get("inputs"), "loss": definition.get("loss")}


def find_study_storage(study: str, results: Any) -> str:
    """results/<study>/study.db (planner.search's layout), else any SQLite file under results/ holding it."""
    from pathlib import Path

    import optuna

    results = Path(results)
    journal = results / study / "journal.log"
    if journal.is_file():
        return f"journal:{journal}"
    own = results / study / "study.db"
    candidates = [own] if own.is_file() else sorted(results.rglob("*.db"))
    for db in candidates:
        url = f"sqlite:///{db}"
        try:
            names = [s.study_name for s in optuna.study.get_all_study_summaries(url, include_best_trial=False)]
        except Exception:  # noqa: BLE001 - not an Optuna database
            continue
        if any(n == study or n.startswith(study + "@") for n in names):
            return url
    raise PlannerError("--study", study, f"a study stored under {results}/ (run `planner search --study {study}`)")


def study_candidates(study: str, top: int, results: Any = "results", storage: str | None = None) -> list[dict[str, Any]]:
    """The `top` best feasible finished trials of a search (all its instance types ranked together)."""
    import optuna

    if top < 1:
        raise PlannerError("--top", top, "an integer >= 1")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    from pathlib import Path

    from planner.search.storage import open_storage, parse_storage

    url = storage or find_study_storage(study, results)
    url = open_storage(parse_storage(url, Path(results) / study / "journal.log"))
    names = [s.study_name for s in optuna.study.get_all_study_summaries(url, include_best_trial=False)
             if s.study_name == study or s.study_name.startswith(study + "@")]
    ranked: list[tuple[tuple[float, int], dict[str, Any]]] = []
    for name in names:
        st = optuna.load_study(study_name=name, storage=url)
        definition = dict(st.user_attrs.get(DEFINITION_ATTR) or {})
        instance = definition.get("instance") or (name.split("@", 1)[1] if "@" in name else None)
        if not instance and not definition.get("instances"):
            raise PlannerError("--study", name, "a planner search study (its definition or name gives the instance)")
        direction = st.directions[0]
        for t in st.trials:
            if t.state != optuna.trial.TrialState.COMPLETE:
                continue
            cand = trial_candidate(t, definition, (t.user_attrs.get("config") or {}).get("instance") or instance)
            if cand["feasible"]:
                ranked.append(((_trial_key(t, direction), t.number), cand))
    if not ranked:
        raise PlannerError("--study", study, "a study with feasible completed trials")
    ranked.sort(key=lambda x: x[0])
    out, seen = [], set()
    for _, cand in ranked:
        key = (json.dumps(cand["model"], sort_keys=True, default=str), cand["instance"],
               json.dumps(cand["config"].model_dump(mode="json"), sort_keys=True))
        if key not in seen:
            seen.add(key)
            out.append(cand)
        if len(out) == top:
            break
    return out


def requests_from_study(study: str, top: int, results: Any = "results", **kw: Any) -> list[ProbeRequest]:
    reqs = []
    for cand in study_candidates(study, top, results):
        reqs.append(make_request(cand["model"], cand["config"], cand["instance"], study=study, trial=cand["trial"],
                                 model_options=cand["model_options"], inputs=cand.get("inputs"),
                                 loss=cand.get("loss"), **kw))
    return reqs
