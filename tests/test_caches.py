"""One cache helper (planner.caches) knows every table the planner makes, so clearing is one loop."""

from __future__ import annotations

import ast
from pathlib import Path

from planner import TrainConfig, caches, estimate

ROOT = Path(__file__).resolve().parent.parent / "planner"


def _decorator_names(tree: ast.AST) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for d in node.decorator_list:
                target = d.func if isinstance(d, ast.Call) else d
                names.add(ast.unparse(target))
    return names


def test_no_cache_is_made_outside_the_helper():
    """functools' caches only through caches.lru, which registers them (else clear() would miss them)."""
    stray = {str(p.relative_to(ROOT)): sorted(n for n in _decorator_names(ast.parse(p.read_text()))
                                              if n.split(".")[-1] in ("lru_cache", "cache"))
             for p in ROOT.rglob("*.py") if p.name != "caches.py"}
    assert {k: v for k, v in stray.items() if v} == {}


def test_clear_empties_every_table_and_estimates_stay_the_same():
    cfg = TrainConfig(batch_size=4, seq_len=128, parallelism="ddp")
    before = estimate("bert-base-uncased", cfg, "ml.g5.12xlarge").to_json()
    made = caches.registered()
    assert {"planner.pipeline.step._ACTIVATIONS", "planner.memory.reserved._TRACES", "planner.perf.roofline._TABLES",
            "planner.hardware._gpus"} <= set(made)
    assert all(c.key and c.scope in ("step", "model", "facts") for c in made.values())
    caches.clear()
    for name in ("planner.pipeline.step._ACTIVATIONS", "planner.memory.reserved._TRACES"):
        module, var = name.rsplit(".", 1)
        assert not vars(__import__(module, fromlist=[var]))[var]
    assert estimate("bert-base-uncased", cfg, "ml.g5.12xlarge").to_json() == before
