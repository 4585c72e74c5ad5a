"""Running a search: ONE Optuna study over the joint space (instance type × count × configuration).

Why one study: "one p4d or four p3.16xlarge?" is a question across instance types and counts, so the
instance type is a parameter like the micro-batch, and the sampler spends its trials where the answer
is (the cheapest types, for a cost objective) instead of giving every type the same budget. Before TPE,
each type gets its own search: a start the memory model says fits (AMP, DDP, the largest micro-batch that
fits), then a deterministic descent from it (planner.search.local), recorded as trials of the study, so
the per-type table has a row for every type that can run the job, at what a search of that type alone
finds (issue 22: with ~10 TPE trials per type, --instance all listed p3.16xlarge at 876.8 samples/s where
its own search finds 1,013.7). The study's name shows the instance set
(`multimodal-bert-p3-p3.16xlarge-<hash>`, `...-all-<hash>`), so results of different searches never
overwrite each other.

Why the last trials of a TPE search are not sampled: they try one-setting changes to the best configuration of
each of the two leading instance types (planner.search.polish), because TPE can settle in one type's basin
and never pair the right values in another (up to 16 trials: a setting they do not reach stays untried).

Why trials are sampled in memory and written to the storage as each one finishes: Optuna's RDB
storage issues one transaction per parameter and attribute of a running trial, which would make the
storage, not the estimate, the cost of a search; a finished trial is written as one record, so the
storage never holds half-written or forever-RUNNING trials, a killed search loses at most the trial in
flight, and re-running with the same study name resumes (its finished trials seed the sampler).

Many workers: each worker takes a number when it joins (under the storage's StudyLock), samples with
seed + that number, and writes a trial only while the study holds fewer than the shared budget and no
trial at the same grid point (checked under the lock after reading the others' trials), so the study
ends with exactly the budget and a grid is covered once.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from planner.build import estimator_build
from planner.errors import PlannerError, interrupted
from planner.search.local import descend
from planner.search.objective import EstimateFn, Objective
from planner.search.polish import polish_points, polish_reserve
from planner.search.records import SearchResult, Start, StudyRun  # noqa: F401  (re-exported)
from planner.search.space import INDEX_SUFFIX, SearchSpace, gpu_can_run, resolve_space
from planner.search.storage import (
    StorageSpec,
    StudyLock,
    open_storage,
    parse_storage,
    release_locks,
    remove_if_empty,
)
from planner.search.sweep import DEFAULT_SWEEP, Sweep, load_sweep, sweep_model

if TYPE_CHECKING:  # pragma: no cover
    import optuna

    from planner.spec import Instance

STUDY_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
DEFINITION_ATTR = "planner:definition"
BUILD_ATTR = "planner:build"  # planner.build.estimator_build() of the process that created the study
WORKERS_ATTR = "planner:workers"
JOURNAL_FILE = "journal.log"
# TPE trials when no count is given: benchmarks/search_benchmark.py shows TPE reaching >= 99% of the
# exhaustive optimum within this budget on the default joint space; each further instance type adds
# TRIALS_PER_EXTRA_TYPE: room for what a multi-type study records of it before TPE, its start and the
# moves of its descent (planner.search.local: 1-3 moves on the reference job, ~3 trials a type in all). Not more: with every type
# already at its own search's best (benchmarks/search_benchmark.py), further TPE trials over 55 types
# would cost ~10 ms each in sampling alone and stretch `--instance all` past its 5 s.
from planner.search.limits import DEFAULT_TRIALS, TRIALS_PER_EXTRA_TYPE  # noqa: E402  (the help text reads them)

ProgressFn = Callable[[str, int, int], None]  # (label, finished trials, target)
# From this many types, a study's descents replay far more than compiled.COMPILE_AFTER steps, so the compiled
# replay is loaded before them rather than after ~0.4 s of replays in Python that it would then repeat faster.
WARM_REPLAY_TYPES = 8


def default_trials(types: int) -> int:
    return DEFAULT_TRIALS + TRIALS_PER_EXTRA_TYPE * (types - 1)


class SearchInterrupted(KeyboardInterrupt):
    """Ctrl-C during a search, carrying the study as it stands: every finished trial is already stored, and
    `run_search` writes their table and best before the interrupt goes on (a user who stops a long search
    wants what it found so far)."""

    def __init__(self, run: StudyRun, objective: Objective) -> None:
        super().__init__()
        self.run, self.objective = run, objective
        self.result: SearchResult | None = None  # set by run_search once the files are written

    @property
    def finished(self) -> int:
        """Trials that completed before the interrupt."""
        import optuna

        return sum(t.state == optuna.trial.TrialState.COMPLETE for t in self.run.trials)


def make_sampler(kind: str, space: SearchSpace, seed: int, objectives: int = 1) -> optuna.samplers.BaseSampler:
    """tpe: multivariate TPE (several objectives: its multi-objective form, MOTPE; constraints come from
    trial.set_constraint); grid: every point; random."""
    import optuna

    if kind == "tpe":
        return optuna.samplers.TPESampler(multivariate=True, seed=seed)
    if kind == "grid":
        return optuna.samplers.GridSampler({k: list(v) for k, v in space.parameters().items()}, seed=seed)
    if kind == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    raise PlannerError("--sampler", kind, "tpe, grid, random")


def _check_definition(study: optuna.Study, definition: dict[str, Any], name: str, build: str) -> None:
    """A study holds one search: the same definition, estimated by the same build (planner.build)."""
    stored = study.user_attrs.get(DEFINITION_ATTR)
    if stored is None:
        study.set_user_attr(DEFINITION_ATTR, definition)
        study.set_user_attr(BUILD_ATTR, build)
        return
    if stored != definition:
        keys = sorted(k for k in set(stored) | set(definition) if stored.get(k) != definition.get(k))
        raise PlannerError("--study", name, f"a new name: this study already holds a search with different "
                           f"{', '.join(keys)}")
    made_by = study.user_attrs.get(BUILD_ATTR)
    if made_by != build:
        raise PlannerError("--study", name, f"a new name, or the study removed: its trials were estimated by "
                           f"another build of planner ({made_by or 'an older one'}, this is {build}), whose "
                           "figures may differ from this one's")


def _point_key(trial: optuna.trial.FrozenTrial) -> tuple:
    return tuple(sorted(trial.params.items()))


class _Mirror:
    """Samples in an in-memory study and writes each finished trial to the persistent one (one record).

    Other workers' trials are found cheaply: trial numbers are consecutive per study, so while the
    numbers we know are 0..n-1, the study has a new trial exactly when number n exists (one lookup);
    only then are the new trials read.
    """

    def __init__(self, persistent: optuna.Study, sampler: optuna.samplers.BaseSampler, lock: StudyLock,
                 unique_points: bool):
        import optuna

        self.storage = persistent._storage
        self.study_id = persistent._study_id
        self.lock = lock
        self.unique_points = unique_points
        self.memory = optuna.create_study(directions=persistent.directions, sampler=sampler)
        self.known: set[int] = set()  # persistent trial numbers seen (ours and others')
        self.points: set[tuple] = set()  # params of the persistent trials
        self.written = 0  # trials this process wrote
        self.complete = 0  # COMPLETE trials in the persistent study that we know of
        self._read_new()

    def _contiguous(self) -> bool:
        return len(self.known) == (max(self.known) + 1 if self.known else 0)

    def _read_new(self) -> None:
        import optuna

        for trial in self.storage.get_all_trials(self.study_id, deepcopy=False):
            if trial.number in self.known or not trial.state.is_finished():
                continue
            self.known.add(trial.number)
            self.points.add(_point_key(trial))
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

    def save(self, trial: optuna.trial.FrozenTrial, target: int) -> bool:
        """Write one finished in-memory trial, unless the shared budget is full or (grid) another worker
        already wrote its point; False when it was not written."""
        import optuna

        with self.lock.hold():
            self.sync()
            if self.complete >= target or (self.unique_points and _point_key(trial) in self.points):
                return False
            trial_id = self.storage.create_new_trial(self.study_id, template_trial=trial)
            self.known.add(self.storage.get_trial_number_from_id(trial_id))
            self.points.add(_point_key(trial))
            self.written += 1
            if trial.state == optuna.trial.TrialState.COMPLETE:
                self.complete += 1
            return True


def _join(study: optuna.Study, lock: StudyLock) -> int:
    """This process's worker number: how many workers joined the study before it."""
    with lock.hold():
        number = int(study.user_attrs.get(WORKERS_ATTR, 0))
        study.set_user_attr(WORKERS_ATTR, number + 1)
    return number


