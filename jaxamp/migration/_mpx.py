"""mpx's names on jaxamp's pieces: function casts, ``DynamicLossScaling`` and
the filtered, loss-scaled gradient transforms.

Mirrors mixed-precision-for-jax 0.1.8 (``mpx/_cast.py``,
``mpx/_loss_scaling.py``, ``mpx/_grad_tools.py``). The loss scaling runs on
:class:`jaxamp.DynamicScalerState` and :func:`jaxamp.training.dynamic_scale_grad` /
:func:`jaxamp.dynamic_scale_value_and_grad`; where mpx's results differ from
what it documents (gradients unscaled with the adjusted scale, a string ignored
by ``set_half_precision_datatype``), jaxamp returns what is documented, and
where a dtype would differ from mpx's the call warns (see
``docs/migration.md``).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .._base._dtypes import canonical_dtype
from .._training._optax import all_finite
from .._training._scaler import (
    DynamicScalerState,
    StaticScalerState,
    _register,
    dynamic_scale_grad,
    dynamic_scale_value_and_grad,
)
from .._training._scaler_checks import _validate
from ._jmp import cast_to_full_precision, cast_to_half_precision, cast_tree

PyTree = Any

# The policy key of regions amp leaves in their traced dtypes (jaxamp.amp_stop).
_AMP_STOP = "amp_stop"

# mpx clips its loss scale to float16's largest value, (2 - 2**-10) * 2**15.
FLOAT16_MAX = float(jnp.finfo(jnp.float16).max)


def _has_float_leaf_not_in(tree: PyTree, dtype: np.dtype) -> bool:
    return any(
        eqx.is_inexact_array(x) and x.dtype != dtype
        for x in jax.tree_util.tree_leaves(tree)
    )


def _cast_outputs(out: PyTree, dtype: np.dtype, caller: str) -> PyTree:
    """Every float leaf of ``out`` in ``dtype``. mpx casts only a tuple's
    elements or a single array; where that would leave a float leaf in another
    dtype, warn, so ported code never gets a silently different dtype."""
    if not (type(out) is tuple or eqx.is_array(out)) and _has_float_leaf_not_in(
        out, dtype
    ):
        warnings.warn(
            f"{caller}: the function returned a {type(out).__name__}; jaxamp casts "
            f"its float leaves to {dtype}, mpx 0.1.8 casts only a tuple's elements "
            "or a single array and would have returned them uncast. Return a "
            "tuple or cast by hand to keep mpx's dtypes.",
            UserWarning,
            stacklevel=3,
        )
    return cast_tree(out, dtype)


def cast_function(func: Callable, dtype: Any, return_dtype: Any = None) -> Callable:
    """Run ``func`` with its float inputs in ``dtype`` and its float outputs in
    ``return_dtype`` (mpx's ``cast_function``, ``mpx/_cast.py``).

    The body runs inside ``jaxamp.amp_stop``, so within :func:`jaxamp.amp` it
    keeps the dtypes its arguments were cast to, as without amp.

    Args:
        func: any function of pytrees.
        dtype: float dtype (or name) for every float array leaf of the
            positional and keyword arguments.
        return_dtype: float dtype for every float array leaf of the result;
            None: ``dtype``.

    Returns:
        The wrapped function.

    Raises:
        TypeError: if ``func`` is not callable.
        ValueError: if ``dtype`` or ``return_dtype`` is not a float dtype.

    Warns:
        UserWarning: when the result is neither a tuple nor an array (a dict,
            a list, a module) and has float leaves in another dtype: mpx leaves
            those uncast, jaxamp casts them.
    """
    if not callable(func):
        raise TypeError(
            f"cast_function(func, dtype): func must be callable, got "
            f"{type(func).__name__}."
        )
    in_dtype = canonical_dtype(dtype, argname="dtype")
    out_dtype = (
        in_dtype
        if return_dtype is None
        else canonical_dtype(return_dtype, argname="return_dtype")
    )

    @functools.wraps(func)
    def cast_call(*args, **kwargs):
        args, kwargs = cast_tree((args, kwargs), in_dtype)
        with jax.named_scope(_AMP_STOP):
            out = func(*args, **kwargs)
            return _cast_outputs(out, out_dtype, "cast_function")

    return cast_call


def force_full_precision(fn: Callable, return_dtype: Any = None) -> Callable:
    """Run ``fn`` in float32, even inside :func:`jaxamp.amp` (mpx's name).

    Floating array inputs are cast to float32 on entry and the body is marked
    ``amp_stop``, so amp leaves it in the traced (float32) dtypes. With
    ``return_dtype``, every float leaf of the result is cast to it, as mpx's
    ``force_full_precision(fn, x.dtype)`` does (``mpx/_cast.py``).

    Unlike mpx, whose ``return_dtype`` defaults to float16, the outputs keep
    the dtypes ``fn`` computed (float32) when ``return_dtype`` is not given:
    pass ``jnp.float16`` for mpx's default.

    Args:
        fn: any function of pytrees.
        return_dtype: None (outputs as computed) or a float dtype or name for
            the outputs.

    Returns:
        The wrapped function.

    Raises:
        TypeError: if ``fn`` is not callable.
        ValueError: if ``return_dtype`` is not a float dtype.

    Warns:
        UserWarning: as :func:`jaxamp.migration.mpx.cast_function`, when
        ``return_dtype`` is
            given and the result is neither a tuple nor an array.
    """
    if not callable(fn):
        raise TypeError(
            f"force_full_precision(fn): fn must be callable, got {type(fn).__name__}."
        )
    out_dtype = (
        None
        if return_dtype is None
        else canonical_dtype(return_dtype, argname="return_dtype")
    )

    @functools.wraps(fn)
    def full(*args, **kwargs):
        args, kwargs = cast_to_full_precision((args, kwargs))
        with jax.named_scope(_AMP_STOP):
            out = fn(*args, **kwargs)
            if out_dtype is not None:
                out = _cast_outputs(out, out_dtype, "force_full_precision")
            return out

    return full


def mpx_force_full_precision(
    func: Callable, return_dtype: Any = jnp.float16
) -> Callable:
    """mpx's ``force_full_precision`` (``mpx/_cast.py``): ``func`` runs in
    float32 and its float outputs are cast to ``return_dtype``, float16 by
    default as in mpx (``jaxamp.migration.mpx.force_full_precision``).

    :func:`jaxamp.migration.mpx.force_full_precision` is the same with outputs left in
    float32 unless ``return_dtype`` is given.

    Args:
        func: any function of pytrees.
        return_dtype: float dtype or name for the outputs (default float16).

    Returns:
        The wrapped function.

    Raises:
        TypeError: if ``func`` is not callable.
        ValueError: if ``return_dtype`` is not a float dtype.
    """
    return force_full_precision(func, return_dtype)


@_register
class DynamicLossScaling(DynamicScalerState):
    """mpx's ``DynamicLossScaling`` (``mpx/_loss_scaling.py``) as a
    :class:`jaxamp.DynamicScalerState`.

    A :class:`~jaxamp.DynamicScalerState` with mpx's constructor and attribute
    names: ``patience = period - 1`` (mpx grows the scale on the ``period``-th
    consecutive finite step, jaxamp after ``patience`` counted ones: the same
    steps), ``adjust_factor = factor``, ``max_scaler`` = float16's largest
    value (mpx clips there on every adjust). It is accepted wherever a scaler
    state is (``dynamic_scale_*``, :func:`filter_grad`), and ``adjust`` returns
    a ``DynamicLossScaling``.

    Differences from mpx: ``scale`` multiplies each float leaf in its own dtype
    (mpx multiplies by a float16 copy of the scale, which promotes bfloat16
    losses to float32), non-float leaves are left alone, and ``unscale``
    divides in float32 instead of multiplying by the rounded reciprocal.

    Args:
        loss_scaling: scalar; the initial scale (mpx's examples start at
            float16's largest value, ``jnp.finfo(jnp.float16).max``).
        min_loss_scaling: scalar > 0; the lower bound of the scale.
        factor: > 1; the scale is multiplied / divided by it (default 2).
        period: int >= 1; consecutive finite steps until the scale grows
            (default 2000).
        counter: int32 scalar; finite steps counted so far (default 0).

    Raises:
        ValueError: as :class:`~jaxamp.DynamicScalerState` (non-positive or
            non-finite scale, ``min_loss_scaling`` above float16's largest
            value, ``factor <= 1``, a non-scalar), or ``period < 1``.
    """

    __slots__ = ()

    def __new__(
        cls,
        loss_scaling: Any,
        min_loss_scaling: Any,
        factor: Any = 2,
        period: Any = 2000,
        counter: Any = None,
    ) -> DynamicLossScaling:
        _validate(
            "DynamicLossScaling", "period", period, lambda v: v >= 1, "must be >= 1"
        )
        return super().__new__(
            cls,
            patience=period - 1,
            adjust_factor=factor,
            scaler=loss_scaling,
            count=0 if counter is None else counter,
            min_scaler=min_loss_scaling,
            max_scaler=FLOAT16_MAX,
        )

    @property
    def loss_scaling(self) -> jax.Array:
        """float32 scalar: the current scale (``scaler``)."""
        return self.scaler

    @property
    def min_loss_scaling(self) -> jax.Array:
        """float32 scalar: the lower bound (``min_scaler``)."""
        return self.min_scaler

    @property
    def counter(self) -> jax.Array:
        """int32 scalar: finite steps since the scale last changed (``count``)."""
        return self.count

    @property
    def factor(self) -> jax.Array:
        """float32 scalar: the adjustment factor (``adjust_factor``)."""
        return self.adjust_factor

    @property
    def period(self) -> jax.Array:
        """int32 scalar: ``patience + 1``."""
        return self.patience + 1


ScalerState = DynamicScalerState | StaticScalerState


def _check_scaling(caller: str, scaling: Any) -> None:
    if not isinstance(scaling, (DynamicScalerState, StaticScalerState)):
        raise TypeError(
            f"{caller}: scaling must be a jaxamp.migration.mpx.DynamicLossScaling, "
            "DynamicScalerState or StaticScalerState, got "
            f"{type(scaling).__name__}; e.g. jaxamp.migration.mpx.DynamicLossScaling("
            "loss_scaling=jnp.float32(2**15), min_loss_scaling=jnp.float32(1))."
        )


def scaled(func: Callable, scaling: ScalerState, has_aux: bool = False) -> Callable:
    """``func`` with its loss multiplied by the loss scale (mpx's ``scaled``,
    ``mpx/_loss_scaling.py``).

    Args:
        func: returns a loss (float array, any dtype), or ``(loss, aux)`` with
            ``has_aux``.
        scaling: a :class:`DynamicLossScaling` or any jaxamp scaler state; its
            ``scale`` multiplies the float array leaves of the loss in their
            own dtype.
        has_aux: whether ``func`` returns ``(loss, aux)``; only the loss is
            scaled.

    Returns:
        The wrapped function.

    Raises:
        TypeError: if ``func`` is not callable or ``scaling`` is no scaler
            state.
    """
    if not callable(func):
        raise TypeError(
            f"scaled(func): func must be callable, got {type(func).__name__}."
        )
    _check_scaling("scaled", scaling)

    @functools.wraps(func)
    def scaled_func(*args, **kwargs):
        out = func(*args, **kwargs)
        if has_aux:
            value, aux = out
            return scaling.scale(value), aux
        return scaling.scale(out)

    return scaled_func


def filter_grad(
    func: Callable,
    scaling: ScalerState | None,
    has_aux: bool = False,
    use_mixed_precision: bool = True,
) -> Callable:
    """Loss-scaled ``eqx.filter_grad`` with mpx's call shape and results
    (``mpx/_grad_tools.py``), on :func:`jaxamp.training.dynamic_scale_grad`.

    With ``use_mixed_precision``, the float arguments are cast to the
    half-precision dtype (:func:`jaxamp.migration.mpx.set_half_precision_datatype`,
    float16
    by default), the loss is scaled, the gradients of the first argument's
    inexact arrays are unscaled in float32 **by the scale that produced them**
    (mpx divides by the adjusted scale, which halves the gradients on every
    step where the scale grows) and the state adjusts. Without it, nothing is
    cast or scaled and ``grads_finite`` is True, as in mpx.

    Args:
        func: ``func(model, *args, **kwargs)`` returning a float scalar loss,
            or ``(loss, aux)`` with ``has_aux``.
        scaling: a :class:`DynamicLossScaling` or any jaxamp scaler state
            (may be None when ``use_mixed_precision`` is False).
        has_aux: whether ``func`` returns ``(loss, aux)``.
        use_mixed_precision: cast to half precision and scale the loss.

    Returns:
        ``g(*args, **kwargs)`` returning ``(new_scaling, grads_finite, grads)``,
        or ``(new_scaling, grads_finite, grads, aux)`` with ``has_aux``;
        ``grads_finite`` is a bool scalar, ``grads`` float32 (without mixed
        precision and with ``has_aux``, the parameters' dtype, as mpx).

    Raises:
        TypeError: if ``func`` is not callable or ``scaling`` is no scaler
            state (with ``use_mixed_precision``).
    """
    if not use_mixed_precision:
        grad_fn = eqx.filter_grad(func, has_aux=has_aux)

        def plain(*args, **kwargs):
            res = grad_fn(*args, **kwargs)
            if has_aux:
                return scaling, jnp.asarray(True), res[0], res[1]
            return scaling, jnp.asarray(True), cast_to_full_precision(res)

        return plain
    _check_scaling("filter_grad", scaling)
    grad_fn = dynamic_scale_grad(func, has_aux=has_aux)

    def scaled_grad(*args, **kwargs):
        args, kwargs = cast_to_half_precision((args, kwargs))
        state, res = grad_fn(*args, dynamic_scaler_state=scaling, **kwargs)
        grads, aux = res if has_aux else (res, None)
        finite = all_finite(grads)
        return (state, finite, grads, aux) if has_aux else (state, finite, grads)

    return scaled_grad


def filter_value_and_grad(
    func: Callable,
    scaling: ScalerState | None,
    has_aux: bool = False,
    use_mixed_precision: bool = True,
) -> Callable:
    """Loss-scaled ``eqx.filter_value_and_grad`` with mpx's call shape and
    results (``mpx/_grad_tools.py``), on
    :func:`jaxamp.dynamic_scale_value_and_grad`.

    As :func:`filter_grad`; the value (the true loss) is unscaled in float32
    by the scale that produced it, as the gradients are.

    Args:
        func, scaling, has_aux, use_mixed_precision: as :func:`filter_grad`.

    Returns:
        ``g(*args, **kwargs)`` returning ``(value, new_scaling, grads_finite,
        grads)``, or ``((value, aux), new_scaling, grads_finite, grads)`` with
        ``has_aux``. Without mixed precision, value and gradients are as
        ``eqx.filter_value_and_grad`` returns them.

    Raises:
        TypeError: as :func:`filter_grad`.
    """
    if not use_mixed_precision:
        vg_fn = eqx.filter_value_and_grad(func, has_aux=has_aux)

        def plain(*args, **kwargs):
            value, grads = vg_fn(*args, **kwargs)
            return value, scaling, jnp.asarray(True), grads

        return plain
    _check_scaling("filter_value_and_grad", scaling)
    vg_fn = dynamic_scale_value_and_grad(func, has_aux=has_aux)

    def scaled_value_and_grad(*args, **kwargs):
        args, kwargs = cast_to_half_precision((args, kwargs))
        state, (value, grads) = vg_fn(*args, dynamic_scaler_state=scaling, **kwargs)
        return value, state, all_finite(grads), grads

    return scaled_value_and_grad
