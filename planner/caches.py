"""Every cache the planner keeps, made through one helper that remembers it, so clearing is one loop.

Why: an estimate derives the same things again and again (a search makes thousands), so about fifty tables
keep them: module dicts (kept per key, or per object identity through `identity_cache.per_object`) and
`functools.lru_cache` functions. Each is declared here with its name, the key it is looked up by (written
beside the function it serves) and a scope saying what clears it:
- "step": what one configuration derives (activations, traces, replays, peaks, runtime constants):
  `estimate.clear_caches()` clears these, so a benchmark starts each row cold;
- "model": what one model or shape class derives and a search keeps warm across configurations (blocks,
  parameter shapes, kernel tables, speed terms);
- "facts": the data files read once (GPUs, instances, stacks, prices, calibration).
`clear("step")` clears one scope; `clear()` every table the planner made.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Literal, TypeVar

Scope = Literal["step", "model", "facts"]
F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class Cache:
    """One table: its name, the key it is looked up by, its scope and how to empty it."""

    name: str
    key: str
    scope: Scope
    clear: Callable[[], None]


_ALL: dict[str, Cache] = {}


def _register(name: str, key: str, scope: Scope, clear: Callable[[], None]) -> None:
    _ALL[name] = Cache(name, key, scope, clear)


def table(name: str, *, key: str, scope: Scope) -> dict[Any, Any]:
    """A new module-level cache dict, remembered under `name` (the module and variable it is bound to)."""
    d: dict[Any, Any] = {}
    _register(name, key, scope, d.clear)
    return d


def adopt(name: str, container: Any, *, key: str, scope: Scope) -> Any:
    """Remember a cache made otherwise (an OrderedDict kept in use order, a one-element memo list)."""
    _register(name, key, scope, container.clear)
    return container


def lru(maxsize: int | None, *, key: str, scope: Scope) -> Callable[[F], F]:
    """`functools.lru_cache(maxsize)` (None: unbounded), remembered under the function's module and name."""
    def wrap(fn: F) -> F:
        cached = lru_cache(maxsize=maxsize)(fn)
        _register(f"{fn.__module__}.{fn.__qualname__}", key, scope, cached.cache_clear)
        return cached  # type: ignore[return-value]

    return wrap


def clear(scope: Scope | None = None) -> None:
    """Empty every table of `scope` (None: every table the planner made)."""
    for c in _ALL.values():
        if scope is None or c.scope == scope:
            c.clear()


def registered() -> dict[str, Cache]:
    """Every table made so far (those of the modules imported), by name."""
    return dict(_ALL)
