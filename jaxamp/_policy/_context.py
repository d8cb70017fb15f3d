"""What a rule is told about the equation it decides: one argument.

The loop builds one :class:`RuleContext` per equation (:func:`rule_context`,
called by ``_walk/_loop.py``): its rule, a higher-order rule (through the
``AmpContext`` of its sub-jaxprs) and the residual choice read it. A rule
declared with context (``CastRule.with_context``,
``ImplementationRule.with_context``) is called as ``fn(ctx, *invars,
**params)``. A rule with jaxamp 0.0.4's signature ``fn(compute_dtype,
original_dtypes, *invars, **params)`` gets the first two fields, the traced
dtypes as a :class:`TracedDtypes` list that carries the whole context: a
0.0.4 rule that passes it on to a context rule (a user's rule delegating to
:func:`jaxamp.rules.follow_compute_precision`) passes on the equation's facts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from .._base import _state
from .._base._codec import Recipe
from .._values._facts import UNKNOWN, EqnFacts


@dataclasses.dataclass(frozen=True)
class RuleContext:
    """The equation a rule decides, as the walk sees it.

    Attributes:
        compute_dtype: amp's compute dtype (a numpy dtype).
        original_dtypes: the dtypes the traced jaxpr declared for each input
            (for a loop's carry rule: the carries' traced dtypes).
        facts: the equation's value facts (``_values/_facts.EqnFacts``:
            whether it is in the loss tail, centres a value, feeds a softmax,
            which loop carries may narrow, ...); None (every fact unknown,
            false) outside an analysed walk.
        scopes: the ``named_scope`` components of the equation, outermost
            first (with the enclosing equations' prefix; its scope path is
            ``_base/_scopes.scope_path(scopes)``).
        policy: the policy in force (an ``AmpPolicy``), None outside a walk.
        residual_format: the stored form of the residuals saved here (the
            codec's ``Recipe``: format, groups, scale form; ``.dtype`` the
            codes' dtype), None where they are kept in the dtype they are
            computed in.
        recomputed: the equation is inside a user's ``jax.checkpoint`` body,
            whose residuals the backward pass recomputes.
    """

    compute_dtype: np.dtype
    original_dtypes: tuple = ()
    facts: EqnFacts | None = None
    scopes: tuple[str, ...] = ()
    policy: Any = None
    residual_format: Recipe | None = None
    recomputed: bool = False

    def __post_init__(self):
        if self.facts is None:  # every fact unknown: false
            object.__setattr__(self, "facts", UNKNOWN)


def rule_context(
    compute_dtype: Any,
    original_dtypes: Sequence[Any],
    facts: EqnFacts | None,
    scopes: tuple[str, ...],
    policy: Any,
) -> RuleContext:
    """The context of an equation walked under ``policy``: the residual
    format is the ``"residuals"`` entry in force for ``scopes``
    (``AmpPolicy.residual_rule``), None inside a user's ``jax.checkpoint``
    (recomputed anyway) and in a rule JAX differentiates itself
    (``WalkState.residuals_off``)."""
    state = _state.current()
    rule = None
    if policy is not None and not (state.recomputed or state.residuals_off):
        rule = policy.residual_rule(scopes)
    return RuleContext(
        compute_dtype=compute_dtype,
        original_dtypes=tuple(original_dtypes),
        facts=facts,
        scopes=scopes,
        policy=policy,
        residual_format=None if rule is None else rule.recipe,
        recomputed=state.recomputed,
    )


class TracedDtypes(list):
    """The traced input dtypes as jaxamp 0.0.4's rule signature passes them
    (a list), with the equation's :class:`RuleContext` as ``context``."""

    context: RuleContext | None = None

    @classmethod
    def of(cls, ctx: RuleContext) -> TracedDtypes:
        """``ctx.original_dtypes`` as a list carrying ``ctx``."""
        dtypes = cls(ctx.original_dtypes)
        dtypes.context = ctx
        return dtypes


def from_dtypes(compute_dtype: Any, original_dtypes: Sequence[Any]) -> RuleContext:
    """The context of a context rule called with 0.0.4's signature: the one
    ``original_dtypes`` carries (:class:`TracedDtypes`) with the two given
    fields, else those two and every fact unknown (a rule called by hand)."""
    cd = None if compute_dtype is None else np.dtype(compute_dtype)
    carried = getattr(original_dtypes, "context", None)
    if carried is None:
        return RuleContext(compute_dtype=cd, original_dtypes=tuple(original_dtypes))
    return dataclasses.replace(
        carried, compute_dtype=cd, original_dtypes=tuple(original_dtypes)
    )
