"""`planner search`: find the fastest (or cheapest) configuration that fits, with Optuna.

`planner search --instance ml.p3.16xlarge` searches the built-in default (the multimodal BERT, text + tabular);
`--sweep FILE` reads a sweep, and every other flag overrides the sweep's field of the same name.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from planner.cli.common import (
    AllocConfOpt,
    CudaVersionOpt,
    InputsOpt,
    LossOpt,
    TorchVersionOpt,
    TransformersVersionOpt,
    console,
    err_console,
    handles_errors,
    parse_model_options,
    quiet_interrupted_trials,
    stack_from_flags,
)
from planner.io import check_writable_dir, dumps_json
from planner.search.limits import (
    DEFAULT_TRIALS,
    MAX_DATASET_SIZE,
    MAX_EPOCHS,
    MAX_GLOBAL_BATCH,
    MAX_SEARCH_INSTANCES,
    MAX_SEED,
    MAX_TRIALS,
    TRIALS_PER_EXTRA_TYPE,
)

if TYPE_CHECKING:  # pragma: no cover
    from planner.search.study import SearchInterrupted, SearchResult
    from planner.search.sweep import Sweep

HELP_SPACE = "Comma-separated values to search."


def _slug(text: str) -> str:
    import re

    text = text.replace(".py:", "-")  # FILE.py:build -> FILE-build
    stem = Path(text).stem if ("/" in text or text.endswith(".json")) else text
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", stem).strip("-.") or "search"


def build_sweep(*, sweep_file: Path | None, model: str | None, model_options: list[str] | None,
                instance: str | None, nodes: int | None, space: dict[str, str | None],
                constraints: dict[str, Any], objective: dict[str, Any], search: dict[str, Any],
                recipe: dict[str, Any] | None = None, max_instances: int | None = None,
                stack: dict[str, str] | None = None, inputs: str | None = None, loss: str | None = None,
                region: str | None = None, held: dict[str, dict[str, Any]] | None = None) -> Sweep:
    """The sweep file (or the built-in default) with the flags that were given laid over it.

    The recipe flags (--global-batch-size, --seq-len, --dataset-size, --epochs) set the sweep's `recipe:`;
    --seq-lens is the older spelling of --seq-len; a --global-batch-tolerance keeps the older, tolerant
    global-batch constraint with searched accumulation."""
    from planner.search.space import space_from_flags
    from planner.search.sweep import DEFAULT_SWEEP, check_sweep, load_sweep

    base = load_sweep(sweep_file) if sweep_file is not None else DEFAULT_SWEEP
    updates: dict[str, Any] = {}
    if model is not None:
        updates["model"] = model
        updates["model_options"] = {}  # the sweep's options belong to its model
        updates["inputs"] = updates["loss"] = None  # and so do its inputs and loss
        if sweep_file is None:
            updates["name"] = _slug(model)
    elif sweep_file is None and instance is not None and instance != base.instance:
        updates["name"] = _slug(base.model)  # the default's name says p3: not for other instance types
    for key, value in (("inputs", inputs), ("loss", loss)):
        if value is not None:
            updates[key] = value
    if model_options:
        updates["model_options"] = {**(updates.get("model_options", base.model_options)),
                                    **parse_model_options(model_options)}
    if instance is not None:
        updates["instance"] = instance
    if nodes is not None:
        updates["fixed"] = {**base.fixed, "instances": nodes}
    recipe = {k: v for k, v in (recipe or {}).items() if v is not None}
    if stack:
        updates["stack"] = stack
    if region is not None:
        from planner.prices import check_region, load_cache

        updates["region"] = check_region(region, load_cache())
    space = dict(space)
    seq_flag = "--seq-len"
    if space.get("seq_lens") is not None and "seq_len" not in recipe:
        recipe["seq_len"] = space.pop("seq_lens")
        seq_flag = "--seq-lens"  # the older spelling: errors name the flag the user typed
    space.pop("seq_lens", None)
    if "seq_len" in recipe:
        recipe["seq_len"] = _seq_lens(recipe["seq_len"], seq_flag)
    constraints = dict(constraints)
    if constraints.get("global_batch_tolerance"):  # the older tolerant form: accumulation is searched
        gbs = constraints.get("global_batch_size") or base.recipe.global_batch_size
        constraints["global_batch_size"] = gbs
        recipe["global_batch_size"] = None
    elif constraints.get("global_batch_size") is not None:
        recipe["global_batch_size"] = constraints.pop("global_batch_size")
    if max_instances is not None:
        space["instance_counts"] = ",".join(str(n) for n in range(1, max_instances + 1))
    flags_space = space_from_flags(**space)
    if flags_space.explicit():
        merged_space = base.space.merged(flags_space)
        if "seq_len" in recipe or base.recipe.seq_len is not None:
            merged_space = merged_space.model_copy(update={"seq_lens": None})
        updates["space"] = merged_space.model_dump()
    elif "seq_len" in recipe and base.space.seq_lens is not None:
        updates["space"] = base.space.model_copy(update={"seq_lens": None}).model_dump()
    if recipe:
        updates["recipe"] = recipe
        if recipe.get("global_batch_size") is not None and base.constraints.global_batch_size is not None:
            constraints["global_batch_size"] = None
            constraints.setdefault("global_batch_tolerance", 0.0)
    if "global_batch_size" in constraints and constraints["global_batch_size"] is None:
        updates["constraints"] = {"global_batch_size": None}
    for key, values in (("constraints", constraints), ("objective", objective), ("search", search)):
        given = {k: v for k, v in values.items() if v is not None}
        if given:
            updates[key] = {**updates.get(key, {}), **given}
    for section, values in (held or {}).items():  # estimate's flags held for every trial (job_flags)
        if section == "fixed":
            values = dict(values)
            if "ds_config" in values:  # --ds-config FILE: read now (one line if it does not parse), as a sweep's
                from planner.parallel.ds_config import read_ds_config

                values["deepspeed"] = read_ds_config(values.pop("ds_config"), "--ds-config").model_dump()
            updates["fixed"] = {**updates.get("fixed", base.fixed), **values}
        else:
            updates[section] = {**updates.get(section, {}), **values}
    if not updates:
        return base
    merged = base.with_overrides(**updates)
    check_sweep(merged)
    return merged


def _seq_lens(text: Any, flag: str = "--seq-len") -> int | tuple[int, ...]:
    """--seq-len 512 or 256,512 (a list is explored; the best is reported at the longest)."""
    from planner.search.space import parse_flag_list

    if isinstance(text, int):
        return text
    values = parse_flag_list("seq_lens", str(text), flag)
    assert values is not None
    return values[0] if len(values) == 1 else values


# ------------------------------------------------------------------------------------------ output
# Every table fits 80 columns (also when piped, where rich assumes 80): few columns, short heads, and the
# configuration as one wrapped cell.


def _num(value: Any, fmt: str = ",.2f", prefix: str = "") -> str:
    if value is None or value != value:
        return "-"
    return f"{prefix}{value:{fmt}}"


def _int(value: Any) -> str:
    return "-" if value is None or value != value else str(int(value))


def _config_text(row: Any, shown: set[str]) -> str:
    """The searched dimensions of one configuration (fixed ones are printed once, above the table):
    micro-batch × accumulation × GPUs, then the rest."""
    gpus = row.get("world_size")
    parts = [f"{_int(row['batch_size'])}x{_int(row['grad_accum'])}x{_int(gpus)}"]
    if "seq_len" in shown:
        parts.append(f"s{_int(row['seq_len'])}")
    for dim in ("precision", "parallelism", "attention", "optimizer", "optimizer_impl", "framework"):
        if dim in shown:
            value = row.get(dim)
            parts.append(value if isinstance(value, str) else "pytorch")  # NaN: a plain-PyTorch trial
    if "checkpointing" in shown:
        parts.append("ckpt" if row["checkpointing"] else "no-ckpt")
    if "lora_r" in shown:
        parts.append(f"r{_int(row.get('lora_r'))}")
    for dim, label in (("lora_targets", "targets"), ("base_dtype", "base")):  # labelled: "bf16" alone reads
        if dim in shown:                                                     # as the precision
            parts.append(f"{label} {row.get(dim) or 'default'}")
    for dim, default in (("loop", "plain"), ("load", "direct")):  # (rows at the defaults do not carry them)
        if dim in shown:
            value = row.get(dim)
            parts.append(value if isinstance(value, str) else default)
    return " ".join(parts)


def _fixed_text(value: Any) -> str:
    """A fixed value as the user gave it: a ds_config by its file (or stage), not its every field."""
    if isinstance(value, dict) and "reduce_bucket_size" in value:
        return value.get("source") or f"ds_config stage {value.get('stage')}"
    return str(value)


def _instance_text(row: Any) -> str:
    n = _int(row.get("instances"))
    name = str(row["instance"]).removeprefix("ml.")
    return name if n in ("1", "-") else f"{n}x {name}"


def _table(title: str, heads: list[str]) -> Any:
    from rich import box
    from rich.table import Table

    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1))
    for head in heads:
        left = head in ("instance", "configuration")
        table.add_column(head, justify="left" if left else "right", overflow="fold",
                         ratio=3 if head == "configuration" else None)
    return table


def _recipe_text(result: SearchResult) -> str:
    from planner.search.sweep import DEFAULT_SWEEP

    r = result.sweep.recipe
    seq = r.seq_lens()
    parts = []
    if r.global_batch_size is not None:
        parts.append(f"global batch {r.global_batch_size}")
    if seq:
        parts.append(f"seq {','.join(map(str, seq))}")
    size = result.sweep.dataset_size()
    if size is not None:
        parts.append(f"{size:,} samples x {r.epochs:g} epoch{'s' if r.epochs != 1 else ''}")
    text = ", ".join(parts) or "none (accumulation and sequence length searched; $ per million samples)"
    if result.sweep.recipe == DEFAULT_SWEEP.recipe:
        text += " (the reference job; dataset size and epochs are documented defaults: --dataset-size, --epochs)"
    return text


def print_result(result: SearchResult, top: int) -> None:
    from planner.search.columns import cost_column, time_column
    from planner.search.results import best_per_instance, best_row, seq_len_front, top_k
    from planner.search.sweep import TARGETS
    from planner.search.table import missing, sort_rows

    assert result.target in TARGETS
    rows = result.rows
    run = result.run
    n_feasible = sum(bool(r["feasible"]) for r in rows)
    goal = {"throughput": "max samples/s", "cost": "min $ per job", "time": "min hours per job",
            "pareto": "hours vs $ per job (Pareto front)"}[result.target]
    types = run.instances
    where = types[0] if len(types) == 1 else f"{len(types)} instance types"
    console.print(f"[bold]{result.sweep.model}[/] on {where}: study [cyan]{result.name}[/]", highlight=False)
    console.print(f"recipe: {_recipe_text(result)}", highlight=False)
    console.print(f"objective: {goal}; {len(rows)} trials ({n_feasible} feasible), sampler {run.sampler}",
                  highlight=False)
    shown = set(run.space.searched())
    fixed = {k: v for k, v in run.space.constants().items() if k not in shown and k != "instance"}
    if fixed:
        console.print("fixed: " + ", ".join(f"{k}={_fixed_text(v)}" for k, v in fixed.items()), highlight=False)
    if run.space.dropped:
        from planner.search.space import dropped_reason

        dropped = "; ".join(f"{k.replace('_', ' ')} {', '.join(map(str, v))} "
                            f"({dropped_reason(k, run.space.global_batch_size)})"
                            for k, v in run.space.dropped.items())
        console.print(f"left out of the default space: {dropped}", highlight=False)
    if n_feasible == 0:
        return
    cost_col, time_col = cost_column(rows), time_column(rows)
    per_job = cost_col == "usd_per_job"
    cost_head, time_head = ("$/job", "h/job") if per_job else ("$/M", "h/M")
    multi = len(types) > 1 or "instances" in shown
    best = best_row(rows, result.target, result.direction)
    if best:
        for line in best_lines(best[0], time_col, cost_col, per_job):
            console.print(line, highlight=False, soft_wrap=True)
    from planner.prices import price_records, provenance_summary, stale_hint

    records = price_records(list(types), result.sweep.region)
    for line in provenance_summary(records):
        console.print(line, highlight=False, soft_wrap=True)
    if any(r["stale"] for r in records):
        console.print(stale_hint(result.sweep.region), highlight=False, soft_wrap=True)
    heads = ["#"] + (["instance"] if multi else []) + ["configuration", "peak GiB", "samples/s", time_head,
                                                       cost_head]
    table = _table(f"Top {top} configurations (micro x accum x GPUs)", heads)
    for i, row in enumerate(top_k(rows, top, result.direction), 1):
        table.add_row(str(i), *([_instance_text(row)] if multi else []), _config_text(row, shown),
                      _num(row["peak_device_gib"]), _num(row["samples_per_s"], ",.1f"), _num(row[time_col]),
                      _num(row[cost_col], prefix="$"))
    console.print(table)
    if len(types) > 1:
        per = best_per_instance(rows, result.direction)
        if result.target == "pareto":
            per = sort_rows(per, [(lambda r: r[cost_col], True)])
        table = _table("Best per instance type, cheapest per job first", ["instance", "configuration",
                                                                          "samples/s", "$/h", time_head, cost_head])
        for row in per:
            table.add_row(_instance_text(row), _config_text(row, shown), _num(row["samples_per_s"], ",.1f"),
                          _num(row["price_per_hour"], prefix="$"), _num(row[time_col]), _num(row[cost_col], prefix="$"))
        console.print(table)
        for line in _missing_lines(result, types):
            console.print(line, highlight=False)
    if result.target == "pareto":
        from planner.search.pareto import time_vs_cost

        table = _table("Pareto front: hours vs $ per job", ["instance", "configuration", "samples/s", time_head,
                                                            cost_head])
        for row in time_vs_cost(rows):
            table.add_row(_instance_text(row), _config_text(row, shown), _num(row["samples_per_s"], ",.1f"),
                          _num(row[time_col]), _num(row[cost_col], prefix="$"))
        console.print(table)
    front = seq_len_front(result)
    if len({r["seq_len"] for r in front if not missing(r["seq_len"])}) > 1:
        table = _table("Best per sequence length (Pareto front)", ["seq", *(["instance"] if multi else []),
                                                                    "configuration", "samples/s", cost_head])
        for row in front:
            table.add_row(_int(row["seq_len"]), *([_instance_text(row)] if multi else []), _config_text(row, shown),
                          _num(row["samples_per_s"], ",.1f"), _num(row[cost_col], prefix="$"))
        console.print(table)


def _joined(parts: list[str], first: str, indent: str = "      ", width: int = 80) -> list[str]:
    """Parts joined by ", " into lines of at most `width` columns, broken only between parts, so a figure
    ("15.78 GiB") is never split across two lines."""
    lines, line = [], first
    for part in parts:
        sep = "" if line in (first, indent) else ", "
        if len(line) + len(sep) + len(part) > width and line not in (first, indent):
            lines.append(line)
            line, sep = indent, ""
        line += sep + part
    return [*lines, line]


def best_lines(b: Any, time_col: str, cost_col: str, per_job: bool) -> list[str]:
    """The best configuration in lines of at most 80 columns: what it is, what it does, what it costs and on
    how many of the instance's GPUs (SageMaker bills every GPU of the instance)."""
    from planner.hardware import get_instance

    gpus, world = get_instance(str(b["instance"])).gpus, _int(b["world_size"])
    n = int(b["instances"]) if b.get("instances") == b.get("instances") and b.get("instances") else 1
    what = [f"{_instance_text(b)}", f"micro-batch {_int(b['batch_size'])} x accumulation {_int(b['grad_accum'])} "
            f"x {world} GPUs = global batch {_int(b['global_batch_size'])}", f"seq {_int(b['seq_len'])}",
            str(b["precision"]), "checkpointing" if b["checkpointing"] else "no checkpointing",
            str(b["parallelism"]), str(b["attention"]), f"{b['optimizer']} {b['optimizer_impl']}"]
    if isinstance(b.get("framework"), str):
        what.append(f"framework {b['framework']}")
    degrees = {dim: int(b[dim]) for dim in ("tp", "pp", "cp")
               if b.get(dim) is not None and b.get(dim) == b.get(dim) and b.get(dim) != 1}
    if degrees:  # a model-parallel layout (issue 34): each micro-batch spreads over tp x pp x cp GPUs
        replicas = int(world) // math.prod(degrees.values())
        what[1] = (f"micro-batch {_int(b['batch_size'])} x accumulation {_int(b['grad_accum'])} x {replicas} "
                   f"replicas = global batch {_int(b['global_batch_size'])}")
        what.append(" x ".join(f"{dim} {n}" for dim, n in degrees.items()) + f" ({world} GPUs)")
    for dim, label in (("lora_r", "LoRA r"), ("lora_targets", "targets"), ("base_dtype", "base")):
        value = b.get(dim)
        if value is not None and value == value and value != "":
            what.append(f"{label} {_int(value) if dim == 'lora_r' else value}")
    used = (f"whole instance{'s' if n > 1 else ''}: {world} of {gpus * n} GPUs used" if world != str(gpus * n)
            else f"{gpus * n} GPU{'s' if gpus * n != 1 else ''}")
    does = [f"{_num(b['samples_per_s'], ',.1f')} samples/s",
            f"{_num(b[time_col])} h and {_num(b[cost_col], prefix='$')} {'per job' if per_job else 'per 1M samples'}",
            f"at {_num(b['price_per_hour'], prefix='$')}/h ({used})",
            f"peak {_num(b['peak_device_gib'])} of {_num(b['gpu_memory_gib'])} GiB ({b['verdict']})",
            f"band's high end {_num(b['peak_device_high_gib'])} GiB"]
    return _joined(what, "best: ") + _joined(does, "      ")


