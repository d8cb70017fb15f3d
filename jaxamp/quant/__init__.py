"""8-bit matmuls and formats: FP8 and int8 recipes, their policies, rules and
products, and the registry of 8-bit formats.

``fp8_policy``, ``int8_policy`` and the ready-made ``fp8_amp_policy`` /
``int8_amp_policy`` are also at the top level.
"""

from .._base._formats import register_format as register_format
from .._base._formats import unregister_format as unregister_format
from .._quant._common import min_matmul_size as min_matmul_size
from .._quant._common import torchao_rowwise_size_rule as torchao_rowwise_size_rule
from .._quant._common import (
    torchao_tensorwise_size_rule as torchao_tensorwise_size_rule,
)
from .._quant._fp8 import fp8_amp_policy as fp8_amp_policy
from .._quant._fp8 import fp8_dot_general as fp8_dot_general
from .._quant._fp8 import fp8_policy as fp8_policy
from .._quant._fp8 import fp8_rule as fp8_rule
from .._quant._fp8 import quantize as quantize
from .._quant._int8 import int8_amp_policy as int8_amp_policy
from .._quant._int8 import int8_dot_general as int8_dot_general
from .._quant._int8 import int8_policy as int8_policy
from .._quant._int8 import int8_quantize as int8_quantize
from .._quant._int8 import int8_rule as int8_rule

__all__ = (
    "fp8_amp_policy",
    "fp8_dot_general",
    "fp8_policy",
    "fp8_rule",
    "int8_amp_policy",
    "int8_dot_general",
    "int8_policy",
    "int8_quantize",
    "int8_rule",
    "min_matmul_size",
    "quantize",
    "register_format",
    "torchao_rowwise_size_rule",
    "torchao_tensorwise_size_rule",
    "unregister_format",
)
