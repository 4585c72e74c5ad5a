"""Speed of `planner.estimate` with the caching-allocator replay on, against the flat fragmentation (prints).

The target (issues 8, 9): >= 1,000 configurations/s on 2 cores with the allocator and the roofline on. A step
of BERT-base is ~3,750 allocator events (first + steady step), laid out as ~200 ranges of tensor ids
(`events.Trace`; laid out from the ops recorded once per shape, `events._LAYOUTS`, `events._STRUCTURES`) and replayed
by the compiled kernel (`replay_kernel`, ~30 ns per event) once the process has replayed
`compiled.COMPILE_AFTER` steps; the kernel is loaded before the clock starts here (its one-off
load time is printed: a search that switches pays it once). Rows:
- flat: `runtime={"fragmentation": 0.10}` (no replay; what estimate cost before the allocator model);
- allocator, Python replay: distinct steps through `allocator.fast_run` (what a single `planner estimate`
  gets: it never loads the kernel);
- allocator, distinct steps: every configuration a new step (cold replay cache: the worst case);
- allocator, search-like: each step evaluated on several instance types and instance counts, as a search
  over instances does (the trace and the unlimited replay are cached per step);
- allocator, steady step only: `reserved.REPLAY_FIRST_STEP = False` (half the events, less faithful);
- allocator, distinct steps / search-like on 2 processes: those rows split over two forked workers (what a
  search with two workers gets from 2 cores; wall time of the whole batch).
Every allocator row starts from cold per-shape caches (`estimate.clear_caches`: activations, traces, trace
structures, replays);
the roofline's kernel tables (one per model and shape class, batch-free) stay warm from the flat row, as in any
search over batch sizes. The process is tuned as the `planner` command tunes its own
(`planner.cli.main.claim_process`: the collector's thresholds, the objects frozen when the compiled replay loads).
Usage: python benchmarks/estimate_benchmark.py [--quick]
"""

from __future__ import annotations

import argparse
import gc
import itertools
import multiprocessing
import os
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


def rate(items, **kw) -> tuple[float, float, int]:
    """(configurations per wall second, per CPU second of this process, count). On a shared machine the
    CPU figure is the steadier one: other processes' load stretches the wall time, not this one's CPU time."""
    from planner.estimate import estimate

    t0, c0 = time.perf_counter(), time.process_time()
    for model, cfg, inst in items:
        estimate(model, cfg, inst, **kw)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return len(items) / wall, len(items) / max(cpu, 1e-9), len(items)


def show(what: str, wall: float, cpu: float | None, n: int) -> None:
    cpu_text = f"{cpu:8.0f}" if cpu is not None else f"{'-':>8}"
    print(f"{what:40s} {wall:8.0f} {cpu_text} {n:8d}")


def _half(items) -> int:
    rate(items)
    return len(items)


def rate_two_processes(items) -> float:
    """Configurations per second of wall time, the items split over two forked workers. The parent's objects
    are frozen out of the collector first (`gc.freeze`, as Python's docs advise before a fork): otherwise each
    child's collections touch the inherited heap and copy its pages, a cost two independently started
    workers of a search do not pay."""
    gc.collect()
    gc.freeze()
    with multiprocessing.get_context("fork").Pool(2) as pool:
        pool.map(abs, [1, 2])  # the workers are up before the clock starts
        t0 = time.perf_counter()
        done = sum(pool.map(_half, [items[0::2], items[1::2]], chunksize=1))
        elapsed = time.perf_counter() - t0
    gc.unfreeze()
    return done / elapsed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    from planner.cli.main import claim_process
    from planner.estimate import clear_caches, estimate
    from planner.memory import compiled, reserved

    claim_process()  # time what the `planner` command runs: its process, tuned as the command tunes it

    cfgs = list(configs(args.quick))
    estimate(cfgs[0][0], cfgs[0][1], INSTANCES[0])  # warm imports and model caches
    single = [(m, c, INSTANCES[0]) for m, c in cfgs]
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(f"{'':40s} {'wall/s':>8} {'CPU/s':>8} {'configs':>8}")
    show("flat fragmentation (no replay)", *rate(single, runtime={"fragmentation": 0.10}))
    clear_caches()
    os.environ["PLANNER_COMPILED_REPLAY"] = "0"
    show("allocator, Python replay (cold cache)", *rate(single))
    del os.environ["PLANNER_COMPILED_REPLAY"]
    clear_caches()
    t0 = time.perf_counter()
    if not compiled.warm():
        print("the compiled replay is not available here (no Numba): the rows below replay in Python")
    print(f"{'(compiled replay loaded in ' + format(time.perf_counter() - t0, '.2f') + ' s, once)':40s}")
    show("allocator, distinct steps (cold cache)", *rate(single))
    clear_caches()
    search = [(m, c.model_copy(update={"instances": k}), inst) for m, c in cfgs for inst in INSTANCES
              for k in (1, 2)]
    show("allocator, search-like (3 types x 2)", *rate(search))
    clear_caches()
    reserved.REPLAY_FIRST_STEP = False
    show("allocator, steady step only (cold)", *rate(single))
    reserved.REPLAY_FIRST_STEP = True
    clear_caches()
    show("allocator, distinct steps, 2 processes", rate_two_processes(single), None, len(single))
    clear_caches()
    show("allocator, search-like, 2 processes", rate_two_processes(search), None, len(search))


if __name__ == "__main__":
    main()
