"""Where traced models come from (user code `file.py:build`, or a Hugging Face config.json outside the six
hand-modelled families), and the trace cache.

A model is traced once per shape class: (model, options, inputs, loss, batch, seq, precision, checkpointing,
attention, optimizer, backend, flash_ok). Search evaluates many configurations of the same model, so the
cache keeps a search over a traced model interactive (`TRACE_CACHE_SIZE` entries, least recently used out).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from planner import caches
from planner.errors import PlannerError
from planner.spec import TrainConfig

if TYPE_CHECKING:  # pragma: no cover - torch is imported only when a model is traced (search start-up)
    from planner.program.trace import StepTrace

TRACE_CACHE_SIZE = 64  # traces kept per process; each holds its op and event lists (a few MB for 8B models)


def _checkpointing_for(module: Any) -> None:
    """Per-layer checkpointing exists for modules that offer it (transformers' PreTrainedModel)."""
    if not any(hasattr(module, m) for m in ("activation_checkpointing_enable", "gradient_checkpointing_enable")):
        raise PlannerError("--checkpointing", True, f"{type(module).__name__} has no gradient_checkpointing_enable; "
                           "wrap its layers in torch.utils.checkpoint in your code and leave the flag off")
    from planner.program.hf import enable_checkpointing

    enable_checkpointing(module)


@caches.lru(TRACE_CACHE_SIZE, scope="model", key="(module reference, options, inputs, loss, config JSON, backend, ...)")
def _user_trace(ref: str, options_json: str, inputs: str | None, loss: str | None, config_json: str, backend: str,
                flash_ok: bool) -> StepTrace:
    from planner.models import user_module

    if inputs is None:
        raise PlannerError("--inputs", None, f"give --inputs FILE.py:FUNCTION (a batch(batch_size, seq_len) "
                           f"function) for --model {ref}")
    config = TrainConfig.model_validate_json(config_json)
    from planner.adapters.traced import with_adapters
    from planner.program.trace import trace_step

    build = with_adapters(user_module.model_builder(ref, json.loads(options_json)), config)
    return trace_step(build, user_module.batch_maker(inputs, json.loads(options_json)),
                      config, loss_fn=user_module.loss_function(loss), backend=backend,  # type: ignore[arg-type]
                      flash_ok=flash_ok, name=ref.rsplit("/", 1)[-1], source=ref,
                      enable_checkpointing=_checkpointing_for)


@caches.lru(TRACE_CACHE_SIZE, scope="model", key="(config.json path, options, config JSON, backend, flash)")
def _config_trace(path: str, options_json: str, config_json: str, backend: str, flash_ok: bool) -> StepTrace:
    from pathlib import Path

    from planner.models.hf_config import load_config_file
    from planner.program import hf

    config = TrainConfig.model_validate_json(config_json)
    hf_config = hf.hf_config_object(load_config_file(path), path, config.attention, json.loads(options_json))
    label = Path(path).stem if Path(path).stem != "config" else Path(path).parent.name
    from planner.adapters.traced import with_adapters
    from planner.program.trace import trace_step

    return trace_step(with_adapters(hf.builder(hf_config, path), config), hf.batch_maker(hf_config, path), config,
                      backend=backend,  # type: ignore[arg-type]
                      flash_ok=flash_ok, name=label or path, source=path, enable_checkpointing=_checkpointing_for)


# What tracing a model needs, said once and up front: PyTorch runs the step on fake tensors, and transformers
# builds config.json models and is what most own models (and examples/) import. docs/own-model.md says the same.
TRACING_LIBRARIES = ("torch", "transformers")


def require_tracing_libraries(model: str) -> None:
    """A model of your own (`FILE.py:build`) or a traced config.json needs torch and transformers; without
    them the answer is one line naming --model and everything missing, not an ImportError traceback (and
    not torch now, transformers on the next try)."""
    import importlib.util

    missing = [name for name in TRACING_LIBRARIES if importlib.util.find_spec(name) is None]
    if not missing:
        return
    how = []
    if "torch" in missing:
        how.append("pip install torch --index-url https://download.pytorch.org/whl/cpu")
    if "transformers" in missing:
        how.append("pip install transformers")
    raise PlannerError("--model", model, f"a model this Python can trace: your own models and config.json "
                       f"files outside the catalog's families are traced with torch and transformers, and "
                       f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} missing "
                       f"({'; '.join(how)}); catalog models need neither")


def is_traced_config(model: object) -> bool:
    """A config.json path (or folder) whose model_type is none of the hand-modelled families."""
    from pathlib import Path

    from planner.models import hf_config
    from planner.models.catalog import _resolve_name

    if not isinstance(model, str) or _resolve_name(model) is not None:
        return False
    if not (model.endswith(".json") or Path(model).is_dir()) or not Path(model).exists():
        return False
    config = hf_config.load_config_file(model)
    model_type = config.get("model_type") if isinstance(config, dict) else None
    return isinstance(model_type, str) and model_type not in hf_config.CLASS_PREFIX  # else hf_config says why


# Trace micro-batches other than scale.BASE_BATCHES by interpolating two traces (planner.program.scale);
# False traces every micro-batch itself (exact to the byte; seconds per batch size instead of none).
SCALE_TRACES = True


@caches.lru(TRACE_CACHE_SIZE, scope="model", key="(source kind, its arguments, config JSON)")
def _at_batch(kind: str, args: tuple, config_json: str) -> StepTrace:
    """The trace at the config's micro-batch: interpolated from the base batches' traces when it is not one
    of them (and they are the same program), else traced directly."""
    from planner.program.scale import BASE_BATCHES, scaled

    direct = _user_trace if kind == "user" else _config_trace
    config = TrainConfig.model_validate_json(config_json)
    b = config.batch_size
    if SCALE_TRACES and b > BASE_BATCHES[0] and b not in BASE_BATCHES:
        b0, b1 = BASE_BATCHES
        t0, t1 = (direct(*args[:-2], config.model_copy(update={"batch_size": x}).model_dump_json(), *args[-2:])
                  for x in (b0, b1))
        out = scaled(t0, t1, b0, b1, b)
        if out is not None:
            from dataclasses import replace

            return replace(out, notes=(*out.notes, f"traced at micro-batches {b0} and {b1}, interpolated to {b}"))
    return direct(*args[:-2], config_json, *args[-2:])


def model_trace(model: str, config: TrainConfig, *, options: dict[str, Any] | None = None,
                inputs: str | None = None, loss: str | None = None, backend: str = "cuda",
                flash_ok: bool = True) -> StepTrace:
    """The trace of user code (`file.py:build`) or of a config.json outside the families (cached)."""
    from planner.models.user_module import is_reference

    if is_reference(model):
        return user_trace(model, config, options=options, inputs=inputs, loss=loss, backend=backend,
                          flash_ok=flash_ok)
    key = config.model_copy(update={"grad_accum": 1, "instances": 1, "parallelism": "single"})
    return _at_batch("config", (model, json.dumps(options or {}, sort_keys=True), backend, flash_ok),
                     key.model_dump_json())


def user_trace(ref: str, config: TrainConfig, *, options: dict[str, Any] | None = None, inputs: str | None = None,
               loss: str | None = None, backend: str = "cuda", flash_ok: bool = True) -> StepTrace:
    """The trace of user code `ref` under `config` (cached per shape class)."""
    key = config.model_copy(update={"grad_accum": 1, "instances": 1, "parallelism": "single"})
    return _at_batch("user", (ref, json.dumps(options or {}, sort_keys=True), inputs, loss, backend, flash_ok),
                     key.model_dump_json())
