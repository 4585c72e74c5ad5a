"""Build the real PyTorch model of a planner `ModelSpec` (as JSON), a batch for it, and its training loss.

Runs on the training machine, so it imports only torch, transformers and the standard library; the spec
arrives as `ModelSpec.model_dump(mode="json")`. Weights are random (nothing is downloaded). Everything
works on the `meta` device and inside `FakeTensorMode`, where tests and the activations helper use it.

Module names follow the planner's blocks: the multimodal model has children `TabAE`, `TextBertBase` and
`merge`, each holding its layers as children "0", "1", ... so block `TabAE.1.dense` is module `TabAE.1`
and the text encoder is `TextBertBase.0`.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

# planner attention names -> transformers `attn_implementation`.
ATTN_IMPLEMENTATION: dict[str, str] = {"eager": "eager", "sdpa": "sdpa", "flash": "flash_attention_2"}
# Keys of a planner-annotated config.json that transformers' config classes must not see.
_PLANNER_KEYS: tuple[str, ...] = ("_source",)


def _transformers(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return [layer for c in spec["components"] for layer in c["layers"] if layer["kind"] == "transformer"]


def hf_config_object(layer: dict[str, Any], attention: str = "sdpa", use_cache: bool = False):
    """The transformers config for one TransformerSpec dict.

    `use_cache=False`: a training step needs no KV cache, and with config.use_cache=True (the hub default)
    Llama/GPT-2 in train mode would build a DynamicCache holding every layer's keys and values.
    Decoder sequence classifiers need a pad token to find each row's last token (transformers raises for
    batch > 1 without one), so a missing pad_token_id becomes the eos token, as fine-tuning scripts do.
    """
    from transformers import AutoConfig

    if attention not in ATTN_IMPLEMENTATION and attention != "auto":
        raise ValueError(f"attention={attention!r}: one of auto, {', '.join(ATTN_IMPLEMENTATION)}")
    cfg = {k: v for k, v in layer["hf_config"].items() if k not in _PLANNER_KEYS}
    # The hub's torch_dtype/dtype is the checkpoint's storage dtype; some classes (Llama/Mistral sequence
    # classifiers) honour it at construction. Training precision is the probe's choice, so build in fp32.
    cfg.pop("torch_dtype", None)
    cfg.pop("dtype", None)
    model_type = cfg.pop("model_type")
    cfg["architectures"] = [layer["architecture"]]
    cfg["use_cache"] = use_cache
    if layer["head"] == "sequence-classification":
        cfg["num_labels"] = layer["num_labels"]
        if cfg.get("id2label") is not None and len(cfg["id2label"]) != layer["num_labels"]:
            cfg.pop("id2label")
            cfg.pop("label2id", None)
        if layer["family"] not in ("bert", "roberta", "distilbert") and cfg.get("pad_token_id") is None:
            eos = cfg.get("eos_token_id")
            cfg["pad_token_id"] = (eos[0] if isinstance(eos, list) else eos) if eos is not None else 0
    if attention == "auto":  # transformers picks its own default kernel for this model type and torch
        return AutoConfig.for_model(model_type, **cfg)
    return AutoConfig.for_model(model_type, attn_implementation=ATTN_IMPLEMENTATION[attention], **cfg)


def build_transformer(layer: dict[str, Any], attention: str = "sdpa", use_cache: bool = False) -> nn.Module:
    """The transformers class named by `architecture`, randomly initialised from `hf_config`."""
    import transformers

    cls = getattr(transformers, layer["architecture"])
    if attention == "sdpa" and getattr(cls, "_supports_sdpa", True) is False:
        attention = "eager"  # gpt-oss has no SDPA path (its attention sinks); transformers defaults it to eager
    config = hf_config_object(layer, attention, use_cache)
    if layer["head"] == "base" and layer["family"] in ("bert", "roberta"):
        return cls(config, add_pooling_layer=layer["pooler"])
    return cls(config)


def _simple(layer: dict[str, Any]) -> nn.Module:
    if layer["kind"] == "dense":
        return nn.Linear(layer["in_features"], layer["out_features"], bias=layer["bias"])
    if layer["kind"] == "batchnorm":
        return nn.BatchNorm1d(layer["num_features"])
    raise ValueError(f"layer kind {layer['kind']!r} is not a simple layer")


class Indexed(nn.Module):
    """Layers registered as children "0", "1", ... (like nn.Sequential), with a custom forward."""

    def __init__(self, *layers: nn.Module):
        super().__init__()
        for i, layer in enumerate(layers):
            self.add_module(str(i), layer)

    def __getitem__(self, i: int) -> nn.Module:
        return self._modules[str(i)]  # type: ignore[return-value]


class TabAE(Indexed):
    """BatchNorm1d(tab_in) -> Linear(tab_in, tab_out) -> Linear(tab_out, 1 or num_classes).

    Returns (features for the merge, auxiliary logits)."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        features = self[1](self[0](x))
        return features, self[2](features)


