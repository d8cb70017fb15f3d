"""The kinds of value a policy holds: small typed rules, told apart by type.

A policy maps keys (primitives, primitive names, ``jax.named_scope`` names and
paths, special keys) to one of:

* :class:`CastRule`: decides an equation's input dtypes (jaxamp 0.0.4's rule
  signature); amp binds the primitive with the inputs it returns;
* :class:`CarryRule`: a cast rule applied to a loop's carries (the ``scan``
  entry of the default policy);
* :class:`ImplementationRule`: runs the equation itself (int8 and FP8 matmuls);
* :class:`AttentionRule`: the value of the ``"attention"`` key, how amp runs
  attention;
* :class:`ResidualRule`: the value of the ``"residuals"`` key, how the values
  saved for the backward pass are stored;
* :class:`ScopePolicy`: a nested policy for everything inside a scope.

User values are converted by :func:`as_policy_value`: a plain function with the
jaxamp 0.0.4 signature becomes a :class:`CastRule`, a mapping under a scope key
a :class:`ScopePolicy`. The types follow qwix's rule dataclasses
(``qwix/_src/qconfig.py``): frozen, compared by value, dispatched on by type.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Mapping
from typing import Any

from .._base import _formats
from .._base._codec import Recipe
from ._context import RuleContext, TracedDtypes, from_dtypes
from ._residual_format import parse_dtype, residual_recipe

ATTENTION_KEY = "attention"
RESIDUALS_KEY = "residuals"
ATTENTION_IMPLEMENTATIONS = ("auto", "xla", "cudnn", "off")
# Attributes a typed rule copies from the function it wraps (its name and
# docstring: for error messages, ``help()`` and the API reference).
_WRAPPED = ("__module__", "__name__", "__qualname__", "__doc__")
# The longest nested policy a ScopePolicy's repr prints in full.
_SHORT_REPR = 80


def _wrap(rule: Any, fn: Callable, kind: str) -> None:
    """Check that ``fn`` is callable and copy its name and docstring onto
    the frozen ``rule`` (as :func:`functools.update_wrapper` does)."""
    if not callable(fn):
        raise TypeError(f"{kind}(fn): fn must be callable, got {type(fn).__name__}.")
    for attr in _WRAPPED:
        if hasattr(fn, attr):
            object.__setattr__(rule, attr, getattr(fn, attr))
    object.__setattr__(rule, "__wrapped__", fn)


@dataclasses.dataclass(frozen=True, repr=False)
class CastRule:
    """A rule that decides an equation's input dtypes (jaxamp 0.0.4's rule).

    ``fn(compute_dtype, original_dtypes, *invars, **params) -> (invars,
    params)``: ``compute_dtype`` is amp's compute dtype (a numpy dtype),
    ``original_dtypes`` the dtypes the traced jaxpr declared for each input,
    ``invars`` the current inputs (arrays or tracers; the jaxpr's literals as
    numpy scalars) and ``params`` the primitive's bind parameters. ``fn``
    returns the (possibly cast) inputs, one per input, and the parameters to
    bind with; amp then binds the primitive. Calling a ``CastRule`` calls
    ``fn``. Usable as a decorator; plain functions in a policy are wrapped in
    one automatically.

    A rule made with :meth:`with_context` is called as ``fn(ctx, *invars,
    **params)`` instead, ``ctx`` a :class:`RuleContext` (the equation's value
    facts, scopes, policy and residual format besides the two dtypes).

    Attributes:
        fn: the rule function.
        context: ``fn`` takes one :class:`RuleContext` (keyword-only).

    Raises:
        TypeError: if ``fn`` is not callable.

    Example:
        >>> import jax.numpy as jnp, jaxamp
        >>> @jaxamp.rules.CastRule
        ... def exp_in_bf16(compute_dtype, original_dtypes, *invars, **params):
        ...     return [v.astype(jnp.bfloat16) for v in invars], params
        >>> policy = {**jaxamp.default_amp_policy, "exp": exp_in_bf16}
    """

    fn: Callable[..., tuple[list, dict]]
    context: bool = dataclasses.field(default=False, kw_only=True)

    def __post_init__(self):
        _wrap(self, self.fn, type(self).__name__)

    @classmethod
    def with_context(cls, fn: Callable[..., Any]) -> Any:
        """A rule called as ``fn(ctx, *invars, **params)`` with one
        :class:`jaxamp.extend.RuleContext` (compute dtype, traced
        dtypes, value facts, scopes, policy, residual format). Usable as a
        decorator."""
        return cls(fn, context=True)

    def decide(self, ctx: RuleContext, *invars, **params):
        """``fn``'s result for the equation ``ctx`` describes."""
        if self.context:
            return self.fn(ctx, *invars, **params)
        # A list, as jaxamp 0.0.4 passed; it carries ctx to a rule it reaches.
        original = TracedDtypes.of(ctx)
        return self.fn(ctx.compute_dtype, original, *invars, **params)

    def __call__(self, compute_dtype, original_dtypes, *invars, **params):
        if self.context:  # called with 0.0.4's signature: the carried context
            ctx = from_dtypes(compute_dtype, original_dtypes)
            return self.fn(ctx, *invars, **params)
        return self.fn(compute_dtype, original_dtypes, *invars, **params)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({getattr(self.fn, '__name__', self.fn)!s})"


