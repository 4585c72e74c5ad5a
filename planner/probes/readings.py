"""Real GPU readings taken outside the probe jobs (results/validation/<gpu>/<folder>/): plain PyTorch training
steps with per-phase CUDA peaks and step times (`steps.jsonl`), profiles of small steps (`launch.jsonl`) and
the versions they ran (`env.json`). Loaded here so that `planner validate` and the fits read them one way.

Which readings may be fitted is decided here, once: the shared H200 folder (not made by this project) is the
fit source, split into a fit part and a held-out third by row order (`fit_split`); the project's own
measured-* folders are held out from every fit.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from planner.spec import TrainConfig

ROOT = Path(__file__).resolve().parent.parent.parent / "results" / "validation"
SHARED = ROOT / "h200" / "shared-2026-11-26"
HELD_OUT = (ROOT / "h200" / "measured-2026-11-26", ROOT / "h100" / "measured-2026-11-26")
# One GPU of the instance type carrying the reading's GPU (the readings are single-GPU steps).
INSTANCE_FOR_GPU = {"H200": "ml.p5e.48xlarge", "H100": "ml.p5.48xlarge"}
PHASES = ("forward", "backward", "optimizer")
LAUNCH_BOUND_S = 0.080  # steps shorter than this are where the host's dispatch matters (issue 24)


@dataclass(frozen=True)
class Reading:
    """One measured training step and what the planner needs to predict it."""

    folder: str
    index: int  # row order in steps.jsonl
    model: str
    config: TrainConfig
    instance: str
    gpu: str
    stack: dict[str, str]
    step_time_s: float
    peak_allocated: int  # max_memory_allocated over every phase of steps 1 and 2
    peak_reserved: int  # max_memory_reserved, the same
    device_peak: int  # total - free (mem_get_info) after each phase, the largest

    @property
    def label(self) -> str:
        c = self.config
        parts = [self.model, f"b{c.batch_size}", f"s{c.seq_len}", "tf32" if c.tf32 else c.precision, c.attention]
        if c.checkpointing:
            parts.append("ckpt")
        if c.optimizer_impl != "foreach":
            parts.append(c.optimizer_impl)
        return " ".join(parts)


def _env(folder: Path) -> dict[str, Any]:
    path = folder / "env.json"
    return json.loads(path.read_text()) if path.exists() else {}


def gpu_of(env: dict[str, Any]) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'H100' (the families readings exist for)."""
    name = str(env.get("gpu", "")).upper()
    for family in INSTANCE_FOR_GPU:
        if family in name:
            return family
    raise ValueError(f"readings of an unknown GPU: {env.get('gpu')!r}")


def _stack(env: dict[str, Any]) -> dict[str, str]:
    def minor(v: str) -> str:
        return ".".join(str(v).split("+")[0].split(".")[:2])

    return {k: minor(env[k]) for k in ("torch", "cuda", "transformers") if env.get(k)}


def _peak(row: dict[str, Any], key: str) -> int:
    return max(int(row[step][phase][key]) for step in ("step1", "step2") for phase in PHASES)


def _named(row: dict[str, Any], env: dict[str, Any], key: str, default: str) -> str:
    """The row's `loop` / `load` name, else the folder's (env.json), else the default. A row's "load" that is
    not a name is the load phase's memory reading, not the load path."""
    for src in (row, env):
        if isinstance(src.get(key), str):
            return src[key]
    return default


def load_steps(folder: Path) -> list[Reading]:
    """Every successful step of a readings folder."""
    env = _env(folder)
    gpu = gpu_of(env)
    out = []
    for i, line in enumerate((folder / "steps.jsonl").read_text().splitlines()):
        row = json.loads(line)
        if row.get("status", "ok") != "ok" or "step_time_s" not in row:
            continue
        config = TrainConfig(batch_size=row["b"], seq_len=row["s"], precision=row["precision"],
                             attention=row.get("attention", "sdpa"), checkpointing=bool(row.get("ckpt")),
                             optimizer_impl=row.get("optimizer_impl", "foreach"), parallelism="single",
                             tf32=bool(row.get("tf32")), loop=_named(row, env, "loop", "plain"),
                             load=_named(row, env, "load", "direct"))
        out.append(Reading(folder.name, i, row["model"], config, INSTANCE_FOR_GPU[gpu], gpu, _stack(env),
                           float(row["step_time_s"]), _peak(row, "max_alloc"), _peak(row, "max_res"),
                           _peak(row, "used")))
    return out


def load_launch(folder: Path) -> list[dict[str, Any]]:
    """Profiles of small steps: wall time, GPU-busy time, kernels and ATen calls per step."""
    path = folder / "launch.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def fit_split(readings: list[Reading]) -> tuple[list[Reading], list[Reading]]:
    """(fit, held out): every third row (index 2, 5, 8, ...) is held out, the rest fit. The shared file
    cycles precisions within each model and alternates eager with checkpointed steps, so both parts span
    fp32 and AMP, eager and SDPA, GPU- and host-bound steps (an even/odd split put every eager step in one
    part)."""
    return [r for r in readings if r.index % 3 != 2], [r for r in readings if r.index % 3 == 2]