def write_best_timeline(result: SearchResult, path: str) -> None:
    """`--plot`: the best configuration estimated again and its memory timeline written (as `estimate --plot`)."""
    from planner.estimate import estimate
    from planner.hardware import get_instance
    from planner.report.timeline_plot import write_timeline
    from planner.search.results import best_row
    from planner.search.sweep import sweep_model

    b = best_row(result.rows, result.target, result.direction)[0]
    space = result.run.space
    values = {dim: b[dim] for dim in space.values() if dim in b and b[dim] == b[dim]}
    for dim, vals in space.values().items():  # numpy scalars back to the space's own values
        values[dim] = next((v for v in vals if v == values.get(dim)), vals[0])
    config = space.config(values)
    sw = result.sweep
    est = estimate(sweep_model(sw), config, get_instance(str(b["instance"])), dataset_size=sw.dataset_size(),
                   spot=sw.objective.spot, **sw.estimate_kwargs())
    write_timeline(est, path, model_options=dict(sw.model_options))


def files_lines(result: SearchResult) -> list[str]:
    """Where the results went, in lines that fit 80 columns with the default study names: the folder on one
    line (a path is never broken), its files on the next; the storage by name when it sits in that folder."""
    names = [p.name for p in result.files.values()]
    storage = str(result.storage)
    folder = Path(result.results_dir)
    inside = Path(storage).parent.resolve() == folder.resolve() if "://" not in storage else False
    lines = [f"results: {folder}/", "  " + ", ".join(names) + (f", {Path(storage).name} (the study)" if inside else "")]
    if not inside:
        lines.append(f"storage: {storage}")
    return lines


