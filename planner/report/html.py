"""`planner report`: a search's results as one HTML page, plotly.js as a file beside it (no CDN: the folder opens
offline), plus a PNG of each chart next to it, under `results/<study>/`.

Why plotly.js is not inlined: it is 4.6 MB, which alone would break the 2 MB page budget of a 37-instance
report; one `plotly.min.js` beside the page keeps report.html small (its own content) and still offline.

Reading: the search's Optuna storage (default `results/<study>/journal.log`, one study over every
instance type, see planner.search.study) and, when present, `results/probes.parquet`.
The trial table and the Pareto fronts come from planner.search (one definition of "best" and "front");
the peak breakdowns of the top candidates are recomputed with `planner.estimate` from each trial's stored
config, because a trial stores the step's totals, not how the peak splits into categories.
"""

from __future__ import annotations

import html
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from planner.errors import PlannerError
from planner.report import figures as F

PROBES_FILE = "probes.parquet"
# Configurations per instance type drawn in the scatter charts when several types were searched.
TOP_PER_TYPE = 5


# ------------------------------------------------------------------------------------------- loading


@dataclass
class StoredRun:
    """The search's study read back from the storage (one study over every instance type)."""

    run: Any  # planner.search.study.StudyRun
    study: Any  # optuna.Study

    @property
    def instance(self) -> str:
        names = [i.removeprefix("ml.") for i in self.run.instances]
        return ", ".join(names) if len(names) <= 3 else f"{len(names)} instance types"

    @property
    def trials(self) -> list[Any]:
        return self.run.trials

    @property
    def definition(self) -> dict[str, Any]:
        from planner.search.study import DEFINITION_ATTR

        return dict(self.study.user_attrs.get(DEFINITION_ATTR, {}))


@dataclass
class Search:
    name: str
    storage: str  # URL with any password masked, or the journal file
    runs: list[StoredRun]
    frame: Any  # planner.search.results.trials_frame
    direction: str

    @property
    def definition(self) -> dict[str, Any]:
        return self.runs[0].definition

    def trial(self, instance: str, number: int) -> Any:
        return next(t for r in self.runs for t in r.trials if t.number == number)


def _stored_run(study: Any, search_name: str) -> Any:
    """The StudyRun rebuilt from the study's stored definition, as planner.search.study.run_study built it
    (its space decodes each trial's sampled parameters into config values)."""
    from pydantic import ValidationError

    from planner.hardware import get_instance
    from planner.models.catalog import cached_model
    from planner.search.space import resolve_space
    from planner.search.study import DEFINITION_ATTR, StudyRun
    from planner.search.sweep import Sweep

    definition = study.user_attrs.get(DEFINITION_ATTR)
    if not definition:
        raise PlannerError("--study", search_name, f"a study written by `planner search` ({study.study_name} has "
                           f"no '{DEFINITION_ATTR}' attribute)")
    data = {k: v for k, v in definition.items() if k not in ("instances", "target")}
    try:
        sweep = Sweep.model_validate({**data, "instance": tuple(definition.get("instances") or ["ml.p3.16xlarge"])})
    except ValidationError as exc:
        raise PlannerError("--study", search_name, f"a study this version can read ({study.study_name}: "
                           f"{exc.errors()[0]['msg']})") from None
    types = [get_instance(n) for n in sweep.instance_names()]
    space = resolve_space(sweep.seq_space(), cached_model(sweep.model, sweep.model_options), types,
                          min_seq_len=sweep.constraints.min_seq_len, fixed=sweep.fixed,
                          global_batch_size=sweep.recipe.global_batch_size)
    trials = study.get_trials(deepcopy=False)
    return StudyRun(study_name=study.study_name, space=space, sampler=sweep.search.sampler or "tpe",
                    target=len(trials), new_trials=0, evaluations=0, worker=0, seed=0, trials=trials)


