"""Speed and memory of the tracer (`planner.program.trace`), and its agreement with the analytic core (prints).

First, issue 38: the first and the second `planner estimate --json` of T5-base, BART-base, Qwen2-0.5B (their
config.json files, traced) and a user ResNet-18 (examples/resnet.py), each in a new process, with an empty
trace cache before the first (a temporary PLANNER_CACHE_DIR): seconds of wall time and of CPU (user + sys;
the wall time on a shared machine is noisy) and whether the two answers are identical; a catalog model for
comparison. Targets: T5-base at 16 x 512 <= 3 s the first time, <= 1 s the second. Then a 100-trial
`planner search` over a traced model (<= 30 s), in a new process with an empty trace cache.

Targets (issue 12), each traced in a fresh process so its peak RSS is its own:
- BERT-base (bert-base-uncased config, BertForSequenceClassification) at batch 32 × 512: <= 10 s, <= 2 GB;
- Llama-3-8B dimensions (the catalog's llama-3-8b config, LlamaForCausalLM) at batch 1 × 2048, bf16:
  <= 60 s, <= 4 GB (nothing is materialised: FakeTensorMode).
Then examples/multimodal_bert.py (traced) against the catalog's multimodal-bert (analytic) at 8 × 512, and a
30-trial `planner search` over it (issue 12: a traced model is traced once per shape class, so a search over
it stays interactive).
Usage: python benchmarks/trace_benchmark.py [--quick] [--repeat N] [--search-only] [--baseline DIR] [--layers]
[--breakdown]
(--quick: the estimates of issue 38 only; --repeat: medians of N runs; --search-only: the search only;
--breakdown: T5-base's first estimate stage by stage, CPU seconds (interpreter, the planner's modules, torch,
torch._dynamo, transformers, T5's modeling module, the trace's forward and backward, the optimizer step in its
forked child, the rest of the estimate, the exit), medians of N (default 3) new processes;
--baseline: another checkout, e.g. `git archive main | tar -x -C DIR`, timed alongside each first estimate;
--layers: only the trace of each config.json model with its identical layers written out
(planner.program.periodic) against the whole model's, in this process: CPU seconds and whether they are equal)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's planner, not another one installed
RESNET = str(ROOT / "examples" / "resnet.py")
ESTIMATES = {  # label: planner estimate arguments
    "t5-base 16x512": ["-m", "tests/data/t5-base.json", "-b", "16", "-s", "512"],
    "bart-base 16x512": ["-m", "tests/data/bart-base.json", "-b", "16", "-s", "512"],
    "qwen2-0.5b 8x1024 bf16": ["-m", "tests/data/qwen2-0.5b.json", "-b", "8", "-s", "1024", "-p", "bf16",
                               "-i", "ml.g5.xlarge"],
    "user resnet-18 64x224": ["-m", f"{RESNET}:build", "--inputs", f"{RESNET}:batch", "--loss", f"{RESNET}:loss",
                              "-b", "64", "-s", "224", "-i", "ml.g5.xlarge"],
    "catalog bert-base 16x512": ["-m", "bert-base-uncased", "-b", "16", "-s", "512"],
}
SEARCH_TRIALS = 100
CASES = {
    "bert-base 32x512 fp32": ("bert-base-uncased", "BertForSequenceClassification", 32, 512, "fp32"),
    "llama-3-8b 1x2048 bf16": ("llama-3-8b", "LlamaForCausalLM", 1, 2048, "bf16"),
}


def one(name: str) -> dict:
    """Trace one case in this process; returns seconds (build + step), peak RSS, ops, events, saved bytes."""
    import resource
    import time

    from planner.models.catalog import catalog_config
    from planner.program import hf
    from planner.program.trace import trace_step
    from planner.spec import TrainConfig

    model, arch, b, s, precision = CASES[name]
    raw = catalog_config(model)
    raw["architectures"] = [arch]
    config = hf.hf_config_object(raw, model, "sdpa")
    start = time.perf_counter()
    trace = trace_step(hf.builder(config, model), hf.batch_maker(config, model),
                       TrainConfig(batch_size=b, seq_len=s, precision=precision), backend="cuda")
    seconds = time.perf_counter() - start
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    return {"seconds": seconds, "rss_bytes": rss, "ops": len(trace.ops), "events": len(trace.events),
            "parameters": trace.parameters["total"], "saved_bytes": trace.saved_bytes}


def agreement() -> list[tuple[str, int, int]]:
    from planner.estimate import estimate
    from planner.spec import TrainConfig

    example = str(ROOT / "examples" / "multimodal_bert.py")
    cfg = TrainConfig(batch_size=8, seq_len=512, parallelism="single")
    traced = estimate(f"{example}:build", cfg, "ml.p3.16xlarge", inputs=f"{example}:batch", with_throughput=False)
    analytic = estimate("multimodal-bert", cfg, "ml.p3.16xlarge", with_throughput=False)
    return [("parameters", traced.parameters["total"], analytic.parameters["total"])] + [
        (k, getattr(traced.memory_bytes, k), getattr(analytic.memory_bytes, k))
        for k in ("activations", "optimizer_states", "batch", "peak_allocated")]


def search(trials: int = SEARCH_TRIALS) -> dict:
    """A fresh `planner search` over examples/multimodal_bert.py on ml.p3.16xlarge (the default recipe):
    seconds, estimates made, direct traces (the rest come from the trace cache or are interpolated)."""
    from planner.program import sources
    from planner.search.study import run_search
    from planner.search.sweep import Sweep

    example = str(ROOT / "examples" / "multimodal_bert.py")
    sweep = Sweep(name="trace-benchmark", model=f"{example}:build", inputs=f"{example}:batch",
                  instance="ml.p3.16xlarge")
    import hashlib

    from planner.program import trace

    sources._user_trace.cache_clear()
    sources._traced_at_batch.cache_clear()
    sources._FAILED.clear()
    built = [0]
    real = trace._trace_step

    def counted(*args, **kwargs):  # the model itself traced (not a step spliced onto a kept trace)
        key = kwargs.get("before_key")
        kept = (key, kwargs.get("periodic", False))
        if key is None or not any(kept in getattr(trace, t, {}) for t in ("_BEFORE_STEP", "_FAILED_BEFORE_STEP")):
            built[0] += 1
        return real(*args, **kwargs)

    trace._trace_step = counted
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        result = run_search(sweep, trials=trials, results_dir=tmp, write_files=False)
    seconds = time.perf_counter() - start
    trace._trace_step = real
    # the trial table without the columns that name this checkout's path (study name, error reasons) or time it
    frame = result.frame
    table = frame.drop(columns=["study", "reason", *(c for c in frame.columns if "time" in c or "duration" in c)],
                       errors="ignore").to_csv()
    return {"seconds": seconds, "trials": len(result.frame),
            "estimates": result.run.evaluations, "traces": sources._user_trace.cache_info().misses,
            "interpolated": sources._traced_at_batch.cache_info().misses, "model_traces": built[0],
            "table_sha256": hashlib.sha256(table.encode()).hexdigest()[:16]}


def layers() -> None:
    """Issue 38: each config.json model of ESTIMATES traced with its runs of identical layers cut and written
    out, and whole (`trace_step(..., periodic=False)`), in this process after a small warm-up trace: CPU seconds
    of each, the layers written out, and whether the two traces are equal in every field."""
    from dataclasses import fields

    from planner.models.hf_config import load_config_file
    from planner.program import hf, periodic
    from planner.program.trace import trace_step
    from planner.spec import TrainConfig

    written: list[int] = []
    real = periodic.expand

    def counted(raw, run):
        out = real(raw, run)
        written.append(len(run.copies) if out is not None else 0)
        return out

    periodic.expand = counted
    print(f"{'trace (CPU seconds)':28s} {'cut':>6s} {'whole':>6s} {'layers written out':>19s} {'equal':>6s}")
    for label, args in ESTIMATES.items():
        if not args[1].endswith(".json"):
            continue
        path, b, s = args[1], int(args[3]), int(args[5])
        precision = args[args.index("-p") + 1] if "-p" in args else "fp32"
        hc = hf.hf_config_object(load_config_file(path), path, "sdpa")
        cfg = TrainConfig(batch_size=b, seq_len=s, precision=precision, attention="sdpa")
        trace_step(hf.builder(hc, path), hf.batch_maker(hc, path), cfg.model_copy(update={"batch_size": 2,
                                                                                        "seq_len": 8}))
        written.clear()
        t0 = time.process_time()
        cut = trace_step(hf.builder(hc, path), hf.batch_maker(hc, path), cfg)
        t1 = time.process_time()
        whole = trace_step(hf.builder(hc, path), hf.batch_maker(hc, path), cfg, periodic=False)
        t2 = time.process_time()
        same = all(getattr(cut, f.name) == getattr(whole, f.name) for f in fields(cut))
        print(f"{label:28s} {t1 - t0:6.2f} {t2 - t1:6.2f} {sum(written):19d} {'yes' if same else 'NO':>6s}", flush=True)
    periodic.expand = real


# T5-base's first estimate, stage by stage (`--breakdown`): what each stage imports or does, in the order the
# command meets them; each stage's CPU seconds are measured in one new process (`breakdown_case`).
BREAKDOWN_ARGS = ["estimate", *ESTIMATES["t5-base 16x512"], "--json"]
STAGES = (
    ("interpreter start", "python -c pass, timed apart"),
    ("planner command", "import planner.cli.main (typer, pydantic)"),
    ("torch", "import torch"),
    ("torch._dynamo", "for masking_utils, the tracer's dispatch"),
    ("transformers", "the package (scans models/) and AutoConfig"),
    ("T5's modeling module", "modeling_utils, hub kernels, scipy, ..."),
    ("trace: forward, backward", "build, FakeTensorMode, the recorder"),
    ("trace: optimizer step", "AdamW foreach, in a child where forked"),
    ("the rest of the estimate", "layers written out, pipeline, JSON"),
    ("exit", "os._exit after atexit: no teardown"),
)


def breakdown_case() -> dict:
    """In this (new) process: CPU seconds of each stage of STAGES but the first and the last, by importing
    the modules in the command's order, then running the command's `main` with the timers on the tracer."""
    import io
    from contextlib import redirect_stdout

    lap = [time.process_time()]
    out: dict[str, float] = {}

    def stage(name: str) -> None:
        now = time.process_time()
        out[name] = now - lap[0]
        lap[0] = now

    import planner.cli.main as cli

    cli.claim_process()  # as the command does (the collector's threshold)
    stage("planner command")
    import torch  # noqa: F401

    stage("torch")
    import torch._dynamo  # noqa: F401

    stage("torch._dynamo")
    import transformers
    from transformers import AutoConfig  # noqa: F401

    transformers.T5Config  # noqa: B018 - the config class, as hf_config_object makes it
    stage("transformers")
    import transformers.models.t5.modeling_t5  # noqa: F401

    stage("T5's modeling module")
    from planner.program import trace

    spent = {"trace": 0.0}
    real = trace._trace_step

    def timed_trace(*args, **kwargs):
        t0 = time.process_time()
        try:
            return real(*args, **kwargs)
        finally:
            spent["trace"] += time.process_time() - t0

    trace._trace_step = timed_trace
    real_step = trace._traced_optimizer_step

    def timed_step(*args, **kwargs):  # the step traced here: no child (the load, one CPU) or a wrong guess
        t0 = time.process_time()
        try:
            return real_step(*args, **kwargs)
        finally:
            spent["step"] = spent.get("step", 0.0) + time.process_time() - t0

    trace._traced_optimizer_step = timed_step
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    sys.argv = ["planner", *BREAKDOWN_ARGS]
    with redirect_stdout(io.StringIO()) as answer:
        try:
            cli.app()
        except SystemExit:
            pass
    child = resource.getrusage(resource.RUSAGE_CHILDREN)
    total = time.process_time() - lap[0]
    here = spent.get("step", 0.0)
    out["trace: forward, backward"] = spent["trace"] - here
    out["trace: optimizer step"] = here + (child.ru_utime - children.ru_utime) + (child.ru_stime - children.ru_stime)
    out["forked"] = here == 0.0
    out["the rest of the estimate"] = total - spent["trace"]
    out["answer_sha256"] = __import__("hashlib").sha256(answer.getvalue().encode()).hexdigest()[:16]
    return out


def breakdown(repeat: int = 3) -> None:
    """T5-base's first estimate, stage by stage (STAGES), medians of `repeat` new processes each with an
    empty trace cache; and the command itself timed the same way, for the total the stages must add up to."""
    from statistics import median

    env_of = {}
    rows: list[dict] = []
    whole: list[tuple[float, float]] = []
    start: list[float] = []
    for _ in range(repeat):
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "PYTHONPATH": str(ROOT), "PLANNER_CACHE_DIR": cache}
            env.pop("PLANNER_TRACE_CACHE", None)
            env_of = env
            _, cpu, _ = timed([sys.executable, "-c", "pass"], env)
            start.append(cpu)
            rows.append(json.loads(_last_line(_run_case(env))))
        with tempfile.TemporaryDirectory() as cache:
            env = {**env_of, "PLANNER_CACHE_DIR": cache}
            wall, cpu, _ = timed([sys.executable, "-m", "planner", *BREAKDOWN_ARGS], env)
            whole.append((wall, cpu))
    figures = {name: median(r[name] for r in rows) for name, _ in STAGES[1:-1]}
    figures["interpreter start"] = median(start)
    total_cpu = median(c for _, c in whole)
    figures["exit"] = max(0.0, total_cpu - sum(figures.values()))
    print(f"T5-base 16 x 512, first estimate (empty trace cache): CPU seconds by stage,\n"
          f"median of {repeat} new processes, load average {os.getloadavg()[0]:.1f}")
    for name, what in STAGES:
        print(f"  {name:26s} {figures[name]:5.2f}  {what}")
    print(f"  {'the command, timed whole':26s} {total_cpu:5.2f}  CPU, the child's included; "
          f"wall {median(w for w, _ in whole):.2f} s")
    forks = sum(r["forked"] for r in rows)
    print("'exit': the whole command's CPU less the stages. The optimizer step was traced\n"
          f"in a forked child in {forks} of {repeat} runs (only while the load leaves a CPU free;\n"
          "then it runs beside the forward and backward, and wall < CPU).\nAnswers identical across runs: "
          f"{'yes' if len({r['answer_sha256'] for r in rows}) == 1 else 'NO'}")


def _run_case(env: dict[str, str]) -> str:
    return subprocess.run([sys.executable, __file__, "--breakdown-case"], capture_output=True, text=True,
                          check=True, cwd=ROOT, env=env).stdout


def _last_line(text: str) -> str:
    return text.strip().splitlines()[-1]


def timed(cmd: list[str], env: dict[str, str], cwd: str | Path = ROOT) -> tuple[float, float, str]:
    """Run `cmd` in a new process: (wall seconds, CPU seconds user + sys, stdout)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=cwd, env=env)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), out.stdout


