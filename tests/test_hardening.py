"""Issue 11, the kinds test_bad_input.py does not reach: the numeric flags of `search` and `explain`
(hypothesis over NaN, +-inf, negatives, huge integers), numbers in sweep files, places `search` and
`report` write or read, a reader that leaves (`| head`) under `--json`, Ctrl-C while starting and while
searching, and explain's wording under DataParallel and per optimizer.

Read-only places are a path under a regular FILE (`blocker/x`): the tests run as root, for whom chmod does
not make a folder read-only.
"""

from __future__ import annotations

import io
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_bad_input import BAD_FLOATS, HUGE_INTS, assert_one_line_error, invoke, strict_json

REPO = Path(__file__).resolve().parents[1]
# A search space of one point, so an accepted value costs one estimate.
SMALL_SEARCH = ["search", "--instance", "ml.p3.2xlarge", "--batch-sizes", "8", "--seq-len", "128",
                "--precisions", "amp-fp16", "--checkpointing", "off", "--parallelisms", "single",
                "--optimizer-impls", "fused", "--trials", "1", "--no-progress", "--json"]


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    """A fresh working directory, as a new user has; no calibration or prices cache leaks in."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PLANNER_CALIBRATION", str(tmp_path / "no-calibration.json"))
    monkeypatch.setenv("PLANNER_PRICES", str(tmp_path / "no-prices.json"))


def _blocker(tmp_path: Path) -> Path:
    """A regular file: nothing can be created under it, root included."""
    path = tmp_path / "blocker"
    path.write_text("x")
    return path


def _files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


# ---- search: numeric flags ----------------------------------------------------------------------

SEARCH_INT_FLAGS = ["--seed", "--trials", "--top", "--global-batch-size", "--dataset-size", "--instances",
                    "--max-instances", "--min-seq-len"]
SEARCH_FLOAT_FLAGS = ["--epochs", "--max-memory-fraction", "--global-batch-tolerance"]
SEARCH_LIST_FLAGS = ["--batch-sizes", "--grad-accums", "--seq-len"]


def _search_answer(args: list[str], flag: str) -> None:
    """Either a strict-JSON answer, or one error line naming the flag (or the infeasible search)."""
    code, out, err = invoke([*SMALL_SEARCH, *args])
    if code == 0:
        data = strict_json(out)
        assert data["trials"] >= 1
        return
    assert code == 2, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), err
    name = flag.lstrip("-")
    assert name in lines[0] or name.replace("-", "_") in lines[0] or "no feasible configuration" in lines[0], err
    if out:
        strict_json(out)  # an infeasible search still prints valid JSON


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(flag=st.sampled_from(SEARCH_INT_FLAGS), value=HUGE_INTS)
def test_search_int_flags(flag, value, tmp_path):
    _search_answer([flag, str(value), "--results-dir", str(tmp_path / "r")], flag)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(flag=st.sampled_from(SEARCH_FLOAT_FLAGS), value=BAD_FLOATS)
def test_search_float_flags(flag, value, tmp_path):
    _search_answer([flag, repr(value), "--results-dir", str(tmp_path / "r")], flag)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(flag=st.sampled_from(SEARCH_LIST_FLAGS), value=st.one_of(HUGE_INTS, BAD_FLOATS))
def test_search_list_flags(flag, value, tmp_path):
    _search_answer([flag, f"8,{value!r}", "--results-dir", str(tmp_path / "r")], flag)


@pytest.mark.parametrize("flag, value", [("--seq-len", "inf"), ("--seed", "-1"), ("--seed", str(2**32)), ("--instances", str(10**20)),
                                         ("--max-instances", str(10**20)), ("--global-batch-size", str(10**23)),
                                         ("--epochs", "inf"), ("--epochs", "1e308"), ("--batch-sizes", str(10**20)),
                                         ("--grad-accums", str(10**20))])
def test_search_absurd_values_are_refused_before_any_trial(tmp_path, flag, value):
    """Formerly: ValueError (seed), OverflowError (int64 columns), MemoryError (a 10^20-long instance list),
    `Infinity` in --json (epochs)."""
    code, out, err = invoke([*SMALL_SEARCH, flag, value, "--results-dir", str(tmp_path / "r")])
    assert_one_line_error(code, err, flag)
    assert out == "" and not (tmp_path / "r").exists()


# ---- search: numbers in sweep files -------------------------------------------------------------

@pytest.mark.parametrize("body, names", [
    ("search: {seed: -4}", ["search.seed", "-4"]),
    ("search: {seed: 9999999999}", ["search.seed"]),
    ("recipe: {epochs: .inf}", ["recipe.epochs"]),
    ("recipe: {epochs: .nan}", ["recipe.epochs"]),
    ("recipe: {dataset_size: 100000000000000000000000}", ["recipe.dataset_size"]),
    ("recipe: {global_batch_size: 100000000000000000000000}", ["recipe.global_batch_size"]),
    ("space: {batch_sizes: [1, 100000000000000000000]}", ["space.batch_sizes"]),
    ("space: {instance_counts: [1, 100000000000000000000]}", ["space.instance_counts"]),
    ("space: {grad_accums: [1, 100000000000000000000]}", ["space.grad_accums"]),
])
def test_sweep_numbers(tmp_path, body, names):
    sweep = tmp_path / "s.yaml"
    sweep.write_text(f"name: s\n{body}\n")
    code, out, err = invoke(["search", "--sweep", str(sweep), "--results-dir", str(tmp_path / "r")])
    assert_one_line_error(code, err, str(sweep), *names)
    assert not (tmp_path / "r").exists()


# ---- search and report: places written and read -------------------------------------------------

def test_search_results_dir_under_a_file(tmp_path):
    target = _blocker(tmp_path) / "results"
    code, out, err = invoke([*SMALL_SEARCH, "--results-dir", str(target)])
    assert_one_line_error(code, err, "--results-dir", str(target), "not a folder")


def test_search_in_a_working_directory_where_results_cannot_be_made(tmp_path):
    """`results` is taken by a file (as a read-only working directory would refuse the folder)."""
    (tmp_path / "results").write_text("not a folder")
    code, out, err = invoke(SMALL_SEARCH)
    assert_one_line_error(code, err, "--results-dir", "results")
    assert _files(tmp_path) == ["results"]


def test_probe_run_where_results_cannot_be_made(tmp_path, monkeypatch):
    """The probe commands have no --results-dir flag: the error names $PLANNER_RESULTS_DIR instead."""
    monkeypatch.delenv("PLANNER_RESULTS_DIR", raising=False)
    (tmp_path / "results").write_text("not a folder")
    code, _, err = invoke(["probe", "run", "-m", "bert-base-uncased", "-i", "ml.g5.xlarge", "-b", "1", "-s", "8"])
    assert_one_line_error(code, err, "PLANNER_RESULTS_DIR", "results")
    assert _files(tmp_path) == ["results"]


def test_failed_searches_leave_no_study_files(tmp_path):
    """Every way a search fails before its first trial leaves the results folder as it was."""
    results = tmp_path / "r"
    fails = [["--model", "no-such-model"], ["--instance", "ml.no.such"], ["--storage", "sqlite:////nonexistent/d/x.db"],
             ["--storage", str(_blocker(tmp_path) / "j.log")], ["--torch-version", "0.1"], ["--study", "../x"],
             ["--objective", "fastest"], ["--precisions", "fp4"]]
    for args in fails:
        code, out, err = invoke([*SMALL_SEARCH, "--results-dir", str(results), *args])
        assert code == 2 and "Traceback" not in err, (args, err)
        assert not results.exists() or _files(results) == [], (args, _files(results))


@pytest.mark.parametrize("env, content, names", [
    ("PLANNER_PRICES", b'{"prices": {"ml.p3.2xlarge": NaN}}', ["prices cache", "NaN"]),
    ("PLANNER_PRICES", b'{"prices": {"ml.p3.2xlarge": "cheap"}}', ["prices.ml.p3.2xlarge", "cheap"]),
    ("PLANNER_CALIBRATION", b'{"families": {"V100": {"fragmentation": -1}}}', ["fragmentation", "-1"]),
    ("PLANNER_CALIBRATION", b'{"families": {"A100": {"cuda_context_bytes": "big"}}}', ["cuda_context_bytes"]),
])
def test_search_with_a_corrupt_cache_fails_before_any_trial(tmp_path, monkeypatch, env, content, names):
    """Formerly every trial was recorded as infeasible for the same bad file, and a study was left behind."""
    path = tmp_path / "cache.json"
    path.write_bytes(content)
    monkeypatch.setenv(env, str(path))
    results = tmp_path / "r"
    code, out, err = invoke([*SMALL_SEARCH, "--results-dir", str(results)])
    assert_one_line_error(code, err, str(path), *names)
    assert out == "" and (not results.exists() or _files(results) == [])


@pytest.mark.parametrize("env, content", [("PLANNER_PRICES", b'{"prices": {"ml.p3.2xlarge": NaN}}'),
                                          ("PLANNER_CALIBRATION", b'{"families": {"V100": {"fragmentation": -1}}}')])
def test_report_with_a_corrupt_cache_fails(tmp_path, monkeypatch, env, content):
    """Formerly the report was written with the breakdowns quietly left out."""
    path = tmp_path / "cache.json"
    path.write_bytes(content)
    monkeypatch.setenv(env, str(path))
    code, _, err = invoke(["report", "--study", "s", "--results-dir", str(tmp_path / "r")])
    assert_one_line_error(code, err, str(path))
    assert not (tmp_path / "r").exists()


def test_report_probes_named_but_missing(tmp_path):
    code, _, err = invoke(["report", "--study", "s", "--probes", str(tmp_path / "none.parquet")])
    assert_one_line_error(code, err, "--probes", "none.parquet")


# ---- config.json and probe flags ----------------------------------------------------------------

BERT = {"model_type": "bert", "architectures": ["BertForSequenceClassification"], "vocab_size": 30522,
        "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 128,
        "max_position_embeddings": 128}


@pytest.mark.parametrize("model_type", [["bert"], {"a": 1}, 5, None])
def test_config_model_type_of_the_wrong_type(tmp_path, model_type):
    import json

    path = tmp_path / "config.json"
    path.write_text(json.dumps({**BERT, "model_type": model_type}))
    code, _, err = invoke(["estimate", "-m", str(path), "-i", "ml.g5.xlarge", "-b", "1", "-s", "16"])
    assert_one_line_error(code, err, "model_type")


def test_config_with_a_byte_order_mark_is_read(tmp_path):
    """Windows editors save UTF-8 with a BOM; Python's json refuses it, `utf-8-sig` strips it."""
    import json

    plain, bom = tmp_path / "plain.json", tmp_path / "bom.json"
    plain.write_text(json.dumps(BERT))
    bom.write_bytes(b"\xef\xbb\xbf" + json.dumps(BERT).encode())
    answers = [invoke(["estimate", "--json", "-m", str(p), "-i", "ml.g5.xlarge", "-b", "1", "-s", "16"])
               for p in (plain, bom)]
    assert [a[0] for a in answers] == [0, 0]
    assert strict_json(answers[0][1])["memory_bytes"] == strict_json(answers[1][1])["memory_bytes"]


