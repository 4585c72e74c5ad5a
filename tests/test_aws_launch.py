"""planner probe launch: image choice, job names, the CreateTrainingJob request, idempotency, bad input."""

from __future__ import annotations

import io
import json
import re
import tarfile

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from moto import mock_aws
from test_aws_fixtures import BUCKET, REGION, ROLE, FakeAws, aws_env, launch_new_job, not_found, tiny_config  # noqa: F401
from typer.testing import CliRunner

from planner.aws import images
from planner.aws.launch import (
    JOB_NAME_RE,
    LaunchOptions,
    create_request,
    job_name,
    launch,
    metric_definitions,
    pack_sourcedir,
)
from planner.aws.session import AwsError, S3Location, parse_s3_uri
from planner.errors import PlannerError
from planner.probes.spec import ProbeRequest, make_request
from planner.spec import TrainConfig

runner = CliRunner()


@pytest.fixture
def tiny_request(tiny_config):  # noqa: F811
    return make_request(str(tiny_config), TrainConfig(batch_size=4, seq_len=32), "ml.g5.xlarge",
                        with_estimate=False, study="s1", trial=7)


def opts(**kw) -> LaunchOptions:
    base = dict(role_arn=ROLE, s3=S3Location(BUCKET, "planner-probes"), region=REGION)
    base.update(kw)
    return LaunchOptions(**base)


# ------------------------------------------------------------------------------------------ images


def test_v100_gets_the_newest_dlc_that_still_ships_sm70():
    p3 = images.choose_image("ml.p3.16xlarge", "us-east-1")
    assert p3.framework_version == "2.8.0"
    assert p3.uri == ("763104351884.dkr.ecr.us-east-1.amazonaws.com/pytorch-training:"
                      "2.8.0-gpu-py312-cu129-ubuntu22.04-sagemaker")
    for newer in images.PYTORCH_TRAINING_IMAGES:
        if newer.framework_version > "2.8.0":
            assert not newer.supports((7, 0))
    with pytest.raises(PlannerError, match="sm70"):
        images.choose_image("ml.p3.2xlarge", "us-east-1", framework_version="2.10.0")


def test_newer_gpus_get_the_newest_dlc_and_regions_map_to_their_registry():
    assert images.choose_image("ml.g5.xlarge", "eu-west-1").framework_version == "2.10.0"
    assert images.choose_image("ml.g4dn.xlarge", "us-west-2").framework_version == "2.10.0"  # T4 is sm75
    assert images.registry("af-south-1") == "626614931356.dkr.ecr.af-south-1.amazonaws.com"
    assert images.registry("cn-north-1").endswith(".amazonaws.com.cn")
    with pytest.raises(PlannerError, match="region"):
        images.registry("mars-east-1")


def test_cubin_and_ptx_compatibility_rules():
    img = images.DlcImage("r", "9", "py3", "cu", "t", cuda_archs=((8, 0), (8, 6)), ptx=(9, 0))
    assert img.supports((8, 9))  # sm86 cubin runs on sm89 (same major, newer minor)
    assert not img.supports((7, 5))  # no older-arch kernels
    assert img.supports((10, 0))  # PTX JIT for newer GPUs
    assert not images.DlcImage("r", "9", "py3", "cu", "t", cuda_archs=((8, 6),)).supports((8, 0))


# ---------------------------------------------------------------------------------------- job names


@settings(max_examples=60, deadline=None)
@given(name=st.text(min_size=0, max_size=120), batch=st.integers(1, 4096))
def test_job_names_are_valid_and_deterministic(name, batch):
    req = ProbeRequest(model={"name": name}, config={"batch_size": batch, "seq_len": 8})
    a, b = job_name(req), job_name(ProbeRequest(model={"name": name}, config={"batch_size": batch, "seq_len": 8}))
    assert a == b and JOB_NAME_RE.match(a) and len(a) <= 63
    assert a.endswith(req.request_id)


def test_job_names_differ_per_candidate(tiny_request):
    other = tiny_request.model_copy(update={"config": {**tiny_request.config, "batch_size": 8}})
    assert job_name(tiny_request) != job_name(other)
    # predictions and study membership do not change what is measured, hence not the job
    same = tiny_request.model_copy(update={"estimate": {"fits": True}, "study": "other", "trial": 1})
    assert job_name(same) == job_name(tiny_request)


# ------------------------------------------------------------------------------ the request itself


