"""Would an op-level trace fix the catalog models' reserved peaks? The per-block replay against the tracer's
two-step replay of the same model, on every catalog step reading.

    python benchmarks/op_level_reserved.py [--folder shared|h200|h100|all] [--limit N]

The catalog models' reserved peak comes from a per-block trace (`planner.memory.events`: per block its saved
tensors, one forward and one backward transient); a model traced from its config replays every storage op by
op, first step then steady step (`planner.program.replay`). Here the catalog models of the step readings
(BERT-base MLM and GPT-2 from their catalog configs, the multimodal BERT from `examples/multimodal_bert.py`)
are also traced, on the reading's configuration and loop (the multimodal example builds SDPA attention
only: its eager rows are not traced), and both replays' reserved peaks are printed
against the GPU's. Nothing is fitted; this only says how much of the catalog rows' reserved error is the
per-block granularity (docs/allocator.md). Tracing costs seconds per shape (cached on disk after the first).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GiB = 2**30
FOLDERS = {"shared": "SHARED", "h200": 0, "h100": 1}
USER = {"multimodal-bert": ("examples/multimodal_bert.py:build", "examples/multimodal_bert.py:batch")}


def traced_reserved(model: str, config, tmp: Path) -> int | None:
    """The tracer's two-step replay of the reading's model and configuration (one GPU, Hopper workspaces);
    None where the traced module cannot run it (the example multimodal BERT builds SDPA attention only)."""
    from planner.memory import runtime
    from planner.program import sources
    from planner.program.replay import replay_trace

    if model in USER and config.attention != "sdpa":
        return None
    if model in USER:
        build, inputs = (str(ROOT / p) for p in USER[model])
        trace = sources.user_trace(build, config, inputs=inputs)
    else:
        path = tmp / f"{model}.json"
        if not path.exists():
            path.write_text((ROOT / "planner" / "data" / "models" / f"{model}.json").read_text())
        trace = sources.model_trace(str(path), config)
    ws = runtime.cublas_workspace_bytes((9, 0))
    return replay_trace(trace, workspace_bytes=ws, loop=config.loop).peak_reserved


def main(argv: list[str] | None = None) -> int:
    from planner.estimate import estimate
    from planner.probes import readings

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--folder", choices=[*FOLDERS, "all"], default="shared")
    ap.add_argument("--limit", type=int, default=0, help="at most this many rows per folder (0: all)")
    args = ap.parse_args(argv)
    names = list(FOLDERS) if args.folder == "all" else [args.folder]
    print("reserved peak, predicted / measured - 1: per-block replay (the estimate) vs op-level (traced)")
    print(f"{'folder':<7}{'reading':<44}{'GiB':>7}{'block':>8}{'traced':>8}")
    block_err, traced_err = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            where = FOLDERS[name]
            folder = readings.SHARED if where == "SHARED" else readings.HELD_OUT[where]
            rows = [r for r in readings.load_steps(folder) if r.model in ("bert-base-uncased", "gpt2", *USER)]
            for r in rows[: args.limit or None]:
                est = estimate(r.model, r.config, r.instance, stack=r.stack or None, with_throughput=False)
                b = est.memory_bytes.peak_reserved / r.peak_reserved - 1
                traced = traced_reserved(r.model, r.config, Path(tmp))
                block_err.append(b)
                if traced is None:
                    shown = "-"
                else:
                    traced_err.append(traced / r.peak_reserved - 1)
                    shown = f"{traced_err[-1]:+.1%}"
                print(f"{name:<7}{r.label[:43]:<44}{r.peak_reserved / GiB:>7.2f}{b:>+8.1%}{shown:>8}", flush=True)
    for what, errs in (("per-block", block_err), ("traced", traced_err)):
        if errs:
            print(f"{what:>9}: median |error| {statistics.median(abs(e) for e in errs):.1%}, "
                  f"range {min(errs):+.1%} to {max(errs):+.1%}, "
                  f"{sum(e < -0.02 for e in errs)} of {len(errs)} more than 2 % under")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
