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
def test_user_guide_code_runs(tmp_path, monkeypatch):
    """The guide's ```python blocks run in order in one namespace, as a reader
    would paste them into one session (needs flax for the NNX section), in a
    temporary working directory: what they save stays out of the checkout."""
    monkeypatch.chdir(tmp_path)
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


README = ROOT / "README.md"


def _readme_section(title: str) -> str:
    """The README's ``## title`` section, up to the next ``## `` heading."""
    text = README.read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else None]


def test_readme_quick_start_runs(tmp_path, monkeypatch):
    """The README's Quick start blocks, pasted in order into one session (in
    a temporary directory), run as written: the bfloat16 block's one step
    and the float16 block's one loss-scaled step on the tiny model the first
    block defines, each loss within bf16's / fp16's rounding of float32's."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    monkeypatch.chdir(tmp_path)
    blocks = _python_blocks(_readme_section("Quick start"))
    assert len(blocks) == 2, "the Quick start has a bfloat16 and a float16 block"
    ns: dict = {"__name__": "readme"}
    losses, refs = [], []
    # A reader runs JAX's default promotion (optax's updates need it).
    with jax.numpy_dtype_promotion("standard"):
        for i, block in enumerate(blocks):
            if i:  # float32's loss at the parameters the fp16 step starts from
                refs.append(ns["loss_fn"](ns["params"], ns["x"], ns["y"]))
            exec(compile(block, f"README.md[quick start {i}]", "exec"), ns)
            losses.append(ns["loss"])
        after = ns["loss_fn"](ns["params"], ns["x"], ns["y"])
    assert [np.dtype(v.dtype) for v in losses] == [np.float32, np.float32]
    # Each step's loss is amp's at the parameters before it.
    init = {
        "w1": jax.random.normal(ns["k1"], (64, 256)) / 8,
        "b1": jnp.zeros(256),
        "w2": jax.random.normal(ns["k2"], (256, 10)) / 16,
    }
    with jax.numpy_dtype_promotion("standard"):
        ref0 = ns["loss_fn"](init, ns["x"], ns["y"])
    np.testing.assert_allclose(losses[0], ref0, rtol=2e-2)  # bf16: 8 bits
    np.testing.assert_allclose(losses[1], refs[0], rtol=2e-3)  # fp16: 11 bits
    assert float(after) < float(refs[0]) < float(ref0)  # both steps trained
    assert float(ns["scaler"].scaler) == 2.0**15  # no overflow, no skip
    assert all(v.dtype == jnp.float32 for v in jax.tree.leaves(ns["params"]))
    assert not np.allclose(ns["params"]["w2"], init["w2"])


# A number as the README prints it: 9.15e-3, 2.437, 0.46x, 26.3 ms.
_NUMBER = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?(?:e-?\d+)?)(?![\w.]*\d)")


def _matches(printed: str, values: list[float]) -> bool:
    """Whether a number printed with ``printed``'s digits rounds one of
    ``values`` (its source's figures, at any precision)."""
    mant = printed.split("e")[0]
    decimals = len(mant.split(".")[1]) if "." in mant else 0
    exp = int(printed.split("e")[1]) if "e" in printed else 0
    half = 0.5 * 10.0 ** (exp - decimals)
    v = float(printed)
    return any(abs(s - v) <= half * (1 + 1e-9) for s in values)


def test_readme_table_figures_equal_their_sources():
    """Every figure of the README's comparison table ("What it gives over hand
    casting": the three figure columns, and the ``name: value`` figures in
    the measure's own cell) is a figure of the file the row links, to the
    digits the README prints."""
    section = _readme_section("What it gives over hand casting")
    rows = [ln for ln in section.splitlines() if ln.startswith("| ") and "](" in ln]
    assert len(rows) >= 6
    checked = 0
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        link = re.search(r"\]\((benchmarks/[\w.]+)\)", cells[-1]).group(1)
        source = (ROOT / link).read_text()
        values = [float(s) for s in _NUMBER.findall(source)]
        printed = [n for c in cells[1:-1] for n in _NUMBER.findall(c)]
        printed += re.findall(r"\w: (\d+\.\d+)", cells[0])
        assert printed, row
        for n in printed:
            assert _matches(n, values), f"README {n} is not in {link}: {row}"
            checked += 1
    assert checked >= 20
