"""Where a pipeline rank's replayed pool (reserved - allocated) comes from, on the published pipeline-parallel rows
(results/public/fp8/, moe/; issue 35): prints, per row, the worst rank's allocated and reserved peaks with its
in-flight micro-batches replayed as their per-op tensors (what the planner does) and as one block of their total
(what it did before), the event of the reserved peak, and the free bytes of the cached segments at that event by
segment class.

Why: the Megatron-Bridge Llama-3-70B FP8 row (64 H100s, ran) was called OOM with 26.8 GiB of pool; the one-block
replay freed that block after step 1's backward, the first optimizer step carved its state out of the cached
segment, and step 2's block needed a second one (docs/fp8-and-compile.md, "The Llama-3-70B FP8 row, term by
term"). Nothing here is fitted; the rows are independent checks.

Usage: python benchmarks/pipeline_pool.py [--rows ID ...]   (about a minute on 2 shared cores)
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GIB, MIB = 2**30, 2**20


def _replays(row: Any, one_block: bool) -> tuple[Any, list]:
    """The row's estimate and the traces the allocator replayed for it (one per pipeline stage)."""
    import planner
    from planner.memory import events, reserved

    reserved.clear_caches()
    traces: list = []
    real_replay, real_split = reserved._replay, events.in_flight_tensors

    def spy(trace, *args, **kwargs):
        traces.append(trace)
        return real_replay(trace, *args, **kwargs)

    reserved._replay = spy
    if one_block:
        events.in_flight_tensors = lambda step, tensors: None  # the replay before: one tensor of the block
    try:
        est = planner.estimate(row.model_ref(ROOT), row.train_config(), row.instance)
    finally:
        reserved._replay, events.in_flight_tensors = real_replay, real_split
        reserved.clear_caches()
    return est, traces


def _at_peak(traces: list, reserved_bytes: int) -> str:
    """The worst stage's reserved peak: which allocation set it and the cached free bytes by segment class."""
    from planner.memory import allocator, events

    for t in traces:
        r = allocator.replay(t.events)
        if r.peak_reserved == reserved_bytes:
            break
    else:
        return "  (the worst stage's trace went through the capacity path: not broken down)"
    free: collections.Counter = collections.Counter()
    for s in allocator.segments_after(t.events[:r.peak_event + 1]):
        kind = ("small (2 MiB)" if s.small else "20 MiB" if s.size == 20 * MIB
                else "<= 256 MiB" if s.size <= 256 * MIB else "> 256 MiB")
        free[kind] += s.size - s.allocated
    parts = ", ".join(f"{k} {v / GIB:.2f}" for k, v in sorted(free.items(), key=lambda kv: -kv[1]) if v >= MIB)
    return (f"  reserved peak at event {r.peak_event:,} of {t.n_events:,}: {events.tensor_name(t, r.peak_tensor)} "
            f"({r.peak_event_bytes / GIB:.2f} GiB)\n  cached free at that event, GiB: {parts or 'none'}")


def main() -> None:
    from planner.probes.public_moe_fp8 import load_published

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", nargs="*", help="row ids (default: every row with pipeline parallelism)")
    args = ap.parse_args()
    rows = [r for kind in ("fp8", "moe") for r in load_published(kind)
            if r.pp > 1 and (not args.rows or r.id in args.rows)]
    for row in rows:
        print(f"{row.id}: {row.model}, {row.gpus} GPUs, {row.framework}, pp {row.pp} vp {row.vp}, "
              f"mb {row.micro_batch} x {row.grad_accum}")
        try:
            old, _ = _replays(row, one_block=True)
            new, traces = _replays(row, one_block=False)
        except Exception as exc:  # a row the planner cannot express: its one-line reason
            print(f"  not expressible: {exc}")
            continue
        for label, est in (("in flight as one block (before)", old), ("in flight as tensors (now)", new)):
            m = est.memory_bytes
            print(f"  {label:32s} allocated {m.peak_allocated / GIB:6.2f}  reserved {m.peak_reserved / GIB:6.2f}  "
                  f"pool {(m.peak_reserved - m.peak_allocated) / GIB:5.2f} GiB  device {m.peak_device / GIB:6.2f} "
                  f"GiB  {est.verdict}")
        print(_at_peak(traces, new.memory_bytes.peak_reserved))


if __name__ == "__main__":
    main()
