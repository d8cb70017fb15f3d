"""Dtype helpers: float-ness tests, widest dtype and dtype parsing."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

_ALIASES = {
    "f16": jnp.float16,
    "float16": jnp.float16,
    "half": jnp.float16,
    "bf16": jnp.bfloat16,
    "bfloat16": jnp.bfloat16,
    "f32": jnp.float32,
    "float32": jnp.float32,
    "full": jnp.float32,
    "single": jnp.float32,
    "f64": jnp.float64,
    "float64": jnp.float64,
    "double": jnp.float64,
    "e4m3": jnp.float8_e4m3fn,
    "float8_e4m3fn": jnp.float8_e4m3fn,
    "e5m2": jnp.float8_e5m2,
    "float8_e5m2": jnp.float8_e5m2,
}


def canonical_dtype(dtype: Any, *, argname: str = "dtype") -> np.dtype:
    """Parse ``dtype`` (a dtype, a scalar type or a name such as ``"bf16"``).

    Raises:
        ValueError: if ``dtype`` does not name a floating-point dtype; the message
            names ``argname``.
    """
    if isinstance(dtype, str):
        key = dtype.strip().lower()
        if key not in _ALIASES:
            raise ValueError(
                f"{argname}={dtype!r} is not a known floating-point dtype name; use "
                f"one of {sorted(_ALIASES)} or a jnp dtype such as jnp.bfloat16."
            )
        dtype = _ALIASES[key]
    try:
        out = np.dtype(dtype)
    except TypeError as e:
        raise ValueError(
            f"{argname}={dtype!r} is not a dtype; pass e.g. jnp.bfloat16."
        ) from e
    if not jnp.issubdtype(out, jnp.floating):
        raise ValueError(
            f"{argname} must be a floating-point dtype (e.g. jnp.bfloat16 or "
            f"jnp.float16), got {out}."
        )
    return out


def is_float(dtype: Any) -> bool:
    """True for real floating dtypes (float8...float64); False for int, bool,
    complex, PRNG key and float0 dtypes, which jaxamp never casts."""
    try:
        return bool(jnp.issubdtype(dtype, jnp.floating))
    except TypeError:
        return False


def dtype_of(x: Any) -> np.dtype:
    """The dtype of an array, tracer, numpy scalar or Python scalar."""
    dt = getattr(x, "dtype", None)
    if dt is not None:
        return np.dtype(dt) if not hasattr(dt, "_rules") else dt
    return np.asarray(x).dtype


def widest(dtypes) -> np.dtype | None:
    """The float dtype with the most bits among ``dtypes`` (None if none is float).

    bfloat16 and float16 have the same width; bfloat16 wins a tie because it has
    float32's range.
    """
    best = None
    for dt in dtypes:
        if not is_float(dt):
            continue
        dt = np.dtype(dt)
        if best is None or _rank(dt) > _rank(best):
            best = dt
    return best


def _rank(dt: np.dtype) -> tuple[int, int]:
    return (dt.itemsize, int(dt == jnp.bfloat16))
