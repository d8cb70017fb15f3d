"""Loss scaling: dynamic (float16) and static / no-op (bfloat16).

The algorithm is the dynamic loss scaling of Micikevicius et al. 2018, "Mixed
Precision Training" (https://arxiv.org/abs/1710.03740), as in NVIDIA's
"Training with mixed precision" guide and PyTorch's ``torch.amp.GradScaler``:
multiply the loss by a scale before differentiating, divide the gradients by
the *same* scale, and when they are not finite shrink the scale (and skip the
step); after ``patience`` finite steps grow it again. Names and defaults follow
jaxamp 0.0.4.

Saving a state: every field is a pytree leaf, so
``numpy.savez(path, **state._asdict())`` and
``DynamicScalerState(**numpy.load(path))`` round-trip it (bounds included).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from numbers import Number
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ._dtypes import widest
from ._optax import all_finite


def _concrete(x: Any) -> bool:
    return isinstance(x, (Number, np.ndarray, np.generic)) and not isinstance(x, bool)


class _DynamicFields(NamedTuple):
    patience: Any = 2000
    adjust_factor: Any = 2.0
    scaler: Any = 2.0**15
    count: Any = 0
    total_resets: Any = 0
    min_scaler: Any = 1.0
    max_scaler: Any = 2.0**24


class DynamicScalerState(_DynamicFields):
    """State of dynamic loss scaling (a NamedTuple pytree; jaxamp 0.0.4 fields).

    Python numbers are converted to arrays (``scaler``, ``adjust_factor``,
    bounds: float32; counters: int32) and validated.

    Attributes:
        patience: number of consecutive finite steps before the scale grows.
        adjust_factor: factor the scale is multiplied / divided by (> 1).
        scaler: the current loss scale, float32 (default 2**15).
        count: finite steps since the last adjustment, int32.
        total_resets: number of times non-finite gradients shrank the scale.
        min_scaler: lower bound of the scale (default 1.0).
        max_scaler: upper bound of the scale (default 2**24).

    Raises:
        ValueError: for a non-positive ``scaler`` or bound, ``adjust_factor <= 1``,
            ``patience < 1`` or ``min_scaler > max_scaler`` given as numbers.
    """

    __slots__ = ()

    def __new__(
        cls,
        patience=2000,
        adjust_factor=2.0,
        scaler=2.0**15,
        count=0,
        total_resets=0,
        min_scaler=1.0,
        max_scaler=2.0**24,
    ):
        checks = [
            ("scaler", scaler, lambda v: v > 0, "must be > 0"),
            ("min_scaler", min_scaler, lambda v: v > 0, "must be > 0"),
            ("max_scaler", max_scaler, lambda v: v > 0, "must be > 0"),
            ("adjust_factor", adjust_factor, lambda v: v > 1, "must be > 1"),
            ("patience", patience, lambda v: v >= 1, "must be >= 1"),
        ]
        for name, val, ok, msg in checks:
            if _concrete(val) and np.ndim(val) == 0 and not ok(float(val)):
                raise ValueError(f"DynamicScalerState: {name}={val} {msg}.")
        if (
            _concrete(min_scaler)
            and _concrete(max_scaler)
            and float(min_scaler) > float(max_scaler)
        ):
            raise ValueError(
                f"DynamicScalerState: min_scaler={min_scaler} > "
                f"max_scaler={max_scaler}."
            )
        f32 = lambda v: jnp.asarray(v, jnp.float32) if _concrete(v) else v
        i32 = lambda v: jnp.asarray(v, jnp.int32) if _concrete(v) else v
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
        """The next state after a step whose gradients were (not) finite."""
        finite = jnp.asarray(grads_finite)
        down = jnp.maximum(self.scaler / self.adjust_factor, self.min_scaler)
        count = jnp.where(finite, self.count + 1, 0)
        grow = finite & (count >= self.patience)
        up = jnp.minimum(self.scaler * self.adjust_factor, self.max_scaler)
        scaler = jnp.where(finite, jnp.where(grow, up, self.scaler), down)
        return self._replace(
            scaler=scaler.astype(jnp.float32),
            count=jnp.where(grow, 0, count).astype(jnp.int32),
            total_resets=(self.total_resets + (~finite).astype(jnp.int32)),
        )


class StaticScalerState(NamedTuple):
    """A fixed loss scale (1.0: no scaling, the bfloat16 case).

    Used with the same ``dynamic_scale_*`` call shape as
    :class:`DynamicScalerState`, so switching float16 <-> bfloat16 is one line.

    Attributes:
        scaler: the fixed loss scale (float32).
    """

    scaler: Any = 1.0

    def adjust(self, grads_finite: Any) -> StaticScalerState:
        """Unchanged: a static scale never adjusts."""
        del grads_finite
        return self


ScalerState = DynamicScalerState | StaticScalerState


def _unscale(tree: Any, scale: jax.Array) -> Any:
    def leaf(x):
        if eqx.is_array(x) and jnp.issubdtype(x.dtype, jnp.floating):
            dt = widest([x.dtype, jnp.float32])
            return x.astype(dt) / scale.astype(dt)
        return x

    return jax.tree_util.tree_map(leaf, tree)


def dynamic_scale_tx(
    transform: Callable,
    *,
    has_aux: bool = False,
    has_value: bool = False,
    redo_on_nan: int = 0,
    **transform_kwargs: Any,
) -> Callable[[Callable], Callable]:
    """Add loss scaling to a gradient transformation (``jax.grad``-like).

    Args:
        transform: ``jax.grad``, ``jax.value_and_grad``, ``eqx.filter_grad``,
            ``eqx.filter_value_and_grad`` or any function with their signature
            ``transform(fun, has_aux=..., **transform_kwargs)``.
        has_aux: whether ``fun`` returns ``(loss, aux)``.
        has_value: whether ``transform`` returns the value too
            (``value_and_grad``).
        redo_on_nan: recompute up to this many times, each with the scale
            divided by ``adjust_factor``, inside the same (jitted) call, when the
            gradients are not finite.
        **transform_kwargs: forwarded to ``transform`` (e.g. ``argnums``).

    Returns:
        A decorator: ``dynamic_scale_tx(jax.grad)(fun)`` is a function
        ``g(*args, dynamic_scaler_state, **kwargs) -> (new_state, results)``
        where ``results`` has ``transform(fun)``'s structure, with gradients
        and value unscaled (in float32, or the primal dtype if wider) by the
        scale that produced them. ``fun`` must return a scalar loss.

    Raises:
        TypeError: if ``dynamic_scaler_state`` is passed positionally or missing.
        ValueError: if ``redo_on_nan`` is negative.
    """
    if not isinstance(redo_on_nan, (int, np.integer)) or redo_on_nan < 0:
        raise ValueError(f"redo_on_nan must be an int >= 0, got {redo_on_nan!r}.")

    def decorator(fun: Callable) -> Callable:
        @functools.wraps(fun)
        def scaled_call(*args, dynamic_scaler_state=None, **kwargs):
            state = _check_state(args, dynamic_scaler_state)

            def attempt(st):
                scale = jnp.asarray(st.scaler, jnp.float32)

                def scaled_fun(*a, **kw):
                    out = fun(*a, **kw)
                    loss, aux = out if has_aux else (out, None)
                    loss = loss * scale.astype(loss.dtype)
                    return (loss, aux) if has_aux else loss

                res = transform(scaled_fun, has_aux=has_aux, **transform_kwargs)(
                    *args, **kwargs
                )
                if has_value:
                    value, grads = res
                    if has_aux:
                        value = (_unscale(value[0], scale), value[1])
                    else:
                        value = _unscale(value, scale)
                    grads = _unscale(grads, scale)
                    return (value, grads), all_finite(grads)
                if has_aux:
                    grads, aux = res
                    grads = _unscale(grads, scale)
                    return (grads, aux), all_finite(grads)
                grads = _unscale(res, scale)
                return grads, all_finite(grads)

            results, finite = attempt(state)
            if redo_on_nan and isinstance(state, DynamicScalerState):

                def cond(carry):
                    _, _, fin, i = carry
                    return (~fin) & (i < redo_on_nan)

                def body(carry):
                    st, _, fin, i = carry
                    st = st.adjust(fin)
                    res, fin = attempt(st)
                    return st, res, fin, i + 1

                state, results, finite, _ = jax.lax.while_loop(
                    cond, body, (state, results, finite, jnp.asarray(0))
                )
            return state.adjust(finite), results

        return scaled_call

    return decorator


def _check_state(args: tuple, state: Any) -> ScalerState:
    if state is None:
        if any(isinstance(a, (DynamicScalerState, StaticScalerState)) for a in args):
            raise TypeError(
                "dynamic_scaler_state was passed positionally; pass it by keyword: "
                "f(*args, dynamic_scaler_state=state)."
            )
        raise TypeError(
            "missing keyword argument dynamic_scaler_state (a DynamicScalerState "
            "or StaticScalerState)."
        )
    if not isinstance(state, (DynamicScalerState, StaticScalerState)):
        raise TypeError(
            "dynamic_scaler_state must be a DynamicScalerState or StaticScalerState, "
            f"got {type(state).__name__}."
        )
    return state


def _transform(grad: bool, filter: bool, argnums: Any) -> tuple[Callable, dict]:
    if filter:
        if argnums != 0:
            raise ValueError(
                "argnums is only supported with filter=False; Equinox's filter "
                "transformations differentiate the first argument."
            )
        return (eqx.filter_grad if grad else eqx.filter_value_and_grad), {}
    return (jax.grad if grad else jax.value_and_grad), {"argnums": argnums}


def dynamic_scale_grad(
    fun: Callable,
    *,
    has_aux: bool = False,
    redo_on_nan: int = 0,
    filter: bool = True,
    argnums: Any = 0,
) -> Callable:
    """``grad`` with loss scaling (jaxamp 0.0.4's name).

    Args:
        fun: scalar loss function (float16 under ``amp``, any float dtype).
        has_aux: ``fun`` returns ``(loss, aux)``.
        redo_on_nan: see :func:`dynamic_scale_tx`.
        filter: True uses ``eqx.filter_grad`` (first argument, array leaves);
            False uses ``jax.grad`` with ``argnums``.
        argnums: as in ``jax.grad`` (``filter=False`` only).

    Returns:
        ``g(*args, dynamic_scaler_state, **kwargs) -> (new_state, grads)`` (or
        ``(new_state, (grads, aux))``), gradients unscaled in float32.

    Raises:
        TypeError: on a positional or missing ``dynamic_scaler_state``.
    """
    transform, kw = _transform(True, filter, argnums)
    return dynamic_scale_tx(transform, has_aux=has_aux, redo_on_nan=redo_on_nan, **kw)(
        fun
    )


def dynamic_scale_value_and_grad(
    fun: Callable,
    *,
    has_aux: bool = False,
    redo_on_nan: int = 0,
    filter: bool = True,
    argnums: Any = 0,
) -> Callable:
    """``value_and_grad`` with loss scaling (jaxamp 0.0.4's name).

    Returns:
        ``g(*args, dynamic_scaler_state, **kwargs) -> (new_state, (value, grads))``
        (``((value, aux), grads)`` with ``has_aux``); value and gradients
        unscaled by the scale that produced them, in float32.

    See :func:`dynamic_scale_grad` for the arguments and errors.
    """
    transform, kw = _transform(False, filter, argnums)
    return dynamic_scale_tx(
        transform, has_aux=has_aux, has_value=True, redo_on_nan=redo_on_nan, **kw
    )(fun)
