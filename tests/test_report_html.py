"""`planner report` and `estimate --plot FILE.html`: the page opens offline (plotly.js beside it, or inlined for the timeline) and its charts really render.

Rendering is checked in headless Chromium (Debian package `chromium`): `--dump-dom` after a virtual-time
budget must show, inside every figure's div, the SVG that plotly.js draws (`main-svg`) with its traces, and a
screenshot must show the breakdown's category colours. Without Chromium those tests skip and say how to
install it; everything else (content, PNGs, notes) runs anyway.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from planner.cli.main import app
from planner.report.figures import CATEGORY_COLORS, STACK

runner = CliRunner()
INSTANCES = "ml.g5.xlarge,ml.p3.2xlarge"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-dev-shm-usage", "--hide-scrollbars"]


# -------------------------------------------------------------------------------------------- browser


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        found = shutil.which(name)
        if found:
            return found
    pytest.skip("headless Chromium not installed: apt-get install -y chromium (Debian)")


def browse(url_path: Path, tmp: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={tmp / 'chromium-profile'}", "--virtual-time-budget=8000",
           *args, url_path.resolve().as_uri()]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def rendered_figures(dom: str) -> dict[str, str]:
    """figure div id -> the DOM inside it (up to the next figure)."""
    parts = re.split(r'<div class="figure">', dom)[1:]
    out = {}
    for part in parts:
        m = re.search(r'id="(fig-[\w-]+)"', part)
        if m:
            out[m.group(1)] = part
    return out


def trace_count(fragment: str) -> int:
    """Traces plotly drew: one <g class="trace ..."> per bar/scatter trace."""
    return len(re.findall(r'<g class="trace[ "]', fragment))


# -------------------------------------------------------------------------------------------- a study


@pytest.fixture(scope="module")
def search(tmp_path_factory):
    """A small real search (real estimates) on two instance types, written to its own results dir."""
    root = tmp_path_factory.mktemp("report")
    results = root / "results"
    r = runner.invoke(app, ["search", "--instance", INSTANCES, "--model", "bert-base-uncased", "--trials", "20",
                            "--study", "t", "--results-dir", str(results), "--seq-lens", "128,256,512",
                            "--no-progress"])
    assert r.exit_code == 0, r.output
    return results


@pytest.fixture(scope="module")
def report(search):
    r = runner.invoke(app, ["report", "--study", "t", "--results-dir", str(search), "--top", "4"])
    assert r.exit_code == 0, r.output
    path = search / "t" / "report.html"
    assert f"report written to {path}" in r.stdout.replace("\n", "")
    return path


EXPECTED_SECTIONS = ["breakdown", "timeline", "throughput-memory", "pareto-seq", "pareto-cost", "history",
                     "importances", "probes"]


def test_report_opens_offline_with_every_section(report):
    from plotly.offline import get_plotlyjs

    text = report.read_text()
    for key in EXPECTED_SECTIONS:
        assert f"id='{key}'" in text, key
    # plotly.js is one file beside the page; nothing is fetched from the network
    sources = re.findall(r"<script[^>]+src='([^']+)'", text)
    assert sources == ["plotly.min.js"], sources
    assert (report.parent / "plotly.min.js").read_text() == get_plotlyjs()
    assert text.count("Plotly.newPlot") >= 7
    assert "probe" in text and "no probe results" in text  # no results/probes.parquet in this search


def test_pngs_next_to_the_report_are_real_pictures(report):
    import matplotlib.image as mpimg

    pngs = sorted(report.parent.glob("report-*.png"))
    stems = {p.stem for p in pngs}
    for stem in ("report-breakdown", "report-timeline", "report-throughput-memory", "report-pareto-seq",
                 "report-pareto-cost", "report-history"):
        assert stem in stems, stem
    for p in pngs:
        img = mpimg.imread(p)
        assert img.shape[0] > 300 and img.shape[1] > 500, p.name
        rgb = img[..., :3]
        # drawn, not blank: ink on over 1 % of the picture, and coloured marks (a chart with axes, ticks and
        # labels but no data is black and grey only; a sparse scatter of 8 points inks about 2 %)
        assert (rgb < 0.9).any(axis=-1).mean() > 0.01, f"{p.name} is blank"
        assert ((rgb.max(axis=-1) - rgb.min(axis=-1)) > 0.2).mean() > 0.0003, f"{p.name} has no coloured marks"


def test_breakdown_bars_add_up_to_each_candidates_stored_peak(search):
    """The bars are recomputed from each trial's config; they must sum to the peak the search stored."""
    from planner.report.html import _estimate_of, load_search, peak_bars
    from planner.search.results import top_k

    s = load_search("t", results_dir=search)
    top = top_k(s.frame, 4, s.direction)
    assert len(top) == 4
    for _, row in top.iterrows():
        bars = peak_bars(_estimate_of(s, row))
        assert set(bars) == set(STACK)
        assert sum(bars.values()) == int(row["mem_peak_device"])
        assert bars["activations"] > 0 and bars["parameters"] > 0


