"""PYTORCH_CUDA_ALLOC_CONF parsing and the stacks.json table it checks against.

Kept apart from planner.memory.stack (which resolves a whole software stack from a GPU) so that the data
model (`spec.SoftwareStack.expandable_segments`) can parse its own allocator setting without importing the
stack resolver, which imports the data model: one direction, no cycle. It sits beside the data model, below
planner.memory (it was planner.memory.alloc_conf until issue 33: the data model imported up a layer).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from planner import caches
from planner.errors import PlannerError

STACKS_PATH = Path(__file__).resolve().parent / "data" / "stacks.json"
_VERSION = re.compile(r"^\s*v?(\d+)\.(\d+)(?:\.\d+)*(?:[+-].*)?\s*$")

Version = tuple[int, int]


@caches.lru(1, scope="facts", key="none: stacks.json")
def table() -> dict[str, Any]:
    """planner/data/stacks.json, read once."""
    return json.loads(STACKS_PATH.read_text(encoding="utf-8"))


@caches.lru(1024, scope="facts", key="(field, version text)")
def parse_version(field: str, value: str | float | None) -> Version:
    """"2.8", "2.8.0", "2.8.0+cu129" -> (2, 8); anything else is bad input naming `field`."""
    m = _VERSION.match(str(value)) if value is not None else None
    if not m:
        raise PlannerError(field, value, "a version like 2.8 (MAJOR.MINOR)")
    return int(m.group(1)), int(m.group(2))


def fmt(v: Version) -> str:
    return f"{v[0]}.{v[1]}"


# ---- PYTORCH_CUDA_ALLOC_CONF ---------------------------------------------------------------------


def _check_alloc_value(key: str, kind: str, raw: str) -> None:
    allowed = {"bool": "True or False", "mb": "a number of MiB > 0", "fraction": "a number in (0, 1)",
               "int": "an integer >= 0", "backend": "native or cudaMallocAsync",
               "divisions": "a power of two or [size:divisions,...]"}[kind]
    ok = True
    try:
        if kind == "bool":
            ok = raw in ("True", "False", "true", "false")
        elif kind == "mb":
            ok = float(raw) > 0
        elif kind == "fraction":
            ok = 0 < float(raw) < 1
        elif kind == "int":
            ok = int(raw) >= 0
        elif kind == "backend":
            ok = raw in ("native", "cudaMallocAsync")
        elif kind == "divisions":
            ok = raw.startswith("[") and raw.endswith("]") or (int(raw) > 0 and int(raw) & (int(raw) - 1) == 0)
    except ValueError:
        ok = False
    if not ok:
        raise PlannerError("--alloc-conf", f"{key}:{raw}", f"{key} takes {allowed}")


def _split_conf(conf: str) -> list[str]:
    """Split on commas outside [...] (roundup_power2_divisions takes a bracketed list)."""
    parts, depth, cur = [], 0, ""
    for ch in conf:
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    return [p.strip() for p in parts if p.strip()]


def parse_alloc_conf(conf: str | None, torch: str | None = None) -> dict[str, str]:
    """PYTORCH_CUDA_ALLOC_CONF ("key:value,key:value") -> {key: value}, checked against the keys that torch
    version parses (c10/cuda/CUDAAllocatorConfig.cpp)."""
    keys: dict[str, Any] = table()["alloc_conf"]["keys"]
    out: dict[str, str] = {}
    for item in _split_conf(conf or ""):
        key, sep, raw = item.partition(":")
        key, raw = key.strip(), raw.strip()
        if key not in keys:
            from planner.errors import closest

            near = closest(key, keys)
            hint = f"did you mean {', '.join(near)}?" if near else f"one of {', '.join(keys)}"
            raise PlannerError("--alloc-conf", item, f"unknown PYTORCH_CUDA_ALLOC_CONF key; {hint}")
        if not sep or not raw:
            raise PlannerError("--alloc-conf", item, f"KEY:VALUE pairs separated by commas, e.g. {key}:True")
        _check_alloc_value(key, keys[key]["value"], raw)
        since = keys[key]["since"]
        if torch is not None and parse_version("torch", torch) < parse_version("since", since):
            raise PlannerError("--alloc-conf", item, f"{key} exists from torch {since} ({keys[key]['source']}); "
                               f"the stack has torch {torch}")
        out[key] = raw
    return out