def interrupted_message(stop: SearchInterrupted) -> str:
    """What a Ctrl-C left: how many trials are kept, where their table is, and how to go on."""
    if stop.result is None or not stop.result.files:
        return "interrupted before any trial finished; nothing was saved"
    names = ", ".join(p.name for p in stop.result.files.values())
    return (f"interrupted after {stop.finished} of {stop.run.target} trials; what they found is in "
            f"{stop.result.results_dir}/ ({names}); run the same command again to go on")


def infeasible_message(result: SearchResult) -> str:
    from planner.search.results import infeasible_reasons

    reasons = infeasible_reasons(result.rows)
    common = "; ".join(f"{n}x {text}" for n, text in reasons[:3])
    hints = []
    if any("memory" in text or "tight" in text for _, text in reasons):
        hints.append("smaller --batch-sizes, --checkpointing on, a larger --max-memory-fraction, --accept-tight, "
                     "a sharded --parallelisms (zero2, zero3, fsdp) or an instance with more GPU memory")
    if any("global batch" in text for _, text in reasons):
        hints.append("a --global-batch-size that micro-batch x GPUs divides, or other --batch-sizes")
    if any(text.startswith("--") for _, text in reasons):
        hints.append("values this GPU and model support (see the reasons)")
    advice = f" Try {'; or '.join(hints)}." if hints else ""
    return (f"no feasible configuration in {len(result.rows)} trials of study {result.name} (the trials are "
            f"saved in {result.storage}); reasons: {common or 'none'}.{advice}")


