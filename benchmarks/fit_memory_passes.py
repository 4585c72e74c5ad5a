"""Fit Hopper's memory-bound passes, with the constants they trade against, on the shared H200 readings:
the streaming (vectorized) HBM efficiency, the per-SM rate of the passes over mixed dtypes, the GEMM size
law's F_1/2, the host's dispatch cost and overlap, and TF32's GEMM efficiency; report fit, held-out and public
errors before and after.

Why a rate per SM for the mixed passes: ATen's CUDA elementwise loop casts each element as it loads it when
the operands' floating dtypes differ (bf16 and fp32 under autocast: CUDALoops.cuh gpu_kernel_impl, the
`needs_dynamic_casting` branch, launch_unrolled_kernel with LoadWithCast/StoreWithCast: no vector loads), so
few bytes are in flight per thread and the pass is bound by the SMs (their count and clock), not the HBM's
datasheet bandwidth; a GPT-2 AMP step is only ~15 % slower on an H100 (3.35 TB/s) than on an H200 (4.8 TB/s)
when over 40 % of its memory-bound time is such passes (results/validation/*/measured-2026-11-26, held out:
read, never fitted).

What is fitted, and on what: on the fit two thirds of results/validation/h200/shared-2026-11-26/steps.jsonl
(planner.probes.readings.fit_split), minimising the mean |log(predicted / measured)| as
benchmarks/fit_readings.py does, alternating a grid over (HBM efficiency, bytes per SM-cycle of the mixed
passes, F_1/2) with one over (cpu_dispatch_s, host_overlap_power); TF32's efficiency on the one TF32 row of the
same folder's launch.jsonl (GPU-bound), as fit_readings.fit_tf32 does. The asymptote of the size law (r_inf,
sourced), the CUDA-core and the constant 16-bit GEMM efficiencies stay as they are. Reported, never fitted:
the held-out third, the project's own H200 and H100 readings.

Usage: python benchmarks/fit_memory_passes.py   (a few minutes on 2 cores)
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's planner

from fit_readings import errors, fit_tf32, loss, report  # noqa: E402

from planner.perf.roofline import HOPPER  # noqa: E402
from planner.perf.throughput import ThroughputConstants  # noqa: E402
from planner.probes.readings import SHARED, fit_split, load_steps  # noqa: E402

HBM_GRID = [round(0.45 + 0.025 * i, 3) for i in range(19)]  # 0.45 .. 0.90 of the datasheet bandwidth
BETA_GRID = [0.0, 3.0, 3.5, 4.0, 4.5, 5.0, 5.5, 6.0, 7.0, 8.0]  # bytes per SM per clock (0: no separate rate)
F_HALF_GRID = [f * 1e9 for f in (5, 10, 15, 20, 30)]
DISPATCH_GRID = [round(14e-6 + 2e-6 * i, 7) for i in range(10)]  # 14 .. 32 us
POWER_GRID = [1.5, 2.0, 2.5, 3.0, 4.0]
TIE = 0.0005  # mean |log error| differences below this are not told apart by 26 rows


def constants(base: ThroughputConstants, hbm: float, beta: float, f_half: float, tf32: float | None = None,
              dispatch: float | None = None, power: float | None = None) -> ThroughputConstants:
    (major, g, cc, _, t), = base.arch_efficiencies
    (_, r_inf, _), = base.arch_gemm_size
    return base.model_copy(update={
        "arch_efficiencies": ((major, g, cc, hbm, t if tf32 is None else tf32),),
        "arch_gemm_size": ((HOPPER, r_inf, f_half),),
        "arch_dynamic_cast": ((HOPPER, beta),) if beta else (),
        "cpu_dispatch_s": base.cpu_dispatch_s if dispatch is None else dispatch,
        "host_overlap_power": base.host_overlap_power if power is None else power})


def fit(rows: list, base: ThroughputConstants) -> ThroughputConstants:
    c = base
    for _ in range(2):  # alternate: the GPU's memory passes and GEMM fixed cost, then the host's two constants
        scores = [(loss(errors(rows, constants(c, h, b, f))), h, b, f)
                  for h, b, f in itertools.product(HBM_GRID, BETA_GRID, F_HALF_GRID)]
        best, h, b, _ = min(scores)
        # the readings' GEMMs (5-80 GFLOP) barely separate F_1/2 below ~10 GFLOP: of the values within
        # TIE of the best loss at the fitted HBM and rate, the largest (the slower small GEMM: the cautious
        # choice a capacity plan wants)
        f = max(f for s, hh, bb, f in scores if hh == h and bb == b and s <= best + TIE)
        c = constants(c, h, b, f)
        _, d, p = min((loss(errors(rows, constants(c, h, b, f, dispatch=d, power=p))), d, p)
                      for d, p in itertools.product(DISPATCH_GRID, POWER_GRID))
        c = constants(c, h, b, f, dispatch=d, power=p)
    (_, g, cc, h, _), = c.arch_efficiencies
    t = fit_tf32(g, cc, h, c.cpu_dispatch_s, c.host_overlap_power)
    (_, _, f), = c.arch_gemm_size
    return constants(c, h, beta_of(c), f, tf32=t)


def beta_of(c: ThroughputConstants) -> float:
    return dict(c.arch_dynamic_cast).get(HOPPER, 0.0)


def describe(c: ThroughputConstants) -> str:
    (_, _, _, h, t), = c.arch_efficiencies
    (_, _, f), = c.arch_gemm_size
    b = beta_of(c)
    return (f"HBM {h}, mixed passes {b} B per SM-cycle ({b * 132 * 1.98e9 / 1e12:.2f} TB/s on 132 SMs at "
            f"1,980 MHz), F_1/2 {f / 1e9:.0f} GFLOP, TF32 {t}, dispatch {c.cpu_dispatch_s * 1e6:.0f} us, "
            f"overlap power {c.host_overlap_power}")


def main() -> int:
    # the constants before this fit (benchmarks/fit_readings.py and fit_gemm_size.py): HBM 0.50, F_1/2 15 GFLOP,
    # no separate rate for the mixed passes
    before = constants(ThroughputConstants(), 0.50, 0.0, 15e9)
    report(before, f"before ({describe(before)}):")
    fit_rows, _ = fit_split(load_steps(SHARED))
    print(f"  mean |log error| on the fit rows: {loss(errors(fit_rows, before)):.4f}")
    after = fit(fit_rows, before)
    print(f"fitted on {len(fit_rows)} shared rows: {describe(after)}; mean |log error| "
          f"{loss(errors(fit_rows, after)):.4f}")
    (_, _, _, h, _), = after.arch_efficiencies
    profile = ", ".join(f"{f / 1e9:g}: {loss(errors(fit_rows, constants(after, h, beta_of(after), f))):.4f}"
                        for f in F_HALF_GRID)
    print(f"  mean |log error| by F_1/2 (GFLOP) at the fitted rest: {profile}")
    report(after, "after:")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
