"""An optimizer's update evaluated one slice of stacked leaves at a time.

The jaxpr of ``tx.update`` is evaluated twice. The first evaluation, on whole
arrays, gives every value that is not laid out like the stacked leaves:
scalars (step counts, schedules, the global norm of gradient clipping, each a
reduction XLA fuses with its elementwise producers) and whole leaves of other
shapes; under ``jit`` XLA drops the rest of it as dead code. The second
evaluation runs inside a loop over the stacked axis, on one slice of every
stacked leaf, and computes only the values laid out like the stacked leaves,
reading the others from the first. It accepts elementwise primitives,
broadcasts of scalars, calls (``jit``, ``custom_jvp``, ...) into such code
and, given the slice's layer, the layer-major steps of rounding bits and
int8 blocks (:func:`evaluate_slice`);
anything else (a reduction across the layers, a reshape that mixes them)
raises :class:`Unchunkable`, and the caller
evaluates the update on whole leaves instead. Both evaluations bind the same
primitives on the same elements, so the results are the same bits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from .. import _compat
from .._base._structure import describe, runs_whole
from ._rounding import BlockQuantized

# Primitives whose every output element depends only on the same element of
# each operand (operands of equal shape, or scalars).
_ELEMENTWISE = frozenset(
    """abs acos acosh add and asin asinh atan atan2 atanh bitcast_convert_type
    cbrt ceil clamp convert_element_type copy copy_p cos cosh div eq erf erf_inv
    erfc exp exp2 expm1 floor ge gt imag integer_pow is_finite le lgamma log
    log1p logistic lt max min mul ne neg nextafter not or pow real
    reduce_precision rem round rsqrt select_n shift_left shift_right_arithmetic
    shift_right_logical sign sin sinh sqrt square stop_gradient sub tan tanh
    xor""".split()
)


class Unchunkable(Exception):
    """The update has a step that is not elementwise on the stacked leaves."""


def _callee(eqn: Any) -> Any:
    """The jaxpr a call equation runs once on its operands (``jit``,
    ``custom_jvp``, ``checkpoint``, a call registered with
    :func:`jaxamp.extend.register_higher_order`: a call in the higher-order
    registry, ``_base/_structure.py``, that it evaluates by running its body),
    or None."""
    structure = describe(eqn)
    if structure is None or not structure.call or runs_whole(eqn):
        return None
    return structure.subs[0].jaxpr


def _bind(eqn: Any, invals: Sequence[Any], params: dict | None = None) -> list:
    prim = eqn.primitive
    out = _compat.bind(
        prim, invals, _compat.bind_params(prim, params or dict(eqn.params))
    )
    return list(out) if prim.multiple_results else [out]


def evaluate_whole(jaxpr: Any, consts: Sequence, args: Sequence, env: dict) -> list:
    """Evaluate ``jaxpr`` on whole arrays, recording every value in ``env``
    (keyed by the call path and the variable) for :func:`evaluate_slice`."""
    return _whole(jaxpr, consts, args, env, ())


def _whole(jaxpr, consts, args, env, path):
    def read(v):
        return v.val if isinstance(v, _compat.Literal) else env[(path, v)]

    for v, x in zip(jaxpr.constvars, consts):
        env[(path, v)] = x
    for v, x in zip(jaxpr.invars, args):
        env[(path, v)] = x
    for i, eqn in enumerate(jaxpr.eqns):
        invals = [read(v) for v in eqn.invars]
        sub = _callee(eqn)
        if sub is not None:
            j, c = _compat.jaxpr_parts(sub)
            outs = _whole(j, c, invals, env, path + (i,))
        else:
            outs = _bind(eqn, invals)
        for v, x in zip(eqn.outvars, outs):
            env[(path, v)] = x
    return [read(v) for v in jaxpr.outvars]


def evaluate_slice(
    jaxpr: Any,
    consts: Sequence,
    args: Sequence,
    env: dict,
    stacked: Callable[[Any], bool],
    slice_shape: Callable[[tuple], tuple],
    index: Any = None,
    length: int | None = None,
    offsets: Callable[[tuple], tuple] | None = None,
) -> list:
    """Evaluate the values of ``jaxpr`` laid out like the stacked leaves on
    one slice of them.

    Args:
        jaxpr: the jaxpr given to :func:`evaluate_whole`.
        consts: its consts.
        args: its arguments: a slice where ``stacked(var.aval)``, else ignored.
        env: the values :func:`evaluate_whole` recorded.
        stacked: whether an aval is laid out like the stacked leaves.
        slice_shape: a stacked shape's slice shape.
        index: the slice's layer (int32 scalar), or None. With it and
            ``length`` (the layers), layer-major values of other shapes are
            sliced too: an ``iota`` laid out like the stacked leaves (the
            rounding bits' element indices), and the ``reshape``, reductions
            over other axes and ``broadcast_in_dim`` of a sliced value whose
            leading axis is a multiple of ``length`` (int8 state's blocks and
            their scales), each slice being rows ``index * r`` to
            ``(index + 1) * r``.
        length: the number of slices of every layer-major value (see
            ``index``): the layers, times the chunks each is cut into.
        offsets: ``offsets(shape) -> per-axis start`` of the slice within a
            stacked shape (for ``iota``); None: ``index * rows`` on the
            leading axis.

    Returns:
        The outputs: slices where stacked, whole values from ``env`` elsewhere.

    Raises:
        Unchunkable: for a stacked value computed by anything but an
            elementwise primitive, a broadcast of a scalar, a call or (with
            ``index``) the layer-major steps above.
    """
    layers = _Layers(stacked, slice_shape, index, length, offsets)
    return _slice(jaxpr, consts, args, env, layers, ())


class _Layers:
    """Which avals are laid out by layers and their slice shapes: the
    caller's, and those learned from layer-major steps (see
    :func:`evaluate_slice`)."""

    def __init__(self, stacked, slice_shape, index, length, offsets=None):
        self._stacked, self._slice_shape = stacked, slice_shape
        self.index, self.length, self._offsets = index, length, offsets
        self.learned: dict[tuple, tuple] = {}

    def offsets(self, shape: tuple) -> tuple:
        """The slice's start on each axis of ``shape``."""
        shape = tuple(shape)
        if self._offsets is not None and shape not in self.learned:
            return tuple(self._offsets(shape))
        rows = self.slice_shape(shape)[0]
        return (self.index * rows,) + (0,) * (len(shape) - 1)

    def stacked(self, aval: Any) -> bool:
        shape = tuple(getattr(aval, "shape", ()) or ())
        return aval is not None and (shape in self.learned or self._stacked(aval))

    def slice_shape(self, shape: tuple) -> tuple:
        shape = tuple(shape)
        return self.learned.get(shape) or self._slice_shape(shape)

    def learn(self, shape: tuple) -> bool:
        """Register ``shape`` as layer-major, if its leading axis allows."""
        n = self.length
        if self.index is None or not n or not shape or shape[0] % n:
            return False
        self.learned.setdefault(tuple(shape), (shape[0] // n, *shape[1:]))
        return True


# Steps that keep a value layer-major (its leading axis) when their input is.
_LAYOUT = frozenset(
    {"reshape", "broadcast_in_dim", "reduce_max", "reduce_min", "reduce_sum"}
)


def _slice(jaxpr, consts, args, env, layers, path):
    local = {}

    def read(v):
        if isinstance(v, _compat.Literal):
            return v.val
        if (path, v) in local:
            return local[(path, v)]
        if layers.stacked(v.aval):
            raise Unchunkable(f"a stacked value {v.aval} with no slice")
        return env[(path, v)]

    for v in jaxpr.constvars:
        if layers.stacked(v.aval):
            raise Unchunkable(f"a stacked constant {v.aval}")
    for v, x in zip(jaxpr.invars, args):
        if layers.stacked(v.aval):
            local[(path, v)] = x
    for i, eqn in enumerate(jaxpr.eqns):
        if not any(layers.stacked(getattr(v, "aval", None)) for v in eqn.outvars):
            sliced_in = any(
                not isinstance(v, _compat.Literal) and (path, v) in local
                for v in eqn.invars
            )
            layout = sliced_in and eqn.primitive.name in _LAYOUT
            if not (layout and all(layers.learn(v.aval.shape) for v in eqn.outvars)):
                continue  # whole or scalar: from the whole evaluation
        sub = _callee(eqn)
        if sub is not None:
            invals = [
                read(v) if layers.stacked(getattr(v, "aval", None)) else None
                for v in eqn.invars
            ]
            j, c = _compat.jaxpr_parts(sub)
            outs = _slice(j, c, invals, env, layers, path + (i,))
        else:
            outs = _slice_eqn(eqn, read, layers)
        for v, x in zip(eqn.outvars, outs):
            local[(path, v)] = x
    return [
        read(v) if layers.stacked(getattr(v, "aval", None)) else None
        for v in jaxpr.outvars
    ]


def _slice_eqn(eqn: Any, read: Callable, layers: _Layers) -> list:
    """One equation with a stacked output, on slices."""
    name = eqn.primitive.name
    params = dict(eqn.params)
    first = eqn.invars[0] if eqn.invars else None
    first_aval = getattr(first, "aval", None)
    if name in _ELEMENTWISE:
        for v in eqn.invars:
            aval = getattr(v, "aval", None)
            if aval is not None and aval.ndim and not layers.stacked(aval):
                raise Unchunkable(f"{name} of a stacked and an unstacked value")
        return _bind(eqn, [read(v) for v in eqn.invars])
    out_shape = tuple(eqn.outvars[0].aval.shape)
    if name == "broadcast_in_dim" and first_aval.ndim == 0:
        params["shape"] = layers.slice_shape(out_shape)
        if "sharding" in params:  # JAX 0.10 / 0.11
            params["sharding"] = None
        return _bind(eqn, [read(first)], params)
    if layers.index is None:
        raise Unchunkable(f"{name} on a stacked value")
    if name == "iota":
        params["shape"] = layers.slice_shape(out_shape)
        if "sharding" in params:
            params["sharding"] = None
        (out,) = _bind(eqn, [], params)
        start = layers.offsets(out_shape)[params["dimension"]]
        if not isinstance(start, int) or start:  # this slice's indices
            out = out + jnp.asarray(start).astype(out.dtype)
        return [out]
    if not layers.stacked(first_aval):
        raise Unchunkable(f"{name} on a stacked value")
    if name == "reshape" and params.get("dimensions") is None:
        params["new_sizes"] = layers.slice_shape(out_shape)
        return _bind(eqn, [read(first)], params)
    if name == "broadcast_in_dim" and params["broadcast_dimensions"][:1] == (0,):
        if out_shape[0] == first_aval.shape[0]:
            params["shape"] = layers.slice_shape(out_shape)
            if "sharding" in params:
                params["sharding"] = None
            return _bind(eqn, [read(first)], params)
    if name.startswith("reduce_") and 0 not in params.get("axes", (0,)):
        return _bind(eqn, [read(first)])
    if name == "slice" and tuple(params["limit_indices"]) == first_aval.shape:
        if not any(params["start_indices"]) and set(params["strides"] or (1,)) == {1}:
            return [read(first)]  # the whole array
    raise Unchunkable(f"{name} on a stacked value")


def is_stacked(shapes: set) -> Callable[[Any], bool]:
    """Whether an aval has one of ``shapes`` (the stacked layouts)."""

    def stacked(aval: Any) -> bool:
        return tuple(getattr(aval, "shape", ())) in shapes

    return stacked


def stacked_length(shapes: Sequence[tuple]) -> int | None:
    """The leading axis shared by every shape of rank >= 3 (the layers axis of
    weights stacked for ``lax.scan``), or None (none, or several)."""
    lengths = {s[0] for s in shapes if len(s) >= 3}
    return lengths.pop() if len(lengths) == 1 else None


# Slicing stacked buffers by layer. Where the backend widens bfloat16 slices
# (XLA:CPU converts the whole buffer to float32 around each one,
# ``_compat.bf16_slices_widen``), bfloat16 buffers are sliced as uint16 views.
_BITS = jnp.uint16


def to_bits(x: Any) -> Any:
    """A bfloat16 array's uint16 view where the backend widens bfloat16
    slices; anything else unchanged."""
    if getattr(x, "dtype", None) == jnp.bfloat16 and _compat.bf16_slices_widen():
        return jax.lax.bitcast_convert_type(x, _BITS)
    return x


def from_bits(x: Any) -> Any:
    """The bfloat16 array of a uint16 view; anything else unchanged."""
    if getattr(x, "dtype", None) == _BITS:
        return jax.lax.bitcast_convert_type(x, jnp.bfloat16)
    return x


def by_layer(s: Any, length: int) -> Any:
    """A stored stacked buffer laid out for :func:`take`: int8 scales as
    ``(length, blocks per layer)``, bfloat16 as :func:`to_bits`."""
    if isinstance(s, BlockQuantized):
        return BlockQuantized(s.codes, s.scales.reshape(length, -1))
    return to_bits(s)


def from_layers(s: Any) -> Any:
    """The inverse of :func:`by_layer` (None stays None)."""
    if isinstance(s, BlockQuantized):
        return BlockQuantized(s.codes, s.scales.reshape(-1))
    return from_bits(s)


def take(a: Any, i: Any) -> Any:
    """Layer ``i`` of a :func:`by_layer` buffer, its leading axis of 1 kept."""
    if isinstance(a, BlockQuantized):
        codes = jax.lax.dynamic_slice_in_dim(a.codes, i, 1, 0)
        return BlockQuantized(
            codes, jax.lax.dynamic_index_in_dim(a.scales, i, 0, False)
        )
    return from_bits(jax.lax.dynamic_slice_in_dim(a, i, 1, 0))


def put(a: Any, v: Any, i: Any) -> Any:
    """``a`` (a :func:`by_layer` buffer) with layer ``i`` replaced by ``v``."""
    if isinstance(a, BlockQuantized):
        codes = jax.lax.dynamic_update_slice_in_dim(a.codes, v.codes, i, 0)
        scales = jax.lax.dynamic_update_index_in_dim(a.scales, v.scales, i, 0)
        return BlockQuantized(codes, scales)
    return jax.lax.dynamic_update_slice_in_dim(a, to_bits(v), i, 0)
