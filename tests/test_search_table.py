"""The search's trial table without pandas (planner/search/table.py) against pandas itself: the rows' types
are a DataFrame's, trials.csv is `DataFrame.to_csv`'s text, trials.parquet's Arrow table is
`pyarrow.Table.from_pandas`'s (schema, `pandas` metadata, values), and every selection (top-k, best per
type, the fronts, the reasons) picks the same rows from rows as from the DataFrame the report holds."""

from __future__ import annotations

import datetime as dt
import math
import random

import pandas as pd
import pyarrow as pa
import pytest
from search_fixtures import fake_estimate

from planner.search import pareto, results
from planner.search.study import run_search
from planner.search.sweep import DEFAULT_SWEEP
from planner.search.table import arrow_table, column_kind, frame_of, typed_rows, write_csv

TYPES = ("ml.p3.2xlarge", "ml.g4dn.xlarge", "ml.g5.xlarge", "ml.p3.16xlarge")
NAN = math.nan
T0 = dt.datetime(2026, 1, 2, 3, 4, 5, 678901)


def _dicts() -> list[dict]:
    """Rows whose columns cover every kind, with gaps (a key absent from a row) and explicit None."""
    return [
        {"i": 1, "f": 1.5, "b": True, "s": "a,b \"q\"", "d": T0, "n": None, "bm": True, "if": 1, "gap": 3},
        {"i": 2, "f": NAN, "b": False, "s": None, "d": T0.replace(microsecond=0), "n": None, "bm": None, "if": 2.5},
        {"i": 3, "f": 1e-5, "b": True, "s": "", "d": None, "n": None, "if": 7, "late": "x"},
    ]


@pytest.fixture(scope="module")
def studies(tmp_path_factory):
    """Tables of real studies: several types by cost (infeasible trials, unpriced types), one type by
    throughput with the real estimate (the default search)."""
    tmp = tmp_path_factory.mktemp("table")
    cost = run_search(DEFAULT_SWEEP.with_overrides(instance=TYPES, objective={"target": "cost"}), trials=24,
                      results_dir=tmp, estimate_fn=fake_estimate, write_files=False)
    default = run_search(None, trials=30, results_dir=tmp, write_files=False)
    return [cost, default]


def test_column_kinds_are_pandas_dtypes():
    rows, kinds = typed_rows(_dicts())
    frame = pd.DataFrame(_dicts())
    assert list(kinds) == list(frame.columns)
    dtypes = {"int": "int64", "float": "float64", "bool": "bool", "bool-missing": "object", "str": "str",
              "datetime": "datetime64[us]", "null": "object"}
    assert {c: dtypes[k] for c, k in kinds.items()} == {c: str(t) for c, t in frame.dtypes.items()}
    back = frame.to_dict("records")
    for mine, theirs in zip(rows, back, strict=True):
        assert set(mine) == set(theirs)
        for c in mine:
            a, b = mine[c], theirs[c]
            assert (pd.isna(a) and pd.isna(b)) or a == b, (c, a, b)
    assert column_kind([1, "a"]) == "object" and column_kind([None, NAN]) == "float"


def test_typed_rows_build_the_same_frame(studies):
    for result in studies:
        old = pd.DataFrame([results._row(result.run, t) for t in result.run.trials])
        pd.testing.assert_frame_equal(result.frame, old)


def _csv(frame: pd.DataFrame, path) -> str:
    frame.to_csv(path, index=False)
    return path.read_text()


def test_csv_is_pandas_to_csv(studies, tmp_path):
    cases = [typed_rows(_dicts())] + [(r.rows, r.kinds) for r in studies]
    random.seed(0)
    floats = [random.uniform(-1, 1) * 10 ** random.randint(-20, 20) for _ in range(500)] + [1e16, 1e-5, math.inf]
    cases.append(typed_rows({"f": v, "ms": T0.replace(microsecond=123000)} for v in floats))
    cases.append(typed_rows({"day": dt.datetime(2026, 1, d)} for d in (1, 2)))
    for rows, kinds in cases:
        write_csv(rows, kinds, tmp_path / "mine.csv")
        assert (tmp_path / "mine.csv").read_text() == _csv(frame_of(rows, kinds), tmp_path / "pandas.csv")


def test_parquet_table_is_pandas_from_pandas(studies):
    cases = [typed_rows(_dicts())] + [(r.rows, r.kinds) for r in studies]
    for rows, kinds in cases:
        frame = frame_of(rows, kinds)
        theirs = pa.Table.from_pandas(frame, preserve_index=False)
        mine = arrow_table(rows, kinds)
        assert mine.schema.equals(theirs.schema, check_metadata=True)
        assert mine.equals(theirs)


# ---- the selections as pandas expressed them before the table became rows (the oracle for the rows' code)


def _pd_rounded(values: pd.Series) -> pd.Series:
    import numpy as np

    v = values.astype(float)
    finite = np.isfinite(v) & (v != 0)
    digits = results.TIE_SIGNIFICANT_DIGITS - 1 - np.floor(np.log10(np.abs(v.where(finite, 1.0))))
    scale = 10.0 ** digits
    return v.where(~finite, np.round(v * scale) / scale)


