"""`allocator.fast_run` (ints, the replay every estimate uses) makes exactly the choices of `run_reference`
(block objects, one method per function of c10/cuda/CUDACachingAllocator.cpp): the same ReplayResult — peaks,
the allocation that set the reserved peak, segment count, OOM flags — for random event streams and for the
step trace of every catalog model over a grid of batch / sequence / precision / checkpointing / parallelism.
"""

from __future__ import annotations

import importlib
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.memory import allocator, compiled, events, reserved
from planner.models.catalog import list_models
from planner.spec import TrainConfig
from tests.allocator_streams import event_streams

estimate_mod = importlib.import_module("planner.estimate")
MiB = 1024 * 1024


@settings(max_examples=300, deadline=None)
@given(event_streams(), st.sampled_from([None, 24 * MiB, 100 * MiB, 400 * MiB]),
       st.sampled_from([None, 4 * MiB, 30 * MiB]))
def test_fast_run_equals_the_reference_on_any_stream(evs, capacity, max_split):
    ref = allocator.run_reference(evs, capacity_bytes=capacity, max_split_size=max_split)[0]
    assert allocator.fast_run(evs, capacity_bytes=capacity, max_split_size=max_split)[0] == ref


@settings(max_examples=100, deadline=None)
@given(event_streams(), event_streams())
def test_fast_snapshot_resumes_exactly(head, tail):
    """A snapshot after permanent allocations, restored, gives the full replay's result."""
    head = [(tid, n) for tid, n in head if n]  # permanent: never freed
    shift = len(head)
    evs = head + [(tid + shift, n) for tid, n in tail]
    full = allocator.run_reference(evs)[0]
    result, snap = allocator.fast_run(evs, snapshot_at=len(head))
    assert result == full
    if snap is not None:
        assert allocator.run(evs, start=snap, snapshot_at=len(head))[0] == full


GRID = list(itertools.product([1, 3, 24], [64, 200, 512], ["fp32", "amp-fp16"], [False, True]))
PARALLEL = [dict(), dict(parallelism="zero3"), dict(grad_accum=2), dict(optimizer_impl="for-loop")]


def _trace(model, cfg, instance="ml.p4d.24xlarge"):
    prep = estimate_mod._prepare(model, cfg, instance, None, "cuda", None)
    return reserved._build_trace(prep.spec, prep.cfg, prep.step, prep.activations, prep.share.parameters,
                                 prep.share.gradients, prep.share.optimizer_states, "cuda")


@pytest.mark.parametrize("model", list_models())
def test_fast_run_equals_the_reference_on_catalog_steps(model, monkeypatch):
    """Every catalog model, 36 shapes each, one parallelism variant per shape (cycled), unlimited and at a
    capacity below the unlimited peak (the OOM retry path); the cached prefix path of `reserved` (Python
    replays pinned); and the compiled kernel (`compiled.kernel_replay`) on the same traces."""
    monkeypatch.setenv("PLANNER_COMPILED_REPLAY", "0")
    large = model.startswith(("llama", "mistral", "gpt2-xl", "gpt2-large"))
    huge = None  # set by the first trace: tens of thousands of events (the MoE models' expert tensors)
    for k, (b, s, precision, ckpt) in enumerate(GRID):
        if large and (b > 3 or s > 200):
            continue  # the same rules; fewer shapes keep the test short
        if huge and (b > 1 or s > 64):
            continue  # the same rules again, at a Python replay of seconds per shape
        cfg = TrainConfig(batch_size=b, seq_len=s, precision=precision, checkpointing=ckpt,
                          **PARALLEL[k % len(PARALLEL)])
        trace = _trace(model, cfg)
        if huge is None:
            huge = len(trace.events) > 15_000
        ref = allocator.run_reference(trace.events)[0]
        assert allocator.fast_run(trace.events)[0] == ref, (model, cfg)
        reserved.clear_caches()
        assert reserved._replay(trace, None, False) == ref  # cold: takes the prefix snapshot
        assert reserved._replay(trace, None, False) == ref  # warm: restores it
        cap = ref.peak_reserved * 3 // 4
        capped = allocator.fast_run(trace.events, capacity_bytes=cap)[0]
        assert capped == allocator.run_reference(trace.events, capacity_bytes=cap)[0], (model, cfg, cap)
        assert compiled.kernel_replay(trace) == ref, (model, cfg)
        assert compiled.kernel_replay(trace, capacity_bytes=cap) == capped, (model, cfg, cap)


def test_builder_prefix_is_the_permanent_prefix():
    """`Trace.permanent` (known while building) is what scanning the events finds."""
    for first in (True, False):
        reserved.REPLAY_FIRST_STEP = first
        try:
            trace = _trace("bert-base-uncased", TrainConfig(batch_size=4, seq_len=128))
        finally:
            reserved.REPLAY_FIRST_STEP = True
        scanned = events.permanent_prefix(events.Trace.from_events(trace.events, trace.names, trace.marks))
        assert trace.permanent == scanned > 0
