"""Figures for `planner search` (prints them; not a test).

1. Wall and CPU time of the default command `planner search --instance ml.p3.16xlarge` (fresh study) and of
   `planner search --instance all` over --runs runs (target: <= 3 s and <= 5 s wall on 2 idle cores; wall
   time also counts whatever else shares the cores, so the CPU time and the load average are printed
   beside it).
2. Estimates/s: `planner.estimate` on distinct points (no cache), and the objective as a search calls it
   (the per-configuration cache answers the points TPE proposes again; target >= 2,000/s), each twice: with
   the allocator replayed in Python (what a default search of ~100 trials gets: it never loads the compiled
   replay) and with the compiled replay loaded (what a longer search gets once it has replayed
   `planner.memory.compiled.COMPILE_AFTER` steps; its one-off load time is printed). The objective figure
   is over the points of 5 default searches (seeds 0-4), 3 passes (median and range): one cyclic garbage
   collection can double a 0.1 s run.
3. Storage: ms to persist one finished trial in the journal file (the default) and in SQLite (WAL).
4. The default search (several types: each type's descent, then TPE) against the exhaustive optimum on a
   joint space small enough to enumerate (3 instance types × parallelism × precision × checkpointing ×
   micro-batch × attention × optimizer kernels), over several seeds with the default trial budget: how many seeds reach >= 99 % of the optimum (target: 9 of 10).
5. Each type of `--instance all` against a search of that type alone (issue 22): the best value of every
   type in the joint study vs the best of `planner search --instance <type>` with the same objective (cost
   per job, the default with several types, and samples/s, which also ranks the types without a price);
   target: every type within 1 %. Types with no feasible row in either search (no price, for cost) are
   counted apart.

The process is tuned as the `planner` command tunes its own (`planner.cli.main.claim_process`: the collector's
thresholds, the objects frozen when the compiled replay loads), so the figures are what the command runs.

Usage: python benchmarks/search_benchmark.py [--seeds 10] [--runs 3] [--no-cli] [--no-per-type] [--fake] [--cpu]
(--cpu: figure 2's rates per CPU second of this process, for a shared machine; compare two builds measured
the same way one after the other.)
(--fake uses the toy estimate of tests/search_fixtures.py, to time the machinery alone).
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The enumerable joint space of figure 4: three instance types with 1, 4 and 8 GPUs, V100 and A10G.
JOINT_TYPES = ("ml.p3.2xlarge", "ml.p3.8xlarge", "ml.g5.12xlarge")
JOINT_SPACE = {"parallelisms": ["ddp", "zero2", "fsdp"]}


def estimate_fn(fake: bool):
    if fake:
        sys.path.insert(0, str(ROOT / "tests"))
        from search_fixtures import fake_estimate

        return fake_estimate
    from planner.estimate import estimate

    return estimate


def bench_cli(args: list[str]) -> tuple[float, float, str, dict]:
    """(wall s, CPU s, the `best:` output line, best.json) of `planner search ARGS` in a fresh results folder."""
    import json

    with tempfile.TemporaryDirectory() as tmp:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "planner", "search", *args, "--results-dir", tmp,
                               "--no-progress"], capture_output=True, text=True, cwd=ROOT,
                              env=dict(os.environ, PYTHONPATH=str(ROOT)))
        wall = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if proc.returncode != 0:
            print(proc.stdout[-2000:], proc.stderr[-2000:])
        cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
        best = next((line for line in proc.stdout.splitlines() if line.startswith("best:")), "")
        files = list(Path(tmp).glob("*/best.json"))
        data = json.loads(files[0].read_text()) if files else {}
        return wall, cpu, best, data


def check_best(data: dict, types: int) -> str:
    """Whether `best` is the cheapest per job among `best_per_instance`, and how many types have a row."""
    per = data.get("best_per_instance") or []
    best = (data.get("best") or {}).get("usd_per_job")
    cheapest = min((r["usd_per_job"] for r in per if r.get("usd_per_job") is not None), default=None)
    same = best is not None and cheapest is not None and abs(best - cheapest) <= 1e-9 * max(1.0, cheapest)
    return (f"best ${best:.4f}/job {'=' if same else '!='} cheapest of best_per_instance ${cheapest:.4f}/job; "
            f"{len(per)}/{types} instance types have a feasible configuration")


def bench_per_type(target: str, fake: bool) -> tuple[list[tuple[str, float, float]], list[str]]:
    """([(type, joint best, alone best)], types with no feasible row in either) for `--instance all` with
    objective `target`; each search is a fresh study with the default budget, as the command runs it."""
    from planner.hardware import list_instances
    from planner.search.study import run_search
    from planner.search.sweep import DEFAULT_SWEEP

    def bests(types: tuple[str, ...]) -> tuple[dict[str, float], str]:
        """(best value per type with a feasible row, direction) of a fresh default search over `types`."""
        sweep = DEFAULT_SWEEP.with_overrides(instance=types, objective={"target": target})
        with tempfile.TemporaryDirectory() as tmp:
            result = run_search(sweep, results_dir=tmp, estimate_fn=estimate_fn(fake), write_files=False)
        ok = result.frame[result.frame.feasible].groupby("instance")["value"]
        return (ok.max() if result.direction == "maximize" else ok.min()).to_dict(), result.direction

    names = tuple(list_instances())
    joint = bests(names)[0]
    rows, neither = [], []
    for name in names:
        alone = bests((name,))[0].get(name)
        if alone is None and name not in joint:
            neither.append(name)
            continue
        rows.append((name, joint.get(name, math.nan), math.nan if alone is None else alone))
    return rows, neither


def shortfall(joint: float, alone: float, direction: str) -> float:
    """How much worse the joint study's best is than the type's own search (0 = as good or better)."""
    if math.isnan(joint):
        return math.inf
    if math.isnan(alone):
        return 0.0
    ratio = alone / joint if direction == "maximize" else joint / alone
    return max(0.0, ratio - 1.0)


def objective_for(sweep, fake: bool):
    from planner.hardware import get_instance
    from planner.models.catalog import cached_model
    from planner.search.objective import Objective
    from planner.search.space import resolve_space

    model = cached_model(sweep.model, sweep.model_options)
    types = [get_instance(n) for n in sweep.instance_names()]
    space = resolve_space(sweep.seq_space(), model, types, min_seq_len=sweep.constraints.min_seq_len,
                          fixed=sweep.fixed, global_batch_size=sweep.recipe.global_batch_size)
    return Objective(model, types, space, constraints=sweep.constraints, objective=sweep.objective,
                     recipe=sweep.recipe, target=sweep.target(), estimate_fn=estimate_fn(fake))


def compiled_loaded() -> bool:
    """Load the compiled allocator replay (loading runs it once, which loads its machine code)."""
    from planner.memory import compiled

    return compiled.warm()


def grid_points(space) -> list[dict]:
    dims = space.searched()
    return [dict(zip(dims, combo, strict=True)) for combo in itertools.product(*dims.values())]


def exhaustive(sweep, fake: bool) -> dict:
    """Every point of the sweep's joint space, each estimated once (no cache hits): estimates/s and the optimum."""
    obj = objective_for(sweep, fake)
    points = [obj.space.point(p) for p in grid_points(obj.space)]
    runnable = [p for p in points if p.config is not None]
    obj.evaluate_point(runnable[0])  # warm the model and import caches
    obj._cache.clear()
    obj.evaluations = 0
    start = time.perf_counter()
    results = [obj.evaluate_point(p) for p in points]
    elapsed = time.perf_counter() - start
    feasible = [r.value for r in results if r.feasible]
    best = max(feasible) if obj.direction == "maximize" else min(feasible)
    return {"points": len(points), "estimates": obj.evaluations, "estimates_per_s": obj.evaluations / elapsed,
            "feasible": len(feasible), "optimum": best, "direction": obj.direction}


