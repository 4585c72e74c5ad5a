"""Every command's table output at 80 columns (a small terminal, or piped: rich then assumes 80): no line is
wider, no cell is cut to "…", and every value the command computes appears in full somewhere in the text.

The expected values come from the command's own `--json` (or the data it lists), not from copied output."""

from __future__ import annotations

import json

import pytest
from test_aws_collect import JOBS, queue_describes, s3_world  # noqa: F401
from test_aws_fixtures import aws_env  # noqa: F401
from test_validate_probes import MIB, estimate, record
from typer.testing import CliRunner

from planner.cli import common
from planner.cli.main import app
from planner.probes import store
from planner.units import fmt_bytes

WIDTH = 80
runner = CliRunner()


@pytest.fixture(autouse=True)
def _width(monkeypatch, tmp_path):
    monkeypatch.setattr(common.console, "width", WIDTH)
    monkeypatch.setattr(common.err_console, "width", WIDTH)
    monkeypatch.setenv("PLANNER_CALIBRATION", str(tmp_path / "none.json"))
    monkeypatch.setenv("PLANNER_PRICES", str(tmp_path / "none.json"))


def text_of(args: list[str]) -> str:
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    return res.stdout


def json_of(args: list[str]):
    res = runner.invoke(app, [*args, "--json"])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def assert_readable(text: str, expected: list[str]) -> None:
    assert "…" not in text and "..." not in text
    wide = [line for line in text.splitlines() if len(line) > WIDTH]
    assert not wide, wide
    flat = " ".join(text.split())  # a folded cell is whole once the line breaks are undone
    missing = [v for v in expected if v not in text and v not in flat]
    assert not missing, missing


@pytest.mark.parametrize("args", [
    [],
    ["-m", "gpt2-xl", "-i", "ml.p4d.24xlarge", "-p", "amp-bf16", "-b", "4", "--dataset-size", "1000000"],
    ["-m", "llama-3-8b", "-i", "ml.g5.48xlarge", "--parallelism", "zero3", "-b", "1", "-s", "2048"],
])
def test_estimate(args):
    data = json_of(["estimate", *args])
    expected = [f"{n:,}" for n in data["parameters"].values()]
    expected += [f"{v:,}" for v in data["memory_bytes"].values()] + [fmt_bytes(v) for v in
                                                                      data["memory_bytes"].values()]
    expected += [ph["phase"] for ph in data["phases"]] + [fmt_bytes(ph["allocated"]) for ph in data["phases"]]
    expected += ["temporaries and buffers"]
    assert_readable(text_of(["estimate", *args]), expected)


@pytest.mark.parametrize("args", [[], ["--parallelism", "dp"], ["-m", "gpt2", "-i", "ml.g5.xlarge", "-b", "64"]])
def test_explain(args):
    steps = json_of(["explain", *args])
    text = text_of(["explain", *args])
    expected = [s["title"] for s in steps] + [w for s in steps for line in s["lines"] for w in line.split()]
    assert_readable(text, expected)
    lowered = text.lower()
    assert "seed" not in lowered and "the seed note" not in lowered


def test_models():
    rows = json_of(["models"])
    assert_readable(text_of(["models"]), [r["name"] for r in rows] + [f"{r['parameters']:,}" for r in rows])


def test_instances():
    rows = json_of(["instances"])
    text = text_of(["instances"])
    assert_readable(text, [r["name"] for r in rows] + [f"{r['usd_per_hour']:.3f}" for r in rows
                                                       if r["usd_per_hour"] is not None])
    for r in rows:  # an instance name users copy is never split over two lines
        assert any(line.split() and line.split()[0] == r["name"] for line in text.splitlines()), r["name"]


def test_prices():
    rows = json_of(["prices"])
    assert_readable(text_of(["prices"]), [r["instance"] for r in rows] + [f"{r['usd_per_hour']:.3f}" for r in rows
                                                                          if r["usd_per_hour"] is not None])


def test_validate_and_calibrate(tmp_path, monkeypatch):
    monkeypatch.setenv("PLANNER_RESULTS_DIR", str(tmp_path / "results"))
    folder = tmp_path / "validation" / "V100"
    for i, ctx in enumerate((500 * MIB, 540 * MIB)):
        store.write_json_atomic(folder / f"r{i}.json", record(f"r{i}", context=ctx, est=estimate()))
    text = text_of(["validate", "--probes", str(folder), "--stored"])
    assert_readable(text, ["r0", "r1"] if "r0" in text else ["V100"])
    text = text_of(["calibrate", "--probes", str(folder), "--out", str(tmp_path / "cal.json")])
    assert_readable(text, ["V100", "520 MiB"])


def test_probe_status(s3_world, monkeypatch):  # noqa: F811
    from planner.aws import session

    monkeypatch.setattr(session, "Aws", lambda region, profile=None: s3_world)
    queue_describes(s3_world.stub, ["probe-oom", "probe-run"])
    text = text_of(["probe", "status", "--job", "probe-oom", "--job", "probe-run"])
    assert_readable(text, ["probe-oom", "probe-run", "Failed", "InProgress"])


def _path_lines_apart(text: str) -> str:
    """The `results:`/`storage:` lines hold a path, soft-wrapped on purpose so it stays one copyable string;
    they are not table cells."""
    return "\n".join(ln for ln in text.splitlines() if not ln.startswith(("results: ", "storage: ")))


@pytest.mark.parametrize("extra", [[], ["--instance", "ml.p3.2xlarge,ml.g5.xlarge", "--objective", "pareto"]])
def test_search(tmp_path, extra):
    args = ["search", "--instance", "ml.p3.2xlarge", "--batch-sizes", "8,32", "--seq-lens", "128,256",
            "--trials", "6", "--study", "w80", "--results-dir", str(tmp_path), "--no-progress", *extra]
    data = json_of(args)
    text = text_of(args)
    expected = []
    for row in data["top"]:
        expected += [row["instance"].removeprefix("ml."), f"{row['samples_per_s']:,.1f}",
                     f"{int(row['batch_size'])}x{int(row['grad_accum'])}x{int(row['world_size'])}", row["precision"]]
        if row.get("usd_per_job") is not None:
            expected.append(f"${row['usd_per_job']:,.2f}")
    assert_readable(_path_lines_apart(text), expected)
    assert f"{tmp_path}/w80/" in text  # the path itself is printed whole


def test_report(tmp_path):
    runner.invoke(app, ["search", "--instance", "ml.p3.2xlarge", "--batch-sizes", "8", "--seq-lens", "128",
                        "--trials", "2", "--study", "r80", "--results-dir", str(tmp_path), "--no-progress"])
    res = runner.invoke(app, ["report", "--study", "r80", "--results-dir", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert_readable(_path_lines_apart(res.stdout).replace(str(tmp_path), "DIR"), ["report.html", "PNGs"])


@pytest.mark.parametrize("args", [["models"], ["estimate", "-m", "gpt2-xl", "-i", "ml.p4d.24xlarge", "-b", "4"]])
def test_piped_to_a_file(tmp_path, args):
    """Piped (stdout not a terminal, no COLUMNS): rich assumes 80 columns; the real process, not CliRunner."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1]) + os.pathsep + env.get("PYTHONPATH", "")
    out = tmp_path / "out.txt"
    with out.open("w") as f:
        proc = subprocess.run([sys.executable, "-m", "planner", *args], stdout=f, stderr=subprocess.PIPE, env=env,
                              timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    data = json_of(args)
    expected = ([r["name"] for r in data] if args == ["models"]
                else [f"{v:,}" for v in data["memory_bytes"].values()])
    assert_readable(out.read_text(), expected)
