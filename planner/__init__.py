"""planner: will a training configuration fit on a SageMaker GPU instance, how fast, and at what cost.

Public API: `estimate()` and the data model. Heavy modules load lazily so `import planner` stays cheap.
"""

from planner._startup import check_environment_or_exit, quiet_interrupts_while_starting

quiet_interrupts_while_starting()  # only in the `planner` command itself; see planner/_startup.py
check_environment_or_exit()  # ditto: a bad PLANNER_* setting is one line and exit 2

from planner.errors import PlannerError  # noqa: E402
from planner.spec import (  # noqa: E402
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

