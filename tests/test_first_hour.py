"""The first hour of a fine-tuning user (issue 31): every command takes the same job, agrees, and says where
its prices come from. Driven through the CLI as a user drives it."""

from __future__ import annotations

import json
import subprocess
import sys

from typer.testing import CliRunner

from planner.cli.main import app

runner = CliRunner()


def run(*args: str):
    return runner.invoke(app, list(args))


def test_explain_takes_lora_and_qlora():
    """explain crashed with any LoRA flag (figures were zipped to steps by position; the adapter step shifted
    them). Each step's numbers now belong to their step by name."""
    for extra in (["--lora-r", "16"], ["--lora-r", "16", "--base-dtype", "nf4", "--precision", "amp-bf16"]):
        r = run("explain", "--model", "llama-2-7b", "--instance", "ml.g5.2xlarge", "--batch-size", "1",
                "--seq-len", "512", *extra, "--json")
        assert r.exit_code == 0, r.output
        steps = json.loads(r.stdout)
        titles = [s["title"] for s in steps]
        adapters = steps[titles.index("Adapters on a frozen base (LoRA)")]
        assert adapters["figures"]["lora_r"] == 16 and adapters["figures"]["lora_targets"] == ["q_proj", "v_proj"]
        verdict = steps[-1]
        assert verdict["title"] == "Verdict" and "verdict" in verdict["figures"]
        assert steps[titles.index("Total by phase of one step")]["figures"]["peak_phase"]


