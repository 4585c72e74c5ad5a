"""Where probe results live: one JSON per measurement under results/probes/, merged into a Parquet table.

* `results/probes/<record_id>.json`: the probe's own result plus where it came from (local run or a
  SageMaker job, its status and failure reason). Local runs use `local-<request_id>`, jobs their name, so
  re-running or re-collecting the same thing overwrites one file: no duplicates, nothing else lost.
* `results/probes/requests/<request_id>.json`: the request sent (model spec, config, predictions).
* `results/probes/jobs.json`: launched SageMaker jobs (name -> request id, region, study, trial).
* `results/probes.parquet`: one row per record, rebuilt by upsert on `record_id`.

Every write is atomic (temp file + rename), and every record is redacted before it is written: account
ids (the 12 digits inside ARNs, ECR hosts, default bucket names) never reach results/.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

RECORD_SCHEMA = "planner.probe-record/1"
ACCOUNT_RE = re.compile(r"(?<!\d)\d{12}(?!\d)")
ARN_RE = re.compile(r"arn:aws[a-z-]*:[a-z0-9-]+:[a-z0-9-]*:\d{12}:[^\s\"',]+")
# Fields that must never be stored at all (whatever their value).
SECRET_KEYS = {"RoleArn", "role", "role_arn", "aws_access_key_id", "aws_secret_access_key", "aws_session_token",
               "AccessKeyId", "SecretAccessKey", "SessionToken", "credentials"}


# How write errors name the place: the probe commands have no --results-dir flag; the folder is
# $PLANNER_RESULTS_DIR (default results/ in the working directory).
RESULTS_WHAT = "results folder ($PLANNER_RESULTS_DIR, default results/)"


def results_dir() -> Path:
    return Path(os.environ.get("PLANNER_RESULTS_DIR", "results"))


def probes_dir(root: Path | None = None) -> Path:
    return (root or results_dir()) / "probes"


def parquet_path(root: Path | None = None) -> Path:
    return (root or results_dir()) / "probes.parquet"


# --------------------------------------------------------------------------------------- redaction


def redact_string(text: str) -> str:
    """An ARN keeps its service and resource but loses the account; lone account ids become ***."""

    def _arn(m: re.Match[str]) -> str:
        parts = m.group(0).split(":", 5)
        parts[4] = "*" * 12
        return ":".join(parts)

    text = ARN_RE.sub(_arn, text)
    if "amazonaws" in text or "s3://" in text or "arn:" in text or "sagemaker-" in text:
        text = ACCOUNT_RE.sub(lambda m: m.group(0) if m.group(0) in _public_accounts() else "*" * 12, text)
    return text


def _public_accounts() -> frozenset[str]:
    """AWS's own DLC registry accounts: public, and needed to read an image URI back."""
    from planner.dlc import DLC_ACCOUNTS

    return frozenset(DLC_ACCOUNTS.values())


def redact(obj: Any) -> Any:
    """A copy of `obj` with secret keys removed and account ids masked in every string."""
    if isinstance(obj, dict):
        return {k: redact(v) for k, v in obj.items() if k not in SECRET_KEYS}
    if isinstance(obj, list | tuple):
        return [redact(v) for v in obj]
    if isinstance(obj, str):
        return redact_string(obj)
    return obj


# ------------------------------------------------------------------------------------------- files


def write_json_atomic(path: Path, obj: Any) -> Path:
    from planner.io import write_text

    # Python's json (NaN allowed): a diverged loss stays NaN in the record, and reads back as null.
    return write_text(path, json.dumps(obj, indent=1, sort_keys=False, default=str), RESULTS_WHAT)


def record_id(record: dict[str, Any]) -> str:
    if record.get("record_id"):
        return str(record["record_id"])
    if record.get("job_name"):
        return str(record["job_name"])
    return f"local-{record.get('request_id') or 'unknown'}"


def save_record(record: dict[str, Any], root: Path | None = None) -> Path:
    """Write one redacted record as results/probes/<record_id>.json (overwrites the same id)."""
    rec = redact(dict(record))
    rec.setdefault("record_schema", RECORD_SCHEMA)
    rec["record_id"] = record_id(rec)
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", rec["record_id"])
    return write_json_atomic(probes_dir(root) / f"{safe}.json", rec)


