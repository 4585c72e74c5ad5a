"""The search machinery: space, recipe, sweep files, objective, sampler and storage (in-process)."""

from __future__ import annotations

import itertools
import math
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
from search_fixtures import fake_estimate

from planner.errors import PlannerError
from planner.hardware import get_instance
from planner.models.catalog import cached_model
from planner.search.objective import SUPPORTED_VIOLATION, Objective
from planner.search.space import SpaceSpec, parse_flag_list, resolve_space, space_from_flags
from planner.search.storage import safe_url
from planner.search.study import run_search
from planner.search.sweep import DEFAULT_SWEEP, Recipe, Sweep, load_sweep, parse_sweep

ROOT = Path(__file__).resolve().parents[1]
SMALL = SpaceSpec(batch_sizes=(4, 16, 64, 256), seq_lens=(128, 512), precisions=("fp32", "amp-fp16"),
                  grad_accums=(1, 4), parallelisms=("ddp",), attentions=("sdpa",), optimizer_impls=("foreach",))
NO_RECIPE = {"global_batch_size": None, "seq_len": None}
BEST_KEYS = {"instance", "instances", "batch_size", "grad_accum", "global_batch_size", "seq_len", "precision",
             "checkpointing", "parallelism", "samples_per_s", "hours_per_job", "usd_per_job"}


def journal(root: Path, name: str) -> optuna.storages.JournalStorage:
    from optuna.storages.journal import JournalFileBackend, JournalStorage

    return JournalStorage(JournalFileBackend(str(root / name / "journal.log")))


def brute_force_optimum(objective: Objective) -> float:
    """Every point of the space evaluated on its own, outside Optuna."""
    dims = objective.space.searched()
    values = []
    for combo in itertools.product(*dims.values()):
        result = objective.evaluate_point(objective.space.point(dict(zip(dims, combo, strict=True))))
        if result.feasible:
            values.append(result.value)
    return max(values) if objective.direction == "maximize" else min(values)


def small_sweep(**updates) -> Sweep:
    recipe = {**NO_RECIPE, **updates.pop("recipe", {})}
    space = {**SMALL.model_dump(), **updates.pop("space", {})}
    return DEFAULT_SWEEP.with_overrides(space=space, recipe=recipe, **updates)


# ------------------------------------------------------------------------------------------- space


def test_default_space_drops_what_no_gpu_of_the_set_can_run():
    model = cached_model("multimodal-bert")
    v100 = resolve_space(SpaceSpec(), model, get_instance("ml.p3.16xlarge"), global_batch_size=64)
    mixed = resolve_space(SpaceSpec(), model, [get_instance("ml.p3.16xlarge"), get_instance("ml.g5.2xlarge")])
    assert "amp-bf16" not in v100.precisions and v100.dropped["precisions"] == ("amp-bf16",)
    assert "flash" not in v100.attentions
    assert "amp-bf16" in mixed.precisions and "flash" in mixed.attentions  # the A10G runs them
    assert max(v100.batch_sizes) == 64  # a micro-batch above the global batch cannot reach it
    assert "grad_accum" not in v100.searched()  # derived from the recipe
    assert set(mixed.searched()) >= {"instance", "batch_size", "precision", "parallelism", "grad_accum"}


def test_accumulation_is_derived_and_an_inexact_global_batch_is_infeasible_with_its_reason():
    model, inst = cached_model("multimodal-bert"), get_instance("ml.p3.16xlarge")  # 8 GPUs
    space = resolve_space(SpaceSpec(seq_lens=(512,)), model, inst, global_batch_size=64)
    objective = Objective(model, inst, space, recipe=Recipe(global_batch_size=64), estimate_fn=fake_estimate)
    assert space.config({"batch_size": 2}).grad_accum == 4  # 2 × 4 × 8 = 64
    point = space.point({"batch_size": 16})  # 16 × 8 = 128 > 64
    assert point.config is None and "64" in point.reason and "128" in point.reason
    calls = objective.evaluations
    result = objective.evaluate_point(point)
    assert not result.feasible and result.constraints["global_batch"] > 0 and "global batch" in result.reason
    assert objective.evaluations == calls  # no estimate for a point that cannot be run
    one_gpu = resolve_space(SpaceSpec(parallelisms=("ddp", "zero3"), seq_lens=(128,)), model,
                            get_instance("ml.g5.xlarge"))
    assert one_gpu.point({"parallelism": "zero3", "batch_size": 8, "grad_accum": 1}).config.parallelism == "single"


