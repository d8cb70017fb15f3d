"""jmp's names (``import jmp``, commit 9c1cdbbf78da, release 0.0.4).

``from jaxamp.migration import jmp`` ports jmp code with one import change:
``jmp.get_policy``, ``jmp.Policy``, ``jmp.DynamicLossScale``,
``jmp.all_finite``, ... (``docs/migration.md``, "jmp -> jaxamp").
"""

from .._training._optax import all_finite as all_finite
from .._training._optax import select_tree as select_tree
from ._jmp import Policy as Policy
from ._jmp import cast_to_full as cast_to_full
from ._jmp import cast_to_half as cast_to_half
from ._jmp import get_policy as get_policy
from ._jmp import half_dtype as half_dtype
from ._jmp_scaling import DynamicLossScale as DynamicLossScale
from ._jmp_scaling import NoOpLossScale as NoOpLossScale
from ._jmp_scaling import StaticLossScale as StaticLossScale

__all__ = (
    "DynamicLossScale",
    "NoOpLossScale",
    "Policy",
    "StaticLossScale",
    "all_finite",
    "cast_to_full",
    "cast_to_half",
    "get_policy",
    "half_dtype",
    "select_tree",
)
