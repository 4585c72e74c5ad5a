"""Issue 27: the inputs that still escaped (a held-out corpus of 125 bad inputs) and their neighbours. Each is
one line naming the flag, file or field, the value and what is allowed; exit 2; nothing left behind."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_bad_input import assert_one_line_error, invoke

ROOT = Path(__file__).resolve().parents[1]
SMALL_SEARCH = ["--instance", "ml.p3.2xlarge", "--batch-sizes", "4,8", "--parallelisms", "single",
                "--no-progress"]


def listing(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else b"" for p in sorted(folder.rglob("*"))}


# ---- calibration file ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("entry,field", [
    ({"fragmentation": "lots"}, "fragmentation"),
    ({"throughput_scale": "lots"}, "throughput_scale"),
    ({"throughput_scale": -1}, "throughput_scale"),
    ({"cuda_context_bytes": "big"}, "cuda_context_bytes"),
    ({"module_loading": "sometimes"}, "module_loading"),
    ({"context_range": ["a", 1]}, "context_range"),
    ({"fragmentation_range": [0.1]}, "fragmentation_range"),
])
@pytest.mark.parametrize("command", [["estimate"], ["explain"], ["search", "--trials", "2"]])
def test_calibration_field_that_is_not_what_it_holds_is_one_line(tmp_path, entry, field, command):
    import json

    cal = tmp_path / "calibration.json"
    cal.write_text(json.dumps({"families": {"V100": entry}}))
    before = listing(tmp_path)
    code, _, err = invoke([*command, *(["--results-dir", str(tmp_path / "r")] if command[0] == "search" else [])],
                          env={"PLANNER_CALIBRATION": str(cal)})
    assert_one_line_error(code, err, str(cal), "V100", field)
    assert listing(tmp_path) == before


# ---- one limit for every command ----------------------------------------------------------------------------

@pytest.mark.parametrize("command", [["estimate"], ["explain"]])
@pytest.mark.parametrize("flag,value", [("--grad-accum", "100000000000000000000"), ("--grad-accum", "65537"),
                                        ("--seq-len", "2147483648"),
                                        ("--dataset-size", "100000000000000000000")])
def test_limits_bind_estimate_and_explain_as_they_bind_search(command, flag, value):
    if command == ["explain"] and flag == "--dataset-size":
        pytest.skip("explain has no --dataset-size")
    code, _, err = invoke([*command, flag, value])
    assert_one_line_error(code, err, flag, value)


def test_the_limits_are_one_set_of_numbers():
    from planner import spec
    from planner.search import limits

    assert limits.MAX_GRAD_ACCUM == spec.MAX_GRAD_ACCUM == 2**16
    assert limits.MAX_DATASET_SIZE == spec.MAX_DATASET_SIZE
    assert spec.TrainConfig.model_fields["grad_accum"].metadata  # bounded in the model every command builds


def test_grad_accum_limit_follows_its_environment_variable():
    code = subprocess.run([sys.executable, "-m", "planner", "estimate", "--grad-accum", "100"], cwd=ROOT,
                          env={**os.environ, "PLANNER_MAX_GRAD_ACCUM": "64"}, capture_output=True, text=True)
    assert_one_line_error(code.returncode, code.stderr, "--grad-accum", "64")


# ---- storage ------------------------------------------------------------------------------------------------

def test_corrupt_sqlite_storage_leaves_no_lock_file(tmp_path):
    db = tmp_path / "bad.db"
    db.write_bytes(b"not a database, just words " * 10)
    before = listing(tmp_path)
    code, _, err = invoke(["search", *SMALL_SEARCH, "--trials", "2", "--storage", f"sqlite:///{db}",
                           "--results-dir", str(tmp_path / "r")])
    assert_one_line_error(code, err, "--storage", "bad.db")
    assert listing(tmp_path) == before


# A journal cut at its end is repaired (issue 37: tests/test_bad_input_37.py); one cut inside is refused.
@pytest.mark.parametrize("damage", ["cut-inside", "binary", "foreign"])
def test_damaged_journal_on_resume_is_one_line_and_left_as_it_was(tmp_path, damage):
    args = ["search", *SMALL_SEARCH, "--study", "j", "--results-dir", str(tmp_path)]
    code, _, err = invoke([*args, "--trials", "3"])
    assert code == 0, err
    journal = tmp_path / "j" / "journal.log"
    data = journal.read_bytes()
    journal.write_bytes({"cut-inside": data[: len(data) // 2] + b"\n" + data[len(data) // 2:], "binary": bytes(range(256)),
                         "foreign": b'{"op_code": 99}\n'}[damage])
    before = listing(tmp_path)
    code, _, err = invoke([*args, "--trials", "6"])
    assert_one_line_error(code, err, "journal", str(journal), "start the study afresh")
    assert listing(tmp_path) == before


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                    reason="a read-only mount needs root and unshare (root ignores chmod)")
def test_search_in_a_read_only_working_directory_stores_nothing_and_says_so(tmp_path):
    """A working directory on a read-only mount (as a person without write access meets it): exit 2 naming
    --results-dir, never exit 0 with nothing stored."""
    ro = tmp_path / "ro"
    ro.mkdir()
    script = (f"mount --bind {ro} {ro} && mount -o remount,bind,ro {ro} && cd {ro} && "
              f"PYTHONPATH={ROOT} {sys.executable} -m planner search --trials 2 --batch-sizes 4 "
              "--parallelisms single --instance ml.p3.2xlarge --no-progress")
    run = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True)
    if "mount" in run.stderr and run.returncode != 2:
        pytest.skip(f"no read-only mount here: {run.stderr.strip()}")
    assert_one_line_error(run.returncode, run.stderr, "--results-dir", "read-only")
    assert not any(ro.iterdir())


# ---- files and references -----------------------------------------------------------------------------------

@pytest.mark.parametrize("text,what", [("", "(empty)"), ("# only a comment\n", "(empty)"), ("- a\n- b\n", "(a list)"),
                                       ("just words\n", "(a single text value)")])
def test_sweep_file_that_is_not_a_mapping_says_what_it_is(tmp_path, text, what):
    sweep = tmp_path / "s.yaml"
    sweep.write_text(text)
    code, _, err = invoke(["search", "--sweep", str(sweep), "--results-dir", str(tmp_path / "r")])
    assert_one_line_error(code, err, str(sweep), what, "a YAML mapping")
    assert "NoneType" not in err and "(document)" not in err
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("command", [["estimate"], ["explain"], ["search", "--trials", "2"]])
@pytest.mark.parametrize("flag", ["--inputs", "--loss"])
def test_inputs_or_loss_with_a_catalog_model_is_refused(tmp_path, command, flag):
    extra = ["--results-dir", str(tmp_path / "r")] if command[0] == "search" else []
    code, _, err = invoke([*command, "-m", "gpt2", "-i", "ml.g5.xlarge", flag, "examples/multimodal_bert.py:batch",
                           *extra])
    assert_one_line_error(code, err, flag, "examples/multimodal_bert.py:batch", "FILE.py:build")
    assert not (tmp_path / "r").exists()


def test_seq_lens_errors_name_the_flag_typed(tmp_path):
    code, _, err = invoke(["search", "--seq-lens", "0", "--results-dir", str(tmp_path)])
    assert_one_line_error(code, err, "--seq-lens='0'")
    code, _, err = invoke(["search", "--seq-len", "0", "--results-dir", str(tmp_path)])
    assert_one_line_error(code, err, "--seq-len='0'")


@pytest.mark.parametrize("command", [["estimate"], ["search", "--trials", "1"]])
@pytest.mark.parametrize("ref", ["examples/multimodal_bert.py", "examples/multimodal_bert.py:1build"])
def test_model_reference_without_a_function_says_so(tmp_path, command, ref):
    extra = ["--results-dir", str(tmp_path / "r")] if command[0] == "search" else []
    code, _, err = invoke([*command, "--model", str(ROOT / ref), *extra])
    assert_one_line_error(code, err, "--model", "FILE.py:FUNCTION", ":build")
    assert "JSON" not in err


def test_own_model_says_up_front_all_it_needs(monkeypatch, tmp_path):
    """Without torch and transformers, one line naming both, before the user's file is imported."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("torch", "transformers") else real(name, *a))
    for command in (["estimate"], ["search", "--trials", "1", "--results-dir", str(tmp_path)]):
        code, _, err = invoke([*command, "--model", "examples/multimodal_bert.py:build", "--inputs",
                               "examples/multimodal_bert.py:batch"])
        assert_one_line_error(code, err, "--model", "torch and transformers are missing", "pip install transformers")


