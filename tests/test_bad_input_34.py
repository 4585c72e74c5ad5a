"""Issue 34's bad input: degrees that do not divide, a schedule that does not match PP, --vp without PP, CP
with an attention kernel that has no CP, more stages than layers, and the recompute flags that contradict
--checkpointing. Each is one line naming the flag, the value and what is allowed; exit 2; nothing written."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.test_bad_input import assert_one_line_error, invoke


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PLANNER_CALIBRATION", str(tmp_path / "no-calibration.json"))
    monkeypatch.setenv("PLANNER_PRICES", str(tmp_path / "no-prices.json"))


QWEN = str(Path(__file__).parent / "data" / "qwen2-0.5b.json")  # a config.json outside the families: traced
BASE = ["--model", "llama-3-8b", "--instance", "ml.p5.48xlarge", "--batch-size", "1", "--seq-len", "1024",
        "--precision", "amp-bf16", "--plot", "timeline.html"]

CASES = {
    "tp-does-not-divide-world": (["--tp", "3"], "--tp/--cp/--pp", "divides the 8 GPUs"),
    "tp-does-not-divide-heads": (["--tp", "3", "--instances", "3"], "--tp", "32 attention heads"),
    "pp-does-not-divide-layers": (["--pp", "3", "--instances", "3"], "--pp/--vp", "32 layers"),
    "more-stages-than-layers": (["--pp", "8", "--vp", "8"], "--pp", "at most 32"),
    "vp-without-pp": (["--vp", "2"], "--vp", "--pp above 1"),
    "schedule-without-pp": (["--pp-schedule", "1f1b"], "--pp-schedule", "--pp above 1"),
    "interleaved-without-vp": (["--pp", "2", "--pp-schedule", "interleaved-1f1b"], "--pp-schedule", "--vp"),
    "gpipe-with-vp": (["--pp", "2", "--vp", "2", "--pp-schedule", "gpipe", "--grad-accum", "2"], "--pp-schedule",
                      "interleaved"),
    "interleaved-micro-batches": (["--pp", "2", "--vp", "2", "--grad-accum", "3"], "--grad-accum", "multiple of --pp"),
    "unknown-schedule": (["--pp", "2", "--pp-schedule", "dualpipe"], "--pp-schedule", "1f1b"),
    "cp-with-eager": (["--cp", "2", "--attention", "eager"], "--attention", "sdpa"),
    "cp-sequence-not-balanced": (["--cp", "4", "--seq-len", "1004"], "--seq-len", "tp × cp × 2"),
    "replicas-without-hsdp": (["--parallelism", "fsdp", "--dp-replicas", "2"], "--dp-replicas", "hsdp"),
    "replicas-do-not-divide": (["--parallelism", "hsdp", "--dp-replicas", "3"], "--dp-replicas", "divisor"),
    "sp-without-tp": (["--sp"], "--sp", "--tp above 1"),
    "recompute-against-checkpointing": (["--checkpointing", "--recompute", "selective"], "--recompute", "full"),
    "unknown-recompute": (["--recompute", "some"], "--recompute", "selective"),
    "modules-without-selective": (["--recompute-modules", "core_attn"], "--recompute-modules", "selective"),
    "tp-zero": (["--tp", "0"], "--tp", "positive"),
    "tp-on-dataparallel": (["--tp", "2", "--parallelism", "dp"], "--parallelism", "ddp"),
    "tp-with-lora": (["--tp", "2", "--lora-r", "8"], "--tp", "LoRA"),
    "lengths-with-pipeline": (["--pp", "2", "--lengths", "uniform:256-1024"], "--lengths", "data parallelism"),
    "tp-on-a-traced-config": (["--tp", "2", "--model", QWEN], "--tp", "one transformer"),
    "tp-on-a-multimodal-model": (["--tp", "2", "--model", "multimodal-bert", "--seq-len", "128"], "--tp", "one transformer"),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("command", ["estimate", "explain"])
def test_one_line_exit_2_nothing_written(case, command, tmp_path):
    args, flag, allowed = CASES[case]
    code, _, err = invoke([command, *BASE, *args])
    assert_one_line_error(code, err, flag, allowed)
    assert list(tmp_path.iterdir()) == []  # no timeline, nothing half-written
