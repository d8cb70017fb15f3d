"""8-bit matmuls: FP8 and int8 recipes, their policies, rules and products.

``fp8_policy``, ``int8_policy``, the ready-made ``fp8_amp_policy`` /
``int8_amp_policy`` and ``eight_bit_policy`` (the format that pays on the
device) are also at the top level. The registry of 8-bit formats
is in :mod:`jaxamp.extend`; the FP8 quantizer is :func:`fp8_quantize` (the old
spellings are served here for one release with a ``DeprecationWarning``,
:data:`_MOVED`).
"""

from .._base._moved import moved_names as _moved_names
from .._quant._choice import EightBitChoice as EightBitChoice
from .._quant._choice import eight_bit_choice as eight_bit_choice
from .._quant._choice import eight_bit_policy as eight_bit_policy
from .._quant._common import min_matmul_size as min_matmul_size
from .._quant._common import torchao_rowwise_size_rule as torchao_rowwise_size_rule
from .._quant._common import (
    torchao_tensorwise_size_rule as torchao_tensorwise_size_rule,
)
from .._quant._fp8 import fp8_amp_policy as fp8_amp_policy
from .._quant._fp8 import fp8_dot_general as fp8_dot_general
from .._quant._fp8 import fp8_policy as fp8_policy
from .._quant._fp8 import fp8_quantize as fp8_quantize
from .._quant._fp8 import fp8_rule as fp8_rule
from .._quant._int8 import Int8Recipe as Int8Recipe
from .._quant._int8 import int8_amp_policy as int8_amp_policy
from .._quant._int8 import int8_dot_general as int8_dot_general
from .._quant._int8 import int8_policy as int8_policy
from .._quant._int8 import int8_quantize as int8_quantize
from .._quant._int8 import int8_rule as int8_rule

# Names served from here for one release: name -> its spelling now. One
# quantize spelling per format family: fp8_quantize, int8_quantize.
_MOVED = {
    "quantize": "jaxamp.quant.fp8_quantize",
    "register_format": "jaxamp.extend.register_format",
    "unregister_format": "jaxamp.extend.unregister_format",
}


__getattr__ = _moved_names("jaxamp.quant", _MOVED)


__all__ = (
    "EightBitChoice",
    "Int8Recipe",
    "eight_bit_choice",
    "eight_bit_policy",
    "fp8_amp_policy",
    "fp8_dot_general",
    "fp8_policy",
    "fp8_quantize",
    "fp8_rule",
    "int8_amp_policy",
    "int8_dot_general",
    "int8_policy",
    "int8_quantize",
    "int8_rule",
    "min_matmul_size",
    "torchao_rowwise_size_rule",
    "torchao_tensorwise_size_rule",
)
