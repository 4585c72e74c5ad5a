"""`planner estimate` / `planner explain` as a user runs them: JSON contract, steps in order, bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from planner.cli.main import app

runner = CliRunner()


def run(*args: str):
    return runner.invoke(app, list(args))


def test_estimate_json_parses_and_has_contract_keys():
    r = run("estimate", "--model", "bert-base-uncased", "--instance", "ml.p3.16xlarge", "--batch-size", "16",
            "--seq-len", "128", "--precision", "amp-fp16", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["config"]["parallelism"] == "ddp"
    for key in ("parameters", "memory_bytes", "peak_phase", "gpu_memory_bytes", "fits", "headroom_bytes"):
        assert key in out
    assert out["memory_bytes"]["peak_device"] > out["memory_bytes"]["peak_allocated"]


def test_global_batch_size_sets_the_micro_batch():
    r = run("estimate", "--model", "bert-base-uncased", "--instance", "ml.p3.16xlarge", "--global-batch-size",
            "256", "--grad-accum", "2", "--seq-len", "128", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["config"]["batch_size"] == 16


def test_human_output_has_verdict():
    r = run("estimate", "--model", "gpt2", "--instance", "ml.g5.2xlarge", "--batch-size", "4", "--seq-len", "512")
    assert r.exit_code == 0, r.output
    assert "Verdict" in r.stdout and "peak" in r.stdout


def test_explain_defaults_answer_the_questions_in_order():
    r = run("explain", "--json")
    assert r.exit_code == 0, r.output
    titles = [s["title"] for s in json.loads(r.stdout)]
    expected = ["Memory of each GPU", "How the model is stored", "Parameters of each component",
                "storage at each precision", "Gradients", "computational graph", "parameters and data are stored",
                "Total by phase", "Verdict"]
    assert titles[0] == "Assumptions"  # stated first: model, batch per GPU and global, sequence, precision, ...
    where = [next(i for i, t in enumerate(titles) if want.lower() in t.lower()) for want in expected]
    assert where == sorted(where)  # in the order users ask (other steps may sit between)
    text = json.dumps(json.loads(r.stdout))
    assert "TabAE" in text and "TextBertBase" in text and "merge" in text


def test_explain_auto_answers_ddp_and_dataparallel_side_by_side():
    steps = json.loads(run("explain", "--json").stdout)
    [both] = [s for s in steps if "DataParallel side by side" in s["title"]]
    text = " ".join(both["lines"])
    assert "`auto` chose DistributedDataParallel" in text and "nn.DataParallel" in text
    assert any(line.split() == ["DDP", "DataParallel"] for line in both["lines"])  # the two columns
    assert "samples/s (job)" in text and "temporaries and buffers" in text


def test_explain_dataparallel_does_not_contradict_itself():
    steps = json.loads(run("explain", "--parallelism", "dp", "--json").stdout)
    storage = " ".join(next(s for s in steps if s["title"].startswith("How the model is stored"))["lines"])
    assert "FULL replica on each" not in storage  # gradients and optimizer states are on GPU 0 only
    assert "ALL the optimizer states" in storage and "no gradients or optimizer states stay on them" in storage
    assert "scatters 8 to each GPU" in storage and "'input batch' row is that share" in storage
    assert not any("DataParallel side by side" in s["title"] for s in steps)


def test_explain_says_why_phase_rows_differ_from_the_terms():
    steps = json.loads(run("explain", "--json").stdout)
    phases = " ".join(next(s for s in steps if s["title"].startswith("Total by phase"))["lines"])
    assert "one moment, that phase's highest point" in phases and "gradients" in phases


def test_explain_on_oom_suggests_fixes_that_fit():
    r = run("explain", "--model", "bert-large-uncased", "--instance", "ml.p3.2xlarge", "--batch-size", "64",
            "--seq-len", "512", "--json")
    assert r.exit_code == 0, r.output
    verdict = json.loads(r.stdout)[-1]["lines"]
    assert verdict[0].startswith("OUT OF MEMORY")
    assert any(line.startswith("fits with") for line in verdict[1:])


@pytest.mark.parametrize("args, field", [
    (["--model", "bert-huge"], "--model"),
    (["--instance", "ml.p3.16xlage"], "--instance"),
    (["--precision", "bf16"], "--precision"),
    (["--attention", "flash", "--precision", "amp-fp16"], "--attention"),
    (["--batch-size", "0"], "--batch-size"),
    (["--batch-size", "-3"], "--batch-size"),
    (["--seq-len", "4096", "--model", "bert-base-uncased"], "--seq-len"),
    (["--precision", "fp4"], "--precision"),
])
def test_bad_input_is_one_line_exit_2(args, field):
    r = run("estimate", *args)
    assert r.exit_code == 2, r.output
    err = r.stderr.strip()
    assert err.startswith("error:") and "\n" not in err and field in err
    assert "Traceback" not in r.output


def test_malformed_config_json_is_one_line(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    r = run("estimate", "--model", str(bad))
    assert r.exit_code == 2 and "Traceback" not in r.output
    assert "\n" not in r.stderr.strip()


def test_unknown_instance_suggests_closest_names():
    r = run("estimate", "--instance", "ml.p3.16xlage")
    assert "ml.p3.16xlarge" in r.stderr


def test_real_process_exit_code_and_no_traceback():
    p = subprocess.run([sys.executable, "-m", "planner", "estimate", "--precision", "bf16"], capture_output=True,
                       text=True)
    assert p.returncode == 2
    assert "Traceback" not in p.stderr and p.stderr.count("\n") == 1


def test_tf32_flag_speeds_fp32_on_ampere_only_and_leaves_memory_alone():
    """--tf32 sets TrainConfig.tf32: fp32 GEMMs take the TF32 tensor-core peak on A100, nothing on V100 (no TF32
    units), and no byte of memory changes."""
    def est(instance: str, *flags: str) -> dict:
        r = run("estimate", "--model", "bert-base-uncased", "--instance", instance, "--batch-size", "32",
                "--seq-len", "128", "--json", *flags)
        assert r.exit_code == 0, r.output
        return json.loads(r.stdout)

    a100, a100_tf32 = est("ml.p4d.24xlarge"), est("ml.p4d.24xlarge", "--tf32")
    v100, v100_tf32 = est("ml.p3.2xlarge"), est("ml.p3.2xlarge", "--tf32")
    assert a100_tf32["config"]["tf32"] is True and a100["config"]["tf32"] is False
    assert a100_tf32["throughput"]["samples_per_s"] > 1.5 * a100["throughput"]["samples_per_s"]
    assert v100_tf32["throughput"]["samples_per_s"] == pytest.approx(v100["throughput"]["samples_per_s"])
    assert a100_tf32["memory_bytes"] == a100["memory_bytes"]
    text = run("explain", "--model", "bert-base-uncased", "--instance", "ml.p3.2xlarge", "--batch-size", "8",
               "--seq-len", "128", "--tf32").stdout
    assert "no TF32 tensor cores" in " ".join(text.split())
