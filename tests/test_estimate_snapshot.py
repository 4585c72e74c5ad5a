"""Memory and time of a grid of estimates, unchanged by the one-program refactor (issue 33).

A regression guard, not a truth: `tests/data/estimate_snapshot.json` was written by the code *before* the
refactor (`python tests/estimate_snapshot.py`, run on the commit that added this test; the fixture then
matched it byte for byte), so a failure here means a refactor step changed a figure. Where a step corrects a
disagreement between two old copies of a layer, the step regenerates the fixture and says which figure moved
and which side the real module (built on CPU) confirmed.

The grid: every catalog model × {fp32, amp-bf16} × checkpointing {off, on} × {single, ddp, zero3} × two
instance types, plus LoRA, QLoRA and a run of varying lengths (all torch-free: the analytic front end), and a
config.json that the tracer models (needs torch). Memory in bytes must be identical; seconds within 1e-9
relative (a refactor may sum the same terms in another order).
"""

from __future__ import annotations

import json
import math

import pytest

from tests.estimate_snapshot import FIXTURE, figures, grid_cases, traced_cases

SNAPSHOT = json.loads(FIXTURE.read_text())


def _diff(old, new, path=""):
    """Where two figure trees differ: ints and strings exactly, floats to 1e-9 relative."""
    if isinstance(old, dict) and isinstance(new, dict):
        out = [f"{path}: keys {sorted(set(old) ^ set(new))}"] if set(old) != set(new) else []
        return out + [d for k in old if k in new for d in _diff(old[k], new[k], f"{path}.{k}")]
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        return [d for i, (a, b) in enumerate(zip(old, new, strict=True)) for d in _diff(a, b, f"{path}[{i}]")]
    if isinstance(old, float) or isinstance(new, float):
        ok = isinstance(old, (int, float)) and isinstance(new, (int, float)) and math.isclose(old, new, rel_tol=1e-9)
        return [] if ok else [f"{path}: {old} -> {new}"]
    return [] if old == new else [f"{path}: {old} -> {new}"]


def test_the_fixture_covers_the_grid():
    keys = {c[0] for c in grid_cases() + traced_cases()}
    assert keys == set(SNAPSHOT)
    assert len(keys) >= 14 * 2 * 2 * 3 * 2


def test_the_comparison_can_fail():
    assert _diff({"a": 1, "b": [1.0]}, {"a": 2, "b": [1.0 + 1e-6]}) == [".a: 1 -> 2", ".b[0]: 1.0 -> 1.000001"]


def test_grid_memory_and_time_unchanged():
    wrong = {}
    for key, model, cfg, inst, extra in grid_cases():
        d = _diff(SNAPSHOT[key], figures(model, cfg, inst, extra))
        if d:
            wrong[key] = d[:4]
    assert wrong == {}


@pytest.mark.parametrize("case", traced_cases(), ids=lambda c: c[0])
def test_traced_memory_and_time_unchanged(case):
    key, model, cfg, inst, extra = case
    assert _diff(SNAPSHOT[key], figures(model, cfg, inst, extra)) == []


def test_the_grid_runs_without_torch():
    """The analytic grid needs no torch (a fresh process computes a sample of it and never imports it)."""
    import subprocess
    import sys
    from pathlib import Path

    code = ("import sys\nfrom tests.estimate_snapshot import grid_cases, figures\n"
            "cases = grid_cases()\n"
            "for key, m, cfg, inst, extra in cases[::23] + cases[-10:]:\n    figures(m, cfg, inst, extra)\n"
            "print('torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parent.parent)
    assert out.stdout.strip().splitlines()[-1] == "False"