def estimates(repeat: int = 1, baseline: str | None = None) -> None:
    """Issue 38: first and second estimate of each model, each in a new process, from an empty trace cache;
    `repeat` times each (a new empty cache each time), medians printed (the machine is shared: CPU seconds
    vary less than wall seconds). `baseline`: a folder holding another checkout's `planner` (e.g. `git archive`
    of main), whose first estimate runs just before ours each time (the same load on a shared machine) and
    whose answer must be the same but for the note saying its trace was interpolated."""
    from statistics import median

    head = f"{'estimate (new process each)':28s} {'1st wall':>8s} {'1st CPU':>8s} {'2nd wall':>8s} {'2nd CPU':>8s}"
    print(head + (f" {'base wall':>9s} {'base CPU':>8s}" if baseline else "") + f" {'same':>5s}")
    for label, args in ESTIMATES.items():
        runs = []
        for _ in range(repeat):
            with tempfile.TemporaryDirectory() as cache:
                env = {**os.environ, "PYTHONPATH": str(ROOT), "PLANNER_CACHE_DIR": cache}
                env.pop("PLANNER_TRACE_CACHE", None)
                cmd = [sys.executable, "-m", "planner", "estimate", *args, "--json"]
                same, b_wall, b_cpu = True, 0.0, 0.0
                if baseline:
                    with tempfile.TemporaryDirectory() as other:
                        b_wall, b_cpu, ob = timed(cmd, {**env, "PYTHONPATH": baseline, "PLANNER_CACHE_DIR": other},
                                                  cwd=baseline)
                w1, c1, o1 = timed(cmd, env)
                w2, c2, o2 = timed(cmd, env)
                if baseline:
                    same = _without_interpolation_note(ob) == json.loads(o1)
                runs.append((w1, c1, w2, c2, b_wall, b_cpu, same and o1 == o2))
        w1, c1, w2, c2, bw, bc = (median(r[i] for r in runs) for i in range(6))
        ok = "yes" if all(r[6] for r in runs) else "NO"
        print(f"{label:28s} {w1:8.2f} {c1:8.2f} {w2:8.2f} {c2:8.2f}" + (f" {bw:9.2f} {bc:8.2f}" if baseline else "")
              + f" {ok:>5s}", flush=True)
    print(f"seconds, median of {repeat} run(s); CPU = user + sys of the process"
          + ("; base = the baseline checkout's first estimate; same = the second answer equals the first (and the "
             "baseline's but for its interpolation note)" if baseline else ""))


