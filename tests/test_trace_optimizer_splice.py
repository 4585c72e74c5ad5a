"""Issue 38: the optimizer step is traced once per parameter list and optimizer (`trace.optimizer_step`) and
spliced into every trace of the model. The spliced trace must be the trace that runs the step itself, field
for field (ops, storage events in order with their ids, categories, blocks), and the estimate JSON the same
byte for byte."""

from __future__ import annotations

import json

import pytest
import torch

from planner import caches
from planner.program import hf, sources, trace
from planner.program.trace import trace_step
from planner.spec import TrainConfig
from tests.test_trace_periodic import _equal, _tiny


def _traces(monkeypatch, config_dict: dict, cfg: TrainConfig, backend: str = "cuda"):
    hc = hf.hf_config_object(config_dict, "config.json", cfg.attention)
    kw = {"backend": backend, "enable_checkpointing": sources._checkpointing_for}
    trace._OPTIMIZER_STEPS.clear()
    spliced = trace_step(hf.builder(hc, "config.json"), hf.batch_maker(hc, "config.json"), cfg, **kw)
    assert len(trace._OPTIMIZER_STEPS) == 1 and next(iter(trace._OPTIMIZER_STEPS.values())).spliceable
    again = trace_step(hf.builder(hc, "config.json"), hf.batch_maker(hc, "config.json"), cfg, **kw)  # reused
    monkeypatch.setattr(trace, "SPLICE_OPTIMIZER", False)
    whole = trace_step(hf.builder(hc, "config.json"), hf.batch_maker(hc, "config.json"), cfg, **kw)
    monkeypatch.setattr(trace, "SPLICE_OPTIMIZER", True)
    return spliced, again, whole


CASES = [  # (architecture, layers, batch, length, precision, optimizer, implementation, checkpointing)
    ("T5ForConditionalGeneration", 8, 3, 8, "fp32", "adamw", "foreach", False),
    ("T5ForConditionalGeneration", 4, 2, 16, "amp-bf16", "adamw", "fused", True),
    ("BartForConditionalGeneration", 8, 4, 8, "amp-fp16", "adamw", "for-loop", False),
    ("BartForConditionalGeneration", 4, 2, 8, "fp32", "sgd-momentum", "foreach", False),
    ("Qwen2ForCausalLM", 9, 2, 8, "bf16", "adamw", "foreach", False),
    ("Qwen2ForCausalLM", 7, 3, 8, "amp-bf16", "adam", "fused", False),
]


@pytest.mark.parametrize(("arch", "layers", "b", "s", "precision", "optimizer", "impl", "ckpt"), CASES)
def test_the_spliced_step_is_the_step_run_in_the_trace(monkeypatch, arch, layers, b, s, precision, optimizer,
                                                         impl, ckpt):
    cfg = TrainConfig(batch_size=b, seq_len=s, precision=precision, attention="sdpa", optimizer=optimizer,
                      optimizer_impl=impl, checkpointing=ckpt)
    spliced, again, whole = _traces(monkeypatch, _tiny(arch, layers), cfg)
    steps = [op for op in whole.ops if op.phase == "optimizer"]
    assert steps and any(e.category == "optimizer_state" for e in whole.events)  # Adam's moments, SGD's momentum
    assert sum(e.op >= steps[0].index for e in whole.events) > 0  # the comparison covers the step's events
    _equal(spliced, whole)
    _equal(again, whole)


def test_a_user_module_on_the_cpu_backend(monkeypatch):
    """BatchNorm's buffers, a frozen parameter (no gradient, not in the optimizer) and the CPU backend."""

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(8, 16)
            self.bn = torch.nn.BatchNorm1d(16)
            self.b = torch.nn.Linear(16, 4)
            self.a.bias.requires_grad_(False)

        def forward(self, x):
            return self.b(torch.relu(self.bn(self.a(x))))

    cfg = TrainConfig(batch_size=4, seq_len=8, precision="fp32")
    trace._OPTIMIZER_STEPS.clear()
    spliced = trace_step(Net, lambda b, s: torch.randn(b, 8), cfg, backend="cpu")
    monkeypatch.setattr(trace, "SPLICE_OPTIMIZER", False)
    whole = trace_step(Net, lambda b, s: torch.randn(b, 8), cfg, backend="cpu")
    assert any(op.phase == "optimizer" for op in whole.ops)
    _equal(spliced, whole)


