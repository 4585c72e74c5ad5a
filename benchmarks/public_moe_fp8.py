"""The planner against published mixture-of-experts and FP8 training runs (issue 35 item 7): prints, per row,
the published tokens/s per GPU and TFLOP/s per GPU (MFU over 989 TFLOP/s, the H100 SXM dense BF16 peak) beside
the planner's, the FP8-over-bf16 speed-up of each FP8 row against its source's own bf16 row, and where a peak is
printed the planner's peak and verdict. An independent check: nothing in the planner is fitted to these rows.

Rows: results/public/fp8/runs.csv and results/public/moe/runs.csv (planner.probes.public_moe_fp8 loads them;
each row names its repository, file, commit and table row). A row whose configuration the planner cannot express
is printed with the planner's own one-line reason instead of figures.

error = planner / published - 1. Usage: python benchmarks/public_moe_fp8.py [--json] [--flags]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GIB = 2**30


def predict(row: Any) -> dict[str, Any]:
    """The planner's estimate of one row (JSON), or {"error": its one-line refusal}."""
    import planner
    from planner.errors import PlannerError

    try:
        est = planner.estimate(row.model_ref(ROOT), row.train_config(), row.instance,
                               model_options=row.model_options()).model_dump(mode="json")
    except PlannerError as exc:
        return {"error": str(exc)}
    t, m = est["throughput"], est["memory_bytes"]
    return {"tokens_per_s_per_gpu": t["tokens_per_s_per_gpu"], "mfu": t["mfu"],
            "peak_reserved_gib": m["peak_reserved"] / GIB, "peak_device_gib": m["peak_device"] / GIB,
            "verdict": est["verdict"]}


def records(kind: str) -> list[dict[str, Any]]:
    from planner.hardware import get_instance
    from planner.probes.public_moe_fp8 import load_published

    rows = load_published(kind)
    out = {}
    for r in rows:
        p = predict(r)
        peak = get_instance(r.instance).gpu.peak_tflops["bf16"]
        rec = {"id": r.id, "model": r.model, "gpus": r.gpus, "precision": r.precision, "recipe": r.fp8_recipe,
               "framework": r.framework, "layout": _layout(r), "published_tokens_per_s_per_gpu": r.tokens_per_s_per_gpu,
               "published_mfu": r.tflops_per_gpu / peak if r.tflops_per_gpu else None,
               "published_peak_gib": r.peak_gib, "baseline": r.baseline, "source": f"{r.repo} {r.commit[:10]}",
               "flags": cli_flags(r), **p}
        if "error" not in p:
            rec["error_tokens"] = p["tokens_per_s_per_gpu"] / r.tokens_per_s_per_gpu - 1
            rec["error_peak"] = p["peak_reserved_gib"] / r.peak_gib - 1 if r.peak_gib else None
        base = out.get(r.baseline or "")
        if base and "error" not in p and "error" not in base:
            rec["published_speedup"] = r.tokens_per_s_per_gpu / base["published_tokens_per_s_per_gpu"]
            rec["planner_speedup"] = p["tokens_per_s_per_gpu"] / base["tokens_per_s_per_gpu"]
        out[r.id] = rec
    return list(out.values())


def cli_flags(r: Any) -> str:
    """The row as `planner estimate` / `planner explain` flags (the same TrainConfig the benchmark estimates)."""
    c = r.train_config()
    f = [f"--model {r.model}", f"--instance {r.instance}", f"--instances {c.instances}", f"--batch-size {c.batch_size}",
         f"--grad-accum {c.grad_accum}", f"--seq-len {c.seq_len}", f"--precision {c.precision}",
         f"--optimizer {c.optimizer}", f"--attention {c.attention}", f"--parallelism {c.parallelism}",
         f"--framework {c.framework}"]
    f += [f"-o {k}={str(v).lower()}" for k, v in r.model_options().items()]
    f += [f"--{k} {getattr(c, k)}" for k in ("tp", "pp", "vp", "ep") if getattr(c, k) > 1]
    if c.checkpointing:
        f.append("--checkpointing")
    if c.recompute == "selective":
        f.append("--recompute selective" + (f" --recompute-modules {','.join(c.recompute_modules)}"
                                            if c.recompute_modules else ""))
    if c.distributed_optimizer:
        f.append("--distributed-optimizer")
    if c.grad_reduce_in_fp32 is not None:
        f.append("--grad-reduce-in-fp32" if c.grad_reduce_in_fp32 else "--no-grad-reduce-in-fp32")
    if c.reshard_after_forward is not None:
        f.append("--reshard-after-forward" if c.reshard_after_forward else "--no-reshard-after-forward")
    if c.fp8_recipe:
        f.append(f"--fp8-recipe {c.fp8_recipe}")
    if c.fp8_param_gather:
        f.append("--fp8-param-gather")
    if c.compile:
        f.append("--compile")
    return " ".join(f)


