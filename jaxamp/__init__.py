"""jaxamp: automatic mixed precision for JAX.

``jaxamp.amp(loss_fn)`` rewrites every equation of ``loss_fn``'s jaxpr, including
those inside ``jit``, ``scan``, ``while``, ``cond``, ``remat``, ``custom_jvp``,
``custom_vjp`` and ``shard_map``, so that matmuls run in a low compute dtype and
numerically fragile operations stay in float32. Loss scaling and optax
integration complete the training story.
"""

from . import _compat
from . import compat as compat
from ._amp import amp as amp
from ._amp import amp_stop as amp_stop
from ._base._ambient_policy import current_policy as current_policy
from ._base._ambient_policy import policy_compute_dtype as policy_compute_dtype
from ._policy._kinds import CarryRule as CarryRule
from ._policy._kinds import CastRule as CastRule
from ._policy._kinds import ImplementationRule as ImplementationRule
from ._policy._kinds import ResidualRule as ResidualRule
from ._policy._kinds import ScopePolicy as ScopePolicy
from ._policy._residuals import residual_rule as residual_rule
from ._policy._rules import default_amp_policy as default_amp_policy
from ._policy._rules import follow_compute_precision as follow_compute_precision
from ._policy._rules import keep_current_precision as keep_current_precision
from ._policy._rules import use_compute_precision as use_compute_precision
from ._policy._rules import use_full_precision as use_full_precision
from ._policy._rules import use_lower_precision as use_lower_precision
from ._policy._rules import use_original_precision as use_original_precision
from ._policy._rules import use_precision as use_precision
from ._policy._rules import use_range_safe_precision as use_range_safe_precision
from ._policy._rules import use_widest_precision as use_widest_precision
from ._quant._common import min_matmul_size as min_matmul_size
from ._quant._common import torchao_rowwise_size_rule as torchao_rowwise_size_rule
from ._quant._common import torchao_tensorwise_size_rule as torchao_tensorwise_size_rule
from ._quant._fp8 import fp8_amp_policy as fp8_amp_policy
from ._quant._fp8 import fp8_dot_general as fp8_dot_general
from ._quant._fp8 import fp8_policy as fp8_policy
from ._quant._fp8 import fp8_rule as fp8_rule
from ._quant._fp8 import quantize as quantize
from ._quant._int8 import int8_amp_policy as int8_amp_policy
from ._quant._int8 import int8_dot_general as int8_dot_general
from ._quant._int8 import int8_policy as int8_policy
from ._quant._int8 import int8_quantize as int8_quantize
from ._quant._int8 import int8_rule as int8_rule
from ._rewrites._attention import AttentionRule as AttentionRule
from ._rewrites._attention import attention_rule as attention_rule
from ._tools._find_overflows import Overflow as Overflow
from ._tools._find_overflows import find_overflows as find_overflows
from ._tools._measure import count_primitive as count_primitive
from ._tools._measure import iter_equations as iter_equations
from ._tools._measure import low_precision_flop_share as low_precision_flop_share
from ._tools._measure import matmul_flops_by_dtype as matmul_flops_by_dtype
from ._tools._measure import primitive_dtypes as primitive_dtypes
from ._tools._measure import saved_residual_bytes as saved_residual_bytes
from ._tools._memory_report import MemoryReport as MemoryReport
from ._tools._memory_report import MemoryRow as MemoryRow
from ._tools._memory_report import memory_report as memory_report
from ._tools._precision_report import PrecisionReport as PrecisionReport
from ._tools._precision_report import precision_report as precision_report
from ._tools._quant_report import MatmulRecord as MatmulRecord
from ._tools._quant_report import eight_bit_flop_share as eight_bit_flop_share
from ._tools._quant_report import quantization_report as quantization_report
from ._training._in_backward import update_in_backward as update_in_backward
from ._training._low_precision import LowPrecisionState as LowPrecisionState
from ._training._low_precision import (
    low_precision_optimizer as low_precision_optimizer,
)
from ._training._optax import SkipNonFiniteState as SkipNonFiniteState
from ._training._optax import all_finite as all_finite
from ._training._optax import optimizer_update as optimizer_update
from ._training._optax import select_tree as select_tree
from ._training._optax import skip_nonfinite_updates as skip_nonfinite_updates
from ._training._scaler import DynamicScalerState as DynamicScalerState
from ._training._scaler import StaticScalerState as StaticScalerState
from ._training._scaler import dynamic_scale_grad as dynamic_scale_grad
from ._training._scaler import dynamic_scale_tx as dynamic_scale_tx
from ._training._scaler import (
    dynamic_scale_value_and_grad as dynamic_scale_value_and_grad,
)
from ._walk._higher_order import register_higher_order as register_higher_order
from .compat._haliax import DTypeish as DTypeish
from .compat._haliax import SemanticDType as SemanticDType
from .compat._haliax import cast_floating as cast_floating
from .compat._haliax import mixed_precision as mixed_precision
from .compat._haliax import resolve_dtype as resolve_dtype
from .compat._jmp import Policy as Policy
from .compat._jmp import cast_to_bfloat16 as cast_to_bfloat16
from .compat._jmp import cast_to_float16 as cast_to_float16
from .compat._jmp import cast_to_float32 as cast_to_float32
from .compat._jmp import cast_to_full as cast_to_full
from .compat._jmp import cast_to_full_precision as cast_to_full_precision
from .compat._jmp import cast_to_half as cast_to_half
from .compat._jmp import cast_to_half_precision as cast_to_half_precision
from .compat._jmp import cast_tree as cast_tree
from .compat._jmp import get_policy as get_policy
from .compat._jmp import half_dtype as half_dtype
from .compat._jmp import half_precision_datatype as half_precision_datatype
from .compat._jmp import half_precision_dtype as half_precision_dtype
from .compat._jmp import set_half_precision_datatype as set_half_precision_datatype
from .compat._jmp import set_half_precision_dtype as set_half_precision_dtype
from .compat._mpx import DynamicLossScaling as DynamicLossScaling
from .compat._mpx import cast_function as cast_function
from .compat._mpx import filter_grad as filter_grad
from .compat._mpx import filter_value_and_grad as filter_value_and_grad
from .compat._mpx import force_full_precision as force_full_precision
from .compat._mpx import scaled as scaled

