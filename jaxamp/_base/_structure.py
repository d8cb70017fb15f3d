"""Higher-order primitives as every pass reads them: one description each.

A higher-order equation (a call, a loop, a conditional, a ``shard_map``) holds
sub-jaxprs. What the passes need to know about it is written once, in a
:class:`HigherOrder` entry registered beside the primitive's rewrite rule
(``jaxamp._walk._higher_order.register_higher_order``): for one equation, its
:class:`Structure` (which operands feed which sub-jaxpr inputs, which outputs
come from which sub-jaxpr outputs, the loop-carried pairs, the static trip
count, whether one sub-jaxpr runs out of several, how many copies run) and how
to evaluate it concretely. The value-facts pass, the scan-input hoist,
``find_overflows``, the FLOP counter and the quantization report read it here,
below the walk, and name no primitive. Like JAX, which registers a primitive's
jvp, batching and lowering rules beside the primitive itself
(``jax/_src/lax/control_flow/loops.py``).

A primitive without an entry is opaque to those passes: its operands are
taken to reach a matmul, it is evaluated by binding it, and its sub-jaxprs are
counted once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from .. import _compat


@dataclasses.dataclass(frozen=True)
class SubJaxpr:
    """One sub-jaxpr of a higher-order equation and how values cross it.

    Attributes:
        jaxpr: the equation's parameter value (a ``Jaxpr`` or ``ClosedJaxpr``).
        inputs: per sub-jaxpr input, the index of the equation operand it
            receives (each iteration, for a loop).
        outputs: per sub-jaxpr output, the index of the equation output it
            becomes, or None (a loop predicate).
        carries: ``(sub-jaxpr output, sub-jaxpr input)`` pairs: the output is
            fed back into the input on the next iteration.
        sliced: sub-jaxpr inputs that receive, at iteration ``t``, slice ``t``
            of their operand along its leading axis (a scan's ``xs``).
        stacked: sub-jaxpr outputs whose values of all iterations are stacked
            along a new leading axis into the equation output (a scan's
            ``ys``); the other outputs give the last iteration's value.
    """

    jaxpr: Any
    inputs: tuple[int, ...]
    outputs: tuple[int | None, ...]
    carries: tuple[tuple[int, int], ...] = ()
    sliced: tuple[int, ...] = ()
    stacked: tuple[int, ...] = ()

    @property
    def core(self) -> Any:
        """The open jaxpr (``invars``, ``eqns``, ``outvars``)."""
        return _compat.jaxpr_parts(self.jaxpr)[0]


@dataclasses.dataclass(frozen=True)
class Structure:
    """How one higher-order equation runs its sub-jaxprs.

    Attributes:
        subs: the sub-jaxprs, in the order the primitive names them.
        trips: how many times each sub-jaxpr runs per run of the equation
            when that is static (a loop's length); None when it is not (a
            ``while`` loop: counts take it as once).
        exclusive: exactly one of ``subs`` runs (a conditional's branches).
        copies: how many instances of the sub-jaxprs run side by side, each
            on its share of the operands (the shards of a ``shard_map``): a
            FLOP count of the sub-jaxprs is multiplied by it.
        call: one sub-jaxpr that runs once on the equation's operands and
            whose outputs are the equation's (a call): the passes enter it as
            if it were inlined.
        dtypes_flow: a call whose rewrite lets its inputs keep the dtypes they
            arrive in and that can be re-traced and re-bound for others: the
            scan-input hoist follows uses into it and moves casts out of it.
        recomputed: the backward pass re-runs the sub-jaxpr
            (``jax.checkpoint``).
        reverse: a loop whose iterations run from the last index down.
    """

    subs: tuple[SubJaxpr, ...]
    trips: int | None = 1
    exclusive: bool = False
    copies: float = 1.0
    call: bool = False
    dtypes_flow: bool = False
    recomputed: bool = False
    reverse: bool = False

    @property
    def unrollable(self) -> bool:
        """One sub-jaxpr run a static number of times with values carried or
        sliced between iterations (a scan): a walk may unroll it."""
        if len(self.subs) != 1 or self.call or self.exclusive or self.copies != 1:
            return False
        sub = self.subs[0]
        return self.trips is not None and bool(sub.carries or sub.sliced)


# eval_sub(sub-jaxpr parameter value, its input values) -> its output values.
EvalSub = Callable[[Any, list], list]
# run(eqn, operand values, eval_sub) -> output values.
Run = Callable[[Any, list, EvalSub], list]


def run_once(eqn: Any, invals: list, eval_sub: EvalSub) -> list:
    """Evaluate an equation whose sub-jaxprs each run once (a call): each on
    the operands its description names; the outputs where it names them."""
    structure = describe(eqn)
    outs: list = [None] * len(eqn.outvars)
    for sub in structure.subs:
        results = eval_sub(sub.jaxpr, [invals[i] for i in sub.inputs])
        for k, value in zip(sub.outputs, results):
            if k is not None:
                outs[k] = value
    return outs


@dataclasses.dataclass(frozen=True)
class HigherOrder:
    """The registered description of a higher-order primitive.

    Attributes:
        describe: ``describe(eqn) -> Structure | None`` for an equation of the
            primitive (None: this equation cannot be described; the passes
            treat it as opaque).
        run: ``run(eqn, invals, eval_sub) -> outputs``: the equation evaluated
            concretely, each sub-jaxpr through ``eval_sub`` (so that a
            debugging walk sees its equations); None to bind the primitive
            as it is (``shard_map``, whose body needs its mesh).
    """

    describe: Callable[[Any], Structure | None]
    run: Run | None = run_once


# Primitive name -> description; filled by register_higher_order.
DESCRIPTIONS: dict[str, HigherOrder] = {}


def describe(eqn: Any) -> Structure | None:
    """The :class:`Structure` of a higher-order equation, or None for a
    primitive without a registered description (or an equation it cannot
    describe)."""
    entry = DESCRIPTIONS.get(eqn.primitive.name)
    return None if entry is None else entry.describe(eqn)


def run_concretely(eqn: Any, invals: list, eval_sub: EvalSub) -> list | None:
    """``eqn`` evaluated through its description's ``run`` (sub-jaxprs through
    ``eval_sub``), or None where the primitive is to be bound as it is."""
    entry = DESCRIPTIONS.get(eqn.primitive.name)
    if entry is None or entry.run is None or entry.describe(eqn) is None:
        return None
    return entry.run(eqn, invals, eval_sub)


def runs_whole(eqn: Any) -> bool:
    """Whether ``eqn`` is to be bound as it is, never entered by a concrete
    walk (its registration's ``run`` is None: a body that needs its mesh)."""
    entry = DESCRIPTIONS.get(eqn.primitive.name)
    return entry is not None and entry.run is None


def trips(eqn: Any) -> int:
    """How many times the sub-jaxprs of ``eqn`` run per run of it, as far as
    that is static (1 where it is not, or for an undescribed primitive)."""
    structure = describe(eqn)
    if structure is None or structure.trips is None:
        return 1
    return structure.trips


def call_body(eqn: Any) -> Any:
    """The open jaxpr of ``eqn`` if it is a call (see :attr:`Structure.call`),
    else None."""
    structure = describe(eqn)
    if structure is None or not structure.call:
        return None
    return structure.subs[0].core


def describe_call(
    eqn: Any, dtypes_flow: bool = False, recomputed: bool = False
) -> Structure | None:
    """The description of a call-like equation: its one sub-jaxpr parameter
    takes the equation's operands and gives its outputs.

    Args:
        eqn: an equation with exactly one sub-jaxpr parameter.
        dtypes_flow: see :attr:`Structure.dtypes_flow`.
        recomputed: see :attr:`Structure.recomputed`.

    Returns:
        A :class:`Structure` with ``call=True``, or None when the equation has
        not exactly one sub-jaxpr or its arity differs from the equation's.
    """
    subs = list(_compat.sub_jaxprs(eqn.params))
    if len(subs) != 1:
        return None
    core = _compat.jaxpr_parts(subs[0])[0]
    if len(core.invars) != len(eqn.invars) or len(core.outvars) != len(eqn.outvars):
        return None
    sub = SubJaxpr(
        subs[0], tuple(range(len(eqn.invars))), tuple(range(len(eqn.outvars)))
    )
    return Structure((sub,), call=True, dtypes_flow=dtypes_flow, recomputed=recomputed)
