"""Measure what autograd really saves for backward, per block, for the models `planner` describes.

Why: `planner.memory.activations` predicts these bytes with one small formula per tensor group; this
harness is the ground truth those formulas are checked against. It builds the real module with the probe
job's builder (`jobs.modeling.build_model`: the transformers class named by the spec's `architecture`,
from its `hf_config`, or the multimodal model), runs one training forward + loss (`jobs.modeling.loss_of`)
with `torch.autograd.graph.saved_tensors_hooks` installed, and counts every saved *storage* once (key:
`StorageWeakRef(t.untyped_storage()).cdata`), attributed to the block whose module was running (module
forward pre-hooks).

Not counted, because `planner` accounts for them elsewhere: parameter and buffer storages (model state)
and the batch's own tensors (`MemoryBytes.batch`). Counted separately: AMP weight casts (16-bit copies of
parameters made by autocast and saved by matmuls), found with a dispatch mode that records the outputs of
`aten._to_copy` applied to a parameter.

By default everything runs under `FakeTensorMode` (no memory, so full-size models are cheap); the model is
built *inside* the mode so that parameters are fake once and for all. `fake=False` runs the same thing on
real CPU tensors: `tests/test_activations.py` checks that both agree byte for byte.

This CPU build measures CPU kernels (dropout noise tensors, CPU SDPA kernels, CPU autocast lists); see
`planner.memory.activations` for how the formulas map them to CUDA.

`python -m tests.saved_tensors` prints measured vs predicted for a grid of cases (README accuracy table).
"""

from __future__ import annotations

import contextlib
import sys
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from planner.spec import ModelSpec, TrainConfig

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # jobs/modeling.py lives at the repository root
    sys.path.insert(0, str(ROOT))

AUTOCAST_DTYPE = {"amp-bf16": torch.bfloat16, "amp-fp16": torch.float16}
MODEL_DTYPE = {"fp32": torch.float32, "amp-bf16": torch.float32, "amp-fp16": torch.float32,
               "bf16": torch.bfloat16, "fp16": torch.float16}


# ------------------------------------------------------------------------------------------ specs

# Catalog config keys for depth / width / heads / FFN / vocab / positions, per family.
SIZE_KEYS = {
    "bert": ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size"),
    "roberta": ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size"),
    "distilbert": ("n_layers", "dim", "n_heads", "hidden_dim"),
    "gpt2": ("n_layer", "n_embd", "n_head", "n_inner"),
    "llama": ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size"),
    "mistral": ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size"),
}
CATALOG_NAME = {"bert": "bert-base-uncased", "roberta": "roberta-base", "distilbert": "distilbert-base-uncased",
                "gpt2": "gpt2", "llama": "llama-2-7b", "mistral": "mistral-7b"}


def model(family: str, head: str | None = None, *, layers: int = 2, hidden: int = 64, heads: int = 4,
          intermediate: int | None = None, vocab: int = 1000, kv_heads: int | None = None, num_labels: int = 3,
          full: bool = False, **hf: Any) -> ModelSpec:
    """A catalog model of `family` (its real config.json), shrunk to the given sizes unless `full`, with
    `head` and extra config keys `hf` (e.g. attention_dropout). Formulas are per layer, so a small model
    exercises the same code as a full-size one."""
    from planner.models import hf_config
    from planner.models.catalog import catalog_config

    name = CATALOG_NAME[family]
    config = catalog_config(name)
    if not full:
        keys = SIZE_KEYS[family]
        config.update(dict(zip(keys, (layers, hidden, heads, intermediate or 4 * hidden), strict=True)))
        config["vocab_size"] = vocab
        if family in ("llama", "mistral"):
            config["num_key_value_heads"] = kv_heads or heads
            config.pop("head_dim", None)
    config.update(hf)
    # transformers' Generic*ForSequenceClassification builds its body with AutoModel.from_config, which
    # honours torch_dtype (float16 for Llama): drop it so the body is fp32 like every other class.
    config.pop("torch_dtype", None)
    config = hf_config.with_head(config, head, num_labels if head == "sequence-classification" else None)
    return hf_config.spec_from_hf_config(config, name=f"{family}-{head or 'default'}")


def multimodal(text_family: str = "bert", *, full: bool = False, binary: bool = True, **sizes: Any) -> ModelSpec:
    """The catalog's multimodal-bert with (unless `full`) a small text encoder of `text_family`."""
    from planner.models import hf_config
    from planner.models.catalog import multimodal_bert

    text_model = CATALOG_NAME[text_family]
    spec = multimodal_bert(text_model=text_model, binary=binary, num_classes=2 if binary else 3)
    if full:
        return spec
    text = model(text_family, "base", **sizes).transformers[0]
    text = hf_config.transformer_from_hf_config(hf_config.with_head(text.hf_config, "base"))
    comps = list(spec.components)
    i = next(k for k, c in enumerate(comps) if c.name == "TextBertBase")
    dense = comps[i].layers[1].model_copy(update={"in_features": text.hidden_size})
    comps[i] = comps[i].model_copy(update={"layers": (text, dense)})
    return spec.model_copy(update={"components": tuple(comps)})