def _missing_lines(result: SearchResult, types: list[str]) -> list[str]:
    """Why some instance types have no row, said honestly: "even its smallest start fails" only where the
    memory model's start (study.start_points: smallest micro-batch, checkpointing, sharding) failed; otherwise
    the trials simply found none ("in its N trials"), which a user must not read as "cannot train here"."""
    from collections import Counter

    found = {r["instance"] for r in result.rows if r["feasible"]}
    missing = [t for t in types if t not in found]
    unfit = {s.instance: s.reason for s in result.run.starts if not s.feasible}
    unpriced = [n for n in missing if unfit.get(n, "").startswith("no price for")]
    counts = Counter(r["instance"] for r in result.rows)
    lines = []
    # types whose smallest start fails the same way (figures aside): one line
    same_reason: dict[str, list[tuple[str, str]]] = {}
    if unpriced:  # their start fits: only the $ per job to rank them by is missing
        names = ", ".join(n.removeprefix("ml.") for n in unpriced)
        lines.append(f"unpriced here, so not ranked by $ per job ({len(unpriced)} type{'s' if len(unpriced) != 1 else ''}; "
                     f"their starts fit, and "
                     f"--objective throughput ranks them by samples/s): {names}")
    for name in missing:
        short = name.removeprefix("ml.")
        n = int(counts.get(name, 0))
        if name in unpriced:
            continue
        if name in unfit:
            same_reason.setdefault(_reason_kind(unfit[name], name), []).append(
                (short, unfit[name].replace(name, "these types")))
        else:
            lines.append(f"{short}: no feasible configuration found in its {n} trial{'s' if n != 1 else ''} "
                         f"(not proven impossible: search it alone, --instance {short})")
    for group in same_reason.values():
        names = [short for short, _ in group]
        reasons = {reason for _, reason in group}
        # the reason as printed for that type: the same words for all, or the first type's figures named
        why = group[0][1] if len(reasons) == 1 else f"on {names[0]}: {group[0][1]}"
        if len(group) == 1:
            why = why.replace("these types", names[0])
        lines.append(f"nothing found on {', '.join(names)}: even the smallest start (micro-batch, "
                     f"checkpointing and sharding as far as the space allows) fails: {why}")
    return lines


