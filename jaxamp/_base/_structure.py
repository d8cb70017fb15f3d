"""Higher-order primitives as every pass reads them: one registration each.

A higher-order equation (a call, a loop, a conditional, a ``shard_map``) holds
sub-jaxprs. Everything jaxamp needs to know about such a primitive is written
once, in the :class:`HigherOrder` entry that
``jaxamp._walk._register.register_higher_order`` records here: its rewrite
rule (the walk), its description for one equation (:class:`Structure`: which
operands feed which sub-jaxpr inputs, which outputs come from which sub-jaxpr
outputs, the loop-carried pairs, the static trip count, whether one sub-jaxpr
runs out of several, how many copies run, whether it is a call and of which
kind), how to evaluate it concretely, and its entry in the default policy.
Every table is derived from this registry when it is read, never copied at
import: the walk's rules, the default policy's entries for these primitives
(also in a policy built before the registration), the value facts, the
scan-input hoist, ``find_overflows``, the FLOP counter, the reports, the
chunked optimizer and the attention matcher all read it here, below the walk,
and name no primitive. Like JAX, which registers a primitive's jvp, batching
and lowering rules beside the primitive itself
(``jax/_src/lax/control_flow/loops.py``).

A primitive without an entry (or with one without a description) is opaque
to the passes that read descriptions: its operands are taken to reach a
matmul, it is evaluated by binding it, and its sub-jaxprs are counted once.
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
    """The registration of a higher-order primitive: what every pass reads.

    Attributes:
        rule: the rewrite rule ``rule(eqn, invals, ctx) -> outvals`` the walk
            applies to its equations
            (``jaxamp._walk._loop.HigherOrderRule``).
        describe: ``describe(eqn) -> Structure | None`` for an equation of the
            primitive (None returned: this equation cannot be described);
            None: no description, the passes treat the primitive as opaque.
        run: ``run(eqn, invals, eval_sub) -> outputs``: the equation evaluated
            concretely, each sub-jaxpr through ``eval_sub`` (so that a
            debugging walk sees its equations); None to bind the primitive
            as it is (``shard_map``, whose body needs its mesh). Read only
            with a description.
        default_rule: the primitive's entry in the default policy (a loop's
            carries' rule), which a policy built on the default table takes
            where it names none (``jaxamp._policy._lookup.AmpPolicy``), or
            None.
    """

    rule: Callable[..., Any]
    describe: Callable[[Any], Structure | None] | None = None
    run: Run | None = run_once
    default_rule: Any = None


# Primitive name -> its registration in force, and the registrations it
# replaced (most recent last), which unregister() puts back.
_REGISTRY: dict[str, HigherOrder] = {}
_REPLACED: dict[str, list[HigherOrder]] = {}
# Bumped by every (un)registration: work cached across calls (rewritten
# sub-jaxprs) keys on it, so that it never outlives the registry it read.
_GENERATION = [0]


def register(name: str, entry: HigherOrder) -> None:
    """Put ``entry`` in force for the primitive named ``name``; the entry it
    replaces comes back with :func:`unregister`."""
    if name in _REGISTRY:
        _REPLACED.setdefault(name, []).append(_REGISTRY[name])
    _REGISTRY[name] = entry
    _GENERATION[0] += 1


def unregister(name: str) -> HigherOrder | None:
    """Remove the registration of ``name`` in force, putting back the one it
    replaced (if any); returns the removed entry (None: none was in force)."""
    removed = _REGISTRY.pop(name, None)
    earlier = _REPLACED.get(name)
    if earlier:
        _REGISTRY[name] = earlier.pop()
        if not earlier:
            del _REPLACED[name]
    _GENERATION[0] += 1
    return removed


def registered(name: str) -> HigherOrder | None:
    """The registration in force for the primitive named ``name``, or None."""
    return _REGISTRY.get(name)


def registered_names() -> tuple[str, ...]:
    """The names of the registered higher-order primitives, in registration
    order."""
    return tuple(_REGISTRY)


def generation() -> int:
    """A number that changes with every registration and unregistration."""
    return _GENERATION[0]


def describe(eqn: Any) -> Structure | None:
    """The :class:`Structure` of a higher-order equation, or None for a
    primitive without a registered description (or an equation it cannot
    describe)."""
    entry = _REGISTRY.get(eqn.primitive.name)
    if entry is None or entry.describe is None:
        return None
    return entry.describe(eqn)


def run_concretely(eqn: Any, invals: list, eval_sub: EvalSub) -> list | None:
    """``eqn`` evaluated through its description's ``run`` (sub-jaxprs through
    ``eval_sub``), or None where the primitive is to be bound as it is."""
    entry = _REGISTRY.get(eqn.primitive.name)
    if entry is None or entry.run is None or describe(eqn) is None:
        return None
    return entry.run(eqn, invals, eval_sub)


def runs_whole(eqn: Any) -> bool:
    """Whether ``eqn`` is to be bound as it is, never entered by a concrete
    walk (its registration's ``run`` is None: a body that needs its mesh)."""
    entry = _REGISTRY.get(eqn.primitive.name)
    return entry is not None and entry.describe is not None and entry.run is None


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


def plain_call(eqn: Any) -> Any:
    """The sub-jaxpr parameter (``Jaxpr`` or ``ClosedJaxpr``) of ``eqn`` if it
    is a plain call, else None: a call (:attr:`Structure.call`) whose body's
    dtypes flow through (:attr:`Structure.dtypes_flow`) and that the backward
    pass does not re-run: ``jax.jit``'s equation (which carries the called
    function's ``name``; JAX reuses its traced body at every call site with
    the same avals), ``closed_call``, a user's call registered so."""
    structure = describe(eqn)
    if structure is None or not structure.call or structure.recomputed:
        return None
    return structure.subs[0].jaxpr if structure.dtypes_flow else None


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
