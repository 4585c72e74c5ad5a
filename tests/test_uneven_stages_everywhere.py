"""Uneven pipeline stages (issue 35) in every command: `planner search` holds --first-stage-layers,
--last-stage-layers, --account-for-embedding, --account-for-loss and --pp-layout for every trial, a sweep file
takes them under `fixed:`, the search proposes pipeline degrees by the searched framework's own split, and the
probe runs the split the estimate modelled (or refuses it with one line)."""

from __future__ import annotations

from pathlib import Path

import pytest

from planner.hardware import get_instance

ROOT = Path(__file__).resolve().parents[1]
P5 = get_instance("ml.p5.48xlarge")
LLAMA_70B = str(ROOT / "tests" / "data" / "llama-3-70b.json")  # 80 layers


def _space(frameworks: tuple[str, ...] | None = None, fixed: dict | None = None):
    from planner.models.catalog import get_model
    from planner.search.space import SpaceSpec, resolve_space

    return resolve_space(SpaceSpec(instance_counts=(1, 2, 4), frameworks=frameworks), get_model(LLAMA_70B), [P5],
                         global_batch_size=64, fixed=fixed)


def test_default_pipeline_degrees_divide_the_layers():
    """--framework pytorch (the default) and Megatron without the uneven flags: the divisors of 80 up to 16, as
    before issue 35's search change (the 70B search benchmark's space stays the same)."""
    divisors = tuple(d for d in range(1, 17) if 80 % d == 0)
    assert _space().pp_sizes == divisors
    assert _space(("megatron",)).pp_sizes == divisors


@pytest.mark.parametrize("framework", ["torchtitan", "nemo-automodel"])
def test_splitters_that_place_leftover_layers_search_every_degree(framework):
    """torchtitan's and NeMo AutoModel's splitters give the first stages one layer more, so every degree up to
    16 is a candidate, and a point at pp 3 (80 = 27 + 27 + 26) is a configuration, not an infeasible row."""
    space = _space((framework,))
    assert space.pp_sizes == tuple(range(1, 17))
    point = space.point({"instance": P5.name, "instances": 3, "tp": 8, "pp": 3, "batch_size": 1, "seq_len": 512,
                         "parallelism": "fsdp", "framework": framework})
    assert point.config is not None, point.reason
    even = _space().point({"instance": P5.name, "instances": 3, "tp": 8, "pp": 3, "batch_size": 1, "seq_len": 512,
                           "parallelism": "fsdp"})
    assert even.config is None and "evenly" in even.reason


def test_megatron_degrees_follow_the_fixed_uneven_flags():
    """Megatron with --first-stage-layers 2 --last-stage-layers 2: the other 76 layers split equally over the
    pp - 2 middle ranks (get_num_layers_to_build); with both account-for flags 80 + 2 layers divide pp."""
    space = _space(("megatron",), {"first_stage_layers": 2, "last_stage_layers": 2})
    assert space.pp_sizes == (1, *(p for p in range(3, 17) if 76 % (p - 2) == 0))
    assert space.fixed["first_stage_layers"] == 2
    space = _space(("megatron",), {"account_for_embedding": True, "account_for_loss": True})
    assert space.pp_sizes == (1, *(p for p in range(2, 17) if 82 % p == 0))


def test_a_search_holds_the_flags_for_every_trial(tmp_path):
    """`search --framework megatron --pp 4 --first-stage-layers 14 --last-stage-layers 22`: the flags land in
    the sweep's fixed fields, and the trial's TrainConfig carries them (its estimate splits 14, 22, 22, 22)."""
    import planner.cli.main  # noqa: F401 - registers estimate, whose flags the search takes
    from planner.cli.job_flags import sweep_updates
    from planner.cli.search_cmd import build_sweep
    from planner.estimate import estimate

    space: dict = {}
    held = sweep_updates({"framework": "megatron", "pp": 4, "first_stage_layers": 14, "last_stage_layers": 22,
                          "parallelism": "ddp", "batch_size": "1", "precision": "bf16"}, space)
    sw = build_sweep(sweep_file=None, model=LLAMA_70B, model_options=None, instance="ml.p5.48xlarge", nodes=4,
                     space=space, constraints={}, objective={}, search={}, held=held,
                     recipe={"global_batch_size": 64, "seq_len": 4096})
    assert sw.fixed["first_stage_layers"] == 14 and sw.fixed["last_stage_layers"] == 22
    from planner.models.catalog import get_model
    from planner.search.space import resolve_space

    space_ = resolve_space(sw.seq_space(), get_model(LLAMA_70B), [P5], fixed=sw.fixed,
                           global_batch_size=sw.recipe.global_batch_size)
    point = space_.point({"instance": P5.name, "instances": 4, "batch_size": 1, "seq_len": 4096})
    assert point.config is not None, point.reason
    assert (point.config.first_stage_layers, point.config.last_stage_layers, point.config.pp) == (14, 22, 4)
    est = estimate(LLAMA_70B, point.config, P5.name, with_throughput=False, calibration={})
    assert [len(s.layers) for s in est.parallel.stages] == [14, 22, 22, 22]


def test_a_sweep_file_takes_them_under_fixed(tmp_path):
    """`fixed: {framework: megatron, pp: 4, pp_layout: ...}` in a sweep file reaches the trial's TrainConfig."""
    from planner.search.sweep import load_sweep

    path = tmp_path / "uneven.yaml"
    path.write_text(f"model: {LLAMA_70B}\ninstance: ml.p5.48xlarge\nfixed:\n  framework: megatron\n  pp: 4\n"
                    "  pp_layout: 'Et*14|t*22|t*22|t*22L'\n  account_for_loss: false\n")
    sw = load_sweep(path)
    assert sw.fixed["pp_layout"] == "Et*14|t*22|t*22|t*22L"
    from planner.estimate import estimate
    from planner.models.catalog import get_model
    from planner.search.space import resolve_space

    space = resolve_space(sw.seq_space(), get_model(LLAMA_70B), [P5], fixed=sw.fixed, global_batch_size=64)
    point = space.point({"instance": P5.name, "instances": 4, "batch_size": 1, "seq_len": 4096,
                         "parallelism": "ddp", "precision": "bf16"})
    assert point.config is not None and point.config.pp_layout == "Et*14|t*22|t*22|t*22L", point.reason
    est = estimate(LLAMA_70B, point.config, P5.name, with_throughput=False, calibration={})
    assert [len(s.layers) for s in est.parallel.stages] == [14, 22, 22, 22]
