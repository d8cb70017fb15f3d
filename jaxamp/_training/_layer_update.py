"""The pieces of ``update_in_backward`` that run inside the transposed loop:
one parameter's update evaluated on one block of one layer
(:class:`LayerUpdate`), and the loop re-bound with those updates in its body
(:func:`fused_scan`). A loop is read through its registered description
(:func:`loop_of`, ``_base/_structure.py``), never by its primitive's name or
parameters. See ``_in_backward.py``."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import _compat
from .._base._jaxpr import bind_eqn, evaluate, is_var
from .._base._structure import SubJaxpr, describe
from . import _chunked

CLIP_ERROR = (
    "update_in_backward(optimizer=...): the update of {what} reads the gradients "
    "of other parameters (global-norm clipping such as optax.clip_by_global_norm "
    "needs every gradient before the first layer is updated). Clip elementwise "
    "(optax.clip) or use the ordinary step "
    "(jax.grad, then optimizer.update)."
)


@dataclasses.dataclass(frozen=True)
class Loop:
    """A loop equation as its description gives it: one body run ``trips``
    times (from the last index down when ``reverse``), each output of the body
    either carried to the next iteration or stacked into an output of the
    equation (a scan's carries and ``ys``).

    Attributes:
        body: the body (:class:`SubJaxpr`): which operand feeds each of its
            inputs, which equation output each of its outputs becomes, the
            carried pairs and the sliced inputs and stacked outputs.
        trips: the static number of iterations.
        reverse: whether the iterations run from the last index down.
    """

    body: SubJaxpr
    trips: int
    reverse: bool

    def stacked_body_output(self, m: int) -> int | None:
        """The body output stacked into equation output ``m``, or None."""
        return next((j for j in self.body.stacked if self.body.outputs[j] == m), None)

    @property
    def sliced_operands(self) -> frozenset[int]:
        """The equation operands the body reads one slice of per iteration."""
        return frozenset(self.body.inputs[j] for j in self.body.sliced)


def loop_of(eqn: Any) -> Loop | None:
    """``eqn`` as a :class:`Loop`, from its registered description; None for
    an equation that is no such loop (no description, not one body run a
    static number of times, or a body output neither carried nor stacked)."""
    structure = describe(eqn)
    if structure is None or not structure.unrollable:
        return None
    body = structure.subs[0]
    carried = {o for o, _ in body.carries}
    if None in body.outputs or carried & set(body.stacked):
        return None
    if carried | set(body.stacked) != set(range(len(body.outputs))):
        return None
    return Loop(body, structure.trips, structure.reverse)


@dataclasses.dataclass
class Fused:
    """The stacked parameters one transposed loop updates.

    Attributes:
        eqn: the loop equation of the gradient's jaxpr.
        loop: its description.
        leaves: parameter indices whose gradient is one of its stacked outputs.
        ys: per leaf, the body output stacked into that gradient.
        chains: per leaf, the ``convert_element_type`` equations between the
            scan's output and the gradient.
        states: per leaf, the optimizer state leaves updated with it.
        forwarded: scan operand position -> (parameter index, casts): an
            operand that is the parameter itself (or casts of it), read from
            the carried stack instead.
    """

    eqn: Any
    loop: Loop
    leaves: list = dataclasses.field(default_factory=list)
    ys: list = dataclasses.field(default_factory=list)
    chains: list = dataclasses.field(default_factory=list)
    states: list = dataclasses.field(default_factory=list)
    forwarded: dict = dataclasses.field(default_factory=dict)


def gradient_deps(ucore: Any, n_g: int) -> dict:
    """``(path, var) -> frozenset`` of the gradient inputs (indices below
    ``n_g``) each value of the update's jaxpr depends on, paths as
    :func:`_chunked.evaluate_whole` records them (call bodies entered)."""
    deps: dict = {}
    ins = [frozenset({i}) if i < n_g else frozenset() for i in range(len(ucore.invars))]
    _deps(ucore, ins, deps, ())
    return deps


def _deps(core, ins, deps, path):
    def get(v):
        return deps.get((path, v), frozenset()) if is_var(v) else frozenset()

    for v, d in zip(core.invars, ins):
        deps[(path, v)] = d
    for i, eqn in enumerate(core.eqns):
        d_in = [get(v) for v in eqn.invars]
        sub = _chunked._callee(eqn)
        if sub is not None:
            j, _ = _compat.jaxpr_parts(sub)
            outs = _deps(j, d_in, deps, path + (i,))
        else:
            union = frozenset().union(*d_in) if d_in else frozenset()
            outs = [union] * len(eqn.outvars)
        for v, d in zip(eqn.outvars, outs):
            deps[(path, v)] = d
    return [get(v) for v in core.outvars]


@dataclasses.dataclass
class LayerUpdate:
    """The update of one stacked parameter and its state, one slice at a time:
    each layer cut into ``chunks`` blocks of rows (of its second axis, or of
    the rows of a state laid out otherwise, such as int8 scales), so that the
    float32 values of the update exist for one block at a time.

    Attributes:
        k: the parameter's index; ``states``: its state leaves' indices.
        jaxpr, consts: the update's jaxpr reduced to their new values.
        env: its whole evaluation on zero gradients (the step's scalars).
        stacked: the layer-major shapes (parameter, gradient, state).
        length: the layers; ``chunks``: the blocks per layer.
    """

    k: int
    states: list
    jaxpr: Any
    consts: list
    env: dict
    stacked: Callable
    length: int
    chunks: int = 1

    def _like_param(self, shape: tuple) -> bool:
        return len(shape) >= 2 and shape[0] == self.length

    def slice_shape(self, shape: tuple) -> tuple:
        """The shape of one block of a stacked ``shape``."""
        if self._like_param(shape):
            return (1, shape[1] // self.chunks, *shape[2:])
        return (shape[0] // (self.length * self.chunks), *shape[1:])

    def starts(self, shape: tuple, i: Any, j: Any) -> tuple:
        """Where block ``j`` of layer ``i`` starts in a stacked ``shape``."""
        if self._like_param(shape):
            rows = shape[1] // self.chunks
            return (i, j * rows) + (0,) * (len(shape) - 2)
        rows = shape[0] // (self.length * self.chunks)
        return ((i * self.chunks + j) * rows,) + (0,) * (len(shape) - 1)

    def __call__(self, i, j, g, p, s, n_p, n_s):
        """New blocks of the parameter and its state from block ``j`` of
        layer ``i`` of the gradient, the parameter and the state."""
        args: list = [None] * (2 * n_p + n_s)
        args[self.k], args[n_p + n_s + self.k] = g, p
        for m, x in zip(self.states, s):
            args[n_p + m] = x
        out = _chunked.evaluate_slice(
            self.jaxpr,
            self.consts,
            args,
            self.env,
            self.stacked,
            self.slice_shape,
            index=i * self.chunks + j,
            length=self.length * self.chunks,
            offsets=lambda shape: self.starts(shape, i, j),
        )
        return out[0], out[1:]  # the outputs kept: the parameter, its states


def _chunks(p_shape: tuple, s_shapes: list, length: int) -> int:
    """Blocks per layer: the fewest that keep a block at most
    :data:`_BLOCK` elements, dividing the parameter's second axis and the rows
    of each state laid out otherwise (int8 scales)."""
    if len(p_shape) < 2:
        return 1
    size = int(np.prod(p_shape[1:]))
    for c in range(1, p_shape[1] + 1):
        if p_shape[1] % c:
            continue
        rows_ok = all(
            (len(sh) >= 2 and sh[0] == length) or (sh[0] // length) % c == 0
            for sh in s_shapes
        )
        if rows_ok and size // c <= _BLOCK:
            return c
    return 1


_BLOCK = 2**19  # elements of a parameter updated at once (2 MiB in float32)


class _NoGradients(dict):
    """An evaluation's values, refusing those that depend on gradients: a
    value of the parameter's gradient that is not laid out by layers (its
    norm across layers) is not known before the whole backward pass."""

    def __init__(self, values: dict, deps: dict):
        super().__init__(values)
        self._deps = deps

    def __getitem__(self, key):
        if self._deps.get(key):
            raise _chunked.Unchunkable("a value of the gradient across layers")
        return super().__getitem__(key)


def _leaf_update(ucore, uconsts, k, states, g, s, p, n_p, n_s, chunks=1):
    used = [m == k or (m - n_p) in states for m in range(n_p + n_s)]
    jaxpr, _ = _compat.dce(ucore, used)
    env: dict = {}
    zeros = [jnp.zeros(x.shape, x.dtype) for x in g]
    _chunked.evaluate_whole(jaxpr, uconsts, [*zeros, *s, *p], env)
    length = p[k].shape[0]
    shapes = {p[k].shape} | {s[j].shape for j in states}
    return LayerUpdate(
        k,
        states,
        jaxpr,
        uconsts,
        _NoGradients(env, gradient_deps(jaxpr, n_p)),
        _chunked.is_stacked(shapes),
        length,
        chunks,
    )


def _sliceable(upd: LayerUpdate, g, p, s, n_p, n_s) -> bool:
    """Whether ``upd`` evaluates on one block (a trial trace)."""

    def trial(i):
        blocks = [jnp.zeros(upd.slice_shape(x.shape), x.dtype) for x in (g, p, *s)]
        return upd(i, i, blocks[0], blocks[1], blocks[2:], n_p, n_s)

    try:
        jax.eval_shape(trial, jnp.zeros((), jnp.int32))
    except (_chunked.Unchunkable, TypeError, ValueError):
        return False  # updated after the backward pass instead
    return True


def plan_leaf(ucore, uconsts, k, states, zeros, s, p, n_p, n_s):
    """The leaf's update in blocks, else whole layers, else None."""
    chunks = _chunks(p[k].shape, [s[j].shape for j in states], p[k].shape[0])
    for c in sorted({chunks, 1}, reverse=True):
        upd = _leaf_update(ucore, uconsts, k, states, zeros, s, p, n_p, n_s, c)
        if _sliceable(upd, zeros[k], p[k], [s[j] for j in states], n_p, n_s):
            return upd
    return None


def fused_scan(eqn, invals, group, keep, p, s, new, n_p, n_s):
    """The transposed loop ``eqn`` re-run as a ``lax.scan`` with the updates
    of ``keep`` in its body; the parameters and state they update are carried
    (in place) and written to ``new``. Returns the equation's outputs (None
    for the gradients the fused loop does not stack)."""
    body_of = group.loop.body
    bcore, bconsts = _compat.jaxpr_parts(body_of.jaxpr)
    kept = {u.k: u for u in keep}
    fwd = {n: r for n, r in group.forwarded.items() if r[0] in kept}
    carry_in = [j for _, j in body_of.carries]
    carry_out = [o for o, _ in body_of.carries]
    # The sliced body inputs the scan slices; the forwarded ones are read
    # from the carried stack.
    sliced = [j for j in body_of.sliced if body_of.inputs[j] not in fwd]
    xs = [invals[body_of.inputs[j]] for j in sliced]
    ys_of = {k: j for k, j in zip(group.leaves, group.ys) if k in kept}
    chain_of = dict(zip(group.leaves, group.chains))
    leaves = [(u.k, [u.k] + [n_p + j for j in u.states]) for u in keep]
    values = [*p, *s]
    stacks = [[_chunked.to_bits(values[m]) for m in ms] for _, ms in leaves]
    done = {ys_of[k] for k, _ in leaves}

    def body(carry, x):
        c, st = carry
        xs_sl, i = x
        args = [invals[n] for n in body_of.inputs]  # the loop's constants
        for j, v in [*zip(carry_in, c), *zip(sliced, xs_sl)]:
            args[j] = v
        for j in body_of.sliced:
            if body_of.inputs[j] in fwd:
                k, casts = fwd[body_of.inputs[j]]
                v = _chunked.take(st[_pos(leaves, k)][0], i)[0]
                for cast in casts:
                    (v,) = bind_eqn(cast, [v])
                args[j] = v
        outs = evaluate(bcore, bconsts, args, bind_eqn)
        new_st = [list(a) for a in st]
        for n, (k, ms) in enumerate(leaves):
            g = outs[ys_of[k]]
            for cast in chain_of[k]:
                (g,) = bind_eqn(cast, [g])
            shapes = [values[m].shape for m in ms]
            new_st[n] = _update_layer(kept[k], i, g[None], st[n], shapes, n_p, n_s)
        ys = [outs[j] for j in body_of.stacked if j not in done]
        return ([outs[o] for o in carry_out], new_st), ys

    init = ([invals[body_of.inputs[j]] for j in carry_in], stacks)
    length = group.loop.trips
    steps = jnp.arange(length, dtype=jnp.int32)
    (c, st), ys = jax.lax.scan(
        body, init, (xs, steps), length=length, reverse=group.loop.reverse
    )
    for (_, ms), arrays in zip(leaves, st):
        for m, a in zip(ms, arrays):
            new[m] = _chunked.from_bits(a)
    outs: list = [None] * len(eqn.outvars)
    for o, v in zip(carry_out, c):
        outs[body_of.outputs[o]] = v
    ys_it = iter(ys)
    for j in body_of.stacked:
        outs[body_of.outputs[j]] = None if j in done else next(ys_it)
    return outs


def _update_layer(upd: LayerUpdate, i, g, arrays, shapes, n_p, n_s) -> list:
    """``arrays`` (the stacked parameter and its state) with layer ``i``
    updated from its gradient ``g``, one block of rows at a time."""

    def block(j, arrays):
        rows = g.shape[1] // upd.chunks if g.ndim >= 2 else 1
        gj = jax.lax.dynamic_slice_in_dim(g, j * rows, rows, 1) if g.ndim >= 2 else g
        old = [
            _chunked.from_bits(
                jax.lax.dynamic_slice(a, upd.starts(sh, i, j), upd.slice_shape(sh))
            )
            for a, sh in zip(arrays, shapes)
        ]
        new_p, new_s = upd(i, j, gj, old[0], old[1:], n_p, n_s)
        return [
            jax.lax.dynamic_update_slice(a, _chunked.to_bits(v), upd.starts(sh, i, j))
            for a, v, sh in zip(arrays, [new_p, *new_s], shapes)
        ]

    if upd.chunks == 1:
        return block(0, list(arrays))
    return jax.lax.fori_loop(0, upd.chunks, block, list(arrays))


def _pos(leaves: list, k: int) -> int:
    return next(n for n, (kk, _) in enumerate(leaves) if kk == k)
