"""Predicted vs published training speed on public PyTorch runs (results/public/throughput/runs.csv).

Prints, per source and overall:
1. single-GPU runs: median |error| and median signed error of samples/s (error = predicted / published - 1)
   and the Spearman rank correlation of predicted vs published;
2. cross-GPU ratios: pairs of single-GPU runs from the same source with the same model, task, sequence
   length and precision on two GPU families (each at its own published micro-batch); error =
   (predicted A/B) / (published A/B) - 1, median |error| per family pair;
3. multi-GPU runs: median |error| and signed error of the whole run's samples/s;
   (1-3 take only rows whose batches all had `seq_len` tokens: `seq_len_kind=fixed`)
4. runs whose batches were padded only to their longest sample (`seq_len_kind=max`, e.g. NVIDIA's binned
   phase-2 pre-training): the prediction at the maximum length is a floor; each must be at or below
   the published speed;
5. configurations/s of the speed model alone (target >= 1,000 on 2 cores).

Usage: python benchmarks/public_speed.py [--rows] [--source ID]
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from public_common import abs_pct, median, pct, run_estimate  # noqa: E402

from planner.probes.public import load_public_throughput  # noqa: E402


def evaluate(rows):
    """One dict per row: published and predicted samples/s of the whole run, the GPU family."""
    out = []
    for row in rows:
        est, used_stack = run_estimate(row, with_throughput=True)
        predicted = est["throughput"]["samples_per_s"]
        family = row.instance().gpu.family
        out.append({"id": row.id, "source": row.source_id, "model": row.model, "task": row.task,
                    "seq": row.seq_len, "precision": row.precision, "gpus": row.gpus, "family": family,
                    "gpu": row.gpu, "batch": row.batch_size, "published": row.samples_per_s,
                    "predicted": predicted, "err": predicted / row.samples_per_s - 1, "stack": used_stack,
                    "fixed": row.fixed_length})
    return out


def spearman(res: list[dict]) -> float | None:
    import pandas as pd

    if len(res) < 3:
        return None
    frame = pd.DataFrame(res)
    return float(frame["predicted"].corr(frame["published"], method="spearman"))


def pairs(single: list[dict]) -> list[dict]:
    """Same source, model, task, seq, precision; different GPU family; ordered by family name."""
    out = []
    key = lambda r: (r["source"], r["model"], r["task"], r["seq"], r["precision"])  # noqa: E731
    for _, group in itertools.groupby(sorted(single, key=key), key=key):
        for a, b in itertools.combinations(sorted(group, key=lambda r: r["family"]), 2):
            if a["family"] == b["family"]:
                continue
            published = a["published"] / b["published"]
            predicted = a["predicted"] / b["predicted"]
            out.append({"source": a["source"], "families": f"{a['family']}/{b['family']}",
                        "a": a["id"], "b": b["id"], "published": published, "predicted": predicted,
                        "err": predicted / published - 1})
    return out


GRID_SIZE = 4 * 8 * 4 * 2 * 2


def configurations_per_s() -> tuple[float, float]:
    """predict_throughput over a grid (models x batch x seq x precision x checkpointing) on one p3.2xlarge:
    (configurations/s with every kernel table built on first use, configurations/s with them cached)."""
    import time

    from planner.hardware import get_instance
    from planner.models.catalog import cached_model
    from planner.perf import roofline
    from planner.perf.throughput import predict_throughput
    from planner.spec import TrainConfig

    names = ["bert-base-uncased", "gpt2", "roberta-base", "distilbert-base-uncased"]
    models = [cached_model(n, {}) for n in names]
    grid = [(m, TrainConfig(batch_size=b, seq_len=s, precision=p, checkpointing=c, parallelism="single"))
            for m, b, s, p, c in itertools.product(models, [1, 2, 4, 8, 12, 16, 24, 32], [64, 128, 256, 512],
                                                   ["fp32", "amp-fp16"], [False, True])]
    inst = get_instance("ml.p3.2xlarge")
    rates = []
    roofline._TABLES.clear()
    for _ in range(2):
        start = time.perf_counter()
        for m, cfg in grid:
            predict_throughput(m, cfg, inst)
        rates.append(len(grid) / (time.perf_counter() - start))
    return rates[0], rates[1]


def line(name: str, errs: list[float], extra: str = "") -> str:
    return (f"{name[:20]:<20}{len(errs):>5}{abs_pct(median([abs(e) for e in errs])):>9}"
            f"{pct(median(errs)):>9}{extra:>10}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", action="store_true", help="print every row and pair too")
    ap.add_argument("--source", help="only this source id")
    args = ap.parse_args(argv)
    rows = [r for r in load_public_throughput() if args.source in (None, r.source_id)]
    res = evaluate(rows)
    single = [r for r in res if r["gpus"] == 1 and r["fixed"]]
    multi = [r for r in res if r["gpus"] > 1 and r["fixed"]]
    floors = [r for r in res if not r["fixed"]]
    sources = list(dict.fromkeys(r["source"] for r in res))

    print("Public training speed: predicted vs published samples/s")
    print("(results/public/throughput/runs.csv; error = predicted / published - 1)")
    print(f"\n1. Single-GPU runs\n{'source':<20}{'rows':>5}{'|err|med':>9}{'err med':>9}{'Spearman':>10}")
    for source in sources:
        sub = [r for r in single if r["source"] == source]
        if sub:
            rho = spearman(sub)
            print(line(source, [r["err"] for r in sub], "n/a" if rho is None else f"{rho:.3f}"))
    rho = spearman(single)
    print(line("all", [r["err"] for r in single], "n/a" if rho is None else f"{rho:.3f}"))

    pr = pairs(single)
    print(f"\n2. Cross-GPU ratios (same run on two GPU families)\n{'source / families':<20}{'pairs':>5}"
          f"{'|err|med':>9}{'err med':>9}")
    for source in sources:
        sub = [p for p in pr if p["source"] == source]
        if sub:
            print(line(source, [p["err"] for p in sub]))
    for fam in sorted({p["families"] for p in pr}):
        print(line("  " + fam, [p["err"] for p in pr if p["families"] == fam]))
    print(line("all", [p["err"] for p in pr]))

    print(f"\n3. Multi-GPU runs (whole run)\n{'source':<20}{'rows':>5}{'|err|med':>9}{'err med':>9}")
    for source in sources:
        sub = [r for r in multi if r["source"] == source]
        if sub:
            print(line(source, [r["err"] for r in sub]))
    print(line("all", [r["err"] for r in multi]))
    if floors:
        held = sum(r["predicted"] <= r["published"] for r in floors)
        print(f"\n4. Variable-length runs (seq_len is a maximum): {held} of {len(floors)} predicted at or\n"
              f"below the published speed, as a floor must be (median {pct(median([r['err'] for r in floors]))})")
    try:  # internals (planner.perf): skipped, not fatal, if they move
        cold, warm = configurations_per_s()
        print(f"\n5. Speed model alone (planner.perf.throughput, {GRID_SIZE} configurations,"
              f" 4 models)\nconfigurations/s: {cold:,.0f} building each kernel table (new shape"
              f" class\nevery 8 batch sizes), {warm:,.0f} with the tables cached")
    except (ImportError, AttributeError) as err:
        print(f"\n5. Speed model alone: not measured ({type(err).__name__}: {err})")
    full = sum(r["stack"] == "full" for r in res)
    part = sum(r["stack"] == "partial" for r in res)
    print(f"\nstack: {full} of {len(res)} rows estimated with their own software versions,\n"
          f"{part} with part of them")

    if args.rows:
        print(f"\n{'row (* seq_len is a maximum)':<42}{'b':>4}{'published':>11}{'predicted':>11}{'err':>7}")
        for r in res:
            name = r["id"][:40] + ("" if r["fixed"] else "*")
            print(f"{name:<42}{r['batch']:>4}{r['published']:>11.2f}{r['predicted']:>11.2f}{pct(r['err']):>7}")
        print(f"\n{'pair (A / B)':<50}{'pub A/B':>9}{'pred A/B':>9}{'err':>7}")
        for p in pr:
            name = f"{p['a'][:24]} / {p['b'][:22]}"
            print(f"{name:<50}{p['published']:>9.2f}{p['predicted']:>9.2f}{pct(p['err']):>7}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
