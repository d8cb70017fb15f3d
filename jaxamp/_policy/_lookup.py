"""``AmpPolicy``: a validated view of an ``amp_policy`` mapping, and its lookup.

Keys are primitive objects, primitive names or ``jax.named_scope`` names (plus
``"amp_stop"`` and ``"amp_default"``); values are rules, or, for scope keys,
nested policies that apply inside the scope.

A policy records the primitive names and scope components it is asked about;
after a trace, :meth:`AmpPolicy.warn_unmatched` warns about each key the user
wrote that matched none of them (a typo such as ``"dot_genral"`` would
otherwise be ignored silently).
"""

from __future__ import annotations

import difflib
import sys
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from .. import _compat
from ._rules import Rule, default_amp_policy

# Scope that marks equations an amp has already rewritten: an enclosing amp
# treats them as "amp_stop", so the innermost amp decides inside its region.
AMP_REGION = "jaxamp.amp"

# Keys that apply without matching a primitive or a scope of the function.
_SPECIAL_KEYS = ("amp_stop", "amp_default")
# Modules whose frames a warning skips to name the user's line.
_LIBRARIES = ("jax.", "jaxlib.", "jaxamp.", "equinox.", "flax.")


def builtin_rule(rule: Rule, *keys: str) -> Rule:
    """Mark ``rule`` as what jaxamp's ready-made policies map ``keys`` to
    (e.g. :func:`jaxamp.fp8_policy`'s ``dot_general`` rule): such an entry is
    not the user's, so it never warns as unmatched. Returns ``rule``."""
    marked = frozenset(getattr(rule, "amp_builtin_keys", ()))
    rule.amp_builtin_keys = marked | frozenset(keys)
    return rule


def _is_builtin(key: Any, rule: Any) -> bool:
    """Whether ``key: rule`` comes from jaxamp's own policies: the key is a
    special key, or maps to the same rule as in the default table, or the rule
    is marked by :func:`builtin_rule` for it."""
    if isinstance(key, str) and key in _SPECIAL_KEYS:
        return True
    builtin = default_amp_policy.get(key) if isinstance(key, str) else None
    return builtin is rule or key in getattr(rule, "amp_builtin_keys", ())


def _closest(name: str, seen: set[str]) -> list[str]:
    """The name closest to ``name``: among those seen in the function, else
    among the default table's keys ([] if none is close)."""
    table = {k for k in default_amp_policy if isinstance(k, str)}
    for known in (seen, table):
        close = difflib.get_close_matches(name, sorted(known - {name}), n=1)
        if close:
            return close
    return []


def _user_stacklevel() -> int:
    """``warnings.warn``'s ``stacklevel`` for the caller of this function to
    name the first frame outside JAX, jaxamp, Equinox and Flax (the user's
    call of the amp'd function, also through ``jit``, ``grad``, ...)."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_globals.get("__name__", "").startswith(
        _LIBRARIES
    ):
        frame, level = frame.f_back, level + 1
    return level if frame is not None else 1


def _user_keys(amp_policy: Mapping, by_name: Mapping) -> dict[Any, tuple]:
    """Key -> the scope keys it is nested in, for every key the user wrote
    (nested policies included), built-in entries left out."""
    keys: dict[Any, tuple] = {}
    for key, rule in amp_policy.items():
        inner = by_name.get(key) if isinstance(key, str) else None
        if isinstance(inner, AmpPolicy):
            keys.setdefault(key, ())
            for k, path in inner._user_keys.items():
                keys.setdefault(k, (key, *path))
        elif not _is_builtin(key, rule):
            keys.setdefault(key, ())
    return keys


class AmpPolicy:
    """A validated, immutable view of an ``amp_policy`` mapping.

    Keys are primitive objects, primitive names or ``jax.named_scope`` names
    (plus the special keys ``"amp_stop"`` and ``"amp_default"``); values are
    rules, or (for scope keys) nested policies that apply inside the scope.
    Lookup order: ``"amp_stop"`` (or an inner amp's region) anywhere on
    the scope stack, then as in jaxamp 0.0.4 the outermost scope component
    found in the policy, then the primitive object, then the primitive name,
    then ``"amp_default"``.

    The view is immutable but for the record of the primitive names and scope
    components :meth:`lookup` was asked about (across every trace of the
    amp'd function), which :meth:`warn_unmatched` compares with the keys.
    """

    __slots__ = (
        "_by_prim",
        "_by_name",
        "_default",
        "_source",
        "_stop",
        "_user_keys",
        "_seen_prims",
        "_seen_scopes",
        "_warned",
    )

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
        self._user_keys = _user_keys(amp_policy, by_name)
        self._seen_prims: set[str] = set()
        self._seen_scopes: set[str] = set()
        self._warned: set[Any] = set()

    @property
    def default_rule(self) -> Rule:
        """The rule used when nothing in the policy matches (``"amp_default"``)."""
        return self._default

    @property
    def stop_rule(self) -> Rule:
        """The rule of ``amp_stop`` regions (and of inner amps' regions)."""
        return self._stop

    def lookup(self, primitive: Any, scopes: Sequence[str]) -> Rule:
        """The rule for ``primitive`` under the scope components ``scopes``
        (recorded: see :meth:`warn_unmatched`)."""
        self._seen_prims.add(primitive.name)
        self._seen_scopes.update(scopes)
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

    def warn_unmatched(self, where: str) -> None:
        """Warn (``UserWarning``) about each key the user wrote that matched no
        primitive and no ``jax.named_scope`` looked up so far, naming the
        closest known name; each key at most once per policy. Keys of jaxamp's
        own policies never warn, nor do ``"amp_stop"`` and ``"amp_default"``;
        keys of a nested policy are matched against the whole function.

        Args:
            where: the traced function's name, for the message.
        """
        seen = self._seen_prims | self._seen_scopes
        for key, path in self._user_keys.items():
            is_prim = isinstance(key, _compat.Primitive)
            name = key.name if is_prim else key
            if name in seen or key in self._warned:
                continue
            self._warned.add(key)
            close = _closest(name, seen)
            shown = f"primitive {name!r}" if is_prim else repr(name)
            nested = f" (in the policy of scope {path[-1]!r})" if path else ""
            hint = f" Did you mean {close[0]!r}?" if close else ""
            warnings.warn(
                f"jaxamp.amp: amp_policy key {shown}{nested} matched no primitive "
                f"and no jax.named_scope in the traced function {where!r}, so its "
                f"rule never applies.{hint}",
                UserWarning,
                stacklevel=_user_stacklevel(),
            )
