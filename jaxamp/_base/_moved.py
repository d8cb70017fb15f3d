"""Names a public namespace serves for one release after they moved: a module
``__getattr__`` (PEP 562) that warns with the new spelling and returns the
object from its new home."""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable, Mapping
from typing import Any


def moved_names(
    module: str, moved: Mapping[str, str], stacklevel: int = 2
) -> Callable[[str], Any]:
    """The ``__getattr__`` of ``module`` serving each name of ``moved``.

    Args:
        module: the namespace's dotted name, e.g. ``"jaxamp.quant"``.
        moved: name -> its spelling now, a dotted path whose last component
            is the attribute (``"jaxamp.extend.register_format"``).
        stacklevel: the warning's stack level as seen from the returned
            function (2: its caller, the user's attribute access; 3 where
            the module's own ``__getattr__`` calls it).

    Returns:
        ``__getattr__(name)``: the object at the new spelling, after a
        ``DeprecationWarning`` that names it.

    Raises:
        AttributeError: (from the returned function) for a name not in
            ``moved``, as for any missing module attribute.
    """

    def __getattr__(name: str) -> Any:
        new = moved.get(name)
        if new is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        warnings.warn(
            f"{module}.{name} is deprecated: use {new}.",
            DeprecationWarning,
            stacklevel=stacklevel,
        )
        home, attr = new.rsplit(".", 1)
        return getattr(importlib.import_module(home), attr)

    return __getattr__
