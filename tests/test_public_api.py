"""The public API: a sorted __all__, every name documented, nothing private."""

import inspect

import jaxamp


def test_all_is_sorted_and_complete():
    assert list(jaxamp.__all__) == sorted(jaxamp.__all__)
    assert len(set(jaxamp.__all__)) == len(jaxamp.__all__)
    for name in jaxamp.__all__:
        assert not name.startswith("_")
        assert hasattr(jaxamp, name), name


def test_public_callables_have_docstrings():
    for name in jaxamp.__all__:
        obj = getattr(jaxamp, name)
        if callable(obj):
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
