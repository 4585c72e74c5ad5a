"""`planner explain` for an adapter run: where its memory goes, and what a change of rank, targets, base
storage or checkpointing would save (each a full estimate of the changed configuration, not a formula)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from planner.errors import PlannerError
from planner.spec import Estimate, TrainConfig
from planner.units import fmt_bytes


def adapter_changes(cfg: TrainConfig) -> list[tuple[str, dict[str, Any]]]:
    """The usual knobs of a LoRA recipe, each as (label, TrainConfig fields)."""
    assert cfg.lora_r is not None
    out: list[tuple[str, dict[str, Any]]] = [(f"rank {cfg.lora_r // 2}", {"lora_r": max(cfg.lora_r // 2, 1)}),
                                             (f"rank {cfg.lora_r * 2}", {"lora_r": cfg.lora_r * 2})]
    if cfg.lora_targets != ("all-linear",):
        out.append(("targets all-linear", {"lora_targets": ("all-linear",)}))
    else:
        out.append(("targets: peft's default for the model", {"lora_targets": ()}))
    if cfg.base_dtype != "nf4":
        out.append(("a 4-bit base (QLoRA, --base-dtype nf4)", {"base_dtype": "nf4"}))
    else:
        out.append(("a 16-bit base (--base-dtype auto)", {"base_dtype": "auto"}))
    out.append(("checkpointing off" if cfg.checkpointing else "checkpointing on",
                {"checkpointing": not cfg.checkpointing}))
    return out


def adapter_lines(model: Any, est: Estimate, model_options: dict[str, Any] | None, *,
                  estimate_fn: Callable[..., Estimate]) -> list[str]:
    """The explain step of an adapter run; `estimate_fn` is planner.estimate.estimate, passed in by the
    explanation (the adapters sit below the pipeline and never import it: issue 33)."""
    estimate = estimate_fn

    m, p = est.memory_bytes, est.parameters
    lines = [f"Trainable {p['trainable']:,} of {p['total']:,} parameters ({100 * p['trainable'] / p['total']:.2f} %); "
             f"frozen {p['frozen']:,}.",
             f"Frozen base {fmt_bytes(m.parameters - m.gradients)} (with the adapters: {fmt_bytes(m.parameters)}); "
             f"gradients {fmt_bytes(m.gradients)} and optimizer states {fmt_bytes(m.optimizer_states)}, "
             "for the fp32 adapters only; saved activations "
             f"{fmt_bytes(m.activations)}: a frozen layer keeps only what its input's gradient needs.",
             "What a change would do (peak on the device, each a full estimate):"]
    for label, change in adapter_changes(est.config):
        try:
            alt = estimate(model, TrainConfig(**(est.config.model_dump() | change)), est.instance,
                           model_options=model_options, stack=est.stack)
        except PlannerError as exc:
            lines.append(f"  {label}: not possible ({exc.allowed})")
            continue
        delta = alt.memory_bytes.peak_device - m.peak_device
        speed = f", {alt.throughput.samples_per_s:.1f} samples/s" if alt.throughput else ""
        lines.append(f"  {label}: {fmt_bytes(alt.memory_bytes.peak_device)} "
                     f"({'+' if delta >= 0 else '-'}{fmt_bytes(abs(delta))}), {alt.verdict}{speed}")
    return lines
