"""Optimizer states (persistent, allocated at the first step) and the temporaries a step allocates, per tensor.

Both take the shapes of the parameter tensors the optimizer updates (`planner.models.params.
model_gradient_tensor_shapes`), because several optimizers treat a tensor by its shape or size.

States, from the optimizers' own code:
- adam / adamw (torch/optim/adam.py `_init_group`): exp_avg + exp_avg_sq, `torch.zeros_like(p)`, so
  2 × n × param bytes per tensor. The per-tensor `step` counter is a CPU float32 scalar, unless fused or
  capturable: then a 0-dim float32 tensor on the device (`_get_scalar_dtype(is_fused=True)`), 4 B per tensor.
- sgd: no state; sgd-momentum: momentum_buffer = `torch.clone(grad)`, 1 × n × param bytes (torch/optim/sgd.py).
- adafactor (transformers.optimization.Adafactor, `step`/`_get_options`): a tensor with ≥ 2 dims is factored:
  exp_avg_sq_row (shape[:-1]) + exp_avg_sq_col (shape[:-2] + shape[-1:]); otherwise exp_avg_sq (full shape);
  exp_avg (full) only with beta1 (default None: none). States are `torch.zeros(...).to(grad)` and fp16/bf16
  grads are first cast with `grad.float()`, so states are fp32 whatever the parameter dtype. `state["RMS"]`
  becomes `self._rms(p_data_fp32)`, a 0-dim fp32 tensor on the device (4 B per tensor); `state["step"]` is a
  Python int (no memory on the device).
- adamw-8bit (bitsandbytes 0.50.2, optim/optimizer.py `Optimizer2State.init_state`): a tensor with fewer than
  `min_8bit_size` = 4096 elements keeps two fp32 states (8 B per element); a larger one two uint8 states
  (2 B per element) + two fp32 absmax vectors of ceil(n / 256) blocks. The two 256-entry fp32 quantisation maps
  (`qmap1`/`qmap2`) are one pair per device, shared by every 8-bit tensor.

Counted as the tensors' own bytes (numel × element size), as `torch.cuda.memory_allocated` would count them
before the caching allocator rounds each block up to 512 B (a few hundred KiB for a few hundred small tensors).

Temporaries of one step (the peak above states, parameters and gradients):
- adam/adamw foreach (`_multi_tensor_adam`): `exp_avg_sq_sqrt = torch._foreach_sqrt(exp_avg_sqs)`, one new
  tensor per parameter: 1 × all parameter bytes of the (local shard of the) group. Adam's weight-decay copy
  of the grads (`_foreach_add`, only when weight_decay != 0; torch's default is 0) is deleted before it.
- adam/adamw for-loop (`_single_tensor_adam`): `denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt)` holds
  the sqrt and the quotient at once, while the previous tensor's `denom` lives until this assignment:
  max over tensors of (n_{k-1} + 2·n_k) × param bytes (`for_loop_adam_temporary_bytes`).
- fused adam/adamw: one kernel per tensor list, nothing of parameter size. SGD variants update in place.
  bitsandbytes updates blockwise in place.
- adafactor: see `adafactor_temporary_bytes`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from planner.spec import TrainConfig

Shape = tuple[int, ...]

FLOAT32_BYTES = 4
# torch/optim/adam.py: with fused=True (or capturable=True) `state["step"]` is a 0-dim float32 device tensor.
ADAM_DEVICE_STEP_BYTES = FLOAT32_BYTES
# transformers Adafactor: `state["RMS"]` is the 0-dim fp32 result of `_rms(p_data_fp32)`, on the device.
ADAFACTOR_RMS_BYTES = FLOAT32_BYTES
# bitsandbytes 0.50.2 AdamW8bit(min_8bit_size=4096): smaller tensors keep 32-bit states.
BNB_MIN_8BIT_SIZE = 4096
# bitsandbytes 0.50.2 Optimizer2State.init_state: `blocksize = 256` for the blockwise absmax (older releases: 2048).
BNB_BLOCKSIZE = 256
# bitsandbytes functional.create_dynamic_map: 256 fp32 values; signed (qmap1) and unsigned (qmap2) maps.
BNB_QMAP_BYTES = 2 * 256 * FLOAT32_BYTES


def numel(shape: Shape) -> int:
    return math.prod(shape)


def factored(shape: Shape) -> bool:
    """Adafactor `_get_options`: factored = len(shape) >= 2."""
    return len(shape) >= 2


def factored_vector_elements(shape: Shape) -> int:
    """exp_avg_sq_row (shape[:-1]) + exp_avg_sq_col (shape[:-2] + shape[-1:]) elements."""
    return numel(shape[:-1]) + numel(shape[:-2] + shape[-1:])


def adafactor_dtype_bytes(param_bytes: int) -> int:
    """Adafactor computes (and keeps its states) in fp32 for fp16/bf16 parameters: `grad = grad.float()`."""
    return max(param_bytes, FLOAT32_BYTES)


def adam_state_bytes(shapes: Sequence[Shape], param_bytes: int, device_step: bool = False) -> int:
    """exp_avg + exp_avg_sq per tensor (+ a 4 B device `step` per tensor when fused/capturable)."""
    step = ADAM_DEVICE_STEP_BYTES * len(shapes) if device_step else 0
    return 2 * param_bytes * sum(numel(s) for s in shapes) + step


def adafactor_state_bytes(shapes: Sequence[Shape], param_bytes: int, first_moment: bool = False) -> int:
    """Σ over tensors: (row + col if factored else n) [+ n with beta1] fp32 values + the RMS scalar."""
    elements = 0
    for s in shapes:
        elements += factored_vector_elements(s) if factored(s) else numel(s)
        if first_moment:
            elements += numel(s)
    return elements * adafactor_dtype_bytes(param_bytes) + ADAFACTOR_RMS_BYTES * len(shapes)


def adamw_8bit_state_bytes(shapes: Sequence[Shape], min_8bit_size: int = BNB_MIN_8BIT_SIZE,
                           blocksize: int = BNB_BLOCKSIZE, qmap_bytes: int = BNB_QMAP_BYTES) -> int:
    """Small tensors: 2 fp32 states; others: 2 uint8 states + 2 fp32 absmax per block; qmaps once."""
    total, any_8bit = 0, False
    for s in shapes:
        n = numel(s)
        if n < min_8bit_size:
            total += 2 * FLOAT32_BYTES * n
        else:
            any_8bit = True
            total += 2 * n + 2 * FLOAT32_BYTES * math.ceil(n / blocksize)
    return total + (qmap_bytes if any_8bit else 0)


def optimizer_state_bytes(shapes: Sequence[Shape], config: TrainConfig, param_bytes: int,
                          share: float = 1.0) -> int:
    """Persistent optimizer state for the parameter tensors `shapes` of `param_bytes` bytes per element.

    `share`: the fraction of the states this GPU keeps (ZeRO/FSDP sharding; 1.0 replicated). bitsandbytes'
    quantisation maps are per device and not sharded.
    """
    opt = config.optimizer
    if opt in ("adam", "adamw"):
        return int(adam_state_bytes(shapes, param_bytes, device_step=config.optimizer_impl == "fused") * share)
    if opt == "sgd":
        return 0
    if opt == "sgd-momentum":
        return int(param_bytes * sum(numel(s) for s in shapes) * share)
    if opt == "adafactor":
        return int(adafactor_state_bytes(shapes, param_bytes) * share)
    if opt == "adamw-8bit":
        qmaps = BNB_QMAP_BYTES if any(numel(s) >= BNB_MIN_8BIT_SIZE for s in shapes) else 0
        return int(adamw_8bit_state_bytes(shapes, qmap_bytes=0) * share) + qmaps
    raise ValueError(f"optimizer {opt!r} has no state formula")


def for_loop_adam_temporary_bytes(shapes: Sequence[Shape], param_bytes: int) -> int:
    """max_k (n_{k-1} + 2·n_k) × param bytes: previous denom + sqrt + quotient (see the module doc)."""
    peak = prev = 0
    for s in shapes:
        n = numel(s)
        peak = max(peak, prev + 2 * n)
        prev = n
    return peak * param_bytes


def adafactor_temporary_bytes(shapes: Sequence[Shape], param_bytes: int) -> int:
    """Peak of the tensor-by-tensor Adafactor step (transformers `Adafactor.step`), fp32 elements × 4 B.

    For tensor k of n_k elements, in the order the optimizer visits them (the previous one's `update`, n_{k-1},
    is only freed when `update = grad**2 + eps` is reassigned):
      A: update = grad**2 + eps          -> n_{k-1} + 2·n_k  (grad**2 and the sum)
      B: update = r_factor * c_factor    -> 2·n_k + rows + cols when factored (old update, r, c, product);
         update = exp_avg_sq.rsqrt()     -> 2·n_k otherwise;  p.add_(-update) -> 2·n_k
    fp16/bf16 parameters add their fp32 copies `grad.float()` and `p.float()`: + 2·n_k throughout.
    """
    c = adafactor_dtype_bytes(param_bytes)
    copies = 2 if param_bytes < c else 0
    peak = prev = 0
    for s in shapes:
        n = numel(s)
        extra = factored_vector_elements(s) if factored(s) else 0
        peak = max(peak, copies * n + max(prev + 2 * n, 2 * n + extra))
        prev = n
    return peak * c


def optimizer_temporary_bytes(shapes: Sequence[Shape], config: TrainConfig, param_bytes: int,
                              share: float = 1.0) -> int:
    """Peak bytes allocated inside `optimizer.step()` beyond states, parameters and gradients (see module doc).

    foreach: 1 × the (local `share` of the) parameters; for-loop: ≈ 2 × the largest tensor; fused, SGD,
    bitsandbytes: 0; Adafactor: `adafactor_temporary_bytes`. The per-tensor paths are not scaled by `share`.
    """
    opt, impl = config.optimizer, config.optimizer_impl
    if opt in ("sgd", "sgd-momentum", "adamw-8bit"):
        return 0
    if opt == "adafactor":
        return adafactor_temporary_bytes(shapes, param_bytes)
    if impl == "fused":
        return 0
    if impl == "for-loop":
        return for_loop_adam_temporary_bytes(shapes, param_bytes)
    return int(sum(numel(s) for s in shapes) * param_bytes * share)
