"""jobs/probe.py on CPU with a tiny BERT: the result file, exact tensor bytes, failure modes, ranks."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from planner.spec import TrainConfig
from tests.module_files import load_module

ROOT = Path(__file__).resolve().parents[1]
torch.set_num_threads(1)  # tiny models: threads only add contention on a shared 2-core machine
SUBPROCESS_ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
TINY_BERT = {"model_type": "bert", "architectures": ["BertForSequenceClassification"], "vocab_size": 128,
             "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64,
             "max_position_embeddings": 64, "type_vocab_size": 2}


probe = load_module("planner_test_probe", ROOT / "jobs" / "probe.py")
modeling = load_module("modeling", ROOT / "jobs" / "modeling.py")


@pytest.fixture(scope="module")
def tiny_spec(tmp_path_factory):
    from planner.models.catalog import get_model

    path = tmp_path_factory.mktemp("cfg") / "tiny-bert.json"
    path.write_text(json.dumps(TINY_BERT))
    return get_model(str(path))


def request(spec, **cfg) -> dict:
    base = {"batch_size": 2, "seq_len": 16}
    base.update(cfg)
    extra = {k: base.pop(k) for k in ("gpus_per_instance", "world_size") if k in base}
    return {"request_id": "t", "model": spec.model_dump(mode="json"),
            "config": TrainConfig(**base).model_dump(mode="json"), "warmup_steps": 1, "measure_steps": 1, **extra}


def hf_reference_parameter_bytes() -> int:
    """The same architecture built straight from transformers, independently of modeling.py."""
    from transformers import BertConfig, BertForSequenceClassification

    cfg = {k: v for k, v in TINY_BERT.items() if k not in ("model_type", "architectures")}
    model = BertForSequenceClassification(BertConfig(**cfg))
    return sum(p.numel() * 4 for p in model.parameters())


def test_probe_subprocess_writes_a_valid_result(tiny_spec, tmp_path):
    from planner.aws.launch import metric_definitions
    from planner.probes.spec import make_request

    req = make_request(tiny_spec, TrainConfig(batch_size=2, seq_len=16), "ml.g5.xlarge", warmup_steps=1,
                       measure_steps=1)
    (tmp_path / "req.json").write_text(json.dumps(req.to_json()))
    out = tmp_path / "out.json"
    proc = subprocess.run([sys.executable, str(ROOT / "jobs" / "probe.py"), "--request", str(tmp_path / "req.json"),
                           "--out", str(out), "--device", "cpu", "--batch_size", "2"],  # SageMaker-style extras
                          capture_output=True, text=True, timeout=120, env=SUBPROCESS_ENV)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["status"] == "ok" and result["device"] == "cpu"
    assert result["request_id"] == req.request_id
    params = hf_reference_parameter_bytes()
    t = result["tensors"]
    assert t["parameters_bytes"] == params
    assert t["gradients_bytes"] == params  # fp32 gradients, one per parameter
    # AdamW: exp_avg + exp_avg_sq in fp32 per parameter, plus one fp32 `step` scalar per parameter tensor.
    n_tensors = len(list(modeling.build_model(tiny_spec.model_dump(mode="json"), device="meta").parameters()))
    assert t["optimizer_state_bytes"] == 2 * params + 4 * n_tensors
    assert t["saved_tensor_bytes"] > 0
    assert {r["phase"] for r in result["phases"]} == {"load", "forward", "backward", "optimizer"}
    assert result["optimizer_states_from_step"] == 0
    s = result["summary"]
    assert s["samples_per_s"] == pytest.approx(2 / s["step_time_s"])
    assert s["tokens_per_s"] == pytest.approx(s["samples_per_s"] * 16)
    assert s["peak_rss_bytes"] > 0
    # Every metric line the probe prints is scraped by one of launch.py's MetricDefinitions.
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("probe_") and "status" not in ln]
    regexes = [re.compile(m["Regex"]) for m in metric_definitions()]
    assert lines and all(any(rx.search(ln) for rx in regexes) for ln in lines)
    assert any(rx.search(f"probe_samples_per_s={s['samples_per_s']:.6g};") for rx in regexes)


def test_metric_names_match_between_probe_and_launch():
    from planner.aws import launch

    assert tuple(launch.METRIC_NAMES) == tuple(probe.METRIC_NAMES)


def test_checkpointing_and_kernels_change_what_is_saved(tiny_spec):
    plain = probe.run_probe(request(tiny_spec, attention="eager"), modeling=modeling, device="cpu")
    ckpt = probe.run_probe(request(tiny_spec, attention="eager", checkpointing=True), modeling=modeling, device="cpu")
    assert plain["status"] == ckpt["status"] == "ok"
    assert ckpt["applied"]["checkpointing"]  # applied on the transformers model
    assert ckpt["tensors"]["saved_tensor_bytes"] < plain["tensors"]["saved_tensor_bytes"]
    # (Saved bytes of eager vs SDPA are not compared: with attention dropout, CPU SDPA runs the math kernel.)
    assert plain["applied"]["attention"] == "eager"  # the kernel the transformers model reports


def test_precisions_accumulation_and_optimizers(tiny_spec):
    bf16 = probe.run_probe(request(tiny_spec, precision="bf16", optimizer="sgd-momentum"), modeling=modeling,
                           device="cpu")
    amp = probe.run_probe(request(tiny_spec, precision="amp-fp16", grad_accum=2, optimizer="adafactor"),
                          modeling=modeling, device="cpu")
    assert bf16["status"] == amp["status"] == "ok", (bf16.get("message"), amp.get("message"))
    assert bf16["tensors"]["parameters_bytes"] * 2 == hf_reference_parameter_bytes()
    assert amp["tensors"]["parameters_bytes"] == hf_reference_parameter_bytes()  # AMP keeps fp32 weights
    assert bf16["applied"]["model_dtype"] == "bfloat16"
    assert bf16["tensors"]["optimizer_state_bytes"] == bf16["tensors"]["parameters_bytes"]  # one momentum buffer
    assert amp["applied"]["grad_scaler"] is True and amp["applied"]["autocast"] == "float16"
    assert amp["applied"]["optimizer"] == "Adafactor"
    forwards = [r for r in amp["phases"] if r["phase"] == "forward"]
    assert len(forwards) == 2 * 2  # 2 steps x 2 micro-steps
    assert amp["summary"]["global_batch_size"] == 4


class _OOMModeling:
    """modeling.py stand-in whose loss raises CUDA OOM in the given phase."""

    def __init__(self, phase: str):
        self.phase = phase

    build_model = staticmethod(modeling.build_model)
    make_batch = staticmethod(modeling.make_batch)

    def loss_of(self, model, batch):
        if self.phase == "forward":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        loss = modeling.loss_of(model, batch)

        class Boom(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                return x.clone()

            @staticmethod
            def backward(ctx, g):
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")

        return Boom.apply(loss)


@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_oom_is_a_result_with_its_phase(tiny_spec, phase):
    result = probe.run_probe(request(tiny_spec), modeling=_OOMModeling(phase), device="cpu")
    assert result["status"] == "oom"
    assert result["phase"] == phase
    assert "out of memory" in result["message"]
    assert result["summary"]["oom"] == 1
    assert "probe_oom=1;" in probe.metric_lines(result)


def test_unsupported_configurations_are_reported(tiny_spec):
    fsdp = probe.run_probe(request(tiny_spec, parallelism="fsdp"), modeling=modeling, device="cpu")
    assert fsdp["status"] == "unsupported" and "world size 1" in fsdp["message"]
    flash = probe.run_probe(request(tiny_spec, attention="flash"), modeling=modeling, device="cpu")
    if importlib.util.find_spec("flash_attn") is None:
        assert flash["status"] == "unsupported" and "flash_attn" in flash["message"]
    if importlib.util.find_spec("bitsandbytes") is None:
        bnb = probe.run_probe(request(tiny_spec, optimizer="adamw-8bit"), modeling=modeling, device="cpu")
        assert bnb["status"] == "unsupported" and "bitsandbytes" in bnb["message"]


def test_merge_ranks_keeps_the_worst_status():
    ok = {"rank": 0, "status": "ok", "summary": {"peak_allocated": 10}, "phase": None}
    oom = {"rank": 1, "status": "oom", "summary": {"peak_allocated": 30}, "phase": "backward", "message": "x"}
    merged = probe.merge_ranks([oom, ok])
    assert merged["status"] == "oom" and merged["phase"] == "backward"
    assert [r["rank"] for r in merged["ranks"]] == [0, 1]
    assert merged["summary"]["max_rank_peak_allocated"] == 30


def test_launcher_merges_rank_files(tiny_spec, tmp_path, monkeypatch):
    """The torchrun launcher path without torchrun: each 'rank' writes its file, the launcher merges them."""
    req = request(tiny_spec, parallelism="ddp", gpus_per_instance=2, world_size=2)
    out = tmp_path / "out.json"
    seen = {}

    def fake_call(cmd):
        seen["cmd"] = cmd
        for rank, status in ((0, "ok"), (1, "oom")):
            (tmp_path / f"out.json.rank{rank}").write_text(json.dumps(
                {"rank": rank, "status": status, "phase": None if status == "ok" else "forward",
                 "summary": {"peak_allocated": 5 + rank}, "message": "CUDA out of memory"}))
        return 3

    monkeypatch.setattr(probe.subprocess, "call", fake_call)
    merged = probe.launch_distributed(json.dumps(req), req, out, device="cpu")
    assert "--nproc_per_node=2" in seen["cmd"] and "--rank-output" in seen["cmd"]
    assert merged["status"] == "oom" and merged["torchrun_exit_code"] == 3
    assert not list(tmp_path.glob("out.json.rank*"))


def test_ddp_two_cpu_processes_under_torchrun(tiny_spec, tmp_path):
    req = request(tiny_spec, parallelism="ddp", gpus_per_instance=2, world_size=2)
    (tmp_path / "req.json").write_text(json.dumps(req))
    out = tmp_path / "out.json"
    env = {**SUBPROCESS_ENV, "PLANNER_MASTER_PORT": "29517"}
    proc = subprocess.run([sys.executable, str(ROOT / "jobs" / "probe.py"), "--request", str(tmp_path / "req.json"),
                           "--out", str(out), "--device", "cpu"], capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["status"] == "ok", result.get("message")
    assert [r["rank"] for r in result["ranks"]] == [0, 1]
    assert result["applied"]["parallelism"] == "ddp"
    assert result["summary"]["global_batch_size"] == 2 * 2
    assert not list(tmp_path.glob("out.json.rank*"))  # per-rank files merged and removed


def test_tf32_reaches_the_probe_and_is_set_either_way(tiny_spec):
    """A configuration estimated with --tf32 is measured with TF32 matmuls, and one without after it is not
    (the flag is process-wide: an earlier probe must not leak into the next)."""
    import torch

    on = probe.run_probe(request(tiny_spec, tf32=True), modeling=modeling, device="cpu")
    assert on["status"] == "ok" and on["applied"]["tf32_matmul"] is True
    off = probe.run_probe(request(tiny_spec), modeling=modeling, device="cpu")
    assert off["status"] == "ok" and off["applied"]["tf32_matmul"] is False
    assert torch.backends.cuda.matmul.allow_tf32 is False


def test_a_run_of_step_lengths_is_replayed_in_order(tiny_spec):
    """`step_lengths`: one step per entry, each batch at its own length (a run of varying lengths)."""
    lengths = [8, 16, 4, 12]
    req = request(tiny_spec) | {"step_lengths": lengths}
    result = probe.run_probe(req, modeling=modeling, device="cpu")
    assert result["status"] == "ok", result.get("error")
    assert result["step_lengths"] == lengths and len(result["step_times_s"]) == len(lengths)
    forward = [r for r in result["phases"] if r["phase"] == "forward"]
    assert [r["seq_len"] for r in forward] == lengths
    assert result["summary"]["step_lengths"] == lengths
    with pytest.raises(ValueError, match="step_lengths"):
        probe.make_plan(request(tiny_spec) | {"step_lengths": [8, 32]})  # above seq_len 16


@pytest.mark.parametrize("base", ["auto", "nf4"])
def test_lora_probe_runs_peft_and_counts_as_planned(tiny_spec, base):
    """The probe job puts peft's LoRA (and, for nf4, bitsandbytes 4-bit layers) on the model as the planner
    models it: the trainable and frozen counts it reports are the plan's, and it trains only the adapters."""
    pytest.importorskip("peft")
    if base == "nf4":
        pytest.importorskip("bitsandbytes")
    from planner.adapters.lora import plan

    cfg = dict(lora_r=4, lora_targets=("query", "value"), base_dtype=base)
    result = probe.run_probe(request(tiny_spec, **cfg), modeling=modeling, device="cpu")
    assert result["status"] == "ok", result.get("message")
    lora = plan(tiny_spec, TrainConfig(batch_size=2, seq_len=16, **cfg))
    assert (result["applied"]["lora"]["trainable"], result["applied"]["lora"]["frozen"]) == (lora.trainable,
                                                                                             lora.frozen)
    # AdamW's two fp32 moments per adapter element; on a CPU its 0-dim fp32 `step` per tensor lives there too
    assert result["tensors"]["optimizer_state_bytes"] == 8 * lora.trainable + 4 * len(lora.shapes)


