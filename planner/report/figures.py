"""The report's charts, each built twice from the same table: a plotly figure for the HTML page and a
matplotlib figure for the PNG next to it (PNG export needs no browser).

Inputs are the search's trial table (`planner.search.results.trials_frame`: one row per trial, columns
`instance`, `trial`, `feasible`, `reason`, the config, `mem_<term>` bytes, `samples_per_s`, cost) and
the Pareto fronts of `planner.search.pareto`, so every function here is pure: tables in, a figure out.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

GIB = 1024**3

# Okabe-Ito colours (distinguishable with the common colour-vision deficiencies); grey for the runtime band.
CATEGORY_COLORS: dict[str, str] = {
    "parameters": "#0072B2",
    "gradients": "#E69F00",
    "optimizer_states": "#009E73",
    "activations": "#D55E00",
    "batch": "#56B4E9",
    "buffers": "#CC79A7",
    "runtime": "#8C8C8C",
}
CATEGORY_LABELS: dict[str, str] = {
    "parameters": "parameters",
    "gradients": "gradients",
    "optimizer_states": "optimizer states",
    "activations": "activations",
    "batch": "input batch",
    "buffers": "temporaries and buffers",  # DDP buckets, workspaces, casts; JSON key `buffers`
    "runtime": "runtime: CUDA context + NCCL + allocator reserve",
}
PHASE_COLORS: dict[str, str] = {"load": "#eeeeee", "forward": "#e3eefa", "backward": "#fbe9dc",
                                "optimizer": "#e4f4ea"}
OOM_COLOR = "#b00020"
FEASIBLE_COLORS = {True: "#009E73", False: "#D55E00"}
INSTANCE_PALETTE = ("#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#000000", "#999933")
# Bottom to top in every stacked chart.
PLOTLY_SYMBOLS = ("circle", "square", "diamond", "triangle-up", "triangle-down", "pentagon", "star", "hexagon")
MPL_MARKERS = ("o", "s", "D", "^", "v", "p", "*", "h")
STACK = ("parameters", "gradients", "optimizer_states", "activations", "batch", "buffers", "runtime")


# ------------------------------------------------------------------------------------------ labels


def candidate_label(row: Any, with_instance: bool) -> str:
    """'#12 b16×s512 amp-fp16 ckpt ga2' (+ the instance type when several were searched)."""
    parts = [f"#{int(row['trial'])}"]
    if with_instance:
        parts.append(str(row["instance"]).removeprefix("ml."))
    parts.append(f"b{int(row['batch_size'])}×s{int(row['seq_len'])}")
    parts.append(str(row["precision"]))
    if bool(row.get("checkpointing")):
        parts.append("ckpt")
    grad_accum = row.get("grad_accum")
    if grad_accum is not None and grad_accum == grad_accum and int(grad_accum) > 1:
        parts.append(f"ga{int(grad_accum)}")
    return " ".join(parts)


def several_instances(frame: Any) -> bool:
    return frame["instance"].nunique() > 1


def _family_and_size(instance: str) -> tuple[str, int]:
    """(GPU family, GPUs per instance) of an instance type; unknown names keep their own name."""
    from planner.errors import PlannerError
    from planner.hardware import get_instance

    try:
        inst = get_instance(instance)
    except PlannerError:
        return instance, 1
    return inst.gpu.family, inst.gpus


def instance_markers(instances: Sequence[str], markers: Sequence[str]) -> dict[str, str]:
    """One marker per size (GPUs per instance), so 37 types need as many markers as there are GPU counts."""
    sizes = {inst: _family_and_size(inst)[1] for inst in set(instances)}
    order = sorted(set(sizes.values()))
    return {inst: markers[order.index(n) % len(markers)] for inst, n in sizes.items()}


def instance_colors(instances: Sequence[str]) -> dict[str, str]:
    """One colour per GPU family (V100, A10G, A100, ...): instance types of one family share it."""
    fams = {inst: _family_and_size(inst)[0] for inst in set(instances)}
    order = sorted(set(fams.values()))
    return {inst: INSTANCE_PALETTE[order.index(f) % len(INSTANCE_PALETTE)] for inst, f in fams.items()}


def family_of(instance: str) -> str:
    return _family_and_size(instance)[0]


def gpus_of(instance: str) -> int:
    return _family_and_size(instance)[1]


def cost_label(column: str) -> str:
    return {"usd_per_job": "$ per job", "usd_per_epoch": "$ per epoch"}.get(column, "$ per million samples")


# What a person calls each searched parameter (the search samples numeric ones as an index: batch_size_index).
PARAM_LABELS = {"batch_size": "micro-batch", "seq_len": "sequence length", "grad_accum": "accumulation",
                "instances": "instances per job", "instance": "instance type", "optimizer_impl": "optimizer kernel",
                "lora_r": "LoRA rank", "lora_targets": "LoRA targets", "base_dtype": "base dtype"}


def param_label(name: str) -> str:
    """`batch_size_index` -> "micro-batch"; a name without a label keeps its words."""
    from planner.search.space import INDEX_SUFFIX

    base = name.removesuffix(INDEX_SUFFIX)
    return PARAM_LABELS.get(base, base.replace("_", " "))


def log_ticks(low: float, high: float) -> list[float]:
    """1-2-5 ticks covering [low, high] on a log axis: labelled ticks a person reads ("$0.5, $1, $2"), where
    the plotting libraries label minor ticks "3 4 5 ... 100 2" or write 4×10⁻¹."""
    import math

    if not (low > 0 and high > 0 and math.isfinite(low) and math.isfinite(high)):
        return []
    ticks = []
    for exp in range(math.floor(math.log10(low)) - 1, math.ceil(math.log10(high)) + 1):
        for m in (1, 2, 5):
            t = m * 10.0**exp
            if low / 1.05 <= t <= high * 1.05:
                ticks.append(t)
    if len(ticks) < 2:  # a narrow range: its ends
        ticks = sorted({low, high})
    return ticks


def tick_text(value: float, money: bool = False) -> str:
    text = f"{value:,.0f}" if value >= 10 else f"{value:g}"
    return f"${text}" if money else text


def oom_label_sides(gpus: list[float]) -> list[str]:
    """"top" or "bottom" for each OOM line (sorted by size): a line close to the previous one (within 8% of the
    largest) puts its label at the other end, so the labels of near sizes (22 and 24 GiB) do not overlap."""
    sides: list[str] = []
    span = max(gpus) if gpus else 1.0
    for i, gpu in enumerate(gpus):
        near = i > 0 and gpu - gpus[i - 1] < 0.08 * span
        sides.append(("bottom" if sides[-1] == "top" else "top") if near else "top")
    return sides


def oom_lines(frame: Any) -> list[tuple[str, float]]:
    """(instance types, GPU memory bytes) for each distinct GPU memory size in the table."""
    seen: dict[float, list[str]] = {}
    cols = frame[["instance", "mem_gpu_memory"]].dropna().drop_duplicates()
    for inst, gpu in cols.itertuples(index=False):
        seen.setdefault(float(gpu), []).append(str(inst).removeprefix("ml."))
    return [(", ".join(sorted(names)), gpu) for gpu, names in sorted(seen.items())]


def _measured(frame: Any) -> Any:
    """Trials with a memory estimate (unsupported combinations have none)."""
    return frame[frame["mem_peak_device"].notna()] if "mem_peak_device" in frame else frame.iloc[0:0]


# ---------------------------------------------------------------------------------------------- plotly


def breakdown_figure(bars: Any) -> Any:
    """Stacked bars: where each candidate's peak memory goes (columns STACK, bytes), its GPU as a marker."""
    import plotly.graph_objects as go

    fig = go.Figure()
    for c in STACK:
        fig.add_trace(go.Bar(x=bars["label"], y=bars[c] / GIB, name=CATEGORY_LABELS[c],
                             marker_color=CATEGORY_COLORS[c],
                             hovertemplate="%{x}<br>" + CATEGORY_LABELS[c] + ": %{y:.2f} GiB<extra></extra>"))
    fig.add_trace(go.Scatter(x=bars["label"], y=bars["gpu_memory"] / GIB, mode="markers", name="GPU memory (OOM)",
                             marker={"symbol": "line-ew-open", "size": 44, "color": OOM_COLOR,
                                     "line": {"width": 3, "color": OOM_COLOR}},
                             hovertemplate="%{x}<br>GPU memory %{y:.2f} GiB<extra></extra>"))
    fig.update_layout(barmode="stack", title="Peak memory of one GPU: the top candidates side by side",
                      yaxis_title="GiB at the peak", template="plotly_white", height=540,
                      xaxis={"tickangle": -25}, margin={"b": 140})
    return fig


