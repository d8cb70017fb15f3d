"""The LayerNorm region: one pattern rewrite (see ``_loop.Region``).

The facts pass marks a LayerNorm's normalisation (``(x - mean(x)) *
rsqrt(var(x) + eps)``, ``(x - m) / sqrt(v)``, Flax's gain folded into the
factor) with the equations that compute it from ``x`` and nothing else reads
(``ln_region``: the means, centrings, variance and its root), which the default
rules run in float32. Without a region the backward pass saves float32 values
of the size of ``x``: the centred ``x - mean`` (read by the normalisation) and
twice it (the square's derivative). When a low-precision ``x`` enters outside
a user's ``jax.checkpoint``, this rewrite runs the region inside one
``jax.checkpoint`` (named scope :data:`LN_SCOPE`): the backward pass saves
the low-precision ``x`` instead and recomputes the float32 centring and
normalisation, as PyTorch's ``native_layer_norm`` keeps its input (with the
per-row mean and rstd) for ``native_layer_norm_backward`` rather than the
centred value; within it the cotangents of ``x`` meet in float32 and are
rounded once. Where the factor does not come from ``x`` (``(x - m) * 0.5``),
nothing float32 is saved to begin with and no region is made.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from .._base._scopes import marker
from .._walk._loop import PatternRewrite, Region, Walk
from ._rmsnorm import run_region

# Scope of the checkpoint in which a LayerNorm's centring and normalisation run.
LN_SCOPE = marker("jaxamp_layer_norm")


def regions(jaxpr: Any, facts: Sequence) -> list[Region]:
    """The LayerNorm regions of ``jaxpr``: one per equation with an
    ``ln_region`` fact, the first of overlapping ones.

    Args:
        jaxpr: an open jaxpr.
        facts: its per-equation facts (``_facts.with_boundary``).

    Returns:
        :class:`Region` s whose ``finish`` returns the normalisation's output.
    """
    found, taken = [], set()
    for f in facts:
        if f.ln_region and not taken & set(f.ln_region):
            taken.update(f.ln_region)
            run = functools.partial(_run, x=f.ln_input)
            found.append(
                Region(f.ln_region, functools.partial(_start, f.ln_region), run)
            )
    return found


REWRITE = PatternRewrite("layer_norm", regions)


def _start(region: tuple[int, ...], walk: Walk) -> tuple[int, ...]:
    del walk
    return region  # always replaced


def _run(walk: Walk, region: tuple[int, ...], x: Any) -> Any:
    """The normalisation's output, computed from ``x`` (in one checkpoint when
    ``x`` is low precision, outside a user's checkpoint)."""
    return run_region(walk, region, LN_SCOPE, input_var=x)
