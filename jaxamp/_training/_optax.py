"""optax integration: finiteness checks, tree selection and an update that skips
non-finite steps (counted, never silently lost)."""

from __future__ import annotations

import weakref
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

from .._base._dtypes import widest

PyTree = Any


def all_finite(tree: PyTree) -> jax.Array:
    """Whether every floating-point leaf of ``tree`` is finite (no inf or NaN).

    The overflow check of dynamic loss scaling (as jmp's ``all_finite``, and
    PyTorch's ``GradScaler`` "found_inf"). Works under ``jit`` (no host sync).

    Args:
        tree: any pytree, leaves of any shape; non-array and non-float leaves
            (ints, None, static fields of an Equinox module) are ignored.

    Returns:
        A bool array of shape ``()`` (True for a tree without float leaves).
    """
    leaves = [
        x
        for x in jax.tree_util.tree_leaves(tree)
        if eqx.is_array(x) and jnp.issubdtype(x.dtype, jnp.inexact)
    ]
    if not leaves:
        return jnp.asarray(True)
    return jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]).all()


def select_tree(pred: Any, a: PyTree, b: PyTree) -> PyTree:
    """``a`` where the scalar boolean ``pred`` is True, else ``b``, leaf by leaf.

    Args:
        pred: scalar boolean (shape ``()`` array or Python bool), e.g. from
            :func:`all_finite`.
        a, b: pytrees of the same structure; array leaves at the same position
            must have equal shapes and dtypes; non-array leaves are taken from
            ``a``.

    Returns:
        A pytree with ``a``'s structure (jmp's ``select_tree``, without the
        requirement that every leaf be an array).

    Raises:
        ValueError: if ``pred`` is not a scalar, or two array leaves differ in
            shape or dtype (a silent promotion would change the dtypes of the
            state and recompile the step).
    """
    pred = jnp.asarray(pred)
    if pred.shape != ():
        raise ValueError(f"select_tree: pred must be a scalar, got shape {pred.shape}.")
    pred = pred.astype(bool)

    def leaf(path, x, y):
        if eqx.is_array(x):
            if eqx.is_array(y) and (x.shape != y.shape or x.dtype != y.dtype):
                raise ValueError(
                    f"select_tree: leaf {jax.tree_util.keystr(path)} is "
                    f"{x.dtype}{list(x.shape)} in a but {y.dtype}{list(y.shape)} "
                    "in b; cast one of them so both match."
                )
            return jnp.where(pred, x, y)
        return x

    return jax.tree_util.tree_map_with_path(leaf, a, b, is_leaf=lambda x: x is None)


# update -> gated_update(updates, state, params, gate, **extra), which returns
# updates that are zero where gate is False and the state unchanged there: an
# optimizer that writes its state in place (in a loop over layers, or ordered
# by ``_in_place``) and so must apply the skip's select inside each write; a
# select after the update would keep the old and the new state alive at once.
_GATED_UPDATES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def register_gated_update(update: Any, gated: Any) -> None:
    """Register ``gated`` as the gated form of the optimizer update ``update``
    (see :data:`_GATED_UPDATES`)."""
    _GATED_UPDATES[update] = gated


def gate_tree(gate: Any, new: PyTree, old: PyTree) -> PyTree:
    """``new`` where the scalar bool ``gate`` is True, else ``old`` (``new``
    as it is when ``gate`` is None), leaf by leaf, for one state write."""
    if gate is None:
        return new
    return jax.tree_util.tree_map(lambda n, o: jnp.where(gate, n, o), new, old)


def gate_update(gate: Any, u: Any, p: Any) -> Any:
    """An update ``u`` of the parameter ``p``: zero where the scalar bool
    ``gate`` is False (``u`` as it is when ``gate`` is None or ``u`` is None).

    The zero is ``-(p - p)``, negative zero for a finite ``p`` (``p + -0.0``
    is ``p`` bit for bit, a negative zero included): an elementwise value of a
    buffer the step holds anyway, which XLA fuses into the update's write. A
    zero-filled ``zeros_like(u)`` can be fused with another zero fill (the
    gradient accumulators of a scanned backward pass) into a buffer of its
    own, one update's bytes per parameter at the step's peak.
    """
    if gate is None or u is None:
        return u
    if p is None or jnp.shape(p) != jnp.shape(u):
        return jnp.where(gate, u, jnp.full_like(u, -0.0))
    return jnp.where(gate, u, (-(p - p)).astype(u.dtype))


