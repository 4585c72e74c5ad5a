"""FP8 Linears for the probe job (issue 35 item 6): torchao float8 or Transformer Engine, as the recipe says.

`probe.py` imports this for `precision: fp8`. Like the other job files it needs only torch and the standard
library; the FP8 library is the image's own (never pip-installed here: torchao and Transformer Engine are built
against one torch and one CUDA, and a wheel from PyPI can replace neither safely).

What runs, as the planner models it (planner/ir/fp8.py, docs/fp8-and-compile.md):

* Which library: the recipe decides. `tensorwise` and `rowwise` are torchao float8 recipes
  (`Float8LinearConfig.from_recipe_name`, pytorch/ao torchao/float8/config.py @36027d82
  `Float8LinearRecipeName`), converted with `convert_to_float8_training` (torchao/float8/float8_linear_utils.py);
  `delayed`, `current` and `mxfp8` are Transformer Engine's `DelayedScaling`, `Float8CurrentScaling` and
  `MXFP8BlockScaling` (transformer_engine/common/recipe), each `nn.Linear` replaced by a `te.Linear` holding the
  same weights and the forward run inside TE's FP8 autocast. A recipe is never run by the other library: the
  reading would not be the configuration the planner predicted.
* Which Linears: those inside the decoder layers (the classes the model lists in `_no_split_modules`, which is
  also what FSDP wraps), with both weight dimensions divisible by 16 (FP8 tensor cores' requirement, the rule of
  torchtitan's `module_filter_fn`, torchtitan/components/quantization/utils.py @03a13843). The LM head and
  classifier heads stay 16-bit (torchtitan's `filter_fqns` default ["output"]); embeddings, norms, routers and
  transformers' grouped experts (3-D parameters, not nn.Linear) are not Linears and stay as they are.
* Everything else computes as amp-bf16 (`probe.py` autocasts to bf16 under `precision: fp8`).
* `fp8_param_gather` (torchao only, FSDP2): `Float8LinearConfig(enable_fsdp_float8_all_gather=True)`.

Refused with one line (`Fp8Unavailable`, which the probe reports as `unsupported`): a CPU or a GPU without FP8
tensor cores (sm89+; MXFP8 sm100+), and an image without the recipe's library.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

TORCHAO_RECIPES = ("tensorwise", "rowwise")
TRANSFORMER_ENGINE_RECIPES = ("delayed", "current", "mxfp8")
RECIPES = TORCHAO_RECIPES + TRANSFORMER_ENGINE_RECIPES
# FP8 tensor cores: Ada (sm89) and later; MXFP8 GEMMs sm100+ (as planner/ir/fp8.py FP8_MIN_CC, MXFP8_MIN_CC)
FP8_MIN_CC = (8, 9)
MXFP8_MIN_CC = (10, 0)
FP8_GPUS = "L4, L40S, H100, H200, B200"  # the GPUs of the planner's instance types with sm89+
HEAD_NAMES = ("lm_head", "score", "classifier", "output")  # heads stay 16-bit (torchtitan filter_fqns)
ALIGN = 16


class Fp8Unavailable(Exception):
    """FP8 cannot run here (device or library): the probe reports it as `unsupported`, one line."""


def library(recipe: str) -> str:
    if recipe not in RECIPES:
        raise Fp8Unavailable(f"fp8_recipe={recipe!r}: one of {', '.join(RECIPES)}")
    return "torchao" if recipe in TORCHAO_RECIPES else "transformer-engine"


def check_device(recipe: str, device: Any, capability: tuple[int, int] | None) -> None:
    """FP8 tensor cores on this device, or one line saying what the recipe needs."""
    if getattr(device, "type", str(device)) != "cuda" or capability is None:
        raise Fp8Unavailable(f"precision=fp8 needs a CUDA GPU with FP8 tensor cores (sm89+: {FP8_GPUS}); this "
                             f"probe runs on {getattr(device, 'type', device)}")
    need = MXFP8_MIN_CC if recipe == "mxfp8" else FP8_MIN_CC
    if tuple(capability) < need:
        what = "MXFP8 (fp8_recipe=mxfp8) needs Blackwell, sm100+" if recipe == "mxfp8" else \
            f"precision=fp8 needs FP8 tensor cores, sm89+ ({FP8_GPUS})"
        raise Fp8Unavailable(f"{what}; this GPU is sm{capability[0]}{capability[1]}")


def check_library(recipe: str) -> str:
    """The recipe's library imported (its version), or one line naming what the image lacks."""
    lib = library(recipe)
    try:
        if lib == "torchao":
            import torchao  # type: ignore[import-not-found]
            import torchao.float8  # type: ignore[import-not-found]  # noqa: F401

            return str(getattr(torchao, "__version__", "?"))
        import transformer_engine  # type: ignore[import-not-found]
        import transformer_engine.pytorch  # type: ignore[import-not-found]  # noqa: F401

        return str(getattr(transformer_engine, "__version__", "?"))
    except ImportError as exc:
        other = "a Transformer Engine recipe (delayed, current)" if lib == "torchao" else \
            "a torchao recipe (tensorwise, rowwise)"
        module = "torchao.float8" if lib == "torchao" else "transformer_engine.pytorch"
        raise Fp8Unavailable(f"fp8_recipe={recipe} runs {lib} ({module}), which this image lacks ({exc.name or exc}); "
                             f"use an image that has it (--image), or {other}") from exc