# ---- output a person reads ----------------------------------------------------------------------------------

def test_huge_batch_prints_short_figures_within_80_columns():
    code, out, err = invoke(["estimate", "-m", "gpt2", "-i", "ml.p3.2xlarge", "-b", "2000000000", "-s", "1024"],
                            env={"COLUMNS": "80"})
    assert code == 0, err
    import re

    assert all(len(line) <= 80 for line in out.splitlines())
    assert not re.search(r"\d{5,}(\.\d+)? [KMGTPEZY]iB", out), out  # no 323014536.50 GiB
    assert "EiB" in out and "global batch 2,000,000,000" in " ".join(out.split())


def test_no_internal_module_path_reaches_the_user():
    """What a person reads names no module or source file of the planner (planner.memory.runtime,
    planner/aws/images.py, jobs/requirements.txt)."""
    import re

    texts = []
    for args in (["estimate"], ["explain"], ["estimate", "--json"], ["explain", "--json"],
                 ["estimate", "-m", "gpt2", "-i", "ml.g4dn.xlarge", "-b", "2", "-s", "128"],
                 ["estimate", "--torch-version", "9.9"], ["search", "--help"], ["estimate", "--help"]):
        code, out, err = invoke(args)
        texts.append(out + err)
    found = [m for t in texts for m in re.findall(r"planner[./][a-z_]+[\w./]*|jobs/[\w.]+", t)]
    assert not found, found


