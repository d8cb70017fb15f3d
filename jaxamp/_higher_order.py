"""Registry: higher-order primitive -> how its sub-jaxprs are rewritten.

Sub-jaxprs are rewritten by re-tracing the interpreter over their avals, and
the same primitive is re-bound with the new jaxpr, so shardings, donation,
layouts, remat policies and any parameter JAX adds later stay valid. Rewrites
are cached per (sub-jaxpr, policy, compute dtype, scopes, signature): a jitted
layer called N times is rewritten once.

* ``jit``/``pjit``/``closed_call``/``remat2``: dtypes flow through, as if the
  body were inlined (see :func:`_call`).
* ``scan``: the policy's ``"scan"`` rule chooses the carry dtype; inputs that
  the rewritten body only reads in a narrower dtype are cast before the loop
  (see :func:`_loop_casts`).
* ``while``, ``cond``, ``shard_map``: identical input and output avals.
* ``custom_jvp_call`` / ``custom_vjp_call``: the primal is rewritten *and* the
  user's jvp / fwd / bwd rules are wrapped so that they still run under
  ``jax.grad`` (in mixed precision too), never inlined away.

A primitive with sub-jaxprs that is not registered here (e.g. ``pallas_call``)
runs unchanged, with its inputs restored to their traced dtypes.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import jax

from . import _compat, _facts, _overflow
from ._dtypes import dtype_of
from ._interpreter import (
    RECAST_SCOPE,
    AmpContext,
    check_rule_result,
    eval_jaxpr,
    is_held,
    recomputed,
    recomputing,
    restore,
)
from ._rules import cast, cast_cache

HigherOrderRule = Callable[[Any, list, AmpContext], Any]

higher_order_rules: dict[str, HigherOrderRule] = {}

# sub-jaxpr -> {context key: rewritten jaxpr}. Keyed weakly by the jaxpr object:
# jit caches its traces, so one jitted layer called N times is rewritten once.
_REWRITES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def register_higher_order(*names: str) -> Callable[[HigherOrderRule], HigherOrderRule]:
    """Register ``rule(eqn, invals, ctx) -> outvals`` for primitive ``names``.

    Args:
        *names: one or more primitive names (``eqn.primitive.name``, e.g.
            ``"my_call"``).

    Returns:
        A decorator that registers ``rule`` and returns it unchanged.

    Raises:
        TypeError: if no name is given or a name is not a string.
    """
    if not names or not all(isinstance(n, str) for n in names):
        raise TypeError(
            f"register_higher_order(*names): give primitive names as strings, "
            f"e.g. register_higher_order('my_call')(rule); got {names!r}."
        )

    def register(rule: HigherOrderRule) -> HigherOrderRule:
        for name in names:
            higher_order_rules[name] = rule
        return rule

    return register


def rewrite_equation(eqn: Any, invals: list, ctx: AmpContext) -> Any:
    """Outputs of a higher-order equation, or None for an ordinary primitive."""
    rule = higher_order_rules.get(eqn.primitive.name)
    if rule is not None:
        return rule(eqn, invals, ctx)
    if any(True for _ in _compat.sub_jaxprs(eqn.params)):
        return run_unchanged(eqn, invals, ctx)
    return None


FREE = "free"  # out_dtypes: outputs keep whatever dtype the rewritten body gives


def rewrite_jaxpr(
    jaxpr: Any,
    ctx: AmpContext,
    in_dtypes: tuple | None = None,
    out_dtypes: tuple | str | None = None,
    held: tuple[bool, ...] = (),
) -> Any:
    """``jaxpr`` rewritten under ``ctx``; by default with identical in/out avals.

    ``in_dtypes`` / ``out_dtypes`` (one entry per input / output, None to keep
    the traced dtype) change the signature where a rule asked for it (scan
    carries); ``out_dtypes=FREE`` lets outputs leave in the dtype the body
    computes them in (call-like primitives). ``held`` marks the inputs bound to
    held values (:func:`jaxamp._interpreter.is_held`) where JAX's partial
    evaluation forwards them as residuals. Returns a jaxpr of the same kind
    (closed or open), or None when an open jaxpr would need constants it
    cannot carry (the caller then runs the equation unchanged).
    """
    try:
        per_jaxpr = _REWRITES.setdefault(jaxpr, {})
    except TypeError:  # not weak-referenceable: no caching
        per_jaxpr = {}
    # The value facts of the outputs' uses, as the enclosing equation's analysis
    # found them (None when traced lazily, e.g. a jvp rule under jax.grad).
    edge = _facts.current_facts().boundary_for(jaxpr)
    key = (ctx.key, in_dtypes, out_dtypes, held, edge, recomputed())
    if key not in per_jaxpr:
        new = _retrace(jaxpr, ctx, in_dtypes, out_dtypes, held, edge)
        per_jaxpr[key] = _compat.like(jaxpr, new)
    return per_jaxpr[key]


def _with_dtypes(avals: list, dtypes: tuple | None) -> list:
    if dtypes is None:
        return avals
    return [
        a if d is None else a.update(dtype=d, weak_type=False)
        for a, d in zip(avals, dtypes)
    ]


def _retrace(
    jaxpr: Any, ctx: AmpContext, in_dtypes=None, out_dtypes=None, held=(), edge=None
) -> Any:
    core, consts = _compat.jaxpr_parts(jaxpr)
    in_avals = _with_dtypes([v.aval for v in core.invars], in_dtypes)
    free = isinstance(out_dtypes, str) and out_dtypes == FREE
    out_avals = [v.aval for v in core.outvars]
    if not free:
        out_avals = _with_dtypes(out_avals, out_dtypes)

    def amp_body(*args):
        # A fresh cast cache per trace: a cast made in this trace must never be
        # served to another one (it would leak a tracer).
        with cast_cache():
            outs = eval_jaxpr(core, consts, args, ctx, held, boundary=edge)
            if free:
                return outs
            return [restore(x, a) for x, a in zip(outs, out_avals)]

    return _compat.trace_to_closed_jaxpr(amp_body, in_avals)


def _restore_inputs(eqn: Any, invals: list) -> list:
    return [restore(x, v.aval) for x, v in zip(invals, eqn.invars)]


def run_unchanged(eqn: Any, invals: list, ctx: AmpContext) -> Any:
    """Bind the equation as traced, inputs restored to their traced dtypes."""
    del ctx
    params = _compat.bind_params(eqn.primitive, eqn.params)
    return _compat.bind(eqn.primitive, _restore_inputs(eqn, invals), params)


def _rewrite_params(params: dict, ctx: AmpContext) -> dict | None:
    new = dict(params)
    for name, val in params.items():
        if _compat.is_jaxpr(val):
            new[name] = rewrite_jaxpr(val, ctx)
            if new[name] is None:
                return None
        elif isinstance(val, tuple) and val and all(map(_compat.is_jaxpr, val)):
            new[name] = tuple(rewrite_jaxpr(v, ctx) for v in val)
            if any(v is None for v in new[name]):
                return None
    return new


@register_higher_order(
    "jit", "pjit", "closed_call", "core_call", "remat2", "checkpoint"
)
def _call(eqn: Any, invals: list, ctx: AmpContext) -> Any:
    """Call-like primitives: dtypes flow through as if the body were inlined.

    The body is rewritten for the dtypes its inputs have now, and its outputs
    leave in the dtypes the policy computed them in. So ``amp(jit(f))`` makes
    the same precision choices as ``amp(f)``, a ``jax.checkpoint``-ed layer
    saves its low-precision inputs, and no cast pair is spent at each call
    boundary. Shardings, layouts, donation and remat policies are per input and
    stay valid.
    """
    (name,) = [k for k, v in eqn.params.items() if _compat.is_jaxpr(v)]
    in_dtypes = _changed_dtypes(invals, eqn.invars)
    params = dict(eqn.params)
    # Held inputs stay held through a jit; inside a user's checkpoint its own
    # policy decides what is saved (a dots_saveable policy must see the dots).
    remat = eqn.primitive.name in ("remat2", "checkpoint")
    held = () if remat else tuple(map(is_held, invals))
    with recomputing(remat):
        params[name] = rewrite_jaxpr(params[name], ctx, in_dtypes, FREE, held)
    if params[name] is None:
        return run_unchanged(eqn, invals, ctx)
    bparams = _compat.bind_params(eqn.primitive, params)
    return _compat.bind(eqn.primitive, invals, bparams)


@register_higher_order("while", "cond")
def rewrite_subjaxprs(eqn: Any, invals: list, ctx: AmpContext) -> Any:
    """Default rule: rewrite every sub-jaxpr parameter, re-bind the primitive."""
    new_params = _rewrite_params(eqn.params, ctx)
    if new_params is None:
        return run_unchanged(eqn, invals, ctx)
    params = _compat.bind_params(eqn.primitive, new_params)
    return _compat.bind(eqn.primitive, _restore_inputs(eqn, invals), params)


@register_higher_order("scan")
def _scan(eqn: Any, invals: list, ctx: AmpContext) -> Any:
    """Scan: the policy's rule for ``scan`` chooses the dtype of the carries.

    By default (see ``_rules.py``) float carries are narrowed to bfloat16 when
    that is the compute dtype, which removes the float32 residual stream of a
    scanned transformer, and keep their traced dtype otherwise. Consts and the
    stacked weights of checkpointed layers that the body only reads in the
    compute dtype are cast once, before the loop (:func:`_loop_casts`).
    """
    n_consts, n_carry = _compat.scan_carry_range(eqn.params)
    invals = _restore_inputs(eqn, invals)
    carry_vars = eqn.invars[n_consts : n_consts + n_carry]
    rule = ctx.policy.lookup(eqn.primitive, ctx.scopes)
    result = rule(
        ctx.compute_dtype,
        [v.aval.dtype for v in carry_vars],
        *invals[n_consts : n_consts + n_carry],
    )
    carry, _ = check_rule_result(result, eqn.primitive, rule, n_carry)
    dtypes = tuple(
        None if getattr(c, "dtype", None) == v.aval.dtype else c.dtype
        for c, v in zip(carry, carry_vars)
    )
    n_in = len(eqn.invars)
    in_dtypes = (None,) * n_consts + dtypes + (None,) * (n_in - n_consts - n_carry)
    out_dtypes = dtypes + (None,) * (len(eqn.outvars) - n_carry)
    # Held consts and xs: scan's partial evaluation forwards them as residuals.
    held = tuple(
        is_held(x) and not n_consts <= i < n_consts + n_carry
        for i, x in enumerate(invals)
    )
    params = dict(eqn.params)
    body = rewrite_jaxpr(params["jaxpr"], ctx, in_dtypes, out_dtypes, held)
    if body is None:
        return run_unchanged(eqn, invals, ctx)
    # Inputs the rewritten body only reads in a narrower dtype are cast once,
    # before the loop, and their casts leave the body (see _loop_casts).
    casts = _loop_casts(eqn, body, n_consts, n_carry)
    if any(d is not None for d in casts):
        replayed = _without_casts(body, casts)
        if replayed is not None:  # None: an open body would need consts
            body = replayed
            invals = [x if c is None else cast(x, c) for x, c in zip(invals, casts)]
    params["jaxpr"] = body
    invals[n_consts : n_consts + n_carry] = carry
    bparams = _compat.bind_params(eqn.primitive, params)
    return _compat.bind(eqn.primitive, invals, bparams)


def _loop_casts(eqn: Any, body: Any, n_consts: int, n_carry: int) -> tuple:
    """Per scan input: the dtype to cast it to once, before the loop, or None.

    A const or xs input that every use in the rewritten ``body`` converts to
    one narrower dtype (a float32 weight read only by bfloat16 matmuls) is cast
    before the loop, as a careful engineer casts parameters before
    ``lax.scan``:

    * consts: one cast instead of one per iteration (and one per iteration
      again in the backward pass); the low-precision copy is one array.
    * xs read only inside a user's ``jax.checkpoint`` (scanned, checkpointed
      layers): the loop casts each layer's weights twice (forward and
      recomputation) in small kernels and stacks float32 weight gradients.
      Cast before the loop, the weights are cast once and their gradients
      are stacked in the compute dtype. The low-precision weight copy is then
      a residual (as in hand-written bfloat16 code), and the float32 gradient
      stack it replaces held as many bytes at the backward pass's peak.

    Other xs (a scan without checkpoint) keep the per-matmul casts that the
    backward pass recomputes from the float32 input, so that no weight copy is
    among the residuals. Carries are the ``"scan"`` rule's.
    """
    narrowed = _facts.narrowed_inputs(body)
    if all(d is None for d in narrowed):
        return narrowed
    recomputed = _facts.recomputed_inputs(eqn.params["jaxpr"])
    return tuple(
        d if i < n_consts or (i >= n_consts + n_carry and recomputed[i]) else None
        for i, d in enumerate(narrowed)
    )


def _without_casts(jaxpr: Any, dtypes: tuple) -> Any:
    """``jaxpr`` taking each input whose ``dtypes`` entry is not None in that
    dtype, with the ``convert_element_type`` equations of those inputs to it
    removed, in call-like bodies too (:func:`jaxamp._facts.narrowed_inputs`
    found that they are their only uses). Every other equation is replayed as
    it is, so the body computes exactly what it computed with the casts
    inside. Returns a jaxpr of the same kind, or None where an open jaxpr
    would need constants."""
    core, consts = _compat.jaxpr_parts(jaxpr)
    in_avals = _with_dtypes([v.aval for v in core.invars], dtypes)
    narrowed = {v for v, d in zip(core.invars, dtypes) if d is not None}
    try:
        new = _compat.trace_to_closed_jaxpr(
            lambda *args: _replay(core, consts, args, narrowed), in_avals
        )
    except _NeedsConsts:
        return None
    return _compat.like(jaxpr, new)


def _replay(core: Any, consts: list, args: Any, narrowed: set) -> list:
    """Bind ``core``'s equations on ``args``, skipping the casts of the
    ``narrowed`` inputs (see :func:`_without_casts`) and, for float16, the NaN
    factor of their overflow checks (the cast before the loop checks the
    whole stack once; the finite tests left in the body read the narrowed
    value and find nothing fresh). A checkpoint amp added to re-cast held
    inputs (:data:`RECAST_SCOPE`) whose casts all moved is inlined: it has
    nothing left to re-cast."""
    env = dict(zip(core.constvars, consts))
    env.update(zip(core.invars, args))
    read = lambda v: v.val if isinstance(v, _compat.Literal) else env[v]
    removed = set()  # outputs of the removed casts
    for eqn in core.eqns:
        invals = [read(v) for v in eqn.invars]
        hit = [not isinstance(v, _compat.Literal) and v in narrowed for v in eqn.invars]
        subs = [k for k, v in eqn.params.items() if _compat.is_jaxpr(v)]
        if eqn.primitive.name == "convert_element_type" and hit[0]:
            outs = invals  # already in the dtype it converted to
            removed.add(eqn.outvars[0])
        elif _is_check_factor(eqn, removed):
            outs = invals[:1]  # the cast before the loop carries the check
        else:
            params = dict(eqn.params)
            outs = None
            if any(hit) and subs:  # a call-like body: the casts are inside it
                (name,) = subs
                sub_core, sub_consts = _compat.jaxpr_parts(params[name])
                sub = {v for v, h in zip(sub_core.invars, hit) if h}
                if _only_recasts(eqn, sub_core, sub):
                    outs = _replay(sub_core, sub_consts, invals, sub)
                else:
                    dtypes = tuple(x.dtype if h else None for x, h in zip(invals, hit))
                    params[name] = _without_casts(params[name], dtypes)
                    if params[name] is None:
                        raise _NeedsConsts
            if outs is None:
                with _compat.eqn_context(eqn):
                    bparams = _compat.bind_params(eqn.primitive, params)
                    outs = _compat.bind(eqn.primitive, invals, bparams)
                if not eqn.primitive.multiple_results:
                    outs = [outs]
        env.update(zip(eqn.outvars, outs))
    return [read(v) for v in core.outvars]


def _is_check_factor(eqn: Any, removed: set) -> bool:
    """``eqn`` multiplies the result of a removed cast by its overflow check's
    NaN-or-1 factor (:func:`jaxamp._overflow.poison`)."""
    return (
        eqn.primitive.name == "mul"
        and not isinstance(eqn.invars[0], _compat.Literal)
        and eqn.invars[0] in removed
        and _overflow.CHECK_SCOPE in _compat.scope_names(eqn)
    )


def _only_recasts(eqn: Any, sub_core: Any, moved: set) -> bool:
    """``eqn`` is a re-casting checkpoint of amp's (not a user's) and every
    input it re-casts is among the ``moved`` ones."""
    if eqn.primitive.name not in ("remat2", "checkpoint"):
        return False
    if RECAST_SCOPE not in _compat.scope_names(eqn):
        return False
    recast = _facts.narrowed_inputs(sub_core)
    return all(v in moved for v, d in zip(sub_core.invars, recast) if d is not None)


class _NeedsConsts(Exception):
    """An open sub-jaxpr would need constants after removing its casts."""


@register_higher_order("shard_map")
def _shard_map(eqn: Any, invals: list, ctx: AmpContext) -> Any:
    # The body is traced in shard_map's own context: manual mesh axes bound.
    token = _facts.no_wide_results(not _compat.wide_products_in_manual_code())
    try:
        with _compat.shard_map_context(eqn.params):
            new_params = _rewrite_params(eqn.params, ctx)
    finally:
        _facts.allow_wide_results(token)
    if new_params is None:
        return run_unchanged(eqn, invals, ctx)
    params = _compat.bind_params(eqn.primitive, new_params)
    return _compat.bind(eqn.primitive, _restore_inputs(eqn, invals), params)


def _amp_closed_jaxpr(jaxpr: Any, consts: list, ctx: AmpContext) -> tuple[Any, list]:
    new = rewrite_jaxpr(_compat.ClosedJaxpr(jaxpr, consts), ctx)
    return _compat.jaxpr_parts(new)


@register_higher_order("custom_jvp_call")
def _custom_jvp_call(eqn: Any, invals: list, ctx: AmpContext) -> Any:
    """custom_jvp: the primal and the user's jvp rule are both rewritten.

    Dtypes flow through as for ``jit``: the primal body is rewritten for the
    dtypes its inputs have now (a bfloat16 activation entering
    ``jax.nn.relu`` stays bfloat16), and the jvp rule, traced by JAX at the
    original dtypes, is rewritten for the same input dtypes (tangents share
    their primal's dtype) and made to return the primal's output dtypes.
    """
    params = dict(eqn.params)
    n_consts = params["num_consts"]
    in_dtypes = _changed_dtypes(invals, eqn.invars)
    call = rewrite_jaxpr(params["call_jaxpr"], ctx, in_dtypes, FREE)
    core, _ = _compat.jaxpr_parts(call)
    out_dtypes = _changed_dtypes(core.outvars, eqn.outvars)
    params["call_jaxpr"] = call
    user_jvp = params["jvp_jaxpr_fun"]
    primal_in = in_dtypes[n_consts:]

    def amp_jvp(*zeros):
        # zeros: which input tangents are symbolic zeros; the jvp jaxpr takes
        # (primals, nonzero tangents) and returns (primals, nonzero tangents).
        jvp_jaxpr, jvp_consts, out_zeros, *rest = user_jvp.call_wrapped(*zeros)
        jin = primal_in + tuple(d for d, z in zip(primal_in, zeros) if not z)
        jout = out_dtypes + tuple(d for d, z in zip(out_dtypes, out_zeros) if not z)
        new = rewrite_jaxpr(_compat.ClosedJaxpr(jvp_jaxpr, jvp_consts), ctx, jin, jout)
        return (*_compat.jaxpr_parts(new), out_zeros, *rest)

    params["jvp_jaxpr_fun"] = _compat.wrap_fun(amp_jvp, user_jvp)
    bparams = _compat.bind_params(eqn.primitive, params)
    return _compat.bind(eqn.primitive, invals, bparams)


def _changed_dtypes(values: list, like_vars: list) -> tuple:
    """Per value: its dtype where it differs from ``like_vars``' traced one."""
    return tuple(
        None if d == v.aval.dtype else d
        for d, v in zip((_value_dtype(x) for x in values), like_vars)
    )


def _value_dtype(x: Any) -> Any:
    aval = getattr(x, "aval", None)  # a jaxpr Var
    return aval.dtype if aval is not None else dtype_of(x)


@register_higher_order("custom_vjp_call")
def _custom_vjp_call(eqn: Any, invals: list, ctx: AmpContext) -> Any:
    params = dict(eqn.params)
    params["call_jaxpr"] = rewrite_jaxpr(params["call_jaxpr"], ctx)
    user_fwd, user_bwd = params["fwd_jaxpr_thunk"], params["bwd"]

    def amp_fwd(*nonzeros):
        fwd_jaxpr, fwd_consts = user_fwd.call_wrapped(*nonzeros)
        return _amp_closed_jaxpr(fwd_jaxpr, fwd_consts, ctx)

    def amp_bwd(*args):
        return _amp_call(user_bwd.call_wrapped, args, ctx)

    params["fwd_jaxpr_thunk"] = _compat.wrap_fun(amp_fwd, user_fwd)
    params["bwd"] = _compat.wrap_fun(amp_bwd, user_bwd)
    bparams = _compat.bind_params(eqn.primitive, params)
    return _compat.bind(eqn.primitive, _restore_inputs(eqn, invals), bparams)


def _amp_call(fn: Callable, args: tuple, ctx: AmpContext) -> Any:
    """Call ``fn(*args)`` with its computation rewritten under ``ctx``.

    Only array arguments are traced; the others (``SymbolicZero`` cotangents of
    a ``symbolic_zeros=True`` rule, None, Python values) reach ``fn`` exactly
    as JAX passes them. The result may be any pytree (a bwd rule returns a list
    of cotangents, and since JAX 0.11 a ``(cotangents, logs)`` pair); leaves
    that are not arrays (symbolic zeros, None) pass through unchanged.
    """
    meta: dict[str, Any] = {}
    traced = [i for i, a in enumerate(args) if isinstance(a, jax.Array)]

    def arrays_only(*xs):
        full = list(args)
        for i, x in zip(traced, xs):
            full[i] = x
        leaves, meta["tree"] = jax.tree_util.tree_flatten(fn(*full))
        meta["others"] = {
            i: x for i, x in enumerate(leaves) if not isinstance(x, jax.Array)
        }
        meta["n"] = len(leaves)
        return [x for x in leaves if isinstance(x, jax.Array)]

    in_args = [args[i] for i in traced]
    closed = _compat.trace_to_closed_jaxpr(
        arrays_only, [jax.typeof(a) for a in in_args]
    )
    core, consts = _compat.jaxpr_parts(closed)
    with cast_cache():
        outs = eval_jaxpr(core, consts, in_args, ctx)
        outs = iter([restore(x, v.aval) for x, v in zip(outs, core.outvars)])
    others = meta["others"]
    leaves = [others[i] if i in others else next(outs) for i in range(meta["n"])]
    return jax.tree_util.tree_unflatten(meta["tree"], leaves)
