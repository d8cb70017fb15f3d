"""The compiled analysis of :func:`jaxamp.precision_report` and its
per-iteration bookkeeping: the differential walk lowered as one function
(:func:`lower_walk`, :func:`run_walk`), the probed float32 gradient (zero
probes on the reduced-precision sites' outputs and their inputs'
cotangents), each site's local backward error, the first-order estimate of
each scope's share (its local errors propagated through the rest of the step:
the probed gradient re-run with them as probes, one scope at a time in a
``lax.map``; only past ``_precision_ablate.MAX_MEASURED`` scopes, to
shortlist the scopes the measured ranking runs), and a loop's stacked
per-iteration results turned into one site per iteration."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import _compat
from .._base._jaxpr import bind_eqn
from .._base._scopes import scope_path
from . import _precision_ablate
from ._precision_walk import (
    DiffVisitor,
    ProbeVisitor,
    Site,
    _float_inputs,
    _float_outs,
    amp_step,
    traverse,
)


def probe_shapes(core, consts, leaves, ctx, edge) -> ProbeVisitor:
    """The traversal run on avals: its sites' float output and input avals."""
    v = ProbeVisitor(None)
    jax.eval_shape(lambda *xs: traverse(v, core, consts, list(xs), ctx, edge), *leaves)
    return v


def probed_gradient(
    core, consts, leaves, wrt, ctx, edge, counts, with_params: bool = True
) -> Callable:
    """``G(params, probes, back) -> (loss, (gradient, cotangents))``: the
    float32 loss with ``probes`` added to the sites' float outputs, its
    gradient w.r.t. ``params`` (the leaves ``wrt``) with ``back`` added to
    the cotangents of the sites' float inputs (:class:`ProbeVisitor`;
    ``back[k]`` None for a site without one) and w.r.t. ``probes`` (every
    site's cotangent ``dL/dy``). With a scope's local errors as ``(probes,
    back)``, its change from the unprobed value is the change of the loss and
    of the gradient those errors cause through the rest of the step.

    Args:
        core: the float32 jaxpr of the flattened function (loss first).
        consts: its constants.
        leaves: its float32 inputs.
        wrt: indices of the leaves to differentiate (the parameters).
        ctx: the amp context (only its pipeline is read: the facts).
        edge: the facts boundary of the function's outputs.
        counts: :attr:`ProbeVisitor.counts` of a :func:`probe_shapes` pass.
        with_params: differentiate w.r.t. ``params`` too; without, the
            gradient is None (the cotangents alone skip the weight-gradient
            products of the backward pass).
    """
    argnums = (0, 1) if with_params else (1,)

    def loss(params, probes, back):
        args = list(leaves)
        for i, p in zip(wrt, params):
            args[i] = p
        v = ProbeVisitor(probes, back, counts)
        out = traverse(v, core, consts, args, ctx, edge)[0].astype(jnp.float32)
        return out + v.extra, out

    def G(params, probes, back):
        grads, out = jax.grad(loss, argnums, has_aux=True)(params, probes, back)
        return out, grads if with_params else (None, *grads)

    return G


def vjp_delta(site: Site, prim: list, g: list, scale: float) -> list:
    """``VJP_amp - VJP_32`` (float32, one array per float input) of
    ``site``'s equation at its float32 inputs (``prim``: the float ones), for
    cotangent ``g`` of its float outputs: the equation's local backward-pass
    error. ``scale`` (a float16 loss scale) multiplies ``g`` for amp's VJP
    and divides its result, as loss scaling does."""
    idx = _float_inputs(site)
    fo = _float_outs(site.y32)

    def call(fn: Callable) -> Callable:
        def f(*xs):
            args = list(site.x32)
            for i, x in zip(idx, xs):
                args[i] = x
            outs = fn(args)
            return [outs[i].astype(jnp.float32) for i in fo]

        return f

    _, v32 = jax.vjp(call(lambda a: bind_eqn(site.eqn, a)), *prim)
    _, va = jax.vjp(call(site.run_amp), *prim)
    ct32 = v32(list(g))
    cta = va([x * np.float32(scale) for x in g])
    return [
        a.astype(jnp.float32) / np.float32(scale) - b.astype(jnp.float32)
        for a, b in zip(cta, ct32)
    ]