def load_search(name: str, storage: str | None = None, results_dir: str | Path = "results") -> Search:
    """The study `name` of `planner search` from its storage (default results/<name>/journal.log)."""
    import optuna

    from planner.search.results import trials_frame
    from planner.search.storage import load_study
    from planner.search.study import JOURNAL_FILE

    results_dir = Path(results_dir)
    if storage is None:
        journal = results_dir / name / JOURNAL_FILE
        if not journal.is_file():
            found = sorted(p.parent.name for p in results_dir.glob(f"*/{JOURNAL_FILE}"))
            raise PlannerError("--study", name, f"a search with {results_dir}/<study>/{JOURNAL_FILE} (found: "
                               f"{', '.join(found) or 'none'}), or pass --storage URL")
    study, display = load_study(name, storage, results_dir / name / JOURNAL_FILE)
    run = StoredRun(_stored_run(study, name), study)
    minimize = study.directions[0] == optuna.study.StudyDirection.MINIMIZE
    return Search(name, display, [run], trials_frame(run.run), "minimize" if minimize else "maximize")


# Quantity -> (predicted column, measured column, unit) in results/probes.parquet (planner.probes.store.flatten:
# predictions are `pred_<MemoryBytes field>`, readings the probe summary's names).
PROBE_PAIRS: dict[str, tuple[str, str, str]] = {
    "peak allocated": ("pred_peak_allocated", "peak_allocated", "bytes"),
    "peak reserved": ("pred_peak_reserved", "peak_reserved", "bytes"),
    "peak on the device": ("pred_peak_device", "device_peak", "bytes"),
    "activations": ("pred_activations", "activations", "bytes"),
    "CUDA context": ("pred_cuda_context", "cuda_context", "bytes"),
    "samples/s": ("pred_samples_per_s", "samples_per_s", "samples/s"),
}
PROBE_LABEL_COLUMNS = ("model", "instance", "batch_size", "seq_len", "precision")


def probe_pairs(path: str | Path) -> Any | None:
    """Predicted vs measured from the probes table, long form (quantity, unit, label, predicted, measured);
    rows where either is missing (failed or OOM probes) are left out. None when nothing to compare."""
    import pandas as pd

    path = Path(path)
    if not path.is_file():
        return None
    from planner.io import read_parquet

    table = read_parquet(path, "--probes")
    labels = [c for c in PROBE_LABEL_COLUMNS if c in table.columns]
    rows = []
    for quantity, (pred, meas, unit) in PROBE_PAIRS.items():
        if pred not in table.columns or meas not in table.columns:
            continue
        part = table[pd.to_numeric(table[pred], errors="coerce").notna()
                     & pd.to_numeric(table[meas], errors="coerce").notna()]
        for _, r in part.iterrows():
            rows.append({"quantity": quantity, "unit": unit, "predicted": float(r[pred]), "measured": float(r[meas]),
                         "label": " ".join(str(r[c]) for c in labels) or str(r.get("record_id", r.name))})
    return pd.DataFrame(rows) if rows else None


# ---------------------------------------------------------------------------------------- breakdowns


def _estimate_of(search: Search, row: Any, estimate_fn: Callable[..., Any] | None = None) -> Any:
    """Recompute a trial's estimate from its stored (resolved) config, called as the search calls it."""
    from planner.hardware import get_instance
    from planner.models.catalog import cached_model
    from planner.spec import TrainConfig

    if estimate_fn is None:
        from planner.estimate import estimate as estimate_fn
    definition = search.definition
    trial = search.trial(row["instance"], int(row["trial"]))
    config = {k: v for k, v in trial.user_attrs.get("config", {}).items() if k in TrainConfig.model_fields}
    objective = definition.get("objective", {})
    recipe = definition.get("recipe") or {}
    model = cached_model(definition.get("model", "multimodal-bert"), definition.get("model_options") or {})
    return estimate_fn(model, TrainConfig(**config), get_instance(row["instance"]),
                       dataset_size=recipe.get("dataset_size") or objective.get("dataset_size"),
                       spot=bool(objective.get("spot", False)))


