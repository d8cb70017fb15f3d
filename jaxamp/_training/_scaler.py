"""Loss scaling: dynamic (float16) and static / no-op (bfloat16).

The algorithm is the dynamic loss scaling of Micikevicius et al. 2018, "Mixed
Precision Training" (https://arxiv.org/abs/1710.03740), as in NVIDIA's
"Training with mixed precision" guide and PyTorch's ``torch.amp.GradScaler``:
multiply the loss by a scale before differentiating, divide the gradients by
the *same* scale, and when they are not finite shrink the scale (and skip the
step); after ``patience`` finite steps grow it again. Names, defaults and the
update rule follow jaxamp 0.0.4 (github acutkosky/jaxamp).

Saving a state: every field is a pytree leaf, so
``numpy.savez(path, **state._asdict())`` and
``DynamicScalerState(**numpy.load(path))`` round-trip it (bounds included).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .._base._dtypes import widest
from ._optax import all_finite
from ._scaler_checks import _as, _validate_dynamic, _validate_scale

PyTree = Any


def _register(cls: type) -> type:
    """Register a NamedTuple subclass as a pytree whose unflatten skips ``__new__``.

    jax rebuilds a plain NamedTuple by calling the class, so validation in
    ``__new__`` would run on whatever jax or the user puts in the leaves
    (``tree_map(lambda _: 0, state)`` for ``in_axes``, ``object()`` sentinels,
    tracers). Validation belongs to construction by the user only.
    """
    keys = tuple(jax.tree_util.GetAttrKey(name) for name in cls._fields)
    jax.tree_util.register_pytree_with_keys(
        cls,
        lambda s: (tuple(zip(keys, s)), None),
        lambda _, children: cls._make(children),
        flatten_func=lambda s: (tuple(s), None),
    )
    return cls


class _DynamicFields(NamedTuple):
    patience: Any = 2000
    adjust_factor: Any = 2.0
    scaler: Any = 2.0**15
    count: Any = 0
    total_resets: Any = 0
    min_scaler: Any = 1.0
    max_scaler: Any = 2.0**24


@_register
class DynamicScalerState(_DynamicFields):
    """State of dynamic loss scaling: a NamedTuple pytree, jaxamp 0.0.4 fields.

    Python and NumPy numbers and concrete JAX arrays are validated and
    converted to scalar arrays (``scaler``, ``adjust_factor`` and the bounds:
    float32; ``patience`` and the counters: int32), so the state has the same
    avals before and after a jitted step (no recompilation). Every field is a
    pytree leaf: the bounds survive ``jax.jit``, ``jax.tree_util.tree_map`` and
    checkpointing (jmp's ``DynamicLossScale`` drops its ``min_loss_scale``
    there). Rebuilding the state from leaves (what jax does) skips validation,
    so ``tree_map(lambda _: 0, state)`` is a valid ``in_axes`` tree.

    Update rule (:meth:`adjust`, as jaxamp 0.0.4, with bounds): on non-finite
    gradients ``scaler = scaler / adjust_factor``, ``count = 0``,
    ``total_resets += 1``; on finite gradients, if ``count >= patience`` then
    ``scaler = scaler * adjust_factor`` and ``count = 0``, else ``count += 1``;
    then, on every adjust, the scale is clipped to ``[min_scaler,
    max_scaler]``, so a state built with a scale outside the bounds is back
    within them after one step. So after ``patience`` consecutive finite steps
    the next finite step grows the scale (jmp's and mpx's ``period`` is
    ``patience + 1``).

    Save and load::

        numpy.savez(path, **state._asdict())
        state = DynamicScalerState(**numpy.load(path))

    Attributes:
        patience: int32 scalar; finite steps counted before the scale grows
            (default 2000).
        adjust_factor: float32 scalar > 1; the scale is multiplied / divided by
            it (default 2.0).
        scaler: float32 scalar; the current loss scale (default 2**15).
        count: int32 scalar; finite steps since the scale last changed.
        total_resets: int32 scalar; how many times non-finite gradients shrank
            the scale.
        min_scaler: float32 scalar; lower bound of the scale (default 1.0, as
            jmp; jaxamp 0.0.4 had none).
        max_scaler: float32 scalar; upper bound of the scale (default 2**24;
            ``inf`` for none).

    Raises:
        ValueError: when built from concrete values with ``scaler``,
            ``min_scaler`` or ``max_scaler`` <= 0 or NaN, ``scaler`` or
            ``min_scaler`` infinite, ``adjust_factor <= 1`` or infinite,
            ``patience < 0``, ``count`` or ``total_resets`` < 0, ``min_scaler >
            max_scaler``, or a non-scalar field. Traced values are not checked.
    """

    __slots__ = ()

    def __new__(
        cls,
        patience: Any = 2000,
        adjust_factor: Any = 2.0,
        scaler: Any = 2.0**15,
        count: Any = 0,
        total_resets: Any = 0,
        min_scaler: Any = 1.0,
        max_scaler: Any = 2.0**24,
    ) -> DynamicScalerState:
        _validate_dynamic(
            patience, adjust_factor, scaler, count, total_resets, min_scaler, max_scaler
        )
        f32, i32 = _as(jnp.float32), _as(jnp.int32)
        return super().__new__(
            cls,
            i32(patience),
            f32(adjust_factor),
            f32(scaler),
            i32(count),
            i32(total_resets),
            f32(min_scaler),
            f32(max_scaler),
        )

    def adjust(self, grads_finite: Any) -> DynamicScalerState:
        """The state after a step whose gradients were (not) finite.

        Args:
            grads_finite: scalar bool (array or Python bool), e.g. from
                :func:`jaxamp.all_finite`.

        Returns:
            The next :class:`DynamicScalerState` (see the class docstring); its
            scale is within ``[min_scaler, max_scaler]``.

        Raises:
            ValueError: if ``grads_finite`` is not a scalar.
        """
        if np.ndim(grads_finite) != 0:
            raise ValueError(
                f"adjust(grads_finite): grads_finite must be a scalar bool, got "
                f"shape {np.shape(grads_finite)}; reduce the gradients with "
                "jaxamp.all_finite(grads)."
            )
        finite = jnp.asarray(grads_finite, bool)
        grow = finite & (self.count >= self.patience)
        up = self.scaler * self.adjust_factor
        # With max_scaler=inf the product can overflow float32: keep the scale.
        up = jnp.where(jnp.isfinite(up), up, self.scaler)
        down = self.scaler / self.adjust_factor
        scaler = jnp.where(finite, jnp.where(grow, up, self.scaler), down)
        # Clipped on every adjust, so a state built outside the bounds comes
        # back within them after one step, whatever the step was.
        scaler = jnp.clip(scaler, self.min_scaler, self.max_scaler)
        count = jnp.where(finite & ~grow, self.count + 1, 0)
        return self._replace(
            scaler=jnp.asarray(scaler, jnp.float32),
            count=jnp.asarray(count, jnp.int32),
            total_resets=jnp.asarray(
                self.total_resets + jnp.asarray(~finite, jnp.int32), jnp.int32
            ),
        )

    def scale(self, tree: PyTree) -> PyTree:
        """Multiply every float leaf of ``tree`` (e.g. the loss) by the scale,
        in the leaf's own dtype."""
        return _scale(tree, self.scaler)

    def unscale(self, tree: PyTree) -> PyTree:
        """Divide every float leaf of ``tree`` (e.g. gradients) by the scale, in
        float32 or the leaf's dtype if wider."""
        return _unscale(tree, self.scaler)

    def _canonical(self) -> DynamicScalerState:
        f32 = lambda v: jnp.asarray(v, jnp.float32)
        i32 = lambda v: jnp.asarray(v, jnp.int32)
        casts = (i32, f32, f32, i32, i32, f32, f32)
        return self._make(c(v) for c, v in zip(casts, self))