@dataclasses.dataclass(frozen=True, repr=False)
class CarryRule(CastRule):
    """A :class:`CastRule` for the carries of a loop (the policy entry of a
    loop primitive, e.g. ``jax.lax.scan``): called as
    ``fn(compute_dtype, carry_dtypes, *carries)`` with the traced carry dtypes
    and the current carries, it returns ``(carries, params)``; the loop body
    is rewritten for the carry dtypes it chooses. Under any other key it acts
    as the cast rule it is.

    Attributes:
        fn: the rule function.
    """


@dataclasses.dataclass(frozen=True, repr=False)
class ImplementationRule:
    """A rule that runs the equation itself (e.g. an int8 or FP8 matmul).

    ``fn(compute_dtype, original_dtypes, *invars, **params) -> outputs``:
    arguments as for :class:`CastRule`; ``fn`` returns the equation's output
    (a list for several), in any dtype (amp casts back where the surrounding
    code needs the traced dtype). amp neither casts its inputs nor binds the
    primitive: ``fn`` does both. Calling it calls ``fn``.

    Attributes:
        fn: the implementation.
        builtin_keys: policy keys under which jaxamp's own ready-made policies
            put this rule (:func:`jaxamp.fp8_policy`'s ``"dot_general"``): such
            an entry is not the user's and never warns as unmatched.
        context: ``fn`` takes one :class:`RuleContext` in place of the two
            dtypes (:meth:`with_context`; keyword-only).

    Raises:
        TypeError: if ``fn`` is not callable.
    """

    fn: Callable[..., Any]
    builtin_keys: frozenset = frozenset()
    context: bool = dataclasses.field(default=False, kw_only=True)

    # The marker attribute of jaxamp 0.0.x implementation rules.
    amp_impl = True

    def __post_init__(self):
        _wrap(self, self.fn, "ImplementationRule")
        object.__setattr__(self, "builtin_keys", frozenset(self.builtin_keys))

    @classmethod
    def with_context(cls, fn: Callable[..., Any], **kw: Any) -> ImplementationRule:
        """An implementation called as ``fn(ctx, *invars, **params)``
        (:meth:`CastRule.with_context`); ``kw``: the other fields."""
        return cls(fn, context=True, **kw)

    decide = CastRule.decide
    __call__ = CastRule.__call__

    def __repr__(self) -> str:
        return f"ImplementationRule({getattr(self.fn, '__name__', self.fn)!s})"


@dataclasses.dataclass(frozen=True)
class Delegate:
    """What an :class:`ImplementationRule` returns to leave its equation to a
    cast rule: amp then runs the equation exactly as a policy with ``rule``
    under its key would (casts, residuals, bind steps), inside
    ``jax.named_scope(scope)`` when ``scope`` is given. An 8-bit rule returns
    one for a product it does not quantize (below its size rule, or the one
    feeding the loss), so that a policy that quantizes nothing compiles to the
    compute-dtype step's program; ``scope`` (a registered marker) tells
    ``jaxamp.quantization_report`` why.

    Attributes:
        rule: the :class:`CastRule` to apply.
        scope: a name-stack marker around the equation, or None.
    """

    rule: CastRule
    scope: str | None = None


@dataclasses.dataclass(frozen=True)
class AttentionRule:
    """Value of the ``"attention"`` policy key: how amp runs the attention it
    recognises (see :func:`jaxamp.attention_rule`). Valid only under that key
    (also in a nested scope policy); it is no rule for the equations of a scope
    that happens to be named ``"attention"``.

    Attributes:
        implementation: ``"auto"``, ``"xla"``, ``"cudnn"`` or ``"off"``.

    Raises:
        ValueError: for another ``implementation``.
    """

    implementation: str = "auto"

    def __post_init__(self):
        if self.implementation not in ATTENTION_IMPLEMENTATIONS:
            raise ValueError(
                f"attention_rule(implementation={self.implementation!r}): "
                f"expected one of {ATTENTION_IMPLEMENTATIONS}."
            )

    def __repr__(self) -> str:
        return f"attention_rule({self.implementation!r})"


