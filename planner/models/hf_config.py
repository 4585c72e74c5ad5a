"""Read a Hugging Face `config.json` into the planner's `TransformerSpec` / `ModelSpec`.

Why a reader of our own instead of `transformers.AutoConfig`: the planner core must not import torch or
transformers, and every bad field must become a one-line `PlannerError` naming it. The defaults used for
absent optional keys are those of the transformers 5 config classes (e.g. `BertConfig.type_vocab_size=2`,
`LlamaConfig.tie_word_embeddings=False`), so the spec describes exactly the module that
`transformers` would build from the same dict; tests/test_params.py checks this against real modules.

Supported: model_type bert, roberta, distilbert, gpt2, llama, mistral, mixtral, qwen2_moe, qwen3_moe, olmoe,
gpt_oss, deepseek_v2, deepseek_v3; `architectures[0]` picks the head:
`<Prefix>Model` -> "base", `...ForSequenceClassification`, `...ForMaskedLM` (encoders),
`GPT2LMHeadModel` / `...ForCausalLM` (decoders).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from planner.errors import PlannerError
from planner.families import FAMILIES
from planner.spec import Component, InputSpec, ModelSpec, TransformerSpec

FIELD = "config.json"

# The model's real maximums, so an absurd config answers at once instead of building 10^9 layers.
# ASSUMPTION: 1,024 layers is 8x the deepest published decoder (Llama 3.1 405B: 126 layers; GPT-3 175B: 96;
# Megatron-Turing NLG 530B: 105). 2^24 bounds every other size (largest vocab ~256k = 2^18, widest hidden
# 16,384 and FFN 53,248 in Llama 3.1 405B, longest context 10M tokens in Llama 4 Scout < 2^24).
MAX_LAYERS = 1024
MAX_DIM = 1 << 24
LAYER_KEYS = ("num_hidden_layers", "n_layers", "n_layer")
# Activations with a saved-tensor formula in planner.memory.activations.mlp_activation (transformers' ACT2FN
# names); any other `hidden_act` is refused here rather than failing deep inside the estimate.
ACTIVATIONS: tuple[str, ...] = ("gelu", "gelu_pytorch_tanh", "silu", "swish", "gelu_python", "gelu_accurate",
                                "relu", "gelu_new", "gelu_fast")

# Views of the family records (planner.families), under the names this reader and its callers use.
CLASS_PREFIX: dict[str, str] = {name: f.class_prefix for name, f in FAMILIES.items()}
ENCODERS: tuple[str, ...] = tuple(name for name, f in FAMILIES.items() if f.encoder)
DECODERS: tuple[str, ...] = tuple(name for name, f in FAMILIES.items() if f.decoder)

# Class-name suffix per head; decoders' causal-LM class is GPT2LMHeadModel but LlamaForCausalLM.
_SUFFIX: dict[str, str] = {"base": "Model", "sequence-classification": "ForSequenceClassification",
                           "masked-lm": "ForMaskedLM", "causal-lm": "ForCausalLM"}

# transformers 5 defaults of `tie_word_embeddings` per config class (BertConfig ... MistralConfig).
TIE_DEFAULT: dict[str, bool] = {name: f.tie_word_embeddings_default for name, f in FAMILIES.items()}

# Tokenizers' `model_input_names`: only BERT's tokenizer returns token_type_ids (RoBERTa's, DistilBERT's,
# GPT-2's and Llama's return input_ids and attention_mask), so only BERT batches carry that int64 tensor.
TOKEN_TYPE_INPUTS: tuple[str, ...] = tuple(name for name, f in FAMILIES.items() if f.token_type_inputs)


def heads_of(family: str) -> tuple[str, ...]:
    """Heads the planner supports for a family: encoders have masked-LM, decoders causal-LM (and
    sequence classification where transformers has the class: OLMoE has none)."""
    lm = "masked-lm" if family in ENCODERS else "causal-lm"
    if not FAMILIES[family].classifier_head:
        return ("base", lm)
    return ("base", "sequence-classification", lm)


def architecture_for(family: str, head: str) -> str:
    """The transformers class name for a family and head, e.g. ("gpt2", "causal-lm") -> GPT2LMHeadModel."""
    if head not in heads_of(family):
        raise PlannerError("head", head, heads_of(family))
    if family == "gpt2" and head == "causal-lm":
        return "GPT2LMHeadModel"
    return CLASS_PREFIX[family] + _SUFFIX[head]


def _architectures(family: str) -> dict[str, str]:
    out = {architecture_for(family, h): h for h in heads_of(family)}
    return out


# ------------------------------------------------------------------------------------- field readers


def _missing(key: str, allowed: str) -> PlannerError:
    return PlannerError(f"{FIELD}:{key}", None, f"missing; required {allowed}")


def _int(cfg: dict[str, Any], key: str, default: int | None = None, *, minimum: int = 1,
         required: bool = False) -> int | None:
    """An integer field (absent or null -> `default`); bools are not integers here (JSON `true` is no size)."""
    value = cfg.get(key)
    if value is None:
        if required:
            raise _missing(key, f"integer >= {minimum}")
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise PlannerError(f"{FIELD}:{key}", value, f"an integer >= {minimum}")
    limit = MAX_LAYERS if key in LAYER_KEYS else MAX_DIM
    if value > limit:
        raise PlannerError(f"{FIELD}:{key}", value, f"an integer <= {limit:,}")
    return value


def _req(cfg: dict[str, Any], key: str) -> int:
    value = _int(cfg, key, required=True)
    assert value is not None
    return value


def _float(cfg: dict[str, Any], key: str, default: float | None) -> float | None:
    value = cfg.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 <= value < 1.0:
        raise PlannerError(f"{FIELD}:{key}", value, "a probability in [0, 1)")
    return float(value)


def _bool(cfg: dict[str, Any], key: str, default: bool) -> bool:
    value = cfg.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise PlannerError(f"{FIELD}:{key}", value, "true or false")
    return value


def _str(cfg: dict[str, Any], key: str, default: str) -> str:
    value = cfg.get(key, default)
    if not isinstance(value, str):
        raise PlannerError(f"{FIELD}:{key}", value, "a string")
    return value


def num_labels_of(cfg: dict[str, Any]) -> int:
    """As transformers 5 does: an explicit `num_labels` wins, else len(id2label), else 2."""
    if cfg.get("num_labels") is not None:
        return _req(cfg, "num_labels")
    id2label = cfg.get("id2label")
    if id2label is None:
        return 2
    if not isinstance(id2label, dict) or not id2label:
        raise PlannerError(f"{FIELD}:id2label", id2label, "a non-empty object {index: label}")
    return len(id2label)


def _check_heads(hidden: int, heads: int, kv_heads: int, head_dim: int | None) -> None:
    if hidden % heads:
        raise PlannerError(f"{FIELD}:num_attention_heads", heads, f"a divisor of hidden_size={hidden}")
    if heads % kv_heads:
        raise PlannerError(f"{FIELD}:num_key_value_heads", kv_heads, f"a divisor of num_attention_heads={heads}")
    if head_dim is not None and head_dim != hidden // heads:
        raise PlannerError(f"{FIELD}:head_dim", head_dim,
                           f"hidden_size/num_attention_heads={hidden // heads} (other head sizes are not modelled)")


# ------------------------------------------------------------------------------------- per family


def _bert_like(cfg: dict[str, Any], family: str) -> dict[str, Any]:
    """BERT and RoBERTa share BertConfig's fields; RoBERTa's position ids start after padding_idx."""
    if _bool(cfg, "add_cross_attention", False):
        raise PlannerError(f"{FIELD}:add_cross_attention", True, "false (cross-attention is not modelled)")
    pet = cfg.get("position_embedding_type", "absolute")
    if pet not in (None, "absolute"):
        raise PlannerError(f"{FIELD}:position_embedding_type", pet, "absolute (transformers 5 builds only that)")
    hidden, heads = _req(cfg, "hidden_size"), _req(cfg, "num_attention_heads")
    _check_heads(hidden, heads, heads, None)
    table = _req(cfg, "max_position_embeddings")
    usable = table
    if family == "roberta":
        # RobertaEmbeddings numbers positions padding_idx + 1 ... so the table holds pad_token_id + 1 fewer.
        pad = _int(cfg, "pad_token_id", 1, minimum=0)
        assert pad is not None
        usable = table - pad - 1
        if usable < 1:
            raise PlannerError(f"{FIELD}:max_position_embeddings", table, f"> pad_token_id + 1 = {pad + 1}")
    hidden_dropout = _float(cfg, "hidden_dropout_prob", 0.1)
    return dict(
        vocab_size=_req(cfg, "vocab_size"), hidden_size=hidden, num_layers=_req(cfg, "num_hidden_layers"),
        num_heads=heads, num_kv_heads=heads, intermediate_size=_req(cfg, "intermediate_size"),
        max_positions=usable, position_table=table, type_vocab_size=_int(cfg, "type_vocab_size", 2),
        hidden_act=_str(cfg, "hidden_act", "gelu"), norm="layernorm", hidden_dropout=hidden_dropout,
        attention_dropout=_float(cfg, "attention_probs_dropout_prob", 0.1), embedding_dropout=hidden_dropout,
        classifier_dropout=_float(cfg, "classifier_dropout", None), attention_bias=True, mlp_bias=True,
    )


def _distilbert(cfg: dict[str, Any]) -> dict[str, Any]:
    hidden, heads = _req(cfg, "dim"), _req(cfg, "n_heads")
    _check_heads(hidden, heads, heads, None)
    table = _req(cfg, "max_position_embeddings")
    dropout = _float(cfg, "dropout", 0.1)
    return dict(
        vocab_size=_req(cfg, "vocab_size"), hidden_size=hidden, num_layers=_req(cfg, "n_layers"),
        num_heads=heads, num_kv_heads=heads, intermediate_size=_req(cfg, "hidden_dim"),
        max_positions=table, position_table=table, type_vocab_size=0, hidden_act=_str(cfg, "activation", "gelu"),
        norm="layernorm", hidden_dropout=dropout, attention_dropout=_float(cfg, "attention_dropout", 0.1),
        embedding_dropout=dropout, classifier_dropout=_float(cfg, "seq_classif_dropout", 0.2),
        attention_bias=True, mlp_bias=True,
    )


def _alias(cfg: dict[str, Any], key: str, alias: str) -> str:
    """GPT2Config's attribute_map lets `hidden_size` stand for `n_embd` etc.; prefer the real name."""
    return key if key in cfg or alias not in cfg else alias


