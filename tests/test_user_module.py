"""`--model FILE.py:build --inputs FILE.py:batch` from the command line: the example, and each bad input as one
line with exit code 2."""

from __future__ import annotations

import json
import textwrap

import pytest
from typer.testing import CliRunner

from planner.cli.main import app

runner = CliRunner()

USER = textwrap.dedent("""
    import torch
    from torch import nn

    class Net(nn.Module):
        def __init__(self, width=16):
            super().__init__()
            self.a = nn.Linear(8, width)
            self.b = nn.Linear(width, 2)
        def forward(self, x):
            return self.b(torch.relu(self.a(x)))

    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(8, 8)
        def forward(self, x):
            h = self.a(x)
            return h[h > 0].sum()

    def build(width=16):
        return Net(width)
    def broken():
        raise ValueError("width must be even")
    def not_module():
        return 3
    def branchy():
        return Branchy()
    def batch(b, s):
        return (torch.randn(b, 8),)
    def bad_batch(b, s):
        return 7
""")


@pytest.fixture()
def user(tmp_path):
    path = tmp_path / "user.py"
    path.write_text(USER)
    return str(path)


def run(*args: str):
    return runner.invoke(app, ["estimate", "--instance", "ml.g5.2xlarge", "-b", "4", "-s", "8", *args])


def test_user_module_estimate_json(user):
    r = run("--model", f"{user}:build", "--inputs", f"{user}:batch", "-o", "width=32", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["parameters"] == {"a": 8 * 32 + 32, "b": 32 * 2 + 2, "total": 8 * 32 + 32 + 32 * 2 + 2}
    assert out["memory_bytes"]["activations"] > 0


@pytest.mark.parametrize(("args", "expect"), [
    (("--model", "{d}/missing.py:build", "--inputs", "{u}:batch"), "does not exist"),
    (("--model", "{u}:nope", "--inputs", "{u}:batch"), "no function 'nope'"),
    (("--model", "{u}:broken", "--inputs", "{u}:batch"), "ValueError: width must be even"),
    (("--model", "{u}:not_module", "--inputs", "{u}:batch"), "torch.nn.Module, got int"),
    (("--model", "{u}:build", "--inputs", "{u}:bad_batch"), "dict of tensors or a tuple, got int"),
    (("--model", "{u}:build"), "--inputs"),
    (("--model", "{u}:branchy", "--inputs", "{u}:batch"), "aten.nonzero.default cannot run on fake tensors in module '(root Branchy)'"),
])
def test_bad_user_input_is_one_line_exit_2(user, tmp_path, args, expect):
    r = run(*(a.format(u=user, d=tmp_path) for a in args))
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output
    assert expect in " ".join(r.output.split())


def test_config_with_unknown_model_type_is_one_line_exit_2(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "not-a-model", "architectures": ["NotAModel"]}))
    r = run("--model", str(path))
    assert r.exit_code == 2, r.output
    assert "model_type" in r.output and "not-a-model" in r.output and "Traceback" not in r.output


def test_config_outside_the_families_is_traced(tmp_path):
    from transformers import Qwen2Config

    cfg = Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=64).to_dict()
    cfg["architectures"] = ["Qwen2ForCausalLM"]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    r = run("--model", str(path), "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    from transformers import Qwen2ForCausalLM

    assert out["parameters"]["total"] == sum(p.numel() for p in Qwen2ForCausalLM(Qwen2Config(**cfg)).parameters())
    assert out["memory_bytes"]["activations"] > 0


def test_explain_a_user_module(user):
    r = runner.invoke(app, ["explain", "--instance", "ml.g5.2xlarge", "-b", "4", "-s", "8", "--model",
                            f"{user}:build", "--inputs", f"{user}:batch", "--json"])
    assert r.exit_code == 0, r.output
    steps = {s["title"]: s["lines"] for s in json.loads(r.stdout)}
    assert steps["Parameters of each component"][:2] == ["a: 144 parameters", "b: 34 parameters"]
    assert any("Largest saved tensors" in line for line in steps['The "computational graph": saved activations'])


def test_forward_error_is_one_line_and_options_reach_batch(tmp_path):
    path = tmp_path / "opts.py"
    path.write_text(textwrap.dedent("""
        import torch
        from torch import nn
        def build(width=8):
            return nn.Linear(width, 2)
        def batch(b, s, width=8):
            return (torch.randn(b, width),)
        def bad_batch(b, s):
            return (torch.randn(b, 3),)
    """))
    r = run("--model", f"{path}:build", "--inputs", f"{path}:batch", "-o", "width=16", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["parameters"]["total"] == 16 * 2 + 2
    r = run("--model", f"{path}:build", "--inputs", f"{path}:bad_batch")
    assert r.exit_code == 2 and "Traceback" not in r.output
    assert "the training step raised RuntimeError" in " ".join(r.output.split())


def test_search_over_a_user_module_traces_once_per_shape_class(user, tmp_path):
    """`planner search --model FILE.py:build --inputs FILE.py:batch`: trials are estimated through the tracer,
    whose cache keeps one trace per (micro-batch, sequence, precision, checkpointing, attention, optimizer)."""
    from planner.program import sources

    sources._user_trace.cache_clear()
    r = runner.invoke(app, ["search", "--model", f"{user}:build", "--inputs", f"{user}:batch", "--instance",
                            "ml.g5.2xlarge", "--trials", "12", "--batch-sizes", "2,4", "--seq-len", "8",
                            "--global-batch-size", "4", "--checkpointing", "off", "--precisions", "fp32,amp-bf16",
                            "--results-dir", str(tmp_path / "results"), "--json", "--no-progress"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout[r.stdout.index("{"):])
    best = out["best"] if "best" in out else out
    assert "samples_per_s" in json.dumps(best)
    info = sources._user_trace.cache_info()
    # 2 micro-batches x 2 precisions x 2 optimizer kernels (foreach, fused): at most 8 traces for 12 trials
    assert 0 < info.misses <= 8
    # the study's best trials become probe requests that carry the user's source (definition: inputs, loss)
    from planner.probes.spec import requests_from_study

    requests = requests_from_study(out["study"], 1, tmp_path / "results")
    assert requests[0].user_code is not None and requests[0].user_code["inputs"] == "user.py:batch"


def test_sweep_file_names_a_user_module_beside_it(user, tmp_path):
    from pathlib import Path

    from planner.search.sweep import load_sweep, sweep_model

    sweep = tmp_path / "mine.yaml"
    sweep.write_text(f"model: {Path(user).name}:build\ninputs: {Path(user).name}:batch\nmodel_options: {{width: 8}}\n"
                     "instance: ml.g5.2xlarge\n")
    loaded = load_sweep(sweep)
    assert loaded.model == f"{user}:build" and loaded.inputs == f"{user}:batch"
    assert sweep_model(loaded) == loaded.model
    assert loaded.estimate_kwargs()["model_options"] == {"width": 8}
    sweep.write_text(f"model: {Path(user).name}:build\ninstance: ml.g5.2xlarge\n")
    r = runner.invoke(app, ["search", "--sweep", str(sweep), "--results-dir", str(tmp_path / "r")])
    assert r.exit_code == 2 and "--inputs" in r.output and "Traceback" not in r.output
