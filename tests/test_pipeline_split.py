"""Uneven pipeline stages (issue 35): planner.parallel.layer_split against each framework's own split function,
transcribed below line for line from its source (none of Megatron-Core, torchtitan or NeMo AutoModel is
installed here), the per-stage parameters against a DeepSeek-V3 module built on the meta device, and the
flags' bad input.

- NeMo AutoModel: nemo_automodel/components/distributed/pipelining/functional.py generate_hf_model_fqn_per_model_part
  (NVIDIA-NeMo/Automodel @cb9765441e5127b8100879ca1f7ff5920f825887, lines 97-178; the same split logic at
  @89e3a9fdd604bc3e70240f2fe4c6a9e1ce76cbd0, the commit that published the DeepSeek-V3 rows);
- torchtitan: torchtitan/distributed/pipeline_parallel.py generate_llm_fqn_per_model_part (pytorch/torchtitan
  @fb3b230e2a050885057a1a02f167658b0cb6c5ac);
- Megatron-Core: megatron/core/transformer/transformer_block.py get_num_layers_to_build and
  transformer_layer.py get_transformer_layer_offset (NVIDIA/Megatron-LM @d98e8a64dd): the uneven first/last
  and the embedding / loss accounting branches; pipeline_parallel_layer_layout.py PipelineParallelLayerLayout
  (parse_str_to_list, the 1-D to 2-D layout, get_num_layers_to_build, get_layer_offset).
"""

from __future__ import annotations

import json
import re

import pytest

from planner.errors import PlannerError
from planner.parallel.layer_split import chunk_layers, parse_layout, rank_layers


def _nemo_fqns(num_stages: int, num_layers: int) -> list[list[str]]:
    """NeMo AutoModel's generate_hf_model_fqn_per_model_part (include_embeddings, include_lm_head,
    include_rotary_emb; no multimodal or extra modules)."""
    if num_stages < 1:
        raise ValueError("Number of stages must be at least 1")
    if num_stages > num_layers:
        raise ValueError(f"Number of stages ({num_stages}) cannot exceed number of layers ({num_layers})")
    layers_per_stage = num_layers // num_stages
    extra_layers = num_layers % num_stages
    module_names_per_stage, current_layer = [], 0
    for stage_idx in range(num_stages):
        stage_modules = []
        stage_layer_count = layers_per_stage
        if stage_idx < extra_layers:
            stage_layer_count += 1
        if stage_idx == 0:
            stage_modules.append("model.embed_tokens")
        for _ in range(stage_layer_count):
            stage_modules.append(f"model.layers.{current_layer}")
            current_layer += 1
        if stage_idx == num_stages - 1:
            stage_modules.append("model.norm")
            stage_modules.append("lm_head")
        stage_modules.append("model.rotary_emb")
        module_names_per_stage.append(stage_modules)
    return module_names_per_stage


def _titan_fqns(num_stages: int, num_layers: int, input_weight: int = 1, output_weight: int = 1) -> list[list[str]]:
    """torchtitan's generate_llm_fqn_per_model_part."""
    if num_stages < 1:
        raise ValueError("Number of stages must be at least 1")
    if num_stages == 1:
        return [["tok_embeddings"] + [f"layers.{i}" for i in range(num_layers)] + ["norm", "output"]]
    num_effective_layers = num_layers + input_weight + output_weight
    if num_stages > num_effective_layers:
        raise ValueError("Number of stages cannot be greater than effective layers")
    layers_per_stage = num_effective_layers // num_stages
    extra_layers = num_effective_layers % num_stages
    if layers_per_stage == 0:
        raise ValueError("Configuration would result in empty stages.")
    if input_weight > layers_per_stage:
        raise ValueError("input_weight exceeds minimum layers per stage")
    if output_weight > layers_per_stage:
        raise ValueError("output_weight exceeds minimum layers per stage")
    module_names_per_stage, current_layer = [], 0
    for stage_idx in range(num_stages):
        stage_modules = []
        effective_layers_for_stage = layers_per_stage
        if stage_idx < extra_layers:
            effective_layers_for_stage += 1
        if stage_idx == 0:
            stage_modules.append("tok_embeddings")
            for _ in range(effective_layers_for_stage - input_weight):
                if current_layer < num_layers:
                    stage_modules.append(f"layers.{current_layer}")
                    current_layer += 1
        elif stage_idx == num_stages - 1:
            for _ in range(effective_layers_for_stage - output_weight):
                if current_layer < num_layers:
                    stage_modules.append(f"layers.{current_layer}")
                    current_layer += 1
            stage_modules.extend(["norm", "output"])
        else:
            for _ in range(effective_layers_for_stage):
                if current_layer < num_layers:
                    stage_modules.append(f"layers.{current_layer}")
                    current_layer += 1
        module_names_per_stage.append(stage_modules)
    return module_names_per_stage


