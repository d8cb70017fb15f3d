"""What a rule is told about the equation it decides: one argument.

A rule declared with context (``CastRule.with_context``,
``ImplementationRule.with_context``) is called as ``fn(ctx, *invars,
**params)`` with a :class:`RuleContext`; the interpreter builds it for each
equation from what it walks with (``_walk/_loop.py``). A rule with jaxamp
0.0.4's signature ``fn(compute_dtype, original_dtypes, *invars, **params)``
gets the first two fields. Calling a context rule with 0.0.4's signature (a
user's rule delegating to :func:`jaxamp.rules.follow_compute_precision`) builds the
context from the walk state instead (:func:`from_walk`): the one place a rule's
context comes from the ``ContextVar`` of ``_base/_state.py``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from .._base import _state
from .._base._codec import Recipe
from .._values._facts import UNKNOWN, EqnFacts, current_facts
from ._compressed import current_residual_format


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
            first (with the enclosing equations' prefix).
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


def from_walk(compute_dtype: Any, original_dtypes: Sequence[Any]) -> RuleContext:
    """The context of the equation the walk is binding now (every field but
    the two given from the walk state; defaults outside a walk)."""
    state = _state.current()
    return RuleContext(
        compute_dtype=np.dtype(compute_dtype) if compute_dtype is not None else None,
        original_dtypes=tuple(original_dtypes),
        facts=current_facts(),
        scopes=state.scopes,
        policy=state.policy,
        residual_format=current_residual_format(),
        recomputed=state.recomputed,
    )
