"""Scan input hoisting: cast and quantize stacked weights once, before the loop.

The scan rule (``_higher_order.py``) rewrites a loop body first; this module
then finds the inputs that every use in the rewritten body only reads in one
narrower dtype (:func:`narrowed_inputs`: a float32 weight read only by bfloat16
matmuls) and, for consts and for xs read only inside a user's
``jax.checkpoint`` (:func:`recomputed_inputs`), moves their casts before the
loop (:func:`loop_casts`, :func:`without_casts`): one cast per step instead of
one per iteration, as a careful engineer casts parameters before ``lax.scan``.
Then the xs that an 8-bit rule quantizes in the body
(``_base/_jaxpr.prepare_operand``) are quantized before the loop, each layer
with its own scale (:func:`hoist_preparations`): once per step instead of in
the forward pass and again in the checkpoint's recompute.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from .. import _compat
from .._base import _overflow
from .._base._cast import cast
from .._base._dtypes import is_float
from .._base._jaxpr import bind_eqn, evaluate, is_prepare, is_var
from .._base._structure import describe
from .._policy._residuals import is_recast


def with_dtypes(avals: list, dtypes: tuple | None) -> list:
    """``avals`` with each dtype replaced where ``dtypes`` has one (not None)."""
    if dtypes is None:
        return avals
    return [
        a if d is None else a.update(dtype=d, weak_type=False)
        for a, d in zip(avals, dtypes)
    ]


def _leaf_uses(core: Any, var: Any, in_remat: bool = False):
    """``(eqn, in_remat)`` for every equation using ``var`` in ``core``, the
    bodies of call-like equations entered (not those of prepared-operand
    calls, which are uses); ``eqn`` is None where ``var`` is an output.
    ``in_remat``: the use is inside a ``jax.checkpoint`` body."""
    if any(v is var for v in core.outvars):
        yield None, in_remat
    for eqn in core.eqns:
        for pos, v in enumerate(eqn.invars):
            if v is not var:
                continue
            if eqn.primitive.name == "stop_gradient":  # a prepared operand's input
                yield from _leaf_uses(core, eqn.outvars[0], in_remat)
                continue
            # A call whose body can be re-typed (_base/_structure.py) is entered.
            structure = None if is_prepare(eqn) else describe(eqn)
            if structure is not None and structure.call and structure.dtypes_flow:
                inner = structure.subs[0].core
                yield from _leaf_uses(
                    inner, inner.invars[pos], in_remat or structure.recomputed
                )
            else:
                yield eqn, in_remat


def narrowed_inputs(jaxpr: Any) -> tuple[Any, ...]:
    """Per input of ``jaxpr``: the narrower float dtype that *every* use of it
    converts it to, else None.

    Read on a body amp has already rewritten: an input all of whose uses are
    ``convert_element_type`` to one dtype narrower than its own (a float32
    weight read only by bfloat16 matmuls, directly or inside ``jit``/``remat``
    bodies) can be passed in that dtype instead, with the same results. The
    finite tests of a float16 cast's overflow check do not count as reads: the
    cast before the loop carries the check (the body's own check of the
    narrowed value then finds nothing fresh). An input that is also an output,
    read by any other equation, or converted to two different dtypes gets None.

    Args:
        jaxpr: an open or closed jaxpr.

    Returns:
        One numpy dtype or None per input.
    """
    core, _ = _compat.jaxpr_parts(jaxpr)
    out = []
    for var in core.invars:
        seen = set()
        for eqn, _ in _leaf_uses(core, var):
            if eqn is not None and _overflow.is_check(eqn):
                continue  # the finite test of a cast's overflow check
            if eqn is None or eqn.primitive.name != "convert_element_type":
                seen = None
                break
            seen.add(np.dtype(eqn.params["new_dtype"]))
        src = var.aval.dtype
        ok = seen is not None and len(seen) == 1 and is_float(src)
        dtype = next(iter(seen)) if ok else None
        if dtype is not None and (
            not is_float(dtype) or dtype.itemsize >= np.dtype(src).itemsize
        ):
            dtype = None
        out.append(dtype)
    return tuple(out)


def recomputed_inputs(jaxpr: Any) -> tuple[bool, ...]:
    """Per input of ``jaxpr``: whether it is used, and only inside the body of
    a ``jax.checkpoint`` (``remat``), whose backward pass re-runs every use.

    Args:
        jaxpr: an open or closed jaxpr, as traced (before amp's rewrite, which
            adds checkpoints of its own).

    Returns:
        One bool per input.
    """
    core, _ = _compat.jaxpr_parts(jaxpr)
    out = []
    for var in core.invars:
        uses = list(_leaf_uses(core, var))
        out.append(bool(uses) and all(e is not None and r for e, r in uses))
    return tuple(out)


def loop_casts(body: Any, recomputed: tuple, n_consts: int, n_carry: int) -> tuple:
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
    among the residuals. The carries' dtypes are the policy's loop-carry rule's.
    ``recomputed``: per input, :func:`recomputed_inputs` of the traced body.
    """
    narrowed = narrowed_inputs(body)
    if all(d is None for d in narrowed):
        return narrowed
    return tuple(
        d if i < n_consts or (i >= n_consts + n_carry and recomputed[i]) else None
        for i, d in enumerate(narrowed)
    )