def _megatron_build(num_layers, pp, vp, first, last, pp_rank, vp_stage=0, embedding=False, loss=False) -> int:
    """get_num_layers_to_build (no custom layout); vp None without VP."""
    is_first_pp_stage, is_last_pp_stage = pp_rank == 0, pp_rank == pp - 1
    if first is not None or last is not None:
        assert not (embedding or loss)
        layers_to_distribute, pipeline_stages_left = num_layers, pp
        if first is not None:
            layers_to_distribute -= first
            pipeline_stages_left -= 1
        if last is not None:
            layers_to_distribute -= last
            pipeline_stages_left -= 1
        if pipeline_stages_left > 0:
            assert layers_to_distribute % pipeline_stages_left == 0
            num_layers_per_pipeline_rank = layers_to_distribute // pipeline_stages_left
        else:
            num_layers_per_pipeline_rank = 0
        if is_first_pp_stage and first is not None:
            num_layers_per_pipeline_rank = first
        if is_last_pp_stage and last is not None:
            num_layers_per_pipeline_rank = last
    else:
        if embedding:
            num_layers += 1
        if loss:
            num_layers += 1
        assert num_layers % pp == 0
        num_layers_per_pipeline_rank = num_layers // pp
    if vp is not None and pp > 1:
        assert num_layers_per_pipeline_rank % vp == 0
        num_layers_to_build = num_layers_per_pipeline_rank // vp
    else:
        num_layers_to_build = num_layers_per_pipeline_rank
    if embedding and (vp is None or vp_stage == 0) and is_first_pp_stage:  # is_vp_first_stage
        num_layers_to_build -= 1
        assert num_layers_to_build >= 0
    if loss and (vp is None or vp_stage == vp - 1) and is_last_pp_stage:  # is_vp_last_stage
        num_layers_to_build -= 1
        assert num_layers_to_build >= 0
    return num_layers_to_build


