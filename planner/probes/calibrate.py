"""Fit the runtime constants per GPU family from probe readings (robust: medians).

From each successful CUDA probe run:

* CUDA context   = device used - reserved, read at the same instant (mem_get_info vs memory_reserved):
                   what lives outside the caching allocator (driver, runtime, kernels, NCCL for world>1,
                   so only single-process runs are used for it);
* fragmentation  = peak reserved / peak allocated - 1;
* throughput scale = measured samples/s / predicted samples/s (multiplies the throughput model);
* band widths      = the [min, max] of the context and of the fragmentation over the family's runs
                     (`context_range`, `fragmentation_range`): they replace the wide default bands of
                     `planner.memory.band` for that family, and `module_loading` ("lazy" / "eager", from the
                     runs' torch and CUDA versions) says which stacks they apply to.

The median per family resists the odd run (another process on the GPU, a cold first step). Written to
`results/calibration.json` in the format `planner.memory.runtime.load_calibration` reads
(`{"families": {fam: {field: value}}, "date", "source"}`; extra keys such as `throughput_scale` and `n`
are ignored by the runtime loader).

Errors "before" use the predictions as they are; "after" applies the calibrated constants through their
definitions (reserved = allocated x (1 + fragmentation); device = reserved + context + NCCL; samples/s x
scale), in-sample and leave-one-out (each run predicted with constants fitted on the other runs), so a
constant fitted to one case cannot pass for accuracy.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from planner.parallel import known
from planner.probes.validate import gpu_family, signed_error_pct

CALIBRATION_SCHEMA = "planner.calibration/1"
MIN_RUNS = 1  # a family with fewer successful runs is not calibrated


@dataclass
class Sample:
    record_id: str
    family: str
    context: float | None  # measured device used - reserved (single process only)
    fragmentation: float | None
    scale: float | None  # measured / predicted samples/s
    measured: dict[str, float | None]
    predicted: dict[str, float | None]  # peak_allocated, peak_reserved, device_peak, samples_per_s, nccl
    lazy: bool | None = None  # CUDA lazy module loading in the run's stack (None: versions not recorded)


def _lazy(versions: dict[str, Any]) -> bool | None:
    """Lazy module loading from the run's torch and CUDA versions (planner.memory.stack.lazy_loading)."""
    from planner.errors import PlannerError
    from planner.memory.stack import lazy_loading
    from planner.spec import SoftwareStack

    try:
        return lazy_loading(SoftwareStack(torch=str(versions["torch"]), cuda=str(versions["cuda"]),
                                          transformers="0.0"))
    except (KeyError, PlannerError, ValueError):
        return None


def sample_of(record: dict[str, Any], estimate: dict[str, Any] | None) -> Sample | None:
    if record.get("device") != "cuda" or record.get("status") != "ok":
        return None
    fam = gpu_family(record.get("gpu_name"))
    if fam is None:
        return None
    s = record.get("summary") or {}
    strategy = known((record.get("config") or {}).get("parallelism"))  # None: "auto" or not recorded
    single = (record.get("world_size") or 1) == 1 and not (strategy and strategy.one_process)
    context = s.get("cuda_context") if single else None
    frag = None
    if s.get("peak_reserved") and s.get("peak_allocated"):
        frag = s["peak_reserved"] / s["peak_allocated"] - 1
    mem = (estimate or {}).get("memory_bytes") or {}
    thr = (estimate or {}).get("throughput") or {}
    pred_sps = thr.get("samples_per_s")
    scale = (s["samples_per_s"] / pred_sps) if (s.get("samples_per_s") and pred_sps) else None
    return Sample(
        record_id=str(record.get("record_id")), family=fam, context=context, fragmentation=frag, scale=scale,
        measured={"peak_reserved": s.get("peak_reserved"), "device_peak": s.get("device_peak"),
                  "samples_per_s": s.get("samples_per_s")},
        predicted={"peak_allocated": mem.get("peak_allocated"), "peak_reserved": mem.get("peak_reserved"),
                   "device_peak": mem.get("peak_device"), "cuda_context": mem.get("cuda_context"),
                   "nccl": mem.get("nccl") or 0, "samples_per_s": pred_sps},
        lazy=_lazy(record.get("versions") or {}),
    )


