"""The last trials of a TPE search: one-dimension changes to the best configurations it found.

Why: TPE models each region of the space from the trials it has, so with several instance types it can settle
in one type's basin and never pair the right values in another (benchmarks/search_benchmark.py: on the
3-type joint space two seeds of ten ended 2.7 % above the optimum, on a type whose best configuration was
one change away from the optimum). A user reading the winner asks the same thing: "would switching one
setting do better?". The search therefore keeps the last trials of its budget for exactly that question,
asked of the best configuration of each of the leading instance types: every other value of one
categorical dimension, the next smaller and larger value of an ordered one (micro-batch). Points already
tried are skipped; what remains is interleaved across the types so each gets its share.

Pure: works on parameter dicts; the caller enqueues the result in Optuna (`Study.enqueue_trial`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from itertools import chain, zip_longest
from typing import Any

from planner.search.space import INDEX_SUFFIX

Params = dict[str, Any]
# At most this many trials of a TPE budget go to polishing, and never more than a fifth of it.
POLISH_TRIALS = 16
POLISH_SHARE = 5
# The best configurations of this many instance types (ranked by their best value) are polished.
POLISH_TYPES = 2


def polish_reserve(budget: int) -> int:
    """Trials kept at the end of a budget for polishing."""
    return min(POLISH_TRIALS, budget // POLISH_SHARE)


def neighbours(params: Params, parameters: dict[str, tuple[Any, ...]]) -> list[Params]:
    """Every point one change away: another value of a categorical parameter, the adjacent index of an
    ordered one (`*_index`)."""
    out = []
    for name, choices in parameters.items():
        if name not in params:
            continue
        if name.endswith(INDEX_SUFFIX):
            moves = [i for i in (params[name] - 1, params[name] + 1) if 0 <= i < len(choices)]
        else:
            moves = [c for c in choices if c != params[name]]
        out.extend({**params, name: value} for value in moves)
    return out


def _key(params: Params) -> tuple:
    return tuple(sorted(params.items()))


def polish_points(tried: Iterable[Params], parameters: dict[str, tuple[Any, ...]],
                  score: Callable[[Params], float | None], limit: int, types: int = POLISH_TYPES) -> list[Params]:
    """Up to `limit` untried neighbours of the best point of each of the `types` best instance types.

    `score(params)` is the point's value to minimise, None when infeasible (the caller negates a value to
    maximise); `tried` are the parameter dicts of every trial so far."""
    tried = list(tried)
    seen = {_key(p) for p in tried}
    best: dict[Any, tuple[float, Params]] = {}
    for params in tried:
        value = score(params)
        if value is None:
            continue
        group = params.get("instance")
        if group not in best or value < best[group][0]:
            best[group] = (value, params)
    leaders = sorted(best.values(), key=lambda vp: vp[0])[:types]
    lists = [neighbours(params, parameters) for _, params in leaders]
    out: list[Params] = []
    for params in chain.from_iterable(zip_longest(*lists)):
        if params is None or _key(params) in seen:
            continue
        seen.add(_key(params))
        out.append(params)
        if len(out) >= limit:
            break
    return out
