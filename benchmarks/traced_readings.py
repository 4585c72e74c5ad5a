"""Models outside the catalog on a real GPU: the planner's prediction against what the GPU measured.

    python benchmarks/traced_readings.py [--readings results/validation/h200/measured-2026-11-26]
                                         [--file traced.jsonl]   (vocab.jsonl: Qwen2-0.5B at five shapes)

Reads `traced.jsonl` (T5-base, BART-base, Pythia-410M, OPT-350M, Qwen2-0.5B, built from the Hugging Face
configs each row carries, measured by `benchmarks/gpu_session.py` on one GPU), writes each row's config to a
`config.json`, traces it with `planner.estimate` as `--model config.json` would on the same GPU's instance type
(one GPU: `--parallelism single`) and prints allocated and reserved peaks of the steady step, predicted vs
measured. Nothing is fitted to these readings: they are a held-out check.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DEFAULT = ROOT / "results" / "validation" / "h200" / "measured-2026-11-26"
GiB = 1 << 30


def measured_peaks(row: dict) -> tuple[int, int]:
    """(allocated, reserved) peaks of the steady step (step 2), over its phases."""
    phases = row["step2"].values()
    return max(p["max_alloc"] for p in phases), max(p["max_res"] for p in phases)


def estimate_row(row: dict, instance: str, folder: Path, loop: str = "plain", with_throughput: bool = False):
    """The planner's estimate of one row: its config written to `folder`, traced as `--model config.json`."""
    from planner.estimate import estimate
    from planner.spec import TrainConfig

    path = folder / f"{row['model']}.json"
    path.write_text(json.dumps(row["hf_config"]))
    cfg = TrainConfig(batch_size=row["b"], seq_len=row["s"], precision=row["precision"], attention="sdpa",
                      parallelism="single", loop=loop)
    return estimate(str(path), cfg, instance, with_throughput=with_throughput)


def predict(row: dict, instance: str, folder: Path, loop: str = "plain") -> tuple[int, int]:
    est = estimate_row(row, instance, folder, loop)
    return est.memory_bytes.peak_allocated, est.memory_bytes.peak_reserved


def measured_step_s(row: dict) -> float:
    """The row's step time: `step_time_s` (the median of timed steps), else (vocab.jsonl, whose three steps
    are the metered ones, the first cold) the median of the steps after the first."""
    if "step_time_s" in row:
        return row["step_time_s"]
    return statistics.median(row["step_times_s"][1:])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--readings", type=Path, default=DEFAULT)
    ap.add_argument("--file", default="traced.jsonl", help="the rows' file in that folder")
    args = ap.parse_args(argv)
    env = json.loads((args.readings / "env.json").read_text())
    from planner.probes.readings import INSTANCE_FOR_GPU, gpu_of

    instance = INSTANCE_FOR_GPU[gpu_of(env)]
    rows = [json.loads(line) for line in (args.readings / args.file).read_text().splitlines() if line.strip()]
    loop = env.get("loop", "plain")  # the loop that measured them (env.json says; the planner's default else)
    print(f"Models outside the catalog on {env['gpu']} (torch {env['torch']}), predicted as {instance}, one GPU, "
          f"--loop {loop}")
    print(f"{'model':<13}{'prec':>9}{'b':>3} {'alloc GiB':>17} {'err':>7} {'reserved GiB':>17} {'err':>7}")
    errs_a, errs_r = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for row in rows:
            if row.get("status") != "ok":
                print(f"{row['model']:<13}{row['precision']:>9}{row['b']:>3} {row.get('status')}")
                continue
            ma, mr = measured_peaks(row)
            pa, pr = predict(row, instance, Path(tmp), loop)
            ea, er = pa / ma - 1, pr / mr - 1
            errs_a.append(ea)
            errs_r.append(er)
            print(f"{row['model']:<13}{row['precision']:>9}{row['b']:>3} {pa / GiB:7.2f} vs {ma / GiB:6.2f} "
                  f"{ea:+7.1%} {pr / GiB:7.2f} vs {mr / GiB:6.2f} {er:+7.1%}")
    if errs_a:
        print(f"allocated: median |error| {statistics.median(abs(e) for e in errs_a):.1%}, "
              f"range {min(errs_a):+.1%} to {max(errs_a):+.1%}")
        print(f"reserved:  median |error| {statistics.median(abs(e) for e in errs_r):.1%}, "
              f"range {min(errs_r):+.1%} to {max(errs_r):+.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