@pytest.mark.parametrize("loop", ["plain", "hf-trainer", "accelerate", "lightning", "loss-only"])
def test_the_probe_runs_the_named_loop(tiny_spec, loop):
    """Each loop trains (the gradients reach the optimizer whenever it zeroes them) and is recorded."""
    out = probe.run_probe(request(tiny_spec, loop=loop), modeling=modeling, device="cpu")
    assert out["status"] == "ok", out.get("message")
    assert out["applied"]["loop"] == loop
    assert out["tensors"]["optimizer_state_bytes"] >= 2 * out["tensors"]["parameters_bytes"]  # AdamW stepped


@pytest.mark.parametrize("load,built", [("direct", torch.bfloat16), ("cast", torch.float32)])
def test_the_probe_builds_in_bf16_or_casts_from_fp32(tiny_spec, load, built, monkeypatch):
    seen = []
    real = modeling.build_model

    def spy(*a, **kw):
        model = real(*a, **kw)
        seen.append(next(model.parameters()).dtype)
        return model

    monkeypatch.setattr(modeling, "build_model", spy)
    out = probe.run_probe(request(tiny_spec, precision="bf16", load=load), modeling=modeling, device="cpu")
    assert out["status"] == "ok", out.get("message")
    assert seen == [built] and out["applied"]["model_dtype"] == "bfloat16" and out["applied"]["load"] == load
    assert torch.get_default_dtype() == torch.float32  # put back
