"""The kernels of one micro-step as the run trains it: every parameter, or adapters on a frozen base.

Why its own module: the full-training kernel list (planner.perf.kernels) is what the adapters reshape
(planner.adapters.speed builds on its kernel records), so the step that picks between them sits above both;
kernels.py never imports the adapters back.
"""

from __future__ import annotations

from planner.adapters.lora import plan
from planner.adapters.speed import lora_kernels
from planner.ir.context import Ctx
from planner.parallel import frameworks
from planner.perf.fused import megatron_kernels
from planner.perf.kernels import Kernel, shapes_for, training_kernels
from planner.spec import ModelSpec, TrainConfig


def micro_kernels(model: ModelSpec, config: TrainConfig, *, causal_fraction: float = 1.0,
                  flash_ok: bool = True, padded: bool | None = None, ctx: Ctx | None = None) -> list[Kernel]:
    """Forward, backward and recompute kernels of one micro-step, identical layers folded (`count`); with
    LoRA (`config.lora`) the frozen base's gradients dropped and the adapters' kernels added."""
    kernels = training_kernels(model, config, causal_fraction=causal_fraction, flash_ok=flash_ok, padded=padded,
                               ctx=ctx)
    if not config.lora:
        if frameworks.get(config.framework).kernels == "megatron":  # fused kernels (planner.perf.fused)
            sh = shapes_for(model, config, ctx, padded, flash_ok)
            return megatron_kernels(kernels, model, sh.b * sh.s)
        return kernels
    sh = shapes_for(model, config, ctx, padded, flash_ok)
    return lora_kernels(model, config, kernels, sh, plan(model, config))