def test_search_keeps_the_recipes_global_batch_on_one_gpu_of_four(tmp_path):
    """`single` on a 4-GPU instance trains on one GPU: accumulation makes up the recipe's global batch (it used
    to divide by all four GPUs and report global batch 4 for a recipe of 16); the price is the whole
    instance's, said so; prices name region, date and source."""
    r = run("search", "--model", "bert-base-uncased", "--instance", "ml.g5.12xlarge", "--parallelisms", "single",
            "--global-batch-size", "16", "--seq-len", "128", "--trials", "12", "--results-dir", str(tmp_path),
            "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    for row in [out["best"], *out["top"]]:
        assert row["global_batch_size"] == 16
        assert row["batch_size"] * row["grad_accum"] * row["world_size"] == 16
    [price] = out["prices"]
    assert price["region"] == "us-east-1" and price["date"] and price["source"] and price["stale"] is not None
    assert price["gpus"] == 4
    text = run("search", "--model", "bert-base-uncased", "--instance", "ml.g5.12xlarge", "--parallelisms",
               "single", "--global-batch-size", "16", "--seq-len", "128", "--trials", "12", "--results-dir",
               str(tmp_path / "b")).stdout
    assert "1 of 4 GPUs used" in text
    assert "price: us-east-1, dated " in text
    best = json.loads((next((tmp_path / "b").iterdir()) / "best.json").read_text())
    assert best["prices"][0]["date"] == price["date"]


# An example value for each estimate flag, as a user types it (the sweep gets the parsed value). A flag added
# to `estimate` that is a TrainConfig field needs none: its TrainConfig default is used.
EXAMPLES = {
    "model": "gpt2", "instance": "ml.g5.2xlarge", "batch_size": "4", "global_batch_size": "16", "seq_len": "256",
    "precision": "amp-bf16", "optimizer": "adamw", "optimizer_impl": "fused", "parallelism": "single",
    "checkpointing": True, "attention": "sdpa", "grad_accum": "2", "instances": "1", "model_option": None,
    "gradient_as_bucket_view": True, "cuda_context_mib": "500", "fragmentation": "0.1", "dataset_size": "1000",
    "spot": True, "region": "us-east-1", "tf32": True, "lora_r": "8", "lora_alpha": "16",
    "lora_targets": "c_attn", "lora_dropout": "0.05", "base_dtype": "bf16", "torch_version": "2.8",
    "cuda_version": None, "transformers_version": None, "alloc_conf": "expandable_segments:True",
    "plot": None, "json_out": None, "inputs": None, "loss": None, "lengths": "uniform:128-256",
    "padding": "longest", "run_steps": "4", "run_seed": "1", "framework": "torchtitan",
    "ds_config": None,  # a file: read when the search starts (test_search_reads_a_ds_config_file_when_it_starts)
}


def _options(command: str) -> set[str]:
    import typer.main

    cmd = typer.main.get_command(app).commands[command]
    return {o for p in cmd.params for o in (*p.opts, *p.secondary_opts)}


def test_every_estimate_flag_is_taken_by_explain_search_and_sweeps():
    """The table (planner.cli.job_flags) is walked: each estimate flag is an explain flag, a search flag (its own
    or derived), and has a sweep path that a sweep file accepts."""
    from planner.cli.job_flags import job_flags
    from planner.search.sweep import parse_sweep

    flags = job_flags()
    assert {f.name for f in flags} >= {"lora_r", "base_dtype", "lengths", "padding", "tf32", "fragmentation",
                                       "first_stage_layers", "last_stage_layers", "account_for_embedding",
                                       "account_for_loss", "pp_layout"}  # issue 35's uneven stages
    explain, search = _options("explain"), _options("search")
    for f in flags:
        assert f.search, f"{f.flag}: no place in the search or sweeps; add it to job_flags.PLACES"
        assert set(f.flags) <= explain, f.flag
        assert f.flag in search, f.flag
        if f.search == "output":
            continue
        section, _, key = f.sweep.partition(".")
        example = EXAMPLES.get(f.name, "default")
        if example == "default":  # a later TrainConfig field: its own default
            from planner.spec import TrainConfig

            example = TrainConfig.model_fields[f.name].default
        if example is None:
            continue
        value = example
        if section == "space":
            from planner.search.space import parse_flag_list

            value = list(parse_flag_list(key, str(example)))
        elif section != "stack" and isinstance(example, str) and example.replace(".", "").isdigit():
            value = float(example) if "." in example else int(example)
        doc = {"model": "gpt2", "instance": "ml.g5.2xlarge"}
        if key:
            doc[section] = {key: value}
        else:
            doc[section] = value
        if section == "recipe" and key in ("padding", "run_steps", "run_seed"):  # these need a run of lengths
            doc[section]["lengths"] = EXAMPLES["lengths"]
        sweep = parse_sweep(doc, "test")
        got = getattr(sweep, section)
        got = getattr(got, key) if key and not isinstance(got, dict) else (got[key] if key else got)
        assert got in (value, tuple(value) if isinstance(value, list) else value), (f.flag, got, value)


def test_search_takes_estimates_flags_as_a_fixed_value_or_a_list(tmp_path):
    """`search --lora-r 8,16 --base-dtype nf4 --lengths ... --tf32 --fragmentation 0.1`: each lands where a sweep
    would put it; one value is fixed, a list is explored; both spellings of a dimension is bad input."""
    from planner.cli.job_flags import sweep_updates
    from planner.cli.search_cmd import build_sweep

    space: dict = {"batch_sizes": None}
    held = sweep_updates({"lora_r": "8,16", "base_dtype": "nf4", "lengths": "uniform:128-256", "tf32": True,
                          "fragmentation": 0.1, "batch_size": "4", "lora_targets": "q_proj,v_proj;all-linear"},
                         space)
    sw = build_sweep(sweep_file=None, model="llama-2-7b", model_options=None, instance="ml.g5.2xlarge", nodes=None,
                     space=space, constraints={}, objective={}, search={}, held=held)
    assert sw.space.lora_ranks == (8, 16) and sw.space.base_dtypes == ("nf4",)
    assert sw.space.lora_target_sets == ("q_proj,v_proj", "all-linear") and sw.space.batch_sizes == (4,)
    assert sw.recipe.lengths == "uniform:128-256" and sw.fixed["tf32"] is True
    assert sw.estimate_kwargs()["runtime"] == {"fragmentation": 0.1}
    r = run("search", "--batch-size", "4", "--batch-sizes", "8", "--results-dir", str(tmp_path))
    assert r.exit_code == 2 and "--batch-size" in r.output and "not both" in r.output


def test_a_qlora_search_labels_its_columns_and_names_its_targets(tmp_path):
    r = run("search", "--model", "llama-2-7b", "--instance", "ml.g5.2xlarge", "--lora-r", "8",
            "--base-dtype", "nf4,bf16", "--precision", "amp-bf16", "--global-batch-size", "16", "--seq-len", "512",
            "--trials", "8", "--results-dir", str(tmp_path))
    assert r.exit_code == 0, r.output
    assert "base nf4" in r.stdout or "base bf16" in r.stdout
    assert "lora_r=8" in r.stdout
    assert not any(line.endswith(" ") for line in r.stdout.splitlines())
    best = json.loads((next(tmp_path.iterdir()) / "best.json").read_text())["best"]
    assert best["lora_targets"] == "q_proj,v_proj" and best["global_batch_size"] == 16


def test_the_report_says_what_the_search_did(tmp_path):
    """The header names the objective the search ran with (not None), prices have their provenance, the top
    table shows whole accumulation steps, $/job and the columns that tell rows apart, and log axes and the
    importance chart read as a person reads them."""
    import re

    from planner.report import figures as F

    r = run("search", "--model", "bert-base-uncased", "--instance", "ml.g5.2xlarge,ml.g5.12xlarge", "--seq-len",
            "128,256", "--trials", "24", "--study", "rep", "--results-dir", str(tmp_path))
    assert r.exit_code == 0, r.output
    r = run("report", "--study", "rep", "--results-dir", str(tmp_path))
    assert r.exit_code == 0, r.output
    page = (tmp_path / "rep" / "report.html").read_text()
    assert "objective <code>cost</code>" in page and "<code>None</code>" not in page
    assert "Price: us-east-1, dated " in page
    table = page[page.index("<table class='trials'>"):]
    table = table[:table.index("</table>")]
    for head in ("accum", "parallelism", "attention", "$/job"):
        assert f"<th>{head}</th>" in table
    assert "$/epoch" not in table and not re.search(r"<td>\d+\.00</td><td>\d+</td><td>\d+</td>", table)
    assert "batch_size_index" not in page
    assert F.param_label("batch_size_index") == "micro-batch"
    assert F.log_ticks(0.38, 3.9) == [0.5, 1.0, 2.0]
    assert F.oom_label_sides([16.0, 22.5, 24.0, 80.0]) == ["top", "top", "bottom", "top"]


def test_words_agree_with_the_code(tmp_path):
    """--help's trial budget is the code's; "did you mean" puts the name that begins as typed first; a module
    without --inputs fails at once (before torch loads); the DDP-bucket legend only where DDP buckets are."""
    import subprocess
    import sys

    from planner.search.study import default_trials

    help_text = " ".join(run("search", "--help").stdout.split())
    per = default_trials(3) - default_trials(2)
    assert f"default {default_trials(1)}, plus {per} per further instance type" in help_text
    r = run("estimate", "--model", "bert-large")
    assert r.exit_code == 2 and "did you mean bert-large-uncased," in r.output
    code = ("import sys; from typer.testing import CliRunner; from planner.cli.main import app; "
            "r = CliRunner().invoke(app, ['estimate', '--model', 'examples/custom_lm.py:build']); "
            "print(r.exit_code, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stdout.split()
    assert out == ["2", "False"]
    single = run("estimate", "--model", "gpt2", "--instance", "ml.g5.2xlarge", "--batch-size", "2").stdout
    ddp = run("estimate", "--model", "gpt2", "--instance", "ml.g5.12xlarge", "--batch-size", "2").stdout
    assert "DDP gradient buckets" not in single and "DDP gradient buckets" in ddp


def test_a_piped_search_prints_no_progress_and_groups_what_failed_alike(tmp_path):
    r = run("search", "--model", "bert-base-uncased", "--instance", "ml.p3.2xlarge,ml.p3.8xlarge,ml.g5.xlarge",
            "--precisions", "amp-bf16", "--seq-len", "128", "--trials", "12", "--results-dir", str(tmp_path))
    assert r.exit_code == 0, r.output
    assert "trials," not in r.stderr  # no "search ...: 5/12 trials, 5 s" lines into a pipe or a log
    text = " ".join(r.stdout.split())
    assert "nothing found on p3.2xlarge, p3.8xlarge: even the smallest start" in text
    assert text.count("nothing found") == 1


PTR_MODEL = '''
import torch


class M(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(100, 32)
        self.out = torch.nn.Linear(32, 100)
        self.same = self.emb.weight.data_ptr() == self.out.weight.data_ptr()  # as tied-weight checks do

    def forward(self, ids):
        return self.out(self.emb(ids)).sum()


def build():
    return M()


def batch(batch_size, seq_len):
    return {"ids": torch.randint(0, 100, (batch_size, seq_len))}
'''


def test_no_fake_tensor_warning_reaches_the_user(tmp_path):
    """A module that reads a data pointer while being built (transformers' tied-weight checks do) made torch
    warn "Accessing the data pointer of FakeTensor is deprecated" into the output; the tracer silences it."""
    import warnings

    path = tmp_path / "ptr_model.py"
    path.write_text(PTR_MODEL)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        r = run("estimate", "--model", f"{path}:build", "--inputs", f"{path}:batch", "--instance", "ml.g5.2xlarge",
                "--batch-size", "2", "--seq-len", "16")
    assert r.exit_code == 0, r.output
    assert not [w for w in caught if "data pointer" in str(w.message)]
    assert "data pointer" not in r.output


def test_a_sweeps_runtime_section_is_checked_naming_the_file():
    import pytest

    from planner.errors import PlannerError
    from planner.search.sweep import parse_sweep

    with pytest.raises(PlannerError) as exc:
        parse_sweep({"model": "gpt2", "instance": "ml.g5.2xlarge", "runtime": {"fragmentation": 99}}, "x.yaml")
    assert exc.value.field == "x.yaml: runtime"


def test_search_reads_a_ds_config_file_when_it_starts(tmp_path):
    """`search --ds-config FILE` is read before any trial: a file that does not parse is one line naming the flag,
    exit 2, and no study folder is left behind."""
    bad = tmp_path / "ds.json"
    bad.write_text("{not json")
    r = subprocess.run([sys.executable, "-m", "planner", "search", "--model", "gpt2", "--instance", "ml.g5.2xlarge",
                        "--framework", "deepspeed", "--ds-config", str(bad), "--trials", "2", "--no-progress"],
                       capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "--ds-config" in r.stderr and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "results").exists()
