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
