"""Exact parameter counts per block, following the transformers 5 module definitions.

Why not `sum(p.numel())` over a built module: the core must not import torch, and building a 7B model just to
count it is slow. A transformer model's blocks (embeddings, layers, final norm, pooler, heads) are counted from
the parameter tensors their layer forms' ops declare (planner.families.forms: `layer_parameter_shapes`,
`block_parameter_shapes`, `program_layer_params`; issue 33: the per-family formulas that were here were a
second copy of those ops). The multimodal model's nn.Linear and BatchNorm1d blocks are counted from their
spec. tests/test_params.py and tests/test_tensor_shapes.py check every count and shape list against the real
modules.
"""

from __future__ import annotations

import math

from planner import caches
from planner.families import family
from planner.identity_cache import per_object
from planner.models.blocks import Block, model_blocks
from planner.spec import BatchNormSpec, DenseSpec, ModelSpec, TransformerSpec

_LAYER_PARAMS: dict[int, dict] = caches.table("planner.models.params._LAYER_PARAMS", scope="model",
    key="TransformerSpec identity (per_object) -> {layer index: parameters} (program-counted layers)")

INT64_BYTES = 8  # torch.long: position_ids / token_type_ids / num_batches_tracked buffers
FLOAT32_BYTES = 4  # default dtype of float buffers (running stats, rotary inv_freq) before any .to(dtype)


def linear_parameters(n_in: int, n_out: int, bias: bool = True) -> int:
    """nn.Linear / GPT-2 Conv1D: n_in*n_out weights (+ n_out bias)."""
    return n_in * n_out + (n_out if bias else 0)


def layer_parameters(spec: TransformerSpec) -> int:
    """One transformer layer: its layer form's parameter tensors (`layer_shapes`)."""
    return sum(math.prod(shape) for shape in layer_shapes(spec))


def program_layer_params(block: Block) -> tuple:
    """The parameter tensors (planner.ir.ops.Param) of a layer whose form has no formula here: the
    mixture-of-experts layer (planner/families/forms/moe_gated.py) is counted from its program, which
    tests/test_params.py and tests/test_program.py check against the module built on the meta device."""
    from planner.families.forms import PARAMETER_CONTEXT, LayerArgs, load_forms
    from planner.families.forms.moe_gated import registration_order

    spec = block.layer
    traits = family(spec.family)
    params = [p for op in load_forms()[traits.layer](LayerArgs(spec, traits, PARAMETER_CONTEXT, block.index, ""))
              for p in op.params]
    return tuple(registration_order(params, "", traits.router_name, traits.experts_before_router))


def _from_program(block: Block) -> bool:
    return block.role == "layer" and isinstance(block.layer, TransformerSpec) and block.layer.moe


def expert_parameters(block: Block) -> int:
    """Parameters of the routed experts of one layer (E · 3·h·i for SwiGLU experts, plus E · (2i + h) where
    they have biases, gpt-oss; 0 for a dense layer)."""
    spec = block.layer
    if block.role != "layer" or not isinstance(spec, TransformerSpec) or not spec.sparse_layer(block.index):
        return 0
    h, i = spec.hidden_size, spec.moe_intermediate_size
    return spec.num_experts * (3 * h * i + ((2 * i + h) if family(spec.family).expert_bias else 0))


def active_parameters(model: ModelSpec) -> int:
    """Parameters one token's forward reads: every parameter, less the routed experts it is not sent to
    (each sparse layer runs top_k of its E experts). Equal to the total for a dense model. The figure MoE
    papers quote as "active" (Mixtral 8x7B: 12.9B of 46.7B; Qwen3-30B-A3B: 3.3B of 30.5B) and the one
    6·N·tokens FLOPs use."""
    total = 0
    for block in model_blocks(model):
        n = block_parameters(block)
        experts = expert_parameters(block)
        if experts:
            spec = block.layer
            assert isinstance(spec, TransformerSpec)
            n -= experts - experts // spec.num_experts * spec.experts_per_token
        total += n
    return total


