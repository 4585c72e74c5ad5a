"""Optuna search over training configurations: space, sweep files, objective, storage, results.

The public entry point is `planner.search.run_search` (what `planner search` runs). Optuna is imported only
when a search actually runs.
"""

from __future__ import annotations

from typing import Any


def run_search(*args: Any, **kwargs: Any) -> Any:
    """See `planner.search.study.run_search`."""
    from planner.search.study import run_search as _run

    return _run(*args, **kwargs)
