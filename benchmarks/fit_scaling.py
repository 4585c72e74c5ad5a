"""Fit how far the slowest of n GPUs holds back a synchronous step, on public runs; check it on those held out.

`rank_speed_spread` (planner/perf/throughput.py) is the spread of per-GPU speed: n GPUs in one data-parallel
step wait spread x E[max of n standard normals] of the compute time for the slowest. It is identifiable only
from scaling: a source's multi-GPU run divided by the same run on one GPU of the same machine
(`planner.probes.public.scaling_pairs`), which cancels the one-GPU speed error. This script grid-searches it
on the pairs of the FIT sources (the roofline's: dle-bert-1907, dle-bert-2006), minimising the median
|log(predicted scaling / published scaling)|, and prints the same figure on the other sources' pairs, which
never enter the fit.

Usage: python benchmarks/fit_scaling.py [--fit dle-bert-1907,dle-bert-2006]   (a few seconds)
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fit_roofline import score  # noqa: E402  (the roofline fit's score)

from planner.perf.throughput import ThroughputConstants  # noqa: E402
from planner.probes.public import (  # noqa: E402
    SPEED_FIT_SOURCES,
    load_public_throughput,
    scaling_errors,
    scaling_pairs,
)

GRID = [round(0.005 * i, 3) for i in range(41)]  # 0 .. 0.20


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fit", default=",".join(SPEED_FIT_SOURCES), help="comma-separated source ids to fit on")
    args = ap.parse_args(argv)
    fit_sources = tuple(args.fit.split(","))
    pairs = scaling_pairs(load_public_throughput())
    fit = [p for p in pairs if p[0].source_id in fit_sources]
    held = [p for p in pairs if p[0].source_id not in fit_sources]
    base = ThroughputConstants()

    def at(spread: float) -> ThroughputConstants:
        return base.model_copy(update={"rank_speed_spread": spread})

    s, best = min((score(scaling_errors(fit, at(v))), v) for v in GRID)
    print(f"fit on {', '.join(fit_sources)} ({len(fit)} multi-GPU runs with a one-GPU twin)")
    print(f"best rank_speed_spread={best}: median |scaling error| {math.exp(s) - 1:.1%} on the fit pairs")
    for name, sub in (("fit", fit), ("held out", held)):
        for label, value in (("none 0.0", 0.0), ("fitted", best)):
            e = scaling_errors(sub, at(value))
            print(f"  {name:<9} {label:<9} pairs {len(sub):>3}  median |error| {math.exp(score(e)) - 1:6.1%}"
                  f"  median signed {math.exp(statistics.median(e)) - 1:+6.1%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
