"""Flax NNX graph nodes (modules, Variables, ``nnx.Rngs``) as ``amp`` arguments.

NNX layers update their Variables in place (``BatchNorm`` statistics, the
counters of ``nnx.Rngs`` streams), and NNX's transforms carry those updates back
to the caller's objects. ``amp`` traces its function to a jaxpr, so it does what
``nnx.jit`` does: the graph nodes among the arguments are split into a graph
definition and their state (``nnx.split``, all nodes together so that shared
Variables stay shared); the state's arrays are traced inputs like any other
array; the function receives the nodes re-built from them (``nnx.merge``); their
state after the call (``nnx.state``) is an extra output; and after the
mixed-precision evaluation the caller's nodes are updated with it
(``nnx.update``), every value in the dtype its Variable had before the call.

Inside ``nnx.jit`` / ``nnx.grad`` / ``nnx.value_and_grad`` / ``nnx.remat`` /
``nnx.scan`` the nodes ``amp`` receives are that transform's own copies; updating
them is what the transform then propagates to the caller.

Flax stays optional: this module imports it only when ``flax.nnx`` is already
loaded, since no NNX object can exist otherwise.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import jax


def _loaded_nnx() -> Any:
    """``flax.nnx`` if the program has imported it, else None."""
    if "flax.nnx" not in sys.modules:
        return None
    from flax import nnx

    return nnx


class _InputNode:
    """Stands, in ``fn``'s output, for the ``index``-th input graph node."""

    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index


def call(amp_call: Callable, fn: Callable, args: tuple, kwargs: dict) -> Any:
    """``amp_call(fn, args, kwargs)``, with NNX graph nodes in the arguments
    lifted to their state and updated after the call.

    Args:
        amp_call: ``amp_call(fn, args, kwargs) -> out``, the traced
            mixed-precision evaluation of ``fn`` on pytree arguments.
        fn: the user's function.
        args: positional arguments of ``fn``: any pytrees, possibly holding
            NNX modules, Variables or ``nnx.Rngs`` anywhere.
        kwargs: keyword arguments of ``fn``, likewise.

    Returns:
        What ``fn`` returns (graph nodes it returns among its inputs are the
        caller's objects). As a side effect, every Variable of the graph nodes
        in ``args``/``kwargs`` holds the value ``fn`` left in it, cast to the
        Variable's dtype before the call.
    """
    nnx = _loaded_nnx()
    if nnx is None:
        return amp_call(fn, args, kwargs)
    is_node = nnx.graph.is_graph_node
    leaves, treedef = jax.tree_util.tree_flatten((args, kwargs), is_leaf=is_node)
    where = [i for i, x in enumerate(leaves) if is_node(x)]
    if not where:
        return amp_call(fn, args, kwargs)

    nodes = [leaves[i] for i in where]
    graphdef, state = nnx.split(nodes)
    others = [None if is_node(x) else x for x in leaves]

    @functools.wraps(fn)
    def pure_fn(state, others):
        merged = nnx.merge(graphdef, state)
        full = list(others)
        for i, node in zip(where, merged):
            full[i] = node
        a, kw = jax.tree_util.tree_unflatten(treedef, full)
        out = fn(*a, **kw)
        index = {id(node): k for k, node in enumerate(merged)}
        out = jax.tree_util.tree_map(
            lambda x: _InputNode(index[id(x)]) if id(x) in index else x,
            out,
            is_leaf=is_node,
        )
        return out, nnx.state(merged)

    out, new_state = amp_call(pure_fn, (state, others), {})
    nnx.update(nodes, _in_dtypes_of(new_state, state))
    return jax.tree_util.tree_map(
        lambda x: nodes[x.index] if isinstance(x, _InputNode) else x,
        out,
        is_leaf=lambda x: isinstance(x, _InputNode),
    )


def _in_dtypes_of(new: Any, old: Any) -> Any:
    """``new`` with every array leaf cast to the dtype of ``old``'s leaf at the
    same path (Variables the call created keep their dtype)."""
    old_dtypes = {
        path: x.dtype
        for path, x in jax.tree_util.tree_leaves_with_path(old)
        if isinstance(x, jax.Array)
    }

    def cast(path, x):
        dtype = old_dtypes.get(path)
        if dtype is None or not isinstance(x, jax.Array) or x.dtype == dtype:
            return x
        return x.astype(dtype)

    return jax.tree_util.tree_map_with_path(cast, new)
