"""Held-out check: the planner's whole-GPU peak vs readings it must never be fitted to.

Reads results/public/heldout/ (see its README.md: tlkh/transformers-benchmarking, RoBERTa on one V100 16 GB,
native AMP, apex FusedAdam, NGC pytorch:20.10-py3) and prints, per run and as medians, the error of
`peak_device` against nvidia-smi's memory.used peak (predicted / measured - 1) and whether the reading lies in
the band [low, high]. Nothing here feeds back into the planner: the figures are for reading only.

Stack: NGC 20.10 ships torch 1.7 (NGC release notes; CUDA 11.1 there, eager module loading like every CUDA
before 11.7): passed as torch 1.7 (the table's CUDA build for it); transformers not stated (2020-12): eager
attention given explicitly.

Usage: python benchmarks/public_heldout.py
"""

from __future__ import annotations

import csv
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import planner  # noqa: E402
from planner.spec import TrainConfig  # noqa: E402

HELDOUT = ROOT / "results" / "public" / "heldout" / "tlkh_v100_16gb_amp.csv"
MIB = 1 << 20
INSTANCE = "ml.p3.2xlarge"  # one V100 16 GB
STACK = {"torch": "1.7"}
OPTIONS = {"head": "sequence-classification", "num_labels": 2}


def rows() -> list[dict[str, str]]:
    with HELDOUT.open(newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def evaluate(row: dict[str, str]) -> dict[str, float | str | bool]:
    cfg = TrainConfig(batch_size=int(row["batch_size"]), seq_len=int(row["seq_len"]), precision="amp-fp16",
                      attention="eager", optimizer="adamw", optimizer_impl="fused", parallelism="single")
    est = planner.estimate(row["model"], cfg, INSTANCE, model_options=OPTIONS, stack=STACK, with_throughput=False)
    measured = float(row["peak_mib"]) * MIB
    m = est.memory_bytes
    return {"id": f"{row['model']} s={row['seq_len']} b={row['batch_size']}", "measured": measured,
            "predicted": m.peak_device, "err": m.peak_device / measured - 1, "verdict": est.verdict,
            "in_band": est.peak_device_low_bytes <= measured <= est.peak_device_high_bytes,
            "above": m.peak_device - m.peak_allocated - m.cuda_context - m.nccl}


def main() -> int:
    res = [evaluate(r) for r in rows()]
    print("HELD OUT (never fitted): tlkh/transformers-benchmarking, V100 16 GB, AMP")
    print(f"{'run':<28}{'real GiB':>9}{'pred GiB':>9}{'err':>7}{'band':>6}{'verdict':>8}")
    for r in res:
        print(f"{r['id']:<28}{r['measured'] / 2**30:>9.2f}{r['predicted'] / 2**30:>9.2f}"
              f"{r['err'] * 100:>+6.0f}%{'in' if r['in_band'] else 'out':>6}{r['verdict']:>8}")
    errs = [float(r["err"]) for r in res]
    print(f"{len(res)} runs: median error {statistics.median(errs) * 100:+.0f}%, median |error| "
          f"{statistics.median(abs(e) for e in errs) * 100:.0f}%, under-predicted {sum(e < 0 for e in errs)}, "
          f"in band {sum(bool(r['in_band']) for r in res)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
