"""Figures for `planner search` (prints them; not a test).

1. Objective speed: estimates/s (every point of the default space, no cache) and trials/s of a whole
   search with its SQLite storage.
2. Wall time of the default command `planner search --instance ml.p3.16xlarge` (a fresh study).
3. TPE against the exhaustive grid on the same space: over several seeds, how often TPE reaches the
   grid's optimum (and >= 99% of it), and after how many trials.

Usage: python benchmarks/search_benchmark.py [--instance ml.p3.16xlarge] [--seeds 10] [--budget 200] [--fake]
(--fake uses the toy estimate of tests/search_fixtures.py, to time the machinery alone).
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def estimate_fn(fake: bool):
    if fake:
        sys.path.insert(0, str(ROOT / "tests"))
        from search_fixtures import fake_estimate

        return fake_estimate
    from planner.estimate import estimate

    return estimate


def objective_for(instance: str, fake: bool):
    from planner.hardware import get_instance
    from planner.models.catalog import cached_model
    from planner.search.objective import Objective
    from planner.search.space import resolve_space
    from planner.search.sweep import DEFAULT_SWEEP

    sweep = DEFAULT_SWEEP
    model = cached_model(sweep.model, sweep.model_options)
    inst = get_instance(instance)
    space = resolve_space(sweep.space, model, inst, fixed=sweep.fixed)
    return Objective(model, inst, space, constraints=sweep.constraints, objective=sweep.objective,
                     estimate_fn=estimate_fn(fake))


def grid_points(space) -> list[dict]:
    dims = space.searched()
    return [dict(zip(dims, combo, strict=True)) for combo in itertools.product(*dims.values())]


def bench_objective(instance: str, fake: bool) -> dict:
    obj = objective_for(instance, fake)
    points = grid_points(obj.space)
    obj.evaluate(obj.space.config(points[0]))  # warm caches (model, imports)
    obj._cache.clear()
    start = time.perf_counter()
    results = [obj.evaluate(obj.space.config(p)) for p in points]
    elapsed = time.perf_counter() - start
    feasible = [r.value for r in results if r.feasible]
    best = max(feasible) if obj.direction == "maximize" else min(feasible, default=None)
    return {"points": len(points), "evals_per_s": len(points) / elapsed, "feasible": len(feasible),
            "grid_optimum": best, "direction": obj.direction}


def bench_tpe(instance: str, fake: bool, seeds: int, budget: int, optimum: float) -> dict:
    """TPE on the in-memory study (what the search samples in), per seed: trials to reach the optimum."""
    import optuna

    from planner.search.study import make_sampler

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    to_opt, to_99, final = [], [], []
    per_trial = []
    for seed in range(seeds):
        obj = objective_for(instance, fake)
        study = optuna.create_study(direction=obj.direction, sampler=make_sampler("tpe", obj.space, seed))
        best = None
        hit_opt = hit_99 = None
        start = time.perf_counter()
        for n in range(1, budget + 1):
            trial = study.ask()
            value = obj(trial)
            study.tell(trial, value)
            ev = obj.evaluate(obj.space.config(obj.space.decode(trial.params)))
            if ev.feasible and (best is None or value > best):
                best = value
            if best is not None and hit_99 is None and best >= 0.99 * optimum:
                hit_99 = n
            if best is not None and hit_opt is None and best >= optimum * (1 - 1e-12):
                hit_opt = n
        per_trial.append((time.perf_counter() - start) / budget)
        to_opt.append(hit_opt)
        to_99.append(hit_99)
        final.append((best or 0.0) / optimum)
    return {"seeds": seeds, "budget": budget, "to_opt": to_opt, "to_99": to_99, "final_ratio": final,
            "sampler_ms_per_trial": 1000 * statistics.mean(per_trial)}


def bench_cli(instance: str) -> tuple[float, float]:
    """(wall s, CPU s) of the default command in a fresh results folder; CPU time is what the figure is
    on an otherwise idle machine (wall time counts other processes sharing the cores)."""
    import resource

    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, COLUMNS="160")
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "planner", "search", "--instance", instance,
                               "--results-dir", tmp, "--no-progress"], capture_output=True, text=True, env=env,
                              cwd=tmp)
        elapsed = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if proc.returncode != 0:
            print(proc.stdout[-2000:], proc.stderr[-2000:])
        cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
        return elapsed, cpu


def bench_search(instance: str, fake: bool, trials: int) -> float:
    from planner.search.study import run_search
    from planner.search.sweep import DEFAULT_SWEEP

    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        run_search(DEFAULT_SWEEP.with_overrides(instance=instance), trials=trials, results_dir=tmp,
                   estimate_fn=estimate_fn(fake))
        return trials / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--instance", default="ml.p3.16xlarge")
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--budget", type=int, default=None, help="TPE trials (default: the default trial count)")
    parser.add_argument("--fake", action="store_true", help="toy estimate: time the machinery alone")
    parser.add_argument("--no-cli", action="store_true")
    args = parser.parse_args()
    from planner.search.sweep import DEFAULT_TRIALS

    budget = args.budget or DEFAULT_TRIALS
    print(f"machine: {os.cpu_count()} CPUs; estimate: {'fake' if args.fake else 'planner.estimate'}; "
          f"instance {args.instance}")
    obj = bench_objective(args.instance, args.fake)
    print(f"objective: {obj['evals_per_s']:,.0f} estimates/s over the {obj['points']} points of the default space "
          f"({obj['feasible']} feasible); grid optimum {obj['grid_optimum']:.2f}")
    print(f"search with SQLite storage: {bench_search(args.instance, args.fake, budget):,.0f} trials/s")
    if not args.no_cli and not args.fake:
        wall, cpu = bench_cli(args.instance)
        print(f"`planner search --instance {args.instance}` (fresh study, {DEFAULT_TRIALS} trials): "
              f"{wall:.2f} s wall, {cpu:.2f} s CPU; load average now {os.getloadavg()[0]:.1f}")
    tpe = bench_tpe(args.instance, args.fake, args.seeds, budget, obj["grid_optimum"])
    n = tpe["seeds"]
    reached = [x for x in tpe["to_opt"] if x is not None]
    reached99 = [x for x in tpe["to_99"] if x is not None]
    print(f"TPE vs grid ({obj['points']} points), {n} seeds × {budget} trials "
          f"(sampler {tpe['sampler_ms_per_trial']:.1f} ms/trial):")
    print(f"  reached the grid optimum: {len(reached)}/{n} seeds; trials needed: "
          f"median {statistics.median(reached) if reached else '-'}, max {max(reached) if reached else '-'}")
    print(f"  reached >= 99% of it:     {len(reached99)}/{n} seeds; trials needed: "
          f"median {statistics.median(reached99) if reached99 else '-'}, max {max(reached99) if reached99 else '-'}")
    print(f"  final best / optimum: min {min(tpe['final_ratio']):.4f}, mean {statistics.mean(tpe['final_ratio']):.4f}")
    for cut in (50, 100, 150, 200, 300):
        if cut <= budget:
            hits = sum(1 for x in tpe["to_99"] if x is not None and x <= cut)
            print(f"  within {cut:>3} trials: {hits}/{n} seeds at >= 99%")


if __name__ == "__main__":
    main()
