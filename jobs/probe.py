"""Measure what one training configuration really uses: the probe job.

Runs on the training machine (a SageMaker Deep Learning Container, a GPU box, or a laptop's CPU for the
tests) and needs only torch, transformers and `modeling.py` next to this file. It reads a request written
by `planner probe` (model spec, training config, the planner's predictions), builds exactly that model
with random weights, and runs warm-up plus a few real optimizer steps with the requested precision,
checkpointing, attention kernel, gradient accumulation, optimizer and parallelism. For every phase of
every step (load, forward, backward, optimizer) it records:

* `torch.cuda.max_memory_allocated` / `max_memory_reserved` (peaks reset before each phase),
* `torch.cuda.memory_allocated` / `memory_reserved` at the end of the phase,
* `torch.cuda.mem_get_info` (what the whole device shows: CUDA context and other processes included),
* wall time, and on CPU the process RSS.

It also counts bytes exactly by walking tensors (parameters, gradients, optimizer states) and the bytes
that autograd saves for backward (`torch.autograd.graph.saved_tensors_hooks`), which work on CPU too.

A CUDA out-of-memory error is a result (`status: "oom"` and the phase where it happened), not a crash.
The result is JSON, written to `--out` and to `$SM_OUTPUT_DATA_DIR/probe.json` on SageMaker, and key
figures are printed as `probe_<name>=<value>;` lines for SageMaker MetricDefinitions
(`planner/aws/launch.py` builds the matching regexes from the same names).

Usage:  python probe.py --request request.json --out probe.json
        (several GPUs with DDP/ZeRO/FSDP: the script re-launches itself under torchrun)
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SCHEMA = "planner.probe-result/1"
REQUEST_SCHEMA = "planner.probe-request/1"
# Names of the `probe_<name>=<value>;` lines; planner/aws/launch.py turns each into a MetricDefinition.
METRIC_NAMES: tuple[str, ...] = (
    "peak_allocated_bytes",
    "peak_reserved_bytes",
    "device_peak_bytes",
    "activation_bytes",
    "saved_tensor_bytes",
    "model_state_bytes",
    "first_step_time_s",
    "step_time_s",
    "samples_per_s",
    "tokens_per_s",
    "peak_rss_bytes",
    "oom",
)
STATUS_ORDER = ("ok", "unsupported", "error", "oom")  # worst last: used to merge ranks
DEFAULT_LR = 1e-4  # any small value: memory does not depend on it, and few steps never diverge
# The tests' switch: FP8 on a CPU through torch's CPU `_scaled_mm` (torchao recipes only), to check what an FP8
# step saves and holds without a GPU; never set on a training machine (its speed means nothing).
FP8_ON_CPU = "PLANNER_PROBE_FP8_ON_CPU"
GRAD_SCALER_INIT_SCALE = 2.0**12  # lower than PyTorch's 2**16 so random-init fp16 steps rarely overflow


class Unsupported(Exception):
    """The configuration cannot run here (missing package, needs more GPUs...): a result, not a crash."""


# --------------------------------------------------------------------------------------------- utils


def log(msg: str) -> None:
    print(f"[probe] {msg}", file=sys.stderr, flush=True)


def is_oom(exc: BaseException) -> bool:
    """CUDA OOM surfaces as torch.OutOfMemoryError, or as a RuntimeError from cuBLAS/cuDNN workspaces."""
    import torch

    if isinstance(exc, torch.OutOfMemoryError):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and (
        "out of memory" in text.lower() or "CUBLAS_STATUS_ALLOC_FAILED" in text
    )


def rss_bytes() -> int | None:
    """Current resident set size of this process (Linux /proc; None elsewhere)."""
    try:
        with open("/proc/self/statm") as fh:
            pages = int(fh.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def peak_rss_bytes() -> int | None:
    """Peak RSS since the process started (ru_maxrss is KiB on Linux, bytes on macOS)."""
    try:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(peak if sys.platform == "darwin" else peak * 1024)
    except (ImportError, OSError):
        return None


def local_tensor(t: Any) -> Any:
    """The shard this rank holds: FSDP2 parameters, gradients and states are DTensors."""
    return t.to_local() if hasattr(t, "to_local") else t


def tensor_bytes(t: Any) -> int:
    t = local_tensor(t)
    return int(t.numel() * t.element_size())


def tensor_key(t: Any) -> tuple[int, int] | None:
    """Identity of a tensor's bytes (views into one flat buffer, as FSDP2 makes, stay distinct)."""
    try:
        t = local_tensor(t)
        return (int(t.data_ptr()), int(t.numel()))
    except (RuntimeError, NotImplementedError, AttributeError):
        return None


def storage_ptr(t: Any) -> int | None:
    try:
        return int(local_tensor(t).untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError, AttributeError):
        return None


def _versions() -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                           "cuda": torch.version.cuda, "cudnn": None, "transformers": None,
                           "bitsandbytes": None, "nccl": None}
    with contextlib.suppress(Exception):
        out["cudnn"] = torch.backends.cudnn.version()
    with contextlib.suppress(Exception):
        import transformers

        out["transformers"] = transformers.__version__
    with contextlib.suppress(Exception):
        import bitsandbytes  # type: ignore[import-not-found]

        out["bitsandbytes"] = bitsandbytes.__version__
    for name, module in (("torchao", "torchao"), ("transformer_engine", "transformer_engine")):
        with contextlib.suppress(Exception):  # the FP8 libraries the image has (jobs/fp8_linears.py)
            import importlib

            out[name] = getattr(importlib.import_module(module), "__version__", "?")
    with contextlib.suppress(Exception):
        if torch.cuda.is_available():
            out["nccl"] = ".".join(str(x) for x in torch.cuda.nccl.version())
    return out


# --------------------------------------------------------------------------------------- request


def load_request(path_or_json: str) -> dict[str, Any]:
    """A request file path (relative to cwd or to this script) or the JSON text itself."""
    text = path_or_json.strip()
    if not text.startswith("{"):
        candidates = [Path(text), Path(__file__).resolve().parent / text]
        for p in candidates:
            if p.is_file():
                text = p.read_text()
                break
        else:
            raise FileNotFoundError(f"request file not found: {path_or_json}")
    request = json.loads(text)
    for key in ("model", "config"):
        if key not in request:
            raise ValueError(f"request has no '{key}' block")
    return request


@dataclass
class Plan:
    """What to run, resolved from the request and the machine."""

    precision: str
    optimizer: str
    optimizer_impl: str
    parallelism: str
    checkpointing: bool
    attention: str
    batch_size: int
    seq_len: int
    grad_accum: int
    world_size: int
    gpus_per_instance: int
    instances: int
    warmup_steps: int
    measure_steps: int
    lr: float
    seed: int
    gradient_as_bucket_view: bool = False
    bucket_cap_mb: float = 25.0
    tf32: bool = False  # fp32 matmuls on TF32 tensor cores (torch.backends.cuda.matmul.allow_tf32)
    # LoRA adapters on a frozen base (peft), base_dtype nf4 = QLoRA (bitsandbytes 4-bit); lora_r None: full
    lora_r: int | None = None
    lora_alpha: float | None = None
    lora_targets: tuple[str, ...] = ()
    lora_dropout: float = 0.0
    base_dtype: str = "auto"
    # planner --loop: whose tensor lifetimes the steps follow (planner/memory/loops.py); --load: the model
    # built in the dtype it trains in ("direct") or in fp32 and then cast ("cast")
    loop: str = "plain"
    load: str = "direct"
    # whose FSDP mixed precision runs (the planner's --framework): torchtitan = FSDP2 MixedPrecisionPolicy
    # (bf16 params, fp32 reduce, no autocast); accelerate = FSDP1 MixedPrecision (all 16-bit); lightning = FSDP1
    # MixedPrecision(param fp32, reduce 16-bit) + autocast; pytorch = autocast around FSDP2
    framework: str = "pytorch"
    extra: dict[str, Any] = field(default_factory=dict)
    # A run of varying lengths: step k's batch is padded to step_lengths[k] (one step per entry; warmup_steps
    # of them untimed). Empty: warmup_steps + measure_steps steps at seq_len.
    step_lengths: tuple[int, ...] = ()
    # tensor / pipeline / context parallelism or HSDP asked for: run by parallel_layout.py over a DeviceMesh
    model_parallel: bool = False
    recompute: str = "none"  # none, full (= checkpointing) or selective (not run by the probe)
    # precision fp8 (issue 35): the recipe (its library: fp8_linears.py) and FSDP2's FP8 all-gather (torchao)
    fp8_recipe: str | None = None
    fp8_param_gather: bool = False
    # FSDP's reshard after forward as the job sets it (the planner's --reshard-after-forward); None: FULL_SHARD /
    # fully_shard's default (True), False for ZeRO-2
    reshard_after_forward: bool | None = None
    # expert parallelism (issue 35): the probe runs every expert on each rank, ep = etp = 1
    ep: int = 1
    etp: int = 1

    @property
    def distributed(self) -> bool:
        return self.world_size > 1 and (self.model_parallel or
                                        self.parallelism in ("ddp", "zero1", "zero2", "zero3", "fsdp", "hsdp"))


