"""Real GPU readings in one short call: training steps, launch profiles, varying-length runs, LoRA/QLoRA and
models outside the catalog, measured with plain PyTorch loops (not with the planner's own code).

    python benchmarks/gpu_session.py prepare --out .gpu/specs.json   # here: model specs and configs
    python benchmarks/gpu_session.py run --specs .gpu/specs.json --out DIR [--quick] [--device cpu]

`prepare` needs the planner (it writes each catalog model's spec as the probe job receives it). `run` needs
only torch and transformers (plus peft, and bitsandbytes for QLoRA), so it runs on a bare GPU machine; it
imports `jobs/modeling.py` to build exactly the models the probe job builds. Every section runs in its own
forked process (a fresh caching allocator, and an OOM or crash in one section cannot spoil another) and
appends JSON lines to its own file in DIR:

* steps.jsonl: one training step per row, measured as ../shared/gpu-readings/*/README.md describes (model
  built on the GPU in fp32; per phase of steps 1 and 2: max_memory_allocated, max_memory_reserved, allocated,
  reserved, device used; bytes packed by saved_tensors_hooks in step 1; median wall time of timed steps).
* launch.jsonl: torch.profiler over small steps: kernels launched, GPU-busy time, ATen calls per step.
* runs.jsonl: many steps whose batches vary in length (seeded uniform draw), and the same run at a fixed
  maximum length, with the default allocator and with expandable segments; every step's length and peaks.
* lora.jsonl: LoRA (peft) on a 16-bit base and QLoRA (bitsandbytes NF4, double quantization) steps.
* traced.jsonl: models outside the catalog (Hugging Face configs), with the tracer's batch convention.
* late.jsonl (`late`): 200-step varying-length runs whose longest batches come late (lengths >= a cutoff kept
  out of the first 150 steps), default allocator and expandable segments; every step's length and peaks.
* vocab.jsonl (`vocab`): Qwen2-0.5B (151,936-token vocabulary) at several shapes, phase peaks of steps 1-3.
* qlora_nockpt.jsonl (`qlora_nockpt`): QLoRA on Llama-2-7B at 2 x 1,024 without and with checkpointing.
* load.jsonl (`load`): LoRA on Llama-2-7B built in bf16, built in fp32 and cast, and cast + empty_cache.
* loops.jsonl (`loops`): one BERT-base AMP bf16 32 x 512 training under a plain loop, the Hugging Face
  Trainer, Accelerate and Lightning; per-step peaks (reset at the step's start, read after its optimizer
  step) and wall time.
* fsdp.jsonl (`fsdp`): a Llama-style model of 0.85 B parameters on one GPU in a one-process group: plain + autocast,
  FSDP2 (fully_shard) with and without a MixedPrecisionPolicy, without resharding after forward, LoRA on a
  bf16 base, and FSDP1 with MixedPrecision; phase peaks of steps 1 and 2, the step time, and a profile of two
  steps (kernels, GPU-busy time, ATen calls, the 15 costliest kernels).
* qlora_profile.jsonl (`qlora_profile`, issue 36): Llama-2-7B b1 and b4 x 512 with checkpointing, NF4 and bf16
  bases: step times over 10 steps, then a profile (kernels, GPU-busy time, ATen calls, bitsandbytes ops and
  their CPU time per step): what settles QLoRA's host cost per 4-bit Linear.
* xent.jsonl (`xent`, issue 36): `F.cross_entropy` alone on (n, V) logits made by a Linear under autocast
  (bf16, fp16) and in fp32, on the logits as they are and after `.float()` (transformers' causal LM): every
  tensor saved for backward (shape, dtype, bytes), the forward's peak over its end and backward's rise over
  its start. What settles `activations.cross_entropy_saved` on the GPU: a 16-bit log-softmax plus nll_loss's
  fp32 copy under CUDA autocast, no unsaved copy, one fp32 gradient at the backward peak.
* passes.jsonl (`passes`, issue 36): eight elementwise passes (fp32 and bf16, mixed bf16/fp32, both casts) at
  4 M, 32 M and 256 M elements, timed with CUDA events: bytes per second, for benchmarks/passes_readings.py.
* segments.jsonl (`segments`, issue 36): two steps of three configurations whose reserved pool the replay
  misses, the caching allocator's segments after every phase (torch.cuda.memory_snapshot).
* memtrace.jsonl (`memtrace`, issue 36): the model's build and two steps from an empty cache with the
  allocator's own record of every request, free and new segment (torch.cuda.memory._record_memory_history),
  for benchmarks/memtrace_replay.py: the planner's allocator model against the real allocator, segment for
  segment and block for block, on the same requests.
* env.json (with the host's CPU), log.txt.

`--device cpu` runs tiny shapes of every section on the CPU (no memory figures): a check of the script itself
before it spends GPU time.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import random
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "jobs"))

# ----------------------------------------------------------------------------------------- what to measure
STEP_ROWS: list[dict[str, Any]] = (
    [{"group": "core", "model": "bert-base-uncased", "b": b, "s": s, "precision": p}
     for s in (128, 512) for b in (8, 32) for p in ("fp32", "amp-bf16", "amp-fp16")]
    + [{"group": "core", "model": "gpt2", "b": b, "s": 1024, "precision": p} for b in (8, 32)
       for p in ("fp32", "amp-bf16")]
    + [{"group": "core", "model": "multimodal-bert", "b": 32, "s": 512, "precision": p}
       for p in ("fp32", "amp-fp16", "amp-bf16")]
    + [{"group": "tf32", "model": m, "b": b, "s": s, "precision": "fp32", "tf32": True}
       for m, b, s in (("bert-base-uncased", 32, 512), ("gpt2", 8, 1024), ("multimodal-bert", 32, 512),
                       ("bert-base-uncased", 8, 128))]
    + [{"group": "ckpt", "model": "bert-base-uncased", "b": 32, "s": 512, "precision": "amp-bf16", "ckpt": True},
       {"group": "kernel", "model": "gpt2", "b": 8, "s": 1024, "precision": "amp-bf16", "attention": "eager"},
       {"group": "optimizer", "model": "bert-base-uncased", "b": 32, "s": 512, "precision": "amp-bf16",
        "optimizer_impl": "fused"}]
)
LAUNCH_ROWS = [{"model": "bert-base-uncased", "b": 8, "s": 128, "precision": p} for p in ("amp-bf16", "fp32")] + [
    {"model": "gpt2", "b": 8, "s": 256, "precision": "amp-bf16"}]
# Varying-length runs: (model, micro-batch, precision, min, max, step of the length grid, steps).
RUNS = [("bert-base-uncased", 32, "amp-bf16", 64, 512, 8, 40), ("gpt2", 16, "fp32", 128, 1024, 8, 40)]
FIXED_RUN_STEPS = 6
LORA_ROWS = [
    {"name": "lora", "model": "llama-2-7b", "b": 1, "s": 512, "r": 16, "alpha": 32, "base": "bf16", "ckpt": False},
    {"name": "lora", "model": "llama-2-7b", "b": 4, "s": 512, "r": 16, "alpha": 32, "base": "bf16", "ckpt": True},
    {"name": "lora", "model": "llama-2-7b", "b": 4, "s": 512, "r": 64, "alpha": 16, "base": "bf16", "ckpt": True,
     "targets": "all-linear"},
    {"name": "qlora", "model": "llama-2-7b", "b": 1, "s": 512, "r": 16, "alpha": 32, "base": "nf4", "ckpt": True},
    {"name": "qlora", "model": "llama-2-7b", "b": 4, "s": 512, "r": 16, "alpha": 32, "base": "nf4", "ckpt": True},
]
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
TRACED_ROWS = [{"model": m, "b": b, "s": 512, "precision": p}
               for m, b in (("t5-base", 16), ("bart-base", 16), ("pythia-410m", 8), ("opt-350m", 8),
                            ("qwen2-0.5b", 8))
               for p in ("amp-bf16", "fp32")]

# Hugging Face configs of the models outside the catalog: the architecture keys of each hub config.json
# (t5-base, facebook/bart-base, EleutherAI/pythia-410m, facebook/opt-350m, Qwen/Qwen2-0.5B). The readings
# and the planner's predictions use these same files (committed beside the readings).
HF_CONFIGS: dict[str, dict[str, Any]] = {
    "t5-base": {"model_type": "t5", "architectures": ["T5ForConditionalGeneration"], "d_model": 768,
                "d_ff": 3072, "d_kv": 64, "num_heads": 12, "num_layers": 12, "num_decoder_layers": 12,
                "vocab_size": 32128, "relative_attention_num_buckets": 32, "relative_attention_max_distance": 128,
                "dropout_rate": 0.1, "feed_forward_proj": "relu", "layer_norm_epsilon": 1e-6,
                "tie_word_embeddings": True, "decoder_start_token_id": 0, "pad_token_id": 0, "eos_token_id": 1,
                "is_encoder_decoder": True},
    "bart-base": {"model_type": "bart", "architectures": ["BartForConditionalGeneration"], "d_model": 768,
                  "encoder_layers": 6, "decoder_layers": 6, "encoder_attention_heads": 12,
                  "decoder_attention_heads": 12, "encoder_ffn_dim": 3072, "decoder_ffn_dim": 3072,
                  "vocab_size": 50265, "max_position_embeddings": 1024, "activation_function": "gelu",
                  "dropout": 0.1, "attention_dropout": 0.1, "activation_dropout": 0.1, "scale_embedding": False,
                  "pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2, "decoder_start_token_id": 2,
                  "is_encoder_decoder": True, "tie_word_embeddings": True},
    "pythia-410m": {"model_type": "gpt_neox", "architectures": ["GPTNeoXForCausalLM"], "hidden_size": 1024,
                    "num_hidden_layers": 24, "num_attention_heads": 16, "intermediate_size": 4096,
                    "vocab_size": 50304, "rotary_pct": 0.25, "rotary_emb_base": 10000,
                    "max_position_embeddings": 2048, "use_parallel_residual": True, "hidden_act": "gelu",
                    "layer_norm_eps": 1e-5, "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 0,
                    "attention_dropout": 0.0, "hidden_dropout": 0.0},
    "opt-350m": {"model_type": "opt", "architectures": ["OPTForCausalLM"], "hidden_size": 1024,
                 "ffn_dim": 4096, "num_hidden_layers": 24, "num_attention_heads": 16, "vocab_size": 50272,
                 "word_embed_proj_dim": 512, "do_layer_norm_before": False, "max_position_embeddings": 2048,
                 "activation_function": "relu", "dropout": 0.1, "attention_dropout": 0.0,
                 "pad_token_id": 1, "bos_token_id": 2, "eos_token_id": 2, "enable_bias": True},
    "qwen2-0.5b": {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 896,
                   "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
                   "intermediate_size": 4864, "vocab_size": 151936, "max_position_embeddings": 32768,
                   "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "hidden_act": "silu",
                   "tie_word_embeddings": True, "attention_dropout": 0.0, "bos_token_id": 151643,
                   "eos_token_id": 151643},
}
TINY = {"b": 2, "s": 32}  # --device cpu: every row at this shape
TINY_HF = {"t5-base": {"num_layers": 2, "num_decoder_layers": 2}, "bart-base": {"encoder_layers": 1,
           "decoder_layers": 1}, "pythia-410m": {"num_hidden_layers": 2}, "opt-350m": {"num_hidden_layers": 2},
           "qwen2-0.5b": {"num_hidden_layers": 2}}


# ----------------------------------------------------------------------------------------- prepare (here)
def prepare(out: Path) -> None:
    """Catalog model specs as the probe job receives them (ModelSpec JSON), and the HF configs."""
    sys.path.insert(0, str(ROOT))
    from planner.models.catalog import get_model

    rows = STEP_ROWS + LAUNCH_ROWS + LORA_ROWS + QLORA_NOCKPT_ROWS + LOAD_ROWS + [LOOP_ROW]
    names = sorted({r["model"] for r in rows} | {r[0] for r in RUNS + LATE_RUNS})
    specs = {n: get_model(n).model_dump(mode="json") for n in names}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"specs": specs, "hf_configs": HF_CONFIGS}))
    print(f"wrote {out}: {', '.join(names)} + {', '.join(HF_CONFIGS)}")


# ----------------------------------------------------------------------------------------- measuring
class Meter:
    """Memory readings of one device (all None on the CPU)."""

    def __init__(self, torch: Any, device: Any):
        self.torch, self.device = torch, device
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def reset(self) -> None:
        self.sync()
        if self.cuda:
            self.torch.cuda.reset_peak_memory_stats()

    def read(self) -> dict[str, Any]:
        self.sync()
        if not self.cuda:
            return {}
        c = self.torch.cuda
        free, total = c.mem_get_info()
        return {"max_alloc": int(c.max_memory_allocated()), "max_res": int(c.max_memory_reserved()),
                "alloc": int(c.memory_allocated()), "res": int(c.memory_reserved()), "used": int(total - free)}

    def used(self) -> int | None:
        if not self.cuda:
            return None
        free, total = self.torch.cuda.mem_get_info()
        return int(total - free)


def autocast(torch: Any, device: Any, precision: str) -> Any:
    if precision == "amp-bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    if precision == "amp-fp16":
        return torch.autocast(device_type=device.type, dtype=torch.float16)
    return contextlib.nullcontext()


def make_optimizer(torch: Any, params: Any, impl: str) -> Any:
    kwargs = {"foreach": {"foreach": True}, "fused": {"fused": True}, "for-loop": {"foreach": False}}[impl]
    return torch.optim.AdamW(params, lr=1e-5, **kwargs)


def tensor_key(t: Any) -> tuple[int, int] | None:
    try:
        s = t.untyped_storage()
        return (s.data_ptr(), s.nbytes())
    except Exception:  # noqa: BLE001 - a tensor without a storage (views of wrapped tensors): not counted
        return None


class SavedBytes:
    """Bytes of distinct storages packed by saved_tensors_hooks (with / without parameter storages)."""

    def __init__(self, torch: Any, model: Any):
        self.torch = torch
        self.params = {tensor_key(p) for p in model.parameters()}
        self.seen: set = set()
        self.all = self.nonparam = 0

    def pack(self, t: Any) -> Any:
        key = tensor_key(t)
        if key is not None and key not in self.seen:
            self.seen.add(key)
            self.all += key[1]
            if key not in self.params:
                self.nonparam += key[1]
        return t

    def hooks(self) -> Any:
        return self.torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)


def loss_fn(model: Any, batch: dict[str, Any]) -> Any:
    import modeling

    return modeling.loss_of(model, batch)


def train_step(torch: Any, model: Any, opt: Any, batch: dict, precision: str, device: Any, scaler: Any,
               meter: Meter | None = None, saved: SavedBytes | None = None) -> dict[str, Any]:
    """One step, phase by phase; `out` is held until the step ends (as a training loop holds it)."""
    rows: dict[str, Any] = {}
    if meter:
        meter.reset()
    with autocast(torch, device, precision), (saved.hooks() if saved else contextlib.nullcontext()):
        out = loss_fn(model, batch)
    if meter:
        rows["forward"] = meter.read()
        meter.reset()
    (scaler.scale(out) if scaler else out).backward()
    if meter:
        rows["backward"] = meter.read()
        meter.reset()
    if scaler:
        scaler.step(opt)
        scaler.update()
    else:
        opt.step()
    opt.zero_grad(set_to_none=True)
    if meter:
        rows["optimizer"] = meter.read()
    del out
    return rows


def clear(torch: Any) -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        with contextlib.suppress(Exception):
            torch._C._cuda_clearCublasWorkspaces()


def timed(torch: Any, fn: Any, n: int, warmup: int = 2) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(n):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return out


# ----------------------------------------------------------------------------------------- models
def build_catalog(spec: dict, attention: str, ckpt: bool, device: Any) -> Any:
    import modeling

    return modeling.build_model(spec, attention, device=device, checkpointing=ckpt)


def catalog_batch(spec: dict, b: int, s: int, device: Any) -> dict:
    import modeling

    return modeling.make_batch(spec, b, s, device=device)


def hf_build(config: dict, attention: str, device: Any) -> Any:
    import transformers
    from transformers import AutoConfig

    cfg = dict(config)
    model_type = cfg.pop("model_type")
    cfg["use_cache"] = False
    conf = AutoConfig.for_model(model_type, attn_implementation=attention, **cfg)
    cls = getattr(transformers, conf.architectures[0])
    with torch_device(device):
        return cls(conf).train(), conf


def torch_device(device: Any) -> Any:
    import torch

    return torch.device(device)


def hf_batch(conf: Any, b: int, s: int, device: Any) -> dict:
    """planner/program/hf.py's batch: token ids, a mask with one padded position, token labels."""
    import torch

    vocab = int(conf.vocab_size)
    batch = {"input_ids": torch.randint(0, vocab, (b, s), device=device)}
    mask = torch.ones(b, s, dtype=torch.int64, device=device)
    if b > 1 and s > 1:
        mask[-1, -1] = 0
    batch["attention_mask"] = mask
    batch["labels"] = torch.randint(0, vocab, (b, s), device=device)
    return batch


