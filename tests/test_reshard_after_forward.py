"""--reshard-after-forward / --no-reshard-after-forward (TrainConfig.reshard_after_forward): FSDP's per-job setting
over the framework's default, checked against real FSDP2 on CPU, through estimate, explain, search and the probe's
request, and refused outside FSDP."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from planner import estimate
from planner.cli.main import app
from planner.memory import framework_layout
from planner.spec import TrainConfig
from tests.module_files import load_module

ROOT = Path(__file__).resolve().parents[1]
N_LLAMA3_8B = 8_030_261_248
runner = CliRunner()


def _held_after_forward(reshard: bool) -> list[tuple[str, torch.dtype]]:
    """(type, dtype) of each unit's weight between the forward and the backward, under fully_shard with a bf16
    MixedPrecisionPolicy (torchtitan's): a sharded fp32 DTensor once resharded, a bf16 Parameter while held."""
    from torch import nn
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = nn.Sequential(*(nn.Linear(16, 16) for _ in range(3)))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model:
        fully_shard(layer, mp_policy=policy, reshard_after_forward=reshard)
    fully_shard(model, mp_policy=policy, reshard_after_forward=reshard)
    out = model(torch.randn(2, 16))
    held = [(type(layer.weight).__name__, layer.weight.dtype) for layer in model]
    out.float().sum().backward()
    assert all(type(layer.weight).__name__ == "DTensor" for layer in model)  # freed after each backward
    return held


def _peak(framework: str, reshard: bool | None, precision: str = "amp-bf16") -> int:
    cfg = TrainConfig(batch_size=1, seq_len=512, precision=precision, parallelism="fsdp", instances=8,
                      framework=framework, reshard_after_forward=reshard)
    return estimate("llama-3-8b", cfg, "ml.p4de.24xlarge").memory_bytes.peak_allocated


def test_fsdp2_holds_every_unit_in_16_bits_until_its_backward_only_without_reshard(one_rank):
    """Real FSDP2 (torch as installed, one gloo rank): with reshard_after_forward=True every unit is sharded
    again after its forward; with False each unit's bf16 copy is still held when the forward ends. The planner
    with --no-reshard-after-forward adds, over the default, every unit's bf16 parameters less the rank's own
    shard, less the window that resharding holds anyway (the LM head's unit and its prefetch, where the
    backward starts)."""
    assert _held_after_forward(True) == [("DTensor", torch.float32)] * 3
    assert _held_after_forward(False) == [("Parameter", torch.bfloat16)] * 3

    default, kept, resharded = _peak("torchtitan", None), _peak("torchtitan", False), _peak("torchtitan", True)
    assert default == resharded  # torchtitan's default policy without PP reshards
    held = 2 * N_LLAMA3_8B * 63 / 64
    head = 128_256 * 4_096
    assert held - 2 * 2 * head * 63 / 64 - 2**30 < kept - default <= held


def test_the_flag_overrides_nemo_automodels_default_both_ways():
    """NeMo AutoModel's parallelizer default is False (frameworks.py cites it); a recipe's `reshard_after_forward:
    true` is the flag's True, and lowers the peak by the held units."""
    assert _peak("nemo-automodel", None, "bf16") == _peak("nemo-automodel", False, "bf16")
    assert _peak("nemo-automodel", True, "bf16") < _peak("nemo-automodel", False, "bf16") - N_LLAMA3_8B


def test_fsdp1_shard_grad_op_holds_the_units_too():
    """Accelerate's FSDP1 with SHARD_GRAD_OP (--no-reshard-after-forward): the flat parameters stay unsharded in
    16 bits from the forward to the backward (torch/distributed/fsdp/_runtime_utils.py `_post_forward_reshard`
    reshards FULL_SHARD and HYBRID_SHARD only)."""
    cfg = TrainConfig(batch_size=1, seq_len=512, precision="amp-bf16", parallelism="fsdp", instances=8,
                      framework="accelerate", reshard_after_forward=False)
    assert not framework_layout.layout(cfg).reshard_after_forward
    assert _peak("accelerate", False) > _peak("accelerate", None) + N_LLAMA3_8B


@pytest.mark.parametrize("args", [("--parallelism", "ddp"), ("--parallelism", "zero3", "--framework", "deepspeed"),
                                  ("--parallelism", "zero3")])
def test_outside_fsdp_the_flag_is_one_line_and_exit_2(args):
    r = runner.invoke(app, ["estimate", "--model", "gpt2", "--instance", "ml.g5.12xlarge", "--batch-size", "1",
                            "--seq-len", "64", "--no-reshard-after-forward", *args])
    assert r.exit_code == 2, r.output
    lines = [line for line in r.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "--reshard-after-forward" in lines[0] and "fsdp or hsdp" in lines[0], r.output


def test_explain_and_the_probe_line_carry_the_flag():
    args = ["--model", "gpt2", "--instance", "ml.g5.12xlarge", "--batch-size", "1", "--seq-len", "64",
            "--parallelism", "fsdp", "--framework", "torchtitan", "--precision", "amp-bf16"]
    r = runner.invoke(app, ["explain", *args, "--no-reshard-after-forward", "--json"])
    assert r.exit_code == 0, r.output
    text = " ".join(line for step in json.loads(r.output) for line in step["lines"])
    assert "no reshard after forward" in text
    r = runner.invoke(app, ["explain", *args, "--json"])
    assert "no reshard after forward" not in r.output
    from planner.cli.estimate_cmd import probe_command

    cfg = TrainConfig(batch_size=1, seq_len=64, precision="amp-bf16", parallelism="fsdp", framework="torchtitan",
                      reshard_after_forward=False)
    line = probe_command(estimate("gpt2", cfg, "ml.g5.12xlarge"))
    assert "--no-reshard-after-forward" in line and "--framework torchtitan" in line


def test_search_holds_the_flag_for_every_trial(tmp_path):
    r = runner.invoke(app, ["search", "--model", "gpt2", "--instance", "ml.g5.12xlarge", "--parallelism", "fsdp",
                            "--framework", "torchtitan", "--precision", "amp-bf16", "--no-reshard-after-forward",
                            "--seq-len", "256", "--batch-sizes", "2,4", "--trials", "3", "--results-dir",
                            str(tmp_path)])
    assert r.exit_code == 0, r.output
    journal = next(tmp_path.glob("*/journal.log")).read_text()
    assert '"fixed":{"reshard_after_forward":false}' in journal
    trials = [json.loads(line) for line in journal.splitlines() if json.loads(line)["op_code"] == 4]
    assert trials and all(re.search(r'"reshard_after_forward":\s*false', json.dumps(t, separators=(",", ":")))
                          for t in trials)


def test_the_probe_job_wraps_as_the_request_says():
    """The request's config reaches the job: its plan and its DeviceMesh layout take the setting; without it,
    torchtitan's default policy (off under PP) and ZeRO-2's keep as before."""
    probe = load_module("planner_test_probe_reshard", ROOT / "jobs" / "probe.py")
    layout = load_module("parallel_layout", ROOT / "jobs" / "parallel_layout.py")
    base = {"batch_size": 2, "seq_len": 16, "parallelism": "fsdp"}
    req = {"config": base | {"reshard_after_forward": False}, "world_size": 2, "gpus_per_instance": 2}
    assert probe.make_plan(req).reshard_after_forward is False
    assert probe.make_plan({**req, "config": base}).reshard_after_forward is None
    assert layout.layout_of(base | {"tp": 2, "reshard_after_forward": False}, 4).reshard is False
    assert layout.layout_of(base | {"tp": 2, "reshard_after_forward": True, "pp": 2}, 8).reshard is True
    assert layout.layout_of(base | {"pp": 2}, 4).reshard is False
    assert layout.layout_of(base | {"tp": 2}, 4).reshard is True


def test_a_kept_unit_is_not_all_gathered_again_in_backward():
    """fully_shard's docstring: False "keeps the unsharded parameters in memory after forward and avoids the
    all-gather in backward": the kernel list drops the backward all-gather, and the step is no slower."""
    from planner.perf.kernels import communication_kernels

    with_ag = {k.collective for k in communication_kernels("fsdp", 16, 2**30, 1, 25.0, 32)}
    without = {k.collective for k in communication_kernels("fsdp", 16, 2**30, 1, 25.0, 32, gather_backward=False)}
    assert with_ag - without == {"fsdp_all_gather_backward"}
    cfg = dict(batch_size=1, seq_len=2048, precision="amp-bf16", parallelism="fsdp", instances=2, framework="torchtitan")
    kept = estimate("llama-3-8b", TrainConfig(**cfg, reshard_after_forward=False), "ml.p4d.24xlarge").throughput
    freed = estimate("llama-3-8b", TrainConfig(**cfg), "ml.p4d.24xlarge").throughput
    assert kept.tokens_per_s > freed.tokens_per_s