# Loops that keep `out = model(**batch)` past the forward: plain (to the step's end), accelerate (to the next
# forward's end). hf-trainer, lightning and loss-only return only the loss from the forward's function.
HOLDS_OUTPUTS = ("plain", "accelerate")


def make_plan(request: dict[str, Any]) -> Plan:
    cfg = request["config"]
    instances = int(cfg.get("instances", 1) or 1)
    gpus = int(request.get("gpus_per_instance") or 1)
    world = int(request.get("world_size") or gpus * instances)
    parallelism = cfg.get("parallelism", "auto") or "auto"
    if parallelism == "auto":
        parallelism = "single" if world == 1 else "ddp"
    return Plan(
        precision=cfg.get("precision", "fp32"),
        optimizer=cfg.get("optimizer", "adamw"),
        optimizer_impl=cfg.get("optimizer_impl", "foreach"),
        parallelism=parallelism,
        # --recompute full is --checkpointing (per-layer activation checkpointing)
        checkpointing=bool(cfg.get("checkpointing", False)) or cfg.get("recompute") == "full",
        recompute=cfg.get("recompute") or "none",
        attention=cfg.get("attention", "sdpa"),
        batch_size=int(cfg["batch_size"]),
        seq_len=int(cfg["seq_len"]),
        grad_accum=int(cfg.get("grad_accum", 1) or 1),
        world_size=world,
        gpus_per_instance=gpus,
        instances=instances,
        warmup_steps=int(request.get("warmup_steps", 1)),
        measure_steps=max(1, int(request.get("measure_steps", 3))),
        lr=float(request.get("lr", DEFAULT_LR)),
        seed=int(request.get("seed", 0)),
        gradient_as_bucket_view=bool(cfg.get("gradient_as_bucket_view", False)),
        bucket_cap_mb=float(cfg.get("bucket_cap_mb", 25.0)),
        tf32=bool(cfg.get("tf32", False)),
        step_lengths=_step_lengths(request.get("step_lengths"), int(cfg["seq_len"])),
        lora_r=int(cfg["lora_r"]) if cfg.get("lora_r") else None,
        lora_alpha=float(cfg["lora_alpha"]) if cfg.get("lora_alpha") is not None else None,
        lora_targets=tuple(cfg.get("lora_targets") or ()),
        lora_dropout=float(cfg.get("lora_dropout") or 0.0),
        base_dtype=cfg.get("base_dtype") or "auto",
        loop=cfg.get("loop") or "plain",
        load=cfg.get("load") or "direct",
        framework=cfg.get("framework") or "pytorch",
        model_parallel=import_parallel_layout().requested(cfg),
        # the planner resolves the recipe (its default: tensorwise, delayed under megatron) into the config
        fp8_recipe=(cfg.get("fp8_recipe") or "tensorwise") if cfg.get("precision") == "fp8" else None,
        fp8_param_gather=bool(cfg.get("fp8_param_gather", False)),
        reshard_after_forward=(None if cfg.get("reshard_after_forward") is None
                               else bool(cfg["reshard_after_forward"])),
        ep=int(cfg.get("ep") or 1),
        etp=int(cfg.get("etp") or 1),
    )


def _step_lengths(value: Any, seq_len: int) -> tuple[int, ...]:
    """The request's per-step lengths: integers 1..seq_len (a bad list stops the job before any step)."""
    if not value:
        return ()
    if not isinstance(value, list | tuple) or not all(
            isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= seq_len for n in value):
        raise ValueError(f"step_lengths: a list of integers 1..{seq_len} (seq_len), got {str(value)[:80]}")
    return tuple(value)


# ------------------------------------------------------------------------------------- recorder


class Recorder:
    """Reads the allocator and the device after each phase; resets peaks before the next."""

    def __init__(self, device: Any, all_devices: list[Any] | None = None):
        import torch

        self.torch = torch
        self.device = device
        self.cuda = device.type == "cuda"
        self.all_devices = all_devices or [device]
        self.phases: list[dict[str, Any]] = []
        self._t0 = 0.0
        self._alloc_before = 0

    def sync(self) -> None:
        if self.cuda:
            for d in self.all_devices:
                self.torch.cuda.synchronize(d)

    def allocated(self) -> int | None:
        return int(self.torch.cuda.memory_allocated(self.device)) if self.cuda else None

    def begin(self) -> None:
        self.sync()
        if self.cuda:
            for d in self.all_devices:
                self.torch.cuda.reset_peak_memory_stats(d)
        self._alloc_before = self.allocated() or 0
        self._t0 = time.perf_counter()

    def end(self, phase: str, step: int, micro: int = 0, **extra: Any) -> dict[str, Any]:
        self.sync()
        elapsed = time.perf_counter() - self._t0
        row: dict[str, Any] = {"step": step, "micro": micro, "phase": phase, "time_s": elapsed,
                               "rss_bytes": rss_bytes(), "peak_rss_bytes": peak_rss_bytes()}
        if self.cuda:
            cuda = self.torch.cuda
            free, total = cuda.mem_get_info(self.device)
            row.update(
                allocated_before=self._alloc_before,
                allocated=int(cuda.memory_allocated(self.device)),
                reserved=int(cuda.memory_reserved(self.device)),
                peak_allocated=int(cuda.max_memory_allocated(self.device)),
                peak_reserved=int(cuda.max_memory_reserved(self.device)),
                device_used=int(total - free),
                device_total=int(total),
            )
            if len(self.all_devices) > 1:  # DataParallel: every replica's peak
                row["per_device_peak_allocated"] = [int(cuda.max_memory_allocated(d)) for d in self.all_devices]
                row["per_device_peak_reserved"] = [int(cuda.max_memory_reserved(d)) for d in self.all_devices]
        row.update(extra)
        self.phases.append(row)
        return row


class SavedTensorCounter:
    """Bytes autograd saves for backward, counted once per storage, parameters excluded.

    Counted in the pack hook of `saved_tensors_hooks`, so it sees exactly what autograd keeps (including
    dropout masks and softmax outputs); with checkpointing only what the checkpoint regions keep.
    """

    def __init__(self, model: Any):
        self.exclude = {storage_ptr(p) for p in model.parameters()} - {None}
        self.seen: set[tuple[int, str]] = set()
        self.bytes = 0
        self.count = 0

    def pack(self, t: Any) -> Any:
        try:
            st = t.untyped_storage()
            key = (st.data_ptr(), str(t.device))
        except (RuntimeError, NotImplementedError, AttributeError):
            return t
        if key[0] not in self.exclude and key not in self.seen:
            self.seen.add(key)
            self.bytes += int(st.nbytes())
            self.count += 1
        return t

    @staticmethod
    def unpack(t: Any) -> Any:
        return t


