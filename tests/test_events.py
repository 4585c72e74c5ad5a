"""The per-tensor trace agrees with the block timeline (one source of numbers), for catalog models."""

from __future__ import annotations

import importlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.memory import events, timeline
from planner.spec import TrainConfig

estimate_mod = importlib.import_module("planner.estimate")

CASES = [
    ("bert-base-uncased", dict(batch_size=8, seq_len=128, precision="amp-fp16"), "ml.p3.2xlarge"),
    ("gpt2", dict(batch_size=4, seq_len=512, precision="fp32", checkpointing=True), "ml.g5.xlarge"),
    ("roberta-base", dict(batch_size=4, seq_len=256, precision="amp-bf16", grad_accum=4), "ml.p4d.24xlarge"),
    ("distilbert-base-uncased", dict(batch_size=8, seq_len=128, parallelism="zero3"), "ml.p3.16xlarge"),
    ("gpt2", dict(batch_size=2, seq_len=256, precision="amp-fp16", parallelism="ddp", optimizer_impl="for-loop"),
     "ml.p3.16xlarge"),
    ("multimodal-bert", dict(batch_size=16, seq_len=128, precision="amp-fp16", parallelism="dp"), "ml.p3.8xlarge"),
    # FSDP1 (Accelerate): the root unit unsharded for the whole step, gradients whole inside no_sync()
    ("gpt2", dict(batch_size=2, seq_len=256, precision="amp-bf16", parallelism="fsdp", framework="accelerate",
                  grad_accum=2, checkpointing=True), "ml.p4d.24xlarge"),
    # FSDP2 without reshard after forward (NeMo AutoModel): every unit gathered from its forward to its backward
    ("gpt2", dict(batch_size=2, seq_len=256, precision="bf16", parallelism="fsdp", framework="nemo-automodel",
                  instances=2), "ml.p4d.24xlarge"),
]


def _trace(model, kw, instance):
    from planner.memory.reserved import _build_trace

    prep = estimate_mod._prepare(model, TrainConfig(**kw), instance, None, "cuda", None)
    trace = _build_trace(prep.spec, prep.cfg, prep.step, prep.activations, prep.share.parameters,
                         prep.share.gradients, prep.share.optimizer_states, "cuda")
    return prep, trace


@pytest.mark.parametrize("model,kw,instance", CASES)
def test_trace_live_bytes_equal_the_timeline_at_every_point(model, kw, instance):
    prep, trace = _trace(model, kw, instance)
    points = timeline.simulate(prep.step)
    assert [(m.phase, m.label) for m in trace.marks] == [(p.phase, p.label) for p in points]
    assert events.live_bytes(trace) == [p.total for p in points]


@pytest.mark.parametrize("model,kw,instance", CASES[:2])
def test_trace_is_per_tensor_and_balanced(model, kw, instance):
    prep, trace = _trace(model, kw, instance)
    allocs = [tid for tid, n in trace.events if n]
    frees = [tid for tid, n in trace.events if not n]
    assert len(set(allocs)) == len(allocs) and set(frees) <= set(allocs)
    # one tensor per parameter of a transformer layer (BERT: 16, GPT-2: 12)
    layer0 = [n for n in trace.names if n.startswith("model.layer.0.param") or n.startswith("transformer.h.0.param")]
    assert len(layer0) in (12, 16)
    # what stays after the step: parameters, buffers, buckets, states, workspace (never freed in a loop)
    never_freed = set(allocs) - set(frees)
    assert all(not trace.names[t].startswith(("batch", "loss")) for t in never_freed)


def test_tensors_of_no_bytes_allocate_nothing():
    """A zero-size parameter (and its gradient and optimizer states) is no allocation in the trace: an event of
    0 bytes would read as a free. The block totals, and so the live bytes, are unchanged."""
    prep, _ = _trace(*CASES[0])
    first = prep.step.blocks[0]
    tensors = events.model_block_tensors(prep.spec, prep.activations, prep.cfg)
    t = tensors[first.name]
    with_zero = events.BlockTensors(t.name, (*t.params, 0), (0, *t.grads), t.saved, t.kept, t.cache)
    assert with_zero.params == t.params and with_zero.grads == t.grads
    from planner.memory.reserved import _optimizer_tensors

    states, temps = _optimizer_tensors(prep.spec, prep.cfg, 4, 1.0)
    assert sum(states) == prep.step.optimizer_state_bytes  # so the states split into these tensors
    trace = events.step_events(prep.step, tensors | {first.name: with_zero}, state_sizes=(*states, 0),
                               temp_sizes=(0, *temps))
    assert all(n > 0 for n in trace.sizes)
    assert events.live_bytes(trace) == [p.total for p in timeline.simulate(prep.step)]


