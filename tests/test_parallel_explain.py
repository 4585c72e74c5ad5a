"""Issue 34 through the CLI: the "Done when" command's --json (every stage's memory, the worst rank's verdict,
the layout under `parallel`), and `explain`: each dimension's effect step by step and the cheapest change that
makes an OOM fit among the model-parallel ones."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.test_bad_input import invoke

LLAMA70 = str(Path(__file__).parent / "data" / "llama-3-70b.json")
DONE_WHEN = ["--model", LLAMA70, "--instance", "ml.p5.48xlarge", "--instances", "32", "--tp", "8", "--pp", "4",
             "--vp", "5", "--parallelism", "fsdp", "--recompute", "selective", "--recompute-modules", "core_attn",
             "--global-batch-size", "512", "--batch-size", "1", "--seq-len", "4096", "--precision", "amp-bf16"]


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PLANNER_CALIBRATION", str(tmp_path / "no-calibration.json"))
    monkeypatch.setenv("PLANNER_PRICES", str(tmp_path / "no-prices.json"))


def test_done_when_json():
    code, out, err = invoke(["estimate", *DONE_WHEN, "--json"])
    assert code == 0, err
    est = json.loads(out)
    p = est["parallel"]
    assert {k: p[k] for k in ("world", "dp", "dp_replicate", "dp_shard", "tp", "cp", "pp", "vp", "sp", "schedule",
                              "micro_batches")} == {
        "world": 256, "dp": 8, "dp_replicate": 1, "dp_shard": 8, "tp": 8, "cp": 1, "pp": 4, "vp": 5, "sp": True,
        "schedule": "interleaved-1f1b", "micro_batches": 64}
    assert len(p["stages"]) == 4
    for s in p["stages"]:
        assert {"layers", "parameter_bytes", "gradient_bytes", "optimizer_bytes", "activation_bytes",
                "peak_device_bytes", "verdict"} <= set(s)
        assert len(s["layers"]) == 20
    worst = p["stages"][p["worst_stage"]]
    assert est["verdict"] == worst["verdict"]
    assert est["memory_bytes"]["peak_device"] == worst["peak_device_bytes"]
    assert est["config"]["recompute"] == "selective" and est["config"]["recompute_modules"] == ["core_attn"]
    # every key of a plain estimate is still there
    code, plain, _ = invoke(["estimate", "--model", "gpt2", "--instance", "ml.g5.xlarge", "--batch-size", "1",
                             "--seq-len", "64", "--json"])
    assert code == 0 and set(json.loads(plain)) | {"parallel"} == set(est)


def test_recompute_full_is_checkpointing():
    code, out, err = invoke(["estimate", "--model", "gpt2", "--instance", "ml.g5.xlarge", "--batch-size", "1",
                             "--seq-len", "64", "--recompute", "full", "--json"])
    ckpt = invoke(["estimate", "--model", "gpt2", "--instance", "ml.g5.xlarge", "--batch-size", "1",
                   "--seq-len", "64", "--checkpointing", "--json"])[1]
    assert code == 0, err
    a, b = json.loads(out), json.loads(ckpt)
    assert a["config"]["checkpointing"] and a["memory_bytes"] == b["memory_bytes"]


def test_explain_steps_through_each_dimension():
    code, out, err = invoke(["explain", *DONE_WHEN, "--json"])
    assert code == 0, err
    steps = {s["title"]: s for s in json.loads(out)}
    split = steps["How the GPUs split the model (tensor, context, pipeline, data)"]
    text = " ".join(split["lines"])
    for words in ("256 GPUs = tensor 8 × context 1 × pipeline 4 × data 8", "Tensor parallelism 8",
                  "Sequence parallelism on", "Pipeline parallelism 4, schedule interleaved-1f1b",
                  "stage 0: 4.6", "Data parallelism 8", "The worst rank is stage 0"):
        assert words in text, words
    assert split["figures"]["stages"][0]["in_flight_micro_batches"] == pytest.approx(4.6)
    assert "8 data-parallel replica(s) = 512 samples" in " ".join(steps["Assumptions"]["lines"])


def test_explain_finds_a_model_parallel_fix():
    """Llama-3-8B with tp 2 × pp 2 under DDP on A100-40GB at a short sequence: the model states decide (not
    activations): four pipeline stages halve them and fit."""
    code, out, err = invoke(["explain", "--model", "llama-3-8b", "--instance", "ml.p4d.24xlarge", "--batch-size",
                             "1", "--precision", "amp-bf16", "--tp", "2", "--pp", "2", "--grad-accum", "2",
                             "--seq-len", "128", "--parallelism", "ddp", "--json"])
    assert code == 0, err
    verdict = next(s for s in json.loads(out) if s["title"] == "Verdict")
    changes = [f["change"] for f in verdict["figures"]["fixes"]]
    assert "pipeline parallelism --pp 4" in changes
    fix = next(f for f in verdict["figures"]["fixes"] if f["change"] == "pipeline parallelism --pp 4")
    assert fix["config"]["pp"] == 4 and fix["headroom_bytes"] > 0


def test_probe_line_reproduces_the_layout():
    from planner.cli.estimate_cmd import probe_command
    from planner.estimate import estimate
    from planner.spec import TrainConfig

    config = TrainConfig(batch_size=1, seq_len=1024, precision="amp-bf16", parallelism="fsdp", tp=2, pp=2, vp=2,
                         grad_accum=4, recompute="selective", recompute_modules="core_attn")
    line = probe_command(estimate("llama-3-8b", config, "ml.p5.48xlarge", with_throughput=False, calibration={}))
    for flag in ("--tp 2", "--pp 2", "--vp 2", "--recompute selective", "--recompute-modules core_attn",
                 "--grad-accum 4", "--parallelism fsdp"):
        assert flag in line, flag
