"""The training loops, load paths and QLoRA-without-checkpointing readings against the planner (prints
predicted vs measured; fits nothing: every row here is held out).

Why: `--loop` and `--load` (planner/memory/loops.py) and the QLoRA rules (planner/adapters/) were written from
the libraries' source; these are the real runs that check them. `benchmarks/gpu_session.py run --sections
loops,load,qlora_nockpt` measured them (see its docstring and the README next to the readings):
- loops.jsonl: BERT-base b32 × 512, AMP bf16, AdamW foreach, 4 steps under a plain loop, transformers'
  Trainer, Accelerate and Lightning; peaks reset at each step's start. Every one of these loops computes the
  loss in a function that returns only the loss (`loss_fn`), so the outputs die when the forward returns: the
  plain row is compared as `--loop loss-only`, the Trainer row as `--loop hf-trainer`, the Lightning row as
  `--loop lightning`, the Accelerate row as `--loop accelerate` (whose fp32 copy of the outputs at the
  forward's end, accelerate's `convert_outputs_to_fp32`, sets this row's peak; `--loop accelerate` also keeps
  the outputs to the next forward, as accelerate's example loop does and this reading's loop does not: the
  backward then holds the logits, which here stays below that forward-end peak).
- load.jsonl: LoRA r16 (q, k, v, o; dropout 0.05) on Llama-2-7B in bf16 with checkpointing, 4 × 512, built in
  bf16 (`--load direct`), built in fp32 and cast (`--load cast`), and cast then `torch.cuda.empty_cache()`
  (not modelled: compared as `cast`, marked).
- qlora_nockpt.jsonl: QLoRA (NF4, double quantization, prepare_model_for_kbit_training) on Llama-2-7B,
  2 × 1,024, without and with checkpointing, all-loss loop (`--loop loss-only`).

Usage: python benchmarks/loop_load_readings.py [--readings results/validation/h200/measured-2026-11-27]
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT = ROOT / "results/validation/h200/measured-2026-11-27"
INSTANCE = "ml.p5e.48xlarge"  # one H200, as measured
GiB = 2**30
# the planner's loop for each reading's loop (see the module doc)
LOOP_OF_READING = {"plain": "loss-only", "hf-trainer": "hf-trainer", "accelerate": "accelerate",
                   "lightning": "lightning"}
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")  # gpu_session.py LORA_TARGETS


def _rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if r.get("status", "ok") == "ok"]


def _phase_peaks(row: dict) -> tuple[int, int]:
    phases = [p for step in ("step1", "step2") for p in row[step].values() if isinstance(p, dict)]
    return max(p["max_alloc"] for p in phases), max(p["max_res"] for p in phases)


def estimate_row(model: str, with_throughput: bool = False, **kw):
    """The planner's estimate of one of these rows (one H200, SDPA, AdamW foreach, as measured)."""
    from planner.estimate import estimate
    from planner.spec import TrainConfig

    cfg = TrainConfig(attention="sdpa", parallelism="single", optimizer="adamw", optimizer_impl="foreach", **kw)
    return estimate(model, cfg, INSTANCE, with_throughput=with_throughput)


def step_peaks(e) -> tuple[int, int]:
    """(allocated, reserved) of the step: the load phase's peak (--load cast's fp32 build) is not a step's."""
    step = max((p.allocated for p in e.phases if p.phase != "load"), default=e.memory_bytes.peak_allocated)
    return step, e.memory_bytes.peak_reserved


def lora_fields(r: dict) -> dict:
    """TrainConfig fields of a LoRA/QLoRA row of `gpu_session.py lora_row` (lora.jsonl, load.jsonl,
    qlora_nockpt.jsonl): AMP bf16, dropout 0.05, the loss-only loop, its adapters and base."""
    load = "direct" if r.get("load_path", "direct") == "direct" else "cast"
    targets = r.get("targets") or LORA_TARGETS
    return dict(batch_size=r["b"], seq_len=r["s"], checkpointing=r["ckpt"], lora_r=r["r"], lora_alpha=r["alpha"],
                lora_targets=(targets,) if isinstance(targets, str) else tuple(targets), base_dtype=r["base"],
                load=load, precision="amp-bf16", lora_dropout=0.05, loop="loss-only")