def _without_interpolation_note(out: str) -> dict:
    answer = json.loads(out)
    answer["notes"] = [n for n in answer.get("notes", []) if not n.startswith("traced at micro-batches")]
    return answer


def search_timed(baseline: str | None = None) -> None:
    """A SEARCH_TRIALS-trial search over examples/multimodal_bert.py in a new process, from an empty trace cache,
    then again in another new process (the traces read back from the disk); with `baseline` (another
    checkout), its own search from an empty trace cache first, back to back, and whether the trial tables
    are the same (a digest of every column but the study name and error reasons, which name the checkout)."""
    print()
    if baseline:
        base = Path(baseline).resolve()
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "PYTHONPATH": str(base), "PLANNER_CACHE_DIR": cache}
            env.pop("PLANNER_TRACE_CACHE", None)
            wall, cpu, out = timed([sys.executable, str(base / "benchmarks" / "trace_benchmark.py"),
                                    "--search-case"], env)
            r = json.loads(out.strip().splitlines()[-1])
            print(f"baseline ({base.name}), empty trace cache: {r['trials']} trials in {wall:.1f} s wall, "
                  f"{cpu:.1f} s CPU, load average {os.getloadavg()[0]:.1f}"
                  + (f", table {r['table_sha256']}" if "table_sha256" in r else ""))
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "PLANNER_CACHE_DIR": cache}
        env.pop("PLANNER_TRACE_CACHE", None)
        for label in ("empty trace cache", "traces on disk"):
            wall, cpu, out = timed([sys.executable, __file__, "--search-case"], env)
            r = json.loads(out.strip().splitlines()[-1])
            print(f"planner search over examples/multimodal_bert.py, ml.p3.16xlarge, new process, {label}: "
                  f"{r['trials']} trials in {wall:.1f} s wall, {cpu:.1f} s CPU (target <= 30 s; "
                  f"{r['estimates']} estimates, {r['traces']} traces made or read, the model traced "
                  f"{r['model_traces']} times, the optimizer step spliced on; the rest interpolated between "
                  f"micro-batches 2 and 4), load average {os.getloadavg()[0]:.1f}, table {r['table_sha256']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="the estimates of issue 38 only")
    parser.add_argument("--repeat", type=int, default=1, help="runs of each estimate (medians printed)")
    parser.add_argument("--search-only", action="store_true", help="the 100-trial search of issue 38 only")
    parser.add_argument("--baseline", help="a folder with another checkout's planner package, timed alongside")
    parser.add_argument("--layers", action="store_true", help="traces with identical layers cut, against whole")
    parser.add_argument("--breakdown", action="store_true",
                        help="T5-base's first estimate, CPU seconds stage by stage")
    parser.add_argument("--breakdown-case", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--case", help=argparse.SUPPRESS)
    parser.add_argument("--search-case", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.case:
        print(json.dumps(one(args.case)))
        return 0
    if args.breakdown_case:
        print(json.dumps(breakdown_case()))
        return 0
    if args.breakdown:
        breakdown(args.repeat if args.repeat > 1 else 3)
        return 0
    if args.search_case:
        print(json.dumps(search(SEARCH_TRIALS)), flush=True)
        os._exit(0)  # as the `planner` command ends (planner.cli.main.leave_now): no interpreter teardown
    if args.search_only:
        search_timed(args.baseline)
        return 0
    if args.layers:
        layers()
        return 0
    estimates(args.repeat, args.baseline)
    if args.quick:
        return 0
    search_timed(args.baseline)
    print()
    print(f"{'case':26s} {'seconds':>8s} {'peak RSS MB':>12s} {'ops':>7s} {'events':>7s} {'saved MiB':>10s}")
    for name in CASES:
        out = subprocess.run([sys.executable, __file__, "--case", name], capture_output=True, text=True, check=True,
                             cwd=ROOT, env={"PYTHONPATH": str(ROOT), **__import__("os").environ})
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"{name:26s} {r['seconds']:8.1f} {r['rss_bytes'] / 1e6:12.0f} {r['ops']:7d} {r['events']:7d} "
              f"{r['saved_bytes'] / 2**20:10.1f}")
    print("\nexamples/multimodal_bert.py (traced) vs multimodal-bert (analytic), 8 x 512 fp32, V100")
    for key, t, a in agreement():
        print(f"  {key:18s} {t:>15,d} {a:>15,d} {100 * (t - a) / a:+7.3f} %")
    return 0


if __name__ == "__main__":
    sys.exit(main())
