"""Issue 27: one figure per question. The search's printed peak, best.json and `planner estimate` agree for
the same configuration; explain's DataParallel column is what `--parallelism dp` says; the default space says
why it left values out; the all-types study is not named after p3."""

from __future__ import annotations

import json
import re

from typer.testing import CliRunner

from planner.cli.main import app
from planner.estimate import estimate
from planner.spec import TrainConfig

GIB = 2**30


def invoke(*args: str):
    return CliRunner().invoke(app, list(args))


def test_search_best_line_table_best_json_and_estimate_give_one_peak(tmp_path):
    result = invoke("search", "--instance", "ml.p3.8xlarge", "--batch-sizes", "4,8,16", "--trials", "10",
                    "--study", "one", "--results-dir", str(tmp_path), "--no-progress")
    assert result.exit_code == 0, result.output
    best = json.loads((tmp_path / "one" / "best.json").read_text())["best"]
    cfg = TrainConfig(**{k: best[k] for k in ("batch_size", "seq_len", "precision", "optimizer", "optimizer_impl",
                                                 "parallelism", "checkpointing", "attention", "grad_accum",
                                                 "instances")})
    est = estimate("multimodal-bert", cfg, best["instance"], model_options={
        "text_model": "bert-base-uncased", "tab_in": 100, "tab_out": 128, "text_out": 128, "num_classes": 2,
        "binary": True})
    point = est.memory_bytes.peak_device / GIB
    assert abs(best["peak_device_gib"] - point) < 1e-9
    printed = re.search(r"peak ([\d.,]+) of ([\d.,]+) GiB \((\w+)\), band's high end ([\d.,]+) GiB",
                        " ".join(result.stdout.split()))
    assert printed, result.stdout
    assert printed[1] == f"{point:,.2f}" and printed[4] == f"{est.peak_device_high_bytes / GIB:,.2f}"
    first_row = next(ln for ln in result.stdout.splitlines() if ln.strip().startswith("1 "))
    assert f"{point:,.2f}" in first_row.split()


def test_explain_side_by_side_dataparallel_is_what_parallelism_dp_says():
    auto = invoke("explain", "--json")
    dp = invoke("estimate", "--parallelism", "dp", "--json")
    assert auto.exit_code == 0 and dp.exit_code == 0, auto.output + dp.output
    side = next(s for s in json.loads(auto.stdout) if "side by side" in s["title"])
    row = next(line for line in side["lines"] if line.startswith("peak on the device"))
    dp_peak = json.loads(dp.stdout)["memory_bytes"]["peak_device"]
    from planner.units import fmt_bytes

    assert row.split()[-2:] == fmt_bytes(dp_peak).split()
    assert side["figures"]["dp"]["memory_bytes"]["peak_device"] == dp_peak


def test_explain_json_gives_the_numbers_as_fields_beside_the_prose():
    """Every step keeps title and lines and adds figures; the verdict's figures are estimate --json's."""
    steps = json.loads(invoke("explain", "--json", "-m", "bert-large-uncased", "-i", "ml.p3.2xlarge", "-b", "32",
                              "-s", "512").stdout)
    est = json.loads(invoke("estimate", "--json", "-m", "bert-large-uncased", "-i", "ml.p3.2xlarge", "-b", "32",
                            "-s", "512").stdout)
    assert all({"step", "title", "lines", "figures"} <= set(s) and s["figures"] for s in steps)
    verdict = steps[-1]["figures"]
    assert verdict["verdict"] == est["verdict"] == "oom"
    assert verdict["peak_device_bytes"] == est["memory_bytes"]["peak_device"]
    assert verdict["headroom_bytes"] == est["headroom_bytes"]
    assert verdict["fixes"] and all(f["headroom_bytes"] >= 0 for f in verdict["fixes"])
    first = verdict["fixes"][0]
    assert f"fits with {first['change']}:" in " ".join(steps[-1]["lines"])
    assert steps[0]["figures"]["config"]["batch_size"] == 32


def test_default_space_says_why_each_value_was_left_out(tmp_path):
    result = invoke("search", "--instance", "ml.p3.2xlarge", "--trials", "2", "--study", "why",
                    "--results-dir", str(tmp_path), "--no-progress")
    text = " ".join(result.stdout.split())
    assert "no GPU here runs them): batch" not in text
    assert re.search(r"batch sizes 128, 256, 512 \(above the global batch 64\)", text), text
    assert re.search(r"precisions amp-bf16 \(no GPU here runs them\)", text), text


def test_default_job_on_other_instance_types_is_not_named_after_p3():
    from planner.cli.search_cmd import build_sweep
    from planner.search.study import resolve_name

    kwargs = dict(sweep_file=None, model=None, model_options=None, nodes=None, space={}, constraints={},
                  objective={}, search={})
    assert resolve_name(build_sweep(instance="all", **kwargs), None).startswith("multimodal-bert-all-")
    assert resolve_name(build_sweep(instance=None, **kwargs), None).startswith("multimodal-bert-p3-p3.16xlarge-")


def test_explain_re_runs_keep_the_users_overrides_and_nothing_more():
    """The DataParallel column and the fixes re-estimate other configurations with the overrides the user gave
    (--cuda-context-mib), not the whole runtime (which switched the allocator replay off: 4.74 vs 4.56 GiB)."""
    from planner.explain import _same_runtime
    from planner.hardware import get_instance

    cfg = TrainConfig(batch_size=8, seq_len=512)
    plain = estimate("multimodal-bert", cfg, get_instance("ml.p3.16xlarge"))
    assert _same_runtime(plain) is None
    given = estimate("multimodal-bert", cfg, "ml.p3.16xlarge", runtime={"cuda_context_bytes": 500 * 2**20})
    assert _same_runtime(given) == {"cuda_context_bytes": 500 * 2**20}
    from planner.explain import explain

    steps = explain(given, "multimodal-bert", requested_parallelism="auto")
    side = next(s for s in steps if "side by side" in s.title)
    dp = estimate("multimodal-bert", cfg.model_copy(update={"parallelism": "dp"}), "ml.p3.16xlarge",
                  runtime={"cuda_context_bytes": 500 * 2**20})
    assert side.figures["dp"]["memory_bytes"] == dp.memory_bytes.model_dump()
    assert dp.allocator is not None  # the replay, as `estimate` runs it
