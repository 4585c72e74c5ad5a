"""Tensor parallelism inside mixture-of-experts models (issue 35): attention and a shared expert split over
--tp, the routed experts over --ep · --etp, the experts' states over the expert data-parallel group.

Checked against real modules where one process can show it (as tests/test_parallel_activations.py does for
a dense layer):
- the parameter tensors of one tensor-parallel rank (the program at ctx.tp, names and shapes) equal the
  module's built on the meta device and split by hand: q/k/v, gate/up (dense MLP, shared expert), DeepSeek's
  q_b/kv_b and gpt-oss's sinks along their output dimension; o_proj and down along their input dimension;
  the token table and the LM head by vocabulary rows; everything else whole (norms, the router, the routed
  experts, DeepSeek's duplicated down projections q_a/kv_a);
- the saved bytes of a rank's layers (without sequence parallelism, which one process cannot run) equal
  what autograd saves in the module built with heads / tp, kv heads / tp and the shared expert's and dense
  MLP's widths / tp, experts whole: Qwen2-MoE (shared expert with its gate, a dense layer) and Qwen3-MoE
  (per-head q/k norms), fp32 and amp-bf16;
- memory per rank: attention and shared-expert states / tp, the experts' / (ep · etp), the experts'
  optimizer states over the expert data-parallel group (world / (ep · etp · pp));
- speed: a sparse layer without a shared expert has one TP all-gather / reduce-scatter pair per forward,
  not two; the expert all-to-all moves the rank's sequence-parallel tokens.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from planner.families.forms import model_program
from planner.ir.context import Ctx
from planner.models import hf_config
from planner.models.blocks import model_blocks
from planner.spec import TrainConfig
from tests.test_moe import TINY, _module

# Module names split along dim 0 (column-parallel, the vocabulary-parallel tables) and dim 1 (row-parallel)
COLUMN = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "q_proj.bias", "k_proj.bias", "v_proj.bias",
          "mlp.gate_proj.weight", "mlp.up_proj.weight", "shared_expert.gate_proj.weight",
          "shared_expert.up_proj.weight", "shared_experts.gate_proj.weight", "shared_experts.up_proj.weight",
          "q_b_proj.weight", "kv_b_proj.weight", "self_attn.sinks", "embed_tokens.weight", "lm_head.weight")
ROW = ("o_proj.weight", "mlp.down_proj.weight", "shared_expert.down_proj.weight", "shared_experts.down_proj.weight")


def _by_hand(name: str, shape: tuple[int, ...], tp: int) -> tuple[int, ...]:
    if name.endswith(COLUMN):
        return (-(-shape[0] // tp), *shape[1:])
    if name.endswith(ROW):
        return (shape[0], shape[1] // tp)
    return shape


@pytest.mark.parametrize("case", ["mixtral", "qwen3_moe", "qwen2_moe", "olmoe", "gpt_oss", "deepseek_v3",
                                  "deepseek_v3_no_q_lora"])
def test_rank_parameters_are_the_module_split_by_hand(case):
    spec = hf_config.spec_from_hf_config(TINY[case], name=case)
    tp = 2
    module = _module(TINY[case])
    real = sorted((n, _by_hand(n, tuple(p.shape), tp)) for n, p in module.named_parameters())
    ctx = Ctx(2, 8, "fp32", "sdpa", "cuda", True, tp=tp, sp=True)
    ours = sorted((p.name, p.shape) for p in model_program(spec, ctx).params)
    assert ours == real


@pytest.mark.parametrize("case", ["qwen2_moe", "deepseek_v3"])
def test_stage_rank_shapes_are_the_module_split_by_hand(case):
    """What the pipeline's stage step sums (planner.memory.stages.rank_tensor_shapes) per layer: the
    module's layer split by hand, routed experts whole (planner.pipeline.step splits them over ep · etp)."""
    from planner.memory.stages import rank_tensor_shapes

    spec = hf_config.spec_from_hf_config(TINY[case], name=case)
    module = _module(TINY[case])
    for block in model_blocks(spec):
        if block.role != "layer":
            continue
        prefix = f"model.layers.{block.index}."
        real = sorted(_by_hand(n, tuple(p.shape), 2) for n, p in module.named_parameters() if n.startswith(prefix))
        assert sorted(rank_tensor_shapes(block, 2)) == real


