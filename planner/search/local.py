"""Each instance type's own search in a multi-type study: descent from the memory model's start.

Why: with many instance types (`--instance all`, 55 types) a shared TPE budget gives each type ~10 trials,
and TPE then reports a type at what it happened to sample: ml.p3.16xlarge at 876.8 samples/s where a
search of that type alone finds 1,013.7 (issue 22). A type's space is small and mostly smooth (larger
micro-batches are faster until memory runs out; one precision, parallelism or kernel is better than
another), so a deterministic descent from a start that fits (study.start_points) reaches what a search of
that type alone finds in a few dozen cached estimates, where TPE would need ~100 trials per type.

The descent: from the current point, every move below is scored, and the best one is taken while it
improves the value; it stops at a point no move improves (a local optimum of that neighbourhood).

- the micro-batch (`batch_size_index`): every other value (a line search: the best split of the global
  batch into micro-batch x accumulation is rarely one step away from the start);
- another value of one categorical setting (precision, checkpointing, parallelism, optimizer kernel,
  attention), at the same micro-batch and at the next larger one when that fits, the next smaller one
  when it does not: switching on checkpointing or a sharded parallelism only pays with the larger
  micro-batch it makes fit, and a precision that needs more memory may need the next smaller one;
- the next smaller or larger value of any other ordered setting (instance count, sequence length).

Pure: works on parameter dicts and a score (the caller's objective, cached); the caller records the
points as trials of its study.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from planner.search.space import INDEX_SUFFIX

Params = dict[str, Any]
Score = Callable[[Params], float | None]  # the value to minimise; None when infeasible
BATCH = "batch_size" + INDEX_SUFFIX
# A descent never takes more moves than this (each move strictly improves, so it ends anyway; the cap
# bounds the time a pathological objective could take).
MAX_MOVES = 12
Group = tuple[Params, Params | None, Params | None]  # a move, and the same with the next smaller / larger batch


def move_groups(params: Params, parameters: dict[str, tuple[Any, ...]],
                fixed: tuple[str, ...] = ("instance",)) -> list[Group]:
    """The moves from `params` (see the module docstring), each with its variants at the next smaller and
    larger micro-batch (None where there is none: ordered settings, the batch itself, the ends of the
    batch line); `fixed` parameters never change."""
    out: list[Group] = []
    batch = params.get(BATCH)
    count = len(parameters.get(BATCH, ()))
    for name, choices in parameters.items():
        if name in fixed or name not in params:
            continue
        if name == BATCH:
            out.extend(({**params, name: i}, None, None) for i in choices if i != params[name])
        elif name.endswith(INDEX_SUFFIX):
            out.extend(({**params, name: i}, None, None) for i in (params[name] - 1, params[name] + 1)
                       if 0 <= i < len(choices))
        else:
            for value in choices:
                if value == params[name]:
                    continue
                moved = {**params, name: value}
                smaller = {**moved, BATCH: batch - 1} if batch is not None and batch > 0 else None
                larger = {**moved, BATCH: batch + 1} if batch is not None and batch + 1 < count else None
                out.append((moved, smaller, larger))
    return out


def moves(params: Params, parameters: dict[str, tuple[Any, ...]], fixed: tuple[str, ...] = ("instance",)) -> list[Params]:
    """Every point one move away from `params`, variants included."""
    return [p for group in move_groups(params, parameters, fixed) for p in group if p is not None]


def descend(start: Params, parameters: dict[str, tuple[Any, ...]], score: Score,
            max_moves: int = MAX_MOVES) -> list[Params]:
    """The descent's path: `start`, then the point each improving move reached (the last is the best);
    only `start` when it is infeasible (nothing to descend from).

    A move's batch variant is scored only where it can matter: the larger micro-batch when the move fits
    (it may have freed memory), the smaller when it does not (it may need memory); memory grows with the
    micro-batch (study.start_points bisects on the same fact), so the other variant would not fit, or
    would run a smaller micro-batch than one that fits. A third fewer estimates than scoring both."""
    path = [start]
    best = score(start)
    if best is None:
        return path
    for _ in range(max_moves):
        scored: list[tuple[float, Params]] = []
        for moved, smaller, larger in move_groups(path[-1], parameters):
            value = score(moved)
            variant = smaller if value is None else larger
            for point, v in ((moved, value), (variant, None if variant is None else score(variant))):
                if v is not None:
                    scored.append((v, point))
        if not scored:
            break
        value, point = min(scored, key=lambda vp: vp[0])
        if value >= best:
            break
        best = value
        path.append(point)
    return path
