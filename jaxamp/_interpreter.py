"""The equation loop: read, look up scope/primitive rule, cast, bind, write.

This module is mechanism only. Which dtype a primitive runs in is data
(:mod:`jaxamp._rules`); how a sub-jaxpr is rewritten is structure
(:mod:`jaxamp._higher_order`).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from . import _attention, _compat, _facts, _overflow, _reductions
from ._dtypes import dtype_of, is_float
from ._rules import (
    MATMULS,
    Rule,
    cast,
    cast_cache,
    default_amp_policy,
    use_lower_precision,
)

# Scope that marks equations an amp has already rewritten: an enclosing amp
# treats them as "amp_stop", so the innermost amp decides inside its region.
AMP_REGION = "jaxamp.amp"

# id -> value of the inputs of the jaxpr being walked that stay alive for the
# whole step anyway: the amp'd function's arguments and closed-over values
# (parameters, batch) and the scan / jit inputs bound to them, which JAX's
# partial evaluation forwards instead of copying.
_HELD: contextvars.ContextVar[dict | None] = contextvars.ContextVar(
    "jaxamp_held", default=None
)


# True while amp rewrites the body of a user's jax.checkpoint: its residuals are
# recomputed anyway, so a square is not wrapped in a checkpoint of its own (that
# would only keep XLA from fusing its backward pass: 2 ms a step on an H100).
_RECOMPUTED: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "jaxamp_recomputed", default=False
)


# Scope of the checkpoints amp adds around an equation to re-cast its inputs in
# the backward pass (_recomputing_casts): the scan rule inlines one whose casts
# it moved before the loop.
RECAST_SCOPE = "jaxamp_recast"

# Scope of the checkpoint in which an RMSNorm's statistic and scaling run
# (_rms_region).
RMS_SCOPE = "jaxamp_rms_norm"


def recomputed() -> bool:
    """Whether the walk is inside a user's ``jax.checkpoint`` body."""
    return _RECOMPUTED.get()


@contextlib.contextmanager
def recomputing(active: bool = True):
    """Mark the walks in this block as inside a user's ``jax.checkpoint``."""
    token = _RECOMPUTED.set(active or _RECOMPUTED.get())
    try:
        yield
    finally:
        _RECOMPUTED.reset(token)


def is_held(x: Any) -> bool:
    """True if ``x`` is an input of the current walk that is alive for the step."""
    held = _HELD.get()
    return held is not None and held.get(id(x)) is x


class AmpPolicy:
    """A validated, immutable view of an ``amp_policy`` mapping.

    Keys are primitive objects, primitive names or ``jax.named_scope`` names
    (plus the special keys ``"amp_stop"`` and ``"amp_default"``); values are
    rules, or (for scope keys) nested policies that apply inside the scope.
    Lookup order: ``"amp_stop"`` (or an inner amp's region) anywhere on
    the scope stack, then as in jaxamp 0.0.4 the outermost scope component
    found in the policy, then the primitive object, then the primitive name,
    then ``"amp_default"``.
    """

    __slots__ = ("_by_prim", "_by_name", "_default", "_source", "_stop")

    def __init__(self, amp_policy: Mapping[Any, Rule]):
        if isinstance(amp_policy, AmpPolicy):
            amp_policy = amp_policy._source
        if not isinstance(amp_policy, Mapping):
            raise TypeError(
                "amp_policy must be a mapping from primitive / primitive name / "
                f"named_scope name to rule, got {type(amp_policy).__name__}."
            )
        by_prim: dict[Any, Rule] = {}
        by_name: dict[str, Rule] = {}
        for key, rule in amp_policy.items():
            if isinstance(rule, Mapping) and isinstance(key, str):
                rule = AmpPolicy(rule)  # a policy for everything inside a scope
            elif not callable(rule):
                raise TypeError(
                    f"amp_policy[{key!r}] must be a rule (a callable with signature "
                    "rule(compute_dtype, original_dtypes, *invars, **params)), got "
                    f"{type(rule).__name__}."
                )
            if isinstance(key, _compat.Primitive):
                by_prim[key] = rule
            elif isinstance(key, str):
                by_name[key] = rule
            else:
                raise TypeError(
                    f"amp_policy key {key!r} of type {type(key).__name__} is neither "
                    "a primitive (e.g. jax.lax.dot_general_p), a primitive name "
                    "(e.g. 'dot_general') nor a jax.named_scope name (a str)."
                )
        by_name.setdefault("amp_stop", default_amp_policy["amp_stop"])
        self._stop = by_name["amp_stop"]
        self._default = by_name.pop("amp_default", default_amp_policy["amp_default"])
        self._by_prim = by_prim
        self._by_name = by_name
        self._source = dict(amp_policy)

    @property
    def default_rule(self) -> Rule:
        """The rule used when nothing in the policy matches (``"amp_default"``)."""
        return self._default

    @property
    def stop_rule(self) -> Rule:
        """The rule of ``amp_stop`` regions (and of inner amps' regions)."""
        return self._stop

    def lookup(self, primitive: Any, scopes: Sequence[str]) -> Rule:
        """The rule for ``primitive`` under the scope components ``scopes``."""
        if "amp_stop" in scopes or AMP_REGION in scopes:
            return self._stop
        for i, scope in enumerate(scopes):
            rule = self._by_name.get(scope)
            if isinstance(rule, AmpPolicy):  # nested: look up inside the scope
                return rule.lookup(primitive, scopes[i + 1 :])
            if rule is not None:
                return rule
        rule = self._by_prim.get(primitive)
        if rule is not None:
            return rule
        rule = self._by_name.get(primitive.name)
        return self._default if rule is None or isinstance(rule, AmpPolicy) else rule