class TextBertBase(Indexed):
    """Encoder -> pooled vector (BERT/RoBERTa pooler; DistilBERT: first token's hidden state) -> Linear."""

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        kwargs = {"token_type_ids": token_type_ids} if token_type_ids is not None else {}
        out = self[0](input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        pooled = out.pooler_output if getattr(out, "pooler_output", None) is not None else out.last_hidden_state[:, 0]
        return self[1](pooled)


class Merge(Indexed):
    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self[0](features)


class MultimodalBert(nn.Module):
    """TabAE + TextBertBase + merge. Loss: CE(merge logits) + BCE-with-logits (binary) or CE on TabAE logits."""

    def __init__(self, spec: dict[str, Any], attention: str = "sdpa"):
        super().__init__()
        parts = {c["name"]: c["layers"] for c in spec["components"]}
        missing = {"TabAE", "TextBertBase", "merge"} - set(parts)
        if missing:
            raise ValueError(f"multimodal spec lacks components {sorted(missing)}")
        self.TabAE = TabAE(*(_simple(x) for x in parts["TabAE"]))
        text, head = parts["TextBertBase"]
        self.TextBertBase = TextBertBase(build_transformer(text, attention), _simple(head))
        self.merge = Merge(*(_simple(x) for x in parts["merge"]))
        self.binary = parts["TabAE"][-1]["out_features"] == 1

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, tabular_features: torch.Tensor,
                token_type_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None) -> dict[str, Any]:
        tab_features, tab_logits = self.TabAE(tabular_features)
        text_features = self.TextBertBase(input_ids, attention_mask, token_type_ids)
        logits = self.merge(torch.cat([tab_features, text_features], dim=-1))
        loss = None
        if labels is not None:
            loss = nn.functional.cross_entropy(logits, labels)
            if self.binary:
                loss = loss + nn.functional.binary_cross_entropy_with_logits(tab_logits.squeeze(-1),
                                                                             labels.to(tab_logits.dtype))
            else:
                loss = loss + nn.functional.cross_entropy(tab_logits, labels)
        return {"loss": loss, "logits": logits, "tab_logits": tab_logits}


def build_model(spec: dict[str, Any], attention: str = "sdpa", *, device: Any = None, use_cache: bool = False,
                checkpointing: bool = False) -> nn.Module:
    """The nn.Module for a ModelSpec dict, in train mode, fp32, random weights.

    `attention`: eager, sdpa or flash (-> transformers attn_implementation). `device`: build there (e.g.
    "meta"); None uses the current default device (or FakeTensorMode when active). `checkpointing`: the
    transformers per-layer gradient checkpointing.
    """
    ctx = torch.device(device) if device is not None else contextlib.nullcontext()
    if "user_code" in spec:
        with ctx:
            model = user_build(spec)
        if checkpointing:
            enable_checkpointing(model)
        return model.train()
    with ctx:
        if spec.get("loss") == "multimodal":
            model: nn.Module = MultimodalBert(spec, attention)
            encoder = model.TextBertBase[0]
        else:
            layers = [x for c in spec["components"] for x in c["layers"]]
            if len(layers) != 1 or layers[0]["kind"] != "transformer":
                raise ValueError("build_model: a spec is either one transformer or the multimodal model")
            model = encoder = build_transformer(layers[0], attention, use_cache)
    if checkpointing:
        enable_checkpointing(encoder)
    return model.train()


