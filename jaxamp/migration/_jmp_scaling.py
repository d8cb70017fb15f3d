"""jmp's loss scales (``jmp/_src/loss_scale.py``, commit 9c1cdbbf78da) as
jaxamp scaler states, so ``from jaxamp.migration import jmp`` ports jmp code.

Each class is a :class:`jaxamp.DynamicScalerState` or
:class:`jaxamp.StaticScalerState` with jmp's constructor and attribute names:
it is accepted wherever a scaler state is (``jaxamp.dynamic_scale_*``,
``jaxamp.skip_nonfinite_updates``), and ``scale`` / ``unscale`` / ``adjust``
keep jmp's meaning.
"""

from __future__ import annotations

from typing import Any

import jax

from .._training._scaler import DynamicScalerState, StaticScalerState, _register
from .._training._scaler_checks import _validate


@_register
class DynamicLossScale(DynamicScalerState):
    """jmp's ``DynamicLossScale``: the scale halves on a non-finite step and
    doubles after ``period`` finite ones.

    ``patience = period - 1`` (jmp grows on the ``period``-th consecutive
    finite step, jaxamp after ``patience`` counted ones: the same steps),
    ``adjust_factor = factor``. Differences from jmp: growth stops at
    ``max_scaler`` (2**24, :class:`jaxamp.DynamicScalerState`'s default), and
    ``unscale`` divides in float32.

    Args:
        loss_scale: scalar > 0; the initial scale (jmp's examples: 2**15).
        counter: int32 scalar; finite steps counted so far (default 0).
        period: int >= 1; consecutive finite steps until the scale grows
            (default 2000).
        factor: > 1; the scale is multiplied / divided by it (default 2).
        min_loss_scale: scalar > 0; the lower bound (default 1).

    Raises:
        ValueError: as :class:`jaxamp.DynamicScalerState`, or ``period < 1``.
    """

    __slots__ = ()

    def __new__(
        cls,
        loss_scale: Any,
        counter: Any = None,
        period: Any = 2000,
        factor: Any = 2,
        min_loss_scale: Any = 1.0,
    ) -> DynamicLossScale:
        _validate(
            "DynamicLossScale", "period", period, lambda v: v >= 1, "must be >= 1"
        )
        return super().__new__(
            cls,
            patience=period - 1,
            adjust_factor=factor,
            scaler=loss_scale,
            count=0 if counter is None else counter,
            min_scaler=min_loss_scale,
        )

    @property
    def loss_scale(self) -> jax.Array:
        """float32 scalar: the current scale (``scaler``)."""
        return self.scaler

    @property
    def counter(self) -> jax.Array:
        """int32 scalar: finite steps since the scale last changed (``count``)."""
        return self.count

    @property
    def period(self) -> jax.Array:
        """int32 scalar: ``patience + 1``."""
        return self.patience + 1

    @property
    def factor(self) -> jax.Array:
        """float32 scalar: the adjustment factor (``adjust_factor``)."""
        return self.adjust_factor

    @property
    def min_loss_scale(self) -> jax.Array:
        """float32 scalar: the lower bound (``min_scaler``)."""
        return self.min_scaler


@_register
class StaticLossScale(StaticScalerState):
    """jmp's ``StaticLossScale``: a fixed scale.

    Args:
        loss_scale: scalar > 0; the scale.

    Raises:
        ValueError: if ``loss_scale`` is not positive and finite.
    """

    __slots__ = ()

    def __new__(cls, loss_scale: Any) -> StaticLossScale:
        return super().__new__(cls, loss_scale)

    @property
    def loss_scale(self) -> jax.Array:
        """float32 scalar: the scale (``scaler``)."""
        return self.scaler


@_register
class NoOpLossScale(StaticScalerState):
    """jmp's ``NoOpLossScale``: scale 1, nothing changes (the bfloat16 case)."""

    __slots__ = ()

    def __new__(cls) -> NoOpLossScale:
        return super().__new__(cls, 1.0)

    @property
    def loss_scale(self) -> jax.Array:
        """float32 scalar: 1."""
        return self.scaler
