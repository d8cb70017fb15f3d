"""Deprecated: the migration namespaces are :mod:`jaxamp.migration`.

``from jaxamp.compat import jmp`` (and ``mpx``, ``haliax``) keeps working for
one release and warns with a ``DeprecationWarning`` naming
``jaxamp.migration``; the names are the same objects.
"""

import importlib
import warnings

_MOVED = ("haliax", "jmp", "mpx")


def __getattr__(name: str):
    if name not in _MOVED:
        raise AttributeError(f"module 'jaxamp.compat' has no attribute {name!r}")
    warnings.warn(
        f"jaxamp.compat.{name} is deprecated: use jaxamp.migration.{name} "
        f"(from jaxamp.migration import {name}).",
        DeprecationWarning,
        stacklevel=2,
    )
    return importlib.import_module(f"jaxamp.migration.{name}")


def __dir__() -> list[str]:
    return sorted(_MOVED)
