"""Each type of a multi-type study descends from its start to what a search of that type alone finds
(planner.search.local), and the descent is recorded as ordinary trials of the study."""

from __future__ import annotations

import itertools

import optuna
import pytest
from search_fixtures import fake_estimate

from planner.search.local import BATCH, descend, moves
from planner.search.study import run_search
from planner.search.sweep import DEFAULT_SWEEP

PARAMETERS = {
    "instance": ("a", "b"),
    BATCH: (0, 1, 2, 3, 4),
    "checkpointing": (False, True),
    "precision": ("fp32", "amp"),
}


def _toy(p: dict) -> float | None:
    """Time per job (minimise): larger batches and AMP are faster, checkpointing costs 5 %; memory allows
    batch index 1 (fp32) / 2 (AMP) without checkpointing and two more with it."""
    limit = (1 if p["precision"] == "fp32" else 2) + (2 if p["checkpointing"] else 0)
    if p[BATCH] > limit:
        return None
    return (10.0 - p[BATCH]) * (1.0 if p["precision"] == "amp" else 2.0) * (1.05 if p["checkpointing"] else 1.0)


def test_moves_keep_the_instance_search_the_whole_batch_line_and_pair_a_setting_with_the_next_batches():
    p = {"instance": "a", BATCH: 2, "checkpointing": False, "precision": "fp32"}
    got = moves(p, PARAMETERS)
    assert all(m["instance"] == "a" for m in got)
    assert {m[BATCH] for m in got if m["checkpointing"] is False and m["precision"] == "fp32"} == {0, 1, 3, 4}
    assert [m[BATCH] for m in got if m["checkpointing"] is True] == [2, 1, 3]
    assert len({tuple(sorted(m.items())) for m in got}) == len(got) == 4 + 3 + 3


def test_descent_reaches_an_optimum_that_needs_a_setting_and_a_larger_batch_together():
    # the optimum (AMP, checkpointing, batch 4) is two changes away from (AMP, batch 2): checkpointing at
    # batch 2 alone is slower, so only the paired move finds it
    start = {"instance": "b", BATCH: 0, "checkpointing": False, "precision": "fp32"}
    path = descend(start, PARAMETERS, _toy)
    points = [dict(zip(PARAMETERS, v, strict=True)) for v in itertools.product(*PARAMETERS.values())]
    optimum = min(s for p in points if p["instance"] == "b" and (s := _toy(p)) is not None)
    assert path[0] == start and _toy(path[-1]) == optimum == pytest.approx(6 * 1.05)
    assert all(p["instance"] == "b" for p in path)
    scores = [_toy(p) for p in path]
    assert all(later < earlier for earlier, later in itertools.pairwise(scores))  # every move improves


def test_an_infeasible_start_is_its_own_path():
    start = {"instance": "a", BATCH: 4, "checkpointing": False, "precision": "fp32"}
    assert descend(start, PARAMETERS, _toy) == [start]


TYPES = ("ml.p3.2xlarge", "ml.g4dn.xlarge", "ml.g5.12xlarge", "ml.p3.16xlarge")


def test_each_type_of_a_joint_search_is_as_good_as_the_best_point_of_that_type(tmp_path, monkeypatch):
    """With a budget that holds only the starts and descents (no TPE trial), every type's best in the joint
    study is the best point of its own space, enumerated here (toy estimate). The starts are made poor (fp32,
    which the toy runs at half the AMP speed) so that only the descent can get there."""
    from planner.search import study
    from planner.search.study import _descents, start_points

    monkeypatch.setitem(study.START_PREFERENCES, "precision", ("fp32",))

    sweep = DEFAULT_SWEEP.with_overrides(instance=TYPES, objective={"target": "cost"})
    obj = _objective(sweep)
    recorded = len(_descents(obj.space, obj, start_points(obj.space, obj)))
    result = run_search(sweep, trials=recorded, results_dir=tmp_path, estimate_fn=fake_estimate, write_files=False)
    frame = result.frame
    assert len(frame) == recorded > len(TYPES)
    assert list(frame.instance[: len(TYPES)]) == list(TYPES)  # the starts come first
    joint = frame[frame.feasible].groupby("instance")["value"].min()
    space = obj.space
    names = list(space.parameters())
    for name in TYPES:
        best = min(r.value for combo in itertools.product(*space.parameters().values())
                   if (p := dict(zip(names, combo, strict=True)))["instance"] == name
                   and (r := obj.evaluate_point(space.point(space.decode(p)))).feasible)
        assert joint[name] == pytest.approx(best)