def test_trials_are_bounded_on_the_flag_in_a_sweep_and_in_python(tmp_path):
    """Found beyond the issue's list: --trials 10^20 with TPE never ended (the budget is never reached)."""
    from planner.errors import PlannerError
    from planner.search.limits import MAX_TRIALS
    from planner.search.study import run_search

    code, _, err = invoke(["search", "--trials", str(10 * MAX_TRIALS), "--results-dir", str(tmp_path)])
    assert_one_line_error(code, err, "--trials")
    sweep = tmp_path / "s.yaml"
    sweep.write_text(f"search: {{trials: {10 * MAX_TRIALS}}}\n")
    code, _, err = invoke(["search", "--sweep", str(sweep), "--results-dir", str(tmp_path)])
    assert_one_line_error(code, err, "search.trials")
    with pytest.raises(PlannerError, match="--trials"):
        run_search(trials=10 * MAX_TRIALS, results_dir=tmp_path)
    assert not any(tmp_path.glob("*/journal.log"))


@pytest.mark.parametrize("storage", ["sqlite:///", "sqlite:///:memory:", "journal:", "sqlite:////tmp"])
def test_storage_that_would_keep_nothing_is_refused(tmp_path, storage):
    """Found beyond the issue's list: `sqlite:///` was a ValueError traceback, `:memory:` ran and kept nothing."""
    code, _, err = invoke(["search", *SMALL_SEARCH, "--trials", "1", "--storage", storage,
                           "--results-dir", str(tmp_path / "r")])
    assert_one_line_error(code, err, "--storage", "a file to keep the trials in")
    assert not (tmp_path / "r").exists()
