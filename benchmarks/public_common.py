"""What public_memory.py and public_speed.py share: run `planner.estimate` on a public row, read its JSON.

Only the public API is used (`planner.estimate(...)` and the keys of `Estimate.model_dump(mode="json")`),
so the scripts keep working while the internals change. A row's software stack (torch / CUDA /
transformers versions) is passed only where `estimate` accepts it: `torch_version=`, `cuda_version=`,
`transformers_version=` or `stack=`; otherwise the planner's defaults apply and the scripts say so.
"""

from __future__ import annotations

import inspect
import statistics
from typing import Any

import planner
from planner.probes.public import PublicRun

STACK_KWARGS = {"torch": "torch_version", "cuda": "cuda_version", "transformers": "transformers_version"}


def stack_kwargs(row: PublicRun) -> dict[str, Any]:
    """The row's stack as keyword arguments `planner.estimate` accepts today (empty when none)."""
    params = inspect.signature(planner.estimate).parameters
    out: dict[str, Any] = {}
    stack = row.stack()
    for field, name in STACK_KWARGS.items():
        if field in stack and name in params:
            out[name] = stack[field]
    if stack and "stack" in params and not out:
        out["stack"] = stack
    return out


def run_estimate(row: PublicRun, with_throughput: bool) -> tuple[dict[str, Any], bool]:
    """(Estimate JSON, whether the row's stack was used). A stack the planner rejects falls back to defaults."""
    from planner.errors import PlannerError

    args = (row.model, row.train_config(), row.instance())
    kwargs: dict[str, Any] = {"model_options": row.model_options(), "with_throughput": with_throughput}
    extra = stack_kwargs(row)
    if extra:
        try:
            return planner.estimate(*args, **kwargs, **extra).model_dump(mode="json"), True
        except (PlannerError, TypeError):
            pass
    return planner.estimate(*args, **kwargs).model_dump(mode="json"), False


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value * 100:+.0f}%"


def abs_pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value * 100:.0f}%"
