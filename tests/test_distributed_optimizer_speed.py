"""Megatron's distributed optimizer on a layout without TP, CP or PP: timed by the model-parallel step (its
reduce-scatter and all-gather, the optimizer on a 1/DP shard), not as plain DDP."""

from __future__ import annotations

from planner.hardware import get_instance
from planner.models.hf_config import spec_from_hf_config
from planner.perf.throughput import predict_throughput
from planner.spec import TrainConfig

P5 = get_instance("ml.p5.48xlarge")


def _gpt():
    cfg = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": 1024, "n_layer": 8,
           "n_head": 16, "vocab_size": 32768, "n_positions": 2048, "tie_word_embeddings": False}
    return spec_from_hf_config(cfg, name="gpt-1024-8")


def _config(distributed: bool) -> TrainConfig:
    return TrainConfig(batch_size=1, seq_len=2048, precision="amp-bf16", attention="flash", parallelism="ddp",
                       framework="megatron", distributed_optimizer=distributed, instances=2, grad_accum=2)


def test_the_optimizer_runs_on_a_shard():
    model = _gpt()
    whole = predict_throughput(model, _config(False), P5)
    shard = predict_throughput(model, _config(True), P5)
    dp = 2 * P5.gpus
    assert shard.breakdown_s["optimizer_s"] < whole.breakdown_s["optimizer_s"] / (dp / 2)
    assert "dp_communication_s" in shard.breakdown_s
    assert "dp_communication_s" not in whole.breakdown_s  # plain DDP keeps its own path and keys
    # the same kernels either way: only the optimizer and the collectives differ
    assert shard.breakdown_s["gemm"] == whole.breakdown_s["gemm"]


def test_megatron_steps_adam_with_the_fused_kernel():
    """Megatron-Core's FusedAdam whatever --optimizer-impl says: the step is as fast as with `fused`."""
    from planner.perf.throughput import optimizer_impl

    model = _gpt()
    base = _config(False)
    assert optimizer_impl(base) == "fused"
    assert optimizer_impl(base.model_copy(update={"framework": "pytorch"})) == base.optimizer_impl
    foreach = predict_throughput(model, base.model_copy(update={"optimizer_impl": "foreach"}), P5)
    fused = predict_throughput(model, base.model_copy(update={"optimizer_impl": "fused"}), P5)
    assert foreach.breakdown_s["optimizer_s"] == fused.breakdown_s["optimizer_s"]