def backward_deltas(
    sites: list[Site], cts: list, chosen: list[bool], scale: float
) -> list:
    """:func:`vjp_delta` of each site where ``chosen`` (None elsewhere, and
    for a site without float inputs or outputs); a site traced once in a
    loop has it per iteration (``vmap`` over its stacked values: traced
    once)."""
    out = []
    for st, g, c in zip(sites, cts, chosen):
        if not (c and _float_inputs(st) and _float_outs(st.y32)):
            out.append(None)
            continue
        idx = _float_inputs(st)
        if not st.stack:
            out.append(vjp_delta(st, [st.x32[i] for i in idx], g, scale))
            continue
        n = len(st.stack)
        flat = lambda v, n=n: v.reshape((-1, *v.shape[n:]))  # noqa: E731

        def one(xs_g, st=st, idx=idx):
            x32, g = xs_g
            one_site = dataclasses.replace(st, x32=x32, stack=())
            return vjp_delta(one_site, [x32[i] for i in idx], g, scale)

        got = jax.vmap(one)(([flat(x) for x in st.x32], [flat(x) for x in g]))
        out.append([d.reshape((*st.stack, *d.shape[1:])) for d in got])
    return out


def norms(sites: list[Site], deltas: list) -> list:
    """The L2 norm of each site's deltas (0 for None): a float32 scalar, or
    per iteration for a site traced once in a loop."""
    out = []
    for st, ds in zip(sites, deltas):
        if not ds:
            out.append(jnp.zeros(st.stack, jnp.float32))
            continue
        n = len(st.stack)
        sq = [jnp.sum(jnp.square(d), tuple(range(n, d.ndim))) for d in ds]
        out.append(jnp.sqrt(sum(sq)))
    return out


def with_share(site: Site, g: list | None) -> jax.Array:
    """The site's statistics (:func:`site_stats`) and its loss share
    ``|<g, local - y32>|`` (per iteration for a loop's site): ``(*stack, 6)``."""
    n = len(site.stack)
    share = jnp.zeros(site.stack, jnp.float32)
    for gi, d in zip(g or (), site.delta or ()):
        prod = gi.astype(jnp.float32) * d.astype(jnp.float32)
        share = share + jnp.sum(prod, tuple(range(n, d.ndim)))
    return jnp.concatenate([site.stats, jnp.abs(share)[..., None]], -1)


def scope_effects(names, sites, chosen, deltas, G, base) -> tuple[list, tuple]:
    """The scope paths (``names[k]``: site ``k``'s) of the reduced-precision
    sites and, per scope, the change of the loss and of the gradient its local
    errors cause through the rest of the step: the probed float32 gradient
    ``G(probes, back)`` (:func:`probed_gradient`, parameters bound) with that
    scope's local forward errors as ``probes`` and backward errors as
    ``back``, minus ``base`` (``G`` with zero probes: ``(loss, gradient)``).
    One evaluation per scope (``lax.map``: one body compiled, one scope's
    probes in memory at a time). Returns ``(loss change, <model total,
    change>, |change|^2, |model total|^2)``, the model total being the sum
    of the scopes' changes. Rounding errors are redrawn at amp's own point (a
    rounding is not differentiable), so the shares are of this model total,
    not of amp's measured error (whose size it matches, not its digits)."""
    scopes = list(dict.fromkeys(n for n, c in zip(names, chosen) if c))
    if not scopes:
        z = jnp.zeros(0, jnp.float32)
        return scopes, (z, z, z, jnp.zeros((), jnp.float32))
    member = [scopes.index(n) if c else -1 for n, c in zip(names, chosen)]
    loss0, g0 = base

    def one(s):
        def pick(k, vals):  # site k's values inside scope s, zeros elsewhere
            if member[k] < 0:
                return None
            on = (s == member[k]).astype(jnp.float32)
            return [v * on.astype(v.dtype) for v in vals]

        f = [pick(k, st.delta) for k, st in enumerate(sites)]
        b = [pick(k, d) for k, d in enumerate(deltas)]
        loss, (g, _) = G(f, b)
        return loss - loss0, [a - c for a, c in zip(g, g0)]

    d_loss, d_grad = jax.lax.map(one, jnp.arange(len(scopes)))
    total = [d.sum(0) for d in d_grad]
    model_sq = sum(jnp.sum(jnp.square(t)) for t in total)
    axes = lambda d: tuple(range(1, d.ndim))  # noqa: E731
    dots = sum(jnp.sum(t[None] * d, axes(d)) for t, d in zip(total, d_grad))
    sq = sum(jnp.sum(jnp.square(d), axes(d)) for d in d_grad)
    return scopes, (d_loss, dots, sq, model_sq)


