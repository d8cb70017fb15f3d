"""The optimizer's update inside the backward pass: no gradient tree.

``update_in_backward(loss_fn, optimizer)`` traces the gradient of ``loss_fn``
and the optimizer's update (``optimizer.update`` and ``optax.apply_updates``)
to jaxprs, then evaluates the gradient's jaxpr with each transposed loop (a
``scan``, read through its registered description) that stacks the gradient
of a stacked parameter replaced: its body computes one layer's cotangent as
before, feeds it at once to the update of that layer's parameter and state
(the update's jaxpr evaluated on one slice, ``_chunked.evaluate_slice``) and
writes them into the stacked parameter and state carried through the loop, in
place (donated). The stacked gradient is
never formed; one layer's is. Parameters the loop does not stack (the
embedding, final norms) are updated from their gradients after the backward
pass. Same primitives on the same elements: the result is the unfused step's,
bit for bit (the rounding bits of ``low_precision_optimizer`` come from the
global element index).

Prior art: PyTorch's ``_apply_optimizer_in_backward`` and LOMO / AdaLomo (Lv
et al. 2023, arXiv 2306.09782) update each parameter from a hook on its
gradient; GaLore's per-layer weight updates (Zhao et al. 2024, arXiv
2403.03507, section 4.4).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from .. import _compat
from .._base._jaxpr import bind_eqn, evaluate, is_var, iter_equations
from . import _chunked
from ._layer_update import (
    CLIP_ERROR,
    Fused,
    fused_scan,
    gradient_deps,
    loop_of,
    plan_leaf,
)
from ._low_precision import whole_leaf_updates
from ._optax import SkipNonFiniteState


def update_in_backward(loss_fn: Callable, optimizer: Any) -> Callable:
    """A training step whose backward pass applies the optimizer's update.

    ``step = update_in_backward(loss_fn, optimizer)`` returns
    ``step(params, opt_state, *batch) -> (params, opt_state, loss)`` with the
    values of the ordinary step::

        loss, grads = jax.value_and_grad(loss_fn)(params, *batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)

    but the gradients of parameters stacked on a layers axis for ``lax.scan``
    never exist as a tree: the transposed loop updates each layer's slice of
    the parameter and its optimizer state as soon as the layer's cotangent is
    ready, in place when ``params`` and ``opt_state`` are donated
    (``jax.jit(step, donate_argnums=(0, 1))``). Other parameters are updated
    after the backward pass. A model without a scan works (every parameter
    is updated at the end). Run it under ``jax.jit``.

    Accepted optimizers: those whose update of a parameter reads only that
    parameter, its gradient and state, elementwise, and step scalars (SGD,
    momentum, Adam/AdamW, Lion, schedules, weight decay masks), plain or
    wrapped by :func:`jaxamp.low_precision_optimizer` (stochastic, Kahan or
    nearest rounding; bfloat16 or int8 state). A stacked parameter whose update
    is not elementwise per layer (Adafactor's factored moments, int8 blocks
    that straddle layers) is updated after the backward pass from its
    gradient, as in the ordinary step.

    A step whose gradients are not finite is not skipped: its NaN or inf
    reaches the parameters it touches, as with plain optax (bfloat16 has
    float32's range: a finite float32 loss gives finite gradients).

    Args:
        loss_fn: ``loss_fn(params, *batch) -> scalar`` (e.g. ``jaxamp.amp(f,
            compute_dtype=jnp.bfloat16)``).
        optimizer: an optax ``GradientTransformation``.

    Returns:
        ``step(params, opt_state, *batch) -> (params, opt_state, loss)``.

    Raises:
        TypeError: if ``loss_fn`` is not callable or ``optimizer`` is not a
            GradientTransformation.
        ValueError (when ``step`` is traced): for an update that reads other
            parameters' gradients (global-norm clipping), for a state of
            :func:`jaxamp.skip_nonfinite_updates` and for float16 compute:
            a step cannot be skipped once its first layer is updated.
    """
    if not callable(loss_fn):
        raise TypeError(
            f"update_in_backward(loss_fn): must be callable, got "
            f"{type(loss_fn).__name__}."
        )
    if not isinstance(optimizer, optax.GradientTransformation):
        raise TypeError(
            f"update_in_backward(optimizer): must be an optax "
            f"GradientTransformation (e.g. optax.adamw(1e-3)), got "
            f"{type(optimizer).__name__}."
        )

    def step(params, opt_state, *batch):
        return _step(loss_fn, optimizer, params, opt_state, batch)

    return step


def _step(loss_fn, optimizer, params, opt_state, batch):
    _refuse_skipping(opt_state)
    p, pdef = jax.tree_util.tree_flatten(params)
    s, sdef = jax.tree_util.tree_flatten(opt_state)
    n_p, n_s = len(p), len(s)

    def flat_grad(*leaves):
        value, g = jax.value_and_grad(lambda q: loss_fn(q, *batch))(
            pdef.unflatten(leaves)
        )
        return [value, *pdef.flatten_up_to(g)]

    avals = [jax.typeof(x) for x in p]
    grad = _compat.trace_to_closed_jaxpr(flat_grad, avals, "update_in_backward")
    core, consts = _compat.jaxpr_parts(grad)
    _refuse_float16(core)
    tx = whole_leaf_updates(optimizer)

    def flat_update(*leaves):
        g, st, q = leaves[:n_p], leaves[n_p : n_p + n_s], leaves[n_p + n_s :]
        params_ = pdef.unflatten(q)
        updates, new_state = tx.update(pdef.unflatten(g), sdef.unflatten(st), params_)
        new = optax.apply_updates(params_, updates)
        return [*pdef.flatten_up_to(new), *sdef.flatten_up_to(new_state)]

    g_avals = [v.aval for v in core.outvars[1:]]
    s_avals = [jax.typeof(x) for x in s]
    upd = _compat.trace_to_closed_jaxpr(flat_update, g_avals + s_avals + avals)
    ucore, uconsts = _compat.jaxpr_parts(upd)
    deps = gradient_deps(ucore, n_p)
    names = [
        jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_leaves_with_path(params)
    ]
    groups = _fusable(core, p, deps, ucore.outvars, names, n_s)
    outs = _run(core, consts, p, s, groups, ucore, uconsts, n_p)
    loss, new_p, new_s = outs
    return pdef.unflatten(new_p), sdef.unflatten(new_s), loss


def _refuse_skipping(opt_state: Any) -> None:
    leaves = jax.tree_util.tree_leaves(
        opt_state, is_leaf=lambda x: isinstance(x, SkipNonFiniteState)
    )
    if any(isinstance(x, SkipNonFiniteState) for x in leaves):
        raise ValueError(
            "update_in_backward(optimizer=skip_nonfinite_updates(...)): a step "
            "cannot be skipped once its first layer is updated. Pass the inner "
            "optimizer (bfloat16 compute: no loss scaling), or use the ordinary "
            "step to skip non-finite float16 steps."
        )


def _refuse_float16(core: Any) -> None:
    for eqn, _ in iter_equations(core):
        if eqn.primitive.name == "dot_general" and any(
            getattr(v.aval, "dtype", None) == jnp.float16 for v in eqn.invars
        ):
            raise ValueError(
                "update_in_backward(loss_fn): float16 compute needs dynamic loss "
                "scaling, whose skip of a non-finite step cannot be decided before "
                "the first layer is updated. Use compute_dtype=jnp.bfloat16, or "
                "the ordinary step with jaxamp.dynamic_scale_value_and_grad."
            )


def _param_reads(core: Any, n_p: int) -> dict:
    """var -> (parameter index, cast equations): the parameters' input
    variables and the ``convert_element_type`` chains of them."""
    reads = {core.invars[k]: (k, ()) for k in range(n_p)}
    for eqn in core.eqns:
        if eqn.primitive.name == "convert_element_type" and is_var(eqn.invars[0]):
            src = reads.get(eqn.invars[0])
            if src is not None:
                reads[eqn.outvars[0]] = (src[0], (*src[1], eqn))
    return reads


def _uses(core: Any) -> dict:
    """var -> indices of the equations reading it (``-1``: an output)."""
    uses: dict = {}
    for i, eqn in enumerate(core.eqns):
        for v in eqn.invars:
            if is_var(v):
                uses.setdefault(v, []).append(i)
    for v in core.outvars:
        if is_var(v):
            uses.setdefault(v, []).append(-1)
    return uses


def _stacked_source(core, k, producers, uses):
    """``(loop index, body output, casts)`` where gradient ``k`` is a stacked
    output of a loop (:func:`loop_of`: a ``scan``; through casts used once),
    else None."""
    v, chain = core.outvars[1 + k], []
    if not is_var(v) or uses.get(v) != [-1]:
        return None
    while v in producers:
        i, eqn = producers[v]
        if eqn.primitive.name == "convert_element_type":
            chain.insert(0, eqn)
            v = eqn.invars[0]
            if not is_var(v) or len(uses.get(v, [])) != 1:
                return None
            continue
        loop = loop_of(eqn)
        if loop is None:
            return None
        j = loop.stacked_body_output(eqn.outvars.index(v))
        return None if j is None else (i, j, tuple(chain))
    return None


def _fusable(core, p, deps, uouts, names, n_s) -> dict:
    """loop index -> :class:`Fused`: the stacked parameters each transposed
    loop can update in place, their state leaves and forwarded operands."""
    n_p = len(names)
    producers = {v: (i, e) for i, e in enumerate(core.eqns) for v in e.outvars}
    uses, reads = _uses(core), _param_reads(core, n_p)
    out_deps = [deps[((), v)] if is_var(v) else frozenset() for v in uouts]
    groups: dict = {}
    for k in range(n_p):
        src = _stacked_source(core, k, producers, uses)
        if src is None:
            continue
        i, m, chain = src
        if out_deps[k] - {k}:
            raise ValueError(CLIP_ERROR.format(what=f"parameter {names[k]}"))
        eqn = core.eqns[i]
        loop = loop_of(eqn)
        if p[k].ndim < 1 or p[k].shape[0] != loop.trips:
            continue
        tied = [v for v, (kk, _) in reads.items() if kk == k]
        late = any(j > i or j == -1 for v in tied for j in uses.get(v, ()))
        inside = [n for n, v in enumerate(eqn.invars) if v in tied]
        # The parameter read inside the loop only as one slice per layer.
        if late or any(n not in loop.sliced_operands for n in inside):
            continue
        states = [j for j in range(n_s) if out_deps[n_p + j] == {k}]
        g = groups.setdefault(i, Fused(eqn, loop))
        g.leaves.append(k)
        g.ys.append(m)
        g.chains.append(chain)
        g.states.append(states)
        for n in inside:
            g.forwarded[n] = reads[eqn.invars[n]]
    fused = {k for g in groups.values() for k in g.leaves}
    for m, d in enumerate(out_deps):
        if len(d) > 1 and d & fused:
            what = f"state leaf {m - n_p}" if m >= n_p else f"parameter {names[m]}"
            raise ValueError(CLIP_ERROR.format(what=what))
    return groups


def _run(core, consts, p, s, groups, ucore, uconsts, n_p):
    """Evaluate the gradient's jaxpr with each group's loop fused with its
    updates, then update the other parameters; ``(loss, new p, new s)``."""
    n_s = len(s)
    g_avals = [v.aval for v in core.outvars[1:]]
    zeros = [jnp.zeros(a.shape, a.dtype) for a in g_avals]
    plans: dict = {}
    for i, group in groups.items():
        keep = []
        for k, states in zip(group.leaves, group.states):
            upd = plan_leaf(ucore, uconsts, k, states, zeros, s, p, n_p, n_s)
            if upd is not None:
                keep.append(upd)
        if keep:
            plans[i] = (group, keep)
    new: dict = {}  # leaf index in [p..., s...] -> its updated value
    by_eqn = {id(core.eqns[i]): plan for i, plan in plans.items()}
    chains = [c for group, keep in plans.values() for c in _kept_chains(group, keep)]
    skipped = {id(e) for chain in chains for e in chain}  # casts done in the loop

    def eval_eqn(eqn, invals):
        if id(eqn) in skipped:
            return [None]
        plan = by_eqn.get(id(eqn))
        if plan is None:
            return bind_eqn(eqn, invals)
        return fused_scan(eqn, invals, *plan, p, s, new, n_p, n_s)

    outs = evaluate(core, consts, p, eval_eqn)
    loss, grads = outs[0], outs[1:]
    # The other parameters and state from their gradients; the fused ones'
    # outputs (computed here from zero gradients) are dead code for XLA.
    g_in = [zeros[k] if k in new else grads[k] for k in range(n_p)]
    rest = _chunked.evaluate_whole(ucore, uconsts, [*g_in, *s, *p], {})
    outs = [new.get(m, rest[m]) for m in range(n_p + n_s)]
    return loss, outs[:n_p], outs[n_p:]


def _kept_chains(group: Fused, keep: list) -> list:
    kept = {u.k for u in keep}
    return [c for k, c in zip(group.leaves, group.chains) if k in kept]
