"""Every bad input is one line on stderr naming the flag, field or file, exit code 2, no traceback.

Kinds covered: numeric flags (hypothesis over NaN, +-inf, negatives, huge integers), files the tool reads
(binary, not UTF-8, truncated, nested deeper than Python's recursion limit, wrong shape, non-finite numbers),
places the tool writes (a file where a folder should be), and `--json` staying valid JSON.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from planner.cli.main import app
from planner.errors import PlannerError

runner = CliRunner()
BINARY = bytes(range(256)) * 4
NOT_UTF8 = b'{"model_type": "bert", "name": "\xff\xfe caf\xe9"}'
DEEP_JSON = "[" * 100_000  # json.loads raises RecursionError on this


def invoke(args: list[str], env: dict[str, str] | None = None) -> tuple[int, str, str]:
    res = runner.invoke(app, args, env=env)
    if res.exception is not None and not isinstance(res.exception, SystemExit):
        raise AssertionError(f"{args}: uncaught {type(res.exception).__name__}: {res.exception}")
    return res.exit_code, res.stdout, res.stderr


def assert_one_line_error(code: int, err: str, *names: str) -> None:
    assert code == 2, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("error:") and "Traceback" not in err
    for name in names:
        assert name in lines[0], (name, lines[0])


def short(value: object) -> str | None:
    """Readable test ids for file contents."""
    return repr(value)[2:30] if isinstance(value, bytes) else None


def strict_json(text: str) -> object:
    def refuse(name: str) -> None:
        raise AssertionError(f"invalid JSON constant {name}")

    return json.loads(text, parse_constant=refuse)


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    """No calibration or prices cache from the developer's results/ leaks in."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PLANNER_CALIBRATION", str(tmp_path / "no-calibration.json"))
    monkeypatch.setenv("PLANNER_PRICES", str(tmp_path / "no-prices.json"))


# ---- numeric flags ------------------------------------------------------------------------------

BAD_FLOATS = st.one_of(st.sampled_from([math.nan, math.inf, -math.inf, -1.0, -5.0, 1e308, -1e308]),
                       st.floats(allow_nan=True, allow_infinity=True))
HUGE_INTS = st.one_of(st.sampled_from([0, -1, -(10**20), 10**20, 2**63, 2**64 + 1, 10**30]),
                      st.integers(min_value=-(10**40), max_value=10**40))
FLOAT_FLAGS = ["--cuda-context-mib", "--fragmentation"]
INT_FLAGS = ["--batch-size", "--seq-len", "--instances", "--grad-accum", "--dataset-size", "--global-batch-size"]


FLOAT_LIMITS = {"--cuda-context-mib": 2**38 / 2**20, "--fragmentation": 9.0}  # MAX_RUNTIME_BYTES, MAX_FRAGMENTATION


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(flag=st.sampled_from(FLOAT_FLAGS), value=BAD_FLOATS)
def test_float_flags(flag, value):
    code, out, err = invoke(["estimate", "--json", flag, repr(value)])
    if not math.isfinite(value) or value < 0 or value > FLOAT_LIMITS[flag]:
        assert_one_line_error(code, err, flag)
    else:
        assert code == 0, err
        strict_json(out)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(flag=st.sampled_from(INT_FLAGS), value=HUGE_INTS)
def test_int_flags(flag, value):
    args = [flag, str(value)]
    if flag == "--global-batch-size":
        args += ["--instance", "ml.g5.xlarge"]  # one GPU: any positive global batch divides evenly
    code, out, err = invoke(["estimate", "--json", *args])
    if value < 1:
        assert_one_line_error(code, err, flag)
    elif code != 0:
        assert_one_line_error(code, err, flag)
    else:
        data = strict_json(out)
        assert data["world_size"] <= 8 * 2048  # a bounded answer, never "ddp over 10^20 GPUs"


def test_instances_beyond_the_limit_names_it():
    code, _, err = invoke(["estimate", "--instances", str(10**20)])
    assert_one_line_error(code, err, "--instances", "2048")


