"""The search machinery: space, sweep files, objective, sampler and storage (in-process)."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import optuna
import pytest
from search_fixtures import fake_estimate

from planner.errors import PlannerError
from planner.hardware import get_instance
from planner.models.catalog import cached_model
from planner.search.objective import SUPPORTED_VIOLATION, Objective
from planner.search.space import SpaceSpec, parse_flag_list, resolve_space, space_from_flags
from planner.search.study import run_search, safe_url
from planner.search.sweep import DEFAULT_SWEEP, Sweep, load_sweep, parse_sweep

ROOT = Path(__file__).resolve().parents[1]
SMALL = SpaceSpec(batch_sizes=(4, 16, 64, 256), seq_lens=(128, 512), precisions=("fp32", "amp-fp16"),
                  grad_accums=(1, 4))


def brute_force_optimum(objective: Objective) -> float:
    """Every point of the space evaluated on its own, outside Optuna."""
    dims = objective.space.searched()
    values = []
    for combo in itertools.product(*dims.values()):
        result = objective.evaluate(objective.space.config(dict(zip(dims, combo, strict=True))))
        if result.feasible:
            values.append(result.value)
    return max(values) if objective.direction == "maximize" else min(values)


def small_sweep(**updates) -> Sweep:
    return DEFAULT_SWEEP.with_overrides(space=SMALL.model_dump(), **updates)


# ------------------------------------------------------------------------------------------- space


def test_default_space_drops_what_the_gpu_cannot_run():
    model = cached_model("multimodal-bert")
    v100 = resolve_space(SpaceSpec(), model, get_instance("ml.p3.16xlarge"))
    a10g = resolve_space(SpaceSpec(), model, get_instance("ml.g5.2xlarge"))
    assert "amp-bf16" not in v100.precisions and v100.dropped["precisions"] == ("amp-bf16",)
    assert "amp-bf16" in a10g.precisions and "precisions" not in a10g.dropped
    # optimizer, attention and parallelism are fixed unless asked for
    assert set(v100.searched()) == {"batch_size", "seq_len", "precision", "checkpointing", "grad_accum"}


def test_explicit_unsupported_values_are_kept_and_recorded_infeasible(tmp_path):
    sweep = DEFAULT_SWEEP.with_overrides(space={"precisions": ["amp-bf16", "amp-fp16"], "batch_sizes": [8],
                                                "seq_lens": [128], "grad_accums": [1], "checkpointing": [False]})
    result = run_search(sweep, sampler="grid", results_dir=tmp_path, estimate_fn=fake_estimate)
    frame = result.frame.set_index("precision")
    assert len(frame) == 2
    assert not frame.loc["amp-bf16", "feasible"] and "bf16" in frame.loc["amp-bf16", "reason"]
    assert frame.loc["amp-bf16", "constraint_supported"] == SUPPORTED_VIOLATION
    assert frame.loc["amp-fp16", "feasible"]


def test_seq_lens_beyond_the_model_are_dropped_from_defaults_only():
    model = cached_model("multimodal-bert")  # BERT: 512 positions
    inst = get_instance("ml.p3.2xlarge")
    assert max(resolve_space(SpaceSpec(seq_lens=None), model, inst).seq_lens) <= 512
    defaults = resolve_space(SpaceSpec(), model, inst)
    assert defaults.seq_lens == (128, 256, 512)
    asked = resolve_space(SpaceSpec(seq_lens=(512, 1024)), model, inst)
    assert asked.seq_lens == (512, 1024)


def test_min_seq_len_filters_and_names_the_flag():
    model, inst = cached_model("multimodal-bert"), get_instance("ml.p3.2xlarge")
    assert resolve_space(SpaceSpec(), model, inst, min_seq_len=256).seq_lens == (256, 512)
    with pytest.raises(PlannerError, match="--min-seq-len"):
        resolve_space(SpaceSpec(), model, inst, min_seq_len=1024)


@pytest.mark.parametrize(("field", "text", "flag"), [
    ("batch_sizes", "1,two", "--batch-sizes"), ("batch_sizes", "0", "--batch-sizes"),
    ("precisions", "fp32,fp8", "--precisions"), ("checkpointing", "maybe", "--checkpointing"),
    ("parallelisms", "zero4", "--parallelisms"),
])
def test_space_flag_errors_name_the_flag(field, text, flag):
    with pytest.raises(PlannerError, match=flag):
        parse_flag_list(field, text)


def test_space_flags_parse():
    spec = space_from_flags(batch_sizes="8,16,8", checkpointing="both", precisions="amp-fp16")
    assert spec.batch_sizes == (8, 16) and spec.checkpointing == (False, True) and spec.precisions == ("amp-fp16",)
    assert spec.explicit() == {"batch_sizes", "checkpointing", "precisions"}


# ------------------------------------------------------------------------------------------- sweeps


@pytest.mark.parametrize("path", sorted((ROOT / "sweeps").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_sweeps_validate(path):
    sweep = load_sweep(path)
    assert sweep.name and sweep.instance_names()


def test_shipped_default_sweep_equals_the_builtin_one():
    shipped = load_sweep(ROOT / "sweeps" / "multimodal-bert-p3.yaml")
    assert shipped.definition() == DEFAULT_SWEEP.definition()
    assert shipped.name == DEFAULT_SWEEP.name and shipped.fingerprint() == DEFAULT_SWEEP.fingerprint()


def test_expected_sweeps_are_shipped():
    names = {p.name for p in (ROOT / "sweeps").glob("*.yaml")}
    assert {"multimodal-bert-p3.yaml", "bert-large-instances.yaml"} <= names
    assert any(n.startswith(("gpt2", "llama")) for n in names)


@pytest.mark.parametrize(("text", "field"), [
    ("space:\n  batch_sizes: [8, two]\n", "space.batch_sizes.1"),
    ("space:\n  batch_size: [8]\n", "space.batch_size"),
    ("constraints:\n  max_memory_fraction: 1.5\n", "constraints.max_memory_fraction"),
    ("objective:\n  target: speed\n", "objective.target"),
    ("model: bert-lage\n", "model"),
    ("instance: ml.p3.17xlarge\n", "instance"),
    ("model: multimodal-bert\nmodel_options: {tab_inn: 3}\n", "model"),
    ("- a\n- b\n", "(document)"),
    ("space: [unclosed\n", "line"),
])
def test_sweep_errors_name_the_file_and_the_field(tmp_path, text, field):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(PlannerError) as info:
        load_sweep(path)
    message = str(info.value)
    assert str(path) in message and field in message, message


def test_sweep_name_defaults_to_the_file_stem(tmp_path):
    path = tmp_path / "my-sweep.yaml"
    path.write_text("model: bert-base-uncased\ninstance: ml.g5.2xlarge\n")
    assert load_sweep(path).name == "my-sweep"


def test_instances_all_and_lists():
    assert parse_sweep({"instance": "ml.p3.2xlarge,ml.g5.xlarge"}).instance_names() == ["ml.p3.2xlarge",
                                                                                       "ml.g5.xlarge"]
    from planner.hardware import list_instances

    assert parse_sweep({"instance": "all"}).instance_names() == list_instances()


# ---------------------------------------------------------------------------------------- objective


def test_objective_records_every_memory_term_and_constraints():
    model, inst = cached_model("multimodal-bert"), get_instance("ml.p3.16xlarge")
    space = resolve_space(SMALL, model, inst)
    objective = Objective(model, inst, space, estimate_fn=fake_estimate)

    class Trial:  # the parts of optuna.Trial the objective uses
        params: dict = {}
        attrs: dict = {}
        constraints: dict = {}

        def suggest_categorical(self, name, values):
            self.params[name] = values[-1]
            return values[-1]

        def suggest_int(self, name, low, high):
            self.params[name] = high
            return high

        def set_user_attr(self, key, value):
            self.attrs[key] = value

        def set_constraint(self, key, value):
            self.constraints[key] = value

    trial = Trial()
    value = objective(trial)
    config = space.config(space.decode(trial.params))
    assert config.batch_size == 256 and config.seq_len == 512  # the last index is the largest value
    est = fake_estimate(model, config, inst)
    assert value == pytest.approx(est.throughput.samples_per_s)
    assert set(trial.attrs["memory_bytes"]) >= set(est.memory_bytes.model_dump())
    limit = 0.95 * est.gpu_memory_bytes
    assert trial.constraints["memory"] == pytest.approx((est.memory_bytes.peak_device - limit) / 2**30, rel=1e-6)
    assert (trial.constraints["memory"] > 0) == ("reason" in trial.attrs)


def test_global_batch_constraint():
    model, inst = cached_model("multimodal-bert"), get_instance("ml.p3.16xlarge")  # 8 GPUs
    space = resolve_space(SMALL, model, inst)
    sweep = small_sweep(constraints={"global_batch_size": 256, "global_batch_tolerance": 0.0})
    objective = Objective(model, inst, space, constraints=sweep.constraints, estimate_fn=fake_estimate)
    def point(batch_size, grad_accum):
        return objective.evaluate(space.config({"batch_size": batch_size, "grad_accum": grad_accum, "seq_len": 128,
                                                "precision": "fp32", "checkpointing": False}))

    assert point(16, 1).constraints["global_batch"] == pytest.approx(0.5)  # 16 × 1 × 8 = 128
    assert point(16, 4).constraints["global_batch"] == pytest.approx(1.0)  # 512
    hit = point(16, 2)  # 256
    assert hit.constraints["global_batch"] == 0 and hit.feasible
    loose = small_sweep(constraints={"global_batch_size": 256, "global_batch_tolerance": 0.5})
    objective = Objective(model, inst, space, constraints=loose.constraints, estimate_fn=fake_estimate)
    assert point(16, 1).feasible and not point(16, 4).feasible


# ------------------------------------------------------------------------------------ search + store


@pytest.mark.parametrize("estimate", ["fake", "real"])
def test_tpe_finds_the_grid_optimum_on_a_small_space(tmp_path, estimate):
    fn = fake_estimate if estimate == "fake" else None
    sweep = small_sweep()
    model, inst = cached_model(sweep.model), get_instance("ml.p3.16xlarge")
    optimum = brute_force_optimum(Objective(model, inst, resolve_space(sweep.space, model, inst), estimate_fn=fn))
    grid = run_search(sweep, sampler="grid", study="grid", results_dir=tmp_path, estimate_fn=fn)
    tpe = run_search(sweep, sampler="tpe", trials=60, study="tpe", results_dir=tmp_path, estimate_fn=fn)
    size = grid.runs[0].space.size
    assert len(grid.frame) == size == 64
    assert grid.frame[["batch_size", "seq_len", "precision", "checkpointing", "grad_accum"]].drop_duplicates().shape[0] \
        == size
    assert grid.frame[grid.frame.feasible].value.max() == pytest.approx(optimum)
    assert tpe.frame[tpe.frame.feasible].value.max() == pytest.approx(optimum)


def test_cost_objective_across_instances_cheapest_first(tmp_path):
    from planner.search.results import best_per_instance

    sweep = small_sweep(instance=("ml.p3.16xlarge", "ml.p3.2xlarge", "ml.g5.2xlarge"),
                        objective={"target": "cost", "dataset_size": 1_000_000})
    result = run_search(sweep, sampler="grid", results_dir=tmp_path, estimate_fn=fake_estimate)
    assert result.direction == "minimize"
    assert {r.study_name for r in result.runs} == {f"{result.name}@{i}" for i in sweep.instance_names()}
    best = best_per_instance(result.frame, "minimize")
    assert list(best["usd_per_epoch"]) == sorted(best["usd_per_epoch"])
    for _, row in best.iterrows():
        same = result.frame[(result.frame.instance == row["instance"]) & result.frame.feasible]
        assert row["usd_per_epoch"] == pytest.approx(same["usd_per_epoch"].min())


def test_resume_keeps_trials_and_tops_up_to_the_target(tmp_path):
    sweep = small_sweep()
    first = run_search(sweep, trials=20, study="resume", results_dir=tmp_path, estimate_fn=fake_estimate)
    assert first.runs[0].new_trials == 20
    second = run_search(sweep, trials=35, study="resume", results_dir=tmp_path, estimate_fn=fake_estimate)
    assert second.runs[0].new_trials == 15 and len(second.frame) == 35
    kept = first.frame.set_index("trial")[["batch_size", "seq_len", "value"]]
    assert kept.equals(second.frame.set_index("trial").loc[kept.index, ["batch_size", "seq_len", "value"]])
    again = run_search(sweep, trials=35, study="resume", results_dir=tmp_path, estimate_fn=fake_estimate)
    assert again.runs[0].new_trials == 0


def test_stored_study_opens_with_optuna_and_files_are_written(tmp_path):
    import json

    import pandas as pd

    result = run_search(small_sweep(), trials=15, study="files", results_dir=tmp_path, estimate_fn=fake_estimate)
    url = f"sqlite:///{tmp_path / 'files' / 'study.db'}"
    study = optuna.load_study(study_name="files@ml.p3.16xlarge", storage=url)
    assert len(study.trials) == 15 and all(t.state.name == "COMPLETE" for t in study.trials)
    best = study.best_trial  # optuna applies the constraints itself
    assert best.value == pytest.approx(result.frame[result.frame.feasible].value.max())
    assert {"config", "memory_bytes", "throughput", "cost"} <= set(best.user_attrs)
    assert pd.read_parquet(result.files["parquet"]).shape[0] == 15
    assert pd.read_csv(result.files["csv"]).shape[0] == 15
    summary = json.loads(result.files["json"].read_text())
    assert summary["best_per_instance"][0]["value"] == pytest.approx(best.value)


def test_a_study_name_cannot_be_reused_for_another_search(tmp_path):
    run_search(small_sweep(), trials=3, study="same", results_dir=tmp_path, estimate_fn=fake_estimate)
    other = small_sweep(constraints={"max_memory_fraction": 0.5})
    with pytest.raises(PlannerError, match="--study.*constraints"):
        run_search(other, trials=3, study="same", results_dir=tmp_path, estimate_fn=fake_estimate)


def test_bad_storage_and_study_names(tmp_path):
    with pytest.raises(PlannerError, match="--storage"):
        run_search(small_sweep(), trials=1, storage="nosuchdb://x", results_dir=tmp_path, estimate_fn=fake_estimate)
    with pytest.raises(PlannerError, match="--study"):
        run_search(small_sweep(), trials=1, study="../up", results_dir=tmp_path, estimate_fn=fake_estimate)
    assert safe_url("postgresql://user:secret@host/db") == "postgresql://user:***@host/db"


def test_all_infeasible_is_reported_and_kept(tmp_path):
    sweep = small_sweep(constraints={"max_memory_fraction": 0.01})
    result = run_search(sweep, trials=10, study="none", results_dir=tmp_path, estimate_fn=fake_estimate)
    assert result.all_infeasible and len(result.frame) == 10
    assert all("GiB" in r for r in result.frame.reason)
    assert not math.isnan(result.frame.value.iloc[0])


def test_grid_after_tpe_in_the_same_study_still_covers_every_point(tmp_path):
    sweep = small_sweep()
    run_search(sweep, trials=10, study="mixed", results_dir=tmp_path, estimate_fn=fake_estimate)
    grid = run_search(sweep, sampler="grid", study="mixed", results_dir=tmp_path, estimate_fn=fake_estimate)
    size = grid.runs[0].space.size
    assert grid.runs[0].new_trials == size and len(grid.frame) == size + 10
    again = run_search(sweep, sampler="grid", study="mixed", results_dir=tmp_path, estimate_fn=fake_estimate)
    assert again.runs[0].new_trials == 0


def test_a_space_no_larger_than_the_budget_is_searched_exhaustively(tmp_path):
    tiny = DEFAULT_SWEEP.with_overrides(space={"batch_sizes": [8, 16], "seq_lens": [128], "grad_accums": [1],
                                               "precisions": ["amp-fp16"]})
    result = run_search(tiny, study="tiny", results_dir=tmp_path, estimate_fn=fake_estimate)
    assert result.runs[0].sampler == "grid" and len(result.frame) == 4  # 2 batch sizes × checkpointing on/off
    asked = run_search(tiny, sampler="tpe", trials=6, study="tiny-tpe", results_dir=tmp_path,
                       estimate_fn=fake_estimate)
    assert asked.runs[0].sampler == "tpe" and len(asked.frame) == 6


def test_public_run_search_entry_point(tmp_path):
    import planner.search

    result = planner.search.run_search(small_sweep(), trials=2, study="api", results_dir=tmp_path, estimate_fn=fake_estimate)
    assert len(result.frame) == 2