def _gpt2(cfg: dict[str, Any]) -> dict[str, Any]:
    hidden = _req(cfg, _alias(cfg, "n_embd", "hidden_size"))
    heads = _req(cfg, _alias(cfg, "n_head", "num_attention_heads"))
    _check_heads(hidden, heads, heads, None)
    if _bool(cfg, "add_cross_attention", False):
        raise PlannerError(f"{FIELD}:add_cross_attention", True, "false (cross-attention is not modelled)")
    table = _req(cfg, _alias(cfg, "n_positions", "max_position_embeddings"))
    inner = _int(cfg, "n_inner", None) or 4 * hidden  # GPT2MLP: n_inner or 4 * n_embd
    return dict(
        vocab_size=_req(cfg, "vocab_size"), hidden_size=hidden,
        num_layers=_req(cfg, _alias(cfg, "n_layer", "num_hidden_layers")), num_heads=heads, num_kv_heads=heads,
        intermediate_size=inner, max_positions=table, position_table=table, type_vocab_size=0,
        hidden_act=_str(cfg, "activation_function", "gelu_new"), norm="layernorm",
        hidden_dropout=_float(cfg, "resid_pdrop", 0.1), attention_dropout=_float(cfg, "attn_pdrop", 0.1),
        embedding_dropout=_float(cfg, "embd_pdrop", 0.1), classifier_dropout=None,
        attention_bias=True, mlp_bias=True,
    )