# Preferred values of a per-type starting trial, most preferred first (values the space lacks or the GPU
# cannot run are skipped; a dimension with none of them takes its first value): what a user would try first.
START_PREFERENCES: dict[str, tuple[Any, ...]] = {
    "precision": ("amp-bf16", "amp-fp16", "fp32"),
    "parallelism": ("ddp", "zero1", "zero2", "zero3", "fsdp"),
    "checkpointing": (False,),
    # a model split by tensor parallelism starts with the widest TP the instance holds (NVLink-bound groups:
    # what Megatron recipes run for models that need TP at all; planner.search.space gpu_can_run drops wider)
    "tp": (8, 4, 2, 1),
}
# What a start falls back to, in order, while no micro-batch fits: the usual memory savers (checkpointing,
# then sharding everything: ZeRO-3, FSDP), as a user would try them. Overrides absent from the space are
# skipped.
START_FALLBACKS: tuple[dict[str, Any], ...] = (
    {},
    {"checkpointing": True},
    {"checkpointing": True, "parallelism": "zero3"},
    {"checkpointing": True, "parallelism": "fsdp"},
)


def _largest_fitting(candidates: list[int], fits: Callable[[int], bool]) -> int | None:
    """The last index of `candidates` (micro-batch indices, ascending) for which `fits` holds, by bisection:
    the estimate's peak grows with the micro-batch, so ~log2(len) estimates instead of len. None when the
    smallest does not fit."""
    if not candidates or not fits(candidates[0]):
        return None
    lo, hi = 0, len(candidates) - 1  # candidates[lo] fits
    if fits(candidates[hi]):
        return candidates[hi]
    while hi - lo > 1:  # candidates[hi] does not fit
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(candidates[mid]) else (lo, mid)
    return candidates[lo]


