"""planner probe status / collect: Completed, Failed (OOM or not), Stopped, missing outputs, idempotency."""

from __future__ import annotations

import io
import json
import tarfile

import pandas as pd
import pytest
from moto import mock_aws
from test_aws_fixtures import BUCKET, REGION, FakeAws, aws_env, describe_response  # noqa: F401
from typer.testing import CliRunner

from planner.aws.collect import collect_jobs, is_oom_text, read_probe_from_tar
from planner.aws.session import AwsError
from planner.probes import store

runner = CliRunner()
OUT = f"s3://{BUCKET}/planner-probes/output"


def output_tar(result: dict) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        data = json.dumps(result).encode()
        info = tarfile.TarInfo("probe.json")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def probe_result(status: str = "ok", **extra) -> dict:
    base = {"schema": "planner.probe-result/1", "request_id": "r-ok", "status": status, "phase": None,
            "model": "tiny", "config": {"batch_size": 2, "seq_len": 16}, "device": "cuda",
            "gpu_name": "NVIDIA A10G", "summary": {"peak_allocated": 1000, "peak_reserved": 1200,
                                                   "device_peak": 1700, "samples_per_s": 10.0},
            "tensors": {"parameters_bytes": 100}, "phases": []}
    base.update(extra)
    return base


JOBS = {
    "probe-ok": {"job_name": "probe-ok", "request_id": "r-ok", "region": REGION, "study": "s"},
    "probe-oom": {"job_name": "probe-oom", "request_id": "r-oom", "region": REGION, "study": "s"},
    "probe-fail": {"job_name": "probe-fail", "request_id": "r-fail", "region": REGION, "study": "s"},
    "probe-stop": {"job_name": "probe-stop", "request_id": "r-stop", "region": REGION, "study": "s"},
    "probe-noout": {"job_name": "probe-noout", "request_id": "r-noout", "region": REGION, "study": "s"},
    "probe-run": {"job_name": "probe-run", "request_id": "r-run", "region": REGION, "study": "s"},
}
OOM_REASON = ("AlgorithmError: ExecuteUserScriptError: torch.OutOfMemoryError: CUDA out of memory. Tried to "
              "allocate 2.00 GiB. GPU 0 has a total capacity of 22.19 GiB")


def queue_describes(stub, names=None) -> None:
    responses = {
        "probe-ok": describe_response("probe-ok", "Completed"),
        "probe-oom": describe_response("probe-oom", "Failed", failure=OOM_REASON, secondary="Failed"),
        "probe-fail": describe_response("probe-fail", "Failed", secondary="Failed",
                                        failure="ClientError: role arn:aws:iam::111122223333:role/X cannot read"),
        "probe-stop": describe_response("probe-stop", "Stopped", secondary="MaxRuntimeExceeded"),
        "probe-noout": describe_response("probe-noout", "Completed"),
        "probe-run": describe_response("probe-run", "InProgress", secondary="Training"),
    }
    for name in names or JOBS:
        stub.add_response("describe_training_job", responses[name], {"TrainingJobName": name})


@pytest.fixture
def s3_world(aws_env):  # noqa: F811
    with mock_aws():
        aws = FakeAws()
        aws.s3.create_bucket(Bucket=BUCKET)
        aws.s3.put_object(Bucket=BUCKET, Key="planner-probes/output/probe-ok/output/output.tar.gz",
                          Body=output_tar(probe_result()))
        store.save_request({"request_id": "r-oom", "model": {"name": "tiny"}, "config": {"batch_size": 64},
                            "instance": "ml.g5.xlarge", "estimate": {"fits": True, "gpu": "NVIDIA A10G"}})
        store.add_jobs(JOBS)
        yield aws


