"""planner probe launch for a model-parallel layout: a multi-instance job under SageMaker's torchrun launcher."""

from __future__ import annotations

import io
import json
import tarfile

import pytest
from moto import mock_aws
from test_aws_fixtures import BUCKET, REGION, ROLE, FakeAws, aws_env, launch_new_job, not_found  # noqa: F401

from planner.aws.launch import (
    INSTANCE_TYPE_HP,
    TORCH_DISTRIBUTED_HP,
    LaunchOptions,
    create_request,
    pack_sourcedir,
)
from planner.aws.session import S3Location
from planner.errors import PlannerError
from planner.probes.spec import make_request
from planner.spec import TrainConfig

TINY_LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 128, "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 8,
              "max_position_embeddings": 64, "tie_word_embeddings": False}


@pytest.fixture
def llama_config(tmp_path):
    path = tmp_path / "tiny-llama.json"
    path.write_text(json.dumps(TINY_LLAMA))
    return path


def opts() -> LaunchOptions:
    return LaunchOptions(role_arn=ROLE, s3=S3Location(BUCKET, "planner-probes"), region=REGION)


def hp_of(req: dict) -> dict:
    return {k: json.loads(v) for k, v in req["HyperParameters"].items()}


def test_a_layout_over_two_instances_runs_under_sagemaker_torchrun(llama_config):
    cfg = TrainConfig(batch_size=1, seq_len=32, tp=8, pp=2, grad_accum=4, instances=2, parallelism="fsdp")
    request = make_request(str(llama_config), cfg, "ml.p4d.24xlarge", with_estimate=False)
    assert request.world_size == 16 and request.gpus_per_instance == 8
    req = create_request(request, opts())
    assert req["ResourceConfig"]["InstanceCount"] == 2
    assert req["ResourceConfig"]["InstanceType"] == "ml.p4d.24xlarge"
    hp = hp_of(req)
    assert hp[TORCH_DISTRIBUTED_HP] is True and hp[INSTANCE_TYPE_HP] == "ml.p4d.24xlarge"
    assert (hp["tp"], hp["pp"], hp["parallelism"], hp["instances"], hp["world_size"]) == (8, 2, "fsdp", 2, 16)
    assert "cp" not in hp and "vp" not in hp  # degrees of 1 are left out
    assert all(isinstance(v, str) and len(v) <= 2500 for v in req["HyperParameters"].values())
    with tarfile.open(fileobj=io.BytesIO(pack_sourcedir(request)), mode="r:gz") as tar:
        names = set(tar.getnames())
        inner = json.loads(tar.extractfile("request.json").read())
    assert {"probe.py", "modeling.py", "parallel_layout.py", "request.json"} <= names
    assert (inner["config"]["tp"], inner["config"]["pp"], inner["world_size"]) == (8, 2, 16)


def test_data_parallel_on_one_instance_keeps_its_own_launcher(llama_config):
    request = make_request(str(llama_config), TrainConfig(batch_size=1, seq_len=32, parallelism="ddp"),
                           "ml.g5.12xlarge", with_estimate=False)
    hp = hp_of(create_request(request, opts()))
    assert TORCH_DISTRIBUTED_HP not in hp and "tp" not in hp
    two = make_request(str(llama_config), TrainConfig(batch_size=1, seq_len=32, parallelism="ddp", instances=2),
                       "ml.g5.12xlarge", with_estimate=False)
    assert hp_of(create_request(two, opts()))[TORCH_DISTRIBUTED_HP] is True  # several instances: SageMaker's


def test_a_layout_that_cannot_exist_is_refused_before_any_job(llama_config):
    with pytest.raises(PlannerError, match="--tp"):  # 3 does not divide the 8 GPUs
        make_request(str(llama_config), TrainConfig(batch_size=1, seq_len=32, tp=3), "ml.p4d.24xlarge",
                     with_estimate=False)
    with pytest.raises(PlannerError, match="--pp"):  # 8 stages for 4 layers
        make_request(str(llama_config), TrainConfig(batch_size=1, seq_len=32, pp=8), "ml.p4d.24xlarge",
                     with_estimate=False)


def test_launch_sends_the_layout_job(aws_env, llama_config):  # noqa: F811
    cfg = TrainConfig(batch_size=1, seq_len=32, tp=4, pp=2, grad_accum=2, instances=2)
    request = make_request(str(llama_config), cfg, "ml.g5.12xlarge", with_estimate=False)
    with mock_aws():
        aws = FakeAws()
        res, sent = launch_new_job(aws, request, opts())
    assert res.action == "created"
    assert sent["ResourceConfig"]["InstanceCount"] == 2
    assert json.loads(sent["HyperParameters"][TORCH_DISTRIBUTED_HP]) is True
    assert json.loads(sent["HyperParameters"]["tp"]) == 4


def _cli(args):
    from typer.testing import CliRunner

    from planner.cli.main import app

    return CliRunner().invoke(app, args)


def test_probe_launch_takes_the_layout_flags(aws_env, llama_config):  # noqa: F811
    base = ["probe", "launch", "--dry-run", "--model", str(llama_config), "--instance", "ml.p4d.24xlarge",
            "--batch-size", "1", "--seq-len", "32"]
    res = _cli(base + ["--instances", "2", "--tp", "8", "--pp", "2", "--vp", "2", "--pp-schedule", "interleaved-1f1b",
                       "--grad-accum", "4", "--parallelism", "fsdp", "--recompute", "full"])
    assert res.exit_code == 0, res.output
    req = json.loads(res.stdout)
    hp = hp_of(req)
    assert req["ResourceConfig"]["InstanceCount"] == 2 and hp[TORCH_DISTRIBUTED_HP] is True
    assert (hp["tp"], hp["pp"], hp["vp"], hp["pp_schedule"]) == (8, 2, 2, "interleaved-1f1b")
    assert hp.get("recompute") == "full" or hp["checkpointing"] is True  # (a TrainConfig may store it either way)
    assert not (aws_env / "results").exists()


@pytest.mark.parametrize("flags,named", [(["--tp", "3"], "--tp"), (["--vp", "2"], "--vp"),
                                         (["--pp", "2", "--pp-schedule", "foo"], "--pp-schedule"),
                                         (["--tp", "2", "--seq-len", "33"], "--seq-len")])
def test_probe_launch_refuses_a_layout_that_cannot_exist(aws_env, llama_config, flags, named):  # noqa: F811
    res = _cli(["probe", "launch", "--dry-run", "--model", str(llama_config), "--instance", "ml.p4d.24xlarge",
                "--batch-size", "1", "--seq-len", "32", *flags])
    assert res.exit_code == 2, res.output
    line = res.output.strip()
    assert named in line and "\n" not in line and "Traceback" not in line
    assert not (aws_env / "results").exists()
