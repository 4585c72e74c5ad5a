"""Pareto fronts of a search's feasible configurations.

- throughput vs sequence length (per instance type): longer sequences cost samples/s; the front says
  the fastest configuration for each length and drops lengths that a longer one beats.
- throughput vs $/epoch (over instance types): a configuration is on the front when no other is both
  faster and cheaper.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd


def pareto_front(frame: pd.DataFrame, objectives: dict[str, bool]) -> pd.DataFrame:
    """Rows not dominated by another row; `objectives` maps column -> True to maximise, False to minimise.

    Row a dominates b when a is at least as good in every objective and better in one. Rows with a
    missing objective value are left out. O(n²) over distinct points, fine for thousands of trials.
    """
    cols = list(objectives)
    data = frame.dropna(subset=cols)
    if data.empty:
        return data
    signs = [1.0 if objectives[c] else -1.0 for c in cols]
    points = [tuple(s * float(v) for s, v in zip(signs, row, strict=True)) for row in data[cols].itertuples(index=False)]
    keep = []
    for i, p in enumerate(points):
        dominated = any(all(q[j] >= p[j] for j in range(len(p))) and q != p for q in points)
        if not dominated and p not in {points[k] for k in keep}:
            keep.append(i)
    return data.iloc[keep].sort_values(cols[0], ascending=not objectives[cols[0]])


def _feasible(frame: pd.DataFrame) -> pd.DataFrame:
    from planner.search.results import unique_configs

    if frame.empty or "feasible" not in frame.columns:
        return frame.iloc[0:0]
    return unique_configs(frame[frame["feasible"]])


def throughput_vs_seq_len(frame: pd.DataFrame) -> pd.DataFrame:
    """Per instance type: the front of (sequence length up, samples/s up), shortest first."""
    import pandas as pd

    data = _feasible(frame)
    if data.empty:
        return data
    fronts = [pareto_front(group, {"seq_len": True, "samples_per_s": True})
              for _, group in data.groupby("instance", sort=False)]
    return pd.concat(fronts).sort_values(["instance", "seq_len"], kind="stable")


def throughput_vs_cost(frame: pd.DataFrame) -> pd.DataFrame:
    """Over all instance types: the front of (samples/s up, $/epoch down), fastest first."""
    from planner.search.results import cost_column

    data = _feasible(frame)
    if data.empty:
        return data
    return pareto_front(data, {"samples_per_s": True, cost_column(data): False})
