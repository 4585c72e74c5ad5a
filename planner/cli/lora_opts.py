"""The LoRA / QLoRA flags shared by estimate, explain and probe, and the TrainConfig fields they set."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from planner.errors import PlannerError

LoraROpt = Annotated[int | None, typer.Option("--lora-r", help="LoRA rank: train adapters on a frozen base "
                                              "(default: train every parameter).")]
LoraAlphaOpt = Annotated[float | None, typer.Option("--lora-alpha", help="LoRA alpha (peft's default 8).")]
LoraTargetsOpt = Annotated[str | None, typer.Option(
    "--lora-targets", help="Modules to adapt, comma-separated (q_proj,v_proj; c_attn), or all-linear "
                           "(default: peft's for the model type); experts adds an MoE model's fused experts "
                           "(peft's target_parameters).")]
LoraDropoutOpt = Annotated[float, typer.Option("--lora-dropout", help="LoRA dropout (default 0).")]
BaseDtypeOpt = Annotated[str, typer.Option(
    "--base-dtype", help="Frozen base storage: auto (as --precision implies), fp32, bf16, fp16, or nf4 "
                         "(QLoRA: bitsandbytes 4-bit).")]


def lora_fields(lora_r: int | None, lora_alpha: float | None, lora_targets: str | None, lora_dropout: float,
                base_dtype: str) -> dict[str, Any]:
    """The TrainConfig fields of the LoRA flags (empty when none is given)."""
    out: dict[str, Any] = {}
    if lora_r is not None:
        out["lora_r"] = lora_r
    if lora_alpha is not None:
        out["lora_alpha"] = lora_alpha
    if lora_targets is not None:
        names = tuple(t.strip() for t in lora_targets.split(",") if t.strip())
        if not names:
            raise PlannerError("--lora-targets", lora_targets, "module names separated by commas, or all-linear")
        out["lora_targets"] = names
    if lora_dropout:
        out["lora_dropout"] = lora_dropout
    if base_dtype != "auto":
        out["base_dtype"] = base_dtype
    return out


def lora_flags(config: Any) -> list[str]:
    """The flags that reproduce a config's LoRA fields (for the probe line)."""
    if not config.lora:
        return []
    parts = [f"--lora-r {config.lora_r}"]
    if config.lora_alpha is not None:
        parts.append(f"--lora-alpha {config.lora_alpha:g}")
    if config.lora_targets:
        parts.append(f"--lora-targets {','.join(config.lora_targets)}")
    if config.lora_dropout:
        parts.append(f"--lora-dropout {config.lora_dropout:g}")
    if config.base_dtype != "auto":
        parts.append(f"--base-dtype {config.base_dtype}")
    return parts