@dataclasses.dataclass(frozen=True)
class ResidualRule:
    """Value of the ``"residuals"`` policy key: how the values amp saves for
    the backward pass are stored (see :func:`jaxamp.residual_rule`). Valid only
    under that key, at the top of a policy or inside a nested scope policy,
    where it applies to the scope.

    Attributes:
        dtype: the dtype of a registered 8-bit format
            (``numpy.dtype(float8_e4m3fn)``, ``float8_e5m2``, ``int8``, or one
            added by :func:`jaxamp.extend.register_format`; given by name, alias or
            dtype): stored in 8 bits with per-group float32 scales; None:
            stored in the dtype amp computes them in (no compression).
        group_size: values per scale along the last axis; None: the format's
            group (128 for FP8, 32 for int8).

    Raises:
        ValueError: for another ``dtype`` or a ``group_size`` below 1.
    """

    dtype: Any = None
    group_size: int | None = None

    def __post_init__(self):
        dtype = parse_dtype(self.dtype, "residual_rule(dtype)")
        object.__setattr__(self, "dtype", dtype)
        size = self.group_size
        if size is None:
            return
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(
                f"residual_rule(group_size={size!r}): a positive int, the values "
                "per float32 scale along the last axis (default 128; 32 for int8)."
            )

    @property
    def recipe(self) -> Recipe | None:
        """The codec's recipe of the stored residuals (``_base/_codec.Recipe``:
        the format, 1 x G groups along the last axis, a step scale), None for
        no compression."""
        if self.dtype is None:
            return None
        return residual_recipe(self.dtype, self.group_size)

    @property
    def format(self) -> Recipe | None:
        """Deprecated spelling of :attr:`recipe`."""
        warnings.warn(
            "ResidualRule.format is deprecated: use ResidualRule.recipe (the "
            "codec's Recipe).",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.recipe

    def __repr__(self) -> str:
        name = None if self.dtype is None else _formats.name_of(self.dtype)
        return f"residual_rule({name!r}, group_size={self.group_size})"


@dataclasses.dataclass(frozen=True, eq=False)
class ScopePolicy:
    """A policy for everything inside a ``jax.named_scope`` (the value of a
    scope key). A plain mapping under a scope key is wrapped in one.

    Attributes:
        policy: the nested mapping (keys and values as in any policy).

    Raises:
        TypeError: if ``policy`` is not a mapping.

    Example:
        >>> import jaxamp
        >>> policy = {**jaxamp.default_amp_policy,
        ...           "head": jaxamp.ScopePolicy(jaxamp.default_amp_policy)}
    """

    policy: Mapping[Any, Any]

    def __post_init__(self):
        if not isinstance(self.policy, Mapping):
            raise TypeError(
                "ScopePolicy(policy): policy must be a mapping, got "
                f"{type(self.policy).__name__}."
            )

    def __repr__(self) -> str:
        # Short (a policy holds ~70 rules): named if it is the default table.
        inner = repr(self.policy)
        if len(inner) > _SHORT_REPR:
            inner = f"<{len(self.policy)} entries>"
        return f"ScopePolicy({inner})"


PolicyValue = CastRule | ImplementationRule | AttentionRule | ResidualRule | ScopePolicy


def as_policy_value(key: Any, value: Any) -> PolicyValue:
    """The typed form of the policy entry ``key: value``.

    Args:
        key: the entry's key (a primitive, a primitive name, a scope name or
            path, a special key).
        value: a typed rule, a mapping (under a ``str`` key: a nested scope
            policy) or a callable (a jaxamp 0.0.4 cast rule; one with the
            attribute ``amp_impl = True`` an implementation rule).

    Returns:
        ``value`` if already typed, else its typed wrapper.

    Raises:
        TypeError: for a value of no kind, a mapping under a non-string key, or
            an :class:`AttentionRule` under another key than ``"attention"``
            (a :class:`ResidualRule` likewise for ``"residuals"``).
    """
    if isinstance(value, AttentionRule):
        if key != ATTENTION_KEY:
            raise TypeError(
                f"amp_policy[{key!r}] is an attention rule; it belongs under the "
                f"key {ATTENTION_KEY!r} (e.g. {{'{ATTENTION_KEY}': {value!r}}})."
            )
        return value
    if isinstance(value, ResidualRule) or key == RESIDUALS_KEY:
        if key != RESIDUALS_KEY or not isinstance(value, ResidualRule):
            raise TypeError(
                f"amp_policy[{key!r}] = {value!r}: the key {RESIDUALS_KEY!r} takes "
                "a jaxamp.residual_rule(...) and a residual rule belongs under it "
                f"(e.g. {{'{RESIDUALS_KEY}': "
                "jaxamp.residual_rule(jnp.float8_e4m3fn)})."
            )
        return value
    if isinstance(value, (CastRule, ImplementationRule, ScopePolicy)):
        return value
    if isinstance(value, Mapping) and isinstance(key, str):
        return ScopePolicy(value)
    if callable(value) and not isinstance(value, Mapping):
        if getattr(value, "amp_impl", False):
            return ImplementationRule(value)
        return CastRule(value)
    raise TypeError(
        f"amp_policy[{key!r}] must be a rule (a callable with signature "
        "rule(compute_dtype, original_dtypes, *invars, **params), or a "
        "jaxamp.rules.CastRule / ImplementationRule / AttentionRule / "
        f"ScopePolicy), got {type(value).__name__}."
    )
