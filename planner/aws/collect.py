"""Status and results of launched probe jobs: DescribeTrainingJob, then the probe's JSON from S3.

A finished job's outcome comes from the probe's own result when it wrote one (`ok`, `oom`, `unsupported`,
`error`), else from SageMaker: a Failed job whose FailureReason mentions CUDA out-of-memory is `oom`, other
failures `failed` (with the reason), a Stopped job `stopped` (e.g. MaxRuntimeExceeded), a Completed job
without output `missing-output`. Each collected job becomes one record file (named after the job), so
collecting again overwrites instead of duplicating; records written before an AWS error are kept.
"""

from __future__ import annotations

import io
import json
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from planner.aws.session import Aws, aws_errors, error_code, no_such_job, parse_s3_uri
from planner.probes import store

TERMINAL = ("Completed", "Failed", "Stopped")
# Text of a CUDA OOM as PyTorch, cuBLAS and the SageMaker toolkit report it in FailureReason.
OOM_PATTERNS = ("cuda out of memory", "outofmemoryerror", "out of memory", "cublas_status_alloc_failed")
OUTPUT_NAMES = ("probe.json",)


@dataclass
class JobInfo:
    name: str
    status: str
    secondary_status: str | None
    failure_reason: str | None
    output_path: str | None
    instance_type: str | None
    instance_count: int | None
    training_seconds: int | None
    billable_seconds: int | None
    start: str | None
    end: str | None

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL


def _iso(value: Any) -> str | None:
    return value.isoformat() if hasattr(value, "isoformat") else (str(value) if value else None)


def job_info(desc: dict[str, Any]) -> JobInfo:
    res = desc.get("ResourceConfig") or {}
    return JobInfo(
        name=desc["TrainingJobName"], status=desc.get("TrainingJobStatus", "Unknown"),
        secondary_status=desc.get("SecondaryStatus"), failure_reason=desc.get("FailureReason"),
        output_path=(desc.get("OutputDataConfig") or {}).get("S3OutputPath"),
        instance_type=res.get("InstanceType"), instance_count=res.get("InstanceCount"),
        training_seconds=desc.get("TrainingTimeInSeconds"), billable_seconds=desc.get("BillableTimeInSeconds"),
        start=_iso(desc.get("TrainingStartTime")), end=_iso(desc.get("TrainingEndTime")),
    )


def describe(aws: Aws, name: str) -> JobInfo | None:
    """None when SageMaker has no job of that name."""
    with aws_errors("DescribeTrainingJob"):
        try:
            desc = aws.sagemaker.describe_training_job(TrainingJobName=name)
        except Exception as exc:
            if no_such_job(aws.sagemaker, exc, name):
                return None
            raise
    return job_info(desc)


def is_oom_text(text: str | None) -> bool:
    return bool(text) and any(p in text.lower() for p in OOM_PATTERNS)


def read_probe_from_tar(data: bytes) -> dict[str, Any] | None:
    """probe.json from output.tar.gz (anywhere in the archive)."""
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:*") as tar:
            for member in tar.getmembers():
                if member.isfile() and Path(member.name).name in OUTPUT_NAMES:
                    fh = tar.extractfile(member)
                    if fh is not None:
                        return json.loads(fh.read().decode())
    except (tarfile.TarError, ValueError, RecursionError, EOFError, OSError):  # ValueError: bad JSON/UTF-8
        return None
    return None


def fetch_output(aws: Aws, info: JobInfo) -> dict[str, Any] | None:
    """The probe result of a job: <S3OutputPath>/<job>/output/output.tar.gz; None when there is none."""
    if not info.output_path:
        return None
    loc = parse_s3_uri(info.output_path, field="S3OutputPath")
    key = loc.key(info.name, "output", "output.tar.gz")
    with aws_errors("S3 GetObject"):
        try:
            body = aws.s3.get_object(Bucket=loc.bucket, Key=key)["Body"].read()
        except Exception as exc:
            if error_code(exc) in ("NoSuchKey", "404", "NotFound"):
                return None
            raise
    return read_probe_from_tar(body)