def peak_bars(est: Any) -> dict[str, int]:
    """The peak of one GPU split into F.STACK: the peak phase's allocated bytes by category, then the
    runtime = CUDA context + NCCL + (peak reserved - peak allocated). Sums to `peak_device`."""
    m = est.memory_bytes
    detail = next((p.detail for p in est.phases if p.phase == est.peak_phase), None)
    if detail is None:
        raise ValueError(f"the estimate has no detail of its peak phase {est.peak_phase!r}")
    bars = {c: int(detail.get(c, 0)) for c in F.STACK if c != "runtime"}
    bars["runtime"] = m.cuda_context + m.nccl + m.peak_reserved - m.peak_allocated
    return bars


# ---------------------------------------------------------------------------------------------- page


@dataclass
class Section:
    key: str  # anchor and PNG file stem
    title: str
    intro: str = ""
    figures: list[Any] = field(default_factory=list)  # plotly figures
    notes: list[str] = field(default_factory=list)
    table: str = ""  # HTML


@dataclass
class Report:
    path: Path
    pngs: list[Path]
    sections: list[Section]

    @property
    def notes(self) -> list[str]:
        return [n for s in self.sections for n in s.notes]


_CSS = """
body{font-family:system-ui,-apple-system,'Segoe UI',Roboto,sans-serif;margin:0 auto;max-width:1280px;padding:0 24px 48px;
color:#222}
h1{font-size:1.6em;margin:24px 0 4px} h2{border-bottom:2px solid #ddd;padding-bottom:4px;margin-top:36px}
.meta{color:#555;font-size:.92em} .meta code{background:#f3f3f3;padding:1px 4px;border-radius:3px}
.note{background:#fff8e1;border-left:4px solid #f0b400;padding:8px 12px;margin:8px 0;font-size:.92em}
nav ul{columns:2;font-size:.95em} table.trials{border-collapse:collapse;font-size:.85em;margin:8px 0}
table.trials th,table.trials td{border:1px solid #ddd;padding:3px 8px;text-align:right}
table.trials th{background:#f5f5f5} .figure{margin:12px 0}
"""


PLOTLY_JS = "plotly.min.js"


def _write_plotly_js(out: Path) -> None:
    """plotly.js beside the page (written once per folder, atomically; rewritten if another version is there)."""
    from plotly.offline import get_plotlyjs

    js = get_plotlyjs()
    path = out / PLOTLY_JS
    try:
        if path.is_file() and path.stat().st_size == len(js.encode()) and path.read_text("utf-8") == js:
            return
    except (OSError, UnicodeDecodeError):
        pass
    _atomic_write(path, js)


def _page(title: str, meta: list[str], sections: list[Section]) -> str:
    """One HTML document loading plotly.js from the file beside it: opens offline, from a file:// URL."""
    parts = [f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>{html.escape(title)}</title>",
             f"<style>{_CSS}</style><script type='text/javascript' src='{PLOTLY_JS}'></script></head><body>",
             f"<h1>{html.escape(title)}</h1>"]
    parts += [f"<p class='meta'>{m}</p>" for m in meta]
    parts.append("<nav><ul>" + "".join(f"<li><a href='#{s.key}'>{html.escape(s.title)}</a></li>"
                                        for s in sections) + "</ul></nav>")
    for s in sections:
        parts.append(f"<section id='{s.key}'><h2>{html.escape(s.title)}</h2>")
        if s.intro:
            parts.append(f"<p>{html.escape(s.intro)}</p>")
        parts += [f"<div class='note'>{html.escape(n)}</div>" for n in s.notes]
        for i, fig in enumerate(s.figures):
            div = fig.to_html(full_html=False, include_plotlyjs=False, div_id=f"fig-{s.key}-{i}",
                              config={"displaylogo": False, "responsive": True})
            parts.append(f"<div class='figure'>{div}</div>")
        parts.append(s.table)
        parts.append("</section>")
    parts.append("<p class='meta'>Written by <code>planner report</code>. Memory is per GPU; throughput is the "
                 "whole job's samples/s.</p></body></html>")
    return "\n".join(parts)


def _atomic_write(path: Path, text: str) -> None:
    from planner.io import write_text

    write_text(path, text, "--out-dir")


