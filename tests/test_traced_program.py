"""The traced front end's `program.blocks[]` (issue 33 item 2): the tracer's ops and saved storages lowered
to the program record (planner.program.lower), reported by the same code as a hand-modelled model's
(planner.pipeline.program_report.blocks_json).

On one GPU the blocks are the step memory's, by name and order; the `param_bytes` sum to
`memory_bytes.parameters`, the `saved_bytes` to `memory_bytes.activations` (also checked on BART-base's
config.json with and without checkpointing while writing this: exact both ways, 3,533 and 5,087 ops), and
every op has the record's keys. A user module's blocks are its top-level children (the root's own ops, such
as the relu between two children, are "(model)"), then the loss.
"""

from __future__ import annotations

import json
import textwrap

import pytest

pytest.importorskip("torch")

USER = textwrap.dedent("""
    import torch
    from torch import nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(8, 32)
            self.drop = nn.Dropout(0.1)
            self.b = nn.Linear(32, 32)
            self.c = nn.Linear(32, 2)
        def forward(self, x):
            return self.c(torch.tanh(self.b(self.drop(torch.relu(self.a(x))))))

    def build():
        return Net()
    def batch(b, s):
        return (torch.randn(b, 8),)
""")


@pytest.fixture()
def user(tmp_path):
    path = tmp_path / "user.py"
    path.write_text(USER)
    return str(path)


@pytest.mark.parametrize("precision", ["fp32", "amp-bf16"])
def test_traced_program_sums_to_the_memory_terms(user, precision):
    from typer.testing import CliRunner

    from planner.cli.main import app

    r = CliRunner().invoke(app, ["estimate", "--instance", "ml.g5.2xlarge", "-b", "64", "-s", "8", "--model",
                                 f"{user}:build", "--inputs", f"{user}:batch", "--precision", precision, "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    program = out["program"]
    assert program["front_end"] == "traced"
    names = [b["name"] for b in program["blocks"]]
    assert [n for n in names if n in "a drop b c".split()] == ["a", "drop", "b", "c"] and names[-1] == "loss"
    ops = [op for b in program["blocks"] for op in b["ops"]]
    keys = {"kind", "shapes", "params", "param_bytes", "saved_bytes", "transient_bytes", "flops", "bytes_moved",
            "launches"}
    assert ops and all(keys <= set(op) for op in ops) and {op["kind"] for op in ops} == {"aten"}
    assert sum(op["param_bytes"] for op in ops) == out["memory_bytes"]["parameters"]
    assert sum(op["saved_bytes"] for op in ops) == out["memory_bytes"]["activations"] > 0
    mm = [op for op in ops if op["name"] in ("aten.addmm.default", "aten.mm.default")]
    assert sum(op["flops"] for op in mm) == 3 * 2 * 64 * (8 * 32 + 32 * 32 + 32 * 2) - 2 * 64 * 8 * 32  # no dX for x