@dataclass(frozen=True, eq=False)
class AmpContext:
    """What one jaxpr walk needs: the compute dtype, the policy, and the
    ``named_scope`` components of the enclosing equations (sub-jaxprs are
    traced with a fresh name stack, so the interpreter carries the prefix)."""

    compute_dtype: np.dtype
    policy: AmpPolicy
    scopes: tuple[str, ...] = ()

    def inside(self, scopes: tuple[str, ...]) -> AmpContext:
        """The context for a sub-jaxpr of an equation with scope ``scopes``."""
        if scopes == self.scopes:
            return self
        return AmpContext(self.compute_dtype, self.policy, scopes)

    @property
    def key(self) -> tuple:
        """Cache key of a sub-jaxpr rewrite under this context."""
        return (self.policy, self.compute_dtype, self.scopes)


def restore(x: Any, aval: Any) -> Any:
    """Cast ``x`` to exactly ``aval``'s dtype (and weak type) if it differs."""
    dtype = getattr(aval, "dtype", None)
    if dtype is None or getattr(x, "dtype", dtype) == dtype:
        return x
    if getattr(aval, "weak_type", False) and isinstance(x, jax.Array):
        return _compat.convert(x, dtype, weak_type=True)
    return cast(x, dtype)


def _read(env: dict, v: Any) -> Any:
    return v.val if isinstance(v, _compat.Literal) else env[v]