@dataclass(frozen=True)
class Predicted:
    """One row of these files, its measured peaks and step time, and the planner's estimate of it."""

    label: str
    kind: str  # "loop", "load" or "qlora"
    row: dict
    measured_allocated: int
    measured_reserved: int
    estimate: object

    @property
    def measured_step_s(self) -> float | None:
        return self.row.get("step_time_s")


def predictions(folder: Path, with_throughput: bool = False) -> list[Predicted]:
    """Every row of loops.jsonl, load.jsonl and qlora_nockpt.jsonl in `folder`, estimated once."""
    out = []
    for r in _rows(folder / "loops.jsonl"):
        steps = [s for s in r["steps"] if "max_alloc" in s]
        if not steps:
            continue
        loop = LOOP_OF_READING[r["loop"]]
        e = estimate_row(r["model"], with_throughput, batch_size=r["b"], seq_len=r["s"],
                         precision=r["precision"], loop=loop)
        out.append(Predicted(f"loop {r['loop']} as {loop}", "loop", r, max(s["max_alloc"] for s in steps),
                             max(s["max_res"] for s in steps), e))
    for r in _rows(folder / "load.jsonl"):
        path = r.get("load_path", "direct")
        e = estimate_row(r["model"], with_throughput, **lora_fields(r))
        ma, mr = _phase_peaks(r)
        out.append(Predicted(f"load {path}" + (" (as cast)" if path == "cast+empty_cache" else ""), "load", r,
                             ma, mr, e))
    for r in _rows(folder / "qlora_nockpt.jsonl"):
        e = estimate_row(r["model"], with_throughput, **lora_fields(r))
        ma, mr = _phase_peaks(r)
        out.append(Predicted(f"qlora {r['b']}x{r['s']} ckpt={'on' if r['ckpt'] else 'off'}", "qlora", r, ma, mr,
                             e))
    return out


def compare(folder: Path) -> list[tuple[str, int, int, int, int]]:
    """(label, measured allocated, predicted allocated, measured reserved, predicted reserved) per row."""
    out = []
    for p in predictions(folder):
        pa, pr = step_peaks(p.estimate)
        out.append((p.label, p.measured_allocated, pa, p.measured_reserved, pr))
    return out


def table(rows: list[tuple[str, int, int, int, int]]) -> list[str]:
    lines = [f"{'row':<34} {'allocated GiB':>14} {'err':>6} {'reserved GiB':>14} {'err':>6}",
             f"{'':<34} {'meas -> pred':>14} {'':>6} {'meas -> pred':>14} {'':>6}"]
    for label, ma, pa, mr, pr in rows:
        lines.append(f"{label:<34} {ma / GiB:6.2f}->{pa / GiB:6.2f} {pa / ma - 1:+6.1%} "
                     f"{mr / GiB:6.2f}->{pr / GiB:6.2f} {pr / mr - 1:+6.1%}")
    if rows:
        ea = [abs(pa / ma - 1) for _, ma, pa, _, _ in rows]
        er = [pr / mr - 1 for _, _, _, mr, pr in rows]
        lines.append(f"allocated median |error| {statistics.median(ea):.1%}; reserved median |error| "
                     f"{statistics.median(map(abs, er)):.1%}, worst under {min(er):+.1%}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--readings", type=Path, default=DEFAULT)
    args = ap.parse_args()
    rows = compare(args.readings)
    print(f"{args.readings} on {INSTANCE}, predicted vs measured peaks (nothing fitted)")
    print("\n".join(table(rows)) if rows else "no loops.jsonl, load.jsonl or qlora_nockpt.jsonl rows there")


if __name__ == "__main__":
    main()