def enable_checkpointing(model: nn.Module) -> None:
    """Per-layer activation checkpointing, non-reentrant (PyTorch's recommended variant; what `planner`
    models). transformers 5 renamed gradient_checkpointing_enable to activation_checkpointing_enable."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def num_classes(spec: dict[str, Any]) -> int:
    """Classes of the label: the merge's outputs (multimodal) or the classifier's num_labels."""
    if spec.get("loss") == "multimodal":
        return spec["components"][-1]["layers"][-1]["out_features"]
    return _transformers(spec)[0]["num_labels"]


def make_batch(spec: dict[str, Any], batch_size: int, seq_len: int, device: Any = "cpu") -> dict[str, torch.Tensor]:
    """Model kwargs with PyTorch's real dtypes: int64 ids/masks/labels, fp32 tabular features.

    Labels: one class per sample, or one token per position (a copy of input_ids, as LM collators make;
    the models shift causal labels themselves).
    """
    if "user_code" in spec:
        return user_batch(spec, batch_size, seq_len, device)
    inputs = spec["inputs"]
    texts = _transformers(spec)
    batch: dict[str, torch.Tensor] = {}
    if texts:
        limit = min(t["max_positions"] for t in texts)
        if seq_len > limit:
            raise ValueError(f"seq_len={seq_len} exceeds the model's {limit} positions")
    shape = (batch_size, seq_len)
    if inputs["input_ids"]:
        batch["input_ids"] = torch.randint(0, texts[0]["vocab_size"], shape, dtype=torch.int64, device=device)
    if inputs["attention_mask"]:
        # Real batches are padded to the longest sample; one padded position makes HF build the 4-D mask
        # that the planner assumes (an all-ones mask is dropped and would measure a different kernel path).
        batch["attention_mask"] = torch.ones(shape, dtype=torch.int64, device=device)
        if batch_size > 1 and seq_len > 1:
            batch["attention_mask"][-1, -1] = 0
    if inputs["token_type_ids"]:
        batch["token_type_ids"] = torch.zeros(shape, dtype=torch.int64, device=device)
    if inputs["tabular_features"]:
        batch["tabular_features"] = torch.randn(batch_size, inputs["tabular_features"], dtype=torch.float32,
                                                device=device)
    if inputs["labels"] == "class":
        batch["labels"] = torch.randint(0, num_classes(spec), (batch_size,), dtype=torch.int64, device=device)
    elif inputs["labels"] == "tokens":
        batch["labels"] = batch["input_ids"].clone()
    return batch


def loss_of(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The training loss; a head-less base model gets mean(last_hidden_state) (+ mean(pooler_output)).

    The stand-in saves nothing large for backward (a mean's gradient needs only the shape) and still sends
    a gradient to every parameter, the pooler's included.
    """
    return outputs_and_loss(model, batch)[1]


def outputs_and_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[Any, torch.Tensor]:
    """`loss_of` with the model's outputs, for a loop that holds them (`out = model(**batch)`: planner --loop
    plain or accelerate); None for the user's own module (its loss function sees the outputs only)."""
    if isinstance(batch, UserBatch):
        return None, user_loss(model, batch)
    out = model(**batch)
    loss = out.get("loss") if hasattr(out, "get") else getattr(out, "loss", None)
    if loss is not None:
        return out, loss
    loss = out["last_hidden_state"].mean()
    pooled = out.get("pooler_output") if hasattr(out, "get") else None
    if pooled is not None:
        loss = loss + pooled.mean()
    return out, loss


# ------------------------------------------------------------------------- the user's own module
# A request for user code (`planner estimate --model FILE.py:build --inputs FILE.py:batch`) carries
# {"name": ..., "user_code": {"model": "file.py:build", "inputs": "file.py:batch", "loss": "file.py:fn" or
# None, "options": {...}, "files": {"file.py": source}}} (planner.models.user_module.probe_model). The files
# are written to a folder of their own and imported by path, as the planner imported them.