def test_create_training_job_request(tiny_request):
    req = create_request(tiny_request, opts(max_run_minutes=20))
    name = req["TrainingJobName"]
    assert req["AlgorithmSpecification"]["TrainingImage"] == images.choose_image("ml.g5.xlarge", REGION).uri
    assert req["ResourceConfig"]["InstanceType"] == "ml.g5.xlarge"
    assert req["ResourceConfig"]["InstanceCount"] == 1
    assert req["RoleArn"] == ROLE
    assert req["OutputDataConfig"]["S3OutputPath"] == f"s3://{BUCKET}/planner-probes/output"
    assert req["StoppingCondition"] == {"MaxRuntimeInSeconds": 1200}
    assert req["EnableManagedSpotTraining"] is False and "CheckpointConfig" not in req
    hp = {k: json.loads(v) for k, v in req["HyperParameters"].items()}  # all JSON-encoded strings
    assert all(isinstance(v, str) for v in req["HyperParameters"].values())
    assert hp["sagemaker_program"] == "probe.py"
    assert hp["sagemaker_submit_directory"] == f"s3://{BUCKET}/planner-probes/{name}/source/sourcedir.tar.gz"
    assert hp["sagemaker_region"] == REGION
    assert hp["request"] == "request.json"
    assert (hp["batch_size"], hp["seq_len"], hp["precision"]) == (4, 32, "fp32")
    assert all(len(v) <= 2500 for v in req["HyperParameters"].values())  # SageMaker's value limit
    tags = {t["Key"]: t["Value"] for t in req["Tags"]}
    assert tags["planner:study"] == "s1" and tags["planner:trial"] == "7"
    assert tags["planner:request-id"] == tiny_request.request_id
    names = {m["Name"] for m in req["AlgorithmSpecification"]["MetricDefinitions"]}
    assert "probe:peak_allocated_bytes" in names


def test_spot_multi_instance_request(tiny_request):
    two = tiny_request.model_copy(update={"config": {**tiny_request.config, "instances": 2}})
    req = create_request(two, opts(spot=True, max_run_minutes=30, instance_type="ml.p3.16xlarge"))
    assert req["ResourceConfig"] == {"InstanceType": "ml.p3.16xlarge", "InstanceCount": 2, "VolumeSizeInGB": 30}
    assert req["EnableManagedSpotTraining"] is True
    stop = req["StoppingCondition"]
    assert stop["MaxRuntimeInSeconds"] == 1800 and stop["MaxWaitTimeInSeconds"] >= stop["MaxRuntimeInSeconds"]
    assert req["CheckpointConfig"]["S3Uri"].startswith(f"s3://{BUCKET}/planner-probes/")
    assert "2.8.0-gpu-py312-cu129" in req["AlgorithmSpecification"]["TrainingImage"]  # V100


def test_metric_regexes_scrape_probe_lines():
    rx = {m["Name"]: re.compile(m["Regex"]) for m in metric_definitions()}
    assert rx["probe:peak_allocated_bytes"].search("probe_peak_allocated_bytes=123456789;").group(1) == "123456789"
    assert float(rx["probe:samples_per_s"].search("x probe_samples_per_s=1.5e+03; y").group(1)) == 1500.0


def test_sourcedir_is_reproducible_and_complete(tiny_request):
    a, b = pack_sourcedir(tiny_request), pack_sourcedir(tiny_request)
    assert a == b
    with tarfile.open(fileobj=io.BytesIO(a), mode="r:gz") as tar:
        names = set(tar.getnames())
        inner = json.loads(tar.extractfile("request.json").read())
    assert {"probe.py", "modeling.py", "requirements.txt", "request.json"} <= names
    assert inner["request_id"] == tiny_request.request_id and inner["model"]["name"] == tiny_request.model_name


# ------------------------------------------------------------------------- AWS calls (moto + Stubber)


def test_launch_uploads_then_creates_and_is_idempotent(aws_env, tiny_request):  # noqa: F811
    with mock_aws():
        aws = FakeAws()
        name = job_name(tiny_request)
        res, sent = launch_new_job(aws, tiny_request, opts())
        assert res.action == "created" and res.job_name == name
        key = f"planner-probes/{name}/source/sourcedir.tar.gz"
        body = aws.s3.get_object(Bucket=BUCKET, Key=key)["Body"].read()
        assert body == pack_sourcedir(tiny_request)
        assert sent["TrainingJobName"] == name and sent["RoleArn"] == ROLE
        assert json.loads(sent["HyperParameters"]["sagemaker_submit_directory"]) == f"s3://{BUCKET}/{key}"
        aws.stub.assert_no_pending_responses()

        # Launching the same candidate again finds the job and creates nothing.
        aws.stub.add_response("describe_training_job", {
            "TrainingJobName": name, "TrainingJobArn": "arn:aws:sagemaker:us-east-1:1:training-job/x",
            "ModelArtifacts": {"S3ModelArtifacts": "s3://b/k"}, "TrainingJobStatus": "InProgress",
            "SecondaryStatus": "Training", "AlgorithmSpecification": {"TrainingInputMode": "File"},
            "ResourceConfig": {"InstanceType": "ml.g5.xlarge", "InstanceCount": 1, "VolumeSizeInGB": 30},
            "StoppingCondition": {}, "CreationTime": "2026-01-01T00:00:00Z"})
        [again] = launch([tiny_request], opts(), aws=aws)
        assert again.action == "exists" and again.status == "InProgress"
        aws.stub.assert_no_pending_responses()


@pytest.mark.parametrize("code,expected", [("AccessDeniedException", "permission"), ("ThrottlingException",
                                                                                        "throttling")])
