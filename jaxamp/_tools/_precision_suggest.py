"""``PrecisionReport.suggest``: the smallest set of ``named_scope`` overrides
that meets an error target, chosen greedily by the report's measured ranking
and verified by re-running amp (Intel Neural Compressor's
``AutoMixedPrecisionTuneStrategy`` falls back op by op the same way, one full
evaluation per trial; here the measured single-scope shares predict how many
to try first, and a single scope's run is the report's own)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import equinox as eqx
import jax.numpy as jnp
import numpy as np

from .._amp import amp
from .._base._formats import is_eight_bit
from ._measure import matmul_flops_by_dtype
from ._precision_ablate import COMPUTE, FLOAT32, override, policy_key

__all__ = ["COMPUTE", "FLOAT32", "Runner", "Suggestion", "policy_key", "suggest"]


@dataclasses.dataclass
class Runner:
    """Re-runs one step of the report's function under another policy."""

    fn: Callable
    args: tuple
    kwargs: dict
    compute_dtype: Any
    policy: Any
    has_aux: bool
    scale: float
    g32: Any
    loss32: float
    gradients: Callable
    # {frozenset of policy keys overridden: (gradient error, loss error)} of
    # the runs the report made (each scope alone).
    measured: dict = dataclasses.field(default_factory=dict)

    def errors(self, policy: Any) -> tuple[float, float]:
        """``(gradient relative L2 error, loss relative error)`` of amp under
        ``policy`` against float32."""
        loss, got = self.gradients(
            self.fn,
            self.args,
            self.kwargs,
            self.compute_dtype,
            policy,
            self.has_aux,
            self.scale,
        )
        want = self.g32
        sq = lambda x: float(jnp.sum(jnp.square(jnp.asarray(x, jnp.float32))))  # noqa: E731
        num = sum(sq(jnp.asarray(a, jnp.float32) - b) for a, b in zip(got, want))
        den = sum(sq(b) for b in want) or 1.0
        loss_err = abs(loss - self.loss32) / max(abs(self.loss32), 1e-30)
        return (num / den) ** 0.5, loss_err

    def reduced_flops(self, policy: Any) -> tuple[float, float]:
        """``(8-bit share, below-float32 share)`` of one step's matmul FLOPs
        (forward and backward) under ``policy``."""
        f = amp(self.fn, compute_dtype=self.compute_dtype, amp_policy=policy)

        def loss(p, *rest):
            out = f(p, *rest, **self.kwargs)
            return (out[0] if self.has_aux else out).astype(jnp.float32)

        closed = eqx.filter_make_jaxpr(eqx.filter_grad(loss))(*self.args)[0]
        flops = matmul_flops_by_dtype(closed)
        total = sum(flops.values()) or 1.0

        def share(width: int) -> float:
            return (
                sum(
                    f
                    for k, f in flops.items()
                    if all(np.dtype(p).itemsize <= width for p in k.split(" x "))
                )
                / total
            )

        return share(1), share(2)


@dataclasses.dataclass(eq=False)
class Suggestion(Mapping):
    """A verified policy change (:meth:`jaxamp.tools.PrecisionReport.suggest`).

    A read-only mapping: its items are ``policy``'s, so the suggestion itself
    is an ``amp_policy`` (``amp(loss, amp_policy=report.suggest(...))``).

    Attributes:
        policy: the amp policy to pass as ``amp_policy`` (the report's policy
            with the overrides added).
        overrides: ``{policy key: "compute dtype" | "float32"}``: the scope
            keys added, in the order chosen; a key is the scope path's last
            component where that names it alone, else the ``/``-separated path.
        grad_error: amp's gradient relative error under ``policy`` (measured).
        loss_error: amp's loss relative error under ``policy`` (measured).
        met: whether the targets were met.
        eight_bit_moved: share of matmul FLOPs moved out of 8 bits.
        low_precision_moved: share of matmul FLOPs moved to float32.
    """

    policy: dict
    overrides: dict
    grad_error: float
    loss_error: float
    met: bool
    eight_bit_moved: float
    low_precision_moved: float

    def __getitem__(self, key: Any) -> Any:
        return self.policy[key]

    def __iter__(self) -> Iterator:
        return iter(self.policy)

    def __len__(self) -> int:
        return len(self.policy)

    def __str__(self) -> str:
        keys = ", ".join(f"{k!r} -> {v}" for k, v in self.overrides.items())
        return (
            f"{len(self.overrides)} override(s): {keys or 'none'}; gradient error "
            f"{self.grad_error:.3e}, loss error {self.loss_error:.3e} "
            f"({'met' if self.met else 'NOT met'}); cost: "
            f"{self.eight_bit_moved:.1%} of matmul FLOPs out of 8 bits, "
            f"{self.low_precision_moved:.1%} to float32"
        )


