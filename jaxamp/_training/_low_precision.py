"""Any optax optimizer for bfloat16 parameters: float32 update arithmetic,
stochastic rounding or Kahan summation on the bfloat16 write, and optimizer
state stored in bfloat16 or block-wise 8-bit codes."""

from __future__ import annotations

import weakref
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from .. import _compat
from . import _chunked, _in_place
from ._optax import gate_count, gate_tree, gate_update, register_gated_update
from ._rounding import StateCodec as _Codec
from ._rounding import noise_bits, round_nearest_bf16, round_stochastic_bf16

PyTree = Any
_ROUNDINGS = ("stochastic", "kahan", "nearest")


class LowPrecisionState(NamedTuple):
    """State of :func:`low_precision_optimizer`.

    Attributes:
        count: int32 scalar, the number of updates (a new draw of rounding bits
            each step).
        inner_state: the wrapped optimizer's state, its buffers laid out like the
            bfloat16 parameters stored as bfloat16 arrays or
            :class:`BlockQuantized` codes; every other leaf unchanged.
        compensation: ``rounding="kahan"``: a bfloat16 buffer per bfloat16
            parameter (None for other leaves); otherwise None.
    """

    count: jax.Array
    inner_state: Any
    compensation: Any


def _is_bf16(x: Any) -> bool:
    return hasattr(x, "dtype") and x.dtype == jnp.bfloat16


def _check_args(tx, rounding, state_dtype, seed, min_quantized_size, block_size):
    """Normalise ``state_dtype`` to None, "bfloat16" or "int8"; raise on bad input."""
    if not isinstance(tx, optax.GradientTransformation):
        raise TypeError(
            "low_precision_optimizer(tx): tx must be an optax GradientTransformation "
            f"(e.g. optax.adamw(1e-3)), got {type(tx).__name__}."
        )
    if rounding not in _ROUNDINGS:
        raise ValueError(
            f"low_precision_optimizer: rounding={rounding!r} is not supported; "
            f"use one of {_ROUNDINGS}."
        )
    for name, val, low in (
        ("seed", seed, 0),
        ("min_quantized_size", min_quantized_size, 0),
        ("block_size", block_size, 1),
    ):
        if not isinstance(val, (int, np.integer)) or isinstance(val, bool) or val < low:
            raise ValueError(
                f"low_precision_optimizer: {name} must be an int >= {low}, got {val!r}."
            )
    if state_dtype is None or (isinstance(state_dtype, str) and state_dtype == "int8"):
        return state_dtype
    try:
        dt = np.dtype(state_dtype)
    except TypeError:
        dt = None
    if dt == np.dtype(jnp.bfloat16):
        return "bfloat16"
    raise ValueError(
        f"low_precision_optimizer: state_dtype={state_dtype!r} is not supported; use "
        'jnp.bfloat16, "int8" or None (the inner state unchanged).'
    )


def _plan(template: PyTree, params: PyTree, state_dtype, min_size: int) -> PyTree:
    """How each leaf of the inner state is stored: "keep", "bfloat16" or "int8".

    A state buffer belongs to a parameter when it sits in a subtree laid out like
    ``params`` (optax's ``mu``, ``nu``, momentum traces, adafactor's factors).
    Buffers of bfloat16 parameters with at least one dimension are stored in
    ``state_dtype``; with "int8", those under ``min_size`` elements of the
    global shape are stored in bfloat16. Counts, hyperparameters and the state
    of other parameters are kept.
    """
    pdef = jax.tree_util.tree_structure(params)
    low = [_is_bf16(p) for p in jax.tree_util.tree_leaves(params)]

    def kind(s, is_low):
        if state_dtype is None or not is_low or s.ndim == 0:
            return "keep"
        if not jnp.issubdtype(s.dtype, jnp.floating):
            return "keep"
        if state_dtype == "int8" and s.size >= min_size:
            return "int8"
        return "bfloat16"

    def subtree(sub):
        if jax.tree_util.tree_structure(sub) != pdef:
            return "keep"
        kinds = [kind(s, f) for s, f in zip(jax.tree_util.tree_leaves(sub), low)]
        return jax.tree_util.tree_unflatten(pdef, kinds)

    return jax.tree_util.tree_map(
        subtree, template, is_leaf=lambda x: jax.tree_util.tree_structure(x) == pdef
    )


