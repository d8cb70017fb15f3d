"""The per-equation analysis of :func:`jaxamp.precision_report`, run when a
per-equation view asks for it (:attr:`PrecisionReport.records
<jaxamp.tools.PrecisionReport.records>`, the printout's equation table, the
plot, the JSON), once per report: the differential walk lowered as one
function (:func:`_precision_rank.lower_walk`), compiled and run, and its
statistics turned into one :class:`SiteRecord` per equation instance. The
ranking (:meth:`~jaxamp.tools.PrecisionReport.scopes`) does not need it,
except past ``_precision_ablate.MAX_MEASURED`` scopes, where its first-order
estimate shortlists the scopes measured."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import _compat
from .._base._dtypes import is_float
from .._base._formats import lookup, name_of
from .._base._prims import MATMULS
from .._base._scopes import scope_path
from .._base._structure import describe
from ._precision_rank import lower_walk, run_walk
from ._precision_walk import Site

_TRANSCENDENTAL = {
    "exp",
    "exp2",
    "log",
    "log1p",
    "logistic",
    "tanh",
    "rsqrt",
    "sqrt",
    "erf",
    "erf_inv",
    "pow",
    "expm1",
}


def op_group(eqn: Any) -> str:
    """The op group of an equation's primitive, for the heatmap's columns."""
    name = eqn.primitive.name
    if name in MATMULS:
        return "matmul"
    if name in _TRANSCENDENTAL:
        return "exp/log/root"
    if name.startswith(("reduce_", "cumsum", "cumlogsumexp", "argmax", "argmin")):
        return "reduction"
    if describe(eqn) is not None:  # a higher-order equation run whole
        return "region"
    return "elementwise"


@dataclasses.dataclass
class SiteRecord:
    """One equation instance of the report (JSON-serialisable).

    Attributes:
        scope: the ``named_scope`` path (``""`` outside any scope).
        iteration: the enclosing ``scan`` iterations, outermost first.
        primitive: the primitive's name.
        group: its op group (``"matmul"``, ``"elementwise"``, ...).
        source: the user's line, ``"file.py:LINE:COL (function)"``.
        format: the low-precision format it ran in (``"bfloat16"``,
            ``"int8"``, ``"float8_e4m3fn"``, ``"float32"``; an 8-bit format
            added by :func:`jaxamp.extend.register_format` by its name).
        local_error: relative L2 error of amp's equation on the float32 inputs.
        propagated_error: relative L2 error of amp's value.
        overflow: fraction of output elements non-finite in amp's local value
            where float32's is finite.
        underflow: fraction of output elements flushed to zero in amp's local
            value where float32's is not zero.
        peak: the largest float32 output magnitude.
        format_max: the largest finite value of the output's amp dtype.
        loss_share: first-order share of the loss error, ``|<g, dy_local>|``.
        grad_share: local backward error ``|VJP_amp - VJP_32|`` relative to
            the float32 gradient's norm.
    """

    scope: str
    iteration: tuple
    primitive: str
    group: str
    source: str
    format: str
    local_error: float
    propagated_error: float
    overflow: float
    underflow: float
    peak: float
    format_max: float
    loss_share: float
    grad_share: float


def _format(site: Site, cache: dict) -> tuple[str, bool]:
    """``(format, reduced)``: the narrowest dtype amp's step computes in (an
    8-bit format of a product where it has one) and whether any value of the
    step is narrower than float32; from its jaxpr, cached per equation (and
    enclosing scopes) in ``cache``."""
    key = (id(site.eqn), site.scopes)
    if key not in cache:
        n = len(site.stack)
        avals = [
            jax.ShapeDtypeStruct(
                np.shape(x)[n:], getattr(x, "dtype", None) or jnp.result_type(x)
            )
            for x in site.x32
        ]
        closed = jax.make_jaxpr(site.run_amp)(avals)
        fmt, reduced = "float32", False
        for eqn in closed.jaxpr.eqns + _inner(closed.jaxpr):
            ops = [np.dtype(v.aval.dtype) for v in eqn.invars]
            if eqn.primitive.name in MATMULS and all(d.itemsize == 1 for d in ops):
                fmt, reduced = name_of(ops[0]), True  # a registered format's name
                break
            avals = (*eqn.invars, *eqn.outvars)
            low = [
                np.dtype(v.aval.dtype)
                for v in avals
                if is_float(v.aval.dtype) and np.dtype(v.aval.dtype).itemsize < 4
            ]
            if low:
                reduced = True
                fmt = low[0].name if fmt == "float32" else fmt
        cache[key] = (fmt, reduced)
    return cache[key]


def _inner(jaxpr: Any) -> list:
    out = []
    for eqn in jaxpr.eqns:
        for sub in _compat.sub_jaxprs(eqn.params):
            core = _compat.jaxpr_parts(sub)[0]
            out.extend(core.eqns + _inner(core))
    return out


def _site_meta(site: Site, cache: dict) -> tuple:
    """What a record keeps of a traced site: equation, scopes, iterations,
    format."""
    has_float = any(is_float(getattr(y, "dtype", None)) for y in site.y32)
    fmt = _format(site, cache)[0] if has_float else ""
    return site.eqn, site.scopes, site.iteration, fmt


def _record(meta: tuple, row: np.ndarray, grad_norm: float) -> SiteRecord:
    eqn, scopes, iteration, fmt = meta
    name = eqn.primitive.name
    fmax = 127.0
    if fmt and lookup(fmt) is not None:  # an 8-bit format: its bound
        fmax = lookup(fmt).bound
    elif fmt.startswith(("float", "bfloat")):
        fmax = float(jnp.finfo(fmt).max)
    local, prop, over, under, peak, loss_share, back = (float(v) for v in row)
    loss_share = loss_share if np.isfinite(loss_share) else float("inf")
    return SiteRecord(
        scope_path(scopes),
        iteration,
        name,
        op_group(eqn),
        _compat.source_line(eqn),
        fmt,
        local,
        prop,
        over,
        under,
        peak,
        fmax,
        loss_share,
        back / grad_norm if grad_norm else 0.0,
    )


class Analysis:
    """The per-equation analysis of one report, run on first use and kept.

    Args:
        trace: ``(core, consts, leaves, wrt, ctx, edge)``: the float32 jaxpr of
            the flattened loss, its constants, its input leaves, the indices
            of the parameters among them, the amp context and the facts
            boundary of its outputs (:func:`_precision_report._trace`); may be
            set after construction, before :meth:`walk`.
        cache: the per-equation format cache (:func:`_format`), shared with
            the ranking's scope discovery.
        scale: the static loss scale of amp's backward pass.
    """

    def __init__(self, trace: tuple | None, cache: dict, scale: float):
        self.trace, self.cache, self.scale = trace, cache, scale
        self.result: tuple | None = None

    def fmt(self, site: Site) -> tuple[str, bool]:
        """:func:`_format` of ``site``, cached."""
        return _format(site, self.cache)

    def walk(self) -> tuple:
        """:func:`_precision_rank.run_walk`'s result: the walk compiled and run
        on the first call, kept for the next."""
        if self.result is None:
            lowered, box = lower_walk(*self.trace, self.fmt, self.scale)
            self.result = run_walk(lowered, box)
        return self.result

    def records(self, grad_norm: float) -> list[SiteRecord]:
        """One :class:`SiteRecord` per equation instance, in walk order; the
        backward errors relative to ``grad_norm`` (the float32 gradient's
        L2 norm)."""
        sites, stats, _, _, back_all, _ = self.walk()
        return [
            _record(_site_meta(st, self.cache), [*row, bk], grad_norm)
            for st, row, bk in zip(sites, stats, back_all)
        ]