def test_every_chart_renders_in_headless_chromium(report, tmp_path):
    r = browse(report, tmp_path, "--dump-dom")
    assert r.returncode == 0, r.stderr[-2000:]
    figures = rendered_figures(r.stdout)
    written = set(re.findall(r"id=\"(fig-[\w-]+)\"", report.read_text()))
    assert written and set(figures) == written
    for fig_id, fragment in figures.items():
        assert 'class="main-svg"' in fragment, f"{fig_id}: plotly drew nothing"
        assert trace_count(fragment) >= 1, f"{fig_id}: no trace"
    # the breakdown: one bar trace per category plus the GPU-memory markers
    assert trace_count(figures["fig-breakdown-0"]) == len(STACK) + 1
    assert 'class="trace bars"' in figures["fig-breakdown-0"]
    assert "OOM" in figures["fig-throughput-memory-0"]


def test_screenshot_shows_the_breakdown_colours(report, tmp_path):
    import matplotlib.image as mpimg

    shot = tmp_path / "shot.png"
    r = browse(report, tmp_path, f"--screenshot={shot}", "--window-size=1400,3000")
    assert r.returncode == 0 and shot.is_file(), r.stderr[-2000:]
    img = mpimg.imread(shot)
    assert img.shape[:2] == (3000, 1400)
    colours = {tuple(px) for px in (img[::4, ::4, :3] * 255).astype(int).reshape(-1, 3)}
    assert len(colours) > 100, "the page looks like text only"
    for category in ("parameters", "optimizer_states", "activations"):
        rgb = np.array([int(CATEGORY_COLORS[category][i:i + 2], 16) / 255 for i in (1, 3, 5)])
        assert (np.abs(img[..., :3] - rgb).max(axis=-1) < 0.03).sum() > 500, category


def test_timeline_html_renders_with_its_peak_annotation(tmp_path):
    from planner.estimate import estimate, memory_timeline
    from planner.report.timeline_plot import timeline_data
    from planner.spec import TrainConfig

    path = tmp_path / "timeline.html"
    args = ["--model", "gpt2", "--instance", "ml.g5.xlarge", "--batch-size", "4", "--seq-len", "256"]
    r = runner.invoke(app, ["estimate", *args, "--plot", str(path)])
    assert r.exit_code == 0, r.output
    est = estimate("gpt2", TrainConfig(batch_size=4, seq_len=256), "ml.g5.xlarge", with_throughput=False)
    peak_text = timeline_data(est, memory_timeline("gpt2", est.config, "ml.g5.xlarge")).peak_text()
    text = path.read_text()
    assert peak_text in text
    assert not re.search(r"<script[^>]+src=", text)
    r = browse(path, tmp_path, "--dump-dom")
    assert r.returncode == 0, r.stderr[-2000:]
    assert 'class="main-svg"' in r.stdout
    assert trace_count(r.stdout) >= len(STACK)  # one area per category + runtime (+ the peak marker)
    assert "peak " in r.stdout and "GPU memory" in r.stdout  # annotations drawn as SVG text


# ----------------------------------------------------------------------------------- edge cases


def _tiny_study(root: Path, values: list[float]) -> Path:
    """A search written straight through Optuna with the search's user-attr layout (real objective)."""
    import optuna

    from planner.hardware import get_instance
    from planner.models.catalog import cached_model
    from planner.search.objective import Objective
    from planner.search.space import INDEX_SUFFIX, SpaceSpec, resolve_space
    from planner.search.study import DEFINITION_ATTR
    from planner.search.sweep import Sweep

    inst = get_instance("ml.g5.xlarge")
    model = cached_model("gpt2")
    spec = SpaceSpec(batch_sizes=(2, 4), seq_lens=(128,), precisions=("fp32",), checkpointing=(False,),
                     grad_accums=(1,))
    spec = spec.model_copy(update={"parallelisms": ("ddp",), "attentions": ("sdpa",), "optimizer_impls": ("foreach",)})
    sweep = Sweep(model="gpt2", instance=inst.name, space=spec)
    space = resolve_space(spec, model, inst)
    objective = Objective(model, inst, space)
    from optuna.storages.journal import JournalFileBackend, JournalStorage

    journal = root / "c" / "journal.log"
    journal.parent.mkdir(parents=True)
    storage = JournalStorage(JournalFileBackend(str(journal)))
    study = optuna.create_study(storage=storage, study_name="c", direction="maximize")
    study.set_user_attr(DEFINITION_ATTR, sweep.definition())
    choices = space.parameters()  # the searched dimensions as Optuna sees them (numeric ones as an index)
    dists = {n: optuna.distributions.IntDistribution(0, len(c) - 1) if n.endswith(INDEX_SUFFIX)
             else optuna.distributions.CategoricalDistribution(c) for n, c in choices.items()}
    for i, value in enumerate(values):
        params = {n: c[i % len(c)] for n, c in choices.items()}
        ev = objective.evaluate(space.config(space.decode(params)))
        study.add_trial(optuna.trial.create_trial(params=params, distributions=dists, value=value,
                                                  user_attrs=ev.attrs))
    return root


