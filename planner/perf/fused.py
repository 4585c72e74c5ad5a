"""The memory-bound kernels a transformer step runs under Megatron-Core (`--framework megatron`), in place of eager
Hugging Face PyTorch's.

The GEMMs and the fused attention are the same in both (the roofline times them alike); what differs is
everything between them. Eager PyTorch under autocast runs one kernel per op (GPT-2's tanh-GELU alone is eight
fp32 passes forward and as many backward), casts every weight and every Linear's input to 16 bits, keeps the
residual stream, the norms and the loss in fp32. Megatron-Core runs:

- no autocast: `Float16Module` (megatron/core/transformer/module.py) converts the parameters to bf16 once; no
  weight or input casts. The weight gradient is accumulated straight into the fp32 main-gradient buffer by
  the wgrad GEMM (`gradient_accumulation_fusion`, on by default: megatron/core/tensor_parallel/layers.py
  `LinearWithGradAccumulationAndAsyncCommunication`, TransformerEngine's `fuse_wgrad_accumulation`): no
  gradient casts; bias gradients come out of the GEMM's epilogue (TransformerEngine
  transformer_engine/pytorch/module/linear.py, cuBLASLt BGRAD): no separate bias reduction.
- a bf16 residual stream (TransformerConfig.fp32_residual_connection = False, the default), so norms,
  residual adds and dropouts read and write 2 bytes an element.
- one kernel per norm forward and one backward (TransformerEngine `LayerNormLinear` / `RMSNorm`:
  transformer_engine/pytorch/module/layernorm_linear.py), fp32 statistics per row;
- fused rotary embedding, one kernel per q and k each way (megatron/core/models/common/embeddings/
  rope_utils.py `apply_rotary_pos_emb` with `apply_rope_fusion`, TransformerEngine `fused_apply_rotary_pos_emb`);
- fused bias-dropout-add, one kernel after attention and one after the MLP (megatron/core/fusions/
  fused_bias_dropout.py), a 1-byte mask when dropout is on;
- one activation kernel each way: bias-GELU (megatron/core/fusions/fused_bias_gelu.py) or bias-SwiGLU
  (megatron/core/fusions/fused_bias_swiglu.py: reads gate and up, writes their product);
- the fused vocabulary-parallel cross-entropy (megatron/core/fusions/fused_cross_entropy.py): forward reads
  the logits for the row max and again for exp, writes the softmax it saves for backward (fp32, ASSUMPTION:
  the logits are upcast before the loss) and divides it in place; backward reads the softmax and writes the
  logits' gradient in bf16.

Embedding kernels keep their eager form with a bf16 output. Identical layers share one record (`count`); the
model-parallel speed splits these kernels by role like any others (planner.perf.model_parallel).
"""

from __future__ import annotations

from planner.families import family
from planner.perf.kernels import Kernel, _with, elementwise
from planner.spec import ModelSpec, TransformerSpec

BF16, F32, MASK = "bfloat16", "float32", "bool"
_DROPPED_WORK = frozenset({"weight_cast", "bias_cast", "grad_cast", "bias_grad"})
# memory-bound kernels of these roles are replaced by the fused list below
_FUSED_ROLES = frozenset({"layer", "final_norm", ""})


def _norm(name: str, rows: int, width: int, phase: str, count: int) -> list[Kernel]:
    """TransformerEngine's norm: forward reads x, writes y and fp32 mean/rstd per row; backward reads dy, x and
    the statistics, writes dx, and the residual stream's gradient adds the branch's (one add)."""
    if phase == "backward":
        k = elementwise(f"{name}.fused_norm.backward", rows * width, (BF16, BF16), (BF16,), BF16)
        add = elementwise(f"{name}.residual_grad_add", rows * width, (BF16, BF16), (BF16,), BF16)
        return [_with(k, phase=phase, count=count, bytes_read=k.bytes_read + 8 * rows),
                _with(add, phase=phase, count=count)]
    k = elementwise(f"{name}.fused_norm", rows * width, (BF16,), (BF16,), BF16)
    return [_with(k, phase=phase, count=count, bytes_written=k.bytes_written + 8 * rows)]


