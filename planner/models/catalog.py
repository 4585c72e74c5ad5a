"""Named models: Hugging Face configs shipped in planner/data/models/, and the multimodal BERT classifier.

`get_model(name_or_path, **options)` accepts a catalog name, a hub id listed in a file's `_source`
(e.g. "google-bert/bert-base-uncased"), or a path to a config.json (or a folder holding one).
Catalog models keep the head of their hub config (bert-base-uncased is BertForMaskedLM, gpt2 is
GPT2LMHeadModel); options `head=` and `num_labels=` change it; `use_cache=true` says the training forward
returns its KV cache (planner/memory/kv_cache.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from planner import caches
from planner.errors import PlannerError, unknown
from planner.models import hf_config
from planner.spec import BatchNormSpec, Component, DenseSpec, InputSpec, ModelSpec, TransformerSpec

DATA_DIR = Path(__file__).resolve().parent.parent / "data" / "models"  # shipped as package data
MULTIMODAL = "multimodal-bert"
# Options of multimodal-bert and their defaults (its TabAE / TextBertBase / merge network).
MULTIMODAL_DEFAULTS: dict[str, Any] = {"text_model": "bert-base-uncased", "tab_in": 100, "tab_out": 128,
                                       "text_out": 128, "num_classes": 2, "binary": True}
TRANSFORMER_OPTIONS: tuple[str, ...] = ("head", "num_labels", "use_cache", "fake_balanced_gate")
# Listing order: by family, small to large; a config file added later is listed after these.
ORDER: tuple[str, ...] = ("bert-base-uncased", "bert-large-uncased", "roberta-base", "roberta-large",
                          "distilroberta-base", "distilbert-base-uncased", "gpt2", "gpt2-medium", "gpt2-large",
                          "gpt2-xl", "llama-2-7b", "llama-3-8b", "mistral-7b", "mixtral-8x7b", "qwen3-30b-a3b",
                          "qwen3-235b-a22b", "gpt-oss-20b", "gpt-oss-120b", "deepseek-v2-lite", "deepseek-v2",
                          "moonlight-16b-a3b", "deepseek-v3")


@caches.lru(None, scope="facts", key="none: the catalog's config files")
def _configs() -> dict[str, dict[str, Any]]:
    folder = DATA_DIR
    out: dict[str, dict[str, Any]] = {}
    found = {e.name[: -len(".json")]: e for e in folder.iterdir() if e.name.endswith(".json")}
    rank = {name: i for i, name in enumerate(ORDER)}
    for name in sorted(found, key=lambda n: (rank.get(n, len(ORDER)), n)):
        out[name] = hf_config.load_config_file(found[name])
    return out


SOURCES_FILE = DATA_DIR.parent / "model_sources.json"


@caches.lru(None, scope="facts", key="none: planner/data/model_sources.json")
def _sources() -> dict[str, Any]:
    from planner.io import read_json

    return read_json(SOURCES_FILE, "model_sources.json")


def config_source(name: str) -> dict[str, Any] | None:
    """Where a catalog model's config.json came from and what it was checked against (the Hub file, public
    copies at a commit with the fields read from each, differences, unverified fields); None for a model the
    sources file does not list (planner/data/model_sources.json, issue 35)."""
    row = _sources()["models"].get(name)
    return json.loads(json.dumps(row)) if row is not None else None


def catalog_config(name: str) -> dict[str, Any]:
    """A copy of a catalog model's config.json dict."""
    configs = _configs()
    if name not in configs:
        raise unknown("--model", name, list_models())
    return json.loads(json.dumps(configs[name]))


def list_models() -> list[str]:
    """Catalog names: the shipped configs, then the multimodal model."""
    return [*_configs(), MULTIMODAL]


def _resolve_name(name: str) -> str | None:
    """Catalog name for a name, a case variant of one, or a hub id in a config's `_source`."""
    configs = _configs()
    if name in configs or name == MULTIMODAL:
        return name
    lowered = name.lower()
    for key, cfg in configs.items():
        if lowered in (key.lower(), str(cfg.get("_source", "")).lower()):
            return key
    return MULTIMODAL if lowered == MULTIMODAL else None


def _is_path(name: str) -> bool:
    return name.endswith(".json") or Path(name).exists()


def _check_options(options: dict[str, Any], allowed: tuple[str, ...], model: str) -> None:
    for key in options:
        if key not in allowed:
            raise PlannerError("--model-option", key, f"for {model} one of {', '.join(allowed) or '(none)'}")


def _int_option(options: dict[str, Any], key: str, minimum: int = 1) -> int:
    return hf_config.int_option(options, key, minimum)


def get_model(name_or_path: str, **options: Any) -> ModelSpec:
    """A `ModelSpec` for a catalog name, hub id or config.json path (see the module docstring)."""
    if not isinstance(name_or_path, str) or not name_or_path:
        raise PlannerError("--model", name_or_path, "a catalog name or a config.json path")
    name = _resolve_name(name_or_path)
    if name == MULTIMODAL:
        return multimodal_bert(**options)
    if name is not None:  # one pass through the reader (hf_config.spec_with_options); the cached dict is not copied
        _check_options(options, TRANSFORMER_OPTIONS, name)
        source: dict[str, Any] = {"catalog": name, "options": dict(options)}
        return hf_config.spec_with_options(_configs()[name], options, name=name, source=source)
    if name_or_path.endswith(".py") or ".py:" in name_or_path:  # not a reference (is_reference): no function
        raise PlannerError("--model", name_or_path, "FILE.py:FUNCTION for a model of your own, naming the "
                           "function that returns your nn.Module, e.g. examples/multimodal_bert.py:build")
    if _is_path(name_or_path):
        raw = hf_config.load_config_file(name_or_path)
        _check_options(options, TRANSFORMER_OPTIONS, name_or_path)
        label = Path(name_or_path).stem if Path(name_or_path).stem != "config" else Path(name_or_path).parent.name
        return hf_config.spec_with_options(raw, options, name=label or "config")
    raise unknown("--model", name_or_path, list_models())