# ----------------------------------------------------------------------------------------- sections
def measure_row(torch: Any, device: Any, row: dict, build: Any, batch_of: Any, timed_steps: int) -> dict:
    """The shared readings' method for one configuration."""
    meter = Meter(torch, device)
    precision = row["precision"]
    torch.backends.cuda.matmul.allow_tf32 = bool(row.get("tf32"))
    torch.backends.cudnn.allow_tf32 = bool(row.get("tf32"))
    clear(torch)
    out: dict[str, Any] = dict(row)
    out["base_used"] = meter.used()
    meter.reset()
    model = build()
    out["load"] = meter.read()
    out["params"] = sum(p.numel() for p in model.parameters())
    batch = batch_of()
    out["batch_bytes"] = sum(t.numel() * t.element_size() for t in batch.values() if hasattr(t, "numel"))
    opt = make_optimizer(torch, model.parameters(), row.get("optimizer_impl", "foreach"))
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**12) if precision == "amp-fp16" and meter.cuda else None
    saved = None if row.get("ckpt") else SavedBytes(torch, model)
    out["step1"] = train_step(torch, model, opt, batch, precision, device, scaler, meter, saved)
    if saved:
        out["saved_bytes_all"], out["saved_bytes_nonparam"] = saved.all, saved.nonparam
    out["step2"] = train_step(torch, model, opt, batch, precision, device, scaler, meter)
    times = timed(torch, lambda: train_step(torch, model, opt, batch, precision, device, scaler), timed_steps)
    out["step_times_s"] = times
    out["step_time_s"] = statistics.median(times)
    out["samples_per_s"] = row["b"] / out["step_time_s"]
    model = opt = batch = scaler = None  # free before the next row
    clear(torch)
    torch.backends.cuda.matmul.allow_tf32 = False
    return out