# Columns of the top table: what tells two configurations apart (attention and parallelism included, else rows
# look identical), whole numbers as whole numbers, and the job's cost (the objective's unit), not an epoch's.
TOP_COLUMNS = [("trial", "trial"), ("instance", "instance"), ("batch_size", "micro-batch"), ("grad_accum", "accum"),
               ("world_size", "GPUs"), ("seq_len", "seq"), ("precision", "precision"), ("parallelism", "parallelism"),
               ("attention", "attention"), ("optimizer_impl", "optimizer"), ("checkpointing", "ckpt"),
               ("lora_r", "LoRA r"), ("lora_targets", "LoRA targets"), ("base_dtype", "base dtype"),
               ("peak_device_gib", "peak GiB"), ("samples_per_s", "samples/s"),
               ("hours_per_job", "h/job"), ("usd_per_job", "$/job"), ("usd_per_million_samples", "$/M samples")]
WHOLE = {"trial", "batch_size", "grad_accum", "world_size", "seq_len", "lora_r"}


def _cell(column: str, value: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    if column in WHOLE and isinstance(value, int | float):
        return f"{int(value):,}"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float):
        return f"{value:,.2f}" if abs(value) < 1e4 else f"{value:,.0f}"
    return str(value).removeprefix("ml.") if column == "instance" else str(value)


def _top_table(top: Any) -> str:
    cols = [(c, h) for c, h in TOP_COLUMNS if c in top.columns and not top[c].isna().all()]
    if "usd_per_job" in dict(cols):  # one cost per row: the job's when there is one
        cols = [(c, h) for c, h in cols if c != "usd_per_million_samples"]
    head = "".join(f"<th>{html.escape(h)}</th>" for _, h in cols)
    body = []
    for _, r in top.iterrows():
        cells = [f"<td>{html.escape(_cell(c, r[c]))}</td>" for c, _ in cols]
        body.append("<tr>" + "".join(cells) + "</tr>")
    return f"<table class='trials'><tr>{head}</tr>{''.join(body)}</table>"


def _target(definition: dict[str, Any]) -> str:
    """The objective the search ran with: the definition's resolved `target` (the sweep's own may be None,
    which means cost over several types, throughput on one)."""
    return str(definition.get("target") or (definition.get("objective") or {}).get("target") or "?")


def _price_lines(search: Search) -> list[str]:
    """Where the prices behind the costs come from (region, date, source, staleness), per instance type."""
    from planner.prices import price_records, provenance_summary, stale_hint

    region = str(search.definition.get("region") or "us-east-1")
    try:
        names = [n for r in search.runs for n in r.instance.split(", ")]  # one study may hold several types
        records = price_records(names, region)
    except PlannerError:
        return []
    lines = [html.escape(line[0].upper() + line[1:]) for line in provenance_summary(records)]
    if any(r["stale"] for r in records):
        lines.append(html.escape(stale_hint(region)))
    return lines


# ------------------------------------------------------------------------------------------ sections


def _breakdown_section(search: Search, top: Any, out: Path, pngs: list[Path],
                       estimate_fn: Callable[..., Any] | None) -> tuple[Section, Any]:
    import pandas as pd

    s = Section("breakdown", "Top candidates: where the peak memory goes",
                "The peak of one GPU for each of the best feasible configurations, by category, recomputed "
                "with the current estimate from each trial's config. The red mark is the GPU's memory.")
    rows, best_est = [], None
    with_instance = F.several_instances(search.frame)
    for _, row in top.iterrows():
        label = F.candidate_label(row, with_instance)
        try:
            est = _estimate_of(search, row, estimate_fn)
            bars = peak_bars(est)
        except (PlannerError, ValueError, KeyError, StopIteration) as exc:
            s.notes.append(f"{label}: could not recompute its estimate ({exc}); left out")
            continue
        best_est = best_est or est
        stored = row.get("mem_peak_device")
        if stored is not None and not math.isnan(stored) and int(stored) != est.memory_bytes.peak_device:
            s.notes.append(f"{label}: the estimate changed since the search (peak {stored / F.GIB:.2f} GiB then, "
                           f"{est.memory_bytes.peak_device / F.GIB:.2f} GiB now); the bars show now")
        rows.append({"label": label, **bars, "gpu_memory": est.gpu_memory_bytes})
    s.table = _top_table(top)
    if not rows:
        s.notes.append("no breakdown to draw: no feasible configuration" if top.empty else "no breakdown to draw")
        return s, None
    bars = pd.DataFrame(rows)
    s.figures.append(F.breakdown_figure(bars))
    pngs.append(_png(F.breakdown_png(bars), out, s.key))
    return s, best_est


