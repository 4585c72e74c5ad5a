"""Traces kept on disk (issue 38): a trace read back equals the trace made (and the estimate from it equals
the estimate with the disk cache off, JSON byte for byte); what changes a trace changes its key; a corrupt,
truncated or foreign file is traced again and rewritten, never an error or another answer."""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import pytest

from planner import caches
from planner.program import sources, trace_cache
from planner.spec import TrainConfig
from tests.test_trace import _tiny_configs


@pytest.fixture()
def cache_dir(tmp_path, monkeypatch):
    folder = tmp_path / "cache"
    monkeypatch.setenv("PLANNER_CACHE_DIR", str(folder))
    monkeypatch.delenv("PLANNER_TRACE_CACHE", raising=False)
    caches.clear()
    yield folder / "traces"
    caches.clear()


def _config_file(tmp_path: Path, arch: str = "T5ForConditionalGeneration", **change) -> str:
    path = tmp_path / f"{arch.lower()}.json"
    path.write_text(json.dumps({**_tiny_configs()[arch], **change}))
    return str(path)


def _trace(model: str, config: TrainConfig, **kw):
    caches.clear()  # a new process: nothing in memory
    return sources.model_trace(model, config, **kw)


def _files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.trace"))


def test_trace_read_back_equals_the_trace_made(cache_dir, tmp_path, monkeypatch):
    model = _config_file(tmp_path)
    config = TrainConfig(attention="sdpa", batch_size=3, seq_len=8, precision="amp-bf16")
    made = _trace(model, config)
    assert len(_files(cache_dir)) == 1  # one trace at batch 3 (issue 38)
    read = _trace(model, config)
    assert read == made and read.events == made.events and read.ops == made.ops
    with sources.many_batches():  # as a search: interpolated from batches 2 and 4, all three kept
        interpolated = _trace(model, config)
        assert len(_files(cache_dir)) == 4
        assert _trace(model, config) == interpolated
    monkeypatch.setenv("PLANNER_TRACE_CACHE", "0")
    assert _trace(model, config) == made  # and equals a trace that never saw the disk


def test_estimate_from_the_disk_equals_the_estimate_without_it(cache_dir, tmp_path, monkeypatch):
    from planner.estimate import estimate

    model = _config_file(tmp_path, "BartForConditionalGeneration")
    config = TrainConfig(attention="sdpa", batch_size=6, seq_len=16, checkpointing=True)
    monkeypatch.setenv("PLANNER_TRACE_CACHE", "0")
    caches.clear()
    reference = estimate(model, config, "ml.g5.xlarge").model_dump_json()
    assert not cache_dir.exists()
    monkeypatch.delenv("PLANNER_TRACE_CACHE")
    caches.clear()
    first = estimate(model, config, "ml.g5.xlarge").model_dump_json()
    caches.clear()
    second = estimate(model, config, "ml.g5.xlarge").model_dump_json()
    assert _files(cache_dir)
    assert first == reference and second == reference


def test_what_changes_a_trace_changes_its_key(cache_dir, tmp_path):
    model = _config_file(tmp_path)
    base = TrainConfig(attention="sdpa", batch_size=2, seq_len=8)
    keys = set()
    for m, cfg, opts in [(model, base, None), (model, base.model_copy(update={"precision": "bf16"}), None),
                         (model, base.model_copy(update={"checkpointing": True}), None),
                         (model, base.model_copy(update={"seq_len": 16}), None),
                         (model, base.model_copy(update={"attention": "eager"}), None),
                         (model, base.model_copy(update={"optimizer": "sgd"}), None),
                         (model, base.model_copy(update={"lora_r": 4, "lora_targets": ("q", "v")}), None),
                         (model, base, {"d_ff": 96}),
                         (_config_file(tmp_path / "..", d_model=48), base, None)]:
        kind_args = ("config", (m, json.dumps(opts or {}, sort_keys=True), "cuda", True))
        keys.add(trace_cache.key_of(sources._parts(*kind_args, cfg.model_dump_json())))
    assert len(keys) == 9
    # the config.json's contents, not only its path
    before = trace_cache.key_of(sources._parts("config", (model, "{}", "cuda", True), base.model_dump_json()))
    Path(model).write_text(json.dumps({**_tiny_configs()["T5ForConditionalGeneration"], "num_layers": 3}))
    after = trace_cache.key_of(sources._parts("config", (model, "{}", "cuda", True), base.model_dump_json()))
    assert before != after


@pytest.mark.parametrize("damage", ["truncate", "flip", "foreign", "empty"])
def test_a_damaged_file_is_traced_again_and_rewritten(cache_dir, tmp_path, damage):
    model = _config_file(tmp_path, "Qwen2ForCausalLM")
    config = TrainConfig(attention="sdpa", batch_size=2, seq_len=8)
    made = _trace(model, config)
    (path,) = _files(cache_dir)
    good = path.read_bytes()
    bad = {"truncate": good[: len(good) // 2], "flip": good[:-10] + bytes([good[-10] ^ 1]) + good[-9:],
           "foreign": b"not a trace at all", "empty": b""}[damage]
    path.write_bytes(bad)
    assert trace_cache.load(path.stem) is None
    assert _trace(model, config) == made
    assert path.read_bytes() == good  # rewritten
    assert not [p for p in cache_dir.iterdir() if p.suffix != ".trace"]  # no temporary file left


def test_an_unwritable_cache_folder_only_means_no_cache(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("PLANNER_CACHE_DIR", str(blocker))  # a file where the folder should be
    model = _config_file(tmp_path)
    assert _trace(model, TrainConfig(attention="sdpa", batch_size=2, seq_len=8)).ops


USER = textwrap.dedent("""
    import torch
    from torch import nn

    def build(width=8):
        return nn.Sequential(nn.Linear(4, width), nn.ReLU(), nn.Linear(width, 2))

    def batch(b, s):
        return (torch.randn(b, 4),)
""")


def test_user_code_edited_is_traced_again(cache_dir, tmp_path):
    folder = tmp_path / "user"
    folder.mkdir()
    code = folder / "net.py"
    code.write_text(USER)
    ref, inputs = f"{code}:build", f"{code}:batch"
    config = TrainConfig(attention="sdpa", batch_size=2, seq_len=8)
    first = _trace(ref, config, inputs=inputs)
    assert trace_cache.load(_files(cache_dir)[0].stem) == first
    code.write_text(USER.replace("width=8", "width=16"))  # same key, other code: the entry no longer holds
    assert trace_cache.load(_files(cache_dir)[0].stem) is None
    os.remove(code)
    assert trace_cache.load(_files(cache_dir)[0].stem) is None


def test_a_shape_class_that_cannot_be_traced_fails_again_without_tracing(cache_dir, tmp_path, monkeypatch):
    from planner.errors import PlannerError
    from planner.program import trace

    code = tmp_path / "bn.py"
    code.write_text(USER.replace("nn.ReLU()", "nn.BatchNorm1d(width)"))  # one sample: BatchNorm refuses
    calls = []
    original = trace.trace_step
    monkeypatch.setattr(trace, "trace_step", lambda *a, **k: calls.append(1) or original(*a, **k))
    config = TrainConfig(attention="sdpa", batch_size=1, seq_len=8)
    caches.clear()
    errors = []
    for _ in range(2):
        with pytest.raises(PlannerError) as exc:
            sources.model_trace(f"{code}:build", config, inputs=f"{code}:batch")
        errors.append(str(exc.value))
    assert len(calls) == 1 and errors[0] == errors[1] and "per channel" in errors[0]
    assert not cache_dir.exists() or not _files(cache_dir)  # a failure is not kept on disk
