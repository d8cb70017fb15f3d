"""``find_overflows``: name the equations whose float16 output overflowed.

It evaluates ``amp(fn)`` equation by equation (inside ``jit``, ``scan``,
``while``, ``cond``, ``remat`` and custom derivatives) and names every equation
whose low-precision output became non-finite from finite inputs: the
primitive, the user's source line, the dtype and the largest input magnitude.
A debugging tool: it runs eagerly, one primitive at a time. The check that
makes such an overflow visible inside a compiled step is ``_overflow.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import equinox as eqx
import jax
import numpy as np

from .. import _compat
from .._amp import amp
from .._base import _jaxpr, _structure
from .._base._dtypes import dtype_of, is_float, is_low_dtype
from .._policy._rules import default_amp_policy


class Overflow(NamedTuple):
    """One equation whose low-precision output overflowed (:func:`find_overflows`).

    Attributes:
        primitive: the primitive's name, e.g. ``"square"``.
        source: the user's source line, ``"file.py:LINE:COL (function)"``.
        dtype: the output dtype that overflowed (a numpy dtype).
        max_input: the largest finite input magnitude seen (float).
        count: how many times the equation overflowed (scan / loop iterations).
        equation: the equation as JAX prints it.
    """

    primitive: str
    source: str
    dtype: np.dtype
    max_input: float
    count: int
    equation: str


def find_overflows(
    fn: Callable,
    *args: Any,
    compute_dtype: Any = None,
    amp_policy: Mapping[Any, Any] | None = None,
    **kwargs: Any,
) -> list[Overflow]:
    """Run ``fn`` under amp and list the equations whose low-precision output
    became non-finite while their inputs were finite.

    Every equation of ``jax.make_jaxpr(amp(fn))`` is evaluated one at a time,
    ``jit``/``remat``/``custom_jvp``/``custom_vjp`` bodies inline, ``scan``,
    ``while`` and ``cond`` by Python control flow (as the description
    registered with :func:`jaxamp.extend.register_higher_order` runs each), so an
    overflow inside a scanned, checkpointed layer is found at the line that
    wrote it. Only the
    first overflow of a chain is reported (its consumers see non-finite inputs).

    Args:
        fn: the function (as passed to :func:`jaxamp.amp`); array leaves of
            ``args``/``kwargs`` are traced, other leaves are static.
        *args: its positional arguments (any pytrees).
        compute_dtype: the amp compute dtype; None: amp's default
            (:func:`jaxamp.amp`: the enclosing
            :func:`jaxamp.migration.haliax.mixed_precision`
            block's compute dtype, else float16).
        amp_policy: the amp policy (default :data:`jaxamp.default_amp_policy`).
        **kwargs: its keyword arguments.

    Returns:
        A list of :class:`Overflow`, in the order the equations first
        overflowed; empty if nothing overflowed.

    Raises:
        TypeError: if ``fn`` is not callable.

    Example:
        >>> import jax.numpy as jnp, jaxamp
        >>> f = lambda w, x: jnp.square(x @ w).sum()
        >>> policy = {**jaxamp.default_amp_policy,
        ...           "square": jaxamp.use_compute_precision}
        >>> [o.primitive for o in jaxamp.find_overflows(
        ...     f, jnp.full((2, 2), 300.0), jnp.ones((1, 2)), amp_policy=policy)]
        ['square']
    """
    if not callable(fn):
        raise TypeError(f"find_overflows(fn): fn must be callable, got {type(fn)}.")
    policy = default_amp_policy if amp_policy is None else amp_policy
    amp_fn = amp(
        fn, compute_dtype=compute_dtype, amp_policy=policy, overflow_check=False
    )
    dynamic, static = eqx.partition((args, kwargs), eqx.is_array)
    leaves, treedef = jax.tree_util.tree_flatten(dynamic)

    def flat(*xs):
        a, kw = eqx.combine(jax.tree_util.tree_unflatten(treedef, xs), static)
        return jax.tree_util.tree_leaves(eqx.filter(amp_fn(*a, **kw), eqx.is_array))

    closed = jax.make_jaxpr(flat)(*leaves)
    core, consts = _compat.jaxpr_parts(closed)
    found: dict[int, list] = {}
    _eval(core, consts, leaves, found)
    return [
        Overflow(e.primitive.name, _compat.source_line(e), dt, mx, n, str(e))
        for e, dt, mx, n in found.values()
    ]


def _eval(core: Any, consts: list, args: list, found: dict) -> list:
    return _jaxpr.evaluate(
        core, consts, args, lambda eqn, invals: _eval_eqn(eqn, invals, found)
    )


def _eval_eqn(eqn: Any, invals: list, found: dict) -> list:
    def eval_sub(jaxpr: Any, args: list) -> list:
        return _eval(*_compat.jaxpr_parts(jaxpr), args, found)

    # A higher-order primitive runs through its registered description
    # (_base/_structure.py): loops by Python control flow, calls inline.
    outs = _structure.run_concretely(eqn, invals, eval_sub)
    if outs is not None:
        return outs
    outs = _jaxpr.bind_eqn(eqn, invals)
    _record(eqn, invals, outs, found)
    return outs


def _finite(x: Any) -> bool:
    return bool(np.all(np.isfinite(np.asarray(x, np.float64))))


def _record(eqn: Any, invals: list, outs: list, found: dict) -> None:
    low = [o for o in outs if is_low_dtype(getattr(o, "dtype", None))]
    if not low or all(_finite(o) for o in low):
        return
    floats = [x for x in invals if is_float(dtype_of(x))]
    if not all(_finite(x) for x in floats):
        return
    mx = max(
        (
            float(np.max(np.abs(np.asarray(x, np.float64))))
            for x in floats
            if np.size(x)
        ),
        default=0.0,
    )
    key = id(eqn)
    if key in found:
        entry = found[key]
        entry[2] = max(entry[2], mx)
        entry[3] += 1
    else:
        dtype = next(np.dtype(o.dtype) for o in low if not _finite(o))
        found[key] = [eqn, dtype, mx, 1]