def _llama_like(cfg: dict[str, Any], family: str) -> dict[str, Any]:
    """Llama and Mistral: RMSNorm, SwiGLU MLP, rotary positions, grouped-query attention, no hidden dropout."""
    hidden, heads = _req(cfg, "hidden_size"), _req(cfg, "num_attention_heads")
    # LlamaConfig: num_key_value_heads=None -> num_attention_heads; MistralConfig defaults to 8.
    kv_default = heads if family == "llama" else 8
    kv_heads = _int(cfg, "num_key_value_heads", kv_default)
    assert kv_heads is not None
    _check_heads(hidden, heads, kv_heads, _int(cfg, "head_dim", None))
    default_positions = 2048 if family == "llama" else 4096 * 32
    # MistralAttention/MistralMLP are built with bias=False whatever the config says.
    biased = family == "llama"
    return dict(
        vocab_size=_req(cfg, "vocab_size"), hidden_size=hidden, num_layers=_req(cfg, "num_hidden_layers"),
        num_heads=heads, num_kv_heads=kv_heads, intermediate_size=_req(cfg, "intermediate_size"),
        max_positions=_int(cfg, "max_position_embeddings", default_positions), position_table=0,
        type_vocab_size=0, hidden_act=_str(cfg, "hidden_act", "silu"), norm="rmsnorm", hidden_dropout=0.0,
        attention_dropout=_float(cfg, "attention_dropout", 0.0), embedding_dropout=0.0, classifier_dropout=None,
        attention_bias=biased and _bool(cfg, "attention_bias", False),
        mlp_bias=biased and _bool(cfg, "mlp_bias", False),
    )