def test_explicit_unsupported_values_are_kept_and_recorded_infeasible(tmp_path):
    sweep = small_sweep(space={"precisions": ["amp-bf16", "amp-fp16"], "batch_sizes": [8],
                               "seq_lens": [128], "grad_accums": [1], "checkpointing": [False]})
    result = run_search(sweep, sampler="grid", results_dir=tmp_path, estimate_fn=fake_estimate)
    frame = result.frame.set_index("precision")
    assert len(frame) == 2
    assert not frame.loc["amp-bf16", "feasible"] and "bf16" in frame.loc["amp-bf16", "reason"]
    assert frame.loc["amp-bf16", "constraint_supported"] == SUPPORTED_VIOLATION


def test_seq_lens_beyond_the_model_are_dropped_from_defaults_only():
    model = cached_model("bert-base-uncased")  # 512 positions
    inst = get_instance("ml.g5.xlarge")
    assert max(resolve_space(SpaceSpec(seq_lens=None), model, inst).seq_lens) <= 512
    assert 1024 in resolve_space(SpaceSpec(seq_lens=(512, 1024)), model, inst).seq_lens


def test_min_seq_len_filters_and_names_the_flag():
    model, inst = cached_model("bert-base-uncased"), get_instance("ml.g5.xlarge")
    assert resolve_space(SpaceSpec(), model, inst, min_seq_len=256).seq_lens == (256, 512)
    with pytest.raises(PlannerError, match="--min-seq-len"):
        resolve_space(SpaceSpec(), model, inst, min_seq_len=4096)


@pytest.mark.parametrize(("field", "text", "flag"), [("batch_sizes", "1,x", "--batch-sizes"),
                                                     ("precisions", "fp4", "--precisions"),
                                                     ("checkpointing", "maybe", "--checkpointing"),
                                                     ("optimizer_impls", "magic", "--optimizer-impls")])
def test_space_flag_errors_name_the_flag(field, text, flag):
    with pytest.raises(PlannerError, match=flag):
        parse_flag_list(field, text)


def test_space_flags_parse():
    spec = space_from_flags(batch_sizes="8,4,8", checkpointing="both", precisions="amp-fp16", instance_counts="1,2")
    assert spec.batch_sizes == (8, 4) and spec.checkpointing == (False, True) and spec.instance_counts == (1, 2)


# ------------------------------------------------------------------------------------------- sweeps


