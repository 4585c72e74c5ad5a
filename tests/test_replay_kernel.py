"""The compiled replay (`replay_kernel`, Numba) makes the choices of `allocator.fast_run`, and the policy that
loads it (`compiled`) changes speed only. Catalog steps are compared in tests/test_allocator_fast.py."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.estimate import estimate
from planner.memory import allocator, compiled, events, reserved
from planner.spec import TrainConfig
from tests.allocator_streams import event_streams

MiB = 1024 * 1024
pytest.importorskip("numba")


@pytest.fixture
def fresh_policy(monkeypatch):
    """A process that has replayed nothing yet (the kernel, once compiled, stays loaded: loading is the cost)."""
    monkeypatch.setitem(compiled._state, "python_replays", 0)
    monkeypatch.setitem(compiled._state, "kernel", None)
    monkeypatch.delenv("PLANNER_COMPILED_REPLAY", raising=False)
    return compiled._state


@settings(max_examples=300, deadline=None)
@given(event_streams(), st.sampled_from([None, 24 * MiB, 100 * MiB, 400 * MiB]),
       st.sampled_from([None, 4 * MiB, 30 * MiB]))
def test_kernel_equals_fast_run_on_any_stream(evs, capacity, max_split):
    trace = events.Trace.from_events(evs, [f"t{i}" for i in range(len(evs))])
    assert trace.events == tuple(evs)
    got = compiled.kernel_replay(trace, capacity_bytes=capacity, max_split_size=max_split)
    assert got == allocator.fast_run(evs, capacity_bytes=capacity, max_split_size=max_split)[0]


def test_compact_trace_expands_to_its_events_and_names():
    """A builder trace: ranges of ids, groups of names; `events`, `names`, `n_events` and `tensor_name` agree."""
    step_trace = _bert_trace()
    assert len(step_trace.program) * 5 < step_trace.n_events == len(step_trace.events)
    again = events.Trace.from_events(step_trace.events, step_trace.names)
    assert again.events == step_trace.events and again.sizes == step_trace.sizes
    assert len(step_trace.names) == len(step_trace.sizes)
    grads = [i for i, n in enumerate(step_trace.names) if n == "model.layer.0.grad"]
    assert len(grads) > 1 and events.tensor_name(step_trace, grads[1]) == "model.layer.0.grad[1]"
    with pytest.raises(ValueError, match="out of id order"):
        events.Trace.from_events([(1, 10)], ["x"])


def _bert_trace():
    from tests.test_allocator_fast import _trace

    return _trace("bert-base-uncased", TrainConfig(batch_size=4, seq_len=128))


def test_policy_replays_in_python_until_enough_replays_then_loads_the_kernel(fresh_policy, monkeypatch):
    monkeypatch.setattr(compiled, "COMPILE_AFTER", 3)
    trace = _bert_trace()
    assert [compiled.replay(trace) for _ in range(3)] == [None] * 3  # the caller replays these in Python
    assert fresh_policy["python_replays"] == 3
    assert compiled.replay(trace) == allocator.fast_run(trace.events)[0]  # the fourth: the kernel


def test_environment_pins_the_policy(fresh_policy, monkeypatch):
    trace = _bert_trace()
    monkeypatch.setenv("PLANNER_COMPILED_REPLAY", "0")
    monkeypatch.setattr(compiled, "COMPILE_AFTER", 0)
    assert compiled.replay(trace) is None and not compiled.warm()
    monkeypatch.setenv("PLANNER_COMPILED_REPLAY", "1")
    monkeypatch.setattr(compiled, "COMPILE_AFTER", 10**9)
    assert compiled.replay(trace) == allocator.fast_run(trace.events)[0]


_FREEZE_COUNT_AT_EXIT = ("import atexit, gc, sys; atexit.register(lambda: print('frozen', gc.get_freeze_count(), "
                         "'threshold', gc.get_threshold()[0], file=sys.stderr)); ")


@pytest.mark.parametrize("command", [True, False])
def test_only_the_command_tunes_its_collector(command, tmp_path):
    """The `planner` command owns its process (`planner.cli.main.claim_process`): its collector runs less often,
    and loading the kernel moves what is alive then out of the collector's reach (`compiled._freeze`); a library
    user's process is left as it is."""
    import os
    import subprocess
    import sys

    from planner.cli.main import GC_FIRST_GENERATION

    if command:
        run = ("sys.argv = ['planner', 'estimate', '--model', 'bert-base-uncased', '--instance', 'ml.p3.2xlarge', "
               "'--batch-size', '4', '--seq-len', '128']; from planner.cli.main import main; main()")
    else:
        run = ("from planner.estimate import estimate; from planner.spec import TrainConfig; "
               "estimate('bert-base-uncased', TrainConfig(batch_size=4, seq_len=128), 'ml.p3.2xlarge')")
    env = os.environ | {"PLANNER_COMPILED_REPLAY": "1"}
    done = subprocess.run([sys.executable, "-c", _FREEZE_COUNT_AT_EXIT + run], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    frozen, threshold = (int(x) for x in done.stderr.rsplit("frozen ", 1)[1].split()[0:3:2])
    assert (frozen > 10_000) if command else frozen == 0
    assert threshold == (GC_FIRST_GENERATION if command else 700)  # 700: Python's own, a library user's


def test_a_kernel_that_fails_to_load_leaves_replays_in_python(fresh_policy, monkeypatch):
    """A Numba cache that cannot be read back (seen: one written by the same file imported under another module
    name) or a compiler failure raises at the first call; the estimate must not: Python replays the same."""
    import sys
    import types

    def broken(*args):
        raise ModuleNotFoundError("No module named '<dynamic>'")

    monkeypatch.setitem(sys.modules, "planner.memory.replay_kernel", types.SimpleNamespace(replay_program=broken))
    monkeypatch.setitem(compiled._state, "unavailable", False)
    monkeypatch.setenv("PLANNER_COMPILED_REPLAY", "1")
    trace = _bert_trace()
    assert compiled.replay(trace) is None and not compiled.warm()
    assert fresh_policy["unavailable"] and fresh_policy["kernel"] is None
    assert reserved._replay(trace, None, False) == allocator.fast_run(trace.events)[0]


def test_sizes_beyond_int64_replay_in_python(fresh_policy, monkeypatch):
    """10^20 bytes (an absurd batch) cannot be an int64 address: the kernel declines, Python replays it."""
    monkeypatch.setenv("PLANNER_COMPILED_REPLAY", "1")
    huge = events.Trace.from_events([(0, 10**20), (1, 5), (0, 0)], ["a", "b"])
    assert compiled.kernel_replay(huge) is None and compiled.replay(huge) is None
    assert reserved._replay(huge, None, False) == allocator.fast_run(huge.events)[0]
    assert compiled.kernel_replay(_bert_trace(), capacity_bytes=1 << 70) is None


@pytest.mark.parametrize("cfg", [TrainConfig(batch_size=8, seq_len=512, precision="amp-fp16"),
                                 TrainConfig(batch_size=64, seq_len=512, precision="fp32")])
def test_estimate_is_the_same_whichever_replays(cfg, monkeypatch):
    """End to end, an OOM-retry case included (fp32 64x512 does not fit a V100 16 GB)."""
    out = {}
    for mode in ("0", "1"):
        monkeypatch.setenv("PLANNER_COMPILED_REPLAY", mode)
        reserved.clear_caches()
        out[mode] = estimate("bert-base-uncased", cfg, "ml.p3.2xlarge").model_dump()
    assert out["0"] == out["1"]
    assert out["0"]["allocator"]["oom_retry"] is (cfg.batch_size == 64)
