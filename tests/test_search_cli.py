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
SMALL = ["--batch-sizes", "1,2,8", "--seq-len", "128,512", "--parallelisms", "ddp", "--optimizer-impls", "foreach"]


def invoke(*args: str):
    return CliRunner().invoke(app, ["search", *args])


def trials_of(journal: Path, study: str) -> list[optuna.trial.FrozenTrial]:
    from optuna.storages.journal import JournalFileBackend, JournalStorage

    storage = JournalStorage(JournalFileBackend(str(journal)))
    return optuna.load_study(study_name=study, storage=storage).get_trials(deepcopy=False)


def test_json_output_parses(tmp_path):
    result = invoke("--instance", "ml.p3.2xlarge", *SMALL, "--trials", "12", "--study", "js", "--json",
                    "--results-dir", str(tmp_path), "--dataset-size", "100000")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["study"] == "js" and data["trials"] == 12
    best = data["best"]
    assert best["instance"] == "ml.p3.2xlarge" and best["samples_per_s"] > 0 and best["usd_per_job"] > 0
    assert best["batch_size"] * best["grad_accum"] == best["global_batch_size"] == 64  # one GPU, recipe batch
    assert best["peak_device_high_gib"] <= 0.95 * best["gpu_memory_gib"] and best["seq_len"] == 512
    assert data["recipe"]["dataset_size"] == 100000
    assert Path(data["files"]["parquet"]).exists()


def test_table_output_and_multiple_instances(tmp_path):
    result = invoke("--instance", "ml.p3.2xlarge,ml.g5.2xlarge", *SMALL, "--sampler", "grid", "--study", "multi",
                    "--results-dir", str(tmp_path), "--objective", "cost", "--dataset-size", "100000")
    assert result.exit_code == 0, result.output
    assert "Best per instance type, cheapest per job first" in result.stdout
    assert all(len(line) <= 80 for line in result.stdout.splitlines() if not line.startswith(("results", "storage")))
    # grid over the joint space: 2 types × 3 micro-batches × 2 lengths × 3 precisions × 2 checkpointing × 2 attentions
    trials = trials_of(tmp_path / "multi" / "journal.log", "multi")
    assert len(trials) == 2 * 3 * 2 * 3 * 2 * 2
    assert len({tuple(sorted(t.params.items())) for t in trials}) == len(trials)


def test_all_infeasible_exits_2_with_a_clear_message_and_keeps_trials(tmp_path):
    result = invoke("--instance", "ml.p3.2xlarge", *SMALL, "--max-memory-fraction", "0.01", "--trials", "6",
                    "--study", "none", "--results-dir", str(tmp_path))
    assert result.exit_code == 2
    assert "no feasible configuration in 6 trials" in result.stderr
    assert "does not fit in GPU memory" in result.stderr and "--checkpointing on" in result.stderr
    assert "Traceback" not in result.output
    assert len(trials_of(tmp_path / "none" / "journal.log", "none")) == 6


@pytest.mark.parametrize(("args", "flag"), [
    (["--instance", "ml.p3.17xlarge"], "--instance"),
    (["--model", "bert-lage"], "--model"),
    (["--batch-sizes", "8,x"], "--batch-sizes"),
    (["--objective", "speed"], "--objective"),
    (["--seq-len", "512,x"], "--seq-len="),  # the flag as typed
    (["--sampler", "cmaes"], "--sampler"),
    (["--storage", "nosuch://db"], "--storage"),
])
def test_bad_flags_exit_2_naming_the_flag(tmp_path, args, flag):
    result = invoke(*args, "--trials", "1", "--results-dir", str(tmp_path))
    assert result.exit_code == 2
    assert flag in result.stderr and "Traceback" not in result.output


def test_explicit_bf16_on_v100_is_recorded_infeasible(tmp_path):
    result = invoke("--instance", "ml.p3.2xlarge", "--precisions", "amp-bf16,amp-fp16", "--batch-sizes", "8",
                    "--seq-lens", "128", "--checkpointing", "off", "--sampler", "grid", "--parallelisms", "ddp",
                    "--optimizer-impls", "foreach", "--study", "bf", "--json", "--results-dir", str(tmp_path))
    assert result.exit_code == 0, result.output
    trials = trials_of(tmp_path / "bf" / "journal.log", "bf")
    bf16 = [t for t in trials if t.params["precision"] == "amp-bf16"]
    assert len(trials) == 2 and len(bf16) == 1
    assert bf16[0].constraints["supported"] > 0 and "bf16" in bf16[0].user_attrs["reason"]


def _start(tmp_path: Path, study: str, trials: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "planner", "search", "--instance", "ml.p3.16xlarge", "--study", study, "--trials",
           str(trials), "--results-dir", str(tmp_path), "--no-progress"]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))


def _count(journal: Path, study: str) -> int:
    """Finished trials in the study (reading a journal file never blocks or changes it)."""
    try:
        return len(trials_of(journal, study))
    except (KeyError, ValueError):  # study not created yet, or a line being written
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
    db, name = tmp_path / study / "journal.log", study
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


def test_stack_flags_and_an_unknown_version_leave_no_files(tmp_path):
    ok = invoke("--instance", "ml.g5.xlarge", *SMALL, "--trials", "4", "--study", "st", "--torch-version", "2.8",
                "--json", "--results-dir", str(tmp_path))
    assert ok.exit_code == 0, ok.output
    assert json.loads(ok.stdout)["best"]["samples_per_s"] > 0
    bad = invoke("--instance", "ml.g5.xlarge", "--torch-version", "0.1", "--study", "bad", "--results-dir",
                 str(tmp_path))
    assert bad.exit_code == 2 and "--torch-version" in bad.stderr and "Traceback" not in bad.output
    assert not (tmp_path / "bad").exists()
