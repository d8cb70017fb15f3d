"""jmp-style ``Policy`` and ``cast_*`` pytree helpers (the names jmp and mpx
users expect).

These cast by hand; :func:`jaxamp.amp` needs none of them. They are for users
who store parameters in one dtype and want explicit casts at the boundaries.
``Policy``, :func:`get_policy`, :func:`half_dtype`, :func:`cast_to_full` and
:func:`cast_to_half` mirror jmp's ``jmp/_src/policy.py`` (commit 9c1cdbbf78da,
release 0.0.4); the half-precision setters mirror mpx's ``mpx/_dtypes.py``
(mixed-precision-for-jax 0.1.8).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._base._dtypes import canonical_dtype, is_float

PyTree = Any


def cast_tree(tree: PyTree, dtype: Any) -> PyTree:
    """Cast every real floating array leaf of ``tree`` to ``dtype``.

    Integer, boolean, complex and PRNG-key leaves and non-array leaves are
    returned unchanged.

    Args:
        tree: any pytree (Equinox modules included).
        dtype: a floating dtype or name (``jnp.bfloat16``, ``"bf16"``).

    Returns:
        A pytree of the same structure.

    Raises:
        ValueError: if ``dtype`` is not a floating dtype.
    """
    dtype = canonical_dtype(dtype)

    def leaf(x):
        if isinstance(x, (jax.Array, np.ndarray, np.generic)) and is_float(x.dtype):
            return jnp.asarray(x).astype(dtype)
        return x

    return jax.tree_util.tree_map(leaf, tree)


def cast_to_float16(tree: PyTree) -> PyTree:
    """Cast float leaves of ``tree`` to float16 (see :func:`cast_tree`)."""
    return cast_tree(tree, jnp.float16)


def cast_to_bfloat16(tree: PyTree) -> PyTree:
    """Cast float leaves of ``tree`` to bfloat16 (see :func:`cast_tree`)."""
    return cast_tree(tree, jnp.bfloat16)


def cast_to_float32(tree: PyTree) -> PyTree:
    """Cast float leaves of ``tree`` to float32 (see :func:`cast_tree`)."""
    return cast_tree(tree, jnp.float32)


_HALF = [np.dtype(jnp.float16)]


def set_half_precision_dtype(dtype: Any) -> None:
    """Set the dtype :func:`cast_to_half_precision` uses (mpx's API).

    Args:
        dtype: a float dtype or name; ``jnp.float16`` is the default.

    Raises:
        ValueError: if ``dtype`` is not a floating dtype.
    """
    _HALF[0] = canonical_dtype(dtype, argname="dtype")


def half_precision_dtype() -> np.dtype:
    """The dtype :func:`cast_to_half_precision` casts to (float16 unless set
    with :func:`set_half_precision_dtype`); the getter mpx calls
    :func:`half_precision_datatype`.

    Returns:
        A NumPy float dtype.
    """
    return _HALF[0]


def set_half_precision_datatype(datatype: Any) -> None:
    """mpx's ``set_half_precision_datatype`` (``mpx/_dtypes.py``, 0.1.8).

    Sets the process-wide dtype of :func:`cast_to_half_precision` and of the
    argument casts of :func:`jaxamp.migration.mpx.filter_grad` /
    :func:`jaxamp.migration.mpx.filter_value_and_grad`. mpx ignores a string argument
    (its
    code sets the dtype only for a dtype object); jaxamp applies it.

    Args:
        datatype: ``jnp.float16``, ``jnp.bfloat16`` or their names
            (``"float16"``, ``"bfloat16"``, ``"bf16"``, ...).

    Raises:
        ValueError: if ``datatype`` is not float16 or bfloat16.
    """
    dtype = canonical_dtype(datatype, argname="datatype")
    if dtype not in (np.dtype(jnp.float16), np.dtype(jnp.bfloat16)):
        raise ValueError(
            f"set_half_precision_datatype: datatype={dtype} is not a half-precision "
            "dtype; pass jnp.float16 or jnp.bfloat16."
        )
    _HALF[0] = dtype


def half_precision_datatype() -> np.dtype:
    """mpx's ``half_precision_datatype()``: the dtype
    :func:`cast_to_half_precision` casts to (float16 by default).

    Returns:
        A NumPy float dtype.
    """
    return _HALF[0]


def cast_to_half_precision(tree: PyTree) -> PyTree:
    """Cast float leaves to the half-precision dtype (float16 unless changed with
    :func:`set_half_precision_dtype`), as mpx does."""
    return cast_tree(tree, _HALF[0])


def cast_to_full_precision(tree: PyTree) -> PyTree:
    """Cast float leaves of ``tree`` to float32 (mpx's name)."""
    return cast_tree(tree, jnp.float32)


def half_dtype() -> np.dtype:
    """The half-precision dtype of the current backend, as jmp's ``half_dtype``.

    bfloat16 when the first local device is a TPU, float16 otherwise (jmp's
    rule, ``jmp/_src/policy.py``). Independent of
    :func:`set_half_precision_dtype`, which sets mpx's process-wide dtype.

    Returns:
        ``dtype(bfloat16)`` or ``dtype(float16)``.
    """
    on_tpu = jax.local_devices()[0].platform == "tpu"
    return np.dtype(jnp.bfloat16 if on_tpu else jnp.float16)


def cast_to_full(tree: PyTree) -> PyTree:
    """Cast float leaves of ``tree`` to float32 (jmp's ``cast_to_full``; see
    :func:`cast_tree` for which leaves are cast)."""
    return cast_tree(tree, jnp.float32)


def cast_to_half(tree: PyTree) -> PyTree:
    """Cast float leaves of ``tree`` to :func:`half_dtype` (jmp's
    ``cast_to_half``: bfloat16 on TPU, float16 elsewhere)."""
    return cast_tree(tree, half_dtype())


_KEYS = {
    "p": "param_dtype",
    "params": "param_dtype",
    "param": "param_dtype",
    "c": "compute_dtype",
    "compute": "compute_dtype",
    "o": "output_dtype",
    "output": "output_dtype",
}

# The name str(policy) prints for each dtype: jmp's first name where jmp has one
# (jmp's ``dtype_to_names``: float32 prints as "full"), else jaxamp's alias.
_SHORT_NAMES = {
    np.dtype(jnp.bfloat16): "bf16",
    np.dtype(jnp.float16): "f16",
    np.dtype(jnp.float32): "full",
    np.dtype(jnp.float64): "f64",
    np.dtype(jnp.float8_e4m3fn): "e4m3",
    np.dtype(jnp.float8_e5m2): "e5m2",
}


@dataclass(frozen=True)
class Policy:
    """A jmp-style mixed precision policy: param, compute and output dtypes.

    Mirrors jmp's ``Policy`` (``jmp/_src/policy.py``, commit 9c1cdbbf78da):
    ``cast_to_param`` / ``cast_to_compute`` / ``cast_to_output``,
    :meth:`with_output_dtype`, and ``str(policy)`` in jmp's grammar
    (``"p=full,c=bf16,o=full"``), which :func:`get_policy` parses back. Unlike
    jmp, the dtypes are validated and stored as NumPy dtypes
    (``Policy(jnp.float32, ...) == Policy(np.float32, ...)``), and a
    non-floating dtype raises instead of being kept.

    Attributes:
        param_dtype: dtype parameters are stored in (usually float32).
        compute_dtype: dtype the computation runs in (e.g. bfloat16).
        output_dtype: dtype of the outputs (usually float32).

    Raises:
        ValueError: if a dtype is not a floating dtype (the message names the
            field).
    """

    param_dtype: np.dtype
    compute_dtype: np.dtype
    output_dtype: np.dtype

    def __post_init__(self):
        for name in ("param_dtype", "compute_dtype", "output_dtype"):
            object.__setattr__(
                self, name, canonical_dtype(getattr(self, name), argname=name)
            )

    def __str__(self) -> str:
        """``"p=...,c=...,o=..."`` with jmp's short names (float32 is
        ``"full"``); ``get_policy(str(policy)) == policy``."""
        names = [
            _SHORT_NAMES.get(d, d.name)
            for d in (self.param_dtype, self.compute_dtype, self.output_dtype)
        ]
        return "p={},c={},o={}".format(*names)

    @classmethod
    def from_string(cls, spec: str) -> Policy:
        """Parse a policy string in jmp's grammar (see :func:`get_policy`).

        Args:
            spec: e.g. ``"p=f32,c=bf16,o=f32"``, ``"c=bf16"`` or ``"bf16"``.

        Returns:
            The :class:`Policy`.

        Raises:
            ValueError: on an unknown key or dtype name, naming it.
            TypeError: if ``spec`` is not a str.
        """
        if not isinstance(spec, str):
            raise TypeError(
                f"Policy spec must be a str such as 'p=f32,c=bf16,o=f32', got "
                f"{type(spec).__name__}."
            )
        spec = spec.strip()
        if "=" not in spec:
            d = _parse_dtype(spec)
            return cls(d, d, d)
        found = {}
        for part in spec.split(","):
            key, sep, val = part.partition("=")
            key = key.strip().lower()
            if not sep or key not in _KEYS:
                raise ValueError(
                    f"Unknown policy entry {part.strip()!r} in {spec!r}; use keys "
                    "p/params, c/compute, o/output, e.g. 'p=f32,c=bf16,o=f32'."
                )
            found[_KEYS[key]] = _parse_dtype(val)
        # jmp's defaults: params float32, compute follows params, output
        # follows compute ('c=bf16' is 'p=f32,c=bf16,o=bf16').
        param = found.get("param_dtype", np.dtype(jnp.float32))
        compute = found.get("compute_dtype", param)
        return cls(param, compute, found.get("output_dtype", compute))

    def with_output_dtype(self, output_dtype: Any) -> Policy:
        """This policy with another output dtype (jmp's ``with_output_dtype``).

        Args:
            output_dtype: a float dtype or name.

        Returns:
            A new :class:`Policy`.

        Raises:
            ValueError: if ``output_dtype`` is not a floating dtype.
        """
        return dataclasses.replace(self, output_dtype=output_dtype)

    def cast_to_param(self, tree: PyTree) -> PyTree:
        """Cast float leaves of ``tree`` to ``param_dtype``."""
        return cast_tree(tree, self.param_dtype)

    def cast_to_compute(self, tree: PyTree) -> PyTree:
        """Cast float leaves of ``tree`` to ``compute_dtype``."""
        return cast_tree(tree, self.compute_dtype)

    def cast_to_output(self, tree: PyTree) -> PyTree:
        """Cast float leaves of ``tree`` to ``output_dtype``."""
        return cast_tree(tree, self.output_dtype)


def _parse_dtype(name: str) -> np.dtype:
    # jmp's parse_dtype: "half" is the backend's half dtype (bfloat16 on TPU).
    if name.strip().lower() == "half":
        return half_dtype()
    return canonical_dtype(name, argname="policy")


def get_policy(spec: str | Policy) -> Policy:
    """A :class:`Policy` from a string in jmp's grammar, or ``spec`` if already
    one (jmp's ``get_policy``, ``jmp/_src/policy.py``).

    Grammar: comma-separated ``key=dtype`` entries with keys ``p`` / ``params``
    (also ``param``), ``c`` / ``compute``, ``o`` / ``output`` (case and spaces
    ignored), or a single dtype name for all three (``"bf16"``). An unspecified
    param dtype is float32, an unspecified compute dtype follows the param
    dtype, an unspecified output dtype follows the compute dtype:
    ``"c=bf16"`` is ``p=f32,c=bf16,o=bf16`` and ``"p=bf16"`` is all bfloat16.
    Dtype names are jmp's (``full``, ``f32``, ``float32``, ``bf16``, ``f16``,
    ``half``: bfloat16 on TPU, float16 elsewhere, ...) and jaxamp's
    (``e4m3``, ``single``, ...).

    Args:
        spec: e.g. ``"p=f32,c=bf16,o=f32"``,
            ``"params=float32,compute=bfloat16,output=float32"``, ``"bf16"``,
            ``str(policy)``, or a :class:`Policy`.

    Returns:
        The :class:`Policy`.

    Raises:
        ValueError: on an unknown key or dtype name, naming it.
        TypeError: if ``spec`` is neither a str nor a :class:`Policy`.
    """
    return spec if isinstance(spec, Policy) else Policy.from_string(spec)
