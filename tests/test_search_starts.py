"""Every instance type gets a fair chance (per-type starting trials from the memory model), ties go to the
simpler parallelism, the ZeRO communication volumes, and a search that never imports torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from hypothesis import given
from hypothesis import strategies as st

from planner.hardware import get_instance
from planner.models.catalog import cached_model
from planner.perf.throughput import ThroughputConstants, predict_throughput
from planner.search.objective import Objective
from planner.search.results import SIMPLICITY, best_row, top_k
from planner.search.space import resolve_space
from planner.search.study import _largest_fitting, run_search, start_points
from planner.search.sweep import DEFAULT_SWEEP
from planner.spec import TrainConfig

ROOT = Path(__file__).resolve().parents[1]
# Types the default recipe (global batch 64, seq 512) fits on at different micro-batches: 1 GPU of 16 GB
# (V100, T4), 1 of 24 GB (A10G), 8 V100s.
TYPES = ("ml.p3.2xlarge", "ml.g4dn.xlarge", "ml.g5.xlarge", "ml.p3.16xlarge")


@given(st.integers(1, 12), st.integers(-1, 12))
def test_bisection_finds_the_last_fitting_candidate_like_a_linear_scan(n, edge):
    candidates = list(range(0, 2 * n, 2))  # indices need not be contiguous
    calls = []

    def fits(i: int) -> bool:
        calls.append(i)
        return i <= 2 * edge

    linear = [c for c in candidates if c <= 2 * edge]
    assert _largest_fitting(candidates, fits) == (linear[-1] if linear else None)
    assert len(calls) <= 2 + max(1, n).bit_length()  # ~log2, not n


def _objective(types: tuple[str, ...]) -> Objective:
    sweep = DEFAULT_SWEEP.with_overrides(instance=types)
    m = cached_model(sweep.model, sweep.model_options)
    instances = [get_instance(t) for t in types]
    space = resolve_space(sweep.seq_space(), m, instances, fixed=sweep.fixed,
                          global_batch_size=sweep.recipe.global_batch_size)
    return Objective(m, instances, space, constraints=sweep.constraints, objective=sweep.objective,
                     recipe=sweep.recipe, target=sweep.target())


def test_each_type_starts_from_the_largest_micro_batch_the_real_estimate_fits():
    objective = _objective(TYPES)
    space = objective.space
    starts = start_points(space, objective)
    assert [s.instance for s in starts] == list(TYPES) and all(s.feasible for s in starts)
    batches = space.values()["batch_size"]
    for start in starts:
        point = space.point(space.decode(start.params))
        assert objective.evaluate_point(point).feasible
        # the next larger micro-batch that hits the global batch does not fit (else bisection stopped short)
        for bigger in range(batches.index(point.config.batch_size) + 1, len(batches)):
            other = space.point(space.decode({**start.params, "batch_size_index": bigger}))
            if other.config is not None:
                assert not objective.evaluate_point(other).feasible
                break


def test_a_search_over_several_types_finds_every_type_that_can_run_the_job(tmp_path):
    # the budget holds only the starts: without them TPE spreads trials and missed p3.2xlarge (issue 10)
    result = run_search(DEFAULT_SWEEP.with_overrides(instance=TYPES), trials=len(TYPES), results_dir=tmp_path)
    frame = result.frame
    assert set(frame[frame.feasible].instance) == set(TYPES)
    per_type = frame[frame.feasible].groupby("instance")["usd_per_job"].min()
    assert best_row(frame, result.target, result.direction)["usd_per_job"].iloc[0] == pytest.approx(per_type.min())


def test_a_type_that_cannot_run_the_job_says_so_with_the_reason(tmp_path):
    from planner.cli.search_cmd import _missing_lines

    sweep = DEFAULT_SWEEP.with_overrides(instance=("ml.g4dn.xlarge", "ml.p4d.24xlarge"), model="llama-2-7b",
                                         model_options={}, recipe={"seq_len": 1024})
    result = run_search(sweep, trials=2, results_dir=tmp_path)
    start = {s.instance: s for s in result.run.starts}
    assert start["ml.p4d.24xlarge"].feasible  # a sharded, checkpointed 7B fits 8 x A100-40GB
    assert not start["ml.g4dn.xlarge"].feasible and "GPU memory" in start["ml.g4dn.xlarge"].reason
    lines = _missing_lines(result, list(sweep.instance_names()))
    assert len(lines) == 1 and lines[0].startswith("nothing found on g4dn.xlarge: even the smallest start")
    assert "N GiB" not in lines[0] and "GPU memory" in lines[0]


def test_a_type_without_a_proof_is_reported_as_not_found_in_its_trials(tmp_path):
    from planner.cli.search_cmd import _missing_lines

    result = run_search(DEFAULT_SWEEP.with_overrides(instance=TYPES), trials=len(TYPES), results_dir=tmp_path)
    for row in result.rows:  # as if TPE had missed it
        row["feasible"] = row["feasible"] and row["instance"] != "ml.g5.xlarge"
    result.run.starts.clear()  # a resumed study has no starts
    lines = _missing_lines(result, list(TYPES))
    assert lines == ["g5.xlarge: no feasible configuration found in its 1 trial (not proven impossible: search "
                     "it alone, --instance g5.xlarge)"]


def _frame(rows: list[tuple[str, float]]) -> pd.DataFrame:
    return pd.DataFrame([{"instance": "ml.p3.16xlarge", "parallelism": p, "value": v, "samples_per_s": v,
                          "usd_per_job": 1000 / v, "feasible": True, "batch_size": i, "seq_len": 512}
                         for i, (p, v) in enumerate(rows)])


def test_ties_go_to_the_simpler_parallelism_and_real_differences_still_win():
    tied = _frame([("fsdp", 1338.5), ("zero3", 1338.5), ("zero2", 1338.46), ("ddp", 1338.5)])
    assert list(top_k(tied, 4, "maximize").parallelism) == ["ddp", "zero2", "fsdp", "zero3"]
    apart = _frame([("ddp", 1270.0), ("zero2", 1338.5)])
    assert list(top_k(apart, 2, "maximize").parallelism) == ["zero2", "ddp"]
    assert SIMPLICITY["ddp"] < SIMPLICITY["zero1"] < SIMPLICITY["zero2"] < SIMPLICITY["zero3"]


def _comm(parallelism: str, accum: int) -> float:
    model = cached_model(DEFAULT_SWEEP.model, DEFAULT_SWEEP.model_options)
    config = TrainConfig(batch_size=8, seq_len=512, precision="amp-fp16", parallelism=parallelism, grad_accum=accum)
    # volumes alone: NCCL's per-call latency (tests/test_parallel_speed.py) set to 0
    c = ThroughputConstants(nccl_base_latency_s=0.0, nccl_hop_latency_nvlink_s=0.0)
    return predict_throughput(model, config, get_instance("ml.p3.16xlarge"), c).breakdown_s["communication_total_s"]


def test_communication_volumes_per_parallelism():
    """In units of DDP's gradient all-reduce (2Ψ): torch's ZeroRedundancyOptimizer (zero1) runs DDP's all-reduce
    and then broadcasts every updated shard (+ Ψ); ZeRO-2 reduce-scatters (Ψ) after every backward (DeepSpeed
    #2252) and all-gathers once (Ψ); ZeRO-3/FSDP all-gather for forward and backward and reduce-scatter, each
    micro-step (3Ψ)."""
    ar = _comm("ddp", 1)
    assert _comm("ddp", 4) == pytest.approx(ar)  # no_sync: once per optimizer step
    assert _comm("zero1", 1) == pytest.approx(1.5 * ar) == pytest.approx(_comm("zero1", 4))
    assert _comm("zero2", 1) == pytest.approx(ar)
    assert _comm("zero2", 4) == pytest.approx(4 * 0.5 * ar + 0.5 * ar)
    for p in ("zero3", "fsdp"):
        assert _comm(p, 1) == pytest.approx(1.5 * ar)
        assert _comm(p, 4) == pytest.approx(4 * 1.5 * ar)


def test_a_search_over_a_hand_modelled_model_never_imports_torch(tmp_path):
    code = ("import sys; from planner.search.study import run_search; "
            f"run_search(None, trials=3, results_dir={str(tmp_path)!r}); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def test_a_piped_search_prints_status_lines_when_asked(tmp_path, monkeypatch):
    """Piped, the search prints status lines only with --progress (issue 31: a log gets no lines it did not
    ask for; tests/test_first_hour.py checks that none come without it)."""
    from typer.testing import CliRunner

    from planner.cli import search_cmd
    from planner.cli.main import app

    monkeypatch.setattr(search_cmd, "STATUS_INTERVAL_S", 0.0)  # a line per trial instead of every 5 s
    result = CliRunner().invoke(app, ["search", "--instance", "ml.p3.2xlarge,ml.g5.xlarge", "--trials", "3",
                                      "--study", "piped", "--results-dir", str(tmp_path), "--progress"])
    assert result.exit_code == 0, result.output
    lines = [line for line in result.stderr.splitlines() if line.startswith("search piped:")]
    assert lines and lines[-1].startswith("search piped: 3/3 trials")


def test_a_single_type_search_starts_from_a_configuration_that_fits(tmp_path):
    # 7B on 8 x A100-40GB: only sharded, checkpointed AMP configurations fit; TPE alone found 26 feasible
    # trials in 100, the best of them fp32 at 1/8 of the AMP speed
    sweep = DEFAULT_SWEEP.with_overrides(instance=("ml.p4d.24xlarge",), model="llama-2-7b", model_options={},
                                         recipe={"seq_len": 1024})
    result = run_search(sweep, trials=1, results_dir=tmp_path)
    first = result.frame.iloc[0]
    assert first.feasible and first.precision == "amp-bf16" and first.parallelism in ("zero3", "fsdp")