def low_precision_optimizer(
    tx: optax.GradientTransformation,
    *,
    rounding: str = "stochastic",
    state_dtype: Any = jnp.bfloat16,
    seed: int = 0,
    min_quantized_size: int = 4096,
    block_size: int = 256,
) -> optax.GradientTransformationExtraArgs:
    """Wrap any optax optimizer for parameters stored in bfloat16.

    Each step upcasts the bfloat16 parameters, gradients and state to float32,
    runs ``tx.update``, forms the float32 new parameter ``p + u`` and writes it
    to bfloat16 with ``rounding``. The returned updates are bfloat16 with
    ``p + updates == new_p`` in bfloat16 arithmetic, so the unchanged
    ``optax.apply_updates``, ``eqx.apply_updates`` and ``nnx.Optimizer.update``
    store the rounded parameter: exactly whenever ``new_p`` is within a factor
    2 of ``p`` (Sterbenz); a parameter that changes sign or by more than 2x in
    one step may land one bfloat16 step away (no bfloat16 update reaches it),
    and Kahan's compensation carries that difference. Float32 (and other
    non-bfloat16) leaves pass through with the inner optimizer's updates.

    Roundings (Zamirai et al. 2020, "Revisiting BFloat16 Training"):

    - ``"stochastic"``: unbiased stochastic rounding (torchao's
      ``bf16_stochastic_round``, llm.c): updates far below half a bfloat16 step
      still move the parameter on average. No extra memory.
    - ``"kahan"``: Kahan-compensated summation with a bfloat16 compensation
      buffer per parameter (optimi): deterministic, 2 more bytes per parameter.
    - ``"nearest"``: round to nearest, what plain optax does (the baseline;
      updates under half a step are lost).

    Rounding bits come from a stateless hash of (``seed``, step, buffer, global
    element index), so an FSDP-sharded run and an unsharded one give
    bit-identical parameters.

    Args:
        tx: any optax ``GradientTransformation`` (adamw, lion, sgd with
            momentum, adafactor, chains with clipping and schedules).
        rounding: "stochastic", "kahan" or "nearest".
        state_dtype: storage of the inner state's buffers for bfloat16
            parameters: ``jnp.bfloat16`` (written with the rounding: stochastic
            unless ``rounding="nearest"``), ``"int8"`` (block-wise absmax codes
            on bitsandbytes' dynamic map, a float32 scale per ``block_size``
            elements; Dettmers et al. 2022; linear codes zero small second
            moments, benchmarks/RESULTS_MEMORY.md), or None (unchanged). With
            ``"int8"``, the state of leaves stacked on a layers axis (the
            leading axis of the rank-3 bfloat16 parameters, what ``lax.scan``
            slices) is written one layer at a time in place, so the step holds
            float32 moments of one layer only (same bits as a whole-leaf
            update; an inner optimizer that is not elementwise on those
            leaves, such as Adafactor, is updated whole).
        seed: int >= 0, seed of the rounding bits.
        min_quantized_size: with ``"int8"``, buffers with fewer elements (of the
            global shape, independent of the mesh) are stored in bfloat16, as
            bitsandbytes' ``min_8bit_size`` (4096).
        block_size: elements per int8 block of the flattened global buffer (256,
            as bitsandbytes and torchao).

    Returns:
        A ``GradientTransformationExtraArgs`` whose state is
        :class:`LowPrecisionState`; ``update`` needs ``params`` (shapes and
        dtypes of the model's parameters) and forwards extra keyword arguments to
        ``tx.update``. Call it on global arrays (under ``jit``), not per shard
        inside ``shard_map``.

    Raises:
        TypeError: if ``tx`` is not a GradientTransformation.
        ValueError: for an unknown ``rounding`` or ``state_dtype``, a negative
            ``seed``, a bad ``block_size``/``min_quantized_size``, float16
            parameters, or ``update`` called without ``params``.
    """
    state_kind = _check_args(
        tx, rounding, state_dtype, seed, min_quantized_size, block_size
    )
    codec = _Codec(rounding, state_kind, seed, min_quantized_size, block_size)
    return _wrap(optax.with_extra_args_support(tx), codec)