def test_collect_classifies_every_outcome(s3_world):
    aws = s3_world
    queue_describes(aws.stub)
    results = {c.job_name: c for c in collect_jobs(lambda region: aws, JOBS)}
    aws.stub.assert_no_pending_responses()
    assert results["probe-ok"].status == "ok" and results["probe-ok"].record["summary"]["peak_allocated"] == 1000
    assert results["probe-oom"].status == "oom"
    oom = results["probe-oom"].record
    assert oom["config"] == {"batch_size": 64} and oom["estimate"]["fits"] is True  # from the stored request
    # An OOM known only from FailureReason still counts against a "fits" prediction for that GPU.
    from planner.probes.validate import validate

    [row] = validate([oom], stored_only=True)
    assert row.fits_measured is False and row.fit_agrees is False
    assert results["probe-fail"].status == "failed"
    assert "111122223333" not in json.dumps(store.load_records())  # failure reason stored redacted
    assert results["probe-stop"].status == "stopped"
    assert results["probe-noout"].status == "missing-output"
    assert results["probe-run"].action == "running"

    store.rebuild_parquet()
    table = pd.read_parquet(store.parquet_path())
    assert sorted(table["record_id"]) == sorted(set(JOBS) - {"probe-run"})
    assert table.set_index("record_id").loc["probe-oom", "status"] == "oom"


def test_collect_is_idempotent(s3_world):
    aws = s3_world
    queue_describes(aws.stub)
    collect_jobs(lambda region: aws, JOBS)
    store.rebuild_parquet()
    first = pd.read_parquet(store.parquet_path())
    # Finished jobs are skipped (no AWS call at all); the running one is described again.
    queue_describes(aws.stub, ["probe-run"])
    again = collect_jobs(lambda region: aws, JOBS)
    aws.stub.assert_no_pending_responses()
    assert {c.action for c in again if c.job_name != "probe-run"} == {"skipped"}
    # --force downloads everything again and still adds no duplicate.
    queue_describes(aws.stub)
    collect_jobs(lambda region: aws, JOBS, force=True)
    store.rebuild_parquet()
    second = pd.read_parquet(store.parquet_path())
    assert len(second) == len(first) and second["record_id"].is_unique


def test_aws_error_midway_keeps_what_was_collected(s3_world, monkeypatch):
    from planner.aws import session
    from planner.cli.main import app

    aws = s3_world
    monkeypatch.setattr(session, "Aws", lambda region, profile=None: aws)
    aws.stub.add_response("describe_training_job", describe_response("probe-ok", "Completed"))
    aws.stub.add_client_error("describe_training_job", service_error_code="AccessDeniedException",
                              service_message="not allowed")
    res = runner.invoke(app, ["probe", "collect", "--job", "probe-ok", "--job", "probe-oom"])
    assert res.exit_code == 2, res.output
    assert "AccessDeniedException" in res.stderr and len(res.stderr.strip().splitlines()) == 1
    table = pd.read_parquet(store.parquet_path())
    assert list(table["record_id"]) == ["probe-ok"]  # collected before the error, and kept


def test_collect_raises_aws_error_on_throttling(s3_world):
    aws = s3_world
    aws.stub.add_client_error("describe_training_job", service_error_code="ThrottlingException",
                              service_message="Rate exceeded")
    with pytest.raises(AwsError, match="throttling"):
        collect_jobs(lambda region: aws, {"probe-ok": JOBS["probe-ok"]})


def test_status_command_lists_jobs(s3_world, monkeypatch):
    from planner.aws import session
    from planner.cli.main import app

    aws = s3_world
    monkeypatch.setattr(session, "Aws", lambda region, profile=None: aws)
    queue_describes(aws.stub, ["probe-oom", "probe-run"])
    res = runner.invoke(app, ["probe", "status", "--job", "probe-oom", "--job", "probe-run", "--json"])
    assert res.exit_code == 0, res.output
    rows = {r["job_name"]: r for r in json.loads(res.stdout)}
    assert rows["probe-oom"]["status"] == "Failed" and "CUDA out of memory" in rows["probe-oom"]["failure_reason"]
    assert rows["probe-run"]["status"] == "InProgress"


def test_oom_text_and_tar_reading():
    assert is_oom_text(OOM_REASON) and is_oom_text("RuntimeError: CUBLAS_STATUS_ALLOC_FAILED")
    assert not is_oom_text("ClientError: AccessDenied") and not is_oom_text(None)
    assert read_probe_from_tar(output_tar({"status": "oom"})) == {"status": "oom"}
    assert read_probe_from_tar(b"not a tarball") is None