def classify(info: JobInfo, probe: dict[str, Any] | None) -> str:
    if probe and probe.get("status"):
        return str(probe["status"])
    if info.status == "Failed":
        return "oom" if is_oom_text(info.failure_reason) else "failed"
    if info.status == "Stopped":
        return "stopped"
    if info.status == "Completed":
        return "missing-output"
    return info.status.lower()


def make_record(info: JobInfo, probe: dict[str, Any] | None, entry: dict[str, Any] | None,
                request: dict[str, Any] | None) -> dict[str, Any]:
    """The probe's result (or the request's identity when there is none) plus what SageMaker said."""
    rec: dict[str, Any] = dict(probe or {})
    if not probe:
        req = request or {}
        rec.update({"request_id": (entry or {}).get("request_id") or req.get("request_id"),
                    "model": (req.get("model") or {}).get("name") or (entry or {}).get("model"),
                    "config": req.get("config"), "instance": req.get("instance") or (entry or {}).get("instance"),
                    "world_size": req.get("world_size"), "estimate": req.get("estimate"),
                    "model_spec": req.get("model"), "study": req.get("study"), "trial": req.get("trial"),
                    "summary": {}, "phases": [], "device": "cuda", "gpu_name": _instance_gpu(info.instance_type)})
    status = classify(info, probe)
    rec.update({
        "source": "sagemaker", "job_name": info.name, "record_id": info.name, "status": status,
        "job_status": info.status, "secondary_status": info.secondary_status,
        "failure_reason": info.failure_reason, "instance_type": info.instance_type,
        "instance_count": info.instance_count, "training_seconds": info.training_seconds,
        "billable_seconds": info.billable_seconds, "job_start": info.start, "job_end": info.end,
        "region": (entry or {}).get("region"), "has_output": probe is not None,
        "collected_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    })
    if status == "oom" and not rec.get("phase"):
        rec["phase"] = "unknown"
    if not probe and status in ("failed", "oom"):
        rec["message"] = info.failure_reason
    return rec


def _instance_gpu(instance_type: str | None) -> str | None:
    """The GPU a job ran on, from the hardware catalog (no probe output to say it)."""
    if not instance_type:
        return None
    try:
        from planner.hardware import get_instance

        return get_instance(instance_type).gpu.name
    except Exception:  # noqa: BLE001 - unknown instance: leave it unknown
        return None


@dataclass
class Collected:
    job_name: str
    status: str  # record status, or the job's status while it runs
    job_status: str
    action: str  # "collected", "skipped" (already collected), "running", "not-found"
    record: dict[str, Any] | None = None


def collect_jobs(aws_for_region: Any, jobs: dict[str, dict[str, Any]], *, root: Path | None = None,
                 force: bool = False) -> list[Collected]:
    """Collect every finished job; each record is saved as soon as it is read."""
    out: list[Collected] = []
    existing = {r.get("record_id"): r for r in store.load_records(root=root)}
    for name, entry in jobs.items():
        prev = existing.get(name)
        if prev and prev.get("job_status") in TERMINAL and not force:
            out.append(Collected(name, str(prev.get("status")), str(prev.get("job_status")), "skipped", prev))
            continue
        aws = aws_for_region(entry.get("region"))
        info = describe(aws, name)
        if info is None:
            out.append(Collected(name, "not-found", "NotFound", "not-found"))
            continue
        if not info.terminal:
            out.append(Collected(name, info.status.lower(), info.status, "running"))
            continue
        probe = fetch_output(aws, info)
        request = store.load_request(entry["request_id"], root) if entry.get("request_id") else None
        record = make_record(info, probe, entry, request)
        store.save_record(record, root)
        out.append(Collected(name, record["status"], info.status, "collected", record))
    return out