def test_model_option_non_finite():
    code, _, err = invoke(["estimate", "-o", "tab_in=nan"])
    assert_one_line_error(code, err, "tab_in")


# ---- calibration file ---------------------------------------------------------------------------

@pytest.mark.parametrize("content, names", [
    (b'{"families": {"V100": {"fragmentation": NaN}}}', ["calibration"]),
    (b'{"families": {"V100": {"fragmentation": -1}}}', ["fragmentation", "-1"]),
    (b'{"families": {"V100": {"fragmentation": 1e308}}}', ["fragmentation"]),
    (b'{"families": {"V100": {"cuda_context_bytes": -5}}}', ["cuda_context_bytes", "-5"]),
    (b'{"families": {"V100": {"cuda_context_bytes": "big"}}}', ["cuda_context_bytes", "big"]),
    (b'{"families": {"V100": {"nccl_bytes_per_peer": true}}}', ["nccl_bytes_per_peer"]),
    (b'[{"families": {}}]', ["calibration", "JSON object"]),
    (b'{"families": [1, 2]}', ["families"]),
    (b'{"families": {"V100": {"fragmentation": 0.1', ["calibration", "valid JSON"]),
    (BINARY, ["calibration", "binary"]),
    (NOT_UTF8, ["calibration", "UTF-8"]),
    (DEEP_JSON.encode(), ["calibration", "nested"]),
], ids=short)
def test_bad_calibration_file(tmp_path, content, names):
    path = tmp_path / "calibration.json"
    path.write_bytes(content)
    code, _, err = invoke(["estimate"], env={"PLANNER_CALIBRATION": str(path)})
    assert_one_line_error(code, err, *names)


def test_calibration_folder_is_an_error(tmp_path):
    code, _, err = invoke(["estimate"], env={"PLANNER_CALIBRATION": str(tmp_path)})
    assert_one_line_error(code, err, "calibration", "folder")


# ---- config.json --------------------------------------------------------------------------------

BERT = {"model_type": "bert", "architectures": ["BertForSequenceClassification"], "vocab_size": 30522,
        "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 128,
        "max_position_embeddings": 128}


@pytest.mark.parametrize("content, names", [
    (BINARY, ["config.json", "binary"]),
    (NOT_UTF8, ["config.json", "UTF-8"]),
    (json.dumps(BERT)[:40].encode(), ["config.json", "valid JSON", "line 1"]),
    (DEEP_JSON.encode(), ["config.json", "nested"]),
    (b"[1, 2, 3]", ["config.json", "JSON object"]),
    (json.dumps({**BERT, "num_hidden_layers": 10**9}).encode(), ["num_hidden_layers", "1000000000", "1,024"]),
    (json.dumps({**BERT, "hidden_size": 10**12}).encode(), ["hidden_size"]),
    (json.dumps({**BERT, "hidden_act": "mish"}).encode(), ["hidden_act", "mish"]),
    (json.dumps({**BERT, "hidden_dropout_prob": math.nan}).encode(), ["config.json"]),
    (json.dumps({**BERT, "hidden_dropout_prob": -1}).encode(), ["hidden_dropout_prob"]),
], ids=short)
def test_bad_config_json(tmp_path, content, names):
    path = tmp_path / "config.json"
    path.write_bytes(content)
    code, _, err = invoke(["estimate", "-m", str(path), "-i", "ml.g5.xlarge", "-s", "16"])
    assert_one_line_error(code, err, *names)


def test_config_json_every_listed_activation_estimates(tmp_path):
    """Each name in ACTIVATIONS has a saved-tensor formula (the list must not promise more than we have)."""
    from planner.models.hf_config import ACTIVATIONS

    for act in ACTIVATIONS:
        path = tmp_path / f"{act}.json"
        path.write_text(json.dumps({**BERT, "hidden_act": act}))
        code, out, err = invoke(["estimate", "-m", str(path), "-i", "ml.g5.xlarge", "-s", "16", "--json"])
        assert code == 0, (act, err)
        strict_json(out)


# ---- sweep YAML ---------------------------------------------------------------------------------

