"""Local jaxpr patterns the facts pass recognises, one equation at a time.

Each recogniser looks at one equation and, through ``producer`` (variable ->
the equation that computed it), at the few equations before it: a value times
itself (:func:`quadratic`), a value minus its own mean (:func:`centring`), a
value scaled by the inverse root of its own mean square (:func:`rms_operands`);
and, for a LayerNorm's normalisation, the equations that compute it from its
input (:class:`CentredRegions`). They are pure functions of the jaxpr;
``_facts.py`` turns their answers into per-equation facts.
"""

from __future__ import annotations

import collections
import functools
from typing import Any

from .._base._jaxpr import is_var, named_subs
from .._base._structure import describe

# Ops that keep a value's magnitude (seen through when asking "x times itself?").
_SAME_MAGNITUDE = frozenset(
    {
        "convert_element_type",
        "neg",
        "abs",
        "copy",
        "copy_p",
        "reduce_precision",
        "real",
        "transpose",
        "pvary",  # shard_map's device-varying marker (JAX >= 0.7)
    }
)


def root(v: Any, producer: dict) -> Any:
    """``v`` seen through casts, negation and abs (ops that keep |v|)."""
    for _ in range(16):
        eqn = producer.get(v) if is_var(v) else None
        if eqn is None or eqn.primitive.name not in _SAME_MAGNITUDE:
            return v
        v = eqn.invars[0]
    return v


def quadratic(eqn: Any, producer: dict) -> bool:
    """``eqn`` squares a value: ``square``, ``pow``, ``integer_pow`` with an
    exponent other than 0 or 1, or a ``mul`` / ``dot_general`` of a value with
    itself (seen through casts, negation and abs). Its output can leave
    float16's range from in-range inputs."""
    name = eqn.primitive.name
    if name in ("square", "pow"):
        return True
    if name == "integer_pow":
        return eqn.params.get("y") not in (0, 1)
    if name in ("mul", "dot_general") and len(eqn.invars) == 2:
        a, b = eqn.invars
        return is_var(a) and is_var(b) and root(a, producer) is root(b, producer)
    return False


# Steps from a reduce_sum to the mean that is subtracted: broadcasts, reshapes,
# casts and the division (or multiplication) by the count.
# Sums over devices: a statistic reduced with psum (shard_map, vmap / pmap with
# an axis_name) is what it would be locally, over the global batch / features.
COLLECTIVE_SUMS = frozenset({"psum", "psum_invariant", "reduce_scatter"})

_MEAN_STEPS = frozenset(
    {
        "broadcast_in_dim",
        "reshape",
        "squeeze",
        "expand_dims",
        "convert_element_type",
        "div",
        "mul",
    }
)
# Data movement between several statistics reduced together: Flax's BatchNorm
# reduces (mean, mean of squares) in one ``pmean``, which batches to a stack,
# one psum and slices of its result.
_PACKING = frozenset(
    {
        "stack",
        "concatenate",
        "slice",
        "dynamic_slice",
        "transpose",
        "squeeze",
        "all_gather",  # per-device statistics gathered, then summed
        "pvary",
    }
)


def centring(eqn: Any, producer: dict) -> bool:
    """``sub(x, m)`` where ``m`` is a mean of ``x`` (both seen through casts).

    The walk from ``m`` back to its ``reduce_sum`` passes the mean's steps
    (:data:`_MEAN_STEPS`), collective sums, sums of partial sums and the
    packing of several statistics reduced together or gathered from devices
    (:data:`_PACKING`). Through a packing it follows every operand (at most 16
    steps in all), so ``m`` qualifies if any statistic packed with it is a
    mean of ``x``: a false positive keeps the subtraction in float32, never
    less precise.
    """
    if eqn.primitive.name != "sub" or len(eqn.invars) != 2:
        return False
    x, m = eqn.invars
    if not (is_var(x) and is_var(m)):
        return False
    x_root = root(x, producer)
    stack, steps = [m], 0
    while stack and steps < 16:
        v = stack.pop()
        steps += 1
        step = producer.get(v) if is_var(v) else None
        if step is None:
            continue
        name = step.primitive.name
        if name == "reduce_sum":
            a = step.invars[0]
            if is_var(a) and root(a, producer) is x_root:
                return True
            if is_var(a):  # a sum of partial sums (gathered from devices)
                stack.append(a)
        elif name in COLLECTIVE_SUMS:  # one operand per output
            stack.append(step.invars[[id(o) for o in step.outvars].index(id(v))])
        elif name in _PACKING:
            stack.extend(u for u in step.invars if is_var(u))
        elif name in _MEAN_STEPS:
            operands = [u for u in step.invars if not _is_constant(u, producer)]
            if len(operands) == 1:  # a mean divides by a constant count
                stack.append(operands[0])
    return False


