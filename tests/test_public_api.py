"""The public API: a sorted __all__, every name documented, nothing private."""

import ast
import importlib
import inspect
import os
import pydoc
import typing
from pathlib import Path

import pytest

import jaxamp

NAMESPACES = ("extend", "quant", "rules", "tools", "training")


def test_all_is_sorted_and_complete():
    assert list(jaxamp.__all__) == sorted(jaxamp.__all__)
    assert len(set(jaxamp.__all__)) == len(jaxamp.__all__)
    for name in jaxamp.__all__:
        assert not name.startswith("_")
        assert hasattr(jaxamp, name), name


def _attribute_docstrings() -> set[str]:
    """Names assigned at module level in jaxamp/ and followed by a string."""
    names = set()
    for path in Path(jaxamp.__file__).parent.rglob("*.py"):
        body = ast.parse(path.read_text()).body
        for stmt, nxt in zip(body, body[1:]):
            targets = getattr(stmt, "targets", None) or [getattr(stmt, "target", None)]
            if isinstance(stmt, (ast.Assign, ast.AnnAssign)) and (
                isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
            ):
                names.update(t.id for t in targets if isinstance(t, ast.Name))
    return names


def test_public_callables_have_docstrings():
    documented = _attribute_docstrings()
    for name in jaxamp.__all__:
        obj = getattr(jaxamp, name)
        if typing.get_origin(obj) is not None:  # a type alias: attribute docstring
            assert name in documented, f"jaxamp.{name} has no docstring"
        elif callable(obj):
            assert inspect.getdoc(obj), f"jaxamp.{name} has no docstring"


def test_jaxamp_004_names_exist():
    for name in (
        "amp",
        "amp_stop",
        "default_amp_policy",
        "use_compute_precision",
        "use_original_precision",
    ):
        assert name in jaxamp.__all__


def _public_callables():
    modules = [("jaxamp", jaxamp)]
    modules += [(f"jaxamp.{m}", getattr(jaxamp, m)) for m in NAMESPACES]
    modules += [
        (f"jaxamp.migration.{m}", getattr(jaxamp.migration, m))
        for m in jaxamp.migration.__all__
    ]
    for prefix, module in modules:
        for name in module.__all__:
            obj = getattr(module, name)
            if callable(obj) and typing.get_origin(obj) is None:
                yield f"{prefix}.{name}", obj


def test_public_signatures_read_in_one_line():
    # help() and the API reference print the signature on one line: a default
    # must print as a name or a short value, never as a table (the default
    # policy's ~70 rules once made amp's signature ~3,400 characters).
    checked = 0
    for name, obj in _public_callables():
        try:
            sig = inspect.signature(obj)
        except (TypeError, ValueError):  # a builtin without a signature
            continue
        checked += 1
        for param in sig.parameters.values():
            assert len(str(param)) <= 80, f"{name}: {param}"
        # Many short parameters (int8_policy's 12) may exceed 300 characters.
        if len(sig.parameters) <= 6:
            assert len(str(sig)) <= 300, f"{name}{sig}"
    assert checked > 50
    assert len(str(inspect.signature(jaxamp.amp))) <= 300
    assert len(str(inspect.signature(jaxamp.precision_report))) <= 300


def test_amp_help_shows_the_example_early():
    text = pydoc.render_doc(jaxamp.amp, renderer=pydoc.plaintext).splitlines()
    signature = next(line for line in text if line.startswith("amp("))
    assert len(signature) <= 300
    assert "<jaxamp.default_amp_policy: " in signature
    example = next(i for i, line in enumerate(text) if line.strip() == "Example:")
    assert example < 40
    assert ">>> f = jaxamp.amp(" in "\n".join(text[example : example + 6])


def test_a_jax_newer_than_tested_warns_naming_the_tested_versions():
    # pyproject.toml sets no upper bound on jax (as equinox, optax and flax);
    # import jaxamp warns once on a newer minor version instead.
    from jaxamp import _compat

    assert not _compat.warn_untested_jax("0.10.2")
    assert not _compat.warn_untested_jax("0.11.9")
    assert not _compat.warn_untested_jax("0.12.0.1")
    with pytest.warns(UserWarning, match=r"tested with JAX 0\.10 to 0\.12.*0\.13\.0"):
        assert _compat.warn_untested_jax("0.13.0")
    assert not _compat.warn_untested_jax("dev")


