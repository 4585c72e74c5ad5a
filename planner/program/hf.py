"""Any Hugging Face config.json that `transformers` can build, for the tracer: the module (the class named by
`architectures[0]`, else AutoModel; random weights, nothing downloaded) and a batch of the model's own inputs.

Inputs follow the class's `main_input_name`: token ids (int64, one padded position, as a collator pads),
images (`pixel_values`, float32, num_channels × image_size²) or log-mel features (`input_features`, Whisper:
num_mel_bins × 2·max_source_positions frames). Labels make the model compute its own loss: one class per
sample for *ForSequenceClassification / *ForImageClassification, one token per position for LM heads and
encoder-decoders (which shift labels into decoder inputs themselves); base models get decoder ids and the
default loss (sum of the first output).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from planner.errors import PlannerError

# planner attention names -> transformers `attn_implementation` (jobs/modeling.py ATTN_IMPLEMENTATION).
ATTN_IMPLEMENTATION: dict[str, str] = {"eager": "eager", "sdpa": "sdpa", "flash": "sdpa"}
TOKEN_LABEL_SUFFIXES: tuple[str, ...] = ("ForCausalLM", "ForMaskedLM", "LMHeadModel", "ForConditionalGeneration",
                                         "ForTokenClassification")
CLASS_LABEL_SUFFIXES: tuple[str, ...] = ("ForSequenceClassification", "ForImageClassification",
                                         "ForAudioClassification")
# Keys of a config.json that describe the checkpoint, not the architecture (dropped before building).
DROPPED_KEYS: tuple[str, ...] = ("torch_dtype", "dtype", "_name_or_path", "transformers_version", "_source")


def enable_checkpointing(model: Any) -> None:
    """Non-reentrant per-layer checkpointing, as `jobs/modeling.py enable_checkpointing` (what planner models);
    transformers 5 renamed gradient_checkpointing_enable to activation_checkpointing_enable."""
    kwargs = {"use_reentrant": False}
    try:
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    except ValueError as exc:  # "... does not support gradient checkpointing"
        raise PlannerError("--checkpointing", True, str(exc).split("\n")[0]) from None


# The sizes of a config.json the tracer builds from, checked before transformers sees them: a count of layers or
# a width that is not a positive integer would raise inside transformers (a library traceback), build nothing
# (0 layers: a model of embeddings only, "fitting" trivially) or build for hours (10^6 layers on the meta device
# are 10^6 modules). ASSUMPTION: the largest published configs hold 126 layers (Llama 3.1 405B), widths of
# 16,384-53,248 and vocabularies of 262,144 (Gemma 3): the limits are far above them.
MAX_LAYERS = 1024
SIZE_LIMITS: dict[str, int] = {
    **dict.fromkeys(("num_hidden_layers", "num_layers", "n_layer", "n_layers", "encoder_layers", "decoder_layers",
                     "num_decoder_layers"), MAX_LAYERS),
    **dict.fromkeys(("hidden_size", "n_embd", "d_model", "dim", "intermediate_size", "ffn_dim", "n_inner",
                     "encoder_ffn_dim", "decoder_ffn_dim", "d_ff"), 2**20),
    **dict.fromkeys(("num_attention_heads", "n_head", "n_heads", "num_key_value_heads", "encoder_attention_heads",
                     "decoder_attention_heads", "head_dim"), 2**14),
    "vocab_size": 2**24,
}


def check_sizes(cfg: dict[str, Any], path: str) -> None:
    """Each size key present must be a whole number from 1 to its limit (SIZE_LIMITS); one line naming it."""
    for key, limit in SIZE_LIMITS.items():
        if key not in cfg or cfg[key] is None:
            continue
        value = cfg[key]
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= limit:
            raise PlannerError(f"{path}:{key}", value, f"a whole number from 1 to {limit:,}")


def hf_config_object(config: dict[str, Any], path: str, attention: str, options: dict[str, Any] | None = None):
    """The transformers config, `options` (-o KEY=VALUE) overriding keys; unknown model_type is an error."""
    import transformers
    from transformers import AutoConfig

    cfg = {k: v for k, v in config.items() if k not in DROPPED_KEYS}
    cfg.update(options or {})
    model_type = cfg.pop("model_type", None)
    if model_type is None:
        raise PlannerError("--model", path, "a config.json with a model_type")
    check_sizes(cfg, path)
    cfg["use_cache"] = False  # a training step keeps no KV cache
    try:
        return AutoConfig.for_model(model_type, attn_implementation=ATTN_IMPLEMENTATION[attention], **cfg)
    except ValueError as exc:
        if "Unrecognized" in str(exc) or "model_type" in str(exc):
            raise PlannerError(f"{path}:model_type", model_type,
                               f"a model type transformers {transformers.__version__} knows") from None
        raise PlannerError("--model", path, f"transformers rejected the config: {_reason(exc)}") from None
    except Exception as exc:  # noqa: BLE001 - huggingface_hub's strict dataclasses raise their own types
        raise PlannerError("--model", path, f"transformers rejected the config: {_reason(exc)}") from None


def _reason(exc: BaseException) -> str:
    """The most specific line of a transformers / huggingface_hub error (its cause when it wraps one)."""
    inner = exc.__cause__ or exc
    text = " ".join(str(inner).split()) or type(inner).__name__
    return text[:200]


def model_class(hf_config: Any) -> Any:
    """The class named by `architectures[0]`, else AutoModel."""
    import transformers

    arch = (getattr(hf_config, "architectures", None) or [None])[0]
    cls = getattr(transformers, arch, None) if isinstance(arch, str) else None
    return cls


def builder(hf_config: Any, path: str) -> Callable[[], Any]:
    from transformers import AutoModel

    from planner.models.user_module import last_line

    cls = model_class(hf_config)

    def build() -> Any:
        """On the meta device (no weight init runs: some inits, e.g. trunc_normal_, read values), then
        storage-less fake CPU tensors via `to_empty` (the tracer calls this inside FakeTensorMode)."""
        import warnings

        import torch

        try:
            # a warning from torch or transformers while building ("zero-element tensors") is no error of the
            # user's: what fails below is said in one line
            with torch.device("meta"), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model = cls(hf_config) if cls is not None else AutoModel.from_config(hf_config)
            return empty_like_on_cpu(model)
        except Exception as exc:  # noqa: BLE001 - any transformers error becomes one line
            raise PlannerError("--model", path, f"building {cls.__name__ if cls else 'AutoModel'} raised "
                               f"{last_line(exc)}") from None

    return build


def empty_like_on_cpu(module: Any) -> Any:
    """Replace every meta parameter and buffer by an uninitialised CPU tensor (fake inside FakeTensorMode),
    keeping shared ones shared. `Module.to_empty` cannot swap fake tensors into parameters, hence by hand."""
    return empty_like_on(module, "cpu")


def empty_like_on(module: Any, device: str) -> Any:
    """Every parameter and buffer of `module` as an uninitialised tensor on `device` (shared ones stay shared,
    requires_grad kept)."""
    import torch

    memo: dict[int, Any] = {}
    for sub in module.modules():
        for name, p in list(sub._parameters.items()):
            if p is not None:
                if id(p) not in memo:
                    memo[id(p)] = torch.nn.Parameter(torch.empty_like(p, device=device), requires_grad=p.requires_grad)
                sub._parameters[name] = memo[id(p)]
        for name, b in list(sub._buffers.items()):
            if b is not None:
                if id(b) not in memo:
                    memo[id(b)] = torch.empty_like(b, device=device)
                sub._buffers[name] = memo[id(b)]
    return module


def _image_size(hf_config: Any) -> tuple[int, int]:
    size = getattr(hf_config, "image_size", 224)
    return (size, size) if isinstance(size, int) else (int(size[0]), int(size[1]))


def batch_maker(hf_config: Any, path: str) -> Callable[[int, int], dict[str, Any]]:
    """batch(b, s) for this model (see the module docstring); `s` is the token / decoder length."""
    import torch

    cls = model_class(hf_config)
    name = cls.__name__ if cls is not None else "AutoModel"
    main = getattr(cls, "main_input_name", "input_ids") if cls is not None else "input_ids"
    encdec = bool(getattr(hf_config, "is_encoder_decoder", False))
    token_labels = name.endswith(TOKEN_LABEL_SUFFIXES)
    class_labels = name.endswith(CLASS_LABEL_SUFFIXES)
    if main not in ("input_ids", "pixel_values", "input_features"):
        raise PlannerError("--model", path, f"{name} takes {main}; the tracer builds input_ids, pixel_values or "
                           "input_features: write a batch() and use --model FILE.py:build --inputs FILE.py:batch")
    vocab = int(getattr(hf_config, "vocab_size", 0) or 0)

    def tokens(b: int, s: int) -> Any:
        return torch.randint(0, max(vocab, 2), (b, s), dtype=torch.int64)

    if encdec and token_labels and getattr(hf_config, "decoder_start_token_id", None) is None:
        # Labels are shifted right into decoder inputs starting with this id; T5/BART checkpoints use the
        # pad token (HF `shift_tokens_right` refuses None).
        hf_config.decoder_start_token_id = getattr(hf_config, "pad_token_id", None) or 0

    def make(b: int, s: int) -> dict[str, Any]:
        batch: dict[str, Any] = {}
        if main == "input_ids":
            batch["input_ids"] = tokens(b, s)
            mask = torch.ones(b, s, dtype=torch.int64)
            if b > 1 and s > 1:
                mask[-1, -1] = 0  # one padded position, as collators pad (HF then builds a 4-D mask)
            batch["attention_mask"] = mask
        elif main == "pixel_values":
            h, w = _image_size(hf_config)
            batch["pixel_values"] = torch.randn(b, getattr(hf_config, "num_channels", 3), h, w)
        else:
            frames = 2 * int(getattr(hf_config, "max_source_positions", 1500))
            batch["input_features"] = torch.randn(b, getattr(hf_config, "num_mel_bins", 80), frames)
        if class_labels:
            batch["labels"] = torch.randint(0, max(int(getattr(hf_config, "num_labels", 2)), 1), (b,))
        elif token_labels:
            batch["labels"] = tokens(b, s)
        elif encdec:
            batch["decoder_input_ids"] = tokens(b, s)
        return batch

    return make
