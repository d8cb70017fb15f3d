"""``precision_report``: where a mixed-precision training step loses accuracy,
and the smallest policy change that wins it back.

The float32 and the amp step are compared on the same inputs in one
differential walk (``_precision_walk.py``; loops walked as loops): per
equation the *local* error (amp's equation fed the float32 inputs, PyTorch's
shadow loggers, ``torch.ao.ns._numeric_suite_fx``) and the *propagated* error
(amp's value against float32's), grouped by ``jax.named_scope`` path and loop
iteration. Per equation, first-order shares from one backward pass (every
site's float32 cotangent ``g = dL/dy``): ``|<g, y_local - y_32>|`` for the
loss and ``|VJP_amp(x_32; g) - VJP_32(x_32; g)|`` (the local error of the
backward pass amp runs for it) for the gradient.

Scopes are ranked by what restoring them buys: each scope's local forward and
backward errors are propagated through the rest of the step by re-running
the probed float32 gradient (``probed_gradient``) with them as probes, one
scope at a time inside the one compiled function;
the shares of the model's total gradient (and loss) error each scope's part
removes order them. The idea of ranking layers by sensitivity times
perturbation is HAWQ's (Dong et al., 2019); the greedy fallback of the worst
ops to higher precision until a target is met is Intel Neural Compressor's
``AutoMixedPrecisionTuneStrategy``; AIMET's QuantAnalyzer measures per-layer
ablations (one evaluation per layer), which the benchmark uses as the ground
truth. The plain-text table and the PNG are in ``_precision_plot.py``.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .. import _compat
from .._amp import DEFAULT_PIPELINE, amp, compute_dtype_or_default
from .._base._dtypes import is_float
from .._base._formats import lookup, name_of
from .._base._prims import MATMULS
from .._base._scopes import scope_path
from .._base._structure import describe
from .._policy._lookup import AmpPolicy
from .._policy._rules import default_amp_policy
from .._walk._loop import AmpContext
from . import _precision_plot, _precision_suggest
from ._precision_rank import (
    backward_deltas,
    norms,
    per_iteration,
    probe_shapes,
    probed_gradient,
    scope_effects,
    with_share,
)
from ._precision_walk import DiffVisitor, Site, traverse

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
            added by :func:`jaxamp.quant.register_format` by its name).
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


def _sums(got: list, want: list) -> tuple[np.ndarray, np.ndarray]:
    """Per array pair, ``sum |g - w|^2`` and ``sum |w|^2`` (float64)."""
    num, den = [], []
    for g, w in zip(got, want):
        w = np.asarray(w, np.float64).ravel()
        d = np.asarray(g, np.float64).ravel() - w
        num.append(d @ d)
        den.append(w @ w)
    return np.asarray(num, np.float64), np.asarray(den, np.float64)


def _rel(num: float, den: float) -> float:
    return float((num / den) ** 0.5) if den else float(num > 0)


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


def _leaf_paths(tree: Any, depth: int) -> list[str]:
    """Per array leaf of ``tree``, its group: the first ``depth`` keys of its
    pytree path joined by ``/`` (``"layers/qkv"``)."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return [
        "/".join(_key_name(k) for k in path[:depth]) or "params" for path, _ in flat
    ]