# Mixture-of-experts families (issue 35): each config class's field names and transformers 5 defaults
# (MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig, OlmoeConfig; printed from the installed classes).
_MOE_DEFAULTS: dict[str, dict[str, Any]] = {
    "mixtral": dict(experts_key="num_local_experts", experts=8, top_k=2, kv=8, positions=4096 * 32),
    "qwen2_moe": dict(experts_key="num_experts", experts=60, top_k=4, kv=16, positions=32768, moe_i=1408,
                      shared_i=5632),
    "qwen3_moe": dict(experts_key="num_experts", experts=128, top_k=8, kv=4, positions=32768, moe_i=768),
    "olmoe": dict(experts_key="num_experts", experts=64, top_k=8, kv=16, positions=4096),
    "gpt_oss": dict(experts_key="num_local_experts", experts=128, top_k=4, kv=8, positions=131072),
}


def _moe_like(cfg: dict[str, Any], family: str) -> dict[str, Any]:
    """Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE: Llama's attention (any head_dim) and a routed SwiGLU MoE MLP.

    Which layers are sparse: every one for Mixtral and OLMoE; for Qwen, layer i unless it is in
    `mlp_only_layers` or (i + 1) is not a multiple of `decoder_sparse_step` (Qwen3MoeDecoderLayer.__init__).
    Mixtral's experts are `intermediate_size` wide and always renormalise their top-k weights; Qwen's are
    `moe_intermediate_size` wide (dense layers `intermediate_size`) and renormalise when `norm_topk_prob`."""
    d = _MOE_DEFAULTS[family]
    hidden, heads = _req(cfg, "hidden_size"), _req(cfg, "num_attention_heads")
    kv_heads = _int(cfg, "num_key_value_heads", d["kv"])
    assert kv_heads is not None
    head_dim = _int(cfg, "head_dim", None)
    _check_heads(hidden, heads, kv_heads, None)  # head_dim may differ from hidden / heads (Qwen3-MoE)
    layers = _req(cfg, "num_hidden_layers")
    experts = _int(cfg, d["experts_key"], d["experts"], minimum=0)
    top_k = _int(cfg, "num_experts_per_tok", d["top_k"])
    assert experts is not None and top_k is not None
    if experts and top_k > experts:
        raise PlannerError(f"{FIELD}:num_experts_per_tok", top_k, f"at most {d['experts_key']}={experts}")
    if family == "gpt_oss":  # GptOssConfig: head_dim 64, experts intermediate_size wide, no renormalising
        head_dim = head_dim or 64
        inner = _int(cfg, "intermediate_size", 2880)
        assert inner is not None
        moe_inner, norm_topk, dense = inner, False, ()
    elif family == "mixtral":
        jitter = cfg.get("router_jitter_noise") or 0.0
        if jitter:
            raise PlannerError(f"{FIELD}:router_jitter_noise", jitter, "0 (the router's jitter is not modelled)")
        inner = _req(cfg, "intermediate_size")
        moe_inner, norm_topk, dense = inner, True, ()
    else:
        inner = _int(cfg, "intermediate_size", 6144 if family == "qwen3_moe" else 5632 if family == "qwen2_moe"
                     else 2048)
        assert inner is not None
        moe_inner = inner if family == "olmoe" else _int(cfg, "moe_intermediate_size", d["moe_i"])
        norm_topk = _bool(cfg, "norm_topk_prob", False)
        dense = tuple(i for i in range(layers) if not _qwen_sparse(cfg, i, experts)) if family != "olmoe" else ()
    if family == "olmoe" and cfg.get("clip_qkv") is not None:
        raise PlannerError(f"{FIELD}:clip_qkv", cfg["clip_qkv"], "null (clamping q, k, v is not modelled)")
    if _bool(cfg, "output_router_logits", False):
        raise PlannerError(f"{FIELD}:output_router_logits", True,
                           "false (the auxiliary loss's kept router logits are not modelled)")
    biased = _bool(cfg, "qkv_bias", True) if family == "qwen2_moe" else \
        family != "mixtral" and _bool(cfg, "attention_bias", family == "gpt_oss")
    return dict(
        vocab_size=_req(cfg, "vocab_size"), hidden_size=hidden, num_layers=layers, num_heads=heads,
        num_kv_heads=kv_heads, intermediate_size=inner, head_size=head_dim or 0,
        max_positions=_int(cfg, "max_position_embeddings", d["positions"]), position_table=0, type_vocab_size=0,
        hidden_act=_str(cfg, "hidden_act", "silu"), norm="rmsnorm", hidden_dropout=0.0,
        attention_dropout=_float(cfg, "attention_dropout", 0.0), embedding_dropout=0.0, classifier_dropout=None,
        attention_bias=biased, mlp_bias=False, num_experts=experts, experts_per_token=top_k if experts else 0,
        moe_intermediate_size=moe_inner if experts else 0,
        shared_expert_intermediate_size=(_int(cfg, "shared_expert_intermediate_size", d["shared_i"]) or 0)
        if family == "qwen2_moe" and experts else 0,
        norm_topk_prob=norm_topk, dense_layers=dense,
    )