@pytest.mark.parametrize("values", [[10.0], [5.0, 5.0, 5.0, 5.0]], ids=["one-trial", "constant"])
def test_importances_that_cannot_be_computed_become_a_note(tmp_path, values):
    from planner.report.html import write_report

    root = _tiny_study(tmp_path, values)
    rep = write_report("c", results_dir=root, top=2)
    imp = next(s for s in rep.sections if s.key == "importances")
    assert imp.figures or imp.notes
    if len(values) == 1:
        assert not imp.figures and "at least 2 completed trials" in imp.notes[0]
    assert rep.path.is_file()


def test_probe_results_are_compared_when_present(tmp_path):
    import pandas as pd

    from planner.report.html import write_report

    root = _tiny_study(tmp_path, [10.0, 12.0])
    gib = 1024**3
    pd.DataFrame({
        "record_id": ["a", "b", "c"], "model": ["gpt2"] * 3, "instance": ["ml.g5.xlarge"] * 3,
        "batch_size": [2, 4, 8], "seq_len": [128] * 3,
        "pred_peak_allocated": [2.0 * gib, 3.0 * gib, 5.0 * gib], "peak_allocated": [2.1 * gib, 2.9 * gib, None],
        "pred_samples_per_s": [50.0, 80.0, 90.0], "samples_per_s": [45.0, 85.0, None],
    }).to_parquet(root / "probes.parquet")
    rep = write_report("c", results_dir=root, top=2)
    probes = next(s for s in rep.sections if s.key == "probes")
    assert len(probes.figures) == 2 and not probes.notes  # memory and throughput
    memory = probes.figures[0].data[0]
    assert list(memory.x) == pytest.approx([2.1, 2.9])  # the OOM probe (no reading) is left out
    assert {p.name for p in rep.pngs} >= {"report-probes-memory.png", "report-probes-throughput.png"}


def test_unknown_study_is_one_line_naming_the_flag(tmp_path):
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "journal.log").write_bytes(b"")
    r = runner.invoke(app, ["report", "--study", "nope", "--results-dir", str(tmp_path)])
    assert r.exit_code == 2
    assert "--study" in r.output and "nope" in r.output and "other" in r.output
    assert "Traceback" not in r.output


# ----------------------------------------------------------------------------------- at scale (issue 10)


@pytest.fixture(scope="module")
def report_all(tmp_path_factory):
    """A search over every instance type (toy estimate for speed), reported with the real breakdowns."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from search_fixtures import fake_estimate

    from planner.report.html import write_report
    from planner.search.study import run_search
    from planner.search.sweep import DEFAULT_SWEEP

    root = tmp_path_factory.mktemp("all")
    sweep = DEFAULT_SWEEP.with_overrides(instance="all", space={"parallelisms": ["ddp"]})
    run_search(sweep, study="everything", trials=150, results_dir=root, estimate_fn=fake_estimate)
    return write_report("everything", results_dir=root, top=3)


def test_report_at_scale_groups_by_gpu_family_and_stays_small(report_all):
    from plotly.offline import get_plotlyjs

    from planner.hardware import get_instance, list_instances

    families = {get_instance(n).gpu.family for n in list_instances()}
    text = report_all.path.read_text()
    assert len(text.encode()) < 2_000_000, len(text.encode())
    assert len(get_plotlyjs()) > 2_000_000  # why the library is a file beside the page, not inlined
    assert len(report_all.pngs) <= 10
    for key in ("throughput-memory", "pareto-cost"):
        section = next(s for s in report_all.sections if s.key == key)
        fig = section.figures[0]
        names = {t.name for t in fig.data if t.showlegend is not False}
        assert len(names) <= len(families) + 1, names  # one legend entry per GPU family (+ the front)
    cost = next(s for s in report_all.sections if s.key == "pareto-cost").figures[0]
    assert cost.layout.xaxis.type == "log"


def test_report_at_scale_renders_in_headless_chromium(report_all, tmp_path):
    import matplotlib.image as mpimg

    r = browse(report_all.path, tmp_path, "--dump-dom")
    assert r.returncode == 0, r.stderr[-2000:]
    figures = rendered_figures(r.stdout)
    assert figures and all('class="main-svg"' in f for f in figures.values())
    shot = tmp_path / "all.png"
    r = browse(report_all.path, tmp_path, f"--screenshot={shot}", "--window-size=1400,3000")
    assert r.returncode == 0 and shot.is_file(), r.stderr[-2000:]
    img = mpimg.imread(shot)
    colours = {tuple(px) for px in (img[::4, ::4, :3] * 255).astype(int).reshape(-1, 3)}
    assert len(colours) > 100, "the page looks like text only"
