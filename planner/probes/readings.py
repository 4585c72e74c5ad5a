"""Real GPU readings taken outside the probe jobs (results/validation/<gpu>/<folder>/): plain PyTorch training
steps with per-phase CUDA peaks and step times (`steps.jsonl`), profiles of small steps (`launch.jsonl`) and
the versions they ran (`env.json`). Loaded here so that `planner validate` and the fits read them one way.

Which readings may be fitted is decided here, once: the shared H200 folder (not made by this project) is the
fit source, split into a fit part and a held-out third by row order (`fit_split`); the project's own
measured-* folders are held out from every fit.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, ValidationError

from planner.errors import PlannerError, one_line
from planner.io import parse_json, read_json, read_text
from planner.spec import MAX_BATCH, TrainConfig

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


class _Phase(BaseModel):
    """One phase's CUDA memory counters (bytes)."""

    model_config = ConfigDict(extra="allow", strict=True)
    max_alloc: NonNegativeInt
    max_res: NonNegativeInt
    used: NonNegativeInt


class _Step(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    forward: _Phase
    backward: _Phase
    optimizer: _Phase


class StepRow(BaseModel):
    """One successful row of steps.jsonl: the schema `load_steps` holds every row to, so a wrong row is one
    line naming the file, the row and the field (not a KeyError or a `+nan%` table)."""

    model_config = ConfigDict(extra="allow", strict=True)
    model: str = Field(min_length=1, max_length=200)
    b: int = Field(ge=1, le=MAX_BATCH)
    s: int = Field(ge=1, le=MAX_BATCH)
    precision: str
    attention: str = "sdpa"
    ckpt: bool = False
    optimizer_impl: str = "foreach"
    tf32: bool = False
    step_time_s: float = Field(gt=0, allow_inf_nan=False)
    step1: _Step
    step2: _Step


class EnvFile(BaseModel):
    """env.json: the GPU and the versions a readings folder ran with."""

    model_config = ConfigDict(extra="allow")
    gpu: str = Field(min_length=1)
    torch: str | None = None
    cuda: str | None = None
    transformers: str | None = None


def _env(folder: Path) -> EnvFile:
    path = folder / "env.json"
    what = f"--readings {folder}: env.json"
    data = read_json(path, what, dict)
    try:
        env = EnvFile.model_validate(data)
    except ValidationError as exc:
        raise PlannerError(what, str(path), one_line(exc).replace("--", "")) from None
    gpu_of(env.model_dump(), what)
    return env


def gpu_of(env: dict[str, Any], what: str = "env.json gpu") -> str:
    """'NVIDIA H100 80GB HBM3' -> 'H100' (the families readings exist for)."""
    name = str(env.get("gpu", "")).upper()
    for family in INSTANCE_FOR_GPU:
        if family in name:
            return family
    raise PlannerError(f"{what} gpu", env.get("gpu"), f"a GPU readings are compared for: {', '.join(INSTANCE_FOR_GPU)}")


def _stack(env: dict[str, Any]) -> dict[str, str]:
    def minor(v: str) -> str:
        return ".".join(str(v).split("+")[0].split(".")[:2])

    return {k: minor(env[k]) for k in ("torch", "cuda", "transformers") if env.get(k)}


def _peak(row: StepRow, key: str) -> int:
    return max(getattr(getattr(getattr(row, step), phase), key) for step in ("step1", "step2") for phase in PHASES)


def _named(row: dict[str, Any], env: dict[str, Any], key: str, default: str) -> str:
    """The row's `loop` / `load` name, else the folder's (env.json), else the default. A row's "load" that is
    not a name is the load phase's memory reading, not the load path."""
    for src in (row, env):
        if isinstance(src.get(key), str):
            return src[key]
    return default


def load_steps(folder: Path) -> list[Reading]:
    """Every successful step of a readings folder. Rows whose `status` is not "ok" (an OOM, a failure) are
    skipped; every other row must match `StepRow`. A folder with no successful row is refused: a comparison
    of nothing would print nothing and exit 0."""
    env = _env(folder)
    env_dict = env.model_dump()
    gpu = gpu_of(env_dict)
    path = folder / "steps.jsonl"
    what = f"--readings {folder}: steps.jsonl"
    out = []
    index = 0
    for lineno, line in enumerate(read_text(path, what).splitlines(), 1):
        if not line.strip():  # a blank line (a trailing newline too many) holds no row
            continue
        raw = parse_json(line, what, f"{path} line {lineno}")
        i, index = index, index + 1
        if not isinstance(raw, dict):
            raise PlannerError(what, f"line {lineno}", f"a JSON object per line, not {type(raw).__name__}")
        if raw.get("status", "ok") != "ok":
            continue
        try:
            row = StepRow.model_validate(raw)
            config = TrainConfig(batch_size=row.b, seq_len=row.s, precision=row.precision,
                                 attention=row.attention, checkpointing=row.ckpt,
                                 optimizer_impl=row.optimizer_impl, parallelism="single", tf32=row.tf32,
                                 loop=_named(raw, env_dict, "loop", "plain"),
                                 load=_named(raw, env_dict, "load", "direct"))
        except ValidationError as exc:
            raise PlannerError(f"{what} line {lineno}", _short(exc), "a successful row holds model, b, s, "
                               "precision, a finite step_time_s > 0 and step1/step2 forward/backward/optimizer "
                               "max_alloc, max_res, used (integers)") from None
        out.append(Reading(folder.name, i, row.model, config, INSTANCE_FOR_GPU[gpu], gpu, _stack(env_dict),
                           row.step_time_s, _peak(row, "max_alloc"), _peak(row, "max_res"), _peak(row, "used")))
    if not out:
        raise PlannerError("--readings", str(folder), "a steps.jsonl with at least one successful row "
                           "(status ok, with step_time_s)")
    return out


def _short(exc: ValidationError) -> str:
    """The first failing field of a row and its value, short (a row is kilobytes)."""
    e = exc.errors()[0]
    value = repr(e.get("input"))
    return f"{'.'.join(str(x) for x in e['loc'])}={value[:60]}{'...' if len(value) > 60 else ''} ({e['msg']})"


def load_launch(folder: Path) -> list[dict[str, Any]]:
    """Profiles of small steps: wall time, GPU-busy time, kernels and ATen calls per step."""
    path = folder / "launch.jsonl"
    if not path.exists():
        return []
    what = f"--readings {folder}: launch.jsonl"
    return [parse_json(line, what, f"{path} line {n}") for n, line in enumerate(read_text(path, what).splitlines(), 1)
            if line.strip()]


def fit_split(readings: list[Reading]) -> tuple[list[Reading], list[Reading]]:
    """(fit, held out): every third row (index 2, 5, 8, ...) is held out, the rest fit. The shared file
    cycles precisions within each model and alternates eager with checkpointed steps, so both parts span
    fp32 and AMP, eager and SDPA, GPU- and host-bound steps (an even/odd split put every eager step in one
    part)."""
    return [r for r in readings if r.index % 3 != 2], [r for r in readings if r.index % 3 == 2]
