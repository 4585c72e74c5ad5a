"""`planner estimate --plot FILE.png`: the drawn series agree with the estimate, and the PNG is a real chart.

The browser check of the HTML variant is in test_report_html.py (it shares the headless-Chromium helper).
"""

from __future__ import annotations

import numpy as np
import pytest
from typer.testing import CliRunner

from planner.cli.main import app
from planner.estimate import estimate, memory_timeline
from planner.memory.timeline import CATEGORIES
from planner.report.figures import CATEGORY_COLORS, OOM_COLOR
from planner.report.timeline_plot import RUNTIME, timeline_data
from planner.spec import TrainConfig

runner = CliRunner()
PHASE_ORDER = ["load", "forward", "backward", "optimizer"]


def _data(model: str, instance: str, **config):
    cfg = TrainConfig(**config)
    est = estimate(model, cfg, instance, with_throughput=False)
    points = memory_timeline(est.model, est.config, est.instance, runtime=est.runtime)
    return est, points, timeline_data(est, points)


def test_stack_is_the_allocators_points_plus_the_runtime_band_up_to_the_device_peak():
    # DDP over 8 V100s: NCCL buffers exist, so every runtime term is exercised.
    est, points, data = _data("bert-base-uncased", "ml.p3.16xlarge", batch_size=8, seq_len=128,
                              precision="amp-fp16")
    m = est.memory_bytes
    assert m.nccl > 0
    for i, p in enumerate(points):
        for c in CATEGORIES:
            assert data.series[c][i] == p.bytes[c]
        # context and NCCL are constant; the allocator's reserve grows with what is allocated
        assert data.series[RUNTIME][i] >= m.cuda_context + m.nccl
    peak = data.peak_index
    assert points[peak].total == m.peak_allocated
    assert data.series[RUNTIME][peak] == m.cuda_context + m.nccl + m.peak_reserved - m.peak_allocated
    assert data.totals[peak] == m.peak_device == max(data.totals)
    assert data.phases[peak] == est.peak_phase
    assert [ph for ph, _, _ in data.phase_spans()] == PHASE_ORDER
    assert data.gpu_memory_bytes == est.gpu_memory_bytes


def test_oom_configuration_is_drawn_above_the_gpu_line_and_says_so():
    est, _, data = _data("bert-large-uncased", "ml.p3.2xlarge", batch_size=64, seq_len=512)
    assert not est.fits
    assert data.totals[data.peak_index] > data.gpu_memory_bytes
    assert "OOM by" in data.subtitle


def _pixels_like(img: np.ndarray, hex_color: str, tol: float = 0.1) -> int:
    rgb = np.array([int(hex_color[i:i + 2], 16) / 255 for i in (1, 3, 5)])
    return int((np.abs(img[..., :3] - rgb).max(axis=-1) < tol).sum())


def test_png_from_the_cli_is_a_chart_with_every_category_colour(tmp_path):
    import matplotlib.image as mpimg

    path = tmp_path / "timeline.png"
    r = runner.invoke(app, ["estimate", "--model", "bert-base-uncased", "--instance", "ml.g5.xlarge",
                            "--batch-size", "8", "--seq-len", "256", "--plot", str(path)])
    assert r.exit_code == 0, r.output
    assert "timeline written to" in r.stdout
    assert 20_000 < path.stat().st_size < 400_000
    img = mpimg.imread(path)
    h, w = img.shape[:2]
    assert 500 <= h <= 900 and 1100 <= w <= 1600
    non_white = (img[..., :3] < 0.95).any(axis=-1).mean()
    assert non_white > 0.25, "mostly blank"
    colours = {tuple(px) for px in (img[::3, ::3, :3] * 255).astype(int).reshape(-1, 3)}
    assert len(colours) > 200
    # Each category that holds memory in this step is drawn in its colour; so is the GPU memory line.
    for category in ("parameters", "gradients", "optimizer_states", "activations"):
        assert _pixels_like(img, CATEGORY_COLORS[category]) > 300, category
    assert _pixels_like(img, OOM_COLOR) > 300


def test_plot_rejects_an_unknown_format_in_one_line(tmp_path):
    r = runner.invoke(app, ["estimate", "--model", "gpt2", "--instance", "ml.g5.xlarge", "--batch-size", "2",
                            "--seq-len", "128", "--plot", str(tmp_path / "x.svg")])
    assert r.exit_code == 2
    assert "--plot" in r.output and ".png or .html" in r.output
    assert "Traceback" not in r.output


@pytest.mark.parametrize("n", [1, 5])
def test_phase_spans_cover_every_point_once(n):
    _, points, data = _data("gpt2", "ml.g5.xlarge", batch_size=n, seq_len=64)
    spans = data.phase_spans()
    assert spans[0][1] == 0 and spans[-1][2] == len(points) - 1
    assert all(a[2] + 1 == b[1] for a, b in zip(spans, spans[1:], strict=False))