def section_steps(ctx: dict) -> None:
    torch, device, specs = ctx["torch"], ctx["device"], ctx["specs"]
    for row in ctx["rows"](STEP_ROWS):
        spec = specs[row["model"]]
        attention = row.get("attention", "sdpa")
        row = {**row, "attention": attention, "ckpt": bool(row.get("ckpt")),
               "optimizer_impl": row.get("optimizer_impl", "foreach"), "tf32": bool(row.get("tf32"))}
        ctx["emit"](guarded(torch, row, lambda r=row, sp=spec, a=attention: measure_row(
            torch, device, r, lambda: build_catalog(sp, a, r["ckpt"], device),
            lambda: catalog_batch(sp, r["b"], r["s"], device), ctx["timed_steps"])))


def section_traced(ctx: dict) -> None:
    torch, device = ctx["torch"], ctx["device"]
    for row in ctx["rows"](TRACED_ROWS):
        config = {**HF_CONFIGS[row["model"]], **(TINY_HF[row["model"]] if ctx["tiny"] else {})}
        holder: dict[str, Any] = {}

        def build(c=config, h=holder):
            model, h["conf"] = hf_build(c, "sdpa", device)
            return model

        row = {**row, "attention": "sdpa", "hf_config": config}
        ctx["emit"](guarded(torch, row, lambda r=row, bld=build, h=holder: measure_row(
            torch, device, r, bld, lambda: hf_batch(h["conf"], r["b"], r["s"], device), ctx["timed_steps"])))


def profile_steps(torch: Any, device: Any, step: Any, steps: int, top: int = 0) -> dict[str, Any]:
    """torch.profiler over `steps` steps: CUDA kernels launched, GPU-busy seconds (sum of kernel time) and
    ATen calls per step; bitsandbytes' custom ops (`bitsandbytes::*`: dequantize, gemm_4bit) per step and
    their CPU seconds (self time plus what they call: the host cost of a 4-bit Linear beyond its kernels);
    with `top`, the `top` costliest CUDA kernels (name, launches and seconds per step)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(steps):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize()
    kernels = busy_us = aten = bnb = bnb_cpu_us = 0
    costly: list[tuple[float, str, int]] = []
    for e in prof.key_averages():
        if "CUDA" in str(getattr(e, "device_type", "")):
            kernels += e.count
            us = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0) or 0
            busy_us += us
            costly.append((us, e.key, e.count))
        elif e.key.startswith("aten::"):
            aten += e.count
        elif e.key.startswith("bitsandbytes::"):
            bnb += e.count
            bnb_cpu_us += getattr(e, "cpu_time_total", 0) or 0
    out: dict[str, Any] = {"kernels_per_step": kernels / steps, "gpu_busy_s_per_step": busy_us / 1e6 / steps,
                           "aten_calls_per_step": aten / steps, "bnb_calls_per_step": bnb / steps,
                           "bnb_cpu_s_per_step": bnb_cpu_us / 1e6 / steps}
    if top:
        out["top_kernels"] = [[name[:120], count / steps, us / 1e6 / steps]
                              for us, name, count in sorted(costly, reverse=True)[:top]]
    return out


def section_launch(ctx: dict) -> None:
    """Where a small step's time goes: kernels, GPU-busy time and ATen calls per step (torch.profiler)."""
    torch, device, specs = ctx["torch"], ctx["device"], ctx["specs"]
    for row in ctx["rows"](LAUNCH_ROWS):
        def run(r=row):
            spec = specs[r["model"]]
            model = build_catalog(spec, "sdpa", False, device)
            batch = catalog_batch(spec, r["b"], r["s"], device)
            opt = make_optimizer(torch, model.parameters(), "foreach")
            scaler = None
            step = lambda: train_step(torch, model, opt, batch, r["precision"], device, scaler)  # noqa: E731
            wall = statistics.median(timed(torch, step, 10, warmup=3))
            out = {**r, "wall_step_s": wall, **profile_steps(torch, device, step, 5)}
            out.pop("bnb_calls_per_step")
            out.pop("bnb_cpu_s_per_step")
            model = opt = batch = None  # free before the next row
            clear(torch)
            return out
        ctx["emit"](guarded(torch, row, run))


