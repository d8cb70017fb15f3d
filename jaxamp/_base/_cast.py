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


def widen(x: Any, dtype: Any) -> Any:
    """``x`` (a narrower float value, e.g. a bfloat16 parameter) widened to
    ``dtype``, recorded in the current cast cache so that the widening is
    undone without a cast: a later ``cast`` of the wide value back to ``x``'s
    dtype returns ``x`` itself (the round trip is exact), and
    :func:`narrow_source` of the wide value returns ``x``. Without a cache
    this is :func:`cast`.

    Args:
        x: a JAX array or tracer of a float dtype narrower than ``dtype``.
        dtype: the wider float dtype (float32 for a bfloat16 parameter).

    Returns:
        ``x`` in ``dtype``.
    """
    out = cast(x, dtype)
    cache = _state.current().casts
    if cache is not None and out is not x:
        cache[(id(out), np.dtype(dtype_of(x)))] = (out, x)
        cache[(id(out), _SOURCE)] = (out, x)
    return out


_SOURCE = "narrow source"  # cast-cache key: the value a wide value widens


def narrow_source(x: Any) -> Any:
    """The narrower value that ``x`` is the exact widening of
    (:func:`widen`, in the current trace), or None."""
    cache = _state.current().casts
    hit = None if cache is None else cache.get((id(x), _SOURCE))
    return hit[1] if hit is not None and hit[0] is x else None


def narrow_sources(invals: list, positions: range | None = None) -> tuple:
    """``(invals, in_dtypes, widened)``: each value at ``positions`` (default:
    all) that is the exact widening of a narrower one (a bfloat16 parameter
    read as the float32 value it holds, :func:`widen`)
    replaced by that narrower value, its dtype in ``in_dtypes`` and True in
    ``widened``; None and False elsewhere.

    A sub-jaxpr rewritten with them (``_walk/_higher_order.rewrite_jaxpr``)
    widens each such input where it is read in the wider dtype: inside a
    ``scan`` body that is one iteration's slice, so a stacked bfloat16 weight
    enters the loop as it is, its matmuls read it as it is, and the
    transposed loop stacks its cotangent in bfloat16 instead of float32.
    """
    new, dtypes, widened = list(invals), [None] * len(invals), [False] * len(invals)
    for i in range(len(invals)) if positions is None else positions:
        source = narrow_source(invals[i])
        if source is not None:
            new[i], dtypes[i], widened[i] = source, dtype_of(source), True
    return new, tuple(dtypes), tuple(widened)


def restore(x: Any, aval: Any) -> Any:
    """Cast ``x`` to exactly ``aval``'s dtype (and weak type) if it differs."""
    dtype = getattr(aval, "dtype", None)
    if dtype is None or getattr(x, "dtype", dtype) == dtype:
        return x
    if getattr(aval, "weak_type", False) and isinstance(x, jax.Array):
        return _compat.convert(x, dtype, weak_type=True)
    return cast(x, dtype)
