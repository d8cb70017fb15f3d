"""One 8-bit codec: :func:`quantize` and :func:`dequantize` with a
:class:`Recipe`, for every 8-bit value jaxamp makes.

Its callers differ only in their recipes:

* FP8 matmul operands (``_quant/_fp8.py``): one scale per tensor, a multiplier
  ``q ~= x * scale`` that the product is unscaled by (Transformer Engine's
  current scaling); a non-finite tensor passes unscaled, so its inf and NaN
  reach the product;
* int8 matmul operands (``_quant/_int8.py``): one scale per row along the
  contracting dims (AQT, qwix, torchao), stochastic rounding of gradients; a
  non-finite row gets a NaN scale;
* stored residuals (``_policy/_residual_format.py``): 1 x G groups along the last axis,
  a step ``x ~= q * scale`` (DeepSeek-V3's tiles);
* 8-bit optimizer state (``_training/_rounding.py``): blocks of the flattened
  array, codes of bitsandbytes' dynamic map (a code-table format).

Each group of values shares one float32 scale from its current absolute maximum
``amax`` (no history, no state). Formats are values (``_formats.py``). The
recipe follows qwix's ``QuantizationRule``: a frozen, keyword-only dataclass
with one commented field per knob.

Stochastic rounding draws its noise from the data (:func:`rounding_noise`):
an amp rule owns no state and sees one trace, so it cannot advance a PRNG key
from step to step. Every random bit in jaxamp comes from :func:`mix32` (two
multiply-xorshift rounds) over :func:`flat_index`; the int8 noise and the
optimizer's noise (``_training/_rounding.py``) use two constant sets of it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from . import _formats

F32, U32 = np.dtype(jnp.float32), np.dtype(jnp.uint32)
# Largest scale: 2**126, whose inverse 2**-126 is float32's smallest normal (an
# inverse scale in the subnormal range would be flushed to zero on CPU and GPU).
MAX_SCALE = np.float32(2.0**126)
# The name (``jax.ad_checkpoint.checkpoint_name``) of an amax that a user's
# ``jax.checkpoint`` saves whatever its policy (``_policy/_checkpoint.py``:
# ``saving_amax``): the recompute then scales by the forward's amax and runs no
# reduction of its own. Only the amaxes of :class:`PerTensor` and
# :class:`PerAxes` groupings are named (matmul operands: a scalar, or one value
# per row or column, a few bytes saved), never those of 1 x G groups or blocks
# (stored residuals and optimizer state, whose amaxes no recompute repeats).
AMAX_NAME = "jaxamp_amax"
# Multiply-xorshift constants (shift, multiplier, shift, multiplier, shift):
# Wellons' lowbias32 (https://nullprogram.com/blog/2018/07/31/) and
# MurmurHash3's fmix32 (Appleby, public domain); each has full avalanche.
LOWBIAS32 = (16, 0x7FEB352D, 15, 0x846CA68B, 16)
MURMUR3_FMIX32 = (16, 0x85EBCA6B, 13, 0xC2B2AE35, 16)
ROUNDINGS = ("nearest", "stochastic")
SCALE_FORMS = ("multiplier", "step")
NONFINITE = ("pass", "nan")


def mix32(h: jax.Array, constants: tuple = LOWBIAS32) -> jax.Array:
    """An integer hash of uint32 ``h``: two multiply-xorshift rounds with
    ``constants`` (:data:`LOWBIAS32` or :data:`MURMUR3_FMIX32`); a bijection
    of uint32 with full avalanche."""
    s1, m1, s2, m2, s3 = (np.uint32(c) for c in constants)
    h = h ^ (h >> s1)
    h = h * m1
    h = h ^ (h >> s2)
    h = h * m2
    return h ^ (h >> s3)


def flat_index(shape: tuple[int, ...], offset: jax.Array | int = 0) -> jax.Array:
    """Row-major flat index of every element of an array of ``shape`` (uint32),
    plus ``offset`` (modulo 2^32).

    Built from ``broadcasted_iota``, so under ``jit`` with a sharded operand each
    shard computes the indices of its own elements in the *global* array; a
    slice of rows of a larger array passes the flat index of its first element
    as ``offset`` and gets the larger array's indices.
    """
    flat = jnp.zeros(shape, U32)
    if not (isinstance(offset, int) and offset == 0):
        flat = flat + jnp.asarray(offset).astype(U32)
    stride = 1
    for axis in reversed(range(len(shape))):
        step = np.uint32(stride % 2**32)
        flat = flat + jax.lax.broadcasted_iota(U32, shape, axis) * step
        stride *= shape[axis]
    return flat


def rounding_noise(x: jax.Array, seed: Any = 0, amax: Any = None) -> jax.Array:
    """Uniform ``[0, 1)`` noise for stochastic rounding, derived from ``x``.

    Each element's noise is a hash of its float32 bits, its flat index, a
    digest of the tensor (the wrapping sum of the bit patterns of its
    ``amax`` values: the quantization's own reductions, one per row) and
    ``seed``. Consequences: the noise changes whenever the data changes (an
    element's own value changes its noise; any change of a row's ``amax``,
    which the next step's or microbatch's gradient brings, changes every
    element's), is identical for identical inputs (reruns, recomputation
    under ``jax.checkpoint``, data-parallel replicas) and needs no key
    threaded through the training step.

    Cost: two multiply-xorshift hashes per element, inside the rounding's own
    pass; no pass over ``x`` of its own (a digest of every element's bits
    would be one more read of ``x``, which XLA does not fuse into the
    ``amax`` reduction).

    Args:
        x: float array, any shape and float dtype (hashed as float32).
        seed: a uint32 scalar (array or int) mixed into every element's hash;
            0 for the data-derived noise alone.
        amax: the float32 ``amax`` values the quantization reduced ``x`` to
            (any shape); None: ``max |x|``.

    Returns:
        float32 array of ``x``'s shape, values ``k * 2**-24`` in ``[0, 1)``.
    """
    xf = x.astype(F32)
    if amax is None:
        amax = jnp.max(jnp.abs(xf))
    amax_bits = jax.lax.bitcast_convert_type(jnp.asarray(amax, F32), U32)
    digest = jnp.sum(mix32(amax_bits), dtype=U32) ^ jnp.asarray(seed, U32)
    key = mix32(mix32(digest) + np.uint32(0x2545F491))
    bits = jax.lax.bitcast_convert_type(xf, U32)
    u = mix32(bits ^ mix32(flat_index(x.shape) ^ key))
    return (u >> np.uint32(8)).astype(F32) * np.float32(2.0**-24)


# Groupings: which values share a scale. Each splits a float32 array into a
# view whose groups ``amax`` reduces, spreads a scale over its group and
# merges the view back into the array's shape.


@dataclasses.dataclass(frozen=True)
class PerTensor:
    """One scale for the whole array: a float32 scalar."""

    def split(self, x: jax.Array) -> jax.Array:
        return x

    def amax(self, v: jax.Array) -> jax.Array:
        return jnp.max(jnp.abs(v))

    def spread(self, s: jax.Array) -> jax.Array:
        return s

    def merge(self, v: jax.Array, shape: tuple) -> jax.Array:
        return v


@dataclasses.dataclass(frozen=True)
class PerAxes(PerTensor):
    """One scale per slice: ``amax`` reduced over ``axes`` (non-negative
    dims; None: all), which the scale keeps as size-1 dims (a matmul operand's
    contracting dims: one scale per row)."""

    axes: tuple[int, ...] | None = None

    def amax(self, v: jax.Array) -> jax.Array:
        axes = tuple(range(v.ndim)) if self.axes is None else self.axes
        return jnp.max(jnp.abs(v), axis=axes, keepdims=True)


@dataclasses.dataclass(frozen=True)
class LastAxisGroups:
    """1 x G groups: the last axis cut into ``size`` consecutive values (a last
    axis of length ``L <= size`` is one group; else the last group is shorter,
    ``L mod size``); the scale has shape ``x.shape[:-1] + (groups,)``."""

    size: int

    def split(self, x: jax.Array) -> jax.Array:
        length = x.shape[-1]
        g = min(self.size, length)
        n = -(-length // g)
        pad = n * g - length
        if pad:
            x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])
        return x.reshape(*x.shape[:-1], n, g)

    def amax(self, v: jax.Array) -> jax.Array:
        return jnp.max(jnp.abs(v), axis=-1)

    def spread(self, s: jax.Array) -> jax.Array:
        return s[..., None]

    def merge(self, v: jax.Array, shape: tuple) -> jax.Array:
        return v.reshape(*shape[:-1], -1)[..., : shape[-1]]


@dataclasses.dataclass(frozen=True)
class FlatBlocks(LastAxisGroups):
    """Blocks of ``size`` consecutive elements of the row-major flattened
    array (bitsandbytes' block-wise quantization; the last block zero-padded),
    so that sharding the array does not change them; the scale has shape
    ``(blocks,)``."""

    def split(self, x: jax.Array) -> jax.Array:
        flat = x.reshape(-1)
        pad = (-flat.size) % self.size
        if pad:
            flat = jnp.pad(flat, (0, pad))
        return flat.reshape(-1, self.size)

    def merge(self, v: jax.Array, shape: tuple) -> jax.Array:
        return v.reshape(-1)[: int(np.prod(shape, dtype=np.int64))].reshape(shape)


GROUPINGS = (PerTensor, PerAxes, LastAxisGroups, FlatBlocks)


def _choice(owner: str, name: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"{owner}({name}={value!r}): one of {choices}.")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Recipe:
    """How an array is stored in 8 bits (qwix's ``QuantizationRule``: one
    field per knob, compared by value).

    Raises:
        ValueError: for an unregistered format name, an unknown choice, a
            stochastic rounding of a float or code-table format, or
            ``power_of_two`` with a step.
        TypeError: for a ``group`` that is no grouping.
    """

    # The 8-bit format: a QFormat, a registered name or dtype, or another
    # 8-bit dtype (a format of its own, named by its dtype).
    format: Any
    # Which values share one scale: PerTensor(), PerAxes(axes),
    # LastAxisGroups(size) or FlatBlocks(size).
    group: Any = PerTensor()
    # The dtype of the returned scales (the arithmetic is float32).
    scale_dtype: Any = F32
    # "nearest" (ties to even; a code table's nearest code) or "stochastic"
    # (integer formats: floor(y + u), u uniform in [0, 1), so E[q] = y).
    rounding: str = "nearest"
    # A uint32 seed (int or scalar array) mixed into the stochastic noise.
    seed: Any = 0
    # "multiplier": q ~= x * scale, amax mapped to the bound (matmul operands,
    # unscaled by 1 / scale after the product); "step": x ~= q * scale, with
    # scale = amax / bound (stored values, decoded with one multiply).
    scale_form: str = "multiplier"
    # Powers of two of headroom below the format's bound (Transformer
    # Engine's margin); 0 uses the full range.
    margin: int = 0
    # Round a multiplier down to a power of two (Transformer Engine's
    # power_2_scale), so that scaling and unscaling are exact.
    power_of_two: bool = False
    # A group whose amax is 0, inf or NaN. "pass": its multiplier is 1 and
    # the values are cast unscaled, so inf and NaN reach the codes (a step is
    # 1 where amax is not positive; an infinite amax gives an infinite step,
    # which decodes to NaN). "nan": a multiplier of NaN for a non-finite group
    # (1 for an all-zero one), a step stored as computed (0 for an all-zero
    # group, NaN for one with a NaN), so what it unscales or decodes to is NaN.
    nonfinite: str = "pass"

    def __post_init__(self):
        fmt = _formats.as_format(self.format, "Recipe(format)")
        object.__setattr__(self, "format", fmt)
        object.__setattr__(self, "scale_dtype", np.dtype(self.scale_dtype))
        if not isinstance(self.group, GROUPINGS):
            raise TypeError(
                f"Recipe(group={self.group!r}): PerTensor(), PerAxes(axes), "
                "LastAxisGroups(size) or FlatBlocks(size)."
            )
        _choice("Recipe", "rounding", self.rounding, ROUNDINGS)
        _choice("Recipe", "scale_form", self.scale_form, SCALE_FORMS)
        _choice("Recipe", "nonfinite", self.nonfinite, NONFINITE)
        if self.rounding == "stochastic" and fmt.kind != "int":
            raise ValueError(
                f"Recipe(rounding='stochastic'): for integer formats; "
                f"{fmt.name} rounds to its nearest value."
            )
        if self.power_of_two and self.scale_form != "multiplier":
            raise ValueError("Recipe(power_of_two=True): a multiplier's option.")

    @property
    def dtype(self) -> np.dtype:
        """The dtype of the codes: the format's 8-bit dtype."""
        return self.format.dtype


def _multiplier(amax: jax.Array, bound: np.float32, recipe: Recipe) -> tuple:
    """``(stored scale, multiplier)`` of each group."""
    ok = (amax > 0) & jnp.isfinite(amax)
    s = bound / jnp.where(ok, amax, np.float32(1))
    s = jnp.minimum(s, MAX_SCALE)  # amax tiny: bound / amax may be inf
    if recipe.power_of_two:
        mantissa, exponent = jnp.frexp(s)  # s = mantissa * 2**exponent
        del mantissa  # in [0.5, 1): 2**(exponent - 1) <= s
        s = jnp.ldexp(np.float32(1), exponent - 1)
    if recipe.nonfinite == "pass":
        mult = jnp.where(ok, s, np.float32(1))
        return mult, mult
    stored = jnp.where(ok, s, jnp.where(amax == 0, np.float32(1), np.nan))
    return stored, jnp.where(ok, stored, np.float32(1))


def _step(amax: jax.Array, bound: np.float32, recipe: Recipe) -> tuple:
    """``(stored scale, divisor)`` of each group."""
    positive = amax > 0
    step = amax if bound == 1 else amax / bound
    divisor = jnp.where(positive, step, np.float32(1.0))
    return (step if recipe.nonfinite == "nan" else divisor), divisor


def _codes(y: jax.Array, noise: Any, recipe: Recipe, bound: np.float32) -> Any:
    """The scaled values ``y`` rounded and cast to the format's codes."""
    fmt = recipe.format
    if fmt.kind == "codes":
        return fmt.codes[0](y)
    if fmt.kind == "int":
        y = jnp.round(y) if noise is None else jnp.floor(y + noise)
    # Saturate, except a float multiplier's cast: its scaled finite values
    # never exceed the bound, and a "pass" group's inf and NaN must reach the
    # codes.
    if fmt.kind == "int" or recipe.scale_form == "step":
        y = jnp.clip(y, -bound, bound)
    return y.astype(fmt.dtype)


def quantize(x: jax.Array, recipe: Recipe) -> tuple[jax.Array, jax.Array]:
    """``x`` in 8 bits: codes and per-group scales (see :class:`Recipe`).

    Args:
        x: float array, any shape and float dtype; its amax is reduced in
            its own dtype, the scaling and rounding run in float32.
        recipe: the format, grouping, rounding and scale form.

    Returns:
        ``(q, scale)``: ``q`` of ``x``'s shape in ``recipe.format.dtype``;
        ``scale`` in ``recipe.scale_dtype``, shaped by the grouping (a scalar
        per tensor; ``x``'s rank with size-1 reduced dims per axes;
        ``x.shape[:-1] + (groups,)`` for last-axis groups; ``(blocks,)``).
        Multipliers are capped at ``2**126`` (their inverses stay normal).
        A per-tensor or per-slice amax is named :data:`AMAX_NAME`
        (``checkpoint_name``): a user's ``jax.checkpoint`` around the call
        saves it, and its recompute scales by it instead of reducing ``x``
        again.
    """
    fmt, group = recipe.format, recipe.group
    # amax of x as passed: in its own dtype (abs and max round nothing). A
    # caller that scales by the float32 values' amax passes them: where XLA
    # keeps a bfloat16 x's producer in float32 (excess precision), the two
    # orders can see different values.
    v = group.split(x)
    amax = group.amax(v).astype(F32)
    if isinstance(group, PerTensor):  # PerAxes too
        amax = checkpoint_name(amax, AMAX_NAME)
    bound = np.float32(fmt.bound / 2.0**recipe.margin)
    if recipe.scale_form == "multiplier":
        stored, mult = _multiplier(amax, bound, recipe)
    else:
        stored, divisor = _step(amax, bound, recipe)
    xf = x.astype(F32)
    if x.dtype != F32:
        v = group.split(xf)
    if recipe.scale_form == "multiplier":
        y = v * group.spread(mult)
    else:
        y = v / group.spread(divisor)
    noise = None
    if recipe.rounding == "stochastic":
        noise = group.split(rounding_noise(xf, recipe.seed, amax))
    q = group.merge(_codes(y, noise, recipe, bound), x.shape)
    return q, stored.astype(recipe.scale_dtype)


def dequantize(
    q: jax.Array, scale: jax.Array, recipe: Recipe, dtype: Any = F32
) -> jax.Array:
    """The values ``(q, scale)`` stand for, in ``dtype``: codes times a step;
    a multiplier's codes divided by it (the inverse of :func:`quantize`).

    Args:
        q: codes from :func:`quantize` with ``recipe``.
        scale: their scales.
        recipe: the recipe they were made with.
        dtype: the result's dtype.

    Returns:
        An array of ``q``'s shape in ``dtype``.
    """
    fmt, group = recipe.format, recipe.group
    values = fmt.codes[1](q) if fmt.kind == "codes" else q.astype(F32)
    s = scale.astype(F32)
    if recipe.scale_form == "multiplier":
        s = np.float32(1) / s
    v = group.split(values) * group.spread(s)
    return group.merge(v, q.shape).astype(dtype)
