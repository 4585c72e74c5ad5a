"""How often the replayed peak reserved DROPS when the batch (or the sequence) grows, and why (prints).

Unlimited replays (no capacity, so no OOM retry / empty_cache is involved), bert-base-uncased and gpt2,
s in 64..512, fp32 and amp-fp16, b = 1..32; three variants of the same events:
- first + steady step (what `estimate` replays), - steady step only (`reserved.REPLAY_FIRST_STEP = False`),
- first + steady step with PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:200 (oversize cached blocks not split).
For the largest drop it names the allocation that set the peak on each side.
Usage: python benchmarks/reserved_monotonicity.py
"""

from __future__ import annotations

import importlib
import itertools

MODELS = ["bert-base-uncased", "gpt2"]
SEQS = [64, 128, 256, 512]
PRECISIONS = ["fp32", "amp-fp16"]
BATCHES = range(1, 33)
MAX_SPLIT_200MB = 200 * 1024 * 1024


def main() -> None:
    from planner.memory import allocator, events, reserved
    from planner.spec import TrainConfig

    est = importlib.import_module("planner.estimate")

    def trace(model, b, s, p):
        prep = est._prepare(model, TrainConfig(batch_size=b, seq_len=s, precision=p), "ml.p4d.24xlarge", None,
                            "cuda", None)
        return reserved._build_trace(prep.spec, prep.cfg, prep.step, prep.activations, 1.0, 1.0, 1.0, "cuda")

    for label, first, max_split in (("first + steady step", True, None), ("steady step only", False, None),
                                    ("first + steady, max_split_size_mb:200", True, MAX_SPLIT_200MB)):
        reserved.REPLAY_FIRST_STEP = first
        res = {}
        for model, s, p, b in itertools.product(MODELS, SEQS, PRECISIONS, BATCHES):
            t = trace(model, b, s, p)
            res[model, s, p, b] = (allocator.fast_run(t.events, max_split_size=max_split)[0], t)
        worst, drops_b, steps_b, drops_s, steps_s = None, 0, 0, 0, 0
        for (model, s, p, b), (r, _) in res.items():
            if b > 1:
                prev = res[model, s, p, b - 1][0]
                steps_b += 1
                if r.peak_reserved < prev.peak_reserved:
                    drops_b += 1
                    drop = prev.peak_reserved - r.peak_reserved
                    if worst is None or drop > worst[0]:
                        worst = (drop, (model, s, p, b - 1), (model, s, p, b))
            if s != SEQS[0]:
                steps_s += 1
                drops_s += r.peak_reserved < res[model, SEQS[SEQS.index(s) - 1], p, b][0].peak_reserved
        print(f"{label}: drops in b {drops_b} of {steps_b}, in s {drops_s} of {steps_s}")
        if worst:
            drop, lo, hi = worst
            for key in (lo, hi):
                r, t = res[key]
                print(f"   {key}: peak reserved {r.peak_reserved / 2**20:,.0f} MiB set by "
                      f"{events.tensor_name(t, r.peak_tensor)} (event {r.peak_event} of {len(t.events)})")
            print(f"   largest drop {drop / 2**20:,.0f} MiB")
    reserved.REPLAY_FIRST_STEP = True


if __name__ == "__main__":
    main()
