"""Speed of `planner.estimate` with the caching-allocator replay on, against the flat fragmentation (prints).

The target (issue 8): >= 1,000 configurations/s on 2 cores with the allocator on. Three figures:
- flat: `runtime={"fragmentation": 0.10}` (no replay; what estimate cost before the allocator model);
- allocator, distinct steps: every configuration a new step (cold replay cache: the worst case);
- allocator, search-like: each step evaluated on several instance types and instance counts, as a search
  over instances does (the trace and the unlimited replay are cached per step);
- allocator, steady step only: `reserved.REPLAY_FIRST_STEP = False` (half the events, less faithful).
Usage: python benchmarks/estimate_benchmark.py [--quick]
"""

from __future__ import annotations

import argparse
import itertools
import time

MODELS = ["bert-base-uncased", "gpt2", "roberta-base", "distilbert-base-uncased"]
PRECISIONS = ["fp32", "amp-fp16"]
INSTANCES = ["ml.p3.2xlarge", "ml.p3.8xlarge", "ml.p3.16xlarge"]  # one GPU family: same runtime constants


def configs(quick: bool):
    from planner.spec import TrainConfig

    batches = [1, 4, 8, 16, 32] if quick else [1, 2, 4, 8, 12, 16, 24, 32]
    seqs = [128, 512] if quick else [64, 128, 256, 512]
    for m, b, s, p, ckpt in itertools.product(MODELS, batches, seqs, PRECISIONS, [False, True]):
        yield m, TrainConfig(batch_size=b, seq_len=s, precision=p, checkpointing=ckpt)


def rate(items, **kw) -> tuple[float, int]:
    from planner.estimate import estimate

    t0 = time.perf_counter()
    for model, cfg, inst in items:
        estimate(model, cfg, inst, **kw)
    return len(items) / (time.perf_counter() - t0), len(items)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    from planner.estimate import estimate
    from planner.memory import reserved

    cfgs = list(configs(args.quick))
    estimate(cfgs[0][0], cfgs[0][1], INSTANCES[0])  # warm imports and model caches
    single = [(m, c, INSTANCES[0]) for m, c in cfgs]
    flat, n = rate(single, runtime={"fragmentation": 0.10})
    print(f"flat fragmentation (no replay)          {flat:8.0f} configs/s  ({n} configs)")
    reserved.clear_caches()
    cold, n = rate(single)
    print(f"allocator, distinct steps (cold cache)   {cold:8.0f} configs/s  ({n} configs)")
    reserved.clear_caches()
    search = [(m, c.model_copy(update={"instances": k}), inst) for m, c in cfgs for inst in INSTANCES
              for k in (1, 2)]
    warm, n = rate(search)
    print(f"allocator, search-like (3 types x 2)     {warm:8.0f} configs/s  ({n} configs)")
    reserved.clear_caches()
    reserved.REPLAY_FIRST_STEP = False
    steady, n = rate(single)
    print(f"allocator, steady step only (cold)       {steady:8.0f} configs/s  ({n} configs)")


if __name__ == "__main__":
    main()
