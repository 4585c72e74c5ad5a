"""Run the validation probe grid on this GPU machine and store real readings for `planner validate`.

    python benchmarks/probe_grid.py              # the full grid (~60 runs, 30-90 min depending on the GPU)
    python benchmarks/probe_grid.py --quick      # ~16 runs
    python benchmarks/probe_grid.py --dry-run    # list the configurations, run nothing

Models: BERT-base, the multimodal BERT, RoBERTa-large, GPT-2; micro-batches, sequence lengths, fp32 and AMP
(bf16 where the GPU has it, else fp16), with and without checkpointing, eager and SDPA attention, plus per
model the smallest batch of a doubling ladder that the planner predicts to need >= OOM_MARGIN x the GPU's
memory (it must OOM) and the largest it predicts to fit (it should not).

Each configuration runs `jobs/probe.py` in its own process (an OOM cannot poison the next run) and its
result lands in results/validation/<gpu>/<model>-<config>-<request id>.json, next to meta.json (GPU,
driver, versions, date). Finished configurations are skipped when the script is run again. At the end it
prints `planner validate` over the folder and writes validation.csv there.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODELS = ("bert-base-uncased", "multimodal-bert", "roberta-large", "gpt2")
QUICK_MODELS = ("bert-base-uncased", "gpt2")
SEQ_LENS = {"gpt2": (256, 1024)}  # others: (128, 512)
DEFAULT_SEQ_LENS = (128, 512)
BATCHES = (8, 32)
OOM_MARGIN = 1.25  # "must OOM": predicted device peak >= 1.25 x GPU memory, so a 20% error still OOMs
FIT_MARGIN = 0.85  # "near the edge": the largest ladder batch predicted below 0.85 x GPU memory
LADDER = tuple(2**k for k in range(0, 12))  # 1 .. 2048
RUN_TIMEOUT_S = 1200


def gpu_facts() -> dict:
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU here: this script measures real GPU memory (use `--dry-run` to list)")
    props = torch.cuda.get_device_properties(0)
    facts = {"gpu_name": props.name, "gpu_total_bytes": int(props.total_memory),
             "compute_capability": [props.major, props.minor], "gpu_count": torch.cuda.device_count(),
             "torch": torch.__version__, "cuda": torch.version.cuda, "bf16": bool(torch.cuda.is_bf16_supported())}
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,name,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        facts["nvidia_smi"] = smi.stdout.strip().splitlines()
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        import transformers

        facts["transformers"] = transformers.__version__
    except ImportError:
        pass
    return facts


def pick_instance(gpu_name: str, override: str | None) -> str:
    """A single-GPU instance type with this GPU (predictions are per GPU; `single` uses one GPU)."""
    if override:
        return override
    from planner.hardware import get_instance, list_instances
    from planner.probes.validate import gpu_family

    fam = gpu_family(gpu_name)
    if fam is None:
        raise SystemExit(f"unknown GPU {gpu_name!r}: pass --instance with the SageMaker type to predict for")
    names = [n for n in list_instances() if get_instance(n).gpu.family == fam]
    if not names:
        raise SystemExit(f"no SageMaker instance with a {fam} in the catalog: pass --instance")
    return min(names, key=lambda n: (get_instance(n).gpus, n))


def label(cfg) -> str:
    parts = [f"b{cfg.batch_size}", f"s{cfg.seq_len}", cfg.precision, cfg.attention]
    if cfg.checkpointing:
        parts.append("ckpt")
    return "-".join(parts)


def predicted_peak(model: str, cfg, instance: str) -> float | None:
    try:
        import planner

        est = planner.estimate(model, cfg, instance, with_throughput=False)
        return est.memory_bytes.peak_device / est.gpu_memory_bytes
    except Exception:  # noqa: BLE001 - a configuration the estimator rejects is simply not chosen
        return None


def grid(models: tuple[str, ...], instance: str, amp: str, quick: bool) -> list[tuple[str, object, str]]:
    """(model, TrainConfig, purpose) for every run."""
    from planner.spec import TrainConfig

    runs: list[tuple[str, object, str]] = []
    for model in models:
        seqs = SEQ_LENS.get(model, DEFAULT_SEQ_LENS)
        batches = BATCHES[:1] if quick else BATCHES
        for s in seqs:
            for b in batches:
                for p in ("fp32", amp):
                    runs.append((model, TrainConfig(batch_size=b, seq_len=s, precision=p, parallelism="single"),
                                 "core"))
        b, s = batches[-1], seqs[-1]
        runs.append((model, TrainConfig(batch_size=b, seq_len=s, precision="fp32", attention="eager",
                                        parallelism="single"), "kernel"))
        for p in ("fp32",) if quick else ("fp32", amp):
            runs.append((model, TrainConfig(batch_size=b, seq_len=s, precision=p, checkpointing=True,
                                            parallelism="single"), "checkpointing"))
        # The fit boundary: the planner's own prediction picks a batch that must OOM and one that should fit.
        fit_b = oom_b = None
        for lb in LADDER:
            cfg = TrainConfig(batch_size=lb, seq_len=s, precision="fp32", attention="eager", parallelism="single")
            frac = predicted_peak(model, cfg, instance)
            if frac is None:
                continue
            if frac < FIT_MARGIN:
                fit_b = lb
            if frac >= OOM_MARGIN:
                oom_b = lb
                break
        if fit_b is not None and not quick:
            runs.append((model, TrainConfig(batch_size=fit_b, seq_len=s, precision="fp32", attention="eager",
                                            parallelism="single"), "edge-fit"))
        if oom_b is not None:
            runs.append((model, TrainConfig(batch_size=oom_b, seq_len=s, precision="fp32", attention="eager",
                                            parallelism="single"), "must-oom"))
    merged: dict[tuple[str, object], str] = {}
    for model, cfg, purpose in runs:  # one run serves several purposes (e.g. kernel+must-oom)
        key = (model, cfg)
        merged[key] = f"{merged[key]}+{purpose}" if key in merged else purpose
    return [(model, cfg, purpose) for (model, cfg), purpose in merged.items()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="BERT-base and GPT-2, fewer points (~16 runs)")
    ap.add_argument("--models", nargs="*", default=None, help=f"subset of {', '.join(MODELS)}")
    ap.add_argument("--instance", default=None, help="SageMaker instance type to predict for (default: by GPU)")
    ap.add_argument("--out-dir", default=None, help="default results/validation/<gpu>/")
    ap.add_argument("--steps", type=int, default=3, help="measured steps after one warm-up step")
    ap.add_argument("--timeout", type=int, default=RUN_TIMEOUT_S, help="seconds per run")
    ap.add_argument("--max-runs", type=int, default=None)
    ap.add_argument("--force", action="store_true", help="re-run configurations that already have a result")
    ap.add_argument("--dry-run", action="store_true", help="list the configurations and exit")
    args = ap.parse_args(argv)

    from planner.probes.spec import make_request

    if args.dry_run:
        from planner.hardware import get_instance

        instance = args.instance or "ml.g5.xlarge"
        facts = {"gpu_name": "(dry run)", "bf16": get_instance(instance).gpu.bf16}
    else:
        facts = gpu_facts()
        instance = pick_instance(facts["gpu_name"], args.instance)
    models = tuple(args.models) if args.models else (QUICK_MODELS if args.quick else MODELS)
    amp = "amp-bf16" if facts.get("bf16") else "amp-fp16"
    runs = grid(models, instance, amp, args.quick)[: args.max_runs]
    slug = re.sub(r"[^A-Za-z0-9]+", "-", facts["gpu_name"]).strip("-")
    out_dir = Path(args.out_dir) if args.out_dir else ROOT / "results" / "validation" / slug
    print(f"{len(runs)} runs on {facts['gpu_name']}, predicted for {instance}; results in {out_dir}")
    if args.dry_run:
        for model, cfg, purpose in runs:
            print(f"  {purpose:22} {model:18} {label(cfg)}")
        return 0
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "meta.json").write_text(json.dumps({**facts, "instance": instance, "date": time.strftime(
        "%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "command": " ".join(sys.argv)}, indent=1))
    started = time.time()
    for i, (model, cfg, purpose) in enumerate(runs, 1):
        req = make_request(model, cfg, instance, measure_steps=args.steps)
        target = out_dir / f"{model}-{label(cfg)}-{req.request_id}.json"
        if target.exists() and not args.force:
            print(f"[{i}/{len(runs)}] skip {target.name}")
            continue
        req_file = out_dir / "requests" / f"{req.request_id}.json"
        req_file.parent.mkdir(exist_ok=True)
        req_file.write_text(json.dumps(req.to_json()))
        tmp = out_dir / f".{req.request_id}.tmp.json"
        cmd = [sys.executable, str(ROOT / "jobs" / "probe.py"), "--request", str(req_file), "--out", str(tmp)]
        t0 = time.time()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
            tail = proc.stderr[-1500:]
        except subprocess.TimeoutExpired:
            tail = f"timed out after {args.timeout} s"
        if tmp.exists():
            result = json.loads(tmp.read_text())
            tmp.unlink()
        else:
            result = {"request_id": req.request_id, "status": "error", "phase": "launch", "message": tail,
                      "model": req.model_name, "config": req.config, "model_spec": req.model,
                      "estimate": req.estimate, "summary": {}, "phases": []}
        result.update(source="grid", purpose=purpose, record_id=f"grid-{req.request_id}", instance=instance)
        target.write_text(json.dumps(result, indent=1, default=str))
        s = result.get("summary") or {}
        peak = s.get("peak_allocated")
        print(f"[{i}/{len(runs)}] {purpose:13} {model:18} {label(cfg):28} {result['status']:11} "
              f"peak={peak / 2**30 if peak else float('nan'):.2f} GiB  {time.time() - t0:.0f} s", flush=True)
    print(f"grid done in {(time.time() - started) / 60:.1f} min")
    from planner.cli.main import app

    try:
        app(["validate", "--probes", str(out_dir), "--csv", str(out_dir / "validation.csv")], standalone_mode=False)
    except SystemExit:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
