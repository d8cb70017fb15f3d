"""Training: loss scaling, non-finite steps, low-precision optimizer state and
the update inside the backward pass.

The names a training loop calls most (``DynamicScalerState``,
``StaticScalerState``, ``dynamic_scale_value_and_grad``, ``all_finite``,
``skip_nonfinite_updates``, ``low_precision_optimizer``, ``optimizer_update``,
``update_in_backward``) are also at the top level.
"""

from .._training._factored import layerwise_adafactor as layerwise_adafactor
from .._training._in_backward import update_in_backward as update_in_backward
from .._training._low_precision import LowPrecisionState as LowPrecisionState
from .._training._low_precision import (
    low_precision_optimizer as low_precision_optimizer,
)
from .._training._optax import SkipNonFiniteState as SkipNonFiniteState
from .._training._optax import all_finite as all_finite
from .._training._optax import optimizer_update as optimizer_update
from .._training._optax import select_tree as select_tree
from .._training._optax import skip_nonfinite_updates as skip_nonfinite_updates
from .._training._scaler import DynamicScalerState as DynamicScalerState
from .._training._scaler import StaticScalerState as StaticScalerState
from .._training._scaler import dynamic_scale_grad as dynamic_scale_grad
from .._training._scaler import dynamic_scale_tx as dynamic_scale_tx
from .._training._scaler import (
    dynamic_scale_value_and_grad as dynamic_scale_value_and_grad,
)

__all__ = (
    "DynamicScalerState",
    "LowPrecisionState",
    "SkipNonFiniteState",
    "StaticScalerState",
    "all_finite",
    "dynamic_scale_grad",
    "dynamic_scale_tx",
    "dynamic_scale_value_and_grad",
    "layerwise_adafactor",
    "low_precision_optimizer",
    "optimizer_update",
    "select_tree",
    "skip_nonfinite_updates",
    "update_in_backward",
)
