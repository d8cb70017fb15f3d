"""Measuring mixed precision: matmul FLOPs by dtype, primitive dtypes and the
bytes of residuals saved for the backward pass (``docs/design.md``, "Measuring").

Every helper walks a jaxpr and all its sub-jaxprs: any equation parameter that
is a ``Jaxpr``/``ClosedJaxpr`` or a tuple/list of them (``jit``'s ``jaxpr``,
``scan``'s and ``remat2``'s ``jaxpr``, ``while``'s ``cond_jaxpr``/``body_jaxpr``,
``cond``'s ``branches``, ``custom_jvp_call``/``custom_vjp_call``'s
``call_jaxpr``, ``shard_map``'s ``jaxpr``, and whatever JAX adds later).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .. import _compat
from .._base._dtypes import is_float
from .._base._jaxpr import check_jaxpr as _check
from .._base._jaxpr import iter_equations as iter_equations
from .._base._structure import describe, trips


def _low_precision(name: str) -> bool:
    """A float dtype of 16 bits or fewer: float16, bfloat16, every float8
    type (registered 8-bit formats included)."""
    dtype = np.dtype(name)
    return is_float(dtype) and dtype.itemsize <= 2


def _prod(xs: Any) -> float:
    return float(np.prod(list(xs), dtype=float))


def _dot_flops(eqn: Any) -> float:
    # 2 * batch * M * N * K: one multiply and one add per term.
    lhs, rhs = (v.aval for v in eqn.invars[:2])
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    contract = _prod(lhs.shape[d] for d in lc)
    batch = _prod(lhs.shape[d] for d in lb)
    m = _prod(s for d, s in enumerate(lhs.shape) if d not in (*lc, *lb))
    n = _prod(s for d, s in enumerate(rhs.shape) if d not in (*rc, *rb))
    return 2.0 * batch * m * n * contract


def _ragged_dot_flops(eqn: Any) -> float:
    # Whichever lhs dimension is ragged (free, contracting or batch), every lhs
    # element meets each free rhs column once; the rhs group dimension selects
    # which matrix, it does not multiply the work.
    lhs, rhs = (v.aval for v in eqn.invars[:2])
    rdn = eqn.params["ragged_dot_dimension_numbers"]
    (_, rc), (_, rb) = rdn.dot_dimension_numbers
    skip = (*rc, *rb, *rdn.rhs_group_dimensions)
    n = _prod(s for d, s in enumerate(rhs.shape) if d not in skip)
    return 2.0 * _prod(lhs.shape) * n


def _conv_flops(eqn: Any) -> float:
    # 2 * output elements * kernel window * input channels per group. The
    # kernel's input-feature dimension already is in_channels /
    # feature_group_count (and batch_group_count only splits the batch).
    rhs = eqn.invars[1].aval
    out = eqn.outvars[0].aval
    dn = eqn.params["dimension_numbers"]
    # rhs_spec: (out feature dim, in feature dim, spatial dims...)
    in_ch = rhs.shape[dn.rhs_spec[1]]
    window = _prod(rhs.shape[d] for d in dn.rhs_spec[2:])
    return 2.0 * _prod(out.shape) * in_ch * window


_FLOPS: dict[str, Callable[[Any], float]] = {
    "dot_general": _dot_flops,
    "ragged_dot_general": _ragged_dot_flops,
    "conv_general_dilated": _conv_flops,
}


def _operand_key(eqn: Any) -> str:
    a, b = (np.dtype(v.aval.dtype).name for v in eqn.invars[:2])
    return a if a == b else f"{a} x {b}"


def _add(out: dict[str, float], more: dict[str, float], weight: float) -> None:
    for key, flops in more.items():
        out[key] = out.get(key, 0.0) + weight * flops


def _shards(eqn: Any) -> float:
    # A shard_map body sees per-shard shapes and runs once per shard.
    structure = describe(eqn)
    return 1.0 if structure is None else structure.copies


def _flops(closed: Any) -> dict[str, float]:
    core, _ = _compat.jaxpr_parts(_check(closed))
    out: dict[str, float] = {}
    for eqn in core.eqns:
        count = _FLOPS.get(eqn.primitive.name)
        if count is not None:
            _add(out, {_operand_key(eqn): count(eqn)}, 1.0)
        elif (structure := describe(eqn)) is not None and structure.exclusive:
            # One branch runs: count the costliest (ties: the first).
            per_branch = [_flops(b.jaxpr) for b in structure.subs]
            if per_branch:
                _add(out, max(per_branch, key=lambda f: sum(f.values())), 1.0)
        else:
            inner = trips(eqn) * _shards(eqn)
            for sub in _compat.sub_jaxprs(eqn.params):
                _add(out, _flops(sub), inner)
    return out


def matmul_flops_by_dtype(closed: Any) -> dict[str, float]:
    """FLOPs of the matrix products of a jaxpr, per operand dtype.

    Counts ``dot_general`` (``2 * batch * M * N * K``), ``ragged_dot_general``
    (``2 * lhs elements * N``) and ``conv_general_dilated`` (``2 * output
    elements * kernel window * input channels per feature group``) in the jaxpr
    and all its sub-jaxprs: ``scan`` bodies weighted by ``length``; ``while``
    bodies counted once (the trip count is not static: a lower bound for loops
    that run more than once); of a ``cond``'s branches only the one with the
    most FLOPs (one branch runs per call: an upper bound); ``shard_map``
    bodies times the number of shards, so that the count is global like that
    of the jaxpr around them.

    Args:
        closed: a ``ClosedJaxpr`` or ``Jaxpr``, e.g.
            ``jax.make_jaxpr(jax.grad(amp(loss)))(params, batch)``.

    Returns:
        ``{dtype name: FLOPs}``, e.g. ``{"bfloat16": 1.2e9}``. A product whose
        two operands have different dtypes is keyed ``"lhs_dtype x rhs_dtype"``
        (e.g. ``"float8_e4m3fn x float8_e5m2"`` for an FP8 gradient matmul).
        Empty for a jaxpr without matrix products.

    Raises:
        TypeError: if ``closed`` is not a jaxpr.
    """
    return _flops(closed)


def low_precision_flop_share(closed: Any) -> float:
    """Share of matrix-product FLOPs whose two operands are 16- or 8-bit floats.

    Args:
        closed: a ``ClosedJaxpr`` or ``Jaxpr`` (walked as in
            :func:`matmul_flops_by_dtype`).

    Returns:
        A float in [0, 1]: low-precision FLOPs (float16, bfloat16, float8
        types; a mixed ``"float32 x bfloat16"`` product is not) over all
        matrix-product FLOPs; 0.0 for a jaxpr without matrix products.

    Raises:
        TypeError: if ``closed`` is not a jaxpr.
    """
    flops = matmul_flops_by_dtype(closed)
    total = sum(flops.values())
    low = sum(f for k, f in flops.items() if all(map(_low_precision, k.split(" x "))))
    return low / total if total else 0.0


def count_primitive(closed: Any, name: str) -> int:
    """Number of equations of one primitive in a jaxpr and all its sub-jaxprs.

    Each equation counts once, however often it runs (not weighted by ``scan``
    length): this counts code, e.g. the ``convert_element_type`` casts a
    transform added.

    Args:
        closed: a ``ClosedJaxpr`` or ``Jaxpr``.
        name: a primitive name, e.g. ``"convert_element_type"``.

    Returns:
        The count, an int.

    Raises:
        TypeError: if ``closed`` is not a jaxpr.
    """
    return sum(1 for eqn, _ in iter_equations(closed) if eqn.primitive.name == name)


def primitive_dtypes(closed: Any) -> list[tuple[str, tuple, tuple]]:
    """The dtypes every equation of a jaxpr and its sub-jaxprs runs in.

    Args:
        closed: a ``ClosedJaxpr`` or ``Jaxpr``.

    Returns:
        ``[(primitive name, input dtypes, output dtypes)]``, one entry per
        equation, depth first (as :func:`iter_equations`); dtypes are
        ``numpy.dtype`` objects, literals included.

    Raises:
        TypeError: if ``closed`` is not a jaxpr.
    """
    return [
        (
            eqn.primitive.name,
            tuple(v.aval.dtype for v in eqn.invars),
            tuple(v.aval.dtype for v in eqn.outvars),
        )
        for eqn, _ in iter_equations(closed)
    ]


def saved_residual_bytes(fn: Callable, *args: Any, **kwargs: Any) -> int:
    """Bytes of the activations ``jax.grad`` saves for the backward pass of ``fn``.

    Uses ``jax.ad_checkpoint``'s saved-residual analysis (the one behind
    ``jax.ad_checkpoint.print_saved_residuals``). Residuals that are ``fn``'s
    own arguments are excluded: the parameters and the batch are alive during
    the step anyway, whatever the precision, whereas a copy made inside ``fn``
    (e.g. a bfloat16 copy of a float32 weight that the backward matmul
    needs) is extra memory and counts. Constants and literals saved as
    residuals count. Each saved array counts once, however many backward
    equations read it. Hardware independent, unlike the compiler's memory
    analysis (XLA:CPU computes bfloat16 in float32 internally).

    Args:
        fn: a function of arrays returning a scalar (what ``jax.grad`` takes).
        *args: its positional inputs.
        **kwargs: its keyword inputs.

    Returns:
        The total bytes of the saved residuals, an int.

    Raises:
        TypeError: if ``fn`` is not callable.
    """
    if not callable(fn):
        raise TypeError(
            f"saved_residual_bytes(fn, *args): fn must be callable (the loss), "
            f"got {type(fn).__name__}."
        )
    total = 0
    for aval, source in _compat.saved_residuals(fn, *args, **kwargs):
        if source.startswith("from the argument"):
            continue
        total += int(np.prod(aval.shape)) * np.dtype(aval.dtype).itemsize
    return total
