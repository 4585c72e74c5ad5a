"""The --ep / --etp / --moe-imbalance flags of estimate and explain (search and sweep files take them through
planner.cli.job_flags, since they are TrainConfig fields), and the fields they set (issue 35; the layout rules:
planner.parallel.dims, where the model is known: planner.pipeline.resolve.check_experts)."""

from __future__ import annotations

import math
from typing import Annotated, Any

import typer

from planner.errors import PlannerError
from planner.spec import TrainConfig

EpOpt = Annotated[int, typer.Option(
    "--ep", help="Expert parallelism: each MoE layer's experts split over N GPUs (it must divide the experts).")]
EtpOpt = Annotated[int, typer.Option(
    "--etp", help="Expert tensor parallelism: each expert split over N GPUs (ep × etp × pp divides the GPUs).")]
MoeImbalanceOpt = Annotated[float, typer.Option(
    "--moe-imbalance", help="The busiest GPU's share of routed tokens over the mean (1.0: balanced).")]

def _check_degree(flag: str, value: int) -> int:
    top = next(m.le for m in TrainConfig.model_fields[flag.lstrip("-")].metadata if getattr(m, "le", None))
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= top:
        raise PlannerError(flag, value, f"an integer from 1 to {top:,}")
    return value


def moe_fields(ep: int = 1, etp: int = 1, moe_imbalance: float = 1.0) -> dict[str, Any]:
    """The TrainConfig fields of the three flags (empty at their defaults, so other configs stay as they were)."""
    out: dict[str, Any] = {}
    if _check_degree("--ep", ep) != 1:
        out["ep"] = ep
    if _check_degree("--etp", etp) != 1:
        out["etp"] = etp
    if not isinstance(moe_imbalance, int | float) or not math.isfinite(moe_imbalance) \
            or not 1.0 <= moe_imbalance <= 1024.0:
        raise PlannerError("--moe-imbalance", moe_imbalance, "a number from 1.0 (balanced) to 1024")
    if moe_imbalance != 1.0:
        out["moe_imbalance"] = float(moe_imbalance)
    return out


def moe_flags(config: Any) -> list[str]:
    """The flags that reproduce a config's expert layout (for the probe line)."""
    parts = []
    if config.ep != 1:
        parts.append(f"--ep {config.ep}")
    if config.etp != 1:
        parts.append(f"--etp {config.etp}")
    if config.moe_imbalance != 1.0:
        parts.append(f"--moe-imbalance {config.moe_imbalance:g}")
    return parts