class ExpertRouting:
    """Tokens each expert of each mixture-of-experts layer received in one forward: a pre-hook on every experts
    module (transformers 5 calls `experts(hidden_states, top_k_index, top_k_weights)`), counting the routed
    indices. Its report gives the hottest expert's load over the mean per layer, what `--moe-imbalance` asks
    for when every expert is its own rank (ep = the experts)."""

    def __init__(self, model: Any):
        self.layers: dict[str, list[int]] = {}
        self.counting = False
        self._handles = []
        for name, module in model.named_modules():
            experts = getattr(module, "num_experts", None)
            if name.endswith("experts") and isinstance(experts, int) and not name.endswith("shared_experts"):
                self._handles.append(module.register_forward_pre_hook(self._hook(name, experts), with_kwargs=True))

    def _hook(self, name: str, experts: int) -> Any:
        def count(_module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            import torch

            if not self.counting:
                return
            index = next((a for a in (*args[1:], *kwargs.values()) if isinstance(a, torch.Tensor)
                          and not a.is_floating_point()), None)
            if index is not None:
                counts = torch.bincount(index.reshape(-1).long(), minlength=experts)[:experts].tolist()
                self.layers[name] = [a + b for a, b in zip(self.layers.get(name, [0] * experts), counts, strict=True)]
        return count

    def report(self) -> dict[str, Any]:
        loads = {name: max(c) / (sum(c) / len(c)) for name, c in self.layers.items() if sum(c)}
        return {"tokens_per_expert": self.layers, "hottest_over_mean": loads,
                "max_hottest_over_mean": max(loads.values()) if loads else None}

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self.counting = False


# ----------------------------------------------------------------------------------- the model


def import_modeling() -> Any:
    """`modeling.py` ships next to this file (planner packs both into the SageMaker source dir)."""
    here = str(Path(__file__).resolve().parent)
    if here not in sys.path:
        sys.path.insert(0, here)
    import modeling  # type: ignore[import-not-found]

    return modeling


def import_parallel_layout() -> Any:
    """`parallel_layout.py` ships next to this file, as `modeling.py` does."""
    here = str(Path(__file__).resolve().parent)
    if here not in sys.path:
        sys.path.insert(0, here)
    import parallel_layout  # type: ignore[import-not-found]

    return parallel_layout


def import_fp8_linears() -> Any:
    """`fp8_linears.py` (FP8 Linears by torchao or Transformer Engine) ships next to this file too."""
    here = str(Path(__file__).resolve().parent)
    if here not in sys.path:
        sys.path.insert(0, here)
    import fp8_linears  # type: ignore[import-not-found]

    return fp8_linears


def _hf_models(model: Any) -> list[Any]:
    """Top-most transformers PreTrainedModel instances inside `model` (itself included)."""
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover
        return []
    found: list[Any] = []
    for _, module in model.named_modules():
        if isinstance(module, PreTrainedModel) and not any(module is not f and _contains(f, module)
                                                            for f in found):
            found.append(module)
    return found


def _contains(parent: Any, child: Any) -> bool:
    return any(m is child for m in parent.modules())


ATTN_IMPL = {"eager": "eager", "sdpa": "sdpa", "flash": "flash_attention_2"}


def apply_attention(model: Any, attention: str) -> str:
    """Set the attention kernel on every HF model inside; returns what the model reports afterwards."""
    impl = ATTN_IMPL.get(attention, attention)
    applied = []
    for m in _hf_models(model):
        if attention == "auto":  # keep the kernel transformers chose by default; report it
            pass
        elif hasattr(m, "set_attn_implementation"):
            m.set_attn_implementation(impl)
        else:  # older transformers
            m.config._attn_implementation = impl
        applied.append(getattr(m.config, "_attn_implementation", impl))
    return ",".join(sorted(set(applied))) if applied else "n/a"


def apply_checkpointing(model: Any) -> list[str]:
    """Per-layer activation checkpointing on every HF model inside (the multimodal model: its BERT)."""
    done = []
    for m in _hf_models(model):
        if getattr(m, "supports_gradient_checkpointing", False):
            import_modeling().enable_checkpointing(m)
            done.append(type(m).__name__)
    if not done:
        raise Unsupported("checkpointing requested but the model has no transformers module that supports it")
    return done


def build(modeling: Any, spec: dict[str, Any], plan: Plan, device: Any) -> tuple[Any, dict[str, Any]]:
    """modeling.build_model on the target device, cast for pure fp16/bf16, kernel and checkpointing set."""
    import inspect

    import torch

    applied: dict[str, Any] = {}
    if plan.attention == "flash":
        try:
            import flash_attn  # type: ignore[import-not-found]  # noqa: F401
        except ImportError as exc:
            raise Unsupported("attention=flash needs the flash_attn package (FlashAttention-2, sm80+)") from exc
    takes_attention = "attention" in inspect.signature(modeling.build_model).parameters
    stored = stored_dtype(plan)
    old_default = torch.get_default_dtype()
    if plan.load == "direct" and stored is not None:  # built in the dtype it is stored in: nothing to cast
        torch.set_default_dtype(stored)
    try:
        with torch.device(device):
            model = (modeling.build_model(spec, attention=plan.attention) if takes_attention
                     else modeling.build_model(spec))
    finally:
        torch.set_default_dtype(old_default)
    applied["load"] = plan.load
    applied["loop"] = plan.loop
    model.to(device)
    if plan.precision in ("fp16", "bf16"):
        model.to(torch.float16 if plan.precision == "fp16" else torch.bfloat16)
    applied["attention"] = apply_attention(model, plan.attention)
    if plan.precision == "fp8":  # the decoder layers' Linears in FP8, before any wrapper (as torchtitan orders it)
        fp8 = import_fp8_linears()
        try:
            applied["fp8_context"], applied["fp8"] = fp8.convert(model, plan.fp8_recipe,
                                                                 param_gather=plan.fp8_param_gather)
        except fp8.Fp8Unavailable as exc:
            raise Unsupported(str(exc)) from exc
    applied["checkpointing"] = apply_checkpointing(model) if plan.checkpointing else []
    if plan.lora_r:
        model = apply_lora(model, spec, plan, device, applied)
    model.train()
    return model, applied


# ------------------------------------------------------------------------------------- LoRA / QLoRA


def ensure_packages(names: list[str]) -> None:
    """pip-install what a LoRA / QLoRA probe needs and the image lacks (peft; bitsandbytes for nf4)."""
    import importlib
    import subprocess

    missing = []
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    if missing:
        done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", *missing], check=False)
        if done.returncode != 0:
            raise Unsupported(f"LoRA needs {', '.join(missing)}; pip install failed here")


def quantize_4bit(model: Any, compute_dtype: Any, device: Any) -> int:
    """Replace the Linear/Conv1D modules transformers would quantize (all but the output embeddings and the
    last parameter's module: `get_keys_to_not_convert`) by bitsandbytes Linear4bit, NF4 with double
    quantization, as `from_pretrained(quantization_config=BitsAndBytesConfig(load_in_4bit=True, ...))` does."""
    import bitsandbytes as bnb  # type: ignore[import-not-found]
    import torch
    from transformers.integrations.bitsandbytes import should_convert_module
    from transformers.pytorch_utils import Conv1D
    from transformers.quantizers.base import get_keys_to_not_convert

    # + the classification heads, as QLoRA classification recipes pass llm_int8_skip_modules (peft's SEQ_CLS
    # trains the head in full, which a 4-bit head cannot be; planner.adapters.lora says the same)
    skip = get_keys_to_not_convert(model) + ["classifier", "score"]
    done = 0
    for name, sub in list(model.named_modules()):
        if not isinstance(sub, torch.nn.Linear | Conv1D) or not should_convert_module(name, skip):
            continue
        weight = (sub.weight.data.t() if isinstance(sub, Conv1D) else sub.weight.data).to(compute_dtype)
        new = bnb.nn.Linear4bit(weight.shape[1], weight.shape[0], sub.bias is not None, compute_dtype,
                                compress_statistics=True, quant_type="nf4")
        new.weight = bnb.nn.Params4bit(weight.cpu().contiguous(), requires_grad=False, compress_statistics=True,
                                       quant_type="nf4", blocksize=64)
        if sub.bias is not None:
            new.bias = torch.nn.Parameter(sub.bias.data.to(compute_dtype), requires_grad=False)
        model.set_submodule(name, new.to(device))  # .to(cuda) quantizes (Params4bit._quantize)
        done += 1
    return done


def stored_dtype(plan: Plan) -> Any:
    """The 16-bit dtype the parameters are stored in (pure fp16/bf16, or a LoRA base in bf16/fp16), None when
    they stay fp32 (fp32, AMP, nf4 quantizes from the fp32 build)."""
    import torch

    name = plan.precision if plan.precision in ("fp16", "bf16") else None
    if plan.lora_r and plan.base_dtype in ("bf16", "fp16"):
        name = plan.base_dtype
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(name or "")


def apply_lora(model: Any, spec: dict[str, Any], plan: Plan, device: Any, applied: dict[str, Any]) -> Any:
    """peft LoRA on a frozen base as planner models it: the base in --base-dtype (nf4: 4-bit, then
    prepare_model_for_kbit_training), adapters fp32 (get_peft_model's autocast_adapter_dtype), task SEQ_CLS
    for classification heads (the head trains in full), CAUSAL_LM for causal LMs."""
    import torch

    ensure_packages(["peft"] + (["bitsandbytes"] if plan.base_dtype == "nf4" else []))
    import peft  # type: ignore[import-not-found]

    low = {"amp-bf16": torch.bfloat16, "bf16": torch.bfloat16, "amp-fp16": torch.float16,
           "fp16": torch.float16}.get(plan.precision, torch.float32)
    if plan.base_dtype == "nf4":
        applied["quantized_modules"] = quantize_4bit(model, low, device)
        model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=plan.checkpointing)
    elif plan.base_dtype in ("bf16", "fp16"):
        model.to(torch.bfloat16 if plan.base_dtype == "bf16" else torch.float16)
    head = next((c for layer in _transformer_layers(spec) for c in [layer.get("head")]), None)
    task = {"causal-lm": "CAUSAL_LM", "sequence-classification": "SEQ_CLS"}.get(head or "")
    modules, parameters = _split_lora_targets(plan.lora_targets)
    targets: Any = modules or None
    if tuple(modules) == ("all-linear",):
        targets = "all-linear"
    config = peft.LoraConfig(r=plan.lora_r, lora_alpha=plan.lora_alpha if plan.lora_alpha is not None else 8,
                             lora_dropout=plan.lora_dropout, target_modules=targets, task_type=task,
                             **({"target_parameters": parameters} if parameters else {}))
    model = peft.get_peft_model(model, config)
    trainable, everything = model.get_nb_trainable_parameters()
    applied["lora"] = {"r": plan.lora_r, "targets": targets, "base_dtype": plan.base_dtype,
                       "trainable": trainable, "frozen": everything - trainable, "peft": peft.__version__}
    return model


