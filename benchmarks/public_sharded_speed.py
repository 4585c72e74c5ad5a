"""Published FSDP training speeds (results/public/sharded/speed.csv) beside the planner's prediction, under the
per-unit overlap model (planner.perf.collectives) and under the model it replaced (`shard_overlap` 0.5: half
of every unit's collective exposed, no SM contention), so what the overlap model changes is visible row by
row. Nothing is fitted to these rows.

Each row runs on its own interconnect: the A100 node (ml.p4d.24xlarge, NVLink inside) with the run's network
between nodes (1600 Gbps RoCE for MosaicML's table), not the instance's 400 Gbps EFA. The models are MPT-7B
and MPT-13B written as GPT-2 configs (same linears and vocabulary; `params` is checked against the source's
count in tests/test_public_data.py).

Two figures per row: the error of tokens/s/GPU, which also carries the one-GPU roofline's error on these
kernels (MosaicML's triton FlashAttention, fused loss, low-precision LayerNorm), and the error of the
*scaling*, tokens/s/GPU relative to the same model's 8-GPU row, which cancels the one-GPU part and leaves
what grows with the GPU count: communication and the slowest-GPU wait.

Usage: python benchmarks/public_sharded_speed.py
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's planner


def predict(row, old: bool = False) -> float:
    """Tokens/s/GPU the planner predicts for `row` (old=True: shard_overlap 0.5 and no SM contention)."""
    from unittest import mock

    from planner import estimate
    from planner.perf import throughput as tp
    from planner.perf.constants import ThroughputConstants

    inst = row.instance()
    cfg = row.train_config(inst.gpus)
    if not old:
        est = estimate(str(row.config_path()), cfg, inst)
    else:  # the model before issue 32: half of every unit's collective exposed, no SM contention
        old_c = ThroughputConstants(shard_overlap=0.5)
        tp._COMM_TIMES.clear()
        with mock.patch.object(tp, "overlap_contention_s", lambda hidden, instance: 0.0), \
                mock.patch.object(tp, "_default_constants", lambda: old_c), \
                mock.patch.object(tp, "ThroughputConstants", lambda: old_c):
            est = estimate(str(row.config_path()), cfg, inst)
        tp._COMM_TIMES.clear()
    return est.throughput.tokens_per_s / row.gpus


def main(argv: list[str] | None = None) -> int:
    from planner.probes.public import load_public_sharded_speed

    rows = load_public_sharded_speed()
    print("Published FSDP speeds: tokens/s/GPU, planner (per-unit overlap) and the old 0.5 overlap")
    print(f"{'row':<24}{'GPUs':>5}{'pub':>7}{'pred':>7}{'err':>6}{'old':>7}{'err':>6}{'scal':>7}{'pred':>7}"
          f"{'old':>7}")
    base: dict[str, tuple[float, float, float]] = {}
    errs, old_errs, scal_errs, old_scal_errs = [], [], [], []
    for row in rows:
        new, old = predict(row), predict(row, old=True)
        key = row.model_config_file
        if key not in base:
            base[key] = (row.tokens_per_s_per_gpu, new, old)
        pub0, new0, old0 = base[key]
        scal, scal_new, scal_old = row.tokens_per_s_per_gpu / pub0, new / new0, old / old0
        errs.append(new / row.tokens_per_s_per_gpu - 1)
        old_errs.append(old / row.tokens_per_s_per_gpu - 1)
        if row.gpus > 8:
            scal_errs.append(scal_new / scal - 1)
            old_scal_errs.append(scal_old / scal - 1)
        print(f"{row.id[:23]:<24}{row.gpus:>5}{row.tokens_per_s_per_gpu:>7.0f}{new:>7.0f}{errs[-1]:>+6.0%}"
              f"{old:>7.0f}{old_errs[-1]:>+6.0%}{scal:>7.3f}{scal_new:>7.3f}{scal_old:>7.3f}")
    med = statistics.median
    print(f"median error: {med(errs):+.0%} (old overlap {med(old_errs):+.0%}); scaling past 8 GPUs, median "
          f"error {med(scal_errs):+.1%} (old {med(old_scal_errs):+.1%})")
    print("scal: tokens/s/GPU over the same model's 8-GPU row (published, predicted, old)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
