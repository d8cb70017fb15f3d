"""Registering a higher-order primitive: one entry of the registry.

:func:`register_higher_order` records a primitive's rewrite rule, its
description and its default policy entry as one
:class:`jaxamp._base._structure.HigherOrder` entry; every pass reads the
registry when it runs (``_base/_structure.py``). The walk's table
(:data:`higher_order_rules`) is a view of it, and
:data:`jaxamp.default_amp_policy` lists the registered default rules. The
built-in primitives are registered in ``_higher_order.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from .._base import _structure
from .._base._structure import HigherOrder, Run, Structure, run_once
from .._policy._rules import Rule, default_amp_policy
from ._loop import HigherOrderRule


class _Rules(Mapping):
    """Primitive name -> rewrite rule, read from the registry
    (``_base/_structure.py``) at each lookup."""

    def __getitem__(self, name: str) -> HigherOrderRule:
        entry = _structure.registered(name)
        if entry is None:
            raise KeyError(name)
        return entry.rule

    def get(self, name: str, default: Any = None) -> Any:
        entry = _structure.registered(name)
        return default if entry is None else entry.rule

    def __iter__(self) -> Iterator[str]:
        return iter(_structure.registered_names())

    def __len__(self) -> int:
        return len(_structure.registered_names())


# The walk's table: primitive name -> rule. ``amp`` hands it to the interpreter
# (``_loop.Pipeline``); a view of the registry, so rules registered (or
# unregistered) later apply too.
higher_order_rules: Mapping[str, HigherOrderRule] = _Rules()


def register_higher_order(
    *names: str,
    describe: Callable[[Any], Structure | None] | None = None,
    run: Run | None = run_once,
    default_rule: Rule | None = None,
) -> Callable[[HigherOrderRule], HigherOrderRule]:
    """Register ``rule(eqn, invals, ctx) -> outvals`` for primitive ``names``,
    with everything the other passes read: the one step that adds a
    higher-order primitive (public as :func:`jaxamp.extend.register_higher_order`).
    The rule gets the equation, its operands as the walk holds them and the
    walk's context, and returns its outputs in the dtypes the equation
    declares: :func:`jaxamp.extend.rewrite_subjaxprs` for a primitive whose
    sub-jaxprs keep their signatures, or a rule of one's own that rewrites
    them with :func:`jaxamp.extend.rewrite_jaxpr`.

    The registration is read when needed: by the walk of every ``amp`` and
    every policy (also ones built before it), and, with ``describe``, by
    every pass that sees through the primitive (value facts, the scan-input
    hoist, :func:`jaxamp.find_overflows`, the FLOP counter, the reports, the
    chunked optimizer update, the attention matcher; ``jaxamp._base._structure``);
    without ``describe`` they treat it as opaque (operands reach a matmul, it
    is bound as it is, its sub-jaxprs run once). A name registered again
    replaces its registration (keeping its description and default rule
    where none is given);
    :func:`unregister_higher_order` puts the replaced one back.

    Args:
        *names: one or more primitive names (``eqn.primitive.name``, e.g.
            ``"my_call"``).
        describe: ``describe(eqn) -> Structure | None``: which operands feed
            which sub-jaxpr inputs, carries, trip count, what kind of call it
            is (:class:`jaxamp.extend.Structure`);
            ``functools.partial(describe_call, dtypes_flow=True)`` for a plain
            call, whose one sub-jaxpr takes the equation's operands and gives
            its outputs and whose body's dtypes flow through (as ``jit``).
        run: ``run(eqn, invals, eval_sub) -> outputs``, the equation evaluated
            concretely with each sub-jaxpr evaluated by ``eval_sub(jaxpr,
            args)`` (for ``find_overflows``); the default runs each sub-jaxpr
            once on the operands ``describe`` names; None binds the primitive
            as it is. Ignored without ``describe``.
        default_rule: the primitive's entry in the default policy (the rewrite
            rule looks it up in the policy, e.g. a loop's carry dtypes): a
            policy built on :data:`jaxamp.default_amp_policy` that names no
            rule for the primitive takes it, and the table lists it; or None.

    Returns:
        A decorator that registers ``rule`` and returns it unchanged.

    Raises:
        TypeError: if no name is given, a name is not a string, or
            ``describe``, ``run`` or ``default_rule`` is not callable.
    """
    _check_names("register_higher_order", names)
    given = {"describe": describe, "run": run, "default_rule": default_rule}
    for arg, value in given.items():
        if value is not None and not callable(value):
            raise TypeError(
                f"register_higher_order({arg}=...): give a function or None, got "
                f"{type(value).__name__}."
            )

    def register(rule: HigherOrderRule) -> HigherOrderRule:
        for name in names:
            before = _structure.registered(name)
            keep = before is not None and describe is None
            default = default_rule
            if default is None and before is not None:
                default = before.default_rule
            entry = HigherOrder(
                rule,
                before.describe if keep else describe,
                before.run if keep else run,
                default,
            )
            _structure.register(name, entry)
            _list_default(name, None if before is None else before.default_rule)
        return rule

    return register


def unregister_higher_order(*names: str) -> None:
    """Remove the registration of each primitive in ``names`` made by
    :func:`register_higher_order`; where it replaced an earlier registration
    (a built-in primitive registered again) that one is in force again, else
    the primitive is unknown to jaxamp again (runs unchanged under ``amp``),
    its entry gone from :data:`jaxamp.default_amp_policy`.

    Args:
        *names: primitive names, as given to :func:`register_higher_order`.

    Raises:
        TypeError: if no name is given or a name is not a string.
        ValueError: if a name has no registration in force.
    """
    _check_names("unregister_higher_order", names)
    missing = [n for n in names if _structure.registered(n) is None]
    if missing:
        raise ValueError(
            f"unregister_higher_order: no registration of {missing} is in force "
            "(register_higher_order(name, ...)(rule) makes one)."
        )
    for name in names:
        removed = _structure.unregister(name)
        _list_default(name, removed.default_rule)


def _check_names(owner: str, names: tuple) -> None:
    if not names or not all(isinstance(n, str) for n in names):
        raise TypeError(
            f"{owner}(*names): give primitive names as strings, "
            f"e.g. {owner}('my_call'); got {names!r}."
        )


def _list_default(name: str, old_rule: Rule | None) -> None:
    """List the default rule of ``name``'s registration in force in
    :data:`jaxamp.default_amp_policy` (the public table; policies look the
    registry up themselves), or drop ``old_rule`` from it where there is
    none."""
    entry = _structure.registered(name)
    rule = None if entry is None else entry.default_rule
    if rule is not None:
        default_amp_policy[name] = rule
    elif old_rule is not None and default_amp_policy.get(name) is old_rule:
        del default_amp_policy[name]