# The planner's names for an MoE model's fused expert weights (planner.adapters.targets: "experts" is both);
# peft adapts them as `target_parameters` (ParamWrapper), matched by the parameter name's suffix.
EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")


def _split_lora_targets(targets: tuple[str, ...]) -> tuple[list[str], list[str]]:
    """(target_modules, target_parameters) of the planner's --lora-targets."""
    modules: list[str] = []
    parameters: list[str] = []
    for t in targets:
        if t == "experts":
            parameters += [f"experts.{w}" for w in EXPERT_WEIGHTS]
        elif any(t == f"experts.{w}" or t.endswith(f".experts.{w}") for w in EXPERT_WEIGHTS):
            parameters.append(t)
        else:
            modules.append(t)
    return modules, parameters


def _transformer_layers(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return [layer for c in spec.get("components", []) for layer in c.get("layers", [])
            if layer.get("kind") == "transformer"]


# ------------------------------------------------------------------------------------- optimizer


def _impl_kwargs(impl: str) -> dict[str, bool]:
    """foreach (PyTorch's default on CUDA), fused (one kernel), for-loop (one tensor at a time)."""
    if impl == "fused":
        return {"fused": True}
    return {"foreach": impl == "foreach"}


def make_optimizer(params: Any, plan: Plan, *, zero_redundancy: bool = False) -> Any:
    import torch

    name, impl = plan.optimizer, plan.optimizer_impl
    kwargs: dict[str, Any] = {"lr": plan.lr}
    if name in ("adamw", "adam"):
        cls = torch.optim.AdamW if name == "adamw" else torch.optim.Adam
        kwargs.update(_impl_kwargs(impl))
    elif name in ("sgd", "sgd-momentum"):
        cls = torch.optim.SGD
        kwargs["momentum"] = 0.9 if name == "sgd-momentum" else 0.0
        kwargs.update(_impl_kwargs(impl))
    elif name == "adafactor":
        from transformers.optimization import Adafactor

        cls = Adafactor
        kwargs = {"lr": plan.lr, "scale_parameter": False, "relative_step": False, "warmup_init": False}
    elif name == "adamw-8bit":
        try:
            import bitsandbytes as bnb  # type: ignore[import-not-found]
        except ImportError as exc:
            raise Unsupported("optimizer=adamw-8bit needs bitsandbytes, which is not installed here") from exc
        cls = bnb.optim.AdamW8bit
    else:
        raise Unsupported(f"optimizer={name!r} is not known to the probe")
    if zero_redundancy:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(params, optimizer_class=cls, **kwargs)
    return cls(params, **kwargs)


def optimizer_state_bytes(optimizer: Any, device: Any = None) -> tuple[int, int]:
    """(bytes on `device`, bytes elsewhere) of every tensor in optimizer.state (ZeRO-1: this rank's shard).

    Apart because PyTorch keeps Adam's `step` counters on the CPU unless fused/capturable: they cost no GPU
    memory.
    """
    import torch

    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer keeps the local one in .optim
    seen: set[tuple[int, int] | None] = set()
    on_device = elsewhere = 0
    for state in inner.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor) and v.device.type != "meta":
                key = tensor_key(v)
                if key is None or key not in seen:
                    seen.add(key)
                    if device is None or local_tensor(v).device == device:
                        on_device += tensor_bytes(v)
                    else:
                        elsewhere += tensor_bytes(v)
    return on_device, elsewhere


def _has_state(optimizer: Any) -> bool:
    inner = getattr(optimizer, "optim", optimizer)
    return any(len(s) > 0 for s in inner.state.values())


# ---------------------------------------------------------------------------------- distributed


def dist_env() -> tuple[int, int, int]:
    """(rank, local_rank, world_size) from torchrun's environment."""
    return (int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0)),
            int(os.environ.get("WORLD_SIZE", 1)))


def wrap_parallel(model: Any, plan: Plan, device: Any) -> tuple[Any, dict[str, Any]]:
    """DataParallel / DDP / FSDP as asked; ZeRO-1 is DDP plus a sharded optimizer (see make_optimizer)."""
    import torch

    info: dict[str, Any] = {"parallelism": plan.parallelism}
    p = plan.parallelism
    if plan.framework in ("megatron", "deepspeed"):
        raise Unsupported(f"framework={plan.framework}: the probe job runs PyTorch's own wrappers only")
    if p in ("single",) or (p == "dp" and plan.world_size == 1):
        return model, info
    if p == "dp":
        n = torch.cuda.device_count() if device.type == "cuda" else 0
        if n < plan.world_size:
            raise Unsupported(f"parallelism=dp needs {plan.world_size} GPUs in one process, found {n}")
        ids = list(range(plan.world_size))
        info["device_ids"] = ids
        return torch.nn.DataParallel(model, device_ids=ids), info
    if plan.world_size <= 1 or not torch.distributed.is_initialized():
        raise Unsupported(f"parallelism={p} needs world size > 1 under torchrun (world size {plan.world_size})")
    if p in ("ddp", "zero1"):
        from torch.nn.parallel import DistributedDataParallel as DDP

        kwargs: dict[str, Any] = {"gradient_as_bucket_view": plan.gradient_as_bucket_view,
                                  "bucket_cap_mb": plan.bucket_cap_mb}
        if device.type == "cuda":
            kwargs["device_ids"] = [device.index]
        return DDP(model, **kwargs), info
    # ZeRO-2 keeps parameters gathered between forward and backward; ZeRO-3/FSDP reshards after forward unless
    # the job says otherwise (fully_shard(reshard_after_forward=False); FSDP1 SHARD_GRAD_OP below).
    reshard = p != "zero2" if plan.reshard_after_forward is None else plan.reshard_after_forward
    layer_names: set[str] = set()
    for m in _hf_models(model):
        layer_names |= set(getattr(m, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in layer_names]
    info.update(reshard_after_forward=reshard, wrapped=sorted({type(m).__name__ for m in layers}))
    low = _low_dtype(plan)
    fsdp1 = plan.framework in ("accelerate", "lightning")
    try:  # FSDP2 (per-parameter DTensor sharding), PyTorch >= 2.6
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    except ImportError:
        fully_shard = None
    if fully_shard is not None and not fsdp1:
        kw: dict[str, Any] = {"reshard_after_forward": reshard}
        if plan.framework == "torchtitan" and low is not None:  # torchtitan's defaults: bf16 params, fp32 reduce
            kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32)
            info["mp_policy"] = f"param {low}, reduce float32"
        for m in layers:
            fully_shard(m, **kw)
        fully_shard(model, **kw)
        info["fsdp"] = "fully_shard (FSDP2)"
        return model, info
    if device.type != "cuda":
        raise Unsupported("FSDP1 needs a GPU")
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import MixedPrecision, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    strategy = ShardingStrategy.FULL_SHARD if reshard else ShardingStrategy.SHARD_GRAD_OP
    policy = ModuleWrapPolicy({type(m) for m in layers}) if layers else None
    mixed = None
    if low is not None and plan.framework == "accelerate":  # accelerate: param, reduce and buffers 16-bit
        mixed = MixedPrecision(param_dtype=low, reduce_dtype=low, buffer_dtype=low)
    elif low is not None and plan.framework == "lightning":  # Lightning bf16-mixed: fp32 params, 16-bit reduce
        mixed = MixedPrecision(param_dtype=torch.float32, reduce_dtype=low, buffer_dtype=low)
    info["fsdp"] = f"FullyShardedDataParallel ({strategy.name})" + (f", {mixed}" if mixed else "")
    return FSDP(model, sharding_strategy=strategy, use_orig_params=True, auto_wrap_policy=policy,
                device_id=device, mixed_precision=mixed), info


def _low_dtype(plan: Plan) -> Any:
    """The 16-bit dtype of an AMP precision (None otherwise)."""
    import torch

    return {"amp-bf16": torch.bfloat16, "amp-fp16": torch.float16, "fp8": torch.bfloat16}.get(plan.precision)


# ---------------------------------------------------------------------------------------- probe


@dataclass
class Ctx:
    plan: Plan
    device: Any
    rec: Recorder
    result: dict[str, Any]
    phase: str = "setup"


