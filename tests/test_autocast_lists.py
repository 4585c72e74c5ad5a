"""The planner's CUDA autocast fp32 list against the one PyTorch compiles: ATen/autocast_mode.h, shipped in the
torch wheel (torch/include/ATen/autocast_mode.h), whose AT_FORALL_FP32 and AT_FORALL_FP32_SET_OPT_DTYPE
macros list the ops CUDA autocast runs in fp32. A name the planner puts on that list must be on it; the
cross-entropy composite must not be (it was, until issue 36: `activations.cross_entropy_saved` says why it
matters)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from planner.ir.context import autocast_fp32_op

HEADER = Path(torch.__file__).parent / "include" / "ATen" / "autocast_mode.h"
# the planner's op names -> ATen's
ATEN = {"softmax": "softmax", "log_softmax": "log_softmax", "layer_norm": "layer_norm", "pow": "pow",
        "rsqrt": "rsqrt", "sum": "sum", "nll_loss": "nll_loss", "bce_with_logits": "binary_cross_entropy_with_logits",
        "cross_entropy": "cross_entropy_loss"}


def _macro(text: str, name: str) -> set[str]:
    body = re.search(rf"#define {name}\(_\)(.*?)(?:\n\s*\n|#define)", text, re.S)
    assert body, f"{name} not in {HEADER}"
    return set(re.findall(r"_\((\w+)", body.group(1)))


@pytest.fixture(scope="module")
def cuda_fp32() -> set[str]:
    if not HEADER.exists():
        pytest.skip("this torch build ships no ATen headers")
    text = HEADER.read_text()
    return _macro(text, "AT_FORALL_FP32") | _macro(text, "AT_FORALL_FP32_SET_OPT_DTYPE")


def test_the_header_parses_to_the_lists_it_holds(cuda_fp32):
    assert {"layer_norm", "nll_loss", "log_softmax", "softmax", "exp"} <= cuda_fp32  # the test can read it


@pytest.mark.parametrize("op", sorted(ATEN))
def test_the_planners_cuda_fp32_ops_are_the_headers(op, cuda_fp32):
    assert autocast_fp32_op(op, "cuda") == (ATEN[op] in cuda_fp32), (op, ATEN[op])
