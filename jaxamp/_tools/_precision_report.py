"""``precision_report``: where a mixed-precision training step loses accuracy,
and the smallest policy change that wins it back.

The ranking comes first and alone: scopes are ranked by what restoring them
buys, measured: amp's step re-run with each scope alone in the higher
precision (``_precision_ablate.py``; AIMET's QuantAnalyzer enables one
layer's quantizers at a time the same way) against the float32 step, each
compiled and run in a second thread while the next is traced. Past
``MAX_MEASURED`` scopes the first-order estimate (each scope's local errors
propagated through the probed float32 gradient, HAWQ's sensitivity times
perturbation, Dong et al., 2019) shortlists the scopes measured. The greedy
fallback of the worst ops to higher precision until a target is met is Intel
Neural Compressor's ``AutoMixedPrecisionTuneStrategy``.

The per-equation analysis runs when a per-equation view asks for it, once
(``_precision_records.py``): the float32 and the amp step are compared on the
same inputs in one differential walk (``_precision_walk.py``; loops walked as
loops): per equation the *local* error (amp's equation fed the float32
inputs, PyTorch's shadow loggers, ``torch.ao.ns._numeric_suite_fx``) and the
*propagated* error (amp's value against float32's), grouped by
``jax.named_scope`` path and loop iteration. Per equation, first-order shares
from one backward pass (every site's float32 cotangent ``g = dL/dy``):
``|<g, y_local - y_32>|`` for the loss and ``|VJP_amp(x_32; g) - VJP_32(x_32;
g)|`` (the local error of the backward pass amp runs for it) for the
gradient. The plain-text table and the PNG are in ``_precision_plot.py``.
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
from .._policy._lookup import AmpPolicy
from .._policy._rules import default_amp_policy
from .._walk._loop import AmpContext
from . import _precision_ablate as _ablate
from . import _precision_plot, _precision_suggest
from ._precision_rank import estimated, find_scopes
from ._precision_records import Analysis, SiteRecord, op_group

__all__ = ["PrecisionReport", "SiteRecord", "op_group", "precision_report"]


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

    Here, the ranking (:meth:`PrecisionReport.scopes`, ``top``, ``suggest``):
    an abstract trace of the walk finds the scopes amp runs in reduced
    precision; the float32 step, amp's step and amp's step per scope alone in
    higher precision are compiled (XLA's default options) and run in a second
    thread while the next is traced: ``k`` scopes, ``k + 2`` compiles and runs.
    On the first read of :attr:`PrecisionReport.records` (the printout,
    ``save``, ``to_json``), once: the per-equation analysis, one compiled
    differential walk (``jaxamp/_tools/_precision_records.py``). Past
    ``_precision_ablate.MAX_MEASURED`` scopes the analysis runs here, its
    first-order estimate shortlisting the scopes measured. Measured on the
    depth GPT of ``benchmarks/precision_report.py --depth`` (3 scopes, 2-core
    CPU under load): the ranking 4.3x to 5.7x the first call of the user's
    jitted step, the analysis about 3x more (``docs/guide.md``, "Cost").

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
    _check_args(loss_fn, args, group_depth)
    cd = compute_dtype_or_default(compute_dtype)
    out = jax.eval_shape(lambda: loss_fn(*args, **kwargs))
    _check_loss(out[0] if has_aux else out)
    scale = float(loss_scale or (2.0**15 if cd == np.float16 else 1.0))
    # amp's steps are traced here, under the caller's JAX configuration.
    step = lambda p: _amp_step(loss_fn, args, kwargs, cd, p, has_aux, scale)  # noqa: E731
    ref = _f32_step(loss_fn, args, kwargs, has_aux)
    analysis = Analysis(None, {}, scale)

    def scopes() -> dict:  # traced while the float32 and amp's steps compile
        analysis.trace = _trace(loss_fn, args, kwargs, cd, amp_policy, has_aux)
        return find_scopes(*analysis.trace[:3], *analysis.trace[4:], analysis.fmt)

    ranked = _rank(step, ref, scopes, amp_policy, analysis)
    todo, (loss32, g32), (lossa, ga), runs, box = ranked
    sums = _sums(ga, g32)
    runner = _precision_suggest.Runner(
        loss_fn, args, kwargs, cd, amp_policy, has_aux, scale, g32, loss32,
        amp_gradients,
    )  # fmt: skip
    effect = analysis.result[5] if analysis.result is not None else None
    out = _assemble(runner, analysis, box, group_depth, (lossa, ga), effect, sums)
    return _ranked(out, box, todo, runs, sums, effect)


def _check_args(loss_fn: Any, args: tuple, group_depth: Any) -> None:
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


def _f32_step(fn, args, kwargs, has_aux) -> tuple:
    """The float32 step (loss and gradient leaves w.r.t. ``args[0]``'s float
    arrays, as :func:`_amp_step`'s), lowered, and its array arguments: the
    reference every measured step is compared with."""

    def loss(p, *rest):
        out = fn(p, *rest, **kwargs)
        return (out[0] if has_aux else out).astype(jnp.float32)

    dynamic, static = eqx.partition(args, eqx.is_array)

    def step(dynamic):
        value, g = eqx.filter_value_and_grad(loss)(*eqx.combine(dynamic, static))
        return value, jax.tree.leaves(eqx.filter(g, eqx.is_array))

    return jax.jit(step).lower(dynamic), dynamic


def _rank(step, ref, scopes, policy, analysis) -> tuple:
    """Run the ranking's steps: ``(plan, float32's (loss, gradient), amp's,
    the measured scopes' in the plan's order, what the scope discovery
    found)``. ``ref`` is the float32 step, lowered; ``step(policy)`` lowers
    amp's step under ``policy`` (traced here); each lowered step is compiled
    and run in a second thread, in order, while the next one (and the scope
    discovery, ``scopes()``: :func:`_precision_rank.find_scopes`) is traced
    (XLA releases Python's lock). Past ``MAX_MEASURED`` scopes the
    per-equation ``analysis`` runs here meanwhile, and its first-order
    estimate picks the scopes measured (:func:`_precision_ablate.plan`)."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        jobs = [pool.submit(_ablate.run_step, ref)]
        jobs.append(pool.submit(_ablate.run_step, step(policy)))
        box = scopes()
        best = box["measure"]
        if box["shortlist"]:
            est = estimated(analysis.walk()[5])["grad"]
            # Unscoped equations (path "") have no policy key: never shortlisted.
            best = sorted((k for k in est if k), key=lambda k: -est[k])
            best = best[: _ablate.MAX_MEASURED]
        todo = _ablate.plan(best, box["paths"], box["formats"], policy)
        jobs += [pool.submit(_ablate.run_step, step(p)) for p, _, _ in todo.values()]
        ref_out, base, *runs = [j.result() for j in jobs]
    return todo, ref_out, base, runs, box


def _ranked(out, box, todo, runs, sums, effect) -> PrecisionReport:
    """``out`` with the measured ranking (``runs``: the scopes' ``(loss,
    gradient)`` in ``todo``'s order), the estimate where it ran, and the
    runs kept for ``suggest``."""
    runner, g32 = out.runner, out.runner.g32
    norm = float(sums[1].sum()) ** 0.5
    measured = {
        path: (_ablate.squared_error(g, g32), lo) for path, (lo, g) in zip(todo, runs)
    }
    for path, (e, lo) in measured.items():  # suggest() reuses these runs
        g = (e / norm**2) ** 0.5 if norm else float(e > 0)
        loss_err = _loss_error(lo, runner.loss32)
        runner.measured[frozenset({todo[path][1]})] = (g, loss_err)
    out.removed = _ablate.removal(
        (float(sums[0].sum()), out.loss), measured, (norm**2, runner.loss32)
    )
    out.ranking = _ranking_note(box, todo)
    out.estimated = estimated(effect) if effect is not None else {}
    out.overrides = {p: (key, kind) for p, (_, key, kind) in todo.items()}
    return out


def _loss_error(loss: float, loss32: float) -> float:
    """``|loss - loss32| / |loss32|``, as :attr:`PrecisionReport.loss_error`."""
    return abs(loss - loss32) / max(abs(loss32), 1e-30)


def _ranking_note(box: dict, todo: dict) -> str:
    """What the ranking is: measured for every scope, or for a shortlist."""
    n = len([s for s in box["scopes"] if s])
    if not box["shortlist"]:
        return f"measured: each of {len(todo)} scope(s) alone in higher precision"
    return (
        f"measured for {len(todo)} of {n} scopes, shortlisted by the first-order "
        f"estimate (more than {_ablate.MAX_MEASURED} scopes)"
    )


def _assemble(runner, analysis, box, group_depth, amp_out, effect, sums):
    """The report: amp's measured gradient (``amp_out``: its ``(loss,
    gradient leaves)``) against float32's per parameter group (``sums``:
    :func:`_sums` of the two), the scope paths and formats the ranking found
    (``box``), the first-order estimate's fit where it ran (``effect``, else
    None), the runner for ``suggest`` and the per-equation ``analysis``."""
    r = runner
    lossa, ga = amp_out
    params = eqx.filter(r.args[0], eqx.is_array)
    names = [
        n
        for n, x in zip(_leaf_paths(params, group_depth), jax.tree.leaves(params))
        if is_float(x.dtype)
    ]
    tree = jax.tree.structure(eqx.filter(params, lambda x: is_float(x.dtype)))
    fit = float("nan")
    meas_sq = float(sums[0].sum())
    if effect is not None and meas_sq:
        fit = (effect[4] / meas_sq) ** 0.5
    return PrecisionReport(
        records=None,
        loss32=r.loss32,
        loss=float(lossa),
        grad_errors=_group_errors(*sums, names),
        compute_dtype=np.dtype(r.compute_dtype).name,
        grads=jax.tree.unflatten(tree, ga),
        grads32=jax.tree.unflatten(tree, r.g32),
        runner=r,
        linear_fit=float(fit),
        paths=box["paths"],
        formats=box["formats"],
        analysis=analysis,
    )


def _check_loss(loss: Any) -> None:
    if not (jnp.ndim(loss) == 0 and jnp.issubdtype(loss.dtype, jnp.floating)):
        raise ValueError(
            "precision_report: loss_fn must return a float scalar (or "
            f"(loss, aux) with has_aux=True), got {jax.typeof(loss)}."
        )


def _trace(fn, args, kwargs, cd, policy, has_aux) -> tuple:
    """Trace ``fn`` (its array leaves flattened, the loss its one output):
    ``(core, consts, leaves, wrt, ctx, edge)``, as
    :func:`_precision_rank.lower_walk` takes them."""
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
    return core, consts, leaves, wrt, ctx, edge


@dataclasses.dataclass
class PrecisionReport:
    """What :func:`jaxamp.precision_report` found.

    The ranking is measured when the report is made; the per-equation
    analysis behind :attr:`records` (also read by the printout's equation
    table, :meth:`save` and :meth:`to_json`) runs on first use, once.

    Attributes:
        records: one :class:`SiteRecord` per equation instance, in the order
            an unrolled walk visits them. The first read runs the per-equation
            analysis (one compile and run of the differential walk: about 3x
            the step's first call on ``benchmarks/precision_report.py``'s
            depth GPT); later reads reuse it.
        loss32: the float32 loss.
        loss: amp's loss.
        grad_errors: ``{"total": e, group: e, ...}``, amp's gradient relative
            L2 error against float32's, per parameter group.
        compute_dtype: amp's compute dtype name.
        grads: amp's gradient w.r.t. ``args[0]``'s float arrays (its
            structure, other leaves None).
        grads32: float32's gradient, the same structure.
        removed: ``{"grad": {scope: share}, "loss": {scope: share}}``: the
            measured share of the error each scope's restoring removes
            (:meth:`scopes`).
        ranking: how the ranking was made, in words: every scope measured,
            or (past :data:`jaxamp._tools._precision_ablate.MAX_MEASURED`
            scopes) a shortlist by the first-order estimate measured.
        estimated: the first-order estimate's shares, in ``removed``'s form,
            where it ran (past ``MAX_MEASURED`` scopes), else empty.
        overrides: ``{scope: (policy key, "compute dtype" | "float32")}``:
            the override each measured scope was run with.
        linear_fit: ``|sum_s dg_s| / |dg|``: the size of the first-order
            estimate's model of the gradient error (the sum of the scopes'
            propagated errors ``dg_s``) against amp's measured one ``dg``,
            where the estimate ran; NaN otherwise.
        paths: every ``named_scope`` path of the step's equations, sorted
            (``""`` outside any scope).
        formats: ``{scope path: {format, ...}}``: the reduced-precision
            formats its equations run in (``"bfloat16"``, ``"int8"``, ...),
            for the paths holding any.
        analysis: the per-equation analysis (:attr:`records`).
    """

    records: list | None = dataclasses.field(repr=False, compare=False)
    loss32: float
    loss: float
    grad_errors: dict
    compute_dtype: str
    grads: Any = None
    grads32: Any = None
    runner: Any = dataclasses.field(default=None, repr=False)
    removed: dict = dataclasses.field(default_factory=dict)
    linear_fit: float = float("nan")
    ranking: str = ""
    estimated: dict = dataclasses.field(default_factory=dict)
    overrides: dict = dataclasses.field(default_factory=dict)
    paths: list = dataclasses.field(default_factory=list)
    formats: dict = dataclasses.field(default_factory=dict)
    analysis: Any = dataclasses.field(default=None, repr=False)

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
        scope), the share of amp's squared gradient error (``by="grad"``:
        ``1 - e_s / e``) or of its loss error (``by="loss"``: ``(|dl| -
        |dl_s|) / |dl|``) removed when that scope alone runs in the higher
        precision (an 8-bit scope in the compute dtype, another in float32),
        measured by running amp's step with the scope overridden in the
        policy (see :func:`jaxamp.precision_report`). A share can be negative
        (the scope's rounding had cancelled others'); shares need not add to
        1 (errors interact). Scopes outside a shortlist (:attr:`ranking`) are
        absent.

        Raises:
            ValueError: if ``by`` is not ``"grad"`` or ``"loss"``.
        """
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
        by :meth:`top` from the measured runs and verified by one more run of
        amp (more only if it misses); see
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


def _records(self: PrecisionReport) -> list[SiteRecord]:
    if self._records is None and self.analysis is not None:
        g32 = jax.tree.leaves(self.grads32)
        sq = sum(float(np.sum(np.square(g, dtype=np.float64))) for g in g32)
        self._records = self.analysis.records(sq**0.5)
    return self._records


def _set_records(self: PrecisionReport, value: list | None) -> None:
    self._records = value


# A property over the dataclass field: ``PrecisionReport(records, ...)`` still
# takes the records, and a report made by ``precision_report`` (records None)
# runs its analysis when they are first read.
PrecisionReport.records = property(  # type: ignore[assignment]
    _records, _set_records, doc=":class:`SiteRecord` per equation instance."
)
