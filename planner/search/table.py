"""A search's trial table as plain rows (one dict per trial, every column in every row), typed as pandas
types a DataFrame built from the same dicts, and written to trials.csv / trials.parquet without pandas.

Why not a pandas DataFrame: importing pandas costs ~0.4 s of CPU (pandas 3.1, 2 cores), a quarter of the
whole default search (`planner search --instance ml.p3.16xlarge`, benchmarks/search_benchmark.py), for a
table of ~100 rows that is sorted, filtered and written once. The rows keep pandas' column types (so a
library user's `SearchResult.frame`, built from them on request, is the DataFrame it always was) and the
writers give the files pandas wrote: `DataFrame.to_csv` runs Python's `csv` writer over each column's text
(pandas/io/formats/csvs.py; floats as `ndarray.astype(str)`, which is Python's repr, datetimes at the finest
unit a value needs: pandas/_libs/tslib.pyx format_array_from_datetime), and `DataFrame.to_parquet` is
`pyarrow.Table.from_pandas` plus its `pandas` schema metadata (pyarrow/pandas_compat.py construct_metadata),
rebuilt here; tests/test_search_table.py compares both with pandas' own output.

pandas stays the library for what the table is used for beyond the command: the HTML report's figures, the
benchmarks and the API's `SearchResult.frame`.
"""

from __future__ import annotations

import csv
import datetime as dt
import functools
import json
import math
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

Row = dict[str, Any]
NAN = math.nan
T = TypeVar("T")


def missing(value: Any) -> bool:
    """None or NaN: a cell pandas counts as missing (isna)."""
    return value is None or (isinstance(value, float) and value != value)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def column_kind(values: list[Any]) -> str:
    """The type pandas 3 infers for a column of a DataFrame built from dicts (a key absent from a dict is
    NaN): int, float, bool, bool-missing (bools with gaps: object), str (NaN for gaps), datetime, null (only
    None) or object (mixed)."""
    present = [v for v in values if not missing(v)]
    if not present:
        return "null" if all(v is None for v in values) else "float"
    gaps = len(present) < len(values)
    if all(_is_number(v) for v in present):
        floats = gaps or any(isinstance(v, float) for v in present)
        return "float" if floats else "int"
    if all(isinstance(v, bool) for v in present):
        return "bool-missing" if gaps else "bool"
    if all(isinstance(v, str) for v in present):
        return "str"
    if all(isinstance(v, dt.datetime) for v in present):
        return "datetime"
    return "object"


def _typed(kind: str, value: Any) -> Any:
    if kind == "float":
        return NAN if missing(value) else float(value)
    if kind == "str":
        return NAN if missing(value) else value
    if kind == "datetime":
        return None if missing(value) else value
    return value


def typed_rows(dicts: Iterable[Row]) -> tuple[list[Row], dict[str, str]]:
    """(rows, column kinds): every row with every column (in order of first appearance, as pandas orders
    them), each value as its column's pandas type gives it back (`DataFrame.to_dict("records")`)."""
    dicts = list(dicts)
    columns: dict[str, None] = {}
    for d in dicts:
        columns.update(dict.fromkeys(d))
    kinds = {}
    cells: list[list[Any]] = []
    for c in columns:
        values = [d.get(c, NAN) for d in dicts]
        kinds[c] = kind = column_kind(values)
        cells.append([_typed(kind, v) for v in values] if kind in ("float", "str", "datetime") else values)
    names = list(columns)
    return [dict(zip(names, row, strict=True)) for row in zip(*cells, strict=True)] if names else [{} for _ in dicts], kinds


def frame_of(rows: list[Row], kinds: dict[str, str]) -> Any:
    """The rows as a pandas DataFrame (the report, the benchmarks and the API's `SearchResult.frame`)."""
    import pandas as pd

    return pd.DataFrame(rows) if rows else pd.DataFrame(columns=list(kinds))


def rows_of(table: Any) -> list[Row]:
    """Rows of a row list, or of a DataFrame (a caller of the library that holds one)."""
    return table if isinstance(table, list) else table.to_dict("records")