def test_top_level_names_few_and_grouped_names_complete():
    # The top level holds what a training script calls; every other public
    # name lives in one namespace, each with a sorted __all__.
    assert len(jaxamp.__all__) <= 35
    public = [n for n in dir(jaxamp) if not n.startswith("_")]
    assert len(public) <= 40 and set(public) <= set(jaxamp.__all__) | {"compat"}
    for ns in NAMESPACES:
        module = getattr(jaxamp, ns)
        assert list(module.__all__) == sorted(module.__all__), ns
        assert all(hasattr(module, n) for n in module.__all__), ns
    for name, home in jaxamp._MOVED.items():
        module = importlib.import_module(f"jaxamp.{home}")
        assert name in module.__all__, (name, home)


@pytest.mark.parametrize("name", sorted(jaxamp._MOVED))
def test_moved_name_served_with_a_deprecation_naming_its_home(name):
    home = jaxamp._MOVED[name]
    with pytest.warns(DeprecationWarning, match=rf"jaxamp\.{home}\.{name}\b"):
        obj = getattr(jaxamp, name)
    assert obj is getattr(importlib.import_module(f"jaxamp.{home}"), name)


# Names that moved between namespaces or were renamed:
# (old namespace, name) -> (new namespace, new name).
MOVED_BETWEEN = {
    ("quant", "quantize"): ("quant", "fp8_quantize"),
    ("quant", "register_format"): ("extend", "register_format"),
    ("quant", "unregister_format"): ("extend", "unregister_format"),
    ("rules", "RuleContext"): ("extend", "RuleContext"),
    ("rules", "register_higher_order"): ("extend", "register_higher_order"),
    ("rules", "unregister_higher_order"): ("extend", "unregister_higher_order"),
    ("", "quantize"): ("quant", "fp8_quantize"),
}


@pytest.mark.parametrize("old,name", sorted(MOVED_BETWEEN))
def test_moved_or_renamed_name_warns_naming_its_new_spelling(old, name):
    home, new = MOVED_BETWEEN[(old, name)]
    module = getattr(jaxamp, old) if old else jaxamp
    assert name not in module.__all__ and name not in dir(module)
    with pytest.warns(DeprecationWarning, match=rf"jaxamp\.{home}\.{new}\b"):
        obj = getattr(module, name)
    assert obj is getattr(getattr(jaxamp, home), new)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        module.nope  # noqa: B018


def test_deprecation_tables_list_the_moved_names():
    for ns in ("quant", "rules"):
        assert getattr(jaxamp, ns)._MOVED == {
            n: f"jaxamp.{h}.{new}"
            for (o, n), (h, new) in MOVED_BETWEEN.items()
            if o == ns
        }
    assert jaxamp._RENAMED == {"quantize": "jaxamp.quant.fp8_quantize"}


def test_deprecated_force_full_precision_and_compat_package():
    from jaxamp.migration import _mpx

    with pytest.warns(DeprecationWarning, match="jaxamp.amp_stop"):
        assert jaxamp.force_full_precision is _mpx.force_full_precision
    with pytest.warns(DeprecationWarning, match=r"jaxamp\.migration\.jmp"):
        from jaxamp.compat import jmp
    assert jmp is jaxamp.migration.jmp
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        jaxamp.nope  # noqa: B018


def test_xla_flags_are_set_only_where_this_xla_knows_them(monkeypatch):
    # An unknown flag in XLA_FLAGS aborts XLA at backend start (JAX >= 0.11
    # lost --xla_cpu_use_fusion_emitters): the table must match the installed
    # XLA, checked by starting a backend with the flag in a subprocess.
    import subprocess
    import sys

    from jaxamp import _compat

    flag = "--xla_cpu_use_fusion_emitters=false"
    env = {**os.environ, "XLA_FLAGS": flag, "JAX_PLATFORMS": "cpu"}
    run = subprocess.run(
        [sys.executable, "-c", "import jax; jax.numpy.ones(2).block_until_ready()"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (run.returncode == 0) == _compat.xla_flag_known(flag), run.stderr[-500:]
    keep = "--xla_backend_optimization_level=0"
    monkeypatch.setattr(_compat, "_jaxlib_minor", lambda: (0, 10))
    assert _compat.known_xla_flags(f"{flag} {keep}") == f"{flag} {keep}"
    monkeypatch.setattr(_compat, "_jaxlib_minor", lambda: (0, 11))
    assert _compat.known_xla_flags(f"{flag} {keep}") == keep
    assert not _compat.xla_flag_known("xla_cpu_use_fusion_emitters")
