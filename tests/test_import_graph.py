"""The import graph of ``hawk/`` has no circles, and its packages import only the layers below them.

Data flows one way (layouts → plan → transform → devices → memory → transport → connector → engine /
integrations → serve, sim and bench on top; docs/design.md §2); a circle between two modules means neither
can be understood, tested or loaded without the other. Imports inside functions count too: deferring one
hides a circle from the interpreter, not from the reader."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "hawk"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(module: str, node: ast.ImportFrom) -> str:
    """The absolute name an ``ImportFrom`` names (relative imports resolved against ``module``)."""
    if not node.level:
        return node.module or ""
    is_package = (PACKAGE.parent / Path(*module.split("."))).is_dir()
    base = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
    return ".".join(base + ([node.module] if node.module else []))


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module → the ``hawk`` modules it imports, at module level or inside any function."""
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(name, node)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            edges |= {t for t in targets if t in modules and t != name}
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _hawk_modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def test_the_checker_finds_a_circle_through_a_function_level_import():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_graph_sees_imports_inside_functions(tmp_path: Path):
    src = tmp_path / "m.py"
    src.write_text("def f():\n    from hawk.engine import ranks\n    import hawk.config\n")
    modules = {**_hawk_modules(), "m": src}
    assert {"hawk.engine.ranks", "hawk.config"} <= import_graph(modules)["m"]


def test_hawk_has_no_import_circles():
    modules = _hawk_modules()
    assert len(modules) > 50, "the package was not found"
    found = cycles(import_graph(modules))
    assert not found, "import circles: " + "; ".join(" <-> ".join(c) for c in found)


@pytest.mark.parametrize("name", ["hawk.engine.instances", "hawk.bench.ttft_cli"])
def test_known_edges_are_seen(name: str):
    """The graph is not empty by accident: modules that import others have edges."""
    assert import_graph(_hawk_modules())[name]


#: The layers, bottom first: a package imports only packages of lower layers (and itself). Two packages
#: in one layer know nothing of each other.
LAYERS: list[set[str]] = [
    {"errors", "triton_launch"},
    {"layouts"},
    {"config"},  # the one serving configuration (device strings parsed by layouts)
    {"config_cli"},  # the CLIs generated from it
    {"plan"},
    {"transform"},
    {"devices"},
    {"memory"},
    {"transport"},
    {"connector"},
    {"engine", "integrations"},  # HAWK's engine; HawkConnector inside vLLM's
    {"serve"},
    {"sim"},
    {"bench"},
    {"cli"},
    {"__main__"},
]


def _package(module: str) -> str:
    """``hawk.connector.algorithm1`` -> ``connector``; a top-level module is its own package."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def upward_imports(graph: dict[str, set[str]], layers: list[set[str]]) -> list[str]:
    """Every import of a package in the same or a higher layer (other than itself), as ``a -> b``."""
    rank = {p: i for i, layer in enumerate(layers) for p in layer}
    bad = []
    for module, targets in sorted(graph.items()):
        a = _package(module)
        for t in sorted(targets):
            b = _package(t)
            if a and b and a != b and rank.get(b, -1) >= rank.get(a, len(layers)):
                bad.append(f"{module} -> {t}")
    return bad


def test_the_layer_check_finds_an_import_of_a_higher_layer():
    graph = {"hawk.plan.x": {"hawk.layouts.y"}, "hawk.layouts.y": set()}
    assert upward_imports(graph, [{"layouts"}, {"plan"}]) == []
    assert upward_imports(graph, [{"plan"}, {"layouts"}]) == ["hawk.plan.x -> hawk.layouts.y"]
    assert upward_imports({"hawk.engine.a": {"hawk.integrations.b"}}, [{"engine", "integrations"}]) == ["hawk.engine.a -> hawk.integrations.b"]


def test_every_package_is_in_a_layer():
    packages = {_package(m) for m in _hawk_modules()} - {""}
    assert packages == set().union(*LAYERS), "place a new package in LAYERS (and docs/design.md §2)"


def test_packages_import_only_lower_layers():
    bad = upward_imports(import_graph(_hawk_modules()), LAYERS)
    assert not bad, "imports of a layer not below: " + "; ".join(bad)
