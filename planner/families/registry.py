"""The hand-modelled transformer families, one record each (`traits.Family`).

Adding a family whose layers have one of the modelled forms: one record here and its config.json reader in
planner.models.hf_config. Sources: transformers 5 modeling_* files (module names, registration order),
peft 0.18 TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING, each config class's defaults.
"""

from __future__ import annotations

from planner.errors import PlannerError
from planner.families.traits import Family, Linear

_BERT_LAYER = (Linear("attention.self.query", "h", "q"), Linear("attention.self.key", "h", "kv"),
               Linear("attention.self.value", "h", "kv"), Linear("attention.output.dense", "q", "h"),
               Linear("intermediate.dense", "h", "i"), Linear("output.dense", "i", "h"))
_DECODER_SCORE = (Linear("score", "h", "labels", "no", last=True, head=True),)
_DECODER_LM = (Linear("lm_head", "h", "vocab", "no", output=True),)
_LLAMA_LAYER = (Linear("self_attn.q_proj", "h", "q", "attention"), Linear("self_attn.k_proj", "h", "kv", "attention"),
                Linear("self_attn.v_proj", "h", "kv", "attention"), Linear("self_attn.o_proj", "q", "h", "attention"),
                Linear("mlp.gate_proj", "h", "i", "mlp"), Linear("mlp.up_proj", "h", "i", "mlp"),
                Linear("mlp.down_proj", "i", "h", "mlp"))

# Qwen2-MoE: q, k, v biased by config.qkv_bias, o_proj never (Qwen2MoeAttention).
_QWEN2_MOE_LAYER = (Linear("self_attn.q_proj", "h", "q", "attention"), Linear("self_attn.k_proj", "h", "kv", "attention"),
                    Linear("self_attn.v_proj", "h", "kv", "attention"), Linear("self_attn.o_proj", "q", "h", "no"),
                    *_LLAMA_LAYER[4:])

# peft 0.21.2 utils/transformers_weight_conversion.py: _MOE_TARGET_MODULE_MAPPING["qwen2_moe"] (used for
# qwen3_moe, olmoe, deepseek_v2, deepseek_v3 through _MODEL_TO_CONVERSION_PATTERN; not for qwen2_moe itself)
# and ["mixtral"]: the target names it rewrites to fused-expert / router parameters (traits.Family).
_PEFT_QWEN2_MOE = ("gate", "gate_proj", "up_proj", "down_proj")
_PEFT_MIXTRAL = ("gate", "w1", "w2", "w3")

_LLAMA_NAMES = {"word_table": "embed_tokens", "layer_norm_names": ("input_layernorm", "post_attention_layernorm"),
                "final_norm_name": "norm"}

FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("bert", "Bert", "bert", "post_norm_encoder", "pooled", "transform_own_bias", "buffer",
           token_types="buffer", token_type_inputs=True, int64_buffer_tables=2,
           lora_default_targets=("query", "value"), layer_prefix="encoder.layer.{i}.", layer_linears=_BERT_LAYER,
           classifier_linears=(Linear("classifier", "h", "labels", last=True, head=True),),
           lm_head_linears=(Linear("cls.predictions.transform.dense", "h", "h"),
                            Linear("cls.predictions.decoder", "h", "vocab", output=True)),
           lm_head_norm="cls.predictions.transform.LayerNorm", lm_head_bias="cls.predictions.bias"),
    Family("roberta", "Roberta", "roberta", "post_norm_encoder", "dense_tanh", "transform_own_bias",
           "from_input_ids", token_types="gathered", int64_buffer_tables=2, positions_after_norm=True,
           lora_default_targets=("query", "value"), layer_prefix="encoder.layer.{i}.", layer_linears=_BERT_LAYER,
           classifier_linears=(Linear("classifier.dense", "h", "h", head=True),
                               Linear("classifier.out_proj", "h", "labels", last=True, head=True)),
           lm_head_linears=(Linear("lm_head.dense", "h", "h"), Linear("lm_head.decoder", "h", "vocab", output=True)),
           lm_head_norm="lm_head.layer_norm", lm_head_bias="lm_head.bias"),
    Family("distilbert", "DistilBert", "distilbert", "post_norm_encoder", "pre_classifier_relu",
           "transform_projector", "buffer", attention_output_dropout=False, int64_buffer_tables=1,
           layer_prefix="transformer.layer.{i}.",
           layer_linears=(Linear("attention.q_lin", "h", "q"), Linear("attention.k_lin", "h", "kv"),
                          Linear("attention.v_lin", "h", "kv"), Linear("attention.out_lin", "q", "h"),
                          Linear("ffn.lin1", "h", "i"), Linear("ffn.lin2", "i", "h")),
           classifier_linears=(Linear("pre_classifier", "h", "h"),
                               Linear("classifier", "h", "labels", last=True, head=True)),
           lm_head_linears=(Linear("vocab_transform", "h", "h"), Linear("vocab_projector", "h", "vocab", output=True)),
           layer_norm_names=("sa_layer_norm", "output_layer_norm"), lm_head_norm="vocab_layer_norm",
           lm_head_bias="vocab_projector.bias"),
    Family("gpt2", "GPT2", "transformer", "pre_norm_conv1d", "score_all_tokens", "plain", "arange",
           probs_cast="value", lora_default_targets=("c_attn",), layer_prefix="h.{i}.",
           layer_linears=(Linear("attn.c_attn", "h", "qkv", conv1d=True), Linear("attn.c_proj", "q", "h", conv1d=True),
                          Linear("mlp.c_fc", "h", "i", conv1d=True), Linear("mlp.c_proj", "i", "h", conv1d=True)),
           classifier_linears=_DECODER_SCORE, lm_head_linears=_DECODER_LM, word_table="wte", position_table_name="wpe",
           layer_norm_names=("ln_1", "ln_2"), final_norm_name="ln_f"),
    Family("llama", "Llama", "model", "pre_norm_gated", "score_all_tokens", "plain", "rotary",
           tie_word_embeddings_default=False, probs_cast="query", fp32_softmax=True,
           lora_default_targets=("q_proj", "v_proj"), layer_prefix="layers.{i}.", layer_linears=_LLAMA_LAYER,
           classifier_linears=_DECODER_SCORE, lm_head_linears=_DECODER_LM, **_LLAMA_NAMES),
    Family("mistral", "Mistral", "model", "pre_norm_gated", "score_all_tokens", "plain", "rotary",
           tie_word_embeddings_default=False, probs_cast="query", fp32_softmax=True, sliding_window=True,
           lora_default_targets=("q_proj", "v_proj"), layer_prefix="layers.{i}.", layer_linears=_LLAMA_LAYER,
           classifier_linears=_DECODER_SCORE, lm_head_linears=_DECODER_LM, **_LLAMA_NAMES),
    # Mixture-of-experts decoders (issue 35): transformers 5 modeling_mixtral / modeling_qwen2_moe /
    # modeling_qwen3_moe / modeling_olmoe. Their attention is Llama's (Qwen3 adds per-head q/k RMSNorms,
    # OLMoE norms over the whole q and k projections); the MLP is `mlp.gate` (a TopKRouter) and `mlp.experts`
    # (gate_up_proj (E, 2i, h) and down_proj (E, h, i) as 3-D parameters), Qwen2-MoE adds `mlp.shared_expert`
    # and `mlp.shared_expert_gate`. peft 0.18 maps only mixtral (q_proj, v_proj); the others ask for targets.
    Family("mixtral", "Mixtral", "model", "moe_gated", "score_all_tokens", "plain", "rotary",
           tie_word_embeddings_default=False, probs_cast="query", fp32_softmax=True, sliding_window=True,
           topk_fp32=True, peft_retargeted=_PEFT_MIXTRAL,
           lora_default_targets=("q_proj", "v_proj"), layer_prefix="layers.{i}.", layer_linears=_LLAMA_LAYER,
           classifier_linears=_DECODER_SCORE, lm_head_linears=_DECODER_LM, **_LLAMA_NAMES),
    Family("qwen2_moe", "Qwen2Moe", "model", "moe_gated", "score_all_tokens", "plain", "rotary",
           tie_word_embeddings_default=False, probs_cast="query", fp32_softmax=True, shared_expert=True,
           layer_prefix="layers.{i}.", layer_linears=_QWEN2_MOE_LAYER, classifier_linears=_DECODER_SCORE,
           lm_head_linears=_DECODER_LM, **_LLAMA_NAMES),
    Family("qwen3_moe", "Qwen3Moe", "model", "moe_gated", "score_all_tokens", "plain", "rotary",
           tie_word_embeddings_default=False, probs_cast="query", fp32_softmax=True, qk_norm="head",
           experts_before_router=True, peft_retargeted=_PEFT_QWEN2_MOE, layer_prefix="layers.{i}.",
           layer_linears=_LLAMA_LAYER,
           classifier_linears=_DECODER_SCORE, lm_head_linears=_DECODER_LM, **_LLAMA_NAMES),
    Family("olmoe", "Olmoe", "model", "moe_gated", "score_all_tokens", "plain", "rotary",
           tie_word_embeddings_default=False, probs_cast="query", fp32_softmax=True, qk_norm="full",
           classifier_head=False, peft_retargeted=_PEFT_QWEN2_MOE, layer_prefix="layers.{i}.",
           layer_linears=_LLAMA_LAYER,
           classifier_linears=_DECODER_SCORE, lm_head_linears=_DECODER_LM, **_LLAMA_NAMES),
    # gpt-oss: every projection biased (attention_bias), a sink logit per head, the router and experts above;
    # transformers 5 runs it eager by default (GptOssPreTrainedModel._supports_sdpa = False).
    Family("gpt_oss", "GptOss", "model", "moe_gated", "score_all_tokens", "plain", "rotary",
           tie_word_embeddings_default=False, probs_cast="query", fp32_softmax=False, sliding_window=True,
           router_name="mlp.router", router_bias=True, topk_then_softmax=True, expert_bias=True,
           experts_transposed=True, clamped_swiglu=True, attention_sinks=True,
           layer_prefix="layers.{i}.", layer_linears=_LLAMA_LAYER, classifier_linears=_DECODER_SCORE,
           lm_head_linears=_DECODER_LM, **_LLAMA_NAMES),
    # DeepSeek-V2 (modeling_deepseek_v2): V3's layer (MLA, `mlp.experts`, `mlp.gate`, `mlp.shared_experts`, in
    # that order in DeepseekV2Moe.__init__; the first `first_k_dense_replace` layers dense) with a softmax
    # router (greedy or group-limited greedy top-k, never renormalised, scaled) and no score-correction buffer.
    Family("deepseek_v2", "DeepseekV2", "model", "moe_gated", "score_all_tokens", "plain", "rotary",
           tie_word_embeddings_default=False, probs_cast="query", fp32_softmax=True, shared_expert=True,
           experts_before_router=True, latent_attention=True, shared_experts_name="mlp.shared_experts",
           shared_expert_gate=False, peft_retargeted=_PEFT_QWEN2_MOE, layer_prefix="layers.{i}.",
           layer_linears=_LLAMA_LAYER,
           classifier_linears=_DECODER_SCORE, lm_head_linears=_DECODER_LM, **_LLAMA_NAMES),
    # DeepSeek-V3 (and Moonlight, the same model type): MLA, experts then router then shared experts
    # (DeepseekV3MoE.__init__), the first `first_k_dense_replace` layers dense.
    Family("deepseek_v3", "DeepseekV3", "model", "moe_gated", "score_all_tokens", "plain", "rotary",
           tie_word_embeddings_default=False, probs_cast="query", fp32_softmax=True, shared_expert=True,
           experts_before_router=True, latent_attention=True, shared_experts_name="mlp.shared_experts",
           shared_expert_gate=False, router_score_buffer=True, peft_retargeted=_PEFT_QWEN2_MOE,
           layer_prefix="layers.{i}.",
           layer_linears=_LLAMA_LAYER, classifier_linears=_DECODER_SCORE, lm_head_linears=_DECODER_LM,
           **_LLAMA_NAMES),
)}


def family(name: str) -> Family:
    """The record of a hand-modelled family."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise PlannerError("family", name, ", ".join(FAMILIES)) from None
