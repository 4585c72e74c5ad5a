"""Predicted vs published GPU memory on public PyTorch training runs (results/public/memory/runs.csv).

Prints, per source and overall: rows (ran / OOM), the planner's verdicts, the count of sure fits that
really OOM'd (the worst answer: a failed job), OOM verdicts on runs that ran, and the whole-GPU peak error
median where the source measured a peak (error = predicted / measured - 1, on the quantity the source
measured: nvidia-smi -> peak_device, max_memory_reserved -> peak_reserved, max_memory_allocated ->
peak_allocated; an OOM message's "reserved in total by PyTorch" is a lower bound of peak_reserved).

Usage: python benchmarks/public_memory.py [--rows] [--source ID]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from public_common import abs_pct, median, pct, run_estimate  # noqa: E402

from planner.probes.public import MIB, load_public_memory  # noqa: E402

MEASURED_KEY = {"nvidia-smi": "peak_device", "max_memory_reserved": "peak_reserved",
                "max_memory_allocated": "peak_allocated", "oom-message-reserved": "peak_reserved"}


def evaluate(rows):
    """One dict per row: outcome, verdict, predicted peak and capacity, measured error when there is one."""
    out = []
    for row in rows:
        est, used_stack = run_estimate(row, with_throughput=False)
        mem = est["memory_bytes"]
        verdict = est.get("verdict") or ("fits" if est["fits"] else "oom")
        err = None
        if row.peak_mib is not None and row.peak_kind != "oom-message-reserved":
            err = mem[MEASURED_KEY[row.peak_kind]] / (row.peak_mib * MIB) - 1
        out.append({"id": row.id, "source": row.source_id, "gpu": row.gpu, "outcome": row.outcome,
                    "verdict": verdict, "peak_gib": mem["peak_device"] / 2**30,
                    "capacity_gib": est["gpu_memory_bytes"] / 2**30, "err": err, "stack": used_stack,
                    "in_band": _in_band(est, row)})
    return out


def _in_band(est, row) -> bool | None:
    """Whether a measured whole-GPU peak (nvidia-smi) lies in the planner's band [low, high]."""
    if row.peak_mib is None or row.peak_kind != "nvidia-smi" or not est.get("peak_device_high_bytes"):
        return None
    return est["peak_device_low_bytes"] <= row.peak_mib * MIB <= est["peak_device_high_bytes"]


def summary_line(name: str, res: list[dict]) -> str:
    ran = sum(r["outcome"] == "ran" for r in res)
    oom = len(res) - ran
    v = {k: sum(r["verdict"] == k for r in res) for k in ("fits", "tight", "oom")}
    bad_fit = sum(r["verdict"] == "fits" and r["outcome"] == "oom" for r in res)
    bad_oom = sum(r["verdict"] == "oom" and r["outcome"] == "ran" for r in res)
    errs = [r["err"] for r in res if r["err"] is not None]
    return (f"{name[:14]:<14}{len(res):>5}{ran:>4}{oom:>4}{v['fits']:>5}{v['tight']:>6}{v['oom']:>4}"
            f"{bad_fit:>8}{bad_oom:>8}{len(errs):>6}{abs_pct(median([abs(e) for e in errs])):>7}"
            f"{pct(median(errs)):>6}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", action="store_true", help="print every row too")
    ap.add_argument("--source", help="only this source id")
    args = ap.parse_args(argv)
    rows = [r for r in load_public_memory() if args.source in (None, r.source_id)]
    res = evaluate(rows)
    print("Public memory runs: planner verdict vs what happened")
    print("(results/public/memory/runs.csv)")
    print(f"{'source':<14}{'rows':>5}{'ran':>4}{'OOM':>4}{'fits':>5}{'tight':>6}{'oom':>4}"
          f"{'fit>OOM':>8}{'oom>ran':>8}{'peaks':>6}{'|err|':>7}{'err':>6}")
    for source in dict.fromkeys(r["source"] for r in res):
        print(summary_line(source, [r for r in res if r["source"] == source]))
    print(summary_line("all", res))
    full = sum(r["stack"] == "full" for r in res)
    part = sum(r["stack"] == "partial" for r in res)
    print(f"stack: {full} of {len(res)} rows estimated with their torch/CUDA/transformers")
    print(f"versions, {part} with part of them (the planner did not know the rest), the")
    print("others with the planner's defaults; |err|, err: medians over the measured")
    print("peaks (predicted / measured - 1)")
    banded = [r["in_band"] for r in res if r["in_band"] is not None]
    print(f"measured whole-GPU peaks inside the band [low, high]: {sum(banded)} of {len(banded)}")
    bad = [r["id"] for r in res if r["verdict"] == "fits" and r["outcome"] == "oom"]
    print("sure fits that OOM'd:" + ("".join(f"\n  {b}" for b in bad) if bad else " none"))
    if args.rows:
        print(f"\n{'row':<36}{'real':>5}{'verdict':>8}{'peak GiB':>10}{'of GiB':>8}{'err':>7}")
        for r in res:
            err = "" if r["err"] is None else pct(r["err"])
            print(f"{r['id'][:35]:<36}{r['outcome']:>5}{r['verdict']:>8}{r['peak_gib']:>10.2f}"
                  f"{r['capacity_gib']:>8.2f}{err:>7}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
