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


def test_a_first_stage_of_no_layers_is_a_given_split():
    """--first-stage-layers 0 (a first rank without a decoder layer) is a split the search places and a probe
    refuses, though `0 in (None, False)` holds in Python: the 80 layers divide over the other pp - 1 ranks."""
    from planner.errors import PlannerError
    from planner.probes.spec import check_split
    from planner.spec import TrainConfig

    assert _space(("megatron",), {"first_stage_layers": 0}).pp_sizes == (
        1, *(p for p in range(2, 17) if 80 % (p - 1) == 0))
    with pytest.raises(PlannerError, match="--first-stage-layers"):
        check_split(TrainConfig(batch_size=1, seq_len=128, framework="megatron", pp=5, first_stage_layers=0))


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


# ---- probe -----------------------------------------------------------------------------------------------

MEGATRON_ARGS = ["--framework", "megatron", "--parallelism", "ddp", "--pp", "4"]


@pytest.mark.parametrize("command", ["run", "launch"])
@pytest.mark.parametrize("args,flag", [
    (["--first-stage-layers", "14", "--last-stage-layers", "22"], "--first-stage-layers"),
    (["--last-stage-layers", "20"], "--last-stage-layers"),
    (["--account-for-embedding", "--account-for-loss"], "--account-for-embedding"),
    (["--account-for-loss"], "--account-for-loss"),
    (["--pp-layout", "Et*14|t*22|t*22|t*22L"], "--pp-layout"),
])
def test_probe_refuses_megatrons_split_in_one_line(command, args, flag, tmp_path, monkeypatch):
    """The probe job runs torch.distributed.pipelining stages, not Megatron-Core: a probe asked for Megatron's
    split says so, naming the flag, exit 2, and writes nothing (rather than measuring an even split)."""
    from typer.testing import CliRunner

    from planner.cli.main import app

    monkeypatch.setenv("PLANNER_RESULTS_DIR", str(tmp_path / "results"))
    res = CliRunner().invoke(app, ["probe", command, "--model", LLAMA_70B, "--instance", "ml.p5.48xlarge",
                                   "--instances", "4", "--batch-size", "1", "--seq-len", "4096", *MEGATRON_ARGS,
                                   *args, *(["--dry-run"] if command == "launch" else [])])
    assert res.exit_code == 2, res.output
    assert flag in res.output and "Megatron-Core" in res.output and "Traceback" not in res.output
    assert len(res.output.strip().splitlines()) == 1
    assert not (tmp_path / "results").exists() or not any((tmp_path / "results").rglob("*.json"))


def _tiny(tmp_path, layers: int):
    import json

    from planner.models.catalog import get_model

    cfg = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 128, "hidden_size": 64,
           "intermediate_size": 128, "num_hidden_layers": layers, "num_attention_heads": 4,
           "num_key_value_heads": 2, "max_position_embeddings": 64, "tie_word_embeddings": False}
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(cfg))
    return get_model(str(path))


@pytest.mark.parametrize("framework,layers,pp,vp,expected", [
    # NeMo AutoModel: layers // stages each, the first layers % stages one more
    ("nemo-automodel", 3, 2, 1, (2, 1)),
    # torchtitan: (layers + 2) // stages, the first (layers + 2) % stages one more, less the embedding and head
    ("torchtitan", 3, 2, 1, (2, 1)),
    ("torchtitan", 4, 2, 2, (1, 2, 1, 0)),  # the last chunk holds only the norm and the head
    ("pytorch", 4, 2, 1, ()),  # an even split travels as nothing: the request's id stays what it was
])
def test_a_probe_request_carries_the_frameworks_split(framework, layers, pp, vp, expected, tmp_path):
    from planner.parallel.frameworks import get as framework_record
    from planner.parallel.layer_split import chunk_layers
    from planner.probes.spec import make_request
    from planner.spec import TrainConfig

    spec = _tiny(tmp_path, layers)
    cfg = TrainConfig(batch_size=2, seq_len=16, pp=pp, vp=vp, grad_accum=2, parallelism="fsdp", framework=framework,
                      pp_schedule="interleaved-1f1b" if vp > 1 else None)
    req = make_request(spec, cfg, "ml.g5.12xlarge", with_estimate=False)
    assert req.stage_layers == expected
    if expected:  # the same split the estimate's layout record uses
        assert expected == chunk_layers(framework_record(framework).pipeline_split, layers, pp, vp)


def test_the_job_builds_its_stages_from_the_requests_split():
    from tests.module_files import load_module

    layout_mod = load_module("parallel_layout_uneven", ROOT / "jobs" / "parallel_layout.py")
    lay = layout_mod.layout_of({"pp": 2, "parallelism": "ddp"}, 2, [1, 3])
    assert layout_mod.stage_layers(4, lay) == [[0], [1, 2, 3]]
    lay = layout_mod.layout_of({"pp": 2, "vp": 2, "parallelism": "fsdp"}, 2, [1, 2, 1, 0])
    assert layout_mod.stage_layers(4, lay) == [[0], [1, 2], [3], []]
    assert layout_mod.stage_layers(4, layout_mod.layout_of({"pp": 2, "parallelism": "ddp"}, 2)) == [[0, 1], [2, 3]]
    with pytest.raises(layout_mod.LayoutError, match="pp × vp = 2"):
        layout_mod.layout_of({"pp": 2, "parallelism": "ddp"}, 2, [1, 1, 2])
    with pytest.raises(layout_mod.LayoutError, match="the model has 4"):
        layout_mod.stage_layers(4, layout_mod.layout_of({"pp": 2, "parallelism": "ddp"}, 2, [1, 2]))


@pytest.mark.slow
def test_an_uneven_pipeline_runs_and_matches_the_plain_model(tmp_path):
    """Two gloo processes on CPU, stages of 1 and 3 layers of the 4-layer tiny Llama: each rank holds its
    layers, and the last stage's loss is the plain model's (the split moves work, not the maths)."""
    from tests.test_probe_parallel import expected_local_count, reference_losses, request, run_probe

    spec = _tiny(tmp_path, 4)
    req = {**request(spec, 2, pp=2, grad_accum=2, parallelism="ddp"), "stage_layers": [1, 3]}
    result = run_probe(req, tmp_path, 29561)
    first, last = sorted(result["ranks"], key=lambda r: r["coordinates"]["pp"])
    assert first["stage_layers"] == [[0]] and last["stage_layers"] == [[1, 2, 3]]
    assert first["local_parameter_count"] == expected_local_count([0], True, False, 1, 0, 1, 0)
    assert last["local_parameter_count"] == expected_local_count([1, 2, 3], False, True, 1, 0, 1, 0)
    assert last["losses"] == pytest.approx(reference_losses(spec, rows=4), rel=1e-5)