def test_one_step_serves_every_shape_class_of_a_model(monkeypatch):
    """Length, micro-batch, compute precision (AMP keeps fp32 weights) and checkpointing leave the step as it
    is: one traced step for all of them; the implementation makes another."""
    hc = hf.hf_config_object(_tiny("Qwen2ForCausalLM", 4), "config.json", "sdpa")
    trace._OPTIMIZER_STEPS.clear()
    for b, s, p, ck in [(2, 8, "fp32", False), (4, 16, "amp-bf16", False), (3, 8, "amp-fp16", True)]:
        cfg = TrainConfig(batch_size=b, seq_len=s, precision=p, checkpointing=ck, attention="sdpa")
        trace_step(hf.builder(hc, "config.json"), hf.batch_maker(hc, "config.json"), cfg,
                   enable_checkpointing=sources._checkpointing_for)
    assert len(trace._OPTIMIZER_STEPS) == 1
    cfg = TrainConfig(batch_size=2, seq_len=8, optimizer_impl="fused", attention="sdpa")
    trace_step(hf.builder(hc, "config.json"), hf.batch_maker(hc, "config.json"), cfg)
    assert len(trace._OPTIMIZER_STEPS) == 2


def test_the_estimate_is_the_same_byte_for_byte(monkeypatch, tmp_path):
    from planner.estimate import estimate

    monkeypatch.setenv("PLANNER_TRACE_CACHE", "0")
    path = tmp_path / "t5.json"
    path.write_text(json.dumps(_tiny("T5ForConditionalGeneration", 6)))
    cfg = TrainConfig(batch_size=3, seq_len=16, precision="amp-bf16", attention="sdpa")
    caches.clear()
    spliced = estimate(str(path), cfg, "ml.g5.xlarge").model_dump(mode="json")
    caches.clear()
    monkeypatch.setattr(trace, "SPLICE_OPTIMIZER", False)
    whole = estimate(str(path), cfg, "ml.g5.xlarge").model_dump(mode="json")
    caches.clear()
    assert json.dumps(spliced, sort_keys=True) == json.dumps(whole, sort_keys=True)


@pytest.mark.parametrize("arch", ["T5ForConditionalGeneration", "Qwen2ForCausalLM"])
def test_a_class_differing_only_in_the_optimizer_reuses_the_trace_before_the_step(monkeypatch, arch):
    """The trace before the step is kept under the caller's key (`before_key`): the same model and shape class
    with another optimizer or implementation is not traced again, and its trace is the one traced whole."""
    hc = hf.hf_config_object(_tiny(arch, 6), "config.json", "sdpa")
    calls = []
    real_build = hf.builder(hc, "config.json")

    def build():
        calls.append(1)
        return real_build()

    trace._OPTIMIZER_STEPS.clear()
    trace._BEFORE_STEP.clear()
    base = TrainConfig(batch_size=2, seq_len=8, precision="amp-bf16", attention="sdpa")
    first = trace_step(build, hf.batch_maker(hc, "config.json"), base, before_key="k")
    assert len(calls) == 1 and trace._BEFORE_STEP
    others = [base.model_copy(update=u) for u in ({"optimizer_impl": "fused"}, {"optimizer": "sgd-momentum"},
                                                  {"optimizer_impl": "for-loop"}, {})]
    reused = [trace_step(build, hf.batch_maker(hc, "config.json"), c, before_key="k") for c in others]
    assert len(calls) == 1  # none traced the model again
    monkeypatch.setattr(trace, "SPLICE_OPTIMIZER", False)
    for c, got in zip(others, reused, strict=True):
        _equal(got, trace_step(hf.builder(hc, "config.json"), hf.batch_maker(hc, "config.json"), c))
    _equal(first, reused[-1])
    trace._BEFORE_STEP.clear()


def test_a_step_that_fails_before_the_optimizer_fails_again_without_tracing(monkeypatch):
    """A BatchNorm given one sample raises in forward: a class differing only in the optimizer gets the same
    one-line error without building the model again."""
    from planner.errors import PlannerError

    built = []

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            built.append(1)
            self.a = torch.nn.Linear(8, 16)
            self.bn = torch.nn.BatchNorm1d(16)

        def forward(self, x):
            return self.bn(self.a(x))

    trace._FAILED_BEFORE_STEP.clear()
    cfg = TrainConfig(batch_size=1, seq_len=8, precision="fp32")
    errors, builds = [], []
    for c in (cfg, cfg.model_copy(update={"optimizer_impl": "fused"})):
        with pytest.raises(PlannerError) as exc:
            trace_step(Net, lambda b, s: torch.randn(b, 8), c, backend="cpu", before_key="net")
        errors.append(str(exc.value))
        builds.append(len(built))
    assert errors[0] == errors[1] and "Expected more than 1 value per channel" in errors[0]
    assert builds[0] >= 1 and builds[1] == builds[0]  # the second class built nothing
    trace._FAILED_BEFORE_STEP.clear()
