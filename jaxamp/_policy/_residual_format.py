"""How a compressed residual is stored: 8-bit values with per-group scales.

A residual ``x`` (any float array) is stored as ``q``, an 8-bit array of
``x``'s shape, and ``scale``, float32 of shape ``x.shape[:-1] + (n,)``: the
last axis is cut into ``n`` groups of ``G`` consecutive values (1 x G tiles,
as DeepSeek-V3's 1 x 128 activation tiles, arXiv 2412.19437 section 3.3, and
COAT's per-group scales, arXiv 2410.19313), each scaled by its own current
absolute maximum (computed from the value itself: no history, no state)::

    scale = amax(|group|) / bound        (1 where the group is all zeros)
    q = saturate(group / scale)          (rounded to the nearest 8-bit value)
    decoded = q * scale

Rule for short and odd axes: a last axis of length ``L <= G`` is one group per
row; a longer one that ``G`` does not divide ends in one shorter group
(``L mod G`` values). An array whose last axis is shorter than
:data:`MIN_AXIS` is not compressed (a float32 scale per fewer than 32 values
costs more than an eighth of a byte per value), nor is a 0-d or 8-bit one.

A group with an infinite value gets an infinite scale and decodes to NaN
everywhere, so a forward overflow stays visible to loss scaling.

The stored form is the codec's :class:`Recipe` (``_base/_codec.py``:
last-axis groups, a step scale), which a residual rule hands the codec as it
is (:func:`residual_recipe`); the bound, the default group and whether
products' inputs are stored come from its registered format
(``_base/_formats.py``). INT8 spaces
its 255 levels evenly, so one outlier coarsens every other value of its group;
its default group is 32 values (Jetfire's 32-wide blocks, arXiv 2403.12422),
where FP8's logarithmic spacing keeps small values precise next to a large one
at 128.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from .._base import _formats
from .._base._codec import LastAxisGroups, Recipe, dequantize, quantize
from .._base._dtypes import is_float

MIN_AXIS = 32


def residual_recipe(spec: Any, group: int | None = None) -> Recipe:
    """The codec's recipe of a stored residual: ``spec``'s registered format
    (a name, alias or dtype), 1 x ``group`` groups along the last axis (None:
    the format's own group), a step scale.

    Raises:
        ValueError: if ``spec`` names no registered 8-bit format.
    """
    fmt = _formats.require(spec, "residual format")
    size = fmt.group if group is None else group
    return Recipe(format=fmt, group=LastAxisGroups(size), scale_form="step")


def product_form(recipe: Recipe) -> Recipe:
    """The recipe of a value a product's input is recomputed from or a weight
    gradient reads: ``recipe`` where its format stores products' inputs
    (``QFormat.stores_products``: of the built-in formats, int8's, 0.5% rms
    error per value in 32-wide groups), else int8 in 1 x 32 groups. FP8's 3
    or 2 mantissa bits (2.6%, 5.1%) reach a weight gradient ``x^T g``
    undamped."""
    if recipe.format.stores_products:
        return recipe
    return residual_recipe(_formats.INT8)


def parse_dtype(dtype: Any, argname: str) -> np.dtype | None:
    """The stored dtype named by ``dtype`` (None: not compressed): a registered
    8-bit format's name, alias or dtype.

    Raises:
        ValueError: for anything but a registered format or None.
    """
    if dtype is None:
        return None
    fmt = _formats.lookup(dtype)
    if fmt is None:
        names = ", ".join(repr(f.name) for f in _formats.registered())
        raise ValueError(
            f"{argname}={dtype!r}: residuals are stored in a registered 8-bit "
            f"format ({names}; jaxamp.extend.register_format adds one), e.g. "
            "jnp.float8_e4m3fn or 'int8' (or None: in the dtype amp computes "
            "them in)."
        )
    return fmt.dtype


def compressible(x: Any) -> bool:
    """Whether ``x`` is stored compressed (see the module docstring)."""
    return isinstance(x, jax.Array) and compressible_aval(x)


def compressible_aval(x: Any) -> bool:
    """:func:`compressible` for anything with a shape and dtype (an aval)."""
    shape = getattr(x, "shape", ())
    dtype = getattr(x, "dtype", None)
    return (
        dtype is not None
        and is_float(dtype)
        and np.dtype(dtype).itemsize > 1
        and len(shape) >= 1
        and shape[-1] >= MIN_AXIS
    )


def encode(x: Any, recipe: Recipe) -> tuple[Any, Any]:
    """``(q, scale)``: ``x`` stored by ``recipe`` (see the module docstring).

    Args:
        x: float array, last axis at least :data:`MIN_AXIS` long.
        recipe: the stored form (:func:`residual_recipe`).

    Returns:
        ``q`` of ``x``'s shape in ``recipe.dtype`` and float32 ``scale`` of
        shape ``x.shape[:-1] + (n,)``.
    """
    q, scale = quantize(x.astype(np.float32), recipe)  # float32 groups' amax
    # The codes are what the backward pass reads: without a barrier XLA:GPU
    # may delete an FP8 round trip (excess precision, openxla/xla#41605) or
    # fuse the encoding into the decoding and keep the activation alive
    # instead (tests/test_gpu_target.py checks the H100 target's HLO).
    return jax.lax.optimization_barrier((q, scale))


def decode(q: Any, scale: Any, recipe: Recipe, dtype: Any) -> Any:
    """The value ``(q, scale)`` stores, in ``dtype`` (inverse of :func:`encode`)."""
    return dequantize(q, scale, recipe, dtype)
