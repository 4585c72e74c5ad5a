"""Issue 38: the optimizer step traced in a forked child while the parent traces the forward and backward
(`planner.program.forked`, `trace._fork_optimizer_step`). The child's step must be the one the parent would
trace (the whole trace equal field for field to the trace made without forking), be used when the gradients
are as guessed, be discarded (and the step traced in the parent) when they are not, and leave no child."""

from __future__ import annotations

import os
import time

import pytest
import torch

from planner.program import forked, hf, sources, trace
from planner.program.trace import trace_step
from planner.spec import TrainConfig
from tests.test_trace_periodic import _equal, _tiny


@pytest.fixture(autouse=True)
def _whatever_the_load(monkeypatch):
    """The tests fork on a busy machine too (`forked.LOAD_AWARE` leaves it out there)."""
    monkeypatch.setattr(forked, "LOAD_AWARE", False)
    if not forked.available():
        pytest.skip("no fork or a single CPU: nothing is forked")


def _counting(monkeypatch) -> list[int]:
    """Counts the optimizer steps traced in this process (not in a child)."""
    calls = [0]
    real = trace._traced_optimizer_step

    def counted(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(trace, "_traced_optimizer_step", counted)
    return calls


def _both(monkeypatch, build, batch, cfg, **kw):
    trace._OPTIMIZER_STEPS.clear()
    calls = _counting(monkeypatch)
    with_child = trace_step(build, batch, cfg, **kw)
    in_parent = calls[0]
    assert forked.pending() == []  # collected or ended, never left running
    trace._OPTIMIZER_STEPS.clear()
    monkeypatch.setattr(forked, "ENABLED", False)
    alone = trace_step(build, batch, cfg, **kw)
    monkeypatch.setattr(forked, "ENABLED", True)
    _equal(with_child, alone)
    return in_parent


@pytest.mark.parametrize(("arch", "precision", "impl"), [("T5ForConditionalGeneration", "fp32", "foreach"),
                                                        ("Qwen2ForCausalLM", "amp-bf16", "fused")])
def test_the_childs_step_is_used_and_is_the_parents(monkeypatch, arch, precision, impl):
    cfg = TrainConfig(batch_size=2, seq_len=8, precision=precision, attention="sdpa", optimizer_impl=impl)
    hc = hf.hf_config_object(_tiny(arch, 4), "config.json", "sdpa")
    in_parent = _both(monkeypatch, hf.builder(hc, "config.json"), hf.batch_maker(hc, "config.json"), cfg,
                      enable_checkpointing=sources._checkpointing_for)
    assert in_parent == 0  # the gradients were as guessed: the child's step was spliced


def test_a_wrong_guess_traces_the_step_here(monkeypatch):
    """A parameter that gets no gradient (an unused layer): the guess names a gradient for it, the real
    metadata do not; the child is ended and the parent traces the step itself."""

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(8, 16)
            self.unused = torch.nn.Linear(16, 16)
            self.b = torch.nn.Linear(16, 4)

        def forward(self, x):
            return self.b(torch.relu(self.a(x)))

    cfg = TrainConfig(batch_size=4, seq_len=8, precision="fp32")
    assert _both(monkeypatch, Net, lambda b, s: torch.randn(b, 8), cfg, backend="cpu") == 1


def test_a_failing_child_gives_none():
    def fails():
        raise RuntimeError("no")

    assert forked.start("fails", fails)
    assert forked.collect("fails") is None
    assert forked.collect("never started") is None


def test_a_slow_child_is_ended():
    assert forked.start("slow", lambda: time.sleep(60))
    pid = forked._PENDING["slow"][0]
    assert forked.collect("slow", timeout=0.2) is None
    with pytest.raises(ChildProcessError):  # killed and reaped
        os.waitpid(pid, os.WNOHANG)


def test_a_discarded_child_is_ended():
    assert forked.start("unwanted", lambda: time.sleep(60))
    pid = forked._PENDING["unwanted"][0]
    forked.discard("unwanted")
    assert forked.pending() == []
    with pytest.raises(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


def test_a_large_answer_comes_back_whole():
    """More than a pipe holds (64 KiB): the parent reads while the child writes."""
    assert forked.start("large", lambda: list(range(200_000)))
    assert forked.collect("large") == list(range(200_000))


def test_nothing_is_forked_while_another_thread_runs():
    import threading

    stop = threading.Event()
    other = threading.Thread(target=stop.wait)
    other.start()
    try:
        assert not forked.available() and not forked.start("threaded", lambda: 1)
    finally:
        stop.set()
        other.join()
    assert forked.available()


def test_a_busy_machine_forks_nothing(monkeypatch):
    monkeypatch.setattr(forked, "LOAD_AWARE", True)
    monkeypatch.setattr(os, "getloadavg", lambda: (len(os.sched_getaffinity(0)) - 0.5, 0.0, 0.0))
    assert not forked.available()
    monkeypatch.setattr(os, "getloadavg", lambda: (0.2, 0.0, 0.0))
    assert forked.available()
