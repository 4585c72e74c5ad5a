"""What one hand-modelled transformer family is, as a record of traits every interpreter reads.

The memory model (planner.memory.activations), the parameter counts (planner.models.params), the kernel list
and FLOPs (planner.perf), the block list (planner.models.blocks) and LoRA's module names
(planner.adapters.targets) ask a family's traits, never its name: a new family that shares the layer forms
modelled so far is one record in `planner/families/registry.py` (plus its config.json reader in
planner.models.hf_config).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

# The layer forms the interpreters know (each is a block of rules in activations/kernels/params):
# post-norm encoder (BertLayer), pre-norm with Conv1D projections (GPT2Block), pre-norm gated with RMSNorm and
# rotary positions (LlamaDecoderLayer), and that layer with a mixture-of-experts MLP (MixtralDecoderLayer,
# Qwen2/3-MoE, OLMoE: a router and routed SwiGLU experts, a shared expert where the family has one).
LayerForm = Literal["post_norm_encoder", "pre_norm_conv1d", "pre_norm_gated", "moe_gated"]
# Per-head query/key norms: none, RMSNorm over each head's width (Qwen3), over the whole projection (OLMoE).
QkNorm = Literal["none", "head", "full"]
# Sequence-classification heads: BERT's classifier on the pooled output; RoBERTa's dense -> tanh -> out_proj
# on hidden[:, 0]; DistilBERT's pre_classifier -> ReLU -> classifier on hidden[:, 0]; decoders' `score` on
# every token (then the last non-pad token is picked).
ClassifierForm = Literal["pooled", "dense_tanh", "pre_classifier_relu", "score_all_tokens"]
# LM heads: BERT/RoBERTa transform (dense, norm) + decoder with the head's own bias (V,) registered first;
# DistilBERT vocab_transform, vocab_layer_norm, vocab_projector; decoders a bare lm_head without bias.
LmHeadForm = Literal["transform_own_bias", "transform_projector", "plain"]
# Position ids: a registered buffer slice (BERT, DistilBERT), made from input_ids (RoBERTa, padding_idx + 1
# onwards), `arange` (GPT-2), none (rotary).
PositionIds = Literal["buffer", "from_input_ids", "arange", "rotary"]
# Token types when the batch has none: gathered from the buffer (BERT, s int64), through the position ids
# (RoBERTa, n int64), none.
TokenTypes = Literal["buffer", "gathered", "none"]
# The softmax probabilities' dtype after eager softmax: as it came out, cast to v's dtype (GPT-2), or cast
# to the query's dtype after an fp32 softmax (Llama `.to(query.dtype)`).
ProbsCast = Literal["none", "value", "query"]
# A module's width, named as the layer's own sizes: hidden, query (heads x head_dim), key/value, q + 2 kv,
# intermediate, labels, vocabulary.
Width = Literal["h", "q", "kv", "qkv", "i", "labels", "vocab"]
# A Linear's bias: always, never, or the config's attention_bias / mlp_bias.
Bias = Literal["yes", "no", "attention", "mlp"]


@dataclass(frozen=True)
class Linear:
    """One linear module as transformers names it, its widths and bias, and LoRA's flags for it
    (planner.adapters.targets.LinearModule)."""

    name: str
    n_in: Width
    n_out: Width
    bias: Bias = "yes"
    conv1d: bool = False
    last: bool = False  # the classifier's last layer (peft's modules_to_save)
    head: bool = False  # part of the classification head
    output: bool = False  # the LM output projection


@dataclass(frozen=True)
class Family:
    """One hand-modelled family: its transformers names and every trait the interpreters branch on."""

    name: str
    class_prefix: str  # transformers class names: f"{class_prefix}ForSequenceClassification"
    base_prefix: str  # `base_model_prefix` of its *For* classes
    layer: LayerForm
    classifier: ClassifierForm
    lm_head: LmHeadForm
    position_ids: PositionIds
    token_types: TokenTypes = "none"
    tie_word_embeddings_default: bool = True  # transformers 5's config default
    token_type_inputs: bool = False  # the tokenizer returns token_type_ids (model_input_names)
    attention_output_dropout: bool = True  # dropout after the attention output projection
    probs_cast: ProbsCast = "none"
    fp32_softmax: bool = False  # the eager path asks softmax for fp32 (Llama)
    sliding_window: bool = False  # config.sliding_window masks once s reaches it (Mistral)
    int64_buffer_tables: int = 0  # registered int64 (1, P) buffers: position_ids, token_type_ids
    positions_after_norm: bool = False  # RobertaEmbeddings registers its position table after the LayerNorm
    lora_default_targets: tuple[str, ...] | None = None  # peft's default target_modules (None: peft asks)
    layer_prefix: str = ""  # module path of layer i, "{i}" for the index
    layer_linears: tuple[Linear, ...] = ()
    classifier_linears: tuple[Linear, ...] = ()
    lm_head_linears: tuple[Linear, ...] = ()
    # Module names of the non-Linear parameters, as transformers registers them (planner.families.forms
    # names each op's parameter tensors with them; tests/test_program.py checks them against the modules).
    word_table: str = "embeddings.word_embeddings"  # under the base model
    position_table_name: str = "embeddings.position_embeddings"
    token_type_table: str = "embeddings.token_type_embeddings"
    embedding_norm_name: str = "embeddings.LayerNorm"
    layer_norm_names: tuple[str, str] = ("attention.output.LayerNorm", "output.LayerNorm")  # in layer order
    final_norm_name: str = ""  # under the base model (decoders)
    lm_head_norm: str = ""  # the masked-LM transform's norm, from the model's root
    lm_head_bias: str = ""  # the masked-LM head's own (V,) bias parameter, from the model's root
    # Mixture-of-experts layers (layer form "moe_gated"): the router keeps its top-k weights in fp32
    # (MixtralTopKRouter) or casts them back to the logits' dtype (Qwen2/Qwen3/OLMoE `.to(router_logits.dtype)`);
    # q/k norms; a shared expert with a sigmoid gate (Qwen2-MoE); whether transformers has a
    # *ForSequenceClassification class (OLMoE has none).
    topk_fp32: bool = False
    experts_before_router: bool = False  # Qwen3MoeSparseMoeBlock registers `experts` before `gate`
    # gpt-oss (transformers 5 modeling_gpt_oss): the router is `mlp.router` with a bias, picks the top-k
    # logits and softmaxes only those; the experts are stored transposed ((E, h, 2i), (E, i, h)) with biases
    # and gate and up interleaved, joined by a clamped SwiGLU ((up + 1) · gate · sigmoid(α · gate)); each
    # attention head has a learned sink logit (`self_attn.sinks`).
    router_name: str = "mlp.gate"
    router_bias: bool = False
    topk_then_softmax: bool = False
    expert_bias: bool = False
    experts_transposed: bool = False
    clamped_swiglu: bool = False
    attention_sinks: bool = False
    # DeepSeek-V3 (modeling_deepseek_v3): multi-head latent attention, `mlp.shared_experts` without a gate, a
    # sigmoid router with a registered fp32 `e_score_correction_bias` buffer (group-limited top-k).
    latent_attention: bool = False
    shared_experts_name: str = "mlp.shared_expert"
    shared_expert_gate: bool = True
    router_score_buffer: bool = False
    # Target names peft 0.21 rewrites for this model type under transformers 5 (peft utils/
    # transformers_weight_conversion.py `_convert_peft_config_moe`, for adapters trained on transformers 4's
    # per-expert Linears): each becomes a `target_parameters` entry on the fused experts or the router (gate_proj
    # and up_proj together -> gate_up_proj at rank 2r; gate -> gate.weight) and leaves target_modules, so the
    # shared experts' and dense layers' Linears of that name get no adapter. Refused here (planner.adapters.targets).
    peft_retargeted: tuple[str, ...] = ()
    qk_norm: QkNorm = "none"
    shared_expert: bool = False
    classifier_head: bool = True

    @property
    def encoder(self) -> bool:
        """Post-norm encoder: masked-LM head, LayerNorm on the embeddings, no final norm."""
        return self.layer == "post_norm_encoder"

    @property
    def decoder(self) -> bool:
        """Pre-norm causal decoder: ends with a final norm, causal-LM head, classifies every token."""
        return not self.encoder

    @property
    def gated_mlp(self) -> bool:
        """SwiGLU MLP (gate, up, down) with RMSNorm and rotary positions (the MoE layers' experts too)."""
        return self.layer in ("pre_norm_gated", "moe_gated")

    @property
    def conv1d(self) -> bool:
        """GPT-2's Conv1D projections (addmm with bias, one fused c_attn)."""
        return self.layer == "pre_norm_conv1d"

    @property
    def early_stop_skips_mlp_out(self) -> bool:
        """The layer ends in a matmul (MLP down projection) that checkpoint early-stop does not re-run."""
        return self.gated_mlp

    @property
    def embedding_norm(self) -> bool:
        return self.encoder

    @property
    def embedding_dropout(self) -> bool:
        return not self.gated_mlp

    @property
    def mask_positional(self) -> bool:
        """HF passes the 4-D mask to each layer positionally (so a checkpoint saves it); Llama by keyword."""
        return not self.gated_mlp

    @property
    def masked_lm(self) -> bool:
        return self.encoder
