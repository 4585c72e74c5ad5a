"""Predicted vs measured, per configuration and per memory term: how wrong is the planner, and where.

Terms and what is measured for each (jobs/probe.py):

=====================  =============================================================  ===================
term                   measured                                                       predicted
=====================  =============================================================  ===================
parameters             bytes of this rank's parameter tensors (shards under FSDP)     memory.parameters
gradients              bytes of .grad tensors after the first backward                memory.gradients
optimizer_states       bytes of optimizer.state tensors after the first step          optimizer_states
model_states           allocated right after the first optimizer step (+ the batch)   params+grads+opt+batch
activations            CUDA: allocated after forward - before (steady step);          memory.activations
                       CPU: bytes autograd saved (saved_tensors_hooks)
peak_allocated         torch.cuda.max_memory_allocated over the run                   peak_allocated
peak_reserved          torch.cuda.max_memory_reserved                                 peak_reserved
device_peak            max(total - free) from torch.cuda.mem_get_info                 peak_device
samples_per_s          global samples per optimizer step / median steady step time    throughput
=====================  =============================================================  ===================

A model-parallel record (tensor / pipeline parallelism: its `ranks` carry their place in the layout) is
measured at its worst rank, as the planner predicts it: each term is the maximum over ranks (the peaks from
`max_rank_peak_*`), since pipeline stages and their ranks differ.

Signed error = (predicted - measured) / measured x 100: positive means the planner over-estimates (safe
for OOM), negative under-estimates. Fit agreement compares `Estimate.fits` with whether the run OOMed,
only when the measured GPU is the one predicted for.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from planner.parallel import is_default

TERMS: tuple[str, ...] = ("parameters", "gradients", "optimizer_states", "model_states", "activations",
                          "peak_allocated", "peak_reserved", "device_peak", "samples_per_s")
ALLOCATOR_TERMS = ("model_states", "peak_allocated", "peak_reserved", "device_peak")


def signed_error_pct(predicted: float | None, measured: float | None) -> float | None:
    if predicted is None or measured is None or measured == 0:
        return None
    return (float(predicted) - float(measured)) / float(measured) * 100.0


def layout_ranks(record: dict[str, Any]) -> list[dict[str, Any]]:
    """The per-rank readings of a model-parallel record (empty for data parallelism and one process)."""
    ranks = record.get("ranks") or []
    return [r for r in ranks if isinstance(r, dict) and r.get("coordinates") is not None]


def _worst(ranks: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in ranks if isinstance(r.get(key), int | float)]
    return max(values) if values else None


def stage_peaks(record: dict[str, Any]) -> dict[int, dict[str, float | None]]:
    """Per pipeline rank (the `pp` coordinate): the largest peaks over its ranks, for comparing with a
    prediction per stage. Empty without a layout."""
    out: dict[int, dict[str, float | None]] = {}
    for r in layout_ranks(record):
        pp = int((r.get("coordinates") or {}).get("pp", 0))
        group = [x for x in layout_ranks(record) if int((x.get("coordinates") or {}).get("pp", 0)) == pp]
        out[pp] = {"peak_allocated": _worst(group, "peak_allocated"), "peak_reserved": _worst(group, "peak_reserved"),
                   "local_parameters_bytes": _worst(group, "local_parameters_bytes"),
                   "local_parameter_count": _worst(group, "local_parameter_count")}
    return dict(sorted(out.items()))


def stage_errors(record: dict[str, Any], estimate: dict[str, Any] | None) -> dict[int, dict[str, float | None]]:
    """Signed % per pipeline stage against the estimate's `parallel.stages` (issue 34: each stage as its
    worst rank holds it): the peak (CUDA only) and the parameter elements per rank, which the planner counts
    after tensor parallelism and before data-parallel sharding, so only where no data-parallel dimension
    shards them (dp_shard 1)."""
    stages = ((estimate or {}).get("parallel") or {}).get("stages") or []
    predicted = {int(s["stage"]): s for s in stages if isinstance(s, dict) and "stage" in s}
    cuda = record.get("device") == "cuda"
    sharded = int((record.get("layout") or {}).get("dp_shard") or 1) > 1
    out: dict[int, dict[str, float | None]] = {}
    for stage, m in stage_peaks(record).items():
        p = predicted.get(stage)
        if p is not None:
            out[stage] = {
                "peak_allocated": signed_error_pct(p.get("peak_allocated_bytes"), m["peak_allocated"]) if cuda else None,
                "parameters": None if sharded else signed_error_pct(p.get("parameters"), m["local_parameter_count"])}
    return out


def measured_terms(record: dict[str, Any]) -> dict[str, float | None]:
    s = record.get("summary") or {}
    t = record.get("tensors") or {}
    cuda = record.get("device") == "cuda"
    params = t.get("local_parameters_bytes", t.get("parameters_bytes"))
    ranks = layout_ranks(record)
    if ranks:  # the worst rank, as the planner predicts it
        t = {**t, "gradients_bytes": _worst(ranks, "gradients_bytes"),
             "optimizer_state_bytes": _worst(ranks, "optimizer_state_bytes")}
        params = _worst(ranks, "local_parameters_bytes")
        s = {**s, "peak_allocated": s.get("max_rank_peak_allocated", s.get("peak_allocated")),
             "peak_reserved": s.get("max_rank_peak_reserved", s.get("peak_reserved")),
             "device_peak": _worst(ranks, "device_peak") if cuda else None}
    return {
        "parameters": params,
        "gradients": t.get("gradients_bytes"),
        "optimizer_states": t.get("optimizer_state_bytes"),
        "model_states": s.get("model_states_after_first_step") if cuda else None,
        "activations": s.get("activations") if cuda else s.get("saved_tensor_bytes"),
        "peak_allocated": s.get("peak_allocated") if cuda else None,
        "peak_reserved": s.get("peak_reserved") if cuda else None,
        "device_peak": s.get("device_peak") if cuda else None,
        # a CPU run's speed says nothing about the GPU the throughput model predicts
        "samples_per_s": s.get("samples_per_s") if cuda and record.get("status") == "ok" else None,
    }


def predicted_terms(estimate: dict[str, Any] | None) -> dict[str, float | None]:
    if not estimate:
        return dict.fromkeys(TERMS)
    m = estimate.get("memory_bytes") or {}
    thr = estimate.get("throughput") or {}
    states = [m.get(k) for k in ("parameters", "gradients", "optimizer_states", "batch")]
    return {
        "parameters": m.get("parameters"), "gradients": m.get("gradients"),
        "optimizer_states": m.get("optimizer_states"),
        "model_states": sum(states) if all(v is not None for v in states) else None,
        "activations": m.get("activations"), "peak_allocated": m.get("peak_allocated"),
        "peak_reserved": m.get("peak_reserved"), "device_peak": m.get("peak_device"),
        "samples_per_s": thr.get("samples_per_s"),
    }


def gpu_family(name: str | None) -> str | None:
    """'Tesla V100-SXM2-16GB' -> 'V100', 'NVIDIA A10G' -> 'A10G' (longest known family name first)."""
    if not name:
        return None
    families: list[str] = []
    try:
        from planner.hardware import gpu_families

        families = list(gpu_families())
    except Exception:  # noqa: BLE001 - the hardware catalog is optional here
        pass
    families += ["GB200", "B200", "H200", "H100", "A100", "A10G", "L40S", "L4", "T4", "V100", "K80", "M60"]
    upper = name.upper()
    for fam in sorted(set(families), key=len, reverse=True):
        if fam.upper() in upper:
            return fam
    return None


@dataclass
class Row:
    record_id: str
    model: str | None
    instance: str | None
    gpu_measured: str | None
    gpu_predicted: str | None
    config: dict[str, Any]
    status: str
    device: str | None
    predicted: dict[str, float | None]
    measured: dict[str, float | None]
    errors: dict[str, float | None]
    fits_predicted: bool | None
    fits_measured: bool | None
    fit_agrees: bool | None
    prediction_source: str
    notes: list[str] = field(default_factory=list)
    stages: dict[int, dict[str, float | None]] = field(default_factory=dict)  # measured, per pipeline rank
    stage_errors: dict[int, dict[str, float | None]] = field(default_factory=dict)  # signed %, per stage

    def to_json(self) -> dict[str, Any]:
        return self.__dict__.copy()


def config_label(cfg: dict[str, Any]) -> str:
    parts = [f"b{cfg.get('batch_size')}", f"s{cfg.get('seq_len')}", str(cfg.get("precision", ""))]
    if cfg.get("checkpointing"):
        parts.append("ckpt")
    parts.append(str(cfg.get("attention", "")))
    if (cfg.get("grad_accum") or 1) > 1:
        parts.append(f"ga{cfg['grad_accum']}")
    if not is_default(cfg.get("parallelism")):
        parts.append(str(cfg["parallelism"]))
    if cfg.get("precision") == "fp8" and cfg.get("fp8_recipe"):
        parts[2] = f"fp8-{cfg['fp8_recipe']}"
    for key in ("tp", "cp", "pp", "vp", "ep"):  # a model-parallel layout: tp2 pp4 vp5; experts: ep8
        if (cfg.get(key) or 1) > 1:
            parts.append(f"{key}{cfg[key]}")
    if cfg.get("optimizer") not in (None, "adamw"):
        parts.append(str(cfg["optimizer"]))
    return " ".join(parts)


def compare(record: dict[str, Any], estimate: dict[str, Any] | None, source: str) -> Row:
    """One record against one estimate (an Estimate.to_json() dict)."""
    measured = measured_terms(record)
    predicted = predicted_terms(estimate)
    errors = {k: signed_error_pct(predicted[k], measured[k]) for k in TERMS}
    status = str(record.get("status"))
    fits_measured = {"ok": True, "oom": False}.get(status)
    fits_predicted = estimate.get("fits") if estimate else None
    gm, gp = record.get("gpu_name"), (estimate or {}).get("gpu")
    notes = []
    same_gpu = record.get("device") == "cuda" and gpu_family(gm) is not None and gpu_family(gm) == gpu_family(gp)
    if record.get("device") == "cuda" and gp and not same_gpu:
        notes.append(f"measured on {gm}, predicted for {gp}: fit not compared")
    agrees = (fits_predicted == fits_measured) if (same_gpu and fits_predicted is not None
                                                  and fits_measured is not None) else None
    if status == "oom":
        # Only the terms measured before the failing phase mean anything.
        for k in ("peak_allocated", "peak_reserved", "device_peak", "samples_per_s"):
            errors[k] = None
    return Row(record_id=str(record.get("record_id")), model=record.get("model"), instance=record.get("instance"),
               gpu_measured=gm, gpu_predicted=gp, config=record.get("config") or {}, status=status,
               device=record.get("device"), predicted=predicted, measured=measured, errors=errors,
               fits_predicted=fits_predicted, fits_measured=fits_measured, fit_agrees=agrees,
               prediction_source=source, notes=notes, stages=stage_peaks(record),
               stage_errors=stage_errors(record, estimate))


EstimateFn = Callable[[dict[str, Any]], dict[str, Any] | None]


def current_estimate(record: dict[str, Any]) -> dict[str, Any] | None:
    """planner.estimate(...) for the record's model spec, config and instance, with today's formulas."""
    from planner.estimate import estimate
    from planner.spec import ModelSpec, TrainConfig

    spec = record.get("model_spec")
    if not spec or not record.get("instance") or not record.get("config"):
        return None
    backend = "cpu" if record.get("device") == "cpu" else "cuda"
    config = TrainConfig.model_validate(record["config"])
    if isinstance(spec.get("user_code"), dict):  # the user's own module: traced from the shipped source
        import tempfile
        from pathlib import Path

        from planner.models.user_module import shipped_references

        refs = shipped_references(spec, Path(tempfile.gettempdir()) / "planner_user_code")
        est = estimate(refs.pop("model"), config, record["instance"], backend=backend, **refs)
        return est.to_json()
    est = estimate(ModelSpec.model_validate(spec), config, record["instance"], backend=backend)
    return est.to_json()


def validate(records: Iterable[dict[str, Any]], *, estimate_fn: EstimateFn | None = current_estimate,
             stored_only: bool = False) -> list[Row]:
    """A Row per record: re-estimated now (falls back to the prediction stored in the record)."""
    rows = []
    for rec in records:
        if rec.get("status") not in ("ok", "oom"):  # unsupported, error, failed, stopped: nothing measured
            continue
        est, source = None, "stored"
        if not stored_only and estimate_fn is not None:
            try:
                est, source = estimate_fn(rec), "current"
            except Exception as exc:  # noqa: BLE001 - fall back to the stored prediction, say so
                est, source = None, f"stored ({type(exc).__name__})"
        if est is None:
            est = rec.get("estimate")
            source = source if source.startswith("stored") else "stored"
        rows.append(compare(rec, est, source))
    return rows


def summary(rows: list[Row]) -> dict[str, dict[str, float | int | None]]:
    """Per term: n, median signed %, mean |%|, max |%|; and fit agreement."""
    out: dict[str, dict[str, float | int | None]] = {}
    for term in TERMS:
        errs = [r.errors[term] for r in rows if r.errors.get(term) is not None and math.isfinite(r.errors[term])]
        out[term] = {"n": len(errs),
                     "median_signed_pct": statistics.median(errs) if errs else None,
                     "mean_abs_pct": statistics.fmean(abs(e) for e in errs) if errs else None,
                     "max_abs_pct": max(abs(e) for e in errs) if errs else None}
    verdicts = [r.fit_agrees for r in rows if r.fit_agrees is not None]
    out["fit_agreement"] = {"n": len(verdicts), "agree": sum(verdicts),
                            "rate": (sum(verdicts) / len(verdicts)) if verdicts else None}
    return out


def long_rows(rows: list[Row]) -> list[dict[str, Any]]:
    """One CSV row per (record, term)."""
    out = []
    for r in rows:
        for term in TERMS:
            out.append({"record_id": r.record_id, "model": r.model, "instance": r.instance,
                        "gpu": r.gpu_measured, "config": config_label(r.config), "status": r.status, "term": term,
                        "predicted": r.predicted.get(term), "measured": r.measured.get(term),
                        "error_pct": r.errors.get(term), "fits_predicted": r.fits_predicted,
                        "fits_measured": r.fits_measured, "prediction": r.prediction_source})
    return out
