"""One SageMaker training job per probe request (boto3 `create_training_job`, no SDK needed).

The job runs `probe.py` in an AWS Deep Learning Container with the DLC's script-mode convention: the
`jobs/` files plus this job's `request.json` are packed as `sourcedir.tar.gz`, uploaded to S3, and named
by the `sagemaker_program` / `sagemaker_submit_directory` hyperparameters; the container installs
`requirements.txt` and runs `python probe.py --request request.json ...`. Hyperparameter values are
JSON-encoded strings (what the SDK sends, and what the training toolkit decodes). SageMaker passes every
non-`sagemaker_` hyperparameter to the program as `--key value`; the probe ignores all but `--request`, the
others name the configuration in the console.

Job names are `probe-<model>-<request hash>`: valid (`^[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}$`), unique per
candidate and stable, so launching the same candidate again finds the existing job and skips it.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import re
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from planner.aws.images import choose_image
from planner.aws.session import Aws, S3Location, aws_errors, error_code, no_such_job
from planner.errors import PlannerError
from planner.probes.spec import ProbeRequest

JOB_NAME_RE = re.compile(r"^[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}$")
JOBS_DIR = Path(__file__).resolve().parents[2] / "jobs"
SOURCE_FILES = ("probe.py", "modeling.py", "parallel_layout.py", "fp8_linears.py", "requirements.txt")
PROGRAM = "probe.py"
# Names of the probe's `probe_<name>=<value>;` lines (jobs/probe.py METRIC_NAMES; a test keeps them equal).
METRIC_NAMES: tuple[str, ...] = (
    "peak_allocated_bytes", "peak_reserved_bytes", "device_peak_bytes", "activation_bytes", "saved_tensor_bytes",
    "model_state_bytes", "first_step_time_s", "step_time_s", "samples_per_s", "tokens_per_s", "peak_rss_bytes",
    "oom",
)
DEFAULT_MAX_RUN_MINUTES = 30  # a probe is a few steps; most of the time is container start and pip install
# CreateTrainingJob limits: VolumeSizeInGB >= 1 (botocore sagemaker-2017-07-24 shape VolumeSizeInGB, min 1);
# MaxRuntimeInSeconds >= 1, at most 28 days (StoppingCondition docs: "The maximum value is 28 days"), the same
# bound for MaxWaitTimeInSeconds, which must be >= MaxRuntimeInSeconds. ASSUMPTION: the volume's upper bound is
# the gp2 EBS maximum, 16,384 GiB (SageMaker uses gp2 training volumes, ResourceConfig docs).
MIN_VOLUME_GB = 1
MAX_VOLUME_GB = 16_384
MAX_RUN_MINUTES = 28 * 24 * 60
DEFAULT_VOLUME_GB = 30  # EBS for the container's pip cache and outputs (ignored on instances with NVMe)
SPOT_WAIT_FACTOR = 2  # MaxWaitTimeInSeconds = factor x MaxRuntime: time allowed to wait for spot capacity
CHECKPOINT_LOCAL_PATH = "/opt/ml/checkpoints"  # SageMaker syncs it with CheckpointConfig.S3Uri (spot)
TAG_VALUE_RE = re.compile(r"[^\w .:/=+\-@]")
# SageMaker's torchrun launcher. The SDK's `PyTorch(distribution={"torch_distributed": {"enabled": True}})`
# becomes these two hyperparameters (aws/sagemaker-python-sdk src/sagemaker/pytorch/estimator.py @f733a35e,
# `_pytorch_distribution_configuration`: LAUNCH_TORCH_DISTRIBUTED_ENV_NAME and INSTANCE_TYPE_ENV_NAME); the
# training toolkit then runs `torchrun --nnodes <hosts> --nproc_per_node <GPUs> --master_addr <first host>
# --master_port 7777 --node_rank <i> probe.py ...` on every instance, with EFA set up on the instances that
# have it (aws/sagemaker-training-toolkit src/sagemaker_training/torch_distributed.py @1d080881,
# TorchDistributedRunner._create_command and _setup). The SDK allows it on GPU (ml.p*, ml.g*) and Trainium
# instances (src/sagemaker/fw_utils.py, validate_torch_distributed_distribution).
TORCH_DISTRIBUTED_HP = "sagemaker_torch_distributed_enabled"
INSTANCE_TYPE_HP = "sagemaker_instance_type"
# The layout, as hyperparameters for the console (the probe reads it from request.json): the names of
# TrainConfig's fields, which are the flags of issue 34 (--tp, --sp, --cp, --pp, --vp, --pp-schedule, ...).
LAYOUT_KEYS = ("tp", "sp", "cp", "pp", "vp", "pp_schedule", "dp_replicas", "distributed_optimizer", "recompute",
               "recompute_modules")
# FP8 and experts (issue 35), likewise for the console: the recipe the job runs (jobs/fp8_linears.py picks
# torchao or Transformer Engine by it), FSDP2's FP8 all-gather, and the expert layout (the job runs ep 1)
FP8_EXPERT_KEYS = ("fp8_recipe", "fp8_param_gather", "ep", "etp")


def metric_definitions() -> list[dict[str, str]]:
    """Regexes that scrape the probe's metric lines from the job log into CloudWatch."""
    return [{"Name": f"probe:{name}", "Regex": rf"probe_{name}=([-+0-9.eE]+);"} for name in METRIC_NAMES]


