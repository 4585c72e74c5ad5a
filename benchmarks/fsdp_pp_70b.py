"""FSDP2 under pipeline parallelism, Llama-3-70B on ml.p5.48xlarge: collectives per micro-batch vs once per step.

Prints, for the layout of issue 34's Done-when command (32 instances, TP 8, PP 4, VP 5, FSDP, global batch
512, micro-batch 1, sequence 4096, amp-bf16, selective recompute of core attention) and a few variations
(torchtitan's mixed-precision policy, HSDP with 2 and 4 replica groups, 1F1B without virtual stages), the
step, tokens/s per GPU, MFU and the exposed data-parallel time:

- "per micro-batch": FSDP's per-unit all-gathers (forward and backward) and reduce-scatters every micro-batch
  (the planner's rule before; planner.perf.model_parallel.fsdp_gathers_once forced off; HSDP's collectives
  over its whole DP group as before is NOT reproduced: the "before" column keeps the new HSDP groups);
- "once per step": the FSDP2 rule under PP (torchtitan: no reshard after forward with PP; torch.distributed.
  pipelining: no gradient sync nor reshard after backward before the last micro-batch).

Nothing here is fitted. Published FSDP+TP+PP 70B runs on H100 report ~35-45 % MFU (an independent check:
not used to set any constant). Run: python benchmarks/fsdp_pp_70b.py
"""

from __future__ import annotations

import sys
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CONFIG = ROOT / "tests" / "data" / "llama-3-70b.json"
BASE = dict(batch_size=1, seq_len=4096, precision="amp-bf16", attention="flash", parallelism="fsdp", tp=8, pp=4,
            vp=5, instances=32, recompute="selective", recompute_modules=("core_attn",))
LAYOUTS = (
    ("Done-when (pytorch FSDP2)", {}),
    ("torchtitan policy", {"framework": "torchtitan"}),
    ("HSDP, 2 replicas", {"parallelism": "hsdp", "dp_replicas": 2}),
    ("HSDP, 4 replicas", {"parallelism": "hsdp", "dp_replicas": 4}),
    ("1F1B, no VP", {"vp": 1}),
)


def run(overrides: dict, once: bool):
    import json

    from planner.hardware import get_instance
    from planner.models.hf_config import spec_from_hf_config
    from planner.perf import model_parallel as mp
    from planner.perf.throughput import predict_throughput
    from planner.spec import TrainConfig

    kw = BASE | overrides
    dp = kw["instances"] * 8 // (kw["tp"] * kw["pp"])
    cfg = TrainConfig(**kw, grad_accum=512 // dp)
    model = spec_from_hf_config(json.loads(CONFIG.read_text()), name="llama-3-70b")
    inst = get_instance("ml.p5.48xlarge")
    if once:
        return predict_throughput(model, cfg, inst)
    with mock.patch.object(mp, "fsdp_gathers_once", lambda *a: False):
        return predict_throughput(model, cfg, inst)


def main() -> None:
    print(f"{'layout':28} {'rule':15} {'step s':>7} {'tok/s/GPU':>9} {'MFU':>6} {'DP exposed s':>12}")
    for name, overrides in LAYOUTS:
        for once in (False, True):
            t = run(overrides, once)
            b = t.breakdown_s
            print(f"{name:28} {'once per step' if once else 'per micro-batch':15} {t.step_time_s:7.2f} "
                  f"{t.tokens_per_s / t.gpus:9.0f} {t.mfu:6.1%} {b['dp_communication_s']:12.2f}")


if __name__ == "__main__":
    main()
