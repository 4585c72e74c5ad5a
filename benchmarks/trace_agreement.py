"""The tracer against the analytic core over the README accuracy grid (issue 12: "agreement with the analytic
core"): every model and configuration of `tests/saved_tensors.py:cases()` (docs/activation-accuracy.txt),
predicted for a V100 (ml.p3.2xlarge, fp32/AMP rows) and an A100 (ml.p4d.24xlarge, every row).

The catalog model is handed to the tracer as user code (`jobs.modeling.build_model`, the module the analytic
core describes), so both paths see the same architecture. Prints per row: parameters off (must be 0),
activations and peak allocated, traced vs analytic, in %, and the seconds of the traced estimate; then the
worst of each. Usage: python benchmarks/trace_agreement.py [--models bert-tiny,gpt2-tiny]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

INSTANCES = ("ml.p3.2xlarge", "ml.p4d.24xlarge")  # V100 (no bf16, no flash), A100


def user_file(folder: Path, name: str, spec) -> str:
    """The catalog model as user code, with per-layer checkpointing for its transformer."""
    from tests.catalog_user import catalog_user_file

    return catalog_user_file(folder / name.replace("-", "_"), spec)


def main(argv: list[str] | None = None) -> int:
    from planner.estimate import estimate
    from tests import saved_tensors as st

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=None, help="comma-separated subset of the grid's model names")
    args = ap.parse_args(argv)
    wanted = set(args.models.split(",")) if args.models else None
    folder = Path(tempfile.mkdtemp())
    print(f"{'model':16s} {'b':>3s} {'s':>4s} {'precision':9s} {'attn':5s} {'ckpt':5s} {'GPU':5s} {'params':>6s} "
          f"{'activ %':>8s} {'peak %':>8s} {'s':>5s}")
    worst_act = worst_peak = 0.0
    params_off = rows = 0
    files: dict[str, str] = {}
    for name, spec, c in st.cases():
        if wanted and name not in wanted:
            continue
        path = files.setdefault(name, user_file(folder, name, spec))
        for inst in INSTANCES:
            if inst == "ml.p3.2xlarge" and "bf16" in c.precision:
                continue
            cfg = c.model_copy(update={"parallelism": "single"})
            t0 = time.perf_counter()
            traced = estimate(f"{path}:build", cfg, inst, inputs=f"{path}:batch",
                              model_options={"attention": c.attention}, with_throughput=False)
            seconds = time.perf_counter() - t0
            analytic = estimate(spec, cfg, inst, with_throughput=False)
            off = traced.parameters["total"] - analytic.parameters["total"]
            ta, aa = traced.memory_bytes.activations, analytic.memory_bytes.activations
            tp, ap_ = traced.memory_bytes.peak_allocated, analytic.memory_bytes.peak_allocated
            act, peak = 100 * (ta - aa) / aa, 100 * (tp - ap_) / ap_
            worst_act, worst_peak = max(worst_act, abs(act)), max(worst_peak, abs(peak))
            params_off += off != 0
            rows += 1
            print(f"{name:16s} {c.batch_size:3d} {c.seq_len:4d} {c.precision:9s} {c.attention:5s} "
                  f"{str(c.checkpointing):5s} {'V100' if 'p3' in inst else 'A100':5s} {off:6d} {act:+8.3f} "
                  f"{peak:+8.3f} {seconds:5.1f}", flush=True)
    print(f"{rows} rows: parameters off in {params_off}; worst |activations| {worst_act:.3f} %; "
          f"worst |peak allocated| {worst_peak:.3f} %")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
