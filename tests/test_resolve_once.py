"""Issue 33 item 5, resolve once: the pipeline resolves a configuration once (planner.pipeline.resolve:
parallelism and attention after "auto", the world, the shares, the context record) and the interpreters read
what it resolved. Before, the memory model built its own context record (activations._ctx) and the speed
model two more (kernels.cuda_shapes at b = 1 and 2) from the TrainConfig; `auto` was resolved in three places
(tests/test_structure.py holds that line)."""

from __future__ import annotations

from dataclasses import replace

from planner.estimate import clear_caches, estimate
from planner.ir.context import Ctx
from planner.memory import activations
from planner.perf import kernels
from planner.spec import TrainConfig


def _count(monkeypatch, module, name) -> list[int]:
    calls = [0]
    original = getattr(module, name)

    def counted(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


def test_an_estimate_builds_its_context_record_once_in_resolve(monkeypatch):
    from planner.pipeline.resolve import context
    from planner.pipeline.step import _prepare

    clear_caches()
    from planner.perf import roofline

    roofline._TABLES.clear()  # scope "model": kept across estimates
    memory_side = _count(monkeypatch, activations, "_ctx")
    speed_side = _count(monkeypatch, kernels, "cuda_shapes")
    cfg = TrainConfig(batch_size=4, seq_len=128, precision="amp-bf16", parallelism="auto")
    est = estimate("bert-base-uncased", cfg, "ml.p4d.24xlarge")
    assert est.throughput is not None and est.memory_bytes.activations > 0
    assert (memory_side[0], speed_side[0]) == (0, 0)  # before: 1 and 2 (b = 1 and b = 2)

    prep = _prepare("bert-base-uncased", cfg, "ml.p4d.24xlarge", None, "cuda", None)
    assert prep.cfg.parallelism == "ddp" and prep.cfg.attention == "sdpa"
    assert prep.ctx == Ctx(4, 128, "amp-bf16", "sdpa", "cuda", True, True)
    assert prep.ctx == context(prep.spec, prep.cfg, prep.inst)


def test_the_interpreters_read_the_record_they_are_given():
    """The record decides, not the TrainConfig's or the GPU's own view: a CPU record gives the CPU's saved
    tensors whatever `backend` says; a record naming eager attention gives eager's kernels whatever the
    TrainConfig says."""
    from planner.hardware import get_instance
    from planner.models.catalog import cached_model
    from planner.perf.throughput import predict_throughput

    spec = cached_model("gpt2", {})
    cfg = TrainConfig(batch_size=2, seq_len=256, precision="amp-bf16", attention="sdpa", parallelism="single")
    cpu = Ctx(2, 256, "amp-bf16", "sdpa", "cpu", spec.inputs.attention_mask, True)
    given = activations.activation_blocks(spec, cfg, backend="cuda", ctx=cpu)
    assert given == activations.activation_blocks(spec, cfg, backend="cpu")
    assert given != activations.activation_blocks(spec, cfg, backend="cuda")
    a100 = get_instance("ml.p4d.24xlarge")
    assert predict_throughput(spec, cfg, a100, ctx=replace(cpu, backend="cuda")) == predict_throughput(spec, cfg, a100)
    eager = predict_throughput(spec, cfg, a100, ctx=replace(cpu, backend="cuda", attention="eager"))
    assert eager.breakdown_s["attention"] > predict_throughput(spec, cfg, a100).breakdown_s["attention"]