def on_rows(fn: Callable[..., list[Row]]) -> Callable[..., Any]:
    """A selection over rows (it returns some of its input rows, in some order) that also takes a DataFrame
    and then returns the DataFrame's rows (`iloc`, index and types kept): the report and the API's callers
    hold frames, the command holds rows, and the selection is written once."""

    @functools.wraps(fn)
    def wrapper(table: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(table, list):
            return fn(table, *args, **kwargs)
        rows = table.to_dict("records")
        where = {id(r): i for i, r in enumerate(rows)}
        return table.iloc[[where[id(r)] for r in fn(rows, *args, **kwargs)]]

    return wrapper


def sort_rows(rows: list[Row], keys: list[tuple[Callable[[Row], Any], bool]]) -> list[Row]:
    """Rows sorted by several keys (each (key, ascending)), stably, a missing key value last whichever the
    direction: pandas' `sort_values(keys, ascending=..., kind="stable", na_position="last")`."""
    out = list(rows)
    for key, ascending in reversed(keys):
        present = [r for r in out if not missing(key(r))]
        gaps = [r for r in out if missing(key(r))]
        out = sorted(present, key=key, reverse=not ascending) + gaps
    return out


# ------------------------------------------------------------------------------------------------ files


def _datetime_format(values: list[Any]) -> str:
    """The unit pandas writes a datetime column in: seconds, milliseconds or microseconds, the finest any
    value needs (dates alone when every value is a midnight)."""
    present = [v for v in values if v is not None]
    if present and all(v.hour == v.minute == v.second == v.microsecond == 0 for v in present):
        return "%Y-%m-%d"
    if all(v.microsecond == 0 for v in present):
        return "%Y-%m-%d %H:%M:%S"
    if all(v.microsecond % 1000 == 0 for v in present):
        return "%Y-%m-%d %H:%M:%S.ms"
    return "%Y-%m-%d %H:%M:%S.%f"


def _csv_cells(kind: str, values: list[Any]) -> list[Any]:
    if kind == "datetime":
        fmt = _datetime_format(values)
        if fmt.endswith(".ms"):
            return ["" if v is None else v.strftime("%Y-%m-%d %H:%M:%S.") + f"{v.microsecond // 1000:03d}"
                    for v in values]
        return ["" if v is None else v.strftime(fmt) for v in values]
    if kind == "float":
        return ["" if v != v else repr(v) for v in values]
    return ["" if missing(v) else v for v in values]


def write_csv(rows: list[Row], kinds: dict[str, str], path: Path) -> None:
    """trials.csv as `DataFrame.to_csv(path, index=False)` writes it."""
    columns = list(kinds)
    cells = [_csv_cells(kinds[c], [r[c] for r in rows]) for c in columns]
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow(columns)
        writer.writerows(zip(*cells, strict=True))


# The `pandas` schema metadata (pandas_type, numpy_type) of each column kind.
PANDAS_TYPES = {"int": ("int64", "int64"), "float": ("float64", "float64"), "bool": ("bool", "bool"),
                "bool-missing": ("bool", "object"), "str": ("object", "str"),
                "datetime": ("datetime", "datetime64[us]"), "null": ("empty", "object")}
EPOCH = dt.datetime(1970, 1, 1)


def _bitmap(bits: list[bool]) -> bytes:
    """Arrow's bit-packed buffer (least significant bit first) of `bits`."""
    out = bytearray((len(bits) + 7) // 8)
    for i, bit in enumerate(bits):
        if bit:
            out[i // 8] |= 1 << (i % 8)
    return bytes(out)


def _arrow_column(pa: Any, kind: str, values: list[Any]) -> Any:
    """One column as the Arrow array pandas' conversion makes of it (missing values null), built from its
    buffers (`pyarrow.Array.from_buffers`): `pyarrow.array` imports pandas to ask whether its input is a
    pandas object."""
    from array import array

    n = len(values)
    valid = [not missing(v) for v in values]
    nulls = valid.count(False)
    validity = pa.py_buffer(_bitmap(valid)) if nulls else None
    if kind == "null":
        return pa.Array.from_buffers(pa.null(), n, [None], null_count=n)
    if kind in ("int", "float"):
        data = array("q" if kind == "int" else "d", [v if ok else 0 for v, ok in zip(values, valid, strict=True)])
        arrow_type = pa.int64() if kind == "int" else pa.float64()
        return pa.Array.from_buffers(arrow_type, n, [validity, pa.py_buffer(data.tobytes())], null_count=nulls)
    if kind in ("bool", "bool-missing"):
        data = _bitmap([bool(v) and ok for v, ok in zip(values, valid, strict=True)])
        return pa.Array.from_buffers(pa.bool_(), n, [validity, pa.py_buffer(data)], null_count=nulls)
    if kind == "datetime":
        micros = array("q", [(v - EPOCH) // dt.timedelta(microseconds=1) if ok else 0
                             for v, ok in zip(values, valid, strict=True)])
        return pa.Array.from_buffers(pa.timestamp("us"), n, [validity, pa.py_buffer(micros.tobytes())],
                                     null_count=nulls)
    if kind == "str":
        encoded = [v.encode() if ok else b"" for v, ok in zip(values, valid, strict=True)]
        offsets = array("q", [0])
        for text in encoded:
            offsets.append(offsets[-1] + len(text))
        return pa.Array.from_buffers(pa.large_string(), n, [validity, pa.py_buffer(offsets.tobytes()),
                                                            pa.py_buffer(b"".join(encoded))], null_count=nulls)
    return pa.array(values, from_pandas=True)  # mixed types: never in a search's table


def arrow_table(rows: list[Row], kinds: dict[str, str]) -> Any:
    """The table `pyarrow.Table.from_pandas(frame, preserve_index=False)` makes of the rows' DataFrame,
    with its `pandas` metadata (so `pandas.read_parquet` restores the same column types)."""
    import pyarrow as pa

    arrays = [_arrow_column(pa, kinds[c], [r[c] for r in rows]) for c in kinds]
    table = pa.Table.from_arrays(arrays, names=list(kinds))
    meta = {"index_columns": [], "column_indexes": [],
            "columns": [{"name": c, "field_name": c, "pandas_type": PANDAS_TYPES.get(kinds[c], ("mixed", ""))[0],
                         "numpy_type": PANDAS_TYPES.get(kinds[c], ("", "object"))[1], "metadata": None}
                        for c in kinds],
            "attributes": {}, "creator": {"library": "pyarrow", "version": pa.__version__},
            "pandas_version": _pandas_version()}
    return table.replace_schema_metadata({b"pandas": json.dumps(meta).encode()})


def _pandas_version() -> str:
    """The installed pandas' version, read from its package metadata (importing pandas is what this module
    avoids)."""
    from importlib.metadata import version

    return version("pandas")


def write_parquet(rows: list[Row], kinds: dict[str, str], path: Path) -> None:
    """trials.parquet as `DataFrame.to_parquet(path, index=False)` writes it (pyarrow, snappy)."""
    import pyarrow.parquet as pq

    pq.write_table(arrow_table(rows, kinds), path, compression="snappy")
