"""Prediction against real GPU readings, term by term: peak allocated, peak reserved, the whole device, and
step time, with what bounds each predicted step (the GPU's kernels or the host's dispatch).

Each reading is predicted for one GPU of the instance type carrying its GPU (`--parallelism single`: the
readings are one-GPU steps) with the reading's own software stack. Signed error = (predicted - measured) /
measured × 100: negative step-time errors mean the planner is too fast.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any

from planner.probes.readings import LAUNCH_BOUND_S, Reading

TERMS = ("peak_allocated", "peak_reserved", "device_peak", "step_time_s")


@dataclass(frozen=True)
class ReadingRow:
    reading: Reading
    predicted: dict[str, float]
    errors: dict[str, float | None]
    bound: str  # "gpu" or "host": which side the prediction says takes longer
    fitted: bool  # the row entered a fit (the shared folder's fit half)

    def to_json(self) -> dict[str, Any]:
        r = self.reading
        return {"folder": r.folder, "row": r.index, "label": r.label, "instance": r.instance, "gpu": r.gpu,
                "measured": {t: getattr(r, t) for t in TERMS}, "predicted": self.predicted,
                "errors_pct": self.errors, "bound": self.bound, "fitted": self.fitted}


def _pct(pred: float, meas: float) -> float | None:
    return (pred - meas) / meas * 100.0 if meas else None


def check(readings: list[Reading], fitted: set[tuple[str, int]] | None = None) -> list[ReadingRow]:
    """One row per reading, re-estimated with today's formulas."""
    from planner.estimate import estimate

    rows = []
    for r in readings:
        est = estimate(r.model, r.config, r.instance, stack=r.stack or None)
        m, thr = est.to_json()["memory_bytes"], est.throughput
        # the readings reset the peaks before each phase of the steps: a load peak (--load cast's fp32 build)
        # is not in them, so it is not in the prediction compared with them
        step_peak = max((p.allocated for p in est.phases if p.phase != "load"), default=m["peak_allocated"])
        predicted = {"peak_allocated": float(step_peak), "peak_reserved": float(m["peak_reserved"]),
                     "device_peak": float(m["peak_device"]), "step_time_s": float(thr.step_time_s)}
        bd = thr.breakdown_s
        bound = "host" if bd.get("host_dispatch_s", 0.0) > bd.get("compute_s", 0.0) else "gpu"
        rows.append(ReadingRow(r, predicted, {t: _pct(predicted[t], getattr(r, t)) for t in TERMS}, bound,
                               (r.folder, r.index) in (fitted or set())))
    return rows


def summary(rows: list[ReadingRow]) -> dict[str, dict[str, float | int | None]]:
    """Per term, and for step time per subset (fit / not fitted / launch-bound / TF32): n, median signed %,
    median |%|."""
    def stats(errs: list[float]) -> dict[str, float | int | None]:
        errs = [e for e in errs if e is not None and math.isfinite(e)]
        return {"n": len(errs), "median_signed_pct": statistics.median(errs) if errs else None,
                "median_abs_pct": statistics.median(abs(e) for e in errs) if errs else None}

    out = {t: stats([r.errors[t] for r in rows]) for t in TERMS}
    step = {
        "step_time_s, fit rows": [r for r in rows if r.fitted],
        "step_time_s, not fitted": [r for r in rows if not r.fitted],
        "step_time_s, < 80 ms": [r for r in rows if r.reading.step_time_s < LAUNCH_BOUND_S],
        "step_time_s, TF32": [r for r in rows if r.reading.config.tf32],
    }
    out.update({k: stats([r.errors["step_time_s"] for r in v]) for k, v in step.items()})
    return out
