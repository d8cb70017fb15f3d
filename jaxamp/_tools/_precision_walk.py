"""The differential walk of :func:`jaxamp.precision_report`.

One traversal of the float32 jaxpr, equation by equation in Python:
calls (``jit``, ``remat``, ``custom_jvp``/``custom_vjp`` primal bodies) are
inlined; a loop with a static trip count (a ``lax.scan``, a ``fori_loop``
with static bounds) is walked as a ``lax.scan`` whose body is the traversal
of its body, traced once (:func:`scan_loop`): the carry holds the float32
and amp values side by side, the per-iteration outputs are each site's
statistics (and, for a reduced-precision site, its forward error and float32
inputs), so the compiled analysis holds one body however many iterations
run (``UNROLL = True`` unrolls instead, one site per equation and iteration:
the tests' reference). Any other equation with sub-jaxprs (a while loop, a
conditional, ``shard_map``) is one site, run whole. Every value is carried
twice: as float32 computes it and as amp computes it. Each first-order
equation (a *site*) is bound three times:

* in float32 on the float32 inputs (the reference);
* by jaxamp's own interpreter step (:meth:`jaxamp._walk._loop.Walk.run_eqn`:
  the policy's rule under the equation's value facts and ``named_scope``
  path) on amp's inputs: the *propagated* value;
* by the same step on the float32 inputs: the *local* value, what PyTorch's
  numeric-suite shadow logger measures (``torch.ao.ns._numeric_suite_fx``
  ``add_shadow_loggers``).

The same traversal, run on float32 values only under ``jax.grad`` with zero
*probes* added to every reduced-precision site's outputs and to its inputs'
cotangents (:class:`ProbeVisitor`, :func:`probed_gradient`), gives every
site's float32 cotangent ``dL/dy`` in one backward pass, and, re-run with a
scope's local errors as the probes, the error they cause in the gradient.

Pattern rewrites (fused attention, the RMSNorm region) are not replayed: their
equations are walked one by one under the per-equation rules, whose value
facts keep the same equations in float32.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import _compat
from .._base._cast import restore
from .._base._dtypes import is_float
from .._base._jaxpr import bind_eqn, is_var, read
from .._base._scopes import eqn_scopes
from .._base._structure import Structure, describe, runs_whole
from .._values import _facts
from .._walk._loop import AmpContext, Walk, check_rule_result, decide


@dataclasses.dataclass
class Site:
    """One first-order equation instance (a scan iteration's own).

    Attributes:
        eqn: the float32 jaxpr's equation.
        facts: its value facts (the rules read them).
        ctx: the amp context it runs under (scopes of the enclosing equations).
        scopes: its full ``named_scope`` path, outermost first.
        iteration: the enclosing ``scan`` iterations, outermost first.
        x32: its float32 inputs.
        y32: its float32 outputs.
        local: the amp step's outputs on ``x32``.
        amp: the amp step's outputs on amp's inputs.
        stack: the trip counts of the loops the site was traced in once
            (outermost first; empty outside a loop). Such a site keeps
            ``stats``, ``delta`` and, for a reduced-precision site, ``x32``
            with these leading axes (one entry per iteration); its other
            values are avals (``jax.ShapeDtypeStruct``) with them.
        stats: :func:`site_stats` (per iteration in a loop).
        delta: :func:`forward_delta` of a reduced-precision site, else None.
        order: its place in an unrolled walk: positions in the enclosing
            traversals, a None before each loop body's position standing for
            that loop's iteration (``-trips`` for a loop run in reverse).
    """

    eqn: Any
    facts: Any
    ctx: AmpContext
    scopes: tuple
    iteration: tuple
    x32: list
    y32: list
    local: list
    amp: list
    stack: tuple = ()
    order: tuple = ()
    stats: Any = None
    delta: list | None = None

    def run_amp(self, invals: list) -> list:
        """The amp interpreter step on ``invals`` (a list of outputs)."""
        return amp_step(self.eqn, self.facts, self.ctx, invals)


def amp_step(eqn: Any, facts: Any, ctx: AmpContext, invals: list) -> list:
    """Bind ``eqn`` as jaxamp's walk does, on ``invals``."""
    jaxpr = _OneEqn(eqn)
    env = {v: x for v, x in zip(eqn.invars, invals) if is_var(v)}
    Walk(jaxpr, (facts,), env, ctx).run_eqn(0)
    return [read(env, v) for v in eqn.outvars]


@dataclasses.dataclass(frozen=True)
class _OneEqn:
    eqn: Any

    @property
    def eqns(self) -> tuple:
        return (self.eqn,)


def _float_outs(outs: list) -> list[int]:
    return [i for i, y in enumerate(outs) if is_float(getattr(y, "dtype", None))]


_FIELDS = ("x32", "y32", "local", "amp")
# Float32 values in float32's top binade (``jnp.finfo(jnp.float32).min``, the
# attention-mask value) are sentinels: a low-precision format holds them as the
# same-signed infinity, which masks as well (softmax gives 0 either way).
_SENTINEL = 2.0**127


def _sat(got: jax.Array, w: jax.Array) -> jax.Array:
    """Where ``got`` holds ``w``'s sentinel as a same-signed infinity (an
    infinite ``w`` is its own sentinel)."""
    big = jnp.abs(w) >= _SENTINEL
    return jnp.isinf(got) & big & ((got > 0) == (w > 0))


def _diff(got: jax.Array, w: jax.Array) -> tuple[jax.Array, jax.Array]:
    m = _sat(got, w)
    return jnp.where(m, 0.0, got - w), jnp.where(m, 0.0, w)


def site_stats(site: Site, reduced: bool) -> jax.Array:
    """Local and propagated relative L2 error, overflow and underflow
    fractions and the peak float32 magnitude of a site's float outputs, a
    float32 vector of 5 (float32 arithmetic, traced with the walk).
    Sentinels held as infinities count as exact and leave the norms (and the
    overflow count); overflow counts amp's non-finite values where
    float32's are finite, underflow its zeros where float32's are not."""
    fo = _float_outs(site.y32)
    if not fo:
        return jnp.zeros(5, jnp.float32)
    vals = [[jnp.asarray(v[i]) for i in fo] for v in (site.y32, site.local, site.amp)]
    # Traced once per signature of (shapes, dtypes): sites alike share it.
    return _stats(*vals, reduced=reduced)


@jax.jit(static_argnames="reduced")
def _stats(ws: list, los: list, ams: list, reduced: bool) -> jax.Array:
    """:func:`site_stats` of the float outputs ``ws`` (float32's), ``los``
    (local) and ``ams`` (amp's)."""
    f32 = lambda v: v.astype(jnp.float32)  # noqa: E731
    sq = lambda v: jnp.sum(v * v)  # noqa: E731
    # num/den of the local and propagated errors, overflows, underflows
    sums = [jnp.float32(0)] * 6
    peak = jnp.float32(0)
    for w, lo, am in zip(ws, los, ams):
        w, lo, am = f32(w), f32(lo), f32(am)
        d_am, w_am = _diff(am, w)
        new = [jnp.float32(0), jnp.float32(0), sq(d_am), sq(w_am)]
        if reduced:
            m = _sat(lo, w)
            fin = jnp.isfinite(w) & ~m
            new[:2] = sq(jnp.where(m, 0.0, lo - w)), sq(jnp.where(m, 0.0, w))
            new.append(jnp.sum(~jnp.isfinite(lo) & fin, dtype=jnp.float32))
            new.append(jnp.sum((lo == 0) & (w != 0) & fin, dtype=jnp.float32))
        else:  # local is float32's own: no error, overflow or sentinel
            fin = jnp.isfinite(w)
            new += [jnp.float32(0), jnp.float32(0)]
        sums = [a + b for a, b in zip(sums, new)]
        if w.size:
            keep = fin & (jnp.abs(w) < _SENTINEL)
            peak = jnp.maximum(peak, jnp.max(jnp.abs(jnp.where(keep, w, 0.0))))

    def rel(num, den):
        safe = jnp.where(den > 0, den, 1.0)
        return jnp.where(den > 0, jnp.sqrt(num / safe), (num > 0).astype(jnp.float32))

    size = np.float32(sum(w.size for w in ws) or 1)
    local = rel(sums[0], sums[1]) if reduced else jnp.float32(0)
    return jnp.stack(
        [local, rel(sums[2], sums[3]), sums[4] / size, sums[5] / size, peak]
    )


def forward_delta(site: Site) -> list:
    """``local - y32`` per float output (of ``y32``'s dtype): a sentinel held
    as an infinity counts 0, an overflow counts as the format's largest
    value, a NaN as 0."""
    fo = _float_outs(site.y32)
    return [_delta(jnp.asarray(site.local[i]), jnp.asarray(site.y32[i])) for i in fo]


@jax.jit
def _delta(lo: jax.Array, w: jax.Array) -> jax.Array:
    """:func:`forward_delta` of one output (traced once per signature)."""
    fmax = np.float32(jnp.finfo(lo.dtype).max)
    lo32, w32 = lo.astype(jnp.float32), w.astype(jnp.float32)
    d = jnp.clip(lo32, -fmax, fmax) - w32
    d = jnp.where(_sat(lo32, w32) | ~jnp.isfinite(d), 0.0, d)
    return d.astype(w.dtype)


class _Visitor:
    """What the traversal does with values: pairs (float32, amp) in the
    differential walk, float32 tracers in the probe pass."""

    def leaf(self, eqn, facts, ctx, scopes, iteration, invals) -> list:
        raise NotImplementedError

    def carry(self, eqn, facts, ctx, carries) -> list:
        return carries

    def lift(self, literal):
        return literal

    def restore(self, val, aval):
        return val

    def index(self, val, t: int):
        return val[t]

    def stack(self, vals: list):
        return jnp.stack(vals)

    def loop(self, eqn, structure, f, invals, ctx, iteration) -> list:
        """A loop with a static trip count, its body traced once (a scan)."""
        raise NotImplementedError


# Loops are walked as loops (their body traced once); True unrolls them, one
# site per equation and iteration (the reference the tests compare against).
UNROLL = False


def _loop_parts(visitor, eqn, structure, f, invals, ctx):
    """``(sub, core, consts, args, boundary)`` of a loop equation: its body,
    the body's operands with the carries' first values chosen by
    ``visitor.carry``."""
    (sub,) = structure.subs
    core, sc = _compat.jaxpr_parts(sub.jaxpr)
    args = [invals[i] for i in sub.inputs]
    carried = [j for _, j in sub.carries]
    first = visitor.carry(eqn, f, ctx, [args[j] for j in carried])
    for j, c in zip(carried, first):
        args[j] = c
    return sub, core, sc, args, f.boundary_for(sub.jaxpr)


def _as_array(x: Any, like: Any = None) -> jax.Array:
    """``x`` as a strongly typed array (of ``like``'s dtype if given): a loop
    carry keeps one type."""
    dtype = jnp.result_type(x) if like is None else like.dtype
    return jax.lax.convert_element_type(jnp.asarray(x), dtype)


def scan_loop(visitor, eqn, structure, f, invals, ctx, body_fn):
    """Run a loop equation as ``lax.scan``: carries and sliced operands as
    the description says; ``body_fn(step_args) -> (outs, extra_ys)`` traverses
    the body once. Returns ``(equation outputs, stacked extra_ys)``."""
    sub, core, sc, args, boundary = _loop_parts(visitor, eqn, structure, f, invals, ctx)
    carried = [j for _, j in sub.carries]
    conv = lambda x, like=None: jax.tree.map(
        _as_array, x, *(() if like is None else (like,))
    )  # noqa: E731
    init = [conv(args[j]) for j in carried]
    xs = [args[j] for j in sub.sliced]

    def body(carry, x):
        step = list(args)
        for j, c in zip(carried, carry):
            step[j] = c
        for j, v in zip(sub.sliced, x):
            step[j] = v
        outs, extra = body_fn(core, sc, step, boundary)
        new = [conv(outs[k], c) for (k, _), c in zip(sub.carries, carry)]
        ys = [outs[k] for k in sub.stacked]
        return new, (ys, extra)

    last, (ys, extra) = jax.lax.scan(
        body, init, xs, length=structure.trips, reverse=structure.reverse
    )
    result: list = [None] * len(eqn.outvars)
    carry_of = {k: c for (k, _), c in zip(sub.carries, last)}
    for k, o in enumerate(sub.outputs):
        if o is None:
            continue
        if k in sub.stacked:
            result[o] = ys[sub.stacked.index(k)]
        else:
            result[o] = visitor.restore(carry_of[k], eqn.outvars[o].aval)
    return result, extra


class DiffVisitor(_Visitor):
    """Values are ``(float32, amp)`` pairs; records a :class:`Site` per leaf."""

    def __init__(self, reduced: Callable[[Site], bool]):
        self.sites: list[Site] = []
        self.reduced = reduced
        self.n = 0  # positions given so far (a loop takes one)

    def leaf(self, eqn, facts, ctx, scopes, iteration, invals):
        x32 = [v[0] for v in invals]
        xa = [v[1] for v in invals]
        y32 = bind_eqn(eqn, x32)
        ya = amp_step(eqn, facts, ctx, xa)
        site = Site(eqn, facts, ctx, scopes, iteration, x32, y32, y32, ya)
        site.order = (self.n,)
        self.n += 1
        reduced = self.reduced(site)
        if reduced:  # else amp's step on x32 is float32's
            site.local = amp_step(eqn, facts, ctx, x32)
        site.stats = site_stats(site, reduced)
        if reduced and _float_outs(y32):
            site.delta = forward_delta(site)
        self.sites.append(site)
        return list(zip(y32, ya))

    def loop(self, eqn, structure, f, invals, ctx, iteration):
        # The body's per-iteration outputs: each site's statistics, and for a
        # reduced-precision site its forward error and float32 inputs (what
        # its backward error and the ranking need); other values are avals.
        box: list = []

        def body_fn(core, sc, step, boundary):
            inner = type(self)(self.reduced)
            outs = traverse(inner, core, sc, step, ctx, boundary, iteration)
            box.append(inner.sites)
            ys = []
            for st in inner.sites:
                keep = st.delta is not None and bool(_float_inputs(st))
                x32 = [_as_array(x) for x in st.x32] if keep else None
                ys.append((st.stats, st.delta, x32))
            return outs, ys

        outs, stacked = scan_loop(self, eqn, structure, f, invals, ctx, body_fn)
        pos = self.n
        self.n += 1
        trips = structure.trips
        lift = lambda v: jax.ShapeDtypeStruct(  # noqa: E731
            (trips, *np.shape(v)), getattr(v, "dtype", None) or jnp.result_type(v)
        )
        for st, (stats, delta, x32) in zip(box[0], stacked):
            st.stats, st.delta = stats, delta
            st.x32 = x32 if x32 is not None else [lift(v) for v in st.x32]
            st.y32, st.amp = [lift(v) for v in st.y32], [lift(v) for v in st.amp]
            st.local = st.y32 if st.delta is None else [lift(v) for v in st.local]
            st.stack = (trips, *st.stack)
            mark = -trips if structure.reverse else None
            st.order = (pos, mark, *st.order)
            self.sites.append(st)
        return outs

    def carry(self, eqn, facts, ctx, carries):
        # The policy's rule for scan chooses amp's carry dtypes (bfloat16
        # residual streams), as the interpreter's scan rule does.
        rule = ctx.policy.lookup(eqn.primitive, ctx.scopes)
        amp_c = [c[1] for c in carries]
        rc = ctx.rule_context([c[0].dtype for c in carries], ctx.scopes, facts)
        result = decide(rule, rc, *amp_c)
        amp_c, _ = check_rule_result(result, eqn.primitive, rule, len(carries))
        return [(c[0], a) for c, a in zip(carries, amp_c)]

    def lift(self, literal):
        return (literal, literal)

    def restore(self, val, aval):
        return (val[0], restore(val[1], aval))

    def index(self, val, t):
        return (val[0][t], val[1][t])

    def stack(self, vals):
        return (jnp.stack([v[0] for v in vals]), jnp.stack([v[1] for v in vals]))


class ProbeVisitor(_Visitor):
    """Float32 values; adds ``probes[k]`` to the float outputs of the k-th
    leaf (the order of :class:`DiffVisitor`'s sites) and, where
    ``back[k]`` is given, ``<back[k][j], x_j>`` over its float inputs to
    :attr:`extra`: a term whose gradient adds ``back[k][j]`` to the
    cotangent of input ``j``, as an error of the equation's backward pass
    does."""

    def __init__(
        self, probes: list | None, back: list | None = None, counts: dict | None = None
    ):
        self.probes = probes
        self.back = back
        self.shapes: list[list] = []
        self.in_shapes: list[list] = []
        self.extra = jnp.float32(0)
        # id of a loop equation -> how many sites its body has (a first pass
        # on avals fills it; a probed pass reads it to hand the body its share).
        self.counts = {} if counts is None else counts

    def loop(self, eqn, structure, f, invals, ctx, iteration):
        k0 = len(self.shapes)
        n = self.counts.get(id(eqn))
        if n is None and (self.probes is not None or self.back is not None):
            raise AssertionError("probe_shapes runs before a probed pass")
        box: list = []

        def body_fn(core, sc, step, boundary):
            step, probes, back = step[:-2], step[-2], step[-1]
            inner = ProbeVisitor(probes, back, self.counts)
            outs = traverse(inner, core, sc, step, ctx, boundary, iteration)
            box.append(inner)
            return outs, inner.extra

        def take(xs):
            return None if xs is None else xs[k0 : k0 + n]

        # The body's probes ride along as two more sliced operands.
        sub = structure.subs[0]
        extra_ops = [take(self.probes), take(self.back)]
        structure2 = dataclasses.replace(
            structure,
            subs=(
                dataclasses.replace(
                    sub,
                    inputs=(*sub.inputs, len(invals), len(invals) + 1),
                    sliced=(*sub.sliced, len(sub.inputs), len(sub.inputs) + 1),
                ),
            ),
        )
        outs, extra = scan_loop(
            self, eqn, structure2, f, [*invals, *extra_ops], ctx, body_fn
        )
        inner = box[0]
        self.counts[id(eqn)] = len(inner.shapes)
        lift = lambda a: jax.ShapeDtypeStruct((structure.trips, *a.shape), a.dtype)  # noqa: E731
        self.shapes.extend([[lift(a) for a in sh] for sh in inner.shapes])
        self.in_shapes.extend([[lift(a) for a in sh] for sh in inner.in_shapes])
        self.extra = self.extra + jnp.sum(extra)
        return outs

    def leaf(self, eqn, facts, ctx, scopes, iteration, invals):
        outs = bind_eqn(eqn, invals)
        k = len(self.shapes)
        self.shapes.append([jax.typeof(outs[i]) for i in _float_outs(outs)])
        fi = _float_outs(invals)
        self.in_shapes.append([jax.typeof(invals[i]) for i in fi])
        if self.back is not None and self.back[k] is not None:
            for j, i in enumerate(fi):
                r = self.back[k][j]
                # A product and a sum, not jnp.vdot: XLA:CPU runs a whole-array
                # vdot as a slow dot (the probed pass 2.5x slower at 24 layers).
                self.extra = self.extra + jnp.sum(r * invals[i].astype(r.dtype))
        if self.probes is not None and self.probes[k] is not None:
            for j, i in enumerate(_float_outs(outs)):
                outs[i] = outs[i] + self.probes[k][j]
        return outs


def traverse(
    visitor: _Visitor,
    jaxpr: Any,
    consts: list,
    args: list,
    ctx: AmpContext,
    boundary: tuple | None,
    iteration: tuple = (),
) -> list:
    """Evaluate open ``jaxpr`` through ``visitor`` (see the module docstring)."""
    facts = _facts.with_boundary(jaxpr, boundary, ctx.pipeline.ignore_facts)
    env = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    for eqn, f in zip(jaxpr.eqns, facts):
        invals = [
            read(env, v) if is_var(v) else visitor.lift(read(env, v))
            for v in eqn.invars
        ]
        scopes = eqn_scopes(ctx.scopes, eqn)
        inner = dataclasses.replace(ctx, scopes=scopes, facts=None)
        structure = None if runs_whole(eqn) else describe(eqn)
        if structure is not None and structure.call:
            sub = structure.subs[0].jaxpr
            core, sc = _compat.jaxpr_parts(sub)
            outs = traverse(
                visitor, core, sc, invals, inner, f.boundary_for(sub), iteration
            )
            outs = [visitor.restore(o, v.aval) for o, v in zip(outs, eqn.outvars)]
        elif structure is not None and structure.unrollable and structure.trips:
            if UNROLL:
                outs = _unroll(visitor, eqn, structure, f, invals, inner, iteration)
            else:
                outs = visitor.loop(eqn, structure, f, invals, inner, iteration)
        else:  # first-order, or run whole (a while loop, a conditional, ...)
            outs = visitor.leaf(eqn, f, ctx, scopes, iteration, invals)
        env.update(zip(eqn.outvars, outs))
    return [
        read(env, v) if is_var(v) else visitor.lift(read(env, v)) for v in jaxpr.outvars
    ]


def _unroll(visitor, eqn, structure: Structure, f, invals, ctx, iteration) -> list:
    """A loop's iterations traversed one by one, as its description says:
    operands sliced or whole, carries fed back, outputs stacked or last."""
    sub, core, sc, args, boundary = _loop_parts(visitor, eqn, structure, f, invals, ctx)
    for _, j in sub.carries:
        args[j] = jax.tree.map(_as_array, args[j])
    steps = range(structure.trips)
    ys = []
    for t in reversed(steps) if structure.reverse else steps:
        step = [
            visitor.index(x, t) if j in sub.sliced else x for j, x in enumerate(args)
        ]
        outs = traverse(visitor, core, sc, step, ctx, boundary, (*iteration, t))
        for k, j in sub.carries:  # a carry keeps its type, as in lax.scan
            args[j] = jax.tree.map(_as_array, outs[k], args[j])
        ys.append(outs)
    if structure.reverse:
        ys.reverse()
    last = ys[-1] if not structure.reverse else ys[0]
    result: list = [None] * len(eqn.outvars)
    for k, o in enumerate(sub.outputs):
        if o is None:
            continue
        if k in sub.stacked:
            result[o] = visitor.stack([y[k] for y in ys])
        else:
            result[o] = visitor.restore(last[k], eqn.outvars[o].aval)
    return result


def _float_inputs(site: Site) -> list[int]:
    return [i for i, x in enumerate(site.x32) if is_float(getattr(x, "dtype", None))]
