"""The public training runs under results/public/: every row loads, is cited, is in range and maps to planner inputs."""

from __future__ import annotations

import math
import shutil

import pytest

from planner import estimate
from planner.errors import PlannerError
from planner.hardware import get_gpu
from planner.models.catalog import get_model
from planner.probes.public import (
    MEMORY_FILE,
    MIB,
    THROUGHPUT_FILE,
    load_public_memory,
    load_public_sharded,
    load_public_sharded_speed,
    load_public_sources,
    load_public_throughput,
    public_dir,
    public_instance,
)
from planner.spec import TrainConfig

HELD_OUT = ("tlkh/transformers-benchmarking", "perf_train_gpu_one", "bingbertsquad")

MEMORY = load_public_memory()
THROUGHPUT = load_public_throughput()
SHARDED = load_public_sharded()  # FSDP / ZeRO runs (tests/test_frameworks.py, benchmarks/public_sharded.py)
SHARDED_SPEED = load_public_sharded_speed()  # published FSDP speeds (benchmarks/public_sharded_speed.py)
SOURCES = load_public_sources()


def test_enough_rows_from_enough_sources():
    assert len(MEMORY) >= 30 and len({r.source_id for r in MEMORY}) >= 3
    assert any(r.outcome == "oom" for r in MEMORY) and any(r.outcome == "ran" for r in MEMORY)
    assert len(THROUGHPUT) >= 30 and len({r.source_id for r in THROUGHPUT}) >= 3


def test_every_row_is_cited():
    for row in MEMORY + THROUGHPUT + SHARDED + SHARDED_SPEED:
        src = SOURCES[row.source_id]
        assert src.url.startswith("https://"), row.id
        assert row.where.strip() and row.quote.strip(), row.id


def test_no_held_out_source_is_used():
    for src in SOURCES.values():
        text = " ".join([src.url, src.repo, src.path, src.note]).lower()
        assert not any(h in text for h in HELD_OUT), src.source_id


def test_every_source_is_used():
    from planner.probes.korthikanti import load_formulas, load_models

    used = {r.source_id for r in MEMORY + THROUGHPUT + SHARDED + SHARDED_SPEED}
    used |= {r.source_id for r in [*load_formulas().values(), *load_models()]}  # results/public/korthikanti/
    # hf-run-clm documents the defaults that the run_clm issues rely on; it carries no row of its own
    assert set(SOURCES) - used <= {"hf-run-clm"}


def test_sharded_speed_models_have_the_published_parameter_count():
    """The MPT stand-ins (GPT-2 configs) hold exactly the parameters the source's table counts, so the
    planner times the same matmuls; each row's quote holds its tokens/s/GPU and its micro-batch."""
    for row in SHARDED_SPEED:
        est = estimate(str(row.config_path()), row.train_config(8), row.instance(), with_throughput=False)
        assert est.parameters["total"] == row.params, row.id
        cells = [c.strip() for c in row.quote.split("|")]
        assert cells[-1] == f"{row.tokens_per_s_per_gpu:.0f}" and cells[2] == str(row.gpus), row.id
        assert row.instance().network_gbps == row.network_gbps


@pytest.mark.parametrize("row", MEMORY + THROUGHPUT, ids=lambda r: r.id)
def test_row_maps_to_planner_inputs(row):
    spec = get_model(row.model, **row.model_options())
    assert spec.max_positions is None or row.seq_len <= spec.max_positions
    inst = row.instance()
    assert inst.gpus == row.gpus and inst.gpu.name == get_gpu(row.gpu).name
    cfg = row.train_config()
    assert (cfg.batch_size, cfg.seq_len, cfg.precision) == (row.batch_size, row.seq_len, row.precision)


def test_memory_numbers_in_range():
    for row in MEMORY:
        if row.peak_mib is not None:
            assert math.isfinite(row.peak_mib)
            assert 0 < row.peak_mib * MIB <= get_gpu(row.gpu).memory_bytes, row.id


def test_published_speed_is_quoted():
    """The number in the row is the number in the quoted source text (no rounding, no arithmetic)."""
    for row in THROUGHPUT:
        assert math.isfinite(row.samples_per_s) and row.samples_per_s > 0
        text = f"{row.samples_per_s:g}"
        assert text in row.quote.replace(" ", ""), (row.id, text, row.quote)


def test_planner_estimates_every_row():
    """Through the public API only, as the benchmark scripts do (no stack arguments needed)."""
    for row in MEMORY[:5] + THROUGHPUT[:5]:
        est = estimate(row.model, row.train_config(), row.instance(), model_options=row.model_options())
        assert est.memory_bytes.peak_device > 0 and est.throughput.samples_per_s > 0


def test_public_instance_prefers_the_exact_sagemaker_type():
    assert public_instance("V100-16GB", 8).name == "ml.p3.16xlarge"
    assert public_instance("T4", 4).name == "ml.g4dn.12xlarge"
    one = public_instance("V100-32GB", 1)  # no SageMaker type has one V100-32GB
    assert one.gpus == 1 and one.gpu.name == get_gpu("V100-32GB").name
    base = public_instance("V100-32GB", 8)
    assert one.price_per_hour == pytest.approx(base.price_per_hour / 8)
    with pytest.raises(PlannerError):
        public_instance("K80", 1)


