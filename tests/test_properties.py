"""Properties that must hold for any configuration (hypothesis)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

import planner
from planner.spec import TrainConfig

MODELS = st.sampled_from(["bert-base-uncased", "gpt2", "distilbert-base-uncased", "multimodal-bert", "roberta-base"])
PRECISIONS = st.sampled_from(["fp32", "amp-fp16", "fp16"])
ATTENTIONS = st.sampled_from(["eager", "sdpa"])
FAST = settings(max_examples=25, deadline=None)


def est(model, **kw):
    return planner.estimate(model, TrainConfig(**kw), "ml.p3.16xlarge", with_throughput=False)


@FAST
@given(MODELS, st.integers(1, 32), st.integers(8, 256), PRECISIONS, ATTENTIONS, st.booleans())
def test_memory_grows_with_batch_and_sequence(model, b, s, precision, attention, ckpt):
    kw = dict(batch_size=b, seq_len=s, precision=precision, attention=attention, checkpointing=ckpt)
    base = est(model, **kw).memory_bytes
    more_b = est(model, **(kw | {"batch_size": b + 1})).memory_bytes
    more_s = est(model, **(kw | {"seq_len": s + 8})).memory_bytes
    for m in (more_b, more_s):
        assert m.activations > base.activations
        assert m.peak_allocated >= base.peak_allocated


@FAST
@given(MODELS, st.integers(1, 32), st.integers(8, 256), PRECISIONS, ATTENTIONS)
def test_checkpointing_never_raises_activations(model, b, s, precision, attention):
    kw = dict(batch_size=b, seq_len=s, precision=precision, attention=attention)
    plain = est(model, **kw).memory_bytes
    ckpt = est(model, **kw, checkpointing=True).memory_bytes
    assert ckpt.activations <= plain.activations


@FAST
@given(MODELS, st.integers(1, 16), st.sampled_from(["fp32", "amp-fp16"]),
       st.sampled_from(["adamw", "sgd-momentum", "adafactor"]))
def test_more_sharding_never_raises_model_states(model, b, precision, optimizer):
    order = ["ddp", "zero1", "zero2", "zero3"]
    states = []
    for p in order:
        m = est(model, batch_size=b, seq_len=64, precision=precision, optimizer=optimizer, parallelism=p).memory_bytes
        states.append(m.parameters + m.gradients + m.optimizer_states)
    assert states == sorted(states, reverse=True)