def _autocast(plan: Plan, device: Any) -> Any:
    import torch

    if plan.framework == "torchtitan" and plan.parallelism == "fsdp" and plan.world_size > 1:
        return contextlib.nullcontext()  # torchtitan's maybe_enable_amp: fully_shard's policy, no autocast

    if plan.precision == "amp-fp16":
        return torch.autocast(device_type=device.type, dtype=torch.float16)
    if plan.precision in ("amp-bf16", "fp8"):  # fp8: amp-bf16 with the layers' Linears in FP8 (planner.ir.fp8)
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _cast_batch(batch: dict[str, Any], plan: Plan) -> dict[str, Any]:
    """Pure fp16/bf16 models need floating inputs (tabular features) in their dtype."""
    import torch

    if plan.precision not in ("fp16", "bf16"):
        return batch
    dtype = torch.float16 if plan.precision == "fp16" else torch.bfloat16
    out = copy.copy(batch)  # keeps a dict subclass (modeling.UserBatch: the user's own batch) and its fields
    out.update({k: (v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
                for k, v in batch.items()})
    return out


def _native_bf16() -> bool:
    """bf16 in hardware (sm80+); PyTorch otherwise reports True for emulated bf16 (V100)."""
    import torch

    try:
        return bool(torch.cuda.is_bf16_supported(including_emulation=False))
    except TypeError:  # older PyTorch without the argument
        return torch.cuda.get_device_capability() >= (8, 0)


def _grad_bytes(model: Any) -> int:
    seen: set[tuple[int, int] | None] = set()
    total = 0
    for p in model.parameters():
        g = p.grad
        if g is not None:
            key = tensor_key(g)
            if key is None or key not in seen:
                seen.add(key)
                total += tensor_bytes(g)
    return total


def run_probe(request: dict[str, Any], *, modeling: Any = None, device: str | None = None) -> dict[str, Any]:
    """Run the request here; always returns a result dict (status ok / oom / unsupported / error)."""
    import torch

    started = time.time()
    plan = make_plan(request)
    rank, local_rank, env_world = dist_env()
    result: dict[str, Any] = {
        "schema": SCHEMA, "request_id": request.get("request_id"), "status": "ok", "phase": None,
        "message": None, "model": (request.get("model") or {}).get("name"), "config": request.get("config"),
        "instance": request.get("instance"), "world_size": plan.world_size,
        "gpus_per_instance": plan.gpus_per_instance, "rank": rank, "study": request.get("study"),
        "trial": request.get("trial"), "estimate": request.get("estimate"), "model_spec": request.get("model"),
        "versions": _versions(),
        "host": platform.node(), "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
    }
    if device is None:
        device = f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    result["device"] = dev.type
    if dev.type == "cuda":
        if not torch.cuda.is_available() or (dev.index or 0) >= torch.cuda.device_count():
            raise RuntimeError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA GPU(s) "
                               f"visible to torch {torch.__version__} (use --device cpu, or cuda:0..N-1)")
        torch.cuda.set_device(dev)
        props = torch.cuda.get_device_properties(dev)
        result.update(gpu_name=props.name, gpu_total_bytes=int(props.total_memory),
                      compute_capability=[props.major, props.minor], gpu_count=torch.cuda.device_count())
    else:
        result.update(gpu_name=None, gpu_total_bytes=None, compute_capability=None, gpu_count=0,
                      cpu=platform.processor() or platform.machine(), cpu_count=os.cpu_count())
    all_devices = [dev]
    if plan.parallelism == "dp" and dev.type == "cuda" and plan.world_size > 1:
        all_devices = [torch.device(f"cuda:{i}") for i in range(min(plan.world_size, torch.cuda.device_count()))]
    rec = Recorder(dev, all_devices)
    ctx = Ctx(plan, dev, rec, result)
    try:
        if plan.distributed and env_world != plan.world_size:
            raise Unsupported(f"parallelism={plan.parallelism} with world size {plan.world_size} must run under "
                              f"torchrun with WORLD_SIZE={plan.world_size} (found {env_world})")
        if plan.parallelism in ("zero1", "zero2", "zero3", "fsdp") and plan.world_size <= 1:
            raise Unsupported(f"parallelism={plan.parallelism} shards over GPUs: world size 1 has nothing to shard")
        if plan.precision == "fp8":  # a CPU or a GPU without FP8 tensor cores, or no library for the recipe
            fp8 = import_fp8_linears()
            cc = tuple(torch.cuda.get_device_capability(dev)) if dev.type == "cuda" else None
            try:
                if not (dev.type == "cpu" and os.environ.get(FP8_ON_CPU) == "1"):
                    fp8.check_device(plan.fp8_recipe, dev, cc)
                fp8.check_library(plan.fp8_recipe)
            except fp8.Fp8Unavailable as exc:
                raise Unsupported(str(exc)) from exc
        if plan.ep * plan.etp > 1:
            raise Unsupported(f"ep={plan.ep}, etp={plan.etp}: the probe runs every expert on each rank (ep 1); "
                              "expert parallelism is estimated, not probed")
        if plan.precision in ("amp-bf16", "bf16", "fp8") and dev.type == "cuda" and not _native_bf16():
            raise Unsupported(f"precision={plan.precision} needs a GPU with native bf16 (sm80+)")
        if plan.recompute == "selective":
            raise Unsupported("recompute=selective: the probe runs full per-layer checkpointing only "
                              "(--recompute full or --checkpointing)")
        if plan.attention == "flash" and dev.type == "cuda" and torch.cuda.get_device_capability(dev) < (8, 0):
            raise Unsupported("attention=flash (FlashAttention-2) needs sm80+")
        _train(ctx, request, modeling or import_modeling())
    except Unsupported as exc:
        result.update(status="unsupported", phase=ctx.phase, message=str(exc))
    except Exception as exc:  # noqa: BLE001 - every failure becomes a result
        if is_oom(exc):
            result.update(status="oom", phase=ctx.phase, message=str(exc).strip().splitlines()[0][:500])
        else:
            result.update(status="error", phase=ctx.phase, message=f"{type(exc).__name__}: {exc}"[:2000],
                          traceback=traceback.format_exc()[-4000:])
    finally:
        gc.collect()
        if dev.type == "cuda":
            with contextlib.suppress(Exception):
                torch.cuda.empty_cache()
    result["phases"] = rec.phases
    result["summary"] = summarize(result, plan)
    result["duration_s"] = time.time() - started
    return result