# DeepSeek-V2 and -V3 (DeepseekV2Config, DeepseekV3Config in transformers 5.24): their defaults for absent keys.
# V2's num_experts_per_tok defaults to None (its router's torch.topk cannot run without it): required here.
_DEEPSEEK_DEFAULTS: dict[str, dict[str, Any]] = {
    "deepseek_v2": dict(vocab=102400, inner=11008, experts=64, top_k=None, groups=None, moe_i=1407, shared=2,
                        dense=0, positions=2048, norm_topk=False),
    "deepseek_v3": dict(vocab=129280, inner=18432, experts=256, top_k=8, groups=8, moe_i=2048, shared=1, dense=3,
                        positions=4096, norm_topk=True),
}
# DeepseekV2TopkRouter.forward: "greedy" or "group_limited_greedy" (any other value leaves its top-k unset).
_V2_TOPK_METHODS = ("greedy", "group_limited_greedy")


def _deepseek(cfg: dict[str, Any], family: str) -> dict[str, Any]:
    """DeepSeek-V2 and -V3 (the config classes' defaults above): MLA, n_routed_experts routed experts (top
    num_experts_per_tok; V3: sigmoid scores, group-limited, renormalised when norm_topk_prob, scaled; V2: softmax,
    greedy or group-limited greedy, never renormalised (DeepseekV2TopkRouter ignores norm_topk_prob), scaled),
    n_shared_experts shared ones as one MLP of moe_intermediate_size · n_shared_experts, dense MLPs
    (intermediate_size) in the first first_k_dense_replace layers. Multi-token prediction
    (num_nextn_predict_layers) is not built by transformers: not counted."""
    d = _DEEPSEEK_DEFAULTS[family]
    v2 = family == "deepseek_v2"
    hidden, heads = _req(cfg, "hidden_size"), _req(cfg, "num_attention_heads")
    _check_heads(hidden, heads, heads, None)
    layers = _req(cfg, "num_hidden_layers")
    experts = _int(cfg, "n_routed_experts", d["experts"])
    top_k = _int(cfg, "num_experts_per_tok", d["top_k"], required=d["top_k"] is None)
    assert experts is not None and top_k is not None
    if top_k > experts:
        raise PlannerError(f"{FIELD}:num_experts_per_tok", top_k, f"at most n_routed_experts={experts}")
    method = cfg.get("topk_method") or "greedy"
    if v2 and method not in _V2_TOPK_METHODS:
        raise PlannerError(f"{FIELD}:topk_method", method, f"one of {', '.join(_V2_TOPK_METHODS)} (DeepSeek-V2)")
    if not v2 or method == "group_limited_greedy":  # the groups split the experts evenly
        groups = _int(cfg, "n_group", d["groups"], required=d["groups"] is None)
        assert groups is not None
        if experts % groups:
            raise PlannerError(f"{FIELD}:n_group", groups, f"a divisor of n_routed_experts={experts}")
    if v2 and _bool(cfg, "mlp_bias", False):
        raise PlannerError(f"{FIELD}:mlp_bias", True, "false (biased dense and shared-expert MLPs are not modelled)")
    moe_inner = _int(cfg, "moe_intermediate_size", d["moe_i"])
    shared = _int(cfg, "n_shared_experts", d["shared"], minimum=0)
    dense = _int(cfg, "first_k_dense_replace", d["dense"], minimum=0)
    nope, rope = _int(cfg, "qk_nope_head_dim", 128), _int(cfg, "qk_rope_head_dim", 64)
    assert moe_inner is not None and shared is not None and dense is not None and nope and rope
    if _bool(cfg, "output_router_logits", False):
        raise PlannerError(f"{FIELD}:output_router_logits", True,
                           "false (the auxiliary loss's kept router logits are not modelled)")
    return dict(
        vocab_size=_int(cfg, "vocab_size", d["vocab"]), hidden_size=hidden, num_layers=layers, num_heads=heads,
        num_kv_heads=heads, intermediate_size=_int(cfg, "intermediate_size", d["inner"]), head_size=nope + rope,
        max_positions=_int(cfg, "max_position_embeddings", d["positions"]), position_table=0, type_vocab_size=0,
        hidden_act=_str(cfg, "hidden_act", "silu"), norm="rmsnorm", hidden_dropout=0.0,
        attention_dropout=_float(cfg, "attention_dropout", 0.0), embedding_dropout=0.0, classifier_dropout=None,
        attention_bias=_bool(cfg, "attention_bias", False), mlp_bias=False, num_experts=experts,
        experts_per_token=top_k, moe_intermediate_size=moe_inner, shared_expert_intermediate_size=moe_inner * shared,
        norm_topk_prob=False if v2 else _bool(cfg, "norm_topk_prob", d["norm_topk"]),
        dense_layers=tuple(range(min(dense, layers))),
        q_lora_rank=0 if "q_lora_rank" in cfg and cfg["q_lora_rank"] is None else _int(cfg, "q_lora_rank", 1536),
        kv_lora_rank=_int(cfg, "kv_lora_rank", 512) or 512,
        qk_rope_head_dim=rope, v_head_dim=_int(cfg, "v_head_dim", 128) or 128,
    )


