"""The equation loop: read, look up the rule, cast, bind, write.

This module is mechanism only: it names no primitive family and no feature.
It is handed, in :class:`Pipeline`, the tables that decide everything else:

* ``higher_order``: primitive name -> how an equation with sub-jaxprs is
  rewritten (``_higher_order.py`` fills it); a primitive with sub-jaxprs that
  is not in it runs unchanged (:func:`run_unchanged`);
* ``rewrites``: pattern rewrites (:class:`PatternRewrite`): each finds regions
  of a jaxpr (:class:`Region`: equations the loop skips and replaces at the
  last one);
* the policy (``_policy/_lookup.py``): primitive or scope -> a typed policy
  value, for every other equation: an implementation rule runs the equation
  itself; a cast rule decides its inputs, then the pipeline's ``residuals``
  step chooses what its backward pass saves and its ``bind_steps`` bind it.

See ``docs/design.md`` for the pipeline from ``amp(fn)`` to the rewritten
function.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from .. import _compat
from .._base import _state
from .._base._cast import cast_cache, restore, widen
from .._base._jaxpr import read, write
from .._base._scopes import eqn_scopes
from .._policy._context import RuleContext, TracedDtypes, rule_context
from .._policy._kinds import Delegate, ImplementationRule
from .._policy._lookup import AmpPolicy
from .._values import _facts

HigherOrderRule = Callable[[Any, list, "AmpContext"], Any]

Bind = Callable[[Any, Sequence[Any], dict], Any]
"""``bind(prim, invals, params) -> outputs``: binds a primitive."""

BindStep = Callable[[Any, Sequence[Any], dict, Bind, "RuleContext | None"], Any]
"""``step(prim, invals, params, bind, ctx) -> outputs``: one step of binding a
ruled equation; ``bind`` binds through the steps listed before it (for the
first step, the primitive's own bind); ``ctx``: the equation's
:class:`RuleContext` (None where a primitive is bound outside a walk)."""

ResidualChoice = Callable[["RuleCall", list, frozenset], Any]
"""``choice(call, invals, off) -> outputs``: binds a ruled equation through
``call`` (:class:`RuleCall`), choosing what its backward pass saves; ``off``
is :attr:`Pipeline.off`."""


class Region(NamedTuple):
    """Equations of one jaxpr that a pattern rewrite replaces together.

    Attributes:
        eqns: the equations' indices, ascending. The loop skips all but the
            last once the region has started, and writes the last one's
            outputs from ``finish``; no equation outside the region may read
            the outputs of the others.
        start: ``start(walk) -> token``, called at ``eqns[0]``: None leaves the
            region to the loop (every equation is walked as usual); anything
            else starts it and is handed to ``finish``.
        finish: ``finish(walk, token) -> outputs`` of ``eqns[-1]`` (a list for
            multiple results), called at ``eqns[-1]``; None walks ``eqns[-1]``
            as usual (only meaningful for a one-equation region).
    """

    eqns: tuple[int, ...]
    start: Callable[[Walk], Any]
    finish: Callable[[Walk, Any], Any]


class PatternRewrite(NamedTuple):
    """A plug-in that replaces patterns of equations (attention, RMSNorm).

    Attributes:
        name: a short name, for configuration and error messages.
        regions: ``regions(jaxpr, facts) -> iterable of Region`` for an open
            jaxpr and its per-equation value facts.
        tracing: a context manager factory entered while ``amp`` traces the
            user's function (e.g. to keep a library call recognisable), or
            None.
    """

    name: str
    regions: Callable[[Any, Sequence[Any]], Iterable[Region]]
    tracing: Callable[[], contextlib.AbstractContextManager] | None = None


@dataclasses.dataclass(frozen=True, eq=False)
class Pipeline:
    """The tables one ``amp`` walks with (compared by identity).

    Attributes:
        higher_order: primitive name -> :data:`HigherOrderRule`; read at each
            equation, so rules registered later apply.
        rewrites: pattern rewrites, in priority order (the first to claim an
            equation wins).
        ignore_facts: pattern facts the analysis does not derive
            (``_facts.analyse``), for ablations.
        off: names of choices and bind steps switched off, for ablations:
            read by ``residuals`` and the higher-order rules (e.g.
            ``"narrow_activations"``, ``"loop_casts"``); a bind step named
            here is skipped.
        bind_steps: ``(name, step)`` pairs (:data:`BindStep`) that bind an
            equation after its rule decided its inputs, innermost first: each
            wraps the ones before it.
        residuals: how a ruled equation is bound (:data:`ResidualChoice`);
            None: decide, then bind.
    """

    higher_order: Mapping[str, HigherOrderRule]
    rewrites: tuple[PatternRewrite, ...] = ()
    ignore_facts: frozenset = frozenset()
    off: frozenset = frozenset()
    bind_steps: tuple[tuple[str, BindStep], ...] = ()
    residuals: ResidualChoice | None = None

    @functools.cached_property
    def _steps(self) -> tuple[BindStep, ...]:
        return tuple(step for name, step in self.bind_steps if name not in self.off)

    def binder(self, ctx: RuleContext | None = None) -> Bind:
        """The bind steps not switched off, composed into one :data:`Bind`
        for the equation ``ctx`` describes."""
        bind: Bind = _compat.bind
        for step in self._steps:
            bind = functools.partial(_through, step, bind, ctx)
        return bind


def _through(step: BindStep, inner: Bind, ctx, prim: Any, invals: Sequence, params):
    return step(prim, invals, params, inner, ctx)


@dataclasses.dataclass(frozen=True, eq=False)
class AmpContext:
    """What one jaxpr walk needs: the compute dtype, the policy, the tables,
    and, from the :class:`RuleContext` the loop built for the enclosing
    higher-order equation (:meth:`inside`), its ``named_scope`` components
    (sub-jaxprs are traced with a fresh name stack, so the walk carries the
    prefix), its value facts and its residual format."""

    compute_dtype: np.dtype
    policy: AmpPolicy
    pipeline: Pipeline
    scopes: tuple[str, ...] = ()
    facts: Any = None
    residual_format: Any = None

    def inside(self, rc: RuleContext) -> AmpContext:
        """The context of the higher-order equation ``rc`` describes, for its
        rule and its sub-jaxprs."""
        return dataclasses.replace(
            self, scopes=rc.scopes, facts=rc.facts, residual_format=rc.residual_format
        )

    def rule_context(
        self, original: Sequence[Any], scopes: tuple, facts: Any = None
    ) -> RuleContext:
        """The :class:`RuleContext` of an equation with the traced input
        dtypes ``original``, scope components ``scopes`` and value facts
        ``facts``, walked under this context."""
        return rule_context(self.compute_dtype, original, facts, scopes, self.policy)

    def eqn_context(self, eqn: Any, facts: Any = None) -> RuleContext:
        """The :class:`RuleContext` the loop builds for ``eqn`` (a sub-jaxpr
        equation walked under this context) with value facts ``facts``."""
        original = [v.aval.dtype for v in eqn.invars]
        return self.rule_context(original, eqn_scopes(self.scopes, eqn), facts)

    @property
    def key(self) -> tuple:
        """Cache key of a sub-jaxpr rewrite under this context: the policy by
        its value (``AmpPolicy.value_key``), the pipeline by identity."""
        return (self.policy.value_key, self.compute_dtype, self.scopes, self.pipeline)


@dataclasses.dataclass(frozen=True, eq=False)
class Walk:
    """One walk of one jaxpr, as a :class:`Region` sees it."""

    jaxpr: Any
    facts: tuple
    env: dict
    ctx: AmpContext

    def read(self, v: Any) -> Any:
        """The current value of variable or literal ``v``."""
        return read(self.env, v)

    def context(self, j: int) -> RuleContext:
        """The :class:`RuleContext` of equation ``j``, as the loop builds it."""
        return self.ctx.eqn_context(self.jaxpr.eqns[j], self.facts[j])

    def run_eqn(self, j: int, env: dict | None = None) -> None:
        """Walk equation ``j`` as the loop would, on ``env`` (default: the
        walk's own environment)."""
        _run_eqn(
            self.jaxpr.eqns[j],
            self.facts[j],
            self.env if env is None else env,
            self.ctx,
        )


def eval_jaxpr(
    jaxpr: Any,
    consts: Sequence[Any],
    args: Sequence[Any],
    ctx: AmpContext,
    held: Sequence[bool] = (),
    consts_held: bool = False,
    boundary: tuple | None = None,
    widened: Sequence[bool] = (),
) -> list[Any]:
    """Evaluate ``jaxpr`` with every equation re-bound under the amp policy.

    Args:
        jaxpr: an open jaxpr (``constvars``, ``invars``, ``eqns``, ``outvars``).
        consts: values for ``jaxpr.constvars``.
        args: values for ``jaxpr.invars`` (in their traced dtypes, except
            where ``widened``).
        ctx: compute dtype, policy, tables and enclosing scopes.
        held: per arg, whether it stays alive for the whole step anyway (see
            :attr:`jaxamp._base._state.WalkState.held`); a matmul whose cast inputs
            are all held recomputes the casts in the backward pass instead of
            saving the copies.
        consts_held: whether ``consts`` are held (closed-over values of the
            amp'd function).
        boundary: ``(out bits, in_squared)``, the value facts at the edges of
            ``jaxpr`` (:mod:`jaxamp._values._facts`): the uses of its outputs (all zero
            for the amp'd function's own outputs) and which inputs have the
            magnitude of a square; None where unknown (conservative).
        widened: per arg, whether it is narrower than its traced dtype and
            holds the wider value (a bfloat16 parameter traced as float32):
            the walk reads it widened, at the start of this jaxpr (for a
            ``scan`` body: the slice one iteration reads), and a cast of the
            widened value back to the arg's dtype is the arg itself
            (:func:`jaxamp._base._cast.widen`), so a matmul reads a bfloat16
            parameter as it is and its cotangent stays bfloat16.

    Returns:
        The output values, in whatever dtype the policy left them; callers cast
        back (:func:`jaxamp._base._cast.restore`) where the surrounding code needs
        the traced avals.

    Raises:
        TypeError: if a rule returns the wrong number of inputs (names the
            primitive and the rule).
    """
    with cast_cache():
        pairs = [*zip(args, held), *((c, consts_held) for c in consts)]
        if any(widened):  # read as the wider values they hold
            wide = [
                widen(x, v.aval.dtype) if w else x
                for x, v, w in itertools.zip_longest(args, jaxpr.invars, widened)
            ]
            pairs += list(zip(wide, held))  # a widened held value is held
            args = wide
        env: dict[Any, Any] = {}
        env.update(zip(jaxpr.constvars, consts))
        env.update(zip(jaxpr.invars, args))
        held_map = {id(x): x for x, h in pairs if h and isinstance(x, jax.Array)}
        with _state.updated(held=held_map, recording=ctx.policy):
            return _eval_eqns(jaxpr, env, ctx, boundary)


def _plan(jaxpr: Any, facts: Sequence, rewrites: Sequence[PatternRewrite]) -> dict:
    """Equation index -> the region claiming it (the first claim wins)."""
    plan: dict[int, Region] = {}
    for rewrite in rewrites:
        for region in rewrite.regions(jaxpr, facts):
            if not any(j in plan for j in region.eqns):
                plan.update((j, region) for j in region.eqns)
    return plan


def _eval_eqns(jaxpr: Any, env: dict, ctx: AmpContext, boundary) -> list[Any]:
    pipeline = ctx.pipeline
    facts = _facts.with_boundary(jaxpr, boundary, pipeline.ignore_facts)
    plan = _plan(jaxpr, facts, pipeline.rewrites)
    walk = Walk(jaxpr, facts, env, ctx)
    started: dict[int, Any] = {}  # first index of a started region -> token
    for i, eqn in enumerate(jaxpr.eqns):
        region = plan.get(i)
        if region is not None and _in_region(walk, region, i, started):
            continue
        _run_eqn(eqn, facts[i], env, ctx)
    return [read(env, v) for v in jaxpr.outvars]


def _in_region(walk: Walk, region: Region, i: int, started: dict) -> bool:
    """Whether ``region`` took care of equation ``i``: skipped it (a started
    region's equation before its last) or wrote its outputs (the last)."""
    first = region.eqns[0]
    if i == first:
        token = region.start(walk)
        if token is None:
            return False
        started[first] = token
    if first not in started:
        return False
    if i != region.eqns[-1]:
        return True
    outs = region.finish(walk, started[first])
    if outs is None:
        return False
    write(walk.env, walk.jaxpr.eqns[i], outs)
    return True


def _run_eqn(eqn: Any, eqn_facts: Any, env: dict, ctx: AmpContext) -> None:
    """Rewrite (higher-order) or re-bind (rule) one equation, told about it
    by the :class:`RuleContext` built here, reading its inputs from ``env``
    and writing its outputs there."""
    invals = [read(env, v) for v in eqn.invars]
    with _compat.eqn_context(eqn):
        nested = any(True for _ in _compat.sub_jaxprs(eqn.params))
        params = None if nested else _compat.bind_params(eqn.primitive, eqn.params)
        outs = _dispatch(eqn, invals, ctx, ctx.eqn_context(eqn, eqn_facts), params)
    write(env, eqn, outs)


def _dispatch(eqn: Any, invals: list, ctx: AmpContext, rc: RuleContext, params):
    """The outputs of ``eqn``: rewritten by its higher-order rule, re-bound by
    its rule with the bind ``params``, or, with sub-jaxprs and no
    higher-order rule (``params`` None), bound unchanged."""
    hop = ctx.pipeline.higher_order.get(eqn.primitive.name)
    if hop is not None:
        return hop(eqn, invals, ctx.inside(rc))
    if params is not None:
        return _apply_rule(eqn.primitive, params, invals, ctx, rc)
    return run_unchanged(eqn, invals)


def run_unchanged(eqn: Any, invals: list, ctx: AmpContext | None = None) -> Any:
    """Bind the equation as traced, inputs restored to their traced dtypes."""
    del ctx
    inputs = restore_inputs(eqn, invals)
    params = _compat.bind_params(eqn.primitive, eqn.params)
    return _compat.bind(eqn.primitive, inputs, params)


def restore_inputs(eqn: Any, invals: list) -> list:
    """``invals`` cast back to the dtypes ``eqn`` was traced with."""
    return [restore(x, v.aval) for x, v in zip(invals, eqn.invars)]


@dataclasses.dataclass(frozen=True, eq=False)
class RuleCall:
    """One equation's rule, ready to decide its inputs and bind; ``context``:
    what the rule is told about the equation."""

    prim: Any
    rule: Callable
    params: dict
    context: RuleContext
    binder: Bind = _compat.bind

    @property
    def name(self) -> str:
        """The primitive's name."""
        return self.prim.name

    @property
    def original(self) -> tuple:
        """The equation's traced input dtypes."""
        return self.context.original_dtypes

    @property
    def compute_dtype(self) -> np.dtype:
        """amp's compute dtype."""
        return self.context.compute_dtype

    def decide(self, *vals: Any) -> tuple[list, dict]:
        """The rule's ``(inputs, bind params)`` for ``vals``, validated."""
        result = decide(self.rule, self.context, *vals, **self.params)
        return check_rule_result(result, self.prim, self.rule, len(vals))

    def bind(self, new_params: dict, *new_in: Any) -> Any:
        """Bind the primitive through the pipeline's bind steps."""
        return self.binder(self.prim, new_in, new_params)

    def apply(self, *vals: Any) -> Any:
        """Decide, then bind."""
        new_in, new_params = self.decide(*vals)
        return self.bind(new_params, *new_in)


def decide(rule: Callable, ctx: RuleContext, *invars: Any, **params: Any) -> Any:
    """``rule``'s result for the equation ``ctx`` describes: a typed rule
    (``_policy/_kinds.py``) takes the context, a plain function jaxamp 0.0.4's
    ``(compute_dtype, original_dtypes)``."""
    typed = getattr(rule, "decide", None)
    if typed is not None:
        return typed(ctx, *invars, **params)
    # jaxamp 0.0.4's signature; the dtypes carry ctx to a rule it calls.
    return rule(ctx.compute_dtype, TracedDtypes.of(ctx), *invars, **params)


def _apply_rule(prim, params: dict, invals: list, ctx: AmpContext, rc) -> Any:
    rule = ctx.policy.lookup(prim, rc.scopes)
    if isinstance(rule, ImplementationRule):  # runs the equation itself
        out = rule.decide(rc, *invals, **params)
        if not isinstance(out, Delegate):
            return out
        if out.scope is None:  # or leaves it to a cast rule
            return _apply_cast_rule(prim, out.rule, params, invals, ctx, rc)
        with jax.named_scope(out.scope):
            return _apply_cast_rule(prim, out.rule, params, invals, ctx, rc)
    return _apply_cast_rule(prim, rule, params, invals, ctx, rc)


def _apply_cast_rule(prim, rule, params: dict, invals: list, ctx: AmpContext, rc):
    pipeline = ctx.pipeline
    call = RuleCall(prim, rule, params, rc, pipeline.binder(rc))
    if rule is ctx.policy.stop_rule or pipeline.residuals is None:
        return call.apply(*invals)  # amp_stop regions stay as traced
    return pipeline.residuals(call, invals, pipeline.off)


def check_rule_result(result, prim, rule: Callable, n: int):
    """Validate a rule's ``(invars, bind_params)`` result for ``n`` inputs."""
    name = getattr(rule, "__name__", repr(rule))
    if not (isinstance(result, (tuple, list)) and len(result) == 2):
        raise TypeError(
            f"amp rule {name} for primitive '{prim.name}' must return "
            f"(invars, bind_params), got {type(result).__name__}."
        )
    new_in, new_params = result
    if len(new_in) != n or not isinstance(new_params, Mapping):
        raise TypeError(
            f"amp rule {name} for primitive '{prim.name}' returned {len(new_in)} "
            f"inputs and {type(new_params).__name__} params; expected {n} inputs "
            "(one per input of the equation) and a dict of bind params."
        )
    return list(new_in), dict(new_params)
