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


def _executed_nodes(tree: ast.AST, type_checking: bool = False):
    """Every node of `tree` except the bodies of `if TYPE_CHECKING:` blocks: those imports never run (they
    serve the type checker only), so they cannot make an import cycle."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        if not type_checking and isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def import_graph(type_checking: bool = False) -> dict[str, set[str]]:
    """Module → the planner modules it imports (anywhere in the file, functions included; not the type checker's
    `if TYPE_CHECKING:` imports). `from a import b`
    counts as an import of `a.b` when that is a module, else of `a`; importing a package runs its __init__."""
    mods = _modules()
    packages = {_module_name(p) for p in ROOT.rglob("__init__.py")}
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, tree in mods.items():
        for node in _executed_nodes(tree, type_checking):
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


# The declared layer order, top to bottom (ARCHITECTURE.md "Layers"): a module may import its own layer or any
# layer below it, never one above. Every planner module belongs to exactly one entry (longest prefix wins), so
# a new top-level module or package has to be placed here, on purpose.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("planner", "planner.__main__", "planner.cli", "planner.aws"),  # edges: the package API, commands, AWS
    ("planner.report", "planner.probes"),  # the HTML report and figures; probe requests and readings
    ("planner.search",),  # the Optuna search (calls the pipeline through estimate / build)
    ("planner.explain", "planner.explain_traced", "planner.explain_where", "planner.explain_parallel",
     "planner.build"),  # explanations
    ("planner.estimate",),  # the one entry point of an estimate
    ("planner.pipeline", "planner.run"),  # resolve → step → verdict; runs of varying length
    ("planner.memory", "planner.perf", "planner.program", "planner.adapters"),  # interpreters, the tracer
    ("planner.parallel", "planner.families", "planner.models", "planner.ir"),  # registries; the op vocabulary
    ("planner.spec", "planner.data", "planner.alloc_conf", "planner.hardware", "planner.dlc", "planner.prices",
     "planner.caches", "planner.identity_cache", "planner.errors", "planner.io", "planner.units", "planner.env",
     "planner._startup"),  # the data model, sourced facts, small shared pieces
)


def layer_of(module: str) -> int:
    """The index in LAYERS of `module` (0 = top), by its longest declared prefix; -1 when none declares it."""
    best, length = -1, -1
    for rank, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > length:
                best, length = rank, len(p)
    return best


def upward_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(importer, imported) pairs where the imported module sits in a layer above the importer's. A package
    importing its own submodules is not counted (its __init__ re-exports them)."""
    return sorted((m, t) for m, ts in graph.items() for t in ts
                  if not t.startswith(m + ".") and layer_of(t) < layer_of(m))


def test_every_module_is_in_a_declared_layer():
    assert [m for m in import_graph() if layer_of(m) < 0] == []


def test_imports_go_down_the_declared_layers_only():
    """Issue 33: spec imported memory.alloc_conf, adapters/explain and run/explain_run imported estimate,
    probes imported the package top; each now sits where its layer says (the estimate function is passed in)."""
    assert upward_imports(import_graph()) == []


def test_the_layer_check_can_fail():
    """The rule itself: an import from the data model up to the pipeline is reported."""
    assert upward_imports({"planner.spec": {"planner.estimate"}, "planner.estimate": set()}) == [
        ("planner.spec", "planner.estimate")]


def test_no_import_cycles_even_through_function_level_imports():
    assert cycles(import_graph()) == []


def test_no_import_cycles_even_through_the_type_checkers_imports():
    """Issue 33: perf.collectives ↔ perf.throughput and search.results ↔ search.study were cycles through
    `if TYPE_CHECKING:` imports: harmless at run time, but a knot for a reader and for the type checker.
    The shared records moved down (perf.constants, search.records)."""
    assert cycles(import_graph(type_checking=True)) == []


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


# What resolves parallelism "auto" (planner.parallel's rule and its names). Issue 33 item 5: `auto` was resolved
# in memory/parallel.py, perf/throughput.py and cli/options.py; now the pipeline resolves a configuration once
# (planner.pipeline.resolve.resolve_parallelism) and every interpreter below it reads the resolved name.
AUTO_RESOLVERS = frozenset({"resolve_name", "resolve_parallelism", "AUTO", "AUTO_ONE_GPU", "AUTO_MULTI_GPU"})


def _reads_auto_parallelism(tree: ast.AST) -> list[int]:
    """Lines that resolve "auto" themselves: a use of planner.parallel's resolving names, or a comparison of a
    `.parallelism` with the string "auto"."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and any(a.name in AUTO_RESOLVERS for a in node.names):
            lines.append(node.lineno)
        elif isinstance(node, (ast.Name, ast.Attribute)) and getattr(node, "id", getattr(node, "attr", "")) \
                in AUTO_RESOLVERS:
            lines.append(node.lineno)
        elif isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(isinstance(n, ast.Attribute) and n.attr == "parallelism" for n in sides) and any(
                    _names_in(n, frozenset({"auto"})) for n in sides):
                lines.append(node.lineno)
    return lines


def modules_resolving_auto_below_the_pipeline(mods: dict[str, ast.Module]) -> dict[str, list[int]]:
    """Modules under the pipeline's layer (interpreters, tracer, registries, data model) that resolve "auto";
    planner.parallel, which owns the rule, excepted."""
    pipeline = layer_of("planner.pipeline")
    return {m: lines for m, tree in mods.items()
            if layer_of(m) > pipeline and not (m == "planner.parallel" or m.startswith("planner.parallel."))
            and (lines := _reads_auto_parallelism(tree))}


def test_nothing_below_the_pipeline_resolves_auto():
    assert modules_resolving_auto_below_the_pipeline(_modules()) == {}


def test_the_auto_check_can_fail():
    """The rule itself, on the code issue 33 found: perf/throughput's own resolver and a literal comparison."""
    old = ast.parse("from planner.parallel import resolve_name\n"
                    "def f(config, instance):\n    return resolve_name(config.parallelism, instance.gpus)\n")
    literal = ast.parse("def g(cfg):\n    return cfg.parallelism == 'auto'\n")
    assert modules_resolving_auto_below_the_pipeline({"planner.perf.throughput": old, "planner.memory.x": literal,
                                                      "planner.pipeline.resolve": old}) == {
        "planner.perf.throughput": [1, 3], "planner.memory.x": [2]}


def test_architecture_is_at_the_project_root_and_names_each_extension_axis():
    text = (ROOT.parent / "ARCHITECTURE.md").read_text()
    for heading in ("### A GPU or an instance type", "### A parallelism strategy", "### A memory effect",
                    "### A model family", "## The pipeline of one estimate"):
        assert heading in text


if __name__ == "__main__":
    for c in cycles(import_graph()):
        print("cycle:", c)
    for m, t in upward_imports(import_graph()):
        print("upward:", m, "->", t)
    print("family:", files_branching_on(FAMILY_NAMES))
    print("parallelism:", files_branching_on(PARALLELISM_NAMES))
