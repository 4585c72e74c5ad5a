"""One error type for bad input, so the CLI can print one line and exit 2 without a traceback."""

from __future__ import annotations

from collections.abc import Iterable


class PlannerError(ValueError):
    """Bad input: names the field, the value and what is allowed."""

    def __init__(self, field: str, value: object, allowed: str | Iterable[str]):
        self.field = field
        self.value = value
        self.allowed = allowed if isinstance(allowed, str) else ", ".join(str(a) for a in allowed)
        super().__init__(f"{field}={value!r} is not allowed: {self.allowed}")


def closest(value: str, choices: Iterable[str], n: int = 3) -> list[str]:
    """Closest names, to suggest on a typo."""
    import difflib

    choices = list(choices)
    found = difflib.get_close_matches(value, choices, n=n, cutoff=0.5)
    if not found:
        found = [c for c in choices if value.lower() in c.lower()][:n]
    return found


def unknown(field: str, value: str, choices: Iterable[str]) -> PlannerError:
    choices = list(choices)
    near = closest(value, choices)
    hint = f"did you mean {', '.join(near)}?" if near else f"one of {', '.join(choices)}"
    return PlannerError(field, value, f"unknown; {hint}")
