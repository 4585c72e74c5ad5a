"""Where traced models come from (user code `file.py:build`, or a Hugging Face config.json outside the six
hand-modelled families), and the trace cache.

A model is traced once per shape class: (model, options, inputs, loss, batch, seq, precision, checkpointing,
attention, optimizer, backend, flash_ok). Search evaluates many configurations of the same model, so the
cache keeps a search over a traced model interactive (`TRACE_CACHE_SIZE` entries, least recently used out);
the traces are also kept on disk for the next process (`planner.program.trace_cache`). One estimate traces
its own micro-batch once; a caller that asks for many micro-batches of a class (`many_batches`: a search,
explain's largest fitting batch) gets the two base traces and every other micro-batch interpolated.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Any

from planner import caches
from planner.errors import PlannerError
from planner.program import trace_cache
from planner.program.records import StepTrace
from planner.spec import TrainConfig

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

    def make() -> StepTrace:
        from planner.adapters.traced import with_adapters
        from planner.program.trace import trace_step

        build = with_adapters(user_module.model_builder(ref, json.loads(options_json)), config)
        return trace_step(build, user_module.batch_maker(inputs, json.loads(options_json)),
                          config, loss_fn=user_module.loss_function(loss), backend=backend,  # type: ignore[arg-type]
                          flash_ok=flash_ok, name=ref.rsplit("/", 1)[-1], source=ref,
                          enable_checkpointing=_checkpointing_for,
                          before_key=("user", ref, options_json, inputs, loss, _but_optimizer(config), backend,
                                      flash_ok))

    return trace_cache.cached(_parts("user", (ref, options_json, inputs, loss, backend, flash_ok), config_json),
                              make, user_code=True)


def _but_optimizer(config: TrainConfig) -> str:
    """The shape class without the optimizer and its implementation: what the trace before the optimizer
    step depends on (`trace_step`'s `before_key`; the step is spliced on per optimizer)."""
    return config.model_copy(update={"optimizer": "adamw", "optimizer_impl": "foreach"}).model_dump_json()


def _absolute(*refs: str | None) -> list[str | None]:
    """The absolute path of each FILE.py:FUNCTION (the same relative path elsewhere is another file)."""
    import os

    return [os.path.abspath(os.path.expanduser(r.rsplit(":", 1)[0])) if r else None for r in refs]


@caches.lru(TRACE_CACHE_SIZE, scope="model", key="(config.json path, options, config JSON, backend, flash)")
def _config_trace(path: str, options_json: str, config_json: str, backend: str, flash_ok: bool) -> StepTrace:
    from pathlib import Path

    from planner.models.hf_config import load_config_file

    config = TrainConfig.model_validate_json(config_json)
    raw = load_config_file(path)
    label = Path(path).stem if Path(path).stem != "config" else Path(path).parent.name

    def make() -> StepTrace:
        from planner.adapters.traced import with_adapters
        from planner.program import hf
        from planner.program.trace import trace_step

        hf_config = hf.hf_config_object(raw, path, config.attention, json.loads(options_json))
        return trace_step(with_adapters(hf.builder(hf_config, path), config), hf.batch_maker(hf_config, path),
                          config, backend=backend,  # type: ignore[arg-type]
                          flash_ok=flash_ok, name=label or path, source=path,
                          enable_checkpointing=_checkpointing_for,
                          before_key=("config", path, options_json, _but_optimizer(config), backend, flash_ok))

    return trace_cache.cached(_parts("config", (path, options_json, backend, flash_ok), config_json), make)


def _parts(kind: str, args: tuple, config_json: str) -> dict[str, Any]:
    """What a trace is made from, for its key on disk (`trace_cache`): the model as given and as absolute
    paths (the same relative path elsewhere is another model), a config.json's contents, and the arguments."""
    import os

    if kind == "user":
        ref, options_json, inputs, loss, backend, flash_ok = args
        return {"kind": kind, "model": ref, "files": _absolute(ref, inputs, loss), "options": options_json,
                "inputs": inputs, "loss": loss, "config": config_json, "backend": backend, "flash_ok": flash_ok}
    from planner.models.hf_config import load_config_file

    path, options_json, backend, flash_ok = args
    return {"kind": kind, "model": path, "file": os.path.abspath(path), "contents": load_config_file(path),
            "options": options_json, "config": config_json, "backend": backend, "flash_ok": flash_ok}


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


# Trace micro-batches other than scale.BASE_BATCHES by interpolating two traces (planner.program.scale) while a
# caller asks for many micro-batches (`many_batches`); False traces every micro-batch itself (exact to the
# byte; seconds per batch size instead of none).
SCALE_TRACES = True

# Callers now inside `many_batches` (a search, explain's largest fitting batch and its fixes).
_MANY = [0]


@contextlib.contextmanager
def many_batches() -> Iterator[None]:
    """Within: a micro-batch other than the base ones (scale.BASE_BATCHES) is interpolated from the two base
    traces, so a shape class costs two traces and every micro-batch after them none. Outside: the micro-batch
    asked is traced itself, one trace instead of two (issue 38: a single estimate wants one batch size).

    Both give the same answer, byte for byte, where the step is the same program at every micro-batch (sizes
    affine in the batch: `scale.scaled` checks the two base traces agree op by op and every interpolated size
    is whole, and tests/test_trace_once.py compares the two ways); a direct trace is the measurement itself,
    so only the note saying the trace was interpolated differs."""
    _MANY[0] += 1
    try:
        yield
    finally:
        _MANY[0] -= 1


def _interpolates(config_json: str) -> bool:
    """Whether the shape class's trace at this micro-batch comes from the base traces (`many_batches`)."""
    from planner.program.scale import BASE_BATCHES

    b = json.loads(config_json)["batch_size"]
    return SCALE_TRACES and _MANY[0] > 0 and b > BASE_BATCHES[0] and b not in BASE_BATCHES


# Shape classes whose trace raised (a BatchNorm given one sample, data-dependent control flow): the same error
# again without tracing again (a search proposes micro-batch 1 many times; each try cost a trace).
_FAILED: dict[tuple, PlannerError] = caches.table("planner.program.sources._FAILED",
                                                   key="(source kind, its arguments, config JSON)", scope="model")


def _at_batch(kind: str, args: tuple, config_json: str) -> StepTrace:
    """The trace at the config's micro-batch: traced itself, or interpolated (`_traced_at_batch`) within
    `many_batches`; remembering a shape class that cannot be traced."""
    failed = _FAILED.get((kind, args, config_json))
    if failed is not None:
        raise failed
    try:
        if _interpolates(config_json):
            return _traced_at_batch(kind, args, config_json)
        direct = _user_trace if kind == "user" else _config_trace
        return direct(*args[:-2], config_json, *args[-2:])
    except PlannerError as exc:
        _FAILED[(kind, args, config_json)] = exc
        raise


@caches.lru(TRACE_CACHE_SIZE, scope="model", key="(source kind, its arguments, config JSON)")
def _traced_at_batch(kind: str, args: tuple, config_json: str) -> StepTrace:
    """The trace at the config's micro-batch: interpolated from the base batches' traces when it is not one
    of them (and they are the same program), else traced directly."""
    from planner.program.scale import BASE_BATCHES, scaled

    direct = _user_trace if kind == "user" else _config_trace
    config = TrainConfig.model_validate_json(config_json)
    b = config.batch_size
    if not (SCALE_TRACES and b > BASE_BATCHES[0] and b not in BASE_BATCHES):
        return direct(*args[:-2], config_json, *args[-2:])
    b0, b1 = BASE_BATCHES
    bases = [config.model_copy(update={"batch_size": x}).model_dump_json() for x in (b0, b1)]

    def make() -> StepTrace:
        t0, t1 = (direct(*args[:-2], base, *args[-2:]) for base in bases)
        out = scaled(t0, t1, b0, b1, b)
        if out is None:
            return direct(*args[:-2], config_json, *args[-2:])
        from dataclasses import replace

        return replace(out, notes=(*out.notes, f"traced at micro-batches {b0} and {b1}, interpolated to {b}"))

    # kept on disk as well: reading one trace back costs less than reading two and interpolating
    parts = {"interpolated": [_parts(kind, args, base) for base in bases], "batch": b, "config": config_json}
    return trace_cache.cached(parts, make, user_code=kind == "user")


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