def throughput_memory_figure(frame: Any) -> Any:
    """Every configuration: samples/s against peak memory, coloured feasible or not, one marker shape per
    instance type; the OOM line at each GPU size."""
    import plotly.graph_objects as go

    data = _measured(frame)
    with_instance = several_instances(frame)
    symbols = instance_markers(data["instance"].tolist(), PLOTLY_SYMBOLS)
    fig = go.Figure()
    if with_instance:
        return _by_family(fig, data, "mem_peak_device", GIB, symbols, frame)
    for inst in sorted(data["instance"].unique()):
        for ok in (True, False):
            part = data[(data["instance"] == inst) & (data["feasible"].astype(bool) == ok)]
            if part.empty:
                continue
            text = [candidate_label(r, with_instance) + (f"<br>{r['reason']}" if r["reason"] else "")
                    for _, r in part.iterrows()]
            what = "feasible" if ok else "infeasible"
            fig.add_trace(go.Scatter(
                x=part["mem_peak_device"] / GIB, y=part["samples_per_s"], mode="markers", text=text,
                name=f"{inst}: {what}" if with_instance else what,
                marker={"color": FEASIBLE_COLORS[ok], "size": 9, "opacity": 0.8, "symbol": symbols[inst],
                        "line": {"width": 0.5, "color": "white"}},
                hovertemplate="%{text}<br>peak %{x:.2f} GiB, %{y:.1f} samples/s<extra></extra>"))
    lines = oom_lines(frame)
    for (names, gpu), side in zip(lines, oom_label_sides([g for _, g in lines]), strict=True):
        # Vertical text along each line, at alternate ends for nearby GPU sizes: labels cannot overlap.
        fig.add_vline(x=gpu / GIB, line={"color": OOM_COLOR, "dash": "dash", "width": 2},
                      annotation_text=f"OOM: {names} ({gpu / GIB:.1f} GiB)", annotation_position=f"{side} left",
                      annotation_textangle=-90, annotation_font_color=OOM_COLOR)
    fig.update_layout(title="Throughput vs peak memory of one GPU (infeasible: over the memory limit or a "
                            "constraint)", xaxis_title="peak memory of one GPU (GiB)",
                      yaxis_title="samples/s (whole job)", template="plotly_white", height=500)
    return fig


