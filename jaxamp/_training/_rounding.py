"""Bit-level rounding to bfloat16 and block-wise 8-bit codes for optimizer state.

Every rounding here is written with integer bit operations or
``lax.reduce_precision``: XLA keeps a value in a wider type than its dtype when
``xla_allow_excess_precision`` is on (the default), which can remove a rounding
written as an ``astype`` round trip (jax#6283, jax#23007). Bit operations and
``reduce_precision`` are never removed.

Random bits come from a stateless integer hash of (seed, step, stream, global
element index), as llm.c's stochastic rounding does (``llmc/adamw.cuh``): no RNG
state, and the same bits for an array on one device or sharded over a mesh. The
hash and the index are the codec's (``_base/_codec.py``), as is the block-wise
8-bit quantization (its code table is a format of its own, :data:`DYNAMIC8`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .._base._codec import MURMUR3_FMIX32, FlatBlocks, Recipe, flat_index, mix32
from .._base._codec import dequantize as _dequantize
from .._base._codec import quantize as _quantize
from .._base._formats import QFormat

_U32 = jnp.uint32
_GOLDEN = 0x9E3779B1
_BF16_MAX_BITS = 0x7F7F  # largest finite bfloat16, bit pattern of its magnitude


def _fmix32(h: jax.Array) -> jax.Array:
    """MurmurHash3's 32-bit finalizer (the codec's :func:`mix32` with its
    constants)."""
    return mix32(h, MURMUR3_FMIX32)


def noise_bits(
    shape: tuple[int, ...],
    seed: int,
    step: jax.Array,
    stream: int,
    offset: jax.Array | int = 0,
) -> jax.Array:
    """Uniform uint32 bits for each element of an array of ``shape``.

    Args:
        shape: the global (logical) shape of the array to round.
        seed: Python int, the user's seed.
        step: int32 scalar, the optimizer step (a new draw every step).
        stream: Python int naming the buffer (leaf index and buffer kind), so
            two buffers never share bits.
        offset: flat index of the first element when ``shape`` is a block of
            rows of a larger array (int or int32 scalar): the bits are that
            array's bits for those elements.

    Returns:
        uint32 array of ``shape``: a hash of (seed, step, stream, global index).
    """
    key = _fmix32(jnp.asarray((seed * _GOLDEN + stream) % 2**32, _U32))
    key = _fmix32(key ^ (jnp.asarray(step).astype(_U32) * _U32(_GOLDEN)))
    return _fmix32(_fmix32(flat_index(shape, offset) ^ key) + key)


def _top_half_to_bf16(bits: jax.Array) -> jax.Array:
    """The bfloat16 whose bit pattern is the top 16 bits of a uint32 array."""
    return lax.bitcast_convert_type((bits >> 16).astype(jnp.uint16), jnp.bfloat16)


def round_nearest_bf16(x: jax.Array) -> jax.Array:
    """Round float32 ``x`` to bfloat16, to nearest even (overflow to inf, NaN kept).

    ``lax.reduce_precision`` performs the rounding (XLA never removes it) and
    the result's top 16 bits are taken as the bfloat16, an exact step.
    """
    x = lax.reduce_precision(x.astype(jnp.float32), exponent_bits=8, mantissa_bits=7)
    return _top_half_to_bf16(lax.bitcast_convert_type(x, _U32))


def round_stochastic_bf16(x: jax.Array, bits: jax.Array) -> jax.Array:
    """Unbiased stochastic rounding of float32 ``x`` to bfloat16.

    Adds the low 16 random bits to the low half of ``x``'s bit pattern and
    truncates (torchao's ``_fp32_to_bf16_sr``, Zamirai et al. 2020): a value a
    fraction ``f`` of the way from one bfloat16 neighbour to the next rounds up
    with probability ``f``, so ``E[round(x)] = x``. Non-finite values are rounded
    to nearest (inf and NaN kept); a finite value above the largest bfloat16
    rounds to the largest bfloat16, never to inf.

    Args:
        x: float32 array.
        bits: uint32 array of ``x``'s shape (from :func:`noise_bits`).

    Returns:
        bfloat16 array of ``x``'s shape.
    """
    x = x.astype(jnp.float32)
    xb = lax.bitcast_convert_type(x, _U32)
    up = (xb + (bits & _U32(0xFFFF))) & _U32(0xFFFF0000)
    sign = up & _U32(0x80000000)
    overflow = ((up >> 16) & _U32(0x7FFF)) > _U32(_BF16_MAX_BITS)
    up = jnp.where(overflow, sign | _U32(_BF16_MAX_BITS << 16), up)
    return jnp.where(jnp.isfinite(x), _top_half_to_bf16(up), round_nearest_bf16(x))


def code_values(idx: jax.Array) -> jax.Array:
    """bitsandbytes' signed dynamic quantization map (Dettmers et al. 2022,
    "8-bit Optimizers via Block-wise Quantization", section 2.2): the float32
    value in [-1, 1] of each code index 0..255, computed elementwise.

    Seven decades ``10^(i-6)``, ``i = 0..6``; decade ``i`` holds the midpoints
    of ``2^i + 1`` equally spaced points in ``[0.1, 1]`` (``2^i`` values), with
    both signs; then 0 (index 127) and 1 (index 255), sorted. Small magnitudes
    keep relative precision, which linear codes lose (a second moment 1e-4 of
    its block's largest becomes 0). Arithmetic rather than a table lookup, so
    that XLA fuses decoding into the optimizer's update.
    """
    idx = idx.astype(jnp.int32)
    pos = jnp.where(idx >= 128, idx - 128, 126 - idx)  # rank among one sign
    i = sum((pos + 1 >= 2**j).astype(jnp.int32) for j in range(1, 7))
    n = jnp.left_shift(1, i).astype(jnp.float32)
    k = (pos + 1).astype(jnp.float32) - n
    decade = jnp.float32(0)
    for j in range(7):
        decade = jnp.where(i == j, np.float32(10.0 ** (j - 6)), decade)
    mag = decade * (0.1 + 0.9 * (k + 0.5) / n)
    val = jnp.where(idx >= 128, mag, -mag)
    val = jnp.where(idx == 127, 0.0, val)
    return jnp.where(idx == 255, 1.0, val).astype(jnp.float32)


class BlockQuantized(NamedTuple):
    """An optimizer-state buffer stored as 8-bit codes with a float32 scale per
    block of the flattened (global, row-major) array.

    Attributes:
        codes: int8, the buffer's shape; ``code + 128`` indexes the map.
        scales: float32, shape ``(ceil(size / block_size),)``, each block's absmax.
    """

    codes: jax.Array
    scales: jax.Array


def _nearest_code(v: jax.Array) -> jax.Array:
    """Index (0..255) of the dynamic map's value nearest to each ``v`` in
    [-1, 1], elementwise (XLA fuses it; a table search would not be).

    The value's decade ``i`` and its slot ``k`` in that decade give a first
    index; comparing it with its two neighbours in the sorted map corrects a
    decade boundary or a ``log10`` rounding.
    """
    a = jnp.abs(v)
    i = jnp.clip(jnp.floor(jnp.log10(jnp.maximum(a, 1e-7))) + 7.0, 0.0, 6.0)
    n = jnp.exp2(i)
    k = jnp.clip(jnp.round((a / 10.0 ** (i - 6.0) - 0.1) / 0.9 * n - 0.5), 0.0, n - 1)
    pos = (n - 1.0 + k).astype(jnp.int32)  # values below this decade: 2**i - 1
    idx = jnp.where(v < 0, 126 - pos, 128 + pos)
    best = idx
    for cand in (idx - 1, idx + 1):
        cand = jnp.clip(cand, 0, 255)
        closer = jnp.abs(code_values(cand) - v) < jnp.abs(code_values(best) - v)
        best = jnp.where(closer, cand, best)
    return best


def _to_codes(v: jax.Array) -> jax.Array:
    return (_nearest_code(v) - 128).astype(jnp.int8)


def _from_codes(codes: jax.Array) -> jax.Array:
    return code_values(codes.astype(jnp.int32) + 128)


DYNAMIC8 = QFormat(
    name="dynamic8", dtype=jnp.int8, bound=1.0, codes=(_to_codes, _from_codes)
)
"""bitsandbytes' dynamic map as a codec format: int8 codes, ``code + 128``
indexing :func:`code_values`; values in [-1, 1]. Not registered: it is the
optimizer state's own, and a report reads int8 codes as the int8 format's."""


def _recipe(block_size: int) -> Recipe:
    # The stored scale is each block's absmax as it is (0 for a zero block, NaN
    # for a block with a NaN, so that it decodes to NaN).
    return Recipe(
        format=DYNAMIC8,
        group=FlatBlocks(block_size),
        scale_form="step",
        nonfinite="nan",
    )


def quantize_blockwise(x: jax.Array, block_size: int) -> BlockQuantized:
    """Block-wise absmax quantization of ``x`` to the dynamic map's 8-bit codes.

    Blocks are consecutive ``block_size`` elements of the row-major flattened
    global array, so a sharding of ``x`` does not change them. Each element gets
    the nearest code of ``x / absmax(block)``.

    Args:
        x: float array of any shape.
        block_size: elements per block (bitsandbytes and torchao use 256).

    Returns:
        :class:`BlockQuantized` with ``codes`` of ``x``'s shape.
    """
    return BlockQuantized(*_quantize(x.astype(jnp.float32), _recipe(block_size)))


def dequantize_blockwise(q: BlockQuantized, block_size: int) -> jax.Array:
    """Float32 values of a :class:`BlockQuantized` buffer (its codes' shape)."""
    return _dequantize(q.codes, q.scales, _recipe(block_size))


class StateCodec(NamedTuple):
    """How :func:`jaxamp.low_precision_optimizer` rounds and stores its state:
    its validated arguments, and the encoding of float32 state buffers as
    bfloat16 (rounded) or block-wise int8 codes."""

    rounding: str
    state_kind: Any  # None, "bfloat16" or "int8"
    seed: int
    min_size: int
    block_size: int
    # When stacked leaves are updated one slice at a time: "int8" (with int8
    # state, whose decoded float32 moments would otherwise exist for whole
    # leaves), "always" or "never" (the two are bit-identical; tests).
    slices: str = "int8"

    def state_round(self, x, step, stream, offset=0):
        if self.rounding == "nearest":
            return round_nearest_bf16(x)
        bits = noise_bits(x.shape, self.seed, step, stream, offset)
        return round_stochastic_bf16(x, bits)

    def encode_leaf(self, x, kind, step, stream, offset=0):
        """One float32 state buffer (or a slice of rows of it starting at
        flat index ``offset``) stored as ``kind`` says."""
        if kind == "int8":
            return quantize_blockwise(x, self.block_size)
        if kind == "bfloat16":
            return self.state_round(x, step, stream, offset)
        return x

    def encode(self, state32, plan, step):
        """The float32 inner state stored as ``plan`` says (streams 2i + 1)."""
        leaves, sdef = jax.tree_util.tree_flatten(state32)
        kinds = jax.tree_util.tree_leaves(plan)
        out = [
            self.encode_leaf(x, k, step, 2 * i + 1)
            for i, (x, k) in enumerate(zip(leaves, kinds))
        ]
        return jax.tree_util.tree_unflatten(sdef, out)

    def decode_leaf(self, t, s):
        """A stored buffer (or slice) in the dtype of template leaf ``t``."""
        if isinstance(s, BlockQuantized):
            return dequantize_blockwise(s, self.block_size).astype(t.dtype)
        return s.astype(t.dtype) if hasattr(s, "astype") else s

    def decode(self, stored, template):
        """The stored inner state in ``template``'s dtypes."""
        return jax.tree_util.tree_map(
            self.decode_leaf,
            template,
            stored,
            is_leaf=lambda x: isinstance(x, BlockQuantized),
        )