class _StaticFields(NamedTuple):
    scaler: Any = 1.0


@_register
class StaticScalerState(_StaticFields):
    """A fixed loss scale; the default 1.0 is no scaling (the bfloat16 case).

    Used with the same ``dynamic_scale_*`` call shape as
    :class:`DynamicScalerState`, so a script switches between float16 (dynamic)
    and bfloat16 (static) by changing one line. :meth:`adjust` returns the state
    unchanged. Save and load as :class:`DynamicScalerState`.

    Attributes:
        scaler: float32 scalar; the fixed loss scale (default 1.0).

    Raises:
        ValueError: when built from a concrete value with ``scaler <= 0`` or a
            non-finite ``scaler``.
    """

    __slots__ = ()

    def __new__(cls, scaler: Any = 1.0) -> StaticScalerState:
        _validate_scale("StaticScalerState", "scaler", scaler)
        return super().__new__(cls, _as(jnp.float32)(scaler))

    def adjust(self, grads_finite: Any) -> StaticScalerState:
        """The same state: a static scale never adjusts."""
        del grads_finite
        return self

    def scale(self, tree: PyTree) -> PyTree:
        """Multiply every float leaf of ``tree`` by the scale, in its own dtype."""
        return _scale(tree, self.scaler)

    def unscale(self, tree: PyTree) -> PyTree:
        """Divide every float leaf of ``tree`` by the scale, in float32 or wider."""
        return _unscale(tree, self.scaler)

    def _canonical(self) -> StaticScalerState:
        return self._make([jnp.asarray(self.scaler, jnp.float32)])