def _by_family(fig: Any, data: Any, x: str, scale: float, symbols: dict[str, str], frame: Any) -> Any:
    """Several instance types: one colour per GPU family (one legend entry each), one marker per size, the
    feasible configurations only (the caller passes the top ones of each type); the OOM lines stay."""
    import plotly.graph_objects as go

    data = data[data["feasible"].astype(bool)]
    colors = instance_colors(data["instance"].tolist())
    for fam in sorted({family_of(i) for i in data["instance"].unique()}):
        part = data[[family_of(i) == fam for i in data["instance"]]]
        text = [candidate_label(r, True) for _, r in part.iterrows()]
        fig.add_trace(go.Scatter(
            x=part[x] / scale, y=part["samples_per_s"], mode="markers", text=text, name=fam, legendgroup=fam,
            marker={"color": [colors[i] for i in part["instance"]], "size": 9, "opacity": 0.85,
                    "symbol": [symbols[i] for i in part["instance"]], "line": {"width": 0.5, "color": "white"}},
            hovertemplate="%{text}<br>peak %{x:.2f} GiB, %{y:.1f} samples/s<extra></extra>"))
    lines = oom_lines(frame)
    for (_names, gpu), side in zip(lines, oom_label_sides([g for _, g in lines]), strict=True):
        fig.add_vline(x=gpu / GIB, line={"color": OOM_COLOR, "dash": "dash", "width": 1},
                      annotation_text=f"OOM {gpu / GIB:.0f} GiB", annotation_position=f"{side} left",
                      annotation_textangle=-90, annotation_font_color=OOM_COLOR)
    sizes = sorted({gpus_of(i) for i in data["instance"].unique()})
    fig.update_layout(title="Throughput vs peak memory: the best configurations of each instance type (colour: "
                            "GPU family; marker: GPUs per instance " + ", ".join(map(str, sizes)) + ")",
                      xaxis_title="peak memory of one GPU (GiB)", yaxis_title="samples/s (whole job)",
                      template="plotly_white", height=520, yaxis=_log_axis(data["samples_per_s"]))
    return fig


