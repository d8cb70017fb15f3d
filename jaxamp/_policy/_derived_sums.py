"""Sums JAX derives when differentiating, accumulated in float32.

Broadcasting. lax's elementwise n-ary primitives broadcast size-1 and rank-0 operands
implicitly (``mul x:bf16[B,T,D] g:bf16[1,1,D]``), and ``broadcast_in_dim``
does it explicitly. Their transpose sums the cotangent over the broadcast
dimensions *in the cotangent's dtype*: under amp the gradient of a bias, a
LayerNorm gain or a subtracted mean would be a bfloat16 ``reduce_sum`` over
``B*T`` terms, which loses every term below 2**-8 of the running sum.

:func:`bind` binds such an equation through a ``jax.custom_jvp`` whose tangent
rule broadcasts the small operand's tangent in float32 and casts the broadcast
result once to the operand's dtype. The transpose of that chain is
``convert -> reduce_sum(float32) -> convert``: the sum accumulates in float32
(XLA fuses the converts into the reduction) and rounds once, as PyTorch
autocast's float32 ``sum`` does
(https://pytorch.org/docs/stable/amp.html#autocast-op-reference).

The primal is the unchanged primitive. Tangent coefficients are computed from
the small operands (``mul``'s coefficient is the other operand, ``div``'s
denominator rule uses ``y**-2`` of the small ``y``), so the backward pass saves
the same residuals as without the wrapper. Forward-mode and higher-order
derivatives go through the same rule.

Wide products. A matmul the policy gives a float32 result from low-precision
operands (attention logits that feed a softmax, the logits the loss reads) would
make JAX transpose it with a float32 cotangent: a float32 x bfloat16 product in
the backward pass, i.e. a float32 matmul. Here its tangent is the product in the
operands' dtype (float32 accumulation), widened once, so the backward matmuls run
on the compute dtype as in a hand-written ``(q @ k.T).astype(float32)``, while
the forward value is the unrounded float32 result.

Choosers. The JVP of ``reduce_max``/``reduce_min`` counts the tied maxima with a
``reduce_sum`` of 0/1 indicators in the operand's dtype (bfloat16 counts are
exact only up to 256). Here the indicators stay in the operand's dtype (the
same residual) and the counts and the tangent's sum are float32.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero

from .. import _compat
from .._base._dtypes import dtype_of, is_float, is_literal, is_low
from .._base._prims import MATMULS

# Elementwise primitives that broadcast size-1 / rank-0 operands implicitly.
ELEMENTWISE = frozenset(
    {"add", "sub", "mul", "div", "max", "min", "pow", "atan2", "rem", "nextafter"}
)
# Linear primitives whose transpose sums over the dimensions they create.
BROADCASTING = frozenset({"broadcast_in_dim"})
# Reductions whose JVP sums indicators of the chosen elements.
CHOOSERS = frozenset({"reduce_max", "reduce_min"})


def _broadcast_to(x: Any, shape: tuple[int, ...]) -> Any:
    """``x`` broadcast to ``shape`` (numpy broadcasting rules), explicitly."""
    lifted = jnp.reshape(x, (1,) * (len(shape) - np.ndim(x)) + np.shape(x))
    return jax.lax.broadcast_in_dim(lifted, shape, tuple(range(len(shape))))


def _widened_broadcast(t: Any, shape: tuple[int, ...]) -> Any:
    """``t`` broadcast to ``shape`` in float32, cast back to ``t``'s dtype."""
    wide = _broadcast_to(jax.lax.convert_element_type(t, jnp.float32), shape)
    return jax.lax.convert_element_type(wide, t.dtype)


