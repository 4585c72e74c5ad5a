"""Hugging Face helpers for the tracer: per-layer checkpointing (transformers 4 and 5 spellings)."""

from __future__ import annotations

from typing import Any


def enable_checkpointing(model: Any) -> None:
    """Non-reentrant per-layer checkpointing, as `jobs/modeling.py enable_checkpointing` (what planner models);
    transformers 5 renamed gradient_checkpointing_enable to activation_checkpointing_enable."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
