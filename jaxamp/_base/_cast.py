"""Casting values: once per value and dtype, literals in numpy, checked.

:func:`cast` is the one way amp changes a value's dtype. Within one trace
(:func:`cast_cache`) a value is cast at most once per dtype, so a parameter
read by many matmuls is converted once; a narrowing cast carries the overflow
check when it is on (``_overflow.py``).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from .. import _compat
from . import _overflow, _state
from ._dtypes import dtype_of, is_float, is_literal

# A fresh cast cache (and overflow-flag cache) for one trace; see _state.
cast_cache = _state.fresh_trace


def _convert(x: Any, dtype: np.dtype) -> Any:
    out = jax.lax.convert_element_type(x, dtype)
    return _overflow.poison("convert_element_type", [x], out)


def cast(x: Any, dtype: Any) -> Any:
    """Cast a real floating value to ``dtype``; anything else is returned as is.

    Args:
        x: a JAX array or tracer, or a literal (numpy / Python scalar).
        dtype: the target float dtype.

    Returns:
        ``x`` in ``dtype``: the cached cast where this trace already made it,
        a numpy value for a literal (it stays a literal), ``x`` itself for
        integer, boolean, complex, PRNG-key and float0 values.
    """
    src = dtype_of(x)
    if not is_float(src):
        return x
    dtype = np.dtype(dtype)
    if src == dtype:
        return x
    if is_literal(x):
        return np.asarray(x, dtype=dtype)
    cache = _state.current().casts
    if cache is None:
        return _convert(x, dtype)
    key = (id(x), dtype)
    hit = cache.get(key)
    if hit is not None and hit[0] is x:
        return hit[1]
    out = _convert(x, dtype)
    cache[key] = (x, out)
    return out


def restore(x: Any, aval: Any) -> Any:
    """Cast ``x`` to exactly ``aval``'s dtype (and weak type) if it differs."""
    dtype = getattr(aval, "dtype", None)
    if dtype is None or getattr(x, "dtype", dtype) == dtype:
        return x
    if getattr(aval, "weak_type", False) and isinstance(x, jax.Array):
        return _compat.convert(x, dtype, weak_type=True)
    return cast(x, dtype)