def _reason_kind(reason: str, instance: str) -> str:
    """A start's failure without what differs by instance type (its name, its GPU's memory, its peak): the key
    that groups types failing alike into one line."""
    import re

    reason = reason.replace(instance, "these types")
    return re.sub(r"\d[\d.,-]*", "N", reason)  # a key only: what is printed keeps its figures


# Seconds between status lines when stderr is not a terminal (a log, CI): a bar would print nothing useful.
STATUS_INTERVAL_S = 5.0


class _Progress:
    """A rich progress bar on a terminal; when piped, a status line every STATUS_INTERVAL_S seconds only if
    `--progress` asked for it (a log or a pipe gets no lines it did not ask for)."""

    def __init__(self, bar: bool, status: bool = False) -> None:
        import time

        self.bar, self.status = bar, status
        self.start = self.last = time.monotonic()
        self.task: Any = None
        self.progress: Any = None
        if bar:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                     TimeElapsedColumn(), console=err_console, transient=True)

    def __call__(self, label: str, done: int, total: int) -> None:
        import time

        if self.progress is not None:
            if self.task is None:
                self.task = self.progress.add_task("search", total=total)
            self.progress.update(self.task, completed=done, total=total)
            return
        if not self.status:
            return
        now = time.monotonic()
        if now - self.last >= STATUS_INTERVAL_S or (done >= total and now - self.start >= STATUS_INTERVAL_S):
            self.last = now
            print(f"search {label}: {done}/{total} trials, {now - self.start:.0f} s", file=sys.stderr, flush=True)

    def __enter__(self) -> _Progress:
        if self.progress is not None:
            self.progress.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.progress is not None:
            self.progress.stop()