@pytest.mark.parametrize("content, names", [
    (BINARY, ["--sweep", "binary"]),
    (b"name: x\nmodel: \xff\xfe\n", ["--sweep", "UTF-8"]),
    (b"space: [1, 2\n", ["--sweep", "valid YAML", "line"]),
    (b"[" * 100_000, ["--sweep"]),
], ids=short)
def test_bad_sweep_file(tmp_path, content, names):
    from planner.search.sweep import load_sweep

    path = tmp_path / "s.yaml"
    path.write_bytes(content)
    with pytest.raises(PlannerError) as info:
        load_sweep(path)
    message = str(info.value)
    assert "\n" not in message and str(path) in message
    for name in names:
        assert name in message


# ---- probe records ------------------------------------------------------------------------------

GOOD_RECORD = {"request_id": "r1", "status": "ok", "model": "m", "config": {}, "summary": {"peak_allocated": 10},
               "estimate": {}, "phases": []}


@pytest.mark.parametrize("content, names", [
    (BINARY, ["probe record", "binary"]),
    (json.dumps({**GOOD_RECORD, "summary": "x"}).encode(), ["summary", "'x'"]),
    (json.dumps({**GOOD_RECORD, "phases": {"a": 1}}).encode(), ["phases"]),
    (json.dumps({**GOOD_RECORD, "summary": {"peak_allocated": "lots"}}).encode(), ["summary.peak_allocated"]),
    (json.dumps(GOOD_RECORD).encode()[:30], ["probe record", "valid JSON"]),
    (DEEP_JSON.encode(), ["probe record", "nested"]),
], ids=short)
def test_bad_probe_record(tmp_path, content, names):
    bad = tmp_path / "results" / "validation" / "bad.json"
    bad.parent.mkdir(parents=True)
    bad.write_bytes(content)
    code, _, err = invoke(["validate", "--probes", str(bad.parent)])
    assert_one_line_error(code, err, str(bad), *names)


def test_probe_record_with_nan_loss_reads_as_no_reading(tmp_path):
    from planner.probes.store import load_records

    path = tmp_path / "r.json"
    path.write_text('{"request_id": "r", "status": "ok", "summary": {"loss": NaN}, "phases": []}')
    [record] = load_records([path])
    assert record["summary"]["loss"] is None


# ---- prices cache and --json --------------------------------------------------------------------

@pytest.mark.parametrize("content, names", [
    (BINARY, ["prices cache", "binary"]),
    (b'{"prices": {"ml.p3.16xlarge": "cheap"}}', ["prices.ml.p3.16xlarge", "cheap"]),
    (b'{"prices": {"ml.p3.16xlarge": NaN}}', ["prices cache"]),
    (b'{"prices": {"ml.p3.16xlarge": Infinity}}', ["prices cache"]),
    (b'{"prices": {"ml.p3.16xlarge": -3}}', ["prices.ml.p3.16xlarge", "-3"]),
    (b'{"prices": {"ml.p3.16xlarge": 1e300}}', ["prices.ml.p3.16xlarge"]),
    (b'{"prices": [1]}', ["prices"]),
    (b'["prices"]', ["prices cache", "JSON object"]),
], ids=short)
@pytest.mark.parametrize("command", [["estimate", "--json"], ["prices", "--json"], ["instances", "--json"]])
def test_bad_prices_cache(tmp_path, content, names, command):
    path = tmp_path / "prices.json"
    path.write_bytes(content)
    code, out, err = invoke(command, env={"PLANNER_PRICES": str(path)})
    assert_one_line_error(code, err, *names)
    assert out == ""  # nothing half-printed, never bare NaN


def test_dumps_json_refuses_non_finite():
    from planner.io import dumps_json

    with pytest.raises(PlannerError):
        dumps_json({"x": math.nan})
    assert strict_json(dumps_json({"x": 1.5})) == {"x": 1.5}


# ---- places the tool writes ---------------------------------------------------------------------

def _blocked_folder(tmp_path: Path) -> Path:
    """A path whose parent is a regular file: unwritable for every user, root included."""
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("x")
    return blocker


