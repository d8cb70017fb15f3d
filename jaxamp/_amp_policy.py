"""``AmpPolicy``: a validated view of an ``amp_policy`` mapping, and its lookup.

Keys are primitive objects, primitive names or ``jax.named_scope`` names (plus
``"amp_stop"`` and ``"amp_default"``); values are rules, or, for scope keys,
nested policies that apply inside the scope.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from . import _compat
from ._rules import Rule, default_amp_policy

# Scope that marks equations an amp has already rewritten: an enclosing amp
# treats them as "amp_stop", so the innermost amp decides inside its region.
AMP_REGION = "jaxamp.amp"


class AmpPolicy:
    """A validated, immutable view of an ``amp_policy`` mapping.

    Keys are primitive objects, primitive names or ``jax.named_scope`` names
    (plus the special keys ``"amp_stop"`` and ``"amp_default"``); values are
    rules, or (for scope keys) nested policies that apply inside the scope.
    Lookup order: ``"amp_stop"`` (or an inner amp's region) anywhere on
    the scope stack, then as in jaxamp 0.0.4 the outermost scope component
    found in the policy, then the primitive object, then the primitive name,
    then ``"amp_default"``.
    """

    __slots__ = ("_by_prim", "_by_name", "_default", "_source", "_stop")

    def __init__(self, amp_policy: Mapping[Any, Rule]):
        if isinstance(amp_policy, AmpPolicy):
            amp_policy = amp_policy._source
        if not isinstance(amp_policy, Mapping):
            raise TypeError(
                "amp_policy must be a mapping from primitive / primitive name / "
                f"named_scope name to rule, got {type(amp_policy).__name__}."
            )
        by_prim: dict[Any, Rule] = {}
        by_name: dict[str, Rule] = {}
        for key, rule in amp_policy.items():
            if isinstance(rule, Mapping) and isinstance(key, str):
                rule = AmpPolicy(rule)  # a policy for everything inside a scope
            elif not callable(rule):
                raise TypeError(
                    f"amp_policy[{key!r}] must be a rule (a callable with signature "
                    "rule(compute_dtype, original_dtypes, *invars, **params)), got "
                    f"{type(rule).__name__}."
                )
            if isinstance(key, _compat.Primitive):
                by_prim[key] = rule
            elif isinstance(key, str):
                by_name[key] = rule
            else:
                raise TypeError(
                    f"amp_policy key {key!r} of type {type(key).__name__} is neither "
                    "a primitive (e.g. jax.lax.dot_general_p), a primitive name "
                    "(e.g. 'dot_general') nor a jax.named_scope name (a str)."
                )
        by_name.setdefault("amp_stop", default_amp_policy["amp_stop"])
        self._stop = by_name["amp_stop"]
        self._default = by_name.pop("amp_default", default_amp_policy["amp_default"])
        self._by_prim = by_prim
        self._by_name = by_name
        self._source = dict(amp_policy)

    @property
    def default_rule(self) -> Rule:
        """The rule used when nothing in the policy matches (``"amp_default"``)."""
        return self._default

    @property
    def stop_rule(self) -> Rule:
        """The rule of ``amp_stop`` regions (and of inner amps' regions)."""
        return self._stop

    def lookup(self, primitive: Any, scopes: Sequence[str]) -> Rule:
        """The rule for ``primitive`` under the scope components ``scopes``."""
        if "amp_stop" in scopes or AMP_REGION in scopes:
            return self._stop
        for i, scope in enumerate(scopes):
            rule = self._by_name.get(scope)
            if isinstance(rule, AmpPolicy):  # nested: look up inside the scope
                return rule.lookup(primitive, scopes[i + 1 :])
            if rule is not None:
                return rule
        rule = self._by_prim.get(primitive)
        if rule is not None:
            return rule
        rule = self._by_name.get(primitive.name)
        return self._default if rule is None or isinstance(rule, AmpPolicy) else rule
