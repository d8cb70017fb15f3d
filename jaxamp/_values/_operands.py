"""Which values reach a product's operand with their error undamped, or an
exponential's input.

A weight gradient ``x^T g`` inherits the error of a stored ``x`` as it is.
FP8 residuals (``QFormat.stores_products``) therefore never
store a product's input in FP8, nor a value the product's input is
recomputed from (``_residual_format.product_form``: int8), through an elementwise
chain (a GELU, a residual add), a normalisation (a LayerNorm's
``x - mean(x)`` and scaling read ``x`` itself, whose relative error they
keep) or data movement (a
reshape, a split). This pass finds those values, backwards from the products
(``dot_general``, convolutions), for the saved values at a user's
``jax.checkpoint`` boundary (``_policy/_checkpoint.py``): its inputs and the
values its policy saves, which the recomputed block reads.

The value-facts bit ``REACH`` (``_facts.py``) does not tell it: it passes every
primitive (a softmax's ``exp``, a pooled mean, a sort), so every value before
the last matmul has it. Here a reduction (an error averaged over many values),
an exponential or a choice ends the path, as they do for the residuals stored
outside checkpoints (``_policy/_compressed.py``). Those never store an
exponential's or a choice's input in 8 bits, nor attention's q and k (exp
turns an absolute error of a logit into a relative error of a probability):
the values that reach them are marked too (:data:`EXACT`), for every format.
The logistic is bounded, so a SiLU's or a gate's input is not among them. The
values an elementwise derivative reads (``tanh``'s ``1 - tanh^2``, a product
``x * y``, a norm's ``rsqrt``) are marked :data:`DERIVATIVE`: stored in 8 bits
they carry their error into every gradient below, so a checkpoint
stores them as it stores a product's input.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Mapping
from typing import Any

from .._base._jaxpr import is_var, named_subs
from .._base._prims import (
    CHEAP_ELEMENTWISE,
    CHOOSERS,
    DATA_MOVEMENT,
    EXPONENTIALS,
    MATMULS,
    READS_NO_VALUE,
)
from .._base._structure import SubJaxpr, describe

# Primitives whose output carries their inputs' relative error (no averaging,
# no exponential, no choice): arithmetic, roots and cheap odd functions (the
# elementwise chains stored as their root), the piecewise-linear ones (relu's
# max), casts, data movement, and the checkpoint name marker.
LOOK_THROUGH = (
    CHEAP_ELEMENTWISE
    | DATA_MOVEMENT
    | frozenset(
        """add_any max min clamp select_n reduce_precision dynamic_update_slice
        gather rev split name optimization_barrier""".split()
    )
)

# The exponentials whose output error is relative to their input's absolute
# error (a softmax's probabilities). The logistic is bounded: an absolute error
# ``dz`` of its input moves ``sigmoid(z)`` by at most ``dz / 4``, so a SiLU's or
# a gate's input is only read by its derivative (:data:`DERIVATIVE`).
UNBOUNDED = EXPONENTIALS - {"logistic"}

# Primitives whose derivative reads none of their float operands' values: the
# linear and structural ones of ``_prims.READS_NO_VALUE``, data movement and
# the markers (their operands get no :data:`DERIVATIVE` from them).
READ_BY_NO_DERIVATIVE = (
    READS_NO_VALUE
    | DATA_MOVEMENT
    | frozenset("split gather name optimization_barrier".split())
)


# Bits per value. PRODUCT: it reaches a product's operand; EXPONENT: it reaches
# the input of an exponential or a choice (``exp``, ``logistic``, a sort, a
# max); EXACT: it is one, or an operand of a product whose result is one (a
# softmax's logits q k^T); DERIVATIVE: it reaches an operand of an elementwise
# primitive whose derivative reads that operand's value (``tanh``, ``mul``, a
# GELU's chain, a norm's ``rsqrt``; anything not in
# :data:`READ_BY_NO_DERIVATIVE`),
# whose error the derivative carries into every gradient below it (``1 -
# tanh^2`` of a stored value near 1 is mostly error). Each passes
# :data:`LOOK_THROUGH` primitives; a product gives its operands PRODUCT, and
# EXACT where its result has EXPONENT.
PRODUCT, EXPONENT, EXACT, DERIVATIVE = 1, 2, 4, 8


@dataclasses.dataclass(frozen=True)
class Operands:
    """The pass over one jaxpr.

    Attributes:
        inputs: per input, its bits (:data:`PRODUCT`, :data:`EXPONENT`,
            :data:`EXACT`, :data:`DERIVATIVE`).
        bits: variable -> its bits, for every variable with some.
    """

    inputs: tuple[int, ...]
    bits: Mapping[Any, int]


_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def product_operands(jaxpr: Any, out_bits: tuple[int, ...] | None = None) -> Operands:
    """The bits of every value of the open ``jaxpr`` (module docstring).

    Args:
        jaxpr: an open jaxpr.
        out_bits: per output, the bits of its uses outside (None: none, as for
            a checkpoint's body, whose outputs are not what its saved values
            are read for).

    Returns:
        An :class:`Operands`, cached per (jaxpr, out_bits).
    """
    if out_bits is None or len(out_bits) != len(jaxpr.outvars):
        out_bits = (0,) * len(jaxpr.outvars)
    key = tuple(int(b) for b in out_bits)
    try:
        per = _CACHE.setdefault(jaxpr, {})
    except TypeError:  # not weak-referenceable
        per = {}
    if key not in per:
        per[key] = _backward(jaxpr, key)
    return per[key]


def _backward(jaxpr: Any, out_bits: tuple[int, ...]) -> Operands:
    bits: dict = {}
    for v, b in zip(jaxpr.outvars, out_bits):
        if b and is_var(v):
            bits[v] = bits.get(v, 0) | b
    for eqn in reversed(jaxpr.eqns):
        outs = tuple(bits.get(v, 0) for v in eqn.outvars)
        for v, b in zip(eqn.invars, _eqn_inputs(eqn, outs)):
            if b and is_var(v):
                bits[v] = bits.get(v, 0) | b
    return Operands(tuple(bits.get(v, 0) for v in jaxpr.invars), bits)


def _eqn_inputs(eqn: Any, outs: tuple[int, ...]) -> list[int]:
    """Per input of ``eqn``: its bits, given those of its outputs."""
    n = len(eqn.invars)
    name = eqn.primitive.name
    either = 0
    for b in outs:
        either |= b
    if name in MATMULS:
        return [PRODUCT | (EXACT if either & EXPONENT else 0)] * n
    if name in UNBOUNDED or name in CHOOSERS:
        return [EXPONENT | EXACT] * n
    structure = describe(eqn)
    if structure is not None:
        ins = [0] * n
        for sub in structure.subs:
            for j, b in zip(sub.inputs, _sub_inputs(sub, outs)):
                ins[j] |= b
        return ins
    if named_subs(eqn.params):  # an opaque higher-order primitive
        return [PRODUCT | EXACT] * n
    passed = either if name in LOOK_THROUGH else 0
    return [passed | (0 if name in READ_BY_NO_DERIVATIVE else DERIVATIVE)] * n


def _sub_inputs(sub: SubJaxpr, outs: tuple[int, ...]) -> tuple[int, ...]:
    """Bits per input of ``sub``, given the equation's output bits; a
    carried output also has the bits of the input it feeds (a fixpoint)."""
    start = tuple(0 if k is None else outs[k] for k in sub.outputs)
    bits = start
    for _ in range(4):
        found = product_operands(sub.core, bits)
        new = list(start)
        for o, i in sub.carries:
            new[o] |= found.inputs[i]
        if tuple(new) == bits:
            break
        bits = tuple(new)
    return found.inputs
