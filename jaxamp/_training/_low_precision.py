"""Any optax optimizer for bfloat16 parameters: float32 update arithmetic,
stochastic rounding or Kahan summation on the bfloat16 write, and optimizer
state stored in bfloat16 or block-wise 8-bit codes."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ._rounding import (
    BlockQuantized,
    dequantize_blockwise,
    noise_bits,
    quantize_blockwise,
    round_nearest_bf16,
    round_stochastic_bf16,
)

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
            moments, benchmarks/RESULTS_MEMORY.md), or None (unchanged).
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


class _Codec(NamedTuple):
    """How the wrapper rounds and stores: the validated arguments."""

    rounding: str
    state_kind: Any  # None, "bfloat16" or "int8"
    seed: int
    min_size: int
    block_size: int

    def state_round(self, x, step, stream):
        if self.rounding == "nearest":
            return round_nearest_bf16(x)
        bits = noise_bits(x.shape, self.seed, step, stream)
        return round_stochastic_bf16(x, bits)

    def encode(self, state32, plan, step):
        """The float32 inner state stored as ``plan`` says (streams 2i + 1)."""
        leaves, sdef = jax.tree_util.tree_flatten(state32)
        kinds = jax.tree_util.tree_leaves(plan)
        out = []
        for i, (x, k) in enumerate(zip(leaves, kinds)):
            if k == "int8":
                out.append(quantize_blockwise(x, self.block_size))
            elif k == "bfloat16":
                out.append(self.state_round(x, step, 2 * i + 1))
            else:
                out.append(x)
        return jax.tree_util.tree_unflatten(sdef, out)

    def decode(self, stored, template):
        """The stored inner state in ``template``'s dtypes."""

        def leaf(t, s):
            if isinstance(s, BlockQuantized):
                return dequantize_blockwise(s, self.block_size).astype(t.dtype)
            return s.astype(t.dtype) if hasattr(s, "astype") else s

        return jax.tree_util.tree_map(
            leaf, template, stored, is_leaf=lambda x: isinstance(x, BlockQuantized)
        )


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
        if params is None:
            raise ValueError(
                "low_precision_optimizer: update needs params "
                "(call tx.update(grads, opt_state, params))."
            )
        p32, template, plan = layout(params)
        inner32 = codec.decode(state.inner_state, template)
        u32, new32 = inner.update(_to32(updates, params), inner32, p32, **extra)
        comp = state.compensation
        if comp is None:
            comp = jax.tree_util.tree_map(lambda p: None, params)
        leaves, pdef = jax.tree_util.tree_flatten(params)
        outs = [
            _write(p, u, c, codec.rounding, codec.seed, state.count, 2 * i)
            for i, (p, u, c) in enumerate(
                zip(leaves, pdef.flatten_up_to(u32), pdef.flatten_up_to(comp))
            )
        ]
        new_comp = None
        if codec.rounding == "kahan":
            new_comp = pdef.unflatten([o[1] for o in outs])
        new_state = codec.encode(new32, plan, state.count)
        return pdef.unflatten([o[0] for o in outs]), LowPrecisionState(
            state.count + 1, new_state, new_comp
        )

    return optax.GradientTransformationExtraArgs(init, update)


def _check_params(params: PyTree) -> None:
    for path, p in jax.tree_util.tree_leaves_with_path(params):
        if hasattr(p, "dtype") and p.dtype == jnp.float16:
            raise ValueError(
                f"low_precision_optimizer: parameter {jax.tree_util.keystr(path)} is "
                "float16; store parameters in bfloat16 (rounded by this optimizer) "
                "or float32 (passed through)."
            )


def _write(p, u, c, rounding, seed, step, stream):
    """The bfloat16 update of one parameter and its new Kahan compensation.

    Returns ``(d, c_new)`` with ``d`` bfloat16 such that ``p + d`` in bfloat16
    is the rounded new parameter; non-bfloat16 leaves return the inner update.
    """
    if not _is_bf16(p) or u is None:
        return u, None
    p32 = p.astype(jnp.float32)
    target = p32 + u.astype(jnp.float32)
    if rounding == "kahan":
        target = target + c.astype(jnp.float32)
    if rounding == "stochastic":
        new = round_stochastic_bf16(target, noise_bits(p.shape, seed, step, stream))
    else:
        new = round_nearest_bf16(target)
    d = _exact_step(p32, new)
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