def hoist_loop_inputs(
    eqn: Any, body: Any, invals: list, params: dict, off: frozenset
) -> tuple[Any, list, dict]:
    """The rewritten scan's ``(body, invals, params)`` with its inputs cast
    (:func:`loop_casts`) and prepared (:func:`hoist_preparations`) before the
    loop, then cast again where preparing left a cast as an input's only use
    (an int8 weight quantized from float32, whose gradient is taken through
    its bfloat16 copy). ``off``: the pipeline's switched-off choices
    (``"loop_casts"``, ``"loop_quantization"``)."""
    n_consts, n_carry = _compat.scan_carry_range(params)
    recomputed = recomputed_inputs(eqn.params["jaxpr"])
    if "loop_casts" not in off:
        body, invals = _cast_pass(body, invals, recomputed, n_consts, n_carry)
    if "loop_quantization" in off:
        return body, invals, {**params, "jaxpr": body}
    n_in = len(invals)
    body, invals, params = hoist_preparations(
        body, invals, {**params, "jaxpr": body}, n_consts, n_consts + n_carry
    )
    if len(invals) == n_in or "loop_casts" in off:
        return body, invals, params
    kc = _compat.scan_carry_range(params)[0] - n_consts
    kx = len(invals) - n_in - kc
    rec = (*recomputed[:n_consts], *(False,) * kc, *recomputed[n_consts:])
    rec += (False,) * kx
    body, invals = _cast_pass(body, invals, rec, n_consts + kc, n_carry)
    return body, invals, {**params, "jaxpr": body}


def _cast_pass(body, invals, recomputed, n_consts, n_carry):
    """:func:`loop_casts` applied: the casts leave ``body`` and the inputs
    are cast before the loop (unchanged where an open body would need
    constants)."""
    casts = loop_casts(body, recomputed, n_consts, n_carry)
    if all(d is None for d in casts):
        return body, invals
    replayed = without_casts(body, casts)
    if replayed is None:
        return body, invals
    return replayed, [x if c is None else cast(x, c) for x, c in zip(invals, casts)]


