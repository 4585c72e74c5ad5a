"""The records a search hands back (its study, the per-type starts, the result with its table), in a module of
their own so that the results writer (planner.search.results) reads them without importing the study runner
(planner.search.study), which calls the writer: issue 33 broke that cycle."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from planner.search.space import SearchSpace
from planner.search.sweep import Sweep

if TYPE_CHECKING:  # pragma: no cover
    import optuna
    import pandas as pd


@dataclass(frozen=True)
class Start:
    """The starting trial of one instance type: its parameters, and whether the memory model says it runs
    (when it does not, even the smallest micro-batch with checkpointing failed: `reason` says why)."""

    instance: str
    params: dict[str, Any]
    feasible: bool
    reason: str = ""


@dataclass
class StudyRun:
    """The study after the search."""

    study_name: str
    space: SearchSpace
    sampler: str  # the one used: tpe/random become grid when the space is no larger than the budget
    target: int  # trials wanted in the study
    new_trials: int  # trials this process wrote
    evaluations: int  # estimate calls (cache misses) this process made
    worker: int  # this process's worker number (0 for the first to join)
    seed: int  # the sampler seed it used: the sweep's seed + worker
    starts: list[Start] = field(default_factory=list)  # per-type starting trials (fresh multi-type studies)
    trials: list[optuna.trial.FrozenTrial] = field(default_factory=list)

    @property
    def instances(self) -> tuple[str, ...]:
        return self.space.instance_types


@dataclass
class SearchResult:
    """A search's study and its trial table: `rows` (planner.search.results.trials_rows: one dict per trial,
    every column, pandas' types; what the command prints and writes) and `frame`, the same table as a pandas
    DataFrame, built when first asked for (pandas' import is a quarter of a default search's time)."""

    name: str
    storage: str  # URL without password, or the journal file
    results_dir: Path
    sweep: Sweep
    target: str  # throughput, cost, time or pareto
    directions: list[str]
    run: StudyRun
    rows: list[dict[str, Any]]
    kinds: dict[str, str]  # each column's kind (planner.search.table.column_kind)
    files: dict[str, Path] = field(default_factory=dict)
    _frame: Any = field(default=None, repr=False, compare=False)

    @property
    def frame(self) -> pd.DataFrame:
        """The trial table as a DataFrame (built once, on first use, from `rows`)."""
        if self._frame is None:
            from planner.search.table import frame_of

            self._frame = frame_of(self.rows, self.kinds)
        return self._frame

    @property
    def direction(self) -> str:
        return self.directions[0]

    @property
    def runs(self) -> list[StudyRun]:
        return [self.run]

    @property
    def all_infeasible(self) -> bool:
        return not any(row["feasible"] for row in self.rows)