def save_request(request_json: dict[str, Any], root: Path | None = None) -> Path:
    return write_json_atomic(probes_dir(root) / "requests" / f"{request_json['request_id']}.json",
                             redact(request_json))


def load_request(request_id: str, root: Path | None = None) -> dict[str, Any] | None:
    from planner.io import read_json

    path = probes_dir(root) / "requests" / f"{request_id}.json"
    return read_json(path, "probe request", nonfinite_as_none=True) if path.exists() else None


# Parts of a record and the type each must have when present (what validate/calibrate/flatten read).
RECORD_PARTS: dict[str, type] = {"summary": dict, "tensors": dict, "estimate": dict, "config": dict,
                                 "phases": list}


# The measured figures validate/calibrate compare with predictions (planner.probes.validate.measured_terms).
MEASURED_KEYS: dict[str, tuple[str, ...]] = {
    "summary": ("peak_allocated", "peak_reserved", "device_peak", "activations", "saved_tensor_bytes",
                "model_states_after_first_step", "samples_per_s"),
    "tensors": ("parameters_bytes", "local_parameters_bytes", "gradients_bytes", "optimizer_state_bytes"),
}


def check_record(data: Any, path: Path) -> dict[str, Any]:
    """A probe record's shape: an object whose parts have the right types and whose measured byte counts are
    finite numbers; anything else names the file and the field."""
    from planner.errors import PlannerError
    from planner.io import number

    if not isinstance(data, dict):
        raise PlannerError("probe record", str(path), "a JSON object")
    for key, kind in RECORD_PARTS.items():
        value = data.get(key)
        if value is not None and not isinstance(value, kind):
            raise PlannerError(f"{path}: {key}", value, f"a JSON {'object' if kind is dict else 'list'} or null")
    for part, keys in MEASURED_KEYS.items():
        for key in keys:
            value = (data.get(part) or {}).get(key)
            if value is not None:
                number(value, f"{path}: {part}.{key}")
    return data


def load_records(paths: Iterable[Path] | None = None, root: Path | None = None) -> list[dict[str, Any]]:
    """Records from results/probes/*.json, or from the given files/directories (e.g. results/validation/)."""
    targets = list(paths) if paths else [probes_dir(root)]
    files: list[Path] = []
    for t in targets:
        t = Path(t)
        if t.is_dir():
            files += sorted(p for p in t.rglob("*.json") if "requests" not in p.parts and p.name != "jobs.json")
        elif t.is_file():
            files.append(t)
    from planner.io import read_json

    out = []
    for f in files:
        # A truncated or corrupt record is an error naming it, not a record silently left out of a comparison.
        data = check_record(read_json(f, "probe record", expect=None, nonfinite_as_none=True), f)
        if isinstance(data, dict) and ("summary" in data or "job_status" in data or "status" in data):
            data.setdefault("record_id", record_id(data) if data.get("job_name") or data.get("request_id")
                            else f.stem)
            out.append(data)
    return out


# ---------------------------------------------------------------------------------------- jobs file


def jobs_path(root: Path | None = None) -> Path:
    return probes_dir(root) / "jobs.json"


def load_jobs(root: Path | None = None) -> dict[str, dict[str, Any]]:
    from planner.io import read_json

    path = jobs_path(root)
    return read_json(path, "probe jobs file") if path.exists() else {}


def add_jobs(entries: dict[str, dict[str, Any]], root: Path | None = None) -> None:
    jobs = load_jobs(root)
    jobs.update(redact(entries))
    write_json_atomic(jobs_path(root), jobs)


# ------------------------------------------------------------------------------------------ parquet

FLAT_CONFIG = ("batch_size", "seq_len", "precision", "optimizer", "optimizer_impl", "parallelism",
               "checkpointing", "attention", "grad_accum", "instances", "tp", "sp", "cp", "pp", "vp", "pp_schedule",
               "dp_replicas")
