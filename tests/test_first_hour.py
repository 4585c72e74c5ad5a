"""The first hour of a fine-tuning user (issue 31): every command takes the same job, agrees, and says where
its prices come from. Driven through the CLI as a user drives it."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from planner.cli.main import app

runner = CliRunner()


def run(*args: str):
    return runner.invoke(app, list(args))


def test_explain_takes_lora_and_qlora():
    """explain crashed with any LoRA flag (figures were zipped to steps by position; the adapter step shifted
    them). Each step's numbers now belong to their step by name."""
    for extra in (["--lora-r", "16"], ["--lora-r", "16", "--base-dtype", "nf4", "--precision", "amp-bf16"]):
        r = run("explain", "--model", "llama-2-7b", "--instance", "ml.g5.2xlarge", "--batch-size", "1",
                "--seq-len", "512", *extra, "--json")
        assert r.exit_code == 0, r.output
        steps = json.loads(r.stdout)
        titles = [s["title"] for s in steps]
        adapters = steps[titles.index("Adapters on a frozen base (LoRA)")]
        assert adapters["figures"]["lora_r"] == 16 and adapters["figures"]["lora_targets"] == ["q_proj", "v_proj"]
        verdict = steps[-1]
        assert verdict["title"] == "Verdict" and "verdict" in verdict["figures"]
        assert steps[titles.index("Total by phase of one step")]["figures"]["peak_phase"]


def test_search_keeps_the_recipes_global_batch_on_one_gpu_of_four(tmp_path):
    """`single` on a 4-GPU instance trains on one GPU: accumulation makes up the recipe's global batch (it used
    to divide by all four GPUs and report global batch 4 for a recipe of 16); the price is the whole
    instance's, said so; prices name region, date and source."""
    r = run("search", "--model", "bert-base-uncased", "--instance", "ml.g5.12xlarge", "--parallelisms", "single",
            "--global-batch-size", "16", "--seq-len", "128", "--trials", "12", "--results-dir", str(tmp_path),
            "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    for row in [out["best"], *out["top"]]:
        assert row["global_batch_size"] == 16
        assert row["batch_size"] * row["grad_accum"] * row["world_size"] == 16
    [price] = out["prices"]
    assert price["region"] == "us-east-1" and price["date"] and price["source"] and price["stale"] is not None
    assert price["gpus"] == 4
    text = run("search", "--model", "bert-base-uncased", "--instance", "ml.g5.12xlarge", "--parallelisms",
               "single", "--global-batch-size", "16", "--seq-len", "128", "--trials", "12", "--results-dir",
               str(tmp_path / "b")).stdout
    assert "1 of 4 GPUs used" in text
    assert "price: us-east-1, dated " in text
    best = json.loads((next((tmp_path / "b").iterdir()) / "best.json").read_text())
    assert best["prices"][0]["date"] == price["date"]
