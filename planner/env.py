"""Settings read from the environment, checked like any flag: a value that is not what the variable takes is
a `PlannerError` naming the variable, never a traceback from `int("abc")` or a silent NaN limit.

Why here, standard library only: the limits are module constants (pydantic field bounds), read when `planner`
is imported, and the `planner` command checks them before importing anything heavy (`planner._startup`), so a
bad value is one line and exit 2 there too.
"""

from __future__ import annotations

import math
import os

from planner.errors import PlannerError

# name: (default, lowest, highest, integer). Each default is explained where it is used (planner.spec,
# planner.search.limits); the highest values are far above any real job and only bound how far a user may
# raise a limit (a search's products stay under its recipe's global batch, itself at most 2^53).
LIMITS: dict[str, tuple[float, float, float, bool]] = {
    "PLANNER_MAX_INSTANCES": (2048, 1, 2**20, True),
    "PLANNER_MAX_GRAD_ACCUM": (2**16, 1, 2**20, True),
    "PLANNER_MAX_EPOCHS": (1e6, 1, 1e12, False),
}
# name: the values it takes ("" = unset).
CHOICES: dict[str, tuple[str, ...]] = {
    "PLANNER_COMPILED_REPLAY": ("", "0", "1"),
    "PLANNER_TRACE_CACHE": ("", "0", "1"),  # 0: traces are not kept on disk (planner.program.trace_cache)
}


def _kind(low: float, high: float, integer: bool) -> str:
    if integer:
        return f"an integer >= {int(low):,} and <= {int(high):,}"
    return f"a finite number >= {low:g} and <= {high:g}"


def limit(name: str) -> int | float:
    """The limit `name` from the environment (its default when unset or empty)."""
    default, low, high, integer = LIMITS[name]
    raw = os.environ.get(name, "").strip()
    if not raw:
        return int(default) if integer else default
    try:
        value = float(raw)
    except ValueError:
        raise PlannerError(name, raw, _kind(low, high, integer)) from None
    if not math.isfinite(value) or not low <= value <= high or (integer and not value.is_integer()):
        raise PlannerError(name, raw, _kind(low, high, integer))
    return int(value) if integer else value


def choice(name: str) -> str:
    """The setting `name` from the environment ("" when unset)."""
    raw = os.environ.get(name, "").strip()
    if raw not in CHOICES[name]:
        raise PlannerError(name, raw, "one of " + ", ".join(repr(c) for c in CHOICES[name] if c) + " or unset")
    return raw


def check_environment() -> PlannerError | None:
    """The first bad setting, if any (the `planner` command reports it before starting)."""
    try:
        for name in LIMITS:
            limit(name)
        for name in CHOICES:
            choice(name)
    except PlannerError as exc:
        return exc
    return None
