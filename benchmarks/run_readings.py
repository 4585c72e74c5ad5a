"""The varying-length runs measured on a GPU, replayed through the planner (prints predicted vs measured).

Why: `planner/run/` predicts the reserved peak of a run whose batches change length; these are the real
runs to check it against. `benchmarks/gpu_session.py run` measured them (plain PyTorch, see its docstring
and the README next to the readings): BERT-base b32 AMP bf16 and GPT-2 b16 fp32, AdamW foreach, SDPA, each
step a fresh batch at that step's length; 40 steps at the recorded lengths ("varied") and 6 at the maximum
("fixed"), with the default allocator and `expandable_segments:True`.

Each row is replayed with the SAME per-step lengths (`--padding exact`: the file is the steps' lengths, in
order) and the same configuration: ml.p5e.48xlarge (one H200), `--parallelism single`, optimizer foreach,
attention sdpa, `--seq-len` the run's longest length. Nothing here is fitted: the readings are held out.

The loop, replayed as measured: the readings' loop holds only the loss (`jobs/modeling.loss_of` returns
`out.loss`), so the logits are freed when the forward returns: `--loop loss-only` (planner/memory/loops.py).
(Until issue 36's cross-entropy rule this replay had to drop the logits altogether to come near: with the loss
modelled as one fp32 log-softmax, `--loop loss-only` put BERT's fixed run 6.6 % under and its growth at +39 %
against +23 %. With log_softmax in the logits' 16-bit dtype and nll_loss's fp32 copy, as CUDA autocast runs
ATen's composite, the readings' own loop gives -0.1 % and +22 %: activations.cross_entropy_saved.)

Columns: measured and predicted run peak reserved and allocated (GiB) with the error in %; for a varied
row also its growth: its reserved peak over the fixed run's of the same model and allocator, measured and
predicted.

Usage: python benchmarks/run_readings.py [--readings results/validation/h200/measured-2026-11-26/runs.jsonl]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

READINGS = Path(__file__).resolve().parent.parent / "results/validation/h200/measured-2026-11-26/runs.jsonl"
INSTANCE = "ml.p5e.48xlarge"  # one H200, as measured
GiB = 2**30


@dataclass(frozen=True)
class Compared:
    """One measured run and its prediction (bytes)."""

    row: dict
    reserved: int  # predicted run peak reserved
    allocated: int  # predicted run peak allocated
    fixed_reserved: int  # predicted one step at the longest length (the run's `fixed_peak_reserved_bytes`)

    @property
    def expandable(self) -> bool:
        return "expandable_segments:True" in self.row["alloc_conf"]

    @property
    def label(self) -> str:
        return (f"{self.row['model'].split('-')[0]} {self.row['kind']} "
                f"{'expandable' if self.expandable else 'default'}")

    @property
    def reserved_error(self) -> float:
        return self.reserved / self.row["peak_reserved"] - 1

    @property
    def allocated_error(self) -> float:
        return self.allocated / self.row["peak_allocated"] - 1


def load(path: Path = READINGS) -> list[dict]:
    """The rows that ran (status ok)."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if r.get("status") == "ok"]


def predict(row: dict, loop: str = "loss-only") -> Compared:
    """The planner's run of `row`'s lengths, configured as the row was measured (`loop`: the readings')."""
    import importlib

    est_mod = importlib.import_module("planner.estimate")
    from planner.run import simulate
    from planner.spec import TrainConfig

    lengths = row["lengths"]
    cfg = TrainConfig(batch_size=row["b"], seq_len=max(lengths), precision=row["precision"], attention="sdpa",
                      parallelism="single", optimizer="adamw", optimizer_impl="foreach", loop=loop)
    with tempfile.TemporaryDirectory() as tmp:
        f = Path(tmp) / "lengths.txt"
        f.write_text("\n".join(map(str, lengths)) + "\n")
        req = simulate.request(str(f), padding="exact", steps=len(lengths))
        e = est_mod.estimate(row["model"], cfg, INSTANCE, with_throughput=False,
                             expandable_segments="expandable_segments:True" in row["alloc_conf"], run=req)
    r = e.run
    return Compared(row, r.peak_reserved_bytes, r.peak_allocated_bytes, r.fixed_peak_reserved_bytes)


def compare(path: Path = READINGS, loop: str = "loss-only") -> list[Compared]:
    return [predict(r, loop) for r in load(path)]


def _fixed_of(rows: list[Compared], c: Compared) -> Compared | None:
    for o in rows:
        if (o.row["model"], o.row["alloc_conf"], o.row["kind"]) == (c.row["model"], c.row["alloc_conf"], "fixed"):
            return o
    return None


def table(rows: list[Compared]) -> list[str]:
    """The comparison as lines of at most 80 columns."""
    out = [f"{'run':<22} {'reserved GiB':>13} {'err':>6} {'allocated GiB':>13} {'err':>6} {'growth':>13}",
           f"{'':<22} {'meas -> pred':>13} {'':>6} {'meas -> pred':>13} {'':>6} {'meas -> pred':>13}"]
    for c in rows:
        growth = ""
        fixed = _fixed_of(rows, c)
        if c.row["kind"] == "varied" and fixed is not None:
            g_meas = c.row["peak_reserved"] / fixed.row["peak_reserved"] - 1
            g_pred = c.reserved / fixed.reserved - 1
            growth = f"{g_meas:+.0%} -> {g_pred:+.0%}"
        out.append(f"{c.label:<22} {c.row['peak_reserved'] / GiB:5.2f}->{c.reserved / GiB:5.2f} "
                   f"{c.reserved_error:+6.1%} {c.row['peak_allocated'] / GiB:5.2f}->{c.allocated / GiB:5.2f} "
                   f"{c.allocated_error:+6.1%} {growth:>13}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--readings", type=Path, default=READINGS)
    ap.add_argument("--loop", default="loss-only", help="the loop whose lifetimes to replay (default: the "
                    "readings' own, loss-only; plain keeps the logits to the step's end)")
    args = ap.parse_args()
    rows = compare(args.readings, args.loop)
    print(f"{args.readings} on {INSTANCE}, predicted vs measured run peaks")
    print("\n".join(table(rows)))
    worst = max(abs(c.reserved_error) for c in rows)
    print(f"worst |reserved error| {worst:.1%}; worst under-prediction "
          f"{min(c.reserved_error for c in rows):+.1%}")


if __name__ == "__main__":
    main()
