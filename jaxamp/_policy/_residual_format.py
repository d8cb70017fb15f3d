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

The arithmetic is the codec's (``_base/_codec.py``: last-axis groups, a step
scale); the bound, the default group and whether products' inputs are stored
come from the dtype's registered format (``_base/_formats.py``). INT8 spaces
its 255 levels evenly, so one outlier coarsens every other value of its group;
its default group is 32 values (Jetfire's 32-wide blocks, arXiv 2403.12422),
where FP8's logarithmic spacing keeps small values precise next to a large one
at 128.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from .._base import _formats
from .._base._codec import LastAxisGroups, Recipe, dequantize, quantize
from .._base._dtypes import is_float

MIN_AXIS = 32


@dataclasses.dataclass(frozen=True)
class Format:
    """A stored form: the 8-bit dtype and the group length along the last axis;
    the rest is read from the dtype's registered format (``_base/_formats.py``).

    Attributes:
        dtype: the dtype of a registered 8-bit format (``float8_e4m3fn``,
            ``float8_e5m2``, ``int8``, or one added by
            ``jaxamp.extend.register_format``).
        group: values per scale along the last axis.
    """

    dtype: np.dtype
    group: int

    @property
    def qformat(self) -> _formats.QFormat:
        """The registered format of :attr:`dtype`."""
        return _formats.require(self.dtype, "Format(dtype)")

    @property
    def bound(self) -> float:
        """The largest stored magnitude: 448 (E4M3), 57344 (E5M2), 127 (INT8)."""
        return self.qformat.bound

    @property
    def stores_products(self) -> bool:
        """Whether the inputs a product's weight gradient reads are stored in
        this form (the format's own property; of the built-in formats, int8's:
        0.5% rms error per value in 32-wide groups). FP8's 3 or 2 mantissa
        bits (2.6%, 5.1%) reach a weight gradient ``x^T g`` undamped, so FP8
        leaves those inputs in the compute dtype and stores the inputs of
        non-linearities, norms and attention."""
        return self.qformat.stores_products

    @property
    def product_form(self) -> Format:
        """The form of a value saved at a ``jax.checkpoint`` boundary that a
        product's input is recomputed from (``_checkpoint.py``): this one
        where it stores products' inputs, else int8 in 1 x 32 groups."""
        if self.stores_products:
            return self
        return Format(_formats.INT8.dtype, _formats.INT8.group)

    @property
    def recipe(self) -> Recipe:
        """The codec's recipe of this form (``_base/_codec.py``)."""
        return Recipe(
            format=self.qformat, group=LastAxisGroups(self.group), scale_form="step"
        )

    def groups(self, length: int) -> tuple[int, int]:
        """``(group length, number of groups)`` for a last axis of ``length``."""
        g = min(self.group, length)
        return g, -(-length // g)


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


def encode(x: Any, fmt: Format) -> tuple[Any, Any]:
    """``(q, scale)``: ``x`` stored in ``fmt`` (see the module docstring).

    Args:
        x: float array, last axis at least :data:`MIN_AXIS` long.
        fmt: the stored form.

    Returns:
        ``q`` of ``x``'s shape in ``fmt.dtype`` and float32 ``scale`` of shape
        ``x.shape[:-1] + (n,)``.
    """
    q, scale = quantize(x.astype(np.float32), fmt.recipe)  # float32 groups' amax
    # The codes are what the backward pass reads: without a barrier XLA:GPU
    # may delete an FP8 round trip (excess precision, openxla/xla#41605) or
    # fuse the encoding into the decoding and keep the activation alive
    # instead (tests/test_gpu_target.py checks the H100 target's HLO).
    return jax.lax.optimization_barrier((q, scale))


def decode(q: Any, scale: Any, fmt: Format, dtype: Any) -> Any:
    """The value ``(q, scale)`` stores, in ``dtype`` (inverse of :func:`encode`)."""
    return dequantize(q, scale, fmt.recipe, dtype)