def _train(ctx: Ctx, request: dict[str, Any], modeling: Any) -> None:
    import torch

    plan, dev, rec, result = ctx.plan, ctx.device, ctx.rec, ctx.result
    torch.manual_seed(plan.seed)
    # Set either way: a container or an earlier probe in this process may have changed PyTorch's default (off).
    torch.backends.cuda.matmul.allow_tf32 = plan.tf32
    spec = request["model"]
    if plan.model_parallel:
        _train_layout(ctx, request, modeling)
        return

    # ---- load: model, wrapper, optimizer, batch ------------------------------------------------
    ctx.phase = "load"
    rec.begin()
    model, applied = build(modeling, spec, plan, dev)
    fp8_context = applied.pop("fp8_context", contextlib.nullcontext)  # TE's FP8 autocast; torchao needs none
    routing = ExpertRouting(model)
    n_params = sum(p.numel() for p in model.parameters())
    param_bytes = sum(tensor_bytes(p) for p in model.parameters())
    buffer_bytes = sum(tensor_bytes(b) for b in model.buffers())
    wrapped, par_info = wrap_parallel(model, plan, dev)
    applied.update(par_info)
    optimizer = make_optimizer(wrapped.parameters(), plan, zero_redundancy=plan.parallelism == "zero1")
    applied["optimizer"] = type(optimizer).__name__ + (
        f"({type(optimizer.optim).__name__})" if hasattr(optimizer, "optim") else "")
    scaler = None
    if plan.precision == "amp-fp16":
        scaler = torch.amp.GradScaler(dev.type, init_scale=GRAD_SCALER_INIT_SCALE)
    applied.update(autocast={"amp-fp16": "float16", "amp-bf16": "bfloat16"}.get(plan.precision),
                   grad_scaler=scaler is not None, tf32_matmul=torch.backends.cuda.matmul.allow_tf32,
                   model_dtype=str(next(model.parameters()).dtype).replace("torch.", ""))
    per_process_batch = plan.batch_size * (plan.world_size if plan.parallelism == "dp" else 1)
    batch = _cast_batch(modeling.make_batch(spec, per_process_batch, plan.seq_len, dev), plan)
    batch_bytes = sum(tensor_bytes(v) for v in batch.values() if isinstance(v, torch.Tensor))
    rec.end("load", step=-1)
    local_param_bytes = sum(tensor_bytes(p) for p in wrapped.parameters())  # FSDP: this rank's shards
    result["applied"] = applied
    result["tensors"] = {"parameter_count": int(n_params), "parameters_bytes": int(param_bytes),
                         "local_parameters_bytes": int(local_param_bytes), "buffers_bytes": int(buffer_bytes),
                         "batch_bytes": int(batch_bytes), "gradients_bytes": None,
                         "optimizer_state_bytes": None, "saved_tensor_bytes": None, "saved_tensor_count": None}

    # ---- steps --------------------------------------------------------------------------------
    total_steps = len(plan.step_lengths) or plan.warmup_steps + plan.measure_steps
    held: list[Any] = []  # the model outputs the loop still holds (planner/memory/loops.py)
    step_times: list[float] = []
    states_step = None
    if plan.step_lengths:  # a run of varying lengths: each step's batch made at its length, freed after it
        del batch
        result["step_lengths"] = list(plan.step_lengths)
    for step in range(total_steps):
        if plan.step_lengths:
            batch = _cast_batch(modeling.make_batch(spec, per_process_batch, plan.step_lengths[step], dev), plan)
        t_step = time.perf_counter()
        for micro in range(plan.grad_accum):
            last_micro = micro == plan.grad_accum - 1
            sync_ctx = contextlib.nullcontext()
            if not last_micro and hasattr(wrapped, "no_sync"):
                sync_ctx = wrapped.no_sync()  # DDP/FSDP1: all-reduce only on the last micro-step
            if hasattr(wrapped, "set_requires_gradient_sync"):  # FSDP2: reduce-scatter only on the last
                wrapped.set_requires_gradient_sync(last_micro)
            with sync_ctx:
                ctx.phase = "forward"
                counter = SavedTensorCounter(model) if (step == 0 and micro == 0) else None
                rec.begin()
                hooks = (torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack) if counter
                         else contextlib.nullcontext())
                routing.counting = counter is not None  # the first micro-step's routing
                with hooks, _autocast(plan, dev), fp8_context():
                    if plan.loop in HOLDS_OUTPUTS and hasattr(modeling, "outputs_and_loss"):
                        out, loss = modeling.outputs_and_loss(wrapped, batch)
                    else:  # the loop's forward returns only the loss: the outputs die here
                        out, loss = None, modeling.loss_of(wrapped, batch)
                    if loss.dim() > 0:  # DataParallel gathers one loss per replica
                        loss = loss.mean()
                    loss = loss / plan.grad_accum
                held[:] = [out]  # accelerate: rebinding frees the previous step's outputs only now
                del out
                rec.end("forward", step, micro, loss=float(loss.detach().float().item()),
                        **({"seq_len": plan.step_lengths[step]} if plan.step_lengths else {}))
                if counter is not None:
                    result["tensors"].update(saved_tensor_bytes=counter.bytes, saved_tensor_count=counter.count)
                    if routing.layers:
                        result["experts"] = routing.report()
                    routing.close()
                if plan.loop == "lightning" and micro == 0:  # Closure: training_step, zero_grad, backward
                    optimizer.zero_grad(set_to_none=True)
                ctx.phase = "backward"
                rec.begin()
                (scaler.scale(loss) if scaler is not None else loss).backward()
                del loss
                rec.end("backward", step, micro)
        if step == 0:
            result["tensors"]["gradients_bytes"] = _grad_bytes(wrapped)
        ctx.phase = "optimizer"
        rec.begin()
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        had_state = _has_state(optimizer)
        alloc_after_step = rec.allocated()
        if plan.loop != "lightning":  # (Lightning zeroes them after the next forward)
            optimizer.zero_grad(set_to_none=True)
        if plan.loop == "plain":
            held.clear()  # `out` held until the step ends
        rec.end("optimizer", step, allocated_after_step=alloc_after_step, optimizer_state=had_state)
        if had_state and states_step is None:
            states_step = step
            on_dev, host = optimizer_state_bytes(optimizer, dev)
            result["tensors"].update(optimizer_state_bytes=on_dev, optimizer_state_host_bytes=host)
        if plan.step_lengths:
            del batch
        rec.sync()
        step_times.append(time.perf_counter() - t_step)
    result["step_times_s"] = step_times
    result["optimizer_states_from_step"] = states_step
    if states_step is None:
        on_dev, host = optimizer_state_bytes(optimizer, dev)
        result["tensors"].update(optimizer_state_bytes=on_dev, optimizer_state_host_bytes=host)
    ctx.phase = "done"


# --------------------------------------------------------------------------- model-parallel layouts


def _train_layout(ctx: Ctx, request: dict[str, Any], modeling: Any) -> None:
    """Tensor / sequence / pipeline parallelism with FSDP2 or DDP over a DeviceMesh (parallel_layout.py).

    The model is built whole on every rank from the same seed (so the same weights as a one-process probe of
    the same request), then split into this rank's pipeline stages and sharded. The batch holds
    batch_size × micro-batches rows of input_ids and labels (no padding: every position is real, as in
    pretraining); the pipeline schedule cuts it into micro-batches of batch_size. Without PP, grad_accum
    micro-steps run on the same batch as the one-process probe does. Phases: load, then per step forward and
    backward (no PP) or `pipeline` (the schedule interleaves them), then optimizer.
    """
    import torch

    pl = import_parallel_layout()
    plan, dev, rec, result = ctx.plan, ctx.device, ctx.rec, ctx.result
    cfg, spec = request["config"], request["model"]
    try:
        layout = pl.layout_of(cfg, plan.world_size, request.get("stage_layers") or ())
    except pl.LayoutError as exc:
        raise Unsupported(str(exc)) from exc
    if plan.precision in ("fp16", "amp-fp16"):
        raise Unsupported(f"precision={plan.precision} with tp/pp: the probe runs fp32, bf16 and amp-bf16 layouts "
                          "(no gradient scaler across pipeline stages)")
    if plan.lora_r or plan.framework in ("megatron", "deepspeed"):
        raise Unsupported("LoRA and the megatron/deepspeed frameworks have no model-parallel probe")
    if plan.precision == "fp8":
        raise Unsupported("precision=fp8 with tp/pp: the probe runs FP8 with data parallelism only (ddp, fsdp)")
    if plan.step_lengths:
        raise Unsupported("a run of varying lengths (step_lengths) has no model-parallel probe")
    if not torch.distributed.is_initialized():
        raise Unsupported(f"tp/pp layouts run under torchrun with {plan.world_size} processes")
    n_micro = pl.microbatches(cfg, layout, plan.batch_size) if layout.pp > 1 else 1
    accum = 1 if layout.pp > 1 else plan.grad_accum

    # "meta": built on the meta device and each rank materialises only its shards (a model larger than one GPU);
    # "full": built whole from the seed on every rank, then split (the weights of a one-process probe)
    init = os.environ.get("PLANNER_PROBE_INIT") or ("meta" if dev.type == "cuda" else "full")
    if init not in ("meta", "full"):
        raise Unsupported(f"PLANNER_PROBE_INIT={init}: meta or full")

    ctx.phase = "load"
    rec.begin()
    model, applied = build(modeling, spec, plan, torch.device("meta") if init == "meta" else dev)
    n_params = sum(p.numel() for p in model.parameters())
    std = float(getattr(getattr(model, "config", None), "initializer_range", None) or 0.02)
    try:
        parallel = pl.parallelize(model, layout, dev, attention=plan.attention, n_microbatches=n_micro)
    except pl.LayoutError as exc:
        raise Unsupported(str(exc)) from exc
    del model  # the other stages' layers go with it
    gc.collect()
    if init == "meta":
        pl.materialize(parallel, dev, std=std, seed=plan.seed)
    applied["init"] = init
    params = parallel.parameters()
    optimizer = make_optimizer(params, plan)
    full = modeling.make_batch(spec, plan.batch_size * n_micro, plan.seq_len, dev)
    batch = {"input_ids": full["input_ids"], "labels": full["labels"]}
    rec.end("load", step=-1)
    applied.update(parallelism=plan.parallelism, optimizer=type(optimizer).__name__,
                   autocast="bfloat16" if plan.precision == "amp-bf16" else None,
                   model_dtype=str(params[0].dtype).replace("torch.", ""), layout=parallel.info)
    result["applied"] = applied
    result["layout"] = {**layout.to_json(), "world": layout.world, "dp": layout.dp, **parallel.info,
                        "samples_per_step": plan.batch_size * n_micro * accum * layout.dp}
    result["tensors"] = {"parameter_count": int(n_params),
                         "local_parameter_count": pl.local_parameter_count(parallel),
                         "parameters_bytes": None,
                         "local_parameters_bytes": int(sum(tensor_bytes(p) for p in params)),
                         "buffers_bytes": int(sum(tensor_bytes(b) for s in parallel.stages for b in s.buffers())),
                         "batch_bytes": int(sum(tensor_bytes(v) for v in batch.values())),
                         "gradients_bytes": None, "optimizer_state_bytes": None, "saved_tensor_bytes": None,
                         "saved_tensor_count": None}
    losses: list[float | None] = []
    step_times: list[float] = []
    for step in range(plan.warmup_steps + plan.measure_steps):
        t_step = time.perf_counter()
        if parallel.schedule is not None:
            ctx.phase = "pipeline"
            rec.begin()
            with _autocast(plan, dev):
                loss_value = pl.pipeline_step(parallel, batch)
            rec.end("pipeline", step, loss=loss_value)
        else:
            total = 0.0
            for micro in range(accum):
                for stage in parallel.stages:  # FSDP2: reduce-scatter on the last micro-step only
                    if hasattr(stage, "set_requires_gradient_sync"):
                        stage.set_requires_gradient_sync(micro == accum - 1)
                ctx.phase = "forward"
                rec.begin()
                with pl.loss_context(layout.tp > 1):
                    with _autocast(plan, dev):
                        loss = pl.forward_loss(parallel, batch) / accum
                    rec.end("forward", step, micro, loss=float(pl.scalar(loss).item()) * accum)
                    ctx.phase = "backward"
                    rec.begin()
                    loss.backward()
                total += float(pl.scalar(loss).item())
                del loss
                rec.end("backward", step, micro)
            loss_value = total
        pl.all_reduce_gradients(parallel)
        if step == 0:
            result["tensors"]["gradients_bytes"] = int(sum(tensor_bytes(p.grad) for p in params
                                                           if p.grad is not None))
        ctx.phase = "optimizer"
        rec.begin()
        optimizer.step()
        alloc_after_step = rec.allocated()
        optimizer.zero_grad(set_to_none=True)
        rec.end("optimizer", step, allocated_after_step=alloc_after_step, optimizer_state=_has_state(optimizer))
        if step == 0:
            on_dev, host = optimizer_state_bytes(optimizer, dev)
            result["tensors"].update(optimizer_state_bytes=on_dev, optimizer_state_host_bytes=host)
        rec.sync()
        step_times.append(time.perf_counter() - t_step)
        losses.append(loss_value)
    result["losses"] = losses
    result["step_times_s"] = step_times
    result["optimizer_states_from_step"] = 0
    ctx.phase = "done"


