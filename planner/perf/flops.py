"""Floating-point operations of one training micro-step, per block.

Counted like `torch.utils.flop_counter.FlopCounterMode`: only matrix products, each as 2*m*n*k (a multiply
and an add per term); biases, norms, activations, softmax, dropout and the loss are left out (they are
memory-bound and small next to the matmuls). With T = batch*seq tokens, h hidden, i intermediate, a heads,
kv key/value heads, d = h/a, V vocabulary, L labels, per block forward:

- embeddings: 0 (table look-ups);
- layer: Q and O projections 2*T*h*h each, K and V 2*T*h*(kv*d) each; attention scores Q@K^T and
  probabilities@V 2*b*a*s*s*d each (= 4*b*s^2*h together); MLP 2*T*h*i per matrix (2 matrices; Llama/Mistral's
  SwiGLU has 3: gate, up, down);
- pooler (BERT/RoBERTa): 2*b*h*h on the first token;
- head: per family, as transformers builds it (MLM: transform h*h + decoder h*V on every token; causal LM:
  h*V on every token; classification: on the first token for BERT/RoBERTa/DistilBERT, on every token
  for GPT-2/Llama/Mistral, whose `score` runs before the last token is picked);
- dense (nn.Linear per sample): 2*b*in*out; batchnorm: 0.

Causal attention: the s^2 terms are counted FULL (as FlopCounterMode and the eager/SDPA kernels' shapes do);
`causal_fraction=0.5` counts only the lower triangle, which is what a causal flash kernel actually computes.

Backward = 2 x forward for every block (gradient w.r.t. the input and w.r.t. the weight: two matmuls of
the forward's size per forward matmul). Activation checkpointing re-runs each checkpointed layer's
forward during backward ("recompute"). transformers 5 checkpoints with torch.utils.checkpoint non-reentrant
(use_reentrant=False) whose early_stop (default True) stops re-running a layer once every tensor saved for
backward is recovered: a layer's trailing matmul whose output nothing saves is skipped. That is Llama's and
Mistral's down_proj (its output only feeds the residual add); BERT/RoBERTa/DistilBERT end in a LayerNorm and
GPT-2 in a dropout, which save that output, so their whole layer is re-run. Fused SDPA/flash backward also recomputes the scores Q@K^T
(one more s^2 matmul: FlopCounterMode's sdpa_backward counts 5 attention bmm's instead of 4); that extra
work is `attention_recompute` and is only counted when the kernel is fused (attention != "eager").
MFU conventionally uses model FLOPs = forward + backward, without any recompute.
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.families import family
from planner.models.blocks import Block, model_blocks
from planner.spec import BatchNormSpec, DenseSpec, ModelSpec, TrainConfig, TransformerSpec

FLOPS_PER_MAC = 2  # a multiply-accumulate is two floating-point operations
BACKWARD_TO_FORWARD = 2  # dL/dinput and dL/dweight, each a matmul of the forward's size
CHECKPOINTED_ROLES = ("layer",)  # HF gradient checkpointing wraps each transformer layer


def matmul_flops(m: int, n: int, k: int) -> int:
    """(m x k) @ (k x n): 2*m*n*k."""
    return FLOPS_PER_MAC * m * n * k


def attention_score_flops(t: TransformerSpec, batch: int, seq: int, causal_fraction: float = 1.0) -> int:
    """Q@K^T and P@V of one layer: 2 * (2*b*a*s*s*d), times the causal fraction counted."""
    per_product = matmul_flops(batch * t.num_heads * seq, seq, t.head_dim)
    return round(2 * per_product * causal_fraction)


def moe_layer_flops(t: TransformerSpec, index: int, batch: int, seq: int, causal_fraction: float = 1.0) -> int:
    """A mixture-of-experts decoder layer (planner/families/forms/moe_gated.py): q, k, v, o at the heads'
    own width (head_dim may differ from h/a), the scores, and then either the router (2·T·h·E), the routed
    experts (each token's top_k experts: 2·T·k·h·2i for gate_up and 2·T·k·i·h for down) and a shared expert
    (3 matrices of h·i_shared and its 1-wide gate), or a dense layer's SwiGLU MLP (3 matrices of h·i)."""
    tokens = batch * seq
    h = t.hidden_size
    q, kv = t.num_heads * t.head_dim, t.num_kv_heads * t.head_dim
    if t.kv_lora_rank:  # DeepSeek's latent attention: q (through its bottleneck), kv_a, kv_b, o
        H, rope, v, ql, kvl = t.num_heads, t.qk_rope_head_dim, t.v_head_dim, t.q_lora_rank, t.kv_lora_rank
        flops = matmul_flops(tokens, ql, h) + matmul_flops(tokens, q, ql) if ql else matmul_flops(tokens, q, h)
        flops += matmul_flops(tokens, kvl + rope, h) + matmul_flops(tokens, H * (t.head_dim - rope + v), kvl)
        flops += matmul_flops(tokens, h, H * v)
    else:
        flops = 2 * matmul_flops(tokens, q, h) + 2 * matmul_flops(tokens, kv, h)
    flops += attention_score_flops(t, batch, seq, causal_fraction)
    if not t.sparse_layer(index):
        return flops + 3 * matmul_flops(tokens, t.intermediate_size, h)
    pairs = tokens * t.experts_per_token
    flops += matmul_flops(tokens, t.num_experts, h) + 3 * matmul_flops(pairs, t.moe_intermediate_size, h)
    if t.shared_expert_intermediate_size:  # Qwen2-MoE's shared expert has a 1-wide sigmoid gate, DeepSeek's none
        flops += 3 * matmul_flops(tokens, t.shared_expert_intermediate_size, h)
        flops += matmul_flops(tokens, 1, h) if family(t.family).shared_expert_gate else 0
    return flops


def block_forward_flops(block: Block, batch: int, seq: int, causal_fraction: float = 1.0) -> int:
    """Forward matmul FLOPs of one block for a micro-batch of `batch` samples of `seq` tokens: its program's
    linear ops (planner.families.forms.block_matmuls: per token or per sample) and, where it runs attention,
    the score matmuls (issue 33: the per-family layer and head formulas here were another copy of each
    layer; tests/test_program.py checks the sum against the FLOP interpreter op by op)."""
    layer = block.layer
    if isinstance(layer, DenseSpec):
        return matmul_flops(batch, layer.out_features, layer.in_features)
    if isinstance(layer, BatchNormSpec):
        return 0
    if block.role == "layer" and isinstance(layer, TransformerSpec) and (
            layer.moe):  # router and grouped expert GEMMs
        return moe_layer_flops(layer, block.index, batch, seq, causal_fraction)
    from planner.families.forms import block_matmuls

    mm = block_matmuls(block)
    total = sum(matmul_flops(batch * seq if tokens else batch, n_out, n_in) for tokens, n_in, n_out, _ in mm.linears)
    return total + (attention_score_flops(layer, batch, seq, causal_fraction) if mm.attention else 0)


def layer_recompute_flops(block: Block, batch: int, seq: int, causal_fraction: float = 1.0) -> int:
    """Forward re-run of one checkpointed layer, less the trailing matmul early-stop skips (the layer's last
    Linear, whose output nothing saves: planner.ir.transforms.checkpoint_layers)."""
    full = block_forward_flops(block, batch, seq, causal_fraction)
    layer = block.layer
    if isinstance(layer, TransformerSpec) and layer.sparse_layer(block.index):
        return full  # a sparse MoE layer ends in the weighting of the experts' outputs, which saves them
    if isinstance(layer, TransformerSpec) and family(layer.family).early_stop_skips_mlp_out:
        from planner.families.forms import block_matmuls

        tokens, n_in, n_out, _ = block_matmuls(block).linears[-1]
        full -= matmul_flops(batch * seq if tokens else batch, n_out, n_in)
    return full


@dataclass(frozen=True)
class BlockFlops:
    name: str
    role: str
    forward: int
    backward: int
    recompute: int  # forward re-run under activation checkpointing + fused-attention score recompute


@dataclass(frozen=True)
class StepFlops:
    """FLOPs of one micro-step (forward + backward of one micro-batch on one GPU)."""

    blocks: tuple[BlockFlops, ...]
    forward: int
    backward: int
    recompute: int

    @property
    def model(self) -> int:
        """Forward + backward: the FLOPs MFU is defined on (no recompute)."""
        return self.forward + self.backward

    @property
    def executed(self) -> int:
        """What the GPU actually runs, recompute included."""
        return self.forward + self.backward + self.recompute


def step_flops(model: ModelSpec, config: TrainConfig, *, causal_fraction: float = 1.0) -> StepFlops:
    """Per-block FLOPs of one micro-step with `config.batch_size` samples of `config.seq_len` tokens."""
    from planner.ir.transforms import recompute_of

    b, s = config.batch_size, config.seq_len
    fused = config.attention != "eager"
    mode, modules = recompute_of(config)
    out: list[BlockFlops] = []
    for block in model_blocks(model):
        fwd = block_forward_flops(block, b, s, causal_fraction)
        recompute = 0
        is_layer = block.role == "layer" and isinstance(block.layer, TransformerSpec)
        if mode == "full" and block.role in CHECKPOINTED_ROLES and is_layer:
            recompute = layer_recompute_flops(block, b, s, causal_fraction)
        if mode == "selective" and is_layer:
            recompute = selective_recompute_flops(block.layer, b, s, causal_fraction, modules)
            tail = block.name.rsplit(".", 1)[-1]
            recompute += moe_recompute_flops(block.layer, int(tail) if tail.isdigit() else 0, b, s, modules)
        if fused and is_layer:
            recompute += attention_score_flops(block.layer, b, s, causal_fraction) // 2  # Q@K^T once more
        out.append(BlockFlops(block.name, block.role, fwd, BACKWARD_TO_FORWARD * fwd, recompute))
    return StepFlops(
        blocks=tuple(out),
        forward=sum(x.forward for x in out),
        backward=sum(x.backward for x in out),
        recompute=sum(x.recompute for x in out),
    )


def selective_recompute_flops(t: TransformerSpec, batch: int, seq: int, causal_fraction: float,
                              modules: tuple[str, ...]) -> int:
    """Matmul FLOPs selective recomputation re-runs in one layer: core attention's Q·Kᵀ and P·V, the MLP's
    matrices (planner.ir.transforms.selective_layer; norms run no matmul)."""
    if "op" in modules:  # torchtitan's per-op policy: Linears it does not keep (planner.ir.transforms)
        from planner.families.forms.common import has_bias, width

        mm, out = 0, 0
        for lin in family(t.family).layer_linears:
            if not (lin.conv1d or has_bias(t, lin)):
                mm += 1
                if mm % 2 == 1:
                    continue  # kept: its output is cached, the GEMM does not run again
            out += matmul_flops(batch * seq, width(t, lin.n_out), width(t, lin.n_in))
        return out
    out = 0
    if "core_attn" in modules:
        out += attention_score_flops(t, batch, seq, causal_fraction)
    if "mlp" in modules:
        out += (3 if family(t.family).gated_mlp else 2) * matmul_flops(batch * seq, t.intermediate_size, t.hidden_size)
    return out


def moe_recompute_flops(t: TransformerSpec, index: int, batch: int, seq: int, modules: tuple[str, ...]) -> int:
    """Matmul FLOPs Megatron's "moe" (the router, the routed experts and a shared expert run again: moe_layer.py
    `moe_layer_recompute`) or "shared_experts" recomputation re-runs in a sparse layer; "moe_act" re-runs no
    matmul. Nothing in a dense layer."""
    if not t.num_experts or not t.sparse_layer(index) or not {"moe", "shared_experts"} & set(modules):
        return 0
    tokens, h = batch * seq, t.hidden_size
    shared = 3 * matmul_flops(tokens, t.shared_expert_intermediate_size, h) if t.shared_expert_intermediate_size else 0
    if "moe" not in modules:
        return shared
    pairs = tokens * t.experts_per_token
    return matmul_flops(tokens, t.num_experts, h) + 3 * matmul_flops(pairs, t.moe_intermediate_size, h) + shared


def tokens_per_sample(model: ModelSpec, seq_len: int) -> int:
    """Tokens one sample feeds the model: seq_len if it has a transformer, else 1 (tabular rows)."""
    return seq_len if model.transformers else 1
