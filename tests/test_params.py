"""Parameter and buffer formulas against real transformers / torch modules built from the same config.

Big models are built on the `meta` device (shapes only, no memory), so every catalog model is checked.
Reference modules are built here straight from transformers (not through jobs/modeling.py), except the
multimodal model, whose real module is the one in jobs/modeling.py.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from planner.models import hf_config  # noqa: E402
from planner.models.blocks import model_blocks  # noqa: E402
from planner.models.catalog import catalog_config, get_model, list_models  # noqa: E402
from planner.models.params import (  # noqa: E402
    block_buffers_bytes,
    block_parameters,
    count_gradient_parameters,
    count_parameters,
)
from planner.spec import ModelSpec  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _modeling():
    if "jobs.modeling" in sys.modules:
        return sys.modules["jobs.modeling"]
    spec = importlib.util.spec_from_file_location("jobs.modeling", ROOT / "jobs" / "modeling.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["jobs.modeling"] = module
    spec.loader.exec_module(module)
    return module


def hf_module(config: dict[str, Any]):
    """The transformers class of architectures[0], built on meta straight from the config dict."""
    cfg = {k: v for k, v in config.items() if k != "_source"}
    model_type = cfg.pop("model_type")
    with torch.device("meta"):
        conf = transformers.AutoConfig.for_model(model_type, **cfg)
        return getattr(transformers, cfg["architectures"][0])(conf)


def real_count(module) -> int:
    return sum(p.numel() for p in module.parameters())  # tied parameters appear once


def real_buffer_bytes(module) -> int:
    return sum(b.numel() * b.element_size() for b in module.buffers())


def planned(config: dict[str, Any]) -> ModelSpec:
    return hf_config.spec_from_hf_config(config, name="t")


# ------------------------------------------------------------------------------------ catalog


@pytest.mark.parametrize("name", [n for n in list_models() if n != "multimodal-bert"])
def test_every_catalog_model_matches_transformers(name):
    spec = get_model(name)
    module = hf_module(catalog_config(name))
    assert count_parameters(spec)["total"] == real_count(module)
    assert sum(block_buffers_bytes(b) for b in model_blocks(spec)) == real_buffer_bytes(module)


@pytest.mark.parametrize("name", [n for n in list_models() if n != "multimodal-bert"])
@pytest.mark.parametrize("head", ["base", "sequence-classification"])
def test_catalog_models_with_other_heads(name, head):
    spec = get_model(name, head=head)
    module = hf_module(spec.transformers[0].hf_config)
    assert type(module).__name__ == spec.transformers[0].architecture
    assert count_parameters(spec)["total"] == real_count(module)


# ------------------------------------------------------------------------------------ unusual configs

UNUSUAL: dict[str, dict[str, Any]] = {
    "bert-odd-vocab-untied-mlm": dict(model_type="bert", architectures=["BertForMaskedLM"], vocab_size=30001,
                                      hidden_size=36, num_hidden_layers=3, num_attention_heads=3,
                                      intermediate_size=50, max_position_embeddings=77, type_vocab_size=5,
                                      tie_word_embeddings=False),
    "bert-cls-5": dict(model_type="bert", architectures=["BertForSequenceClassification"], vocab_size=999,
                       hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=12,
                       max_position_embeddings=64, num_labels=5),
    "roberta-cls-id2label": dict(model_type="roberta", architectures=["RobertaForSequenceClassification"],
                                 vocab_size=1003, hidden_size=24, num_hidden_layers=2, num_attention_heads=4,
                                 intermediate_size=40, max_position_embeddings=130, pad_token_id=1,
                                 type_vocab_size=1, id2label={"0": "a", "1": "b", "2": "c"}),
    "roberta-untied-mlm": dict(model_type="roberta", architectures=["RobertaForMaskedLM"], vocab_size=517,
                               hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=20,
                               max_position_embeddings=66, tie_word_embeddings=False),
    "roberta-base-model": dict(model_type="roberta", architectures=["RobertaModel"], vocab_size=211,
                               hidden_size=16, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                               max_position_embeddings=40),
    "distilbert-cls-5": dict(model_type="distilbert", architectures=["DistilBertForSequenceClassification"],
                             vocab_size=30523, dim=12, n_layers=2, n_heads=3, hidden_dim=7,
                             max_position_embeddings=33, num_labels=5),
    "distilbert-untied-mlm": dict(model_type="distilbert", architectures=["DistilBertForMaskedLM"],
                                  vocab_size=101, dim=16, n_layers=1, n_heads=4, hidden_dim=24,
                                  max_position_embeddings=20, tie_word_embeddings=False),
    "gpt2-n-inner-untied": dict(model_type="gpt2", architectures=["GPT2LMHeadModel"], vocab_size=50259, n_embd=20,
                                n_layer=2, n_head=5, n_inner=33, n_positions=99, tie_word_embeddings=False),
    "gpt2-cls-5": dict(model_type="gpt2", architectures=["GPT2ForSequenceClassification"], vocab_size=333,
                       n_embd=16, n_layer=1, n_head=2, n_positions=50, num_labels=5),
    "llama-gqa-biased-tied": dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=32003,
                                  hidden_size=48, num_hidden_layers=2, num_attention_heads=6,
                                  num_key_value_heads=2, intermediate_size=130, attention_bias=True,
                                  mlp_bias=True, tie_word_embeddings=True, max_position_embeddings=128),
    "llama-cls-5": dict(model_type="llama", architectures=["LlamaForSequenceClassification"], vocab_size=100,
                        hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=1,
                        intermediate_size=20, num_labels=5),
    "llama-base-odd-head-dim": dict(model_type="llama", architectures=["LlamaModel"], vocab_size=77,
                                    hidden_size=30, num_hidden_layers=1, num_attention_heads=3,
                                    intermediate_size=11),
    "mistral-cls-bias-ignored": dict(model_type="mistral", architectures=["MistralForSequenceClassification"],
                                     vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, intermediate_size=48, num_labels=5,
                                     attention_bias=True),
    "mistral-tied-lm": dict(model_type="mistral", architectures=["MistralForCausalLM"], vocab_size=97,
                            hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                            intermediate_size=8, tie_word_embeddings=True),
}


@pytest.mark.parametrize("case", list(UNUSUAL))
def test_unusual_configs_match_transformers(case):
    config = UNUSUAL[case]
    spec = planned(config)
    module = hf_module(config)
    assert count_parameters(spec)["total"] == real_count(module)
    assert sum(block_buffers_bytes(b) for b in model_blocks(spec)) == real_buffer_bytes(module)


def test_num_labels_follow_transformers():
    """num_labels from id2label; an explicit num_labels wins over id2label (transformers 5 keeps it)."""
    assert planned(UNUSUAL["roberta-cls-id2label"]).transformers[0].num_labels == 3
    both = {**UNUSUAL["bert-cls-5"], "id2label": {"0": "x", "1": "y"}}
    spec = planned(both)
    assert spec.transformers[0].num_labels == 5
    assert count_parameters(spec)["total"] == real_count(hf_module(both))


FAMILY_PARTS = {  # (embeddings, first layer, final norm) submodule paths in the base model
    "bert": ("embeddings", "encoder.layer.0", None),
    "roberta": ("embeddings", "encoder.layer.0", None),
    "distilbert": ("embeddings", "transformer.layer.0", None),
    "gpt2": (None, "h.0", "ln_f"),
    "llama": ("embed_tokens", "layers.0", "norm"),
    "mistral": ("embed_tokens", "layers.0", "norm"),
}


@pytest.mark.parametrize("case", ["bert-cls-5", "roberta-base-model", "distilbert-cls-5", "gpt2-cls-5",
                                  "llama-gqa-biased-tied", "mistral-cls-bias-ignored"])
def test_blocks_match_submodules(case):
    """Each block's count equals its own submodule's, so per-block memory is right, not just the total."""
    config = {**UNUSUAL[case], "architectures": [hf_config.architecture_for(UNUSUAL[case]["model_type"], "base")]}
    spec = planned(config)
    base = hf_module(config)
    t = spec.transformers[0]
    blocks = {b.role: b for b in model_blocks(spec)}
    emb, layer, final = FAMILY_PARTS[t.family]
    if emb is None:  # GPT-2 keeps wte/wpe on the model itself
        assert block_parameters(blocks["embeddings"]) == real_count(base.wte) + real_count(base.wpe)
    else:
        assert block_parameters(blocks["embeddings"]) == real_count(base.get_submodule(emb))
    assert block_parameters(blocks["layer"]) == real_count(base.get_submodule(layer))
    if final:
        assert block_parameters(blocks["final_norm"]) == real_count(base.get_submodule(final))
    if t.pooler:
        assert block_parameters(blocks["pooler"]) == real_count(base.pooler)


# property test: random small sizes per family and head
_FAMILIES = st.sampled_from(sorted(hf_config.CLASS_PREFIX))


@st.composite
def random_configs(draw):
    family = draw(_FAMILIES)
    head = draw(st.sampled_from(hf_config.heads_of(family)))
    heads = draw(st.integers(1, 4))
    kv = draw(st.sampled_from([d for d in range(1, heads + 1) if heads % d == 0]))
    hidden = heads * draw(st.integers(1, 6)) * 2
    vocab, layers, inter = draw(st.integers(5, 300)), draw(st.integers(1, 2)), draw(st.integers(1, 40))
    positions = draw(st.integers(8, 70))
    tie = draw(st.booleans())
    if family in ("bert", "roberta"):
        cfg = dict(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, intermediate_size=inter,
                   max_position_embeddings=positions, type_vocab_size=draw(st.integers(1, 3)))
    elif family == "distilbert":
        cfg = dict(dim=hidden, n_layers=layers, n_heads=heads, hidden_dim=inter, max_position_embeddings=positions)
    elif family == "gpt2":
        cfg = dict(n_embd=hidden, n_layer=layers, n_head=heads, n_inner=inter, n_positions=positions,
                   bos_token_id=0, eos_token_id=0)
    else:
        cfg = dict(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                   intermediate_size=inter, max_position_embeddings=positions, bos_token_id=0, eos_token_id=0)
        if family == "llama":
            cfg |= dict(attention_bias=draw(st.booleans()), mlp_bias=draw(st.booleans()))
        if family == "deepseek_v2":  # DeepseekV2Config's default top-k is None: its router cannot run without one
            cfg["num_experts_per_tok"] = draw(st.integers(1, 6))
    cfg |= dict(model_type=family, architectures=[hf_config.architecture_for(family, head)], vocab_size=vocab,
                tie_word_embeddings=tie, pad_token_id=0 if family != "roberta" else 1)
    if head == "sequence-classification":
        cfg["num_labels"] = draw(st.integers(1, 7))
    return cfg


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_configs())
def test_random_configs_match_transformers(config):
    spec = planned(config)
    module = hf_module(config)
    assert count_parameters(spec)["total"] == real_count(module)
    assert sum(block_buffers_bytes(b) for b in model_blocks(spec)) == real_buffer_bytes(module)


# ------------------------------------------------------------------------------------ multimodal

MULTIMODAL_CASES = [
    {},
    {"text_model": "roberta-base", "tab_in": 37, "tab_out": 19, "text_out": 7, "num_classes": 5},
    {"text_model": "distilbert-base-uncased", "tab_in": 3, "tab_out": 300, "text_out": 1, "binary": False},
    {"text_model": "bert-large-uncased", "tab_in": 1000, "num_classes": 2, "binary": True},
]


@pytest.mark.parametrize("options", MULTIMODAL_CASES)
def test_multimodal_components_match_real_submodules(options):
    spec = get_model("multimodal-bert", **options)
    model = _modeling().build_model(spec.model_dump(mode="json"), device="meta")
    counts = count_parameters(spec)
    assert [c.name for c in spec.components] == ["TabAE", "TextBertBase", "merge"]
    for name in ("TabAE", "TextBertBase", "merge"):
        assert counts[name] == real_count(getattr(model, name)), name
    assert counts["total"] == real_count(model)
    assert sum(block_buffers_bytes(b) for b in model_blocks(spec)) == real_buffer_bytes(model)
    # block TabAE.<i>.<kind> is module TabAE.<i>
    for block in model_blocks(spec):
        if block.role in ("dense", "batchnorm"):
            assert block_parameters(block) == real_count(model.get_submodule(f"{block.component}.{block.index}"))


# ------------------------------------------------------------------------------------ jobs/modeling.py


@pytest.mark.parametrize("case", list(UNUSUAL))
@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_build_model_trains_one_step(case, attention):
    """build_model + make_batch + loss_of: one real CPU step reaches every parameter with a gradient."""
    modeling = _modeling()
    spec = planned(UNUSUAL[case]).model_dump(mode="json")
    model = modeling.build_model(spec, attention)
    assert model.training and model.config._attn_implementation == attention
    batch = modeling.make_batch(spec, 3, 8, "cpu")
    assert all(v.dtype == torch.int64 for v in batch.values())
    modeling.loss_of(model, batch).backward()
    with_grad = sum(p.numel() for p in model.parameters() if p.grad is not None)
    assert count_gradient_parameters(planned(UNUSUAL[case])) == with_grad
    assert count_parameters(planned(UNUSUAL[case]))["total"] == real_count(model)


@pytest.mark.parametrize("options", MULTIMODAL_CASES)
def test_multimodal_step_under_fake_tensors(options):
    from torch._subclasses.fake_tensor import FakeTensorMode

    modeling = _modeling()
    spec = get_model("multimodal-bert", **options).model_dump(mode="json")
    with FakeTensorMode():
        model = modeling.build_model(spec)
        batch = modeling.make_batch(spec, 2, 16, "cpu")
        assert batch["tabular_features"].dtype == torch.float32
        assert batch["tabular_features"].shape == (2, spec["inputs"]["tabular_features"])
        assert batch["labels"].shape == (2,) and batch["labels"].dtype == torch.int64
        assert ("token_type_ids" in batch) == spec["inputs"]["token_type_ids"]
        loss = modeling.loss_of(model, batch)
        loss.backward()
    assert loss.shape == ()
    assert all(p.grad is not None for p in model.parameters())