def test_split_and_buckets():
    assert events.split(10, [3, 3]) == (3, 3, 4)
    assert events.split(10, [6, 6]) == (10,)
    assert events.split(0, [1]) == ()
    assert events.buckets(60 * events.MiB, 25 * events.MiB) == (events.MiB, 25 * events.MiB, 25 * events.MiB,
                                                                  9 * events.MiB)


@pytest.mark.parametrize("model,kw,instance", CASES)
def test_a_known_structure_gives_what_a_fresh_build_gives(model, kw, instance):
    """A step of a structure met before is laid out from the cached program (`events._STRUCTURES`): over
    micro-batch sizes, with and without the first step, the trace equals a build from scratch, field by
    field."""
    from planner.memory import reserved

    shapes = [dict(kw, batch_size=b) for b in (1, 3, 8, 24)]
    cached, fresh = [], []
    try:
        for first in (True, False):
            reserved.REPLAY_FIRST_STEP = first
            events._STRUCTURES.clear()
            cached += [_trace(model, k, instance)[1] for k in shapes]
            hits = len(shapes) - len(events._STRUCTURES)
            assert hits > 0  # the cache was used
            for k in shapes:
                events._STRUCTURES.clear()
                fresh.append(_trace(model, k, instance)[1])
    finally:
        reserved.REPLAY_FIRST_STEP = True
    assert cached == fresh


_SMALL = st.integers(0, 3)  # small byte counts: many ties between points, where the first highest must win
_BLOCK = st.builds(timeline.BlockMemory, name=st.sampled_from(["a", "b", "loss"]), param_bytes=_SMALL,
                   grad_bytes=_SMALL, gathered_param_bytes=_SMALL, transient_grad_bytes=_SMALL, kept_bytes=_SMALL,
                   saved_bytes=_SMALL, forward_transient_bytes=_SMALL, backward_transient_bytes=_SMALL,
                   checkpointed=st.booleans(), forward_cache_bytes=_SMALL, retained_bytes=_SMALL)
_STEP = st.builds(timeline.StepMemory, blocks=st.lists(_BLOCK, max_size=5).map(tuple), module_buffer_bytes=_SMALL,
                  ddp_bucket_bytes=_SMALL, workspace_bytes=_SMALL, batch_bytes=_SMALL,
                  optimizer_state_bytes=_SMALL, optimizer_temporary_bytes=_SMALL, grads_resident=st.booleans(),
                  extra_forward_bytes=_SMALL)


@settings(max_examples=300, deadline=None)
@given(_STEP)
def test_peaks_are_the_simulated_points_peaks(step):
    """`timeline.peaks` (what an estimate uses) picks the same points as the full timeline, ties included."""
    points = timeline.simulate(step)
    assert timeline.peaks(step) == (timeline.phase_peaks(points), timeline.peak(points))


@pytest.mark.parametrize("model,kw,instance", CASES)
def test_a_laid_out_trace_equals_its_eager_copy(model, kw, instance):
    """A trace from `step_events` expands its sizes, program, groups and marks on first use; what it reports
    before that (tensor and event counts, the compiled replay's arrays, tensor names) is what the expanded
    tuples say."""
    import numpy as np

    from planner.memory import compiled

    _, lazy = _trace(model, kw, instance)
    arrays = compiled._arrays(lazy)  # before any expansion
    n_tensors, n_events = lazy.n_tensors, lazy.n_events
    names = [events.tensor_name(lazy, tid) for tid in range(n_tensors)]
    assert set(lazy.__dict__).isdisjoint(events.Trace.FIELDS[:-1])  # nothing expanded yet
    eager = events.Trace(*(getattr(lazy, f) for f in events.Trace.FIELDS))
    assert names == [events.tensor_name(eager, tid) for tid in range(n_tensors)]
    assert eager == lazy and hash(eager) == hash(lazy)
    assert (n_tensors, n_events) == (len(eager.sizes), sum(b - a for a, b, _ in eager.program))
    again = compiled._arrays(eager)
    assert all(np.array_equal(x, y) and x.dtype == y.dtype for x, y in zip(arrays, again, strict=True))
    assert repr(lazy) == repr(eager)