def _to32(tree, params):
    return jax.tree_util.tree_map(
        lambda x, p: x.astype(jnp.float32) if _is_bf16(p) else x, tree, params
    )


def _wrap(inner, codec: _Codec) -> optax.GradientTransformationExtraArgs:
    """The wrapper's ``init`` and ``update`` around ``inner``."""

    def layout(params):
        _check_params(params)
        p32 = _to32(params, params)
        template = jax.eval_shape(inner.init, p32)
        plan = _plan(template, params, codec.state_kind, codec.min_size)
        return p32, template, plan

    def init(params):
        p32, _, plan = layout(params)
        state = codec.encode(inner.init(p32), plan, jnp.zeros((), jnp.int32))
        comp = None
        if codec.rounding == "kahan":
            comp = jax.tree_util.tree_map(
                lambda p: jnp.zeros_like(p) if _is_bf16(p) else None, params
            )
        return LowPrecisionState(jnp.zeros((), jnp.int32), state, comp)

    def update(updates, state, params=None, **extra):
        return gated_update(updates, state, params, None, **extra)

    def gated_update(updates, state, params, gate, **extra):
        """``update``; with a scalar bool ``gate``, the new state is written
        only where it is True (the old state, bit for bit, elsewhere) and the
        updates are zero where it is False, each select fused into its write
        (:func:`jaxamp.skip_nonfinite_updates`)."""
        if params is None:
            raise ValueError(
                "low_precision_optimizer: update needs params "
                "(call tx.update(grads, opt_state, params))."
            )
        p32, template, plan = layout(params)
        if codec.slices == "always" or (
            codec.slices == "int8" and codec.state_kind == "int8"
        ):
            out = _update_in_slices(
                inner, codec, updates, state, params, extra, template, plan, gate
            )
            if out is not None:
                return out
        g32 = _to32(updates, params)
        inner32 = codec.decode(state.inner_state, template)
        u32, _ = inner.update(g32, inner32, p32, **extra)
        comp = state.compensation
        if comp is None:
            comp = jax.tree_util.tree_map(lambda p: None, params)
        leaves, pdef = jax.tree_util.tree_flatten(params)
        outs = [
            _write(p, u, c, codec.rounding, codec.seed, state.count, 2 * i, gate=gate)
            for i, (p, u, c) in enumerate(
                zip(leaves, pdef.flatten_up_to(u32), pdef.flatten_up_to(comp))
            )
        ]
        d_out = [o[0] for o in outs]
        stored = _in_place.read_before_write(
            d_out, state.inner_state, template, params, state.count
        )
        _, new32 = inner.update(g32, codec.decode(stored, template), p32, **extra)
        new_comp = None
        if codec.rounding == "kahan":
            new_comp = gate_tree(gate, pdef.unflatten([o[1] for o in outs]), comp)
        new_state = gate_tree(
            gate, codec.encode(new32, plan, state.count), state.inner_state
        )
        return pdef.unflatten(d_out), LowPrecisionState(
            gate_count(state.count, gate), new_state, new_comp
        )

    register_gated_update(update, gated_update)
    if codec.slices != "never":
        _WHOLE_LEAF[update] = lambda: _wrap(inner, codec._replace(slices="never"))
    return optax.GradientTransformationExtraArgs(init, update)


_WHOLE_LEAF = weakref.WeakKeyDictionary()  # update -> () -> whole-leaf optimizer


def whole_leaf_updates(tx: Any) -> Any:
    """``tx``, or for a :func:`low_precision_optimizer` writing stacked state a
    layer at a time, the same one updating whole leaves (same bits): for a
    caller that slices the update itself (``jaxamp.update_in_backward``)."""
    make = _WHOLE_LEAF.get(getattr(tx, "update", None))
    return tx if make is None else make()