def _timeline_section(search: Search, est: Any, out: Path, pngs: list[Path]) -> Section:
    from planner.estimate import memory_timeline
    from planner.report.timeline_plot import timeline_data, timeline_figure, timeline_png

    s = Section("timeline", "The best candidate through one training step",
                "Memory of one GPU after load, through forward (activations rise block by block), backward "
                "(they fall as gradients appear) and the optimizer step.")
    points = memory_timeline(est.model, est.config, est.instance, runtime=est.runtime,
                             model_options=search.definition.get("model_options") or None)
    data = timeline_data(est, points)
    s.figures.append(timeline_figure(data))
    path = out / f"report-{s.key}.png"
    timeline_png(data, str(path))
    pngs.append(path)
    return s


def _throughput_memory_section(search: Search, frame: Any, out: Path, pngs: list[Path]) -> Section:
    s = Section("throughput-memory", "Throughput vs peak memory",
                "Every distinct configuration the search tried; the dashed line is the GPU's memory, beyond "
                "which a step runs out of memory. Infeasible also covers the memory limit and batch constraints.")
    missing = int(frame["mem_peak_device"].isna().sum()) if "mem_peak_device" in frame else len(frame)
    if missing:
        s.notes.append(f"{missing} configuration(s) have no estimate (the GPU or model cannot run them) and "
                       "are not drawn")
    if missing == len(frame):
        return s
    s.figures.append(F.throughput_memory_figure(frame))
    pngs.append(_png(F.throughput_memory_png(frame), out, s.key))
    return s


def _pareto_sections(search: Search, frame: Any, out: Path, pngs: list[Path]) -> list[Section]:
    from planner.search.pareto import throughput_vs_cost, throughput_vs_seq_len
    from planner.search.results import cost_column

    feasible = frame[frame["feasible"].astype(bool) & frame["samples_per_s"].notna()]
    seq = Section("pareto-seq", "Pareto front: throughput vs sequence length",
                  "For each instance type, the fastest feasible configuration at each sequence length; a length "
                  "is dropped from the front when a longer one is at least as fast.")
    cost = Section("pareto-cost", "Pareto front: throughput vs cost across instance types",
                   "Configurations on the front are not beaten by another that is both faster and cheaper.")
    if feasible.empty:
        for s in (seq, cost):
            s.notes.append("no feasible configuration: nothing to draw")
        return [seq, cost]
    seq.figures.append(F.pareto_seq_figure(feasible, throughput_vs_seq_len(frame)))
    pngs.append(_png(F.pareto_seq_png(feasible, throughput_vs_seq_len(frame)), out, seq.key))
    col = cost_column(feasible)
    priced = feasible[feasible[col].notna()] if col in feasible else feasible.iloc[0:0]
    if feasible["instance"].nunique() < 2:
        cost.notes.append("one instance type was searched; search several (--instance A,B) to compare cost")
    if priced.empty:
        cost.notes.append("no prices for the searched instance types: no cost to compare")
        return [seq, cost]
    front = throughput_vs_cost(frame)
    cost.figures.append(F.pareto_cost_figure(priced, front, col))
    pngs.append(_png(F.pareto_cost_png(priced, front, col), out, cost.key))
    return [seq, cost]


def _value_name(search: Search) -> str:
    d = search.definition
    target = d.get("target") or d.get("objective", {}).get("target")
    sized = (d.get("recipe") or {}).get("dataset_size") or d.get("objective", {}).get("dataset_size")
    if target == "cost":
        return "$ per job" if sized else "$ per million samples"
    if target == "time":
        return "hours per job" if sized else "hours per million samples"
    if target == "pareto":
        return "hours per job (first objective)"
    return "samples/s"


