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

A group with a non-finite value gets a non-finite scale and decodes to NaN
everywhere, so a forward overflow stays visible to loss scaling.

INT8 spaces its 255 levels evenly, so one outlier coarsens every other value
of its group; its default group is 32 values (Jetfire's 32-wide blocks,
arXiv 2403.12422), where FP8's logarithmic spacing keeps small values precise
next to a large one at 128.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._base._dtypes import is_float

MIN_AXIS = 32
FP8_GROUP = 128
INT8_GROUP = 32

_NAMES = {
    "fp8": jnp.float8_e4m3fn,
    "e4m3": jnp.float8_e4m3fn,
    "float8_e4m3fn": jnp.float8_e4m3fn,
    "e5m2": jnp.float8_e5m2,
    "float8_e5m2": jnp.float8_e5m2,
    "int8": jnp.int8,
}
STORED_DTYPES = (
    np.dtype(jnp.float8_e4m3fn),
    np.dtype(jnp.float8_e5m2),
    np.dtype(jnp.int8),
)


@dataclasses.dataclass(frozen=True)
class Format:
    """A stored form: the 8-bit dtype and the group length along the last axis.

    Attributes:
        dtype: ``float8_e4m3fn``, ``float8_e5m2`` or ``int8``.
        group: values per scale along the last axis.
    """

    dtype: np.dtype
    group: int

    @property
    def bound(self) -> float:
        """The largest stored magnitude: 448 (E4M3), 57344 (E5M2), 127 (INT8)."""
        if self.dtype == np.dtype(jnp.int8):
            return 127.0
        return float(jnp.finfo(self.dtype).max)

    @property
    def stores_products(self) -> bool:
        """Whether the inputs a product's weight gradient reads are stored in
        this form: only int8 in 32-wide groups (0.5% rms error per value).
        FP8's 3 or 2 mantissa bits (2.6%, 5.1%) reach a weight gradient
        ``x^T g`` undamped, so FP8 leaves those inputs in the compute dtype
        and stores the inputs of non-linearities, norms and attention."""
        return self.dtype == np.dtype(jnp.int8)

    @property
    def product_form(self) -> Format:
        """The form of a value saved at a ``jax.checkpoint`` boundary that a
        product's input is recomputed from (``_checkpoint.py``): this one
        where it stores products' inputs, else int8 in 1 x 32 groups."""
        if self.stores_products:
            return self
        return Format(np.dtype(jnp.int8), INT8_GROUP)

    def groups(self, length: int) -> tuple[int, int]:
        """``(group length, number of groups)`` for a last axis of ``length``."""
        g = min(self.group, length)
        return g, -(-length // g)


def parse_dtype(dtype: Any, argname: str) -> np.dtype | None:
    """The stored dtype named by ``dtype`` (None: not compressed).

    Raises:
        ValueError: for anything but FP8 E4M3/E5M2, ``"int8"`` or None.
    """
    if dtype is None:
        return None
    key = dtype.lower() if isinstance(dtype, str) else None
    try:
        found = np.dtype(_NAMES[key]) if key in _NAMES else np.dtype(dtype)
    except TypeError:
        found = None
    if found not in STORED_DTYPES:
        raise ValueError(
            f"{argname}={dtype!r}: residuals are stored as jnp.float8_e4m3fn, "
            "jnp.float8_e5m2 or 'int8' (or None: in the dtype amp computes them "
            "in)."
        )
    return found


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


def _grouped(x: Any, fmt: Format) -> Any:
    """``x`` in float32 as ``(..., n, g)``, the last group zero-padded."""
    g, n = fmt.groups(x.shape[-1])
    xf = x.astype(jnp.float32)
    pad = n * g - x.shape[-1]
    if pad:
        xf = jnp.pad(xf, [(0, 0)] * (x.ndim - 1) + [(0, pad)])
    return xf.reshape(*x.shape[:-1], n, g)


def encode(x: Any, fmt: Format) -> tuple[Any, Any]:
    """``(q, scale)``: ``x`` stored in ``fmt`` (see the module docstring).

    Args:
        x: float array, last axis at least :data:`MIN_AXIS` long.
        fmt: the stored form.

    Returns:
        ``q`` of ``x``'s shape in ``fmt.dtype`` and float32 ``scale`` of shape
        ``x.shape[:-1] + (n,)``.
    """
    groups = _grouped(x, fmt)
    amax = jnp.max(jnp.abs(groups), axis=-1)
    bound = np.float32(fmt.bound)
    scale = jnp.where(amax > 0, amax / bound, np.float32(1.0))
    y = groups / scale[..., None]
    if fmt.dtype == np.dtype(jnp.int8):
        y = jnp.round(y)
    y = jnp.clip(y, -bound, bound).astype(fmt.dtype)
    q = y.reshape(*x.shape[:-1], -1)[..., : x.shape[-1]]
    # The codes are what the backward pass reads: without a barrier XLA:GPU
    # may delete an FP8 round trip (excess precision, openxla/xla#41605) or
    # fuse the encoding into the decoding and keep the activation alive
    # instead (tests/test_gpu_target.py checks the H100 target's HLO).
    return jax.lax.optimization_barrier((q, scale))


def decode(q: Any, scale: Any, fmt: Format, dtype: Any) -> Any:
    """The value ``(q, scale)`` stores, in ``dtype`` (inverse of :func:`encode`)."""
    groups = _grouped(q, fmt) * scale[..., None]
    return groups.reshape(*q.shape[:-1], -1)[..., : q.shape[-1]].astype(dtype)
