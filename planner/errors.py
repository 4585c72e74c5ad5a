"""One error type for bad input, so the CLI can print one line and exit 2 without a traceback."""

from __future__ import annotations

from collections.abc import Iterable


class PlannerError(ValueError):
    """Bad input: names the field, the value and what is allowed."""

    def __init__(self, field: str, value: object, allowed: str | Iterable[str]):
        self.field = field
        self.value = value
        self.allowed = allowed if isinstance(allowed, str) else ", ".join(str(a) for a in allowed)
        super().__init__(f"{field}={short_repr(value)} is not allowed: {self.allowed}")


# The longest value an error line shows: a value built from a file (a list of a million entries, a YAML
# document) would make a line of millions of characters.
MAX_VALUE_CHARS = 200


def short_repr(value: object) -> str:
    """repr(value), cut to MAX_VALUE_CHARS with '...' (reprlib keeps big containers cheap to print)."""
    import reprlib

    r = reprlib.Repr()
    r.maxstring = r.maxother = MAX_VALUE_CHARS
    r.maxlist = r.maxtuple = r.maxdict = r.maxset = 20
    r.maxlevel = 4
    text = r.repr(value)
    return text if len(text) <= MAX_VALUE_CHARS else text[: MAX_VALUE_CHARS - 3] + "..."


def closest(value: str, choices: Iterable[str], n: int = 3) -> list[str]:
    """Closest names, to suggest on a typo."""
    import difflib

    choices = list(choices)
    low = value.lower()
    # Names that begin with what was typed come first ("bert-large" -> bert-large-uncased, not roberta-large,
    # which difflib ranks higher for sharing more letters), then those that contain it, then the similar.
    starts = [c for c in choices if c.lower().startswith(low)]
    contains = [c for c in choices if low in c.lower() and c not in starts]
    similar = difflib.get_close_matches(value, choices, n=n, cutoff=0.5)
    found = list(dict.fromkeys([*starts, *contains, *similar]))
    return found[:n]


def unknown(field: str, value: str, choices: Iterable[str]) -> PlannerError:
    choices = list(choices)
    near = closest(value, choices)
    hint = f"did you mean {', '.join(near)}?" if near else f"one of {', '.join(choices)}"
    return PlannerError(field, value, f"unknown; {hint}")


def interrupted(exc: BaseException | None) -> bool:
    """Ctrl-C somewhere in the chain of `exc`: a library's cleanup code can replace the KeyboardInterrupt
    with its own error. Optuna 5.0's `_run_trial` does, when Ctrl-C lands inside `tell` (its `finally` reads
    `updated_state` before assignment: UnboundLocalError; the same pattern as optuna/optuna#5280)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, KeyboardInterrupt):
            return True
        seen.add(id(exc))
        # `raise ... from None` (a command that already answered the interrupt) ends the chain
        exc = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
    return False


# Model fields whose flag is not the field's name with dashes (planner.probes.spec.ProbeSpec).
FLAG_OF_FIELD = {"measure_steps": "--steps"}


def one_line(exc: BaseException) -> str:
    """A pydantic ValidationError or PlannerError as one line naming the field. Here, beside the errors, so
    the core (a search's infeasible-point reasons) and the CLI word an error the same way without the core
    importing the CLI."""
    try:
        from pydantic import ValidationError
    except ImportError:  # pragma: no cover
        ValidationError = ()  # type: ignore[assignment]
    if isinstance(exc, ValidationError):
        parts = []
        for e in exc.errors():
            loc = [str(x) for x in e["loc"]]
            # A TrainConfig field is a flag on the command line: batch_size -> --batch-size.
            field = (FLAG_OF_FIELD.get(loc[0], "--" + loc[0].replace("_", "-")) if len(loc) == 1
                     else ".".join(loc) or "input")
            parts.append(f"{field}={short_repr(e.get('input'))}: {e['msg']}")
        return "; ".join(parts)
    return str(exc).replace("\n", " ")