def _pd_feasible(frame: pd.DataFrame) -> pd.DataFrame:
    from planner.search.columns import (
        CONFIG_COLUMNS,
        FRAMEWORK_COLUMNS,
        LOOP_COLUMNS,
        LORA_COLUMNS,
        MODEL_PARALLEL_COLUMNS,
    )

    keys = [c for c in (*CONFIG_COLUMNS, *LORA_COLUMNS, *FRAMEWORK_COLUMNS, *LOOP_COLUMNS, *MODEL_PARALLEL_COLUMNS)
            if c in frame.columns]
    return frame[frame["feasible"].astype(bool)].drop_duplicates(subset=keys, keep="first")


def _pd_cost(frame: pd.DataFrame) -> str:
    return "usd_per_job" if frame["usd_per_job"].notna().any() else "usd_per_million_samples"


def _pd_order(frame: pd.DataFrame, direction: str) -> pd.DataFrame:
    if frame.empty:
        return frame
    keys = {"_value": _pd_rounded(frame["value"])}
    asc = [direction == "minimize"]
    for col, up in ((_pd_cost(frame), True), ("samples_per_s", False)):
        if col in frame.columns and col != "value":
            keys[f"_{col}"] = _pd_rounded(frame[col])
            asc.append(up)
    keys["_simplicity"] = frame["parallelism"].map(results.SIMPLICITY).fillna(len(results.SIMPLICITY))
    asc.append(True)
    keys["_exact"] = frame["value"]
    asc.append(direction == "minimize")
    ordered = frame.assign(**keys).sort_values(list(keys), ascending=asc, kind="stable", na_position="last")
    return ordered.drop(columns=list(keys))


def _pd_longest(data: pd.DataFrame) -> pd.DataFrame:
    return data[data["seq_len"] == data["seq_len"].max()] if len(data) else data


def _pd_best_per_instance(frame: pd.DataFrame, direction: str) -> pd.DataFrame:
    data = _pd_longest(_pd_feasible(frame))
    if data.empty:
        return data
    best = _pd_order(data, direction).groupby("instance", sort=False).head(1)
    return best.sort_values([_pd_cost(best), "samples_per_s"], ascending=[True, False], na_position="last",
                            kind="stable")


def _pd_front(frame: pd.DataFrame, objectives: dict[str, bool]) -> pd.DataFrame:
    """The pareto front by the pairwise definition (not the rows' sweep): no other row at least as good in
    both and better in one; one row per point."""
    data = _pd_feasible(frame).dropna(subset=list(objectives))
    signs = {c: 1.0 if up else -1.0 for c, up in objectives.items()}
    pts = [tuple(signs[c] * float(r[c]) for c in objectives) for _, r in data.iterrows()]
    keep, seen = [], set()
    for i, p in enumerate(pts):
        if not any(all(q[j] >= p[j] for j in range(2)) and q != p for q in pts) and p not in seen:
            keep.append(i)
            seen.add(p)
    first = next(iter(objectives))
    return data.iloc[keep].sort_values(first, ascending=not objectives[first], kind="stable")


def _same_rows(selected: list[dict], frame: pd.DataFrame) -> None:
    """The rows a selection picked are the oracle's, in its order."""
    assert [r["trial"] for r in selected] == list(frame["trial"])


def test_selections_are_the_pandas_selections(studies):
    for result in studies:
        rows, frame = result.rows, result.frame
        cost = _pd_cost(_pd_feasible(frame))
        for direction in ("minimize", "maximize"):
            ordered = _pd_order(_pd_feasible(frame), direction)
            _same_rows(results.top_k(rows, 7, direction), ordered.head(7))
            _same_rows(results.top_k_per_instance(rows, 2, direction), ordered.groupby("instance", sort=False).head(2))
            _same_rows(results.best_per_instance(rows, direction), _pd_best_per_instance(frame, direction))
            _same_rows(results.best_row(rows, "cost", direction), _pd_order(_pd_longest(_pd_feasible(frame)),
                                                                             direction).head(1))
        _same_rows(pareto.throughput_vs_cost(rows), _pd_front(frame, {"samples_per_s": True, cost: False}))
        _same_rows(pareto.time_vs_cost(rows), _pd_front(frame, {"hours_per_job": False, cost: False}))
        # a DataFrame in, its own rows out (the report's calls)
        pd.testing.assert_frame_equal(results.top_k(frame, 7, "maximize"), _pd_order(_pd_feasible(frame),
                                                                                     "maximize").head(7))
        assert results.infeasible_reasons(rows) == results.infeasible_reasons(frame)
    assert any(not r["feasible"] for r in studies[0].rows)


def test_ties_and_gaps_sort_as_pandas_sorts():
    """Rounded ties, NaN values and costs (last whichever the direction) and unknown parallelisms."""
    dicts = [{"trial": i, "instance": "ml.p3.2xlarge", "parallelism": p, "value": v, "samples_per_s": s,
              "usd_per_job": c, "feasible": True, "batch_size": i, "seq_len": 512}
             for i, (p, v, s, c) in enumerate([("fsdp", 1338.5, 10.0, 2.0), ("zero3", 1338.46, 10.0, NAN),
                                               ("ddp", NAN, 9.0, 1.0), ("odd", 1338.5, NAN, 2.0),
                                               ("ddp", 1338.54, 10.0, 2.0), ("zero2", 0.0, 11.0, 1.0)])]
    rows, kinds = typed_rows(dicts)
    frame = frame_of(rows, kinds)
    for direction in ("minimize", "maximize"):
        _same_rows(results.top_k(rows, 6, direction), _pd_order(_pd_feasible(frame), direction))
        _same_rows(results.best_per_instance(rows, direction), _pd_best_per_instance(frame, direction))