def _gate_updates(gate: jax.Array, updates: PyTree, params: PyTree) -> PyTree:
    """:func:`gate_update` leaf by leaf (zeros of ``updates``' own shape where
    ``params`` is None or of another structure)."""
    u_leaves, tdef = jax.tree_util.tree_flatten(updates)
    p_leaves = [None] * len(u_leaves)
    if params is not None:
        p_flat, p_def = jax.tree_util.tree_flatten(params)
        if p_def == tdef:
            p_leaves = p_flat
    out = [
        gate_update(gate, u, p) if eqx.is_array(u) else u
        for u, p in zip(u_leaves, p_leaves)
    ]
    return tdef.unflatten(out)


def _gated_update(inner, gated, updates, state, params, gate, extra):
    """``inner``'s ``(updates, state)`` where the scalar bool ``gate`` is True;
    zero updates and ``state`` unchanged, bit for bit, where it is False.

    ``gated``: the registered gated form of ``inner.update`` (it selects inside
    its own in-place writes) or None: then each new state leaf is a select
    between the new and the old value and each update one of
    :func:`gate_update`, elementwise, which XLA fuses into the writes into the
    donated buffers (the decision exists before the update, so nothing waits
    for a reduction over the new values).
    """
    if gated is not None:
        return gated(updates, state, params, gate, **extra)
    new_updates, new_state = inner.update(updates, state, params, **extra)
    return (
        _gate_updates(gate, new_updates, params),
        select_tree(gate, new_state, state),
    )


def gate_count(count: jax.Array, gate: Any) -> jax.Array:
    """A step count after an update: unchanged where ``gate`` is False."""
    return count + (1 if gate is None else gate.astype(count.dtype))


class SkipNonFiniteState(NamedTuple):
    """State of :func:`skip_nonfinite_updates`.

    Attributes:
        inner_state: the wrapped optimizer's state (unchanged on a skipped step).
        skipped_steps: int32 count of steps skipped because the gradients (with
            ``check_updates``, or the inner optimizer's updates) were not finite.
        last_finite: bool, whether the last step was applied.
    """

    inner_state: Any
    skipped_steps: jax.Array
    last_finite: jax.Array