@pytest.mark.parametrize("suffix", [".png", ".html"])
def test_plot_into_unwritable_place(tmp_path, suffix):
    target = _blocked_folder(tmp_path) / f"timeline{suffix}"
    code, _, err = invoke(["estimate", "--plot", str(target)])
    assert_one_line_error(code, err, "--plot", str(target))


def test_plot_leaves_nothing_half_written(tmp_path, monkeypatch):
    """A failure while drawing leaves neither the target nor a temporary file behind."""
    import planner.report.timeline_plot as tp

    def boom(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(tp, "timeline_png", boom)
    target = tmp_path / "plots" / "t.png"
    code, _, err = invoke(["estimate", "--plot", str(target)])
    assert_one_line_error(code, err, "--plot")
    assert not target.exists() and list(target.parent.iterdir()) == []


def test_atomic_write_keeps_the_old_file_on_failure(tmp_path):
    from planner.io import atomic_path, write_text

    path = write_text(tmp_path / "a.json", "old", "out")
    with pytest.raises(RuntimeError), atomic_path(path, "out") as tmp:
        tmp.write_text("half")
        raise RuntimeError("interrupted")
    assert path.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["a.json"]
    assert oct(path.stat().st_mode & 0o777) == oct(0o666 & ~_umask())


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_report_out_dir_unwritable(tmp_path):
    target = _blocked_folder(tmp_path) / "out"
    code, _, err = invoke(["report", "--study", "s", "--out-dir", str(target)])
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_probe_results_dir_unwritable(tmp_path):
    from planner.probes.store import write_json_atomic

    with pytest.raises(PlannerError) as info:
        write_json_atomic(_blocked_folder(tmp_path) / "probes" / "x.json", {"a": 1})
    assert "PLANNER_RESULTS_DIR" in str(info.value)  # the probe commands have no --results-dir flag


# ---- SageMaker request limits ------------------------------------------------------------------

@pytest.mark.parametrize("flag, value", [("--volume-gb", "0"), ("--volume-gb", "-3"), ("--volume-gb", "99999999"),
                                         ("--max-run-minutes", "0"), ("--max-run-minutes", "100000000")])
def test_launch_dry_run_refuses_what_sagemaker_refuses(flag, value):
    code, _, err = invoke(["probe", "launch", "--dry-run", "-m", "bert-base-uncased", "-i", "ml.g5.xlarge",
                           "-b", "2", "-s", "32", "--role", "arn:aws:iam::123456789012:role/x",
                           "--bucket", "s3://planner-test/p", flag, value])
    assert_one_line_error(code, err, flag, value)


def test_launch_dry_run_accepts_the_minimum_volume():
    code, out, err = invoke(["probe", "launch", "--dry-run", "--json", "-m", "bert-base-uncased",
                             "-i", "ml.g5.xlarge", "-b", "2", "-s", "32", "--role", "arn:aws:iam::123456789012:role/x",
                             "--bucket", "s3://planner-test/p", "--volume-gb", "1"])
    assert code == 0, err
    assert strict_json(out)["ResourceConfig"]["VolumeSizeInGB"] == 1


# ---- probe run --local ------------------------------------------------------------------------

def test_probe_run_without_torch_fails_on_one_line(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torch" else real(name, *a))
    code, _, err = invoke(["probe", "run", "-m", "bert-base-uncased", "-i", "ml.g5.xlarge", "-b", "1", "-s", "8"])
    assert_one_line_error(code, err, "torch", "pip install torch")


def test_probe_run_that_cannot_start_exits_2(tmp_path, monkeypatch):
    """A probe whose Python dies at import (as without torch) is a failed command, reason on the last line."""
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 'Traceback (most recent call last):' >&2\n"
                    "echo \"ModuleNotFoundError: No module named 'torch'\" >&2\nexit 1\n")
    fake.chmod(0o755)
    import planner.cli.probe_cmd as probe_cmd

    monkeypatch.setattr(probe_cmd.sys, "executable", str(fake))
    code, _, err = invoke(["probe", "run", "-m", "bert-base-uncased", "-i", "ml.g5.xlarge", "-b", "1", "-s", "8"])
    assert code == 2
    last = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(last) == 1 and "No module named 'torch'" in last[0] and "@launch" in last[0]


def test_unwritable_working_directory_results(tmp_path, monkeypatch):
    """`results/` cannot be made (a file holds its name, as a read-only working directory would refuse it):
    validate's CSV and calibrate's file fail on one line naming the flag; nothing is half-written."""
    from test_validate_probes import MIB, estimate, record

    from planner.probes.store import write_json_atomic

    folder = tmp_path / "probes-in"
    for i, ctx in enumerate((500 * MIB, 540 * MIB)):
        write_json_atomic(folder / f"r{i}.json", record(f"r{i}", context=ctx, est=estimate()))
    work = tmp_path / "work"
    work.mkdir()
    (work / "results").write_text("not a folder")
    monkeypatch.chdir(work)
    monkeypatch.delenv("PLANNER_RESULTS_DIR", raising=False)
    code, _, err = invoke(["validate", "--probes", str(folder), "--stored"])
    assert_one_line_error(code, err, "--csv", "results")
    code, _, err = invoke(["calibrate", "--probes", str(folder)])
    assert_one_line_error(code, err, "--out", "results")
    assert sorted(p.name for p in work.iterdir()) == ["results"]


@pytest.mark.parametrize("option", ["tab_in=100000000000000000000", "text_out=-1", "binary=nan"])
def test_absurd_model_options_answer_at_once(option):
    code, _, err = invoke(["estimate", "-o", option])
    assert_one_line_error(code, err, option.split("=")[0])


def test_largest_allowed_config_answers_with_an_oom_verdict(tmp_path):
    """Every size at its limit (2^24 wide, 1,024 layers): a bounded answer, OOM, in strict JSON."""
    from planner.models.hf_config import MAX_DIM, MAX_LAYERS

    path = tmp_path / "huge.json"
    path.write_text(json.dumps({**BERT, "vocab_size": MAX_DIM, "hidden_size": MAX_DIM, "num_attention_heads": 1,
                                "intermediate_size": MAX_DIM, "num_hidden_layers": MAX_LAYERS,
                                "max_position_embeddings": MAX_DIM}))
    code, out, err = invoke(["estimate", "-m", str(path), "-i", "ml.g5.xlarge", "-b", "1", "-s", "128", "--json"])
    assert code == 0, err
    assert strict_json(out)["verdict"] == "oom"


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(flag=st.sampled_from(["--volume-gb", "--max-run-minutes", "--max-wait-minutes", "--steps", "--warmup-steps",
                             "--instances", "--batch-size"]), value=HUGE_INTS)
def test_launch_numeric_flags(flag, value):
    extra = ["--spot"] if flag == "--max-wait-minutes" else []
    code, out, err = invoke(["probe", "launch", "--dry-run", "--json", "-m", "bert-base-uncased", "-i", "ml.g5.xlarge",
                             "-b", "2", "-s", "32", "--role", "arn:aws:iam::123456789012:role/x",
                             "--bucket", "s3://planner-test/p", *extra, flag, str(value)])
    if code == 0:
        req = strict_json(out)
        assert req["ResourceConfig"]["VolumeSizeInGB"] >= 1 and req["StoppingCondition"]["MaxRuntimeInSeconds"] >= 1
    else:
        assert_one_line_error(code, err, flag if flag != "--steps" else "steps")


@pytest.mark.parametrize("args, names", [
    (["estimate", "--batch-size", "inf"], ["--batch-size"]),
    (["estimate", "--seq-len", "nan"], ["--seq-len"]),
    (["estimate", "--bogus"], ["--bogus"]),
    (["probe", "launch", "--volume-gb", "-inf"], ["--volume-gb"]),
    (["report"], ["--study"]),
])
def test_unparsable_flags_are_one_line(args, names):
    """What click itself refuses (not a number, unknown flag, missing option) is one line too, not a usage box."""
    code, out, err = invoke(args)
    assert_one_line_error(code, err, *names)
    assert out == ""
