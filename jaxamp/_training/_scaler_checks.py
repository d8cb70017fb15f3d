"""Checks of loss-scaler state fields: concrete values only, errors that name
the field and the fix.

A field is checked when its value is known at construction (a Python or NumPy
number, or a concrete JAX array); tracers, sentinels and None pass unchecked,
because JAX and users rebuild states from such leaves (``in_axes`` trees,
``object()`` sentinels, values under ``jit``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from numbers import Number
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def _concrete(x: Any) -> bool:
    """A number whose value is known now: a Python or NumPy number, or a JAX
    array that is neither a tracer nor sharded beyond this process (not a
    sentinel, None or bool)."""
    if isinstance(x, (bool, np.bool_)):
        return False
    if isinstance(x, Number):
        return True
    if isinstance(x, jax.Array):
        return (
            not isinstance(x, jax.core.Tracer)
            and getattr(x, "is_fully_addressable", True)
            and bool(jnp.issubdtype(x.dtype, jnp.number))
        )
    return isinstance(x, (np.ndarray, np.generic)) and np.issubdtype(
        np.asarray(x).dtype, np.number
    )


def _value(owner: str, name: str, value: Any) -> float | None:
    """The float value of a concrete scalar field; None for a traced one."""
    if not _concrete(value):
        return None
    if np.ndim(value) != 0:
        raise ValueError(
            f"{owner}: {name} must be a scalar, got shape {np.shape(value)}."
        )
    return float(value)


def _validate(owner: str, name: str, value: Any, ok: Callable, msg: str) -> None:
    v = _value(owner, name, value)
    if v is not None and not ok(v):
        raise ValueError(f"{owner}: {name}={value} {msg}.")


def _validate_scale(owner: str, name: str, value: Any, allow_inf: bool = False) -> None:
    """A loss scale or bound: not NaN, finite (unless ``allow_inf``), > 0."""
    v = _value(owner, name, value)
    if v is None:
        return
    if math.isnan(v) or (math.isinf(v) and not allow_inf):
        raise ValueError(
            f"{owner}: {name}={value} must be finite; pass a positive number "
            "such as 2.0**15 (rebuild a state that overflowed from its fields "
            "with a finite scale)."
        )
    if v <= 0:
        raise ValueError(
            f"{owner}: {name}={value} must be > 0; a loss scale multiplies the "
            "loss, so pass a positive number such as 2.0**15 (1.0 for none)."
        )


def _as(dtype: Any) -> Callable[[Any], Any]:
    return lambda v: jnp.asarray(v, dtype) if _concrete(v) else v


def _validate_dynamic(
    patience, adjust_factor, scaler, count, total_resets, min_scaler, max_scaler
) -> None:
    """The checks of :class:`DynamicScalerState`'s concrete fields."""
    own = "DynamicScalerState"
    non_negative = (lambda v: v >= 0, "must be >= 0")
    _validate_scale(own, "scaler", scaler)
    _validate_scale(own, "min_scaler", min_scaler)
    _validate_scale(own, "max_scaler", max_scaler, allow_inf=True)
    _validate(
        own,
        "adjust_factor",
        adjust_factor,
        lambda v: 1 < v < math.inf,
        "must be > 1 (and finite), e.g. 2.0",
    )
    _validate(own, "patience", patience, *non_negative)
    _validate(own, "count", count, *non_negative)
    _validate(own, "total_resets", total_resets, *non_negative)
    lo, hi = (
        _value(own, "min_scaler", min_scaler),
        _value(own, "max_scaler", max_scaler),
    )
    if lo is not None and hi is not None and lo > hi:
        raise ValueError(
            f"{own}: min_scaler={min_scaler} > max_scaler={max_scaler}; the "
            "bounds are out of order: pass min_scaler <= max_scaler."
        )
