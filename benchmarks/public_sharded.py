"""Published FSDP / ZeRO runs (results/public/sharded/runs.csv): the planner's verdict and peak under the
framework that ran each one, beside the same run under `--framework pytorch` (autocast around FSDP, the
planner's rule before frameworks existed), so what the framework layouts change is visible row by row.

Every row cites its source (results/public/sources.csv). Nothing is fitted to these rows. A row with
`seq_len_kind=max` ran at up to `seq_len` tokens: a "fits" there holds at any shorter length, an "oom" there
may not be the run's.

Usage: python benchmarks/public_sharded.py [--rows]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's planner

from planner.probes.public import MIB, load_public_sharded  # noqa: E402

MEASURED_KEY = {"nvidia-smi": "peak_device", "max_memory_reserved": "peak_reserved",
                "max_memory_allocated": "peak_allocated", "oom-message-reserved": "peak_reserved"}


def _estimate(row, framework: str | None = None):
    from planner import estimate

    cfg = row.train_config()
    if framework is not None:
        cfg = cfg.model_copy(update={"framework": framework})
    return estimate(row.model, cfg, row.instance(), model_options=row.model_options())


def evaluate(rows):
    """One dict per row: outcome, verdict under the row's framework and under pytorch, measured error."""
    out = []
    for row in rows:
        est, plain = _estimate(row), _estimate(row, "pytorch")
        err = None
        if row.peak_mib is not None and row.peak_kind != "oom-message-reserved":
            measured = getattr(est.memory_bytes, MEASURED_KEY[row.peak_kind])
            err = measured / (row.peak_mib * MIB) - 1
        out.append({"id": row.id, "framework": row.framework, "outcome": row.outcome, "verdict": est.verdict,
                    "peak_gib": est.memory_bytes.peak_device / 2**30, "plain_verdict": plain.verdict,
                    "plain_gib": plain.memory_bytes.peak_device / 2**30,
                    "capacity_gib": est.gpu_memory_bytes / 2**30, "err": err, "kind": row.peak_kind or "",
                    "seq": f"{row.seq_len}{'max' if row.seq_len_kind == 'max' else ''}", "lora": row.lora_r})
    return out


def _answered(r: dict) -> bool:
    """The verdict agrees with what happened (a tight verdict answers neither way)."""
    return (r["outcome"] == "ran" and r["verdict"] == "fits") or (r["outcome"] == "oom" and r["verdict"] == "oom")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", action="store_true", help="print every row (the default prints them too)")
    ap.parse_args(argv)
    res = evaluate(load_public_sharded())
    print("Published FSDP / ZeRO runs: planner verdict vs what happened")
    print("(results/public/sharded/runs.csv; peaks in GiB, whole device)")
    print(f"{'row':<28}{'fw':<10}{'ran':>4}{'verdict':>8}{'peak':>6}{'pytorch':>8}{'peak':>6}{'GPU':>4}"
          f"{'err':>6}")
    for r in res:
        err = f"{100 * r['err']:+.0f}%" if r["err"] is not None else ""
        print(f"{r['id'][:27]:<28}{r['framework']:<10}{r['outcome']:>4}{r['verdict']:>8}{r['peak_gib']:>6.1f}"
              f"{r['plain_verdict']:>8}{r['plain_gib']:>6.1f}{r['capacity_gib']:>4.0f}{err:>6}")
    good = sum(_answered(r) for r in res)
    plain_good = sum(_answered({**r, "verdict": r["plain_verdict"]}) for r in res)
    sure_fit_oom = sum(r["outcome"] == "oom" and r["verdict"] == "fits" for r in res)
    print(f"answered as they ran: {good} of {len(res)} under each row's framework, {plain_good} of {len(res)}")
    print(f"under --framework pytorch; sure fits that ran out of memory: {sure_fit_oom}")
    print("err: predicted / measured - 1 on what the source measured (allocated or reserved)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
