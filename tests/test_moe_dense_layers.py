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


def test_deepseek_v3_speed_counts_its_dense_and_moe_layers_apart():
    """The kernel table counts the 3 dense layers' MLP GEMMs 3 times and the routed experts' 58 times (the first
    layer's kernels had stood for all 61: no router, no experts)."""
    from planner.perf.kernels import training_kernels

    cfg = TrainConfig(batch_size=1, seq_len=256, precision="bf16")
    spec = cached_model("deepseek-v3")
    t = next(b.layer for b in model_blocks(spec) if b.role == "layer")
    sparse = sum(t.sparse_layer(i) for i in range(t.num_layers))
    assert (sparse, t.num_layers - sparse) == (58, 3)
    ks = {k.name: k for k in training_kernels(spec, cfg)}
    assert ks["layer.mlp.experts.down"].count == sparse and ks["layer.mlp.gate_proj"].count == t.num_layers - sparse
    attention = [k for name, k in ks.items() if name.startswith("layer.self_attn.") and k.phase == "forward"]
    assert attention and all(k.count == t.num_layers for k in attention)
