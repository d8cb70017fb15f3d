"""The 8-bit formats, each registered once as a value.

A format is a :class:`QFormat`: its name, its 8-bit dtype and the properties in
which formats differ (largest magnitude, report label, default group of a stored
residual, whether products' inputs are stored in it, the format of a matmul's
gradient operand). The codec (``_codec.py``), the 8-bit matmul rules, the
stored residuals and the reports read those properties from the value; none of
them tests for a particular dtype. jaxamp registers int8, E4M3 and E5M2;
:func:`register_format` adds another, e.g. ``jnp.float8_e3m4`` (a format is a
value, as qwix's qtypes are).

Lookups read the registry when they run, so a format registered after
``import jaxamp`` is seen by ``amp(residual_dtype=...)``,
``fp8_policy(format=...)``, the scope marker ``jaxamp_<label>_matmul`` around its
matmuls and the labels of ``quantization_report``, ``memory_report`` and
``precision_report``.

One format per dtype: a report sees only a jaxpr's dtypes, so the dtype must
name the format.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np

from ._scopes import marker


@dataclasses.dataclass(frozen=True, kw_only=True)
class QFormat:
    """An 8-bit format: what every user of the codec reads about it.

    Attributes:
        name: the name ``amp(residual_dtype=...)``, ``residual_rule`` and
            ``fp8_policy(format=...)`` accept and ``memory_report`` and
            ``precision_report`` print.
        dtype: the 8-bit dtype the codes are stored in.
        aliases: other (lower-case) names the format answers to.
        bound: the largest magnitude a scaled value is mapped to; None when
            constructed: the dtype's largest finite value (127 for int8:
            symmetric, -128 unused).
        label: what ``quantization_report`` prints for a product in this
            format, and the scope marker ``jaxamp_<label>_matmul`` put around its
            matmuls; None when constructed: ``name``.
        group: values per float32 scale along the last axis of a stored
            residual.
        stores_products: whether the inputs a product's weight gradient reads
            are stored in this form (else in int8, 1 x 32 groups).
        grad: the name of the format of an 8-bit matmul's gradient operand;
            None: this format.
        codes: for a format whose codes index a table of values (8-bit
            optimizer state), ``(encode, decode)``: float32 values in
            ``[-bound, bound]`` to codes of ``dtype``, and back to float32;
            None: the codes are the dtype's own values.

    Raises:
        ValueError: for an empty name or a dtype that is not 8 bits wide.
    """

    # How the format is written by users and printed by the reports.
    name: str
    # The 8-bit dtype of the codes (an integer or a float dtype).
    dtype: Any
    # Other names that resolve to this format ("fp8", "e4m3").
    aliases: tuple[str, ...] = ()
    # Largest magnitude after scaling; None: the dtype's own largest.
    bound: float | None = None
    # The quantization_report label and scope marker; None: the name.
    label: str | None = None
    # Default group length of a stored residual (DeepSeek-V3: 128).
    group: int = 128
    # Whether a product's inputs (weight gradients read them) may be stored.
    stores_products: bool = False
    # The gradient operand's format in an 8-bit matmul; None: this one.
    grad: str | None = None
    # A code table (encode, decode); None: the dtype's values are the codes.
    codes: tuple[Callable[[Any], Any], Callable[[Any], Any]] | None = None

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"QFormat(name={self.name!r}): a non-empty string.")
        dtype = np.dtype(self.dtype)
        if dtype.itemsize != 1:
            raise ValueError(
                f"QFormat({self.name!r}, dtype={dtype.name}): an 8-bit dtype "
                "(int8, a float8 type)."
            )
        info = jnp.iinfo(dtype) if dtype.kind in "iu" else jnp.finfo(dtype)
        bound = float(info.max) if self.bound is None else float(self.bound)
        object.__setattr__(self, "dtype", dtype)
        object.__setattr__(self, "bound", bound)
        object.__setattr__(self, "label", self.label or self.name)
        object.__setattr__(self, "aliases", tuple(a.lower() for a in self.aliases))
        marker(self.scope)  # left out of scope paths

    @property
    def kind(self) -> str:
        """``"codes"`` (a code table), ``"int"`` or ``"float"``."""
        if self.codes is not None:
            return "codes"
        return "int" if self.dtype.kind in "iu" else "float"

    @property
    def scope(self) -> str:
        """The ``jax.named_scope`` marker around this format's matmuls."""
        return f"jaxamp_{self.label}_matmul"

    @property
    def grad_format(self) -> QFormat:
        """The format of an 8-bit matmul's gradient operand."""
        return self if self.grad is None else require(self.grad, "QFormat.grad")


