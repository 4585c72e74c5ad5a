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
