"""`planner estimate --plot FILE`: the memory of one GPU through one training step, as a picture.

The numbers come from `planner.estimate.memory_timeline` (allocated bytes by category at each block of
the step); this module only adds what the device shows on top of the allocator's tensors and draws it.

Top band ("runtime") at each point, so that its top at the peak is exactly `est.memory_bytes.peak_device`:

    runtime = cuda_context + nccl + (int(allocated * (1 + fragmentation)) - allocated)

with fragmentation = peak_reserved / peak_allocated - 1 of the estimate (the allocator replay's, or a given one)

i.e. the CUDA context and NCCL buffers (outside the caching allocator) plus the allocator's reserve
(reserved - allocated) scaled from the estimate's fragmentation ratio.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from planner.errors import PlannerError
from planner.memory.timeline import CATEGORIES, Point
from planner.report.figures import CATEGORY_COLORS, CATEGORY_LABELS, GIB, OOM_COLOR, PHASE_COLORS
from planner.spec import Estimate
from planner.units import fmt_bytes

RUNTIME = "runtime"
SERIES = (*CATEGORIES, RUNTIME)
FORMATS = (".png", ".html")


@dataclass(frozen=True)
class TimelineData:
    """The drawn series: bytes per point for each category and the runtime band, plus the markers."""

    labels: tuple[str, ...]  # block name (or "after load", "optimizer step") per point
    phases: tuple[str, ...]  # phase per point
    series: dict[str, tuple[int, ...]]  # SERIES -> bytes per point
    peak_index: int
    gpu_memory_bytes: int
    title: str
    subtitle: str
    fits: bool

    @property
    def totals(self) -> tuple[int, ...]:
        """Top of the stack at each point: what the whole GPU would show."""
        return tuple(sum(self.series[s][i] for s in SERIES) for i in range(len(self.labels)))

    def phase_spans(self) -> list[tuple[str, int, int]]:
        """(phase, first index, last index) for each run of consecutive points in one phase."""
        spans: list[tuple[str, int, int]] = []
        for i, ph in enumerate(self.phases):
            if spans and spans[-1][0] == ph:
                spans[-1] = (ph, spans[-1][1], i)
            else:
                spans.append((ph, i, i))
        return spans

    def peak_text(self) -> str:
        i = self.peak_index
        return f"peak {fmt_bytes(self.totals[i])} ({self.phases[i]}, {self.labels[i]})"


def timeline_data(est: Estimate, points: list[Point]) -> TimelineData:
    """Pure: the estimate's runtime terms added on top of the allocator's points."""
    if not points:
        raise PlannerError("timeline", "no points", "a model with at least one block")
    m = est.memory_bytes
    frag = m.peak_reserved / m.peak_allocated - 1 if m.peak_allocated else est.runtime.fragmentation
    series: dict[str, list[int]] = {s: [] for s in SERIES}
    for p in points:
        for c in CATEGORIES:
            series[c].append(int(p.bytes.get(c, 0)))
        allocated = p.total
        series[RUNTIME].append(m.cuda_context + m.nccl + int(allocated * (1 + frag)) - allocated)
    totals = [sum(series[s][i] for s in SERIES) for i in range(len(points))]
    peak_index = max(range(len(points)), key=totals.__getitem__)
    cfg = est.config
    title = (f"{est.model} on {est.instance} ({est.gpu}): micro-batch {cfg.batch_size} × seq {cfg.seq_len}, "
             f"{cfg.precision}, {cfg.optimizer}, {cfg.parallelism} × {est.world_size}"
             + (", checkpointing" if cfg.checkpointing else "")
             + (f", grad-accum {cfg.grad_accum}" if cfg.grad_accum > 1 else ""))
    verdict = (f"fits, headroom {fmt_bytes(est.headroom_bytes)}" if est.fits
               else f"OOM by {fmt_bytes(-est.headroom_bytes)}")
    subtitle = f"One training step on one GPU: peak {fmt_bytes(totals[peak_index])} of " \
               f"{fmt_bytes(est.gpu_memory_bytes)}: {verdict}"
    return TimelineData(
        labels=tuple(p.label for p in points),
        phases=tuple(p.phase for p in points),
        series={s: tuple(v) for s, v in series.items()},
        peak_index=peak_index,
        gpu_memory_bytes=est.gpu_memory_bytes,
        title=title,
        subtitle=subtitle,
        fits=est.fits,
    )


def write_timeline(est: Estimate, path: str, model_options: dict | None = None) -> None:
    """Recompute the estimate's step point by point and write it to `path` (.png or .html)."""
    from planner.estimate import memory_timeline

    suffix = Path(path).suffix.lower()
    if suffix not in FORMATS:
        raise PlannerError("--plot", path, "a file name ending in .png or .html")
    points = memory_timeline(est.model, est.config, est.instance, runtime=est.runtime,
                             model_options=model_options)
    data = timeline_data(est, points)
    from planner.io import atomic_path

    with atomic_path(path, "--plot") as tmp:  # a failure leaves no half-written file
        if suffix == ".png":
            timeline_png(data, str(tmp))
        else:
            timeline_figure(data).write_html(str(tmp), include_plotlyjs=True, full_html=True)


