"""Column helpers over a search's trial table, shared by results (best, top-k) and pareto (fronts).

Kept apart so that results -> pareto is the only import between them (no loop). Each takes the table as rows
(planner.search.table) or as a DataFrame (what the report and the API's callers hold).
"""

from __future__ import annotations

from typing import Any

from planner.search.table import Row, missing, on_rows, rows_of

CONFIG_COLUMNS = ("instance", "instances", "batch_size", "seq_len", "precision", "checkpointing", "grad_accum",
                  "optimizer", "optimizer_impl", "attention", "parallelism")
# Added to a study's rows only when it trains adapters (planner.adapters); targets as one "a,b" string.
LORA_COLUMNS = ("lora_r", "lora_targets", "base_dtype")
# Added only to the rows of a loop or load other than the default (planner.memory.loops).
LOOP_COLUMNS = ("loop", "load")
# Added only when a study runs under another framework than a plain PyTorch loop (planner.parallel.frameworks).
FRAMEWORK_COLUMNS = ("framework",)
# Added only to the rows of a study whose trials split the model (tensor, pipeline, context degrees; issue 34).
MODEL_PARALLEL_COLUMNS = ("tp", "pp", "cp")


def _cell_key(value: Any) -> Any:
    return None if missing(value) else value  # drop_duplicates counts NaN equal to NaN


@on_rows
def unique_configs(rows: list[Row]) -> list[Row]:
    """One row per (instance, configuration): TPE evaluates a good point of a discrete space many times."""
    if not rows:
        return rows
    keys = [c for c in (*CONFIG_COLUMNS, *LORA_COLUMNS, *FRAMEWORK_COLUMNS, *LOOP_COLUMNS, *MODEL_PARALLEL_COLUMNS)
            if c in rows[0]]
    seen: set[tuple] = set()
    out = []
    for row in rows:
        key = tuple(_cell_key(row[k]) for k in keys)
        if key not in seen:
            seen.add(key)
            out.append(row)
    return out


@on_rows
def feasible(rows: list[Row]) -> list[Row]:
    """The feasible trials, one per distinct configuration."""
    if not rows or "feasible" not in rows[0]:
        return []
    return unique_configs([r for r in rows if r["feasible"]])


def _any_value(rows: list[Row], column: str) -> bool:
    return bool(rows) and column in rows[0] and any(not missing(r[column]) for r in rows)


def cost_column(table: Any) -> str:
    """$ per job when the recipe gives a dataset size, else $ per million samples."""
    return "usd_per_job" if _any_value(rows_of(table), "usd_per_job") else "usd_per_million_samples"


def time_column(table: Any) -> str:
    """Hours per job when the recipe gives a dataset size, else hours per million samples."""
    return "hours_per_job" if _any_value(rows_of(table), "hours_per_job") else "hours_per_million_samples"
