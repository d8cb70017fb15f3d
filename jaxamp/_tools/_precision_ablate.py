"""The ranking of :func:`jaxamp.precision_report`, measured: per scope, the
share of amp's squared gradient error (and of its loss error) removed when
that scope alone runs in the higher precision (an 8-bit scope in the compute
dtype, a 16-bit one in float32), by running amp's step with the scope
overridden, as AIMET's QuantAnalyzer enables one layer's quantizers at a time
(``aimet_torch/quant_analyzer.py``) and as a user would by hand.

Each ablation is amp's own jitted step under the policy with one scope key
added, lowered (traced) in the caller's thread and compiled and run in the
report's second thread while the next one is traced: ``k`` measured scopes
cost ``k`` compiles and runs of the step besides the baseline step's and the
float32 step's. A compiled step is dropped once it has run, so at most one
ablation executable and its gradient are alive beyond the ``k + 2`` gradients'
squared-error sums the report keeps (numbers, not arrays). Past
:data:`MAX_MEASURED` scopes the first-order estimate (the probed float32
gradient, ``_precision_rank.scope_effects``) shortlists which ones are
measured, and the report says so (:attr:`PrecisionReport.ranking`).

Why measured, not estimated to first order: under amp every rounding is
redrawn at amp's own point, which a model taken at the float32 point cannot
reproduce; such an estimate can rank another scope first than ablation does
(on a scanned int8 GPT) and change its order with the JAX version.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._base._formats import is_eight_bit
from .._policy._rules import default_amp_policy, use_original_precision

# Scopes measured by ablation when the report has at most this many scope
# paths holding reduced-precision equations; past it the first-order estimate
# shortlists this many (each measured scope costs one compile and one run of
# amp's step).
MAX_MEASURED = 12

COMPUTE = "compute dtype"
FLOAT32 = "float32"


def override(eight_bit: bool) -> tuple[Any, str]:
    """``(policy value, kind)`` that runs a scope in the higher precision: an
    8-bit scope (``eight_bit``) under the default policy (its matmuls in the
    compute dtype), another one in float32 (every equation at its traced
    dtype)."""
    if eight_bit:
        return default_amp_policy, COMPUTE
    return {"amp_default": use_original_precision}, FLOAT32


def policy_key(path: str, paths: list[str]) -> str:
    """The shortest key naming scope ``path`` alone: its last component if no
    other path has that component, else the whole ``/`` path."""
    last = path.split("/")[-1]
    others = [p for p in paths if p != path and last in p.split("/")]
    return last if not others else path


def plan(
    scopes: list[str], paths: list[str], formats: dict[str, set], policy: Any
) -> dict[str, tuple[dict, str, str]]:
    """Per scope path to measure, ``(policy, key, kind)``: the report's
    ``policy`` with that scope's override (:func:`override`) under its key
    (:func:`policy_key` among all scope ``paths``). Equations outside every
    named scope (path ``""``) cannot be targeted by a scope key and are not
    measured. ``formats[path]``: the formats its reduced-precision equations
    ran in (``"int8"``, ``"bfloat16"``, ...)."""
    out = {}
    for path in scopes:
        if not path:
            continue
        value, kind = override(any(is_eight_bit(f) for f in formats.get(path, ())))
        key = policy_key(path, paths)
        out[path] = ({**dict(policy), key: value}, key, kind)
    return out


def squared_error(got: list, want: list) -> float:
    """``sum |got - want|^2`` over the gradient leaves, in float64."""
    total = 0.0
    for g, w in zip(got, want):
        d = np.asarray(g, np.float64).ravel() - np.asarray(w, np.float64).ravel()
        total += float(d @ d)
    return total


def removal(base: tuple[float, float], runs: dict, ref: tuple[float, float]) -> dict:
    """``{"grad": {path: share}, "loss": {path: share}}`` from measured runs.

    Args:
        base: ``(squared gradient error, loss)`` of amp's step under the
            report's policy.
        runs: ``{path: (squared gradient error, loss)}`` of the step with
            that scope alone overridden.
        ref: ``(squared norm of the float32 gradient, float32 loss)``.

    Returns:
        Per scope, ``1 - e_s / e`` for the squared gradient error ``e`` and
        ``(|dl| - |dl_s|) / |dl|`` for the loss error ``dl`` (0 where the
        base error is 0). A share can be negative (the override makes the
        error larger: its rounding had cancelled another scope's).
    """
    e0, l0 = base
    d0 = abs(l0 - ref[1])
    grad = {p: (1.0 - e / e0) if e0 else 0.0 for p, (e, _) in runs.items()}
    loss = {
        p: (d0 - abs(lo - ref[1])) / d0 if d0 else 0.0 for p, (_, lo) in runs.items()
    }
    return {"grad": grad, "loss": loss}


def run_step(job: tuple) -> tuple[float, list]:
    """Compile (XLA's default options) and run a lowered step ``(lowered,
    arguments)``: ``(loss, gradient leaves as numpy arrays)``. The executable
    is dropped after its run."""
    lowered, dynamic = job
    loss, leaves = lowered.compile()(dynamic)
    return float(loss), [np.asarray(x) for x in leaves]


def run_steps(jobs: list) -> list[tuple[float, list]]:
    """:func:`run_step` of each job, in order (one executable alive at a
    time)."""
    return [run_step(job) for job in jobs]
