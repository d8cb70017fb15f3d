"""The public API: a sorted __all__, every name documented, nothing private."""

import ast
import inspect
import typing
from pathlib import Path

import jaxamp


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