CLOCK = time.perf_counter  # figure 2's clock: wall seconds, or this process's CPU seconds with --cpu


def objective_rate(sweep, fake: bool, trials: int, seeds: int = 5, passes: int = 3) -> tuple[list[float], float]:
    """(objective calls/s of each pass, cache hit fraction) over the points TPE runs of `seeds` seeds propose:
    each pass replays every run's points on a fresh objective with cold caches, and its rate is all calls over
    all their time (a single 0.1 s run can be doubled by one cyclic garbage collection; passes show the spread
    that remains)."""
    from planner.search.study import run_search

    runs = []
    for seed in range(seeds):
        with tempfile.TemporaryDirectory() as tmp:
            result = run_search(sweep, trials=trials, results_dir=tmp, estimate_fn=estimate_fn(fake),
                                write_files=False, seed=seed)
        space = result.run.space
        runs.append([space.point(space.decode(t.params)) for t in result.run.trials])
    rates = []
    for _ in range(passes):
        calls = evaluations = 0
        elapsed = 0.0
        for points in runs:
            obj = objective_for(sweep, fake)
            if not fake:  # an earlier run left every step's trace and replay cached
                from planner.estimate import clear_caches

                clear_caches()
                obj.evaluate_point(points[0])  # the model's own facts, once, as a search computes them at its start
                obj._cache.clear()
                obj.evaluations = 0
            start = CLOCK()
            for p in points:
                obj.evaluate_point(p)
            elapsed += CLOCK() - start
            calls += len(points)
            evaluations += obj.evaluations
        rates.append(calls / elapsed)
    return rates, 1 - evaluations / calls


