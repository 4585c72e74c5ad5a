"""The config.json reader, the catalog's options and errors, and `planner models`."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from planner.errors import PlannerError
from planner.models import hf_config
from planner.models.catalog import catalog_config, get_model, list_models
from planner.models.hf_config import load_config_file, spec_from_hf_config, transformer_from_hf_config

BERT = catalog_config("bert-base-uncased")


def _error(config) -> PlannerError:
    with pytest.raises(PlannerError) as info:
        spec_from_hf_config(config, name="x")
    return info.value


# ------------------------------------------------------------------------------------ bad configs


def test_unknown_model_type_names_the_field():
    err = _error({**BERT, "model_type": "t5"})
    assert err.field == "config.json:model_type" and "'t5'" in str(err) and "bert" in err.allowed


def test_unknown_architecture_names_the_field():
    err = _error({**BERT, "architectures": ["BertForQuestionAnswering"]})
    assert err.field == "config.json:architectures[0]" and "BertForSequenceClassification" in err.allowed
    assert _error({**BERT, "architectures": ["GPT2LMHeadModel"]}).field == "config.json:architectures[0]"


@pytest.mark.parametrize("key", ["hidden_size", "num_hidden_layers", "vocab_size", "model_type", "architectures"])
def test_missing_required_key(key):
    config = dict(BERT)
    del config[key]
    err = _error(config)
    assert err.field == f"config.json:{key}" and "missing" in str(err)


@pytest.mark.parametrize("key,value", [("hidden_size", "768"), ("num_hidden_layers", True), ("vocab_size", 0),
                                       ("hidden_dropout_prob", 1.5), ("tie_word_embeddings", "yes"),
                                       ("num_attention_heads", 7)])
def test_ill_typed_keys(key, value):
    err = _error({**BERT, key: value})
    assert err.field == f"config.json:{key}" and repr(value) in str(err)


def test_gqa_heads_must_divide():
    llama = catalog_config("llama-3-8b")
    assert _error({**llama, "num_key_value_heads": 5}).field == "config.json:num_key_value_heads"
    assert _error({**llama, "head_dim": 256}).field == "config.json:head_dim"


def test_not_an_object():
    assert _error([1, 2]).field == "config.json"


def test_malformed_json_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{"model_type": "bert",\n "hidden_size": }')
    with pytest.raises(PlannerError) as info:
        load_config_file(path)
    assert info.value.field == "config.json" and "line 2" in str(info.value)
    with pytest.raises(PlannerError):
        get_model(str(path))


def test_missing_file():
    with pytest.raises(PlannerError) as info:
        get_model("/nonexistent/config.json")
    assert info.value.field == "--model"


# ------------------------------------------------------------------------------------ faithful fields


def test_bert_fields():
    t = transformer_from_hf_config(BERT)
    assert (t.family, t.architecture, t.head, t.pooler) == ("bert", "BertForMaskedLM", "masked-lm", False)
    assert (t.vocab_size, t.hidden_size, t.num_layers, t.num_heads, t.intermediate_size) == (30522, 768, 12, 12, 3072)
    assert (t.max_positions, t.position_table, t.type_vocab_size) == (512, 512, 2)
    assert (t.hidden_dropout, t.attention_dropout, t.embedding_dropout) == (0.1, 0.1, 0.1)
    assert t.hf_config == BERT


def test_roberta_usable_positions():
    t = get_model("roberta-base").transformers[0]
    assert (t.position_table, t.max_positions, t.type_vocab_size) == (514, 512, 1)
    t = transformer_from_hf_config({**catalog_config("roberta-base"), "pad_token_id": 5})
    assert t.max_positions == 514 - 5 - 1


def test_family_dropouts_and_ties():
    d = transformer_from_hf_config({**catalog_config("distilbert-base-uncased"), "dropout": 0.2,
                                    "attention_dropout": 0.3})
    assert (d.hidden_dropout, d.attention_dropout, d.classifier_dropout) == (0.2, 0.3, 0.2)
    g = transformer_from_hf_config({**catalog_config("gpt2"), "resid_pdrop": 0.01, "attn_pdrop": 0.02,
                                    "embd_pdrop": 0.03})
    assert (g.hidden_dropout, g.attention_dropout, g.embedding_dropout, g.tie_word_embeddings) == (0.01, 0.02, 0.03, True)
    assert g.intermediate_size == 4 * 768
    ll = transformer_from_hf_config({**catalog_config("llama-3-8b"), "attention_dropout": 0.05})
    assert (ll.hidden_dropout, ll.attention_dropout, ll.norm, ll.position_table) == (0.0, 0.05, "rmsnorm", 0)
    assert (ll.num_kv_heads, ll.tie_word_embeddings, ll.max_positions, ll.vocab_size) == (8, False, 8192, 128256)
    m = get_model("mistral-7b").transformers[0]
    assert (m.num_kv_heads, m.intermediate_size, m.attention_bias) == (8, 14336, False)


def test_inputs_and_loss():
    assert get_model("bert-base-uncased").inputs.token_type_ids
    assert not get_model("roberta-base").inputs.token_type_ids
    assert get_model("gpt2").inputs.labels == "tokens"
    base = get_model("gpt2", head="base")
    assert (base.inputs.labels, base.loss) == ("none", "none")


# ------------------------------------------------------------------------------------ catalog


def test_catalog_heads_as_on_hub():
    heads = {n: get_model(n).transformers[0].architecture for n in list_models() if n != "multimodal-bert"}
    assert heads["bert-base-uncased"] == "BertForMaskedLM" and heads["gpt2-xl"] == "GPT2LMHeadModel"
    assert heads["llama-2-7b"] == "LlamaForCausalLM" and heads["mistral-7b"] == "MistralForCausalLM"
    for name in heads:
        assert catalog_config(name)["_source"] and catalog_config(name)["model_type"]


def test_head_and_num_labels_options():
    t = get_model("roberta-large", head="sequence-classification", num_labels=5).transformers[0]
    assert (t.architecture, t.num_labels, t.pooler) == ("RobertaForSequenceClassification", 5, False)
    t = get_model("bert-base-uncased", num_labels=3).transformers[0]
    assert (t.head, t.num_labels, t.pooler) == ("sequence-classification", 3, True)
    assert get_model("bert-base-uncased", head="base").transformers[0].pooler
    assert get_model("google-bert/bert-base-uncased").name == "bert-base-uncased"


@pytest.mark.parametrize("options,field", [({"head": "causal-lm"}, "head"), ({"foo": 1}, "--model-option"),
                                           ({"num_labels": 0}, "num_labels"),
                                           ({"head": "masked-lm", "num_labels": 3}, "num_labels")])
def test_bad_options(options, field):
    with pytest.raises(PlannerError) as info:
        get_model("bert-base-uncased", **options)
    assert info.value.field == field


def test_unknown_name_suggests():
    with pytest.raises(PlannerError) as info:
        get_model("bert-base-uncasd")
    assert info.value.field == "--model" and "bert-base-uncased" in str(info.value)


def test_config_path_round_trip(tmp_path):
    path = tmp_path / "my-model.json"
    path.write_text(json.dumps(catalog_config("gpt2")))
    spec = get_model(str(path), head="sequence-classification", num_labels=4)
    assert spec.name == "my-model" and spec.transformers[0].architecture == "GPT2ForSequenceClassification"
    assert spec_from_hf_config(spec.source["config"], name="my-model", source=spec.source) == spec


# ------------------------------------------------------------------------------------ multimodal


def test_multimodal_structure():
    spec = get_model("multimodal-bert")
    tab, text, merge = spec.components
    assert [c.name for c in spec.components] == ["TabAE", "TextBertBase", "merge"]
    assert [layer.kind for layer in tab.layers] == ["batchnorm", "dense", "dense"]
    assert (tab.layers[0].num_features, tab.layers[1].out_features, tab.layers[2].out_features) == (100, 128, 1)
    bert, head = text.layers
    assert (bert.architecture, bert.head, bert.pooler) == ("BertModel", "base", True)
    assert (head.in_features, head.out_features) == (768, 128)
    assert (merge.layers[0].in_features, merge.layers[0].out_features) == (256, 2)
    assert spec.inputs.tabular_features == 100 and spec.inputs.token_type_ids and spec.loss == "multimodal"
    assert get_model(spec.source["catalog"], **spec.source["options"]) == spec


def test_multimodal_options():
    spec = get_model("multimodal-bert", text_model="distilbert-base-uncased", num_classes=5, tab_in=7)
    tab, text, merge = spec.components
    assert tab.layers[2].out_features == 5 and merge.layers[0].out_features == 5
    assert not text.layers[0].pooler and not spec.inputs.token_type_ids
    assert get_model(spec.source["catalog"], **spec.source["options"]) == spec
    for options, field in [({"text_model": "gpt2"}, "text_model"), ({"binary": True, "num_classes": 3}, "binary"),
                           ({"tab_in": 0}, "tab_in"), ({"head": "base"}, "--model-option")]:
        with pytest.raises(PlannerError) as info:
            get_model("multimodal-bert", **options)
        assert info.value.field == field


# ------------------------------------------------------------------------------------ CLI


def test_cli_models_table_and_json():
    from planner.cli.main import app

    runner = CliRunner()
    result = runner.invoke(app, ["models"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    for name in list_models():
        assert name in result.output
    result = runner.invoke(app, ["models", "--json"])
    assert result.exit_code == 0
    rows = json.loads(result.output)
    assert [r["name"] for r in rows] == list_models()
    assert {"name", "family", "head", "parameters", "layers", "hidden", "max_positions"} <= set(rows[0])


def test_family_heads_table():
    assert hf_config.architecture_for("gpt2", "causal-lm") == "GPT2LMHeadModel"
    assert hf_config.architecture_for("llama", "causal-lm") == "LlamaForCausalLM"
    with pytest.raises(PlannerError):
        hf_config.architecture_for("bert", "causal-lm")


def _reader_calls(fn) -> tuple[int, int]:
    """(calls from planner/models/catalog.py into planner/models/hf_config.py, reading a file aside; family
    determinations) while `fn` runs, counted with a profile hook."""
    import sys

    crossings, families = [0], [0]

    def hook(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.endswith(("models/hf_config.py", "models\\hf_config.py")):
            families[0] += frame.f_code.co_name == "family_of"
            back = frame.f_back
            crossings[0] += back is not None and frame.f_code.co_name != "load_config_file" \
                and back.f_code.co_filename.endswith(("models/catalog.py", "models\\catalog.py"))

    sys.setprofile(hook)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return crossings[0], families[0]


def test_a_model_name_is_read_in_one_pass(tmp_path):
    """Issue 33 item 5: a catalog name went back and forth between the catalog and the reader (family_of,
    heads_of, with_head, spec_from_hf_config: 4 calls for gpt2 head=base, the family read 4 times, the dict
    copied 3 times); now the catalog calls the reader once and the family is read once."""
    list_models()  # the catalog's files read beforehand
    path = tmp_path / "config.json"
    path.write_text(json.dumps(catalog_config("gpt2")))
    for name, options in (("gpt2", {"head": "base"}), ("bert-base-uncased", {}),
                          ("google-bert/bert-base-uncased", {"num_labels": 3}), (str(path), {"num_labels": 2})):
        assert _reader_calls(lambda n=name, o=options: get_model(n, **o)) == (1, 1), name
    assert get_model("gpt2", head="base").transformers[0].architecture == "GPT2Model"
    assert get_model("google-bert/bert-base-uncased", num_labels=3).transformers[0].num_labels == 3