ScalerState = DynamicScalerState | StaticScalerState


def _is_float_array(x: Any) -> bool:
    return eqx.is_array(x) and jnp.issubdtype(x.dtype, jnp.floating)


def _scale(tree: PyTree, scale: Any) -> PyTree:
    scale = jnp.asarray(scale, jnp.float32)
    return jax.tree_util.tree_map(
        lambda x: x * scale.astype(x.dtype) if _is_float_array(x) else x, tree
    )


def _unscale(tree: PyTree, scale: Any) -> PyTree:
    scale = jnp.asarray(scale, jnp.float32)

    def leaf(x):
        if _is_float_array(x):
            dt = widest([x.dtype, jnp.float32])
            return x.astype(dt) / scale.astype(dt)
        return x

    return jax.tree_util.tree_map(leaf, tree)


# Where the gradients and the loss sit in a transform's results.
_KNOWN_HAS_VALUE = {
    jax.grad: False,
    eqx.filter_grad: False,
    jax.value_and_grad: True,
    eqx.filter_value_and_grad: True,
}


def _has_aux(transform: Callable, fun: Callable, args: tuple, kwargs: dict) -> bool:
    try:
        bound = inspect.signature(transform).bind_partial(fun, *args, **kwargs)
    except (TypeError, ValueError):
        return bool(kwargs.get("has_aux", False))
    return bool(bound.arguments.get("has_aux", False))