def _layer(model: TransformerSpec, n: int, phase: str, count: int, mlp_count: int | None = None) -> list[Kernel]:
    """One layer's fused memory-bound kernels; the dense MLP's activation on `mlp_count` of the `count` layers
    (a mixture-of-experts layer runs its experts' own activation instead, kept from the program's ops)."""
    h, i = model.hidden_size, model.intermediate_size
    d = model.head_dim
    q, kv = model.num_heads * d, model.num_kv_heads * d
    fam = family(model.family)
    drop = model.hidden_dropout > 0
    bwd = phase == "backward"
    out: list[Kernel] = []
    out += _norm("layer.norm1", n, h, phase, count)
    out += _norm("layer.norm2", n, h, phase, count)
    if fam.gated_mlp:  # rotary on q and k, read and written once each way
        for name, width in (("q", q), ("k", kv)):
            k = elementwise(f"layer.fused_rope.{name}" + (".backward" if bwd else ""), n * width, (BF16,), (BF16,),
                            BF16)
            out.append(_with(k, phase=phase, count=count))
    for where in ("attention", "mlp"):  # bias-dropout-add: x + residual (+ mask) -> out; backward: dropout's
        if bwd:
            reads = (BF16, MASK) if drop else ()
            if reads:
                k = elementwise(f"layer.{where}.fused_bias_dropout_add.backward", n * h, reads, (BF16,), BF16)
                out.append(_with(k, phase=phase, count=count))
        else:
            k = elementwise(f"layer.{where}.fused_bias_dropout_add", n * h, (BF16, BF16),
                            (BF16, MASK) if drop else (BF16,), BF16)
            out.append(_with(k, phase=phase, count=count))
    if fam.gated_mlp:  # bias-SwiGLU: (gate, up) -> silu(gate)·up; backward: (dy, gate, up) -> (dgate, dup)
        k = (elementwise("layer.mlp.fused_bias_swiglu.backward", n * i, (BF16, BF16, BF16), (BF16, BF16), BF16)
             if bwd else elementwise("layer.mlp.fused_bias_swiglu", n * i, (BF16, BF16), (BF16,), BF16))
    else:  # bias-GELU: x -> gelu(x + bias); backward: (dy, x) -> dx
        k = (elementwise("layer.mlp.fused_bias_gelu.backward", n * i, (BF16, BF16), (BF16,), BF16)
             if bwd else elementwise("layer.mlp.fused_bias_gelu", n * i, (BF16,), (BF16,), BF16))
    mlp = count if mlp_count is None else mlp_count
    if mlp:
        out.append(_with(k, phase=phase, count=mlp))
    return [_with(k, block_role="layer") for k in out]


def _loss(n: int, vocab: int) -> list[Kernel]:
    fwd = elementwise("loss.fused_vocab_parallel_cross_entropy", n * vocab, (BF16, BF16, F32), (F32, F32), F32)
    bwd = elementwise("loss.fused_vocab_parallel_cross_entropy.backward", n * vocab, (F32,), (BF16,), BF16)
    return [_with(fwd, block_role=""), _with(bwd, phase="backward", block_role="")]


def _bf16_stream(k: Kernel) -> Kernel:
    """An embedding or MoE kernel with the bf16 residual stream (Float16Module: no autocast, so the tensors the
    eager list carries in fp32 under `amp-*` are bf16): its fp32 traffic halves."""
    if k.dtype != F32:
        return k
    return _with(k, dtype=BF16, bytes_read=k.bytes_read // 2, bytes_written=k.bytes_written // 2)


def megatron_kernels(kernels: list[Kernel], model: ModelSpec, tokens: int) -> list[Kernel]:
    """The eager kernel list with its memory-bound kernels replaced by Megatron-Core's (module docstring).
    `tokens`: the micro-batch's b·s. Models other than one transformer are returned unchanged."""
    if len(model.components) != 1 or len(model.transformers) != 1:
        return kernels
    t = model.transformers[0]
    layer_count = next((k.count for k in kernels if k.block_role == "layer" and k.kind == "gemm"), 0)
    layer_phases = sorted({k.phase for k in kernels if k.block_role == "layer" and k.kind == "gemm"
                           and k.phase in ("forward", "recompute", "backward")})
    has_final_norm = any(k.block_role == "final_norm" for k in kernels)
    # the fused vocabulary-parallel cross-entropy replaces a language model's loss over every token's logits;
    # a classifier's loss (over b x labels) keeps its eager kernels
    lm_loss = t.head in ("causal-lm", "masked-lm") and any(
        k.block_role == "" and k.kind == "memory_bound" for k in kernels)
    fused_roles = _FUSED_ROLES if lm_loss else _FUSED_ROLES - {""}
    # a mixture-of-experts layer's router, permutation, expert activation and combine are not in the dense
    # layer's fused list: their own kernels stay (planner.perf.op_rules: TE's fused permutation and
    # unpermutation, the weighted SwiGLU under Megatron's fused MoE), and only dense layers run the fused SwiGLU
    moe = (f"layer.{family(t.family).router_name}.", "layer.mlp.experts.") if t.num_experts else ()
    sparse = sum(t.sparse_layer(i) for i in range(t.num_layers)) if t.num_experts else 0
    mlp_count = round(layer_count * (t.num_layers - sparse) / t.num_layers)
    out: list[Kernel] = []
    for k in kernels:
        if k.param_work in _DROPPED_WORK or k.name.endswith((".input_cast", ".input_cast.backward")):
            continue
        if k.kind == "memory_bound" and k.block_role in fused_roles and not k.name.startswith(moe):
            continue
        bf16 = k.kind == "memory_bound" and (k.block_role == "embeddings" or k.name.startswith(moe))
        out.append(_bf16_stream(k) if bf16 else k)
    for phase in layer_phases:
        out += _layer(t, tokens, phase, layer_count, mlp_count)
    if has_final_norm:
        out += [_with(k, block_role="final_norm")
                for ph in ("forward", "backward") for k in _norm("final_norm", tokens, t.hidden_size, ph, 1)]
    if lm_loss:
        out += _loss(tokens, t.vocab_size)
    return out
