"""The parameter interpreter: elements of the parameter tensors an op owns. One rule for every kind (a
parameter tensor counts the same whichever op owns it); registered per kind like the other interpreters."""

from __future__ import annotations

from planner.ir.interpret import register
from planner.ir.ops import OP_KINDS, Op


@register("params", *OP_KINDS)
def parameter_elements(op: Op, ctx: object = None) -> int:
    return sum(p.numel for p in op.params)
