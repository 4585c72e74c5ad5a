"""The last TPE trials try one-setting changes to the leading instance types' best points (planner.search.polish)."""

from __future__ import annotations

from planner.search.polish import neighbours, polish_points, polish_reserve

PARAMETERS = {
    "instance": ("a", "b", "c"),
    "batch_size_index": (0, 1, 2, 3),
    "precision": ("fp32", "amp-fp16"),
}


def test_neighbours_change_one_setting_and_step_ordered_ones_by_one():
    p = {"instance": "a", "batch_size_index": 0, "precision": "fp32"}
    got = neighbours(p, PARAMETERS)
    assert {"instance": "b", "batch_size_index": 0, "precision": "fp32"} in got
    assert {"instance": "a", "batch_size_index": 1, "precision": "fp32"} in got
    assert {"instance": "a", "batch_size_index": 0, "precision": "amp-fp16"} in got
    assert len(got) == 2 + 1 + 1  # two other instances, one batch step (no index -1), one other precision
    for n in got:
        assert sum(n[k] != p[k] for k in p) == 1


def test_polish_takes_the_leading_types_interleaved_and_skips_what_was_tried():
    values = {("a", 3, "amp-fp16"): 1.0, ("b", 1, "fp32"): 2.0, ("c", 0, "fp32"): 3.0, ("a", 2, "amp-fp16"): 1.5}
    tried = [dict(zip(PARAMETERS, k, strict=True)) for k in values] + [{"instance": "c", "batch_size_index": 3,
                                                          "precision": "fp32"}]

    def score(p):
        return values.get((p["instance"], p["batch_size_index"], p["precision"]))  # None: infeasible

    out = polish_points(tried, PARAMETERS, score, limit=100)
    keys = [(p["instance"], p["batch_size_index"], p["precision"]) for p in out]
    assert len(keys) == len(set(keys)) and not set(keys) & set(values)
    # only the best points of the two best types (a at 1.0, b at 2.0), alternating between them
    a_best = {"instance": "a", "batch_size_index": 3, "precision": "amp-fp16"}
    b_best = {"instance": "b", "batch_size_index": 1, "precision": "fp32"}
    untried = [[n for n in neighbours(best, PARAMETERS) if (n["instance"], n["batch_size_index"], n["precision"])
                not in values] for best in (a_best, b_best)]
    assert out[0] == untried[0][0] and out[1] == untried[1][0] and out[2] == untried[0][1]
    assert sorted(map(str, out)) == sorted(map(str, untried[0] + untried[1]))
    assert polish_points(tried, PARAMETERS, score, limit=3) == out[:3]
    assert polish_points(tried, PARAMETERS, lambda p: None, limit=10) == []  # nothing feasible: nothing to polish


def test_reserve_is_a_small_share_of_the_budget():
    assert polish_reserve(116) == 16
    assert polish_reserve(20) == 4
    assert polish_reserve(3) == 0


def test_a_tpe_search_ends_with_one_setting_changes_to_its_best_points(tmp_path):
    """The last polish_reserve(budget) trials of a real TPE search are untried neighbours of the best point,
    before them, of one of the two leading instance types."""
    from planner.search.study import run_search
    from planner.search.sweep import DEFAULT_SWEEP

    sweep = DEFAULT_SWEEP.with_overrides(instance=("ml.p3.2xlarge", "ml.g5.12xlarge"), objective={"target": "cost"})
    budget = 40
    result = run_search(sweep, trials=budget, results_dir=tmp_path, sampler="tpe", write_files=False)
    trials = sorted(result.run.trials, key=lambda t: t.number)
    assert len(trials) == budget
    reserve = polish_reserve(budget)
    head, tail = trials[:-reserve], trials[-reserve:]
    parameters = result.run.space.parameters()
    before = [t.params for t in head]
    frame = result.frame.set_index("trial")
    feasible = [t for t in head if frame.loc[t.number, "feasible"]]
    best: dict[str, object] = {}
    for t in sorted(feasible, key=lambda t: frame.loc[t.number, "usd_per_job"]):
        best.setdefault(t.params["instance"], t.params)
    leaders = list(best.values())[:2]
    for t in tail:
        assert t.params not in before
        assert any(t.params in neighbours(p, parameters) for p in leaders)
