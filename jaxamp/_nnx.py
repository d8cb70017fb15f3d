"""Flax NNX graph nodes (modules, Variables, ``nnx.Rngs``) as ``amp`` arguments.

NNX layers update their Variables in place (``BatchNorm`` statistics, the
counters of ``nnx.Rngs`` streams), and NNX's transforms carry those updates back
to the caller's objects. ``amp`` traces its function to a jaxpr, so it does what
``nnx.jit`` does for the graph nodes it may update: they are split into a graph
definition and their state (``nnx.split``, all nodes together so that shared
Variables stay shared); the state's arrays are traced inputs like any other
array; the function receives the nodes re-built from them (``nnx.merge``); their
state after the call (``nnx.state``) is an extra output; and after the
mixed-precision evaluation the caller's nodes are updated with it
(``nnx.update``), every value in the dtype its Variable had before the call.

Which arguments are graph nodes to update, and which are values:

- A graph node (``nnx.Module``, ``nnx.Rngs``, ``nnx.Variable``, any
  ``nnx.Pytree``) that the caller could mutate itself is a graph node to update.
  Flax records the JAX trace an object was created at, and allows in-place
  updates only from that trace (``Variable._can_update``,
  ``Pytree._check_valid_context``; anything else raises
  ``flax.errors.TraceContextError``), so this is what ``amp`` checks.
- ``nnx.State`` / ``nnx.FlatState`` / ``nnx.GraphState`` are values. They are
  the pytree side of Flax's functional API: "The Flax NNX Functional API
  provides a way to convert graph structures to pytrees and back. By doing this
  at every function boundary you can effectively use graph structures with any
  JAX transforms" (Flax, "Flax NNX vs JAX transformations",
  https://flax.readthedocs.io/en/latest/guides/jax_and_nnx_transforms.html).
  The function gets the state as an ordinary pytree argument, re-built inside
  the trace as ``jax.jit`` re-builds it, and returns whatever new state it
  wants kept (``nnx.state(model, nnx.Not(nnx.Param))``); as under ``jax.jit``,
  writes into the argument's own Variables do not reach the caller.
- A graph node or Variable created at an outer trace (a Variable that
  ``jax.value_and_grad`` passes through undifferentiated belongs to the
  enclosing ``jax.jit``'s trace) is a value as well: the caller cannot update
  it, so neither does ``amp``. Inside a graph node to update (a module merged
  from such Variables), such a Variable is read and never written back; if the
  function changed it, ``amp`` raises the ``TraceContextError`` the same code
  raises without ``amp``.

So ``jax.jit(jax.value_and_grad(amp(loss), has_aux=True))`` over
``nnx.split(model, nnx.Param, ...)`` states computes what it computes without
``amp``, and module arguments keep their in-place updates.

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


def _state_types(nnx: Any) -> tuple[type, ...]:
    """The functional API's state containers (values, never graph nodes)."""
    names = ("State", "FlatState", "GraphState")
    found = (getattr(nnx, name, None) for name in names)
    return tuple(t for t in found if isinstance(t, type))


def _mutable_here(nnx: Any, x: Any) -> bool:
    """Whether Flax lets the current trace update ``x`` in place.

    A Variable answers itself (``_can_update``: created at this trace, or a
    hijax Variable); a Pytree (modules, ``nnx.Rngs``) keeps the trace it was
    created at in ``_pytree__state``. Anything else (array refs) is mutable.
    """
    if isinstance(x, nnx.Variable):
        return bool(getattr(x, "_can_update", True))
    pytree_state = getattr(x, "_pytree__state", None)
    trace_state = getattr(pytree_state, "trace_state", None)
    return trace_state is None or bool(trace_state.is_valid())


def _nodes_to_update(nnx: Any, tree: Any) -> tuple[list, Any, list[int]]:
    """``tree`` flattened down to its graph nodes and States (each one leaf),
    and the indices of the leaves that are graph nodes to update."""
    states = _state_types(nnx)
    is_graph_node = nnx.graph.is_graph_node
    stop = lambda x: isinstance(x, states) or is_graph_node(x)  # noqa: E731
    leaves, treedef = jax.tree_util.tree_flatten(tree, is_leaf=stop)
    where = [
        i
        for i, x in enumerate(leaves)
        if is_graph_node(x) and not isinstance(x, states) and _mutable_here(nnx, x)
    ]
    return leaves, treedef, where


class _InputNode:
    """Stands, in ``fn``'s output, for the ``index``-th input graph node."""

    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index