def register(app: typer.Typer) -> None:
    from planner.cli.job_flags import search_takes

    @app.command("search")
    @handles_errors
    @search_takes
    def search(
        instance: Annotated[str | None, typer.Option(
            "--instance", "-i", help="Instance type(s): NAME, A,B,C or all (default: the sweep's).")] = None,
        model: Annotated[str | None, typer.Option(
            "--model", "-m", help="Catalog name, config.json path or FILE.py:build (your own module, traced once "
                                  "per shape class).")] = None,
        model_option: Annotated[list[str] | None, typer.Option(
            "--model-option", "-o", help="Model option KEY=VALUE (repeatable).")] = None,
        inputs: InputsOpt = None,
        loss: LossOpt = None,
        region: Annotated[str | None, typer.Option(
            "--region", help="Region whose SageMaker prices the cost uses (default: the sweep's, us-east-1).")] = None,
        sweep: Annotated[Path | None, typer.Option("--sweep", help="YAML sweep file (see sweeps/).")] = None,
        trials: Annotated[int | None, typer.Option(
            min=1, max=MAX_TRIALS, help=f"Finished trials wanted in the study, shared by every worker (default "
                                     f"{DEFAULT_TRIALS}, plus {TRIALS_PER_EXTRA_TYPE} per further instance type; "
                                     "grid: the whole grid).")] = None,
        sampler: Annotated[str | None, typer.Option(help="tpe (default; grid when the space has no more points than --trials), grid (exhaustive) or random.")] = None,
        seed: Annotated[int | None, typer.Option(
            min=0, max=MAX_SEED, help="Sampler seed (default 0); each further worker on the same study adds its number.")] = None,
        study: Annotated[str | None, typer.Option(
            help="Study name; re-running with the same name resumes it (default: sweep name, instance set, "
                 "hash).")] = None,
        storage: Annotated[str | None, typer.Option(
            help="Journal file (default results/<study>/journal.log) or Optuna RDB URL: sqlite:///x.db, "
                 "postgresql://user@host/db (pip install .[postgres]).")] = None,
        top: Annotated[int, typer.Option(min=1, help="Configurations to show.")] = 5,
        json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
        max_memory_fraction: Annotated[float | None, typer.Option(
            min=0.01, max=1.0, help="Fits only if peak GPU memory <= this × GPU memory (default 0.95).")] = None,
        global_batch_size: Annotated[int | None, typer.Option(
            min=1, max=MAX_GLOBAL_BATCH, help="Recipe: samples per optimizer step over all GPUs (default 64); accumulation = this / "
                        "(micro-batch x GPUs), and must be whole.")] = None,
        seq_len: Annotated[str | None, typer.Option(
            "--seq-len", help="Recipe: tokens per sample, or a list to explore, e.g. 256,512 (default 512).")] = None,
        epochs: Annotated[float | None, typer.Option(
            min=0.001, max=MAX_EPOCHS, help="Recipe: passes over the dataset (default 3), for hours and $ per job.")] = None,
        global_batch_tolerance: Annotated[float | None, typer.Option(
            min=0.0, max=0.99, help="Accept a global batch within this relative tolerance, with searched "
                                    "--grad-accums (default 0: exact, accumulation derived).")] = None,
        min_seq_len: Annotated[int | None, typer.Option(min=1, help="Search only sequence lengths >= this.")] = None,
        dataset_size: Annotated[int | None, typer.Option(
            min=1, max=MAX_DATASET_SIZE, help="Recipe: samples per epoch (default 100,000).")] = None,
        spot: Annotated[bool | None, typer.Option("--spot/--on-demand", help="Price with spot instances.")] = None,
        objective: Annotated[str | None, typer.Option(
            help="cost ($/job; default with several instance types), time (hours/job), throughput "
                 "(samples/s; default on one) or pareto (hours vs $).")] = None,
        accept_tight: Annotated[bool | None, typer.Option(
            "--accept-tight/--sure-fit", help="Count a 'tight' memory verdict as feasible (default: sure "
                                             "fits only).")] = None,
        nodes: Annotated[int | None, typer.Option("--instances", min=1, max=MAX_SEARCH_INSTANCES, help="Instances (nodes) per job, fixed.")] = None,
        max_instances: Annotated[int | None, typer.Option(
            min=1, max=MAX_SEARCH_INSTANCES, help="Search 1..N instances per job (default 1).")] = None,
        batch_sizes: Annotated[str | None, typer.Option(help="Micro-batches per GPU, e.g. 1,2,4,8.")] = None,
        seq_lens: Annotated[str | None, typer.Option(help="Older spelling of --seq-len.")] = None,
        precisions: Annotated[str | None, typer.Option(help="fp32, amp-fp16, amp-bf16, fp16, bf16, fp8.")] = None,
        checkpointing: Annotated[str | None, typer.Option(help="on, off or both (default both).")] = None,
        grad_accums: Annotated[str | None, typer.Option(help="Gradient accumulation steps, e.g. 1,2,4.")] = None,
        optimizers: Annotated[str | None, typer.Option(help="adamw (default), adam, sgd, ...")] = None,
        optimizer_impls: Annotated[str | None, typer.Option(help="foreach, fused (default both), for-loop.")] = None,
        attentions: Annotated[str | None, typer.Option(help="sdpa, flash (default both where a GPU has it), "
                                                            "eager.")] = None,
        parallelisms: Annotated[str | None, typer.Option(
            help="ddp, zero1, zero2, zero3, fsdp, dp (default all), single, auto.")] = None,
        frameworks: Annotated[str | None, typer.Option(
            help="pytorch (default), torchtitan, megatron, deepspeed, accelerate, lightning: whose layouts "
                 "apply.")] = None,
        results_dir: Annotated[Path, typer.Option(help="Where results/<study>/ goes.")] = Path("results"),
        torch_version: TorchVersionOpt = None,
        cuda_version: CudaVersionOpt = None,
        transformers_version: TransformersVersionOpt = None,
        alloc_conf: AllocConfOpt = None,
        progress: Annotated[bool | None, typer.Option(
            "--progress/--no-progress", help="Progress bar (default: on a terminal).")] = None,
        plot: Annotated[str | None, typer.Option(
            "--plot", help="Write the best configuration's memory timeline to FILE.png or FILE.html.")] = None,
        job: dict[str, Any] | None = None,
    ) -> None:
        """Search instance type and count, parallelism, precision, checkpointing, micro-batch, attention and
        optimizer kernels for the best way to run a training recipe; prints the best, the top configurations
        and writes results/<study>/."""
        from planner.search.study import SearchInterrupted, run_search
        from planner.search.sweep import TARGETS

        if objective is not None and objective not in TARGETS:
            from planner.errors import unknown

            raise unknown("--objective", objective, list(TARGETS))
        if sampler is not None and sampler not in ("tpe", "grid", "random"):
            from planner.errors import unknown

            raise unknown("--sampler", sampler, ["tpe", "grid", "random"])
        from planner.cli.job_flags import sweep_updates

        space = {"batch_sizes": batch_sizes, "seq_lens": seq_lens, "precisions": precisions,
                 "checkpointing": checkpointing, "grad_accums": grad_accums, "optimizers": optimizers,
                 "optimizer_impls": optimizer_impls, "attentions": attentions, "parallelisms": parallelisms,
                 "frameworks": frameworks}
        held = sweep_updates(job or {}, space)  # estimate's flags: --batch-size 8, --lora-r 8,16, --tf32 ...
        sw = build_sweep(
            sweep_file=sweep, model=model, model_options=model_option, instance=instance, nodes=nodes,
            space=space,
            constraints={"max_memory_fraction": max_memory_fraction, "global_batch_size": global_batch_size,
                         "global_batch_tolerance": global_batch_tolerance, "min_seq_len": min_seq_len,
                         "accept_tight": accept_tight},
            objective={"target": objective, "spot": spot},
            search={},
            recipe={"seq_len": seq_len, "dataset_size": dataset_size, "epochs": epochs},
            max_instances=max_instances,
            stack=stack_from_flags(torch_version, cuda_version, transformers_version, alloc_conf),
            inputs=inputs, loss=loss, region=region, held=held,
        )
        check_writable_dir(results_dir, "--results-dir")  # before any trial: the result files go there
        quiet_interrupted_trials()
        # a bar on a terminal; piped or logged, nothing unless --progress asks (then a status line every 5 s)
        bar = sys.stderr.isatty() and not json_out if progress is None else (progress and sys.stderr.isatty())
        status = bool(progress) and not bar
        kwargs = dict(study=study, storage=storage, trials=trials, sampler=sampler, seed=seed,
                      results_dir=results_dir)
        try:
            with _Progress(bar, status) as report:
                result = run_search(sw, progress=report, **kwargs)
        except SearchInterrupted as stop:
            err_console.print(interrupted_message(stop), highlight=False, soft_wrap=True)
            raise typer.Exit(130) from None
        if json_out:
            from planner.search.results import summary

            data = summary(result, top) | {"files": {k: str(v) for k, v in result.files.items()}}
            typer.echo(dumps_json(data, indent=2, default=str))
        else:
            print_result(result, top)
            if result.files:
                for line in files_lines(result):
                    console.print(line, highlight=False, soft_wrap=True)
        if plot and not result.all_infeasible:
            write_best_timeline(result, plot)
            if not json_out:
                console.print(f"timeline of the best written to {plot}", highlight=False)
        if result.all_infeasible:
            err_console.print(f"[bold red]error:[/] {infeasible_message(result)}", highlight=False, soft_wrap=True)
            raise typer.Exit(2)
