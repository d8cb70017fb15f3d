"""The current mixed precision policy: one ``ContextVar``, read by dtype parsing.

This module imports nothing from jaxamp, so :mod:`jaxamp._base._dtypes` (which
resolves ``"compute"`` / ``"param"`` / ``"output"`` against the current policy)
and :mod:`jaxamp.migration._jmp` (which defines :class:`~jaxamp.migration.jmp.Policy`
and imports
``_dtypes``) can both read it without an import cycle. The context manager users
open, :func:`jaxamp.migration.haliax.mixed_precision`, lives in
``migration/_haliax.py``.

A ``ContextVar`` is per thread (a new thread starts with no policy) and per
asyncio task, as Haliax's thread-local ``ResourceEnv`` is per thread.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import numpy as np

# The active jaxamp.migration.jmp.Policy, or None outside every
# jaxamp.migration.haliax.mixed_precision block.
_CURRENT: contextvars.ContextVar[Any] = contextvars.ContextVar(
    "jaxamp_current_policy", default=None
)


def current_policy() -> Any:
    """The policy of the innermost active
    :func:`jaxamp.migration.haliax.mixed_precision` block.

    Mirrors Haliax's ``current_mp_policy()`` (``haliax/_src/mixed_precision.py``),
    except outside every block: Haliax returns its default all-float32 policy,
    jaxamp returns None, so code can tell "no policy" from "float32 policy".

    The policy is read when JAX traces: a ``jax.jit``-compiled function keeps
    the dtypes of the policy active when it was traced (``jit`` does not key its
    cache on the context), so open the block around the ``jit`` call's first
    trace or inside the jitted function.

    Returns:
        A :class:`jaxamp.migration.jmp.Policy`, or None when no block is active in this
        thread
        / context.
    """
    return _CURRENT.get()


def policy_compute_dtype() -> np.dtype | None:
    """The compute dtype of the current policy, or None when none is active.

    What :func:`jaxamp.amp` reads as its default ``compute_dtype``, and what
    generic layer code can use as ``jaxamp.migration.haliax.policy_compute_dtype() or
    jnp.float32``.

    Returns:
        A NumPy float dtype (e.g. ``dtype(bfloat16)``) or None.
    """
    policy = _CURRENT.get()
    return None if policy is None else np.dtype(policy.compute_dtype)


@contextlib.contextmanager
def policy_scope(policy: Any) -> Iterator[Any]:
    """Make ``policy`` (a parsed :class:`jaxamp.migration.jmp.Policy`, or None for "no
    policy") current for the ``with`` block; the previous one is restored on
    exit, also on an exception."""
    token = _CURRENT.set(policy)
    try:
        yield policy
    finally:
        _CURRENT.reset(token)
