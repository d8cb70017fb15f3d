"""Haliax's mixed-precision names (``haliax/_src/mixed_precision.py``,
``haliax/_src/resource_env.py``).

``from jaxamp.migration import haliax`` gives semantic dtypes and the current
policy: ``haliax.cast_floating(x, "compute")``, ``with
haliax.mixed_precision("p=f32,c=bf16,o=f32"):`` (Haliax's
``hax.resource_env(mp=...)``), ``haliax.current_mp_policy()``
(``docs/migration.md``, "Haliax -> jaxamp").
"""

from .._base._ambient_policy import current_policy as current_mp_policy
from .._base._ambient_policy import current_policy as current_policy
from .._base._ambient_policy import policy_compute_dtype as policy_compute_dtype
from ._haliax import DTypeish as DTypeish
from ._haliax import SemanticDType as SemanticDType
from ._haliax import cast_floating as cast_floating
from ._haliax import mixed_precision as mixed_precision
from ._haliax import resolve_dtype as resolve_dtype
from ._jmp import Policy as Policy
from ._jmp import get_policy as get_policy

__all__ = (
    "DTypeish",
    "Policy",
    "SemanticDType",
    "cast_floating",
    "current_mp_policy",
    "current_policy",
    "get_policy",
    "mixed_precision",
    "policy_compute_dtype",
    "resolve_dtype",
)
