"""``AmpPolicy``: a validated view of an ``amp_policy`` mapping, and its lookup.

Keys are primitive objects, primitive names, ``jax.named_scope`` names or
``/``-separated scope paths (plus ``"amp_stop"`` and ``"amp_default"``);
values are typed policy values (``_kinds.py``): cast rules, implementation
rules, the attention rule, or, for scope keys, nested policies that apply
inside the scope. Plain functions and mappings are converted on the way in.

A policy records the primitive names and scope paths it is asked about;
after a trace, :meth:`AmpPolicy.warn_unmatched` warns about each key the user
wrote that matched none of them (a typo such as ``"dot_genral"`` would
otherwise be ignored silently).
"""

from __future__ import annotations

import dataclasses
import difflib
import sys
import warnings
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

from .. import _compat
from .._base._scopes import components, marker
from .._base._structure import registered
from ._kinds import (
    ATTENTION_KEY,
    RESIDUALS_KEY,
    AttentionRule,
    CastRule,
    ImplementationRule,
    PolicyValue,
    ResidualRule,
    ScopePolicy,
    as_policy_value,
)
from ._rules import default_amp_policy

# Scope that marks equations an amp has already rewritten: an enclosing amp
# treats them as "amp_stop", so the innermost amp decides inside its region.
AMP_REGION = marker("jaxamp.amp")

# Keys that apply without matching a primitive or a scope of the function.
_SPECIAL_KEYS = ("amp_stop", "amp_default")
# Modules whose frames a warning skips to name the user's line.
_LIBRARIES = ("jax.", "jaxlib.", "jaxamp.", "equinox.", "flax.")


def builtin_rule(rule: ImplementationRule, *keys: str) -> ImplementationRule:
    """A copy of ``rule`` marked as what jaxamp's ready-made policies map
    ``keys`` to (e.g. :func:`jaxamp.fp8_policy`'s ``dot_general`` rule): such
    an entry is not the user's, so it never warns as unmatched.

    Raises:
        TypeError: if ``rule`` is not an :class:`ImplementationRule`.
    """
    if not isinstance(rule, ImplementationRule):
        raise TypeError(f"builtin_rule: expected an ImplementationRule, got {rule!r}.")
    return dataclasses.replace(rule, builtin_keys=rule.builtin_keys | frozenset(keys))


def _is_builtin(key: Any, value: PolicyValue) -> bool:
    """Whether ``key: value`` comes from jaxamp's own policies: the key is a
    special key, or maps to the same value as in the default table, or the
    value is an implementation rule marked by :func:`builtin_rule` for it."""
    if isinstance(key, str) and key in _SPECIAL_KEYS:
        return True
    builtin = default_amp_policy.get(key) if isinstance(key, str) else None
    marked = getattr(value, "builtin_keys", ())
    return builtin is value or (isinstance(value, ImplementationRule) and key in marked)


def _path(key: str) -> tuple[str, ...]:
    """The scope components of the string key ``key`` (one for a name)."""
    parts = tuple(key.split("/"))
    if len(parts) > 1 and not all(parts):
        raise ValueError(
            f"amp_policy key {key!r}: a scope path needs non-empty components "
            "separated by single '/', e.g. 'layer2/mlp'."
        )
    return parts


def _find(path: tuple[str, ...], names: Sequence[str]) -> int:
    """Index where ``path`` occurs as a contiguous run of ``names``, or -1."""
    n = len(path)
    for j in range(len(names) - n + 1):
        if tuple(names[j : j + n]) == path:
            return j
    return -1


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


def _user_keys(typed: Mapping) -> dict[Any, tuple]:
    """Key -> the scope keys it is nested in, for every key the user wrote
    (nested policies included), built-in entries left out."""
    keys: dict[Any, tuple] = {}
    for key, value in typed.items():
        if isinstance(value, AmpPolicy):
            keys.setdefault(key, ())
            for k, path in value._user_keys.items():
                keys.setdefault(k, (key, *path))
        elif not _is_builtin(key, value):
            keys.setdefault(key, ())
    return keys


def _registered_default(name: str) -> PolicyValue | None:
    """The default rule registered with the higher-order primitive ``name``
    (``register_higher_order(default_rule=...)``), typed; None if none."""
    entry = registered(name)
    if entry is None or entry.default_rule is None:
        return None
    return as_policy_value(name, entry.default_rule)


def _typed(amp_policy: Mapping) -> dict[Any, Any]:
    """Key -> typed value (``_kinds.as_policy_value``; a scope policy as a
    nested :class:`AmpPolicy`), keys validated."""
    typed: dict[Any, Any] = {}
    for key, value in amp_policy.items():
        value = as_policy_value(key, value)
        if not isinstance(key, (str, _compat.Primitive)):
            raise TypeError(
                f"amp_policy key {key!r} of type {type(key).__name__} is neither "
                "a primitive (e.g. jax.lax.dot_general_p), a primitive name "
                "(e.g. 'dot_general') nor a jax.named_scope name or path (a str)."
            )
        if isinstance(value, ScopePolicy):
            if not isinstance(key, str) or key in _SPECIAL_KEYS:
                raise TypeError(
                    f"amp_policy[{key!r}] is a nested policy; only a "
                    "jax.named_scope name or path takes one."
                )
            value = AmpPolicy(value.policy)  # a policy for everything inside
        typed[key] = value
    return typed