def _place(o: int | None, it: Any) -> int:
    """An entry of :attr:`Site.order` with the iteration filled in."""
    if o is None:
        return next(it)
    return -o - 1 - next(it) if o < 0 else o  # a reversed loop: trips - 1 - t


def per_iteration(sites: list, stats: list, back: list) -> tuple[list, list, list]:
    """Sites traced once in a loop (statistics stacked per iteration) as one
    site per iteration, with their statistics and backward errors, in the
    order an unrolled walk visits them (:attr:`Site.order`)."""
    rows = []
    for st, row, b in zip(sites, stats, back):
        row, b = np.asarray(row, np.float64), np.asarray(b, np.float64)
        if not st.stack:
            rows.append((st.order, st, row, float(b)))
            continue
        for t in np.ndindex(*st.stack):
            it = iter(t)
            order = tuple(_place(o, it) for o in st.order)
            one = dataclasses.replace(st, iteration=(*st.iteration, *t))
            rows.append((order, one, row[t], float(b[t])))
    rows.sort(key=lambda r: r[0])
    return [r[1] for r in rows], [r[2] for r in rows], [r[3] for r in rows]


def estimated(effect: tuple) -> dict:
    """The first-order estimate's shares (:func:`scope_effects`):
    ``{"grad": {scope: share}, "loss": {scope: share}}``."""
    scopes, d_loss, dots, sq, model_sq = effect
    loss_err = float(np.sum(d_loss))
    grad = {
        k: float((2 * d - n) / model_sq) if model_sq else 0.0
        for k, d, n in zip(scopes, dots, sq)
    }
    loss = {
        k: float((abs(loss_err) - abs(loss_err - dl)) / abs(loss_err))
        if loss_err
        else 0.0
        for k, dl in zip(scopes, d_loss)
    }
    return {"grad": grad, "loss": loss}


class _ScopeVisitor(DiffVisitor):
    """:class:`DiffVisitor`'s sites without their statistics: what the
    ranking needs of the walk (which scopes amp runs in reduced precision)."""

    def leaf(self, eqn, facts, ctx, scopes, iteration, invals):
        x32, xa = [v[0] for v in invals], [v[1] for v in invals]
        y32 = bind_eqn(eqn, x32)
        ya = amp_step(eqn, facts, ctx, xa)
        site = Site(eqn, facts, ctx, scopes, iteration, x32, y32, y32, ya)
        site.order = (self.n,)
        self.n += 1
        self.sites.append(site)
        return list(zip(y32, ya))


def _chosen(sites: list, fmt: Callable) -> list[bool]:
    """Per site, whether amp runs it in reduced precision (``fmt(site)[1]``)
    with a float input and a float output: the sites probed and ranked."""
    return [
        bool(_float_outs(st.y32)) and bool(_float_inputs(st)) and fmt(st)[1]
        for st in sites
    ]


def _scope_box(sites: list, chosen: list, fmt: Callable) -> dict:
    """The scope paths of the ``chosen`` sites (``"scopes"``), those the
    ranking measures (``"measure"``), every site's path (``"paths"``), the
    formats per path (``"formats"``) and whether the first-order estimate
    shortlists the measured ones (``"shortlist"``)."""
    names = [scope_path(st.scopes) for st in sites]
    scopes = list(dict.fromkeys(n for n, c in zip(names, chosen) if c))
    formats: dict = {}
    for n, st, c in zip(names, sites, chosen):
        if c:
            formats.setdefault(n, set()).add(fmt(st)[0])
    short = len([s for s in scopes if s]) > _precision_ablate.MAX_MEASURED
    return dict(
        scopes=scopes,
        paths=sorted(set(names)),
        formats=formats,
        shortlist=short,
        measure=[] if short else scopes,
    )


