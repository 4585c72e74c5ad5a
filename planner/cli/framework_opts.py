"""The --framework and --ds-config flags shared by estimate, explain, probe and search, and the TrainConfig
fields they set (`framework`, `deepspeed`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from planner.errors import PlannerError
from planner.spec import FRAMEWORKS, DeepSpeedSettings

FrameworkOpt = Annotated[str, typer.Option(
    "--framework", help="Whose layouts and defaults apply: " + ", ".join(FRAMEWORKS) + " (default pytorch: a "
                        "plain loop with autocast).")]
DsConfigOpt = Annotated[str | None, typer.Option(
    "--ds-config", help="DeepSpeed JSON config of the job (stage, bf16/fp16, bucket and prefetch sizes).")]

# ds_config keys read (zero_optimization.*), by DeepSpeedSettings field; "auto" values (the Hugging Face
# integration fills them from the model) keep DeepSpeed's default
_ZERO_KEYS = {"reduce_bucket_size": "reduce_bucket_size", "allgather_bucket_size": "allgather_bucket_size",
              "stage3_prefetch_bucket_size": "prefetch_bucket_size",
              "stage3_param_persistence_threshold": "param_persistence_threshold",
              "stage3_max_live_parameters": "max_live_parameters",
              "contiguous_gradients": "contiguous_gradients", "overlap_comm": "overlap_comm"}
STAGE_STRATEGY = {0: "ddp", 1: "zero1", 2: "zero2", 3: "zero3"}


def read_ds_config(path: str) -> DeepSpeedSettings:
    """The settings of a ds_config file; PlannerError (exit 2) naming --ds-config when it does not parse."""
    try:
        raw = json.loads(Path(path).read_text())
    except OSError as e:
        raise PlannerError("--ds-config", path, f"a readable DeepSpeed JSON file ({e.strerror})") from None
    except json.JSONDecodeError as e:
        raise PlannerError("--ds-config", path, f"valid JSON (line {e.lineno}: {e.msg})") from None
    if not isinstance(raw, dict):
        raise PlannerError("--ds-config", path, "a JSON object (DeepSpeed's ds_config)")
    zero = raw.get("zero_optimization") or {}
    if not isinstance(zero, dict):
        raise PlannerError("--ds-config", path, "zero_optimization as an object")
    out: dict[str, Any] = {"source": path}
    stage = zero.get("stage")
    if stage is not None and stage != "auto":
        if stage not in STAGE_STRATEGY:
            raise PlannerError("--ds-config", path, f"zero_optimization.stage 0-3, not {stage!r}")
        out["stage"] = stage
    for key, name in _ZERO_KEYS.items():
        value = zero.get(key)
        if value is None or value == "auto":
            continue
        if isinstance(value, bool) != (name in ("contiguous_gradients", "overlap_comm")) or (
                not isinstance(value, bool) and not isinstance(value, (int, float))):
            raise PlannerError("--ds-config", path, f"zero_optimization.{key} as a number or true/false")
        out[name] = value if isinstance(value, bool) else int(value)
    for dtype in ("bf16", "fp16"):
        section = raw.get(dtype)
        if isinstance(section, dict) and str(section.get("enabled", False)).lower() == "true":
            out["dtype"] = dtype
    try:
        return DeepSpeedSettings(**out)
    except ValueError as e:
        raise PlannerError("--ds-config", path, f"non-negative sizes ({str(e).splitlines()[1]})") from None


def framework_fields(framework: str, ds_config: str | None, parallelism: str = "auto",
                     precision: str | None = None) -> dict[str, Any]:
    """The TrainConfig fields of --framework / --ds-config (empty for the defaults). A ds_config's stage sets an
    "auto" parallelism and must agree with a given one; its bf16/fp16 must agree with --precision."""
    from planner.parallel.frameworks import get

    get(framework)  # an unknown framework: one line, exit 2
    out: dict[str, Any] = {}
    if framework != "pytorch":
        out["framework"] = framework
    if ds_config is None:
        return out
    if framework not in ("deepspeed", "accelerate", "lightning"):
        raise PlannerError("--ds-config", ds_config, "with --framework deepspeed, accelerate or lightning")
    ds = read_ds_config(ds_config)
    out["deepspeed"] = ds
    if ds.stage is not None:
        wanted = STAGE_STRATEGY[ds.stage]
        if parallelism == "auto":
            out["parallelism"] = wanted
        elif parallelism != wanted and not (ds.stage == 0 and parallelism == "single"):
            raise PlannerError("--parallelism", parallelism,
                               f"{wanted} (the ds_config's zero_optimization.stage {ds.stage}), or leave it out")
    if ds.dtype and precision is not None and ds.dtype not in precision:
        raise PlannerError("--precision", precision, f"amp-{ds.dtype} or {ds.dtype} (the ds_config enables {ds.dtype})")
    return out


def framework_flags(config: Any) -> list[str]:
    """The flags that reproduce a config's framework (for the probe line)."""
    parts = [] if config.framework == "pytorch" else [f"--framework {config.framework}"]
    if config.deepspeed is not None and config.deepspeed.source:
        parts.append(f"--ds-config {config.deepspeed.source}")
    return parts