def layer_classes(model: Any) -> set[str]:
    """The decoder-layer classes of every transformers model inside (their `_no_split_modules`)."""
    names: set[str] = set()
    for module in model.modules():
        names |= set(getattr(module, "_no_split_modules", None) or [])
    return names


def eligible(model: Any) -> tuple[list[str], dict[str, str]]:
    """(the Linears to convert, {Linear kept in 16 bits: why}) by fully qualified name."""
    import torch

    layers = layer_classes(model)
    inside: set[str] = set()
    for name, module in model.named_modules():
        if type(module).__name__ in layers:
            inside |= {f"{name}.{sub}" if name else sub for sub, _ in module.named_modules() if sub}
    convert, kept = [], {}
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        leaf = name.rsplit(".", 1)[-1]
        if leaf in HEAD_NAMES:
            kept[name] = "head"
        elif name not in inside:
            kept[name] = "outside the decoder layers"
        elif module.weight.shape[0] % ALIGN or module.weight.shape[1] % ALIGN:
            kept[name] = f"a dimension not divisible by {ALIGN}"
        else:
            convert.append(name)
    return convert, kept


def convert(model: Any, recipe: str, *, param_gather: bool = False) -> tuple[Any, dict[str, Any]]:
    """Convert `model`'s eligible Linears in place: (the context to run each forward in, what was done)."""
    names, kept = eligible(model)
    if not names:
        raise Fp8Unavailable("precision=fp8: no Linear of the decoder layers has both dimensions divisible by 16")
    info: dict[str, Any] = {"recipe": recipe, "library": library(recipe), "version": check_library(recipe),
                            "converted": len(names), "kept_16bit": kept, "param_gather": param_gather}
    if info["library"] == "torchao":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # type: ignore[import-not-found]

        config = Float8LinearConfig.from_recipe_name(recipe)
        if param_gather:
            config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
        wanted = set(names)
        convert_to_float8_training(model, config=config, module_filter_fn=lambda _m, fqn: fqn in wanted)
        return contextlib.nullcontext, info
    if param_gather:
        raise Fp8Unavailable(f"fp8_param_gather with fp8_recipe={recipe}: FSDP2's FP8 all-gather is torchao's "
                             "(tensorwise, rowwise)")
    return _transformer_engine(model, recipe, names), info


def _transformer_engine(model: Any, recipe: str, names: list[str]) -> Any:
    """Each named nn.Linear replaced by a te.Linear with the same weights; the forward context is TE's FP8
    autocast with the recipe (`te.fp8_autocast(enabled=True, fp8_recipe=)`, kept in TE 2.x; `te.autocast`
    where a newer TE has only that)."""
    import torch
    import transformer_engine.pytorch as te  # type: ignore[import-not-found]
    from transformer_engine.common import recipe as te_recipe  # type: ignore[import-not-found]

    made = {"delayed": te_recipe.DelayedScaling, "current": te_recipe.Float8CurrentScaling,
            "mxfp8": te_recipe.MXFP8BlockScaling}[recipe]()
    for name in names:
        old = model.get_submodule(name)
        new = te.Linear(old.in_features, old.out_features, bias=old.bias is not None,
                        params_dtype=old.weight.dtype, device=old.weight.device)
        with torch.no_grad():
            new.weight.copy_(old.weight)
            if old.bias is not None:
                new.bias.copy_(old.bias)
        model.set_submodule(name, new)
    if hasattr(te, "fp8_autocast"):
        return lambda: te.fp8_autocast(enabled=True, fp8_recipe=made)
    return lambda: te.autocast(enabled=True, recipe=made)
