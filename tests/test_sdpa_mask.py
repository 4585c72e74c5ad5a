"""The additive bias SDPA makes of a bool mask, as the tracer emulates it for CUDA (planner.program.trace
.additive_mask), against what torch dispatches for the same conversion (attention.cpp
`convert_boolean_attn_mask`, shared by the CPU and CUDA paths): the same ops, dtypes and shapes, and no fp32
intermediate when the query is 16-bit."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from planner.program.trace import additive_mask


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, str, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        first = out[0] if isinstance(out, tuple) else out
        self.ops.append((str(func), str(first.dtype), tuple(first.shape)))
        return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_bool_mask_becomes_one_where_in_the_query_dtype(dtype):
    q = torch.randn(2, 4, 8, 16, dtype=dtype)
    mask = torch.ones(2, 1, 8, 8, dtype=torch.bool)
    mask[1, ..., -1] = False
    with _Ops() as real:
        torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=mask)
    conversion = [op for op in real.ops if "attention" not in op[0]]  # what runs before the kernel
    with _Ops() as emulated:
        bias = additive_mask(mask, dtype)
    assert emulated.ops == conversion
    assert [op for op in emulated.ops if op[2]] == [("aten.where.self", str(dtype), (2, 1, 8, 8))]
    assert bias[1, 0, 0, -1] == float("-inf") and bias[0, 0, 0, 0] == 0