def block_parameters(block: Block) -> int:
    """Parameters of one block of `model_blocks` (each tensor counted once, tied ones in their owner)."""
    layer = block.layer
    if _from_program(block):
        return per_object(_LAYER_PARAMS, layer, dict).setdefault(block.index, sum(
            p.numel for p in program_layer_params(block)))
    if isinstance(layer, DenseSpec):
        return linear_parameters(layer.in_features, layer.out_features, layer.bias)
    if isinstance(layer, BatchNormSpec):
        return 2 * layer.num_features  # affine weight + bias; running stats are buffers
    if block.role == "layer":
        return layer_parameters(layer)
    return sum(math.prod(shape) for shape in block_tensor_shapes(block))


def block_gradient_parameters(block: Block) -> int:
    """Parameters that receive a gradient (and so get a .grad tensor) in a training step.

    All of them, except in an untied BERT/RoBERTa masked-LM head: there transformers 5 ties the decoder's bias
    to the head's `bias` only together with the weight, so untied, `cls.predictions.bias` / `lm_head.bias`
    (V values) is a parameter the forward never uses; its .grad stays None (and DDP would need
    find_unused_parameters=True).
    """
    n = block_parameters(block)
    layer = block.layer
    if (block.role == "head" and isinstance(layer, TransformerSpec) and layer.head == "masked-lm"
            and family(layer.family).lm_head == "transform_own_bias" and not layer.tie_word_embeddings):
        n -= layer.vocab_size
    return n


