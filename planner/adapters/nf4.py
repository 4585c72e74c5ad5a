"""How bitsandbytes stores one 4-bit weight (QLoRA's NF4 with double quantization), tensor by tensor.

From bitsandbytes 0.50 `functional.quantize_4bit(A, blocksize=64, compress_statistics=True, quant_type="nf4")`,
which transformers' `Linear4bit` weights go through (`Params4bit._quantize`), and `quantize_blockwise(absmax -
offset, blocksize=256)` for the second level:
- the packed weight: two 4-bit codes per byte, (n + 1) // 2 uint8 for n = out × in elements;
- absmax, one per block of 64 elements: ceil(n / 64) values, themselves quantized to uint8 (double quantization);
- offset: the mean of those absmax values, a 0-dim fp32 tensor;
- the second level's absmax, one fp32 per block of 256 first-level absmax values;
- the NF4 code (16 fp32; `get_4bit_type` makes a new tensor per call) and the second level's dynamic code
  (256 fp32; `quantize_blockwise` keeps `code.to(device, copy=True)`, so a copy per weight).
tests/test_lora.py quantizes real weights of several shapes on the CPU and compares every storage.
"""

from __future__ import annotations

import math

BLOCKSIZE = 64  # bitsandbytes quantize_4bit default (Params4bit blocksize=None -> 64)
NESTED_BLOCKSIZE = 256  # quantize_4bit(compress_statistics=True): quantize_blockwise(absmax, blocksize=256)
NF4_CODE_VALUES = 16  # get_4bit_type("nf4"): 16 fp32 values
DYNAMIC_CODE_VALUES = 256  # create_dynamic_map(): 256 fp32 values
FLOAT32_BYTES = 4


def weight_storages(numel: int, double_quant: bool = True) -> dict[str, int]:
    """Bytes of each storage bitsandbytes keeps for one 4-bit weight of `numel` elements."""
    blocks = math.ceil(numel / BLOCKSIZE)
    out = {"packed": (numel + 1) // 2, "code": NF4_CODE_VALUES * FLOAT32_BYTES}
    if not double_quant:
        return out | {"absmax": blocks * FLOAT32_BYTES}
    return out | {
        "absmax": blocks,  # uint8
        "offset": FLOAT32_BYTES,
        "nested_absmax": math.ceil(blocks / NESTED_BLOCKSIZE) * FLOAT32_BYTES,
        "nested_code": DYNAMIC_CODE_VALUES * FLOAT32_BYTES,
    }


def weight_bytes(numel: int, double_quant: bool = True) -> int:
    """All storages of one 4-bit weight, exact (numel × element size, before the CUDA allocator's rounding)."""
    return sum(weight_storages(numel, double_quant).values())


def bits_per_parameter(numel: int) -> float:
    """Effective storage per weight element: 4 + 8/64 + 32/(64·256) ≈ 4.127 bits for a large matrix."""
    return 8 * weight_bytes(numel) / numel
