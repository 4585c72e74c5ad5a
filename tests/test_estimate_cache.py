"""The estimate's caches key on what the cached functions read, so a cached answer is the uncached one."""

from __future__ import annotations

import importlib

import pytest

from planner.memory.activations import activation_blocks
from planner.models.catalog import cached_model
from planner.spec import DeepSpeedSettings, TrainConfig

estimate_mod = importlib.import_module("planner.estimate")

# Another valid value for every TrainConfig field that is not in estimate.ACTIVATION_FIELDS.
OTHER = {"optimizer": "sgd", "optimizer_impl": "for-loop", "parallelism": "zero3", "grad_accum": 4, "instances": 3,
         "gradient_as_bucket_view": True, "bucket_cap_mb": 100.0, "tf32": True, "lora_alpha": 64.0,
         "framework": "torchtitan", "deepspeed": DeepSpeedSettings(reduce_bucket_size=1000),
         "loop": "lightning", "load": "cast", "pp": 2, "vp": 2, "pp_schedule": "gpipe", "dp_replicas": 2,
         "distributed_optimizer": True, "ep": 2, "etp": 2, "moe_imbalance": 1.5,
         "grad_reduce_in_fp32": False, "reshard_after_forward": False, "first_stage_layers": 1, "last_stage_layers": 1,
         "account_for_embedding": True, "account_for_loss": True, "pp_layout": "Et|tL"}


def test_every_other_field_is_listed():
    assert set(OTHER) | set(estimate_mod.ACTIVATION_FIELDS) == set(TrainConfig.model_fields)


@pytest.mark.parametrize("model", ["bert-base-uncased", "gpt2", "multimodal-bert"])
@pytest.mark.parametrize("kw", [dict(batch_size=4, seq_len=128), dict(batch_size=2, seq_len=64, precision="amp-fp16",
                                                                      checkpointing=True, attention="eager")])
def test_activation_blocks_read_only_the_keyed_fields(model, kw):
    """Changing any field outside ACTIVATION_FIELDS leaves activation_blocks unchanged (if this fails, add the
    field to ACTIVATION_FIELDS)."""
    spec = cached_model(model)
    base = activation_blocks(spec, TrainConfig(**kw))
    for field, value in OTHER.items():
        assert activation_blocks(spec, TrainConfig(**kw, **{field: value})) == base, field


def test_cached_estimate_equals_a_cold_one():
    cfg = TrainConfig(batch_size=8, seq_len=256, precision="amp-fp16")
    warm = [estimate_mod.estimate("bert-base-uncased", cfg.model_copy(update={"instances": k}), "ml.p3.8xlarge")
            for k in (1, 2, 1)]
    estimate_mod.clear_caches()
    cold = estimate_mod.estimate("bert-base-uncased", cfg, "ml.p3.8xlarge")
    assert warm[0] == warm[2] == cold


def test_trace_reads_only_the_keyed_fields():
    """The step trace built with a config differing outside reserved.TRACE_FIELDS (same step, same activation
    records) is the same trace (if this fails, add the field to TRACE_FIELDS)."""
    from planner.memory import reserved

    cfg = TrainConfig(batch_size=4, seq_len=128, precision="amp-fp16")
    prep = estimate_mod._prepare("bert-base-uncased", cfg, "ml.p3.2xlarge", None, "cuda", None)
    args = (prep.step, prep.activations, 1.0, 1.0, 1.0, "cuda")
    base = reserved._build_trace(prep.spec, prep.cfg, *args)
    others = {f: v for f, v in OTHER.items() if f not in reserved.TRACE_FIELDS}
    assert set(others) | set(reserved.TRACE_FIELDS) == set(TrainConfig.model_fields)
    for field, value in others.items():
        assert reserved._build_trace(prep.spec, prep.cfg.model_copy(update={field: value}), *args) == base, field


def test_roofline_timings_are_cached_per_gpu_facts_not_name():
    """A GPU changed with model_copy keeps its name; its kernels must not be timed from the cache of the other."""
    from planner.hardware import get_instance
    from planner.perf.roofline import RooflineConstants, kernel_table, time_table

    spec = cached_model("bert-base-uncased")
    cfg = TrainConfig(batch_size=8, seq_len=128, precision="amp-fp16")
    gpu = get_instance("ml.p3.2xlarge").gpu
    faster = gpu.model_copy(update={"memory_bandwidth_gbs": 2 * gpu.memory_bandwidth_gbs})
    table = kernel_table(spec, cfg, flash_ok=gpu.flash_attention)
    c = RooflineConstants()
    slow, fast = time_table(table, 8, gpu, c), time_table(table, 8, faster, c)
    assert fast.seconds.sum() < slow.seconds.sum()
    assert time_table(table, 8, gpu, c) is slow  # cached
