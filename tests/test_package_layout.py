"""The shape of the package: no import cycles among jaxamp's modules, an
equation loop that names no feature, a higher-order primitive named only
where it is registered, and functions and modules a newcomer can read
(docs/design.md, "Modules and imports")."""

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


# The packages, lowest first (docs/design.md, "Packages"): a module imports only
# from its own package and from packages on a lower layer. Packages on one
# layer do not import each other.
LAYERS = (
    ("jaxamp._compat",),
    ("jaxamp._base", "jaxamp._nnx"),
    ("jaxamp._values",),
    ("jaxamp._policy",),
    ("jaxamp._walk", "jaxamp._quant"),
    ("jaxamp._rewrites",),
    ("jaxamp._amp",),
    ("jaxamp._tools", "jaxamp._training"),
    (
        "jaxamp.compat",
        "jaxamp.extend",
        "jaxamp.migration",
        "jaxamp.quant",
        "jaxamp.rules",
        "jaxamp.tools",
        "jaxamp.training",
    ),
    ("jaxamp",),
)
MAX_TOP_LEVEL_MODULES = 6


def package_of(module: str) -> str:
    """``jaxamp._walk._loop`` -> ``jaxamp._walk``; top-level modules are their
    own package; ``jaxamp`` (the ``__init__``) is the root."""
    return ".".join(module.split(".")[:2])


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for module, deps in graph.items():
        out.setdefault(package_of(module), set()).update(
            package_of(d) for d in deps if package_of(d) != package_of(module)
        )
    return out


def _layer(package: str) -> int:
    for i, names in enumerate(LAYERS):
        if package in names:
            return i
    raise AssertionError(f"{package} is on no layer: add it to LAYERS")


def test_no_import_cycles():
    graph = import_graph()
    assert len(graph) > 20 and "jaxamp._walk._loop" in graph
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))
    packages = package_graph(graph)
    assert _cycle(packages) is None, " -> ".join(_cycle(packages))


def test_cycle_finder_finds_a_cycle():
    # The check can fail: a two-module circle through a function-level import.
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}
    assert _cycle(graph) == ["a", "b", "c", "a"]


def test_imports_flow_one_way_between_packages():
    upward = [
        (p, d)
        for p, deps in package_graph(import_graph()).items()
        for d in deps
        if _layer(d) >= _layer(p)
    ]
    assert not upward, f"imports that do not go down a layer: {upward}"


def test_layer_check_can_fail():
    graph = {"jaxamp._base._x": {"jaxamp._walk._loop"}, "jaxamp._walk._loop": set()}
    packages = package_graph(graph)
    assert packages["jaxamp._base"] == {"jaxamp._walk"}
    assert _layer("jaxamp._walk") > _layer("jaxamp._base")


def test_few_modules_at_the_top_level():
    top = sorted(p.name for p in PKG.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, top


def test_equation_loop_names_no_feature():
    """The loop imports neither the higher-order rules nor any pattern
    rewrite, 8-bit format or tool, and its code names no feature: it is handed
    them as tables."""
    graph = import_graph()
    features = {"jaxamp._walk._higher_order", "jaxamp._walk._scan_hoist"}
    features |= {
        m
        for m in graph
        if package_of(m) in ("jaxamp._rewrites", "jaxamp._quant", "jaxamp._tools")
    }
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
    words |= {"layernorm", "layer_norm", "ln_region"}
    # The bind steps and residual choices (pipeline configuration, _amp.py).
    words |= {"overflow", "_overflow", "poison", "barrier", "narrow_activations"}
    words |= {"derived_sums", "_derived_sums", "runnable_product", "transposed"}
    words |= {"_residuals", "bind_saving_less", "loop_casts"}
    assert not {n for n in names if n.lower() in words or "rms_" in n.lower()}


def _modules_naming(word: str) -> list[str]:
    """Modules of jaxamp/ whose text holds the string literal ``word`` (in
    code or in prose, either quote)."""
    return sorted(
        str(p.relative_to(PKG))
        for p in PKG.rglob("*.py")
        if f'"{word}"' in p.read_text() or f"'{word}'" in p.read_text()
    )


# The one module that names the higher-order primitives: their registrations
# (rule and description together, docs/design.md "A higher-order primitive").
# Every other module reads the registry (``_base/_structure.py``).
REGISTERING_MODULE = "_walk/_higher_order.py"
# Patterns that are recognised by a higher-order primitive's name elsewhere:
# module -> the names it may hold, and why.
NAMED_PATTERNS = {
    # jax.nn.softmax is a custom_jvp_call of a known body: the attention
    # matcher recognises the softmax between the two products by it.
    "_rewrites/_attention/_match.py": {"custom_jvp_call"},
}


def registered_primitives(path: Path = PKG / REGISTERING_MODULE) -> set[str]:
    """The primitive names given to ``register_higher_order(...)`` in
    ``path`` (read from its code, not from the registry, which a test may
    have extended)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == (
            "register_higher_order"
        ):
            names |= {
                a.value
                for a in node.args
                if isinstance(a, ast.Constant) and isinstance(a.value, str)
            }
    return names


def misplaced_names(primitives: set[str], naming) -> dict[str, list[str]]:
    """Primitive name -> the modules besides the registering one that name
    it and are not allowed to (:data:`NAMED_PATTERNS`)."""
    out = {}
    for word in sorted(primitives):
        extra = [
            m
            for m in naming(word)
            if m != REGISTERING_MODULE and word not in NAMED_PATTERNS.get(m, ())
        ]
        if extra:
            out[word] = extra
    return out


def test_a_higher_order_primitive_is_named_in_one_module():
    """No higher-order primitive's name as a string outside its registration
    but the named patterns: the walk, the passes, the reports and the
    training modules read a loop or a call through its description."""
    primitives = registered_primitives()
    assert {"scan", "while", "cond", "jit", "custom_jvp_call"} <= primitives
    assert len(primitives) >= 10
    assert not misplaced_names(primitives, _modules_naming)


def test_named_primitive_check_can_fail():
    naming = {"scan": ["_training/_in_backward.py", REGISTERING_MODULE]}
    found = misplaced_names({"scan", "custom_jvp_call"}, lambda w: naming.get(w, []))
    assert found == {"scan": ["_training/_in_backward.py"]}
    mixed = {"custom_jvp_call": ["_rewrites/_attention/_match.py"]}
    assert not misplaced_names({"custom_jvp_call"}, lambda w: mixed.get(w, []))


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