# ------------------------------------------------------------------------------------- summary


def _max(rows: list[dict[str, Any]], key: str) -> int | None:
    vals = [r[key] for r in rows if r.get(key) is not None]
    return max(vals) if vals else None


def summarize(result: dict[str, Any], plan: Plan) -> dict[str, Any]:
    """The figures `planner validate` compares, computed from the phase rows.

    activations = allocated after forward - allocated before it, in the last step (its first micro-step):
    by then gradients are freed (zero_grad(set_to_none=True)) and optimizer states exist, so the delta is
    what the forward keeps for backward plus its outputs. model states = allocated right after the first
    optimizer step that created states, before zero_grad: parameters + gradients + optimizer states (+ the
    batch). cuda context = device used - reserved, read at the same instant.
    """
    rows = result.get("phases") or []
    steps = [r for r in rows if r["step"] >= 0]
    s: dict[str, Any] = {"peak_allocated": _max(rows, "peak_allocated"), "peak_reserved": _max(rows, "peak_reserved"),
                         "device_peak": _max(rows, "device_used"), "device_total": _max(rows, "device_total"),
                         "peak_rss_bytes": _max(rows, "peak_rss_bytes")}
    by_phase: dict[str, int | None] = {}
    for phase in ("load", "forward", "backward", "optimizer") + (("pipeline",) if result.get("layout") else ()):
        by_phase[phase] = _max([r for r in rows if r["phase"] == phase], "peak_allocated")
    s["phase_peak_allocated"] = by_phase
    s["peak_phase"] = (max((p for p in by_phase if by_phase[p] is not None), key=lambda p: by_phase[p] or 0)
                       if any(v is not None for v in by_phase.values()) else None)
    fwd = [r for r in steps if r["phase"] == "forward" and r["micro"] == 0 and r.get("allocated") is not None]
    s["activations"] = (fwd[-1]["allocated"] - fwd[-1]["allocated_before"]) if fwd else None
    s["activations_first_step"] = (fwd[0]["allocated"] - fwd[0]["allocated_before"]) if fwd else None
    opt = [r for r in steps if r["phase"] == "optimizer"]
    with_state = [r for r in opt if r.get("optimizer_state")] or opt  # plain SGD keeps no state at all
    s["model_states_after_first_step"] = with_state[0].get("allocated_after_step") if with_state else None
    first = [r for r in steps if r["step"] == 0]
    later = [r for r in steps if r["step"] >= max(1, plan.warmup_steps)]
    s["first_step_peak_allocated"] = _max(first, "peak_allocated")
    s["steady_peak_allocated"] = _max(later, "peak_allocated")
    last = rows[-1] if rows else {}
    if last.get("device_used") is not None:
        s["cuda_context"] = last["device_used"] - last["reserved"]
        s["fragmentation"] = (s["peak_reserved"] / s["peak_allocated"] - 1) if s["peak_allocated"] else None
    else:
        s["cuda_context"] = s["fragmentation"] = None
    tensors = result.get("tensors") or {}
    s["saved_tensor_bytes"] = tensors.get("saved_tensor_bytes")
    s["model_state_bytes"] = (sum(tensors.get(k) or 0 for k in ("local_parameters_bytes", "gradients_bytes",
                                                                 "optimizer_state_bytes"))
                              if tensors.get("gradients_bytes") is not None else None)
    times = result.get("step_times_s") or []
    s["first_step_time_s"] = times[0] if times else None
    steady = times[plan.warmup_steps:] or times[1:] or times
    # a run of varying lengths: the mean step (its steps differ by design); fixed length: the median
    average = statistics.mean if result.get("step_lengths") else statistics.median
    s["step_time_s"] = average(steady) if steady else None
    samples = plan.batch_size * plan.grad_accum * plan.world_size
    if result.get("layout"):  # model parallelism: only the data-parallel ranks see different samples
        samples = result["layout"]["samples_per_step"]
    lengths = result.get("step_lengths") or []
    steady_lengths = lengths[plan.warmup_steps:] or lengths
    mean_length = statistics.mean(steady_lengths) if steady_lengths else plan.seq_len
    if lengths:  # a run: the padded length of each step and the step that reached the reserved peak
        s["step_lengths"] = lengths
        s["run_peak_reserved"] = s["peak_reserved"]
    if s["step_time_s"]:
        s["samples_per_s"] = samples / s["step_time_s"]
        s["tokens_per_s"] = s["samples_per_s"] * mean_length
    else:
        s["samples_per_s"] = s["tokens_per_s"] = None
    s["global_batch_size"] = samples
    s["oom"] = 1 if result.get("status") == "oom" else 0
    losses = [x for x in result.get("losses") or [] if x is not None]
    if losses:  # model-parallel layouts: each step's loss where this rank computes it
        s["first_loss"], s["last_loss"] = losses[0], losses[-1]
    return s


def metric_lines(result: dict[str, Any]) -> list[str]:
    """`probe_<name>=<value>;` for SageMaker MetricDefinitions (numbers only; missing ones skipped)."""
    s = result.get("summary") or {}
    values = {
        "peak_allocated_bytes": s.get("peak_allocated"), "peak_reserved_bytes": s.get("peak_reserved"),
        "device_peak_bytes": s.get("device_peak"), "activation_bytes": s.get("activations"),
        "saved_tensor_bytes": s.get("saved_tensor_bytes"), "model_state_bytes": s.get("model_state_bytes"),
        "first_step_time_s": s.get("first_step_time_s"), "step_time_s": s.get("step_time_s"),
        "samples_per_s": s.get("samples_per_s"), "tokens_per_s": s.get("tokens_per_s"),
        "peak_rss_bytes": s.get("peak_rss_bytes"), "oom": s.get("oom", 0),
    }
    assert set(values) == set(METRIC_NAMES)
    lines = []
    for name in METRIC_NAMES:
        v = values[name]
        if isinstance(v, int | float) and math.isfinite(v):
            lines.append(f"probe_{name}={v:.6g};" if isinstance(v, float) else f"probe_{name}={v};")
    return lines


# ----------------------------------------------------------------------------------- launching


