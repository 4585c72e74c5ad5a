"""Pareto fronts of a search's feasible configurations.

- time vs $ per job (the `pareto` objective, over every instance type and count): a configuration is on
  the front when no other is both faster and cheaper;
- throughput vs sequence length: longer sequences cost samples/s; the front says the fastest (or, for a
  cost objective, cheapest) configuration for each length and drops lengths that a longer one beats;
- throughput vs $: kept for the report.
"""

from __future__ import annotations

from planner.search.columns import cost_column, feasible, time_column
from planner.search.table import Row, missing, on_rows, sort_rows


@on_rows
def pareto_front(rows: list[Row], objectives: dict[str, bool]) -> list[Row]:
    """Rows not dominated by another row; `objectives` maps column -> True to maximise, False to minimise.

    Row a dominates b when a is at least as good in every objective and better in one. Rows with a
    missing objective value are left out. Sort by the first objective, then one pass keeping each row
    strictly better than every kept row in the rest: O(n log n) for two objectives; more objectives use
    the O(n²) pairwise test.
    """
    cols = list(objectives)
    data = [r for r in rows if not any(missing(r[c]) for c in cols)]
    if not data:
        return data
    signs = [1.0 if objectives[c] else -1.0 for c in cols]
    points = [tuple(s * float(r[c]) for s, c in zip(signs, cols, strict=True)) for r in data]
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
    first = cols[0]
    return sort_rows([data[i] for i in keep], [(lambda r: r[first], not objectives[first])])


@on_rows
def time_vs_cost(rows: list[Row]) -> list[Row]:
    """Over all instance types and counts: the front of (hours per job down, $ per job down), fastest first."""
    data = feasible(rows)
    if not data:
        return data
    return pareto_front(data, {time_column(data): False, cost_column(data): False})


@on_rows
def throughput_vs_seq_len(rows: list[Row], direction: str = "maximize", value: str = "samples_per_s") -> list[Row]:
    """The front of (sequence length up, `value` better), shortest first."""
    data = feasible(rows)
    if not data:
        return data
    return sort_rows(pareto_front(data, {"seq_len": True, value: direction == "maximize"}),
                     [(lambda r: r["seq_len"], True)])


@on_rows
def throughput_vs_cost(rows: list[Row]) -> list[Row]:
    """Over all instance types: the front of (samples/s up, $ down), fastest first."""
    data = feasible(rows)
    if not data:
        return data
    return pareto_front(data, {"samples_per_s": True, cost_column(data): False})
