"""Shared helpers for the AWS tests: fake credentials, moto S3, Stubber-backed SageMaker, a tiny model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.stub import Stubber

TINY_BERT = {"model_type": "bert", "architectures": ["BertForSequenceClassification"], "vocab_size": 128,
             "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64,
             "max_position_embeddings": 64, "type_vocab_size": 2}
ROLE = "arn:aws:iam::111122223333:role/ProbeRole"
BUCKET = "probe-bucket"
REGION = "us-east-1"


@pytest.fixture
def aws_env(monkeypatch, tmp_path):
    """Fake credentials (moto/Stubber never send them anywhere), results under tmp_path."""
    for key in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "PLANNER_SAGEMAKER_ROLE", "SAGEMAKER_ROLE_ARN",
                "PLANNER_S3_URI"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("PLANNER_RESULTS_DIR", str(tmp_path / "results"))
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture
def tiny_config(tmp_path) -> Path:
    path = tmp_path / "tiny-bert.json"
    path.write_text(json.dumps(TINY_BERT))
    return path


class FakeAws:
    """planner.aws.session.Aws with a stubbed SageMaker client and a moto S3 client."""

    def __init__(self, region: str = REGION):
        self.region = region
        self.sagemaker = boto3.client("sagemaker", region_name=region)
        self.stub = Stubber(self.sagemaker)
        self.stub.activate()
        self.s3 = boto3.client("s3", region_name=region)

    def client(self, service: str) -> Any:
        return {"sagemaker": self.sagemaker, "s3": self.s3}[service]


def not_found(stub: Stubber, name: str | None = None) -> None:
    """SageMaker's answer for a missing job: a ValidationException that does not name it, so the planner
    asks ListTrainingJobs(NameContains=name), which lists no job of that exact name."""
    stub.add_client_error("describe_training_job", service_error_code="ValidationException",
                          service_message="Requested resource not found.",
                          expected_params=None if name is None else {"TrainingJobName": name})
    stub.add_response("list_training_jobs", {"TrainingJobSummaries": []},
                      expected_params=None if name is None else {"NameContains": name, "MaxResults": 100})


def describe_response(name: str, status: str, *, failure: str | None = None, secondary: str = "Completed",
                      output: str = f"s3://{BUCKET}/planner-probes/output") -> dict[str, Any]:
    resp: dict[str, Any] = {
        "TrainingJobName": name,
        "TrainingJobArn": f"arn:aws:sagemaker:{REGION}:111122223333:training-job/{name}",
        "ModelArtifacts": {"S3ModelArtifacts": f"{output}/{name}/output/model.tar.gz"},
        "TrainingJobStatus": status, "SecondaryStatus": secondary,
        "AlgorithmSpecification": {"TrainingInputMode": "File", "TrainingImage": "img"},
        "ResourceConfig": {"InstanceType": "ml.g5.xlarge", "InstanceCount": 1, "VolumeSizeInGB": 30},
        "StoppingCondition": {"MaxRuntimeInSeconds": 1800},
        "CreationTime": "2026-01-01T00:00:00Z", "OutputDataConfig": {"S3OutputPath": output},
        "RoleArn": ROLE,
    }
    if failure:
        resp["FailureReason"] = failure
    if status in ("Completed", "Failed", "Stopped"):
        resp["TrainingTimeInSeconds"] = 120
        resp["BillableTimeInSeconds"] = 120
    return resp


def launch_new_job(aws: FakeAws, request: Any, options: Any) -> tuple[Any, dict[str, Any]]:
    """Launch one request whose job does not exist yet (inside `mock_aws()`): the bucket made, SageMaker
    answering "not found" then "created"; returns the launch result and the CreateTrainingJob parameters
    the planner sent, with every stubbed answer used."""
    from planner.aws.launch import job_name, launch

    aws.s3.create_bucket(Bucket=BUCKET)
    not_found(aws.stub, job_name(request))
    aws.stub.add_response("create_training_job", {"TrainingJobArn": f"arn:aws:sagemaker:{REGION}:1:training-job/x"})
    sent: dict[str, Any] = {}
    aws.sagemaker.meta.events.register("before-parameter-build.sagemaker.CreateTrainingJob",
                                       lambda params, **_: sent.update(params))
    [res] = launch([request], options, aws=aws)
    aws.stub.assert_no_pending_responses()
    return res, sent