def _optuna_sections(search: Search, out: Path, pngs: list[Path]) -> list[Section]:
    import optuna
    from optuna.visualization import matplotlib as omp
    from optuna.visualization import plot_optimization_history, plot_param_importances

    studies = [r.study for r in search.runs]
    name = _value_name(search)
    history = Section("history", "Optuna: optimisation history",
                      f"The objective ({name}) of each trial and the best so far, per instance type's study. "
                      "Optuna draws infeasible trials (over the memory limit or a constraint) in grey.")
    importances = Section("importances", "Optuna: parameter importances",
                          "How much of the objective's variance each searched parameter explains (fANOVA).")
    completed = {r.instance: [t for t in r.trials if t.state == optuna.trial.TrialState.COMPLETE]
                 for r in search.runs}
    finite = [s for s, r in zip(studies, search.runs, strict=True)
              if any(_first(t) is not None and math.isfinite(_first(t)) for t in completed[r.instance])]
    if finite:
        target = _finite_target([t for ts in completed.values() for t in ts])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            history.figures.append(plot_optimization_history(finite, target=target, target_name=name))
            pngs.append(_optuna_png(lambda: omp.plot_optimization_history(finite, target=target, target_name=name),
                                    out, history.key, history))
    else:
        history.notes.append("no completed trial with a finite objective value")
    for run in search.runs:
        if len(completed[run.instance]) < 2:
            importances.notes.append(f"{run.instance}: needs at least 2 completed trials "
                                     f"({len(completed[run.instance])} so far)")
            continue
        target = _finite_target(completed[run.instance])
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                fig = plot_param_importances(run.study, target=target, target_name=name)
        except Exception as exc:  # fANOVA fails in several ways on degenerate studies (constant values, ...)
            importances.notes.append(f"{run.instance}: importances unavailable ({type(exc).__name__}: "
                                     f"{str(exc).splitlines()[0] if str(exc) else 'no detail'})")
            continue
        fig.update_layout(title=f"Parameter importances: {run.instance}")
        for trace in fig.data:  # the parameters by what a person calls them, not batch_size_index
            if getattr(trace, "y", None) is not None:
                names = [str(v) for v in trace.y]
                trace.y = [F.param_label(v) for v in names]
                for attr in ("hovertext", "hovertemplate"):
                    hover = getattr(trace, attr, None)
                    if isinstance(hover, list | tuple):
                        setattr(trace, attr, [str(h).replace(n, F.param_label(n), 1)
                                              for h, n in zip(hover, names, strict=False)])
        importances.figures.append(fig)
        stem = f"{importances.key}-{run.instance.removeprefix('ml.').replace('.', '-').replace(', ', '_').replace(' ', '-')}"
        pngs.append(_optuna_png(lambda s=run.study, t=target: _relabelled(omp.plot_param_importances(
            s, target=t, target_name=name)), out, stem, importances))
    return [history, importances]


def _relabelled(ax: Any) -> Any:
    """Optuna's matplotlib importances with the parameters named as a person calls them."""
    labels = [F.param_label(t.get_text()) for t in ax.get_yticklabels()]
    ax.set_yticks(ax.get_yticks(), labels)
    ax.set_ylabel("parameter")
    return ax


def _finite_target(trials: list[Any]) -> Callable[[Any], float]:
    """The objective with infinite values (a cost search records inf for infeasible trials) replaced by the
    worst finite value, so the charts can draw them."""
    values = [_first(t) for t in trials if _first(t) is not None and math.isfinite(_first(t))]
    worst = max(values) if values else 0.0

    def target(trial: Any) -> float:
        v = _first(trial)
        return float(v) if v is not None and math.isfinite(v) else worst

    return target


