"""Elementwise passes measured on a GPU (`gpu_session.py run --sections passes`: passes.jsonl) against the
planner's timing of the same pass: vectorized passes at the architecture's HBM efficiency, passes over mixed
floating dtypes (and 16-bit -> fp32 copies) at most the SM-bound rate of planner.perf.roofline.ARCH_DYNAMIC_CAST.

Those two constants were fitted on whole training steps (benchmarks/fit_memory_passes.py); this checks them
pass by pass. Nothing is fitted here.

Usage: python benchmarks/passes_readings.py FOLDER   (a folder with env.json and passes.jsonl)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's planner

from planner.hardware import get_instance  # noqa: E402
from planner.perf.kernels import elementwise  # noqa: E402
from planner.perf.roofline import time_kernels  # noqa: E402
from planner.perf.throughput import ThroughputConstants  # noqa: E402
from planner.probes.readings import INSTANCE_FOR_GPU, gpu_of  # noqa: E402


def compare(folder: Path) -> list[dict]:
    """One dict per measured pass: the row, the planner's seconds and the error (predicted / measured - 1)."""
    env = json.loads((folder / "env.json").read_text())
    gpu = get_instance(INSTANCE_FOR_GPU[gpu_of(env)]).gpu
    c = ThroughputConstants()
    out = []
    for line in (folder / "passes.jsonl").read_text().splitlines():
        row = json.loads(line) if line.strip() else {}
        if row.get("status", "ok") != "ok" or not row.get("seconds"):
            continue
        k = elementwise(row["op"], row["numel"], tuple(row["reads"]), (row["writes"],), row["writes"])
        secs = time_kernels([k], gpu, c)[0]
        out.append({**row, "mixed": k.dynamic_cast, "predicted_s": secs, "error": secs / row["seconds"] - 1})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder", type=Path)
    args = ap.parse_args(argv)
    rows = compare(args.folder)
    print(f"{'pass':<34}{'elements':>11}{'GB/s meas':>11}{'GB/s pred':>11}{'error':>8}")
    for r in rows:
        name = f"{r['op']} {'+'.join(d[:4] for d in r['reads'])}->{r['writes'][:4]}{' (mixed)' if r['mixed'] else ''}"
        print(f"{name:<34}{r['numel']:>11,}{r['bytes_per_s'] / 1e9:>11.0f}"
              f"{r['bytes'] / r['predicted_s'] / 1e9:>11.0f}{r['error']:>+8.1%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
