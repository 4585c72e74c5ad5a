"""The rest of the MoE catalog (issue 35 items 1 and 2): DeepSeek-V2, DeepSeek-V2-Lite and Moonlight against the
transformers modules, DeepSeek-V2's saved tensors against autograd's hooks, its bad fields, and the sources of
every MoE catalog config.

- total and active parameters of deepseek-v2, deepseek-v2-lite and moonlight-16b-a3b equal the modules built
  on the meta device from the same config (tests/test_moe.py does the same for the other MoE catalog models);
- tiny DeepSeek-V2 configs (group-limited and greedy routing, with and without the query bottleneck, LM and
  classifier heads): every parameter tensor's name and shape, total and active;
- DeepSeek-V2's saved bytes per block: an upper bound of what autograd's hooks see on a tiny real module, within
  the approximation's spread (its attention and experts as docs/moe.md says);
- planner/data/model_sources.json: every MoE catalog config has a row naming the Hub file and public copies at a
  commit, and every field a copy was read for equals the catalog file.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from typer.testing import CliRunner

from planner.families.forms import model_program
from planner.ir.context import Ctx
from planner.models import hf_config
from planner.models.catalog import catalog_config, config_source, get_model, list_models
from planner.models.params import active_parameters, count_parameters
from planner.spec import TrainConfig
from tests.test_moe import _module, _module_counts

NEW = ("deepseek-v2-lite", "deepseek-v2", "moonlight-16b-a3b")
# Published totals / actives: DeepSeek-V2 236B / 21B and DeepSeek-V2-Lite 15.7B / 2.4B (the DeepSeek-V2 paper,
# arXiv:2405.04434, and the model cards; their "activated" figures leave out the input embedding table, a
# look-up, as gpt-oss's do), Moonlight 16B / 3B (its model card, embeddings in).
PUBLISHED = {"deepseek-v2-lite": (15.7e9, 2.4e9, False), "deepseek-v2": (236e9, 21e9, False),
             "moonlight-16b-a3b": (16e9, 3e9, True)}

TINY_V2: dict[str, dict[str, Any]] = {
    "group_limited": dict(model_type="deepseek_v2", architectures=["DeepseekV2ForCausalLM"], vocab_size=128,
                          hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
                          intermediate_size=96, moe_intermediate_size=24, n_routed_experts=8, num_experts_per_tok=2,
                          n_shared_experts=2, first_k_dense_replace=1, n_group=2, topk_group=1,
                          topk_method="group_limited_greedy", q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8,
                          qk_nope_head_dim=16, v_head_dim=12, max_position_embeddings=256),
    "lite_like_classifier": dict(model_type="deepseek_v2", architectures=["DeepseekV2ForSequenceClassification"],
                                 vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                 intermediate_size=40, moe_intermediate_size=8, n_routed_experts=4,
                                 num_experts_per_tok=3, n_shared_experts=1, first_k_dense_replace=0,
                                 topk_method="greedy", q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=4,
                                 qk_nope_head_dim=8, v_head_dim=8, num_labels=3, attention_bias=True),
}


@pytest.mark.parametrize("name", NEW)
def test_new_catalog_models_total_and_active_are_the_modules(name):
    spec = get_model(name)
    total, active = _module_counts(_module(catalog_config(name)))
    assert count_parameters(spec)["total"] == total
    assert active_parameters(spec) == active
    published_total, published_active, embeddings_in = PUBLISHED[name]
    t = spec.transformers[0]
    if not embeddings_in:
        active -= t.vocab_size * t.hidden_size
    assert abs(total / published_total - 1) < 0.01 and abs(active / published_active - 1) < 0.03


@pytest.mark.parametrize("case", list(TINY_V2))
def test_tiny_deepseek_v2_parameters_and_tensor_names(case):
    spec = hf_config.spec_from_hf_config(TINY_V2[case], name=case)
    module = _module(TINY_V2[case])
    real = sorted((n, tuple(p.shape)) for n, p in module.named_parameters())
    ours = sorted((p.name, p.shape) for p in model_program(spec, Ctx(2, 8, "fp32", "sdpa", "cuda", True)).params)
    assert ours == real
    assert (count_parameters(spec)["total"], active_parameters(spec)) == _module_counts(module)


def test_deepseek_v2_router_never_renormalises():
    """DeepseekV2TopkRouter multiplies the top-k softmax weights by routed_scaling_factor and ignores
    norm_topk_prob; the program's router says so whatever the config holds."""
    spec = hf_config.spec_from_hf_config(TINY_V2["group_limited"] | {"norm_topk_prob": True}, name="v2")
    assert spec.transformers[0].norm_topk_prob is False