def skip_nonfinite_updates(
    inner: optax.GradientTransformation, *, check_updates: bool = False
) -> optax.GradientTransformationExtraArgs:
    """Wrap an optax optimizer so that a step with non-finite gradients is skipped.

    On such a step the updates are zeros, the inner state is left unchanged and
    ``skipped_steps`` is incremented; the next finite step updates normally.
    This is the optimizer half of dynamic loss scaling (NVIDIA, "Training with
    mixed precision", and PyTorch's ``GradScaler.step``, which skips
    ``optimizer.step()`` on inf/NaN). Unlike ``optax.apply_if_finite`` it never
    gives up after a number of bad steps.

    The skip is decided from the gradients alone, before the update, as
    PyTorch and jmp decide it: each leaf's new state and update are then a
    select between the new and the old value, which XLA can fuse into the
    update's writes into the donated buffers. :func:`jaxamp.low_precision_optimizer`
    takes the decision into its own in-place writes (its layer-by-layer loop
    included). What the wrapper still costs at the step's peak, per recipe and
    compiler, is in ``benchmarks/RESULTS_MEMORY.md``. Finite gradients give
    finite updates for optax's optimizers whose state is float32 or bfloat16
    (the range of float32) and for :func:`jaxamp.low_precision_optimizer`.

    Args:
        inner: any optax ``GradientTransformation``.
        check_updates: also skip a step whose *updates* are not finite although
            its gradients were (an optimizer whose state can overflow, e.g.
            float16 moments). The decision then needs every update before any
            is written: the whole update tree and both inner states are alive
            at once, about 2 to 8 bytes per parameter more at the step's peak.

    Returns:
        A ``GradientTransformationExtraArgs`` with state :class:`SkipNonFiniteState`;
        extra keyword arguments are forwarded to ``inner.update``.

    Raises:
        TypeError: if ``inner`` is not a GradientTransformation.
    """
    if not isinstance(inner, optax.GradientTransformation):
        raise TypeError(
            "skip_nonfinite_updates(inner): inner must be an optax "
            "GradientTransformation (e.g. optax.adam(1e-3)), got "
            f"{type(inner).__name__}."
        )
    gated = _GATED_UPDATES.get(inner.update)
    inner = optax.with_extra_args_support(inner)

    def init(params):
        return SkipNonFiniteState(
            inner.init(params), jnp.zeros((), jnp.int32), jnp.asarray(True)
        )

    def update(updates, state, params=None, **extra):
        finite = all_finite(updates)  # the gradients: known before the update
        if check_updates:
            new_updates, new_inner = inner.update(
                updates, state.inner_state, params, **extra
            )
            finite = finite & all_finite(new_updates)
            inner_state = select_tree(finite, new_inner, state.inner_state)
            out = _gate_updates(finite, new_updates, params)
        else:
            out, inner_state = _gated_update(
                inner, gated, updates, state.inner_state, params, finite, extra
            )
        skipped = state.skipped_steps + (~finite).astype(jnp.int32)
        return out, SkipNonFiniteState(inner_state, skipped, finite)

    return optax.GradientTransformationExtraArgs(init, update)


def optimizer_update(
    model: PyTree,
    optimizer: optax.GradientTransformation,
    opt_state: PyTree,
    grads: PyTree,
    grads_finite: Any,
) -> tuple[PyTree, PyTree]:
    """One optimizer step for an Equinox model, skipped when ``grads_finite`` is
    False (mpx's call shape).

    Args:
        model: an Equinox module (or any pytree of parameters).
        optimizer: an optax GradientTransformation.
        opt_state: its state for ``eqx.filter(model, eqx.is_array)``.
        grads: gradients with the structure of the model's arrays.
        grads_finite: scalar bool, e.g. from :func:`all_finite`.

    Returns:
        ``(new_model, new_opt_state)``; both unchanged, bit for bit, if
        ``grads_finite`` is False. The decision is taken inside each write (as
        :func:`skip_nonfinite_updates`), so the step's peak is the plain
        one. Each parameter keeps its dtype (``p + u`` is computed in the
        wider of the two dtypes, as ``optax.apply_updates``).

    Raises:
        TypeError: if ``optimizer`` is not an optax GradientTransformation.
        ValueError: if ``grads_finite`` is not a scalar.
    """
    if not isinstance(optimizer, optax.GradientTransformation):
        raise TypeError(
            "optimizer_update: optimizer must be an optax GradientTransformation "
            f"(e.g. optax.adam(1e-3)), got {type(optimizer).__name__}."
        )
    params, static = eqx.partition(model, eqx.is_array)
    gate = jnp.asarray(grads_finite)
    if gate.shape != ():
        raise ValueError(
            "optimizer_update: grads_finite must be a scalar bool (e.g. "
            f"jaxamp.all_finite(grads)), got shape {gate.shape}."
        )
    updates, new_state = _gated_update(
        optax.with_extra_args_support(optimizer),
        _GATED_UPDATES.get(optimizer.update),
        grads,
        opt_state,
        params,
        gate.astype(bool),
        {},
    )
    new_params = jax.tree_util.tree_map(
        _apply_update, params, updates, is_leaf=lambda x: x is None
    )
    return eqx.combine(new_params, static), new_state


def _apply_update(p: Any, u: Any) -> Any:
    """``p + u`` computed in the wider dtype and stored in ``p``'s dtype (float32
    updates of float16 parameters; strict-promotion safe), as optax does."""
    if p is None or u is None:
        return p
    dt = widest([p.dtype, u.dtype]) or p.dtype
    return (p.astype(dt) + u.astype(dt)).astype(p.dtype)