def _short(label: str) -> str:
    """'TextBertBase.layer.11' -> 'TextBertBase.L11' so that rotated ticks stay readable."""
    return label.replace(".layer.", ".L").replace(".batchnorm", ".bn")


def _tick_indices(data: TimelineData, max_ticks: int = 48) -> list[int]:
    n = len(data.labels)
    step = max(1, -(-n // max_ticks))
    return list(range(0, n, step))


# ---------------------------------------------------------------------------------------------- PNG


def timeline_png(data: TimelineData, path: str, *, dpi: int = 110) -> None:
    """Stacked areas with matplotlib (Agg: no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(data.labels)
    x = list(range(n))
    fig, ax = plt.subplots(figsize=(12, 6.2), dpi=dpi)
    try:
        _draw_png(ax, data, x)
        fig.suptitle(data.title, fontsize=10.5, fontweight="bold", x=0.01, ha="left")
        ax.set_title(data.subtitle, fontsize=9.5, loc="left", color=OOM_COLOR if not data.fits else "#333333")
        fig.tight_layout()
        fig.savefig(path, dpi=dpi)
    finally:
        plt.close(fig)


def _draw_png(ax: Any, data: TimelineData, x: list[int]) -> None:
    ys = [[v / GIB for v in data.series[s]] for s in SERIES]
    labels = [CATEGORY_LABELS[s] for s in SERIES]
    colors = [CATEGORY_COLORS[s] for s in SERIES]
    polys = ax.stackplot(x, *ys, labels=labels, colors=colors, step="mid", linewidth=0.3, edgecolor="white",
                         alpha=0.95)
    polys[-1].set_hatch("///")
    polys[-1].set_alpha(0.55)
    totals = [t / GIB for t in data.totals]
    gpu = data.gpu_memory_bytes / GIB
    top = max(max(totals), gpu) * 1.16

    for phase, lo, hi in data.phase_spans():
        ax.axvspan(lo - 0.5, hi + 0.5, color=PHASE_COLORS[phase], alpha=0.35, zorder=0, linewidth=0)
        narrow = hi - lo + 1 < max(4, len(x) // 12)  # one-point phases (load, optimizer): vertical label
        ax.text((lo + hi) / 2, top * 0.985, phase, ha="center", va="top", fontsize=8.5 if narrow else 9.5,
                color="#444444", fontweight="bold", rotation=90 if narrow else 0)
        if lo > 0:
            ax.axvline(lo - 0.5, color="#888888", linewidth=0.6, linestyle=":", zorder=1)

    ax.axhline(gpu, color=OOM_COLOR, linewidth=1.6, linestyle="--", zorder=4)
    # Right-aligned before the last point, clear of the optimizer phase's vertical label.
    ax.text(len(x) - 1.6, gpu, f"GPU memory {gpu:.2f} GiB", ha="right", va="bottom", fontsize=8.5,
            color=OOM_COLOR, zorder=5, bbox={"boxstyle": "square,pad=0.15", "fc": "white", "ec": "none",
                                             "alpha": 0.85})

    i = data.peak_index
    peak = totals[i]
    ax.plot([i], [peak], marker="v", color="black", markersize=7, zorder=6)
    text_x = i - len(x) * 0.12 if i > len(x) * 0.55 else i + len(x) * 0.08
    # The label sits between the peak and the GPU line when there is room, else above both (clear of the line).
    roof = max(peak, gpu)
    text_y = peak + (gpu - peak) * 0.45 if peak < 0.75 * gpu else roof + (top - roof) * 0.35
    ax.annotate(data.peak_text(), xy=(i, peak), xytext=(text_x, text_y),
                fontsize=9, ha="center", arrowprops={"arrowstyle": "->", "color": "black", "linewidth": 0.9},
                bbox={"boxstyle": "round,pad=0.25", "fc": "white", "ec": "#888888", "linewidth": 0.6}, zorder=7)

    ticks = _tick_indices(data)
    ax.set_xticks(ticks)
    ax.set_xticklabels([_short(data.labels[t]) for t in ticks], rotation=90, fontsize=6.5)
    ax.set_xlim(-0.5, len(x) - 0.5)
    ax.set_ylim(0, top)
    ax.set_ylabel("GiB on one GPU")
    ax.grid(axis="y", color="#dddddd", linewidth=0.6)
    ax.set_axisbelow(True)
    handles, names = ax.get_legend_handles_labels()
    ax.legend(handles[::-1], names[::-1], loc="upper left", fontsize=8, framealpha=0.92,
              bbox_to_anchor=(1.005, 1.0), borderaxespad=0)


# --------------------------------------------------------------------------------------------- HTML


def timeline_figure(data: TimelineData) -> Any:
    """The same picture as an interactive plotly figure (hover shows the block and each category)."""
    import plotly.graph_objects as go

    n = len(data.labels)
    x = list(range(n))
    fig = go.Figure()
    for s in SERIES:
        ys = [v / GIB for v in data.series[s]]
        fig.add_trace(go.Scatter(
            x=x, y=ys, name=CATEGORY_LABELS[s], stackgroup="memory", mode="lines",
            line={"width": 0.5, "color": CATEGORY_COLORS[s], "shape": "hvh"},
            fillcolor=CATEGORY_COLORS[s], opacity=0.9,
            customdata=[[lab, ph] for lab, ph in zip(data.labels, data.phases, strict=True)],
            hovertemplate="%{customdata[1]} · %{customdata[0]}<br>" + CATEGORY_LABELS[s]
            + ": %{y:.3f} GiB<extra></extra>",
        ))
    totals = [t / GIB for t in data.totals]
    gpu = data.gpu_memory_bytes / GIB
    top = max(max(totals), gpu) * 1.16
    for phase, lo, hi in data.phase_spans():
        fig.add_vrect(x0=lo - 0.5, x1=hi + 0.5, fillcolor=PHASE_COLORS[phase], opacity=0.35, layer="below",
                      line_width=0, annotation_text=f"<b>{phase}</b>", annotation_position="top")
    fig.add_hline(y=gpu, line={"color": OOM_COLOR, "dash": "dash", "width": 2},
                  annotation_text=f"GPU memory {gpu:.2f} GiB", annotation_position="bottom right",
                  annotation_font_color=OOM_COLOR)
    i = data.peak_index
    fig.add_trace(go.Scatter(x=[i], y=[totals[i]], mode="markers", name="peak", showlegend=False,
                             marker={"symbol": "triangle-down", "size": 11, "color": "black"},
                             hovertemplate=data.peak_text() + "<extra></extra>"))
    fig.add_annotation(x=i, y=totals[i], text=data.peak_text(), showarrow=True, arrowhead=2, ax=0,
                       ay=-40, bgcolor="white", bordercolor="#888888")
    ticks = _tick_indices(data)
    fig.update_layout(
        title={"text": f"{data.title}<br><sup>{data.subtitle}</sup>", "x": 0.01, "font": {"size": 14}},
        xaxis={"tickmode": "array", "tickvals": ticks, "ticktext": [_short(data.labels[t]) for t in ticks],
               "tickangle": -90, "range": [-0.5, n - 0.5], "tickfont": {"size": 9}},
        yaxis={"title": "GiB on one GPU", "range": [0, top]},
        legend={"traceorder": "reversed"},
        template="plotly_white", height=620, margin={"t": 90, "b": 150},
        hovermode="closest",
    )
    return fig
