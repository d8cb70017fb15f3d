"""Reading and evaluating jaxprs: the helpers every pass shares.

An environment maps a jaxpr's variables to values; literals carry their own.
:func:`evaluate` is the plain walk (bind each equation through a callback)
that the scan-hoisting replay and :func:`jaxamp.find_overflows` run; the amp
interpreter (``_walk/_loop.py``) has its own loop for its regions, on the
same :func:`read` / :func:`write`. :func:`iter_equations` lists every
equation of a jaxpr and its sub-jaxprs (``jaxamp.tools.iter_equations``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax

from .. import _compat
from ._structure import trips


def is_var(v: Any) -> bool:
    """True for a jaxpr variable, False for a literal."""
    return not isinstance(v, _compat.Literal)


def read(env: dict, v: Any) -> Any:
    """The value of jaxpr variable or literal ``v`` in ``env``."""
    return v.val if isinstance(v, _compat.Literal) else env[v]


def write(env: dict, eqn: Any, outs: Any) -> None:
    """Bind ``eqn``'s output variables to ``outs`` (a list for primitives with
    multiple results, else one value)."""
    if eqn.primitive.multiple_results:
        env.update(zip(eqn.outvars, outs))
    else:
        env[eqn.outvars[0]] = outs


def named_subs(params: dict) -> list[tuple[Any, Any]]:
    """``(param value, core jaxpr)`` of each sub-jaxpr of an equation
    (tuple-valued params such as ``cond``'s branches included)."""
    out = []
    for val in params.values():
        for sub in val if isinstance(val, (tuple, list)) else (val,):
            if _compat.is_jaxpr(sub):
                out.append((sub, _compat.jaxpr_parts(sub)[0]))
    return out


def bind_eqn(eqn: Any, invals: Sequence[Any], params: dict | None = None) -> list:
    """Bind ``eqn``'s primitive on ``invals`` (with ``params`` in place of its
    own, if given) under its source info and name stack; a list of outputs."""
    params = eqn.params if params is None else params
    with _compat.eqn_context(eqn):
        out = _compat.bind(
            eqn.primitive, invals, _compat.bind_params(eqn.primitive, params)
        )
    return list(out) if eqn.primitive.multiple_results else [out]


def evaluate(
    core: Any,
    consts: Sequence[Any],
    args: Sequence[Any],
    eval_eqn: Callable[[Any, list], list],
) -> list:
    """Evaluate open jaxpr ``core`` on ``consts`` and ``args``.

    Args:
        core: an open jaxpr.
        consts: values of ``core.constvars``.
        args: values of ``core.invars``.
        eval_eqn: ``eval_eqn(eqn, invals) -> list of outputs`` for each
            equation, in order (:func:`bind_eqn` binds it as it is).

    Returns:
        The values of ``core.outvars``.
    """
    env = dict(zip(core.constvars, consts))
    env.update(zip(core.invars, args))
    for eqn in core.eqns:
        outs = eval_eqn(eqn, [read(env, v) for v in eqn.invars])
        env.update(zip(eqn.outvars, outs))
    return [read(env, v) for v in core.outvars]


def check_jaxpr(closed: Any) -> Any:
    """``closed`` if it is a jaxpr, else a TypeError naming what to pass."""
    if not _compat.is_jaxpr(closed):
        raise TypeError(
            "expected a jaxpr, e.g. jax.make_jaxpr(jax.grad(loss))(*args); got "
            f"{type(closed).__name__}."
        )
    return closed


def _inner_weight(eqn: Any, weight: float) -> float:
    # The static trip count of a loop's body (_structure.py).
    return weight * trips(eqn)


def iter_equations(closed: Any, weight: float = 1.0) -> Iterator[tuple[Any, float]]:
    """Every equation of a jaxpr and of all its sub-jaxprs, depth first.

    Each equation comes with how many times it runs per call of ``closed``, as
    far as that is static: ``scan`` bodies are weighted by ``length``;
    ``while`` bodies (trip count unknown) and every ``cond`` branch get the
    weight of the equation that holds them.

    Args:
        closed: a ``ClosedJaxpr`` or ``Jaxpr``.
        weight: the weight of the top-level equations.

    Yields:
        ``(equation, weight)`` pairs; a higher-order equation comes before the
        equations of its sub-jaxprs.

    Raises:
        TypeError: if ``closed`` is not a jaxpr.
    """
    core, _ = _compat.jaxpr_parts(check_jaxpr(closed))
    for eqn in core.eqns:
        yield eqn, weight
        for sub in _compat.sub_jaxprs(eqn.params):
            yield from iter_equations(sub, _inner_weight(eqn, weight))


# The name of the jit call that prepares one operand of a product (an 8-bit
# rule's quantization of it: the 8-bit array and its scale). The call's outputs
# carry no gradient, so the scan rule may compute it for every layer before
# the loop (``_walk/_scan_hoist.py``) where its input is a stacked weight.
PREPARE_CALL = "jaxamp_prepare_operand"


def prepare_operand(fn: Callable[[Any], Any], x: Any) -> Any:
    """``fn(x)`` as a jit call named :data:`PREPARE_CALL` on
    ``lax.stop_gradient(x)``: differentiation never enters the call (its
    outputs carry no gradient). ``fn`` must be a pure function of ``x``."""

    def jaxamp_prepare_operand(v):
        return fn(v)

    return jax.jit(jaxamp_prepare_operand)(jax.lax.stop_gradient(x))


def is_prepare(eqn: Any) -> bool:
    """``eqn`` is a call made by :func:`prepare_operand`."""
    return eqn.params.get("name") == PREPARE_CALL and any(
        _compat.is_jaxpr(v) for v in eqn.params.values()
    )