def _check_params(params: PyTree) -> None:
    for path, p in jax.tree_util.tree_leaves_with_path(params):
        if hasattr(p, "dtype") and p.dtype == jnp.float16:
            raise ValueError(
                f"low_precision_optimizer: parameter {jax.tree_util.keystr(path)} is "
                "float16; store parameters in bfloat16 (rounded by this optimizer) "
                "or float32 (passed through)."
            )


def _write(p, u, c, rounding, seed, step, stream, offset=0, gate=None):
    """The bfloat16 update of one parameter and its new Kahan compensation.

    Returns ``(d, c_new)`` with ``d`` bfloat16 such that ``p + d`` in bfloat16
    is the rounded new parameter; non-bfloat16 leaves return the inner update.
    ``offset``: the flat index of ``p``'s first element when it is a slice of
    rows of the parameter (the rounding bits are the whole parameter's).
    ``gate``: a scalar bool; where False, ``d`` is zero (the skip of
    :func:`jaxamp.skip_nonfinite_updates`), made from ``p`` inside the write:
    a zero-filled array would be a buffer of its own at the step's peak.
    """
    if u is None:
        return u, None
    if not _is_bf16(p):
        return gate_update(gate, u, p), None
    p32 = p.astype(jnp.float32)
    target = p32 + u.astype(jnp.float32)
    if rounding == "kahan":
        target = target + c.astype(jnp.float32)
    if rounding == "stochastic":
        bits = noise_bits(p.shape, seed, step, stream, offset)
        new = round_stochastic_bf16(target, bits)
    else:
        new = round_nearest_bf16(target)
    d = gate_update(gate, _exact_step(p32, new), p)
    if rounding != "kahan":
        return d, None
    reached = round_nearest_bf16(p32 + d.astype(jnp.float32))
    return d, round_nearest_bf16(target - reached.astype(jnp.float32))


def _exact_step(p32: jax.Array, new: jax.Array) -> jax.Array:
    """A bfloat16 ``d`` with ``p + d == new`` in bfloat16 arithmetic.

    ``new - p`` rounded to bfloat16 is such a ``d`` unless its rounding and the
    sum's rounding add up across a rounding boundary (a sign change, or ``new``
    far from ``p``); then one of its two bfloat16 neighbours is. When ``new``
    is far smaller than ``p`` (under 2^-8 of it) no bfloat16 ``d`` may reach it
    and the sum is the nearest reachable value.
    """
    new32 = new.astype(jnp.float32)
    d = round_nearest_bf16(new32 - p32)
    bits = jax.lax.bitcast_convert_type(d, jnp.uint16)
    for step in (1, -1):  # bfloat16 neighbours (magnitude +-1 ulp)
        cand = jax.lax.bitcast_convert_type(
            (bits.astype(jnp.int32) + step).astype(jnp.uint16), jnp.bfloat16
        )
        ok = round_nearest_bf16(p32 + d.astype(jnp.float32)) == new
        hits = round_nearest_bf16(p32 + cand.astype(jnp.float32)) == new
        d = jnp.where(~ok & hits & jnp.isfinite(cand), cand, d)
    return d


class _Layout(NamedTuple):
    """The leaves of one update, flattened, and which are stacked."""

    length: int  # the stacked (layers) axis
    stacked: Any  # aval -> bool
    pdef: Any
    tdef: Any
    edef: Any
    p: list  # parameters
    g: list  # gradients
    t: list  # float32 state template
    s: list  # stored state
    c: list  # Kahan compensation (or Nones)
    e: list  # extra arguments
    kinds: list  # the plan's kind per state leaf


