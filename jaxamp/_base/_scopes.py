"""The user's ``jax.named_scope`` path of an equation: one computation that
:func:`jaxamp.quantization_report`, :func:`jaxamp.memory_report` and
:func:`jaxamp.precision_report` share, so that one equation has one scope
string in all three.

The path is what the user wrote with ``jax.named_scope``, outermost first and
joined by ``/``: a ``jnp.einsum`` inside ``named_scope("mlp")`` is ``"mlp"``,
as is a matmul inside a ``jit`` or a ``scan`` body called there. It is the
string an ``amp_policy`` key takes to match the equation.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .. import _compat

# Prefixes of scope names that are not the user's: jaxamp's markers
# (``jaxamp_int8_matmul``, ``jaxamp_recast``, the ``jaxamp.amp`` region, all
# ``jaxamp_``), JAX's, and jaxamp 0.0.4's ``amp_stop`` region.
_MARKER_PREFIXES = ("jax", "amp_stop")


def is_user_scope(name: str) -> bool:
    """Whether the scope component ``name`` is one the user opened: not a
    jaxamp or JAX marker, not the scope JAX gives a differentiated
    ``jax.checkpoint`` body, not ``jnp.einsum``'s own scope (its subscripts,
    e.g. ``"bi,ij->bj"``)."""
    return not (
        name.startswith(_MARKER_PREFIXES)
        or name == _compat.REMAT_BODY_SCOPE
        or "->" in name
    )


def eqn_scopes(outer: tuple[str, ...], eqn: Any) -> tuple[str, ...]:
    """The scope components of ``eqn`` inside a sub-jaxpr whose enclosing
    equations have the components ``outer``: equations in a sub-jaxpr carry
    name stacks relative to the equation that holds them (or, after a
    transform, the whole stack again, which :func:`scope_path` folds)."""
    return outer + _compat.scope_names(eqn)


def _fold_repeats(parts: list[str]) -> list[str]:
    """``parts`` with each immediately repeated run kept once: ``a/a`` is
    ``a``, ``a/b/a/b/c`` is ``a/b/c`` (a stack that JAX repeats in a
    transformed body, or the enclosing prefix given twice)."""
    k = 1
    while k <= len(parts) // 2:
        for i in range(len(parts) - 2 * k + 1):
            if parts[i : i + k] == parts[i + k : i + 2 * k]:
                parts = parts[: i + k] + parts[i + 2 * k :]
                k = 0  # start over on the shorter path
                break
        k += 1
    return parts


def scope_path(scopes: Sequence[str]) -> str:
    """The user's ``named_scope`` path of an equation.

    Args:
        scopes: its scope components, outermost first, with the enclosing
            equations' (:func:`eqn_scopes`).

    Returns:
        The components the user opened (:func:`is_user_scope`), a run that
        repeats immediately kept once, joined by ``/``: ``"block/mlp"``;
        ``""`` outside any scope.
    """
    return "/".join(_fold_repeats([s for s in scopes if is_user_scope(s)]))