class AmpPolicy:
    """A validated, immutable view of an ``amp_policy`` mapping.

    Keys are primitive objects, primitive names, ``jax.named_scope`` names or
    ``/``-separated scope paths (plus the special keys ``"amp_stop"`` and
    ``"amp_default"``); values are typed policy values (:class:`CastRule`,
    :class:`ImplementationRule`, :class:`AttentionRule`; for scope keys, a
    :class:`ScopePolicy` that applies inside the scope); plain functions and
    mappings are converted.

    Lookup order: ``"amp_stop"`` (or an inner amp's region) anywhere on the
    scope stack; then the scope keys that match the equation's scope path
    (``_base/_scopes.components``: the scopes the user opened, the string the
    reports print): a path ``"a/b"`` matches where its components occur as a
    contiguous run of it (anywhere, not only from the root), a name where it is
    one component; the longest matching key wins, and among equally long ones
    the outermost (as jaxamp 0.0.4 for names); then the primitive object, then
    the primitive name; then, in a policy built on the default table (one that
    holds :data:`jaxamp.default_amp_policy`'s own ``"amp_default"`` entry, as
    every copy of it and jaxamp's ready-made policies do), the default rule of a
    registered higher-order primitive (``_base/_structure.py``), read when
    looked up, so that a primitive registered after the policy was built has its
    entry; then ``"amp_default"``. A nested policy found on the stack is looked
    up with the components inside its match.

    The view is immutable but for the record of the primitive names and scope
    stacks :meth:`lookup` was asked about (across every trace of the amp'd
    function), which :meth:`warn_unmatched` compares with the keys.
    """

    __slots__ = (
        "_by_prim",
        "_by_name",
        "_by_path",
        "_default",
        "_key",
        "_on_default",
        "_source",
        "_stop",
        "_user_keys",
        "_seen_prims",
        "_seen_scopes",
        "_seen_stacks",
        "_warned",
    )

    def __init__(self, amp_policy: Mapping[Any, Any]):
        if isinstance(amp_policy, AmpPolicy):
            amp_policy = amp_policy._source
        if not isinstance(amp_policy, Mapping):
            raise TypeError(
                "amp_policy must be a mapping from primitive / primitive name / "
                f"named_scope name to rule, got {type(amp_policy).__name__}."
            )
        typed = _typed(amp_policy)
        self._by_prim = {k: v for k, v in typed.items() if not isinstance(k, str)}
        paths = {_path(k): v for k, v in typed.items() if isinstance(k, str)}
        by_name = {p[0]: v for p, v in paths.items() if len(p) == 1}
        self._by_path = {p: v for p, v in paths.items() if len(p) > 1}
        by_name.setdefault("amp_stop", default_amp_policy["amp_stop"])
        self._stop = by_name["amp_stop"]
        builtin_default = default_amp_policy["amp_default"]
        self._on_default = by_name.get("amp_default") is builtin_default
        self._default = by_name.pop("amp_default", builtin_default)
        self._by_name = by_name
        self._source = dict(amp_policy)
        self._user_keys = _user_keys(typed)
        self._seen_prims: set[str] = set()
        self._seen_scopes: set[str] = set()
        self._seen_stacks: set[tuple[str, ...]] = set()
        self._warned: set[Any] = set()
        self._key: Hashable | None = None

    @property
    def value_key(self) -> Hashable:
        """A key equal for policies with equal entries as typed when they
        were built (the same keys; rules compare by their fields, so a
        function by identity; nested policies by their entries): what work
        done under a policy is cached by (``_walk/_higher_order.py``), so
        re-wrapping a function with an equal policy reuses it. A policy
        holding an unhashable value is its own key (compared by identity).
        Made once: the entries do not change after the policy is built."""
        if self._key is None:
            try:
                self._key = self._typed_key()
            except TypeError:  # a value that cannot be hashed
                self._key = self
        return self._key

    def _typed_key(self) -> Hashable:
        """The typed entries (fixed when the policy was built, nested
        policies by their own entries) as a hashable value."""
        entries = [
            (k, v._typed_key() if isinstance(v, AmpPolicy) else v)
            for table in (self._by_prim, self._by_name, self._by_path)
            for k, v in table.items()
        ]
        key = (frozenset(entries), self._default, self._stop, self._on_default)
        hash(key)
        return key

    def replay(self, other: AmpPolicy) -> None:
        """Record what :meth:`lookup` asked ``other`` (an equal policy that
        did work this one reuses, see :attr:`value_key`) as if it had been
        asked here, for :meth:`warn_unmatched`."""
        self._seen_prims |= other._seen_prims
        self._seen_scopes |= other._seen_scopes
        self._seen_stacks |= other._seen_stacks

    @property
    def default_rule(self) -> CastRule | ImplementationRule:
        """The rule used when nothing in the policy matches (``"amp_default"``)."""
        return self._default

    @property
    def stop_rule(self) -> CastRule | ImplementationRule:
        """The rule of ``amp_stop`` regions (and of inner amps' regions)."""
        return self._stop

    def lookup(self, primitive: Any, scopes: Sequence[str]) -> PolicyValue:
        """The policy value for ``primitive`` (a primitive, or a key name such
        as ``"attention"``) under the scope components ``scopes``, outermost
        first (recorded: see :meth:`warn_unmatched`)."""
        name = primitive if isinstance(primitive, str) else primitive.name
        self._seen_prims.add(name)
        path = components(tuple(scopes))
        self._seen_scopes.update(path)
        self._seen_stacks.add(path)
        if "amp_stop" in scopes or AMP_REGION in scopes:
            return self._stop
        found = self._in_scopes(path, name == ATTENTION_KEY)
        if found is not None:
            value, inside = found
            if isinstance(value, AmpPolicy):  # nested: look up inside the scope
                return value.lookup(primitive, inside)
            return value
        value = None if isinstance(primitive, str) else self._by_prim.get(primitive)
        if value is None:
            value = self._by_name.get(name)
        if value is None and self._on_default:
            value = _registered_default(name)
        return self._default if value is None or isinstance(value, AmpPolicy) else value

    def residual_rule(self, scopes: Sequence[str]) -> ResidualRule | None:
        """The ``"residuals"`` entry in force under the scope components
        ``scopes``: that of the innermost nested scope policy on the stack that
        has one, else this policy's own, else None (recorded as a lookup of
        the key, for :meth:`warn_unmatched`). None in ``amp_stop`` regions."""
        self._seen_prims.add(RESIDUALS_KEY)
        if "amp_stop" in scopes or AMP_REGION in scopes:
            return None
        own = self._by_name.get(RESIDUALS_KEY)
        found = self._in_scopes(components(tuple(scopes)), False)
        if found is not None and isinstance(found[0], AmpPolicy):
            inner = found[0].residual_rule(found[1])
            if inner is not None:
                return inner
        return own if isinstance(own, ResidualRule) else None

    def _in_scopes(self, path: tuple[str, ...], attention: bool) -> tuple | None:
        """``(value, components inside the match)`` of the scope key that wins
        on the scope path ``path`` (``_scopes.components``; see the class
        docstring), or None. An attention rule matches only when
        ``attention`` (the attention lookup); a residual rule never (it is no
        rule for a scope named ``"residuals"``)."""
        best = None  # (components, start, value)
        for i, scope in enumerate(path):
            value = self._by_name.get(scope)
            if value is None or (isinstance(value, AttentionRule) and not attention):
                continue
            if isinstance(value, ResidualRule):
                continue
            best = (1, i, value)
            break
        for key, value in self._by_path.items():
            j = _find(key, path)
            n = len(key)
            if j >= 0 and (best is None or (n, -j) > (best[0], -best[1])):
                best = (n, j, value)
        return None if best is None else (best[2], path[best[1] + best[0] :])

    def _matched(self, name: str) -> bool:
        """Whether the key ``name`` (primitive, scope name or path) matched."""
        path = _path(name)
        if len(path) == 1:
            return name in self._seen_prims or name in self._seen_scopes
        return any(_find(path, stack) >= 0 for stack in self._seen_stacks)

    def _closest_path(self, path: tuple[str, ...]) -> list[str]:
        """The scope path of ``len(path)`` components closest to ``path`` among
        those seen ([] if none is close)."""
        n = len(path)
        seen = {
            "/".join(stack[j : j + n])
            for stack in self._seen_stacks
            for j in range(len(stack) - n + 1)
        }
        return difflib.get_close_matches("/".join(path), sorted(seen), n=1)

    def warn_unmatched(self, where: str) -> None:
        """Warn (``UserWarning``) about each key the user wrote that matched no
        primitive and no ``jax.named_scope`` (name, or path as a contiguous run
        of a scope stack) looked up so far, naming the closest known name or
        path; each key at most once per policy. Keys of jaxamp's own policies
        never warn, nor do ``"amp_stop"`` and ``"amp_default"``; keys of a
        nested policy are matched against the whole function.

        Args:
            where: the traced function's name, for the message.
        """
        seen = self._seen_prims | self._seen_scopes
        for key, nested_in in self._user_keys.items():
            is_prim = isinstance(key, _compat.Primitive)
            name = key.name if is_prim else key
            if key in self._warned or self._matched(name):
                continue
            self._warned.add(key)
            path = _path(name)
            close = _closest(name, seen) if len(path) == 1 else self._closest_path(path)
            shown = f"primitive {name!r}" if is_prim else repr(name)
            nested = f" (in the policy of scope {nested_in[-1]!r})" if nested_in else ""
            hint = f" Did you mean {close[0]!r}?" if close else ""
            warnings.warn(
                f"jaxamp.amp: amp_policy key {shown}{nested} matched no primitive "
                f"and no jax.named_scope in the traced function {where!r}, so its "
                f"rule never applies.{hint}",
                UserWarning,
                stacklevel=_user_stacklevel(),
            )