FLAT_SUMMARY = ("peak_allocated", "peak_reserved", "device_peak", "device_total", "activations",
                "activations_first_step", "model_states_after_first_step", "first_step_peak_allocated",
                "steady_peak_allocated", "cuda_context", "fragmentation", "saved_tensor_bytes",
                "model_state_bytes", "first_step_time_s", "step_time_s", "samples_per_s", "tokens_per_s",
                "peak_rss_bytes", "peak_phase", "global_batch_size", "max_rank_peak_allocated",
                "max_rank_peak_reserved", "first_loss", "last_loss")
FLAT_TENSORS = ("parameter_count", "parameters_bytes", "local_parameters_bytes", "gradients_bytes",
                "optimizer_state_bytes", "batch_bytes")
FLAT_PRED = ("parameters", "gradients", "optimizer_states", "activations", "peak_allocated", "peak_reserved",
             "cuda_context", "peak_device")


def flatten(record: dict[str, Any]) -> dict[str, Any]:
    """One Parquet row: identity, config, measured figures, and the prediction carried in the record."""
    cfg = record.get("config") or {}
    summary = record.get("summary") or {}
    tensors = record.get("tensors") or {}
    est = record.get("estimate") or {}
    mem = est.get("memory_bytes") or {}
    thr = est.get("throughput") or {}
    row: dict[str, Any] = {
        "record_id": record_id(record), "request_id": record.get("request_id"), "source": record.get("source"),
        "job_name": record.get("job_name"), "job_status": record.get("job_status"),
        "status": record.get("status"), "phase": record.get("phase"), "message": record.get("message"),
        "failure_reason": record.get("failure_reason"), "model": record.get("model"),
        "instance": record.get("instance"), "world_size": record.get("world_size"),
        "device": record.get("device"), "gpu_name": record.get("gpu_name"),
        "gpu_total_bytes": record.get("gpu_total_bytes"), "study": record.get("study"),
        "trial": record.get("trial"), "torch": (record.get("versions") or {}).get("torch"),
        "cuda": (record.get("versions") or {}).get("cuda"), "collected_at": record.get("collected_at"),
    }
    row.update({k: cfg.get(k) for k in FLAT_CONFIG})
    row.update({k: summary.get(k) for k in FLAT_SUMMARY})
    row.update({f"tensors_{k}": tensors.get(k) for k in FLAT_TENSORS})
    row.update({f"pred_{k}": mem.get(k) for k in FLAT_PRED})
    row["pred_samples_per_s"] = thr.get("samples_per_s")
    row["pred_fits"] = est.get("fits")
    return row


def update_parquet(records: Iterable[dict[str, Any]], root: Path | None = None) -> Path:
    """Upsert rows by record_id into results/probes.parquet (re-running adds no duplicates)."""
    import pandas as pd

    path = parquet_path(root)
    new = pd.DataFrame([flatten(r) for r in records])
    from planner.io import read_parquet

    old = read_parquet(path, "probes table") if path.is_file() else pd.DataFrame()
    if "record_id" in old and not new.empty:
        old = old[~old["record_id"].isin(new["record_id"])]
    frames = [f for f in (old, new) if not f.empty and "record_id" in f]
    if not frames:
        return path
    table = pd.concat(frames, ignore_index=True) if len(frames) > 1 else frames[0].reset_index(drop=True)
    if "checkpointing" in table:
        table["checkpointing"] = table["checkpointing"].astype("boolean")
    for col in table.columns:  # mixed object columns (None + str) must be one Arrow type
        if table[col].dtype == object:
            table[col] = table[col].map(lambda v: None if v is None else str(v) if not isinstance(v, str) else v)
    from planner.io import atomic_path

    with atomic_path(path, RESULTS_WHAT) as tmp:  # a failure leaves neither a half table nor a temporary file
        table.to_parquet(tmp, index=False)
    return path


def rebuild_parquet(root: Path | None = None) -> Path:
    """The table from every record file (what `collect` and `probe run` call after writing records)."""
    return update_parquet(load_records(root=root), root)
