"""Bytes of parameters and gradients by precision.

PyTorch AMP (autocast + GradScaler) keeps fp32 parameters and fp32 gradients and casts weights to 16 bit
on the fly (the casts are cached for the forward and saved for backward: see activations). This differs
from the ZeRO paper's "mixed precision" (fp16 params + fp32 master copy). Pure fp16/bf16
training casts the model itself: 2-byte parameters and gradients.
"""

from __future__ import annotations

from planner.spec import TrainConfig


def parameter_dtype_bytes(precision: str) -> int:
    """fp32 and AMP keep fp32 parameters (4 B); pure fp16/bf16 keep 2 B."""
    return 2 if precision in ("fp16", "bf16") else 4


def gradient_dtype_bytes(precision: str) -> int:
    """A gradient has its parameter's dtype (param.grad is allocated like the parameter)."""
    return parameter_dtype_bytes(precision)


def parameter_bytes(num_parameters: int, config: TrainConfig, share: float = 1.0) -> int:
    return int(num_parameters * parameter_dtype_bytes(config.precision) * share)


def gradient_bytes(num_parameters: int, config: TrainConfig, share: float = 1.0) -> int:
    return int(num_parameters * gradient_dtype_bytes(config.precision) * share)
