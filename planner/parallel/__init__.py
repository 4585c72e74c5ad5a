"""Parallelism strategies: one record per strategy (`strategy.Strategy`) in one registry (`registry`).

Everything that differs between DDP, ZeRO-1/2/3, FSDP and nn.DataParallel is a field of its record, read by
the memory model, the speed model, the explanation and the probe job; "auto" and the world size are resolved
here only. See ARCHITECTURE.md, "Adding a parallelism".
"""

from planner.parallel.registry import (
    AUTO,
    AUTO_MULTI_GPU,
    AUTO_ONE_GPU,
    STRATEGIES,
    get,
    is_default,
    known,
    resolve_name,
    sharded_names,
)
from planner.parallel.strategy import Collective, Sharding, Strategy

__all__ = ["AUTO", "AUTO_MULTI_GPU", "AUTO_ONE_GPU", "STRATEGIES", "Collective", "Sharding", "Strategy", "get",
           "is_default", "known", "resolve_name", "sharded_names"]