def _median(values: Iterable[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def _range(values: Iterable[float | None]) -> list[float] | None:
    vals = [v for v in values if v is not None]
    return [min(vals), max(vals)] if vals else None


def fit(samples: list[Sample]) -> dict[str, Any]:
    """Medians of one family's samples, and the [min, max] ranges the verdict band uses."""
    ctx = _median(s.context for s in samples)
    modes = {s.lazy for s in samples if s.lazy is not None}
    return {"cuda_context_bytes": int(ctx) if ctx is not None else None,
            "context_range": _range(s.context for s in samples),
            "fragmentation_range": _range(s.fragmentation for s in samples),
            "module_loading": ({True: "lazy", False: "eager"}[modes.pop()] if len(modes) == 1 else None),
            "fragmentation": _median(s.fragmentation for s in samples),
            "throughput_scale": _median(s.scale for s in samples),
            "n": len(samples), "n_context": sum(s.context is not None for s in samples),
            "n_throughput": sum(s.scale is not None for s in samples)}


def adjusted(sample: Sample, constants: dict[str, Any]) -> dict[str, float | None]:
    """The sample's predictions with calibrated constants applied through their definitions."""
    p = sample.predicted
    frag = constants.get("fragmentation")
    ctx = constants.get("cuda_context_bytes")
    reserved = p["peak_reserved"]
    if frag is not None and p["peak_allocated"] is not None:
        reserved = p["peak_allocated"] * (1 + frag)
    device = p["device_peak"]
    if reserved is not None and (ctx is not None or p["cuda_context"] is not None):
        device = reserved + (ctx if ctx is not None else p["cuda_context"]) + (p["nccl"] or 0)
    sps = p["samples_per_s"]
    if sps is not None and constants.get("throughput_scale") is not None:
        sps = sps * constants["throughput_scale"]
    return {"peak_reserved": reserved, "device_peak": device, "samples_per_s": sps}


ERROR_TERMS = ("peak_reserved", "device_peak", "samples_per_s")


def _errors(samples: list[Sample], preds: list[dict[str, float | None]]) -> dict[str, float | None]:
    """Median |signed %| per term over the samples."""
    out: dict[str, float | None] = {}
    for term in ERROR_TERMS:
        errs = [signed_error_pct(p[term], s.measured[term]) for s, p in zip(samples, preds, strict=True)]
        errs = [abs(e) for e in errs if e is not None]
        out[term] = statistics.median(errs) if errs else None
    return out


def calibrate(records: Iterable[dict[str, Any]], estimates: dict[str, dict[str, Any] | None]) -> dict[str, Any]:
    """Constants per family plus the error table (before / after in-sample / after leave-one-out)."""
    by_family: dict[str, list[Sample]] = defaultdict(list)
    for rec in records:
        smp = sample_of(rec, estimates.get(str(rec.get("record_id"))))
        if smp is not None:
            by_family[smp.family].append(smp)
    families: dict[str, Any] = {}
    report: dict[str, Any] = {}
    for fam, samples in sorted(by_family.items()):
        if len(samples) < MIN_RUNS:
            continue
        constants = fit(samples)
        families[fam] = {k: v for k, v in constants.items() if v is not None}
        before = _errors(samples, [s.predicted for s in samples])
        after_in = _errors(samples, [adjusted(s, constants) for s in samples])
        after_loo: dict[str, float | None] = dict.fromkeys(ERROR_TERMS)
        if len(samples) >= 2:
            loo_preds = [adjusted(s, fit([o for o in samples if o is not s])) for s in samples]
            after_loo = _errors(samples, loo_preds)
        report[fam] = {"n": len(samples), "before": before, "after": after_in, "after_leave_one_out": after_loo,
                       "constants": constants}
    return {"families": families, "report": report}


def calibration_document(result: dict[str, Any], records_used: int) -> dict[str, Any]:
    when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    fams = {}
    for fam, c in result["families"].items():
        entry = dict(c)
        entry["source"] = f"median over {c.get('n')} probe runs (planner calibrate, {when})"
        fams[fam] = entry
    return {"schema": CALIBRATION_SCHEMA, "date": when, "records": records_used,
            "source": f"planner calibrate: medians of {records_used} probe records", "families": fams}


def merge_into(path: Path, doc: dict[str, Any]) -> dict[str, Any]:
    """Families calibrated now replace their entries; other families already in the file stay."""
    from planner.memory.runtime import load_calibration

    old = load_calibration(path)  # a corrupt file is an error naming it, not silently overwritten
    fams = dict(old.get("families") or {})
    fams.update(doc["families"])
    out = dict(doc)
    out["families"] = fams
    return out