# Steps from a sum of squares to the factor that scales the value: the mean's
# count, the epsilon, a clamp, broadcasts, casts and a gain folded into the
# factor (Flax's RMSNorm multiplies rsqrt(ms) by its scale first).
_NORM_STEPS = _MEAN_STEPS | COLLECTIVE_SUMS | frozenset({"add", "max", "sub"})
_INVERSE_ROOTS = {"mul": "rsqrt", "div": "sqrt"}


def rms_operands(eqn: Any, producer: dict) -> tuple | None:
    """For ``x * rsqrt(f(sum(x * x)))`` or ``x / sqrt(f(sum(x * x)))`` (``x``
    seen through casts, negation, abs and a constant shift; ``f`` through
    :data:`_NORM_STEPS`), the equations computing ``x * x`` and the shift (if
    any); else None."""
    name = eqn.primitive.name
    if name not in _INVERSE_ROOTS or len(eqn.invars) != 2:
        return None
    a, b = eqn.invars
    if not (is_var(a) and is_var(b)):
        return None
    pairs = [(a, b), (b, a)] if name == "mul" else [(a, b)]
    for x, factor in pairs:
        unshifted = _unshifted(x, producer)
        x_root = root(unshifted, producer)
        square = _own_square(factor, x_root, _INVERSE_ROOTS[name], producer)
        if square is not None:
            return (square,) if unshifted is x else (square, producer[x])
    return None


def _own_square(v: Any, x_root: Any, inverse: str, producer: dict) -> Any:
    """The equation squaring ``x`` if ``v`` is ``inverse`` (``rsqrt`` /
    ``sqrt``) of a statistic derived from ``sum(x * x)`` (depth-first, at most
    12 steps), else None."""
    stack = [(v, False, 0)]
    while stack:
        v, rooted, depth = stack.pop()
        step = producer.get(v) if is_var(v) else None
        if step is None or depth > 12:
            continue
        name = step.primitive.name
        if name == "reduce_sum":
            sq = producer.get(step.invars[0]) if is_var(step.invars[0]) else None
            if (
                rooted
                and sq is not None
                and quadratic(sq, producer)
                and is_var(sq.invars[0])
                and root(sq.invars[0], producer) is x_root
            ):
                return sq
            continue
        if name == inverse and not rooted:
            stack.append((step.invars[0], True, depth + 1))
        elif name in _NORM_STEPS:
            stack.extend((u, rooted, depth + 1) for u in step.invars if is_var(u))
    return None


def _unshifted(v: Any, producer: dict) -> Any:
    """``v`` without a constant shift: Flax's RMSNorm subtracts a broadcast
    zero (its mean, for LayerNorm) before scaling."""
    eqn = producer.get(v)
    if eqn is None or eqn.primitive.name not in ("sub", "add"):
        return v
    x, c = eqn.invars
    return x if is_var(x) and _is_constant(c, producer) else v


def _is_constant(v: Any, producer: dict) -> bool:
    """A literal, or a broadcast / reshape / cast of literals only."""
    for _ in range(8):
        if not is_var(v):
            return True
        eqn = producer.get(v)
        if eqn is None or eqn.primitive.name not in (
            "broadcast_in_dim",
            "reshape",
            "convert_element_type",
            "pvary",
        ):
            return False
        v = eqn.invars[0]
    return False


