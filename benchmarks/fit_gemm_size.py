"""Fit F_1/2 of the size law of Hopper's 16-bit GEMMs (planner.perf.roofline.ARCH_GEMM_SIZE) on the shared H200
readings, the asymptote held at its sourced value; report the readings' errors before (constant efficiency) and
after (size law).

What is fitted, and on what: F_1/2 and, jointly with it, Hopper's HBM efficiency (it was fitted together with the
constant GEMM efficiency this replaces), on the fit two thirds of
results/validation/h200/shared-2026-11-26/steps.jsonl (planner.probes.readings.fit_split), minimising the mean
|log(predicted / measured)| as benchmarks/fit_readings.py does; every other constant (CUDA-core and TF32 GEMMs,
the host's dispatch and overlap) stays as that script fitted it. The held-out third, the project's own H200/H100 readings (results/validation/*/measured-*) and the
launch-bound rows are reported, never fitted. The asymptote r_inf (0.80 of the dense peak on Hopper) is
Stas Bekman's MAMF figure (results/public/gemm/mamf.csv), not fitted.

Also prints the size law's efficiency for a few GEMM shapes (BERT-base, GPT-2, Llama-3-70B).

Superseded by benchmarks/fit_memory_passes.py, which fits F_1/2 and Hopper's HBM efficiency again together with
the rate of the passes over mixed dtypes (planner.perf.roofline.ARCH_DYNAMIC_CAST); this script is kept for the
record of the first fit (its "before" now starts from the current constants).

Usage: python benchmarks/fit_gemm_size.py   (a few minutes on 2 cores)
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's planner

import numpy as np  # noqa: E402
from fit_readings import errors, loss, report  # noqa: E402

from planner.perf.roofline import ARCH_GEMM_SIZE, HOPPER, gemm_size_efficiency  # noqa: E402
from planner.perf.throughput import ThroughputConstants  # noqa: E402
from planner.probes.readings import SHARED, fit_split, load_steps  # noqa: E402

R_INF = dict((r[0], r[1]) for r in ARCH_GEMM_SIZE)[HOPPER]
F_HALF_GRID = [f * 1e9 for f in (1, 2.5, 5, 10, 15, 20, 25, 30, 40, 50, 60, 80)]
SHAPES = {  # (tokens, n, k): the forward GEMMs of one micro-batch
    "BERT-base b32 s512 QKV (16384x768x768)": (16384, 768, 768),
    "BERT-base b32 s512 FFN up (16384x3072x768)": (16384, 3072, 768),
    "GPT-2 b8 s1024 FFN up (8192x3072x768)": (8192, 3072, 768),
    "Llama-3-70B TP8 s4096 FFN up (4096x3584x8192)": (4096, 3584, 8192),
    "Llama-3-70B s4096 FFN up (4096x28672x8192)": (4096, 28672, 8192),
}


BEFORE_HBM = 0.65  # Hopper's HBM efficiency as benchmarks/fit_readings.py fitted it with the constant GEMM efficiency
HBM_GRID = [round(0.50 + 0.05 * i, 3) for i in range(9)]  # 0.50 .. 0.90


def with_half(f_half: float, hbm: float | None = None) -> ThroughputConstants:
    c = ThroughputConstants(arch_gemm_size=((HOPPER, R_INF, f_half),))
    if hbm is None:
        return c
    (major, g, cc, _, tf32), = c.arch_efficiencies
    return c.model_copy(update={"arch_efficiencies": ((major, g, cc, hbm, tf32),)})


def main() -> int:
    before = with_half(0.0, BEFORE_HBM).model_copy(update={"arch_gemm_size": ()})
    report(before, f"before (constant Hopper GEMM efficiency 0.45, HBM {BEFORE_HBM}):")
    fit_rows, _ = fit_split(load_steps(SHARED))
    print(f"  mean |log error| on the fit rows, constant efficiency: {loss(errors(fit_rows, before)):.4f}")
    scores = [(loss(errors(fit_rows, with_half(f, h))), f, h) for f in F_HALF_GRID for h in HBM_GRID]
    s, best, hbm = min(scores)
    print(f"fitted F_1/2 = {best / 1e9:.1f} GFLOP, Hopper HBM efficiency {hbm} (r_inf {R_INF}, sourced): mean "
          f"|log error| on the fit rows {s:.4f}")
    report(with_half(best, hbm), f"after (size law, r_inf {R_INF}, F_1/2 {best / 1e9:.1f} GFLOP, HBM {hbm}):")
    for name, (m, n, k) in SHAPES.items():
        e = gemm_size_efficiency(np.array([2.0 * m * n * k]), R_INF, best)[0]
        print(f"  {name:<48} {2 * m * n * k / 1e9:8.1f} GFLOP  efficiency {e:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