@pytest.mark.parametrize("model", ["custom.json", "mod.py:build"])
def test_traced_model_without_torch_is_one_line(tmp_path, monkeypatch, model):
    """A model outside the hand-modelled families is traced with PyTorch; without torch (simulated: None in
    sys.modules makes `import torch` raise ImportError) that is one line naming --model and the install."""
    import json

    (tmp_path / "custom.json").write_text(json.dumps({**BERT, "model_type": "some-new-arch"}))
    (tmp_path / "mod.py").write_text("def build():\n    return None\n")
    (tmp_path / "inp.py").write_text("def batch(b, s):\n    return {}\n")
    monkeypatch.setitem(sys.modules, "torch", None)
    inputs = ["--inputs", str(tmp_path / "inp.py:batch")] if model.endswith(":build") else []  # a config makes its own
    code, _, err = invoke(["estimate", "-m", str(tmp_path / model), *inputs,
                           "-i", "ml.g5.xlarge", "-b", "1", "-s", "16"])
    assert_one_line_error(code, err, "--model", "torch", "pip install torch")


def test_catalog_estimate_needs_no_torch(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)
    code, out, err = invoke(["estimate", "--json", "-m", "bert-base-uncased", "-i", "ml.g5.xlarge", "-b", "2"])
    assert code == 0, err
    assert strict_json(out)["parameters"]["total"] > 0


