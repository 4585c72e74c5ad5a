"""The probe job on mixture-of-experts models and FP8 (issue 35 item 6).

- a tiny Mixtral trains for a few steps through `planner probe run --local --device cpu`, and `planner validate`
  compares the reading with the estimate: parameters, gradients and optimizer states exact, autograd's saved bytes
  equal to the planner's activations plus the input ids the embedding saves (the planner counts them in the
  batch); a tiny Qwen3-MoE likewise in fp32 and bf16, in process; every token's top-k experts are counted; under
  FSDP2 on two gloo ranks each rank holds what the planner predicts per rank;
- FP8 is refused with one line on a CPU, on a GPU without FP8 tensor cores, and where the image lacks the
  recipe's library; the Linears the job converts are the ones the planner computes in FP8;
- `planner probe launch` sends the FP8 settings to SageMaker (request.json, hyperparameters, the job file), and
  the probe line an FP8 or expert-parallel estimate prints runs as printed;
- with torchao installed (not a requirement), an FP8 step runs on CPU through torch's CPU `_scaled_mm`.
"""

from __future__ import annotations

import io
import json
import sys
import tarfile
from pathlib import Path

import pytest
import torch
from moto import mock_aws
from test_aws_fixtures import BUCKET, REGION, ROLE, FakeAws, aws_env, launch_new_job, not_found  # noqa: F401
from test_moe import TINY
from test_probe_spec import _in_process_run
from typer.testing import CliRunner

from planner.models import hf_config
from planner.spec import TrainConfig
from tests.module_files import load_module

ROOT = Path(__file__).resolve().parents[1]
torch.set_num_threads(1)  # tiny models: threads only add contention on a shared 2-core machine
probe = load_module("planner_test_probe_moe", ROOT / "jobs" / "probe.py")
modeling = load_module("modeling", ROOT / "jobs" / "modeling.py")
fp8_linears = load_module("fp8_linears", ROOT / "jobs" / "fp8_linears.py")
runner = CliRunner()


def _cli(args):
    from planner.cli.main import app

    return runner.invoke(app, args)


@pytest.fixture
def mixtral_path(tmp_path) -> Path:
    path = tmp_path / "tiny-mixtral.json"
    path.write_text(json.dumps(TINY["mixtral"]))
    return path


def _request(case: str, **cfg) -> dict:
    spec = hf_config.spec_from_hf_config(TINY[case], name=case)
    config = TrainConfig(**({"batch_size": 2, "seq_len": 24} | cfg))
    return {"request_id": "t", "model": spec.model_dump(mode="json"), "config": config.model_dump(mode="json"),
            "warmup_steps": 1, "measure_steps": 2}


def _parameter_tensors(case: str) -> int:
    spec = hf_config.spec_from_hf_config(TINY[case], name=case)
    return len(list(modeling.build_model(spec.model_dump(mode="json"), device="meta").parameters()))


def test_a_tiny_moe_trains_through_the_probe_and_validate_compares_it(mixtral_path, tmp_path, monkeypatch):
    """`planner probe run` then `planner validate` on a tiny Mixtral (4 experts, top-2) on CPU."""
    monkeypatch.setenv("PLANNER_RESULTS_DIR", str(tmp_path / "results"))
    _in_process_run(monkeypatch)
    res = _cli(["probe", "run", "--local", "--model", str(mixtral_path), "--instance", "ml.p5.48xlarge",
                "--batch-size", "2", "--seq-len", "24", "--precision", "amp-bf16", "--attention", "eager",
                "--parallelism", "single", "--steps", "2", "--device", "cpu", "--json"])
    assert res.exit_code == 0, res.output
    [rec] = json.loads(res.stdout)
    assert rec["status"] == "ok" and rec["device"] == "cpu", rec.get("message")
    losses = [r["loss"] for r in rec["phases"] if r["phase"] == "forward"]
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]  # it learns
    # the router's choices: every token's top-2 experts, in each of the two sparse layers
    routed = rec["experts"]["tokens_per_expert"]
    assert sorted(routed) == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    assert all(len(c) == 4 and sum(c) == 2 * 24 * 2 for c in routed.values())
    assert rec["experts"]["max_hottest_over_mean"] >= 1.0

    val = _cli(["validate", "--json"])
    assert val.exit_code == 0, val.output
    [row] = json.loads(val.stdout)["rows"]
    assert row["prediction_source"] == "current"
    for term in ("parameters", "gradients"):
        assert row["errors"][term] == 0.0, term
    # AdamW's state: the planner's exp_avg and exp_avg_sq; on CPU the job also counts each tensor's fp32 step
    # (on a GPU PyTorch keeps those on the host, where neither counts them)
    assert row["measured"]["optimizer_states"] == row["predicted"]["optimizer_states"] + 4 * _parameter_tensors(
        "mixtral")
    # autograd's saved bytes = the planner's activations + the input ids the embedding saves for its backward
    # (int64, b × s; the planner counts them in the batch)
    assert row["measured"]["activations"] == row["predicted"]["activations"] + 2 * 24 * 8


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_tiny_qwen3_moe_probe_agrees_with_the_estimate(precision):
    from planner.estimate import estimate

    rec = probe.run_probe(_request("qwen3_moe", precision=precision, attention="eager"), modeling=modeling,
                          device="cpu")
    assert rec["status"] == "ok", rec.get("message")
    spec = hf_config.spec_from_hf_config(TINY["qwen3_moe"], name="qwen3_moe")
    est = estimate(spec, TrainConfig.model_validate(rec["config"]), "ml.p5.48xlarge", backend="cpu")
    m, t = est.memory_bytes, rec["tensors"]
    assert (t["parameters_bytes"], t["gradients_bytes"]) == (m.parameters, m.gradients)
    assert t["saved_tensor_bytes"] == m.activations + 2 * 24 * 8