def eval_jaxpr(
    jaxpr: Any,
    consts: Sequence[Any],
    args: Sequence[Any],
    ctx: AmpContext,
    held: Sequence[bool] = (),
    consts_held: bool = False,
    boundary: tuple | None = None,
) -> list[Any]:
    """Evaluate ``jaxpr`` with every equation re-bound under the amp policy.

    Args:
        jaxpr: an open jaxpr (``constvars``, ``invars``, ``eqns``, ``outvars``).
        consts: values for ``jaxpr.constvars``.
        args: values for ``jaxpr.invars`` (in their traced dtypes).
        ctx: compute dtype, policy and enclosing scopes.
        held: per arg, whether it stays alive for the whole step anyway (see
            :func:`is_held`); a matmul whose cast inputs are all held recomputes
            the casts in the backward pass instead of saving the copies.
        consts_held: whether ``consts`` are held (closed-over values of the
            amp'd function).
        boundary: ``(out bits, in_squared)``, the value facts at the edges of
            ``jaxpr`` (:mod:`jaxamp._facts`): the uses of its outputs (all zero
            for the amp'd function's own outputs) and which inputs have the
            magnitude of a square; None where unknown (conservative).

    Returns:
        The output values, in whatever dtype the policy left them; callers cast
        back (:func:`restore`) where the surrounding code needs the traced avals.

    Raises:
        TypeError: if a rule returns the wrong number of inputs (names the
            primitive and the rule).
    """
    env: dict[Any, Any] = {}
    env.update(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    pairs = [*zip(args, held), *((c, consts_held) for c in consts)]
    held_map = {id(x): x for x, h in pairs if h and isinstance(x, jax.Array)}
    token = _HELD.set(held_map)
    try:
        return _eval_eqns(jaxpr, env, ctx, boundary)
    finally:
        _HELD.reset(token)


def _eval_eqns(jaxpr: Any, env: dict, ctx: AmpContext, boundary) -> list[Any]:
    facts = _facts.with_boundary(jaxpr, boundary)
    fusions = _attention.Fusions(jaxpr)  # matched attention (issue 12)
    with cast_cache():
        for i, (eqn, eqn_facts) in enumerate(zip(jaxpr.eqns, facts)):
            if fusions.handled(i, eqn, env, ctx):
                continue
            if eqn_facts.rms_member:  # runs with its RMSNorm scaling, below
                continue
            if eqn_facts.rms_region:
                env[eqn.outvars[0]] = _rms_region(jaxpr, facts, env, ctx, i)
                continue
            _run_eqn(eqn, eqn_facts, env, ctx)
        return [_read(env, v) for v in jaxpr.outvars]


def _run_eqn(eqn: Any, eqn_facts: Any, env: dict, ctx: AmpContext) -> None:
    """Rewrite (higher-order) or re-bind (rule) one equation with its facts
    current, reading its inputs from ``env`` and writing its outputs there."""
    from ._higher_order import rewrite_equation  # cycle: structure uses mechanism

    invals = [_read(env, v) for v in eqn.invars]
    scopes = ctx.scopes + _compat.scope_names(eqn)
    token = _facts.set_current(eqn_facts)
    try:
        with _compat.eqn_context(eqn):
            outs = rewrite_equation(eqn, invals, ctx.inside(scopes))
            if outs is None:
                outs = _apply_rule(eqn, invals, ctx, scopes)
    finally:
        _facts.reset_current(token)
    if eqn.primitive.multiple_results:
        env.update(zip(eqn.outvars, outs))
    else:
        env[eqn.outvars[0]] = outs


def _rms_region(jaxpr: Any, facts: Sequence, env: dict, ctx: AmpContext, k: int):
    """Run the equations of RMSNorm scaling ``k``'s ``rms_region`` (its square,
    statistic and scaling: :mod:`jaxamp._facts`) under their rules, and return
    the scaling's output.

    When a low-precision value enters them outside a user's ``jax.checkpoint``
    they run inside one ``jax.checkpoint`` (named scope ``jaxamp_rms_norm``):
    the backward pass saves the low-precision ``x`` and recomputes the float32
    normalisation, instead of saving a float32 copy of ``x``; within it the
    cotangents of ``x`` meet in float32 and are rounded once.
    """
    region = facts[k].rms_region
    eqns = [jaxpr.eqns[j] for j in region]
    made = {v for e in eqns for v in e.outvars}
    leaves = list(
        dict.fromkeys(
            v
            for e in eqns
            for v in e.invars
            if not isinstance(v, _compat.Literal) and v not in made
        )
    )

    def run(*vals):
        local = dict(zip(leaves, vals))
        for j, e in zip(region, eqns):
            _run_eqn(e, facts[j], local, ctx)
        return local[eqns[-1].outvars[0]]

    vals = [env[v] for v in leaves]
    if _RECOMPUTED.get() or not any(map(_is_low, vals)):
        return run(*vals)

    def recomputed_run(*vals):
        with cast_cache(), recomputing():  # casts traced here stay here
            return run(*vals)

    with jax.named_scope(RMS_SCOPE):
        return jax.checkpoint(recomputed_run)(*vals)


def _apply_rule(eqn, invals, ctx: AmpContext, scopes) -> Any:
    prim = eqn.primitive
    rule = ctx.policy.lookup(prim, scopes)
    params = _compat.bind_params(prim, eqn.params)
    original = [v.aval.dtype for v in eqn.invars]
    if getattr(rule, "amp_impl", False):  # an implementation rule (e.g. FP8)
        return rule(ctx.compute_dtype, original, *invals, **params)

    def decide(*vals):
        result = rule(ctx.compute_dtype, original, *vals, **params)
        return check_rule_result(result, prim, rule, len(vals))

    def bind(new_params, *new_in):
        outs = _reductions.bind(prim, new_in, new_params)
        return _overflow.poison(prim.name, new_in, outs)

    def apply(*vals):
        new_in, new_params = decide(*vals)
        return bind(new_params, *new_in)

    if rule is ctx.policy.stop_rule:  # amp_stop regions stay as traced
        return apply(*invals)
    # A matmul re-casts held inputs in the backward pass instead of saving copies.
    if prim.name in MATMULS and rule is use_lower_precision:
        invals = _narrow_activations(invals, original, ctx.compute_dtype)
    if prim.name in MATMULS and _casts_only_held(invals, ctx.compute_dtype):
        return _recomputing_casts(apply, invals)
    # A square widened to float32 re-casts its low-precision input (the float32
    # copy would be a residual as large as the activation, twice its bytes); in
    # a user's checkpoint that would only cost fusion. An RMSNorm's square casts
    # outside and recomputes only itself (``2 * x``): its float32 copy of x is the
    # one the scaling saves, and sharing it sums the two cotangents of x (which
    # nearly cancel) in float32 before one rounding (_facts.rms_operand).
    facts = _facts.current_facts()
    if facts.quadratic and any(map(_is_low, invals)) and not _RECOMPUTED.get():
        if facts.rms_operand:
            new_in, new_params = decide(*invals)
            return _recomputing_casts(functools.partial(bind, new_params), new_in)
        return _recomputing_casts(apply, invals)
    return apply(*invals)


def _is_low(x: Any) -> bool:
    return isinstance(x, jax.Array) and is_float(x.dtype) and x.dtype.itemsize < 4


def _narrow_activations(
    invals: Sequence[Any], original: Sequence[Any], compute_dtype: np.dtype
) -> list[Any]:
    """Cast the wide float inputs of a default-rule matmul that are not held
    (activations: a float32 RMSNorm output) to the compute dtype, as the rule
    would, before the held ones (weights) are left to :func:`_casts_only_held`:
    the activation's low-precision copy is a residual either way, the weight's
    copy need not be. Only where no held input is read by another equation
    too: a weight that several matmuls read keeps its one cached copy (the cast
    cache), instead of a cast per matmul in both passes. Inputs of a matmul
    traced with mixed float dtypes stay."""
    invals = list(invals)
    floats = {np.dtype(d) for d, x in zip(original, invals) if is_float(d)}
    shared = _facts.current_facts().shared_inputs or (True,) * len(invals)
    held = [is_held(x) for x in invals]
    if len(floats) > 1 or not any(held) or any(h and s for h, s in zip(held, shared)):
        return invals
    width = np.dtype(compute_dtype).itemsize
    return [
        cast(x, compute_dtype)
        if isinstance(x, jax.Array)
        and is_float(dtype_of(x))
        and x.dtype.itemsize > width
        and not is_held(x)
        else x
        for x in invals
    ]


def _casts_only_held(invals: Sequence[Any], compute_dtype: np.dtype) -> bool:
    """Some input is a held float wider than the compute dtype, and every other
    float input is at most as wide (so nothing but held values gets narrowed)."""
    width = np.dtype(compute_dtype).itemsize
    wide = [
        x
        for x in invals
        if isinstance(x, jax.Array)
        and is_float(dtype_of(x))
        and x.dtype.itemsize > width
    ]
    return bool(wide) and all(is_held(x) for x in wide)


def _recomputing_casts(apply: Callable, invals: Sequence[Any]) -> Any:
    """``apply(*invals)`` inside ``jax.checkpoint``: the backward pass saves the
    held wide inputs (alive anyway) and re-casts them, instead of saving their
    low-precision copies. ``prevent_cse`` stays on so that XLA cannot merge the
    recomputed cast with the forward one and keep the copy alive after all."""
    idx = [i for i, x in enumerate(invals) if isinstance(x, jax.Array)]

    def run(*arrays):
        vals = list(invals)
        for i, a in zip(idx, arrays):
            vals[i] = a
        with cast_cache():  # casts traced here must not leak to the outer walk
            return apply(*vals)

    with jax.named_scope(RECAST_SCOPE):
        return jax.checkpoint(run)(*(invals[i] for i in idx))


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
