"""The walk state: what the interpreter's helpers share while amp binds.

Rules receive their context as an argument (``_policy/_context.RuleContext``,
built by the interpreter per equation). What stays here is what JAX's own
tracing reaches without an argument to carry it: a ``custom_jvp`` rule or a
``custom_vjp``'s fwd and bwd that JAX traces after the rule that bound them
returned (under ``jax.grad``), and a ``scan`` or ``jit`` body it re-traces,
must still find the trace's cast cache, its held inputs and overflow flags,
and whether they are recomputed; and a rule with jaxamp 0.0.4's signature
that calls a context rule by hand gets the equation's facts from here
(``_context.from_walk``). It lives in one immutable :class:`WalkState`, held
by one ``ContextVar`` and replaced, never mutated, by :func:`updated` for the
extent of a ``with`` block. A trace that starts inside a block sees the
block's state; nested blocks restore the outer state on exit.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any


@dataclasses.dataclass(frozen=True)
class WalkState:
    """What one jaxpr walk shares with the rules it calls.

    Attributes:
        held: ``id(value) -> value`` of the walk's inputs that stay alive for
            the whole step anyway: the amp'd function's arguments and
            closed-over values (parameters, batch) and the ``scan``/``jit``
            inputs bound to them, which JAX's partial evaluation forwards
            instead of copying. None outside a walk.
        recomputed: the walk is inside a user's ``jax.checkpoint`` body, whose
            residuals are recomputed anyway.
        casts: the cast cache of the current trace, ``(id(value), dtype) ->
            (value, cast value)``: one value cast once per dtype. None: no cache.
        flags: the overflow check's cache of non-finite flags of the current
            trace, ``id(value) -> (value, flag)``; None: no check.
        facts: the value facts of the equation being bound (an
            ``EqnFacts``; None outside a walk: every fact unknown).
        scopes: the ``named_scope`` components of the equation being bound,
            outermost first (with the enclosing equations' prefix).
        policy: the policy of the walk (an ``AmpPolicy``; None outside one).
        residuals_off: the walk binds a rule JAX differentiates itself (a
            ``custom_jvp`` rule, a ``custom_vjp``'s fwd or bwd): its values are
            not stored compressed (``_policy/_residuals.py``).
    """

    held: Mapping[int, Any] | None = None
    recomputed: bool = False
    casts: dict | None = None
    flags: dict | None = None
    facts: Any = None
    scopes: tuple = ()
    policy: Any = None
    residuals_off: bool = False


_WALK: contextvars.ContextVar[WalkState] = contextvars.ContextVar(
    "jaxamp_walk",
    default=WalkState(),  # noqa: B039 (frozen: replaced, never mutated)
)


def current() -> WalkState:
    """The walk state in force."""
    return _WALK.get()


@contextlib.contextmanager
def updated(**changes: Any) -> Iterator[WalkState]:
    """Replace fields of the walk state for the extent of the block.

    Args:
        **changes: :class:`WalkState` fields and their new values.

    Yields:
        The new state.
    """
    state = dataclasses.replace(_WALK.get(), **changes)
    token = _WALK.set(state)
    try:
        yield state
    finally:
        _WALK.reset(token)


def recomputing(active: bool = True) -> contextlib.AbstractContextManager:
    """Mark the walks in the block as inside a user's ``jax.checkpoint``
    (``active=False`` keeps the enclosing mark)."""
    return updated(recomputed=active or current().recomputed)


def fresh_trace() -> contextlib.AbstractContextManager:
    """A fresh cast cache and overflow-flag cache for a new trace: a value
    traced in one jaxpr must never be served to another (it would leak a
    tracer). The overflow check stays on or off as it is."""
    flags = None if current().flags is None else {}
    return updated(casts={}, flags=flags)
