"""Issue 37: bad input on the newer features (GPU readings, own modules, traced configs, sweeps, storage, a
full disk, a silent endpoint, stacks that cannot exist). Each is one line naming the input, the value and what
is allowed; exit 2; nothing left behind."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.test_bad_input import assert_one_line_error, invoke

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT / "results" / "validation" / "h200" / "shared-2026-11-26"


def listing(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else b"" for p in sorted(folder.rglob("*"))}


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PLANNER_CALIBRATION", str(tmp_path / "no-calibration.json"))
    monkeypatch.setenv("PLANNER_PRICES", str(tmp_path / "no-prices.json"))


# ---- validate --readings ------------------------------------------------------------------------------------

GOOD_ROW = json.loads(next(iter((SHARED / "steps.jsonl").read_text().splitlines())))
GOOD_ENV = (SHARED / "env.json").read_text()


def _row(**change: object) -> str:
    row = {**GOOD_ROW, **change}
    return json.dumps({k: v for k, v in row.items() if v is not ...})


def _peak_string() -> str:
    row = json.loads(_row())
    row["step1"]["forward"]["max_alloc"] = "1GB"
    return json.dumps(row)


STEPS = {
    "malformed": ("{not json", "valid JSON"),
    "binary": (bytes(range(256)) * 4, "binary"),
    "blank-line-then-bad": (_row() + "\n\n" + "{", "line 3"),
    "mixed": (_row() + "\n" + "[1, 2]", "a JSON object per line"),
    "row-a-list": ("[1, 2, 3]", "a JSON object per line"),
    "peak-a-string": (_peak_string(), "max_alloc"),
    "empty": ("", "at least one successful row"),
    "only-blank": ("\n\n", "at least one successful row"),
    "all-failed": (_row(status="oom") + "\n" + _row(status="error"), "at least one successful row"),
    "missing-keys": (json.dumps({"model": "bert-base-uncased", "status": "ok"}), "b="),
    "missing-step-time": (_row(step_time_s=...), "step_time_s"),
    "nan-step-time": (_row().replace(f'"step_time_s": {GOOD_ROW["step_time_s"]}', '"step_time_s": NaN'),
                      "NaN"),
    "zero-step-time": (_row(step_time_s=0), "step_time_s"),
    "negative-batch": (_row(b=-1), "b="),
    "batch-a-string": (_row(b="8"), "b="),
    "steps-a-list": (_row(step1=[1, 2]), "step1"),
}


@pytest.mark.parametrize("name", sorted(STEPS))
def test_bad_steps_jsonl_is_one_line(tmp_path, name):
    content, expected = STEPS[name]
    folder = tmp_path / "readings"
    folder.mkdir()
    (folder / "env.json").write_text(GOOD_ENV)
    (folder / "steps.jsonl").write_bytes(content if isinstance(content, bytes) else content.encode())
    before = listing(tmp_path)
    code, _, err = invoke(["validate", "--readings", str(folder)])
    assert_one_line_error(code, err, str(folder), expected)
    assert listing(tmp_path) == before


ENVS = {
    "missing": (None, "an existing file"),
    "malformed": ("{", "valid JSON"),
    "a-list": ("[]", "a JSON object"),
    "binary": (bytes(range(256)), "binary"),
    "no-gpu": ('{"torch": "2.4.0"}', "gpu"),
    "unknown-gpu": ('{"gpu": "Tesla K80"}', "Tesla K80"),
    "gpu-a-number": ('{"gpu": 7}', "gpu"),
}


@pytest.mark.parametrize("name", sorted(ENVS))
def test_bad_env_json_is_one_line(tmp_path, name):
    content, expected = ENVS[name]
    folder = tmp_path / "readings"
    folder.mkdir()
    (folder / "steps.jsonl").write_text(_row())
    if content is not None:
        (folder / "env.json").write_bytes(content if isinstance(content, bytes) else content.encode())
    code, _, err = invoke(["validate", "--readings", str(folder)])
    assert_one_line_error(code, err, "env.json", expected)


def test_a_good_folder_beside_a_bad_one_is_refused_before_anything_is_compared(tmp_path):
    good = tmp_path / "good"
    shutil.copytree(SHARED, good)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "env.json").write_text(GOOD_ENV)
    (bad / "steps.jsonl").write_text("{")
    code, out, err = invoke(["validate", "--readings", str(good), "--readings", str(bad)])
    assert_one_line_error(code, err, str(bad), "valid JSON")
    assert out == ""


# ---- traced config.json -------------------------------------------------------------------------------------

TRACED = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "num_hidden_layers": 2, "hidden_size": 64,
          "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 100}


@pytest.mark.parametrize("key,value", [("num_hidden_layers", 1_000_000), ("num_hidden_layers", 0),
                                       ("num_hidden_layers", -1), ("hidden_size", "big"), ("vocab_size", 0),
                                       ("num_attention_heads", 2.5), ("intermediate_size", True),
                                       ("vocab_size", 10**30)])
def test_traced_config_sizes_are_checked_before_anything_is_built(tmp_path, key, value):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**TRACED, key: value}))
    code, _, err = invoke(["estimate", "--model", str(path), "--instance", "ml.g5.xlarge"])
    assert_one_line_error(code, err, key, repr(value) if isinstance(value, str) else str(value))


def test_traced_config_transformers_refuses_is_one_line(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**TRACED, "num_attention_heads": 3}))  # 64 is not a multiple of 3 heads
    code, _, err = invoke(["estimate", "--model", str(path), "--instance", "ml.g5.xlarge"])
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


# ---- storage ------------------------------------------------------------------------------------------------

SMALL_SEARCH = ["search", "--instance", "ml.p3.2xlarge", "--batch-sizes", "4,8", "--parallelisms", "single",
                "--no-progress"]


@pytest.mark.parametrize("storage,expected", [("sqlite://", "sqlite:///PATH.db"), ("sqlite:///:memory:", "file"),
                                              ("journal:/dev/null", "regular file"),
                                              ("sqlite:////dev/null", "regular file")])
def test_storage_that_keeps_nothing_is_one_line(tmp_path, storage, expected):
    before = listing(tmp_path)
    code, _, err = invoke([*SMALL_SEARCH, "--trials", "2", "--results-dir", str(tmp_path / "r"),
                           "--storage", storage])
    assert_one_line_error(code, err, "--storage", storage, expected)
    assert listing(tmp_path) == before


@pytest.mark.parametrize("content", [b"garbage here\n", bytes(range(256)) * 4, b'{"op_code": 0}\n',
                                     b"[1, 2]\n", b"\xff\xfe\n", b'{"op_code": 0, "worker_id": "w"}\nnot json\n'])
def test_foreign_journal_is_refused_untouched_and_no_lock_files(tmp_path, content):
    journal = tmp_path / "mine.log"
    journal.write_bytes(content)
    before = listing(tmp_path)
    code, _, err = invoke([*SMALL_SEARCH, "--trials", "2", "--results-dir", str(tmp_path / "r"),
                           "--storage", str(journal)])
    assert_one_line_error(code, err, "journal", str(journal))
    assert listing(tmp_path) == before  # nothing appended, no .lock / .study-lock, no results folder


@pytest.mark.parametrize("storage", [None, "sqlite"])
def test_a_finished_search_leaves_no_lock_files(tmp_path, storage):
    extra = [] if storage is None else ["--storage", f"sqlite:///{tmp_path / 's.db'}"]
    code, _, err = invoke([*SMALL_SEARCH, "--trials", "2", "--study", "s", "--results-dir", str(tmp_path), *extra])
    assert code == 0, err
    assert not [p.name for p in tmp_path.rglob("*lock*")]


def _create_trials(journal: Path) -> list[bytes]:
    return [line for line in journal.read_bytes().splitlines() if json.loads(line)["op_code"] == 4]


def test_a_journal_cut_at_its_end_is_repaired_keeping_every_whole_record(tmp_path):
    args = [*SMALL_SEARCH, "--study", "j", "--results-dir", str(tmp_path)]
    assert invoke([*args, "--trials", "3"])[0] == 0
    journal = tmp_path / "j" / "journal.log"
    whole = journal.read_bytes()
    kept = _create_trials(journal)
    journal.write_bytes(whole + b'{"op_code":4,"worker_id":"x","study_id":0,"datetime_st')  # a cut record
    code, _, err = invoke([*args, "--trials", "5"])
    assert code == 0, err
    assert "cut short" in err and "every whole record kept" in err
    assert journal.read_bytes().startswith(whole) and _create_trials(journal)[: len(kept)] == kept
    assert len(_create_trials(journal)) == 5


FULL_DISK = """
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, as ENOSPC on a full disk
limit = int(sys.argv[1])
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
sys.argv = ["planner", *sys.argv[2:]]
from planner.cli.main import main
main()
"""


def test_a_study_whose_disk_filled_resumes_keeping_every_finished_trial(tmp_path):
    """The file-size limit (RLIMIT_FSIZE) stands in for a full disk: write(2) writes what fits, then fails,
    as it does with ENOSPC; no root or small filesystem needed."""
    import os
    import subprocess
    import sys

    args = [*SMALL_SEARCH, "--study", "j", "--results-dir", str(tmp_path)]
    assert invoke([*args, "--trials", "2"])[0] == 0
    journal = tmp_path / "j" / "journal.log"
    before = _create_trials(journal)
    record = max(len(r) for r in before) + 1
    limit = journal.stat().st_size + record + record // 2  # one more trial fits, the next is cut mid-record
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PLANNER_PRICES": os.environ["PLANNER_PRICES"],
           "PLANNER_CALIBRATION": os.environ["PLANNER_CALIBRATION"]}
    proc = subprocess.run([sys.executable, "-c", FULL_DISK, str(limit), *args, "--trials", "6"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    data = journal.read_bytes()
    assert data.endswith(b"\n") and len(data) <= limit  # whole records only: the failed write was cut back
    finished = _create_trials(journal)
    assert finished[: len(before)] == before and len(finished) == len(before) + 1
    code, _, err = invoke([*args, "--trials", "6"])  # space freed
    assert code == 0, err
    assert _create_trials(journal)[: len(finished)] == finished and len(_create_trials(journal)) == 6


def test_a_new_sqlite_study_on_a_full_disk_leaves_no_partial_database(tmp_path):
    import os
    import subprocess
    import sys

    db = tmp_path / "s.db"
    args = [*SMALL_SEARCH, "--study", "s", "--results-dir", str(tmp_path / "r"), "--storage", f"sqlite:///{db}",
            "--trials", "4"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", FULL_DISK, "40000", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []


# ---- a silent endpoint --------------------------------------------------------------------------------------

def test_prices_refresh_against_a_silent_endpoint_times_out_and_says_so(tmp_path, monkeypatch):
    """A server on 127.0.0.1 that accepts the connection and never answers: the refresh gives up after its
    timeouts (shortened here; 30 s at most with the shipped ones) with one line, and keeps the cache."""
    import socket
    import threading

    from planner.aws import pricing

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])  # accepted, never answered
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    monkeypatch.setattr(pricing, "PRICING_TIMEOUTS", {"connect_timeout": 1.0, "read_timeout": 1.0})
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{server.getsockname()[1]}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    try:
        code, _, err = invoke(["prices", "--refresh"])
    finally:
        stop.set()
        thread.join()
        for s in held:
            s.close()
        server.close()
    assert_one_line_error(code, err, "did not answer", "2 tries")
    assert not (tmp_path / "no-prices.json").exists()


def test_shipped_pricing_timeouts_bound_a_silent_endpoint_to_30_s():
    from planner.aws import pricing

    t = pricing.PRICING_TIMEOUTS
    assert pricing.PRICING_ATTEMPTS * (t["connect_timeout"] + t["read_timeout"]) <= 30


# ---- your own module ----------------------------------------------------------------------------------------

OWN = {
    "loop-in-build": ("def build():\n    while True:\n        pass\n", "build ran for 1 s"),
    "loop-at-import": ("while True:\n    pass\ndef build(): ...\n", "ran for 1 s"),
    "loop-that-catches-exceptions": ("def build():\n    while True:\n        try:\n            pass\n"
                                     "        except Exception:\n            pass\n", "build ran for 1 s"),
    "exit-3-in-build": ("import sys\ndef build():\n    sys.exit(3)\n", "sys.exit(3)"),
    "exit-0-at-import": ("import sys\nsys.exit(0)\ndef build(): ...\n", "sys.exit(0)"),
    "exit-none-in-build": ("import sys\ndef build():\n    sys.exit()\n", "sys.exit(None)"),
    "raises": ("def build():\n    raise ValueError('no such layer')\n", "no such layer"),
}
BATCH = "\nimport torch\ndef batch(b, s):\n    return {'x': torch.zeros(b, s)}\n"


@pytest.mark.parametrize("name", sorted(OWN))
@pytest.mark.parametrize("command", ["estimate", "search"])
def test_own_module_that_loops_exits_or_raises_is_one_line_and_leaves_nothing(tmp_path, monkeypatch, name, command):
    source, expected = OWN[name]
    path = tmp_path / f"own_{name.replace('-', '_')}.py"
    path.write_text(source + BATCH)
    monkeypatch.setenv("PLANNER_USER_CODE_TIMEOUT_S", "1")
    before = listing(tmp_path)
    extra = ["--trials", "3", "--no-progress", "--results-dir", str(tmp_path / "results")] if command == "search" else []
    code, _, err = invoke([command, "--model", f"{path}:build", "--inputs", f"{path}:batch",
                           "--instance", "ml.g5.xlarge", *extra])
    assert_one_line_error(code, err, "--model", str(path), expected)
    assert {k: v for k, v in listing(tmp_path).items() if "__pycache__" not in k} == before


def test_user_code_time_limit_variable_is_checked(tmp_path, monkeypatch):
    path = tmp_path / "own.py"
    path.write_text("def build(): ...\n" + BATCH)
    monkeypatch.setenv("PLANNER_USER_CODE_TIMEOUT_S", "nan")
    code, _, err = invoke(["estimate", "--model", f"{path}:build", "--inputs", f"{path}:batch"])
    assert_one_line_error(code, err, "PLANNER_USER_CODE_TIMEOUT_S", "nan")


# ---- non-finite LoRA values ---------------------------------------------------------------------------------

@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "-1", "0"])
@pytest.mark.parametrize("json_flag", [[], ["--json"]])
def test_lora_alpha_must_be_finite_and_positive(value, json_flag):
    code, out, err = invoke(["estimate", "--lora-r", "8", "--lora-alpha", value, *json_flag])
    assert_one_line_error(code, err, "--lora-alpha")
    assert "--json" not in err and out == ""


def test_probe_launch_dry_run_refuses_nan_alpha(tmp_path):
    code, _, err = invoke(["probe", "launch", "--model", "bert-base-uncased", "--instance", "ml.g5.xlarge",
                           "--batch-size", "8", "--dry-run", "--lora-r", "8", "--lora-alpha", "nan"])
    assert_one_line_error(code, err, "--lora-alpha", "nan")


# ---- sweeps: values checked before the study is created -------------------------------------------------------

SWEEP = "model: bert-base-uncased\ninstance: ml.g5.xlarge\nsearch: {trials: 3}\n"
SWEEPS = {
    "unknown-target": ('space: {lora_ranks: [8], lora_target_sets: ["nope_proj"]}\n', "nope_proj"),
    "one-bad-target-of-two": ('space: {lora_ranks: [8], lora_target_sets: ["query,value", "query,nope"]}\n',
                              "nope"),
    "targets-without-ranks": ('space: {lora_target_sets: ["query,value"]}\n', "lora_ranks"),
    "base-dtypes-without-ranks": ("space: {base_dtypes: [bf16]}\n", "lora_ranks"),
    "alpha-negative": ("space: {lora_ranks: [8]}\nfixed: {lora_alpha: -1}\n", "lora_alpha"),
    "alpha-nan": ("space: {lora_ranks: [8]}\nfixed: {lora_alpha: .nan}\n", "lora_alpha"),
    "alpha-inf": ("space: {lora_ranks: [8]}\nfixed: {lora_alpha: .inf}\n", "lora_alpha"),
    "rank-true": ("space: {lora_ranks: [true]}\n", "lora_ranks"),
    "batch-true": ("space: {batch_sizes: [true]}\n", "batch_sizes"),
    "checkpointing-1": ("space: {checkpointing: [1]}\n", "checkpointing"),
    "seq-too-long": ("recipe: {seq_len: 99999}\n", "seq_len"),
    "seq-float": ("recipe: {seq_len: 512.5}\n", "seq_len"),
    "dropout-nan": ("space: {lora_ranks: [8]}\nfixed: {lora_dropout: .nan}\n", "lora_dropout"),
}


@pytest.mark.parametrize("name", sorted(SWEEPS))
def test_bad_sweep_values_fail_before_the_study_is_created(tmp_path, name):
    body, expected = SWEEPS[name]
    path = tmp_path / "s.yaml"
    path.write_text(SWEEP + body)
    before = listing(tmp_path)
    code, _, err = invoke(["search", "--sweep", str(path), "--results-dir", str(tmp_path / "results"),
                           "--no-progress"])
    assert_one_line_error(code, err, expected)
    assert listing(tmp_path) == before


def test_search_seq_len_beyond_the_models_positions_leaves_nothing(tmp_path):
    code, _, err = invoke(["search", "--instance", "ml.g5.xlarge", "--seq-len", "99999999", "--trials", "3",
                           "--results-dir", str(tmp_path / "r"), "--no-progress"])
    assert_one_line_error(code, err, "--seq-len", "99999999", "positions")
    assert not (tmp_path / "r").exists()


def _bomb(levels: int) -> str:
    text = 'a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]\n'
    for i in range(1, levels):
        text += f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]\n"
    return text + f"model: *a{levels - 1}\n"


@pytest.mark.parametrize("levels", [6, 9])
def test_yaml_alias_bomb_is_one_short_line(tmp_path, levels):
    path = tmp_path / "bomb.yaml"
    path.write_text(_bomb(levels))
    code, _, err = invoke(["search", "--sweep", str(path), "--results-dir", str(tmp_path / "r"), "--no-progress"])
    assert_one_line_error(code, err, "--sweep", "aliases")
    assert len(err) < 400


def test_a_few_aliases_are_fine(tmp_path):
    from planner.io import read_yaml

    path = tmp_path / "ok.yaml"
    path.write_text("base: &b {trials: 3}\nsearch: *b\nother: *b\n")
    assert read_yaml(path, "--sweep")["other"] == {"trials": 3}


def test_error_lines_cut_huge_values():
    from planner.errors import PlannerError

    assert len(str(PlannerError("x", list(range(10**6)), "fewer"))) < 300
    assert len(str(PlannerError("x", "a" * 10**6, "shorter"))) < 300


# ---- things that cannot exist -------------------------------------------------------------------------------

@pytest.mark.parametrize("instance,stack,flag,value", [
    ("ml.p5.48xlarge", ["--torch-version", "1.8", "--cuda-version", "11.1"], "--cuda-version", "11.1"),
    ("ml.p5.48xlarge", ["--torch-version", "1.8"], "--torch-version", "1.8"),
    ("ml.p6-b200.48xlarge", ["--cuda-version", "12.1"], "--cuda-version", "12.1"),
    ("ml.g5.xlarge", ["--torch-version", "1.7", "--cuda-version", "11.0"], "--cuda-version", "11.0"),
])
def test_a_stack_with_no_kernels_for_the_gpu_is_refused(instance, stack, flag, value):
    code, _, err = invoke(["estimate", "--instance", instance, *stack])
    assert_one_line_error(code, err, flag, value, "compute capability")


def test_every_default_stack_has_kernels_for_its_gpu():
    """The data and the default stacks agree: no GPU's default is refused by the CUDA-arch rows."""
    from planner.hardware import get_instance, list_instances
    from planner.memory.stack import check_arch, default_stack

    for name in list_instances():
        gpu = get_instance(name).gpu
        check_arch(default_stack(gpu).cuda, gpu)