class UserBatch(dict):
    """The user's batch as `model(**batch)` (a dict) or `model(*batch)` (a tuple, kept here under the keys
    "0", "1", ...), with the request attached; a dict so that the probe's byte counting and dtype casting see
    its tensors."""

    spec: dict[str, Any]
    positional: bool = False

    def call(self, model: nn.Module) -> Any:
        return model(*self.original()) if self.positional else model(**self)

    def original(self) -> Any:
        return tuple(self[str(i)] for i in range(len(self))) if self.positional else dict(self)


_USER_MODULES: dict[tuple[str, str], Any] = {}


def _user_function(spec: dict[str, Any], role: str) -> Any:
    import hashlib
    import importlib.util
    import sys
    import tempfile
    from pathlib import Path

    code = spec["user_code"]
    ref = code.get(role)
    if not ref:
        return None
    file, fn = ref.rsplit(":", 1)
    digest = hashlib.sha256("\0".join(f"{k}\0{v}" for k, v in sorted(code["files"].items())).encode()).hexdigest()
    module = _USER_MODULES.get((file, digest))
    if module is None:
        folder = Path(tempfile.gettempdir()) / "planner_user_code" / digest[:16]
        folder.mkdir(parents=True, exist_ok=True)
        for name, text in code["files"].items():
            (folder / name).write_text(text, encoding="utf-8")
        name = f"planner_user_{Path(file).stem}_{digest[:12]}"
        loader_spec = importlib.util.spec_from_file_location(name, folder / file)
        assert loader_spec is not None and loader_spec.loader is not None
        module = importlib.util.module_from_spec(loader_spec)
        sys.modules[name] = module
        loader_spec.loader.exec_module(module)
        _USER_MODULES[(file, digest)] = module
    return getattr(module, fn)


def _accepted_options(fn: Any, options: dict[str, Any]) -> dict[str, Any]:
    """The model options `fn` names among its parameters (as planner.models.user_module._accepted)."""
    import inspect

    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(options)
    return {k: v for k, v in options.items() if k in params}


def user_build(spec: dict[str, Any]) -> nn.Module:
    """`build(**options)` of the user's file."""
    model = _user_function(spec, "model")(**spec["user_code"].get("options", {}))
    if not isinstance(model, nn.Module):
        raise TypeError(f"{spec['user_code']['model']} returned {type(model).__name__}, not an nn.Module")
    return model


def user_batch(spec: dict[str, Any], batch_size: int, seq_len: int, device: Any = "cpu") -> UserBatch:
    """`batch(batch_size, seq_len, **options it names)` of the user's file, moved to `device`."""
    fn = _user_function(spec, "inputs")
    raw = fn(batch_size, seq_len, **_accepted_options(fn, spec["user_code"].get("options", {})))

    def move(v: Any) -> Any:
        return v.to(device) if isinstance(v, torch.Tensor) else v

    if isinstance(raw, dict):
        out = UserBatch({k: move(v) for k, v in raw.items()})
    elif isinstance(raw, (tuple, list)):
        out = UserBatch({str(i): move(v) for i, v in enumerate(raw)})
        out.positional = True
    else:
        raise TypeError(f"{spec['user_code']['inputs']} returned {type(raw).__name__}, not a dict or tuple")
    out.spec = spec
    return out


def user_loss(model: nn.Module, batch: UserBatch) -> torch.Tensor:
    """`fn(output, batch)` when the request names a loss; else output.loss, else the sum of the first floating
    tensor of the output (planner.program.trace.default_loss)."""
    out = batch.call(model)
    fn = _user_function(batch.spec, "loss")
    if fn is not None:
        return fn(out, batch.original())
    loss = out.get("loss") if isinstance(out, dict) else getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    from torch.utils._pytree import tree_flatten

    leaves, _ = tree_flatten(out.to_tuple() if hasattr(out, "to_tuple") else out)
    first = next(t for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point())
    return first.sum()