def draw_lengths(lo: int, hi: int, step: int, n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    grid = list(range(lo, hi + 1, step))
    return [rng.choice(grid) for _ in range(n)]


def one_run(ctx: dict, model_name: str, b: int, precision: str, lengths: list[int], kind: str,
            alloc_conf: str) -> dict:
    torch, device, spec = ctx["torch"], ctx["device"], ctx["specs"][model_name]
    meter = Meter(torch, device)
    model = build_catalog(spec, "sdpa", False, device)
    opt = make_optimizer(torch, model.parameters(), "foreach")
    steps = []
    for i, s in enumerate(lengths):
        batch = catalog_batch(spec, b, s, device)
        meter.reset()
        t0 = time.perf_counter()
        train_step(torch, model, opt, batch, precision, device, None)
        reading = meter.read()
        steps.append({"step": i + 1, "len": s, "time_s": time.perf_counter() - t0, **reading})
        del batch
    peak_res = max((r.get("max_res", 0) for r in steps), default=0)
    peak_alloc = max((r.get("max_alloc", 0) for r in steps), default=0)
    out = {"model": model_name, "b": b, "precision": precision, "kind": kind, "alloc_conf": alloc_conf,
           "lengths": lengths, "steps": steps, "peak_reserved": peak_res, "peak_allocated": peak_alloc,
           "peak_used": max((r.get("used", 0) for r in steps), default=0)}
    del model, opt
    return out


def section_runs(ctx: dict) -> None:
    """Each run in its own process: the allocator setting must be fixed before CUDA starts."""
    for model_name, b, precision, lo, hi, step, n in RUNS:
        if ctx["tiny"]:
            b, lo, hi, n = 2, 8, 32, 4
        lengths = draw_lengths(lo, hi, step, n, seed=0)
        for alloc_conf in ("", "expandable_segments:True"):
            for kind, lens in (("varied", lengths), ("fixed", [hi] * (FIXED_RUN_STEPS if not ctx["tiny"] else 2))):
                row = {"model": model_name, "b": b, "precision": precision, "kind": kind, "alloc_conf": alloc_conf}
                ctx["fork"](f"run {model_name} {kind} {alloc_conf or 'default'}", "runs.jsonl", row,
                            lambda c, m=model_name, bb=b, p=precision, ls=lens, k=kind, a=alloc_conf:
                            one_run(c, m, bb, p, ls, k, a), alloc_conf)


def host_cpu() -> dict:
    """The host's CPU: its model name, logical CPUs and the clock the kernel reports. Launch-bound steps are set
    by it (the H100 readings of 2026-11-26 ran 1.3-2x the H200's wall time on the same small AMP steps, their
    GPU time about equal), and the planner scales host time by the instance's CPU clock (planner.perf.host):
    without it a reading's host is an assumption."""
    info: dict[str, Any] = {"cpu_count": os.cpu_count()}
    with contextlib.suppress(OSError):
        text = Path("/proc/cpuinfo").read_text()
        names = [line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")]
        mhz = [float(line.split(":", 1)[1]) for line in text.splitlines() if line.startswith("cpu MHz")]
        if names:
            info["cpu_model"] = names[0]
        if mhz:
            info["cpu_mhz_max_reported"] = max(mhz)
    return info


def lora_row(ctx: dict, row: dict) -> dict:
    torch, device, spec = ctx["torch"], ctx["device"], ctx["specs"][row["model"]]
    import peft

    meter = Meter(torch, device)
    if ctx["tiny"]:
        spec = json.loads(json.dumps(spec))
        layer = spec["components"][0]["layers"][0]
        layer["hf_config"].update({"num_hidden_layers": 2, "hidden_size": 256, "intermediate_size": 512,
                                   "num_attention_heads": 4, "num_key_value_heads": 4})
    meter.reset()
    out: dict[str, Any] = dict(row)
    load = row.get("load_path", "direct")
    if load == "direct":  # built in bf16 where it runs
        old = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            model = build_catalog(spec, "sdpa", False, device)
        finally:
            torch.set_default_dtype(old)
    else:  # built in fp32 on the device, then cast (the fp32 segments stay reserved unless emptied)
        model = build_catalog(spec, "sdpa", False, device)
        out["load_fp32"] = meter.read()
        model = model.to(torch.bfloat16)
        if load == "cast+empty_cache":
            out["load_cast"] = meter.read()
            gc.collect()
            if meter.cuda:
                torch.cuda.empty_cache()
    out["load_bf16"] = meter.read()
    empty = row.get("empty_cache", True)  # the first lora rows emptied the cache after peft; the load rows do not
    if row["base"] == "nf4":
        out["quantized_linears"] = quantize_nf4(torch, model, device)
        model.is_loaded_in_4bit = True
        clear(torch)
        model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=row["ckpt"],
                                                     gradient_checkpointing_kwargs={"use_reentrant": False})
    elif row["ckpt"]:
        import modeling

        modeling.enable_checkpointing(model)
        model.enable_input_require_grads()
    targets = row.get("targets") or LORA_TARGETS
    config = peft.LoraConfig(r=row["r"], lora_alpha=row["alpha"], lora_dropout=0.05, bias="none",
                             task_type="CAUSAL_LM", target_modules=targets)
    model = peft.get_peft_model(model, config)
    trainable, total = model.get_nb_trainable_parameters()
    out.update(trainable=int(trainable), total=int(total),
               param_bytes=sum(p.numel() * p.element_size() for p in model.parameters()),
               trainable_dtypes=sorted({str(p.dtype) for p in model.parameters() if p.requires_grad}))
    if empty:
        clear(torch)
    else:
        gc.collect()
    meter.reset()
    out["load"] = meter.read()
    batch = catalog_batch(spec, row["b"], row["s"], device)
    opt = make_optimizer(torch, [p for p in model.parameters() if p.requires_grad], "foreach")
    saved = None if row["ckpt"] else SavedBytes(torch, model)
    out["step1"] = train_step(torch, model, opt, batch, "amp-bf16", device, None, meter, saved)
    if saved:
        out["saved_bytes_all"], out["saved_bytes_nonparam"] = saved.all, saved.nonparam
    out["step2"] = train_step(torch, model, opt, batch, "amp-bf16", device, None, meter)
    n = 10 if row.get("profile") else 3
    times = timed(torch, lambda: train_step(torch, model, opt, batch, "amp-bf16", device, None), n, warmup=1 + 2 * (n > 3))
    out["step_times_s"], out["step_time_s"] = times, statistics.median(times)
    if row.get("profile"):
        out.update(profile_steps(torch, device, lambda: train_step(torch, model, opt, batch, "amp-bf16", device, None),
                                 3))
    return out


def quantize_nf4(torch: Any, model: Any, device: Any) -> int:
    """Every nn.Linear of the decoder layers (not the LM head) as bitsandbytes NF4 with double quantization,
    computing in bf16: what `BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
    bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=bfloat16)` loads."""
    import bitsandbytes as bnb

    count = 0
    for _name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            if isinstance(child, torch.nn.Linear) and child_name != "lm_head":
                new = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                                        compute_dtype=torch.bfloat16, compress_statistics=True, quant_type="nf4",
                                        device="meta")
                new.weight = bnb.nn.Params4bit(child.weight.data, requires_grad=False, compress_statistics=True,
                                               quant_type="nf4", blocksize=64).to(device)
                if child.bias is not None:
                    new.bias = torch.nn.Parameter(child.bias.data, requires_grad=False)
                setattr(parent, child_name, new)
                del child
                count += 1
    return count


def _fork_rows(ctx: dict, rows: list[dict], tiny: dict, out: str, label: Any, measure: Any) -> None:
    """Each row through `measure(ctx, row)` in a fresh process, written to `out`; a tiny run (--device cpu)
    overrides the row's fields with `tiny` before the row is labelled."""
    for row in rows:
        if ctx["tiny"]:
            row = {**row, **tiny}
        ctx["fork"](label(row), out, row, lambda c, r=row: measure(c, r), "")


def _fork_lora_rows(ctx: dict, rows: list[dict], out: str, label: Any) -> None:
    """Each row through `lora_row` (LoRA, QLoRA and the load path all run it); a tiny run at 1 x 16."""
    _fork_rows(ctx, rows, {"b": 1, "s": 16}, out, label, lora_row)


def section_lora(ctx: dict) -> None:
    _fork_lora_rows(ctx, LORA_ROWS, "lora.jsonl", lambda r: f"{r['name']} r{r['r']} b{r['b']}")


# ----------------------------------------------------------------------------------------- issue 36 and 32
# Varying-length runs whose longest batches come late: (model, micro-batch, precision, min, max, grid step,
# steps, cutoff, steps kept under the cutoff). Lengths >= cutoff are redrawn below it in the first
# `early` steps, and the maximum length is placed once in the late part if the draw left it out.
LATE_RUNS = [("bert-base-uncased", 32, "amp-bf16", 64, 512, 8, 200, 480, 150),
             ("gpt2", 16, "fp32", 128, 1024, 8, 200, 960, 150)]
VOCAB_ROWS = ([{"model": "qwen2-0.5b", "b": b, "s": s, "precision": "amp-bf16"}
               for b, s in ((4, 512), (8, 1024), (4, 2048), (16, 512))]
              + [{"model": "qwen2-0.5b", "b": 8, "s": 1024, "precision": "fp32"}])
QLORA_NOCKPT_ROWS = [{"name": "qlora", "model": "llama-2-7b", "b": 2, "s": 1024, "r": 16, "alpha": 32,
                      "base": "nf4", "ckpt": c} for c in (False, True)]
# The load path: built in bf16 on the GPU (direct), built in fp32 on the GPU then .to(bfloat16) (cast), and
# cast followed by torch.cuda.empty_cache() (cast+empty_cache). No other empty_cache in these rows.
LOAD_ROWS = [{"name": "lora", "model": "llama-2-7b", "b": 4, "s": 512, "r": 16, "alpha": 32, "base": "bf16",
              "ckpt": True, "load_path": mode, "empty_cache": False}
             for mode in ("direct", "cast", "cast+empty_cache")]
# Where a QLoRA step's time goes (issue 36: the planner predicts Llama-2-7B QLoRA b1 x 512 with checkpointing 42 %
# too fast, the same with a bf16 base 5-20 %; the dequantization kernels' bytes and launches are counted from
# bitsandbytes' source, its Python and custom-op host cost per 4-bit Linear is not known): the same step with
# an NF4 and a bf16 base, timed over 10 steps, then profiled (kernels, GPU-busy time, ATen calls, the
# bitsandbytes ops and their CPU time per step). GPU-busy far below the wall time says the host bounds it.
QLORA_PROFILE_ROWS = [{"name": n, "model": "llama-2-7b", "b": b, "s": 512, "r": 16, "alpha": 32, "base": base,
                       "ckpt": True, "profile": True}
                      for n, base in (("qlora", "nf4"), ("lora", "bf16")) for b in (1, 4)]
LOOP_ROW = {"model": "bert-base-uncased", "b": 32, "s": 512, "precision": "amp-bf16", "steps": 4}
LOOPS = ("plain", "hf-trainer", "accelerate", "lightning")
# A Llama-style model of 852,559,872 parameters (issue 32; measured); TINY_FSDP for --device cpu.
FSDP_CONFIG = {"hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
               "intermediate_size": 5632, "vocab_size": 32000, "max_position_embeddings": 4096,
               "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": False,
               "attention_dropout": 0.0}
