"""mpx's names (``import mpx``, mixed-precision-for-jax 0.1.8).

``from jaxamp.migration import mpx`` ports mpx code with one import change:
casts, ``force_full_precision`` (outputs in float16 by default, as mpx),
``DynamicLossScaling``, ``filter_grad``, ``filter_value_and_grad``,
``optimizer_update``, ... (``docs/migration.md``, "mpx -> jaxamp"); also
jaxamp's spellings ``set_half_precision_dtype`` and ``half_precision_dtype``.
"""

from .._training._optax import all_finite as all_finite
from .._training._optax import optimizer_update as optimizer_update
from .._training._optax import select_tree as select_tree
from ._jmp import cast_to_bfloat16 as cast_to_bfloat16
from ._jmp import cast_to_float16 as cast_to_float16
from ._jmp import cast_to_float32 as cast_to_float32
from ._jmp import cast_to_full_precision as cast_to_full_precision
from ._jmp import cast_to_half_precision as cast_to_half_precision
from ._jmp import cast_tree as cast_tree
from ._jmp import half_precision_datatype as half_precision_datatype
from ._jmp import half_precision_dtype as half_precision_dtype
from ._jmp import set_half_precision_datatype as set_half_precision_datatype
from ._jmp import set_half_precision_dtype as set_half_precision_dtype
from ._mpx import FLOAT16_MAX as FLOAT16_MAX
from ._mpx import DynamicLossScaling as DynamicLossScaling
from ._mpx import cast_function as cast_function
from ._mpx import filter_grad as filter_grad
from ._mpx import filter_value_and_grad as filter_value_and_grad
from ._mpx import mpx_force_full_precision as force_full_precision
from ._mpx import scaled as scaled

__all__ = (
    "DynamicLossScaling",
    "FLOAT16_MAX",
    "all_finite",
    "cast_function",
    "cast_to_bfloat16",
    "cast_to_float16",
    "cast_to_float32",
    "cast_to_full_precision",
    "cast_to_half_precision",
    "cast_tree",
    "filter_grad",
    "filter_value_and_grad",
    "force_full_precision",
    "half_precision_datatype",
    "half_precision_dtype",
    "optimizer_update",
    "scaled",
    "select_tree",
    "set_half_precision_datatype",
    "set_half_precision_dtype",
)
