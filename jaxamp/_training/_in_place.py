"""Ordering for state updated in place: the dependency that lets XLA overwrite
a donated optimizer state without first copying it (``docs/design.md``, a
bfloat16-parameter step)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

PyTree = Any


def _is_bf16(x: Any) -> bool:
    return hasattr(x, "dtype") and x.dtype == jnp.bfloat16


def _owners(template: PyTree, params: PyTree) -> list:
    """For each leaf of the inner state, the index of the parameter it belongs
    to (a subtree laid out like ``params``, as in :func:`_plan`), or None."""
    pdef = jax.tree_util.tree_structure(params)
    n = pdef.num_leaves

    def subtree(sub):
        if jax.tree_util.tree_structure(sub) != pdef:
            return None
        return jax.tree_util.tree_unflatten(pdef, list(range(n)))

    marks = jax.tree_util.tree_map(
        subtree, template, is_leaf=lambda x: jax.tree_util.tree_structure(x) == pdef
    )
    return jax.tree_util.tree_leaves(marks, is_leaf=lambda x: x is None)


def read_before_write(d_leaves, stored, template, params, count):
    """The stored state, each parameter's state leaves made to depend on that
    parameter's update ``d``, so that the new state is computed after it.

    The update of a parameter reads its old state (with the float32 new
    moments, before their rounding) while the new state overwrites the old in
    place (donated). XLA orders two computations only by their data, so
    without a dependency it copies every state buffer the update reads (4
    bytes per parameter with bfloat16 moments). ``where(never, d, s)``, with a
    predicate that is false at run time (``count | 1`` is odd) but that XLA
    cannot fold, is that dependency: ``s`` unchanged, bit for bit, and ``d``
    materialised (2 bytes per parameter, one parameter at a time) instead of a
    copy of each state buffer. ``lax.optimization_barrier`` does not order
    anything here: XLA:CPU removes it before copy insertion. State leaves of
    another shape or dtype (factored or int8 state) and those of float32
    parameters (whose update XLA would then round differently: no fused
    multiply-add across the materialised update) are left as they are.

    Args:
        d_leaves: the updates, ``params``' leaves in order (bfloat16 for
            bfloat16 parameters).
        stored: the stored inner state.
        template: the float32 inner state's shapes (``tx.init`` on params).
        params: the parameters.
        count: int32 scalar, the step count (``count | 1`` is odd, never 0).

    Returns:
        ``stored`` with the tied leaves replaced.
    """
    s_leaves, sdef = jax.tree_util.tree_flatten(stored)
    t_leaves = jax.tree_util.tree_leaves(template)
    owners = _owners(template, params) if len(t_leaves) == len(s_leaves) else []
    if len(owners) != len(s_leaves):
        return stored
    never = (count | 1) == 0
    for j, i in enumerate(owners):
        d, s = (None, None) if i is None else (d_leaves[i], s_leaves[j])
        if _is_bf16(d) and getattr(s, "shape", None) == d.shape and _is_bf16(s):
            s_leaves[j] = jnp.where(never, d, s)
    return jax.tree_util.tree_unflatten(sdef, s_leaves)