def _layout(r: Any) -> str:
    parts = [r.parallelism] + [f"{k}{v}" for k, v in (("tp", r.tp), ("pp", r.pp), ("vp", r.vp), ("ep", r.ep)) if v > 1]
    parts.append(f"mb{r.micro_batch}x{r.grad_accum}")
    if r.compile:
        parts.append("compile")
    if r.recompute != "none":
        mods = getattr(r, "recompute_modules", "")
        parts.append(f"ac-{r.recompute}" + (f"({mods.replace(' ', ',')})" if mods else ""))
    return " ".join(parts)


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:+.0%}"


def print_table(kind: str, recs: list[dict[str, Any]], flags: bool = False) -> None:
    print(f"\n{kind.upper()}: published vs planner (tokens/s per GPU, MFU, peak GiB)")
    for rec in recs:
        prec = rec["precision"] + (f" {rec['recipe']}" if rec["recipe"] else "")
        print(f"{rec['id']}: {rec['model']}, {rec['gpus']} GPUs, {rec['framework']}, {prec}, {rec['layout']}")
        if flags:
            print(f"  planner explain {rec['flags']}")
        if "error" in rec:
            print(f"  not expressible: {rec['error']}")
            continue
        mfu = "-" if rec["published_mfu"] is None else f"{rec['published_mfu']:.1%}"
        line = (f"  tokens/s/GPU {rec['published_tokens_per_s_per_gpu']:,.0f} vs {rec['tokens_per_s_per_gpu']:,.0f}"
                f" ({_pct(rec['error_tokens'])}); MFU {mfu} vs {rec['mfu']:.1%}")
        if rec.get("published_speedup"):
            line += f"; FP8 speed-up {rec['published_speedup']:.2f} vs {rec['planner_speedup']:.2f}"
        print(line)
        if rec["published_peak_gib"]:
            print(f"  peak {rec['published_peak_gib']:.1f} vs reserved {rec['peak_reserved_gib']:.1f} GiB"
                  f" ({_pct(rec['error_peak'])}), device {rec['peak_device_gib']:.1f} GiB; ran, planner: {rec['verdict']}")
        else:  # every published run ran: a verdict of oom disagrees
            print(f"  peak not published; planner device peak {rec['peak_device_gib']:.1f} GiB; ran, planner:"
                  f" {rec['verdict']}")
    done = [r for r in recs if "error" not in r]
    if done:
        errs = [abs(r["error_tokens"]) for r in done]
        print(f"  median |tokens/s error| {statistics.median(errs):.0%} over {len(done)} rows"
              f" (signed median {statistics.median(r['error_tokens'] for r in done):+.0%});"
              f" {len(recs) - len(done)} not expressible")
        oom = [r["id"] for r in done if r["verdict"] == "oom"]
        print(f"  verdicts: {len(done) - len(oom)} of {len(done)} agree that the run fits"
              + (f" (oom predicted: {', '.join(oom)})" if oom else ""))
        ratios = [r["planner_speedup"] / r["published_speedup"] - 1 for r in done if r.get("published_speedup")]
        if ratios:
            print(f"  FP8 speed-up error: {', '.join(f'{x:+.0%}' for x in ratios)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="one JSON record per row instead of the tables")
    ap.add_argument("--flags", action="store_true", help="print each row's `planner explain` flags")
    args = ap.parse_args()
    for kind in ("fp8", "moe"):
        recs = records(kind)
        if args.json:
            for rec in recs:
                print(json.dumps({"kind": kind, **rec}))
        else:
            print_table(kind, recs, args.flags)


if __name__ == "__main__":
    main()
