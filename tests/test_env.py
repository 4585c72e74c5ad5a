"""PLANNER_* settings from the environment are checked like flags: a bad value is a PlannerError naming the
variable (library), and one line with exit 2 before anything runs (the `planner` command)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner import env
from planner.errors import PlannerError

BAD = ["abc", "nan", "inf", "-inf", "-5", "0", "1e300", "\x7fELF", "2.5e", "0x10"]


@pytest.mark.parametrize("name", sorted(env.LIMITS))
def test_each_limit_takes_its_default_and_valid_overrides(name, monkeypatch):
    default, low, high, integer = env.LIMITS[name]
    monkeypatch.delenv(name, raising=False)
    assert env.limit(name) == default
    monkeypatch.setenv(name, f" {int(high)} ")
    assert env.limit(name) == high
    monkeypatch.setenv(name, "")
    assert env.limit(name) == default


@pytest.mark.parametrize("name", sorted(env.LIMITS))
@pytest.mark.parametrize("raw", BAD)
def test_a_bad_limit_names_the_variable_and_the_range(name, raw, monkeypatch):
    monkeypatch.setenv(name, raw)
    with pytest.raises(PlannerError, match=name) as exc:
        env.limit(name)
    assert ">=" in str(exc.value) and "<=" in str(exc.value)


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=12))
def test_any_text_is_a_limit_or_a_planner_error(raw):
    os.environ["PLANNER_MAX_INSTANCES"] = raw.replace("\x00", "")
    try:
        value = env.limit("PLANNER_MAX_INSTANCES")
    except PlannerError:
        return
    finally:
        del os.environ["PLANNER_MAX_INSTANCES"]
    assert isinstance(value, int) and 1 <= value <= env.LIMITS["PLANNER_MAX_INSTANCES"][2]


def test_a_fractional_integer_limit_is_refused(monkeypatch):
    monkeypatch.setenv("PLANNER_MAX_GRAD_ACCUM", "2.5")
    with pytest.raises(PlannerError, match="an integer"):
        env.limit("PLANNER_MAX_GRAD_ACCUM")


def test_compiled_replay_setting(monkeypatch):
    for ok in ("0", "1", " 1 ", ""):
        monkeypatch.setenv("PLANNER_COMPILED_REPLAY", ok)
        assert env.choice("PLANNER_COMPILED_REPLAY") == ok.strip()
    monkeypatch.setenv("PLANNER_COMPILED_REPLAY", "yes")
    with pytest.raises(PlannerError, match="PLANNER_COMPILED_REPLAY='yes'"):
        env.choice("PLANNER_COMPILED_REPLAY")
    assert env.check_environment() is not None


def _run(args: list[str], **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, env={**os.environ, **extra}, timeout=120)


@pytest.mark.parametrize("setting", ["PLANNER_MAX_INSTANCES=abc", "PLANNER_MAX_GRAD_ACCUM=-5",
                                     "PLANNER_MAX_EPOCHS=nan", "PLANNER_COMPILED_REPLAY=yes"])
def test_the_command_says_one_line_and_exits_2(setting):
    name, value = setting.split("=")
    r = _run([sys.executable, "-m", "planner", "estimate"], **{name: value})
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    assert r.stderr.startswith(f"error: {name}={value!r} is not allowed")


def test_a_library_import_raises_the_planner_error():
    r = _run([sys.executable, "-c", "import planner"], PLANNER_MAX_INSTANCES="abc")
    assert r.returncode != 0 and "PlannerError: PLANNER_MAX_INSTANCES='abc'" in r.stderr