def _qwen_sparse(cfg: dict[str, Any], index: int, experts: int) -> bool:
    """Qwen2MoeDecoderLayer / Qwen3MoeDecoderLayer: the sparse block unless mlp_only_layers lists the layer or
    decoder_sparse_step skips it."""
    only = cfg.get("mlp_only_layers") or []
    if not isinstance(only, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in only):
        raise PlannerError(f"{FIELD}:mlp_only_layers", only, "a list of layer indices")
    step = _int(cfg, "decoder_sparse_step", 1)
    assert step is not None
    return index not in only and experts > 0 and (index + 1) % step == 0


# ------------------------------------------------------------------------------------- public


def family_of(config: Any) -> str:
    if not isinstance(config, dict):
        raise PlannerError(FIELD, type(config).__name__, "a JSON object")
    model_type = config.get("model_type")
    if model_type is None:
        raise _missing("model_type", f"one of {', '.join(CLASS_PREFIX)}")
    if not isinstance(model_type, str) or model_type not in CLASS_PREFIX:
        raise PlannerError(f"{FIELD}:model_type", model_type, f"one of {', '.join(CLASS_PREFIX)}")
    return str(model_type)


def head_of(config: dict[str, Any]) -> tuple[str, str]:
    """(architecture, head) from `architectures[0]`."""
    return _head_of(config, family_of(config))


def _head_of(config: dict[str, Any], family: str) -> tuple[str, str]:
    archs = config.get("architectures")
    allowed = _architectures(family)
    if archs is None:
        raise _missing("architectures", f"a list whose first entry is one of {', '.join(allowed)}")
    if not isinstance(archs, list) or not archs or not isinstance(archs[0], str):
        raise PlannerError(f"{FIELD}:architectures", archs, f"a list whose first entry is one of {', '.join(allowed)}")
    if archs[0] not in allowed:
        raise PlannerError(f"{FIELD}:architectures[0]", archs[0], f"for model_type={family!r} one of {', '.join(allowed)}")
    return archs[0], allowed[archs[0]]


