"""Haliax-style semantic dtypes and the current-policy context.

Mirrors Haliax's ``haliax/_src/mixed_precision.py`` and the mixed precision part
of ``haliax/_src/resource_env.py`` (stanford-crfm/haliax): a dtype may be named
by its role, ``"compute"``, ``"param"`` or ``"output"``, and is resolved against
a policy: the one passed, else the current one (``with
jaxamp.migration.haliax.mixed_precision(...)``, Haliax's ``with
hax.resource_env(mp=...)``).

Outside every block, :func:`cast_floating`, :func:`resolve_dtype` and
:meth:`SemanticDType.to_dtype` resolve against an all-float32 policy, as
Haliax's default ``ResourceEnv`` does; :func:`jaxamp.migration.haliax.current_policy`
returns
None there, and a semantic name given where jaxamp takes a dtype
(``jaxamp.migration.mpx.cast_tree(x, "compute")``, ``amp(compute_dtype="compute")``)
raises
instead of silently meaning float32.
"""

from __future__ import annotations

import enum
from typing import Any, Literal, TypeVar

import numpy as np
from jax.typing import DTypeLike

from .._base._ambient_policy import current_policy, policy_scope
from .._base._dtypes import SEMANTIC_FIELDS, canonical_dtype
from ._jmp import Policy, cast_tree, get_policy

T = TypeVar("T")

_FLOAT32_POLICY = Policy(np.float32, np.float32, np.float32)


class SemanticDType(str, enum.Enum):
    """A dtype named by its role in a mixed precision policy (Haliax's
    ``SemanticDType``).

    Members are strings (``SemanticDType.COMPUTE == "compute"``), so they are
    accepted wherever jaxamp takes a dtype, resolved against the current
    policy there.
    """

    COMPUTE = "compute"
    PARAM = "param"
    OUTPUT = "output"

    def __str__(self) -> str:
        return self.value

    def to_dtype(self, policy: Policy | str | None = None) -> np.dtype:
        """The dtype this role has in ``policy``.

        Args:
            policy: a :class:`jaxamp.migration.jmp.Policy` or policy string; None: the
                current policy, or all-float32 outside every
                :func:`jaxamp.migration.haliax.mixed_precision` block (Haliax's
                default).

        Returns:
            A NumPy float dtype.

        Raises:
            ValueError: if ``policy`` is a string that does not parse.
        """
        return np.dtype(getattr(_policy_or_default(policy), SEMANTIC_FIELDS[self]))


DTypeish = (
    DTypeLike | SemanticDType | Literal["compute", "param", "parameter", "output"]
)
"""A type alias (Haliax's ``DTypeish``): a real dtype
(``jnp.bfloat16``, ``"bf16"``) or a semantic one (a :class:`SemanticDType` or
its string, ``"parameter"`` included), resolved by :func:`resolve_dtype`."""


def _policy_or_default(policy: Policy | str | None) -> Policy:
    if policy is not None:
        return get_policy(policy)
    return current_policy() or _FLOAT32_POLICY


def resolve_dtype(dtype: DTypeish, policy: Policy | str | None = None) -> np.dtype:
    """Resolve a :data:`DTypeish` to a dtype (Haliax's ``resolve_dtype``).

    Args:
        dtype: a float dtype or name, or a semantic dtype (``"compute"``,
            ``"param"`` / ``"parameter"``, ``"output"``, :class:`SemanticDType`).
        policy: the policy a semantic dtype is resolved against (a
            :class:`jaxamp.migration.jmp.Policy` or string); None: the current policy,
            or
            all-float32 outside every :func:`jaxamp.migration.haliax.mixed_precision`
            block.

    Returns:
        A NumPy float dtype.

    Raises:
        ValueError: if ``dtype`` names no floating dtype (the message names
            ``dtype``) or ``policy`` does not parse.
    """
    if isinstance(dtype, str) and dtype.strip().lower() in SEMANTIC_FIELDS:
        field = SEMANTIC_FIELDS[dtype.strip().lower()]
        return np.dtype(getattr(_policy_or_default(policy), field))
    return canonical_dtype(dtype, argname="dtype")


def cast_floating(
    tree: T, dtype: DTypeish | None, policy: Policy | str | None = None
) -> T:
    """Cast the floating array leaves of ``tree`` to ``dtype`` (Haliax's
    ``haliax.mixed_precision.cast_floating``).

    Example::

        from jaxamp.migration import haliax

        with haliax.mixed_precision("p=f32,c=bf16,o=f32"):
            h = haliax.cast_floating(x, "compute")        # bfloat16
        haliax.cast_floating(x, "compute")                # float32 outside
        haliax.cast_floating(x, "compute", "c=f16")       # float16

    Args:
        tree: any pytree; integer, boolean, complex, PRNG-key and non-array
            leaves are returned unchanged (see :func:`jaxamp.migration.mpx.cast_tree`).
        dtype: a :data:`DTypeish`, or None to return ``tree`` as it is.
        policy: the policy semantic dtypes resolve against (Haliax's ``mp``
            argument); None: the current policy, or all-float32 outside every
            :func:`jaxamp.migration.haliax.mixed_precision` block, as Haliax's default.

    Returns:
        A pytree of ``tree``'s structure.

    Raises:
        ValueError: if ``dtype`` names no floating dtype or ``policy`` does not
            parse.
    """
    if dtype is None:
        return tree
    return cast_tree(tree, resolve_dtype(dtype, policy))


def mixed_precision(policy: Policy | str | None) -> Any:
    """Make ``policy`` the current policy for a ``with`` block (Haliax's
    ``with hax.resource_env(mp=...)``).

    Inside the block, :func:`jaxamp.migration.haliax.current_policy` returns it,
    semantic dtype
    names (``"compute"``, ``"param"``, ``"output"``) resolve against it wherever
    jaxamp takes a dtype, and :func:`jaxamp.amp` without an explicit
    ``compute_dtype`` uses its compute dtype. Blocks nest (the innermost wins;
    ``None`` clears the policy inside a block) and are per thread: a new thread
    starts without a policy. Usable as a decorator too.

    The policy is read while JAX traces: a ``jax.jit``-compiled function keeps
    the dtypes of the block active at its first trace; open the block inside
    the jitted function (or around its first call) to be explicit.

    Example::

        with jaxamp.migration.haliax.mixed_precision("p=f32,c=bf16,o=f32") as policy:
            y = layer(jaxamp.migration.haliax.cast_floating(x, "compute"))

    Args:
        policy: a :class:`jaxamp.migration.jmp.Policy`, a string in jmp's grammar
            (``"p=f32,c=bf16,o=f32"``, ``"c=bf16"``, ``"bf16"``), or None.

    Returns:
        A context manager whose ``__enter__`` returns the parsed
        :class:`jaxamp.migration.jmp.Policy` (or None).

    Raises:
        ValueError: if ``policy`` is a string that does not parse (raised here,
            not on entering the block).
        TypeError: if ``policy`` is neither a Policy, a str nor None.
    """
    return policy_scope(None if policy is None else get_policy(policy))
