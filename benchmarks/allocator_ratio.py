"""How the caching-allocator model's reserved/allocated ratio compares with the flat 10 % it replaces (prints).

1. Over the catalog's transformer models, a grid of batch, sequence, precision and checkpointing on one
   A100-40GB: the distribution of peak_reserved / peak_allocated from the replay (the flat model: 1.10).
2. On the public runs of results/public/memory (planner.probes.public): median error of the whole-GPU peak
   where a peak was measured, and sure fits that really OOM'd, allocator model vs flat 10 %.
Usage: python benchmarks/allocator_ratio.py [--quick]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

MODELS = ["bert-base-uncased", "bert-large-uncased", "roberta-base", "distilbert-base-uncased", "gpt2",
          "gpt2-medium"]
FLAT = {"fragmentation": 0.10}


def catalog_ratios(quick: bool) -> None:
    import planner
    from planner.errors import PlannerError
    from planner.models.catalog import list_models
    from planner.spec import TrainConfig

    models = [m for m in MODELS if m in list_models()]
    batches = [1, 8, 32] if quick else [1, 4, 8, 16, 32]
    seqs = [128, 512]
    print(f"{'model':24s} {'configs':>7s} {'min':>6s} {'median':>6s} {'max':>6s}   reserved/allocated")
    allr = []
    for m in models:
        ratios = []
        for b, s, p, ck in itertools.product(batches, seqs, ["fp32", "amp-fp16"], [False, True]):
            try:
                e = planner.estimate(m, TrainConfig(batch_size=b, seq_len=s, precision=p, checkpointing=ck),
                                     "ml.p4d.24xlarge", with_throughput=False)
            except PlannerError:
                continue
            mb = e.memory_bytes
            ratios.append(mb.peak_reserved / mb.peak_allocated)
        allr += ratios
        print(f"{m:24s} {len(ratios):7d} {min(ratios):6.3f} {statistics.median(ratios):6.3f} {max(ratios):6.3f}")
    print(f"{'all':24s} {len(allr):7d} {min(allr):6.3f} {statistics.median(allr):6.3f} {max(allr):6.3f}"
          "   (flat model: 1.100)")


def public_runs() -> None:
    from public_memory import MEASURED_KEY

    import planner
    from planner.probes.public import MIB, load_public_memory

    rows = load_public_memory()
    print(f"\n{'model of reserved':18s} {'rows':>5s} {'measured':>8s} {'median err':>10s} {'median |err|':>12s} "
          f"{'fits but OOM':>12s}")
    for label, runtime in (("allocator replay", None), ("flat 10 %", FLAT)):
        errs, bad = [], 0
        for row in rows:
            est = planner.estimate(row.model, row.train_config(), row.instance(), model_options=row.model_options(),
                                   with_throughput=False, runtime=runtime)
            if est.fits and row.outcome == "oom":
                bad += 1
            if row.peak_mib is not None and row.peak_kind != "oom-message-reserved":
                got = getattr(est.memory_bytes, MEASURED_KEY[row.peak_kind])
                errs.append(got / (row.peak_mib * MIB) - 1)
        med = statistics.median(errs) if errs else float("nan")
        mabs = statistics.median(abs(e) for e in errs) if errs else float("nan")
        print(f"{label:18s} {len(rows):5d} {len(errs):8d} {med:10.1%} {mabs:12.1%} {bad:12d}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    catalog_ratios(args.quick)
    public_runs()


if __name__ == "__main__":
    main()
