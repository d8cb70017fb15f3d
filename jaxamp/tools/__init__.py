"""Tools: what amp did to a function, measured.

Reports (``precision_report``, ``memory_report``, ``quantization_report``,
``find_overflows``; also at the top level with ``saved_residual_bytes``) and
the counters the benchmarks and tests read from a jaxpr.
"""

from .._tools._find_overflows import Overflow as Overflow
from .._tools._find_overflows import find_overflows as find_overflows
from .._tools._measure import count_primitive as count_primitive
from .._tools._measure import iter_equations as iter_equations
from .._tools._measure import low_precision_flop_share as low_precision_flop_share
from .._tools._measure import matmul_flops_by_dtype as matmul_flops_by_dtype
from .._tools._measure import primitive_dtypes as primitive_dtypes
from .._tools._measure import saved_residual_bytes as saved_residual_bytes
from .._tools._memory_report import MemoryReport as MemoryReport
from .._tools._memory_report import MemoryRow as MemoryRow
from .._tools._memory_report import memory_report as memory_report
from .._tools._precision_report import PrecisionReport as PrecisionReport
from .._tools._precision_report import precision_report as precision_report
from .._tools._quant_report import MatmulRecord as MatmulRecord
from .._tools._quant_report import eight_bit_flop_share as eight_bit_flop_share
from .._tools._quant_report import quantization_report as quantization_report

__all__ = (
    "MatmulRecord",
    "MemoryReport",
    "MemoryRow",
    "Overflow",
    "PrecisionReport",
    "count_primitive",
    "eight_bit_flop_share",
    "find_overflows",
    "iter_equations",
    "low_precision_flop_share",
    "matmul_flops_by_dtype",
    "memory_report",
    "precision_report",
    "primitive_dtypes",
    "quantization_report",
    "saved_residual_bytes",
)
