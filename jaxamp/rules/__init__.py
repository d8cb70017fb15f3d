"""Rules and policy values: what a policy maps a primitive or a scope to.

A policy (``jaxamp.default_amp_policy`` and its copies) maps primitive names,
``named_scope`` names and the ``"attention"`` / ``"residuals"`` keys to these
values. The rules most policies name (``use_full_precision``,
``use_compute_precision``, ``use_original_precision``), ``residual_rule``,
``attention_rule`` and ``ScopePolicy`` are also at the top level. The
registry of higher-order primitives and the :class:`RuleContext` a rule reads
are in :mod:`jaxamp.extend` (served here for one release with a
``DeprecationWarning``, :data:`_MOVED`).
"""

from .._base._moved import moved_names as _moved_names
from .._policy._kinds import CarryRule as CarryRule
from .._policy._kinds import CastRule as CastRule
from .._policy._kinds import ImplementationRule as ImplementationRule
from .._policy._kinds import ResidualRule as ResidualRule
from .._policy._kinds import ScopePolicy as ScopePolicy
from .._policy._residuals import residual_rule as residual_rule
from .._policy._rules import default_amp_policy as default_amp_policy
from .._policy._rules import follow_compute_precision as follow_compute_precision
from .._policy._rules import keep_current_precision as keep_current_precision
from .._policy._rules import use_compute_precision as use_compute_precision
from .._policy._rules import use_full_precision as use_full_precision
from .._policy._rules import use_lower_precision as use_lower_precision
from .._policy._rules import use_original_precision as use_original_precision
from .._policy._rules import use_precision as use_precision
from .._policy._rules import use_range_safe_precision as use_range_safe_precision
from .._policy._rules import use_widest_precision as use_widest_precision
from .._rewrites._attention import AttentionRule as AttentionRule
from .._rewrites._attention import attention_rule as attention_rule

# Names served from here for one release: name -> its spelling now.
_MOVED = {
    "RuleContext": "jaxamp.extend.RuleContext",
    "register_higher_order": "jaxamp.extend.register_higher_order",
    "unregister_higher_order": "jaxamp.extend.unregister_higher_order",
}


__getattr__ = _moved_names("jaxamp.rules", _MOVED)


__all__ = (
    "AttentionRule",
    "CarryRule",
    "CastRule",
    "ImplementationRule",
    "ResidualRule",
    "ScopePolicy",
    "attention_rule",
    "default_amp_policy",
    "follow_compute_precision",
    "keep_current_precision",
    "residual_rule",
    "use_compute_precision",
    "use_full_precision",
    "use_lower_precision",
    "use_original_precision",
    "use_precision",
    "use_range_safe_precision",
    "use_widest_precision",
)