def test_a_stack_that_exists_still_passes():
    code, _, err = invoke(["estimate", "--instance", "ml.p5.48xlarge", "--torch-version", "2.1",
                           "--cuda-version", "11.8"])
    assert code == 0, err


@pytest.mark.parametrize("command", ["estimate", "explain"])
@pytest.mark.parametrize("flag,value", [("--padding", "exact"), ("--padding", "longest"), ("--run-seed", "3"),
                                        ("--run-steps", "5")])
def test_run_flags_without_lengths_are_refused_alike(command, flag, value):
    code, _, err = invoke([command, flag, value])
    assert_one_line_error(code, err, flag, value, "--lengths")


@pytest.mark.parametrize("body", ["recipe: {padding: exact}\n", "recipe: {run_seed: 4}\n", "recipe: {run_steps: 9}\n"])
def test_sweep_run_fields_without_lengths_are_refused(tmp_path, body):
    path = tmp_path / "s.yaml"
    path.write_text(SWEEP + body)
    before = listing(tmp_path)
    code, _, err = invoke(["search", "--sweep", str(path), "--results-dir", str(tmp_path / "r"), "--no-progress"])
    assert_one_line_error(code, err, "lengths")
    assert listing(tmp_path) == before


@pytest.mark.parametrize("device", ["tpu", "cuda:x", "gpu", "mps"])
def test_probe_run_device_is_checked_before_the_probe_starts(tmp_path, device):
    before = listing(tmp_path)
    code, _, err = invoke(["probe", "run", "--model", "bert-base-uncased", "--instance", "ml.g5.xlarge",
                           "--batch-size", "2", "--device", device])
    assert_one_line_error(code, err, "--device", device)
    assert listing(tmp_path) == before


