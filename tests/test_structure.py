"""The shape the architecture promises (ARCHITECTURE.md): no import cycles among planner's modules, counting
imports inside functions too, and each extension axis branched on by name in at most two files.

Why static: an import cycle through a function-level import works until someone moves the import to the top
of the file; a name branch (`if family in ("llama", "mistral")`) is where a new family or strategy has to be
added by hand. Both are read from the source with `ast`, so the test needs nothing imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "planner"

# The hand-modelled families and the parallelism strategies, as the code spells them.
FAMILY_NAMES = frozenset({"bert", "roberta", "distilbert", "gpt2", "llama", "mistral"})
PARALLELISM_NAMES = frozenset({"single", "dp", "ddp", "zero1", "zero2", "zero3", "fsdp"})
MAX_FILES_BRANCHING = 2


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, ast.Module]:
    return {_module_name(p): ast.parse(p.read_text(), str(p)) for p in sorted(ROOT.rglob("*.py"))}


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _executed_nodes(tree: ast.AST):
    """Every node of `tree` except the bodies of `if TYPE_CHECKING:` blocks: those imports never run (they
    serve the type checker only), so they cannot make an import cycle."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def import_graph() -> dict[str, set[str]]:
    """Module → the planner modules it imports (anywhere in the file, functions included; not the type checker's
    `if TYPE_CHECKING:` imports). `from a import b`
    counts as an import of `a.b` when that is a module, else of `a`; importing a package runs its __init__."""
    mods = _modules()
    packages = {_module_name(p) for p in ROOT.rglob("__init__.py")}
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, tree in mods.items():
        for node in _executed_nodes(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                src = _resolve(name, name in packages, node)
                targets = [f"{src}.{a.name}" if f"{src}.{a.name}" in mods else src for a in node.names]
            for t in targets:
                if t in mods and t != name:
                    graph[name].add(t)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each a cycle or a knot of cycles.
    A package's __init__ importing its own submodules is not a cycle of the kind that bites (Python finishes
    the submodule first), so edges from a package to its own children are left out."""
    def edges(m: str) -> set[str]:
        return {t for t in graph[m] if not t.startswith(m + ".")}

    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges(v):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for m in sorted(graph):
        if m not in index:
            visit(m)
    return out


def _names_in(node: ast.AST, names: frozenset[str]) -> bool:
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str) and node.value in names
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_names_in(e, names) for e in node.elts)
    return False


def files_branching_on(names: frozenset[str]) -> list[str]:
    """Files with a comparison (==, !=, in, not in) or a `case` against one of `names` as a string literal."""
    hits = []
    for path in sorted(ROOT.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare) and any(_names_in(n, names) for n in [node.left, *node.comparators]):
                hits.append(str(path.relative_to(ROOT.parent)))
                break
            if isinstance(node, ast.MatchValue) and _names_in(node.value, names):
                hits.append(str(path.relative_to(ROOT.parent)))
                break
    return hits


def test_no_import_cycles_even_through_function_level_imports():
    assert cycles(import_graph()) == []


def test_the_core_never_imports_the_cli_or_aws():
    """The CLI and AWS are edges: the core (estimate, memory, perf, models, search, probes, report) reaches
    neither, so it runs and tests without typer's commands or boto3."""
    edges = ("planner.cli", "planner.aws")
    wrong = {m: sorted(t for t in ts if t.startswith(edges))
             for m, ts in import_graph().items() if not m.startswith(edges) and m != "planner.__main__"}
    assert {m: ts for m, ts in wrong.items() if ts} == {}


def test_families_are_branched_on_by_name_in_at_most_two_files():
    files = files_branching_on(FAMILY_NAMES)
    assert len(files) <= MAX_FILES_BRANCHING, files


def test_parallelisms_are_branched_on_by_name_in_at_most_two_files():
    files = files_branching_on(PARALLELISM_NAMES)
    assert len(files) <= MAX_FILES_BRANCHING, files


def test_architecture_is_at_the_project_root_and_names_each_extension_axis():
    text = (ROOT.parent / "ARCHITECTURE.md").read_text()
    for heading in ("### A GPU or an instance type", "### A parallelism strategy", "### A memory effect",
                    "### A model family", "## The pipeline of one estimate"):
        assert heading in text


if __name__ == "__main__":
    for c in cycles(import_graph()):
        print("cycle:", c)
    print("family:", files_branching_on(FAMILY_NAMES))
    print("parallelism:", files_branching_on(PARALLELISM_NAMES))
