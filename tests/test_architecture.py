"""The package's import graph keeps its drawing (grimp reads it from the source, every import
statement, function-level ones too): no module takes part in an import circle (nor, counting
the package __init__s an import runs, in a circle of load-time imports), no library module
imports a benchmark, and the floors of a request's path import only downward, serving -> pdc
-> frontend -> engine -> executor -> worker -> model -> kernels. The one exception left is listed: the engine's step messages
(SchedulerOutput, SamplingParams, Logprob) and its block name (the EMS page key the KV
connector shares) are read from below until they move to a module of the boundary under the
engine (issue 52)."""

import ast
from pathlib import Path

import grimp
import pytest

import matrixinfer

FLOORS = ["matrixinfer.serving", "matrixinfer.pdc", "matrixinfer.frontend", "matrixinfer.engine",
          "matrixinfer.executor", "matrixinfer.worker", "matrixinfer.model", "matrixinfer.kernels"]
STEP_MESSAGES = {"matrixinfer.engine.scheduler", "matrixinfer.engine.sampling_params", "matrixinfer.engine.request",
                 "matrixinfer.engine.block_hash"}


def _circles(graph) -> list[list[str]]:
    """Modules that reach themselves through imports, one list per strongly connected set
    (Tarjan's algorithm over the direct imports), largest first. `graph` is grimp's, or a
    dict of module -> the modules it imports."""
    if isinstance(graph, dict):
        edges = graph
        graph = type("Edges", (), {"modules": set(edges),
                                   "find_modules_directly_imported_by": staticmethod(lambda m: edges.get(m, set()))})
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.find_modules_directly_imported_by(v):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                out.append(sorted(part))

    for m in sorted(graph.modules):
        if m not in index:
            visit(m)
    return sorted(out, key=len, reverse=True)


def test_no_module_is_in_an_import_circle():
    # annotation-only imports (under TYPE_CHECKING) never run, so they close no circle
    circles = _circles(grimp.build_graph("matrixinfer", exclude_type_checking_imports=True, cache_dir=None))
    assert not circles, "import circles: " + "; ".join(" <-> ".join(c) for c in circles)


def _load_time_imports() -> dict[str, set[str]]:
    """What importing each module runs before its own body finishes: its top-level imports
    (not those inside functions or under TYPE_CHECKING) and the packages above every module
    it imports, whose __init__ runs first (but not its own packages: they are loaded, or
    loading, already)."""
    root = Path(matrixinfer.__file__).parent
    files = {".".join(("matrixinfer",) + f.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): f
             for f in root.rglob("*.py")}

    def top_level(body):
        for node in body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                yield node
            elif isinstance(node, ast.If) and "TYPE_CHECKING" not in ast.unparse(node.test):
                yield from top_level(node.body + node.orelse)
            elif isinstance(node, ast.Try):
                yield from top_level(node.body + node.orelse + node.finalbody)

    edges = {}
    for module, path in files.items():
        targets = set()
        for node in top_level(ast.parse(path.read_text()).body):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
                    package = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                    base = f"{package}.{base}" if base else package
                names = [base] + [f"{base}.{a.name}" for a in node.names]
            for name in names:
                parts = name.split(".")
                for i in range(1, len(parts) + 1):
                    target = ".".join(parts[:i])
                    if target in files and not (module == target or module.startswith(target + ".")):
                        targets.add(target)
        edges[module] = targets
    return edges


def test_no_module_is_in_a_circle_of_load_time_imports():
    """Whichever module a process imports first loads: spawned ranks start from
    `worker.model_runner` or a bench module, and a circle through a package's __init__ made
    that import fail halfway (ImportError: partially initialized module) while the suite,
    importing in another order, passed."""
    circles = _circles(_load_time_imports())
    assert not circles, "load-time import circles: " + "; ".join(" <-> ".join(c) for c in circles)


def test_the_request_path_imports_downward_only():
    graph = grimp.build_graph("matrixinfer", cache_dir=None)
    for importer in sorted(graph.modules):
        if not importer.startswith("matrixinfer.engine"):
            for imported in STEP_MESSAGES & graph.find_modules_directly_imported_by(importer):
                graph.remove_import(importer=importer, imported=imported)
    upward = graph.find_illegal_dependencies_for_layers(layers=FLOORS, containers=set())
    assert not upward, "upward imports: " + "; ".join(
        f"{d.importer} -> {d.imported} (via {sorted(r.heads)} -> {sorted(r.tails)})" for d in upward for r in d.routes)


def _library_modules_importing_bench(graph: grimp.ImportGraph) -> list[str]:
    """Modules outside bench/ that import from it, but the command lines (`cli` modules), which
    register the bench subcommands and load their harness when one runs."""
    return sorted(f"{m} -> {i}" for m in graph.modules
                  if not m.startswith("matrixinfer.bench") and m.rpartition(".")[2] != "cli"
                  for i in graph.find_modules_directly_imported_by(m) if i.startswith("matrixinfer.bench"))


def test_no_library_module_imports_a_benchmark():
    """Benchmarks live in bench/ and library code needs none of them (nor their report writer)."""
    found = _library_modules_importing_bench(grimp.build_graph("matrixinfer", cache_dir=None))
    assert not found, "library modules importing bench/: " + "; ".join(found)


def test_the_check_finds_a_circle_and_an_upward_import():
    """The checks can fail: a made-up circle and an upward arrow are found."""
    graph = grimp.build_graph("matrixinfer", cache_dir=None)
    graph.add_import(importer="matrixinfer.kernels", imported="matrixinfer.serving.api_server")
    assert graph.find_illegal_dependencies_for_layers(layers=FLOORS, containers=set())
    graph.add_import(importer="matrixinfer.model.context", imported="matrixinfer.model.deepseek")
    assert any("matrixinfer.model.context" in c for c in _circles(graph))
    graph.add_import(importer="matrixinfer.ems.client", imported="matrixinfer.bench.report")
    assert _library_modules_importing_bench(graph) == ["matrixinfer.ems.client -> matrixinfer.bench.report"]
    edges = _load_time_imports()
    edges["matrixinfer.kernels"] = edges["matrixinfer.kernels"] | {"matrixinfer.engine.core"}
    assert any("matrixinfer.kernels" in c for c in _circles(edges))