def _elementwise(prim: Any, invals: Sequence[Any], params: dict) -> Any:
    shapes = [np.shape(x) for x in invals]
    shape = tuple(np.broadcast_shapes(*shapes))
    small = [i for i, x in enumerate(invals) if is_low(x) and np.shape(x) != shape]
    if not small:
        return None
    traced = [i for i, x in enumerate(invals) if not is_literal(x)]

    def primal(*args):
        vals = list(invals)
        for i, a in zip(traced, args):
            vals[i] = a
        return _compat.bind(prim, vals, params)

    f = jax.custom_jvp(primal)

    def jvp(primals, tangents):
        vals = list(invals)
        for i, a in zip(traced, primals):
            vals[i] = a
        out = _compat.bind(prim, vals, params)
        t_out = None
        for i, t in zip(traced, tangents):
            if isinstance(t, SymbolicZero):
                continue
            if i in small:
                t_i = _partial_tangent(prim, params, vals, i, shape, t)
            else:
                t_i = _jvp_at(prim, params, vals, i, vals[i], t)
            t_out = t_i if t_out is None else jax.lax.add(t_out, t_i)
        if t_out is None:
            t_out = jnp.zeros_like(out)
        return out, t_out

    f.defjvp(jvp, symbolic_zeros=True)
    return f(*(invals[i] for i in traced))


def _jvp_at(prim, params, vals, i, x, t):
    """Tangent of ``prim`` in operand ``i`` at ``x``, the others held fixed."""

    def partial_fn(xi):
        args = list(vals)
        args[i] = xi
        return _compat.bind(prim, args, params)

    return jax.jvp(partial_fn, (x,), (t,))[1]


def _partial_tangent(prim, params, vals, i, shape, t):
    """Tangent in the broadcast operand ``i``: its tangent is broadcast in float32
    first, so no cotangent is summed in low precision."""
    t_full = _widened_broadcast(t, shape)
    if prim.name == "div" and i == 1:
        # d(x/y) = -t (x/y) / y: the quotient (an activation's magnitude) and the
        # small y are the residuals; y**-2 would underflow float16 for |y| > 256.
        x, y = vals
        q = _compat.bind(prim, vals, params)
        return jax.lax.div(jax.lax.mul(jax.lax.neg(t_full), q), y)
    x_full = _broadcast_to(vals[i], shape)
    return _jvp_at(prim, params, vals, i, x_full, t_full)


def _unary(prim: Any, x: Any, params: dict, tangent: Any) -> Any:
    """``prim(x)`` through a custom_jvp whose tangent is ``tangent(x, out, t)``."""

    @jax.custom_jvp
    def f(x):
        return _compat.bind(prim, [x], params)

    @f.defjvp
    def f_jvp(primals, tangents):
        (x,), (t,) = primals, tangents
        out = _compat.bind(prim, [x], params)
        return out, tangent(x, out, t)

    return f(x)


def _broadcast_in_dim(prim: Any, invals: Sequence[Any], params: dict) -> Any:
    (x, *dyn) = invals
    if dyn or not is_low(x) or np.size(x) == np.prod(params["shape"]):
        return None

    def tangent(x, out, t):
        wide = _compat.bind(
            prim, [jax.lax.convert_element_type(t, jnp.float32)], params
        )
        return jax.lax.convert_element_type(wide, t.dtype)

    return _unary(prim, x, params, tangent)


def _chooser(prim: Any, invals: Sequence[Any], params: dict) -> Any:
    (x,) = invals
    if not is_low(x):
        return None
    axes = tuple(params["axes"])

    def tangent(x, out, t):
        keep = [1 if i in axes else d for i, d in enumerate(x.shape)]
        chosen = jax.lax.eq(x, jnp.reshape(out, keep))
        indicators = jax.lax.convert_element_type(chosen, x.dtype)
        counts = jnp.sum(jax.lax.convert_element_type(chosen, jnp.float32), axes)
        picked = jax.lax.convert_element_type(jax.lax.mul(t, indicators), jnp.float32)
        t_out = jax.lax.div(jnp.sum(picked, axes), counts)
        return jax.lax.convert_element_type(t_out, t.dtype)

    return _unary(prim, x, params, tangent)