def test_aws_errors_become_one_line(aws_env, tiny_request, code, expected):  # noqa: F811
    with mock_aws():
        aws = FakeAws()
        aws.stub.add_client_error("describe_training_job", service_error_code=code,
                                  service_message=f"User: {ROLE} is not authorized")
        with pytest.raises(AwsError) as err:
            launch([tiny_request], opts(), aws=aws)
    text = str(err.value)
    assert code in text and expected in text and "\n" not in text
    assert "111122223333" not in text  # the account id from the role ARN is masked


# ---------------------------------------------------------------------------------------------- CLI


def _cli(args, **kw):
    from planner.cli.main import app

    return runner.invoke(app, args, **kw)


def test_dry_run_calls_nothing_and_allows_placeholders(aws_env, tiny_config, monkeypatch):  # noqa: F811
    import boto3

    def boom(*a, **k):
        raise AssertionError("dry run must not create AWS sessions")

    monkeypatch.setattr(boto3.session, "Session", boom)
    res = _cli(["probe", "launch", "--dry-run", "--model", str(tiny_config), "--instance", "ml.p3.2xlarge",
                "--batch-size", "2", "--seq-len", "32", "--spot"])
    assert res.exit_code == 0, res.output
    req = json.loads(res.stdout)
    assert JOB_NAME_RE.match(req["TrainingJobName"])
    assert req["ResourceConfig"]["InstanceType"] == "ml.p3.2xlarge"
    assert "2.8.0-gpu-py312-cu129" in req["AlgorithmSpecification"]["TrainingImage"]
    assert req["RoleArn"].startswith("arn:aws:iam::************:role/")  # placeholder, account masked
    assert req["EnableManagedSpotTraining"] is True
    assert not (aws_env / "results").exists()  # a dry run writes nothing
    tf32 = _cli(["probe", "launch", "--dry-run", "--model", str(tiny_config), "--instance", "ml.p3.2xlarge",
                 "--batch-size", "2", "--seq-len", "32", "--spot", "--tf32"])
    assert tf32.exit_code == 0, tf32.output  # another configuration, so another job
    assert json.loads(tf32.stdout)["TrainingJobName"] != req["TrainingJobName"]


@pytest.mark.parametrize("extra,needle", [
    ([], "--role"),
    (["--role", ROLE], "--bucket"),
    (["--role", ROLE, "--bucket", "s3://Bad_Bucket/x"], "--bucket"),
    (["--role", "not-an-arn", "--bucket", f"s3://{BUCKET}"], "--role"),
    (["--role", ROLE, "--bucket", f"s3://{BUCKET}", "--region", "nowhere"], "--region"),
])
def test_bad_input_is_one_line_exit_2(aws_env, tiny_config, extra, needle):  # noqa: F811
    res = _cli(["probe", "launch", "--model", str(tiny_config), "--instance", "ml.g5.xlarge", "--batch-size", "2",
                "--seq-len", "32", *extra])
    assert res.exit_code == 2, res.output
    assert needle in res.stderr and len(res.stderr.strip().splitlines()) == 1
    assert "Traceback" not in res.output


def test_no_credentials_is_one_line_exit_2(aws_env, tiny_config, monkeypatch, tmp_path):  # noqa: F811
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    res = _cli(["probe", "launch", "--model", str(tiny_config), "--instance", "ml.g5.xlarge", "--batch-size", "2",
                "--seq-len", "32", "--role", ROLE, "--bucket", f"s3://{BUCKET}/p"])
    assert res.exit_code == 2, res.output
    assert "NoCredentials" in res.stderr and len(res.stderr.strip().splitlines()) == 1


def test_cli_launch_records_the_job_without_secrets(aws_env, tiny_config, monkeypatch):  # noqa: F811
    from planner.aws import session

    with mock_aws():
        fake = FakeAws()
        fake.s3.create_bucket(Bucket=BUCKET)
        monkeypatch.setattr(session, "Aws", lambda region, profile=None: fake)
        not_found(fake.stub)
        fake.stub.add_response("create_training_job", {"TrainingJobArn": "arn:aws:sagemaker:us-east-1:1:training-job/x"})
        res = _cli(["probe", "launch", "--model", str(tiny_config), "--instance", "ml.g5.xlarge", "--batch-size",
                    "2", "--seq-len", "32", "--role", ROLE, "--bucket", f"s3://{BUCKET}/p", "--json"])
    assert res.exit_code == 0, res.output
    [out] = json.loads(res.stdout)
    assert out["action"] == "created"
    jobs = json.loads((aws_env / "results" / "probes" / "jobs.json").read_text())
    assert out["job_name"] in jobs and jobs[out["job_name"]]["region"] == REGION
    for path in (aws_env / "results").rglob("*.json"):
        text = path.read_text()
        assert "111122223333" not in text and "ProbeRole" not in text


def test_parse_s3_uri():
    assert parse_s3_uri("s3://my-bucket/a/b/") == S3Location("my-bucket", "a/b")
    assert parse_s3_uri("my-bucket") == S3Location("my-bucket", "")
    for bad in ("s3://", "http://x/y", "s3://UPPER/x", "s3://a/x", "s3://bad..dots/x"):
        with pytest.raises(PlannerError):
            parse_s3_uri(bad)