def test_fp8_on_a_cpu_is_refused_with_one_line():
    rec = probe.run_probe(_request("mixtral", precision="fp8", fp8_recipe="tensorwise"), modeling=modeling,
                          device="cpu")
    assert rec["status"] == "unsupported" and rec["phase"] == "setup"
    assert "\n" not in rec["message"] and "sm89+" in rec["message"] and "cpu" in rec["message"]


@pytest.mark.parametrize("recipe,cc,ok", [("tensorwise", (8, 0), False), ("delayed", (8, 6), False),
                                          ("rowwise", (8, 9), True), ("current", (9, 0), True),
                                          ("mxfp8", (9, 0), False), ("mxfp8", (10, 0), True)])
def test_fp8_needs_fp8_tensor_cores(recipe, cc, ok):
    """The job's rule is the planner's (planner/ir/fp8.py FP8_MIN_CC, MXFP8_MIN_CC)."""
    from planner.ir import fp8

    assert (fp8_linears.FP8_MIN_CC, fp8_linears.MXFP8_MIN_CC) == (fp8.FP8_MIN_CC, fp8.MXFP8_MIN_CC)
    assert fp8_linears.library(recipe) == fp8.library(recipe)
    cuda = torch.device("cuda", 0)
    if ok:
        fp8_linears.check_device(recipe, cuda, cc)
    else:
        with pytest.raises(fp8_linears.Fp8Unavailable, match=f"sm{cc[0]}{cc[1]}"):
            fp8_linears.check_device(recipe, cuda, cc)


@pytest.mark.parametrize("recipe,module,other", [("tensorwise", "torchao", "delayed, current"),
                                                 ("delayed", "transformer_engine", "tensorwise, rowwise")])
def test_a_missing_fp8_library_is_one_line(recipe, module, other, monkeypatch):
    monkeypatch.setitem(sys.modules, module, None)  # import fails as in an image without it
    with pytest.raises(fp8_linears.Fp8Unavailable) as err:
        fp8_linears.check_library(recipe)
    line = str(err.value)
    assert "\n" not in line and module in line and other in line and "--image" in line


@pytest.mark.parametrize("case", ["mixtral", "qwen2_moe"])
def test_the_job_converts_the_linears_the_planner_computes_in_fp8(case):
    """The decoder layers' nn.Linears (attention; Qwen2-MoE's dense MLP too), not the LM head, the routers or the
    grouped experts: as the planner's FP8 transform marks the layer blocks' linear ops."""
    from planner.families.forms import model_program
    from planner.ir.context import Ctx
    from planner.ir.transforms import fp8_program

    spec = hf_config.spec_from_hf_config(TINY[case], name=case)
    module = modeling.build_model(spec.model_dump(mode="json"), device="meta")
    converted, kept = fp8_linears.eligible(module)
    program = model_program(spec, Ctx(2, 24, "amp-bf16", "sdpa", "cuda", True))
    fp8 = fp8_program(program, "tensorwise")
    planned = {p.name.rsplit(".", 1)[0] for b in fp8.blocks if b.role == "layer" for op in b.ops
               if op.attrs.get("fp8") for p in op.params if p.name.endswith(".weight")}
    assert set(converted) == planned and converted
    assert kept.pop("lm_head") == "head"
    # what stays 16-bit inside the layers: weights with a dimension not divisible by 16 (Qwen2-MoE's shared
    # expert of width 56 and its h × 1 gate here), by both the job's rule and the planner's
    assert all(why.startswith("a dimension") for why in kept.values())
    assert set(kept) == {p.name.rsplit(".", 1)[0] for b in fp8.blocks if b.role == "layer" for op in b.ops
                         if op.kind == "linear" and not op.attrs.get("fp8") for p in op.params
                         if p.name.endswith(".weight")}
    assert bool(kept) == (case == "qwen2_moe")


