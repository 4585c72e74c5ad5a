"""A search's trials as one table: top-k, best per instance type, and the files under results/<study>/.

Files: `trials.csv` and `trials.parquet` (every trial of every instance type, feasible or not, with its
reason), `best.json` (the best feasible configuration per instance type, cheapest first, the top-k and
the Pareto fronts). Columns: the config, every memory term in bytes, peak/headroom in GiB, throughput,
cost and the constraint values.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

    from planner.search.study import InstanceRun, SearchResult

GIB = 1024**3
CONFIG_COLUMNS = ("batch_size", "seq_len", "precision", "checkpointing", "grad_accum", "optimizer", "attention",
                  "parallelism", "instances")
THROUGHPUT_COLUMNS = ("samples_per_s", "tokens_per_s", "step_time_s", "mfu", "global_batch_size")
COST_COLUMNS = ("price_per_hour", "usd_per_epoch", "hours_per_epoch", "usd_per_million_samples")


def _row(run: InstanceRun, trial: Any) -> dict[str, Any]:
    attrs = trial.user_attrs
    config = {**run.space.constants(), **run.space.decode(trial.params), **attrs.get("config", {})}
    mem = attrs.get("memory_bytes", {})
    row: dict[str, Any] = {
        "instance": run.instance,
        "study": run.study_name,
        "trial": trial.number,
        "state": trial.state.name,
        "value": trial.value if trial.value is not None else math.nan,
        "feasible": trial.state.name == "COMPLETE" and all(v <= 0 for v in trial.constraints.values()),
        "reason": attrs.get("reason", "" if trial.state.name == "COMPLETE" else f"trial {trial.state.name}"),
    }
    for col in CONFIG_COLUMNS:
        row[col] = config.get(col)
    row["world_size"] = config.get("world_size")
    row["peak_device_gib"] = mem["peak_device"] / GIB if "peak_device" in mem else math.nan
    row["headroom_gib"] = mem["headroom"] / GIB if "headroom" in mem else math.nan
    row["gpu_memory_gib"] = mem["gpu_memory"] / GIB if "gpu_memory" in mem else math.nan
    for key, value in mem.items():
        if key != "peak_phase":
            row[f"mem_{key}"] = value
    row["peak_phase"] = mem.get("peak_phase")
    throughput, cost = attrs.get("throughput", {}), attrs.get("cost", {})
    for col in THROUGHPUT_COLUMNS:
        row[col] = throughput.get(col, math.nan)
    for col in COST_COLUMNS:
        value = cost.get(col)
        row[col] = math.nan if value is None else value
    for key, value in trial.constraints.items():
        row[f"constraint_{key}"] = value
    row["datetime_complete"] = trial.datetime_complete
    return row


def trials_frame(runs: list[InstanceRun]) -> pd.DataFrame:
    """One row per trial of every instance type's study."""
    import pandas as pd

    rows = [_row(run, t) for run in runs for t in run.trials]
    frame = pd.DataFrame(rows)
    if frame.empty:
        frame = pd.DataFrame(columns=["instance", "study", "trial", "state", "value", "feasible", "reason",
                                      *CONFIG_COLUMNS])
    return frame


def unique_configs(frame: pd.DataFrame) -> pd.DataFrame:
    """One row per (instance, configuration): TPE evaluates a good point of a discrete space many times."""
    keys = [c for c in ("instance", *CONFIG_COLUMNS) if c in frame.columns]
    return frame.drop_duplicates(subset=keys, keep="first")


def top_k(frame: pd.DataFrame, k: int, direction: str) -> pd.DataFrame:
    """The k best feasible distinct configurations (over all instance types)."""
    feasible = unique_configs(frame[frame["feasible"]])
    return feasible.sort_values("value", ascending=direction == "minimize", kind="stable").head(k)


def cost_column(frame: pd.DataFrame) -> str:
    """$/epoch when a dataset size was given, else $ per million samples."""
    if "usd_per_epoch" in frame.columns and frame["usd_per_epoch"].notna().any():
        return "usd_per_epoch"
    return "usd_per_million_samples"


def best_per_instance(frame: pd.DataFrame, direction: str) -> pd.DataFrame:
    """The best feasible configuration of each instance type, cheapest (then fastest) first."""
    feasible = frame[frame["feasible"]]
    if feasible.empty:
        return feasible
    ordered = feasible.sort_values("value", ascending=direction == "minimize", kind="stable")
    best = ordered.groupby("instance", sort=False).head(1)
    return best.sort_values([cost_column(best), "samples_per_s"], ascending=[True, False], na_position="last")


