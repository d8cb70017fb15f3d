"""Attention as a pattern rewrite (``_walk._loop.Region``).

Each matched group (``_match.py``) is one region: at its first equation the
policy decides (:func:`jaxamp.attention_rule`); a group left alone is walked
as usual; a re-dispatched one skips its equations and writes the p·v output at
its last.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np

from ... import _compat
from ..._base._cast import cast
from ..._base._dtypes import is_float
from ..._base._jaxpr import read
from ..._walk._loop import PatternRewrite, Region, Walk
from ._intercept import intercept, marked_spec, not_intercepting, unpack
from ._match import plan


def regions(jaxpr: Any, facts: Any) -> list[Region]:
    """One :class:`Region` per matched attention group of ``jaxpr``."""
    del facts
    groups = {id(g): g for g in plan(jaxpr).values()} if jaxpr.eqns else {}
    return [
        Region(g.eqns, functools.partial(_start, g), _finish)
        for g in sorted(groups.values(), key=lambda g: g.first)
    ]


REWRITE = PatternRewrite("attention", regions, intercept)


def _start(group: Any, walk: Walk) -> Any:
    """The policy's decision at the group's first equation: ``(group, mode)``
    to re-dispatch it (``mode`` None: an intercepted call that asked for cuDNN
    in an ``amp_stop`` region, run as written), or None to leave it alone."""
    mode = group.mode(walk.ctx)
    if mode is None and group.marked and group.marked.requested:
        return (group, None)
    if mode in (None, "off"):
        return None
    return (group, mode)


def _finish(walk: Walk, token: Any) -> Any:
    """The group's output, written at its last equation (None: a
    one-equation group declined, the equation is walked as usual)."""
    group, mode = token
    eqn = walk.jaxpr.eqns[group.last]
    with _compat.eqn_context(eqn):
        if mode is None:  # amp_stop: as written, cuDNN too
            return _as_traced(eqn, walk.env)
        rc = walk.context(group.last)
        return group.run(walk.read, rc, group.mode(walk.ctx), _where(eqn))


def _where(eqn: Any) -> str:
    frame = _compat.user_frame(eqn)
    return "dot_product_attention" + (f" at {frame}" if frame else "")


def _as_traced(eqn: Any, env: dict) -> Any:
    """An intercepted call that asked for cuDNN, run as the model wrote it (in an
    ``amp_stop`` region): on its traced dtypes, JAX's own checks and errors."""
    spec = marked_spec(eqn)
    vals = [read(env, v) for v in eqn.invars]
    vals = [
        cast(x, v.aval.dtype) if is_float(np.dtype(x.dtype)) else x
        for x, v in zip(vals, eqn.invars)
    ]
    q, k, v, bias, mask, qs, kvs = unpack(spec, vals)
    with not_intercepting():
        out = jax.nn.dot_product_attention(
            q,
            k,
            v,
            bias,
            mask,
            scale=spec.scale,
            is_causal=spec.is_causal,
            query_seq_lengths=qs,
            key_value_seq_lengths=kvs,
            local_window_size=spec.local_window_size,
            implementation="cudnn",
        )
    return [out]
