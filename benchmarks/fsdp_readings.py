"""Held-out check of the FSDP mixed-precision rules against the GPU session's `fsdp.jsonl` readings.

The coordinator's GPU session (benchmarks/gpu_session.py, section `fsdp`) trains a ~1.1 B Llama-style model
on ONE GPU in a one-process group: plain + autocast, FSDP2 with and without MixedPrecisionPolicy, without
resharding, LoRA on a bf16 base, FSDP1 with MixedPrecision. World size 1 shards nothing, but the 16-bit unit
copies, the autocast cache and their lifetimes show. This script predicts each variant's phase peaks
(allocated) under the framework whose layout it is and prints predicted / measured - 1. Nothing is fitted.
On the 2026-11-27 readings: median |error| 3 % over 18 phase peaks (docs/frameworks.md; 4 % before
variant d ran with --no-reshard-after-forward as the run did).

Usage: python benchmarks/fsdp_readings.py [results/validation/h200/measured-2026-11-27/fsdp.jsonl]
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's planner

DEFAULT = Path(__file__).resolve().parents[1] / "results/validation/h200/measured-2026-11-27/fsdp.jsonl"
GIB = 2**30

# variant -> (framework, parallelism, extra TrainConfig fields, what differs from the run)
VARIANTS = {
    "a-plain-autocast": ("pytorch", "single", {}, ""),
    "b-fsdp2-policy": ("torchtitan", "fsdp", {}, ""),
    "c-fsdp2-autocast": ("pytorch", "fsdp", {}, ""),
    "d-fsdp2-policy-no-reshard": ("torchtitan", "fsdp", {"reshard_after_forward": False}, ""),
    "e-fsdp2-policy-lora-bf16-base": ("torchtitan", "fsdp", {
        "lora_r": 16, "lora_alpha": 32, "lora_dropout": 0.05, "base_dtype": "bf16",
        "lora_targets": ("q_proj", "k_proj", "v_proj", "o_proj")}, ""),
    "f-fsdp1-mixed-precision": ("accelerate", "fsdp", {}, "the run reduces in fp32, Accelerate's layout in bf16"),
}


def _config_file(row: dict, folder: Path) -> str:
    conf = {**row["llama_config"], "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "torch_dtype": "float32"}
    path = folder / f"{row['variant']}.json"
    path.write_text(json.dumps(conf))
    return str(path)


def predict(row: dict, folder: Path):
    from planner import estimate
    from planner.probes.public import public_instance
    from planner.spec import TrainConfig

    framework, parallelism, extra, _ = VARIANTS[row["variant"]]
    cfg = TrainConfig(batch_size=row["b"], seq_len=row["s"], precision="amp-bf16", checkpointing=True,
                      attention="sdpa", parallelism=parallelism, framework=framework, **extra)
    return estimate(_config_file(row, folder), cfg, public_instance("H200-141GB", 1))


def main(argv: list[str] | None = None) -> int:
    path = Path((argv or sys.argv[1:] or [str(DEFAULT)])[0])
    if not path.is_file():
        print(f"no readings at {path}")
        return 1
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    print("FSDP on one GPU: predicted vs measured peak allocated by phase (step 2), GiB")
    print(f"{'variant':<30}{'phase':<10}{'measured':>9}{'predicted':>10}{'err':>7}")
    errors = []
    with tempfile.TemporaryDirectory() as tmp:
        for row in rows:
            if row.get("variant") not in VARIANTS or not isinstance(row.get("step2"), dict):
                print(f"{str(row.get('variant'))[:29]:<30}skipped: {row.get('error') or 'no step-2 readings'}")
                continue
            est = predict(row, Path(tmp))
            phases = {p.phase: p.allocated for p in est.phases}
            for phase in ("forward", "backward", "optimizer"):
                measured = (row["step2"].get(phase) or {}).get("max_alloc")
                if not measured:
                    continue
                err = phases[phase] / measured - 1
                errors.append(abs(err))
                print(f"{row['variant'][:29]:<30}{phase:<10}{measured / GIB:>9.2f}{phases[phase] / GIB:>10.2f}"
                      f"{100 * err:>+6.0f}%")
            note = VARIANTS[row["variant"]][3]
            if note:
                print(f"{'':<30}({note})")
    if errors:
        errors.sort()
        print(f"median |err| {100 * errors[len(errors) // 2]:.0f}% over {len(errors)} phase peaks")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