def _megatron_offset(num_layers, pp, vp, first, last, pp_rank, vp_stage, embedding=False, loss=False) -> int:
    """get_transformer_layer_offset (pp > 1, no custom layout)."""
    if first is not None or last is not None:
        middle_pipeline_stages = pp - sum(1 if x is not None else 0 for x in (first, last))
        n_first, n_last = first or 0, last or 0
        middle_num_layers = num_layers - n_first - n_last
        middle_pipeline_rank = pp_rank if first is None else pp_rank - 1
        if vp is not None:
            v_first = 0 if first is None else first // vp
            v_last = 0 if last is None else last // vp
            v_middle = middle_num_layers // vp
            total_virtual_chunks = v_first + v_middle + v_last
            if pp_rank == 0:
                return vp_stage * total_virtual_chunks
            return vp_stage * total_virtual_chunks + v_first + middle_pipeline_rank * (v_middle // middle_pipeline_stages)
        per_rank = middle_num_layers // middle_pipeline_stages if middle_pipeline_stages > 0 else 0
        return 0 if pp_rank == 0 else middle_pipeline_rank * per_rank + n_first
    num_layers += int(embedding) + int(loss)
    per_rank = num_layers // pp
    if vp is not None:
        offset = vp_stage * (num_layers // vp) + pp_rank * (per_rank // vp)
    else:
        offset = pp_rank * per_rank
    if embedding and not ((vp is None or vp_stage == 0) and pp_rank == 0):
        offset -= 1
    return offset


def _megatron_parse(layout_str: str) -> list[list[str]]:
    """PipelineParallelLayerLayout.parse_str_to_list (layer characters kept as characters)."""
    import re

    layout_str = layout_str.replace(",", "")
    for pattern in (r'\(([^)]+)\)\*(\d+)', r'(.)\*(\d+)'):
        layout_str = re.sub(pattern, lambda x: x.group(1) * int(x.group(2)), layout_str)
    layout_list = []
    for stage in layout_str.split('|'):
        layout_list.append([])
        for layer_char in stage:
            assert layer_char in "ELtm"
            layout_list[-1].append(layer_char)
    return layout_list


def _megatron_layout_counts(layout_str: str, pp: int) -> tuple[list[list[int]], list[list[int]]]:
    """PipelineParallelLayerLayout.__init__'s 2-D layout (layout[pp_rank][vpp_rank] = stage vpp_rank · pp +
    pp_rank), then get_num_layers_to_build and get_layer_offset of the decoder layers for every rank and
    virtual stage."""
    flat = _megatron_parse(layout_str)
    assert len(flat) % pp == 0
    vpp = len(flat) // pp
    layout = [[flat[v * pp + r] for v in range(vpp)] for r in range(pp)]
    build = [[layout[r][v].count("t") for v in range(vpp)] for r in range(pp)]
    offsets = [[sum(layout[_r][_v].count("t") for _v in range(v + 1)
                    for _r in range(pp if _v < v else r)) for v in range(vpp)] for r in range(pp)]
    return build, offsets


LAYOUTS = [("Et*3|(tt|)*29|L", 16, 61),  # DeepSeek-V3 at PP 16 × VP 2 (Megatron's docs, without the MTP layer)
           ("Et|(tt|)*30L", 8, 61),  # PP 8 × VP 4, the loss with the last two layers
           ("Et|(tt|)*6L", 2, 13), ("Ett|tt|t|ttL", 2, 7), ("E|t*4|t*4|L", 4, 8), ("Et,t|t,tL", 2, 4)]


@pytest.mark.parametrize("layout,pp,layers", LAYOUTS)
def test_megatron_layout_is_theirs(layout, pp, layers):
    """--pp-layout: the chunks parse as parse_str_to_list does, each (rank, virtual stage) builds as many decoder
    layers as PipelineParallelLayerLayout.get_num_layers_to_build says, and the chunks start at its
    get_layer_offset."""
    assert [list(st) for st in parse_layout(layout)] == _megatron_parse(layout)
    build, offsets = _megatron_layout_counts(layout, pp)
    vp = len(build[0])
    ours = chunk_layers("megatron", layers, pp, vp, layout=layout)
    assert [[ours[v * pp + r] for v in range(vp)] for r in range(pp)] == build
    assert [[sum(ours[:v * pp + r]) for v in range(vp)] for r in range(pp)] == offsets


@pytest.mark.parametrize("layout,pp,vp,needle", [
    ("Et*3|(tt|)*29|L", 16, 1, "give --vp 2"),
    ("Et*3|(tt|)*29,m|L", 16, 2, "multi-token prediction"),
    ("Et*3|(tt|)*29|X", 16, 2, "'X' is not one"),
    ("Et*2|(tt|)*29|L", 16, 2, "61 decoder layers"),
    ("Ett|L|tt|tt", 2, 2, "'E' first and the loss 'L' last"),
    ("Ett|tt|ttL|", 2, 2, "the loss in one of the last rank"),
])
def test_bad_megatron_layouts(layout, pp, vp, needle):
    with pytest.raises(PlannerError, match=re.escape(needle)):
        chunk_layers("megatron", 61 if "29" in layout else 6, pp, vp, layout=layout)


def _layer_counts(fqns: list[list[str]]) -> tuple[int, ...]:
    return tuple(sum(1 for n in stage if ".layers." in f".{n}" or n.startswith("layers.")) for stage in fqns)


@pytest.mark.parametrize("framework,their_fqns", [("nemo-automodel", _nemo_fqns), ("torchtitan", _titan_fqns)])
@pytest.mark.parametrize("pp,vp", [(2, 1), (3, 1), (4, 1), (2, 2), (4, 2), (4, 8), (8, 1)])
def test_the_split_is_theirs(framework, their_fqns, pp, vp):
    """NeMo AutoModel's and torchtitan's own split functions (transcribed above), layer for layer; where
    theirs refuses a count, so does the planner."""
    for layers in range(1, 70):
        try:
            theirs = _layer_counts(their_fqns(pp * vp, layers))
        except ValueError:
            with pytest.raises(PlannerError):
                chunk_layers(framework, layers, pp, vp)
            continue
        assert chunk_layers(framework, layers, pp, vp) == theirs, layers


@pytest.mark.parametrize("pp,vp", [(2, None), (4, None), (4, 2), (8, None), (3, 3)])
def test_megatron_split_is_get_num_layers_to_build(pp, vp):
    """Every (rank, virtual stage)'s count equals get_num_layers_to_build, and every chunk starts where
    get_transformer_layer_offset puts it (the layers contiguous in chunk order v · pp + r); where Megatron
    asserts (or would silently build another number of layers), the planner refuses."""
    v = vp or 1
    for layers in (12, 24, 30, 61, 62, 64):
        for first in (None, 0, 3, 6, 13):
            for last in (None, 0, 4, 6, 16):
                try:
                    theirs = [_megatron_build(layers, pp, vp, first, last, c % pp) for c in range(pp * v)]
                    # Megatron builds a model of other than num_layers layers without a word when the first and
                    # last stages take more, or all of them leave some over (pp 2): the planner refuses those
                    assert min(theirs) >= 0 and sum(theirs) == layers
                except AssertionError:
                    with pytest.raises(PlannerError):
                        chunk_layers("megatron", layers, pp, v, first=first, last=last)
                    continue
                ours = chunk_layers("megatron", layers, pp, v, first=first, last=last)
                assert list(ours) == theirs, (layers, first, last)
                starts = [sum(ours[:c]) for c in range(pp * v)]
                assert starts == [_megatron_offset(layers, pp, vp, first, last, c % pp, c // pp)
                                  for c in range(pp * v)], (layers, first, last)


@pytest.mark.parametrize("pp,vp", [(2, None), (4, None), (4, 2), (8, None), (3, 3)])
@pytest.mark.parametrize("embedding,loss", [(True, False), (False, True), (True, True)])
def test_megatron_embedding_and_loss_accounting(pp, vp, embedding, loss):
    """--account-for-embedding / --account-for-loss against get_num_layers_to_build's accounting branch (the
    embedding / loss counted as a layer of the first / last chunk) and get_transformer_layer_offset."""
    v = vp or 1
    for layers in range(2, 70):
        try:
            theirs = [_megatron_build(layers, pp, vp, None, None, c % pp, c // pp, embedding, loss)
                      for c in range(pp * v)]
        except AssertionError:
            with pytest.raises(PlannerError):
                chunk_layers("megatron", layers, pp, v, embedding=embedding, loss=loss)
            continue
        ours = chunk_layers("megatron", layers, pp, v, embedding=embedding, loss=loss)
        assert list(ours) == theirs and sum(ours) == layers, layers
        assert [sum(ours[:c]) for c in range(pp * v)] == [
            _megatron_offset(layers, pp, vp, None, None, c % pp, c // pp, embedding, loss) for c in range(pp * v)]
    with pytest.raises(PlannerError, match="not with"):  # transformer_config.py refuses both at once
        chunk_layers("megatron", 62, pp, v, first=2 * v, embedding=embedding, loss=loss)


def test_deepseek_v3_rows_split():
    """The NeMo AutoModel rows (61 layers, pp 4 × vp 8 = 32 chunks): 29 chunks of 2 and 3 of 1; rank 0 holds 16
    layers (its eight 2-layer chunks) and the embedding, ranks 1-3 hold 15."""
    chunks = chunk_layers("nemo-automodel", 61, 4, 8)
    assert chunks.count(2) == 29 and chunks.count(1) == 3
    assert rank_layers(chunks, 4) == (16, 15, 15, 15)


def _tiny_dsv3() -> dict:
    from tests.test_moe import TINY

    return TINY["deepseek_v3"] | {"num_hidden_layers": 5}


def test_stage_parameters_are_the_modules_on_meta():
    """Each pipeline rank's parameters equal the meta-device DeepSeek-V3 modules NeMo AutoModel's split gives
    it: 5 layers (1 dense) over pp 2 × vp 2 chunks of (2, 1, 1, 1) layers; rank 0 the embedding and layers
    0, 1, 3, rank 1 layers 2, 4, the norm and the head."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from planner.estimate import estimate
    from planner.models.hf_config import spec_from_hf_config
    from planner.spec import TrainConfig

    cfg = _tiny_dsv3()
    spec = spec_from_hf_config(cfg, name="tiny-dsv3")
    conf = transformers.AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "architectures"})
    with torch.device("meta"):
        module = transformers.DeepseekV3ForCausalLM(conf)
    stages = _nemo_fqns(4, 5)
    expected = [0, 0]
    for s, names in enumerate(stages):
        for name in names:
            expected[s % 2] += sum(p.numel() for p in module.get_submodule(name).parameters())
    config = TrainConfig(batch_size=1, grad_accum=4, seq_len=32, precision="bf16", parallelism="fsdp",
                         framework="nemo-automodel", instances=1, pp=2, vp=2, attention="sdpa")
    est = estimate(spec, config, "ml.p5.48xlarge", with_throughput=False, calibration={})
    assert [s.layers for s in est.parallel.stages] == [(0, 1, 3), (2, 4)]
    assert [s.parameters for s in est.parallel.stages] == expected
    assert sum(expected) == sum(p.numel() for p in module.parameters())


def _estimate(*args: str):
    from typer.testing import CliRunner

    from planner.cli.main import app

    return CliRunner().invoke(app, ["estimate", "--model", "deepseek-v3", "--instance", "ml.p5.48xlarge",
                                    "--instances", "32", "--batch-size", "1", "--grad-accum", "8", "--seq-len",
                                    "4096", "--precision", "bf16", "--ep", "64", "--checkpointing", *args])


def test_megatron_first_and_last_stage_flags():
    res = _estimate("--parallelism", "ddp", "--framework", "megatron", "--pp", "4", "--first-stage-layers", "13",
                    "--last-stage-layers", "16", "--json")
    assert res.exit_code == 0, res.output
    stages = json.loads(res.output)["parallel"]["stages"]
    assert [len(s["layers"]) for s in stages] == [13, 16, 16, 16]
    assert stages[0]["layers"][:3] == [0, 1, 2]  # the three dense layers on the first rank
    res = _estimate("--parallelism", "ddp", "--framework", "megatron", "--pp", "9", "--instances", "72",
                    "--account-for-embedding", "--account-for-loss", "--json")
    assert res.exit_code == 0, res.output
    assert [len(s["layers"]) for s in json.loads(res.output)["parallel"]["stages"]] == [6, *[7] * 7, 6]
    res = _estimate("--parallelism", "ddp", "--framework", "megatron", "--pp", "4", "--pp-layout",
                    "Et*13|t*16|t*16|t*16L", "--json")
    assert res.exit_code == 0, res.output
    assert [len(s["layers"]) for s in json.loads(res.output)["parallel"]["stages"]] == [13, 16, 16, 16]


@pytest.mark.parametrize("args,needle", [
    (("--parallelism", "ddp", "--framework", "megatron", "--pp", "4"), "--first-stage-layers / --last-stage-layers"),
    (("--parallelism", "ddp", "--framework", "megatron", "--pp", "4", "--first-stage-layers", "14"),
     "--first-stage-layers=14"),
    (("--parallelism", "ddp", "--framework", "megatron", "--pp", "4", "--vp", "2", "--first-stage-layers", "13",
      "--last-stage-layers", "16"), "a multiple of --vp 2"),
    (("--parallelism", "fsdp", "--framework", "nemo-automodel", "--pp", "4", "--first-stage-layers", "13"),
     "only with --framework megatron"),
    (("--parallelism", "ddp", "--framework", "megatron", "--first-stage-layers", "13"), "only with --pp above 1"),
    (("--parallelism", "ddp", "--framework", "megatron", "--pp", "4", "--last-stage-layers", "-1"),
     "--last-stage-layers"),
    (("--parallelism", "ddp", "--pp", "4"), "splits layers evenly"),
    (("--parallelism", "fsdp", "--framework", "torchtitan", "--pp", "4", "--account-for-loss"),
     "only with --framework megatron"),
    (("--parallelism", "ddp", "--framework", "megatron", "--pp", "4", "--account-for-embedding"),
     "the embedding and the loss counted as layers"),
    (("--parallelism", "fsdp", "--framework", "nemo-automodel", "--pp", "4", "--pp-layout", "Et*61|||L"),
     "only with --framework megatron"),
    (("--parallelism", "ddp", "--framework", "megatron", "--pp", "4", "--pp-layout", "Et*13|t*16|t*16|t*16L",
      "--first-stage-layers", "13"), "alone: not with"),
    (("--parallelism", "ddp", "--framework", "megatron", "--pp-layout", "Et*61L"), "only with --pp above 1"),
])
def test_bad_split_is_one_line_exit_2(args, needle):
    res = _estimate(*args)
    assert res.exit_code == 2, res.output
    assert needle in res.output and len(res.output.strip().splitlines()) == 1 and "Traceback" not in res.output


def test_explain_names_each_stages_layers():
    from typer.testing import CliRunner

    from planner.cli.main import app

    res = CliRunner().invoke(app, ["explain", "--model", "deepseek-v3", "--instance", "ml.p5.48xlarge", "--instances",
                                   "32", "--batch-size", "1", "--grad-accum", "8", "--seq-len", "4096", "--precision",
                                   "bf16", "--parallelism", "fsdp", "--framework", "nemo-automodel", "--pp", "4",
                                   "--vp", "8", "--ep", "64", "--checkpointing"])
    assert res.exit_code == 0, res.output
    assert "stages hold 16, 15, 15, 15" in " ".join(res.output.split())


def test_published_deepseek_v3_rows_are_expressible():
    """results/public/moe's two NeMo AutoModel DeepSeek-V3 rows (issue 35: refused before uneven stages) now
    estimate, each rank holding the layers NeMo's splitter gives it (the benchmark prints their figures)."""
    from pathlib import Path

    from planner.estimate import estimate
    from planner.probes.public_moe_fp8 import load_published

    root = Path(__file__).resolve().parents[1]
    rows = [r for r in load_published("moe") if r.model == "deepseek-v3"]
    assert len(rows) == 2
    for r in rows:
        est = estimate(r.model_ref(root), r.train_config(), r.instance, with_throughput=False, calibration={})
        assert [len(s.layers) for s in est.parallel.stages] == [16, 15, 15, 15]
        assert "embeddings" in " ".join(est.parallel.stages[0].blocks)


def test_the_slowest_stage_sets_the_pipelines_pace():
    """Llama-3-8B's 32 layers over 4 Megatron ranks: moving layers off the first and last ranks (2, 14, 14, 2)
    or onto them (11, 5, 5, 11) makes the heaviest rank slower than the even split's (8 + the embedding or
    the head), and the step with it."""
    from planner.estimate import estimate
    from planner.spec import TrainConfig

    base = TrainConfig(batch_size=1, grad_accum=8, seq_len=4096, precision="bf16", parallelism="ddp",
                       framework="megatron", pp=4)
    steps = {}
    for first, last in ((None, None), (2, 2), (11, 11)):
        cfg = base.model_copy(update={"first_stage_layers": first, "last_stage_layers": last})
        est = estimate("llama-3-8b", cfg, "ml.p5.48xlarge", calibration={})
        steps[first] = est.throughput.breakdown_s["compute_s"]
    assert steps[2] > steps[None] and steps[11] > steps[None]
    assert steps[2] > steps[11]  # 14 layers outweigh 11 layers and the LM head
