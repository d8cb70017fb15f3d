"""jaxamp: automatic mixed precision for JAX.

``jaxamp.amp(loss_fn)`` rewrites every equation of ``loss_fn``'s jaxpr, including
those inside ``jit``, ``scan``, ``while``, ``cond``, ``remat``, ``custom_jvp``,
``custom_vjp`` and ``shard_map``, so that matmuls run in a low compute dtype and
numerically fragile operations stay in float32. Loss scaling and optax
integration complete the training story.

The top level holds what a training script calls; the rest is grouped:
:mod:`jaxamp.rules` (rules and policy values), :mod:`jaxamp.quant` (8-bit
matmuls and formats), :mod:`jaxamp.training` (loss scaling, optimizer state),
:mod:`jaxamp.tools` (reports and counters), :mod:`jaxamp.extend` (the
registries of higher-order primitives and 8-bit formats, and the types they
take: the extension API) and :mod:`jaxamp.migration` (jmp's, mpx's and
Haliax's names). A name that moved there from the top level is
served from here for one release with a ``DeprecationWarning`` naming its new
place (:data:`_MOVED`).
"""

import importlib as _importlib
import warnings as _warnings

# The walk's built-in higher-order registrations (scan's carry rule) precede
# the policies that copy the default table (jaxamp.quant's ready-made ones).
from . import (
    _compat,
    _walk,  # noqa: F401
)
from . import extend as extend
from . import migration as migration
from . import quant as quant
from . import rules as rules
from . import tools as tools
from . import training as training
from ._amp import amp as amp
from ._amp import amp_stop as amp_stop
from ._base._moved import moved_names as _moved_names
from .quant import eight_bit_policy as eight_bit_policy
from .quant import fp8_amp_policy as fp8_amp_policy
from .quant import fp8_policy as fp8_policy
from .quant import int8_amp_policy as int8_amp_policy
from .quant import int8_policy as int8_policy
from .rules import ScopePolicy as ScopePolicy
from .rules import attention_rule as attention_rule
from .rules import default_amp_policy as default_amp_policy
from .rules import residual_rule as residual_rule
from .rules import use_compute_precision as use_compute_precision
from .rules import use_full_precision as use_full_precision
from .rules import use_original_precision as use_original_precision
from .tools import find_overflows as find_overflows
from .tools import memory_report as memory_report
from .tools import precision_report as precision_report
from .tools import quantization_report as quantization_report
from .tools import saved_residual_bytes as saved_residual_bytes
from .training import DynamicScalerState as DynamicScalerState
from .training import StaticScalerState as StaticScalerState
from .training import all_finite as all_finite
from .training import dynamic_scale_value_and_grad as dynamic_scale_value_and_grad
from .training import low_precision_optimizer as low_precision_optimizer
from .training import optimizer_update as optimizer_update
from .training import skip_nonfinite_updates as skip_nonfinite_updates
from .training import update_in_backward as update_in_backward

__version__ = "0.1.0"

_compat.warn_untested_jax()  # once, at import: a JAX newer than tested


def _moved(home: str, names: str) -> dict[str, str]:
    return {name: home for name in names.split()}


# Names served from the top level for one release: name -> the module that
# holds it now (``jaxamp.<home>.<name>``).
_MOVED = {
    **_moved(
        "rules",
        """AttentionRule CarryRule CastRule ImplementationRule ResidualRule
        follow_compute_precision keep_current_precision use_lower_precision
        use_precision use_range_safe_precision use_widest_precision""",
    ),
    **_moved(
        "quant",
        """fp8_dot_general fp8_rule int8_dot_general int8_quantize int8_rule
        min_matmul_size torchao_rowwise_size_rule
        torchao_tensorwise_size_rule""",
    ),
    **_moved("extend", "register_format register_higher_order"),
    **_moved(
        "training",
        "LowPrecisionState SkipNonFiniteState dynamic_scale_grad dynamic_scale_tx "
        "select_tree",
    ),
    **_moved(
        "tools",
        """MatmulRecord MemoryReport MemoryRow Overflow PrecisionReport
        count_primitive eight_bit_flop_share iter_equations low_precision_flop_share
        matmul_flops_by_dtype primitive_dtypes""",
    ),
    **_moved(
        "migration.haliax",
        """DTypeish SemanticDType cast_floating current_policy mixed_precision
        policy_compute_dtype resolve_dtype""",
    ),
    **_moved("migration.jmp", "Policy cast_to_full cast_to_half get_policy half_dtype"),
    **_moved(
        "migration.mpx",
        """DynamicLossScaling cast_function cast_to_bfloat16 cast_to_float16
        cast_to_float32 cast_to_full_precision cast_to_half_precision cast_tree
        filter_grad filter_value_and_grad half_precision_datatype
        half_precision_dtype scaled set_half_precision_datatype
        set_half_precision_dtype""",
    ),
}


# Names served from the top level for one release under a new name:
# name -> its spelling now.
_RENAMED = {"quantize": "jaxamp.quant.fp8_quantize"}


def __getattr__(name: str):
    if name == "force_full_precision":  # float32 outputs; mpx's are float16
        _warnings.warn(
            "jaxamp.force_full_precision is deprecated: use jaxamp.amp_stop to keep "
            "amp's casts out of a function, or jaxamp.migration.mpx."
            "force_full_precision (mpx's, outputs in float16 unless return_dtype).",
            DeprecationWarning,
            stacklevel=2,
        )
        return _importlib.import_module("jaxamp.migration._mpx").force_full_precision
    if name == "compat":  # the deprecated package of jaxamp.migration's names
        return _importlib.import_module("jaxamp.compat")
    return _moved_getattr(name)


# Every moved or renamed name: its spelling now.
_moved_getattr = _moved_names(
    "jaxamp",
    {**{n: f"jaxamp.{home}.{n}" for n, home in _MOVED.items()}, **_RENAMED},
    stacklevel=3,
)


__all__ = (
    "DynamicScalerState",
    "ScopePolicy",
    "StaticScalerState",
    "all_finite",
    "amp",
    "amp_stop",
    "attention_rule",
    "default_amp_policy",
    "dynamic_scale_value_and_grad",
    "eight_bit_policy",
    "extend",
    "find_overflows",
    "fp8_amp_policy",
    "fp8_policy",
    "int8_amp_policy",
    "int8_policy",
    "low_precision_optimizer",
    "memory_report",
    "migration",
    "optimizer_update",
    "precision_report",
    "quant",
    "quantization_report",
    "residual_rule",
    "rules",
    "saved_residual_bytes",
    "skip_nonfinite_updates",
    "tools",
    "training",
    "update_in_backward",
    "use_compute_precision",
    "use_full_precision",
    "use_original_precision",
)
