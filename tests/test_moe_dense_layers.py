"""A mixture-of-experts model whose first layers are dense (DeepSeek-V3's first_k_dense_replace): each layer's
saved tensors are its own kind's, not a copy of the first non-first layer's."""

from __future__ import annotations

from planner.memory.activations import activation_blocks, block_saved
from planner.models.blocks import model_blocks
from planner.models.catalog import cached_model
from planner.spec import TrainConfig


def test_deepseek_v3_moe_layers_save_their_own_tensors():
    cfg = TrainConfig(batch_size=1, seq_len=256, precision="bf16")
    spec = cached_model("deepseek-v3")
    acts = {a.block: a for a in activation_blocks(spec, cfg)}
    from planner.memory.activations import _ctx

    ctx = _ctx(cfg, "cuda", spec.inputs.attention_mask, True)
    layers = [b for b in model_blocks(spec) if b.role == "layer"]
    dense, sparse = layers[2], layers[3]
    assert not dense.layer.sparse_layer(dense.index) and sparse.layer.sparse_layer(sparse.index)
    for b in (dense, sparse, layers[-1]):  # copied per kind, equal to the block's own saved tensors
        own = sum(t.nbytes for t in block_saved(b, spec, ctx))
        assert acts[b.name].saved_bytes == own, b.name
    assert acts[sparse.name].saved_bytes > acts[dense.name].saved_bytes