@pytest.mark.parametrize("command", [["probe", "run"], ["probe", "launch", "--dry-run", "--role",
                                                         "arn:aws:iam::123456789012:role/x", "--bucket", "s3://b-1/p"]])
def test_probe_steps_error_names_the_flag(command):
    code, _, err = invoke([*command, "-m", "bert-base-uncased", "-i", "ml.g5.xlarge", "-b", "1", "-s", "8",
                           "--steps", "-1"])
    assert_one_line_error(code, err, "--steps=-1")


# ---- explain: numeric flags ---------------------------------------------------------------------

@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(flag=st.sampled_from(["--batch-size", "--seq-len", "--instances", "--grad-accum", "--global-batch-size"]),
       value=HUGE_INTS)
def test_explain_int_flags(flag, value):
    args = ["explain", "--json", "-m", "gpt2", "-i", "ml.g5.xlarge", flag, str(value)]
    if flag != "--batch-size":
        args += [] if flag == "--global-batch-size" else ["-b", "2"]
    code, out, err = invoke(args)
    if code == 0:
        steps = strict_json(out)
        assert steps and all(s["title"] for s in steps)
    else:
        assert_one_line_error(code, err, flag)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(option=st.sampled_from(["n_layer", "n_embd", "n_head"]), value=st.one_of(HUGE_INTS, BAD_FLOATS))
