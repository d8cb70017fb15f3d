"""The scope path of an equation: the one string by which the policy and the
reports name where an equation is.

An ``amp_policy`` scope key is matched against it (``_policy/_lookup.py``),
and :func:`jaxamp.quantization_report`, :func:`jaxamp.memory_report` and
:func:`jaxamp.precision_report` print it: a report's scope string is the path
key that matches the equation. It is what the user wrote with
``jax.named_scope``, outermost first and joined by ``/``: a matmul inside
``named_scope("jaxformer")`` / ``named_scope("mlp")`` is ``"jaxformer/mlp"``,
also inside a ``jit``, a ``scan`` body or a ``jax.checkpoint`` called there.

Left out, each by its exact name, are the scopes no user opened:

* jaxamp's markers, registered by :func:`marker` where they are defined
  (``jaxamp.amp``'s region, ``jaxamp_recast``, an 8-bit format's
  ``jaxamp_int8_matmul``, ...) and ``"amp_stop"`` (which the policy reads on
  the whole stack, :func:`components`' input);
* JAX's scope of a differentiated ``jax.checkpoint`` body
  (``_compat.REMAT_BODY_SCOPE``);
* ``jnp.einsum``'s scope, named by its subscripts (``"bi,ij->bj"``): JAX
  opens it, and no scope name the user could key on holds ``"->"``.

A run of components repeated at once is kept once (``a/b/a/b/c`` is
``a/b/c``): JAX repeats the enclosing stack in a ``jax.checkpoint`` body and
in a transposed body. A scope opened directly inside one of the same name
cannot be told from that, so it is one component too, for the policy as for
the reports.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from .. import _compat

# Scope names that are not the user's (see the module docstring); jaxamp's
# own are added by marker() where each is defined.
_MARKERS: set[str] = {"amp_stop", _compat.REMAT_BODY_SCOPE}


def marker(name: str) -> str:
    """Register ``name`` as a scope jaxamp opens around equations it binds,
    left out of every scope path. Returns ``name``."""
    _MARKERS.add(name)
    components.cache_clear()
    return name


def is_user_scope(name: str) -> bool:
    """Whether the scope component ``name`` is one the user opened: not a
    registered marker, not JAX's differentiated-checkpoint scope, not
    ``jnp.einsum``'s subscripts."""
    return name not in _MARKERS and "->" not in name


def eqn_scopes(outer: tuple[str, ...], eqn: Any) -> tuple[str, ...]:
    """The scope components of ``eqn`` inside a sub-jaxpr whose enclosing
    equations have the components ``outer``: equations in a sub-jaxpr carry
    name stacks relative to the equation that holds them (or, in a
    ``jax.checkpoint`` body or after a transform, the stack again, which
    :func:`components` folds)."""
    return outer + _compat.scope_names(eqn)


def _fold_repeats(parts: list[str]) -> list[str]:
    """``parts`` with each immediately repeated run kept once: ``a/a`` is
    ``a``, ``a/b/a/b/c`` is ``a/b/c``."""
    k = 1
    while k <= len(parts) // 2:
        for i in range(len(parts) - 2 * k + 1):
            if parts[i : i + k] == parts[i + k : i + 2 * k]:
                parts = parts[: i + k] + parts[i + 2 * k :]
                k = 0  # start over on the shorter path
                break
        k += 1
    return parts


@functools.lru_cache(maxsize=4096)
def components(scopes: tuple[str, ...]) -> tuple[str, ...]:
    """The user's scope components of an equation, outermost first.

    Args:
        scopes: all its scope components, with the enclosing equations'
            (:func:`eqn_scopes`).

    Returns:
        The components the user opened (:func:`is_user_scope`), a run that
        repeats immediately kept once: what a policy's scope keys match.
    """
    return tuple(_fold_repeats([s for s in scopes if is_user_scope(s)]))


def scope_path(scopes: Sequence[str]) -> str:
    """The scope path of an equation with the scope components ``scopes``:
    :func:`components` joined by ``/`` (``"jaxformer/mlp"``; ``""`` outside
    any scope)."""
    return "/".join(components(tuple(scopes)))
