"""The walk's ambient state: the one ``ContextVar`` of the walk, and why.

What a rule, a higher-order rule and the residual choice read about an
equation comes as an argument: the ``RuleContext`` the loop builds for it
(``_policy/_context.py``), handed on in the ``AmpContext`` of a sub-jaxpr's
walk (``_walk/_loop.py``). What stays here is what JAX's own tracing forces:
JAX traces a ``custom_jvp`` rule, a ``custom_vjp``'s fwd and bwd, and the
transpose of a ``jit`` or ``scan`` body when it chooses (under ``jax.grad``,
after the rule that bound them returned, or while an enclosing equation is
bound), through its own call stack, which no argument of jaxamp's crosses.
Such a trace must still find its walk's cast cache, held inputs and overflow
flags, whether it is recomputed and whether it stores residuals, which
policy records the keys it asks, and where a report logs the choices it
makes. It lives in one immutable
:class:`WalkState`, held by one ``ContextVar`` and replaced, never mutated,
by :func:`updated` for the extent of a ``with`` block (the equation loop sets
it once per walk, not per equation). A trace that starts inside a block sees the
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
        recording: the policy of the walk in progress (an ``AmpPolicy``;
            None outside one): a rule JAX traces while this walk binds (a
            ``custom_jvp``'s jvp of a rewrite another amp made with an equal
            policy) records the keys it asks here too
            (``_walk/_higher_order.rewrite_jaxpr``).
        residuals_off: the walk binds a rule JAX differentiates itself (a
            ``custom_jvp`` rule, a ``custom_vjp``'s fwd or bwd): its values are
            not stored compressed (``_policy/_residuals.py``).
        saved_choices: the list each checkpoint's saved-value choices are
            logged to while :func:`jaxamp.memory_report` traces the step
            (``_policy/_checkpoint.recording``); None: not logged.
    """

    held: Mapping[int, Any] | None = None
    recomputed: bool = False
    casts: dict | None = None
    flags: dict | None = None
    recording: Any = None
    residuals_off: bool = False
    saved_choices: list | None = None


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