def test_bad_row_names_file_line_and_field(tmp_path):
    shutil.copytree(public_dir(), tmp_path / "public")
    path = tmp_path / "public" / MEMORY_FILE
    lines = path.read_text().splitlines()
    lines[1] = lines[1].replace(",ran,", ",maybe,", 1)
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(PlannerError, match=r"runs.csv line 2 outcome"):
        load_public_memory(tmp_path / "public")


def test_unknown_model_is_rejected(tmp_path):
    shutil.copytree(public_dir(), tmp_path / "public")
    path = tmp_path / "public" / THROUGHPUT_FILE
    lines = path.read_text().splitlines()
    lines[1] = lines[1].replace("bert-large-uncased", "bert-huge", 1)
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(PlannerError, match="model"):
        load_public_throughput(tmp_path / "public")


def test_benchmark_scripts_run_through_the_public_api(capsys):
    """The two accuracy scripts run end to end on one source each (they use only planner.estimate + its JSON)."""
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "benchmarks"
    for name, source, expect in (("public_memory", "hf-issue-10754", "sure fits that OOM'd"),
                                 ("public_speed", "dle-bert-1907", "Single-GPU runs")):
        spec = importlib.util.spec_from_file_location(name, root / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        assert module.main(["--source", source, "--rows"]) == 0
        out = capsys.readouterr().out
        assert expect in out and source in out
        assert max(len(line) for line in out.splitlines()) <= 80


def test_held_out_readings_live_apart_from_the_fitting_files():
    """results/public/heldout/ holds readings of held-out sources (tlkh/transformers-benchmarking, the Hugging
    Face single-GPU performance page): only benchmarks/public_heldout.py reads them; the loaders never cite them."""
    import csv

    held = public_dir() / "heldout" / "tlkh_v100_16gb_amp.csv"
    with held.open(newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) >= 10
    for r in rows:
        assert r["path"].startswith("results/v100-16gb-300w/amp/") and r["path"].endswith("/metrics.csv"), r
        assert 0 < int(r["peak_mib"]) * MIB <= get_gpu("V100-16GB").memory_bytes, r
        get_model(r["model"])  # a catalog model
    with (public_dir() / "heldout" / "tlkh_step_times.csv").open(newline="", encoding="utf-8") as f:
        steps = list(csv.DictReader(f))
    pairs = {(r["model"], r["seq_len"], r["batch_size"]) for r in steps if r["gpu"] == "a100-40gb-400w"} & \
        {(r["model"], r["seq_len"], r["batch_size"]) for r in steps if r["gpu"] == "v100-16gb-300w"}
    assert len(pairs) >= 20 and len(steps) == 2 * len(pairs)  # only runs both GPUs have
    for r in steps:
        assert r["path"] == f"results/{r['gpu']}/amp/{r['model']}/{r['seq_len']}-{r['batch_size']}/pl_profile.txt", r
        step, forward, backward = (float(r[k]) for k in ("optimizer_step_mean_s", "model_forward_mean_s",
                                                          "model_backward_mean_s"))
        assert 0 < forward + backward <= step, r  # Lightning's optimizer_step wraps forward and backward
        assert len(r["commit"]) == 40
    with (public_dir() / "heldout" / "hf_perf_train_gpu_one_v100.csv").open(newline="", encoding="utf-8") as f:
        page = list(csv.DictReader(f))
    assert len(page) == 9  # every experiment the page prints a reading for
    for r in page:  # each row is a configuration the planner can take
        TrainConfig(batch_size=int(r["batch_size"]), seq_len=512, grad_accum=int(r["grad_accum"]),
                    precision=r["precision"], optimizer=r["optimizer"], optimizer_impl=r["optimizer_impl"])
        assert 0 < int(r["peak_mib"]) * MIB <= get_gpu("V100-16GB").memory_bytes and float(r["samples_per_s"]) > 0
    for name in (MEMORY_FILE, THROUGHPUT_FILE):
        assert not any(h in (public_dir() / name).read_text(encoding="utf-8").lower() for h in HELD_OUT), name


def test_held_out_benchmark_runs_and_prints_within_80_columns(capsys):
    """benchmarks/public_heldout.py reads every held-out file (memory, speed, the A100/V100 pairs) without
    error; its figures are for reading, so only the report's shape is checked."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "public_heldout.py"
    spec = importlib.util.spec_from_file_location("public_heldout", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["public_heldout"] = module  # its dataclass looks its module up
    spec.loader.exec_module(module)
    assert module.main() == 0
    out = capsys.readouterr().out
    for section in ("tlkh/transformers-benchmarking, RoBERTa", "Hugging Face single-GPU page",
                    "A100/V100 speed ratio"):
        assert section in out
    assert max(len(line) for line in out.splitlines()) <= 80