def _records(frame: pd.DataFrame, columns: list[str]) -> list[dict[str, Any]]:
    cols = [c for c in columns if c in frame.columns]
    out = []
    for rec in frame[cols].to_dict(orient="records"):
        out.append({k: (None if isinstance(v, float) and math.isnan(v) else _plain(v)) for k, v in rec.items()})
    return out


def _plain(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    if hasattr(value, "isoformat"):
        return value.isoformat()
    return value


def infeasible_reasons(frame: pd.DataFrame) -> list[tuple[int, str]]:
    """Why trials were infeasible, grouped by violated constraint, most frequent first."""
    from collections import Counter

    counts: Counter[str] = Counter()
    bad = frame[~frame["feasible"]] if len(frame) else frame
    for _, row in bad.iterrows():
        if row.get("constraint_supported", 0) > 0:
            counts[str(row["reason"]).split("; ")[0]] += 1
        elif row.get("constraint_memory", 0) > 0:
            counts["does not fit in GPU memory (peak > max-memory-fraction × GPU memory)"] += 1
        elif row.get("constraint_global_batch", 0) > 0:
            counts["global batch size outside the tolerance of --global-batch-size"] += 1
        else:
            counts[str(row["reason"]) or f"trial {row['state']}"] += 1
    return [(n, text) for text, n in counts.most_common()]


SUMMARY_COLUMNS = ["instance", "trial", "value", *CONFIG_COLUMNS, "world_size", "peak_device_gib", "headroom_gib",
                   "gpu_memory_gib", *THROUGHPUT_COLUMNS, *COST_COLUMNS]


def summary(result: SearchResult, k: int = 5) -> dict[str, Any]:
    """The JSON summary: best per instance type (cheapest first), top-k, Pareto fronts, counts."""
    from planner.search.pareto import throughput_vs_cost, throughput_vs_seq_len

    frame = result.frame
    feasible = frame[frame["feasible"]] if len(frame) else frame
    sweep = result.sweep
    return {
        "study": result.name,
        "storage": result.storage,
        "model": sweep.model,
        "model_options": sweep.model_options,
        "objective": sweep.objective.model_dump(mode="json") | {"direction": result.direction},
        "constraints": sweep.constraints.model_dump(mode="json"),
        "trials": int(len(frame)),
        "feasible_trials": int(len(feasible)),
        "instances": [{"instance": r.instance, "study": r.study_name, "trials": len(r.trials),
                       "sampler": r.sampler, "new_trials": r.new_trials, "estimate_calls": r.evaluations, "space_size": r.space.size,
                       "searched": {k: list(v) for k, v in r.space.searched().items()},
                       "fixed": r.space.constants(), "dropped_defaults": {k: list(v) for k, v in
                                                                           r.space.dropped.items()}}
                      for r in result.runs],
        "best_per_instance": _records(best_per_instance(frame, result.direction), SUMMARY_COLUMNS),
        "top": _records(top_k(frame, k, result.direction), SUMMARY_COLUMNS),
        "pareto": {
            "throughput_vs_seq_len": _records(throughput_vs_seq_len(frame), SUMMARY_COLUMNS),
            "throughput_vs_cost": _records(throughput_vs_cost(frame), SUMMARY_COLUMNS),
        },
        "all_infeasible": result.all_infeasible,
        "infeasible_reasons": [{"trials": n, "reason": text} for n, text in infeasible_reasons(frame)],
    }


def write_results(result: SearchResult, k: int = 5) -> dict[str, Path]:
    """trials.csv, trials.parquet and best.json under results/<study>/ (written whole, then renamed)."""
    out = Path(result.results_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = {"csv": out / "trials.csv", "parquet": out / "trials.parquet", "json": out / "best.json"}
    frame = result.frame.copy()
    if "datetime_complete" in frame.columns:
        frame["datetime_complete"] = frame["datetime_complete"].astype("datetime64[us]")
    _atomic(files["csv"], lambda p: frame.to_csv(p, index=False))
    _atomic(files["parquet"], lambda p: frame.to_parquet(p, index=False))
    text = json.dumps(summary(result, k), indent=2, default=str)
    _atomic(files["json"], lambda p: p.write_text(text + "\n"))
    return files


def _atomic(path: Path, write: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    tmp.replace(path)
