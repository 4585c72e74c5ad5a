"""Held-out check: the planner's whole-GPU peak (and speed) vs readings it must never be fitted to.

Reads results/public/heldout/ (see its README.md) and prints, per run and as medians per source, the error of
`peak_device` against nvidia-smi's used memory after training (predicted / measured - 1) and whether the
reading lies in the band [low, high]; for the Hugging Face page also the error of samples/s. Nothing here
feeds back into the planner: the figures are for reading only.

- tlkh/transformers-benchmarking: RoBERTa on one V100 16 GB, native AMP, apex FusedAdam, NGC
  pytorch:20.10-py3 = torch 1.7 (CUDA 11.1 there, eager module loading like every CUDA before 11.7);
  transformers not stated (2020-12): eager attention given explicitly. Its PyTorch Lightning profiler
  reports (tlkh_step_times.csv) also time the same runs on one A100 40 GB: the speed ratio between the two
  GPU families, the figure issue 9 found over-predicted by +62 % (median) before the roofline.
- Hugging Face "efficient training on a single GPU" page: BERT-large on one V100 16 GB (2022-01: torch 1.10,
  transformers 4.15, eager attention by that version's default), input_ids and labels only (no attention
  mask in the batch), transformers' AdamW (a loop over parameters), Adafactor, bitsandbytes Adam8bit.

Usage: python benchmarks/public_heldout.py
"""

from __future__ import annotations

import csv
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import planner  # noqa: E402
from planner.models.catalog import get_model  # noqa: E402
from planner.spec import InputSpec, TrainConfig  # noqa: E402

HELD = ROOT / "results" / "public" / "heldout"
MIB = 1 << 20
INSTANCE = "ml.p3.2xlarge"  # one V100 16 GB
OPTIONS = {"head": "sequence-classification", "num_labels": 2}


@dataclass(frozen=True)
class Run:
    source: str
    label: str
    model: object  # a catalog name or a ModelSpec
    config: TrainConfig
    stack: dict[str, str]
    peak_mib: float
    samples_per_s: float | None = None


