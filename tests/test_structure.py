"""The shape of the package: no import cycles among jaxamp's modules, an
equation loop that names no feature, and functions and modules a newcomer can
read (docs/design.md, "Modules and imports")."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "jaxamp"
MAX_FUNCTION_LINES = 80
MAX_MODULE_LINES = 600


def _module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> list[str]:
    """Absolute names a ``from ... import`` names (module or attribute)."""
    if node.level:
        base = module.split(".")
        if not is_package:
            base = base[:-1]
        base = base[: len(base) - (node.level - 1)]
        prefix = ".".join(base + ([node.module] if node.module else []))
    else:
        prefix = node.module or ""
    names = [f"{prefix}.{a.name}" for a in node.names]
    return names if node.module is None else [prefix, *names]


def import_graph() -> dict[str, set[str]]:
    """jaxamp module -> the jaxamp modules it imports, anywhere in its body
    (function-level imports included)."""
    files = {_module_name(p): p for p in PKG.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                targets = _resolve(name, path.name == "__init__.py", node)
            else:
                continue
            deps.update(t for t in targets if t in files and t != name)
        graph[name] = deps
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                return stack[stack.index(m) :] + [m]
            if m not in state and (found := visit(m)):
                return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (found := visit(n)):
            return found
    return None


def test_no_import_cycles():
    graph = import_graph()
    assert len(graph) > 20 and "jaxamp._walk._loop" in graph
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_cycle_finder_finds_a_cycle():
    # The check can fail: a two-module circle through a function-level import.
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}
    assert _cycle(graph) == ["a", "b", "c", "a"]


def test_equation_loop_names_no_feature():
    """The interpreter imports neither the higher-order rules nor any pattern
    rewrite, and its code names no feature: it is handed them as tables."""
    graph = import_graph()
    features = {
        "jaxamp._walk._higher_order",
        "jaxamp._rewrites._rmsnorm",
        "jaxamp._walk._scan_hoist",
    }
    features |= {m for m in graph if m.startswith("jaxamp._rewrites._attention")}
    assert not graph["jaxamp._walk._loop"] & features
    code = (PKG / "_walk" / "_loop.py").read_text()
    tree = ast.parse(code)
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    names |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    names |= {
        n.value
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant) and isinstance(n.value, str)
    }
    words = {"attention", "rms", "rmsnorm", "rms_norm", "scan", "fp8", "int8"}
    # The bind steps and residual choices (pipeline configuration, _amp.py).
    words |= {"overflow", "_overflow", "poison", "barrier", "narrow_activations"}
    words |= {"derived_sums", "_derived_sums", "runnable_product", "transposed"}
    words |= {"_residuals", "bind_saving_less", "loop_casts"}
    assert not {n for n in names if n.lower() in words or "rms_" in n.lower()}


def test_functions_and_modules_are_short():
    long_functions, long_modules = [], []
    for path in PKG.rglob("*.py"):
        text = path.read_text()
        if text.count("\n") > MAX_MODULE_LINES:
            long_modules.append((path.name, text.count("\n")))
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long_functions.append((path.name, node.name, n))
    assert not long_functions, long_functions
    assert not long_modules, long_modules