TINY_FSDP = {"hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "intermediate_size": 256, "vocab_size": 1000}
FSDP_ROWS = [
    {"variant": "a-plain-autocast", "wrap": "none", "policy": False, "autocast": True},
    {"variant": "b-fsdp2-policy", "wrap": "fsdp2", "policy": True, "autocast": False},
    {"variant": "c-fsdp2-autocast", "wrap": "fsdp2", "policy": False, "autocast": True},
    {"variant": "d-fsdp2-policy-no-reshard", "wrap": "fsdp2", "policy": True, "autocast": False,
     "reshard_after_forward": False},
    {"variant": "e-fsdp2-policy-lora-bf16-base", "wrap": "fsdp2", "policy": True, "autocast": False, "lora": True},
    {"variant": "f-fsdp1-mixed-precision", "wrap": "fsdp1", "policy": True, "autocast": False},
]
FSDP_SHAPE = {"b": 2, "s": 2048}
FSDP_CKPT = ("transformers gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False}) "
             "on every LlamaDecoderLayer, applied before wrapping")


def draw_late_lengths(lo: int, hi: int, step: int, n: int, cutoff: int, early: int, seed: int) -> list[int]:
    """A seeded uniform draw on the grid, with every length >= cutoff in the first `early` steps redrawn below
    it, and `hi` placed once (at a seeded late step) when the late part did not draw it."""
    rng = random.Random(seed)
    grid = list(range(lo, hi + 1, step))
    low = [x for x in grid if x < cutoff]
    lengths = [rng.choice(low) if i < early else rng.choice(grid) for i in range(n)]
    if hi not in lengths[early:]:
        lengths[rng.randrange(early, n)] = hi
    return lengths


def section_late(ctx: dict) -> None:
    """Both models with the default allocator first, then with expandable segments (what a tight budget
    skips last)."""
    for alloc_conf in ("", "expandable_segments:True"):
        for model_name, b, precision, lo, hi, step, n, cutoff, early in LATE_RUNS:
            if ctx["tiny"]:
                b, lo, hi, n, cutoff, early = 2, 8, 32, 8, 24, 6
            lengths = draw_late_lengths(lo, hi, step, n, cutoff, early, seed=0)
            extra = {"cutoff": cutoff, "early_steps": early, "grid": [lo, hi, step], "seed": 0}
            row = {"model": model_name, "b": b, "precision": precision, "kind": "late", "alloc_conf": alloc_conf}
            t0 = time.monotonic()
            ctx["fork"](f"late {model_name} {alloc_conf or 'default'}", "late.jsonl", row,
                        lambda c, m=model_name, bb=b, p=precision, ls=lengths, a=alloc_conf, x=extra:
                        {**one_run(c, m, bb, p, ls, "late", a), **x}, alloc_conf)
            ctx["log"](f"  wall {time.monotonic() - t0:.1f}s")


def vocab_row(ctx: dict, row: dict) -> dict:
    """A traced-style Qwen2 row with three measured steps (the second step's reserved jump)."""
    torch, device = ctx["torch"], ctx["device"]
    config = {**HF_CONFIGS[row["model"]], **(TINY_HF[row["model"]] if ctx["tiny"] else {})}
    meter = Meter(torch, device)
    out: dict[str, Any] = {**row, "attention": "sdpa", "hf_config": config, "base_used": meter.used()}
    meter.reset()
    model, conf = hf_build(config, "sdpa", device)
    out["load"] = meter.read()
    out["params"] = sum(p.numel() for p in model.parameters())
    batch = hf_batch(conf, row["b"], row["s"], device)
    opt = make_optimizer(torch, model.parameters(), "foreach")
    times = []
    for i in (1, 2, 3):
        t0 = time.perf_counter()
        out[f"step{i}"] = train_step(torch, model, opt, batch, row["precision"], device, None, meter)
        times.append(time.perf_counter() - t0)
    out["step_times_s"] = times  # phase-by-phase (synchronised) steps, the first one cold
    return out


# ---- cross-entropy under autocast (issue 36: activations.cross_entropy_saved)
XENT_ROWS = [{"n": n, "V": v, "precision": p, "upcast": up}
             for n, v in ((16384, 30522), (8192, 151936)) for p in ("amp-bf16", "amp-fp16", "fp32")
             for up in (False, True) if not (up and p == "fp32")]
XENT_TINY = {"n": 64, "V": 1000}


def xent_row(ctx: dict, row: dict) -> dict:
    """One cross-entropy on (n, V) logits of a Linear(64, V): saved tensors, forward and backward peaks."""
    torch, device = ctx["torch"], ctx["device"]
    meter = Meter(torch, device)
    n, v = row["n"], row["V"]
    x = torch.randn(n, 64, device=device, requires_grad=True)
    w = torch.randn(v, 64, device=device, requires_grad=True)
    y = torch.randint(0, v, (n,), device=device)
    saved: list[list[Any]] = []

    def pack(t: Any) -> Any:
        saved.append([list(t.shape), str(t.dtype).removeprefix("torch."), t.numel() * t.element_size()])
        return t

    with autocast(torch, device, row["precision"]):
        logits = torch.nn.functional.linear(x, w)
        meter.reset()
        start = meter.read()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = torch.nn.functional.cross_entropy(logits.float() if row["upcast"] else logits, y)
        forward = meter.read()  # the .float() copy, if any, is dropped here as a loss function's local is
    meter.reset()
    before = meter.read()
    loss.backward()
    backward = meter.read()
    out = {**row, "logits_dtype": str(logits.dtype).removeprefix("torch."), "loss_dtype": str(loss.dtype).removeprefix("torch."),
           "saved": [t for t in saved if t[2] >= n * v], "saved_small": [t for t in saved if t[2] < n * v]}
    if meter.cuda:
        out |= {"forward_peak_over_end": forward["max_alloc"] - forward["alloc"],
                "forward_end_over_start": forward["alloc"] - start["alloc"],
                "backward_rise": backward["max_alloc"] - before["alloc"], "nv": n * v}
    return out


# ---- elementwise passes by operand dtypes (issue 36: planner.perf.roofline ARCH_DYNAMIC_CAST, Hopper's HBM)
# (name, operand dtypes read, dtype written): a vectorized pass of each width, the mixed passes of autocast
# (CUDALoops.cuh `needs_dynamic_casting`), and the two casts (Copy.cu: only fp32 -> 16-bit is vectorized).
PASSES = [("add", ("float32", "float32"), "float32"), ("add", ("bfloat16", "bfloat16"), "bfloat16"),
          ("add", ("bfloat16", "float32"), "float32"), ("mul", ("float32", "bfloat16"), "float32"),
          ("copy", ("float32",), "bfloat16"), ("copy", ("bfloat16",), "float32"),
          ("tanh", ("float32",), "float32"), ("sigmoid", ("bfloat16",), "bfloat16")]
PASS_ROWS = [{"op": op, "reads": list(reads), "writes": w, "numel": n}
             for op, reads, w in PASSES for n in (1 << 22, 1 << 25, 1 << 28)]
PASS_TINY = {"numel": 1 << 12}


def pass_row(ctx: dict, row: dict) -> dict:
    """One elementwise pass over `numel` elements, timed with CUDA events over 20 repeats after 3 warm-up
    runs: seconds per pass and bytes moved per second (its operands read once, its output written once)."""
    torch, device = ctx["torch"], ctx["device"]
    dt = {name: getattr(torch, name) for name in ("float32", "bfloat16")}
    n = row["numel"]
    xs = [torch.randn(n, device=device).to(dt[d]) for d in row["reads"]]
    out = torch.empty(n, device=device, dtype=dt[row["writes"]])
    run = {"add": lambda: torch.add(xs[0], xs[1], out=out), "mul": lambda: torch.mul(xs[0], xs[1], out=out),
           "copy": lambda: out.copy_(xs[0]), "tanh": lambda: torch.tanh(xs[0], out=out),
           "sigmoid": lambda: torch.sigmoid(xs[0], out=out)}[row["op"]]
    nbytes = sum(x.numel() * x.element_size() for x in xs) + out.numel() * out.element_size()
    for _ in range(3):
        run()
    reps = 20
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(reps):
            run()
        end.record()
        torch.cuda.synchronize()
        seconds = start.elapsed_time(end) / 1e3 / reps
    else:
        t0 = time.perf_counter()
        for _ in range(reps):
            run()
        seconds = (time.perf_counter() - t0) / reps
    return {**row, "bytes": nbytes, "seconds": seconds, "bytes_per_s": nbytes / seconds}


def section_passes(ctx: dict) -> None:
    _fork_rows(ctx, PASS_ROWS, PASS_TINY, "passes.jsonl",
               lambda r: f"pass {r['op']} {'+'.join(r['reads'])}->{r['writes']} n={r['numel']}", pass_row)


# ---- the caching allocator's segments, phase by phase (issue 36: the reserved rows the replay misses)
# (model, micro-batch, length, precision, attention): BERT-base fp32 b8 x 128 is one ~120 MiB segment short on
# all four readings (step 2's forward takes a segment step 1 left none free for); GPT-2 AMP eager and the
# multimodal BERT AMP are 3-6 % short.
SEGMENT_ROWS = [{"model": "bert-base-uncased", "b": 8, "s": 128, "precision": "fp32", "attention": "sdpa"},
                {"model": "gpt2", "b": 8, "s": 1024, "precision": "amp-bf16", "attention": "eager"},
                {"model": "multimodal-bert", "b": 8, "s": 512, "precision": "amp-bf16", "attention": "sdpa"}]


def segments_now(torch: Any) -> list[list[Any]]:
    """Every segment the caching allocator holds: [bytes, bytes allocated in it, pool ("small"/"large"),
    its blocks' sizes, each negative when free] (torch.cuda.memory_snapshot; [] on the CPU)."""
    if not torch.cuda.is_available():
        return []
    return [[seg["total_size"], seg["allocated_size"], seg.get("segment_type", ""),
             [b["size"] if b["state"] == "active_allocated" else -b["size"] for b in seg["blocks"]]]
            for seg in sorted(torch.cuda.memory_snapshot(), key=lambda x: x["address"])]


class SegmentMeter(Meter):
    """A Meter whose every reading also lists the allocator's segments (`segments_now`)."""

    def read(self) -> dict[str, Any]:
        return {**super().read(), "segments": segments_now(self.torch)}


def segments_row(ctx: dict, row: dict) -> dict:
    """Two steps of `train_step` (its loss-only loop: `loss_fn` returns the loss alone, as in the held-out
    readings' steps), the segments after each phase: what the planner's allocator replay
    (planner.memory.allocator) is compared with segment by segment."""
    torch, device, spec = ctx["torch"], ctx["device"], ctx["specs"][row["model"]]
    model = build_catalog(spec, row["attention"], False, device)
    batch = catalog_batch(spec, row["b"], row["s"], device)
    opt = make_optimizer(torch, model.parameters(), "foreach")
    scaler = torch.amp.GradScaler() if row["precision"] == "amp-fp16" else None
    meter = SegmentMeter(torch, device)
    out: dict[str, Any] = {**row, "loop": "loss-only", "load": segments_now(torch)}
    for step in (1, 2):
        out[f"step{step}"] = train_step(torch, model, opt, batch, row["precision"], device, scaler, meter)
    return out


def section_segments(ctx: dict) -> None:
    _fork_rows(ctx, SEGMENT_ROWS, {"b": 2, "s": 16}, "segments.jsonl",
               lambda r: f"segments {r['model']} b{r['b']} s{r['s']} {r['precision']}", segments_row)


# The allocator's own record of two steps, for the check of the planner's allocator model against it
# (planner.memory.allocator_trace; benchmarks/memtrace_replay.py): the rows whose reserved the replays miss
# (BERT-base fp32 8 x 128: the per-block replay -4.7 %; Qwen2-0.5B 8 x 512: the traced replay -7.7 % fp32; QLoRA
# Llama-2-7B 4 x 512 with checkpointing -12 %).
MEMTRACE_ROWS = [{"model": "bert-base-uncased", "b": 8, "s": 128, "precision": "fp32", "attention": "sdpa"},
                 {"model": "gpt2", "b": 8, "s": 1024, "precision": "amp-bf16", "attention": "eager"},
                 {"model": "multimodal-bert", "b": 8, "s": 512, "precision": "amp-bf16", "attention": "sdpa"},
                 {"model": "qwen2-0.5b", "b": 8, "s": 512, "precision": "fp32", "attention": "sdpa", "hf": True},
                 {"model": "qwen2-0.5b", "b": 8, "s": 512, "precision": "amp-bf16", "attention": "sdpa",
                  "hf": True},
                 # QLoRA with checkpointing, the worst reserved miss (-12 %), and its bf16-base twin (+5 %): run by
                 # `lora_row` (its load path's empty_cache calls included: the check replays them)
                 {**LORA_ROWS[4], "precision": "amp-bf16", "attention": "sdpa"},
                 {**LORA_ROWS[1], "precision": "amp-bf16", "attention": "sdpa"}]
# torch's TraceEntry actions, one letter each in memtrace.jsonl (benchmarks/memtrace_replay.py reads them back)
TRACE_CODES = {"alloc": "a", "free_requested": "r", "free_completed": "c", "segment_alloc": "s",
               "segment_free": "f", "oom": "o", "snapshot": "n", "segment_map": "m", "segment_unmap": "u"}


def memtrace_row(ctx: dict, row: dict) -> dict:
    """`_memtrace_run` from an empty cache, with the caching allocator recording every action
    (`torch.cuda.memory._record_memory_history`, no stacks): each request's size and address, each free, each
    new segment, in order (`trace`: [letter, address, size]). On the CPU the rows run with no trace (a check of
    the section only)."""
    torch = ctx["torch"]
    cuda = torch.cuda.is_available() and str(ctx["device"]).startswith("cuda")
    clear(torch)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python",
                                                 max_entries=5_000_000)
    try:
        out = _memtrace_run(ctx, row)
        trace = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()] if cuda else []
        if cuda:
            out.update(max_reserved=torch.cuda.max_memory_reserved(), max_allocated=torch.cuda.max_memory_allocated())
    finally:
        if cuda:
            torch.cuda.memory._record_memory_history(enabled=None)
    return {**out, "loop": "loss-only",
            "trace": [[TRACE_CODES.get(e["action"], e["action"]), e.get("addr", 0), e.get("size", 0)] for e in trace]}


