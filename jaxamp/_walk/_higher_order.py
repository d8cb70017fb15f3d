"""Registry: higher-order primitive -> how its sub-jaxprs are rewritten.

Sub-jaxprs are rewritten by re-tracing the interpreter over their avals, and
the same primitive is re-bound with the new jaxpr, so shardings, donation,
layouts, remat policies and any parameter JAX adds later stay valid. Rewrites
are cached per (sub-jaxpr, policy value, compute dtype, scopes, signature): a
jitted layer called N times is rewritten once, and once for every ``amp`` that
wraps it with an equal policy.

* ``jit``/``pjit``/``closed_call``/``remat2``: dtypes flow through, as if the
  body were inlined (see :func:`_call`).
* ``scan``: the policy's ``"scan"`` rule chooses the carry dtype; inputs that
  the rewritten body only reads in a narrower dtype are cast before the loop
  (``_scan_hoist.py``).
* ``while``, ``cond``, ``shard_map``: identical input and output avals.
* ``custom_jvp_call`` / ``custom_vjp_call``: the primal is rewritten *and* the
  user's jvp / fwd / bwd rules are wrapped so that they still run under
  ``jax.grad`` (in mixed precision too), never inlined away.

A primitive with sub-jaxprs that is not registered here (e.g. ``pallas_call``)
runs unchanged, with its inputs restored to their traced dtypes.

Each registration is one entry of the registry in ``_base/_structure.py``:
the rewrite rule, the primitive's description (which operands feed which
sub-jaxpr inputs, carries, trip count, what kind of call it is, how to
evaluate it) and, for ``scan``, its carries' entry in the default policy.
The walk, the policies, the value facts, the scan-input hoist,
``find_overflows``, the FLOP counter, the reports, the chunked optimizer and
the attention matcher read it there when they run. Adding a higher-order
primitive is one ``register_higher_order`` call (``_register.py``; the
built-in ones here, or in user code); :func:`unregister_higher_order` removes
one.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import _compat
from .._base import _state, _structure
from .._base._cast import cast_cache, narrow_sources, restore
from .._base._dtypes import dtype_of
from .._base._structure import Structure, SubJaxpr, describe_call
from .._policy._checkpoint import (
    offloads,
    policy_cases,
    saving_amax,
    store_checkpoint,
)
from .._policy._compressed import is_held, recomputable, store_compressed
from .._policy._lookup import AmpPolicy
from .._policy._residual_format import compressible
from .._policy._rules import narrow_bfloat16_carries
from .._values import _facts
from ._loop import (
    AmpContext,
    check_rule_result,
    decide,
    eval_jaxpr,
    restore_inputs,
    run_unchanged,
)
from ._register import higher_order_rules as higher_order_rules
from ._register import register_higher_order as register_higher_order
from ._register import unregister_higher_order as unregister_higher_order
from ._scan_hoist import hoist_loop_inputs, with_dtypes

# sub-jaxpr -> {context key: (rewritten jaxpr, recorder)}. Keyed weakly by the
# jaxpr object (jit caches its traces, so one jitted layer called N times is
# rewritten once) and by the policy's value (AmpPolicy.value_key: amp wrapping
# it again with an equal policy reuses the rewrite). The recorder is the copy
# of the policy (the policy itself where it is keyed by identity) that the
# rewrite is traced under and that its rules traced later keep (a custom_jvp's
# jvp under jax.grad): what it is asked is replayed into the policy of each
# use, so warn_unmatched warns as for a rewrite of its own.
_REWRITES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


FREE = "free"  # out_dtypes: outputs keep whatever dtype the rewritten body gives


def rewrite_jaxpr(
    jaxpr: Any,
    ctx: AmpContext,
    in_dtypes: tuple | None = None,
    out_dtypes: tuple | str | None = None,
    held: tuple[bool, ...] = (),
    widened: tuple[bool, ...] = (),
) -> Any:
    """``jaxpr`` rewritten under ``ctx``; by default with identical in/out avals.

    Rewrites are cached per sub-jaxpr, context and signature: a body called
    many times is rewritten once.

    Args:
        jaxpr: a sub-jaxpr parameter of a higher-order equation (a
            ``ClosedJaxpr`` or an open ``Jaxpr``).
        ctx: the walk's context, as a higher-order rule receives it.
        in_dtypes: one dtype per input (None keeps the traced dtype), where a
            rule changes the signature (a loop's carries); None: all traced.
        out_dtypes: the same per output; ``"free"`` lets outputs leave in
            the dtype the body computes them in (call-like primitives).
        held: per input, whether it is bound to a held value (an argument of
            the amp'd function: :func:`jaxamp._policy._compressed.is_held`),
            which JAX's partial evaluation forwards as a residual.
        widened: per input given in a narrower dtype (``in_dtypes``) that
            holds the traced, wider value: the body reads it widened where it
            needs the wider dtype (:func:`narrow_sources`).

    Returns:
        A jaxpr of the same kind (closed or open), or None when an open jaxpr
        would need constants it cannot carry (the caller then runs the
        equation unchanged).
    """
    try:
        per_jaxpr = _REWRITES.setdefault(jaxpr, {})
    except TypeError:  # not weak-referenceable: no caching
        per_jaxpr = {}
    # The value facts of the outputs' uses, as the enclosing equation's analysis
    # found them (None for a jaxpr it did not see, e.g. a jvp rule's).
    edge = (ctx.facts or _facts.UNKNOWN).boundary_for(jaxpr)
    state = _state.current()
    modes = (state.recomputed, state.residuals_off)
    # The registry's generation: a rewrite made before a higher-order primitive
    # was (un)registered is not served after it.
    key = (ctx.key, in_dtypes, out_dtypes, held, edge, modes, widened)
    key += (_structure.generation(),)
    if key not in per_jaxpr:
        # Shared by equal policies (keyed by value, not by the policy itself):
        # traced under a copy, which records what it is asked, also by the
        # rules traced later (a custom_jvp's jvp under jax.grad).
        shared = key[0][0] is not ctx.policy
        recorder = AmpPolicy(ctx.policy) if shared else ctx.policy
        own = dataclasses.replace(ctx, policy=recorder)
        new = _retrace(jaxpr, own, in_dtypes, out_dtypes, held, edge, widened)
        per_jaxpr[key] = (_compat.like(jaxpr, new), recorder)
    rewritten, recorder = per_jaxpr[key]
    ctx.policy.replay(recorder)
    # A rule traced later under another amp's walk with an equal policy (JAX
    # reuses the rule's trace for it): that amp's policy records it too.
    walking = state.recording
    if walking is not None and walking is not ctx.policy:
        if walking.value_key == key[0][0]:
            walking.replay(recorder)
    return rewritten


def _retrace(
    jaxpr: Any,
    ctx: AmpContext,
    in_dtypes=None,
    out_dtypes=None,
    held=(),
    edge=None,
    widened=(),
) -> Any:
    core, consts = _compat.jaxpr_parts(jaxpr)
    in_avals = with_dtypes([v.aval for v in core.invars], in_dtypes)
    free = isinstance(out_dtypes, str) and out_dtypes == FREE
    out_avals = [v.aval for v in core.outvars]
    if not free:
        out_avals = with_dtypes(out_avals, out_dtypes)

    def amp_body(*args):
        # A fresh cast cache per trace: a cast made in this trace must never be
        # served to another one (it would leak a tracer).
        with cast_cache():
            outs = eval_jaxpr(
                core, consts, args, ctx, held, boundary=edge, widened=widened
            )
            if free:
                return outs
            return [restore(x, a) for x, a in zip(outs, out_avals)]

    return _compat.trace_to_closed_jaxpr(amp_body, in_avals)


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
    "jit",
    "pjit",
    "closed_call",
    "core_call",
    describe=functools.partial(describe_call, dtypes_flow=True),
)
@register_higher_order(
    "remat2",
    "checkpoint",
    describe=functools.partial(describe_call, dtypes_flow=True, recomputed=True),
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
    invals, _, widened = narrow_sources(invals)
    in_dtypes = _changed_dtypes(invals, eqn.invars)
    params = dict(eqn.params)
    # Held inputs stay held through a jit; inside a user's checkpoint its own
    # policy decides what is saved (a dots_saveable policy must see the dots).
    structure = _structure.describe(eqn)
    remat = structure is not None and structure.recomputed
    # With a residual format: the values a checkpoint saves (its inputs, what
    # its policy names) each by the rule (_policy/_checkpoint.py), or all
    # inputs of a call cheap and safe to recompute (jax.nn.silu), are saved
    # compressed and the body recomputed from them (_policy/_compressed.py).
    fmt = ctx.residual_format
    saves = remat and "save" in policy_cases(params.get("policy"), params[name])
    stored = fmt is not None and (saves or _worth_storing(invals))
    stored = stored and (remat or recomputable(params[name]))
    stored = stored and not (remat and offloads(params.get("policy"), params[name]))
    held = () if remat or stored else tuple(map(is_held, invals))
    with _state.recomputing(remat or stored):
        params[name] = rewrite_jaxpr(
            params[name], ctx, in_dtypes, FREE, held, widened if any(widened) else ()
        )
    if params[name] is None:
        return run_unchanged(eqn, invals, ctx)
    if stored and remat:
        outs = store_checkpoint(eqn, params[name], invals, fmt, ctx.scopes)
        if outs is not None:
            return outs
    if remat and "checkpoint_amax" not in ctx.pipeline.off:
        # the recompute scales by the forward's amaxes
        params["policy"] = saving_amax(params.get("policy"), params[name])
    return _bind_stored(eqn.primitive, params, invals, fmt if stored else None)


def _bind_stored(prim: Any, params: dict, invals: list, fmt: Any) -> Any:
    """Bind ``prim`` with its rewritten ``params``; with a residual format
    ``fmt`` (None: none), as ``store_compressed`` stores it where it can."""
    bind = functools.partial(_bind_list, prim, _compat.bind_params(prim, params))
    if fmt is not None:
        outs = store_compressed(bind, invals, fmt)
        if outs is not None:
            return outs
    return bind(*invals)


def _bind_list(prim: Any, params: dict, *invals: Any) -> Any:
    return _compat.bind(prim, invals, params)


def _worth_storing(invals: list) -> bool:
    """Some input would be stored compressed (not held, compressible)."""
    return any(compressible(x) and not is_held(x) for x in invals)


def _describe_while(eqn: Any) -> Structure:
    # Operands: (cond consts, body consts, carries); outputs: the carries.
    cn, bn = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
    n_carry = len(eqn.invars) - cn - bn
    carry = tuple(range(cn + bn, len(eqn.invars)))
    cond = SubJaxpr(eqn.params["cond_jaxpr"], tuple(range(cn)) + carry, (None,))
    body = SubJaxpr(
        eqn.params["body_jaxpr"],
        tuple(range(cn, cn + bn)) + carry,
        tuple(range(n_carry)),
        tuple((k, bn + k) for k in range(n_carry)),
    )
    return Structure((cond, body), trips=None)


def _run_while(eqn: Any, invals: list, eval_sub: Callable) -> list:
    cond, body = _describe_while(eqn).subs
    cn, bn = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
    carry = invals[cn + bn :]
    while bool(eval_sub(cond.jaxpr, invals[:cn] + carry)[0]):
        carry = eval_sub(body.jaxpr, invals[cn : cn + bn] + carry)
    return carry


def _describe_cond(eqn: Any) -> Structure:
    # Operand 0 is the branch index; the others are every branch's inputs.
    ins, outs = tuple(range(1, len(eqn.invars))), tuple(range(len(eqn.outvars)))
    branches = eqn.params["branches"]
    return Structure(tuple(SubJaxpr(b, ins, outs) for b in branches), exclusive=True)


def _run_cond(eqn: Any, invals: list, eval_sub: Callable) -> list:
    branches = eqn.params["branches"]
    i = int(np.clip(int(invals[0]), 0, len(branches) - 1))
    return eval_sub(branches[i], invals[1:])


@register_higher_order("cond", describe=_describe_cond, run=_run_cond)
@register_higher_order("while", describe=_describe_while, run=_run_while)
def rewrite_subjaxprs(eqn: Any, invals: list, ctx: AmpContext) -> Any:
    """The rewrite rule of a primitive whose sub-jaxprs keep their signatures:
    each sub-jaxpr parameter rewritten (:func:`rewrite_jaxpr`, identical input
    and output avals), the primitive bound again with the same parameters
    otherwise.

    Args:
        eqn: the higher-order equation.
        invals: its operands as the walk holds them (possibly cast).
        ctx: the walk's context, as the rule receives it.

    Returns:
        The equation's outputs, in the dtypes it declares; where a sub-jaxpr
        cannot be rewritten (an open jaxpr that would need constants), the
        equation runs unchanged on its traced dtypes.
    """
    new_params = _rewrite_params(eqn.params, ctx)
    if new_params is None:
        return run_unchanged(eqn, invals, ctx)
    params = _compat.bind_params(eqn.primitive, new_params)
    return _compat.bind(eqn.primitive, restore_inputs(eqn, invals), params)


def _describe_scan(eqn: Any) -> Structure:
    # The body takes (consts, carries, one slice of each xs) and gives
    # (carries, one slice of each ys): operands and outputs in order.
    n_consts, n_carry = _compat.scan_carry_range(eqn.params)
    n_in, n_out = len(eqn.invars), len(eqn.outvars)
    body = SubJaxpr(
        eqn.params["jaxpr"],
        tuple(range(n_in)),
        tuple(range(n_out)),
        tuple((c, n_consts + c) for c in range(n_carry)),
        sliced=tuple(range(n_consts + n_carry, n_in)),
        stacked=tuple(range(n_carry, n_out)),
    )
    length = eqn.params.get("length", 1)
    return Structure((body,), trips=length, reverse=bool(eqn.params["reverse"]))


def _run_scan(eqn: Any, invals: list, eval_sub: Callable) -> list:
    n_consts, n_carry = _compat.scan_carry_range(eqn.params)
    body = eqn.params["jaxpr"]
    length, reverse = eqn.params["length"], eqn.params["reverse"]
    c, carry = invals[:n_consts], invals[n_consts : n_consts + n_carry]
    xs = invals[n_consts + n_carry :]
    ys = []
    for t in range(length - 1, -1, -1) if reverse else range(length):
        outs = eval_sub(body, c + carry + [x[t] for x in xs])
        carry, y = outs[:n_carry], outs[n_carry:]
        ys.append(y)
    if reverse:
        ys.reverse()
    n_ys = len(eqn.outvars) - n_carry
    stacked = [jnp.stack([y[k] for y in ys]) for k in range(n_ys)] if ys else []
    if not ys:  # zero-length scan: empty stacks of the declared avals
        stacked = [jnp.zeros(v.aval.shape, v.aval.dtype) for v in eqn.outvars[n_carry:]]
    return carry + stacked


# The policy's entry for the loop chooses the dtype of its carries.
@register_higher_order(
    "scan",
    describe=_describe_scan,
    run=_run_scan,
    default_rule=narrow_bfloat16_carries,
)
def _scan(eqn: Any, invals: list, ctx: AmpContext) -> Any:
    """Scan: the policy's rule for ``scan`` chooses the dtype of the carries.

    By default (``_rules.narrow_bfloat16_carries``) float carries are narrowed
    to bfloat16 when that is the compute dtype, which removes the float32
    residual stream of a scanned transformer, and keep their traced dtype
    otherwise. Consts and the stacked weights of checkpointed layers that the
    body only reads in the compute dtype are cast once, before the loop
    (:func:`jaxamp._walk._scan_hoist.loop_casts`). Stacked inputs held in a
    narrower dtype than traced (bfloat16 parameters) enter the loop as they
    are (:func:`jaxamp._base._cast.narrow_sources`).
    """
    n_consts, n_carry = _compat.scan_carry_range(eqn.params)
    invals = restore_inputs(eqn, invals)
    carry_vars = eqn.invars[n_consts : n_consts + n_carry]
    rule = ctx.policy.lookup(eqn.primitive, ctx.scopes)
    rc = ctx.rule_context([v.aval.dtype for v in carry_vars], ctx.scopes, ctx.facts)
    result = decide(rule, rc, *invals[n_consts : n_consts + n_carry])
    carry, _ = check_rule_result(result, eqn.primitive, rule, n_carry)
    dtypes = tuple(
        None if getattr(c, "dtype", None) == v.aval.dtype else c.dtype
        for c, v in zip(carry, carry_vars)
    )
    n_in = len(eqn.invars)
    # Stacked inputs held narrower than traced (bfloat16 parameters) enter the
    # loop as they are; the body widens the slice it reads where it needs to.
    # Consts keep their traced dtype: the transposed loop accumulates their
    # cotangent across iterations, which must not be in bfloat16.
    xs = range(n_consts + n_carry, n_in)
    invals, xs_dtypes, widened = narrow_sources(invals, xs)
    in_dtypes = (None,) * n_consts + dtypes + xs_dtypes[xs.start :]
    out_dtypes = dtypes + (None,) * (len(eqn.outvars) - n_carry)
    # Held consts and xs: scan's partial evaluation forwards them as residuals.
    held = tuple(
        is_held(x) and not n_consts <= i < n_consts + n_carry
        for i, x in enumerate(invals)
    )
    params = dict(eqn.params)
    widened = widened if any(widened) else ()
    body = rewrite_jaxpr(params["jaxpr"], ctx, in_dtypes, out_dtypes, held, widened)
    if body is None:
        return run_unchanged(eqn, invals, ctx)
    invals[n_consts : n_consts + n_carry] = carry
    # Inputs the rewritten body only reads in a narrower dtype are cast once,
    # before the loop, and weights an 8-bit rule quantizes in it are quantized
    # before it (one scale per layer of a stacked weight): _scan_hoist.py.
    body, invals, params = hoist_loop_inputs(
        eqn, body, invals, {**params, "jaxpr": body}, ctx.pipeline.off
    )
    bparams = _compat.bind_params(eqn.primitive, params)
    return _compat.bind(eqn.primitive, invals, bparams)


def _describe_shard_map(eqn: Any) -> Structure | None:
    # A call whose body runs once per shard of the axes it makes manual (as
    # _compat.shard_map_context reads them), on per-shard shapes.
    structure = describe_call(eqn)
    if structure is None:
        return None
    mesh = eqn.params["mesh"]
    axes = eqn.params.get("newly_manual_axes", mesh.axis_names)
    copies = float(np.prod([mesh.shape[a] for a in axes], dtype=float))
    return dataclasses.replace(structure, copies=copies)


# Evaluated by binding it: the body needs shard_map's mesh and axis names.
@register_higher_order("shard_map", describe=_describe_shard_map, run=None)
def _shard_map(eqn: Any, invals: list, ctx: AmpContext) -> Any:
    # The body is traced in shard_map's own context: manual mesh axes bound.
    with _compat.shard_map_context(eqn.params):
        new_params = _rewrite_params(eqn.params, ctx)
    if new_params is None:
        return run_unchanged(eqn, invals, ctx)
    params = _compat.bind_params(eqn.primitive, new_params)
    return _compat.bind(eqn.primitive, restore_inputs(eqn, invals), params)


def _amp_closed_jaxpr(jaxpr: Any, consts: list, ctx: AmpContext) -> tuple[Any, list]:
    new = rewrite_jaxpr(_compat.ClosedJaxpr(jaxpr, consts), ctx)
    return _compat.jaxpr_parts(new)


@register_higher_order("custom_jvp_call", describe=describe_call)
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
    # With a residual format the function's inputs are saved compressed and
    # its jvp rule runs in the backward pass on the decoded values.
    fmt = ctx.residual_format
    stored = fmt is not None and _worth_storing(invals)
    stored = stored and recomputable(params["call_jaxpr"])
    with _state.recomputing(stored):
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
        # JAX linearizes the rule itself: nothing in it is stored compressed.
        with _state.updated(residuals_off=True):
            jvp_closed = _compat.ClosedJaxpr(jvp_jaxpr, jvp_consts)
            new = rewrite_jaxpr(jvp_closed, ctx, jin, jout)
        return (*_compat.jaxpr_parts(new), out_zeros, *rest)

    params["jvp_jaxpr_fun"] = _compat.wrap_fun(amp_jvp, user_jvp)
    return _bind_stored(eqn.primitive, params, invals, fmt if stored else None)


def _changed_dtypes(values: list, like_vars: list) -> tuple:
    """Per value: its dtype where it differs from ``like_vars``' traced one."""
    return tuple(
        None if d == v.aval.dtype else d
        for d, v in zip((_value_dtype(x) for x in values), like_vars)
    )


def _value_dtype(x: Any) -> Any:
    aval = getattr(x, "aval", None)  # a jaxpr Var
    return aval.dtype if aval is not None else dtype_of(x)


@register_higher_order("custom_vjp_call", describe=describe_call)
def _custom_vjp_call(eqn: Any, invals: list, ctx: AmpContext) -> Any:
    params = dict(eqn.params)
    params["call_jaxpr"] = rewrite_jaxpr(params["call_jaxpr"], ctx)
    user_fwd, user_bwd = params["fwd_jaxpr_thunk"], params["bwd"]

    # The user's rules choose and read their residuals: nothing in them is
    # stored compressed.
    def amp_fwd(*nonzeros):
        fwd_jaxpr, fwd_consts = user_fwd.call_wrapped(*nonzeros)
        with _state.updated(residuals_off=True):
            return _amp_closed_jaxpr(fwd_jaxpr, fwd_consts, ctx)

    def amp_bwd(*args):
        with _state.updated(residuals_off=True):
            return _walk_call(user_bwd.call_wrapped, args, ctx)

    params["fwd_jaxpr_thunk"] = _compat.wrap_fun(amp_fwd, user_fwd)
    params["bwd"] = _compat.wrap_fun(amp_bwd, user_bwd)
    bparams = _compat.bind_params(eqn.primitive, params)
    return _compat.bind(eqn.primitive, restore_inputs(eqn, invals), bparams)


def _walk_call(fn: Callable, args: tuple, ctx: AmpContext) -> Any:
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
