"""The planner's MFU against Megatron-LM's published weak-scaling table (H100, GPT 1.7B-462B): prints each row
with the error (issue 34 item 7). An independent check: nothing in the planner is fitted to these rows.

Rows: results/public/megatron/weak_scaling_h100.csv (NVIDIA/Megatron-LM README.md, images/model_table.png at
commit f2e5db402c44ae309aa6448bcb4ae87e8ae0f5f4; planner.probes.public_megatron loads them). Each row runs
through `planner.perf.throughput.predict_throughput` with the printed TP, PP, data-parallel size and batch, and
the assumptions results/public/megatron/README.md states (micro-batch 1, 1F1B, GPT-2 layer form, bf16 with the
distributed optimizer, ml.p5.48xlarge). Memory is not judged here (the rows ran).

error = planner MFU / published MFU - 1 (the published MFU to two digits as printed, and from the per-GPU
teraFLOP/s over 989.5, the H100 SXM dense BF16 peak of planner/data/gpus.json). Also printed: the planner's
step split (compute, exposed TP, bubble, exposed DP, the wait for the slowest GPU) so that the error can be read term by term.

Usage: python benchmarks/megatron_scaling.py [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def predict(row):
    from planner.hardware import get_gpu, get_instance
    from planner.models.hf_config import spec_from_hf_config
    from planner.perf.throughput import predict_throughput
    from planner.probes.public_megatron import INSTANCE

    model = spec_from_hf_config(row.hf_config(), name=f"megatron-gpt-{row.model_size}")
    inst = get_instance(INSTANCE)
    t = predict_throughput(model, row.train_config(), inst)
    peak = get_gpu(inst.gpu.name).peak_tflops["bf16"]
    return t, peak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="one JSON record per row instead of the table")
    args = ap.parse_args()
    from planner.probes.public_megatron import SOURCE, load_megatron_weak_scaling

    rows = load_megatron_weak_scaling()
    out = []
    for r in rows:
        t, peak = predict(r)
        b = t.breakdown_s
        rec = {"id": r.id, "model": r.model_size, "tp": r.tp, "pp": r.pp, "dp": r.dp, "gpus": r.gpus,
               "m": r.micro_batches(), "published_mfu": r.mfu, "published_mfu_from_tflops": r.tflops_per_gpu / peak,
               "planner_mfu": t.mfu, "error": t.mfu / r.mfu - 1,
               "error_vs_tflops": t.mfu / (r.tflops_per_gpu / peak) - 1, "step_s": t.step_time_s,
               "compute_s": b["compute_s"], "tp_s": b.get("tp_communication_s", 0.0),
               "bubble_s": b.get("pp_bubble_s", 0.0), "dp_s": b.get("dp_communication_s", b["communication_s"]),
               "wait_s": b["slowest_gpu_wait_s"],
               "tokens_per_s_per_gpu": t.tokens_per_s_per_gpu,
               "published_tokens_per_s_per_gpu": None}
        out.append(rec)
    if args.json:
        for rec in out:
            print(json.dumps(rec))
        return
    print(f"Megatron-LM weak scaling, H100 ({SOURCE['repo']} {SOURCE['commit'][:10]})")
    print("published MFU vs the planner's; its step split in seconds")
    print(f"{'model':>5} {'tp':>2} {'pp':>2} {'GPUs':>4} {'m':>2} {'pub.':>4} {'plan.':>5} {'error':>5}"
          f" {'step s':>6} {'comp.':>5} {'TP':>4} {'bubl.':>5} {'DP':>4} {'wait':>4}")
    for rec in out:
        print(f"{rec['model']:>5} {rec['tp']:>2} {rec['pp']:>2} {rec['gpus']:>4} {rec['m']:>2}"
              f" {rec['published_mfu']:>4.0%} {rec['planner_mfu']:>5.1%} {rec['error']:>+5.0%}"
              f" {rec['step_s']:>6.2f} {rec['compute_s']:>5.2f} {rec['tp_s']:>4.2f} {rec['bubble_s']:>5.2f}"
              f" {rec['dp_s']:>4.2f} {rec['wait_s']:>4.2f}")
    errs = [abs(rec["error"]) for rec in out]
    print(f"median |error| {statistics.median(errs):.0%}, max {max(errs):.0%} over {len(out)} rows "
          f"(signed median {statistics.median(rec['error'] for rec in out):+.0%})")
    nemo()


def nemo() -> None:
    """NeMo AutoModel's dense pre-training row (FSDP2 + CP, Hugging Face Llama): tokens/s/GPU and MFU."""
    from planner.hardware import get_instance
    from planner.models.catalog import get_model
    from planner.perf.throughput import predict_throughput
    from planner.probes.public_megatron import INSTANCE, LLAMA3_70B_CONFIG, NEMO_SOURCE, load_nemo_automodel

    inst = get_instance(INSTANCE)
    peak = inst.gpu.peak_tflops["bf16"]
    print(f"\nNeMo AutoModel, H100 BF16 ({NEMO_SOURCE['repo']} {NEMO_SOURCE['commit'][:10]})")
    for r in load_nemo_automodel():
        t = predict_throughput(get_model(str(ROOT / LLAMA3_70B_CONFIG)), r.train_config(), inst)
        pub_mfu = r.tflops_per_gpu / peak
        b = t.breakdown_s
        print(f"{r.model}, {r.gpus} GPUs, cp {r.cp}, FSDP {r.fsdp}, seq {r.seq_len}")
        print(f"  tokens/s/GPU {r.tokens_per_s_per_gpu:,.0f} published, {t.tokens_per_s_per_gpu:,.0f} planner "
              f"({t.tokens_per_s_per_gpu / r.tokens_per_s_per_gpu - 1:+.0%}); MFU {pub_mfu:.1%} vs {t.mfu:.1%}")
        print(f"  step {r.step_s:.2f} s vs {t.step_time_s:.2f} s: compute {b['compute_s']:.2f}, "
              f"exposed CP {b.get('cp_communication_s', 0):.2f}, DP {b.get('dp_communication_s', 0):.2f},")
        print(f"  the slowest GPU's wait {b['slowest_gpu_wait_s']:.2f}")


if __name__ == "__main__":
    main()
