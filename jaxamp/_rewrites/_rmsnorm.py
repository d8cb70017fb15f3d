"""The RMSNorm region: one pattern rewrite (see ``_walk._loop.Region``).

The facts pass marks an RMSNorm scaling (``x * rsqrt(mean(x * x) + eps)``,
``x / sqrt(sum(x * x))``: ``rms_scaling``) and its operands (the square, Flax's
shift: ``rms_operand``), which the default rules run in float32. Where the
statistic's intermediate values have no other reader, this rewrite runs the
square, statistic and scaling together; when a low-precision ``x`` enters them
outside a user's ``jax.checkpoint``, inside one ``jax.checkpoint`` (named
scope :data:`RMS_SCOPE`): the backward pass saves the low-precision ``x`` and
recomputes the float32 normalisation, instead of saving a float32 copy of
``x``; within it the cotangents of ``x`` meet in float32 and are rounded once.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Sequence
from typing import Any

import jax

from .._base import _state
from .._base._cast import cast_cache
from .._base._dtypes import is_low
from .._base._jaxpr import is_var, named_subs
from .._base._scopes import marker
from .._policy._compressed import store_compressed
from .._walk._loop import PatternRewrite, Region, Walk

# Scope of the checkpoint in which an RMSNorm's statistic and scaling run.
RMS_SCOPE = marker("jaxamp_rms_norm")


def regions(jaxpr: Any, facts: Sequence) -> list[Region]:
    """The RMSNorm regions of ``jaxpr`` (see :func:`region_indices`)."""
    return [
        Region(idx, functools.partial(_start, idx), _run)
        for idx in region_indices(jaxpr, facts)
    ]


REWRITE = PatternRewrite("rms_norm", regions)


def _start(region: tuple[int, ...], walk: Walk) -> tuple[int, ...]:
    del walk
    return region  # always replaced


def _run(walk: Walk, region: tuple[int, ...]) -> Any:
    """Run the region's equations under their rules and return the scaling's
    output (inside one ``jax.checkpoint`` when a low-precision value enters
    them outside a user's checkpoint)."""
    return run_region(walk, region, RMS_SCOPE)


def run_region(
    walk: Walk, region: tuple[int, ...], scope: str, input_var: Any = None
) -> Any:
    """Run equations ``region`` of ``walk`` under their rules and return the
    last one's output: inside one ``jax.checkpoint`` (named scope ``scope``)
    when a low-precision value enters them (``input_var``'s, if given) outside
    a user's checkpoint, so that the backward pass saves their inputs and
    recomputes the rest. With a residual format in force the values entering
    the region are saved in it instead (``_policy/_residuals.py``) and the
    region is recomputed from them."""
    eqns = [walk.jaxpr.eqns[j] for j in region]
    made = {v for e in eqns for v in e.outvars}
    leaves = list(
        dict.fromkeys(v for e in eqns for v in e.invars if is_var(v) and v not in made)
    )

    def run(*vals):
        local = dict(zip(leaves, vals))
        for j in region:
            walk.run_eqn(j, local)
        return local[eqns[-1].outvars[0]]

    vals = [walk.env[v] for v in leaves]
    # The entering values are stored in the last equation's residual format.
    fmt = walk.context(region[-1]).residual_format
    if fmt is not None:
        with jax.named_scope(scope):
            outs = store_compressed(run, vals, fmt, recomputed=True)
        if outs is not None:
            return outs
    entering = vals if input_var is None else [walk.env[input_var]]
    if _state.current().recomputed or not any(map(is_low, entering)):
        return run(*vals)

    def recomputed_run(*vals):
        with cast_cache(), _state.recomputing():  # casts traced here stay here
            return run(*vals)

    with jax.named_scope(scope):
        return jax.checkpoint(recomputed_run)(*vals)


def region_indices(jaxpr: Any, facts: Sequence) -> list[tuple[int, ...]]:
    """Per RMSNorm scaling ``k`` (an ``rms_scaling`` equation), the equations
    that are both descendants of its square and ancestors of ``k`` (plus the
    square and Flax's shift), where no value they compute is read outside that
    set or returned, and none has sub-jaxprs or several results; regions never
    overlap.

    Args:
        jaxpr: an open jaxpr.
        facts: its per-equation facts (``_facts.with_boundary``).

    Returns:
        The regions' equation indices, each ascending with ``k`` last.
    """
    scalings = {k: f.rms_operand_eqns for k, f in enumerate(facts) if f.rms_scaling}
    found = []
    eqns = jaxpr.eqns
    index = {id(e): j for j, e in enumerate(eqns)}
    readers: dict[Any, set[int]] = collections.defaultdict(set)
    for j, e in enumerate(eqns):
        for v in e.invars:
            if is_var(v):
                readers[v].add(j)
    returned = {v for v in jaxpr.outvars if is_var(v)}
    taken: set[int] = set()
    for k, operands in sorted(scalings.items()):
        s = index[id(operands[0])]  # the square
        desc = set(eqns[s].outvars)
        below: set[int] = set()
        for j in range(s + 1, k + 1):
            if any(is_var(v) and v in desc for v in eqns[j].invars):
                below.add(j)
                desc.update(eqns[j].outvars)
        need = {v for v in eqns[k].invars if is_var(v)}
        above: set[int] = set()
        for j in range(k - 1, s - 1, -1):
            if any(v in need for v in eqns[j].outvars):
                above.add(j)
                need.update(v for v in eqns[j].invars if is_var(v))
        region = (below & above) | {s, k} | {index[id(e)] for e in operands[1:]}
        members = region - {k}
        exclusive = all(
            v not in returned and readers[v] <= region
            for j in members
            for v in eqns[j].outvars
        )
        if (
            not exclusive
            or region & taken
            or any(
                eqns[j].primitive.multiple_results or named_subs(eqns[j].params)
                for j in region
            )
        ):
            continue
        taken |= region
        found.append(tuple(sorted(region)))
    return found