def _plain_call(eqn: Any) -> bool:
    """A call a centred region may hold (Equinox's ``jnp.var`` is a ``jit``):
    not a user's checkpoint, loop or custom rule."""
    s = describe(eqn)
    return s is not None and s.call and s.dtypes_flow and not s.recomputed


def centred_region(
    eqns: Any, k: int, x: Any, readers: dict, returned: set
) -> tuple[int, ...]:
    """The equations computing normalisation ``eqns[k]`` from ``x``.

    ``eqns[k]`` multiplies or divides a centred value ``x - mean(x)`` (its
    first operand ``c``) by a factor (its other operand). The region is every
    equation that descends from ``x`` and is an ancestor of ``k`` (the means,
    the centrings, the variance, its root), plus ``k``. It is kept only where
    recomputing it from ``x`` replaces float32 residuals: the factor itself
    descends from ``x`` (so ``k``'s backward pass would save the float32
    centred value), no value it computes but ``k``'s is read outside it or
    returned, and it holds no equation with several results or with
    sub-jaxprs other than a plain call.

    Args:
        eqns: the jaxpr's equations.
        k: index of the normalisation (``mul``/``div``).
        x: the centring's input variable (the normalised activations).
        readers: variable -> indices of the equations reading it.
        returned: the jaxpr's output variables.

    Returns:
        The region's indices, ascending with ``k`` last; ``()`` if none.
    """
    start = next((j + 1 for j in range(k - 1, -1, -1) if x in eqns[j].outvars), 0)
    desc = {x}
    below: set[int] = set()
    for j in range(start, k + 1):
        if any(is_var(v) and v in desc for v in eqns[j].invars):
            below.add(j)
            desc.update(eqns[j].outvars)
    if k not in below or not all(is_var(v) and v in desc for v in eqns[k].invars):
        return ()  # the factor does not come from x: nothing saved by recomputing
    need = {v for v in eqns[k].invars if is_var(v)}
    region = {k}
    for j in range(k - 1, start - 1, -1):
        if j in below and any(v in need for v in eqns[j].outvars):
            region.add(j)
            need.update(v for v in eqns[j].invars if is_var(v))
    for j in region - {k}:
        e = eqns[j]
        nested = e.primitive.multiple_results or named_subs(e.params)
        if nested and not _plain_call(e):
            return ()
        if any(v in returned or not readers.get(v, set()) <= region for v in e.outvars):
            return ()
    return tuple(sorted(region))


class CentredRegions:
    """The readers and producers of one jaxpr's values, to find the region
    of each LayerNorm normalisation (:func:`centred_region`)."""

    def __init__(self, jaxpr: Any):
        self.jaxpr = jaxpr
        self.eqns = jaxpr.eqns

    @functools.cached_property
    def producer(self) -> dict:
        """Variable -> the equation computing it."""
        return {v: e for e in self.eqns for v in e.outvars}

    @functools.cached_property
    def readers(self) -> dict:
        """Variable -> indices of the equations reading it."""
        out: dict = collections.defaultdict(set)
        for j, e in enumerate(self.eqns):
            for v in e.invars:
                if is_var(v):
                    out[v].add(j)
        return out

    @functools.cached_property
    def returned(self) -> set:
        """The jaxpr's output variables."""
        return {v for v in self.jaxpr.outvars if is_var(v)}

    def find(self, k: int, x: Any) -> tuple[Any, tuple[int, ...]]:
        """``(input, region)`` of normalisation ``k`` of centred ``x``: from
        ``x`` seen through casts first (the region then recomputes the cast
        too), else from ``x`` itself; ``(None, ())`` if neither qualifies."""
        for start in dict.fromkeys((root(x, self.producer), x)):
            region = centred_region(self.eqns, k, start, self.readers, self.returned)
            if region:
                return start, region
        return None, ()