# ---------------------------------------------------------------------------------------- building


def inject_lora(module: torch.nn.Module, targets: tuple[str, ...], dropout: float, r: int = 4,
                alpha: int = 8) -> torch.nn.Module:
    """peft's LoRA injected in place (module names unchanged), the adapters cast to fp32 as get_peft_model's
    autocast_adapter_dtype=True does: what the planner's LoRA runs are compared with."""
    import warnings

    import peft

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module = peft.inject_adapter_in_model(peft.LoraConfig(
            r=r, lora_alpha=alpha, lora_dropout=dropout,
            target_modules="all-linear" if targets == ("all-linear",) else list(targets)), module)
    for name, p in module.named_parameters():
        if "lora_" in name:
            p.data = p.data.float()
    return module


def make_batch(spec: ModelSpec, b: int, s: int, padded: bool) -> dict[str, Any]:
    """The probe job's batch (`jobs.modeling.make_batch`). `padded`: mask out the last token of the first
    row, so HF materialises the 4-D mask (on real and fake tensors alike; under FakeTensorMode HF cannot
    inspect the mask and always materialises it); otherwise drop the mask, which is what HF does with an
    all-ones mask on real tensors (SDPA then gets no mask / is_causal)."""
    from jobs.modeling import make_batch as probe_batch

    batch = probe_batch(spec.model_dump(mode="json"), b, s, "cpu")
    if "attention_mask" in batch:
        if padded and s > 1:
            batch["attention_mask"][0, -1] = 0
        elif not padded:
            del batch["attention_mask"]
    if spec.transformers and spec.transformers[0].family == "roberta":
        batch["input_ids"].clamp_(min=2)  # keep ids off RoBERTa's padding index (1)
    return batch


# ----------------------------------------------------------------------------------------- blocks

HEAD_MODULES = ("classifier", "lm_head", "cls", "score", "pre_classifier", "dropout", "vocab_transform",
                "vocab_layer_norm", "vocab_projector", "activation")
EMBEDDING_MODULES = ("embeddings", "wte", "wpe", "drop", "embed_tokens", "rotary_emb")
FINAL_NORM_MODULES = ("ln_f", "norm")
BASE_PREFIXES = ("bert", "roberta", "distilbert", "transformer", "model")
# The last module of each head: ops of the top-level forward after it are the loss.
LOSS_AFTER = ("classifier", "lm_head", "cls", "score", "vocab_projector", "merge")
LOSS_MODULES = ("mlm_loss_fct",)  # DistilBertForMaskedLM's CrossEntropyLoss module


def _transformer_block(component: str, parts: list[str], after_head: bool) -> str:
    """Block name for a module path inside one HF model (planner.models.blocks naming)."""
    if parts and parts[0] in BASE_PREFIXES:
        parts = parts[1:]
    if not parts or parts[0] in LOSS_MODULES:
        return "loss" if after_head or parts else f"{component}.head"
    for key in ("layer", "layers", "h"):
        if key in parts:
            i = parts.index(key)
            if i + 1 < len(parts) and parts[i + 1].isdigit():
                return f"{component}.layer.{parts[i + 1]}"
    if parts[0] in EMBEDDING_MODULES:
        return f"{component}.embeddings"
    if parts[0] in FINAL_NORM_MODULES:
        return f"{component}.final_norm"
    if parts[0] == "pooler":
        return f"{component}.pooler"
    if parts[0] in HEAD_MODULES:
        return f"{component}.head"
    return f"{component}.{parts[0]}"


def block_of(spec: ModelSpec, qualname: str, after_head: bool) -> str:
    """Block for the module running when a tensor is saved. Single HF models: module paths of the HF
    class; the multimodal model (jobs/modeling.py): `Component.i[.<HF path>]`; top level: the loss."""
    parts = qualname.split(".") if qualname else []
    if len(spec.components) == 1 and len(spec.components[0].layers) == 1:
        return _transformer_block(spec.components[0].name, parts, after_head)
    if not parts:
        return "loss"
    comp = next(c for c in spec.components if c.name == parts[0])
    if len(parts) == 1:
        return f"{comp.name}.forward"
    layer = comp.layers[int(parts[1])]
    if layer.kind == "transformer":
        return _transformer_block(comp.name, parts[2:], False)
    return f"{comp.name}.{parts[1]}.{layer.kind}"


