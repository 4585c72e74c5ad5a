"""FP8 training (issue 35): which library a recipe means, which copies of a weight exist, what a Linear saves,
which GEMMs run in FP8 and which casting kernels each FP8 Linear adds.

The model: `--precision fp8` is amp-bf16 (fp32 master weights, bf16 autocast or FSDP's bf16 policy, bf16
activations, residual and every non-linear op) with the transformer layers' nn.Linear GEMMs in FP8. Two
libraries, told apart by the recipe:

- torchao float8 (torchtitan's `--model.converters float8`), recipes "tensorwise" (the default of
  `Float8LinearConfig()` and of torchtitan's Float8 config, whose recipe_name None means tensorwise) and
  "rowwise". Dynamic scaling: the input, the weight and the output gradient are each cast per GEMM (an amax
  reduction, then a scaled cast), in the forward and again in the backward. The autograd function saves the
  HIGH-PRECISION input and weight (pytorch/ao torchao/float8/float8_linear.py `matmul_with_hp_or_float8_args.
  forward`: `ctx.save_for_backward(input_hp, weight_hp_t)`) and recasts in backward: saved activations are
  those of amp-bf16, and no FP8 weight copy outlives its GEMM. The LM head stays 16-bit (torchtitan
  torchtitan/components/quantization/float8.py: `filter_fqns` default ["output"]; embeddings and norms are not
  nn.Linear). With FSDP2, `enable_fsdp_float8_all_gather` (`--fp8-param-gather`) all-gathers the weights
  already cast to FP8: one byte per gathered parameter of an FP8 Linear instead of two.
- Transformer Engine (Megatron-Core's `--fp8-format`/`--fp8-recipe`, and any te.Linear), recipes "delayed"
  (`DelayedScaling`: TE's default recipe and Megatron's `--fp8-recipe` default), "current"
  (`Float8CurrentScaling`) and "mxfp8" (`MXFP8BlockScaling`, Blackwell, sm100+: one E8M0 scale per 32
  elements). te.Linear casts its input once and saves the FP8 copy for the weight-gradient GEMM (on Hopper the
  column-major, transposed copy that the TN-only FP8 GEMM needs), and saves the FP8 weight and its transpose
  from the forward to the backward (transformer_engine/pytorch/module/linear.py `_Linear.forward`:
  `ctx.save_for_backward(saved_inputmat, weightmat, ...)`). Delayed scaling keeps an amax history per FP8
  tensor: `amax_history_len` default 1024 fp32 entries (transformer_engine/common/recipe/__init__.py
  `DelayedScaling.amax_history_len: int = 1024`), three tensors in the forward (input, weight, output) and two
  in the backward (output gradient, input gradient) per Linear.

Assumptions, named: the same GEMM efficiency as a 16-bit GEMM at the FP8 peak (no FP8-specific fit: there are
no FP8 readings yet); the casting kernels as memory-bound passes; Blackwell keeps TE's two copies as Hopper
does (MXFP8 needs both directions' scales; for per-tensor recipes on sm100 TE may skip the transpose, not
modelled).
"""

from __future__ import annotations

F8 = "float8_e4m3fn"
TORCHAO = ("tensorwise", "rowwise")
TRANSFORMER_ENGINE = ("delayed", "current", "mxfp8")
# TE DelayedScaling.amax_history_len default (transformer_engine/common/recipe/__init__.py).
AMAX_HISTORY_LEN = 1024
# Scaling tensors with a history per te.Linear: forward input, weight, output; backward grad output, grad input
# (TE's FP8FwdTensors GEMM1_INPUT/WEIGHT/OUTPUT and FP8BwdTensors GRAD_OUTPUT1/GRAD_INPUT1).
AMAX_TENSORS_PER_LINEAR = 5
# MXFP8: one 8-bit (E8M0) scale per block of 32 elements (MXFP8BlockScaling; OCP MX spec v1.0).
MX_BLOCK = 32
# FP8 tensor cores: Ada (sm89) and later (torch `_scaled_mm`: "FP8 is only supported on H100+, SM 8.9 and
# MI300+ devices", test/test_scaled_matmul_cuda.py); MXFP8 GEMMs on sm100+ ("MX gemm is only supported on
# CUDA capability 10.0+", same file).
FP8_MIN_CC = (8, 9)
MXFP8_MIN_CC = (10, 0)


def default_recipe(framework: str) -> str:
    """The recipe a framework runs when none is named: Megatron-Core runs Transformer Engine, whose default
    recipe is DelayedScaling (and Megatron's `--fp8-recipe` default is "delayed"); everything else here reaches
    FP8 through torchao float8, whose `Float8LinearConfig()` default is tensorwise (torchtitan's too)."""
    return "delayed" if framework == "megatron" else "tensorwise"


def library(recipe: str) -> str:
    return "torchao" if recipe in TORCHAO else "transformer-engine"


def input_saved(recipe: str) -> tuple[str, float] | None:
    """(dtype, bytes per element) of the FP8 copy of its input a Linear saves for backward; None: the
    high-precision input is saved, as under amp-bf16 (torchao)."""
    if recipe in TORCHAO:
        return None
    return F8, 1 + (1 / MX_BLOCK if recipe == "mxfp8" else 0)


def weight_copies(recipe: str) -> float:
    """Bytes per weight element of the FP8 copies a Linear saves from its forward to its backward: none under
    torchao (it recasts), the FP8 weight and its transpose under Transformer Engine (plus MX scales)."""
    if recipe in TORCHAO:
        return 0.0
    return 2 * (1 + (1 / MX_BLOCK if recipe == "mxfp8" else 0))


def amax_history_bytes(recipe: str, linears: int) -> int:
    """fp32 amax histories of delayed scaling for `linears` FP8 Linears (0 for the other recipes)."""
    return linears * AMAX_TENSORS_PER_LINEAR * AMAX_HISTORY_LEN * 4 if recipe == "delayed" else 0


def gather_bytes(param_gather: bool) -> int:
    """Bytes per gathered parameter of an FP8 Linear under FSDP2 (torchao enable_fsdp_float8_all_gather)."""
    return 1 if param_gather else 2
