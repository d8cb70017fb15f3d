"""Rules and policy values: what a policy maps a primitive or a scope to.

A policy (``jaxamp.default_amp_policy`` and its copies) maps primitive names,
``named_scope`` names and the ``"attention"`` / ``"residuals"`` keys to these
values. The rules most policies name (``use_full_precision``,
``use_compute_precision``, ``use_original_precision``), ``residual_rule``,
``attention_rule`` and ``ScopePolicy`` are also at the top level.
"""

from .._policy._context import RuleContext as RuleContext
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
from .._walk._register import register_higher_order as register_higher_order
from .._walk._register import unregister_higher_order as unregister_higher_order

__all__ = (
    "AttentionRule",
    "CarryRule",
    "CastRule",
    "ImplementationRule",
    "ResidualRule",
    "RuleContext",
    "ScopePolicy",
    "attention_rule",
    "default_amp_policy",
    "follow_compute_precision",
    "keep_current_precision",
    "register_higher_order",
    "residual_rule",
    "unregister_higher_order",
    "use_compute_precision",
    "use_full_precision",
    "use_lower_precision",
    "use_original_precision",
    "use_precision",
    "use_range_safe_precision",
    "use_widest_precision",
)
