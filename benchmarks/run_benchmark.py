"""What simulating a run of varying lengths costs (prints): BERT-base, micro-batch 32, AMP bf16, lengths
uniform 64-512 step 8, on one H100 (`ml.p5.48xlarge`, parallelism single).

Target (issue 23): 200 steps in <= 0.5 s with the compiled replay, so a search over runs stays within its
budgets. Rows, each the median of `--repeat` runs:
- cold: a new run (fresh caches): each distinct length's step prepared and laid out (57 lengths), the run
  laid out and replayed; what one `planner estimate --lengths` pays beyond its one step;
- replay only: the same run's program replayed again (steps already laid out), compiled and in Python;
- expandable segments: the block-object model (`allocator.run_reference`), the only one that has them.
The compiled kernel is loaded before the clock starts (its one-off load time is printed).

Usage: python benchmarks/run_benchmark.py [--steps 200] [--repeat 5]
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()

    import importlib

    est_mod = importlib.import_module("planner.estimate")  # the module (planner.estimate is also a function)
    from planner.memory import compiled
    from planner.run import replay as rr
    from planner.run import simulate
    from planner.spec import TrainConfig

    t = time.perf_counter()
    loaded = compiled.warm()
    print(f"compiled replay: {'loaded' if loaded else 'unavailable'} in {time.perf_counter() - t:.2f} s (once per "
          "process)")
    cfg = TrainConfig(batch_size=32, seq_len=512, precision="amp-bf16", parallelism="single")
    req = simulate.request("uniform:64-512:8", steps=args.steps, seed=0)
    est_mod.estimate("bert-base-uncased", cfg, "ml.p5.48xlarge", with_throughput=False)  # the model, warm

    cold = []
    for _ in range(args.repeat):
        est_mod.clear_caches()
        est_mod.estimate("bert-base-uncased", cfg, "ml.p5.48xlarge", with_throughput=False)  # the one step
        t = time.perf_counter()
        e = est_mod.estimate("bert-base-uncased", cfg, "ml.p5.48xlarge", with_throughput=False, run=req)
        cold.append(time.perf_counter() - t)
    one = []
    for _ in range(args.repeat):
        est_mod.clear_caches()
        t = time.perf_counter()
        est_mod.estimate("bert-base-uncased", cfg, "ml.p5.48xlarge", with_throughput=False)
        one.append(time.perf_counter() - t)
    r = e.run
    print(f"run: {r.steps} steps, {r.events:,} allocator events, peak reserved {r.peak_reserved_bytes / 2**30:.2f} "
          f"GiB at step {r.peak_step}")
    print(f"cold run beyond its one step (57 lengths prepared, laid out, replayed): "
          f"{statistics.median(cold):.3f} s (one step alone, cold: {statistics.median(one):.3f} s)")

    at = simulate.StepsAt(est_mod._prepare("bert-base-uncased", cfg, "ml.p5.48xlarge", None, "cuda", None),
                          None, "cuda", None, None, est_mod.run_steps())
    padded = simulate.plan(req, 32, 512, args.steps).padded
    program = rr.lay_out(simulate._sections(at, padded))
    for label, kwargs in (("compiled", {"compiled_ok": True}), ("Python (fast_run)", {"compiled_ok": False}),
                          ("expandable segments (run_reference)", {"expandable_segments": True})):
        if label == "compiled" and not loaded:
            continue
        times = []
        for _ in range(args.repeat if label == "compiled" else max(1, args.repeat // 2)):
            t = time.perf_counter()
            rr.replay(program, **kwargs)
            times.append(time.perf_counter() - t)
        print(f"replay only, {label}: {statistics.median(times):.3f} s "
              f"({statistics.median(times) / program.n_events * 1e9:.0f} ns per event)")


if __name__ == "__main__":
    main()