INT8 = QFormat(name="int8", dtype=jnp.int8, group=32, stores_products=True)
"""int8: 255 even levels. Stored residuals in 1 x 32 groups (Jetfire's 32-wide
blocks, arXiv 2403.12422: one outlier coarsens only its group); the only form
a product's inputs are stored in (0.5% rms error per value)."""

E4M3 = QFormat(
    name="float8_e4m3fn",
    dtype=jnp.float8_e4m3fn,
    aliases=("fp8", "e4m3"),
    label="fp8",
    grad="float8_e5m2",
)
"""FP8 E4M3 (max 448): forward operands and stored residuals; its gradient
operand is E5M2 (Micikevicius et al. 2022). Its 3 mantissa bits (2.6% rms
error) reach a weight gradient undamped, so a product's inputs are not stored
in it."""

E5M2 = QFormat(
    name="float8_e5m2", dtype=jnp.float8_e5m2, aliases=("e5m2",), label="fp8"
)
"""FP8 E5M2 (max 57344): gradient operands of FP8 matmuls."""

_REGISTRY: dict[str, QFormat] = {}


def _keys(fmt: QFormat) -> tuple[str, ...]:
    return (fmt.name.lower(), *fmt.aliases)


def _add(fmt: QFormat) -> QFormat:
    if _REGISTRY.get(fmt.name.lower()) == fmt:  # the same value again (a rerun)
        return _REGISTRY[fmt.name.lower()]
    taken = [k for k in _keys(fmt) if k in _REGISTRY]
    if taken:
        raise ValueError(f"register_format: the name {taken[0]!r} is registered.")
    other = format_of_dtype(fmt.dtype)
    if other is not None:
        raise ValueError(
            f"register_format({fmt.name!r}): {fmt.dtype.name} is the dtype of the "
            f"registered format {other.name!r}; one format per dtype (a report "
            "tells formats apart by their dtype)."
        )
    for key in _keys(fmt):
        _REGISTRY[key] = fmt
    return fmt


def register_format(
    name: str,
    dtype: Any,
    *,
    aliases: tuple[str, ...] = (),
    bound: float | None = None,
    label: str | None = None,
    group: int = 128,
    stores_products: bool = False,
    grad: str | None = None,
) -> QFormat:
    """Register an 8-bit format: the one step a new format needs.

    Once registered, ``name`` (or ``dtype``) works as
    ``jaxamp.amp(..., residual_dtype=name)``, as ``jaxamp.residual_rule(name)``
    and, for a float dtype, as ``jaxamp.fp8_policy(format=name)`` (per-tensor
    current scaling, the FP8 recipe); its matmuls run inside the scope
    ``jaxamp_<label>_matmul``, and ``quantization_report``, ``memory_report`` and
    ``precision_report`` print its name (its label in
    ``quantization_report``).

    Example::

        jaxamp.extend.register_format("e3m4", jnp.float8_e3m4)
        loss8 = jaxamp.amp(loss, compute_dtype=jnp.bfloat16,
                           amp_policy=jaxamp.fp8_policy(format="e3m4"),
                           residual_dtype="e3m4")

    Args:
        name: the format's name, a non-empty string (matched case-blind).
        dtype: its 8-bit dtype, e.g. ``jnp.float8_e3m4``; one format per dtype.
        aliases: other names for it.
        bound: the largest magnitude a scaled value maps to; None: the dtype's
            largest finite value.
        label: the name ``quantization_report`` prints and the scope marker
            uses; None: ``name``.
        group: values per float32 scale along the last axis of a stored
            residual (default 128).
        stores_products: store the inputs a product's weight gradient reads in
            this format too (default False: they are stored in int8).
        grad: the name of the format of an 8-bit matmul's gradient operand
            (E4M3's is ``"float8_e5m2"``); None: this format.

    Returns:
        The registered :class:`QFormat`.

    Raises:
        ValueError: if the name, an alias or the dtype is registered already
            (to another format: registering an equal one again returns it),
            the dtype is not 8 bits wide, or ``group`` is not a positive int.
    """
    if isinstance(group, bool) or not isinstance(group, int) or group < 1:
        raise ValueError(f"register_format(group={group!r}): a positive int.")
    fmt = QFormat(
        name=name,
        dtype=dtype,
        aliases=tuple(aliases),
        bound=bound,
        label=label,
        group=group,
        stores_products=bool(stores_products),
        grad=grad,
    )
    return _add(fmt)