def _csv(name: str) -> list[dict[str, str]]:
    with (HELD / name).open(newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


TLKH_STACK = {"torch": "1.7"}


def tlkh_config(row: dict[str, str]) -> TrainConfig:
    """A tlkh run (memory or speed file): native AMP, eager attention, apex FusedAdam, one GPU."""
    return TrainConfig(batch_size=int(row["batch_size"]), seq_len=int(row["seq_len"]), precision="amp-fp16",
                       attention="eager", optimizer="adamw", optimizer_impl="fused", parallelism="single")


def tlkh_runs() -> list[Run]:
    return [Run("tlkh", f"{r['model']} s={r['seq_len']} b={r['batch_size']}", r["model"], tlkh_config(r),
                TLKH_STACK, float(r["peak_mib"]))
            for r in _csv("tlkh_v100_16gb_amp.csv")]


def hf_page_runs() -> list[Run]:
    bert = get_model("bert-large-uncased", **OPTIONS)
    bert = bert.model_copy(update={"inputs": InputSpec(attention_mask=False)})  # input_ids and labels only
    out = []
    for r in _csv("hf_perf_train_gpu_one_v100.csv"):
        cfg = TrainConfig(batch_size=int(r["batch_size"]), seq_len=512, grad_accum=int(r["grad_accum"]),
                          checkpointing=r["checkpointing"] == "true", precision=r["precision"],
                          optimizer=r["optimizer"], optimizer_impl=r["optimizer_impl"], parallelism="single")
        out.append(Run("hf-page", r["experiment"], bert, cfg, {"torch": "1.10", "transformers": "4.15"},
                       float(r["peak_mib"]), float(r["samples_per_s"])))
    return out


def evaluate(run: Run) -> dict[str, float | str | bool | None]:
    est = planner.estimate(run.model, run.config, INSTANCE, model_options=None if not isinstance(run.model, str)
                           else OPTIONS, stack=run.stack, with_throughput=run.samples_per_s is not None)
    measured = run.peak_mib * MIB
    m = est.memory_bytes
    speed = None
    if run.samples_per_s is not None and est.throughput is not None:
        speed = est.throughput.samples_per_s / run.samples_per_s - 1
    return {"source": run.source, "id": run.label, "measured": measured, "predicted": m.peak_device,
            "err": m.peak_device / measured - 1, "verdict": est.verdict, "speed_err": speed,
            "in_band": est.peak_device_low_bytes <= measured <= est.peak_device_high_bytes}


def summary(res: list[dict]) -> str:
    errs = [float(r["err"]) for r in res]
    line = (f"{len(res)} runs: median error {statistics.median(errs) * 100:+.0f}%, median |error| "
            f"{statistics.median(abs(e) for e in errs) * 100:.0f}%, under {sum(e < 0 for e in errs)}, "
            f"in band {sum(bool(r['in_band']) for r in res)}")
    speeds = [float(r["speed_err"]) for r in res if r["speed_err"] is not None]
    if speeds:
        line += (f"\n  samples/s: median error {statistics.median(speeds) * 100:+.0f}%, median |error| "
                 f"{statistics.median(abs(e) for e in speeds) * 100:.0f}%")
    return line


def tlkh_speed_pairs() -> list[tuple[dict[str, str], dict[str, str]]]:
    """(V100 row, A100 row) of each run both GPUs have, from tlkh_step_times.csv."""
    by_gpu: dict[str, dict[tuple, dict[str, str]]] = {}
    for r in _csv("tlkh_step_times.csv"):
        by_gpu.setdefault(r["gpu"], {})[(r["model"], int(r["seq_len"]), int(r["batch_size"]))] = r
    v100, a100 = by_gpu.get("v100-16gb-300w", {}), by_gpu.get("a100-40gb-400w", {})
    return [(v100[k], a100[k]) for k in sorted(set(v100) & set(a100))]


def measured_samples_per_s(row: dict[str, str]) -> float:
    """PyTorch Lightning's `optimizer_step` wraps the closure (forward + backward) and the step itself; the
    batch fetch is timed apart: one training step = both."""
    step = float(row["optimizer_step_mean_s"]) + float(row["get_train_batch_mean_s"])
    return int(row["batch_size"]) / step


def predicted_samples_per_s(row: dict[str, str], gpu: str) -> float:
    from planner.probes.public import public_instance

    est = planner.estimate(row["model"], tlkh_config(row), public_instance(gpu, 1), model_options=OPTIONS,
                           stack=TLKH_STACK)
    return est.throughput.samples_per_s


def speed_section() -> None:
    """tlkh's A100 / V100 pairs: samples/s per GPU and the speed ratio between the two GPU families."""
    pairs = tlkh_speed_pairs()
    if not pairs:
        return
    print("\ntlkh/transformers-benchmarking speed, AMP: one V100 16 GB vs one A100 40 GB")
    print(f"{'run':<28}{'V100 err':>9}{'A100 err':>9}{'real A/V':>9}{'pred A/V':>9}{'ratio err':>10}")
    v_errs, a_errs, r_errs = [], [], []
    for v, a in pairs:
        mv, ma = measured_samples_per_s(v), measured_samples_per_s(a)
        pv, pa = predicted_samples_per_s(v, "V100-16GB"), predicted_samples_per_s(a, "A100-40GB")
        v_errs.append(pv / mv - 1)
        a_errs.append(pa / ma - 1)
        r_errs.append((pa / pv) / (ma / mv) - 1)
        label = f"{v['model']} s={v['seq_len']} b={v['batch_size']}"
        print(f"{label[:27]:<28}{v_errs[-1] * 100:>+8.0f}%{a_errs[-1] * 100:>+8.0f}%{ma / mv:>9.2f}"
              f"{pa / pv:>9.2f}{r_errs[-1] * 100:>+9.0f}%")

    def med(xs: list[float]) -> str:
        return f"median {statistics.median(xs) * 100:+.0f}% (|error| {statistics.median(abs(x) for x in xs) * 100:.0f}%)"

    print(f"{len(pairs)} pairs, samples/s: V100 {med(v_errs)}")
    print(f"  A100 {med(a_errs)}")
    print(f"  A100/V100 speed ratio: {med(r_errs)}")


def main() -> int:
    print("HELD OUT (never fitted): nvidia-smi used memory after training, one V100 16 GB")
    everything = []
    for title, runs in (("tlkh/transformers-benchmarking, RoBERTa, AMP", tlkh_runs()),
                        ("Hugging Face single-GPU page, BERT-large s=512", hf_page_runs())):
        res = [evaluate(r) for r in runs]
        everything += res
        print(f"\n{title}")
        print(f"{'run':<34}{'real GiB':>9}{'pred GiB':>9}{'err':>6}{'band':>5}{'verdict':>8}{'speed':>7}")
        for r in res:
            speed = f"{r['speed_err'] * 100:+6.0f}%" if r["speed_err"] is not None else f"{'':>7}"
            print(f"{str(r['id'])[:33]:<34}{r['measured'] / 2**30:>9.2f}{r['predicted'] / 2**30:>9.2f}"
                  f"{r['err'] * 100:>+5.0f}%{'in' if r['in_band'] else 'out':>5}{r['verdict']:>8}{speed}")
        print(summary(res))
    print(f"\nall held out:\n{summary(everything)}")
    speed_section()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