def _memtrace_run(ctx: dict, row: dict) -> dict:
    """A LoRA/QLoRA row: the whole of `lora_row` (build, quantize, peft, steps); any other: the model built
    and two steps of `train_step` (its loss-only loop)."""
    if row.get("name") in ("lora", "qlora"):
        return lora_row(ctx, row)
    torch, device = ctx["torch"], ctx["device"]
    if row.get("hf"):
        config = {**HF_CONFIGS[row["model"]], **(TINY_HF[row["model"]] if ctx["tiny"] else {})}
        model, conf = hf_build(config, row["attention"], device)
        batch = hf_batch(conf, row["b"], row["s"], device)
    else:
        spec = ctx["specs"][row["model"]]
        model = build_catalog(spec, row["attention"], False, device)
        batch = catalog_batch(spec, row["b"], row["s"], device)
    opt = make_optimizer(torch, model.parameters(), "foreach")
    scaler = torch.amp.GradScaler() if row["precision"] == "amp-fp16" else None
    for _ in (1, 2):
        train_step(torch, model, opt, batch, row["precision"], device, scaler)
    return {**row, "load": "direct"}


def section_memtrace(ctx: dict) -> None:
    _fork_rows(ctx, MEMTRACE_ROWS, {"b": 2, "s": 16}, "memtrace.jsonl",
               lambda r: f"memtrace {r.get('name', '')} {r['model']} b{r['b']} s{r['s']} {r['precision']}".replace(
                   "  ", " "), memtrace_row)


def section_xent(ctx: dict) -> None:
    _fork_rows(ctx, XENT_ROWS, XENT_TINY, "xent.jsonl",
               lambda r: f"xent {r['n']}x{r['V']} {r['precision']} upcast={r['upcast']}", xent_row)


def section_vocab(ctx: dict) -> None:
    _fork_rows(ctx, VOCAB_ROWS, TINY, "vocab.jsonl", lambda r: f"vocab {r['b']}x{r['s']} {r['precision']}", vocab_row)


def section_qlora_nockpt(ctx: dict) -> None:
    _fork_lora_rows(ctx, QLORA_NOCKPT_ROWS, "qlora_nockpt.jsonl",
                    lambda r: f"qlora_nockpt ckpt={r['ckpt']} b{r['b']}x{r['s']}")


def section_qlora_profile(ctx: dict) -> None:
    _fork_lora_rows(ctx, QLORA_PROFILE_ROWS, "qlora_profile.jsonl", lambda r: f"qlora_profile {r['base']} b{r['b']}")


def section_load(ctx: dict) -> None:
    _fork_lora_rows(ctx, LOAD_ROWS, "load.jsonl", lambda r: f"load {r['load_path']}")


# ---- loops
class StepClock:
    """Per-step peaks and wall time: `begin` at a step's start, `end` after its optimizer step."""

    def __init__(self, torch: Any, device: Any):
        self.meter, self.steps, self.t0 = Meter(torch, device), [], 0.0

    def begin(self) -> None:
        self.meter.reset()
        self.t0 = time.perf_counter()

    def end(self) -> None:
        reading = self.meter.read()
        self.steps.append({"step": len(self.steps) + 1, "time_s": time.perf_counter() - self.t0, **reading})


