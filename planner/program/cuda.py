"""CPU → CUDA mappings for what the tracer records on CPU: one function per rule, each with its source.

The tracer runs a step on CPU fake tensors; the GPU would run other kernels for a few ops. Each rule here
says how one recorded storage (the output `index` of ATen op `op`, `numel` elements of `dtype`) would look on
CUDA, or how an op is swapped for the kernel CUDA would run. The analytic core (`planner.memory.activations`)
uses the same named rules (`dropout_saved`, `norm_stats_dtype`, `autocast_fp32_op`, `sdpa_kernel`,
`alloc_bytes`), so both paths share one registry: the functions below call them instead of restating them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from planner.memory import activations as rules
from planner.spec import BYTES_PER_DTYPE, Backend

# Outputs of the fused SDPA kernels that live on the host: the Philox RNG seed and offset. Source:
# aten/src/ATen/native/transformers/cuda/attention.cu (`_efficient_attention_forward`,
# `_flash_attention_forward`): seed/offset are CPU int64 tensors unless captured in a CUDA graph.
HOST_OUTPUTS: dict[str, tuple[int, ...]] = {
    "aten._scaled_dot_product_efficient_attention.default": (2, 3),
    "aten._scaled_dot_product_flash_attention.default": (6, 7),
}
# Ops whose outputs 1.. are per-row / per-feature statistics (mean, rstd / save_mean, save_invstd).
NORM_OPS: tuple[str, ...] = (
    "aten.native_layer_norm.default",
    "aten.native_batch_norm.default",
    "aten._native_batch_norm_legit.default",
    "aten._native_batch_norm_legit_functional.default",
    "aten._native_batch_norm_legit.no_stats",
)
# CPU dropout (`_dropout_impl`, aten/src/ATen/native/Dropout.cpp) fills a noise tensor with bernoulli_ and
# multiplies; the storage last written by this op is that noise.
DROPOUT_NOISE_OP = "aten.bernoulli_.float"


@dataclass(frozen=True)
class Storage:
    """One storage as the device would hold it: `numel` elements of `dtype`; `host` when not on the GPU."""

    numel: int
    dtype: str
    rule: str = ""
    host: bool = False

    @property
    def nbytes(self) -> int:
        return 0 if self.host else self.numel * BYTES_PER_DTYPE.get(self.dtype, 4)


def dropout_mask(op: str, index: int, numel: int, dtype: str, backend: Backend) -> Storage | None:
    """CPU saves a noise tensor of x's dtype, CUDA's fused `native_dropout` a 1-byte mask
    (`rules.dropout_saved`)."""
    if op != DROPOUT_NOISE_OP:
        return None
    saved = rules.dropout_saved("dropout", numel, dtype, 0.5, backend)[0]
    return Storage(saved.numel, saved.dtype, "dropout_saved")


def norm_statistics(op: str, index: int, numel: int, dtype: str, backend: Backend) -> Storage | None:
    """LayerNorm / BatchNorm statistics are fp32 on CUDA, the input's dtype on CPU (`rules.norm_stats_dtype`)."""
    if op not in NORM_OPS or index == 0:
        return None
    return Storage(numel, rules.norm_stats_dtype(dtype, backend), "norm_stats_dtype")


def philox_state(op: str, index: int, numel: int, dtype: str, backend: Backend) -> Storage | None:
    """Fused attention's RNG seed and offset are host tensors on CUDA (HOST_OUTPUTS)."""
    if backend != "cuda" or index not in HOST_OUTPUTS.get(op, ()):
        return None
    return Storage(numel, dtype, "philox_state", host=True)


STORAGE_RULES: tuple[Callable[[str, int, int, str, Backend], Storage | None], ...] = (
    dropout_mask, norm_statistics, philox_state)


def device_storage(op: str, index: int, numel: int, dtype: str, backend: Backend) -> Storage:
    """The storage created as output `index` of `op` on `backend`: the first rule that applies, else as is."""
    if backend == "cuda":
        for rule in STORAGE_RULES:
            mapped = rule(op, index, numel, dtype, backend)
            if mapped is not None:
                return mapped
    return Storage(numel, dtype)


def allocation_bytes(nbytes: int, backend: Backend) -> int:
    """Bytes one storage takes in the allocator (`rules.alloc_bytes`: 512-byte blocks on CUDA)."""
    return rules.alloc_bytes(nbytes, backend)


def sdpa_kernel(backend: Backend, attention: str, flash_ok: bool, dtype: str, dropout_p: float, masked: bool,
                head_dim: int, mask_requires_grad: bool = False) -> str:
    """The SDPA kernel the device would pick (`rules.sdpa_kernel`): math, cpu_flash, flash or efficient.
    A mask that requires grad takes the math path (`rules.sdpa_math_for_mask_grad`)."""
    ctx = rules.Ctx(1, 1, "fp32", attention, backend, masked, flash_ok)
    return rules.sdpa_kernel(ctx, dtype, dropout_p, masked, head_dim, mask_requires_grad)


def sdpa_math_dtype(dtype: str, backend: Backend) -> str:
    """The dtype SDPA's math path computes in (`rules.math_sdpa_dtype`: fp32 for 16-bit inputs)."""
    return rules.math_sdpa_dtype(dtype, backend)


# Python entry points of the ops CUDA autocast runs in fp32 and CPU autocast does not (`rules.autocast_fp32_op`):
# (owner, attribute, op name in the rule). Source: ATen/autocast_mode.h AT_FORALL_FP32; measured on CPU.
AUTOCAST_FP32_FUNCTIONS: tuple[tuple[str, str, str], ...] = (
    ("torch.nn.functional", "softmax", "softmax"), ("torch", "softmax", "softmax"),
    ("torch.Tensor", "softmax", "softmax"),
    ("torch.nn.functional", "log_softmax", "log_softmax"), ("torch", "log_softmax", "log_softmax"),
    ("torch.Tensor", "log_softmax", "log_softmax"),
    ("torch.nn.functional", "layer_norm", "layer_norm"),
    ("torch", "pow", "pow"), ("torch.Tensor", "pow", "pow"), ("torch.Tensor", "__pow__", "pow"),
    ("torch", "rsqrt", "rsqrt"), ("torch.Tensor", "rsqrt", "rsqrt"),
)


# The fp32 ops whose policy is fp32_set_opt_dtype (ATen/autocast_mode.h AT_FORALL_FP32_SET_OPT_DTYPE): an
# explicit dtype argument is kept, only a missing one becomes fp32.
SET_OPT_DTYPE_OPS: tuple[str, ...] = ("softmax", "log_softmax")


def autocast_fp32_op(op: str, backend: Backend) -> bool:
    """Whether autocast runs `op` in fp32 on `backend` (`rules.autocast_fp32_op`)."""
    return rules.autocast_fp32_op(op, backend)
