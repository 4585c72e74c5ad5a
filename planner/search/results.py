"""A search's trials as one table: the best, the best per instance type, top-k, and the files under
results/<study>/.

Files: `trials.csv` and `trials.parquet` (every trial, feasible or not, with its reason), `best.json`
(`best`: the winner; `best_per_instance`: the best of each instance type, cheapest per job first; the
top-k; the Pareto fronts; counts and reasons). Columns: the config (with instance type and count), every
memory term in bytes, peak/headroom in GiB, the verdict, throughput, cost (per job, per epoch, per
million samples) and the constraint values. Files are written under a per-process temporary name, then
renamed: a reader never sees half a file and two workers never share a temporary file.

The table is plain rows (planner.search.table: pandas' column types, no pandas import, which alone cost a
quarter of the default search's time); every selection below takes rows or a DataFrame (the report's).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from planner.parallel import STRATEGIES
from planner.search.columns import (
    CONFIG_COLUMNS,
    LORA_COLUMNS,
    MODEL_PARALLEL_COLUMNS,
    cost_column,
    feasible,
    time_column,
    unique_configs,
)
from planner.search.pareto import throughput_vs_cost, throughput_vs_seq_len, time_vs_cost
from planner.search.table import (
    Row,
    frame_of,
    missing,
    on_rows,
    rows_of,
    sort_rows,
    typed_rows,
    write_csv,
    write_parquet,
)

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

    from planner.search.records import SearchResult, StudyRun

GIB = 1024**3
THROUGHPUT_COLUMNS = ("samples_per_s", "tokens_per_s", "step_time_s", "mfu", "global_batch_size")
COST_COLUMNS = ("price_per_hour", "usd_per_job", "hours_per_job", "epochs", "usd_per_epoch", "hours_per_epoch",
                "usd_per_million_samples")
# The keys every `best` / `best_per_instance` record carries (issue 10), then the evidence.
BEST_KEYS = ["instance", "instances", "batch_size", "grad_accum", "global_batch_size", "seq_len", "precision",
             "checkpointing", "parallelism", "samples_per_s", "hours_per_job", "usd_per_job"]
SUMMARY_COLUMNS = [*BEST_KEYS, "trial", "value", "attention", "optimizer", "optimizer_impl", "world_size",
                   "verdict", "peak_device_gib", "peak_device_high_gib", "headroom_gib", "gpu_memory_gib",
                   "tokens_per_s", "step_time_s", "mfu", "price_per_hour", "epochs", "usd_per_epoch",
                   "hours_per_epoch", "usd_per_million_samples", *LORA_COLUMNS]  # LoRA's: adapter studies only


def _row(run: StudyRun, trial: Any) -> dict[str, Any]:
    attrs = trial.user_attrs
    config = {**run.space.constants(), **run.space.decode(trial.params), **attrs.get("config", {})}
    mem = attrs.get("memory_bytes", {})
    values = trial.values or []
    row: dict[str, Any] = {
        "study": run.study_name,
        "trial": trial.number,
        "state": trial.state.name,
        "value": values[0] if values else math.nan,
        "feasible": trial.state.name == "COMPLETE" and all(v <= 0 for v in trial.constraints.values()),
        "reason": attrs.get("reason", "" if trial.state.name == "COMPLETE" else f"trial {trial.state.name}"),
    }
    for col in CONFIG_COLUMNS:
        row[col] = config.get(col)
    if config.get("lora_r") is not None:  # an adapter study: which rank, targets and base each trial had
        targets = config.get("lora_targets") or ()
        row |= {"lora_r": config["lora_r"], "base_dtype": config.get("base_dtype", "auto"),
                "lora_targets": targets if isinstance(targets, str) else ",".join(targets)}
    if config.get("loop", "plain") != "plain" or config.get("load", "direct") != "direct":  # a loop/load study
        row |= {"loop": config.get("loop", "plain"), "load": config.get("load", "direct")}
    if config.get("framework", "pytorch") != "pytorch":  # whose layouts the trial's estimate used
        row["framework"] = config["framework"]
    if any(config.get(d, 1) != 1 for d in MODEL_PARALLEL_COLUMNS):  # a model-parallel study (issue 34)
        row |= {d: config.get(d, 1) for d in MODEL_PARALLEL_COLUMNS}
    row["world_size"] = config.get("world_size")
    row["verdict"] = mem.get("verdict")
    row["peak_device_gib"] = mem["peak_device"] / GIB if "peak_device" in mem else math.nan
    row["peak_device_high_gib"] = mem.get("peak_device_high", mem.get("peak_device", math.nan)) / GIB
    row["headroom_gib"] = mem["headroom"] / GIB if "headroom" in mem else math.nan
    row["gpu_memory_gib"] = mem["gpu_memory"] / GIB if "gpu_memory" in mem else math.nan
    for key, value in mem.items():
        if key not in ("peak_phase", "verdict"):
            row[f"mem_{key}"] = value
    row["peak_phase"] = mem.get("peak_phase")
    throughput, cost = attrs.get("throughput", {}), attrs.get("cost", {})
    for col in THROUGHPUT_COLUMNS:
        row[col] = throughput.get(col, math.nan)
    for col in COST_COLUMNS:
        value = cost.get(col)
        row[col] = math.nan if value is None else value
    rate = row["samples_per_s"]
    row["hours_per_million_samples"] = 1e6 / rate / 3600 if rate == rate and rate > 0 else math.nan
    for key, value in trial.constraints.items():
        row[f"constraint_{key}"] = value
    row["datetime_complete"] = trial.datetime_complete
    return row


# The columns of a study without a trial (its table and files are empty but still say what they hold).
EMPTY_COLUMNS = ("study", "trial", "state", "value", "feasible", "reason", *CONFIG_COLUMNS)


def trials_rows(run: StudyRun) -> tuple[list[Row], dict[str, str]]:
    """(one row per trial of the study, each column's kind): planner.search.table.typed_rows."""
    rows, kinds = typed_rows(_row(run, t) for t in run.trials)
    return rows, kinds or dict.fromkeys(EMPTY_COLUMNS, "null")


def trials_frame(run: StudyRun) -> pd.DataFrame:
    """One row per trial of the study."""
    return frame_of(*trials_rows(run))


# Values equal to this many significant digits are a tie (the tables show 1,338.5 samples/s, $1.75): a
# difference of <= 0.05 % is far below the estimate's own error, so it must not decide between strategies.
# ASSUMPTION; override: results.TIE_SIGNIFICANT_DIGITS = n.
TIE_SIGNIFICANT_DIGITS = 4
# Among tied configurations, the simpler parallelism first: what a user would pick given equal speed and
# cost (DDP is plain PyTorch; ZeRO-1 adds a sharded optimizer, ZeRO-2 sharded gradients, ZeRO-3/FSDP sharded
# parameters; DataParallel is single-process and discouraged by PyTorch's docs in favour of DDP).
SIMPLICITY: dict[str, int] = {name: s.rank for name, s in STRATEGIES.items()}  # each record's `rank`


def _rounded(rows: list[Row], column: str) -> list[float]:
    """The column's values to TIE_SIGNIFICANT_DIGITS significant digits (NaN and inf stay), with numpy's
    log10 and half-even rounding over the column, as the tables' ties were always decided."""
    import numpy as np

    v = np.array([math.nan if missing(r[column]) else float(r[column]) for r in rows], dtype=float)
    finite = np.isfinite(v) & (v != 0)
    digits = TIE_SIGNIFICANT_DIGITS - 1 - np.floor(np.log10(np.abs(np.where(finite, v, 1.0))))
    scale = 10.0 ** digits
    return np.where(finite, np.round(v * scale) / scale, v).tolist()


def _order(rows: list[Row], direction: str) -> list[Row]:
    """Best value first (to TIE_SIGNIFICANT_DIGITS); ties broken by the cheaper, then the faster, then the
    simpler-parallelism configuration (SIMPLICITY), then the exact value."""
    if not rows:
        return rows
    position = {id(r): i for i, r in enumerate(rows)}
    keys: list[tuple[list[Any], bool]] = [(_rounded(rows, "value"), direction == "minimize")]
    for col, up in ((cost_column(rows), True), ("samples_per_s", False)):
        if col in rows[0] and col != "value":
            keys.append((_rounded(rows, col), up))
    if "parallelism" in rows[0]:
        keys.append(([SIMPLICITY.get(r["parallelism"], len(SIMPLICITY)) for r in rows], True))
    keys.append(([r["value"] for r in rows], direction == "minimize"))
    return sort_rows(rows, [(lambda r, values=values: values[position[id(r)]], up) for values, up in keys])


def _first_per_instance(rows: list[Row], k: int) -> list[Row]:
    """The first k rows of each instance type, in the rows' order (pandas' groupby("instance").head(k))."""
    seen: dict[Any, int] = {}
    out = []
    for row in rows:
        if missing(row["instance"]):
            continue
        seen[row["instance"]] = seen.get(row["instance"], 0) + 1
        if seen[row["instance"]] <= k:
            out.append(row)
    return out


@on_rows
def top_k(rows: list[Row], k: int, direction: str) -> list[Row]:
    """The k best feasible distinct configurations (over every instance type)."""
    return _order(feasible(rows), direction)[:k]


@on_rows
def top_k_per_instance(rows: list[Row], k: int, direction: str) -> list[Row]:
    """The k best feasible distinct configurations of each instance type (the report's scatter)."""
    return _first_per_instance(_order(feasible(rows), direction), k)


def _longest(data: list[Row]) -> list[Row]:
    """The rows at the longest sequence searched: the recipe's job (shorter lengths are the seq-len front)."""
    lengths = [r["seq_len"] for r in data if not missing(r["seq_len"])]
    return [r for r in data if lengths and r["seq_len"] == max(lengths)]


@on_rows
def best_per_instance(rows: list[Row], direction: str) -> list[Row]:
    """The best feasible configuration of each instance type (at the longest sequence searched), cheapest
    per job (then fastest) first."""
    data = _longest(feasible(rows))
    if not data:
        return data
    best = _first_per_instance(_order(data, direction), 1)
    cost = cost_column(best)
    return sort_rows(best, [(lambda r: r[cost], True), (lambda r: r["samples_per_s"], False)])


@on_rows
def best_row(rows: list[Row], target: str, direction: str) -> list[Row]:
    """The winner (one row, or none): the best value at the recipe's longest sequence (the per-length bests
    are the seq-len front); for `pareto`, the cheapest configuration of the time-vs-cost front."""
    data = _longest(feasible(rows))
    if not data:
        return data
    if target == "pareto":
        front = time_vs_cost(data)
        cost, time = cost_column(front), time_column(front)
        return sort_rows(front, [(lambda r: r[cost], True), (lambda r: r[time], True)])[:1]
    return _order(data, direction)[:1]


# Counts that pandas turns into floats when a column also holds NaN (an infeasible trial): JSON gives them as
# integers again (a consumer reading "world_size": 1.0 would have to guess).
INTEGER_COLUMNS = frozenset({"trial", "instances", "batch_size", "grad_accum", "global_batch_size", "seq_len",
                             "world_size"})


def _records(table: Any, columns: list[str]) -> list[dict[str, Any]]:
    rows = rows_of(table)
    cols = [c for c in columns if rows and c in rows[0]]
    return [{k: _cell(k, row[k]) for k in cols} for row in rows]


def _cell(column: str, value: Any) -> Any:
    value = _plain(value)
    if isinstance(value, float):
        if math.isnan(value):
            return None
        if column in INTEGER_COLUMNS and value.is_integer():
            return int(value)
    return value


def _plain(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    if hasattr(value, "isoformat"):
        return value.isoformat()
    return value


def infeasible_reasons(table: Any) -> list[tuple[int, str]]:
    """Why trials were infeasible, grouped by violated constraint, most frequent first."""
    from collections import Counter

    counts: Counter[str] = Counter()
    bad = [r for r in rows_of(table) if not r["feasible"]]
    for row in bad:
        if row.get("constraint_supported", 0) > 0:
            counts[str(row["reason"]).split("; ")[0]] += 1
        elif row.get("constraint_global_batch", 0) > 0:
            counts["cannot hit the global batch exactly (micro-batch × GPUs does not divide it)"
                   if str(row["reason"]).startswith("global batch") and "whole number" in str(row["reason"])
                   else "global batch size outside the tolerance of --global-batch-size"] += 1
        elif row.get("constraint_memory", 0) > 0:
            counts["verdict tight: not a sure fit (--accept-tight allows it)" if "tight" in str(row["reason"])
                   else "does not fit in GPU memory (peak > max-memory-fraction × GPU memory)"] += 1
        else:
            counts[str(row["reason"]) or f"trial {row['state']}"] += 1
    return [(n, text) for text, n in counts.most_common()]


def summary(result: SearchResult, k: int = 5) -> dict[str, Any]:
    """The JSON summary: best, best per instance type (cheapest first), top-k, Pareto fronts, counts."""
    rows = result.rows
    ok = [r for r in rows if r["feasible"]]
    sweep, run = result.sweep, result.run
    best = _records(best_row(rows, result.target, result.direction), SUMMARY_COLUMNS)
    return {
        "study": result.name,
        "storage": result.storage,
        "model": sweep.model,
        "model_options": sweep.model_options,
        "recipe": sweep.recipe.model_dump(mode="json"),
        "objective": sweep.objective.model_dump(mode="json") | {"target": result.target,
                                                                "direction": result.direction,
                                                                "directions": result.directions},
        "constraints": sweep.constraints.model_dump(mode="json"),
        "trials": len(rows),
        "feasible_trials": int(len(ok)),
        "instances": [{"instance": name, "study": run.study_name,
                       "trials": sum(r["instance"] == name for r in rows)}
                      for name in run.instances],
        "search": {"sampler": run.sampler, "seed": run.seed, "worker": run.worker, "new_trials": run.new_trials,
                   "estimate_calls": run.evaluations, "space_size": run.space.size,
                   "searched": {k: list(v) for k, v in run.space.searched().items()},
                   "fixed": run.space.constants(),
                   "dropped_defaults": {k: list(v) for k, v in run.space.dropped.items()}},
        "best": best[0] if best else None,
        "best_per_instance": _records(best_per_instance(rows, result.direction), SUMMARY_COLUMNS),
        "top": _records(top_k(rows, k, result.direction), SUMMARY_COLUMNS),
        "pareto": {
            "time_vs_cost": _records(time_vs_cost(rows), SUMMARY_COLUMNS),
            "throughput_vs_seq_len": _records(seq_len_front(result), SUMMARY_COLUMNS),
            "throughput_vs_cost": _records(throughput_vs_cost(rows), SUMMARY_COLUMNS),
        },
        "prices": _prices(result),
        "all_infeasible": result.all_infeasible,
        "infeasible_reasons": [{"trials": n, "reason": text} for n, text in infeasible_reasons(rows)],
    }


def _prices(result: SearchResult) -> list[dict[str, Any]]:
    """Each instance type's price with where and when it is from, and whether stale (planner.prices)."""
    from planner.prices import price_records

    return price_records(list(result.run.instances), result.sweep.region)


def seq_len_front(result: SearchResult) -> list[Row]:
    """The best configuration per sequence length that a longer one does not beat (by the objective)."""
    if result.target == "pareto":
        return throughput_vs_seq_len(result.rows)
    value = "samples_per_s" if result.target == "throughput" else "value"
    return throughput_vs_seq_len(result.rows, result.direction, value)


def write_results(result: SearchResult, k: int = 5) -> dict[str, Path]:
    """trials.csv, trials.parquet and best.json under results/<study>/ (written whole, then renamed)."""
    out = Path(result.results_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = {"csv": out / "trials.csv", "parquet": out / "trials.parquet", "json": out / "best.json"}
    rows, kinds = result.rows, result.kinds  # datetimes in microseconds, as Optuna stores them
    _atomic(files["csv"], lambda p: write_csv(rows, kinds, p))
    _atomic(files["parquet"], lambda p: write_parquet(rows, kinds, p))
    text = json.dumps(summary(result, k), indent=2, default=str)
    _atomic(files["json"], lambda p: p.write_text(text + "\n"))
    return files


def _atomic(path: Path, write: Any) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)


__all__ = ["best_per_instance", "best_row", "cost_column", "summary", "top_k", "trials_frame", "trials_rows",
           "unique_configs", "write_results"]