def dynamic_scale_tx(
    transform: Callable,
    redo_on_nan: int = 0,
    unscale_fn: Callable | None = None,
    scale_fn: Callable | None = None,
    *,
    has_value: bool | None = None,
) -> Callable:
    """Add loss scaling to a gradient transformation (jaxamp 0.0.4's call shape).

    ``dynamic_scale_tx(jax.value_and_grad)(fun, has_aux=True, argnums=1)`` is
    ``jax.value_and_grad(fun, has_aux=True, argnums=1)`` with loss scaling: it
    returns ``g(*args, dynamic_scaler_state, **kwargs) -> (new_state, results)``.
    ``fun``'s loss (a float scalar of any dtype) is multiplied by the scale in its
    own dtype; the gradients (and the value) in ``results`` are divided by the
    scale that produced them, in float32 or the primal dtype if wider; then the
    state adjusts to whether the gradients are finite. Algorithm: Micikevicius et
    al. 2018, "Mixed Precision Training", section 3.2.

    Args:
        transform: ``jax.grad``, ``jax.value_and_grad``, ``eqx.filter_grad``,
            ``eqx.filter_value_and_grad`` or another function with the signature
            ``transform(fun, *args, has_aux=..., **kwargs)`` whose results are
            either all linear in the loss or shaped like those.
        redo_on_nan: int >= 0. When the gradients are not finite, shrink the scale
            (counted in ``total_resets``) and recompute, up to this many times,
            inside the same call (a ``lax.while_loop``; it stops early once the
            scale is at ``min_scaler``). The body is compiled a second time for
            the loop. Ignored for a :class:`StaticScalerState`.
        unscale_fn: optional ``unscale_fn(results, state) -> results`` replacing
            the default unscaling (jaxamp 0.0.4).
        scale_fn: optional ``scale_fn(fun_output, state) -> fun_output`` replacing
            the default scaling of the loss (jaxamp 0.0.4).
        has_value: whether ``transform`` returns ``(value, grads)``; found
            automatically for the four transforms above. Needed for another
            transform only with ``has_aux=True``.

    Returns:
        ``scaled_transform(fun, *args, **kwargs)``, which forwards ``args`` and
        ``kwargs`` to ``transform`` and returns ``g`` above. ``g`` takes
        ``dynamic_scaler_state`` (a :class:`DynamicScalerState` or
        :class:`StaticScalerState`) by keyword only.

    Raises:
        TypeError: if ``transform`` (or, from ``scaled_transform``, ``fun``) is
            not callable.
        ValueError: if ``redo_on_nan`` is not an int >= 0, or an unknown
            transform is used with ``has_aux=True`` and no ``has_value``.
        TypeError: (from ``g``) if ``dynamic_scaler_state`` is passed positionally,
            missing, or not a scaler state.
    """
    if not callable(transform):
        raise TypeError(
            f"dynamic_scale_tx(transform): transform must be a gradient "
            f"transformation such as jax.value_and_grad, got "
            f"{type(transform).__name__}."
        )
    if has_value is None:
        has_value = _KNOWN_HAS_VALUE.get(transform)
    return functools.partial(
        _scaled_transform,
        transform,
        _check_redo(redo_on_nan),
        scale_fn,
        unscale_fn,
        has_value,
    )


def _check_redo(redo_on_nan: Any) -> int:
    if (
        isinstance(redo_on_nan, bool)
        or not isinstance(redo_on_nan, (int, np.integer))
        or redo_on_nan < 0
    ):
        raise ValueError(
            f"redo_on_nan must be an int >= 0 (recomputations per call), got "
            f"{redo_on_nan!r}."
        )
    return int(redo_on_nan)


class _Layout(NamedTuple):
    """Where the loss, the aux and the gradients sit in a transform's
    results: ``has_value`` None (no aux: every float leaf is linear in the
    loss), True (``(value, grads)``) or False (``grads``)."""

    has_aux: bool
    has_value: bool | None

    def grads(self, results: Any) -> Any:
        if self.has_value is None:
            return results
        if self.has_value:
            return results[1]
        return results[0] if self.has_aux else results

    def scale(self, out: Any, state: ScalerState) -> Any:
        if self.has_aux:
            loss, aux = out
            return _scale(loss, state.scaler), aux
        return _scale(out, state.scaler)

    def unscale(self, results: Any, state: ScalerState) -> Any:
        if self.has_value is None or not self.has_aux:
            return _unscale(results, state.scaler)
        if self.has_value:
            (value, aux), grads = results
            value, grads = _unscale((value, grads), state.scaler)
            return (value, aux), grads
        grads, aux = results
        return _unscale(grads, state.scaler), aux


