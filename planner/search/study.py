"""Running a search: Optuna studies in a persistent storage, one study per instance type.

Storage layout. By default one SQLite file per search, `results/<study>/study.db`, which opens in
`optuna-dashboard sqlite:///results/<study>/study.db`; `--storage URL` takes any Optuna RDB URL
(postgresql://..., mysql://...). Inside it, the instance type `I` of search `S` is the Optuna study
`S@I`, so one file holds a multi-instance search and each instance type has its own sampler history.

Why one study per instance type, not the instance as a categorical dimension: the answer wanted is
the best configuration *per* instance type (then the cheapest of those), and a shared TPE model would
spend its trials on the best-looking type and leave the others' optima unexplored; the spaces also
differ per GPU (bf16 exists only from A100/A10G on).

Why trials are sampled in memory and written to the storage as each one finishes: Optuna's RDB
storage issues one transaction per parameter and attribute of a running trial (tens per trial), which
would make the storage, not the estimate, the cost of a search; a finished trial is written in one
transaction, so the storage never holds half-written or forever-RUNNING trials, a killed search
loses at most the trial in flight, and re-running with the same study name resumes (its finished
trials seed the sampler). Trials written by other workers sharing the storage are read back after
every trial, so concurrent workers see each other's results and count toward one budget.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from planner.errors import PlannerError
from planner.models.catalog import cached_model
from planner.search.objective import EstimateFn, Objective
from planner.search.space import SearchSpace, resolve_space
from planner.search.sweep import DEFAULT_SWEEP, DEFAULT_TRIALS, Sweep, load_sweep

if TYPE_CHECKING:  # pragma: no cover
    import optuna
    import pandas as pd

STUDY_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
DEFINITION_ATTR = "planner:definition"
STORAGE_ATTEMPTS = 5  # tries to open a storage whose tables another worker is creating
ProgressFn = Callable[[str, int, int], None]  # (instance, finished trials, target)


@dataclass
class InstanceRun:
    """The study of one instance type after the search."""

    instance: str
    study_name: str
    space: SearchSpace
    sampler: str  # the one used: tpe/random become grid when the space is no larger than the budget
    target: int  # trials wanted in the study
    new_trials: int  # trials this process ran
    evaluations: int  # estimate calls (cache misses) this process made
    trials: list[optuna.trial.FrozenTrial] = field(default_factory=list)


@dataclass
class SearchResult:
    name: str
    storage: str  # URL without password
    results_dir: Path
    sweep: Sweep
    direction: str
    runs: list[InstanceRun]
    frame: pd.DataFrame
    files: dict[str, Path] = field(default_factory=dict)

    @property
    def all_infeasible(self) -> bool:
        return not bool(self.frame["feasible"].any()) if len(self.frame) else True


def safe_url(url: str) -> str:
    """The URL with any password masked, for printing and JSON."""
    return re.sub(r"://([^:/@]+):[^@]*@", r"://\1:***@", url)


def default_storage(results_dir: Path, name: str) -> str:
    folder = (results_dir / name).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{folder / 'study.db'}"


def open_storage(url: str) -> optuna.storages.BaseStorage:
    """An Optuna RDB storage; errors (bad URL, server down, missing driver) name --storage."""
    import optuna

    for attempt in range(STORAGE_ATTEMPTS):
        try:
            storage = optuna.storages.RDBStorage(url)
            break
        except Exception as exc:  # sqlalchemy raises many types; all mean "cannot use this URL (now)"
            # Workers starting together on a new database race to create Optuna's tables ("table ...
            # already exists"); the loser succeeds on a retry, once the tables are there.
            if attempt + 1 < STORAGE_ATTEMPTS and "already exists" in str(exc):
                time.sleep(0.2 * (attempt + 1))
                continue
            raise PlannerError("--storage", safe_url(url), f"a reachable Optuna RDB URL ({type(exc).__name__}: "
                               f"{str(exc).splitlines()[0][:200]})") from None
    if storage.engine.name == "sqlite":
        _sqlite_wal(storage.engine)
    return storage


def _sqlite_wal(engine: Any) -> None:
    """Write-ahead log + synchronous=NORMAL: one fsync per checkpoint instead of per trial, still
    crash-safe (a killed process loses nothing committed; https://sqlite.org/wal.html). The file
    stays one database for optuna-dashboard; SQLite folds the -wal file back in when the last
    connection closes."""
    from sqlalchemy import event

    @event.listens_for(engine, "connect")
    def _pragmas(dbapi_connection: Any, _record: Any) -> None:
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.close()

    engine.dispose()  # connections opened by RDBStorage's setup reconnect with the pragmas


def make_sampler(kind: str, space: SearchSpace, seed: int) -> optuna.samplers.BaseSampler:
    """tpe: multivariate TPE (constraints come from trial.set_constraint); grid: every point; random."""
    import optuna

    if kind == "tpe":
        return optuna.samplers.TPESampler(multivariate=True, seed=seed)
    if kind == "grid":
        return optuna.samplers.GridSampler({k: list(v) for k, v in space.parameters().items()}, seed=seed)
    if kind == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    raise PlannerError("--sampler", kind, "tpe, grid, random")


def _check_definition(study: optuna.Study, definition: dict[str, Any], name: str, instance: str) -> None:
    stored = study.user_attrs.get(DEFINITION_ATTR)
    if stored is None:
        study.set_user_attr(DEFINITION_ATTR, definition)
        return
    if stored != definition:
        keys = sorted(k for k in set(stored) | set(definition) if stored.get(k) != definition.get(k))
        raise PlannerError("--study", name, f"a new name: this study already holds a search on {instance} with "
                           f"different {', '.join(keys)}")


class _Mirror:
    """Samples in an in-memory study and writes each finished trial to the persistent one.

    Other workers' trials are found cheaply: RDB trial numbers are consecutive per study, so while the
    numbers we know are 0..n-1, the study has a new trial exactly when number n exists (one indexed
    lookup); only then are the new trials read.
    """

    def __init__(self, persistent: optuna.Study, sampler: optuna.samplers.BaseSampler):
        import optuna

        self.storage = persistent._storage
        self.study_id = persistent._study_id
        self.memory = optuna.create_study(direction=persistent.direction, sampler=sampler)
        self.known: set[int] = set()  # persistent trial numbers seen (ours and others')
        self.saved: set[int] = set()  # in-memory trial numbers already written
        self.complete = 0  # COMPLETE trials in the in-memory study
        self._read_new()

    def _contiguous(self) -> bool:
        return len(self.known) == (max(self.known) + 1 if self.known else 0)

    def _read_new(self) -> None:
        import optuna

        for trial in self.storage.get_all_trials(self.study_id, deepcopy=False):
            if trial.number in self.known or not trial.state.is_finished():
                continue
            self.known.add(trial.number)
            if trial.state == optuna.trial.TrialState.COMPLETE:
                self.memory.add_trial(trial)
                self.complete += 1

    def sync(self) -> None:
        """Copy finished trials that other processes wrote into the in-memory study."""
        if self._contiguous():
            try:
                self.storage.get_trial_id_from_study_id_trial_number(self.study_id, len(self.known))
            except KeyError:
                return
        self._read_new()

    def save(self, trial: optuna.trial.FrozenTrial) -> None:
        """Write one finished in-memory trial (params, values, attrs, constraints) in one transaction."""
        import optuna

        if trial.number in self.saved:
            return
        self.saved.add(trial.number)
        trial_id = self.storage.create_new_trial(self.study_id, template_trial=trial)
        self.known.add(self.storage.get_trial_number_from_id(trial_id))
        if trial.state == optuna.trial.TrialState.COMPLETE:
            self.complete += 1


def run_instance(storage: optuna.storages.BaseStorage, name: str, sweep: Sweep, instance: str, *,
                 trials: int | None, sampler: str | None, seed: int, estimate_fn: EstimateFn | None = None,
                 progress: ProgressFn | None = None) -> InstanceRun:
    """Search one instance type until its study holds `trials` finished trials (grid: every point)."""
    import optuna

    from planner.hardware import get_instance

    model = cached_model(sweep.model, sweep.model_options)
    inst = get_instance(instance)
    space = resolve_space(sweep.space, model, inst, min_seq_len=sweep.constraints.min_seq_len, fixed=sweep.fixed)
    objective = Objective(model, inst, space, constraints=sweep.constraints, objective=sweep.objective,
                          estimate_fn=estimate_fn)
    study_name = f"{name}@{inst.name}"
    persistent = optuna.create_study(storage=storage, study_name=study_name, direction=objective.direction,
                                     load_if_exists=True)
    _check_definition(persistent, {**sweep.definition(), "instance": inst.name}, name, inst.name)
    if sampler is None:  # not chosen: a space no larger than the budget is searched exhaustively
        sampler = "grid" if space.size <= (trials or DEFAULT_TRIALS) else "tpe"
    smp = make_sampler(sampler, space, seed)
    mirror = _Mirror(persistent, smp)
    before = mirror.complete
    if isinstance(smp, optuna.samplers.GridSampler):
        # The grid sampler stops the study itself once every point is done (trials of an earlier TPE
        # run in the same study do not count as grid points); --trials caps the study's size.
        budget = 0 if smp.is_exhausted(mirror.memory) else space.size
        target = min(trials, before + budget) if trials else before + budget
    else:
        target = trials or DEFAULT_TRIALS
    remaining = target - before

    def after_trial(study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
        mirror.save(trial)
        mirror.sync()
        done = mirror.complete
        if progress is not None:
            progress(inst.name, min(done, target), target)
        if done >= target:
            study.stop()

    if progress is not None:
        progress(inst.name, min(before, target), target)
    if remaining > 0:
        try:
            mirror.memory.optimize(objective, n_trials=remaining, callbacks=[after_trial])
        except Exception:
            # A bug in an estimate: keep its FAIL trial next to the finished ones, then let it surface.
            for trial in mirror.memory.get_trials(deepcopy=False, states=(optuna.trial.TrialState.FAIL,)):
                mirror.save(trial)
            raise
    mirror.sync()
    if progress is not None:
        progress(inst.name, mirror.complete, max(mirror.complete, target))
    return InstanceRun(instance=inst.name, study_name=study_name, space=space, sampler=sampler, target=target,
                       new_trials=len(mirror.saved), evaluations=objective.evaluations,
                       trials=persistent.get_trials(deepcopy=False))


def resolve_name(sweep: Sweep, study: str | None) -> str:
    name = study or f"{sweep.name}-{sweep.fingerprint()}"
    if not STUDY_NAME.match(name):
        raise PlannerError("--study", name, "letters, digits, '.', '_' and '-', starting with a letter or digit")
    return name


def run_search(sweep: Sweep | str | Path | None = None, *, study: str | None = None, storage: str | None = None,
               trials: int | None = None, sampler: str | None = None, seed: int | None = None,
               results_dir: str | Path = "results", estimate_fn: EstimateFn | None = None,
               progress: ProgressFn | None = None, write_files: bool = True) -> SearchResult:
    """Run (or resume) a search and write its results under `results_dir/<study>/`.

    `sweep`: a Sweep, a YAML path, or None for the built-in default (multimodal BERT on ml.p3.16xlarge).
    `trials`, `sampler`, `seed` override the sweep's `search:` section; with no sampler named anywhere,
    TPE searches each instance type, or the grid when its space has no more points than the budget. Returns every trial of every
    instance type's study (including trials of earlier runs and of other workers).
    """
    import optuna

    from planner.search.results import trials_frame, write_results

    if sweep is None:
        sweep = DEFAULT_SWEEP
    elif not isinstance(sweep, Sweep):
        sweep = load_sweep(sweep)
    sampler = sampler or sweep.search.sampler
    seed = sweep.search.seed if seed is None else seed
    trials = trials or sweep.search.trials
    if trials is not None and trials <= 0:
        raise PlannerError("--trials", trials, "a positive integer")
    name = resolve_name(sweep, study)
    results_dir = Path(results_dir)
    instances = sweep.instance_names()
    cached_model(sweep.model, sweep.model_options)  # a bad model fails before any storage is created
    url = storage or default_storage(results_dir, name)
    store = open_storage(url)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    runs = [run_instance(store, name, sweep, inst, trials=trials, sampler=sampler, seed=seed,
                         estimate_fn=estimate_fn, progress=progress) for inst in instances]
    frame = trials_frame(runs)
    direction = "maximize" if sweep.objective.target == "throughput" else "minimize"
    result = SearchResult(name=name, storage=safe_url(url), results_dir=results_dir / name, sweep=sweep,
                          direction=direction, runs=runs, frame=frame)
    if write_files:
        result.files = write_results(result)
    return result
