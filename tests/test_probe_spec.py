"""Probe requests: stable ids, resolved parallelism, candidates from a search study, `planner probe run`."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
from test_aws_fixtures import TINY_BERT
from typer.testing import CliRunner

from planner.probes import spec as pspec
from planner.probes import store
from planner.spec import TrainConfig

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()
torch.set_num_threads(1)  # tiny models: threads only add contention on a shared 2-core machine


@pytest.fixture
def tiny_path(tmp_path) -> str:
    p = tmp_path / "tiny-bert.json"
    p.write_text(json.dumps(TINY_BERT))
    return str(p)


def test_request_id_ignores_predictions_but_not_the_configuration(tiny_path):
    a = pspec.make_request(tiny_path, TrainConfig(batch_size=2, seq_len=16), "ml.g5.xlarge", with_estimate=False)
    b = a.model_copy(update={"estimate": {"fits": False}, "study": "x", "trial": 3})
    c = pspec.make_request(tiny_path, TrainConfig(batch_size=2, seq_len=16, checkpointing=True), "ml.g5.xlarge",
                           with_estimate=False)
    assert a.request_id == b.request_id != c.request_id
    assert pspec.ProbeRequest.from_json(a.to_json()) == a


def test_parallelism_and_world_size_without_an_estimate(tiny_path):
    single = pspec.make_request(tiny_path, TrainConfig(batch_size=2, seq_len=16), "ml.g5.xlarge", with_estimate=False)
    assert (single.config["parallelism"], single.world_size, single.gpus_per_instance) == ("single", 1, 1)
    ddp = pspec.make_request(tiny_path, TrainConfig(batch_size=2, seq_len=16, instances=2), "ml.p3.16xlarge",
                             with_estimate=False)
    assert (ddp.config["parallelism"], ddp.world_size, ddp.gpus_per_instance) == ("ddp", 16, 8)
    one = pspec.make_request(tiny_path, TrainConfig(batch_size=2, seq_len=16, parallelism="single"),
                             "ml.p3.16xlarge", with_estimate=False)
    assert one.world_size == 1  # `single` uses one of the eight GPUs


def test_a_broken_estimator_does_not_block_a_measurement(tiny_path, monkeypatch):
    def broken(*a, **k):
        raise TypeError("bug in a formula")

    monkeypatch.setattr(pspec, "predict", broken)
    req = pspec.make_request(tiny_path, TrainConfig(batch_size=2, seq_len=16), "ml.g5.xlarge")
    assert req.estimate is None and "TypeError" in req.estimate_error


def test_candidates_come_from_the_search_study(tmp_path):
    sys.path.insert(0, str(ROOT / "tests"))
    from search_fixtures import fake_estimate

    from planner.search.study import run_search

    run_search(None, study="s1", trials=6, results_dir=tmp_path, estimate_fn=fake_estimate, write_files=False)
    cands = pspec.study_candidates("s1", 2, tmp_path)
    assert len(cands) == 2 and all(c["instance"] == "ml.p3.16xlarge" and c["feasible"] for c in cands)
    assert cands[0]["model"] == "multimodal-bert"
    reqs = pspec.requests_from_study("s1", 2, tmp_path, with_estimate=False)
    assert [r.trial for r in reqs] == [c["trial"] for c in cands] and reqs[0].study == "s1"
    with pytest.raises(pspec.PlannerError, match="--study"):
        pspec.study_candidates("nope", 1, tmp_path)


def _in_process_run(monkeypatch):
    """Run jobs/probe.py's main in this process instead of a subprocess (the subprocess path is tested in
    test_probe_job.py); keeps this CLI test fast."""
    from planner.cli import probe_cmd

    spec = importlib.util.spec_from_file_location("probe_inproc", ROOT / "jobs" / "probe.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["probe_inproc"] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)

    def fake_run(cmd, capture_output, text, timeout):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = mod.main(cmd[2:])
        return subprocess.CompletedProcess(cmd, code, out.getvalue(), "")

    monkeypatch.setattr(probe_cmd, "run_process", fake_run)


def test_probe_run_local_stores_results(tiny_path, tmp_path, monkeypatch):
    from planner.cli.main import app

    monkeypatch.setenv("PLANNER_RESULTS_DIR", str(tmp_path / "results"))
    _in_process_run(monkeypatch)
    args = ["probe", "run", "--local", "--model", tiny_path, "--instance", "ml.g5.xlarge", "--batch-size", "2",
            "--seq-len", "16", "--attention", "eager", "--grad-accum", "2", "--steps", "1", "--device", "cpu",
            "--json"]
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    [rec] = json.loads(res.stdout)
    assert rec["status"] == "ok" and rec["source"] == "local" and rec["device"] == "cpu"
    assert rec["config"]["grad_accum"] == 2 and rec["applied"]["attention"] == "eager"
    files = list((tmp_path / "results" / "probes").glob("local-*.json"))
    assert len(files) == 1
    assert (tmp_path / "results" / "probes" / "requests" / f"{rec['request_id']}.json").is_file()
    # Rebuilding the table again (as every run and collect does) adds no duplicate.
    store.rebuild_parquet(tmp_path / "results")
    table = pd.read_parquet(store.parquet_path(tmp_path / "results"))
    assert len(table) == 1 and table.loc[0, "status"] == "ok"


def test_probe_run_bad_input(tmp_path, monkeypatch):
    from planner.cli.main import app

    monkeypatch.setenv("PLANNER_RESULTS_DIR", str(tmp_path / "results"))
    res = runner.invoke(app, ["probe", "run", "--instance", "ml.g5.xlarge", "--batch-size", "2"])
    assert res.exit_code == 2 and "--model" in res.stderr
    res = runner.invoke(app, ["probe", "run", "--model", "bert-base-uncased", "--instance", "ml.g5.xlarge",
                              "--batch-size", "2", "--precision", "fp4"])
    assert res.exit_code == 2 and "precision" in res.stderr and "Traceback" not in res.output