def _start_params(space: SearchSpace, instance: Instance, overrides: dict[str, Any]) -> dict[str, Any] | None:
    """A start's parameters except the micro-batch: `overrides`, else the preferred value of each dimension
    the GPU runs (None when an override is not in the space)."""
    values = space.values()
    params: dict[str, Any] = {}
    for dim, value in overrides.items():
        if value not in values[dim]:
            return None
    for pname in space.parameters():
        dim = pname[: -len(INDEX_SUFFIX)] if pname.endswith(INDEX_SUFFIX) else pname
        if dim == "instance":
            params[pname] = instance.name
            continue
        runnable = [v for v in values[dim] if gpu_can_run(instance, dim, v)] or list(values[dim])
        prefer = (overrides[dim],) if dim in overrides else START_PREFERENCES.get(dim, ())
        value = next((v for v in prefer if v in runnable), runnable[0])
        params[pname] = values[dim].index(value) if pname.endswith(INDEX_SUFFIX) else value
    return params


def start_points(space: SearchSpace, objective: Objective) -> list[Start]:
    """One starting trial per instance type, chosen with the memory model so that every type gets a fair
    chance: TPE alone spreads ~budget/types trials over a type and may never sample a micro-batch that fits
    it (issue 10: p3.2xlarge reported "no feasible configuration" while it trains the reference job at
    micro-batch 8-16 with accumulation); on one type, where few points fit (llama-2-7b on p4d.24xlarge:
    26 of 100 TPE trials, the best of them fp32 at 1/8 of the AMP speed), it starts TPE from one that does.

    The start: the preferred values (START_PREFERENCES: AMP, DDP, no checkpointing; what the GPU runs) and the
    largest micro-batch whose estimate is feasible (a sure fit that hits the recipe's global batch), found by
    bisection (`_largest_fitting`); when none fits, the same after each START_FALLBACKS (checkpointing, then
    ZeRO-3, FSDP); when still none, the last smallest micro-batch tried, marked infeasible with its reason. Each probe is an objective evaluation, cached, so the
    enqueued trial itself costs nothing more. A start, not a guess at the optimum."""
    if not space.parameters():
        return []
    # A search over several sequence lengths answers with one best per length (a front): each length gets
    # its start on every type, or TPE, drawn to the cheapest length, may never try the longest.
    lengths = space.values().get("seq_len", ())
    bases = [{"seq_len": n} for n in lengths] if len(lengths) > 1 else [{}]
    starts = []
    for name in space.instance_types:
        try:
            starts.extend(_start(space, objective, name, base) for base in bases)
        except Exception:  # a bug in an estimate: the first trial meets it again and keeps it as a FAIL trial
            break
    return starts