def test_explain_model_options(option, value):
    code, out, err = invoke(["explain", "--json", "-m", "gpt2", "-i", "ml.g5.xlarge", "-b", "1", "-s", "64",
                             "-o", f"{option}={value!r}"])
    if code == 0:
        strict_json(out)
    else:
        assert_one_line_error(code, err, option)


# ---- a reader that leaves, and Ctrl-C -----------------------------------------------------------

def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}


@pytest.mark.parametrize("args", [["estimate", "--json"], ["models", "--json"], ["instances", "--json"]])
def test_json_into_a_closed_pipe_is_quiet(args):
    """`planner estimate --json | head -c 10`: the reader is gone; no 'error: Broken pipe', no traceback."""
    read, write = os.pipe()
    os.close(read)  # nobody will read: the first write fails with EPIPE
    try:
        proc = subprocess.run([sys.executable, "-m", "planner", *args], stdout=write, stderr=subprocess.PIPE,
                              env=_env(), timeout=120)
    finally:
        os.close(write)
    err = proc.stderr.decode()
    assert "Traceback" not in err and "error" not in err, err
    assert proc.returncode in (0, 1), err


STARTER = """
import builtins, os, signal, sys
real = builtins.__import__
def interrupting(name, *args, **kwargs):
    if name == "typer":  # the first import of typer: inside planner.cli.main, while the command starts
        builtins.__import__ = real
        os.kill(os.getpid(), signal.SIGINT)
    return real(name, *args, **kwargs)
builtins.__import__ = interrupting
sys.argv = [sys.argv[0], "models"]
from planner.cli.main import main
main()
"""


def test_ctrl_c_while_starting_is_one_line(tmp_path):
    """Ctrl-C before the command has finished importing: 'interrupted', exit 130, no import traceback."""
    script = tmp_path / "planner"  # the console script's name: the process is the command
    script.write_text(STARTER)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, env=_env(), timeout=120)
    err = proc.stderr.decode()
    assert proc.returncode == 130 and err.strip() == "interrupted", (proc.returncode, err)


def test_importing_planner_keeps_the_callers_ctrl_c():
    """A library user (or this test process) keeps Python's KeyboardInterrupt."""
    import planner  # noqa: F401
    from planner._startup import started_as_command

    assert signal.getsignal(signal.SIGINT) is not None
    assert signal.getsignal(signal.SIGINT).__name__ != "interrupted_while_starting"
    assert started_as_command(["/usr/local/bin/planner"]) and started_as_command(["-m"])
    assert not started_as_command(["/usr/local/bin/pytest"]) and not started_as_command([""])


