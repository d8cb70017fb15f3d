"""Dtype helpers: float-ness and width tests, widest dtype, dtype parsing.

Every "is this a low-precision float / a literal / weakly typed" question in
jaxamp is answered here, once.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import _ambient_policy

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


# Semantic dtype names (Haliax's ``SemanticDType``): the field of the current
# policy each one names.
SEMANTIC_FIELDS = {
    "compute": "compute_dtype",
    "param": "param_dtype",
    "parameter": "param_dtype",
    "output": "output_dtype",
}


def canonical_dtype(dtype: Any, *, argname: str = "dtype") -> np.dtype:
    """Parse ``dtype`` (a dtype, a scalar type, a name such as ``"bf16"``, or a
    semantic name).

    The semantic names ``"compute"``, ``"param"`` (or ``"parameter"``) and
    ``"output"`` (also :class:`jaxamp.migration.haliax.SemanticDType` members) resolve
    to that
    dtype of the current policy (:func:`jaxamp.migration.haliax.mixed_precision`), when
    this
    function runs.

    Args:
        dtype: a NumPy / JAX dtype or scalar type, a dtype name (see
            ``_ALIASES``) or a semantic name.
        argname: the caller's argument name, used in error messages.

    Returns:
        A NumPy floating dtype.

    Raises:
        ValueError: if ``dtype`` does not name a floating-point dtype, or is a
            semantic name while no policy is active; the message names
            ``argname``.
    """
    if isinstance(dtype, str):
        key = dtype.strip().lower()
        if key in SEMANTIC_FIELDS:
            return _semantic(key, argname)
        if key in ("int8", "s8", "i8"):
            raise ValueError(_int8_hint(argname, dtype))
        if key not in _ALIASES:
            raise ValueError(
                f"{argname}={dtype!r} is not a known floating-point dtype name; use "
                f"one of {sorted(_ALIASES)}, a semantic name "
                "('compute', 'param', 'output') or a jnp dtype such as jnp.bfloat16."
            )
        dtype = _ALIASES[key]
    try:
        out = np.dtype(dtype)
    except TypeError as e:
        raise ValueError(
            f"{argname}={dtype!r} is not a dtype; pass e.g. jnp.bfloat16."
        ) from e
    if out == np.dtype(np.int8):
        raise ValueError(_int8_hint(argname, dtype))
    if not jnp.issubdtype(out, jnp.floating):
        raise ValueError(
            f"{argname} must be a floating-point dtype (e.g. jnp.bfloat16 or "
            f"jnp.float16), got {out}."
        )
    return out


def _int8_hint(argname: str, dtype: Any) -> str:
    """The error for an int8 dtype where a float one is needed: int8 matmuls
    are a policy over a float compute dtype, not a compute dtype."""
    return (
        f"{argname}={dtype!r}: int8 is not a compute dtype; int8 matmuls are a "
        "policy: pass compute_dtype=jnp.bfloat16, "
        "amp_policy=jaxamp.int8_amp_policy (or jaxamp.int8_policy(...); FP8: "
        "jaxamp.fp8_amp_policy)."
    )


def _semantic(key: str, argname: str) -> np.dtype:
    policy = _ambient_policy.current_policy()
    if policy is None:
        raise ValueError(
            f"{argname}={key!r} names the current policy's {key} dtype, but no "
            "policy is active: call it inside `with jaxamp.migration.haliax."
            "mixed_precision('p=f32,c=bf16,o=f32'):` or pass a dtype such as "
            "jnp.bfloat16."
        )
    return np.dtype(getattr(policy, SEMANTIC_FIELDS[key]))


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


def is_literal(x: Any) -> bool:
    """True for jaxpr literals and other constants (numpy / Python scalars):
    anything that is not a JAX array or tracer."""
    return not isinstance(x, jax.Array)


def is_weak(x: Any) -> bool:
    """True for weakly typed values (Python scalars and what they produce)."""
    if is_literal(x):
        return isinstance(x, (int, float))
    return bool(getattr(jax.typeof(x), "weak_type", False))


def is_low(x: Any) -> bool:
    """True for a traced float value narrower than float32 (bfloat16, float16,
    FP8); False for literals and numpy constants."""
    return isinstance(x, jax.Array) and is_low_dtype(x.dtype)


def is_low_dtype(dtype: Any) -> bool:
    """True for a float dtype narrower than float32 (bfloat16, float16, FP8)."""
    return dtype is not None and is_float(dtype) and np.dtype(dtype).itemsize < 4


def limited_range(dtype: Any) -> bool:
    """A float dtype whose largest value is below float32's (float16, FP8):
    what the overflow check guards. bfloat16 has float32's range."""
    return is_float(dtype) and float(jnp.finfo(dtype).max) < 1e38
