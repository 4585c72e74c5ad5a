"""`planner probe launch/status` against a SageMaker-compatible endpoint: a real moto server over HTTP.

Nothing is stubbed: the real planner.aws code paths (boto3 session, retries, S3 upload, DescribeTrainingJob,
CreateTrainingJob) talk to `moto.server.ThreadedMotoServer` through AWS_ENDPOINT_URL (boto3 >= 1.28 reads it).
Its not-found answer words differ from SageMaker's ("Could not find training job ..." vs "Requested resource
not found."), which is the point: "no such job" must not depend on the wording.
"""

from __future__ import annotations

import json
import socket

import boto3
import pytest
from test_aws_fixtures import BUCKET, REGION, ROLE, aws_env, tiny_config  # noqa: F401
from typer.testing import CliRunner

from planner.cli.main import app

moto_server = pytest.importorskip("moto.server")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def endpoint():
    port = _free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    yield f"http://127.0.0.1:{port}"
    server.stop()


@pytest.fixture
def on_server(aws_env, endpoint, monkeypatch):  # noqa: F811
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    boto3.client("s3", region_name=REGION, endpoint_url=endpoint).create_bucket(Bucket=BUCKET)
    return endpoint


def _launch(config) -> list[dict]:
    res = CliRunner().invoke(app, ["probe", "launch", "--model", str(config), "--instance", "ml.g5.xlarge",
                                   "--batch-size", "2", "--seq-len", "32", "--role", ROLE,
                                   "--bucket", f"s3://{BUCKET}/p", "--region", REGION, "--json"])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def test_describe_missing_job_is_none_on_the_server(on_server):
    from planner.aws.launch import existing_job
    from planner.aws.session import Aws

    sm = Aws(REGION).sagemaker
    with pytest.raises(Exception) as info:  # what the server really answers
        sm.describe_training_job(TrainingJobName="planner-no-such-job")
    assert "not found" not in str(info.value).lower()  # the wording the old check relied on is absent
    assert existing_job(sm, "planner-no-such-job") is None


def test_launch_creates_then_skips_the_existing_job(on_server, tiny_config):  # noqa: F811
    [first] = _launch(tiny_config)
    assert first["action"] == "created"
    sm = boto3.client("sagemaker", region_name=REGION, endpoint_url=on_server)
    desc = sm.describe_training_job(TrainingJobName=first["job_name"])
    assert desc["ResourceConfig"]["InstanceType"] == "ml.g5.xlarge"
    assert desc["ResourceConfig"]["VolumeSizeInGB"] >= 1
    [again] = _launch(tiny_config)  # idempotent: DescribeTrainingJob finds it, nothing is created twice
    assert again["job_name"] == first["job_name"] and again["action"] == "exists"
    names = [j["TrainingJobName"] for j in sm.list_training_jobs()["TrainingJobSummaries"]]
    assert names.count(first["job_name"]) == 1