class LossModule:
    """A wrapper whose forward returns {"loss": ...} (what Trainer and Lightning take), built lazily so that
    torch.nn is imported only in the child."""

    @staticmethod
    def wrap(torch: Any, model: Any) -> Any:
        class Wrapped(torch.nn.Module):
            def __init__(self, inner: Any):
                super().__init__()
                self.inner = inner

            def forward(self, **batch: Any) -> dict:
                return {"loss": loss_fn(self.inner, batch)}

        return Wrapped(model)


def loop_dataset(spec: dict, b: int, s: int, steps: int) -> list[dict]:
    """steps * b samples of random token ids on the CPU, one dict per sample (collated by the loop)."""
    full = catalog_batch(spec, b * steps, s, "cpu")
    if "attention_mask" in full and b > 1 and s > 1:  # one padded position per batch, as make_batch makes
        full["attention_mask"][b - 1::b, -1] = 0
    return [{k: v[i] for k, v in full.items()} for i in range(b * steps)]


def loop_row(ctx: dict, loop: str, row: dict) -> dict:
    torch, device, spec = ctx["torch"], ctx["device"], ctx["specs"][row["model"]]
    b, s, n = row["b"], row["s"], row["steps"]
    clock = StepClock(torch, device)
    out: dict[str, Any] = {**row, "loop": loop, "base_used": clock.meter.used()}
    clock.meter.reset()
    model = build_catalog(spec, "sdpa", False, device)
    out["load"] = clock.meter.read()
    data = loop_dataset(spec, b, s, n)
    if loop == "plain":
        opt = make_optimizer(torch, model.parameters(), "foreach")
        phases = []
        for i in range(n):
            batch = {k: v.to(device) for k, v in torch.utils.data.default_collate(data[i * b:(i + 1) * b]).items()}
            clock.begin()
            phases.append(train_step(torch, model, opt, batch, row["precision"], device, None, clock.meter))
            clock.end()
            clock.steps[-1].update({k: max(p.get(k, 0) for p in phases[-1].values()) for k in ("max_alloc",
                                    "max_res")} if clock.meter.cuda else {})
            clock.steps[-1]["phases"] = phases[-1]
            del batch
        out["api"] = "torch loop: autocast bf16 forward, backward, AdamW(foreach) step, zero_grad(set_to_none)"
    elif loop == "hf-trainer":
        import tempfile

        import transformers

        class Reader(transformers.TrainerCallback):
            def on_step_begin(self, args, state, control, **kw):  # noqa: ANN001
                clock.begin()

            def on_step_end(self, args, state, control, **kw):  # noqa: ANN001
                clock.end()

        with tempfile.TemporaryDirectory() as tmp:
            args = transformers.TrainingArguments(
                output_dir=tmp, bf16=True, per_device_train_batch_size=b, max_steps=n, learning_rate=1e-5,
                eval_strategy="no", save_strategy="no", report_to="none", dataloader_num_workers=0,
                logging_strategy="no", disable_tqdm=True, remove_unused_columns=False, optim="adamw_torch",
                use_cpu=device.type == "cpu")
            trainer = transformers.Trainer(model=LossModule.wrap(torch, model), args=args, train_dataset=data,
                                           data_collator=torch.utils.data.default_collate, callbacks=[Reader()])
            trainer.train()
        out["api"] = (f"transformers {transformers.__version__} Trainer(bf16=True, optim=adamw_torch); peaks reset "
                      "in on_step_begin, read in on_step_end")
    elif loop == "accelerate":
        import accelerate

        acc = accelerate.Accelerator(mixed_precision="bf16", cpu=device.type == "cpu")
        opt = make_optimizer(torch, model.parameters(), "foreach")
        model, opt = acc.prepare(model, opt)
        for i in range(n):
            batch = {k: v.to(acc.device) for k, v in torch.utils.data.default_collate(data[i * b:(i + 1) * b]).items()}
            clock.begin()
            loss = loss_fn(model, batch)
            acc.backward(loss)
            opt.step()
            opt.zero_grad(set_to_none=True)
            clock.end()
            del loss, batch
        out["api"] = (f"accelerate {accelerate.__version__} Accelerator(mixed_precision='bf16'), prepare(model, "
                      "AdamW(foreach)), accelerator.backward")
    elif loop == "lightning":
        try:
            import lightning as L  # noqa: N812
        except ImportError:
            import pytorch_lightning as L  # noqa: N812

        inner = model

        class Module(L.LightningModule):
            def __init__(self):
                super().__init__()
                self.inner = inner

            def training_step(self, batch, idx):  # noqa: ANN001
                return loss_fn(self.inner, batch)

            def configure_optimizers(self):
                return make_optimizer(torch, self.parameters(), "foreach")

        class Reader(L.Callback):
            def on_train_batch_start(self, trainer, pl_module, batch, idx):  # noqa: ANN001
                clock.begin()

            def on_train_batch_end(self, trainer, pl_module, outputs, batch, idx):  # noqa: ANN001
                clock.end()

        loader = torch.utils.data.DataLoader(data, batch_size=b, num_workers=0)
        trainer = L.Trainer(precision="bf16-mixed", max_steps=n, logger=False, enable_checkpointing=False,
                            devices=1, accelerator="gpu" if device.type == "cuda" else "cpu", callbacks=[Reader()],
                            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
        trainer.fit(Module(), loader)
        out["api"] = (f"{L.__name__} {L.__version__} Trainer(precision='bf16-mixed'); peaks reset in "
                      "on_train_batch_start, read in on_train_batch_end (after the optimizer step)")
    out["steps"] = clock.steps
    out["step_time_s"] = statistics.median(x["time_s"] for x in clock.steps[1:]) if len(clock.steps) > 1 else None
    return out


def section_loops(ctx: dict) -> None:
    row = {**LOOP_ROW, **(TINY if ctx["tiny"] else {})}
    for loop in LOOPS:
        if loop == "lightning" and not any(_has(m) for m in ("lightning", "pytorch_lightning")):
            ctx["log"]("loops lightning: skipped (neither lightning nor pytorch_lightning is installed)")
            continue
        t0 = time.monotonic()
        ctx["fork"](f"loop {loop}", "loops.jsonl", {**row, "loop": loop}, lambda c, lp=loop: loop_row(c, lp, row), "")
        ctx["log"](f"  wall {time.monotonic() - t0:.1f}s")


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


# ---- FSDP on one GPU (issue 32)
def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def fsdp_row(ctx: dict, row: dict) -> dict:
    torch, device = ctx["torch"], ctx["device"]
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    config = {**FSDP_CONFIG, **(TINY_FSDP if ctx["tiny"] else {})}
    shape = {"b": 2, "s": 32} if ctx["tiny"] else FSDP_SHAPE
    backend = "nccl" if device.type == "cuda" else "gloo"
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    if device.type == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group(backend, rank=0, world_size=1)
    try:
        meter = Meter(torch, device)
        out: dict[str, Any] = {**row, **shape, "model": "llama-style", "llama_config": config, "backend": backend,
                               "checkpointing": FSDP_CKPT, "base_used": meter.used()}
        meter.reset()
        conf = LlamaConfig(**config, use_cache=False, attn_implementation="sdpa")
        base_dtype = torch.bfloat16 if row.get("lora") else torch.float32
        old = torch.get_default_dtype()
        torch.set_default_dtype(base_dtype)
        try:
            with torch.device(device):
                model = LlamaForCausalLM(conf).train()
        finally:
            torch.set_default_dtype(old)
        out["params"] = sum(p.numel() for p in model.parameters())
        out["build"] = meter.read()
        import modeling

        modeling.enable_checkpointing(model)
        if row.get("lora"):
            import peft

            model.enable_input_require_grads()
            model = peft.get_peft_model(model, peft.LoraConfig(
                r=16, lora_alpha=32, lora_dropout=0.05, bias="none", task_type="CAUSAL_LM",
                target_modules=LORA_TARGETS))
            out["trainable"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
            out["trainable_dtypes"] = sorted({str(p.dtype) for p in model.parameters() if p.requires_grad})
        layers = [m for m in model.modules() if type(m).__name__ == "LlamaDecoderLayer"]
        bf16 = torch.bfloat16
        if row["wrap"] == "fsdp2":
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            kwargs: dict[str, Any] = {"reshard_after_forward": row.get("reshard_after_forward", True)}
            if row["policy"]:
                kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=torch.float32)
            for layer in layers:
                fully_shard(layer, **kwargs)
            fully_shard(model, **kwargs)
            out["api"] = (f"torch {torch.__version__} torch.distributed.fsdp.fully_shard per LlamaDecoderLayer and "
                          f"root, reshard_after_forward={kwargs['reshard_after_forward']}, mp_policy="
                          + ("MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)" if row["policy"]
                             else "none"))
        elif row["wrap"] == "fsdp1":
            import functools

            from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision
            from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

            cls = type(layers[0])
            model = FullyShardedDataParallel(
                model, auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={cls}),
                mixed_precision=MixedPrecision(param_dtype=bf16, reduce_dtype=torch.float32, buffer_dtype=bf16),
                use_orig_params=True, device_id=torch.cuda.current_device() if device.type == "cuda" else None)
            out["api"] = (f"torch {torch.__version__} FullyShardedDataParallel(auto_wrap_policy="
                          "transformer_auto_wrap_policy({LlamaDecoderLayer}), MixedPrecision(param_dtype=bfloat16, "
                          "reduce_dtype=float32, buffer_dtype=bfloat16), use_orig_params=True)")
        else:
            out["api"] = f"torch {torch.__version__} plain module, fp32 parameters, torch.autocast(bfloat16)"
        out["load"] = meter.read()
        batch = {"input_ids": torch.randint(0, config["vocab_size"], (shape["b"], shape["s"]), device=device)}
        batch["labels"] = batch["input_ids"].clone()
        opt = make_optimizer(torch, [p for p in model.parameters() if p.requires_grad], "foreach")
        precision = "amp-bf16" if row["autocast"] else "fp32"
        out["step1"] = train_step(torch, model, opt, batch, precision, device, None, meter)
        out["step2"] = train_step(torch, model, opt, batch, precision, device, None, meter)
        times = timed(torch, lambda: train_step(torch, model, opt, batch, precision, device, None), 3, warmup=0)
        out["step_times_s"], out["step_time_s"] = times, statistics.median(times)
        # where FSDP's time goes (issue 36: the planner is 10-42 % fast on these rows): kernels, GPU-busy time
        # against the wall, ATen calls, and the costliest kernels (the copy-in/copy-out and casts among them)
        prof = profile_steps(torch, device, lambda: train_step(torch, model, opt, batch, precision, device, None), 2,
                             top=15)
        out.update({k: v for k, v in prof.items() if not k.startswith("bnb_")})
        return out
    finally:
        dist.destroy_process_group()


