"""`planner search` end to end with the real estimate: JSON output, exit codes, kill and resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
from typer.testing import CliRunner

from planner.cli.main import app

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--batch-sizes", "8,32,128", "--seq-lens", "128,512", "--grad-accums", "1,4"]


def invoke(*args: str):
    return CliRunner().invoke(app, ["search", *args])


def trials_of(db: Path, study: str) -> list[optuna.trial.FrozenTrial]:
    return optuna.load_study(study_name=study, storage=f"sqlite:///{db}").get_trials(deepcopy=False)


def test_json_output_parses(tmp_path):
    result = invoke("--instance", "ml.p3.2xlarge", *SMALL, "--trials", "12", "--study", "js", "--json",
                    "--results-dir", str(tmp_path), "--dataset-size", "100000")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["study"] == "js" and data["trials"] == 12
    best = data["best_per_instance"][0]
    assert best["instance"] == "ml.p3.2xlarge" and best["samples_per_s"] > 0 and best["usd_per_epoch"] > 0
    assert best["peak_device_gib"] <= 0.95 * best["gpu_memory_gib"]
    assert Path(data["files"]["parquet"]).exists()


def test_table_output_and_multiple_instances(tmp_path):
    result = invoke("--instance", "ml.p3.2xlarge,ml.g5.2xlarge", *SMALL, "--sampler", "grid", "--study", "multi",
                    "--results-dir", str(tmp_path), "--objective", "cost", "--dataset-size", "100000")
    assert result.exit_code == 0, result.output
    assert "Best configuration per instance type, cheapest first" in result.stdout
    # grid over the whole space: 3 × 2 × 2 precisions... × 2 checkpointing × 2 accum per instance
    db = tmp_path / "multi" / "study.db"
    assert len(trials_of(db, "multi@ml.p3.2xlarge")) == 3 * 2 * 2 * 2 * 2  # fp32, amp-fp16 on V100
    assert len(trials_of(db, "multi@ml.g5.2xlarge")) == 3 * 2 * 3 * 2 * 2  # + amp-bf16 on A10G


def test_all_infeasible_exits_2_with_a_clear_message_and_keeps_trials(tmp_path):
    result = invoke("--instance", "ml.p3.2xlarge", *SMALL, "--max-memory-fraction", "0.01", "--trials", "6",
                    "--study", "none", "--results-dir", str(tmp_path))
    assert result.exit_code == 2
    assert "no feasible configuration in 6 trials" in result.stderr
    assert "6× does not fit in GPU memory" in result.stderr and "--checkpointing on" in result.stderr
    assert "Traceback" not in result.output
    assert len(trials_of(tmp_path / "none" / "study.db", "none@ml.p3.2xlarge")) == 6


@pytest.mark.parametrize(("args", "flag"), [
    (["--instance", "ml.p3.17xlarge"], "--instance"),
    (["--model", "bert-lage"], "--model"),
    (["--batch-sizes", "8,x"], "--batch-sizes"),
    (["--objective", "speed"], "--objective"),
    (["--sampler", "cmaes"], "--sampler"),
    (["--storage", "nosuch://db"], "--storage"),
])
def test_bad_flags_exit_2_naming_the_flag(tmp_path, args, flag):
    result = invoke(*args, "--trials", "1", "--results-dir", str(tmp_path))
    assert result.exit_code == 2
    assert flag in result.stderr and "Traceback" not in result.output


def test_explicit_bf16_on_v100_is_recorded_infeasible(tmp_path):
    result = invoke("--instance", "ml.p3.2xlarge", "--precisions", "amp-bf16,amp-fp16", "--batch-sizes", "8",
                    "--seq-lens", "128", "--grad-accums", "1", "--checkpointing", "off", "--sampler", "grid",
                    "--study", "bf", "--json", "--results-dir", str(tmp_path))
    assert result.exit_code == 0, result.output
    trials = trials_of(tmp_path / "bf" / "study.db", "bf@ml.p3.2xlarge")
    bf16 = [t for t in trials if t.params["precision"] == "amp-bf16"]
    assert len(trials) == 2 and len(bf16) == 1
    assert bf16[0].constraints["supported"] > 0 and "bf16" in bf16[0].user_attrs["reason"]


def _start(tmp_path: Path, study: str, trials: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "planner", "search", "--instance", "ml.p3.16xlarge", "--study", study, "--trials",
           str(trials), "--results-dir", str(tmp_path), "--no-progress"]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))


def _count(db: Path, study: str) -> int:
    """Trials in the study, read-only (opening it with Optuna would race the search to create tables)."""
    import sqlite3

    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5) as conn:
            row = conn.execute("SELECT COUNT(*) FROM trials JOIN studies USING (study_id) WHERE study_name = ?",
                               (study,)).fetchone()
            return row[0]
    except sqlite3.OperationalError:  # file or tables not created yet
        return 0


def _wait_for_trials(db: Path, study: str, n: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        if db.exists() and _count(db, study) >= n:
            return
        time.sleep(0.05)
    raise AssertionError("the search wrote no trials in time")


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT], ids=["SIGKILL", "SIGINT"])
def test_a_killed_search_resumes_without_losing_trials(tmp_path, sig):
    study = f"killed-{sig.name}"
    db, name = tmp_path / study / "study.db", f"{study}@ml.p3.16xlarge"
    proc = _start(tmp_path, study, 5000)
    _wait_for_trials(db, name, 5, proc)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    if sig == signal.SIGINT:
        assert proc.returncode == 130 and "interrupted" in err
    else:
        assert proc.returncode == -signal.SIGKILL
    before = {t.number: (t.params, t.value) for t in trials_of(db, name)}
    assert len(before) >= 5
    assert all(t.state.name == "COMPLETE" for t in trials_of(db, name))  # nothing half-written
    target = len(before) + 8
    rerun = _start(tmp_path, study, target)
    out, err = rerun.communicate(timeout=120)
    assert rerun.returncode == 0, err
    after = {t.number: (t.params, t.value) for t in trials_of(db, name)}
    assert len(after) == target
    assert {n: after[n] for n in before} == before