def _scaled_transform(
    transform: Callable,
    redo_on_nan: int,
    scale_fn: Callable | None,
    unscale_fn: Callable | None,
    has_value: bool | None,
    fun: Callable,
    *t_args: Any,
    **t_kwargs: Any,
) -> Callable:
    """``dynamic_scale_tx(transform, ...)(fun, *t_args, **t_kwargs)``."""
    if not callable(fun):
        raise TypeError(
            f"fun must be the loss function (callable), got "
            f"{type(fun).__name__}: e.g. "
            "jaxamp.dynamic_scale_value_and_grad(loss_fn)."
        )
    has_aux = _has_aux(transform, fun, t_args, t_kwargs)
    if has_aux and has_value is None and unscale_fn is None:
        raise ValueError(
            f"dynamic_scale_tx({getattr(transform, '__name__', transform)}): "
            "with has_aux=True pass has_value=True (the transform returns "
            "((value, aux), grads)) or has_value=False (it returns "
            "(grads, aux)), or an unscale_fn."
        )
    layout = _Layout(has_aux, has_value)
    do_scale = scale_fn or layout.scale
    do_unscale = unscale_fn or layout.unscale

    def scaled_fun(*args, _jaxamp_scaler_state, **kwargs):
        return do_scale(fun(*args, **kwargs), _jaxamp_scaler_state)

    transformed = transform(scaled_fun, *t_args, **t_kwargs)

    def attempt(state, args, kwargs):
        results = transformed(*args, _jaxamp_scaler_state=state, **kwargs)
        results = do_unscale(results, state)
        return results, all_finite(layout.grads(results))

    return _scaled_call(fun, attempt, redo_on_nan)


def _scaled_call(fun: Callable, attempt: Callable, redo_on_nan: int) -> Callable:
    """``g(*args, dynamic_scaler_state, **kwargs) -> (new_state, results)``:
    one ``attempt(state, args, kwargs) -> (results, finite)``, recomputed with
    a shrunk scale up to ``redo_on_nan`` times while not finite."""

    @functools.wraps(fun)
    def scaled_call(*args, dynamic_scaler_state=None, **kwargs):
        state = _check_state(args, dynamic_scaler_state)._canonical()
        results, finite = attempt(state, args, kwargs)
        if redo_on_nan and isinstance(state, DynamicScalerState):
            state, results, finite = _redo(
                attempt, state, results, finite, args, kwargs, redo_on_nan
            )
        return state.adjust(finite), results

    # Keep fun's name and docstring but not its signature (no __wrapped__):
    # eqx.filter_jit binds arguments to the signature, which must accept
    # dynamic_scaler_state.
    del scaled_call.__wrapped__
    return scaled_call


def _redo(attempt, state, results, finite, args, kwargs, redo_on_nan):
    """Shrink the scale and recompute inside a ``lax.while_loop`` while the
    results are not finite, at most ``redo_on_nan`` times, stopping once the
    scale is at ``min_scaler`` (a retry there would change nothing)."""
    dynamic, static = eqx.partition(results, eqx.is_array)

    def cond(carry):
        st, _, fin, i = carry
        return ~fin & (i < redo_on_nan) & (st.scaler > st.min_scaler)

    def body(carry):
        st, _, _, i = carry
        st = st.adjust(False)
        res, fin = attempt(st, args, kwargs)
        return st, eqx.filter(res, eqx.is_array), fin, i + 1

    state, dynamic, finite, _ = jax.lax.while_loop(
        cond, body, (state, dynamic, finite, jnp.asarray(0, jnp.int32))
    )
    return state, eqx.combine(dynamic, static), finite


def _check_state(args: tuple, state: Any) -> ScalerState:
    if state is None:
        if any(isinstance(a, (DynamicScalerState, StaticScalerState)) for a in args):
            raise TypeError(
                "dynamic_scaler_state was passed positionally; pass it by keyword: "
                "g(*args, dynamic_scaler_state=state)."
            )
        raise TypeError(
            "missing keyword argument dynamic_scaler_state: call "
            "g(*args, dynamic_scaler_state=jaxamp.DynamicScalerState()) "
            "(or jaxamp.StaticScalerState() for no loss scaling)."
        )
    if not isinstance(state, (DynamicScalerState, StaticScalerState)):
        raise TypeError(
            "dynamic_scaler_state must be a jaxamp.DynamicScalerState or "
            f"jaxamp.StaticScalerState, got {type(state).__name__}."
        )
    return state