@pytest.mark.parametrize("path", sorted((ROOT / "sweeps").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_sweeps_validate(path):
    sweep = load_sweep(path)
    assert sweep.instance_names()


def test_shipped_default_sweep_equals_the_builtin_one():
    sweep = load_sweep(ROOT / "sweeps" / "multimodal-bert-p3.yaml")
    assert sweep.definition() == DEFAULT_SWEEP.definition()
    assert DEFAULT_SWEEP.recipe.global_batch_size == 64 and DEFAULT_SWEEP.recipe.seq_len == 512
    assert DEFAULT_SWEEP.model_options["tab_in"] == 100


@pytest.mark.parametrize(("text", "field"), [
    ("model: nope-model\n", "model"),
    ("space: {batch_sizes: [a]}\n", "space.batch_sizes.0"),
    ("recipe: {global_batch_size: 0}\n", "recipe.global_batch_size"),
    ("recipe: {global_batch_size: 64}\nconstraints: {global_batch_size: 64}\n", "constraints.global_batch_size"),
    ("objective: {target: fastest}\n", "objective.target"),
    ("instance: ml.nope\n", "instance"),
])
def test_sweep_errors_name_the_file_and_the_field(tmp_path, text, field):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(PlannerError, match=field.replace(".", r"\.")) as err:
        load_sweep(path)
    assert str(path) in str(err.value)


def test_instances_all_and_lists():
    assert parse_sweep({"instance": "ml.p3.2xlarge,ml.g5.xlarge"}).instance_names() == ["ml.p3.2xlarge",
                                                                                       "ml.g5.xlarge"]
    from planner.hardware import list_instances

    assert parse_sweep({"instance": "all"}).instance_names() == list_instances()


# ---------------------------------------------------------------------------------------- objective


def test_memory_constraint_is_the_sure_fit_verdict_unless_tight_is_accepted():
    from planner.search.sweep import Constraints

    model, inst = cached_model("multimodal-bert"), get_instance("ml.g5.xlarge")
    gib = 2**30

    def tight(*args, **kwargs):  # the band straddles the GPU's memory: low end under it, high end over
        est = fake_estimate(*args, **kwargs)
        mem = est.gpu_memory_bytes
        return est.model_copy(update={"verdict": "tight", "fits": False, "peak_device_low_bytes": mem - 4 * gib,
                                      "peak_device_high_bytes": mem + gib})

    space = resolve_space(SMALL, model, inst)
    config = space.config({"batch_size": 4, "seq_len": 128, "precision": "amp-fp16", "grad_accum": 1})
    strict = Objective(model, inst, space, estimate_fn=tight).evaluate(config)
    assert not strict.feasible and strict.constraints["memory"] > 0 and "accept-tight" in strict.reason
    loose = Objective(model, inst, space, constraints=Constraints(accept_tight=True), estimate_fn=tight)
    assert loose.evaluate(config).feasible


def test_job_cost_is_dataset_times_epochs_over_samples_per_second():
    model, inst = cached_model("multimodal-bert"), get_instance("ml.p3.16xlarge")
    space = resolve_space(SMALL, model, inst)
    recipe = Recipe(dataset_size=200_000, epochs=2.5)
    objective = Objective(model, inst, space, recipe=recipe, target="cost", estimate_fn=fake_estimate)
    config = space.config({"batch_size": 4, "seq_len": 128, "precision": "amp-fp16", "grad_accum": 1})
    result = objective.evaluate(config)
    est = fake_estimate(model, config, inst)
    hours = 200_000 * 2.5 / est.throughput.samples_per_s / 3600
    assert result.attrs["cost"]["hours_per_job"] == pytest.approx(hours)
    assert result.value == pytest.approx(hours * inst.price_per_hour)
    assert result.attrs["cost"]["usd_per_million_samples"] == pytest.approx(est.cost.usd_per_million_samples)


# ------------------------------------------------------------------------------------ search + store


@pytest.mark.parametrize("estimate", ["fake", "real"])
def test_tpe_finds_the_grid_optimum_on_a_small_space(tmp_path, estimate):
    fn = fake_estimate if estimate == "fake" else None
    sweep = small_sweep()
    model, inst = cached_model(sweep.model), get_instance("ml.p3.16xlarge")
    optimum = brute_force_optimum(Objective(model, inst, resolve_space(sweep.space, model, inst), estimate_fn=fn))
    grid = run_search(sweep, sampler="grid", study="grid", results_dir=tmp_path, estimate_fn=fn)
    tpe = run_search(sweep, sampler="tpe", trials=60, study="tpe", results_dir=tmp_path, estimate_fn=fn)
    size = grid.run.space.size
    assert len(grid.frame) == size == 64
    assert grid.frame[["batch_size", "seq_len", "precision", "checkpointing", "grad_accum"]].drop_duplicates().shape[0] \
        == size
    assert grid.frame[grid.frame.feasible].value.max() == pytest.approx(optimum)
    assert tpe.frame[tpe.frame.feasible].value.max() == pytest.approx(optimum)


def test_one_study_over_instance_types_best_is_the_cheapest_per_job(tmp_path):
    import json

    from planner.search.results import best_per_instance

    sweep = small_sweep(instance=("ml.p3.16xlarge", "ml.p3.2xlarge", "ml.g5.2xlarge"),
                        recipe={"dataset_size": 1_000_000, "epochs": 2})
    result = run_search(sweep, sampler="grid", results_dir=tmp_path, estimate_fn=fake_estimate)
    assert result.target == "cost" and result.direction == "minimize"  # the default with several types
    assert "p3.16xlarge_p3.2xlarge_g5.2xlarge" in result.name
    assert optuna.study.get_all_study_names(journal(tmp_path, result.name)) == [result.name]
    per = best_per_instance(result.frame, "minimize")
    assert list(per["usd_per_job"]) == sorted(per["usd_per_job"]) and len(per) == 3
    for _, row in per.iterrows():
        same = result.frame[(result.frame.instance == row["instance"]) & result.frame.feasible
                            & (result.frame.seq_len == 512)]  # the best are at the longest sequence searched
        assert row["usd_per_job"] == pytest.approx(same["usd_per_job"].min())
    data = json.loads(result.files["json"].read_text())
    assert BEST_KEYS <= set(data["best"]) and all(BEST_KEYS <= set(r) for r in data["best_per_instance"])
    assert data["best"]["usd_per_job"] == pytest.approx(min(r["usd_per_job"] for r in data["best_per_instance"]))
    assert {"study", "storage", "model", "objective", "constraints", "trials", "top", "pareto"} <= set(data)
    for rec in [data["best"], *data["best_per_instance"], *data["top"]]:  # counts stay integers in JSON
        for key in ("instances", "batch_size", "grad_accum", "global_batch_size", "seq_len", "world_size"):
            assert type(rec[key]) is int, (key, rec[key])


def test_counts_stay_integers_when_an_infeasible_trial_left_a_gap():
    """pandas stores a count column holding NaN (an infeasible trial's missing estimate) as floats; the JSON
    records give the counts back as integers and the gaps as null."""
    import pandas as pd

    from planner.search.results import _records

    frame = pd.DataFrame({"world_size": [8, None], "global_batch_size": [64, None], "mfu": [0.5, None]})
    assert frame["world_size"].dtype == float
    assert _records(frame, ["world_size", "global_batch_size", "mfu"]) == [
        {"world_size": 8, "global_batch_size": 64, "mfu": 0.5},
        {"world_size": None, "global_batch_size": None, "mfu": None}]
    assert type(_records(frame, ["world_size"])[0]["world_size"]) is int


def test_instance_count_is_searched_and_priced_per_instance(tmp_path):
    sweep = small_sweep(space={**SMALL.model_dump(), "instance_counts": [1, 2]},
                        recipe={"dataset_size": 100_000}, objective={"target": "time"})
    result = run_search(sweep, sampler="grid", results_dir=tmp_path, estimate_fn=fake_estimate)
    ok = result.frame[result.frame.feasible]
    assert set(ok.instances) == {1, 2}
    two = ok[ok.instances == 2].iloc[0]
    assert two.price_per_hour == pytest.approx(2 * get_instance("ml.p3.16xlarge").price_per_hour)
    assert two.world_size == 16
    assert result.frame[result.frame.feasible].value.min() == pytest.approx(ok.hours_per_job.min())


def test_pareto_objective_returns_a_non_dominated_front(tmp_path):
    import json

    sweep = small_sweep(instance=("ml.p3.2xlarge", "ml.g5.2xlarge"), recipe={"dataset_size": 100_000},
                        objective={"target": "pareto"})
    result = run_search(sweep, trials=40, results_dir=tmp_path, estimate_fn=fake_estimate)
    assert result.directions == ["minimize", "minimize"]
    front = json.loads(result.files["json"].read_text())["pareto"]["time_vs_cost"]
    ok = result.frame[result.frame.feasible]
    assert front
    for p in front:
        assert not any((r.hours_per_job <= p["hours_per_job"]) and (r.usd_per_job <= p["usd_per_job"])
                       and (r.hours_per_job < p["hours_per_job"] or r.usd_per_job < p["usd_per_job"])
                       for r in ok.itertuples())


def test_a_list_of_sequence_lengths_reports_the_best_at_the_longest(tmp_path):
    import json

    sweep = small_sweep(space={**SMALL.model_dump(), "seq_lens": None}, recipe={"seq_len": [128, 512]})
    result = run_search(sweep, sampler="grid", results_dir=tmp_path, estimate_fn=fake_estimate)
    data = json.loads(result.files["json"].read_text())
    assert data["best"]["seq_len"] == 512
    assert {r["seq_len"] for r in data["pareto"]["throughput_vs_seq_len"]} == {128, 512}


def test_resume_keeps_trials_and_tops_up_to_the_target(tmp_path):
    sweep = small_sweep()
    first = run_search(sweep, trials=20, study="resume", results_dir=tmp_path, estimate_fn=fake_estimate)
    assert first.run.new_trials == 20
    second = run_search(sweep, trials=35, study="resume", results_dir=tmp_path, estimate_fn=fake_estimate)
    assert second.run.new_trials == 15 and len(second.frame) == 35
    kept = first.frame.set_index("trial")[["batch_size", "seq_len", "value"]]
    assert kept.equals(second.frame.set_index("trial").loc[kept.index, ["batch_size", "seq_len", "value"]])
    again = run_search(sweep, trials=35, study="resume", results_dir=tmp_path, estimate_fn=fake_estimate)
    assert again.run.new_trials == 0


def test_stored_study_opens_with_optuna_and_files_are_written(tmp_path):
    import json

    import pandas as pd

    result = run_search(small_sweep(), trials=15, study="files", results_dir=tmp_path, estimate_fn=fake_estimate)
    study = optuna.load_study(study_name="files", storage=journal(tmp_path, "files"))
    assert len(study.trials) == 15 and all(t.state.name == "COMPLETE" for t in study.trials)
    best = study.best_trial  # optuna applies the constraints itself
    assert best.value == pytest.approx(result.frame[result.frame.feasible].value.max())
    assert {"config", "memory_bytes", "throughput", "cost"} <= set(best.user_attrs)
    assert pd.read_parquet(result.files["parquet"]).shape[0] == 15
    assert pd.read_csv(result.files["csv"]).shape[0] == 15
    summary = json.loads(result.files["json"].read_text())
    assert summary["top"][0]["value"] == pytest.approx(best.value)
    assert not list((tmp_path / "files").glob("*.tmp"))


def test_sqlite_storage_works_too(tmp_path):
    url = f"sqlite:///{tmp_path / 'x.db'}"
    result = run_search(small_sweep(), trials=5, study="sq", storage=url, results_dir=tmp_path,
                        estimate_fn=fake_estimate)
    assert len(optuna.load_study(study_name="sq", storage=url).trials) == 5 == len(result.frame)


def test_a_study_name_cannot_be_reused_for_another_search(tmp_path):
    run_search(small_sweep(), trials=3, study="same", results_dir=tmp_path, estimate_fn=fake_estimate)
    other = small_sweep(constraints={"max_memory_fraction": 0.5})
    with pytest.raises(PlannerError, match="--study.*constraints"):
        run_search(other, trials=3, study="same", results_dir=tmp_path, estimate_fn=fake_estimate)


def test_a_study_resumed_by_another_build_of_planner_is_refused(tmp_path, monkeypatch):
    """Trials estimated by an older planner (another memory or speed model) are not ranked against new ones;
    the build is a digest of the package's code and data, so it is the same within one checkout."""
    from planner.build import estimator_build
    from planner.search import study as study_mod

    assert estimator_build() == estimator_build() and len(estimator_build()) == 12
    run_search(small_sweep(), trials=3, study="old", results_dir=tmp_path, estimate_fn=fake_estimate)
    run_search(small_sweep(), trials=4, study="old", results_dir=tmp_path, estimate_fn=fake_estimate)  # same build
    monkeypatch.setattr(study_mod, "estimator_build", lambda: "0123456789ab")
    with pytest.raises(PlannerError, match="--study.*another build of planner"):
        run_search(small_sweep(), trials=5, study="old", results_dir=tmp_path, estimate_fn=fake_estimate)


def test_a_results_dir_no_one_can_create_names_the_flag():
    """/proc takes no new folders, for root either (whom permission checks let through)."""
    with pytest.raises(PlannerError, match="--results-dir.*/proc/planner-nope"):
        run_search(small_sweep(), trials=1, results_dir="/proc/planner-nope", estimate_fn=fake_estimate)


def test_different_instance_sets_never_share_results(tmp_path):
    one = run_search(small_sweep(), trials=3, results_dir=tmp_path, estimate_fn=fake_estimate)
    two = run_search(small_sweep(instance="ml.p3.16xlarge,ml.g5.xlarge"), trials=3, results_dir=tmp_path,
                     estimate_fn=fake_estimate)
    assert one.name != two.name and one.results_dir != two.results_dir
    assert "p3.16xlarge" in one.name and "g5.xlarge" in two.name


def test_bad_storage_and_study_names_leave_no_empty_files(tmp_path):
    with pytest.raises(PlannerError, match="--storage"):
        run_search(small_sweep(), trials=1, storage="nosuchdb://x", results_dir=tmp_path, estimate_fn=fake_estimate)
    with pytest.raises(PlannerError, match="--study"):
        run_search(small_sweep(), trials=1, study="../up", results_dir=tmp_path, estimate_fn=fake_estimate)
    assert safe_url("postgresql://user:secret@host/db") == "postgresql://user:***@host/db"
    (tmp_path / "fresh").mkdir()
    db = tmp_path / "fresh" / "s.db"

    def boom(*args, **kwargs):
        raise RuntimeError("a bug in an estimate")

    with pytest.raises(RuntimeError):
        run_search(small_sweep(), trials=1, study="b", storage=f"sqlite:///{db}", results_dir=tmp_path,
                   estimate_fn=boom)
    assert db.exists()  # the failed trial is kept as evidence
    with pytest.raises(PlannerError, match="fixed"):  # fails after opening its storage: nothing is left
        run_search(small_sweep(fixed={"bucket_cap_mb": -1}), trials=1, study="c", results_dir=tmp_path,
                   estimate_fn=fake_estimate)
    assert not (tmp_path / "c").exists()


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
    size = grid.run.space.size
    covered = grid.frame[["batch_size", "seq_len", "precision", "checkpointing", "grad_accum"]].drop_duplicates()
    assert len(covered) == size and len(grid.frame) <= size + 10
    again = run_search(sweep, sampler="grid", study="mixed", results_dir=tmp_path, estimate_fn=fake_estimate)
    assert again.run.new_trials == 0


def test_a_space_no_larger_than_the_budget_is_searched_exhaustively(tmp_path):
    tiny = small_sweep(space={"batch_sizes": [8, 16], "seq_lens": [128], "grad_accums": [1],
                              "precisions": ["amp-fp16"], "parallelisms": ["ddp"], "attentions": ["sdpa"],
                              "optimizer_impls": ["foreach"]})
    result = run_search(tiny, study="tiny", results_dir=tmp_path, estimate_fn=fake_estimate)
    assert result.run.sampler == "grid" and len(result.frame) == 4  # 2 batch sizes × checkpointing on/off
    asked = run_search(tiny, sampler="tpe", trials=6, study="tiny-tpe", results_dir=tmp_path,
                       estimate_fn=fake_estimate)
    assert asked.run.sampler == "tpe" and len(asked.frame) == 6


def test_public_run_search_entry_point(tmp_path):
    import planner.search

    result = planner.search.run_search(small_sweep(), trials=2, study="api", results_dir=tmp_path,
                                       estimate_fn=fake_estimate)
    assert len(result.frame) == 2


def test_search_modules_import_without_a_loop_and_cost_without_the_aws_client():
    code = ("import sys; import planner.search.pareto, planner.search.results; "
            "from planner.estimate import estimate; from planner.spec import TrainConfig; "
            "estimate('bert-base-uncased', TrainConfig(batch_size=8, seq_len=128), 'ml.g5.xlarge', dataset_size=10); "
            "assert 'planner.search.study' not in sys.modules; assert 'planner.aws.pricing' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def test_the_sweeps_stack_reaches_every_estimate(tmp_path):
    seen = []

    def recording(*args, **kwargs):
        seen.append(kwargs.get("stack"))
        return fake_estimate(*args, **kwargs)

    sweep = small_sweep(stack={"torch": "2.8", "alloc_conf": "expandable_segments:True"})
    run_search(sweep, trials=3, results_dir=tmp_path, estimate_fn=recording)
    assert seen and all(s == {"torch": "2.8", "alloc_conf": "expandable_segments:True"} for s in seen)
    with pytest.raises(PlannerError, match="torch"):
        parse_sweep({"stack": {"torch": "0.1"}}, "x.yaml")