def job_name(request: ProbeRequest, prefix: str = "probe") -> str:
    """`probe-<model slug>-<16 hex of the request hash>`, at most 63 characters."""
    slug = re.sub(r"[^a-zA-Z0-9]+", "-", request.model_name).strip("-").lower() or "model"
    rid = request.request_id
    room = 63 - len(prefix) - len(rid) - 2
    slug = slug[:room].strip("-")
    name = "-".join(p for p in (prefix, slug, rid) if p)
    name = re.sub(r"-{2,}", "-", name)
    if not JOB_NAME_RE.match(name):
        raise PlannerError("job name", name, "^[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}$")
    return name


def _tag(key: str, value: Any) -> dict[str, str]:
    return {"Key": key, "Value": TAG_VALUE_RE.sub("_", str(value))[:256]}


def uses_torchrun(request: ProbeRequest) -> bool:
    """Whether the job runs under SageMaker's torchrun launcher: a model-parallel layout (tensor, context or
    pipeline parallelism, HSDP), or any multi-process probe over several instances. A data-parallel probe on
    one instance keeps starting torchrun itself (jobs/probe.py launch_distributed)."""
    cfg = request.config
    layout = any(int(cfg.get(k) or 1) > 1 for k in ("tp", "cp", "pp")) or cfg.get("parallelism") == "hsdp"
    return layout or (request.world_size > 1 and int(cfg.get("instances") or 1) > 1)


def hyperparameters(request: ProbeRequest, *, submit_uri: str, region: str, name: str,
                    instance_type: str | None = None) -> dict[str, str]:
    """JSON-encoded strings: SageMaker's own keys, then the configuration (for humans and the console)."""
    cfg = request.config
    hp: dict[str, Any] = {
        "sagemaker_program": PROGRAM,
        "sagemaker_submit_directory": submit_uri,
        "sagemaker_region": region,
        "sagemaker_job_name": name,
        "sagemaker_container_log_level": 20,
        "request": "request.json",
        "request_id": request.request_id,
        "model": request.model_name,
        "instance": request.instance,
        "world_size": request.world_size,
    }
    if uses_torchrun(request):
        hp[TORCH_DISTRIBUTED_HP] = True
        hp[INSTANCE_TYPE_HP] = instance_type or request.instance
    for key in ("batch_size", "seq_len", "precision", "optimizer", "optimizer_impl", "parallelism",
                "checkpointing", "attention", "grad_accum", "instances"):
        if key in cfg:
            hp[key] = cfg[key]
    for key in LAYOUT_KEYS + FP8_EXPERT_KEYS:  # only what departs from plain data parallelism
        value = cfg.get(key)
        if value not in (None, False, 1, (), []) and not (key == "recompute" and value == "none"):
            hp[key] = ",".join(value) if isinstance(value, list | tuple) else value
    if request.study:
        hp["study"] = request.study
    if request.trial is not None:
        hp["trial"] = request.trial
    return {k: json.dumps(v) for k, v in hp.items() if v is not None}


