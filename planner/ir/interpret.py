"""Interpreters of a program: each a registry of rules keyed by op kind.

Like torch/utils/flop_counter.py (`register_flop_formula(aten.mm)` adds a formula for one ATen op without
editing the counter), an interpreter module registers its rule for each op kind with `@register(name, *kinds)`.
The interpreters: "params" (parameter elements, planner.ir.params), "flops" (forward matmul FLOPs,
planner.perf.op_rules), "kernels" (forward CUDA kernels, whence bytes moved and launches, planner.perf.op_rules),
"saved" (storages saved for backward, planner.memory.op_saved). `tests/test_program.py` fails when an op kind
of planner.ir.ops.OP_KINDS lacks a rule in any of them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from planner.ir.ops import OP_KINDS, Op

INTERPRETERS = ("params", "flops", "kernels", "saved")
# The modules that register each interpreter's rules (imported by `load_rules`).
RULE_MODULES = ("planner.ir.params", "planner.perf.op_rules", "planner.memory.op_saved")

_RULES: dict[str, dict[str, Callable[..., Any]]] = {name: {} for name in INTERPRETERS}


def register(interpreter: str, *kinds: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: `fn(op, ctx)` is `interpreter`'s rule for each of `kinds`."""
    if interpreter not in _RULES:
        raise ValueError(f"interpreter {interpreter!r}: known {INTERPRETERS}")
    unknown = [k for k in kinds if k not in OP_KINDS]
    if unknown:
        raise ValueError(f"op kinds {unknown} are not in planner.ir.ops.OP_KINDS")

    def put(fn: Callable[..., Any]) -> Callable[..., Any]:
        for k in kinds:
            _RULES[interpreter][k] = fn
        return fn

    return put


_LOADED: list[bool] = []


def load_rules() -> None:
    """Import every rule module (each registers on import); once per process."""
    if _LOADED:
        return
    import importlib

    for m in RULE_MODULES:
        importlib.import_module(m)
    _LOADED.append(True)


def apply(interpreter: str, op: Op, ctx: Any) -> Any:
    """The rule of `interpreter` for `op.kind`, applied."""
    try:
        fn = _RULES[interpreter][op.kind]
    except KeyError:
        raise KeyError(f"interpreter {interpreter!r} has no rule for op kind {op.kind!r}") from None
    return fn(op, ctx)


def missing_rules() -> dict[str, list[str]]:
    """Interpreter -> op kinds without a rule (after `load_rules`)."""
    load_rules()
    return {name: sorted(set(OP_KINDS) - set(rules)) for name, rules in _RULES.items()
            if set(OP_KINDS) - set(rules)}
