"""The tracer's frees come from weak-reference callbacks on the storages (issue 38); the scan of every live
storage after every op (`scan_frees=True`, what the tracer did before) is kept as the reference: both must give
the same trace, event by event, on models with views, checkpoint recomputation, autocast, tied weights and
adapters."""

from __future__ import annotations

import pytest

from planner.program import hf
from planner.program.trace import trace_step
from planner.spec import TrainConfig
from tests.test_trace import ConvNet, TinyLM, _tiny_configs, conv_batch, lm_batch

CONFIGS = [  # (architecture, precision, checkpointing)
    ("T5ForConditionalGeneration", "fp32", False),
    ("T5ForConditionalGeneration", "amp-bf16", True),
    ("BartForConditionalGeneration", "amp-fp16", False),
    ("Qwen2ForCausalLM", "bf16", True),
    ("ViTForImageClassification", "fp32", False),
]


def _both(build, make, config: TrainConfig, **kw):
    fast = trace_step(build, make, config, **kw)
    slow = trace_step(build, make, config, scan_frees=True, **kw)
    return fast, slow


def _same(fast, slow) -> None:
    assert sum(e.action == "free" for e in slow.events) > 0  # the comparison covers frees
    assert fast.events == slow.events  # order and timing of every alloc and free
    assert fast == slow  # and everything derived from them (blocks' transients, saved records, ops)


@pytest.mark.parametrize(("arch", "precision", "checkpointing"), CONFIGS)
def test_callback_frees_equal_the_scan_on_hf_models(arch, precision, checkpointing):
    config = hf.hf_config_object(_tiny_configs()[arch], "config.json", "sdpa")
    make = hf.batch_maker(config, "config.json")
    cfg = TrainConfig(batch_size=2, seq_len=8, precision=precision, checkpointing=checkpointing)
    _same(*_both(hf.builder(config, "config.json"), make, cfg, enable_checkpointing=hf.enable_checkpointing))


@pytest.mark.parametrize(("build", "make", "seq"), [(lambda: TinyLM(), lm_batch, 8), (lambda: ConvNet(0.1),
                                                                                      conv_batch, 6)])
def test_callback_frees_equal_the_scan_on_user_modules(build, make, seq):
    for precision in ("fp32", "amp-fp16"):
        _same(*_both(build, make, TrainConfig(batch_size=3, seq_len=seq, precision=precision)))


def test_callback_frees_equal_the_scan_with_lora():
    from planner.adapters.traced import with_adapters

    config = hf.hf_config_object(_tiny_configs()["Qwen2ForCausalLM"], "config.json", "sdpa")
    cfg = TrainConfig(batch_size=2, seq_len=8, lora_r=4, lora_targets=["q_proj", "v_proj"])
    _same(*_both(with_adapters(hf.builder(config, "config.json"), cfg), hf.batch_maker(config, "config.json"), cfg))


def test_a_storage_whose_python_object_died_first_is_scanned_until_it_dies():
    """The fallback: a callback for a storage still alive (its Python object died without it) moves it to
    the scanned set; its free is recorded once, after the op where it really died."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from planner.program.trace import _Recorder, storage_key

    with FakeTensorMode():
        rec = _Recorder("cuda", [])
        t = torch.empty(16)
        info = rec.register(t, "temporary", 0)
        rec.dead.append(storage_key(t))  # as if its Python object had died
        rec._poll(1)
        assert rec.raw_events == [(0, "alloc", info.sid)] and storage_key(t) in rec.scanned
        del t
        rec._poll(2)
    assert rec.raw_events == [(0, "alloc", info.sid), (2, "free", info.sid)] and not rec.scanned
