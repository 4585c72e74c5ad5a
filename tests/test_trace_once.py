"""One trace per estimate (issue 38): a single estimate traces the micro-batch it is asked for, once, where it
used to trace micro-batches 2 and 4 and interpolate; a search (and explain's largest fitting batch) still takes
the two base traces and interpolates every other micro-batch (`sources.many_batches`). The two ways must give
the same trace and the same estimate, byte for byte (only the note that says the trace was interpolated
differs), on config.json models and on a module of the user's own."""

from __future__ import annotations

import json
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest

from planner import caches
from planner.program import sources
from planner.spec import TrainConfig
from tests.test_trace import _tiny_configs

USER_MODULE = textwrap.dedent('''
    import torch
    from torch import nn


    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(64, 32)
            self.layers = nn.ModuleList(nn.TransformerEncoderLayer(32, 4, 64, batch_first=True) for _ in range(2))
            self.norm = nn.BatchNorm1d(32)
            self.head = nn.Linear(32, 64)

        def forward(self, input_ids):
            x = self.embed(input_ids)
            for layer in self.layers:
                x = layer(x)
            x = self.norm(x.transpose(1, 2)).transpose(1, 2)
            return self.head(x)


    def build():
        return Net()


    def batch(b, s):
        return {"input_ids": torch.randint(0, 64, (b, s))}
''')


@pytest.fixture()
def fresh(monkeypatch):
    """No trace in memory or on disk, and a count of the traces made."""
    from planner.program import trace

    monkeypatch.setenv("PLANNER_TRACE_CACHE", "0")
    caches.clear()
    made: list[int] = []
    real = trace.trace_step

    def counted(*args, **kwargs):
        made.append(args[2].batch_size)
        return real(*args, **kwargs)

    monkeypatch.setattr(trace, "trace_step", counted)
    yield made
    caches.clear()


def _models(tmp_path: Path) -> dict[str, dict]:
    t5 = tmp_path / "t5.json"
    t5.write_text(json.dumps(_tiny_configs()["T5ForConditionalGeneration"]))
    qwen = tmp_path / "qwen2.json"
    qwen.write_text(json.dumps(_tiny_configs()["Qwen2ForCausalLM"]))
    user = tmp_path / "net.py"
    user.write_text(USER_MODULE)
    return {"t5": {"model": str(t5)}, "qwen2": {"model": str(qwen)},
            "user": {"model": f"{user}:build", "inputs": f"{user}:batch"}}


CASES = [  # (model, batch, length, precision, checkpointing)
    ("t5", 6, 8, "fp32", False),
    ("t5", 3, 16, "amp-bf16", True),
    ("qwen2", 7, 8, "bf16", False),
    ("user", 5, 8, "amp-fp16", False),
]


@pytest.mark.parametrize(("name", "b", "s", "precision", "checkpointing"), CASES)
def test_one_trace_equals_the_two_trace_interpolation(fresh, tmp_path, name, b, s, precision, checkpointing):
    model = _models(tmp_path)[name]
    config = TrainConfig(batch_size=b, seq_len=s, precision=precision, checkpointing=checkpointing,
                         attention="sdpa")
    once = sources.model_trace(model["model"], config, inputs=model.get("inputs"))
    assert fresh == [b]  # one trace, at the micro-batch asked
    caches.clear()
    with sources.many_batches():
        twice = sources.model_trace(model["model"], config, inputs=model.get("inputs"))
    assert fresh == [b, 2, 4]  # the two base traces
    note = f"traced at micro-batches 2 and 4, interpolated to {b}"
    assert twice.notes == (*once.notes, note)
    assert sum(e.action == "free" for e in once.events) > 0 and once.saved  # the comparison covers something
    assert replace(twice, notes=once.notes) == once  # ops, events, saved tensors, blocks: every field


def test_the_estimate_is_the_same_but_for_the_note(fresh, tmp_path):
    from planner.estimate import estimate

    model = _models(tmp_path)["t5"]["model"]
    config = TrainConfig(batch_size=6, seq_len=8, checkpointing=True, attention="sdpa")
    once = estimate(model, config, "ml.g5.xlarge").model_dump(mode="json")
    assert sorted(fresh) == [6, 6]  # with checkpointing and without: one trace each
    caches.clear()
    with sources.many_batches():
        twice = estimate(model, config, "ml.g5.xlarge").model_dump(mode="json")
    assert twice["notes"] == [*once["notes"], "traced at micro-batches 2 and 4, interpolated to 6"]
    twice["notes"] = once["notes"]
    assert json.dumps(twice, sort_keys=True) == json.dumps(once, sort_keys=True)


def test_base_batches_and_smaller_ones_are_traced_themselves_either_way(fresh, tmp_path):
    model = _models(tmp_path)["t5"]["model"]
    with sources.many_batches():
        for b in (1, 2, 4):
            sources.model_trace(model, TrainConfig(batch_size=b, seq_len=8, attention="sdpa"))
    assert fresh == [1, 2, 4]
    with sources.many_batches():
        sources.model_trace(model, TrainConfig(batch_size=9, seq_len=8, attention="sdpa"))
    assert fresh == [1, 2, 4]  # interpolated from the traces already made
    assert sources._MANY == [0]  # the context is left as found


def test_explain_interpolates_the_batches_it_tries(fresh, tmp_path):
    """explain's largest fitting micro-batch (doubling, then bisecting) and its fixes ask for many micro-batches
    of one shape class: two base traces, then every one of them interpolated, not a trace each."""
    from planner.estimate import estimate
    from planner.explain import explain

    model = _models(tmp_path)["t5"]["model"]
    config = TrainConfig(batch_size=6, seq_len=8, attention="sdpa")
    est = estimate(model, config, "ml.g5.xlarge")
    assert est.fits and fresh == [6]
    steps = explain(est, model)
    # the micro-batches it tried (12, 24, ... 6,144, then bisecting) came from the base traces, none traced
    # itself; explain's other steps may trace other shape classes at the asked micro-batch, 6
    assert steps and set(fresh) == {2, 4, 6} and fresh.count(2) == fresh.count(4) == 1
