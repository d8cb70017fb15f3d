"""Measuring mixed precision: matmul FLOPs by dtype, primitive dtypes and the
bytes of residuals saved for the backward pass (DESIGN.md, "Measuring")."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import jax.numpy as jnp
import numpy as np

from . import _compat

LOW_PRECISION = frozenset(
    np.dtype(d).name
    for d in (
        jnp.float16,
        jnp.bfloat16,
        jnp.float8_e4m3fn,
        jnp.float8_e5m2,
        jnp.float8_e4m3fnuz,
        jnp.float8_e5m2fnuz,
    )
)


def _check(closed: Any) -> Any:
    if not _compat.is_jaxpr(closed):
        raise TypeError(
            "expected a jaxpr, e.g. jax.make_jaxpr(jax.grad(loss))(*args); got "
            f"{type(closed).__name__}."
        )
    return closed


def iter_equations(closed: Any, weight: float = 1.0) -> Iterator[tuple[Any, float]]:
    """Every equation of a jaxpr and of all its sub-jaxprs, depth first, with
    how many times it runs per call: scan bodies are weighted by ``length``;
    ``while`` bodies and ``cond`` branches count once (trip counts and branch
    choices are not static).

    Args:
        closed: a ClosedJaxpr or Jaxpr.

    Yields:
        ``(equation, weight)`` pairs.

    Raises:
        TypeError: if ``closed`` is not a jaxpr.
    """
    core, _ = _compat.jaxpr_parts(_check(closed))
    for eqn in core.eqns:
        yield eqn, weight
        inner = (
            weight * eqn.params.get("length", 1)
            if eqn.primitive.name == "scan"
            else weight
        )
        for val in eqn.params.values():
            for sub in val if isinstance(val, (tuple, list)) else (val,):
                if _compat.is_jaxpr(sub):
                    yield from iter_equations(sub, inner)


def _dot_flops(eqn: Any) -> float:
    lhs, rhs = (v.aval for v in eqn.invars[:2])
    (lc, rc), (lb, _) = eqn.params["dimension_numbers"]
    contract = np.prod([lhs.shape[d] for d in lc], dtype=float)
    batch = np.prod([lhs.shape[d] for d in lb], dtype=float)
    m = np.prod(
        [s for d, s in enumerate(lhs.shape) if d not in (*lc, *lb)], dtype=float
    )
    rb = eqn.params["dimension_numbers"][1][1]
    n = np.prod(
        [s for d, s in enumerate(rhs.shape) if d not in (*rc, *rb)], dtype=float
    )
    return 2.0 * batch * m * n * contract


def _conv_flops(eqn: Any) -> float:
    rhs = eqn.invars[1].aval
    out = eqn.outvars[0].aval
    dn = eqn.params["dimension_numbers"]
    # rhs spec: (out feature dim, in feature dim, spatial dims...)
    in_ch = rhs.shape[dn.rhs_spec[1]]
    spatial = np.prod([rhs.shape[d] for d in dn.rhs_spec[2:]], dtype=float)
    return 2.0 * np.prod(out.shape, dtype=float) * in_ch * spatial


_FLOPS: dict[str, Callable[[Any], float]] = {
    "dot_general": _dot_flops,
    "conv_general_dilated": _conv_flops,
}


def matmul_flops_by_dtype(closed: Any) -> dict[str, float]:
    """FLOPs of ``dot_general`` and ``conv_general_dilated`` per operand dtype.

    Args:
        closed: the jaxpr of e.g. ``jax.grad(amp(loss))``; all sub-jaxprs are
            walked (scan bodies weighted by length).

    Returns:
        ``{dtype name: FLOPs}``; a product whose two operands differ is keyed
        ``"lhs_dtype x rhs_dtype"`` (e.g. FP8 ``"float8_e4m3fn x float8_e5m2"``).

    Raises:
        TypeError: if ``closed`` is not a jaxpr.
    """
    out: dict[str, float] = {}
    for eqn, weight in iter_equations(closed):
        count = _FLOPS.get(eqn.primitive.name)
        if count is None:
            continue
        a, b = (np.dtype(v.aval.dtype).name for v in eqn.invars[:2])
        key = a if a == b else f"{a} x {b}"
        out[key] = out.get(key, 0.0) + weight * count(eqn)
    return out


def low_precision_flop_share(closed: Any) -> float:
    """Share of matmul/conv FLOPs whose operands are both 16- or 8-bit floats.

    Returns:
        A float in [0, 1] (0.0 for a jaxpr without matmuls).
    """
    flops = matmul_flops_by_dtype(closed)
    total = sum(flops.values())
    low = sum(
        f for k, f in flops.items() if all(p in LOW_PRECISION for p in k.split(" x "))
    )
    return low / total if total else 0.0


def count_primitive(closed: Any, name: str) -> int:
    """Number of equations of primitive ``name`` over all sub-jaxprs (each
    equation counted once, not weighted by trip count)."""
    return sum(1 for eqn, _ in iter_equations(closed) if eqn.primitive.name == name)


def primitive_dtypes(closed: Any) -> list[tuple[str, tuple, tuple]]:
    """``(primitive name, input dtypes, output dtypes)`` of every equation over
    all sub-jaxprs, depth first."""
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

    Uses ``jax.ad_checkpoint``'s saved-residual analysis; residuals that are
    ``fn``'s own arguments (the parameters and data, the same for every
    precision) are excluded, so the figure is the activation memory that
    mixed precision changes. Hardware independent, unlike the compiler's
    memory analysis (XLA:CPU computes bfloat16 in float32 internally).

    Args:
        fn: a function of arrays returning a scalar.
        *args, **kwargs: its inputs.

    Returns:
        The total bytes, an int.
    """
    total = 0
    for aval, source in _compat.saved_residuals(fn, *args, **kwargs):
        if "from the argument" in source:
            continue
        total += int(np.prod(aval.shape)) * np.dtype(aval.dtype).itemsize
    return total