def find_scopes(core, consts, leaves, ctx, edge, fmt) -> dict:
    """The walk traced on avals, without its statistics (no compile):
    :func:`lower_walk`'s ``box`` without the sites."""
    v = _ScopeVisitor(lambda site: fmt(site)[1])

    def run(*xs):
        pairs, cpairs = [(x, x) for x in xs], [(c, c) for c in consts]
        traverse(v, core, cpairs, pairs, ctx, edge)

    jax.eval_shape(run, *leaves)
    return _scope_box(v.sites, _chosen(v.sites, fmt), fmt)


def lower_walk(core, consts, leaves, wrt, ctx, edge, fmt, scale):
    """One function, lowered: the differential walk, the probed float32
    gradient (every site's cotangent), every reduced site's backward error
    and, past :data:`_precision_ablate.MAX_MEASURED` scopes only, each
    scope's first-order effect (:func:`scope_effects`: the probed gradient
    re-run with the scope's local errors as probes), which shortlists the
    scopes the ablation measures.

    Returns ``(lowered, box)``; ``box`` holds what the trace found: the sites
    (tracers until :func:`run_walk`), the scope paths of the reduced sites
    (``"scopes"``), those measured (``"measure"``), all paths (``"paths"``),
    the formats per path and whether the estimate ran (``"shortlist"``)."""
    box: dict = {}

    def run(xs):
        visitor = DiffVisitor(lambda site: fmt(site)[1])
        pairs, cpairs = [(x, x) for x in xs], [(c, c) for c in consts]
        traverse(visitor, core, cpairs, pairs, ctx, edge)
        sites = visitor.sites
        shapes = probe_shapes(core, consts, xs, ctx, edge)
        chosen = _chosen(sites, fmt)
        # Probes only where amp's equation differs from float32's.
        fp0 = [
            [jnp.zeros(a.shape, a.dtype) for a in sh] if c else None
            for sh, c in zip(shapes.shapes, chosen)
        ]
        bp0 = [
            [jnp.zeros(a.shape, jnp.float32) for a in sh] if c else None
            for sh, c in zip(shapes.in_shapes, chosen)
        ]
        box.update(_scope_box(sites, chosen, fmt), sites=sites)
        # The parameters' float32 gradient only for the first-order estimate
        # (the ranking compares against the float32 step's).
        G = probed_gradient(
            core, consts, xs, wrt, ctx, edge, shapes.counts, box["shortlist"]
        )
        params = [xs[i] for i in wrt]
        loss32, (g32, cts) = G(params, fp0, bp0)
        deltas = backward_deltas(sites, cts, chosen, scale)
        back = norms(sites, deltas)
        names = [scope_path(st.scopes) for st in sites]
        effect = None
        if box["shortlist"]:
            probed = lambda fp, bp: G(params, fp, bp)  # noqa: E731
            base = (loss32, g32)
            effect = scope_effects(names, sites, chosen, deltas, probed, base)[1]
        stats = [with_share(st, g) for st, g in zip(sites, cts)]
        return [loss32, back, stats, g32, effect]

    box["leaves"] = leaves
    return jax.jit(run).lower(leaves), box


def run_walk(lowered: Any, box: dict) -> tuple:
    """Compile and run :func:`lower_walk`'s function: the sites (their
    values concrete, one per loop iteration), their statistics, the float32
    gradient (None unless estimated), the float32 loss, the backward errors
    and the first-order effect ``(scopes, loss change, <model total,
    change>, |change|^2, |model total|^2)`` (None when not estimated)."""
    compiled = _compat.compile_analysis(lowered)
    loss32, back, stats, g32, effect = compiled(box["leaves"])
    sites, stats, back = per_iteration(box["sites"], stats, back)
    if effect is not None:
        d_loss, dots, sq, model_sq = (np.asarray(e, np.float64) for e in effect)
        effect = (box["scopes"], d_loss, dots, sq, float(model_sq))
    return sites, stats, g32, float(loss32), back, effect
