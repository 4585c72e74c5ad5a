"""Four worker processes start together on one fresh study: every one exits 0, the study holds exactly the
shared budget, and no grid point is evaluated twice (journal file, SQLite and, when its binaries exist,
PostgreSQL through a plain postgresql:// URL)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
from search_fixtures import postgres_server

ROOT = Path(__file__).resolve().parents[1]
WORKERS = 4

WORKER = """
import json, sys, time
from pathlib import Path
sys.path.insert(0, "tests")
from search_fixtures import fake_estimate
from planner.search.study import run_search
from planner.search.sweep import DEFAULT_SWEEP
storage, go, results, sampler, trials = sys.argv[1], Path(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
sweep = DEFAULT_SWEEP.with_overrides(instance="ml.p3.2xlarge,ml.g5.xlarge",
                                     space={"parallelisms": ["ddp"], "optimizer_impls": ["foreach"]})
while not go.exists():  # start every worker's search at the same moment
    time.sleep(0.005)
result = run_search(sweep, study="shared", storage=None if storage == "-" else storage, sampler=sampler,
                    trials=int(trials) or None, results_dir=results, estimate_fn=fake_estimate)
print(json.dumps({"new": result.run.new_trials, "seed": result.run.seed, "size": result.run.space.size}))
"""


def _run_workers(tmp_path: Path, storage: str, sampler: str, trials: int) -> list[dict]:
    go = tmp_path / "go"
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, storage, str(go), str(tmp_path), sampler, str(trials)],
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(WORKERS)]
    time.sleep(1.0)
    go.touch()
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=300)
        assert p.returncode == 0, stderr
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


def _trials(storage: str, tmp_path: Path) -> list[optuna.trial.FrozenTrial]:
    if storage == "-":
        from optuna.storages.journal import JournalFileBackend, JournalStorage

        storage = JournalStorage(JournalFileBackend(str(tmp_path / "shared" / "journal.log")))
    return optuna.load_study(study_name="shared", storage=storage).get_trials(deepcopy=False)


def _check(storage: str, tmp_path: Path) -> None:
    grid = _run_workers(tmp_path, storage, "grid", 0)
    trials = _trials(storage, tmp_path)
    size = grid[0]["size"]
    assert len(trials) == size == sum(w["new"] for w in grid)  # the whole grid, once
    assert len({tuple(sorted(t.params.items())) for t in trials}) == size  # no grid point twice
    assert len({w["seed"] for w in grid}) == WORKERS  # seed + worker number
    assert all(t.state.name == "COMPLETE" and "config" in t.user_attrs for t in trials)


def test_four_workers_journal(tmp_path):
    _check("-", tmp_path)
    # and a TPE budget on top of it, shared exactly
    tpe = _run_workers(tmp_path, "-", "tpe", 0)
    size = tpe[0]["size"]
    budget = size + 40
    (tmp_path / "go").unlink()
    more = _run_workers(tmp_path, "-", "tpe", budget)
    assert len(_trials("-", tmp_path)) == budget and sum(w["new"] for w in more) == 40


def test_four_workers_sqlite(tmp_path):
    _check(f"sqlite:///{tmp_path / 'shared.db'}", tmp_path)


@pytest.mark.postgres
def test_four_workers_postgresql(tmp_path):
    for url in postgres_server():
        assert url.startswith("postgresql://")  # the plain scheme: SQLAlchemy 2.1 picks psycopg 3
        _check(url, tmp_path)