def unregister_format(name: str) -> None:
    """Remove the format registered as ``name`` (with its aliases).

    Raises:
        KeyError: if no format is registered as ``name``.
    """
    fmt = _REGISTRY[name.lower()]
    for key in _keys(fmt):
        del _REGISTRY[key]


def registered() -> tuple[QFormat, ...]:
    """The registered formats, in registration order."""
    return tuple(dict.fromkeys(_REGISTRY.values()))


def format_of_dtype(dtype: Any) -> QFormat | None:
    """The format registered for ``dtype``; None if there is none."""
    try:
        dtype = np.dtype(dtype)
    except TypeError:
        return None
    return next((f for f in _REGISTRY.values() if f.dtype == dtype), None)


def lookup(spec: Any) -> QFormat | None:
    """The format ``spec`` names: a :class:`QFormat`, a registered name or
    alias (case-blind), or a registered format's dtype; None otherwise."""
    if isinstance(spec, QFormat):
        return spec
    if isinstance(spec, str) and spec.lower() in _REGISTRY:
        return _REGISTRY[spec.lower()]
    return format_of_dtype(spec)


def require(spec: Any, argname: str) -> QFormat:
    """:func:`lookup`, raising for a format that is not registered.

    Raises:
        ValueError: naming ``argname`` and the registered formats.
    """
    fmt = lookup(spec)
    if fmt is None:
        names = ", ".join(repr(f.name) for f in registered())
        raise ValueError(
            f"{argname}={spec!r}: not a registered 8-bit format (registered: "
            f"{names}; jaxamp.extend.register_format adds one)."
        )
    return fmt


def as_format(spec: Any, argname: str) -> QFormat:
    """:func:`lookup`; any other 8-bit dtype as an unregistered format of its
    own (named by its dtype), for the codec's direct callers.

    Raises:
        ValueError: if ``spec`` names neither a format nor an 8-bit dtype.
    """
    fmt = lookup(spec)
    if fmt is not None:
        return fmt
    try:
        dtype = np.dtype(spec)
    except TypeError:
        dtype = None
    if dtype is None or dtype.itemsize != 1:
        return require(spec, argname)
    return QFormat(name=dtype.name, dtype=dtype)


def name_of(dtype: Any) -> str:
    """The registered format's name for ``dtype``, else the dtype's name."""
    fmt = format_of_dtype(dtype)
    return np.dtype(dtype).name if fmt is None else fmt.name


def label_of(dtype: Any) -> str:
    """The registered format's label for ``dtype``, else the dtype's name."""
    fmt = format_of_dtype(dtype)
    return np.dtype(dtype).name if fmt is None else fmt.label


def is_eight_bit(name: str) -> bool:
    """Whether ``name`` (a report's format string) is an 8-bit format: a
    registered name, or the name of an 8-bit dtype."""
    if lookup(name) is not None:
        return True
    try:
        return np.dtype(name).itemsize == 1
    except TypeError:
        return False


for _builtin in (INT8, E4M3, E5M2):
    _add(_builtin)