def without_casts(jaxpr: Any, dtypes: tuple) -> Any:
    """``jaxpr`` taking each input whose ``dtypes`` entry is not None in that
    dtype, with the ``convert_element_type`` equations of those inputs to it
    removed, in call-like bodies too (:func:`narrowed_inputs`
    found that they are their only uses). Every other equation is replayed as
    it is, so the body computes exactly what it computed with the casts
    inside. Returns a jaxpr of the same kind, or None where an open jaxpr
    would need constants."""
    core, consts = _compat.jaxpr_parts(jaxpr)
    in_avals = with_dtypes([v.aval for v in core.invars], dtypes)
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
    inputs (``_residuals.is_recast``) whose casts all moved is inlined: it has
    nothing left to re-cast."""
    removed: set = set()  # outputs of the removed casts

    def replay_eqn(eqn: Any, invals: list) -> list:
        hit = [is_var(v) and v in narrowed for v in eqn.invars]
        if eqn.primitive.name == "convert_element_type" and hit[0]:
            removed.add(eqn.outvars[0])
            return invals  # already in the dtype it converted to
        if _is_check_factor(eqn, removed):
            return invals[:1]  # the cast before the loop carries the check
        subs = [k for k, v in eqn.params.items() if _compat.is_jaxpr(v)]
        if not (any(hit) and subs):
            return bind_eqn(eqn, invals)
        (name,) = subs  # a call-like body: the casts are inside it
        sub_core, sub_consts = _compat.jaxpr_parts(eqn.params[name])
        sub = {v for v, h in zip(sub_core.invars, hit) if h}
        if _only_recasts(eqn, sub_core, sub):
            # Under the checkpoint's name stack: the inlined equations keep
            # the user's named_scope path (their own is relative to it).
            with _compat.eqn_context(eqn):
                return _replay(sub_core, sub_consts, invals, sub)
        dtypes = tuple(x.dtype if h else None for x, h in zip(invals, hit))
        params = {**eqn.params, name: without_casts(eqn.params[name], dtypes)}
        if params[name] is None:
            raise _NeedsConsts
        return bind_eqn(eqn, invals, params)

    return evaluate(core, consts, args, replay_eqn)


def _is_check_factor(eqn: Any, removed: set) -> bool:
    """``eqn`` multiplies the result of a removed cast by its overflow check's
    NaN-or-1 factor (:func:`jaxamp._base._overflow.poison`)."""
    return (
        _overflow.is_factor(eqn) and is_var(eqn.invars[0]) and eqn.invars[0] in removed
    )


def _only_recasts(eqn: Any, sub_core: Any, moved: set) -> bool:
    """``eqn`` is a re-casting checkpoint of amp's (not a user's) and every
    input it re-casts is among the ``moved`` ones."""
    if not is_recast(eqn):
        return False
    recast = narrowed_inputs(sub_core)
    return all(v in moved for v, d in zip(sub_core.invars, recast) if d is not None)


class _NeedsConsts(Exception):
    """An open sub-jaxpr would need constants after removing its casts."""


def _prepares(core: Any, var: Any) -> bool:
    """``var`` is read by a prepared-operand call in ``core`` (or below)."""
    return any(e is not None and is_prepare(e) for e, _ in _leaf_uses(core, var))


def loop_preparations(body: Any, n_consts: int, first_xs: int) -> dict[int, Any]:
    """Per const (index below ``n_consts``) and xs input (index ``first_xs``
    on) of the rewritten scan ``body`` that an 8-bit rule quantizes in it:
    the prepared-operand call (``_base/_jaxpr.prepare_operand``) it reads,
    where every such call of that input (in the body or in the jit and
    checkpoint bodies it enters) is the same function. The input's other uses
    (the products' gradients) stay."""
    core, _ = _compat.jaxpr_parts(body)
    found = {}
    for i, var in enumerate(core.invars):
        if n_consts <= i < first_xs:
            continue  # a carry changes from one iteration to the next
        calls = [e for e, _ in _leaf_uses(core, var) if e is not None and is_prepare(e)]
        if calls and len({str(c.params["jaxpr"]) for c in calls}) == 1:
            found[i] = calls[0]
    return found


def hoist_preparations(
    body: Any, invals: list, params: dict, n_consts: int, first_xs: int
) -> tuple[Any, list, dict]:
    """The scan's ``(body, invals, params)`` with each prepared const and xs
    input (:func:`loop_preparations`) prepared once, before the loop (xs under
    ``jax.vmap`` over the stacked axis: a per-tensor scale becomes one scale
    per layer), the results passed as new consts and xs and read where the
    body prepared them.

    A scanned, checkpointed layer's weight is then quantized once per step
    (as Transformer Engine and a careful engineer quantize weights; the
    per-layer scale is what the body computed for the slice), not in the
    forward pass and again in the recompute, and the backward pass reads the
    8-bit stack; a weight every iteration reads (an RNN cell's) is quantized
    once, not once per iteration. Nothing changes where no input is prepared
    or an open body would need constants.
    """
    found = loop_preparations(body, n_consts, first_xs)
    if not found:
        return body, invals, params
    core, consts = _compat.jaxpr_parts(body)
    made: dict[bool, list] = {True: [], False: []}  # is a const -> values
    avals: dict[bool, list] = {True: [], False: []}
    for i, call in found.items():
        if i < n_consts:
            outs = bind_eqn(call, [invals[i]])
        else:
            outs = jax.vmap(lambda w, call=call: bind_eqn(call, [w]))(invals[i])
        made[i < n_consts].extend(jax.lax.stop_gradient(o) for o in outs)
        avals[i < n_consts].extend(v.aval for v in call.outvars)
    n, kc = len(core.invars), len(made[True])
    in_avals = [v.aval for v in core.invars]
    in_avals = [*in_avals[:n_consts], *avals[True], *in_avals[n_consts:], *avals[False]]

    def replay(*args):
        extra = [*args[n_consts : n_consts + kc], *args[n + kc :]]
        prepared, k = {}, 0
        for i, call in sorted(found.items()):  # consts first, as in extra
            prepared[core.invars[i]] = extra[k : k + len(call.outvars)]
            k += len(call.outvars)
        own = [*args[:n_consts], *args[n_consts + kc : n + kc]]
        return _replay_prepared(core, consts, own, prepared)

    try:
        new = _compat.like(body, _compat.trace_to_closed_jaxpr(replay, in_avals))
    except _NeedsConsts:
        new = None
    if new is None:
        return body, invals, params
    params = _compat.scan_params_with_inputs(params, kc, len(made[False]))
    invals = [*invals[:n_consts], *made[True], *invals[n_consts:], *made[False]]
    return new, invals, {**params, "jaxpr": new}


def _replay_prepared(core: Any, consts: list, args: Any, prepared: dict) -> list:
    """Bind ``core``'s equations on ``args``, a prepared-operand call of a
    ``prepared`` variable replaced by its prepared values. A jit body that
    holds such a call is inlined; a checkpoint's body takes the values as
    extra inputs (it stays a checkpoint)."""

    # stop_gradient outputs that only prepared-operand calls read
    only_prepared = {
        e.outvars[0]
        for e in core.eqns
        if e.primitive.name == "stop_gradient"
        and all(
            u is not None and is_prepare(u) for u, _ in _leaf_uses(core, e.outvars[0])
        )
    }

    def replay_eqn(eqn: Any, invals: list) -> list:
        if is_prepare(eqn) and is_var(eqn.invars[0]) and eqn.invars[0] in prepared:
            return list(prepared[eqn.invars[0]])
        stop = eqn.primitive.name == "stop_gradient" and is_var(eqn.invars[0])
        if stop and eqn.invars[0] in prepared:
            prepared[eqn.outvars[0]] = prepared[eqn.invars[0]]  # what it prepares
            if eqn.outvars[0] in only_prepared:
                return invals  # read by nothing once its calls are replaced
        structure = None if is_prepare(eqn) else describe(eqn)
        if structure is None or not (structure.call and structure.dtypes_flow):
            return bind_eqn(eqn, invals)  # a custom_vjp reads the weight as it is
        (name,) = [k for k, v in eqn.params.items() if _compat.is_jaxpr(v)]
        sub_core, sub_consts = _compat.jaxpr_parts(eqn.params[name])
        hit = {
            pos: prepared[v]
            for pos, v in enumerate(eqn.invars)
            if is_var(v) and v in prepared and _prepares(sub_core, sub_core.invars[pos])
        }
        if not hit:
            return bind_eqn(eqn, invals)
        if not structure.recomputed:  # jit, closed_call: inlined
            sub = {sub_core.invars[pos]: vals for pos, vals in hit.items()}
            with _compat.eqn_context(eqn):
                return _replay_prepared(sub_core, sub_consts, invals, sub)
        extra = [x for vals in hit.values() for x in vals]
        n = len(invals)

        def sub_body(*args):
            sub, k = {}, n
            for pos, vals in hit.items():
                sub[sub_core.invars[pos]] = args[k : k + len(vals)]
                k += len(vals)
            return _replay_prepared(sub_core, sub_consts, args[:n], sub)

        avals = [v.aval for v in sub_core.invars]
        avals += [jax.typeof(x) for x in extra]
        traced = _compat.trace_to_closed_jaxpr(sub_body, avals)
        new_sub = _compat.like(eqn.params[name], traced)
        if new_sub is None:
            raise _NeedsConsts
        return bind_eqn(eqn, [*invals, *extra], {**eqn.params, name: new_sub})

    return evaluate(core, consts, args, replay_eqn)
