"""jmp-style ``Policy`` and ``cast_*`` pytree helpers (the names jmp and mpx
users expect).

These cast by hand; :func:`jaxamp.amp` needs none of them. They are for users
who store parameters in one dtype and want explicit casts at the boundaries.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._dtypes import canonical_dtype, is_float

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


_HALF = [jnp.float16]


def set_half_precision_dtype(dtype: Any) -> None:
    """Set the dtype :func:`cast_to_half_precision` uses (mpx's API).

    Args:
        dtype: ``jnp.float16`` (default) or ``jnp.bfloat16``.
    """
    _HALF[0] = canonical_dtype(dtype, argname="dtype")


def cast_to_half_precision(tree: PyTree) -> PyTree:
    """Cast float leaves to the half-precision dtype (float16 unless changed with
    :func:`set_half_precision_dtype`), as mpx does."""
    return cast_tree(tree, _HALF[0])


def cast_to_full_precision(tree: PyTree) -> PyTree:
    """Cast float leaves of ``tree`` to float32 (mpx's name)."""
    return cast_tree(tree, jnp.float32)


_KEYS = {
    "p": "param_dtype",
    "params": "param_dtype",
    "param": "param_dtype",
    "c": "compute_dtype",
    "compute": "compute_dtype",
    "o": "output_dtype",
    "output": "output_dtype",
}


@dataclass(frozen=True)
class Policy:
    """A jmp-style mixed precision policy: param, compute and output dtypes.

    Attributes:
        param_dtype: dtype parameters are stored in (usually float32).
        compute_dtype: dtype the computation runs in (e.g. bfloat16).
        output_dtype: dtype of the outputs (usually float32).
    """

    param_dtype: np.dtype
    compute_dtype: np.dtype
    output_dtype: np.dtype

    def __post_init__(self):
        for name in ("param_dtype", "compute_dtype", "output_dtype"):
            object.__setattr__(
                self, name, canonical_dtype(getattr(self, name), argname=name)
            )

    @classmethod
    def from_string(cls, spec: str) -> Policy:
        """Parse ``"p=f32,c=bf16,o=f32"`` or
        ``"params=float32,compute=bfloat16,output=float32"`` (jmp's grammar).

        A single dtype name (``"bf16"``) sets all three. Missing entries
        default to float32.

        Raises:
            ValueError: on an unknown key or dtype name, naming it.
        """
        if not isinstance(spec, str):
            raise TypeError(f"Policy spec must be a str, got {type(spec).__name__}.")
        spec = spec.strip()
        if "=" not in spec:
            d = canonical_dtype(spec, argname="policy")
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
            found[_KEYS[key]] = val.strip()
        full = {k: found.get(k, "float32") for k in set(_KEYS.values())}
        return cls(**full)

    def cast_to_param(self, tree: PyTree) -> PyTree:
        """Cast float leaves of ``tree`` to ``param_dtype``."""
        return cast_tree(tree, self.param_dtype)

    def cast_to_compute(self, tree: PyTree) -> PyTree:
        """Cast float leaves of ``tree`` to ``compute_dtype``."""
        return cast_tree(tree, self.compute_dtype)

    def cast_to_output(self, tree: PyTree) -> PyTree:
        """Cast float leaves of ``tree`` to ``output_dtype``."""
        return cast_tree(tree, self.output_dtype)


def get_policy(spec: str | Policy) -> Policy:
    """A :class:`Policy` from a jmp-style string, or ``spec`` if already one."""
    return spec if isinstance(spec, Policy) else Policy.from_string(spec)