def test_expert_parallelism_is_estimated_not_probed():
    rec = probe.run_probe(_request("mixtral", ep=2, parallelism="ddp", instances=1), modeling=modeling,
                          device="cpu")
    assert rec["status"] == "unsupported" and "ep=2" in rec["message"]


def _hp(req: dict) -> dict:
    return {k: json.loads(v) for k, v in req["HyperParameters"].items()}


def test_probe_launch_sends_the_fp8_settings(aws_env, mixtral_path):  # noqa: F811
    """CreateTrainingJob (Stubber) and the uploaded source (moto S3) carry the recipe: the hyperparameters,
    request.json's config, and the job file that converts the Linears."""
    from planner.aws.launch import LaunchOptions
    from planner.aws.session import S3Location
    from planner.probes.spec import make_request

    cfg = TrainConfig(batch_size=1, seq_len=32, precision="fp8", fp8_recipe="rowwise", parallelism="fsdp")
    request = make_request(str(mixtral_path), cfg, "ml.p5.48xlarge")
    assert request.config["precision"] == "fp8" and request.config["fp8_recipe"] == "rowwise"
    with mock_aws():
        aws = FakeAws()
        res, sent = launch_new_job(aws, request, LaunchOptions(role_arn=ROLE, s3=S3Location(BUCKET, "p"),
                                                                region=REGION))
        uri = _hp(sent)["sagemaker_submit_directory"]
        body = aws.s3.get_object(Bucket=BUCKET, Key=uri.split(BUCKET + "/", 1)[1])["Body"].read()
    assert res.action == "created"
    hp = _hp(sent)
    assert (hp["precision"], hp["fp8_recipe"]) == ("fp8", "rowwise") and "ep" not in hp
    with tarfile.open(fileobj=io.BytesIO(body), mode="r:gz") as tar:
        assert "fp8_linears.py" in tar.getnames()
        sent_request = json.loads(tar.extractfile("request.json").read())
    assert (sent_request["config"]["precision"], sent_request["config"]["fp8_recipe"]) == ("fp8", "rowwise")


def test_probe_launch_refuses_fp8_where_the_gpu_has_none(aws_env, mixtral_path):  # noqa: F811
    res = _cli(["probe", "launch", "--dry-run", "--model", str(mixtral_path), "--instance", "ml.g5.xlarge",
                "--batch-size", "1", "--seq-len", "32", "--precision", "fp8"])
    assert res.exit_code == 2 and len(res.stderr.strip().splitlines()) == 1, res.output
    assert "FP8 tensor cores" in res.stderr and "ml.p5" in res.stderr and "Traceback" not in res.output


def test_the_probe_line_of_an_fp8_expert_estimate_runs_as_printed(aws_env):  # noqa: F811
    from planner.cli.estimate_cmd import probe_command
    from planner.estimate import estimate

    cfg = TrainConfig(batch_size=1, seq_len=32, precision="fp8", fp8_recipe="delayed", parallelism="fsdp", ep=2,
                      moe_imbalance=1.5)
    line = probe_command(estimate("mixtral-8x7b", cfg, "ml.p5.48xlarge"))
    assert "--fp8-recipe delayed" in line and "--ep 2" in line
    args = line.split()[1:]  # `planner probe launch ...`
    res = _cli([*args, "--dry-run"])
    assert res.exit_code == 0, res.output
    hp = _hp(json.loads(res.stdout))
    assert (hp["precision"], hp["fp8_recipe"], hp["ep"]) == ("fp8", "delayed", 2)


