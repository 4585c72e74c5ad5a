"""The KV cache a decoder returns in a training forward (`-o use_cache=true`, planner/memory/kv_cache.py),
measured on CPU: a tiny Llama built as the probe job builds it, run forward once with `use_cache=True` under
saved-tensor hooks; the cache's storages that autograd does not save are what the loop's `outputs` add. The
planner's `retained_output_bytes` of the layers must equal them, with and without a checkpoint wrapper that
transformers does not see (FSDP's `apply_activation_checkpointing`, as llama-recipes applies it), for
multi-head and grouped-query attention, eager and SDPA."""

from __future__ import annotations

import functools

import pytest
import torch

from planner.errors import PlannerError
from planner.memory.activations import activation_blocks
from planner.spec import TrainConfig
from tests import saved_tensors


def _llama(kv_heads: int):
    spec = saved_tensors.model("llama", "causal-lm", layers=2, hidden=64, heads=4, kv_heads=kv_heads,
                               intermediate=128, vocab=100)
    (component,) = spec.components
    layers = tuple(t.model_copy(update={"use_cache": True}) for t in component.layers)
    return spec.model_copy(update={"components": (component.model_copy(update={"layers": layers}),)})


def _measured_extra(spec, attention: str, wrapped: bool, b: int, s: int) -> int:
    """Bytes of the returned cache's storages that the forward's saved tensors do not hold."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    from jobs.modeling import build_model

    torch.manual_seed(0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        module = build_model(spec.model_dump(mode="json"), attention, use_cache=True).train()
    finally:
        torch.set_default_dtype(old)
    if wrapped:
        layer_cls = type(module.model.layers[0])
        apply_activation_checkpointing(module, checkpoint_wrapper_fn=functools.partial(
            checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
            check_fn=lambda m: isinstance(m, layer_cls))
    batch = saved_tensors.make_batch(spec, b, s, padded=False)
    saved: set[int] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.add(t.untyped_storage().data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = module(**batch, use_cache=True)
    cache = out.past_key_values
    assert cache is not None
    tensors = [t for layer in cache.layers for t in (layer.keys, layer.values)]
    assert len(tensors) == 2 * spec.transformers[0].num_layers
    return sum(t.untyped_storage().nbytes() for t in tensors if t.untyped_storage().data_ptr() not in saved)


def _planned_extra(spec, attention: str, wrapped: bool, b: int, s: int) -> int:
    cfg = TrainConfig(batch_size=b, seq_len=s, precision="bf16", attention=attention, checkpointing=wrapped)
    blocks = activation_blocks(spec, cfg, backend="cpu", padded=False)
    return sum(r.retained_output_bytes for r in blocks if ".layer" in r.block or "layers" in r.block)


@pytest.mark.parametrize("kv_heads", [4, 2])
@pytest.mark.parametrize("attention", ["eager", "sdpa"])
@pytest.mark.parametrize("wrapped", [False, True])
def test_cache_bytes_beyond_saved_match_a_real_forward(kv_heads: int, attention: str, wrapped: bool) -> None:
    spec = _llama(kv_heads)
    b, s = 2, 16
    measured = _measured_extra(spec, attention, wrapped, b, s)
    assert _planned_extra(spec, attention, wrapped, b, s) == measured
    if wrapped:  # checkpointed: every layer's K and V are extra, whole
        assert measured == 2 * 2 * b * s * kv_heads * 16 * 2


def test_no_cache_no_bytes() -> None:
    """use_cache off (the default): the layers retain nothing; on: a checkpointed layer retains K and V."""
    spec = saved_tensors.model("llama", "causal-lm", layers=2, hidden=64, heads=4, intermediate=128, vocab=100)
    cfg = TrainConfig(batch_size=2, seq_len=16, precision="bf16", attention="sdpa", checkpointing=True)
    off = activation_blocks(spec, cfg, backend="cpu", padded=False)
    assert all(r.retained_output_bytes == 0 for r in off if "layer" in r.block)
    on = activation_blocks(_llama(4), cfg, backend="cpu", padded=False)
    assert [r.retained_output_bytes for r in on if "layer" in r.block] == [2 * 2 * 16 * 64 * 2] * 2


def test_model_option() -> None:
    """`-o use_cache=true` reaches the spec; a value that is not a boolean, or a model whose cache is not
    modelled (GPT-2: views of its fused qkv output), is one clear error naming the option."""
    from planner.models.catalog import get_model

    assert get_model("llama-2-7b", use_cache=True).transformers[0].use_cache
    assert not get_model("llama-2-7b").transformers[0].use_cache  # config.json's true is not read
    with pytest.raises(PlannerError, match="use_cache"):
        get_model("llama-2-7b", use_cache="maybe")
    with pytest.raises(PlannerError, match="use_cache"):
        get_model("gpt2", use_cache=True)
    get_model("gpt2", use_cache=False)


def test_kept_cache_moves_the_plain_loops_peak_and_the_forward_end() -> None:
    """Llama-2-7B LoRA at 4 × 2,048 with checkpointing, on A100s: the plain loop keeps the cache through
    backward (2 × 32 layers × 4 × 2,048 × 4,096 × 2 B = 4 GiB more at its backward peak); a loop that returns
    only the loss frees it when the forward returns, so the cache puts its peak at the end of the forward (as
    meta-llama/llama-cookbook#165 shows: "avoids peak memory from being at the end of the forward pass")."""
    from planner import estimate

    def est(loop: str, cache: bool):
        cfg = TrainConfig(batch_size=4, seq_len=2048, precision="bf16", checkpointing=True, lora_r=8,
                          lora_targets=("q_proj", "v_proj"), loop=loop)
        return estimate("llama-2-7b", cfg, "ml.p4d.24xlarge", model_options={"head": "causal-lm", "use_cache": cache})

    kv = 2 * 32 * 4 * 2048 * 4096 * 2
    plain, plain_kv = est("plain", False), est("plain", True)
    assert plain_kv.memory_bytes.peak_allocated - plain.memory_bytes.peak_allocated == kv
    only, only_kv = est("loss-only", False), est("loss-only", True)
    assert only.peak_phase == "backward" and only_kv.peak_phase == "forward"
    forward = {p.phase: p.allocated for p in only.phases}["forward"]
    assert {p.phase: p.allocated for p in only_kv.phases}["forward"] == forward + kv
    assert {p.phase: p.allocated for p in only_kv.phases}["backward"] == only.memory_bytes.peak_allocated