def bench_storage(fake: bool, trials: int) -> dict[str, float]:
    """ms per persisted trial: the same search into a journal file and into SQLite (WAL)."""
    from planner.search.study import run_search
    from planner.search.sweep import DEFAULT_SWEEP

    out = {}
    for kind in ("journal", "sqlite"):
        with tempfile.TemporaryDirectory() as tmp:
            storage = None if kind == "journal" else f"sqlite:///{Path(tmp) / 'study.db'}"
            run_search(DEFAULT_SWEEP, trials=5, study="warm", storage=storage, results_dir=tmp,
                       estimate_fn=estimate_fn(fake), write_files=False)
            start = time.perf_counter()
            result = run_search(DEFAULT_SWEEP, trials=trials, study="s", storage=storage, results_dir=tmp,
                                estimate_fn=estimate_fn(fake), write_files=False)
            elapsed = time.perf_counter() - start
            out[kind] = 1000 * elapsed / result.run.new_trials
    return out


def bench_tpe(sweep, fake: bool, seeds: int, optimum: float, direction: str) -> list[float]:
    """The final best / optimum of a default-budget TPE search, per seed (1.0 = the optimum)."""
    from planner.search.study import run_search

    ratios = []
    for seed in range(seeds):
        with tempfile.TemporaryDirectory() as tmp:
            result = run_search(sweep, seed=seed, results_dir=tmp, estimate_fn=estimate_fn(fake), write_files=False,
                                sampler="tpe")
        ok = result.frame[result.frame.feasible]
        best = ok.value.max() if direction == "maximize" else ok.value.min()
        ratios.append(best / optimum if direction == "maximize" else optimum / best)
    return ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--fake", action="store_true", help="toy estimate: time the machinery alone")
    parser.add_argument("--no-cli", action="store_true")
    parser.add_argument("--runs", type=int, default=3, help="runs of `planner search --instance all`")
    parser.add_argument("--no-per-type", action="store_true", help="skip figure 5 (~40 s)")
    parser.add_argument("--cpu", action="store_true",
                        help="figure 2 over this process's CPU seconds, not wall seconds (a shared machine)")
    args = parser.parse_args()
    from planner.cli.main import claim_process
    from planner.search.study import default_trials
    from planner.search.sweep import DEFAULT_SWEEP

    if args.cpu:  # the objective's rate over CPU time: other processes' load stretches wall time only
        global CLOCK
        CLOCK = time.process_time
    claim_process()  # time what the `planner` command runs: its process, tuned as the command tunes it

    print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; estimate: "
          f"{'fake' if args.fake else 'planner.estimate'}")
    if not args.no_cli and not args.fake:
        from planner.hardware import list_instances

        for flags in (["--instance", "ml.p3.16xlarge"], ["--instance", "all"]):
            runs = [bench_cli(flags) for _ in range(args.runs if flags[-1] == "all" else 1)]
            walls, cpus = [r[0] for r in runs], [r[1] for r in runs]
            print(f"`planner search {' '.join(flags)}` (fresh study, {len(runs)} run(s)): {min(walls):.2f}-"
                  f"{max(walls):.2f} s wall, {min(cpus):.2f}-{max(cpus):.2f} s CPU; load average "
                  f"{os.getloadavg()[0]:.1f}")
            print(f"  {runs[-1][2][:150]}")
            if flags[-1] == "all":
                print(f"  {check_best(runs[-1][3], len(list_instances()))}; "
                      f"{runs[-1][3].get('trials')} trials")
    for replay in ("python", "compiled"):
        os.environ["PLANNER_COMPILED_REPLAY"] = "0" if replay == "python" else "1"
        if replay == "compiled" and not args.fake:
            start = time.perf_counter()
            if not compiled_loaded():
                print("the compiled replay is not available here (no Numba)")
            print(f"compiled replay loaded in {time.perf_counter() - start:.2f} s (once per process)")
        default = exhaustive(DEFAULT_SWEEP, args.fake)
        print(f"[{replay} replay] estimate: {default['estimates_per_s']:,.0f} estimates/s over the "
              f"{default['estimates']} runnable points of the default space ({default['points']} points, no cache)")
        rates, hits = objective_rate(DEFAULT_SWEEP, args.fake, default_trials(1))
        print(f"[{replay} replay] objective as the default search calls it: {statistics.median(rates):,.0f} calls/s "
              f"over 5 searches' points (median of {len(rates)} passes, {min(rates):,.0f}-{max(rates):,.0f}; "
              f"{hits:.0%} answered by the per-configuration cache; target >= 2,000/s)")
    del os.environ["PLANNER_COMPILED_REPLAY"]
    storage = bench_storage(args.fake, 100)
    print(f"storage per finished trial: journal file {storage['journal']:.1f} ms, SQLite (WAL) "
          f"{storage['sqlite']:.1f} ms (whole search, estimate included)")
    joint = DEFAULT_SWEEP.with_overrides(instance=JOINT_TYPES, space=JOINT_SPACE, objective={"target": "cost"})
    ex = exhaustive(joint, args.fake)
    budget = default_trials(len(JOINT_TYPES))
    print(f"joint space {', '.join(JOINT_TYPES)} (cost per job): {ex['points']} points, {ex['feasible']} feasible, "
          f"exhaustive optimum ${ex['optimum']:.4f}/job ({ex['estimates_per_s']:,.0f} estimates/s)")
    ratios = bench_tpe(joint, args.fake, args.seeds, ex["optimum"], ex["direction"])
    n99 = sum(r >= 0.99 for r in ratios)
    print(f"default search (descents, then TPE), {budget} trials, {args.seeds} seeds: >= 99 % of the optimum on {n99}/"
          f"{args.seeds} seeds; reached the optimum on {sum(r >= 1 - 1e-9 for r in ratios)}; best/optimum "
          f"min {min(ratios):.4f}, median {statistics.median(ratios):.4f}")
    if not args.no_per_type:  # last: it loads the compiled replay, which the figures above time
        for target, direction in (("cost", "minimize"), ("throughput", "maximize")):
            rows, neither = bench_per_type(target, args.fake)
            gaps = [(shortfall(j, a, direction), n, j, a) for n, j, a in rows]
            within = sum(g <= 0.01 for g, *_ in gaps)
            worst = max(gaps)
            print(f"`--instance all` by {target}, each type vs a search of it alone: {within}/{len(rows)} types "
                  f"within 1 % (worst {worst[1]}: {worst[0]:.2%} short, {worst[2]:.4g} vs {worst[3]:.4g})"
                  + (f"; {len(neither)} with no feasible row in either search (e.g. no price)" if neither else ""))
            for gap, name, in_joint, alone in sorted(gaps, reverse=True):
                if gap > 0.01:
                    print(f"  {name}: joint {in_joint:.4g}, alone {alone:.4g} ({gap:.2%} short)")


if __name__ == "__main__":
    main()