def _start(space: SearchSpace, objective: Objective, name: str, base: dict[str, Any] | None = None) -> Start:
    """The start of one instance type (see start_points); `base`: values every candidate keeps (a length)."""
    batches = len(space.values()["batch_size"])

    def with_batch(params: dict[str, Any], index: int) -> dict[str, Any]:
        return {**params, "batch_size" + INDEX_SUFFIX: index} if batches > 1 else params

    instance = objective.instances[name]
    reason, smallest, tried = "no micro-batch hits the global batch", None, set()
    for overrides in START_FALLBACKS:
        params = _start_params(space, instance, {**(base or {}), **overrides})
        if params is None:
            continue
        # only micro-batches that hit the global batch exactly can be feasible
        points = {i: space.point(space.decode(with_batch(params, i))) for i in range(batches)}
        candidates = [i for i, point in points.items() if point.config is not None]
        if not candidates or points[candidates[0]] in tried:  # one GPU: zero3 and fsdp are `single`
            continue
        tried.add(points[candidates[0]])
        best = _largest_fitting(candidates, lambda i, points=points: objective.evaluate_point(points[i]).feasible)
        if best is not None:
            return Start(name, with_batch(params, best), True)
        smallest = with_batch(params, candidates[0])
        reason = objective.evaluate_point(points[candidates[0]]).reason
    return Start(name, smallest or with_batch(_start_params(space, instance, dict(base or {})) or {}, 0), False, reason)