def pack_sourcedir(request: ProbeRequest, jobs_dir: Path = JOBS_DIR) -> bytes:
    """A reproducible sourcedir.tar.gz: the job files and request.json (sorted, zero mtimes)."""
    missing = [f for f in ("probe.py", "modeling.py") if not (jobs_dir / f).is_file()]
    if missing:
        raise PlannerError("jobs/", ", ".join(missing), f"the probe job files in {jobs_dir}")
    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb", mtime=0) as gz, tarfile.open(fileobj=gz, mode="w") as tar:
        files = {f: (jobs_dir / f).read_bytes() for f in SOURCE_FILES if (jobs_dir / f).is_file()}
        files["request.json"] = json.dumps(request.to_json(), indent=1, sort_keys=True).encode()
        for fname in sorted(files):
            info = tarfile.TarInfo(fname)
            info.size, info.mtime, info.mode = len(files[fname]), 0, 0o644
            tar.addfile(info, io.BytesIO(files[fname]))
    return buf.getvalue()


@dataclass
class LaunchOptions:
    role_arn: str
    s3: S3Location
    region: str
    instance_type: str | None = None  # default: the request's instance
    spot: bool = False
    max_run_minutes: int = DEFAULT_MAX_RUN_MINUTES
    max_wait_minutes: int | None = None
    volume_gb: int = DEFAULT_VOLUME_GB
    image_uri: str | None = None
    framework_version: str | None = None
    extra_tags: dict[str, str] = field(default_factory=dict)


def check_limits(opts: LaunchOptions) -> None:
    """What CreateTrainingJob would refuse, refused here first (naming the flag)."""
    from planner.io import number

    number(opts.max_run_minutes, "--max-run-minutes", low=1, high=MAX_RUN_MINUTES, integer=True)
    if opts.max_wait_minutes is not None:
        number(opts.max_wait_minutes, "--max-wait-minutes", low=opts.max_run_minutes, high=MAX_RUN_MINUTES,
               integer=True)
    number(opts.volume_gb, "--volume-gb", low=MIN_VOLUME_GB, high=MAX_VOLUME_GB, integer=True)


def create_request(request: ProbeRequest, opts: LaunchOptions, *, name: str | None = None,
                   source_sha: str | None = None) -> dict[str, Any]:
    """The CreateTrainingJob request (pure: no AWS call)."""
    name = name or job_name(request)
    instance_type = opts.instance_type or request.instance
    if not instance_type:
        raise PlannerError("--instance", None, "a SageMaker instance type, e.g. ml.g5.xlarge")
    if not instance_type.startswith("ml."):
        raise PlannerError("--instance", instance_type, "a SageMaker instance type starting with ml.")
    image = choose_image(instance_type, opts.region, framework_version=opts.framework_version,
                         image_uri=opts.image_uri)
    submit = opts.s3.child(name, "source", "sourcedir.tar.gz")
    check_limits(opts)
    max_run = int(opts.max_run_minutes * 60)
    stopping: dict[str, int] = {"MaxRuntimeInSeconds": max_run}
    req: dict[str, Any] = {
        "TrainingJobName": name,
        "AlgorithmSpecification": {"TrainingImage": image.uri, "TrainingInputMode": "File",
                                   "MetricDefinitions": metric_definitions()},
        "RoleArn": opts.role_arn,
        "HyperParameters": hyperparameters(request, submit_uri=submit, region=opts.region, name=name,
                                           instance_type=instance_type),
        "OutputDataConfig": {"S3OutputPath": opts.s3.child("output")},
        "ResourceConfig": {"InstanceType": instance_type, "InstanceCount": int(request.train_config.instances),
                           "VolumeSizeInGB": int(opts.volume_gb)},
        "StoppingCondition": stopping,
        "Tags": [_tag("planner:request-id", request.request_id), _tag("planner:model", request.model_name),
                 _tag("planner:study", request.study or "none"),
                 _tag("planner:trial", "none" if request.trial is None else request.trial),
                 _tag("planner:image", image.framework_version)]
                + [_tag(k, v) for k, v in opts.extra_tags.items()],
        "EnableManagedSpotTraining": bool(opts.spot),
    }
    if source_sha:
        req["Tags"].append(_tag("planner:source-sha256", source_sha[:32]))
    if opts.spot:
        wait_min = opts.max_wait_minutes or opts.max_run_minutes * SPOT_WAIT_FACTOR
        stopping["MaxWaitTimeInSeconds"] = max(int(wait_min * 60), max_run)
        req["CheckpointConfig"] = {"S3Uri": opts.s3.child(name, "checkpoints"), "LocalPath": CHECKPOINT_LOCAL_PATH}
    return req


