"""planner: will a training configuration fit on a SageMaker GPU instance, how fast, and at what cost.

Public API: `estimate()` and the data model. Heavy modules load lazily so `import planner` stays cheap.
"""

from planner.errors import PlannerError
from planner.spec import (
    GPU,
    Estimate,
    Instance,
    MemoryBytes,
    ModelSpec,
    RuntimeConstants,
    TrainConfig,
)

__all__ = ["GPU", "Estimate", "Instance", "MemoryBytes", "ModelSpec", "PlannerError", "RuntimeConstants",
           "TrainConfig", "estimate"]

# Binding the function after the submodule import keeps `planner.estimate` callable (the submodule of the
# same name stays reachable as `sys.modules["planner.estimate"]`).
from planner.estimate import estimate  # noqa: E402