@pytest.mark.parametrize("precision", ["fp32", "amp-bf16"])
def test_deepseek_v2_saved_bytes_are_an_upper_bound_within_thirty_percent(precision):
    """DeepSeek-V2 shares DeepSeek-V3's approximations (docs/moe.md: MLA's value and output heads counted at the
    query/key width; the experts as transformers' grouped path where the module loops over the experts it hit)
    and rotates q and k as complex numbers (apply_rotary_emb, not modelled): on this tiny model the planner
    counts 2-8 % more than autograd per layer over three seeds (fp32: layer 0 269,568 vs 251,904 B; layer 1
    322,208 vs 297,632-306,848 B), never less; a full CI run saw layer 1 at 273,056 B (+18 %): the seed does
    not make the routing, hence the experts hit, repeat between processes (as test_moe's DeepSeek-V3 case).
    The bound is that spread, as DeepSeek-V3's, not a fit: a planner below autograd, or 30 % above it, fails."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import torch

    from tests.saved_tensors import measure, program_saved_per_block

    spec = hf_config.spec_from_hf_config(TINY_V2["group_limited"], name="deepseek_v2")
    config = TrainConfig(batch_size=2, seq_len=24, precision=precision, attention="eager")
    torch.manual_seed(0)
    measured = measure(spec, config, fake=False, keep_tensors=False).per_block
    ours = program_saved_per_block(spec, config)
    assert any(name.startswith("model.layer.") for name in measured)
    for name, real in measured.items():
        if name.startswith("model.layer."):
            assert real <= ours[name] <= 1.30 * real, name
        elif name in ("model.final_norm", "model.head"):
            assert ours[name] == real, name


# ------------------------------------------------------------------------------------ bad input

runner = CliRunner()


@pytest.mark.parametrize("change,needle", [
    ({"topk_method": "noaux_tc"}, "config.json:topk_method"),
    ({"mlp_bias": True}, "config.json:mlp_bias"),
    ({"num_experts_per_tok": None}, "config.json:num_experts_per_tok"),
    ({"n_group": 3}, "config.json:n_group"),
    ({"num_experts_per_tok": 9}, "config.json:num_experts_per_tok"),
])
def test_bad_deepseek_v2_fields_are_one_line_exit_2(tmp_path, change, needle):
    from planner.cli.main import app

    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY_V2["group_limited"] | change))
    res = runner.invoke(app, ["estimate", "--model", str(path), "--instance", "ml.g5.xlarge", "--batch-size", "1",
                              "--seq-len", "64"])
    assert res.exit_code == 2, res.output
    assert needle in res.output and len(res.output.strip().splitlines()) == 1, res.output


# ------------------------------------------------------------------------------------ sources

MOE_CATALOG = [n for n in list_models() if n != "multimodal-bert" and get_model(n).transformers[0].moe]


def test_every_moe_catalog_model_is_in_the_catalog():
    """The issue's list, plus DeepSeek-V2 and its Lite."""
    assert {"mixtral-8x7b", "qwen3-30b-a3b", "qwen3-235b-a22b", "deepseek-v3", "moonlight-16b-a3b", "gpt-oss-20b",
            "gpt-oss-120b", "deepseek-v2", "deepseek-v2-lite"} <= set(MOE_CATALOG)


@pytest.mark.parametrize("name", MOE_CATALOG)
def test_every_moe_catalog_config_cites_its_source_and_agrees_with_it(name):
    row = config_source(name)
    assert row is not None, f"{name} has no row in planner/data/model_sources.json"
    cfg = catalog_config(name)
    assert row["config"] == f"https://huggingface.co/{cfg['_source']}/blob/main/config.json"
    assert row["copies"] or row["unverified"], name
    for copy in row["copies"]:
        assert re.fullmatch(r"[0-9a-f]{40}", copy["commit"]) and "/" in copy["repo"] and copy["path"], copy
        assert copy["fields"], copy
        for key, value in copy["fields"].items():
            assert cfg.get(key, "absent") == value, (name, copy["repo"], key)
    for key in row["unverified"]:
        assert key in cfg, (name, key)  # an unverified field is one the catalog file holds