def run_study(storage: optuna.storages.BaseStorage, spec: StorageSpec, name: str, sweep: Sweep, *,
              trials: int | None, sampler: str | None, seed: int, estimate_fn: EstimateFn | None = None,
              progress: ProgressFn | None = None) -> tuple[StudyRun, Objective]:
    """Search the joint space until the study holds `trials` finished trials (grid: every point)."""
    import optuna

    from planner.hardware import get_instance

    model = sweep_model(sweep)
    types = [get_instance(n) for n in sweep.instance_names()]
    space = resolve_space(sweep.seq_space(), model, types, min_seq_len=sweep.constraints.min_seq_len,
                          fixed=sweep.fixed, global_batch_size=sweep.recipe.global_batch_size)
    objective = Objective(model, types, space, constraints=sweep.constraints, objective=sweep.objective,
                          recipe=sweep.recipe, target=sweep.target(), estimate_fn=estimate_fn,
                          estimate_kwargs=sweep.estimate_kwargs())
    lock = StudyLock.for_storage(spec, storage, name)
    with lock.hold():
        persistent = optuna.create_study(storage=storage, study_name=name, directions=objective.directions,
                                         load_if_exists=True)
        _check_definition(persistent, sweep.definition(), name, estimator_build())
    worker = _join(persistent, lock)
    budget = trials or default_trials(len(types))
    if sampler is None:  # not chosen: a space no larger than the budget is searched exhaustively
        sampler = "grid" if space.size <= budget else "tpe"
    grid = sampler == "grid"
    starts: list[Start] = []
    descend_first = False
    # Grid: the same seed in every worker, because it shuffles the grid and a trial's grid_id indexes that
    # shuffled list (optuna's GridSampler docs: fix the seed in distributed runs); then the worker's own seed
    # for choosing among the unvisited points, so that workers do not all pick the same next point.
    smp = make_sampler(sampler, space, seed if grid else seed + worker, len(objective.directions))
    if grid:
        smp._rng.rng.seed(seed + worker)
    mirror = _Mirror(persistent, smp, lock, unique_points=grid)
    before = mirror.complete
    if grid:
        # The grid sampler stops the study itself once every point is done (trials of an earlier TPE
        # run in the same study do not count as grid points); --trials caps the study's size.
        todo = 0 if smp.is_exhausted(mirror.memory) else space.size
        target = min(trials, before + todo) if trials else before + todo
    else:
        target = budget
        if before == 0:
            # several types: each type's own search (its start, then its descent) is recorded before TPE;
            # one type keeps the plain TPE search from its start (unchanged: it already finds its best)
            # A search over several sequence lengths answers with a front, one best per length: a descent
            # minimising one figure over all lengths would settle on the shortest and starve the others, so
            # such a search keeps TPE from its starts.
            descend_first = (len(space.instance_types) > 1 and sampler == "tpe" and len(objective.directions) == 1
                             and len(space.values().get("seq_len", ())) <= 1)
            if descend_first and estimate_fn is None and len(space.instance_types) >= WARM_REPLAY_TYPES:
                from planner.memory import compiled

                compiled.warm()  # starts and descents replay ~25 new steps a type: the compiled replay at once
            starts = start_points(space, objective)
            if not descend_first:
                for start in starts:
                    mirror.memory.enqueue_trial(start.params, skip_if_exists=True)

    # TPE's last trials try one-setting changes to the best configurations (planner.search.polish)
    polish_at = target - polish_reserve(budget) if sampler == "tpe" and len(objective.directions) == 1 else None
    polished = False

    def polish(study: optuna.Study) -> None:
        nonlocal polished
        polished = True
        for params in _polish_params(study, objective, space, target - mirror.complete):
            study.enqueue_trial(params, skip_if_exists=True)

    def after_trial(study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
        mirror.save(trial, target)
        if progress is not None:
            progress(name, min(mirror.complete, target), target)
        if mirror.complete >= target or (grid and smp.is_exhausted(study)):
            study.stop()
        elif polish_at is not None and not polished and mirror.complete >= polish_at:
            polish(study)

    if progress is not None:
        progress(name, min(mirror.complete, target), target)

    def the_run(trials: list[optuna.trial.FrozenTrial]) -> StudyRun:
        return StudyRun(study_name=name, space=space, sampler=sampler, target=target, new_trials=mirror.written,
                        evaluations=objective.evaluations, worker=worker, seed=seed + worker, starts=starts,
                        trials=trials)

    def record_descents() -> None:
        for params in _descents(space, objective, starts)[:target]:
            trial = _record(objective, space, params)
            mirror.memory.add_trial(trial)
            mirror.save(trial, target)
            if progress is not None:
                progress(name, min(mirror.complete, target), target)

    if target > mirror.complete:
        try:
            if descend_first:
                record_descents()
            if polish_at is not None and mirror.complete >= polish_at:  # a resumed study already in its last trials
                polish(mirror.memory)
            if target > mirror.complete:
                # The grid stops itself once every point is in the in-memory study (ours and the others'
                # trials); a point another worker wrote meanwhile is skipped by `save`, not written twice.
                remaining = space.size if grid else target - mirror.complete
                mirror.memory.optimize(objective, n_trials=remaining, callbacks=[after_trial])
        except KeyboardInterrupt:
            raise SearchInterrupted(the_run(persistent.get_trials(deepcopy=False)), objective) from None
        except Exception as exc:
            if interrupted(exc):  # Ctrl-C inside optuna's tell: an interrupt, not a failed trial to keep
                raise SearchInterrupted(the_run(persistent.get_trials(deepcopy=False)), objective) from None
            # A bug in an estimate: keep its FAIL trial next to the finished ones, then let it surface.
            for trial in mirror.memory.get_trials(deepcopy=False, states=(optuna.trial.TrialState.FAIL,)):
                mirror.save(trial, target + 1)
            raise
    mirror.sync()
    if progress is not None:
        progress(name, mirror.complete, max(mirror.complete, target))
    return the_run(persistent.get_trials(deepcopy=False)), objective


def _descents(space: SearchSpace, objective: Objective, starts: list[Start]) -> list[dict[str, Any]]:
    """The points a multi-type study records before TPE: every type's start, then the rest of each feasible
    start's descent (planner.search.local), type after type. Starts come first so that a --trials smaller
    than the descents still gives every type its row."""
    sign = 1.0 if objective.direction == "minimize" else -1.0
    parameters = space.parameters()

    def score(params: dict[str, Any]) -> float | None:
        result = objective.evaluate_point(space.point(space.decode(params)))
        return sign * result.values[0] if result.feasible else None

    paths = []
    for start in starts:
        try:
            paths.append(descend(start.params, parameters, score) if start.feasible else [start.params])
        except Exception:  # a bug in an estimate: as in start_points, a TPE trial meets it and keeps it (FAIL)
            paths.append([start.params])
    out = [path[0] for path in paths]
    for path in paths:
        out.extend(path[1:])
    return out


def _record(objective: Objective, space: SearchSpace, params: dict[str, Any]) -> optuna.trial.FrozenTrial:
    """A finished trial of `params` as Objective.__call__ would have made it (same distributions, values,
    constraints and evidence), without a sampler round trip: the point is already evaluated (cached)."""
    import optuna

    dists: dict[str, optuna.distributions.BaseDistribution] = {}
    for pname, choices in space.parameters().items():
        if pname in params:
            dists[pname] = (optuna.distributions.IntDistribution(0, len(choices) - 1) if pname.endswith(INDEX_SUFFIX)
                            else optuna.distributions.CategoricalDistribution(choices))
    result = objective.evaluate_point(space.point(space.decode(params)))
    return optuna.trial.create_trial(params=params, distributions=dists, values=list(result.values),
                                     user_attrs=result.attrs, constraints=result.constraints)


def _polish_params(study: optuna.Study, objective: Objective, space: SearchSpace, limit: int) -> list[dict[str, Any]]:
    """Untried one-setting changes to the best configurations so far (planner.search.polish), scored with the
    objective's cache (every tried point is in it)."""
    sign = 1.0 if objective.direction == "minimize" else -1.0

    def score(params: dict[str, Any]) -> float | None:
        result = objective.evaluate_point(space.point(space.decode(params)))
        return sign * result.values[0] if result.feasible else None

    tried = [t.params for t in study.get_trials(deepcopy=False)]
    return polish_points(tried, space.parameters(), score, limit)


def instance_tag(names: list[str]) -> str:
    """The instance set in a study name: one type 'p3.16xlarge', up to three joined by '_', the whole
    catalog 'all', else '<n>-types'."""
    from planner.hardware import list_instances

    short = [n.removeprefix("ml.") for n in names]
    if len(names) > 3 and sorted(names) == sorted(list_instances()):
        return "all"
    if len(short) <= 3:
        return "_".join(short)
    return f"{len(short)}-types"


def resolve_name(sweep: Sweep, study: str | None) -> str:
    name = study or f"{sweep.name}-{instance_tag(sweep.instance_names())}-{sweep.fingerprint()}"
    if not STUDY_NAME.match(name):
        raise PlannerError("--study", name, "letters, digits, '.', '_' and '-', starting with a letter or digit")
    return name


def run_search(sweep: Sweep | str | Path | None = None, *, study: str | None = None, storage: str | None = None,
               trials: int | None = None, sampler: str | None = None, seed: int | None = None,
               results_dir: str | Path = "results", estimate_fn: EstimateFn | None = None,
               progress: ProgressFn | None = None, write_files: bool = True) -> SearchResult:
    """Run (or resume) a search and write its results under `results_dir/<study>/`.

    `sweep`: a Sweep, a YAML path, or None for the built-in default (the reference multimodal job on
    ml.p3.16xlarge). `trials`, `sampler`, `seed` override the sweep's `search:` section; with no sampler
    named anywhere, TPE, or the grid when the space has no more points than the budget. Returns every trial
    of the study (including trials of earlier runs and of other workers).
    """
    import optuna

    from planner.search.results import trials_rows, write_results

    if sweep is None:
        sweep = DEFAULT_SWEEP
    elif not isinstance(sweep, Sweep):
        sweep = load_sweep(sweep)
    sampler = sampler or sweep.search.sampler
    seed = sweep.search.seed if seed is None else seed
    trials = trials or sweep.search.trials
    from planner.search.limits import MAX_TRIALS

    if trials is not None and not 1 <= trials <= MAX_TRIALS:
        raise PlannerError("--trials", trials, f"an integer >= 1 and <= {MAX_TRIALS:,}")
    name = resolve_name(sweep, study)
    results_dir = Path(results_dir)
    sweep_model(sweep)  # a bad model fails before any storage is created
    from planner.memory.runtime import check_calibration
    from planner.prices import load_cache
    from planner.program.sources import many_batches

    load_cache()  # so does a corrupt prices cache or calibration (else every trial is infeasible for it)
    check_calibration()
    folder = results_dir / name
    spec = parse_storage(storage, folder / JOURNAL_FILE)
    file = spec.file
    created = file is not None and not file.exists()
    made_root = not results_dir.exists()
    folder_made = storage is None and not folder.exists()
    if storage is None:
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # e.g. a place even root cannot make folders in (/proc)
            raise PlannerError("--results-dir", str(results_dir),
                               f"a writable folder ({exc.strerror or exc})") from None

    def leave_nothing() -> None:
        """A search that stored no trial leaves no storage file, study folder or results folder it made."""
        remove_if_empty(spec, created, folder_made)
        if made_root:
            with contextlib.suppress(OSError):
                results_dir.rmdir()
    optuna.logging.set_verbosity(optuna.logging.WARNING)

    def result_of(run: StudyRun, objective: Objective) -> SearchResult:
        rows, kinds = trials_rows(run)
        result = SearchResult(name=name, storage=spec.display(), results_dir=folder, sweep=sweep,
                              target=objective.target, directions=objective.directions, run=run, rows=rows,
                              kinds=kinds)
        if write_files:
            result.files = write_results(result)
        return result

    try:
        store = open_storage(spec)
        # a traced model: two traces per shape class, every micro-batch after them interpolated (issue 38)
        with many_batches():
            run, objective = run_study(store, spec, name, sweep, trials=trials, sampler=sampler, seed=seed,
                                       estimate_fn=estimate_fn, progress=progress)
    except SearchInterrupted as stop:
        if stop.finished:  # the table and best of what was found so far; a second Ctrl-C leaves no half file
            stop.result = result_of(stop.run, stop.objective)
        else:
            leave_nothing()
        raise
    except BaseException:
        leave_nothing()
        raise
    finally:
        release_locks(spec)
    return result_of(run, objective)