def test_ctrl_c_while_estimating_is_one_line(monkeypatch):
    est_mod = sys.modules["planner.estimate"]  # the module; `planner.estimate` is the function

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(est_mod, "estimate", interrupted)
    code, out, err = invoke(["estimate"])
    assert code == 130 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_ctrl_c_inside_optunas_tell_is_an_interrupt(tmp_path, monkeypatch):
    """Ctrl-C while optuna records a trial (`_tell_with_warning`) surfaced as optuna 5.0's UnboundLocalError
    (`_run_trial`'s finally), exit 1 with a traceback, and the in-memory FAIL trial was saved to the study.
    Now: 'interrupted', exit 130, only finished trials in the journal."""
    import optuna
    from optuna.study import _optimize

    real, calls = _optimize._tell_with_warning, []

    def tell(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(_optimize, "_tell_with_warning", tell)
    code, out, err = invoke(["search", "--instance", "ml.p3.2xlarge", "--trials", "20", "--study", "t",
                             "--results-dir", str(tmp_path), "--no-progress"])
    assert code == 130 and "Traceback" not in err and len(err.strip().splitlines()) == 1, (code, err)
    assert err.strip().startswith("interrupted after 2 of 20 trials") and "run the same command again" in err, err
    import pandas as pd

    assert pd.read_csv(tmp_path / "t" / "trials.csv").shape[0] == 2  # the table of what was found so far
    from optuna.storages.journal import JournalFileBackend, JournalStorage

    storage = JournalStorage(JournalFileBackend(str(tmp_path / "t" / "journal.log")))
    trials = optuna.load_study(study_name="t", storage=storage).get_trials(deepcopy=False)
    assert len(trials) == 2 and all(t.state == optuna.trial.TrialState.COMPLETE for t in trials)


def test_ctrl_c_before_the_first_trial_leaves_nothing(tmp_path, monkeypatch):
    """Nothing finished: no table, no empty study folder, and the message says so."""
    from optuna.study import _optimize

    def tell(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(_optimize, "_tell_with_warning", tell)
    code, out, err = invoke(["search", "--instance", "ml.p3.2xlarge", "--trials", "20", "--study", "t",
                             "--results-dir", str(tmp_path / "results"), "--no-progress"])
    assert code == 130 and err.strip() == "interrupted before any trial finished; nothing was saved", err
    assert not (tmp_path / "results").exists()


def test_ctrl_c_in_a_trial_logs_no_traceback():
    """Optuna logs a trial stopped by KeyboardInterrupt with its traceback (optuna/study/_optimize.py
    `_run_trial`); the CLI's filter drops that and the 'failed' line after it, and keeps other warnings."""
    import optuna

    from planner.cli.common import quiet_interrupted_trials

    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    logger = logging.getLogger("optuna")
    logger.addHandler(handler)
    try:
        quiet_interrupted_trials()
        study = optuna.create_study()

        def objective(trial):
            if trial.number == 1:
                raise KeyboardInterrupt
            return trial.suggest_float("x", 0, 1)

        with pytest.raises(KeyboardInterrupt):
            study.optimize(objective, n_trials=3)
        assert len(study.trials) == 2
        logging.getLogger("optuna.study").warning("an ordinary warning")
    finally:
        logger.removeHandler(handler)
    text = stream.getvalue()
    assert "Traceback" not in text and "KeyboardInterrupt" not in text and "failed" not in text, text
    assert "an ordinary warning" in text


# ---- explain's words ----------------------------------------------------------------------------

def _explain(*args: str) -> dict[str, list[str]]:
    code, out, err = invoke(["explain", "--json", *args])
    assert code == 0, err
    return {s["title"]: s["lines"] for s in strict_json(out)}


def test_dataparallel_states_are_on_gpu_0_everywhere():
    """Step 3 says gradients and optimizer states live on GPU 0 only; step 7 must not say 'per GPU'."""
    steps = _explain("--parallelism", "dp")
    states = " ".join(steps["Gradients and optimizer states"])
    assert "GPU 0 only" in states and "per GPU" not in states
    storage = " ".join(next(v for k, v in steps.items() if k.startswith("How the model is stored")))
    assert "GPU 0" in storage


@pytest.mark.parametrize("optimizer, kwargs", [("sgd", {}), ("sgd-momentum", {"momentum": 0.9}), ("adamw", {}),
                                               ("adam", {})])
def test_optimizer_states_named_as_torch_names_them(optimizer, kwargs):
    """The states step 7 names are the ones torch.optim really keeps after a step (none for plain SGD)."""
    torch = pytest.importorskip("torch")
    p = torch.nn.Parameter(torch.ones(2, 2))
    cls = {"sgd": torch.optim.SGD, "sgd-momentum": torch.optim.SGD, "adamw": torch.optim.AdamW,
           "adam": torch.optim.Adam}[optimizer]
    opt = cls([p], lr=0.1, **kwargs)
    p.grad = torch.ones(2, 2)
    opt.step()
    names = {k for k, v in opt.state[p].items() if k != "step" and v is not None}
    text = " ".join(_explain("--optimizer", optimizer, "-b", "2")["Gradients and optimizer states"])
    if names:
        assert all(n in text for n in names), (names, text)
    else:
        assert "no state" in text and "exp_avg" not in text, text


def test_phase_activations_above_the_saved_ones_are_explained():
    """The phase table's activations include the model's outputs the training loop holds until the step
    ends (GPT-2's logits, b × s × vocab); the note beside the table names them with their size."""
    from planner.units import fmt_bytes

    args = ["-m", "gpt2", "-i", "ml.g5.xlarge", "-b", "8", "-s", "512"]
    data = strict_json(invoke(["estimate", "--json", *args])[1])
    held = {p["phase"]: p["detail"] for p in data["phases"]}["optimizer"]["activations"]
    assert held >= 8 * 512 * 50257 * 4 * 0.5  # at least the logits in 16 bits
    code, text, err = invoke(["estimate", *args])
    assert f"outputs ({fmt_bytes(held)}" in " ".join(text.split())
    steps = _explain(*args)
    assert f"outputs ({fmt_bytes(held)}" in " ".join(steps["Total by phase of one step"])