def _rank_config(case: str, tp: int) -> dict[str, Any]:
    """The module one rank runs, for its activations: heads, kv heads, the shared expert's and the dense
    MLP's widths over tp (head_dim kept), the router and the experts whole."""
    cfg = dict(TINY[case])
    d = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    cfg.update(num_attention_heads=cfg["num_attention_heads"] // tp,
               num_key_value_heads=max(1, cfg["num_key_value_heads"] // tp), head_dim=d,
               intermediate_size=cfg["intermediate_size"] // tp)
    if cfg.get("shared_expert_intermediate_size"):
        cfg["shared_expert_intermediate_size"] //= tp
    return cfg


@pytest.mark.parametrize("precision", ["fp32", "amp-bf16"])
@pytest.mark.parametrize("case", ["qwen2_moe", "qwen3_moe"])
def test_tensor_parallel_moe_rank_saves_what_the_rank_module_saves(case, precision):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tests.saved_tensors import measure, program_saved_per_block

    tp = 2
    spec = hf_config.spec_from_hf_config(TINY[case], name=case)
    rank = hf_config.spec_from_hf_config(_rank_config(case, tp), name=case)
    measured = measure(rank, TrainConfig(batch_size=2, seq_len=24, precision=precision, attention="eager"),
                       fake=False, keep_tensors=False)
    config = TrainConfig(batch_size=2, seq_len=24, precision=precision, attention="eager", tp=tp, sp=False)
    ours = program_saved_per_block(spec, config, tp=tp, sp=False)
    layers = [b.name for b in model_blocks(spec) if b.role == "layer"]
    assert {n: ours[n] for n in layers} == {n: measured.per_block[n] for n in layers}
    whole = TrainConfig(batch_size=2, seq_len=24, precision=precision, attention="eager")
    assert ours[layers[0]] < program_saved_per_block(spec, whole)[layers[0]]


def test_sequence_parallel_moe_layer_routes_the_local_tokens():
    """Under TP + SP the router, the token-expert pairs and the norms hold n / tp rows (Megatron-Core routes
    the rank's sequence-parallel tokens); the shared expert is gathered before and reduce-scattered after."""
    spec = hf_config.spec_from_hf_config(TINY["qwen2_moe"], name="q")
    n, tp = 2 * 24, 2
    program = model_program(spec, Ctx(2, 24, "bf16", "sdpa", "cuda", False, tp=tp, sp=True))
    layer = next(b for b in program.blocks if b.name.endswith("layer.0"))
    ops = {op.name: op for op in layer.ops}
    assert ops["mlp.gate"].shapes["input"] == (n // tp, 64)
    assert ops["mlp.experts.permute"].shapes["output"][0] == n // tp * 2
    assert ops["post_attention_layernorm"].shapes["input"][0] == n // tp
    kinds = [op.kind for op in layer.ops]
    assert kinds.count("all_gather") == 2 and kinds.count("reduce_scatter") == 2  # attention, shared expert
    dense = next(b for b in program.blocks if b.name.endswith("layer.1"))  # mlp_only_layers=[1]
    assert [op.kind for op in dense.ops].count("all_gather") == 2


# ------------------------------------------------------------------------------- memory and speed per rank


def _est(**kw: Any):
    from planner.estimate import estimate

    fields = dict(batch_size=1, seq_len=1024, precision="amp-bf16", parallelism="ddp", instances=2) | kw
    return estimate("qwen3-30b-a3b", TrainConfig(**fields), "ml.p5.48xlarge")


def _split(tp: int, ep: int) -> int:
    """Parameters of one rank of qwen3-30b-a3b split by hand: the attention's q/k/v/o and the vocabulary
    tables / tp, the norms and routers whole, the routed experts / ep."""
    from planner.models.catalog import get_model

    t = get_model("qwen3-30b-a3b").transformers[0]
    h, d, L = t.hidden_size, t.head_dim, t.num_layers
    attention = (h * t.num_heads * d * 2 + h * t.num_kv_heads * d * 2) // tp
    norms = 2 * h + 2 * d  # input/post-attention norms, q/k norms per head
    router = t.num_experts * h
    experts = t.num_experts * 3 * h * t.moe_intermediate_size // ep
    tables = 2 * -(-t.vocab_size // tp) * h  # untied embeddings and LM head
    return L * (attention + norms + router + experts) + tables + h


@pytest.mark.parametrize("tp,ep", [(2, 8), (4, 4), (2, 1)])
def test_rank_states_attention_over_tp_experts_over_ep(tp, ep):
    e = _est(tp=tp, ep=ep)
    rank = _split(tp, ep)
    assert e.parallel.stages[0].parameters == rank
    assert e.memory_bytes.parameters == 4 * rank  # DDP: whole on the rank, fp32 under AMP
    assert e.memory_bytes.optimizer_states == 8 * rank


def test_expert_optimizer_states_over_the_expert_data_parallel_group():
    """ZeRO-1 over 16 GPUs with tp 2, ep 8: the dense part's AdamW states over dp = 8, the experts' over
    edp = 16 / 8 = 2 (Megatron-Core's expert_data_parallel group), not over dp."""
    from planner.models.catalog import get_model

    t = get_model("qwen3-30b-a3b").transformers[0]
    e = _est(tp=2, ep=8, parallelism="zero1")
    experts = t.num_layers * t.num_experts * 3 * t.hidden_size * t.moe_intermediate_size // 8
    dense = _split(2, 8) - experts
    assert e.memory_bytes.optimizer_states == pytest.approx(8 * (dense / 8 + experts / 2), rel=1e-6)


def test_sparse_layers_have_one_tp_collective_pair_without_a_shared_expert():
    from planner.models.catalog import get_model
    from planner.perf.model_parallel import layer_shape, tp_pairs

    assert tp_pairs(get_model("qwen3-30b-a3b")) == 1.0
    assert tp_pairs(get_model("llama-3-8b")) == 2.0
    qwen2 = hf_config.spec_from_hf_config(TINY["qwen2_moe"], name="q")  # shared expert: two pairs
    assert tp_pairs(qwen2) == 2.0
    shape = layer_shape(get_model("qwen3-30b-a3b"), TrainConfig(batch_size=1, seq_len=1024, tp=2, ep=8))
    assert shape.tp_pairs == 1.0 and shape.local_experts > 0


def test_tp_times_the_moe_layers_collectives_and_the_rank_all_to_all():
    """Under TP (+SP) the step has TP collectives and the expert all-to-all of the rank's tokens: half the
    sequence's pairs at tp 2, exactly what an unsplit rank with half the sequence sends."""
    from planner.hardware import get_instance
    from planner.models.catalog import get_model
    from planner.perf.constants import ThroughputConstants
    from planner.perf.throughput import expert_exchange_seconds

    spec, inst, c = get_model("qwen3-30b-a3b"), get_instance("ml.p5.48xlarge"), ThroughputConstants()
    half = expert_exchange_seconds(spec, TrainConfig(batch_size=1, seq_len=512, ep=8, instances=2), inst, c)
    rank = expert_exchange_seconds(spec, TrainConfig(batch_size=1, seq_len=1024, ep=8, tp=2, instances=2), inst, c)
    assert rank == half > 0
    b = _est(tp=2, ep=8).throughput.breakdown_s
    assert b["tp_communication_s"] > 0
    assert math.isclose(b["expert_all_to_all_s"], expert_exchange_seconds(
        spec, TrainConfig(batch_size=1, seq_len=1024, precision="amp-bf16", ep=8, tp=2, instances=2), inst, c))


def test_context_parallel_moe_layer_holds_its_chunk():
    """Under CP the MoE layer's attention exchanges K/V in a ring (as Llama's) and the router and the expert
    pairs take the rank's s / cp tokens."""
    spec = hf_config.spec_from_hf_config(TINY["qwen3_moe"], name="q")
    program = model_program(spec, Ctx(2, 24, "bf16", "sdpa", "cuda", False, cp=2))
    layer = next(b for b in program.blocks if b.name.endswith("layer.0"))
    ops = {op.name: op for op in layer.ops}
    assert ops["attention.cp_ring"].attrs["steps"] == 1
    assert ops["mlp.gate"].shapes["input"][0] == 2 * 24 // 2
    assert ops["rotary"].shapes["tables"][0] == 24 // 2


def test_expert_tensor_parallelism_gathers_the_groups_pairs():
    """--etp: each expert's width / etp over the group's gathered pairs (Megatron-Core's dispatcher
    all-gathers over the expert-TP group): the same FLOPs, the gathered input saved by the first grouped
    GEMM (etp × the pairs), everything else of the layer unchanged; the gather and the reduce-scatter are
    ops (timed with the all-to-all)."""
    from planner.memory.activations import layer_saved

    spec = hf_config.spec_from_hf_config(TINY["qwen3_moe"], name="q")
    t = spec.transformers[0]
    n, k, h, i = 2 * 24, t.experts_per_token, t.hidden_size, t.moe_intermediate_size
    one, two = (Ctx(2, 24, "bf16", "sdpa", "cuda", False, ep=2, etp=etp) for etp in (1, 2))
    layer = next(b for b in model_program(spec, two).blocks if b.name.endswith("layer.0"))
    ops = {op.name: op for op in layer.ops}
    assert ops["mlp.experts.gate_up"].shapes["input"] == (2 * n * k, h)
    assert ops["mlp.experts.gate_up"].shapes["output"] == (2 * n * k, i)  # 2i / etp
    assert ops["mlp.experts.down"].shapes["input"] == (2 * n * k, i // 2)
    assert {"mlp.experts.etp_all_gather", "mlp.experts.etp_reduce_scatter"} <= set(ops)
    delta = sum(x.nbytes for x in layer_saved(t, two, 0)) - sum(x.nbytes for x in layer_saved(t, one, 0))
    assert delta == n * k * h * 2  # the second half of the gathered bf16 input


def test_etp_is_timed_with_the_expert_exchange():
    from planner.hardware import get_instance
    from planner.models.catalog import get_model
    from planner.perf.constants import ThroughputConstants
    from planner.perf.throughput import expert_exchange_seconds

    spec, inst, c = get_model("qwen3-30b-a3b"), get_instance("ml.p5.48xlarge"), ThroughputConstants()
    base = TrainConfig(batch_size=1, seq_len=1024, ep=4, instances=2)
    assert expert_exchange_seconds(spec, base.model_copy(update={"etp": 2}), inst, c) > expert_exchange_seconds(
        spec, base, inst, c)
    assert expert_exchange_seconds(spec, base.model_copy(update={"ep": 1, "etp": 2}), inst, c) > 0
