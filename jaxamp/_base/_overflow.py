"""Forward overflows: found, located and never silent.

A float16 value that overflows can vanish without a trace: ``rsqrt(inf) = 0``,
``tanh(inf) = 1``, ``exp(-inf) = 0`` absorb it, no inf or NaN reaches the loss or
the gradients, and dynamic loss scaling (which only sees the gradients) cannot
react. Two tools close that hole:

* :func:`jaxamp.find_overflows` (``_find_overflows.py``) evaluates ``amp(fn)``
  equation by equation and names every equation whose low-precision output
  became non-finite from finite inputs.
* ``amp(fn, overflow_check=True)`` (the default for float16) makes such an
  overflow visible inside the compiled step: where a range-risky equation (a
  sum, product, quotient, power, matmul or narrowing cast) turns finite inputs
  into a non-finite float16 value, the value is multiplied by NaN. The NaN then
  reaches the loss and, through the backward pass, the gradients, so the step's
  loss is NaN and the dynamic loss scaler and ``skip_nonfinite_updates`` skip
  and count the step, as PyTorch's ``GradScaler`` does for an overflow that
  propagates on its own. Values that were already non-finite (a ``-inf``
  attention mask) are left alone.

This module is the check: :func:`checking` switches it on for a walk,
:func:`poison` applies it to one equation's outputs, and :func:`is_check` /
:func:`is_factor` recognise the equations it adds (the scan rule drops them
where a cast moves before the loop and carries the check there).
"""

from __future__ import annotations

import contextlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import _compat
from . import _state
from ._dtypes import dtype_of, is_float, limited_range
from ._scopes import marker

# Primitives that can turn finite inputs into a non-finite output.
RISKY = frozenset(
    {
        "add",
        "add_any",
        "sub",
        "mul",
        "div",
        "square",
        "integer_pow",
        "pow",
        "exp",
        "exp2",
        "expm1",
        "sinh",
        "cosh",
        "dot_general",
        "conv_general_dilated",
        "ragged_dot_general",
        "reduce_sum",
        "cumsum",
        "convert_element_type",
    }
)

# Named scope of the equations a check adds (finite tests, the NaN factor): the
# scan rule recognises a cast's check when it casts the input before the loop.
CHECK_SCOPE = marker("jaxamp_overflow_check")


def checking(enabled: bool = True) -> contextlib.AbstractContextManager:
    """Poison forward overflows in the equations bound inside (or, with
    ``enabled=False``, switch an enclosing check off)."""
    return _state.updated(flags={} if enabled else None)


def is_check(eqn: Any) -> bool:
    """``eqn`` is a finite test that the check added."""
    return eqn.primitive.name == "is_finite" and CHECK_SCOPE in _compat.scope_names(eqn)


def is_factor(eqn: Any) -> bool:
    """``eqn`` multiplies a checked value by the check's NaN-or-1 factor."""
    return eqn.primitive.name == "mul" and CHECK_SCOPE in _compat.scope_names(eqn)


def _nonfinite(x: Any) -> Any:
    """Scalar bool: ``x`` has a non-finite element (cached per value)."""
    cache = _state.current().flags
    key = id(x)
    hit = cache.get(key) if cache is not None else None
    if hit is not None and hit[0] is x:
        return hit[1]
    flag = jnp.logical_not(jnp.all(jnp.isfinite(x)))
    if cache is not None:
        cache[key] = (x, flag)
    return flag


def poison(prim_name: str, inputs: Any, outputs: Any) -> Any:
    """``outputs`` with NaN in place of a fresh overflow (see the module doc).

    Args:
        prim_name: the primitive that produced ``outputs``.
        inputs: its inputs (arrays, tracers or literals).
        outputs: its output or list of outputs.

    Returns:
        ``outputs`` unchanged when no check is active, the primitive is not
        range-risky or no output has a limited-range float dtype; otherwise each
        such output multiplied by ``nan`` if it holds a non-finite value while
        every float input is finite, by 1 otherwise.
    """
    if _state.current().flags is None or prim_name not in RISKY:
        return outputs
    many = isinstance(outputs, (list, tuple))
    outs = list(outputs) if many else [outputs]
    idx = [i for i, o in enumerate(outs) if limited_range(getattr(o, "dtype", None))]
    if not idx:
        return outputs
    with jax.named_scope(CHECK_SCOPE):
        return _poison(inputs, outputs, outs, idx)


def _poison(inputs: Any, outputs: Any, outs: list, idx: list) -> Any:
    """:func:`poison` for the limited-range outputs ``outs[i]``, ``i in idx``."""
    ins_ok = True
    for x in inputs:
        if not is_float(dtype_of(x)):
            continue
        if isinstance(x, jax.Array):
            ins_ok = jnp.logical_and(ins_ok, jnp.logical_not(_nonfinite(x)))
        elif not np.all(np.isfinite(np.asarray(x, np.float64))):
            return outputs  # a literal inf / NaN (a mask): nothing is fresh
    for i in idx:
        o = outs[i]
        fresh = jnp.logical_and(_nonfinite(o), ins_ok)
        factor = jnp.where(fresh, jnp.nan, 1.0).astype(o.dtype)
        outs[i] = jax.lax.mul(o, factor)
        cache = _state.current().flags
        cache[id(outs[i])] = (outs[i], jnp.logical_or(fresh, _nonfinite(o)))
    return outs if isinstance(outputs, (list, tuple)) else outs[0]