@dataclass
class LaunchResult:
    job_name: str
    action: str  # "created", "exists", "dry-run"
    status: str | None
    request_id: str
    image: str
    request: dict[str, Any] | None = None


def existing_job(sm: Any, name: str) -> dict[str, Any] | None:
    """DescribeTrainingJob, or None when no job has that name (SageMaker answers ValidationException)."""
    try:
        return sm.describe_training_job(TrainingJobName=name)
    except Exception as exc:
        if no_such_job(sm, exc, name):
            return None
        raise


def launch(requests: list[ProbeRequest], opts: LaunchOptions, *, aws: Aws | None = None, dry_run: bool = False,
           jobs_dir: Path = JOBS_DIR, on_result: Any = None) -> list[LaunchResult]:
    """Create one job per request; a request whose job exists is skipped (idempotent)."""
    results: list[LaunchResult] = []
    for request in requests:
        name = job_name(request)
        source = pack_sourcedir(request, jobs_dir)
        sha = hashlib.sha256(source).hexdigest()
        req = create_request(request, opts, name=name, source_sha=sha)
        image = req["AlgorithmSpecification"]["TrainingImage"]
        if dry_run:
            res = LaunchResult(name, "dry-run", None, request.request_id, image, req)
        else:
            assert aws is not None
            sm, s3 = aws.sagemaker, aws.s3
            with aws_errors("DescribeTrainingJob"):
                found = existing_job(sm, name)
            if found is not None:
                res = LaunchResult(name, "exists", found.get("TrainingJobStatus"), request.request_id, image)
            else:
                key = opts.s3.key(name, "source", "sourcedir.tar.gz")
                with aws_errors("S3 PutObject"):
                    s3.put_object(Bucket=opts.s3.bucket, Key=key, Body=source, ContentType="application/gzip")
                with aws_errors("CreateTrainingJob"):
                    try:
                        sm.create_training_job(**req)
                        res = LaunchResult(name, "created", "InProgress", request.request_id, image)
                    except Exception as exc:
                        if error_code(exc) == "ResourceInUse":  # raced with another launch of the same job
                            res = LaunchResult(name, "exists", None, request.request_id, image)
                        else:
                            raise
        results.append(res)
        if on_result is not None:
            on_result(res, request)
    return results


def jobs_entry(res: LaunchResult, request: ProbeRequest, region: str) -> dict[str, Any]:
    """What results/probes/jobs.json keeps about a launched job (no role, no bucket)."""
    return {"job_name": res.job_name, "request_id": request.request_id, "region": region,
            "model": request.model_name, "instance": request.instance, "study": request.study,
            "trial": request.trial, "image": res.image,
            "launched_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
