"""`planner search`: find the fastest (or cheapest) configuration that fits, with Optuna.

`planner search --instance ml.p3.16xlarge` searches the built-in default (the seed's multimodal BERT);
`--sweep FILE` reads a sweep, and every other flag overrides the sweep's field of the same name.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from planner.cli.common import console, err_console, handles_errors, parse_model_options

if TYPE_CHECKING:  # pragma: no cover
    from planner.search.study import SearchResult
    from planner.search.sweep import Sweep

HELP_SPACE = "Comma-separated values to search (default: see planner/search/space.py)."


def _slug(text: str) -> str:
    import re

    stem = Path(text).stem if ("/" in text or text.endswith(".json")) else text
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", stem).strip("-.") or "search"


def build_sweep(*, sweep_file: Path | None, model: str | None, model_options: list[str] | None,
                instance: str | None, nodes: int | None, space: dict[str, str | None],
                constraints: dict[str, Any], objective: dict[str, Any], search: dict[str, Any]) -> Sweep:
    """The sweep file (or the built-in default) with the flags that were given laid over it."""
    from planner.search.space import space_from_flags
    from planner.search.sweep import DEFAULT_SWEEP, check_sweep, load_sweep

    base = load_sweep(sweep_file) if sweep_file is not None else DEFAULT_SWEEP
    updates: dict[str, Any] = {}
    if model is not None:
        updates["model"] = model
        updates["model_options"] = {}  # the sweep's options belong to its model
        if sweep_file is None:
            updates["name"] = _slug(model)
    if model_options:
        updates["model_options"] = {**(updates.get("model_options", base.model_options)),
                                    **parse_model_options(model_options)}
    if instance is not None:
        updates["instance"] = instance
    if nodes is not None:
        updates["fixed"] = {**base.fixed, "instances": nodes}
    flags_space = space_from_flags(**space)
    if flags_space.explicit():
        updates["space"] = base.space.merged(flags_space).model_dump()
    for key, values in (("constraints", constraints), ("objective", objective), ("search", search)):
        given = {k: v for k, v in values.items() if v is not None}
        if given:
            updates[key] = given
    if not updates:
        return base
    merged = base.with_overrides(**updates)
    check_sweep(merged)
    return merged


# ------------------------------------------------------------------------------------------ output


def _gib(value: float) -> str:
    return "-" if value != value else f"{value:.2f}"


def _money(value: Any) -> str:
    return "-" if value is None or value != value else f"${value:,.2f}"


ALWAYS_SHOWN = ("batch_size", "seq_len", "parallelism")


def _config_text(row: Any, shown: set[str]) -> str:
    """The searched dimensions of one configuration (fixed ones are printed once, above the table)."""
    parts = [f"b={row['batch_size']}", f"s={row['seq_len']}"]
    if "precision" in shown:
        parts.append(str(row["precision"]))
    if "checkpointing" in shown:
        parts.append("ckpt" if row["checkpointing"] else "no-ckpt")
    if "grad_accum" in shown:
        parts.append(f"accum={row['grad_accum']}")
    parts.append(str(row["parallelism"]))
    parts += [str(row[d]) for d in ("optimizer", "attention") if d in shown]
    return " ".join(parts)


def print_result(result: SearchResult, top: int) -> None:
    from rich.table import Table

    from planner.search.pareto import throughput_vs_seq_len
    from planner.search.results import best_per_instance, cost_column, top_k

    frame = result.frame
    n_feasible = int(frame["feasible"].sum()) if len(frame) else 0
    target = result.sweep.objective.target
    console.print(f"[bold]{result.sweep.model}[/] search [cyan]{result.name}[/]: {len(frame)} trials "
                  f"({n_feasible} feasible) on {', '.join(r.instance for r in result.runs)}; "
                  f"objective: {'max samples/s' if target == 'throughput' else 'min cost'}", highlight=False)
    shown = {dim for run in result.runs for dim in run.space.searched()}
    fixed = {k: v for k, v in result.runs[0].space.constants().items() if k not in shown} if result.runs else {}
    if fixed:
        console.print("fixed: " + ", ".join(f"{k}={v}" for k, v in fixed.items()), highlight=False)
    for run in result.runs:
        if run.space.dropped:
            dropped = "; ".join(f"{k} {', '.join(map(str, v))}" for k, v in run.space.dropped.items())
            console.print(f"  {run.instance}: left out of the default space (unsupported here): {dropped}",
                          highlight=False)
    if n_feasible == 0:
        return
    cost_col = cost_column(frame)
    cost_head = "$/epoch" if cost_col == "usd_per_epoch" else "$/M samples"
    multi = len(result.runs) > 1
    table = Table(title=f"Top {top} configurations", title_justify="left")
    for head in (["#"] + (["instance"] if multi else []) +
                 ["configuration", "GBS", "peak GiB", "headroom GiB", "samples/s", "tokens/s", "MFU", "$/hour",
                  cost_head]):
        table.add_column(head, justify="left" if head in ("instance", "configuration") else "right")
    for i, (_, row) in enumerate(top_k(frame, top, result.direction).iterrows(), 1):
        cells = [str(i)] + ([row["instance"]] if multi else []) + [
            _config_text(row, shown), f"{int(row['global_batch_size']) if row['global_batch_size'] == row['global_batch_size'] else '-'}",
            f"{_gib(row['peak_device_gib'])} / {_gib(row['gpu_memory_gib'])}", _gib(row["headroom_gib"]),
            f"{row['samples_per_s']:,.1f}", f"{row['tokens_per_s']:,.0f}", f"{row['mfu']:.1%}",
            _money(row["price_per_hour"]), _money(row[cost_col])]
        table.add_row(*cells)
    console.print(table)
    if multi:
        per = Table(title="Best configuration per instance type, cheapest first", title_justify="left")
        for head in ("instance", "configuration", "samples/s", "$/hour", cost_head, "hours/epoch"):
            per.add_column(head, justify="left" if head in ("instance", "configuration") else "right")
        for _, row in best_per_instance(frame, result.direction).iterrows():
            hours = row.get("hours_per_epoch")
            per.add_row(row["instance"], _config_text(row, shown), f"{row['samples_per_s']:,.1f}",
                        _money(row["price_per_hour"]), _money(row[cost_col]),
                        "-" if hours is None or hours != hours else f"{hours:,.2f}")
        console.print(per)
        missing = [r.instance for r in result.runs if r.instance not in set(frame[frame["feasible"]]["instance"])]
        if missing:
            console.print(f"no feasible configuration on: {', '.join(missing)}", highlight=False)
    front = throughput_vs_seq_len(frame)
    if front["seq_len"].nunique() > 1:
        ft = Table(title="Fastest configuration per sequence length among the trials (Pareto front)", title_justify="left")
        for head in (["instance"] if multi else []) + ["seq len", "configuration", "samples/s", "tokens/s"]:
            ft.add_column(head, justify="left" if head in ("instance", "configuration") else "right")
        for _, row in front.iterrows():
            ft.add_row(*([row["instance"]] if multi else []), str(row["seq_len"]), _config_text(row, shown),
                       f"{row['samples_per_s']:,.1f}", f"{row['tokens_per_s']:,.0f}")
        console.print(ft)


def infeasible_message(result: SearchResult) -> str:
    from planner.search.results import infeasible_reasons

    reasons = infeasible_reasons(result.frame)
    common = "; ".join(f"{n}× {text}" for n, text in reasons[:3])
    hints = []
    if any("memory" in text for _, text in reasons):
        hints.append("smaller --batch-sizes or --seq-lens, --checkpointing on, a larger --max-memory-fraction, "
                     "a sharded --parallelisms (zero2, zero3, fsdp) or an instance with more GPU memory")
    if any("global batch" in text for _, text in reasons):
        hints.append("a --global-batch-tolerance, or --batch-sizes/--grad-accums that multiply to the target")
    if any(text.startswith("--") for _, text in reasons):
        hints.append("values this GPU and model support (see the reasons)")
    advice = f" Try {'; or '.join(hints)}." if hints else ""
    return (f"no feasible configuration in {len(result.frame)} trials of study {result.name} (the trials are "
            f"saved in {result.storage}); reasons: {common or 'none'}.{advice}")


class _Progress:
    """A rich progress bar per instance type on stderr."""

    def __init__(self) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), console=err_console, transient=True)
        self.tasks: dict[str, Any] = {}

    def __call__(self, instance: str, done: int, total: int) -> None:
        if instance not in self.tasks:
            self.tasks[instance] = self.progress.add_task(instance, total=total)
        self.progress.update(self.tasks[instance], completed=done, total=total)

    def __enter__(self) -> _Progress:
        self.progress.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.progress.stop()


def register(app: typer.Typer) -> None:
    @app.command("search")
    @handles_errors
    def search(
        instance: Annotated[str | None, typer.Option(
            "--instance", "-i", help="Instance type(s): NAME, A,B,C or all (default: the sweep's).")] = None,
        model: Annotated[str | None, typer.Option("--model", "-m", help="Catalog name or config.json path.")] = None,
        model_option: Annotated[list[str] | None, typer.Option(
            "--model-option", "-o", help="Model option KEY=VALUE (repeatable).")] = None,
        sweep: Annotated[Path | None, typer.Option("--sweep", help="YAML sweep file (see sweeps/).")] = None,
        trials: Annotated[int | None, typer.Option(
            min=1, help="Finished trials wanted per instance type (default 100; grid: the whole grid).")] = None,
        sampler: Annotated[str | None, typer.Option(help="tpe (default; grid when the space has no more points than --trials), grid (exhaustive) or random.")] = None,
        seed: Annotated[int | None, typer.Option(help="Sampler seed (default 0).")] = None,
        study: Annotated[str | None, typer.Option(
            help="Study name; re-running with the same name resumes it (default: sweep name + hash).")] = None,
        storage: Annotated[str | None, typer.Option(
            help="Optuna RDB URL (default sqlite:///results/<study>/study.db), e.g. postgresql://...")] = None,
        top: Annotated[int, typer.Option(min=1, help="Configurations to show.")] = 5,
        json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
        max_memory_fraction: Annotated[float | None, typer.Option(
            min=0.01, max=1.0, help="Fits only if peak GPU memory <= this × GPU memory (default 0.95).")] = None,
        global_batch_size: Annotated[int | None, typer.Option(
            min=1, help="Required micro-batch × accumulation × GPUs × instances.")] = None,
        global_batch_tolerance: Annotated[float | None, typer.Option(
            min=0.0, max=0.99, help="Relative tolerance on --global-batch-size (default 0).")] = None,
        min_seq_len: Annotated[int | None, typer.Option(min=1, help="Search only sequence lengths >= this.")] = None,
        dataset_size: Annotated[int | None, typer.Option(min=1, help="Samples per epoch, for $/epoch.")] = None,
        spot: Annotated[bool | None, typer.Option("--spot/--on-demand", help="Price with spot instances.")] = None,
        objective: Annotated[str | None, typer.Option(
            help="throughput (max samples/s, default) or cost (min $/epoch).")] = None,
        nodes: Annotated[int | None, typer.Option("--instances", min=1, help="Instances (nodes) per job.")] = None,
        batch_sizes: Annotated[str | None, typer.Option(help="Micro-batches per GPU, e.g. 1,2,4,8.")] = None,
        seq_lens: Annotated[str | None, typer.Option(help="Sequence lengths, e.g. 128,256,512.")] = None,
        precisions: Annotated[str | None, typer.Option(help="fp32, amp-fp16, amp-bf16, fp16, bf16.")] = None,
        checkpointing: Annotated[str | None, typer.Option(help="on, off or both (default both).")] = None,
        grad_accums: Annotated[str | None, typer.Option(help="Gradient accumulation steps, e.g. 1,2,4.")] = None,
        optimizers: Annotated[str | None, typer.Option(help="adamw (default), adam, sgd, ...")] = None,
        attentions: Annotated[str | None, typer.Option(help="sdpa (default), eager, flash.")] = None,
        parallelisms: Annotated[str | None, typer.Option(help="auto (default), ddp, zero1, zero2, zero3, ...")] = None,
        results_dir: Annotated[Path, typer.Option(help="Where results/<study>/ goes.")] = Path("results"),
        progress: Annotated[bool | None, typer.Option(
            "--progress/--no-progress", help="Progress bar (default: on a terminal).")] = None,
    ) -> None:
        """Search micro-batch, sequence length, precision, checkpointing and accumulation for the best
        configuration that fits; prints the top configurations and writes results/<study>/."""
        from planner.search.study import run_search

        if objective is not None and objective not in ("throughput", "cost"):
            from planner.errors import unknown

            raise unknown("--objective", objective, ["throughput", "cost"])
        if sampler is not None and sampler not in ("tpe", "grid", "random"):
            from planner.errors import unknown

            raise unknown("--sampler", sampler, ["tpe", "grid", "random"])
        sw = build_sweep(
            sweep_file=sweep, model=model, model_options=model_option, instance=instance, nodes=nodes,
            space={"batch_sizes": batch_sizes, "seq_lens": seq_lens, "precisions": precisions,
                   "checkpointing": checkpointing, "grad_accums": grad_accums, "optimizers": optimizers,
                   "attentions": attentions, "parallelisms": parallelisms},
            constraints={"max_memory_fraction": max_memory_fraction, "global_batch_size": global_batch_size,
                         "global_batch_tolerance": global_batch_tolerance, "min_seq_len": min_seq_len},
            objective={"target": objective, "dataset_size": dataset_size, "spot": spot},
            search={},
        )
        show = (sys.stderr.isatty() and not json_out) if progress is None else progress
        kwargs = dict(study=study, storage=storage, trials=trials, sampler=sampler, seed=seed,
                      results_dir=results_dir)
        if show:
            with _Progress() as bar:
                result = run_search(sw, progress=bar, **kwargs)
        else:
            result = run_search(sw, **kwargs)
        if json_out:
            from planner.search.results import summary

            data = summary(result, top) | {"files": {k: str(v) for k, v in result.files.items()}}
            typer.echo(json.dumps(data, indent=2, default=str))
        else:
            print_result(result, top)
            if result.files:
                console.print(f"results: {', '.join(str(p) for p in result.files.values())}; "
                              f"storage: {result.storage}", highlight=False, soft_wrap=True)
        if result.all_infeasible:
            err_console.print(f"[bold red]error:[/] {infeasible_message(result)}", highlight=False, soft_wrap=True)
            raise typer.Exit(2)