# ------------------------------------------------------------------------------------- multimodal


def text_encoder(name: str) -> TransformerSpec:
    """A catalog encoder as a base model; BERT and RoBERTa with their pooler (add_pooling_layer=True)."""
    encoders = [n for n, c in _configs().items() if c.get("model_type") in hf_config.ENCODERS]
    resolved = _resolve_name(name) if isinstance(name, str) else None
    if resolved not in encoders:
        raise unknown("text_model", str(name), encoders)
    return hf_config.transformer_with_options(_configs()[resolved], {"head": "base"})[0]


def multimodal_bert(**options: Any) -> ModelSpec:
    """The multimodal classifier users train: a tabular branch, a text branch and a merge layer.

    - TabAE: BatchNorm1d(tab_in) -> Linear(tab_in, tab_out) -> Linear(tab_out, 1 if binary else num_classes);
      the tab_out features feed the merge, the last Linear gives auxiliary tabular logits.
    - TextBertBase: a catalog encoder (BertModel/RobertaModel with pooler; DistilBertModel has no pooler, so its
      first token's hidden state stands in) -> Linear(hidden, text_out).
    - merge: Linear(tab_out + text_out, num_classes) on the concatenated features.

    No nonlinearity between these Linear layers (as the reference model defines them).
    Loss ("multimodal"): cross-entropy on the merge logits + an auxiliary loss on the TabAE logits:
    BCE-with-logits when binary, cross-entropy otherwise. jobs/modeling.py builds exactly this.
    """
    _check_options(options, tuple(MULTIMODAL_DEFAULTS), MULTIMODAL)
    opts = {**MULTIMODAL_DEFAULTS, **options}
    for key in ("tab_in", "tab_out", "text_out"):
        _int_option(opts, key)
    num_classes = _int_option(opts, "num_classes", minimum=2)
    if not isinstance(opts["binary"], bool):
        raise PlannerError("binary", opts["binary"], "true or false")
    if "binary" not in options and "num_classes" in options:
        opts["binary"] = num_classes == 2  # num_classes=5 alone means a multi-class model
    if opts["binary"] and num_classes != 2:
        raise PlannerError("binary", True, f"only with num_classes=2 (got num_classes={num_classes})")
    text = text_encoder(opts["text_model"])
    tab_in, tab_out, text_out = opts["tab_in"], opts["tab_out"], opts["text_out"]
    tab_head = 1 if opts["binary"] else num_classes
    components = (
        Component(name="TabAE", layers=(BatchNormSpec(num_features=tab_in), DenseSpec(in_features=tab_in, out_features=tab_out),
                                        DenseSpec(in_features=tab_out, out_features=tab_head))),
        Component(name="TextBertBase", layers=(text, DenseSpec(in_features=text.hidden_size, out_features=text_out))),
        Component(name="merge", layers=(DenseSpec(in_features=tab_out + text_out, out_features=num_classes),)),
    )
    inputs = InputSpec(token_type_ids=text.family in hf_config.TOKEN_TYPE_INPUTS, tabular_features=tab_in,
                       labels="class")
    return ModelSpec(
        name=MULTIMODAL, components=components, inputs=inputs, loss="multimodal",
        description=(f"TabAE({tab_in}->{tab_out}->{tab_head}) + TextBertBase({opts['text_model']}->{text_out}) "
                     f"+ merge({tab_out + text_out}->{num_classes})"),
        source={"catalog": MULTIMODAL, "options": opts},
    )


# ------------------------------------------------------------------------------------- listing


def describe_models() -> list[dict[str, Any]]:
    """One row per catalog model: name, family, head, architecture, parameters, layers, hidden, positions."""
    from planner.models.params import count_parameters

    rows = []
    for name in list_models():
        spec = get_model(name)
        t = spec.transformers[0]
        rows.append({
            "name": name,
            "family": f"multimodal ({t.family})" if name == MULTIMODAL else t.family,
            "head": "multimodal" if name == MULTIMODAL else t.head,
            "architecture": "TabAE+TextBertBase+merge" if name == MULTIMODAL else t.architecture,
            "parameters": count_parameters(spec)["total"],
            "layers": t.num_layers,
            "hidden": t.hidden_size,
            "max_positions": spec.max_positions,
            "source": _configs()[name].get("_source", "") if name in _configs() else "planner",
        })
    return rows


@caches.lru(256, scope="model", key="(catalog name, options JSON)")
def _cached_from_key(name: str, options_json: str) -> ModelSpec:
    return get_model(name, **json.loads(options_json))


def cached_model(name: str, options: dict[str, Any] | None = None) -> ModelSpec:
    """`get_model` once per (name, options) per process: estimate and search resolve the same model often."""
    return _cached_from_key(name, json.dumps(options or {}, sort_keys=True))
