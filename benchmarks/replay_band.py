"""Which real readings check the caching-allocator replay, and by how much the real pool misses it (prints).

The band (planner.memory.band) narrows the reserved pool to the replay's point plus a margin only where GPU
readings check the replay. This script says what they check and derives the margin:

- every step reading in the repository (benchmarks/readings_scorecard.py's rows: steps, loops, LoRA, QLoRA,
  traced models, FSDP at world size 1), each with its pool miss = (measured reserved - predicted reserved) /
  predicted allocated, the unit of the band's margin. Whole runs of varying lengths (runs.jsonl, late.jsonl)
  are `planner run`'s replay, not one estimate's band: printed apart with --runs. The reading of a cast
  followed by `empty_cache` is left out: the planner does not model it and says to answer it as `--load direct`
  (docs/accuracy.md);
- the margin: low = the largest over-prediction, high = the largest under-prediction over the H200 readings
  (the shared folder and this project's H200 folders), each rounded up to the next whole percent: a bound that
  every one of them lies inside, not a fitted point (nothing in the replay is tuned to them). The H100 folder
  (results/validation/h100/) is held out of it and counted against it. Printed beside it, the margin the
  shared H200 folder alone would give and how many of the other readings it would leave outside: too many for
  a bound, which is why the project's own H200 readings are part of the fit.

What the readings have in common is what the replay is checked on: torch 2.11 (every folder's env.json), one
process on one GPU (no reading has a world size above 1: the FSDP rows are world size 1), the default
allocator and `expandable_segments:True` (no reading sets max_split_size_mb or another option).

Usage: python benchmarks/replay_band.py [--runs]   (a few minutes on 2 shared cores)
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import readings_scorecard as sc  # noqa: E402

FIT_GROUPS = (sc.SHARED_FIT, sc.SHARED_HELD)  # the shared folder, both halves
HELD_OUT_GROUP = sc.H100  # the same steps on another GPU: held out of the margin, checked against it


def fitted_margin(misses: list[float]) -> tuple[float, float]:
    """(low, high): the largest over- and under-prediction, as shares of allocated, up to the next percent."""
    over = max([-m for m in misses] + [0.0])
    under = max(misses + [0.0])
    return math.ceil(over * 100) / 100, math.ceil(under * 100) / 100


def not_modelled(row: sc.Scored) -> bool:
    """A reading of a setting the planner says it does not model (answered as another setting)."""
    return "empty_cache" in row.label


def is_run(row: sc.Scored) -> bool:
    return row.label.startswith("run ")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", action="store_true", help="also replay the whole runs (the slowest part)")
    args = ap.parse_args(argv)
    every = [r for r in sc.collect(with_runs=args.runs) if r.pool_miss is not None]
    rows = [r for r in every if not not_modelled(r) and not is_run(r)]
    fit = [r for r in rows if r.group != HELD_OUT_GROUP]
    held = [r for r in rows if r.group == HELD_OUT_GROUP]
    lo, hi = fitted_margin([r.pool_miss for r in fit])
    outside = sum(not -lo <= r.pool_miss <= hi for r in held)
    s_lo, s_hi = fitted_margin([r.pool_miss for r in rows if r.group in FIT_GROUPS])
    s_others = [r for r in rows if r.group not in FIT_GROUPS]
    s_outside = sum(not -s_lo <= r.pool_miss <= s_hi for r in s_others)
    print("pool miss = (measured reserved - replay's reserved) / predicted allocated; > 0: real pool larger")
    print(f"band margin over the H200 step readings ({len(fit)}): -{lo:.0%} / +{hi:.0%} of allocated")
    print(f"held out, the H100 readings ({len(held)}): {outside} outside that margin")
    print(f"the shared folder alone ({len(rows) - len(s_others)}): -{s_lo:.0%} / +{s_hi:.0%}, leaving "
          f"{s_outside} of {len(s_others)} other readings outside\n")
    print(f"{'group':<24}{'n':>4}{'min':>8}{'median':>8}{'max':>8}")
    for g in [g for g in sc.GROUPS if any(r.group == g for r in rows)]:
        m = [r.pool_miss for r in rows if r.group == g]
        print(f"{g[:23]:<24}{len(m):>4}{min(m):>+8.1%}{statistics.median(m):>+8.1%}{max(m):>+8.1%}")
    print("\nthe largest misses each way:")
    for r in sorted(rows, key=lambda r: r.pool_miss)[:3] + sorted(rows, key=lambda r: r.pool_miss)[-3:]:
        print(f"  {r.group[:16]:<17}{r.label[:48]:<49}{r.pool_miss:+.1%}")
    apart = [r for r in every if not_modelled(r) or is_run(r)]
    if apart:
        print("\nleft out of the band (whole runs: `planner run`; settings the planner does not model):")
        for r in apart:
            print(f"  {r.group[:16]:<17}{r.label[:48]:<49}{r.pool_miss:+.1%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
