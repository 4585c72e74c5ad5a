"""Mixture-of-experts models (issue 35): Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE against the transformers
modules, their saved tensors against autograd's hooks, expert parallelism's memory and time, bad input.

- total and active parameters, and the program's parameter tensors (names, shapes), against the module built
  on the meta device from the same config (catalog models and a tiny config per family);
- the saved bytes per block against saved-tensor hooks on tiny real modules run on CPU (tests/saved_tensors.py),
  in fp32, amp-bf16 and bf16 (the experts run transformers 5's default grouped_mm path on CPU too);
- --ep splits the experts' states (and only theirs) over ep ranks; the all-to-all's time grows when the
  expert-parallel group leaves the node; --moe-imbalance makes the hottest rank's activations larger;
- an EP that does not divide the experts, EP on a dense model and a top-k above the experts are one line,
  exit 2.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from typer.testing import CliRunner

from planner.estimate import estimate
from planner.families.forms import model_program
from planner.ir.context import Ctx
from planner.models import hf_config
from planner.models.catalog import catalog_config, get_model
from planner.models.params import active_parameters, count_parameters
from planner.spec import TrainConfig

CATALOG = ("mixtral-8x7b", "qwen3-30b-a3b", "qwen3-235b-a22b", "gpt-oss-20b", "gpt-oss-120b", "deepseek-v3")
# Published totals / actives (the model cards): 46.7B / 12.9B, 30.5B / 3.3B, 235B / 22B; gpt-oss 20.9B / 3.6B
# and 116.8B / 5.1B, whose "active" leaves out the input embedding table (a look-up, no matmul).
PUBLISHED = {"mixtral-8x7b": (46.7e9, 12.9e9), "qwen3-30b-a3b": (30.5e9, 3.3e9), "qwen3-235b-a22b": (235e9, 22e9),
             "gpt-oss-20b": (20.9e9, 3.61e9), "gpt-oss-120b": (116.8e9, 5.13e9),
             "deepseek-v3": (671e9, 37e9)}  # DeepSeek-V3 without its multi-token-prediction module (+14B)

TINY: dict[str, dict[str, Any]] = {
    "mixtral": dict(model_type="mixtral", architectures=["MixtralForCausalLM"], vocab_size=128, hidden_size=64,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=48,
                    num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=256),
    "qwen3_moe": dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], vocab_size=128, hidden_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                      intermediate_size=96, moe_intermediate_size=40, num_experts=4, num_experts_per_tok=2,
                      norm_topk_prob=True, max_position_embeddings=256),
    "qwen2_moe": dict(model_type="qwen2_moe", architectures=["Qwen2MoeForCausalLM"], vocab_size=128, hidden_size=64,
                      num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
                      moe_intermediate_size=40, shared_expert_intermediate_size=56, num_experts=4,
                      num_experts_per_tok=2, mlp_only_layers=[1], max_position_embeddings=256),
    "olmoe": dict(model_type="olmoe", architectures=["OlmoeForCausalLM"], vocab_size=128, hidden_size=64,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=40,
                  num_experts=4, num_experts_per_tok=2, max_position_embeddings=256, eos_token_id=1,
                  pad_token_id=1),
    "gpt_oss": dict(model_type="gpt_oss", architectures=["GptOssForCausalLM"], vocab_size=128, hidden_size=64,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    intermediate_size=40, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=256,
                    sliding_window=8, layer_types=["sliding_attention", "full_attention"], eos_token_id=1,
                    pad_token_id=1),
    "deepseek_v3": dict(model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], vocab_size=128,
                        hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
                        intermediate_size=96, moe_intermediate_size=24, n_routed_experts=8, num_experts_per_tok=2,
                        n_shared_experts=2, first_k_dense_replace=1, n_group=2, topk_group=1, q_lora_rank=32,
                        kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12,
                        max_position_embeddings=256),
    "deepseek_v3_no_q_lora": dict(model_type="deepseek_v3", architectures=["DeepseekV3ForSequenceClassification"],
                                  vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                  num_key_value_heads=2, intermediate_size=40, moe_intermediate_size=8,
                                  n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                                  first_k_dense_replace=0, n_group=1, topk_group=1, q_lora_rank=None,
                                  kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8, num_labels=3,
                                  attention_bias=True),
    "qwen3_moe_step2": dict(model_type="qwen3_moe", architectures=["Qwen3MoeForSequenceClassification"],
                            vocab_size=100, hidden_size=32, num_hidden_layers=4, num_attention_heads=2,
                            num_key_value_heads=1, intermediate_size=24, moe_intermediate_size=8, num_experts=6,
                            num_experts_per_tok=3, decoder_sparse_step=2, num_labels=3),
}


def _module(config: dict[str, Any]):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg = {k: v for k, v in config.items() if k != "_source"}
    model_type = cfg.pop("model_type")
    with torch.device("meta"):
        conf = transformers.AutoConfig.for_model(model_type, **cfg)
        return getattr(transformers, cfg["architectures"][0])(conf)


def _module_counts(module) -> tuple[int, int]:
    """(total, active) of a real module: every parameter, less the experts a token is not routed to (each
    `*Experts` module's 3-D tensors times (E - top_k) / E)."""
    total = sum(p.numel() for p in module.parameters())
    idle = 0
    for name, sub in module.named_modules():
        if name.endswith("mlp.experts"):
            experts = sub.num_experts
            top_k = module.config.num_experts_per_tok
            idle += sum(p.numel() for p in sub.parameters()) * (experts - top_k) // experts
    return total, total - idle


@pytest.mark.parametrize("name", CATALOG)
def test_catalog_total_and_active_parameters_are_the_modules(name):
    spec = get_model(name)
    module = _module(catalog_config(name))
    total, active = _module_counts(module)
    assert count_parameters(spec)["total"] == total
    assert active_parameters(spec) == active
    published_total, published_active = PUBLISHED[name]
    if name.startswith("gpt-oss"):
        active -= spec.transformers[0].vocab_size * spec.transformers[0].hidden_size
    assert abs(total / published_total - 1) < 0.01 and abs(active / published_active - 1) < 0.03


@pytest.mark.parametrize("case", list(TINY))
def test_tiny_configs_parameters_and_tensor_names(case):
    spec = hf_config.spec_from_hf_config(TINY[case], name=case)
    module = _module(TINY[case])
    real = sorted((n, tuple(p.shape)) for n, p in module.named_parameters())
    ours = sorted((p.name, p.shape) for p in model_program(spec, Ctx(2, 8, "fp32", "sdpa", "cuda", True)).params)
    assert ours == real
    assert (count_parameters(spec)["total"], active_parameters(spec)) == _module_counts(module)


def test_dense_layers_of_qwen():
    """mlp_only_layers and decoder_sparse_step pick the dense layers as Qwen's decoder layer does."""
    assert hf_config.spec_from_hf_config(TINY["qwen2_moe"], name="q").transformers[0].dense_layers == (1,)
    assert hf_config.spec_from_hf_config(TINY["qwen3_moe_step2"], name="q").transformers[0].dense_layers == (0, 2)


@pytest.mark.parametrize("precision", ["fp32", "amp-bf16", "bf16"])
@pytest.mark.parametrize("case", ["mixtral", "qwen3_moe", "qwen2_moe", "olmoe"])
def test_saved_bytes_match_saved_tensor_hooks(case, precision):
    """Every block's saved bytes (the router's softmax, top-k indices and weights; the permutation's index
    tensors and offsets; the grouped GEMMs' inputs; the weighting's factors; autocast's weight casts) equal
    what autograd saves in the real module on CPU."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tests.saved_tensors import measure, program_saved_per_block

    spec = hf_config.spec_from_hf_config(TINY[case], name=case)
    config = TrainConfig(batch_size=2, seq_len=24, precision=precision, attention="eager")
    measured = measure(spec, config, fake=False, keep_tensors=False)
    ours = program_saved_per_block(spec, config)
    assert {k: v for k, v in ours.items() if v} == {k: v for k, v in measured.per_block.items() if v}


@pytest.mark.parametrize("precision", ["fp32", "amp-bf16"])
def test_gpt_oss_saved_bytes_within_a_percent(precision):
    """gpt-oss: the full-attention layer is exact; its sliding-window layer saves 1,536 B less than modelled
    here (b · heads · s int64: the row max's indices, ASSUMPTION: not saved where the window mask is built);
    under pure bf16 transformers keeps its norms in fp32 (`_keep_in_fp32_modules`), not modelled (docs/moe.md)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tests.saved_tensors import measure, program_saved_per_block

    spec = hf_config.spec_from_hf_config(TINY["gpt_oss"], name="gpt_oss")
    config = TrainConfig(batch_size=2, seq_len=24, precision=precision, attention="eager")
    measured = measure(spec, config, fake=False, keep_tensors=False).per_block
    ours = program_saved_per_block(spec, config)
    assert ours["model.layer.1"] == measured["model.layer.1"]
    for name, real in measured.items():
        assert abs(ours.get(name, 0) - real) <= 0.01 * real, name


@pytest.mark.parametrize("precision", ["fp32", "amp-bf16"])
def test_deepseek_v3_saved_bytes_are_an_upper_bound_within_thirty_percent(precision):
    """DeepSeek-V3's multi-head latent attention is approximated (its value and output heads counted at the
    query/key width; the sigmoid group-limited router as a softmax router), and its experts run as a loop
    over the experts the router hit, so what autograd saves depends on the routing: on this tiny model the
    planner counts 3-25 % more than autograd per layer over seeds and runs (a seed alone did not make the
    measured bytes repeat between processes: 274,400-308,192 bytes for layer 1 in fp32), never less
    (docs/moe.md). The bound is that spread, not a fit: a planner below autograd, or 30 % above, fails."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import torch

    from tests.saved_tensors import measure, program_saved_per_block

    spec = hf_config.spec_from_hf_config(TINY["deepseek_v3"], name="deepseek_v3")
    config = TrainConfig(batch_size=2, seq_len=24, precision=precision, attention="eager")
    torch.manual_seed(0)
    measured = measure(spec, config, fake=False, keep_tensors=False).per_block
    ours = program_saved_per_block(spec, config)
    for name, real in measured.items():
        if name.startswith("model.layer."):
            assert real <= ours[name] <= 1.3 * real, name


# ------------------------------------------------------------------------------- expert parallelism


def _est(model: str = "qwen3-30b-a3b", **kw: Any):
    fields = dict(batch_size=1, seq_len=1024, precision="amp-bf16", parallelism="ddp", instances=2) | kw
    return estimate(model, TrainConfig(**fields), "ml.p5.48xlarge")


def test_ep_splits_the_experts_states_only():
    """Under DDP each rank holds the dense part and 1/ep of every sparse layer's experts: parameters and
    gradients 4 B each, AdamW's two states 8 B (fp32 under AMP); the expert count is the config's own
    (L · E · 3 · h · i), not the program's."""
    t = get_model("qwen3-30b-a3b").transformers[0]
    experts = t.num_layers * t.num_experts * 3 * t.hidden_size * t.moe_intermediate_size
    total = count_parameters(get_model("qwen3-30b-a3b"))["total"]
    for ep in (1, 4, 16):
        e = _est(ep=ep)
        local = total - experts + experts // ep
        assert e.memory_bytes.parameters == 4 * local
        assert e.memory_bytes.gradients == 4 * local
        assert e.memory_bytes.optimizer_states == 8 * local
        assert e.parameters["active"] == active_parameters(get_model("qwen3-30b-a3b"))


def test_ep_under_fsdp_shards_experts_over_the_expert_data_parallel_group():
    """FSDP over 16 GPUs already keeps 1/16 of everything; EP 16 leaves the resident share as it was (each
    rank keeps its own experts whole: edp = 1), so only the gathered units change."""
    base, ep = _est(parallelism="fsdp"), _est(parallelism="fsdp", ep=16)
    assert abs(ep.memory_bytes.parameters / base.memory_bytes.parameters - 1) < 0.01


def test_all_to_all_time_leaves_the_node():
    from planner.hardware import get_instance
    from planner.perf.constants import ThroughputConstants
    from planner.perf.throughput import expert_exchange_seconds

    spec, inst, c = get_model("qwen3-30b-a3b"), get_instance("ml.p5.48xlarge"), ThroughputConstants()
    cfg = TrainConfig(batch_size=1, seq_len=1024, precision="amp-bf16", parallelism="fsdp", instances=2)
    times = {ep: expert_exchange_seconds(spec, cfg.model_copy(update={"ep": ep}), inst, c) for ep in (1, 2, 8, 16)}
    assert times[1] == 0.0 < times[2] < times[8] < times[16]
    assert times[16] > 2 * times[8]  # half the pairs cross EFA (3,200 Gb/s per 8 GPUs) instead of NVLink
    assert _est(parallelism="fsdp", ep=16).throughput.breakdown_s["expert_all_to_all_s"] > 0


def test_imbalance_loads_the_hottest_rank():
    even, hot = _est(ep=8), _est(ep=8, moe_imbalance=2.0)
    assert hot.memory_bytes.activations > even.memory_bytes.activations
    assert hot.throughput.step_time_s > even.throughput.step_time_s


# ------------------------------------------------------------------------------------ bad input

runner = CliRunner()


def _cli(*args: str):
    from planner.cli.main import app

    return runner.invoke(app, ["estimate", "--instance", "ml.p5.48xlarge", "--instances", "2", "--batch-size", "1",
                               "--seq-len", "128", "--parallelism", "fsdp", *args])


@pytest.mark.parametrize("args,needle", [
    (("--model", "qwen3-30b-a3b", "--ep", "3"), "--ep"),
    (("--model", "mixtral-8x7b", "--ep", "16"), "divisor of the model's 8 experts"),
    (("--model", "llama-3-8b", "--ep", "2"), "without experts"),
    (("--model", "qwen3-30b-a3b", "--ep", "0"), "--ep"),
    (("--model", "qwen3-30b-a3b", "--moe-imbalance", "0.5"), "--moe-imbalance"),
    (("--model", "qwen3-30b-a3b", "--ep", "8", "--etp", "8"), "--ep/--etp"),
])
def test_bad_expert_layout_is_one_line_exit_2(args, needle):
    res = _cli(*args)
    assert res.exit_code == 2, res.output
    assert needle in res.output and len(res.output.strip().splitlines()) == 1, res.output


def test_top_k_above_the_experts_is_one_line_exit_2(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY["mixtral"] | {"num_experts_per_tok": 5}))
    res = _cli("--model", str(path))
    assert res.exit_code == 2, res.output
    assert "num_experts_per_tok" in res.output and len(res.output.strip().splitlines()) == 1


def test_done_when_json_has_memory_verdict_speed_and_active_parameters():
    res = _cli_json("--model", "qwen3-30b-a3b", "--ep", "16", "--precision", "amp-bf16")
    d = json.loads(res.output)
    assert d["parameters"]["active"] < d["parameters"]["total"]
    assert d["memory_bytes"]["peak_device"] > 0 and d["verdict"] in ("fits", "tight", "oom")
    assert d["throughput"]["tokens_per_s"] > 0 and 0 < d["throughput"]["mfu"] < 1
    assert d["config"]["ep"] == 16


def _cli_json(*args: str):
    from planner.cli.main import app

    return runner.invoke(app, ["estimate", "--instance", "ml.p5.48xlarge", "--instances", "2", "--json", *args])


def test_explain_says_how_the_experts_are_laid_out():
    from planner.cli.main import app

    res = runner.invoke(app, ["explain", "--model", "qwen3-30b-a3b", "--instance", "ml.p5.48xlarge", "--instances",
                              "2", "--ep", "8", "--moe-imbalance", "1.5", "--batch-size", "1", "--seq-len", "256",
                              "--parallelism", "fsdp"], env={"COLUMNS": "80"})
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())
    assert "3,353,032,704 of 30,532,122,624 parameters are active" in text
    assert "--ep 8: each GPU holds 1/8 of every MoE layer's experts" in text and "1.5× the mean" in text


@pytest.mark.parametrize("name", ["mixtral-8x7b", "qwen3-30b-a3b", "gpt-oss-20b"])
def test_flops_are_six_active_parameters_per_token(name):
    """Forward + backward matmul FLOPs = 6 · (active parameters in matmuls) · tokens + the attention scores:
    the routed experts count top_k times, not E (the embedding table is a look-up: no FLOPs; norms, biases,
    sinks are not matmuls either, well under 0.1 % here)."""
    from planner.perf.flops import attention_score_flops, step_flops

    spec = get_model(name)
    t = spec.transformers[0]
    cfg = TrainConfig(batch_size=2, seq_len=512, precision="bf16", attention="sdpa")
    tokens = cfg.batch_size * cfg.seq_len
    matmul_params = active_parameters(spec) - t.vocab_size * t.hidden_size
    scores = 3 * t.num_layers * attention_score_flops(t, cfg.batch_size, cfg.seq_len)
    assert abs(step_flops(spec, cfg).model / (6 * matmul_params * tokens + scores) - 1) < 1e-3
