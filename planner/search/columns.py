"""Column helpers over a search's trial table, shared by results (best, top-k) and pareto (fronts).

Kept apart so that results -> pareto is the only import between them (no loop).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

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


def unique_configs(frame: pd.DataFrame) -> pd.DataFrame:
    """One row per (instance, configuration): TPE evaluates a good point of a discrete space many times."""
    keys = [c for c in (*CONFIG_COLUMNS, *LORA_COLUMNS, *FRAMEWORK_COLUMNS, *LOOP_COLUMNS, *MODEL_PARALLEL_COLUMNS)
            if c in frame.columns]
    return frame.drop_duplicates(subset=keys, keep="first")


def feasible(frame: pd.DataFrame) -> pd.DataFrame:
    """The feasible trials, one per distinct configuration."""
    if frame.empty or "feasible" not in frame.columns:
        return frame.iloc[0:0]
    return unique_configs(frame[frame["feasible"].astype(bool)])


def cost_column(frame: pd.DataFrame) -> str:
    """$ per job when the recipe gives a dataset size, else $ per million samples."""
    if "usd_per_job" in frame.columns and frame["usd_per_job"].notna().any():
        return "usd_per_job"
    return "usd_per_million_samples"


def time_column(frame: pd.DataFrame) -> str:
    """Hours per job when the recipe gives a dataset size, else hours per million samples."""
    if "hours_per_job" in frame.columns and frame["hours_per_job"].notna().any():
        return "hours_per_job"
    return "hours_per_million_samples"
