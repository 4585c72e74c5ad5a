"""Pareto fronts of a search's feasible configurations.

- time vs $ per job (the `pareto` objective, over every instance type and count): a configuration is on
  the front when no other is both faster and cheaper;
- throughput vs sequence length: longer sequences cost samples/s; the front says the fastest (or, for a
  cost objective, cheapest) configuration for each length and drops lengths that a longer one beats;
- throughput vs $: kept for the report.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from planner.search.columns import cost_column, feasible, time_column

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd


def pareto_front(frame: pd.DataFrame, objectives: dict[str, bool]) -> pd.DataFrame:
    """Rows not dominated by another row; `objectives` maps column -> True to maximise, False to minimise.

    Row a dominates b when a is at least as good in every objective and better in one. Rows with a
    missing objective value are left out. Sort by the first objective, then one pass keeping each row
    strictly better than every kept row in the rest: O(n log n) for two objectives; more objectives use
    the O(n²) pairwise test.
    """
    cols = list(objectives)
    data = frame.dropna(subset=cols)
    if data.empty:
        return data
    signs = [1.0 if objectives[c] else -1.0 for c in cols]
    points = [tuple(s * float(v) for s, v in zip(signs, row, strict=True)) for row in data[cols].itertuples(index=False)]
    keep: list[int] = []
    seen: set[tuple[float, ...]] = set()
    if len(cols) == 2:
        best_second = -float("inf")
        for i in sorted(range(len(points)), key=lambda k: (-points[k][0], -points[k][1])):
            if points[i][1] > best_second and points[i] not in seen:
                keep.append(i)
                seen.add(points[i])
                best_second = points[i][1]
    else:
        for i, p in enumerate(points):
            dominated = any(all(q[j] >= p[j] for j in range(len(p))) and q != p for q in points)
            if not dominated and p not in seen:
                keep.append(i)
                seen.add(p)
    return data.iloc[keep].sort_values(cols[0], ascending=not objectives[cols[0]], kind="stable")


def time_vs_cost(frame: pd.DataFrame) -> pd.DataFrame:
    """Over all instance types and counts: the front of (hours per job down, $ per job down), fastest first."""
    data = feasible(frame)
    if data.empty:
        return data
    return pareto_front(data, {time_column(data): False, cost_column(data): False})


def throughput_vs_seq_len(frame: pd.DataFrame, direction: str = "maximize", value: str = "samples_per_s"
                          ) -> pd.DataFrame:
    """The front of (sequence length up, `value` better), shortest first."""
    data = feasible(frame)
    if data.empty:
        return data
    return pareto_front(data, {"seq_len": True, value: direction == "maximize"}).sort_values("seq_len",
                                                                                            kind="stable")


def throughput_vs_cost(frame: pd.DataFrame) -> pd.DataFrame:
    """Over all instance types: the front of (samples/s up, $ down), fastest first."""
    data = feasible(frame)
    if data.empty:
        return data
    return pareto_front(data, {"samples_per_s": True, cost_column(data): False})
