"""The published MoE and FP8 runs of results/public/moe/ and fp8/ load, every row has its source, each row agrees
with itself where its source prints a derived figure, and nothing in the planner reads them (they are checks)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from planner.errors import PlannerError
from planner.probes.public_moe_fp8 import FILES, load_published
from planner.spec import TrainConfig

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("kind", ["fp8", "moe"])
def test_rows_parse_and_every_row_has_its_source(kind):
    rows = load_published(kind)
    assert len(rows) >= 5
    for r in rows:
        assert re.fullmatch(r"[0-9a-f]{40}", r.commit) and r.url.startswith("https://") and "/" in r.repo
        assert r.where and r.read_on.startswith("2026-")
        assert isinstance(r.train_config(), TrainConfig)  # every row is a configuration the planner reads
    readme = (ROOT / "results" / "public" / kind / "README.md").read_text()
    assert all(r.commit[:8] in readme for r in rows)  # the README names every source's commit


def test_printed_speedups_are_the_rows_own_ratio():
    """torchao's table prints each FP8 row's speed-up over its bf16 row: the row's tokens/s reproduce it."""
    rows = {r.id: r for r in load_published("fp8")}
    checked = 0
    for r in rows.values():
        m = re.search(r"([0-9.]+)% over baseline", r.where)
        if m:
            ratio = r.tokens_per_s_per_gpu / rows[r.baseline].tokens_per_s_per_gpu - 1
            assert ratio * 100 == pytest.approx(float(m.group(1)), abs=0.01), r.id
            checked += 1
    assert checked == 2


def test_megatron_bridge_micro_batches_give_the_global_batch():
    """GBS = micro-batch × micro-batches × data-parallel ranks (GPUs / (TP · PP)), for the printed layouts."""
    quoted = {"mb-2511-h100-qwen3-30b-fp8cs": 512, "mb-2511-h100-l3-8b-fp8cs": 128,
              "mb-2511-h100-gpt-oss-120b-bf16": 512, "mb-2511-h100-l3-70b-fp8cs": 128}
    rows = {r.id: r for kind in FILES for r in load_published(kind)}
    for rid, gbs in quoted.items():
        r = rows[rid]
        assert f"| {gbs} |" in r.where
        assert r.micro_batch * r.grad_accum * r.gpus // (r.tp * r.pp) == gbs, rid


def test_a_bad_row_is_one_line(tmp_path):
    src = (ROOT / "results" / "public" / "fp8" / "runs.csv").read_text().splitlines()
    (tmp_path / "fp8").mkdir()
    bad = src[0] + "\n" + src[2].replace(",tensorwise,", ",,", 1) + "\n"  # an fp8 row without its recipe
    (tmp_path / "fp8" / "runs.csv").write_text(bad)
    with pytest.raises(PlannerError, match="fp8_recipe"):
        load_published("fp8", tmp_path)


def test_nothing_in_the_planner_reads_these_rows():
    """Checks, never fitted: only the loader names the files, and only benchmarks and tests import it."""
    readers = [p for p in (ROOT / "planner").rglob("*.py")
               if "public_moe_fp8" in p.read_text() and p.name != "public_moe_fp8.py"]
    assert readers == []


def test_a_rows_recompute_modules_reach_the_planner():
    """Megatron-Bridge's gpt-oss-120b H100 preset recomputes `layernorm` and `moe_act` (its recipe, cited in the
    row); a selective row without modules under torchtitan is its per-op policy."""
    rows = {r.id: r for r in load_published("moe")}
    cfg = rows["mb-2511-h100-gpt-oss-120b-bf16"].train_config()
    assert (cfg.recompute, cfg.recompute_modules) == ("selective", ("layernorm", "moe_act"))
    assert "recompute_modules=['layernorm', 'moe_act']" in rows["mb-2511-h100-gpt-oss-120b-bf16"].where
    tt = [r for r in load_published("fp8") if r.framework == "torchtitan" and r.recompute == "selective"]
    assert tt and all(r.train_config().recompute_modules == ("op",) for r in tt)


def test_rows_take_their_recipes_framework_settings():
    """Megatron-Bridge's performance recipes set `cfg.ddp.grad_reduce_in_fp32 = False` (cited in each row): the
    rows reach the planner with bf16 main gradients; NeMo AutoModel's rows run under its own framework record."""
    rows = {r.id: r for r in load_published("moe")}
    for rid in ("mb-2511-h100-gpt-oss-120b-bf16", "mb-2511-h100-qwen3-30b-fp8cs"):
        assert rows[rid].train_config().grad_reduce_in_fp32 is False
        assert "cfg.ddp.grad_reduce_in_fp32 = False" in rows[rid].where
    nemo = [r for r in rows.values() if r.repo == "NVIDIA-NeMo/Automodel"]
    assert nemo and all(r.train_config().framework == "nemo-automodel" for r in nemo)
    assert all(r.train_config().grad_reduce_in_fp32 is None for r in nemo)


def test_rows_take_their_recipes_reshard_after_forward():
    """NeMo AutoModel's gpt-oss-120b row ran the recipe that sets `parallelizer.reshard_after_forward: true`
    (cited with its lines in the row); a blank is the framework's default (False for nemo-automodel), and the
    planner's estimate of the row holds fewer gathered units with True."""
    from planner.memory.framework_layout import reshard_after_forward

    rows = {r.id: r for r in load_published("moe")}
    oss = rows["nemo-am-gpt-oss-120b"]
    assert oss.reshard_after_forward is True and "reshard_after_forward: true" in oss.where
    assert reshard_after_forward(oss.train_config()) is True
    assert rows["nemo-am-dsv3-1024"].reshard_after_forward is False
    assert "reshard_after_forward: false" in rows["nemo-am-dsv3-1024"].where
    assert rows["nemo-am-qwen3-30b"].reshard_after_forward is None
    assert reshard_after_forward(rows["nemo-am-qwen3-30b"].train_config()) is False
    assert all(r.reshard_after_forward is None for r in load_published("fp8"))
