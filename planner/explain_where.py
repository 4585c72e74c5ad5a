"""Where the explanation's per-GPU figures live (each GPU, GPU 0 only, one GPU's shard), shared by the
analytic explanation (planner.explain) and the traced one (planner.explain_traced) so neither imports the
other.
"""

from __future__ import annotations

from planner.parallel import get as strategy_of
from planner.spec import Estimate


def where_states_live(est: Estimate) -> str:
    """Where the gradient and optimizer-state figures are: per GPU, on GPU 0 only (DataParallel), or one
    GPU's shard (ZeRO/FSDP), so step 7 says the same as step 3."""
    p = est.config.parallelism
    if strategy_of(p).one_process:
        return "on GPU 0 only (DataParallel reduces gradients and steps the optimizer there)"
    if strategy_of(p).shards:
        return f"on each GPU (its share under {p}; see step 3)"
    return "on each GPU" if est.world_size > 1 else "on the GPU"


def batch_where(est: Estimate) -> str:
    """The 'input batch' row under DataParallel is one GPU's scattered share; elsewhere each GPU's own."""
    if strategy_of(est.config.parallelism).one_process:
        return ("on each GPU (its scattered share; GPU 0 also holds the whole batch before the scatter, "
                "counted in temporaries and buffers)")
    return "per GPU"
