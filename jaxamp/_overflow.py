"""Forward overflows: found, located and never silent.

A float16 value that overflows can vanish without a trace: ``rsqrt(inf) = 0``,
``tanh(inf) = 1``, ``exp(-inf) = 0`` absorb it, no inf or NaN reaches the loss or
the gradients, and dynamic loss scaling (which only sees the gradients) cannot
react. Two tools close that hole:

* :func:`find_overflows` evaluates ``amp(fn)`` equation by equation (inside
  ``jit``, ``scan``, ``while``, ``cond``, ``remat`` and custom derivatives) and
  names every equation whose low-precision output became non-finite from finite
  inputs: the primitive, the user's source line, the dtype and the largest input
  magnitude. A debugging tool: it runs eagerly, one primitive at a time.
* ``amp(fn, overflow_check=True)`` (the default for float16) makes such an
  overflow visible inside the compiled step: where a range-risky equation (a
  sum, product, quotient, power, matmul or narrowing cast) turns finite inputs
  into a non-finite float16 value, the value is multiplied by NaN. The NaN then
  reaches the loss and, through the backward pass, the gradients, so the step's
  loss is NaN and the dynamic loss scaler and ``skip_nonfinite_updates`` skip
  and count the step, as PyTorch's ``GradScaler`` does for an overflow that
  propagates on its own. Values that were already non-finite (a ``-inf``
  attention mask) are left alone.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from . import _compat
from ._dtypes import dtype_of, is_float

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
CHECK_SCOPE = "jaxamp_overflow_check"

_CHECK: contextvars.ContextVar[dict | None] = contextvars.ContextVar(
    "jaxamp_overflow_check", default=None
)


def limited_range(dtype: Any) -> bool:
    """A float dtype whose largest value is below float32's (float16, FP8)."""
    return is_float(dtype) and float(jnp.finfo(dtype).max) < 1e38


@contextlib.contextmanager
def checking(enabled: bool = True):
    """Poison forward overflows in the equations bound inside (or, with
    ``enabled=False``, switch an enclosing check off)."""
    token = _CHECK.set({} if enabled else None)
    try:
        yield
    finally:
        _CHECK.reset(token)


@contextlib.contextmanager
def fresh_flags():
    """A fresh cache of non-finite flags for a new trace (a flag traced in one
    jaxpr must never be served to another: it would leak a tracer)."""
    if _CHECK.get() is None:
        yield
        return
    with checking(True):
        yield


def _nonfinite(x: Any) -> Any:
    """Scalar bool: ``x`` has a non-finite element (cached per value)."""
    cache = _CHECK.get()
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
    if _CHECK.get() is None or prim_name not in RISKY:
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
        cache = _CHECK.get()
        cache[id(outs[i])] = (outs[i], jnp.logical_or(fresh, _nonfinite(o)))
    return outs if isinstance(outputs, (list, tuple)) else outs[0]


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
    compute_dtype: Any = jnp.float16,
    amp_policy: Mapping[Any, Any] | None = None,
    **kwargs: Any,
) -> list[Overflow]:
    """Run ``fn`` under amp and list the equations whose low-precision output
    became non-finite while their inputs were finite.

    Every equation of ``jax.make_jaxpr(amp(fn))`` is evaluated one at a time,
    ``jit``/``remat``/``custom_jvp``/``custom_vjp`` bodies inline, ``scan``,
    ``while`` and ``cond`` by Python control flow, so an overflow inside a
    scanned, checkpointed layer is found at the line that wrote it. Only the
    first overflow of a chain is reported (its consumers see non-finite inputs).

    Args:
        fn: the function (as passed to :func:`jaxamp.amp`); array leaves of
            ``args``/``kwargs`` are traced, other leaves are static.
        *args: its positional arguments (any pytrees).
        compute_dtype: the amp compute dtype (default float16).
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
    from ._amp import amp
    from ._rules import default_amp_policy

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


_CALLS = ("jit", "pjit", "closed_call", "core_call", "remat2", "checkpoint")


def _eval(core: Any, consts: list, args: list, found: dict) -> list:
    env: dict[Any, Any] = {}

    def read(v):
        return v.val if isinstance(v, _compat.Literal) else env[v]

    env.update(zip(core.constvars, consts))
    env.update(zip(core.invars, args))
    for eqn in core.eqns:
        invals = [read(v) for v in eqn.invars]
        outs = _eval_eqn(eqn, invals, found)
        env.update(zip(eqn.outvars, outs))
    return [read(v) for v in core.outvars]


def _sub(params: dict, name: str) -> tuple[Any, list]:
    return _compat.jaxpr_parts(params[name])


def _eval_eqn(eqn: Any, invals: list, found: dict) -> list:
    name = eqn.primitive.name
    params = eqn.params
    if name in _CALLS or name in ("custom_jvp_call", "custom_vjp_call"):
        key = "call_jaxpr" if "call_jaxpr" in params else "jaxpr"
        core, consts = _sub(params, key)
        return _eval(core, consts, invals, found)
    if name == "scan":
        return _scan(eqn, invals, found)
    if name == "while":
        cn, bn = params["cond_nconsts"], params["body_nconsts"]
        cc, ccon = _sub(params, "cond_jaxpr")
        bc, bcon = _sub(params, "body_jaxpr")
        carry = invals[cn + bn :]
        while bool(_eval(cc, ccon, invals[:cn] + carry, found)[0]):
            carry = _eval(bc, bcon, invals[cn : cn + bn] + carry, found)
        return carry
    if name == "cond":
        branches = params["branches"]
        i = int(np.clip(int(invals[0]), 0, len(branches) - 1))
        core, consts = _compat.jaxpr_parts(branches[i])
        return _eval(core, consts, invals[1:], found)
    bparams = _compat.bind_params(eqn.primitive, params)
    with _compat.eqn_context(eqn):
        out = _compat.bind(eqn.primitive, invals, bparams)
    outs = list(out) if eqn.primitive.multiple_results else [out]
    _record(eqn, invals, outs, found)
    return outs


def _scan(eqn: Any, invals: list, found: dict) -> list:
    n_consts, n_carry = _compat.scan_carry_range(eqn.params)
    core, consts = _sub(eqn.params, "jaxpr")
    length, reverse = eqn.params["length"], eqn.params["reverse"]
    c, carry = invals[:n_consts], invals[n_consts : n_consts + n_carry]
    xs = invals[n_consts + n_carry :]
    ys = []
    for t in range(length - 1, -1, -1) if reverse else range(length):
        outs = _eval(core, consts, c + carry + [x[t] for x in xs], found)
        carry, y = outs[:n_carry], outs[n_carry:]
        ys.append(y)
    if reverse:
        ys.reverse()
    n_ys = len(eqn.outvars) - n_carry
    stacked = [jnp.stack([y[k] for y in ys]) for k in range(n_ys)] if ys else []
    if not ys:  # zero-length scan: empty stacks of the declared avals
        stacked = [jnp.zeros(v.aval.shape, v.aval.dtype) for v in eqn.outvars[n_carry:]]
    return carry + stacked


def _finite(x: Any) -> bool:
    return bool(np.all(np.isfinite(np.asarray(x, np.float64))))


def _record(eqn: Any, invals: list, outs: list, found: dict) -> None:
    low = [o for o in outs if _low_float(o)]
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


def _low_float(x: Any) -> bool:
    """A float narrower than float32 (bfloat16, float16, FP8)."""
    dt = getattr(x, "dtype", None)
    return dt is not None and is_float(dt) and np.dtype(dt).itemsize < 4