__version__ = "0.1.0"

# The core names. The jmp, mpx and Haliax names imported above stay importable
# from ``jaxamp`` for code written against it; their home is
# ``jaxamp.compat.{jmp,mpx,haliax}``.
_compat.warn_untested_jax()  # once, at import: a JAX newer than tested

__all__ = (
    "AttentionRule",
    "CarryRule",
    "CastRule",
    "DynamicScalerState",
    "ImplementationRule",
    "LowPrecisionState",
    "MatmulRecord",
    "MemoryReport",
    "MemoryRow",
    "Overflow",
    "PrecisionReport",
    "ResidualRule",
    "ScopePolicy",
    "SkipNonFiniteState",
    "StaticScalerState",
    "all_finite",
    "amp",
    "amp_stop",
    "attention_rule",
    "compat",
    "count_primitive",
    "default_amp_policy",
    "dynamic_scale_grad",
    "dynamic_scale_tx",
    "dynamic_scale_value_and_grad",
    "eight_bit_flop_share",
    "find_overflows",
    "follow_compute_precision",
    "fp8_amp_policy",
    "fp8_dot_general",
    "fp8_policy",
    "fp8_rule",
    "int8_amp_policy",
    "int8_dot_general",
    "int8_policy",
    "int8_quantize",
    "int8_rule",
    "iter_equations",
    "keep_current_precision",
    "low_precision_flop_share",
    "low_precision_optimizer",
    "matmul_flops_by_dtype",
    "memory_report",
    "min_matmul_size",
    "optimizer_update",
    "precision_report",
    "primitive_dtypes",
    "quantization_report",
    "quantize",
    "register_higher_order",
    "residual_rule",
    "saved_residual_bytes",
    "select_tree",
    "skip_nonfinite_updates",
    "torchao_rowwise_size_rule",
    "torchao_tensorwise_size_rule",
    "update_in_backward",
    "use_compute_precision",
    "use_full_precision",
    "use_lower_precision",
    "use_original_precision",
    "use_precision",
    "use_range_safe_precision",
    "use_widest_precision",
)