def _log_axis(values: Any, money: bool = False) -> dict[str, Any]:
    """A plotly log axis with 1-2-5 ticks only (`log_ticks`)."""
    ticks = log_ticks(float(values.min()), float(values.max())) if len(values) else []
    axis: dict[str, Any] = {"type": "log"}
    if ticks:
        axis |= {"tickvals": ticks, "ticktext": [tick_text(t, money) for t in ticks]}
    return axis


def _mpl_log_axis(axis: Any, values: Any, money: bool = False) -> None:
    """A matplotlib log axis with the same 1-2-5 ticks and no minor labels."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter

    ticks = log_ticks(float(values.min()), float(values.max())) if len(values) else []
    if ticks:
        axis.set_major_locator(FixedLocator(ticks))
        axis.set_major_formatter(FuncFormatter(lambda v, _pos: tick_text(v, money)))
    axis.set_minor_formatter(NullFormatter())


def _front_traces(feasible: Any, front: Any, x: str, per_instance: bool) -> list[Any]:
    """Faint points for every feasible configuration, coloured by instance type, and the front on top:
    one line per instance type (`per_instance`) or one line across all of them."""
    import plotly.graph_objects as go

    colors = instance_colors(feasible["instance"].tolist())
    with_instance = several_instances(feasible)
    hover = "%{text}<br>%{x}, %{y:.1f} samples/s<extra></extra>"
    traces = []
    symbols = instance_markers(feasible["instance"].tolist(), PLOTLY_SYMBOLS)
    for fam in sorted({family_of(i) for i in feasible["instance"].unique()}):
        part = feasible[[family_of(i) == fam for i in feasible["instance"]]]
        traces.append(go.Scatter(
            x=part[x], y=part["samples_per_s"], mode="markers", name=f"{fam}: feasible", legendgroup=fam,
            marker={"color": [colors[i] for i in part["instance"]], "size": 7, "opacity": 0.35,
                    "symbol": [symbols[i] for i in part["instance"]]},
            text=[candidate_label(r, with_instance) for _, r in part.iterrows()], hovertemplate=hover))
    if per_instance and several_instances(feasible):  # one front line per type would be a legend per type
        per_instance = False
    groups = [(f"{inst}: Pareto front", front[front["instance"] == inst], colors.get(inst, "#000000"))
              for inst in sorted(front["instance"].unique())] if per_instance else [("Pareto front", front, "#000000")]
    for name, part, color in groups:
        part = part.sort_values(x)
        traces.append(go.Scatter(
            x=part[x], y=part["samples_per_s"], mode="lines+markers", name=name,
            line={"color": color, "width": 2},
            marker={"color": [colors.get(i, "#000000") for i in part["instance"]], "size": 11,
                    "line": {"color": "black", "width": 1}},
            text=[candidate_label(r, with_instance) for _, r in part.iterrows()], hovertemplate=hover))
    return traces


def pareto_seq_figure(feasible: Any, front: Any) -> Any:
    """Per instance type: the fastest configuration at each sequence length (longer and faster is better)."""
    import plotly.graph_objects as go

    fig = go.Figure(_front_traces(feasible, front, "seq_len", per_instance=True))
    ticks = sorted(int(v) for v in feasible["seq_len"].unique())
    fig.update_layout(title="Pareto front: throughput vs sequence length", xaxis_title="sequence length (tokens)",
                      yaxis_title="samples/s (whole job)", template="plotly_white", height=480,
                      xaxis={"type": "log", "tickvals": ticks, "ticktext": [str(t) for t in ticks]})
    return fig


def pareto_cost_figure(feasible: Any, front: Any, cost: str) -> Any:
    """Over instance types: no configuration on the front is beaten by one both faster and cheaper."""
    import plotly.graph_objects as go

    fig = go.Figure(_front_traces(feasible, front, cost, per_instance=False))
    fig.update_layout(title=f"Pareto front: throughput vs {cost_label(cost)} across instance types (colour: GPU "
                            "family; marker: GPUs per instance)",
                      xaxis_title=f"{cost_label(cost)} (log)", yaxis_title="samples/s (whole job)",
                      template="plotly_white", height=500, xaxis=_log_axis(feasible[cost], money=True),
                      yaxis=_log_axis(feasible["samples_per_s"]))
    return fig


def _unit(unit: str) -> tuple[float, str, str]:
    """(divisor, axis unit, what) for the predicted-vs-measured charts."""
    return (GIB, "GiB", "memory") if unit == "bytes" else (1.0, unit, "throughput")


def predicted_measured_figure(pairs: Any, unit: str = "bytes") -> Any:
    """Predicted against measured (columns quantity, label, predicted, measured), with the y = x line."""
    import plotly.graph_objects as go

    div, axis, what = _unit(unit)
    fig = go.Figure()
    for quantity, part in pairs.groupby("quantity", sort=True):
        fig.add_trace(go.Scatter(x=part["measured"] / div, y=part["predicted"] / div, mode="markers",
                                 name=str(quantity), text=part["label"], marker={"size": 10},
                                 hovertemplate="%{text}<br>measured %{x:.3f}<br>predicted %{y:.3f}<extra></extra>"))
    hi = float(max(pairs["measured"].max(), pairs["predicted"].max())) / div * 1.05
    fig.add_trace(go.Scatter(x=[0, hi], y=[0, hi], mode="lines", name="y = x (exact)",
                             line={"color": "#888888", "dash": "dot"}))
    fig.update_layout(title=f"Predicted vs measured {what} (probe jobs)", xaxis_title=f"measured ({axis})",
                      yaxis_title=f"predicted ({axis})", template="plotly_white", height=520)
    return fig


# ------------------------------------------------------------------------------------------ matplotlib


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_png(fig: Any, path: str, dpi: int = 100) -> None:
    """Write and close (figures left open leak memory in long runs)."""
    plt = _plt()
    try:
        from planner.io import atomic_path

        fig.tight_layout()
        with atomic_path(path, "--out-dir") as tmp:
            fig.savefig(tmp, dpi=dpi, bbox_inches="tight", pad_inches=0.15)  # keeps outside legends and labels
    finally:
        plt.close(fig)


def breakdown_png(bars: Any) -> Any:
    plt = _plt()
    n = len(bars)
    fig, ax = plt.subplots(figsize=(max(8.0, 1.2 * n + 5), 5.6))
    x = list(range(n))
    bottom = [0.0] * n
    for c in STACK:
        vals = (bars[c] / GIB).tolist()
        ax.bar(x, vals, bottom=bottom, color=CATEGORY_COLORS[c], label=CATEGORY_LABELS[c], width=0.62,
               hatch="///" if c == "runtime" else None, edgecolor="white", linewidth=0.4)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax.hlines((bars["gpu_memory"] / GIB).tolist(), [i - 0.4 for i in x], [i + 0.4 for i in x], colors=OOM_COLOR,
              linewidths=2.5, label="GPU memory (OOM)", zorder=5)
    ax.set_xlim(-0.6, n - 0.4)
    ax.set_xticks(x)
    ax.set_xticklabels(bars["label"].tolist(), rotation=25, ha="right", fontsize=8)
    ax.set_ylabel("GiB at the peak")
    ax.set_title("Peak memory of one GPU: the top candidates side by side", fontsize=11)
    handles, names = ax.get_legend_handles_labels()
    ax.legend(handles[::-1], names[::-1], fontsize=7.5, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(axis="y", color="#dddddd")
    ax.set_axisbelow(True)
    return fig


def throughput_memory_png(frame: Any) -> Any:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(9, 5.5))
    data = _measured(frame)
    with_instance = several_instances(frame)
    markers = instance_markers(data["instance"].tolist(), MPL_MARKERS)
    if with_instance:
        data = data[data["feasible"].astype(bool)]
        colors = instance_colors(data["instance"].tolist())
        seen: set[str] = set()
        for inst in sorted(data["instance"].unique()):
            part = data[data["instance"] == inst]
            fam = family_of(inst)
            ax.scatter(part["mem_peak_device"] / GIB, part["samples_per_s"], color=colors[inst],
                       marker=markers[inst], alpha=0.85, edgecolors="white", linewidths=0.5,
                       label=fam if fam not in seen else None)
            seen.add(fam)
        ax.set_yscale("log")
    for inst in sorted(data["instance"].unique()) if not with_instance else ():
        for ok in (True, False):
            part = data[(data["instance"] == inst) & (data["feasible"].astype(bool) == ok)]
            if not part.empty:
                what = "feasible" if ok else "infeasible"
                ax.scatter(part["mem_peak_device"] / GIB, part["samples_per_s"], color=FEASIBLE_COLORS[ok],
                           marker=markers[inst], alpha=0.8, edgecolors="white", linewidths=0.5,
                           label=f"{inst}: {what}" if with_instance else what)
    if with_instance and len(data):
        _mpl_log_axis(ax.yaxis, data["samples_per_s"])
    ymin, ymax = ax.get_ylim()
    lines = oom_lines(frame)
    for (names, gpu), side in zip(lines, oom_label_sides([g for _, g in lines]), strict=True):
        ax.axvline(gpu / GIB, color=OOM_COLOR, linestyle="--", linewidth=1.4)
        label = f"OOM {gpu / GIB:.0f} GiB " if with_instance else f"OOM: {names} ({gpu / GIB:.1f} GiB) "
        ax.text(gpu / GIB, ymax if side == "top" else ymin, f" {label}" if side == "bottom" else label,
                color=OOM_COLOR, fontsize=8, va=side, ha="right", rotation=90)
    ax.set_xlabel("peak memory of one GPU (GiB)")
    ax.set_ylabel("samples/s (whole job)")
    ax.set_title("Throughput vs peak memory of one GPU" + (" (best of each type; colour: GPU family, marker: "
                                                           "GPUs per instance)" if with_instance else ""), fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(color="#eeeeee")
    return fig


def _front_png(ax: Any, feasible: Any, front: Any, x: str, per_instance: bool) -> None:
    colors = instance_colors(feasible["instance"].tolist())
    markers = instance_markers(feasible["instance"].tolist(), MPL_MARKERS)
    seen: set[str] = set()
    for inst in sorted(feasible["instance"].unique()):
        part = feasible[feasible["instance"] == inst]
        fam = family_of(inst)
        ax.scatter(part[x], part["samples_per_s"], color=colors[inst], marker=markers[inst], alpha=0.35, s=16,
                   label=fam if not per_instance and fam not in seen else None)
        seen.add(fam)
    if per_instance and several_instances(feasible):
        per_instance = False
    if per_instance:
        for inst in sorted(front["instance"].unique()):
            part = front[front["instance"] == inst].sort_values(x)
            ax.plot(part[x], part["samples_per_s"], color=colors.get(inst, "#000000"), marker="o",
                    markeredgecolor="black", label=f"{inst}: Pareto front")
    else:
        part = front.sort_values(x)
        ax.plot(part[x], part["samples_per_s"], color="black", linewidth=1.5, label="Pareto front", zorder=3)
        ax.scatter(part[x], part["samples_per_s"], c=[colors.get(i, "#000000") for i in part["instance"]], s=60,
                   edgecolors="black", zorder=4)
    ax.set_ylabel("samples/s (whole job)")
    ax.legend(fontsize=8)
    ax.grid(color="#eeeeee")


def pareto_seq_png(feasible: Any, front: Any) -> Any:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(9, 5))
    _front_png(ax, feasible, front, "seq_len", per_instance=True)
    ax.set_xscale("log", base=2)
    ticks = sorted(int(v) for v in feasible["seq_len"].unique())
    ax.set_xticks(ticks)
    ax.set_xticklabels([str(t) for t in ticks])
    ax.minorticks_off()
    ax.set_xlabel("sequence length (tokens)")
    ax.set_title("Pareto front: throughput vs sequence length", fontsize=11)
    return fig


def pareto_cost_png(feasible: Any, front: Any, cost: str) -> Any:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(9, 5))
    _front_png(ax, feasible, front, cost, per_instance=False)
    ax.set_xscale("log")
    ax.set_yscale("log")
    _mpl_log_axis(ax.xaxis, feasible[cost], money=True)
    _mpl_log_axis(ax.yaxis, feasible["samples_per_s"])
    ax.set_xlabel(f"{cost_label(cost)} (log)")
    ax.set_title(f"Pareto front: throughput vs {cost_label(cost)} (colour: GPU family; marker: GPUs/instance)",
                 fontsize=10)
    return fig


def predicted_measured_png(pairs: Any, unit: str = "bytes") -> Any:
    plt = _plt()
    div, axis, what = _unit(unit)
    fig, ax = plt.subplots(figsize=(6.8, 6))
    for quantity, part in pairs.groupby("quantity", sort=True):
        ax.scatter(part["measured"] / div, part["predicted"] / div, label=str(quantity))
    hi = float(max(pairs["measured"].max(), pairs["predicted"].max())) / div * 1.05
    ax.plot([0, hi], [0, hi], color="#888888", linestyle=":", label="y = x (exact)")
    ax.set_xlabel(f"measured ({axis})")
    ax.set_ylabel(f"predicted ({axis})")
    ax.set_title(f"Predicted vs measured {what} (probe jobs)", fontsize=11)
    ax.legend(fontsize=8)
    ax.grid(color="#eeeeee")
    return fig