def _probes_section(probes: Path, out: Path, pngs: list[Path]) -> Section:
    s = Section("probes", "Predicted vs measured (probe jobs)",
                "Each point is one probe job: the planner's prediction against what CUDA reported; on the dotted "
                "line the prediction is exact.")
    pairs = probe_pairs(probes)
    if pairs is None:
        s.notes.append(f"no probe results to compare ({probes} is absent or has no completed probe); run "
                       "`planner probe` to measure real CUDA memory")
        return s
    for unit, part in pairs.groupby("unit", sort=True):
        stem = f"{s.key}-memory" if unit == "bytes" else f"{s.key}-throughput"
        s.figures.append(F.predicted_measured_figure(part, unit))
        pngs.append(_png(F.predicted_measured_png(part, unit), out, stem))
    return s


def _first(trial: Any) -> float | None:
    """The first objective's value (a pareto search has two; Optuna's `.value` refuses those)."""
    return trial.values[0] if trial.values else None


def _png(fig: Any, out: Path, stem: str) -> Path:
    path = out / f"report-{stem}.png"
    F.save_png(fig, str(path))
    return path


def _optuna_png(draw: Callable[[], Any], out: Path, stem: str, section: Section) -> Path | None:
    """Optuna's own matplotlib version of a chart (experimental API: failures become a note)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ax = draw()
        fig = ax.figure if hasattr(ax, "figure") else ax.flat[0].figure
        fig.set_size_inches(9, 5)
        return _png(fig, out, stem)
    except Exception as exc:  # the PNG is a convenience; the HTML chart is already there
        plt.close("all")
        section.notes.append(f"PNG export failed ({type(exc).__name__}: {exc})")
        return None


# ---------------------------------------------------------------------------------------------- main


def write_report(name: str, storage: str | None = None, *, top: int = 5, results_dir: str | Path = "results",
                 probes: str | Path | None = None, out_dir: str | Path | None = None,
                 estimate_fn: Callable[..., Any] | None = None) -> Report:
    """Write `<out_dir or results_dir/name>/report.html` and the PNGs next to it; return what was written.

    `estimate_fn` (default planner.estimate.estimate) recomputes the top candidates' peak breakdowns."""
    from planner.search.results import top_k, top_k_per_instance, unique_configs

    if top < 1:
        raise PlannerError("--top", top, "a positive integer")
    search = load_search(name, storage, results_dir)
    out = Path(out_dir) if out_dir is not None else Path(results_dir) / name
    from planner.io import writable_dir

    writable_dir(out, "--out-dir" if out_dir is not None else "--results-dir")
    probes = Path(probes) if probes is not None else Path(results_dir) / PROBES_FILE
    frame = search.frame
    if frame.empty:
        raise PlannerError("--study", name, "a search with at least one finished trial (run `planner search`)")
    distinct = unique_configs(frame)
    pngs: list[Path | None] = []
    sections: list[Section] = []

    best = top_k(frame, top, search.direction)
    breakdown, best_est = _breakdown_section(search, best, out, pngs, estimate_fn)
    sections.append(breakdown)
    if best_est is not None:
        sections.append(_timeline_section(search, best_est, out, pngs))
    # Several instance types: the charts draw the top configurations of each type only (37 types × hundreds
    # of points would be unreadable and would bloat the page); the tables and files keep every trial.
    several = frame["instance"].nunique() > 1
    shown = top_k_per_instance(frame, max(top, TOP_PER_TYPE), search.direction) if several else distinct
    sections.append(_throughput_memory_section(search, shown, out, pngs))
    sections += _pareto_sections(search, shown if several else frame, out, pngs)
    sections += _optuna_sections(search, out, pngs)
    sections.append(_probes_section(probes, out, pngs))

    d = search.definition
    feasible = int(frame["feasible"].sum())
    meta = [f"Model <code>{html.escape(str(d.get('model', '?')))}</code> on "
            f"{html.escape(', '.join(r.instance for r in search.runs))}; objective "
            f"<code>{html.escape(str(_target(d)))}</code> ({search.direction}); "
            f"{len(frame)} trials, {len(distinct)} distinct configurations, {feasible} feasible trials.",
            *_price_lines(search),
            f"Storage <code>{html.escape(search.storage)}</code>"]
    path = out / "report.html"
    _write_plotly_js(out)
    _atomic_write(path, _page(f"planner report: {name}", meta, sections))
    return Report(path, [p for p in pngs if p is not None], sections)