def _transform(grad: bool, filter: bool, argnums: Any) -> tuple[Callable, dict]:
    if filter:
        if not (isinstance(argnums, int) and argnums == 0):
            raise ValueError(
                f"argnums={argnums!r} needs filter=False: Equinox's filter "
                "transformations differentiate the first argument only."
            )
        return (eqx.filter_grad if grad else eqx.filter_value_and_grad), {}
    return (jax.grad if grad else jax.value_and_grad), {"argnums": argnums}


def dynamic_scale_grad(
    fun: Callable,
    *,
    has_aux: bool = False,
    redo_on_nan: int = 0,
    filter: bool = True,
    argnums: int | tuple[int, ...] = 0,
    **kwargs: Any,
) -> Callable:
    """``grad`` with dynamic loss scaling (jaxamp 0.0.4's name and call shape).

    Example::

        grad_fn = jax.jit(jaxamp.training.dynamic_scale_grad(amp_loss))
        state, grads = grad_fn(model, x, y, dynamic_scaler_state=state)

    Args:
        fun: the loss function; returns a float scalar of any dtype (float16
            under ``amp``), or ``(loss, aux)`` with ``has_aux=True``.
        has_aux: as in ``jax.grad``.
        redo_on_nan: int >= 0; see :func:`dynamic_scale_tx`.
        filter: True differentiates with ``eqx.filter_grad`` (the inexact array
            leaves of the first argument); False with ``jax.grad``.
        argnums: as in ``jax.grad``; ``filter=False`` only.
        **kwargs: forwarded to ``jax.grad`` (e.g. ``allow_int``).

    Returns:
        ``g(*args, dynamic_scaler_state, **kwargs) -> (new_state, grads)``, or
        ``(new_state, (grads, aux))`` with ``has_aux``. Gradients are unscaled by
        the scale that produced them, in float32 (or the primal dtype if
        wider); ``new_state`` has the type of ``dynamic_scaler_state``.

    Raises:
        ValueError: ``argnums`` other than 0 with ``filter=True``; a bad
            ``redo_on_nan``.
        TypeError: ``fun`` is not callable.
        TypeError: (from ``g``) a positional, missing or wrong-typed
            ``dynamic_scaler_state``.
    """
    transform, kw = _transform(True, filter, argnums)
    return dynamic_scale_tx(transform, redo_on_nan=redo_on_nan)(
        fun, has_aux=has_aux, **kw, **kwargs
    )


def dynamic_scale_value_and_grad(
    fun: Callable,
    *,
    has_aux: bool = False,
    redo_on_nan: int = 0,
    filter: bool = True,
    argnums: int | tuple[int, ...] = 0,
    **kwargs: Any,
) -> Callable:
    """``value_and_grad`` with dynamic loss scaling (jaxamp 0.0.4's name).

    Example::

        vg = jax.jit(jaxamp.dynamic_scale_value_and_grad(amp_loss, filter=False))
        state, (loss, grads) = vg(params, x, y, dynamic_scaler_state=state)

    Args:
        fun, has_aux, redo_on_nan, filter, argnums, kwargs: as in
            :func:`dynamic_scale_grad` (``jax.value_and_grad`` /
            ``eqx.filter_value_and_grad``). ``redo_on_nan`` defaults to 0 here
            too (jaxamp 0.0.4 used 10 here, 0 in its README).

    Returns:
        ``g(*args, dynamic_scaler_state, **kwargs) -> (new_state, (value,
        grads))``, or ``(new_state, ((value, aux), grads))`` with ``has_aux``.
        The value (the true, unscaled loss) and the gradients are divided by the
        scale that produced them, in float32 (or wider).

    Raises:
        ValueError, TypeError: as :func:`dynamic_scale_grad`.
    """
    transform, kw = _transform(False, filter, argnums)
    return dynamic_scale_tx(transform, redo_on_nan=redo_on_nan)(
        fun, has_aux=has_aux, **kw, **kwargs
    )