def _key_name(k: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def _group_errors(num: np.ndarray, den: np.ndarray, names: list[str]) -> dict:
    """Relative L2 error ``sqrt(sum |g - r|^2 / sum |r|^2)`` in total
    (``"total"``) and per group (``names[i]``: array ``i``'s) from the
    per-array sums (:func:`_sums`)."""
    out = {"total": _rel(num.sum(), den.sum())}
    for name in dict.fromkeys(names):
        idx = [i for i, n in enumerate(names) if n == name]
        out[name] = _rel(num[idx].sum(), den[idx].sum())
    return out


def amp_gradients(
    fn: Callable,
    args: tuple,
    kwargs: dict,
    compute_dtype: Any,
    policy: Any,
    has_aux: bool,
    scale: float,
) -> tuple[float, list]:
    """``(loss, gradient leaves w.r.t. args[0]'s float arrays)`` of one amp
    step under ``policy``, jitted; the loss multiplied by ``scale`` before
    differentiating and the gradient divided by it (static loss scaling)."""
    lowered, dynamic = _amp_step(
        fn, args, kwargs, compute_dtype, policy, has_aux, scale
    )
    loss, leaves = lowered.compile()(dynamic)
    return float(loss), leaves


def _amp_step(fn, args, kwargs, compute_dtype, policy, has_aux, scale) -> tuple:
    """:func:`amp_gradients`' step, lowered (traced here, under the caller's
    JAX configuration), and its array arguments."""
    f = amp(fn, compute_dtype=compute_dtype, amp_policy=policy)

    def scaled(p, *rest):
        out = f(p, *rest, **kwargs)
        loss = (out[0] if has_aux else out).astype(jnp.float32)
        return loss * np.float32(scale), loss

    dynamic, static = eqx.partition(args, eqx.is_array)

    def step(dynamic):
        a = eqx.combine(dynamic, static)
        (_, loss), g = eqx.filter_value_and_grad(scaled, has_aux=True)(*a)
        leaves = jax.tree.leaves(eqx.filter(g, eqx.is_array))
        return loss, [x / np.float32(scale) for x in leaves]

    # Compiled as the user's step is (default options), the unscaling inside:
    # the measured error is the step's own.
    return jax.jit(step).lower(dynamic), dynamic


def precision_report(
    loss_fn: Callable,
    *args: Any,
    compute_dtype: Any = None,
    amp_policy: Mapping[Any, Any] = default_amp_policy,
    has_aux: bool = False,
    loss_scale: float | None = None,
    group_depth: int = 1,
    **kwargs: Any,
) -> PrecisionReport:
    """Where ``amp(loss_fn)`` loses accuracy against float32, per equation,
    ``named_scope`` path, scan iteration and parameter group.

    Runs amp's own jitted step, then one compiled function: the float32 and
    the amp step on the same inputs in one differential walk (see
    ``jaxamp/_tools/_precision_walk.py``; a loop's body traced once), one
    backward pass for every equation's float32 cotangent, each equation's
    backward pass at the float32 point, and the float32 gradient re-run once
    per scope with that scope's local errors added (the ranking). amp's own
    jitted step is compiled and run in a second thread meanwhile.

    Args:
        loss_fn: ``loss_fn(params, *rest, **kwargs)`` returning a float scalar
            loss (or ``(loss, aux)`` with ``has_aux``); ``params`` a pytree
            (dicts, Equinox modules; for Flax NNX pass ``nnx.split``'s state).
        *args: its arguments; gradients are taken w.r.t. the float arrays of
            ``args[0]``; other array leaves are inputs, non-arrays static.
        compute_dtype: amp's compute dtype; None: amp's default (:func:`jaxamp.amp`).
        amp_policy: amp's policy (default :data:`jaxamp.default_amp_policy`;
            e.g. :func:`jaxamp.int8_policy` or :func:`jaxamp.fp8_policy`).
        has_aux: ``loss_fn`` returns ``(loss, aux)``.
        loss_scale: static loss scale of amp's backward pass; default
            ``2**15`` for float16, else 1.
        group_depth: how many pytree path keys of ``args[0]`` name a
            parameter group (1: top-level keys).
        **kwargs: keyword arguments of ``loss_fn`` (arrays or static).

    Returns:
        A :class:`PrecisionReport`.

    Raises:
        TypeError: if ``loss_fn`` is not callable or ``args`` is empty.
        ValueError: if the loss is not a float scalar, ``compute_dtype`` is
            not a float dtype or ``group_depth`` is below 1.
    """
    if not callable(loss_fn) or not args:
        raise TypeError(
            "precision_report(loss_fn, params, *batch): loss_fn must be callable "
            f"and params given, got {type(loss_fn).__name__} and {len(args)} args."
        )
    if not (isinstance(group_depth, int) and group_depth >= 1):
        raise ValueError(
            f"precision_report(group_depth=...) must be an int >= 1, got "
            f"{group_depth!r}; 1 groups parameters by their top-level keys."
        )
    cd = compute_dtype_or_default(compute_dtype)
    out = jax.eval_shape(lambda: loss_fn(*args, **kwargs))
    _check_loss(out[0] if has_aux else out)
    scale = float(loss_scale or (2.0**15 if cd == np.float16 else 1.0))
    # amp's own step (its gradient is the error the ranking apportions) is
    # traced here, under the caller's JAX configuration, and compiled and run
    # in a second thread while the analysis is (XLA releases Python's lock).
    cache: dict = {}
    job = _amp_step(loss_fn, args, kwargs, cd, amp_policy, has_aux, scale)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        amp_step = pool.submit(lambda: job[0].compile()(job[1]))
        walk = _walk(loss_fn, args, kwargs, cd, amp_policy, has_aux, cache, scale)
        lossa, ga = amp_step.result()
    sites, stats, g32, loss32, back_all, effect = walk
    sums = _sums(ga, g32)
    norm = float(sums[1].sum()) ** 0.5
    records = [
        _record(_site_meta(st, cache), [*row, bk], norm)
        for st, row, bk in zip(sites, stats, back_all)
    ]
    runner = _precision_suggest.Runner(
        loss_fn, args, kwargs, cd, amp_policy, has_aux, scale, g32, loss32,
        amp_gradients,
    )  # fmt: skip
    return _assemble(runner, records, group_depth, float(lossa), ga, effect, sums)


def _assemble(runner, records, group_depth, lossa, ga, effect, sums) -> PrecisionReport:
    """The report: amp's measured gradient against float32's per parameter
    group (``sums``: :func:`_sums` of the two), the records, each scope's
    estimated effect, the runner for ``suggest``."""
    r = runner
    params = eqx.filter(r.args[0], eqx.is_array)
    names = [
        n
        for n, x in zip(_leaf_paths(params, group_depth), jax.tree.leaves(params))
        if is_float(x.dtype)
    ]
    tree = jax.tree.structure(eqx.filter(params, lambda x: is_float(x.dtype)))
    scopes, d_loss, dots, sq, model_sq = effect
    meas_sq = float(sums[0].sum())
    fit = (model_sq / meas_sq) ** 0.5 if meas_sq else float("nan")
    loss_err = float(np.sum(d_loss))  # the model's loss error
    grad_removed = {
        k: float((2 * d - n) / model_sq) if model_sq else 0.0
        for k, d, n in zip(scopes, dots, sq)
    }
    loss_removed = {
        k: float((abs(loss_err) - abs(loss_err - dl)) / abs(loss_err))
        if loss_err
        else 0.0
        for k, dl in zip(scopes, d_loss)
    }
    return PrecisionReport(
        records=records,
        loss32=r.loss32,
        loss=lossa,
        grad_errors=_group_errors(*sums, names),
        compute_dtype=np.dtype(r.compute_dtype).name,
        grads=jax.tree.unflatten(tree, ga),
        grads32=jax.tree.unflatten(tree, r.g32),
        runner=r,
        removed={"grad": grad_removed, "loss": loss_removed},
        linear_fit=float(fit),
    )


def _check_loss(loss: Any) -> None:
    if not (jnp.ndim(loss) == 0 and jnp.issubdtype(loss.dtype, jnp.floating)):
        raise ValueError(
            "precision_report: loss_fn must return a float scalar (or "
            f"(loss, aux) with has_aux=True), got {jax.typeof(loss)}."
        )


def _walk(fn, args, kwargs, cd, policy, has_aux, cache, scale):
    """Trace ``fn``; the differential walk's sites, their float32
    cotangents, the float32 gradient (leaves of ``args[0]``'s float arrays),
    the float32 loss, the backward errors and each scope's effect (see
    :func:`_compiled_walk`)."""
    dynamic, static = eqx.partition((args, kwargs), eqx.is_array)
    leaves, treedef = jax.tree_util.tree_flatten(dynamic)
    n0 = len(jax.tree.leaves(eqx.filter(args[0], eqx.is_array)))
    wrt = [i for i in range(n0) if is_float(leaves[i].dtype)]

    def flat(*xs):
        a, kw = eqx.combine(jax.tree_util.tree_unflatten(treedef, xs), static)
        out = fn(*a, **kw)
        return [out[0] if has_aux else out]

    core, consts = _compat.jaxpr_parts(jax.make_jaxpr(flat)(*leaves))
    ctx = AmpContext(cd, AmpPolicy(policy), DEFAULT_PIPELINE)
    edge = ((0,) * len(core.outvars), None)
    reduced = lambda site: _format(site, cache)[1]  # noqa: E731
    return _compiled_walk(core, consts, leaves, wrt, ctx, edge, reduced, scale)


def _compiled_walk(core, consts, leaves, wrt, ctx, edge, reduced, scale):
    """One compiled function: the differential walk, the probed float32
    gradient, every reduced site's backward error, and each scope's effect:
    the probed gradient (:func:`probed_gradient`) re-run with the scope's
    local forward and backward errors as probes, minus the unprobed one,
    i.e. the change of the loss and of the gradient those errors cause
    through the rest of the step (exact propagation of the local errors; one
    evaluation per scope, :func:`scope_effects`).

    Returns the sites (their values concrete, read back from its outputs),
    their statistics, the float32 gradient, the float32 loss, the backward
    errors and ``(scopes, loss change, <model total, change>, |change|^2,
    |model total|^2)`` (per scope where indexed)."""
    box: list = []

    def run(xs):
        visitor = DiffVisitor(reduced)
        pairs, cpairs = [(x, x) for x in xs], [(c, c) for c in consts]
        traverse(visitor, core, cpairs, pairs, ctx, edge)
        sites = visitor.sites
        box.append(sites)
        shapes = probe_shapes(core, consts, xs, ctx, edge)
        chosen = [
            reduced(st) and bool(o) and bool(i)
            for st, o, i in zip(sites, shapes.shapes, shapes.in_shapes)
        ]
        # Probes only where amp's equation differs from float32's.
        fp0 = [
            [jnp.zeros(a.shape, a.dtype) for a in sh] if c else None
            for sh, c in zip(shapes.shapes, chosen)
        ]
        bp0 = [
            [jnp.zeros(a.shape, jnp.float32) for a in sh] if c else None
            for sh, c in zip(shapes.in_shapes, chosen)
        ]
        G = probed_gradient(core, consts, xs, wrt, ctx, edge, shapes.counts)
        params = [xs[i] for i in wrt]
        loss32, (g32, cts) = G(params, fp0, bp0)
        deltas = backward_deltas(sites, cts, chosen, scale)
        back = norms(sites, deltas)
        names = [scope_path(st.scopes) for st in sites]
        probed = lambda fp, bp: G(params, fp, bp)  # noqa: E731
        base = (loss32, g32)
        scopes, effect = scope_effects(names, sites, chosen, deltas, probed, base)
        box.append(scopes)
        stats = [with_share(st, g) for st, g in zip(sites, cts)]
        return [loss32, back, stats, g32, effect]

    compiled = _compat.compile_analysis(jax.jit(run).lower(leaves))
    loss32, back, stats, g32, effect = compiled(leaves)
    sites, stats, back = per_iteration(box[0], stats, back)
    d_loss, dots, sq, model_sq = (np.asarray(e, np.float64) for e in effect)
    effect = (box[1], d_loss, dots, sq, float(model_sq))
    return sites, stats, g32, float(loss32), back, effect


@dataclasses.dataclass
class PrecisionReport:
    """What :func:`jaxamp.precision_report` found.

    Attributes:
        records: one :class:`SiteRecord` per equation instance, in order.
        loss32: the float32 loss.
        loss: amp's loss.
        grad_errors: ``{"total": e, group: e, ...}``, amp's gradient relative
            L2 error against float32's, per parameter group.
        compute_dtype: amp's compute dtype name.
        grads: amp's gradient w.r.t. ``args[0]``'s float arrays (its
            structure, other leaves None).
        grads32: float32's gradient, the same structure.
        removed: ``{"grad": {scope: share}, "loss": {scope: share}}``: the
            estimated share of the error each scope's restoring removes
            (:meth:`scopes`).
        linear_fit: ``|sum_s dg_s| / |dg|``: the size of the ranking's
            model of the gradient error (the sum of the scopes' propagated
            errors ``dg_s``) against amp's measured one ``dg`` (near 1: the
            model accounts for the error's size; far from 1: the ranking is a
            poor guide, check it with :meth:`suggest`, which measures).
    """

    records: list
    loss32: float
    loss: float
    grad_errors: dict
    compute_dtype: str
    grads: Any = None
    grads32: Any = None
    runner: Any = dataclasses.field(default=None, repr=False)
    removed: dict = dataclasses.field(default_factory=dict)
    linear_fit: float = float("nan")

    @property
    def grad_error(self) -> float:
        """amp's gradient relative L2 error against float32's."""
        return self.grad_errors["total"]

    @property
    def loss_error(self) -> float:
        """``|loss_amp - loss_32| / |loss_32|``."""
        return abs(self.loss - self.loss32) / max(abs(self.loss32), 1e-30)

    def scopes(self, by: str = "grad") -> dict[str, float]:
        """``{scope path: share of the error removed}``, largest first: per
        ``named_scope`` path (one entry for all the scan iterations of a
        scope), the estimated share of amp's squared gradient error
        (``by="grad"``) or of its loss error (``by="loss"``) that running
        the scope's reduced-precision equations as float32 does would remove
        (what overriding the scope in the policy buys; see
        :func:`jaxamp.precision_report`). A share can be negative (errors of
        the scope cancel others') or, for the loss, above the other scopes'
        sum."""
        if by not in ("grad", "loss"):
            raise ValueError(f"scopes(by=...) is 'grad' or 'loss', got {by!r}.")
        return dict(sorted(self.removed[by].items(), key=lambda kv: -kv[1]))

    def top(self, k: int = 5, by: str = "grad") -> list[str]:
        """The ``k`` scope paths whose restoring removes the largest share of
        the gradient (``by="grad"``) or loss (``by="loss"``) error, largest
        first (:meth:`scopes`)."""
        return list(self.scopes(by))[:k]

    def suggest(
        self,
        grad_error: float | None = None,
        loss_error: float | None = None,
        max_overrides: int = 8,
    ):
        """The smallest set of scope overrides meeting the targets, chosen
        greedily by :meth:`top` and verified by re-running amp; see
        :func:`jaxamp._tools._precision_suggest.suggest`."""
        return _precision_suggest.suggest(self, grad_error, loss_error, max_overrides)

    def to_json(self) -> dict:
        """The report as a JSON-serialisable dict."""
        return _precision_plot.to_json(self)

    def save(self, directory: str) -> tuple[str, str]:
        """Write ``precision_report.json`` and ``precision_report.png`` (a
        heatmap of scopes x op groups and the ranking; needs matplotlib) into
        ``directory``; returns their paths."""
        return _precision_plot.save(self, directory)

    def __str__(self) -> str:
        return _precision_plot.text(self)