def _override(report: Any, path: str) -> tuple[Any, str]:
    """The override of scope ``path`` (:func:`_precision_ablate.override`):
    to the compute dtype if any of its equations ran in 8 bits."""
    eight = any(is_eight_bit(f) for f in report.formats.get(path, ()))
    return override(eight)


def suggest(
    report: Any,
    grad_error: float | None,
    loss_error: float | None,
    max_overrides: int = 8,
) -> Suggestion:
    """See :meth:`jaxamp.tools.PrecisionReport.suggest`.

    Args:
        report: the :class:`jaxamp.tools.PrecisionReport`.
        grad_error: target gradient relative L2 error, or None.
        loss_error: target loss relative error, or None.
        max_overrides: most scopes to override.

    Returns:
        A :class:`Suggestion` (``met`` False if ``max_overrides`` scopes did
        not reach the targets).

    Raises:
        ValueError: if no target is given or a target is not positive.
    """
    if grad_error is None and loss_error is None:
        raise ValueError("suggest(grad_error=..., loss_error=...): give a target.")
    for name, t in (("grad_error", grad_error), ("loss_error", loss_error)):
        if t is not None and not t > 0:
            raise ValueError(f"suggest({name}=...) must be > 0, got {t!r}.")
    run = report.runner
    by = "grad" if grad_error is not None else "loss"
    # Equations outside every named scope cannot be targeted by a scope key.
    shares = {k: v for k, v in report.scopes(by).items() if v > 0 and k}
    paths = report.paths
    ok = lambda g, lo: (
        (grad_error is None or g <= grad_error)
        and (  # noqa: E731
            loss_error is None or lo <= loss_error
        )
    )
    n = _predicted(report, shares, grad_error, loss_error, max_overrides)
    base_policy = dict(run.policy)
    while True:
        chosen = list(shares)[:n]
        policy, overrides = dict(base_policy), {}
        for path in chosen:
            value, kind = _override(report, path)
            key = policy_key(path, paths)
            policy[key] = value
            overrides[key] = kind
        if not chosen:
            g, lo = report.grad_error, report.loss_error
        elif frozenset(overrides) in run.measured:  # the report ran it already
            g, lo = run.measured[frozenset(overrides)]
        else:  # one more run verifies the combination
            g, lo = run.errors(policy)
        if ok(g, lo) or n >= min(max_overrides, len(shares)):
            break
        n += 1
    e0, l0 = run.reduced_flops(base_policy)
    e1, l1 = run.reduced_flops(policy)
    return Suggestion(policy, overrides, g, lo, ok(g, lo), e0 - e1, l0 - l1)


def _predicted(report, shares, grad_error, loss_error, max_overrides) -> int:
    """How many of the ranked scopes the estimated shares of the error they
    remove (:meth:`jaxamp.tools.PrecisionReport.scopes`) say are needed."""
    vals = list(shares.values())
    if grad_error is not None:
        now, target, sq = report.grad_error, grad_error, True
    else:
        now, target, sq = report.loss_error, loss_error, False
    if now <= target or not vals:
        return 0
    removed = 0.0
    for n, v in enumerate(vals[:max_overrides], 1):
        removed += v
        left = max(0.0, 1.0 - removed)
        if now * (left**0.5 if sq else left) <= target:
            return n
    return min(max_overrides, len(vals))