def _layout(codec, updates, state, params, extra, template, plan) -> _Layout | None:
    """The update's leaves, or None where no leaf is stacked or a stacked leaf
    cannot be sliced (int8 blocks across layers, a gradient in another dtype)."""
    p_leaves, pdef = jax.tree_util.tree_flatten(params)
    length = _chunked.stacked_length([p.shape for p in p_leaves if _is_bf16(p)])
    if length is None:
        return None
    # Float32 leaves keep their whole-leaf update (XLA may contract their
    # float32 arithmetic differently inside a loop); a shape shared with one
    # is not sliced.
    shapes = {
        p.shape for p in p_leaves if _is_bf16(p) and p.ndim and p.shape[0] == length
    }
    shapes -= {jnp.shape(p) for p in p_leaves if not _is_bf16(p)}
    stacked = _chunked.is_stacked(shapes)
    t_leaves, tdef = jax.tree_util.tree_flatten(template)
    e_leaves, edef = jax.tree_util.tree_flatten(extra)
    try:
        g_leaves = pdef.flatten_up_to(updates)
        s_leaves = tdef.flatten_up_to(state.inner_state)
    except (TypeError, ValueError):
        return None
    comp = state.compensation
    c_leaves = [None] * len(p_leaves) if comp is None else pdef.flatten_up_to(comp)
    kinds = jax.tree_util.tree_leaves(plan)
    if any(stacked(e) for e in e_leaves) or any(
        stacked(t) and k == "int8" and (t.size // length) % codec.block_size
        for t, k in zip(t_leaves, kinds)
    ):
        return None
    if any(stacked(g) and g.dtype != p.dtype for g, p in zip(g_leaves, p_leaves)):
        return None
    return _Layout(
        length,
        stacked,
        pdef,
        tdef,
        edef,
        p_leaves,
        g_leaves,
        t_leaves,
        s_leaves,
        c_leaves,
        e_leaves,
        kinds,
    )


def _wide(x, p):
    return x.astype(jnp.float32) if _is_bf16(p) else x


def _inner_jaxpr(inner, lay: _Layout):
    """The jaxpr of ``inner.update`` on the flat float32 leaves (gradients,
    state, parameters, extra arguments), or None where it cannot be traced
    flat or a stacked output is laid out otherwise than its input."""
    n_p, n_t = len(lay.p), len(lay.t)

    def flat_update(*flat):
        g = lay.pdef.unflatten(flat[:n_p])
        st = lay.tdef.unflatten(flat[n_p : n_p + n_t])
        p = lay.pdef.unflatten(flat[n_p + n_t : 2 * n_p + n_t])
        e = lay.edef.unflatten(flat[2 * n_p + n_t :])
        u, new = inner.update(g, st, p, **e)
        return lay.pdef.flatten_up_to(u) + lay.tdef.flatten_up_to(new)

    spec = lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x))  # noqa: E731
    try:
        closed = jax.make_jaxpr(flat_update)(
            *[spec(_wide(g, p)) for g, p in zip(lay.g, lay.p)],
            *[spec(t) for t in lay.t],
            *[spec(_wide(p, p)) for p in lay.p],
            *[spec(e) for e in lay.e],
        )
    except (TypeError, ValueError):
        return None
    jaxpr, consts = _compat.jaxpr_parts(closed)
    outs = [v.aval for v in jaxpr.outvars]
    bad_u = any(
        lay.stacked(p)
        and (a.shape != p.shape or (not _is_bf16(p) and a.dtype != p.dtype))
        for a, p in zip(outs[:n_p], lay.p)
    )
    bad_s = any(
        lay.stacked(t) and (a.shape != t.shape or a.dtype != t.dtype)
        for a, t in zip(outs[n_p:], lay.t)
    )
    return None if bad_u or bad_s else (jaxpr, consts)


