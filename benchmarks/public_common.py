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


def major_minor(version: str) -> str:
    """'1.6.0+cu101' -> '1.6' (the stack table is keyed by X.Y)."""
    parts = version.split("+")[0].split(".")
    return ".".join(parts[:2])


def stack_kwargs(row: PublicRun, fields: tuple[str, ...] = ("torch", "cuda", "transformers")) -> dict[str, Any]:
    """The row's stack (only `fields`) as keyword arguments `planner.estimate` accepts today (empty when none)."""
    params = inspect.signature(planner.estimate).parameters
    stack = {k: major_minor(v) for k, v in row_stack(row).items() if k in fields}
    out: dict[str, Any] = {name: stack[field] for field, name in STACK_KWARGS.items()
                           if field in stack and name in params}
    if stack and "stack" in params and not out:
        out["stack"] = stack
    return out


def row_stack(row: PublicRun) -> dict[str, str]:
    """The versions the source states; else those of the NGC container its stack note names (NGC release
    notes, planner/data/stacks.json "ngc")."""
    from planner.memory.stack import ngc_stack

    return row.stack() or ngc_stack(row.stack_note) or {}


# What to try, most complete first: a stack table may not know an old transformers (or CUDA) version.
STACK_TRIES = (("torch", "cuda", "transformers"), ("torch", "cuda"), ("torch",))


def run_estimate(row: PublicRun, with_throughput: bool) -> tuple[dict[str, Any], str]:
    """(Estimate JSON, which stack was used: "full", "partial" or "none"). A stack the planner rejects is
    retried with fewer fields, then dropped (the planner's defaults)."""
    from planner.errors import PlannerError

    args = (row.model, row.train_config(), row.instance())
    kwargs: dict[str, Any] = {"model_options": row.model_options(), "with_throughput": with_throughput}
    for number, fields in enumerate(STACK_TRIES):
        extra = stack_kwargs(row, fields)
        if not extra:
            continue
        try:
            est = planner.estimate(*args, **kwargs, **extra).model_dump(mode="json")
        except (PlannerError, TypeError):
            continue
        return est, "full" if number == 0 and len(row_stack(row)) == 3 else "partial"
    return planner.estimate(*args, **kwargs).model_dump(mode="json"), "none"


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value * 100:+.0f}%"


def abs_pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value * 100:.0f}%"