def _objective(sweep):
    from planner.hardware import get_instance
    from planner.models.catalog import cached_model
    from planner.search.objective import Objective
    from planner.search.space import resolve_space

    model = cached_model(sweep.model, sweep.model_options)
    types = [get_instance(n) for n in sweep.instance_names()]
    space = resolve_space(sweep.seq_space(), model, types, fixed=sweep.fixed,
                          global_batch_size=sweep.recipe.global_batch_size)
    return Objective(model, types, space, constraints=sweep.constraints, objective=sweep.objective,
                     recipe=sweep.recipe, target=sweep.target(), estimate_fn=fake_estimate)


def test_a_recorded_trial_is_the_trial_the_objective_would_have_made(tmp_path):
    """Same parameters, distributions, values, constraints and evidence as a trial TPE runs through the
    objective: TPE learns from both alike and the results table cannot tell them apart."""
    from planner.search.study import _record

    sweep = DEFAULT_SWEEP.with_overrides(instance=TYPES[:2], objective={"target": "cost"})
    obj = _objective(sweep)
    params = {name: choices[-1] for name, choices in obj.space.parameters().items()}
    params["instance"] = TYPES[0]
    recorded = _record(obj, obj.space, params)
    study = optuna.create_study(directions=obj.directions)
    study.enqueue_trial(params)
    study.optimize(obj, n_trials=1)
    ran = study.trials[0]
    assert recorded.params == ran.params and recorded.distributions == ran.distributions
    assert recorded.values == ran.values and recorded.constraints == ran.constraints
    assert recorded.user_attrs == ran.user_attrs and recorded.state == ran.state


def test_unpriced_types_are_listed_as_unpriced_not_as_unable_to_run(tmp_path):
    from planner.cli.search_cmd import _missing_lines
    from planner.search.study import Start

    result = run_search(DEFAULT_SWEEP.with_overrides(instance=TYPES[:2], objective={"target": "cost"}), trials=2,
                        results_dir=tmp_path, estimate_fn=fake_estimate, write_files=False)
    for row in result.rows:
        row["feasible"] = row["feasible"] and row["instance"] != TYPES[1]
    result.run.starts[1] = Start(TYPES[1], result.run.starts[1].params, False,
                                 f"no price for {TYPES[1]}, so no cost to minimise")
    lines = _missing_lines(result, list(TYPES[:2]))
    assert len(lines) == 1 and lines[0].startswith("unpriced here, so not ranked by $ per job (1 type;")
    assert lines[0].endswith(": g4dn.xlarge")


def test_ctrl_c_during_the_descents_keeps_what_they_recorded(tmp_path, monkeypatch):
    from planner.search import study
    from planner.search.study import SearchInterrupted

    real, calls = study._record, []

    def record(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # the second type's start
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(study, "_record", record)
    with pytest.raises(SearchInterrupted) as stop:
        run_search(DEFAULT_SWEEP.with_overrides(instance=TYPES[:2]), trials=50, study="t", results_dir=tmp_path,
                   estimate_fn=fake_estimate)
    assert stop.value.finished == 1 and list(stop.value.result.frame.instance) == [TYPES[0]]
    assert (tmp_path / "t" / "trials.csv").exists()