def _stacked_state(codec, lay: _Layout, jaxpr, consts, env, count, gate) -> list:
    """The new stored state of the stacked leaves (None elsewhere), written
    one layer at a time in a ``fori_loop``: a layer of the state decoded, the
    inner update's elementwise part evaluated on the layer's slices
    (:func:`_chunked.evaluate_slice`, its scalars from ``env``), encoded with
    the whole leaf's rounding bits and written back in place."""
    n_p, length = len(lay.p), lay.length
    views = [
        _chunked.to_bits(g) if lay.stacked(p) else None for g, p in zip(lay.g, lay.p)
    ]
    views += [None] * len(lay.t)
    views += [_chunked.to_bits(p) if lay.stacked(p) else None for p in lay.p]
    views += [None] * len(lay.e)
    wides = lay.p + [None] * len(lay.t) + lay.p + [None] * len(lay.e)

    def body(i, state):
        args = [
            None if v is None else _wide(_chunked.take(v, i), w)
            for v, w in zip(views, wides)
        ]
        for j, (t, s) in enumerate(zip(lay.t, state)):
            if s is not None:
                args[n_p + j] = codec.decode_leaf(t, _chunked.take(s, i))
        out = _chunked.evaluate_slice(
            jaxpr, consts, args, env, lay.stacked, lambda sh: (1, *sh[1:])
        )
        new = list(state)
        for j, k in enumerate(lay.kinds):
            if state[j] is not None:
                rows = lay.t[j].size // length
                offset = i.astype(jnp.uint32) * jnp.uint32(rows % 2**32)
                x = codec.encode_leaf(out[n_p + j], k, count, 2 * j + 1, offset)
                x = gate_tree(gate, x, _chunked.take(state[j], i))
                new[j] = _chunked.put(state[j], x, i)
        return new

    state = [
        _chunked.by_layer(s, length) if lay.stacked(t) else None
        for s, t in zip(lay.s, lay.t)
    ]
    return [_chunked.from_layers(s) for s in jax.lax.fori_loop(0, length, body, state)]


def _update_in_slices(
    inner, codec, updates, state, params, extra, template, plan, gate=None
):
    """:func:`low_precision_optimizer`'s update with the state of leaves
    stacked on a layers axis written one slice (layer) at a time, in place.

    The inner update's jaxpr is evaluated on whole arrays for its scalars (the
    global norm of gradient clipping, counts, schedules), for the leaves of
    other shapes and for the updates: elementwise in the decoded old state,
    which XLA fuses into them (no float32 moments materialised). The new
    state of the stacked leaves, whose int8 encoding needs each block's
    maximum of the new float32 moments, is computed in a ``fori_loop`` over
    the layers (:func:`_stacked_state`). So float32 moments exist for one
    layer at a time, never for a whole stacked leaf. The bits are those of
    the whole-leaf update (same operations per element; rounding bits from
    the global element index).

    Returns:
        ``(updates, LowPrecisionState)``, or None when there is no stacked
        axis or the inner update is not elementwise on the stacked leaves
        (:class:`_chunked.Unchunkable`); the caller then updates whole leaves.
    """
    lay = _layout(codec, updates, state, params, extra, template, plan)
    traced = None if lay is None else _inner_jaxpr(inner, lay)
    if traced is None:
        return None
    jaxpr, consts = traced
    n_p, count = len(lay.p), state.count

    def run(g_leaves, s_leaves, p_leaves, e_leaves):
        whole_in = [
            *[_wide(g, p) for g, p in zip(g_leaves, p_leaves)],
            *[codec.decode_leaf(t, s) for t, s in zip(lay.t, s_leaves)],
            *[_wide(p, p) for p in p_leaves],
            *e_leaves,
        ]
        env = {}
        whole = _chunked.evaluate_whole(jaxpr, consts, whole_in, env)
        lay_now = lay._replace(g=g_leaves, s=s_leaves, p=p_leaves, e=e_leaves)
        stacked = _stacked_state(codec, lay_now, jaxpr, consts, env, count, gate)
        s_out = [
            gate_tree(gate, codec.encode_leaf(whole[n_p + j], k, count, 2 * j + 1), old)
            if s is None
            else s
            for j, (s, k, old) in enumerate(zip(stacked, lay.kinds, s_leaves))
        ]
        outs = [
            _write(p, whole[j], c, codec.rounding, codec.seed, count, 2 * j, gate=gate)
            for j, (p, c) in enumerate(zip(p_leaves, lay.c))
        ]
        return (
            [o[0] for o in outs],
            s_out,
            [o[1] for o in outs],
        )

    args = (lay.g, lay.s, lay.p, lay.e)
    try:
        jax.eval_shape(run, *args)
    except _chunked.Unchunkable:
        return None
    d_out, s_out, c_out = run(*args)
    new_comp = None
    if codec.rounding == "kahan":
        new_comp = gate_tree(gate, lay.pdef.unflatten(c_out), state.compensation)
    return lay.pdef.unflatten(d_out), LowPrecisionState(
        gate_count(count, gate), lay.tdef.unflatten(s_out), new_comp
    )