def block_buffers_bytes(block: Block, float_bytes: int = FLOAT32_BYTES) -> int:
    """Bytes of registered buffers (not parameters) that a block moves to the GPU with `model.to(device)`.

    BERT/RoBERTa embeddings: position_ids and token_type_ids, int64 (1, P) each; DistilBERT: position_ids;
    GPT-2: none; Llama/Mistral rotary: inv_freq and original_inv_freq, ceil(d/2) floats each.
    BatchNorm1d: running_mean, running_var (n floats each) + num_batches_tracked (one int64).
    `float_bytes` is the float buffers' size after a `model.to(dtype)` cast (4 for fp32/AMP).
    """
    layer = block.layer
    if isinstance(layer, BatchNormSpec):
        return 2 * layer.num_features * float_bytes + INT64_BYTES
    if isinstance(layer, TransformerSpec) and block.role == "layer" and layer.sparse_layer(block.index) \
            and family(layer.family).router_score_buffer:  # DeepseekV3TopkRouter.e_score_correction_bias (E,)
        return layer.num_experts * float_bytes
    if isinstance(layer, DenseSpec) or block.role != "embeddings":
        return 0
    traits = family(layer.family)
    if traits.int64_buffer_tables:
        return traits.int64_buffer_tables * layer.position_table * INT64_BYTES
    if traits.position_ids == "rotary":  # MLA rotates qk_rope_head_dim of each head (DeepseekV3Config.head_dim)
        return 2 * (((layer.qk_rope_head_dim or layer.head_dim) + 1) // 2) * float_bytes
    return 0


def count_parameters(model: ModelSpec) -> dict[str, int]:
    """Parameters per component, plus "total" (all of them trainable: nothing is frozen)."""
    out: dict[str, int] = {c.name: 0 for c in model.components}
    for block in model_blocks(model):
        out[block.component] += block_parameters(block)
    out["total"] = sum(out[c.name] for c in model.components)
    return out


def trainable_parameters(model: ModelSpec) -> int:
    """Parameters with requires_grad: every one, since the planner trains the whole model."""
    return count_parameters(model)["total"]


def count_gradient_parameters(model: ModelSpec) -> int:
    """Parameters whose .grad is allocated in a step (see `block_gradient_parameters`)."""
    return sum(block_gradient_parameters(b) for b in model_blocks(model))


def parameters_by_block(model: ModelSpec) -> dict[str, int]:
    """Block name -> parameters, in forward order."""
    return {b.name: block_parameters(b) for b in model_blocks(model)}


def count_buffers_bytes(model: ModelSpec, float_bytes: int = FLOAT32_BYTES) -> int:
    """Bytes of all registered buffers (see `block_buffers_bytes`)."""
    return sum(block_buffers_bytes(b, float_bytes) for b in model_blocks(model))


# ------------------------------------------------------------------------------------ tensor shapes
# Per-tensor shapes, for what depends on each tensor and not only on the total: Adafactor's factored states
# (a row and a column vector per matrix), bitsandbytes' 32-bit fallback for small tensors, the largest tensor
# that a for-loop optimizer step works on. Same blocks, families, heads and tying rules as the counts above;
# Listed in registration order, so that a model's list equals `[p.shape for p in module.parameters()]`
# (Adafactor's peak depends on which tensors are adjacent); tests/test_tensor_shapes.py checks both.

Shape = tuple[int, ...]


def linear_shapes(n_in: int, n_out: int, bias: bool = True) -> list[Shape]:
    """nn.Linear(n_in, n_out): weight (n_out, n_in) [+ bias (n_out,)]."""
    return [(n_out, n_in)] + ([(n_out,)] if bias else [])


def layer_shapes(spec: TransformerSpec) -> list[Shape]:
    """One layer, in registration order: its layer form's ops' parameters (planner.families.forms
    .layer_parameter_shapes; issue 33: the per-form attention, MLP and norm lists here were another copy of
    each layer, and the only module outside planner/families that named a layer form)."""
    from planner.families.forms import layer_parameter_shapes

    return list(layer_parameter_shapes(spec))


def block_tensor_shapes(block: Block) -> list[Shape]:
    """Shapes of the trainable parameter tensors of one block; sum of their products == `block_parameters`."""
    layer = block.layer
    if _from_program(block):
        return [p.shape for p in program_layer_params(block)]
    if isinstance(layer, DenseSpec):
        return linear_shapes(layer.in_features, layer.out_features, layer.bias)
    if isinstance(layer, BatchNormSpec):
        return [(layer.num_features,), (layer.num_features,)]
    if block.role == "layer":
        return layer_shapes(layer)
    # the embeddings, final norm, pooler and head: their ops' parameters (issue 33: the per-family formulas
    # here were another copy of what planner/families/forms/common.py emits)
    from planner.families.forms import block_parameter_shapes

    return list(block_parameter_shapes(block))


def model_tensor_shapes(model: ModelSpec) -> list[Shape]:
    """Shapes of every trainable parameter tensor (tied ones once), in `module.parameters()` order."""
    return [shape for block in model_blocks(model) for shape in block_tensor_shapes(block)]


def block_gradient_tensor_shapes(block: Block) -> list[Shape]:
    """`block_tensor_shapes` less the tensor whose .grad stays None (see `block_gradient_parameters`).

    Optimizers skip a parameter without a gradient, so this is what they keep states for.
    """
    shapes = block_tensor_shapes(block)
    unused = block_parameters(block) - block_gradient_parameters(block)
    if unused:  # untied BERT/RoBERTa MLM: the head's own bias (V,), first in `lm_head_shapes`
        return shapes[1:]
    return shapes


def model_gradient_tensor_shapes(model: ModelSpec) -> tuple[Shape, ...]:
    """Shapes of the parameter tensors that receive a gradient, in `module.parameters()` order; found once per
    `components` (~0.1 ms for the multimodal model; a search's new optimizer settings each read them)."""
    return per_object(_GRADIENT_SHAPES, model, lambda m: tuple(
        shape for block in model_blocks(m) for shape in block_gradient_tensor_shapes(block)))


_GRADIENT_SHAPES: dict[int, tuple] = caches.table("planner.models.params._GRADIENT_SHAPES", scope="model",
    key="ModelSpec identity (per_object): its gradient shapes")  # ModelSpec -> its gradient shapes (`per_object`)


def tied_gradient(model: ModelSpec) -> tuple[str, str, Shape] | None:
    """(embeddings block, head block, shape) when an LM head shares the token table (`tie_word_embeddings`).

    Why: the shared (V, h) weight gets its gradient first from the head's backward (the head runs last in
    forward, so first in backward); autograd's AccumulateGrad keeps that tensor as `.grad` and adds the
    embedding's gradient into it later (torch/csrc/autograd/functions/accumulate_grad.h), so the gradient
    is allocated when the HEAD back-propagates, not the embeddings. Parameters stay with the embeddings.
    """
    blocks = model_blocks(model)
    emb = next((b for b in blocks if b.role == "embeddings"), None)
    head = next((b for b in blocks if b.role == "head"), None)
    if emb is None or head is None or not isinstance(head.layer, TransformerSpec):
        return None
    spec = head.layer
    if not spec.tie_word_embeddings or spec.head not in ("causal-lm", "masked-lm") \
            or emb.component != head.component:
        return None
    return emb.name, head.name, (spec.vocab_size, spec.hidden_size)