def merge_ranks(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One result from every rank's: rank 0's figures, the worst status, every rank's peaks."""
    if not results:
        raise ValueError("no rank results")
    results = sorted(results, key=lambda r: r.get("rank", 0))
    worst = max(results, key=lambda r: STATUS_ORDER.index(r.get("status", "error")))
    base = dict(results[0]) if worst.get("status") == results[0].get("status") else dict(worst)
    base["status"] = worst.get("status")
    if base is not worst and worst.get("status") != "ok":
        base.update(phase=worst.get("phase"), message=f"rank {worst.get('rank')}: {worst.get('message')}")
    base["ranks"] = [_rank_row(r) for r in results]
    summary = base.setdefault("summary", {})
    for key in ("peak_allocated", "peak_reserved"):
        peaks = [x[key] for x in base["ranks"] if x[key] is not None]
        if peaks:
            summary[f"max_rank_{key}"] = max(peaks)
    with_loss = [r for r in results if r.get("losses") and any(x is not None for x in r["losses"])]
    if with_loss and not any(x is not None for x in base.get("losses") or []):
        # a pipeline: the loss lives on the last stage's ranks
        base["losses"] = with_loss[0]["losses"]
        for key in ("first_loss", "last_loss"):
            summary[key] = (with_loss[0].get("summary") or {}).get(key)
    return base


def _rank_row(r: dict[str, Any]) -> dict[str, Any]:
    """One rank's reading in the merged result: its peaks, and under a model-parallel layout its place in
    the mesh, its stages, the parameters it holds, its step time and losses."""
    s = r.get("summary") or {}
    row = {"rank": r.get("rank"), "status": r.get("status"), "phase": r.get("phase"),
           "peak_allocated": s.get("peak_allocated"), "peak_reserved": s.get("peak_reserved"),
           "device_peak": s.get("device_peak")}
    layout = r.get("layout")
    if layout:
        tensors = r.get("tensors") or {}
        row.update(coordinates=layout.get("coordinates"), stages=layout.get("stages"),
                   stage_layers=layout.get("stage_layers"),
                   local_parameter_count=tensors.get("local_parameter_count"),
                   local_parameters_bytes=tensors.get("local_parameters_bytes"),
                   gradients_bytes=tensors.get("gradients_bytes"),
                   optimizer_state_bytes=tensors.get("optimizer_state_bytes"),
                   step_time_s=s.get("step_time_s"), peak_rss_bytes=s.get("peak_rss_bytes"),
                   losses=r.get("losses"))
    return row


def torchrun_command(script: str, request_arg: str, out: str, nproc: int, *, nnodes: int = 1,
                     node_rank: int = 0, master_addr: str = "127.0.0.1", master_port: int = 29500,
                     device: str | None = None) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--nnodes={nnodes}",
           f"--node_rank={node_rank}", f"--master_addr={master_addr}", f"--master_port={master_port}",
           script, "--request", request_arg, "--out", out, "--rank-output"]
    return cmd + (["--device", device] if device else [])


def launch_distributed(request_arg: str, request: dict[str, Any], out: Path,
                       device: str | None = None) -> dict[str, Any] | None:
    """Re-run this script under torchrun (one process per GPU, and per node on SageMaker). None on the
    nodes after the first, whose ranks global rank 0 gathered and wrote on the first node."""
    plan = make_plan(request)
    hosts = json.loads(os.environ.get("SM_HOSTS", "[]") or "[]")
    current = os.environ.get("SM_CURRENT_HOST")
    nnodes, node_rank, master = 1, 0, "127.0.0.1"
    if len(hosts) > 1 and current in hosts:
        hosts = sorted(hosts)
        nnodes, node_rank, master = len(hosts), hosts.index(current), hosts[0]
    nproc = max(1, plan.world_size // nnodes)
    import torch

    have = torch.cuda.device_count()
    if device != "cpu" and have < nproc:
        return {"schema": SCHEMA, "request_id": request.get("request_id"), "status": "unsupported",
                "phase": "launch", "message": f"parallelism={plan.parallelism} needs {nproc} GPUs per node, "
                                              f"found {have} (pass --device cpu to run the processes on CPU)",
                "summary": {}, "phases": [], "estimate": request.get("estimate"), "config": request.get("config"),
                "model_spec": request.get("model"), "model": (request.get("model") or {}).get("name"),
                "instance": request.get("instance"), "world_size": plan.world_size}
    if request_arg.strip().startswith("{"):
        req_file = out.with_suffix(".request.json")
        req_file.write_text(request_arg)
        request_arg = str(req_file)
    cmd = torchrun_command(str(Path(__file__).resolve()), request_arg, str(out), nproc, nnodes=nnodes,
                           node_rank=node_rank, master_addr=master,
                           master_port=int(os.environ.get("PLANNER_MASTER_PORT", 29500)), device=device)
    log("launching: " + " ".join(cmd))
    code = subprocess.call(cmd)
    parts = [json.loads(p.read_text()) for p in sorted(out.parent.glob(out.name + ".rank*"))]
    for p in out.parent.glob(out.name + ".rank*"):
        p.unlink()
    if not parts and code == 0 and node_rank > 0:
        return None
    if not parts:
        return {"schema": SCHEMA, "request_id": request.get("request_id"), "status": "error", "phase": "launch",
                "message": f"torchrun exited with code {code} and no rank wrote a result", "summary": {},
                "phases": [], "estimate": request.get("estimate"), "config": request.get("config"),
                "model_spec": request.get("model"),
                "model": (request.get("model") or {}).get("name"), "instance": request.get("instance")}
    merged = merge_ranks(parts)
    merged["torchrun_exit_code"] = code
    return merged


def output_paths(out_arg: str | None) -> list[Path]:
    paths = []
    if out_arg:
        paths.append(Path(out_arg))
    sm_dir = os.environ.get("SM_OUTPUT_DATA_DIR")
    if sm_dir:
        paths.append(Path(sm_dir) / "probe.json")
    return paths or [Path("probe.json")]


def write_json(path: Path, obj: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=str))
    os.replace(tmp, path)


def write_failure_file(message: str) -> None:
    """SageMaker shows /opt/ml/output/failure as the job's FailureReason."""
    sm_out = os.environ.get("SM_OUTPUT_DIR") or ("/opt/ml/output" if os.environ.get("SM_TRAINING_ENV") else None)
    if sm_out and Path(sm_out).is_dir():
        with contextlib.suppress(OSError):
            (Path(sm_out) / "failure").write_text(message[:1000])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--request", required=True, help="request JSON file (or the JSON text)")
    parser.add_argument("--out", default=None, help="result JSON path (default: $SM_OUTPUT_DATA_DIR/probe.json)")
    parser.add_argument("--device", default=None, help="force a device, e.g. cpu or cuda:0")
    parser.add_argument("--rank-output", action="store_true", help=argparse.SUPPRESS)
    # SageMaker passes every hyperparameter as --key value: accept and ignore the rest.
    args, _unknown = parser.parse_known_args(argv)
    try:
        request = load_request(args.request)
    except (OSError, ValueError) as exc:
        log(f"bad request: {exc}")
        write_failure_file(f"bad probe request: {exc}")
        return 2
    outs = output_paths(args.out)
    plan = make_plan(request)
    # One process per GPU under torchrun: started by this script's own launcher (--rank-output, below), or
    # by SageMaker's torch_distributed runner (`torchrun ... probe.py --request ...` on every instance).
    if args.rank_output or ("LOCAL_RANK" in os.environ and plan.distributed):
        return run_rank(args, request, outs)
    if plan.distributed and "LOCAL_RANK" not in os.environ:
        result = launch_distributed(args.request, request, outs[0], device=args.device)
        if result is None:  # another instance's node: rank 0 on the first node reports every rank
            log("this node's ranks are reported by the first node")
            return 0
        return finish(result, outs)
    return finish(run_probe(request, device=args.device), outs)


def finish(result: dict[str, Any], outs: list[Path]) -> int:
    """Write the result, print the metric lines, set the exit code."""
    for p in outs:
        write_json(p, result)
    for line in metric_lines(result):
        print(line, flush=True)
    print(f"probe_status={result['status']};", flush=True)
    log(f"status={result['status']} phase={result.get('phase')} -> {', '.join(str(p) for p in outs)}")
    if result["status"] == "error":
        write_failure_file(f"probe error in {result.get('phase')}: {result.get('message')}")
        return 1
    return 0


def run_rank(args: argparse.Namespace, request: dict[str, Any], outs: list[Path]) -> int:
    """One rank: join the process group, run, and gather every rank's result on global rank 0, which writes
    them (its launcher merges `<out>.rank<N>` files) or, started by torchrun directly, the merged result.
    Gathering through the process group works across instances, where each node's files stay on its disk."""
    import torch
    import torch.distributed as dist

    rank = dist_env()[0]
    backend = "nccl" if torch.cuda.is_available() and args.device != "cpu" else "gloo"
    if not dist.is_initialized():
        if backend == "nccl":
            torch.cuda.set_device(dist_env()[1])
        dist.init_process_group(backend=backend)
    result = run_probe(request, device=args.device)
    if result["status"] in ("oom", "error"):
        write_json(outs[0].with_name(outs[0].name + f".rank{rank}"), result)
        if not args.rank_output:
            finish(result, outs)
        os._exit(3)  # a peer may wait in a collective forever: let torchrun tear the group down
    gathered: list[Any] | None = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(result, gathered, dst=0)
    if rank == 0 and gathered is not None:
        if args.rank_output:
            for r in gathered:
                write_json(outs[0].with_name(outs[0].name + f".rank{r['rank']}"), r)
        else:
            finish(merge_ranks(gathered), outs)
    with contextlib.suppress(Exception):
        dist.barrier()
        dist.destroy_process_group()
    return 0



if __name__ == "__main__":
    sys.exit(main())
