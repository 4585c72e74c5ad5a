"""A DeepSpeed config file (ds_config JSON) read into the settings the planner uses (spec.DeepSpeedSettings):
the ZeRO stage, bf16/fp16, bucket and prefetch sizes. Errors name --ds-config (or the sweep field) and exit 2."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from planner.errors import PlannerError
from planner.spec import DeepSpeedSettings

# ds_config keys read (zero_optimization.*), by DeepSpeedSettings field; "auto" values (the Hugging Face
# integration fills them from the model) keep DeepSpeed's default
_ZERO_KEYS = {"reduce_bucket_size": "reduce_bucket_size", "allgather_bucket_size": "allgather_bucket_size",
              "stage3_prefetch_bucket_size": "prefetch_bucket_size",
              "stage3_param_persistence_threshold": "param_persistence_threshold",
              "stage3_max_live_parameters": "max_live_parameters",
              "contiguous_gradients": "contiguous_gradients", "overlap_comm": "overlap_comm",
              "sub_group_size": "sub_group_size"}
STAGE_STRATEGY = {0: "ddp", 1: "zero1", 2: "zero2", 3: "zero3"}


def read_ds_config(path: str, flag: str = "--ds-config") -> DeepSpeedSettings:
    """The settings of a ds_config file; PlannerError (exit 2) naming --ds-config when it does not parse."""
    try:
        raw = json.loads(Path(path).read_text())
    except OSError as e:
        raise PlannerError(flag, path, f"a readable DeepSpeed JSON file ({e.strerror})") from None
    except json.JSONDecodeError as e:
        raise PlannerError(flag, path, f"valid JSON (line {e.lineno}: {e.msg})") from None
    except UnicodeDecodeError:
        raise PlannerError(flag, path, "a UTF-8 JSON text file") from None
    if not isinstance(raw, dict):
        raise PlannerError(flag, path, "a JSON object (DeepSpeed's ds_config)")
    zero = raw.get("zero_optimization") or {}
    if not isinstance(zero, dict):
        raise PlannerError(flag, path, "zero_optimization as an object")
    out: dict[str, Any] = {"source": path}
    stage = zero.get("stage")
    if stage is not None and stage != "auto":
        if stage not in STAGE_STRATEGY:
            raise PlannerError(flag, path, f"zero_optimization.stage 0-3, not {stage!r}")
        out["stage"] = stage
    for key, name in _ZERO_KEYS.items():
        value = zero.get(key)
        if value is None or value == "auto":
            continue
        if isinstance(value, bool) != (name in ("contiguous_gradients", "overlap_comm")) or (
                not isinstance(value, bool) and not isinstance(value, (int, float))):
            raise PlannerError(flag, path, f"zero_optimization.{key} as a number or true/false")
        out[name] = value if isinstance(value, bool) else int(value)
    # no "optimizer" block: the script's own optimizer steps the partitions (spec.DeepSpeedSettings)
    out["client_optimizer"] = "optimizer" not in raw
    for dtype in ("bf16", "fp16"):
        section = raw.get(dtype)
        if isinstance(section, dict) and str(section.get("enabled", False)).lower() == "true":
            out["dtype"] = dtype
    try:
        return DeepSpeedSettings(**out)
    except ValueError as e:
        why = str(e).splitlines()[1]
        raise PlannerError(flag, path, f"non-negative sizes, sub_group_size >= 1 ({why})") from None