def with_head(config: dict[str, Any], head: str | None = None, num_labels: int | None = None) -> dict[str, Any]:
    """A copy of `config` whose `architectures[0]` is the class for `head` (and `num_labels` labels).

    `num_labels` replaces id2label/label2id as `PreTrainedConfig.num_labels`'s setter would.
    """
    return _with_head(copy.deepcopy(config), family_of(config), head, num_labels)


def _with_head(out: dict[str, Any], family: str, head: str | None, num_labels: int | None) -> dict[str, Any]:
    """`with_head` on `out`, a copy of the config the caller owns (changed in place: top-level keys only)."""
    if head is not None:
        out["architectures"] = [architecture_for(family, head)]
    if num_labels is not None:
        if isinstance(num_labels, bool) or not isinstance(num_labels, int) or num_labels < 1:
            raise PlannerError("num_labels", num_labels, "an integer >= 1")
        out.pop("id2label", None)
        out.pop("label2id", None)
        out["num_labels"] = num_labels
    return out


def transformer_from_hf_config(config: dict[str, Any]) -> TransformerSpec:
    """One `TransformerSpec` from a config.json dict; `hf_config` keeps the whole dict."""
    return _transformer(config, family_of(config))


def _transformer(config: dict[str, Any], family: str) -> TransformerSpec:
    architecture, head = _head_of(config, family)
    if family in ("bert", "roberta"):
        fields = _bert_like(config, family)
    elif family == "distilbert":
        fields = _distilbert(config)
    elif family == "gpt2":
        fields = _gpt2(config)
    elif family in _MOE_DEFAULTS:
        fields = _moe_like(config, family)
    elif family in _DEEPSEEK_DEFAULTS:
        fields = _deepseek(config, family)
    else:
        fields = _llama_like(config, family)
    _check_limits(fields)
    # BertModel/RobertaModel default to add_pooling_layer=True; the LM and RoBERTa classification classes
    # build theirs with add_pooling_layer=False; BertForSequenceClassification classifies the pooled output.
    pooler = family in ("bert", "roberta") and (
        head == "base" or (family == "bert" and head == "sequence-classification"))
    return TransformerSpec(
        family=family, architecture=architecture, head=head, pooler=pooler,  # type: ignore[arg-type]
        num_labels=num_labels_of(config) if head == "sequence-classification" else 2,
        tie_word_embeddings=_bool(config, "tie_word_embeddings", TIE_DEFAULT[family]),
        hf_config=copy.deepcopy(config), **fields,
    )


def _check_limits(fields: dict[str, Any]) -> None:
    """An activation we have a saved-tensor formula for (names the config key)."""
    if fields["hidden_act"] not in ACTIVATIONS:
        raise PlannerError(f"{FIELD}:hidden_act", fields["hidden_act"], f"one of {', '.join(ACTIVATIONS)}")


def inputs_for(spec: TransformerSpec) -> InputSpec:
    """What one sample of this model's batch holds (labels per sample or per token)."""
    labels = {"sequence-classification": "class", "masked-lm": "tokens", "causal-lm": "tokens"}.get(spec.head, "none")
    return InputSpec(token_type_ids=spec.family in TOKEN_TYPE_INPUTS, labels=labels)  # type: ignore[arg-type]


def spec_from_hf_config(config: dict[str, Any], *, name: str, component: str = "model",
                        source: dict[str, Any] | None = None) -> ModelSpec:
    """A one-component `ModelSpec` for a config.json dict (loss: the head's cross-entropy, none for base)."""
    return _model_spec(transformer_from_hf_config(config), config, name, component, source)


def _model_spec(t: TransformerSpec, config: dict[str, Any], name: str, component: str,
                source: dict[str, Any] | None) -> ModelSpec:
    return ModelSpec(
        name=name, components=(Component(name=component, layers=(t,)),), inputs=inputs_for(t),
        loss="none" if t.head == "base" else "cross-entropy",
        description=f"{t.architecture} ({t.family}, {t.num_layers} layers, hidden {t.hidden_size})",
        source=source if source is not None else {"config": copy.deepcopy(config)},
    )