def _wide_product(prim: Any, invals: Sequence[Any], params: dict) -> Any:
    wide = params.get("preferred_element_type")
    lows = [x for x in invals[:2] if is_low(x)]
    if wide is None or len(lows) != 2 or np.dtype(wide).itemsize <= 2:
        return None
    low = np.dtype(lows[0].dtype)
    low_params = {**params, "preferred_element_type": low}
    traced = [i for i, x in enumerate(invals) if not is_literal(x)]

    def with_args(args):
        vals = list(invals)
        for i, a in zip(traced, args):
            vals[i] = a
        return vals

    f = jax.custom_jvp(lambda *args: _compat.bind(prim, with_args(args), params))

    def jvp(primals, tangents):
        vals = with_args(primals)
        out = _compat.bind(prim, vals, params)
        t_out = None
        for i, t in zip(traced, tangents):
            if isinstance(t, SymbolicZero) or not is_float(dtype_of(vals[i])):
                continue
            t_i = _jvp_at(prim, low_params, vals, i, vals[i], t)
            t_i = jax.lax.convert_element_type(t_i, out.dtype)
            t_out = t_i if t_out is None else jax.lax.add(t_out, t_i)
        return out, jnp.zeros_like(out) if t_out is None else t_out

    f.defjvp(jvp, symbolic_zeros=True)
    return f(*(invals[i] for i in traced))


def wide_dot_general(x: Any, y: Any, dimension_numbers: Any) -> Any:
    """A float32 product of low-precision operands whose backward runs low.

    ``lax.dot_general(x, y, dimension_numbers, preferred_element_type=float32)``
    whose tangent (so both backward matmuls) is the product in ``x``'s dtype,
    widened once: the "wide products" of the module docstring, for code that
    builds its own product (the XLA attention path of ``_attention``).

    Args:
        x, y: arrays of one floating dtype narrower than float32 (e.g. bfloat16
            q of shape ``(B, T, K, G, H)`` and k of shape ``(B, S, K, H)``).
        dimension_numbers: as for ``lax.dot_general``.

    Returns:
        The float32 product, as ``lax.dot_general`` returns it.
    """
    f32 = np.dtype(np.float32)
    low = np.dtype(x.dtype)

    @jax.custom_jvp
    def product(x, y):
        return jax.lax.dot_general(x, y, dimension_numbers, preferred_element_type=f32)

    @product.defjvp
    def product_jvp(primals, tangents):
        (x, y), (tx, ty) = primals, tangents
        lo = dict(dimension_numbers=dimension_numbers, preferred_element_type=low)
        t = jax.lax.add(
            jax.lax.dot_general(tx, y, **lo), jax.lax.dot_general(x, ty, **lo)
        )
        return product(x, y), jax.lax.convert_element_type(t, f32)

    return product(x, y)


def bind(
    prim: Any,
    invals: Sequence[Any],
    params: dict,
    bind: Callable[[Any, Sequence[Any], dict], Any] = _compat.bind,
    ctx: Any = None,
) -> Any:
    """Bind ``prim`` so that the sums its derivatives need run in float32 (a
    bind step of the pipeline, ``_walk._loop.BindStep``).

    Args:
        prim: the primitive of an equation.
        invals: its inputs after the policy's casts (arrays, tracers or literals).
        params: its bind parameters (as from ``_compat.bind_params``).
        bind: how to bind an equation that needs no ``custom_jvp``.
        ctx: the equation's ``RuleContext`` (unread: the inputs' dtypes decide).

    Returns:
        ``prim``'s outputs, with the same values and dtypes as ``prim.bind``.
        Elementwise primitives (``add``, ``mul``, ...) with a traced operand
        narrower than float32 that is broadcast, and ``broadcast_in_dim`` of such
        a value, ``reduce_max``/``reduce_min`` of such a value, and matmuls with
        low-precision operands and a wider result are bound through a
        ``custom_jvp`` (module docstring); anything else is bound directly.
    """
    if prim.name in MATMULS:
        out = _wide_product(prim, invals, params)
    elif prim.name in ELEMENTWISE and len(invals) == 2:
        out = _elementwise(prim, invals, params)
    elif prim.name in BROADCASTING:
        out = _broadcast_in_dim(prim, invals, params)
    elif prim.name in CHOOSERS and len(invals) == 1:
        out = _chooser(prim, invals, params)
    else:
        out = None
    return bind(prim, invals, params) if out is None else out
