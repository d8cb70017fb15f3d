"""Tests of the documentation: the API reference lists every public name, every
public name has a docstring, and the user guide's code runs."""

import functools
import re
import warnings
from pathlib import Path

import pytest

import jaxamp

ROOT = Path(__file__).resolve().parents[1]
API = ROOT / "docs" / "api.md"
GUIDE = ROOT / "docs" / "guide.md"


@functools.cache
def _griffe_package():
    """jaxamp as griffe reads it (the whole package parsed once per process)."""
    griffe = pytest.importorskip("griffe")
    return griffe.load("jaxamp", search_paths=[str(ROOT)], resolve_aliases=True)


def _docstring(name: str) -> str:
    """The docstring the API reference renders: griffe's, which also reads the
    string literal after a module attribute (``default_amp_policy``)."""
    doc = _griffe_package()[name].docstring
    return "" if doc is None else doc.value.strip()


NAMESPACES = ("extend", "quant", "rules", "tools", "training")


def test_every_public_name_is_in_the_api_reference():
    # Each name of jaxamp.__all__ and of its namespaces' (jaxamp.quant, ...)
    # under one ``::: jaxamp.NAME`` or ``::: jaxamp.NAMESPACE.NAME`` entry; a
    # namespace itself as a module entry.
    text = API.read_text()
    listed = set(re.findall(r"^::: jaxamp\.(\w+(?:\.\w+)?)\s*$", text, re.M))
    modules = set(re.findall(r"^::: jaxamp\.([\w.]+)\n    options:", text, re.M))
    listed -= modules
    public = set(jaxamp.__all__) - {*NAMESPACES, "migration"}
    for ns in NAMESPACES:
        public |= {f"{ns}.{n}" for n in getattr(jaxamp, ns).__all__}
    aliases = {n for n in public if "." not in n}
    wanted = {n for n in public if n.split(".")[-1] not in aliases or "." not in n}
    missing = sorted(wanted - listed)
    assert not missing, f"add `::: jaxamp.NAME` entries to docs/api.md for {missing}"
    unknown = sorted(listed - public)
    assert not unknown, f"docs/api.md lists names not public in jaxamp: {unknown}"
    assert set(NAMESPACES) | {"migration"} <= modules


@pytest.mark.parametrize("name", sorted(jaxamp.__all__))
def test_every_public_name_has_a_docstring(name):
    assert _docstring(name), f"jaxamp.{name} has no docstring"


def _python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, re.M | re.S)


@pytest.mark.slow
def test_user_guide_code_runs():
    """The guide's ```python blocks run in order in one namespace, as a reader
    would paste them into one session (needs flax for the NNX section)."""
    blocks = _python_blocks(GUIDE.read_text())
    assert len(blocks) > 10
    import jax

    from jaxamp._base import _formats

    namespace: dict = {"__name__": "guide"}
    formats_before = set(_formats.registered())
    # A reader runs JAX's default promotion (optax's updates need it), not the
    # strict promotion conftest.py sets for the library's own tests.
    try:
        with jax.numpy_dtype_promotion("standard"):
            for i, block in enumerate(blocks):
                try:
                    code = compile(block, f"docs/guide.md[block {i}]", "exec")
                    exec(code, namespace)
                except Exception as e:
                    msg = f"docs/guide.md block {i} failed:\n{block}"
                    raise AssertionError(msg) from e
    finally:  # the guide's formats (its "e3m4") leave the process's registry
        for fmt in set(_formats.registered()) - formats_before:
            jaxamp.extend.unregister_format(fmt.name)


def test_module_paths_named_in_docstrings_and_docs_exist():
    # A reader follows ``jaxamp._walk._loop`` or ``_scan_hoist.py`` from a
    # docstring or a page of docs/: each must name a module (or an attribute
    # of one) that exists. Files of other libraries (``mpx/_grad_tools.py``)
    # are named with their library's folder and are not checked.
    import importlib

    pkg = ROOT / "jaxamp"
    stems = {p.stem for p in pkg.rglob("*.py")} | {
        p.name for p in pkg.rglob("*") if p.is_dir()
    }
    files = [*pkg.rglob("*.py"), *(ROOT / "docs").glob("*.md"), ROOT / "README.md"]
    missing = []
    for f in files:
        text = f.read_text()
        for m in re.finditer(r"(?<![\w/])(_[a-z][a-z0-9_]*)\.py\b", text):
            if m.group(1) not in stems:
                missing.append((f.name, m.group(0)))
        for m in re.finditer(r"jaxamp((?:\._?[a-z][a-z0-9_]*)+)(?![\w*])", text):
            parts = m.group(1).strip(".").split(".")
            obj, name = None, "jaxamp"
            try:
                obj = importlib.import_module(name)
                for part in parts:
                    name += "." + part
                    try:
                        with warnings.catch_warnings():  # a deprecated alias
                            warnings.simplefilter("ignore", DeprecationWarning)
                            obj = getattr(obj, part)
                    except AttributeError:
                        obj = importlib.import_module(name)
            except ImportError:
                missing.append((f.name, m.group(0)))
    assert not missing, missing