def test_an_fp8_step_on_cpu_with_torchao(monkeypatch):
    """torchao's Float8Linear on CPU (torch's CPU `_scaled_mm`), run only where torchao is installed: the planned
    Linears converted, the step trains, the states are exact, and FP8 saves at least the weight casts the planner
    removes. (On CPU torchao does not cast the input to bf16 — its Float8Linear reads CUDA's autocast state,
    torchao/float8/float8_linear.py `torch.is_autocast_enabled()` — so the q/k/v projections share one fp32 input
    where on a GPU each saves its bf16 copy: the saved bytes here are below the planner's, not equal.)"""
    pytest.importorskip("torchao.float8")
    from planner.estimate import estimate

    monkeypatch.setenv(probe.FP8_ON_CPU, "1")
    fp8 = probe.run_probe(_request("mixtral", precision="fp8", fp8_recipe="tensorwise", attention="eager"),
                          modeling=modeling, device="cpu")
    amp = probe.run_probe(_request("mixtral", precision="amp-bf16", attention="eager"), modeling=modeling,
                          device="cpu")
    assert fp8["status"] == amp["status"] == "ok", fp8.get("message")
    assert fp8["applied"]["fp8"]["converted"] == 8 and fp8["applied"]["fp8"]["library"] == "torchao"
    losses = [r["loss"] for r in fp8["phases"] if r["phase"] == "forward"]
    assert losses[-1] < losses[0]
    spec = hf_config.spec_from_hf_config(TINY["mixtral"], name="mixtral")
    est = {p: estimate(spec, TrainConfig.model_validate(r["config"]), "ml.p5.48xlarge", backend="cpu").memory_bytes
           for p, r in (("fp8", fp8), ("amp", amp))}
    assert (fp8["tensors"]["parameters_bytes"], fp8["tensors"]["gradients_bytes"]) == (
        est["fp8"].parameters, est["fp8"].gradients)
    saved = {p: r["tensors"]["saved_tensor_bytes"] for p, r in (("fp8", fp8), ("amp", amp))}
    assert saved["fp8"] <= est["fp8"].activations
    assert saved["amp"] - saved["fp8"] >= est["amp"].activations - est["fp8"].activations > 0


def test_probe_run_says_why_fp8_did_not_run_here(mixtral_path, tmp_path, monkeypatch):
    """`planner probe run --precision fp8` on a CPU: the record is `unsupported`, the command prints its one line
    (and the configuration label names the recipe), exit 0: nothing failed, nothing was measured."""
    from planner.probes.validate import config_label

    monkeypatch.setenv("PLANNER_RESULTS_DIR", str(tmp_path / "results"))
    _in_process_run(monkeypatch)
    res = _cli(["probe", "run", "--local", "--model", str(mixtral_path), "--instance", "ml.p5.48xlarge",
                "--batch-size", "1", "--seq-len", "16", "--precision", "fp8", "--fp8-recipe", "rowwise",
                "--parallelism", "single", "--device", "cpu"])
    assert res.exit_code == 0, res.output
    assert "unsupported: precision=fp8 needs a CUDA GPU with FP8 tensor cores" in " ".join(res.stderr.split())
    [record] = [json.loads(p.read_text()) for p in (tmp_path / "results" / "probes").glob("local-*.json")]
    assert record["config"]["fp8_recipe"] == "rowwise" and "fp8-rowwise" in config_label(record["config"])


@pytest.mark.slow  # two torchrun processes importing torch and transformers: 20-60 s on a shared 2-core machine
def test_a_tiny_moe_under_fsdp_on_two_cpu_processes(mixtral_path, tmp_path):
    """FSDP2 over two gloo ranks (torchrun, as on a GPU box): each rank's shard of the experts and the rest is
    what the planner predicts per rank (parameters, gradients; AdamW's states plus the CPU-side step counters)."""
    import os
    import subprocess

    from planner.probes.spec import make_request

    cfg = TrainConfig(batch_size=2, seq_len=16, parallelism="fsdp", precision="amp-bf16", attention="eager",
                      instances=2)
    req = make_request(str(mixtral_path), cfg, "ml.g5.xlarge", warmup_steps=1, measure_steps=1)
    assert req.world_size == 2
    (tmp_path / "req.json").write_text(json.dumps(req.to_json()))
    out = tmp_path / "out.json"
    proc = subprocess.run([sys.executable, str(ROOT / "jobs" / "probe.py"), "--request", str(tmp_path / "req.json"),
                           "--out", str(out), "--device", "cpu"], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PLANNER_MASTER_PORT": "29617"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    rec = json.loads(out.read_text())
    assert rec["status"] == "ok" and len(rec["ranks"]) == 2, rec.get("message")
    m, t = req.estimate["memory_bytes"], rec["tensors"]
    assert t["local_parameters_bytes"] == m["parameters"] == t["parameters_bytes"] // 2
    assert t["gradients_bytes"] == m["gradients"]
    assert t["optimizer_state_bytes"] == m["optimizer_states"] + 4 * _parameter_tensors("mixtral")
