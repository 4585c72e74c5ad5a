"""The KV cache a decoder returns when it runs a training forward with `use_cache=True`.

Why it matters: a loop that keeps the model's outputs (`outputs = model(**batch)`, `--loop plain`) keeps
`outputs.past_key_values` too, so every layer's keys and values live until the loop lets go of the outputs,
like the logits (planner.memory.loops). llama-recipes PR #41 ("Improve FSDP LoRA Memory Usage", meta-llama/
llama-cookbook#41) measured 4.98 GB of active memory freed on Llama-2-7B at 4 × 2,048 by not keeping them.

What the cache holds, per layer: K after the rotary embedding and V, at the key/value heads' width
(before `repeat_kv`), in the dtype the projections compute in.
- transformers 4.31 (the PR's era), modeling_llama.py LlamaAttention.forward:
  `past_key_value = (key_states, value_states) if use_cache else None`, taken after `apply_rotary_pos_emb`
  and before `repeat_kv`.
- transformers 5.24 (installed here), cache_utils.py DynamicLayer.update: `self.keys = torch.cat([self.keys,
  key_states], dim=-2)`, a new tensor per layer, which the attention then uses (`key_states, value_states =
  past_key_values.update(...)` in LlamaAttention.forward).

Which of those bytes are extra, measured on CPU with a tiny Llama (saved-tensor hooks against the returned
cache's storages; tests/test_kv_cache.py repeats it):
- the layer checkpointed by a wrapper transformers does not see (torch's `checkpoint_wrapper` /
  FSDP's `apply_activation_checkpointing`, as llama-recipes applies it): the forward saves only the layer's
  input, so K and V are extra, whole. (transformers' own `gradient_checkpointing_enable` sets `use_cache=False`
  in training: "`use_cache=True` is incompatible with gradient checkpointing", so no cache then.)
- the layer not checkpointed, transformers 5.24: the attention saves the cache's own tensors when it reads K
  and V at their width (SDPA/flash, or eager with as many K/V heads as query heads): nothing extra; where it
  saves repeated copies (`repeat_kv` before eager attention under GQA) the cache is extra.
- the layer not checkpointed, transformers 4.31: the rotary output keeps the (b, s, heads, d) layout of the
  projections, so eager attention's `torch.matmul` saves contiguous copies of K and V and the cache's tensors
  are extra even so. NOT MODELLED: the planner follows today's transformers (the second case) there.

This module decides, from the storages the planner says a layer keeps for backward (planner.memory.activations
`Saved` records `attention.k` / `attention.v`), which cache tensors are not among them. A shared tensor also
outlives its layer's backward while the loop holds the outputs; that lifetime is not modelled (the bytes are
counted while autograd holds them, as before).
"""

from __future__ import annotations

from collections.abc import Iterable

from planner.ir.context import Ctx, kv_heads_per_rank
from planner.spec import TransformerSpec

# The Saved records of the attention's keys and values (planner.memory.op_saved's attention rule).
SAVED_NAMES = {"cache.k": "attention.k", "cache.v": "attention.v"}


def cache_tensors(spec: TransformerSpec, ctx: Ctx) -> tuple[tuple[str, int], ...]:
    """(name, elements) of one layer's cache on this rank: K and V, n tokens × kv heads × head_dim each (in
    ctx.low). Empty when the model's training forward returns no cache (`spec.use_cache` false)."""
    if not spec.use_cache:
        return ()
    width = kv_heads_per_rank(spec, ctx) * spec.head_dim
    return (("cache.k", ctx.n * width), ("cache.v", ctx.n * width))


def extra_tensors(spec: TransformerSpec, ctx: Ctx, kept: Iterable[tuple[str, int]]) -> tuple[tuple[str, int], ...]:
    """The cache tensors of one layer that are not storages autograd keeps after the layer's forward: `kept`
    is (name, elements) of what it keeps (a checkpointed layer: its input only)."""
    held = set(kept)
    return tuple((name, n) for name, n in cache_tensors(spec, ctx) if (SAVED_NAMES[name], n) not in held)
