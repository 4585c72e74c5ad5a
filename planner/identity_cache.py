"""What is made from an immutable object, kept per object identity.

Why: a model's layers (`ModelSpec.components`) are immutable, and an estimate derives the same things from
them many times (its blocks, transformer layers, gradient shapes), but hashing them costs more than deriving.
Keyed by `id`, the object is kept beside its result, so its id cannot be reused while the entry lives; a copy
with other contents is another object and gets its own entry."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")
LIMIT = 256  # entries kept per table (a catalog is a few dozen models); a full table starts again


def per_object(table: dict[int, tuple[Any, Any]], obj: Any, make: Callable[[Any], T]) -> T:
    """`make(obj)`, computed once while `table` keeps it."""
    hit = table.get(id(obj))
    if hit is None or hit[0] is not obj:
        if len(table) >= LIMIT:
            table.clear()
        hit = table[id(obj)] = (obj, make(obj))
    return hit[1]