class _Changed:
    """The paths of read-only Variables ``fn`` changed; a static output (not a
    pytree), so it leaves the trace as the Python value it is."""

    __slots__ = ("paths",)

    def __init__(self, paths: frozenset):
        self.paths = paths


def call(amp_call: Callable, fn: Callable, args: tuple, kwargs: dict) -> Any:
    """``amp_call(fn, args, kwargs)``, with the NNX graph nodes in the arguments
    that the caller may update lifted to their state and updated after the call.

    Args:
        amp_call: ``amp_call(fn, args, kwargs) -> out``, the traced
            mixed-precision evaluation of ``fn`` on pytree arguments.
        fn: the user's function.
        args: positional arguments of ``fn``: any pytrees, possibly holding
            NNX modules, Variables, ``nnx.Rngs`` or ``nnx.State`` anywhere.
        kwargs: keyword arguments of ``fn``, likewise.

    Returns:
        What ``fn`` returns (graph nodes it returns among its inputs are the
        caller's objects). As a side effect, every Variable of the graph nodes
        to update (see the module docstring) holds the value ``fn`` left in
        it, cast to the Variable's dtype before the call.

    Raises:
        flax.errors.TraceContextError: ``fn`` changed a Variable of a graph
            node argument that belongs to an outer trace (as it would without
            ``amp``).
    """
    nnx = _loaded_nnx()
    if nnx is None:
        return amp_call(fn, args, kwargs)
    leaves, treedef, where = _nodes_to_update(nnx, (args, kwargs))
    if not where:
        return amp_call(fn, args, kwargs)
    is_graph_node = nnx.graph.is_graph_node

    nodes = [leaves[i] for i in where]
    graphdef, state = nnx.split(nodes)
    # Variables of these nodes that an outer trace owns: read, never written.
    frozen = frozenset(
        path for path, var in nnx.to_flat_state(state) if not _mutable_here(nnx, var)
    )
    others = list(leaves)
    for i in where:
        others[i] = None

    @functools.wraps(fn)
    def pure_fn(state, others):
        merged = nnx.merge(graphdef, state)
        before = _raw_values(nnx, merged, frozen)
        full = list(others)
        for i, node in zip(where, merged):
            full[i] = node
        a, kw = jax.tree_util.tree_unflatten(treedef, full)
        out = fn(*a, **kw)
        after = _raw_values(nnx, merged, frozen)
        changed = frozenset(p for p in after if after[p] is not before[p])
        index = {id(node): k for k, node in enumerate(merged)}
        out = jax.tree_util.tree_map(
            lambda x: _InputNode(index[id(x)]) if id(x) in index else x,
            out,
            is_leaf=is_graph_node,
        )
        return out, nnx.state(merged), _Changed(changed)

    out, new_state, changed = amp_call(pure_fn, (state, others), {})
    _update(nnx, nodes, new_state, state, frozen, changed.paths)
    return jax.tree_util.tree_map(
        lambda x: nodes[x.index] if isinstance(x, _InputNode) else x,
        out,
        is_leaf=lambda x: isinstance(x, _InputNode),
    )


def _raw_values(nnx: Any, node: Any, paths: frozenset) -> dict:
    """The raw values (tracers inside the trace) of ``node``'s Variables at
    ``paths``; the same object before and after a call means unchanged, the
    test ``nnx.jit`` applies (``flax.nnx.extract.variable_changed``)."""
    if not paths:
        return {}
    flat = nnx.to_flat_state(nnx.state(node))
    return {path: var.get_raw_value() for path, var in flat if path in paths}


def _update(
    nnx: Any,
    nodes: list,
    new: Any,
    old: Any,
    frozen: frozenset,
    changed: frozenset,
) -> None:
    """Write ``new`` into the caller's ``nodes``, except the Variables at the
    ``frozen`` paths (an outer trace owns them); raise as Flax does if ``fn``
    changed one of those."""
    if changed:
        from flax import errors

        path = sorted(changed, key=str)[0]
        var = dict(nnx.to_flat_state(old))[path]
        raise errors.TraceContextError(
            f"Cannot mutate {type(var).__name__} from a different trace level "
            f"(path {'/'.join(map(str, path))}: the Variable belongs to an outer "
            "trace; return its new value instead, as the functional API does)"
        )
    new = _in_dtypes_of(new, old)
    if frozen:
        kept = [(p, v) for p, v in nnx.to_flat_state(new) if p not in frozen]
        new = nnx.from_flat_state(kept)
    nnx.update(nodes, new)


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
