"""Probes of the user's own module: the source travels in the request (hence in the SageMaker source
archive), jobs/probe.py imports it there and trains it for real (here on CPU), and the bytes it saves match
the tracer's."""

from __future__ import annotations

import gzip
import io
import json
import os
import subprocess
import sys
import tarfile
import textwrap
from pathlib import Path

import pytest
import torch

from planner.spec import TrainConfig
from tests.module_files import load_module

ROOT = Path(__file__).resolve().parents[1]
torch.set_num_threads(1)

USER_CODE = textwrap.dedent("""
    import torch
    from torch import nn

    class Net(nn.Module):
        def __init__(self, width=8, dropout=0.2):
            super().__init__()
            self.conv = nn.Sequential(nn.Conv2d(3, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU())
            self.drop = nn.Dropout(dropout)
            self.head = nn.Linear(width, 4)

        def forward(self, x):
            h = self.conv(x)
            return self.head(self.drop(h.mean(dim=(2, 3))))

    def build(width=8):
        return Net(width)

    def batch(b, s):
        return (torch.randn(b, 3, s, s),)

    def loss(out, batch):
        return out.square().mean()
""")


@pytest.fixture()
def user(tmp_path) -> Path:
    path = tmp_path / "usernet.py"
    path.write_text(USER_CODE)
    return path


def _request(path: Path, **cfg):
    from planner.probes.spec import make_request

    config = TrainConfig(batch_size=2, seq_len=6, parallelism="single", **cfg)
    return make_request(f"{path}:build", config, "ml.g5.xlarge", inputs=f"{path}:batch", loss=f"{path}:loss",
                        model_options={"width": 6}, warmup_steps=1, measure_steps=1)


def test_request_carries_the_source_and_its_hash_follows_it(user):
    req = _request(user)
    code = req.user_code
    assert code is not None and code["files"] == {"usernet.py": USER_CODE}
    assert (code["model"], code["inputs"], code["loss"]) == ("usernet.py:build", "usernet.py:batch", "usernet.py:loss")
    assert code["options"] == {"width": 6} and req.model_name == "usernet.py:build"
    assert req.estimate is not None and req.estimate["parameters"]["total"] == sum(
        p.numel() for p in load_module("usernet_ref", user).build(width=6).parameters())
    user.write_text(USER_CODE + "\n# edited\n")
    assert _request(user).request_id != req.request_id  # new code, new measurement


def test_launch_ships_the_source_in_the_job_archive(user):
    from planner.aws.launch import pack_sourcedir

    req = _request(user)
    with tarfile.open(fileobj=gzip.GzipFile(fileobj=io.BytesIO(pack_sourcedir(req)))) as tar:
        shipped = json.loads(tar.extractfile("request.json").read())
    assert shipped["model"]["user_code"]["files"]["usernet.py"] == USER_CODE


def test_probe_job_trains_the_user_module_and_saves_what_the_tracer_says(user, tmp_path):
    """On CPU: the probe imports the shipped file (not the user's path), trains, and autograd saves the
    tracer's CPU bytes plus what the probe does not exclude and the tracer files apart: the input image
    (Conv2d saves its input: `batch`) and BatchNorm's running statistics (`buffers`)."""
    from planner.program.trace import trace_step

    probe = load_module("planner_test_probe_user", ROOT / "jobs" / "probe.py")
    modeling = load_module("modeling", ROOT / "jobs" / "modeling.py")
    req = _request(user)
    user.rename(tmp_path / "ref.py")  # the job must not need the user's own file
    result = probe.run_probe(req.to_json(), modeling=modeling, device="cpu")
    assert result["status"] == "ok", result.get("message")
    ref = load_module("usernet_ref2", tmp_path / "ref.py")
    trace = trace_step(lambda: ref.build(width=6), ref.batch, TrainConfig(batch_size=2, seq_len=6), backend="cpu",
                       loss_fn=ref.loss)
    image = 2 * 3 * 6 * 6 * 4
    running_stats = 2 * 6 * 4  # BatchNorm2d saves running_mean/var: buffers, which the tracer files apart
    assert result["tensors"]["parameter_count"] == trace.parameters["total"]
    assert result["tensors"]["saved_tensor_bytes"] == trace.saved_bytes + image + running_stats
    from planner.probes.validate import current_estimate

    again = current_estimate(result)  # `planner validate` re-estimates from the shipped source
    assert again is not None and again["parameters"]["total"] == trace.parameters["total"]


def test_probe_run_local_cli_with_user_module(user, tmp_path):
    env = {**os.environ, "PLANNER_RESULTS_DIR": str(tmp_path / "results"), "PYTHONPATH": str(ROOT),
           "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "planner", "probe", "run", "--local", "--model", f"{user}:build",
           "--inputs", f"{user}:batch", "--loss", f"{user}:loss", "--instance", "ml.g5.xlarge", "--batch-size", "2",
           "--seq-len", "6", "--device", "cpu", "--steps", "1", "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    record = json.loads(proc.stdout[proc.stdout.index("["):])[0]
    assert record["status"] == "ok" and record["model"] == "usernet.py:build"


def test_launch_dry_run_with_a_user_module_and_without_its_inputs(user, tmp_path):
    env = {**os.environ, "PLANNER_RESULTS_DIR": str(tmp_path / "results"), "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "planner", "probe", "launch", "--dry-run", "--model", f"{user}:build",
           "--instance", "ml.g5.xlarge", "--batch-size", "2", "--seq-len", "6", "--role",
           "arn:aws:iam::123456789012:role/x", "--bucket", "s3://my-bucket/probes", "--json"]
    ok = subprocess.run([*cmd, "--inputs", f"{user}:batch"], capture_output=True, text=True, env=env, cwd=tmp_path,
                        timeout=120)
    assert ok.returncode == 0, ok.stderr[-1000:]
    assert json.loads(ok.stdout)["TrainingJobName"].startswith("probe-usernet-py-build-")
    bad = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert bad.returncode == 2
    assert "--inputs" in bad.stderr and "Traceback" not in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
