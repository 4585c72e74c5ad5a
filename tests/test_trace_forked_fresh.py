"""The forked optimizer-step trace in a fresh interpreter (issue 38).

Why a subprocess: `planner.program.forked` refuses to fork while another Python thread runs (a lock it holds
would stay held in the child), and a pytest worker may hold one from an earlier test (a moto server, a thread
pool), in which case `tests/test_trace_forked.py` skips. Here the path runs whatever the order of the suite:
the child's step is used (the parent traces no optimizer step) and the trace is equal, field for field, to
the one traced without forking."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = r"""
from dataclasses import fields

from planner.program import forked, hf, sources, trace
from planner.program.trace import trace_step
from planner.spec import TrainConfig
from tests.test_trace_periodic import _tiny

forked.LOAD_AWARE = False
assert forked.available(), "a fresh interpreter on two CPUs: nothing should stop the fork"
calls = [0]
real = trace._traced_optimizer_step


def counted(*args, **kwargs):
    calls[0] += 1
    return real(*args, **kwargs)


trace._traced_optimizer_step = counted
cfg = TrainConfig(batch_size=2, seq_len=8, precision="fp32", attention="sdpa", optimizer_impl="foreach")
hc = hf.hf_config_object(_tiny("T5ForConditionalGeneration", 4), "config.json", "sdpa")
build, batch = hf.builder(hc, "config.json"), hf.batch_maker(hc, "config.json")
with_child = trace_step(build, batch, cfg, enable_checkpointing=sources._checkpointing_for)
assert calls[0] == 0, "the parent traced the optimizer step: the child's was not used"
assert forked.pending() == []
trace._OPTIMIZER_STEPS.clear()
forked.ENABLED = False
alone = trace_step(build, batch, cfg, enable_checkpointing=sources._checkpointing_for)
for f in fields(with_child):
    assert getattr(with_child, f.name) == getattr(alone, f.name), f.name
print("forked step used and equal")
"""


def test_the_forked_step_runs_and_equals_the_parents_in_a_fresh_process():
    if not (hasattr(os, "fork") and sys.platform.startswith("linux") and len(os.sched_getaffinity(0)) >= 2):
        pytest.skip("no fork or a single CPU: nothing is forked")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "forked step used and equal" in done.stdout