# -------------------------------------------------------------------------------------- measuring


@dataclass
class SavedTensor:
    block: str
    module: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    weight_cast: bool = False


@dataclass
class Measurement:
    total: int = 0  # activations + weight casts, each storage once
    per_block: dict[str, int] = field(default_factory=lambda: defaultdict(int))  # weight casts included
    weight_cast: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    tensors: list[SavedTensor] = field(default_factory=list)
    cast_cache: int = 0  # bytes of all parameter casts autocast made (and cached) during the forward

    def table(self) -> str:
        return "\n".join(f"{t.block:28s} {t.module:52s} {str(t.shape):22s} {t.dtype:9s} {t.nbytes:>11d}"
                         f"{' cast' if t.weight_cast else ''}" for t in self.tensors)


class _CastRecorder(TorchDispatchMode):
    """Records storages produced by `aten._to_copy` of a parameter: autocast's cached weight casts."""

    def __init__(self, param_keys: set[int]):
        super().__init__()
        self.param_keys = param_keys
        self.casts: dict[int, int] = {}  # storage key -> bytes, every parameter cast of the forward

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and isinstance(args[0], torch.Tensor):
            if _key(args[0]) in self.param_keys and isinstance(out, torch.Tensor):
                self.casts[_key(out)] = out.untyped_storage().nbytes()
        return out


def _key(t: torch.Tensor) -> int:
    return StorageWeakRef(t.untyped_storage()).cdata


@contextlib.contextmanager
def _module_tracker(module: torch.nn.Module) -> Iterator[tuple[list[str], set[str]]]:
    """Stack of the qualified names of the modules running now, and the set of those finished."""
    names = {id(m): n for n, m in module.named_modules()}
    stack: list[str] = []
    finished: set[str] = set()

    def pre(mod, args):
        stack.append(names.get(id(mod), stack[-1] if stack else ""))

    def post(mod, args, out):
        finished.add(stack.pop() if stack else "")

    h1 = torch.nn.modules.module.register_module_forward_pre_hook(pre)
    h2 = torch.nn.modules.module.register_module_forward_hook(post)
    try:
        yield stack, finished
    finally:
        h1.remove()
        h2.remove()


def program_saved_per_block(spec: ModelSpec, config: TrainConfig, **ctx_fields: Any) -> dict[str, int]:
    """What the planner's program says each block saves for backward on one CPU rank (the numbers the tests
    hold against `measure`): `program_report` with unsharded states and the context record of `config` on the
    CPU backend (`ctx_fields`: tp, sp, ... of one rank)."""
    from planner.ir.context import Ctx
    from planner.memory.parallel import Sharding
    from planner.pipeline.program_report import program_report

    ctx = Ctx(config.batch_size, config.seq_len, config.precision, config.attention, "cpu",
              spec.inputs.attention_mask, **ctx_fields)
    report = program_report(spec, config, Sharding(1.0, 1.0, 1.0), ctx)
    return {b["name"]: sum(o["saved_bytes"] for o in b["ops"]) for b in report["blocks"]}