# ---- explain --json is strict JSON on any configuration --------------------------------------------------------

PARALLELISMS = ["auto", "single", "dp", "ddp", "zero1", "zero2", "zero3", "fsdp"]


def explain_args(draw) -> list[str]:
    """One random `explain --json` configuration: a model, an instance of 1-8 GPUs, every parallelism, LoRA
    or QLoRA or none, a run of varying lengths or one step (shared with benchmarks/explain_json_property.py)."""
    from hypothesis import strategies as st

    model = draw(st.sampled_from(["bert-base-uncased", "gpt2", "distilbert-base-uncased", "llama-2-7b"]))
    positions = 4096 if model == "llama-2-7b" else 512
    seq = draw(st.sampled_from([s for s in (64, 128, 512, 1024, 4096) if s <= positions]))
    args = ["explain", "--json", "--model", model,
            "--instance", draw(st.sampled_from(["ml.g5.xlarge", "ml.g5.12xlarge", "ml.p4d.24xlarge",
                                                "ml.p3.16xlarge"])),
            "--parallelism", draw(st.sampled_from(PARALLELISMS)),
            "--batch-size", str(draw(st.sampled_from([1, 2, 8, 32]))), "--seq-len", str(seq),
            "--precision", draw(st.sampled_from(["fp32", "amp-fp16", "amp-bf16"]))]
    if draw(st.booleans()):
        args.append("--checkpointing")
    if draw(st.booleans()):
        args += ["--lora-r", str(draw(st.sampled_from([4, 8, 64]))),
                 "--lora-alpha", str(draw(st.sampled_from([1, 16, 32.5]))),
                 "--base-dtype", draw(st.sampled_from(["auto", "nf4", "bf16"]))]
    if draw(st.booleans()):
        low = draw(st.integers(1, seq))
        args += ["--lengths", f"uniform:{low}-{draw(st.integers(low, seq))}"]
    return args


def check_explain_json(args: list[str]) -> bool:
    """Exit 0 with strict JSON (no NaN / Infinity anywhere), or a bad combination refused in one line.
    Returns whether it explained."""
    from tests.test_bad_input import strict_json

    code, out, err = invoke(args)
    if code == 2:  # e.g. QLoRA under a 16-bit --precision, bf16 on a V100: refused, in one line
        assert_one_line_error(code, err)
        return False
    assert code == 0, err
    strict_json(out)
    return True


def test_explain_json_is_strict_on_random_configurations():
    """A few examples here (each explain takes seconds); benchmarks/explain_json_property.py runs 100."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    @settings(max_examples=10, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(st.data())
    def run(data):
        check_explain_json(explain_args(data.draw))

    run()