def int_option(options: dict[str, Any], key: str, minimum: int = 1) -> int:
    """A model option that must be an integer in [minimum, MAX_DIM] (names the option)."""
    value = options[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise PlannerError(key, value, f"an integer >= {minimum}")
    if value > MAX_DIM:  # the same bound as a config.json size: absurd sizes answer at once
        raise PlannerError(key, value, f"an integer <= {MAX_DIM:,}")
    return value


def transformer_with_options(config: dict[str, Any], options: dict[str, Any]) -> tuple[TransformerSpec, dict]:
    """One pass from a config.json dict and the model options `head=` / `num_labels=` (num_labels alone
    implies head=sequence-classification) to the TransformerSpec, and the dict with the head applied.

    Why one pass: a catalog name used to go back and forth between planner.models.catalog and this module
    (family, heads, with_head, spec; the family read four times, the dict copied three times). Here the
    family is read once, the head checked and applied on a shallow copy (`config` is never changed: the
    catalog passes its cached dict), and the spec takes the one deep copy it keeps."""
    family = family_of(config)
    head = options.get("head")
    if head is not None and head not in heads_of(family):
        raise PlannerError("head", head, f"for {family} one of {', '.join(heads_of(family))}")
    num_labels = None
    if "num_labels" in options:
        num_labels = int_option(options, "num_labels")
        if head is None:
            head = "sequence-classification"
        elif head != "sequence-classification":
            raise PlannerError("num_labels", num_labels, "only with head=sequence-classification")
    applied = _with_head(dict(config), family, head, num_labels)
    t = _transformer(applied, family)
    if "use_cache" in options:
        t = t.model_copy(update={"use_cache": use_cache_option(options["use_cache"], t)})
    if "fake_balanced_gate" in options:
        t = t.model_copy(update={"fake_balanced_gate": fake_gate_option(options["fake_balanced_gate"], t)})
    return t, applied


def fake_gate_option(value: Any, t: TransformerSpec) -> bool:
    """The model option `fake_balanced_gate`: NeMo AutoModel's FakeBalancedGate in place of the router
    (TransformerSpec.fake_balanced_gate). Its BackendConfig defaults it False (nemo_automodel/components/models/
    common/utils.py @cb976544 `fake_balanced_gate: bool = False`); its benchmark recipes set it true."""
    if not isinstance(value, bool):
        raise PlannerError("fake_balanced_gate", value, "true or false")
    if value and not t.num_experts:
        raise PlannerError("fake_balanced_gate", value, "false for this model (it has no mixture-of-experts router)")
    return value


def use_cache_option(value: Any, t: TransformerSpec) -> bool:
    """The model option `use_cache`: whether the training forward returns its KV cache (planner/memory/kv_cache.py).
    Not read from config.json: the hub's `use_cache: true` is what generation wants, and training code turns it
    off (transformers' gradient_checkpointing_enable in training, FastChat's train.py, the probe job); a job
    that keeps it on says so. Modelled for decoders with rotary attention and one K/V head width (Llama,
    Mistral, Qwen, Mixtral); GPT-2's cache holds views of its fused qkv output and MLA caches its up-projected
    keys, which are not modelled."""
    if not isinstance(value, bool):
        raise PlannerError("use_cache", value, "true or false")
    if value and (t.position_table or t.kv_lora_rank):
        raise PlannerError("use_cache", value, "false for this model (the KV cache is modelled for decoders with "
                           "rotary attention: Llama, Mistral, Qwen, Mixtral)")
    return value


def spec_with_options(config: dict[str, Any], options: dict[str, Any], *, name: str,
                      source: dict[str, Any] | None = None) -> ModelSpec:
    """`transformer_with_options` as a one-component ModelSpec; `source` None records the applied dict."""
    t, applied = transformer_with_options(config, options)
    return _model_spec(t, applied, name, "model", source)  # None: a deep copy of the applied dict


def load_config_file(path: str | Path) -> dict[str, Any]:
    """Parse a config.json file (or a folder holding one); bad JSON names the file, line and column."""
    from planner.io import read_json

    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.exists():
        raise PlannerError("--model", str(path), "an existing config.json file or a catalog name")
    return read_json(p, FIELD)
