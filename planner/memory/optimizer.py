"""Optimizer states (persistent, allocated at the first step) and the temporaries a step allocates.

State bytes per parameter element, with states in the parameter's dtype as `torch.zeros_like(p)` makes them:
- adam / adamw: exp_avg + exp_avg_sq = 2 × dtype bytes (torch/optim/adam.py `_init_group`); the per-tensor `step`
  counter is a CPU scalar unless fused/capturable (then on the GPU: 4 B per tensor, negligible).
- sgd: no state; sgd-momentum: momentum_buffer = 1 × dtype bytes (torch/optim/sgd.py).
- adafactor (transformers.optimization.Adafactor, beta1=None default): factored second moment, a row and a column
  vector per matrix and a full vector for 1-D parameters: ≈ (rows + cols) / (rows · cols) of a matrix. We use
  `ADAFACTOR_FACTORED_FRACTION` of the parameter bytes (see its note).
- adamw-8bit (bitsandbytes AdamW8bit): two 1-byte states + fp32 absmax per 2048-element block
  (bitsandbytes/optim/optimizer.py, blocksize 2048): 2 + 2·4/2048 bytes per element.

Temporaries of one step (torch/optim/adam.py `_multi_tensor_adam`): the foreach path computes
`exp_avg_sq_sqrt = torch._foreach_sqrt(exp_avg_sqs)`, a new tensor list as large as all parameters of the
group (1 × param bytes); Adam with weight_decay also makes `grads + wd·params` (another 1 ×), AdamW decays in
place. The fused kernel (`fused=True`) allocates nothing of size. The for-loop path allocates the same per
tensor, so its peak is one parameter tensor, bounded here by the largest block.
"""

from __future__ import annotations

from planner.spec import TrainConfig

ADAMW_8BIT_BYTES_PER_ELEMENT = 2 + 2 * 4 / 2048
# Adafactor keeps rows+cols per matrix; for transformer matrices (h×h, h×4h, V×h) that is < 0.5% of the
# elements. 1-D parameters (biases, norms: ~0.1% of a BERT's parameters) keep a full vector. Upper bound used:
ADAFACTOR_FACTORED_FRACTION = 0.01


def optimizer_state_bytes(num_parameters: int, config: TrainConfig, param_bytes: int, share: float = 1.0) -> int:
    """Persistent state of the optimizer for `num_parameters` elements of `param_bytes` bytes each."""
    per_element = {
        "adam": 2 * param_bytes,
        "adamw": 2 * param_bytes,
        "sgd": 0,
        "sgd-momentum": param_bytes,
        "adafactor": ADAFACTOR_FACTORED_FRACTION * param_bytes,
        "adamw-8bit": ADAMW_8BIT_BYTES_PER_ELEMENT,
    }[config.optimizer]
    return int(num_parameters * per_element * share)


def optimizer_temporary_bytes(num_parameters: int, largest_tensor: int, config: TrainConfig, param_bytes: int,
                              share: float = 1.0) -> int:
    """Peak bytes allocated inside `optimizer.step()` beyond states, parameters and gradients.

    foreach: 1 × the (local shard of the) parameters for adam/adamw's sqrt temporary; fused: 0;
    for-loop: one tensor. SGD variants update in place. Adafactor works tensor by tensor
    (update = grad² + eps, then the factored approximation): ≈ 2 × the largest tensor.
    """
    opt, impl = config.optimizer, config.optimizer_impl
    if opt in ("sgd", "sgd-momentum"):
        return 0
    if opt == "adafactor":
        return 2 * largest_tensor * param_bytes
    if opt == "adamw-8bit":  # bitsandbytes updates blockwise in place
        return 0
    if impl == "fused":
        return 0
    if impl == "for-loop":
        return largest_tensor * param_bytes
    return int(num_parameters * param_bytes * share)
