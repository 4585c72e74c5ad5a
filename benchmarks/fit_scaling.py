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

from planner.models.catalog import cached_model
from planner.perf.throughput import ThroughputConstants, predict_throughput
from planner.probes.public import load_public_throughput, scaling_pairs

FIT_SOURCES = ("dle-bert-1907", "dle-bert-2006")
GRID = [round(0.005 * i, 3) for i in range(41)]  # 0 .. 0.20


def scaling_errors(pairs, constants: ThroughputConstants) -> list[float]:
    """log(predicted scaling / published scaling) per (multi, single) pair."""
    out = []
    for multi, single in pairs:
        model = cached_model(multi.model, multi.model_options())
        pm = predict_throughput(model, multi.train_config(), multi.instance(), constants).samples_per_s
        ps = predict_throughput(model, single.train_config(), single.instance(), constants).samples_per_s
        out.append(math.log((pm / ps) / (multi.samples_per_s / single.samples_per_s)))
    return out


def score(errs: list[float]) -> float:
    return statistics.median(abs(e) for e in errs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fit", default=",".join(FIT_SOURCES), help="comma-separated source ids to fit on")
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