def measure(spec: ModelSpec, config: TrainConfig, *, fake: bool = True, padded: bool = True,
            keep_tensors: bool = True, transform: Any = None) -> Measurement:
    """Bytes autograd saves during one training forward + loss of `spec` under `config` (CPU kernels).

    `transform(module)` returns the module to run instead (a LoRA run: peft's `get_peft_model` around it)."""
    from jobs.modeling import build_model, loss_of

    if fake and not padded and any(t.family in ("gpt2", "llama", "mistral") for t in spec.transformers):
        # HF cannot read a fake cache position, so under FakeTensorMode decoders always get a 4-D mask
        # (masking_utils._ignore_causal_mask_sdpa); only a real run shows the unpadded SDPA path.
        raise ValueError("padded=False for a decoder needs fake=False")
    precision = config.precision
    attention = "sdpa" if config.attention == "flash" else config.attention  # no FlashAttention-2 on CPU
    torch.manual_seed(0)
    mode = torch._subclasses.fake_tensor.FakeTensorMode() if fake else contextlib.nullcontext()
    result = Measurement()
    with mode:
        old = torch.get_default_dtype()
        torch.set_default_dtype(MODEL_DTYPE[precision])  # pure 16-bit: built in that dtype, like .half()
        try:
            module = build_model(spec.model_dump(mode="json"), attention, checkpointing=config.checkpointing)
        finally:
            torch.set_default_dtype(old)
        if transform is not None:
            module = transform(module)
        wrong = set() if transform else {p.dtype for p in module.parameters()} - {MODEL_DTYPE[precision]}
        if wrong:
            raise ValueError(f"built parameters in {wrong}, expected {MODEL_DTYPE[precision]}")
        batch = make_batch(spec, config.batch_size, config.seq_len, padded)
        if precision in ("bf16", "fp16") and "tabular_features" in batch:
            batch["tabular_features"] = batch["tabular_features"].to(MODEL_DTYPE[precision])
        params = {_key(p) for p in module.parameters()}
        excluded = params | {_key(b) for b in module.buffers()}
        excluded |= {_key(v) for v in batch.values() if isinstance(v, torch.Tensor)}
        seen: set[int] = set()
        # The storages counted stay referenced until the measurement ends: a key is a storage's address, and a
        # saved tensor whose graph branch dies in the forward (an MoE router's discarded scores, say) would free
        # its storage, and a later storage at the same address would be skipped as seen (a nondeterministic
        # miss of a few bytes, seen on DeepSeek-V2's final norm).
        counted: list[Any] = []
        recorder = _CastRecorder(params)

        with _module_tracker(module) as (stack, finished):
            def pack(t: torch.Tensor) -> torch.Tensor:
                k = _key(t)
                if k in excluded or k in seen:
                    return t
                seen.add(k)
                counted.append(t.untyped_storage())
                qual = stack[-1] if stack else ""
                blk = block_of(spec, qual, bool(finished & set(LOSS_AFTER)))
                n = t.untyped_storage().nbytes()
                cast = k in recorder.casts
                result.total += n
                result.per_block[blk] += n
                if cast:
                    result.weight_cast[blk] += n
                if keep_tensors:
                    result.tensors.append(SavedTensor(blk, qual, tuple(t.shape), str(t.dtype).split(".")[-1],
                                                      n, cast))
                return t

            autocast = (torch.autocast("cpu", dtype=AUTOCAST_DTYPE[precision]) if precision in AUTOCAST_DTYPE
                        else contextlib.nullcontext())
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), recorder, autocast:
                loss = loss_of(module, batch)
        result.cast_cache = sum(recorder.casts.values())
        if not fake:
            loss.backward()  # the real run also proves the saved graph is complete
    result.per_block = dict(result.per_block)
    result.weight_cast = dict(result.weight_cast)
    return result


# ------------------------------------------------------------------------------------------ table


def cases() -> list[tuple[str, ModelSpec, TrainConfig]]:
    """The README accuracy grid: each family, eager/sdpa, precisions, with and without checkpointing."""
    models = {
        "bert-tiny": model("bert", "sequence-classification"),
        "roberta-tiny": model("roberta", "sequence-classification"),
        "distilbert-tiny": model("distilbert", "sequence-classification"),
        "gpt2-tiny": model("gpt2", "causal-lm"),
        "llama-tiny-gqa": model("llama", "causal-lm", kv_heads=2, intermediate=176),
        "multimodal-tiny": multimodal("bert"),
        "bert-base": model("bert", "sequence-classification", full=True),
        "multimodal-bert": multimodal("bert", full=True),
    }
    out = []
    for name, spec in models.items():
        shapes = ((8, 512),) if name in ("bert-base", "multimodal-bert") else ((2, 37), (4, 128))
        for b, s in shapes:
            for precision in ("fp32", "amp-bf16", "bf16"):
                for attention in ("eager", "sdpa"):
                    for ckpt in (False, True):
                        out.append((name, spec, TrainConfig(batch_size=b, seq_len=s, precision=precision,
                                                            attention=attention, checkpointing=ckpt)))
    return out


def main(argv: list[str] | None = None) -> int:
    """Print measured (CPU kernels) vs predicted (backend="cpu") saved bytes, plus the CUDA prediction."""
    from planner.memory.activations import saved_activation_bytes

    mib = 2**20
    print(f"{'model':16s} {'b':>3s} {'s':>4s} {'precision':9s} {'attn':5s} {'ckpt':5s} {'measured MiB':>13s} "
          f"{'predicted MiB':>14s} {'error %':>8s} {'CUDA MiB':>9s}")
    worst = 0.0
    for name, spec, c in cases():
        measured = measure(spec, c, keep_tensors=False).total
        predicted = saved_activation_bytes(spec, c, backend="cpu")
        cuda = saved_activation_bytes(spec, c, backend="cuda")
        err = 100.0 * (predicted - measured) / measured
        worst = max(worst, abs(err))
        print(f"{name:16s} {c.batch_size:3d} {c.seq_len:4d} {c.precision:9s} {c.attention:5s} "
              f"{str(c.checkpointing):5s} {measured / mib:13.3f} {predicted / mib:14.3f} {err:8.3f} {cuda / mib:9.2f}")
    print(f"worst |error| = {worst:.3f} %  (CPU kernels; CUDA column: backend='cuda', padded batch)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