def section_fsdp(ctx: dict) -> None:
    for row in FSDP_ROWS:
        if row["wrap"] == "fsdp1" and ctx["device"].type != "cuda":
            ctx["log"](f"fsdp {row['variant']}: skipped on the CPU (FullyShardedDataParallel needs an accelerator)")
            continue
        t0 = time.monotonic()
        ctx["fork"](f"fsdp {row['variant']}", "fsdp.jsonl", row, lambda c, r=row: fsdp_row(c, r), "")
        ctx["log"](f"  wall {time.monotonic() - t0:.1f}s")


# ----------------------------------------------------------------------------------------- plumbing
def guarded(torch: Any, row: dict, fn: Any) -> dict:
    """A row's result, or its OOM / error as the result."""
    try:
        return {"status": "ok", **fn()}
    except Exception as exc:  # noqa: BLE001 - every failure is a reading
        oom = isinstance(exc, getattr(torch, "OutOfMemoryError", ())) or "out of memory" in str(exc)
        clear(torch)
        return {**row, "status": "oom" if oom else "error", "error": f"{type(exc).__name__}: {exc}"[:400],
                "trace": "" if oom else traceback.format_exc()[-1500:]}


SECTIONS = ("runs", "lora", "steps", "launch", "traced", "late", "vocab", "qlora_nockpt", "load", "loops", "fsdp",
            "qlora_profile", "xent", "passes", "segments", "memtrace")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("--out", default=".gpu/specs.json")
    r = sub.add_parser("run")
    r.add_argument("--specs", default=".gpu/specs.json")
    r.add_argument("--out", required=True)
    r.add_argument("--device", default="cuda")
    r.add_argument("--sections", default="runs,lora,steps,launch,traced")
    r.add_argument("--timed-steps", type=int, default=6)
    r.add_argument("--budget-s", type=float, default=420.0, help="skip what is left after this many seconds")
    args = ap.parse_args(argv)
    if args.cmd == "prepare":
        prepare(Path(args.out))
        return 0
    unknown = [n for n in args.sections.split(",") if n not in SECTIONS]
    if unknown:
        print(f"--sections: unknown {', '.join(unknown)}; allowed: {', '.join(SECTIONS)}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    logf = open(out / "log.txt", "a", buffering=1)  # noqa: SIM115 - kept open for the whole run

    def log(msg: str) -> None:
        line = f"[{time.monotonic() - start:6.1f}s] {msg}"
        print(line, flush=True)
        logf.write(line + "\n")

    import torch  # CUDA is not touched in this process before the forked sections

    data = json.loads(Path(args.specs).read_text())
    tiny = args.device == "cpu"
    device = torch.device(args.device)

    def rows(table: list[dict]) -> list[dict]:
        return [{**row, **TINY} for row in table] if tiny else table

    def emit_to(name: str) -> Any:
        def emit(obj: dict) -> None:
            with open(out / name, "a") as f:
                f.write(json.dumps(obj) + "\n")
            log(f"{name}: {obj.get('model')} {obj.get('status', '')} "
                f"{obj.get('error', '') or obj.get('step_time_s', '')}")
        return emit

    ctx: dict[str, Any] = {"torch": torch, "device": device, "specs": data["specs"], "tiny": tiny, "rows": rows,
                           "timed_steps": 2 if tiny else args.timed_steps}

    def fork(label: str, file: str, row: dict, fn: Any, alloc_conf: str) -> None:
        """Run fn(ctx) in a child process with its own allocator setting; its result is one line."""
        if time.monotonic() - start > args.budget_s:
            log(f"skipped (budget): {label}")
            return
        pid = os.fork()
        if pid == 0:  # child
            code = 0
            try:
                if alloc_conf:
                    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = alloc_conf
                emit_to(file)(guarded(torch, row, lambda: fn(ctx)))
            except BaseException:  # noqa: BLE001
                traceback.print_exc()
                code = 1
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        if status:
            log(f"{label}: child exited with status {status}")

    ctx["fork"] = fork
    ctx["log"] = log
    env = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": sys.version.split()[0]}
    from importlib import metadata

    # Versions read from the installed metadata, not by importing (bitsandbytes would start CUDA here).
    for mod in ("transformers", "peft", "bitsandbytes", "accelerate", "pytorch-lightning", "lightning"):
        try:
            env[mod] = metadata.version(mod)
        except metadata.PackageNotFoundError:
            env[mod] = "unavailable"
    env["sections"] = args.sections
    env.update(host_cpu())
    log(f"versions: {env}")

    def env_section(c: dict) -> dict:
        if device.type != "cuda":
            return {"device": "cpu"}
        props = torch.cuda.get_device_properties(0)
        torch.zeros(1, device=device)
        free, total = torch.cuda.mem_get_info()
        info = {"gpu": props.name, "total_memory": int(props.total_memory), "sm": props.multi_processor_count,
                "cc": f"{props.major}.{props.minor}", "used_after_init": int(total - free)}
        with contextlib.suppress(Exception):
            import subprocess

            info["nvidia_smi"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                 "--format=csv,noheader"], capture_output=True, text=True, timeout=20).stdout.strip()
        return info

    def write_env(c: dict) -> dict:
        info = {**env, **env_section(c)}
        (out / "env.json").write_text(json.dumps(info, indent=1))
        return info

    fork("env", "env.jsonl", {}, write_env, "")
    with contextlib.suppress(FileNotFoundError):
        (out / "env.jsonl").unlink()
    sections = {"runs": section_runs, "lora": section_lora, "late": section_late, "vocab": section_vocab,
                "qlora_nockpt": section_qlora_nockpt, "load": section_load, "loops": section_loops,
                "fsdp": section_fsdp, "qlora_profile": section_qlora_profile, "xent": section_xent,
                "passes": section_passes, "segments": section_segments, "memtrace": section_memtrace}
    in_child = {"steps": ("steps.jsonl", section_steps), "launch": ("launch.jsonl", section_launch),
                "traced": ("traced.jsonl", section_traced)}
    for name in args.sections.split(","):
        section_start = time.monotonic()
        log(f"section {name}")
        if name in sections:
            sections[name](ctx)
        elif name in in_child:
            file, fn = in_child[name]
            ctx_emit = emit_to(file)

            def whole(c, f=fn, e=ctx_emit):
                f({**c, "emit": lambda obj: e(obj) if time.monotonic() - start < args.budget_s + 60 else None})
                return {"section": "done"}
            fork(name, "sections.jsonl", {"section": name}, whole, "")
        log(f"section {name} wall {time.monotonic() - section_start:.1f}s")
    with contextlib.suppress(FileNotFoundError):
        (out / "sections.jsonl").unlink()
    log("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
