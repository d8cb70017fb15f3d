"""What the backward pass saves: re-cast held inputs instead of saving copies.

JAX derives the backward pass from the rewritten forward pass and saves, as
residuals, the values its derivatives read. Three choices keep those lean, as
a careful hand-written model keeps them (see ``docs/design.md``, "Residuals"):

* A matmul whose down-cast inputs are all *held* (alive for the whole step
  anyway: :attr:`jaxamp._base._state.WalkState.held`) runs inside a
  ``jax.checkpoint`` (named scope :data:`RECAST_SCOPE`) that re-casts them in
  the backward pass: the low-precision copy of a weight is not a residual.
* A default-rule matmul of a wide activation and a held weight casts the
  activation first (its low-precision copy is a residual either way), so that
  the weight can take the re-casting path (:func:`_narrow_activations`).
* A square widened to float32 re-casts its low-precision input in the
  backward pass: the float32 copy would be a residual twice the activation's
  bytes. Inside a user's ``jax.checkpoint`` none of this applies: its own
  policy decides what is saved.

With a residual format in force (``amp(residual_dtype=...)`` or the policy key
``"residuals"``: :func:`residual_rule`; ``RuleContext.residual_format``),
an equation whose backward pass reads an input that is not held is bound by
``_compressed.py`` instead: that input is saved in 8 bits with per-group
scales and decoded in the backward pass. See ``docs/design.md``, "Compressed
residuals".
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from .. import _compat
from .._base._cast import cast, cast_cache, narrow_source
from .._base._dtypes import dtype_of, is_float, is_low
from .._base._prims import MATMULS
from .._base._scopes import marker
from .._base._structure import describe
from . import _residual_format
from ._compressed import bind_compressed, is_held
from ._kinds import RESIDUALS_KEY, ResidualRule
from ._rules import use_lower_precision

# Scope of the checkpoints added around an equation to re-cast its inputs in
# the backward pass: the scan rule inlines one whose casts it moved before the
# loop (is_recast).
RECAST_SCOPE = marker("jaxamp_recast")


def is_recast(eqn: Any) -> bool:
    """``eqn`` is a re-casting checkpoint added here (not a user's)."""
    structure = describe(eqn)
    recomputed = structure is not None and structure.recomputed
    return recomputed and RECAST_SCOPE in _compat.scope_names(eqn)


def bind_saving_less(
    call: Any, invals: Sequence[Any], off: Collection[str] = frozenset()
) -> Any:
    """Bind one equation under its rule, choosing what its backward pass saves.

    Args:
        call: the equation's rule call: ``call.name`` (the primitive's name),
            ``call.rule``, ``call.context`` (its ``RuleContext``: value facts,
            residual format, ...), ``call.original`` (its traced input
            dtypes), ``call.compute_dtype``, ``call.decide(*vals) -> (inputs,
            params)``,
            ``call.bind(params, *inputs)`` and ``call.apply(*vals)`` (decide,
            then bind).
        invals: the equation's current input values.
        off: choices switched off, for ablations: with
            ``"narrow_activations"`` a default-rule matmul's activations are
            not cast before its held inputs (:func:`_narrow_activations`).

    Returns:
        The equation's outputs.
    """
    narrow = "narrow_activations" not in off
    if narrow and call.name in MATMULS and call.rule is use_lower_precision:
        shared = call.context.facts.shared_inputs
        invals = _narrow_activations(invals, call.original, call.compute_dtype, shared)
    if call.name in MATMULS and call.rule is use_lower_precision:
        invals = _as_held_narrow(invals, call.compute_dtype)
    fmt = call.context.residual_format
    if fmt is not None:
        outs = bind_compressed(call, invals, fmt)
        if outs is not None:
            return outs
    if call.name in MATMULS and _casts_only_held(invals, call.compute_dtype):
        return recomputing_casts(call.apply, invals)
    # A square widened to float32 re-casts its low-precision input. An
    # RMSNorm's square casts outside and recomputes only itself (2 * x): its
    # float32 copy of x is the one the scaling saves, and sharing it sums the
    # two cotangents of x (which nearly cancel) in float32 before one rounding.
    facts = call.context.facts
    if facts.quadratic and any(map(is_low, invals)) and not call.context.recomputed:
        if facts.rms_operand:
            new_in, new_params = call.decide(*invals)
            return recomputing_casts(functools.partial(call.bind, new_params), new_in)
        return recomputing_casts(call.apply, invals)
    return call.apply(*invals)


def _narrow_activations(
    invals: Sequence[Any],
    original: Sequence[Any],
    compute_dtype: np.dtype,
    shared: Sequence[bool],
) -> list[Any]:
    """Cast the wide float inputs of a default-rule matmul that are not held
    (activations: a float32 RMSNorm output) to the compute dtype, as the rule
    would, before the held ones (weights) are left to :func:`_casts_only_held`:
    the activation's low-precision copy is a residual either way, the weight's
    copy need not be. Only where no held input is read by another equation
    too: a weight that several matmuls read keeps its one cached copy (the cast
    cache), instead of a cast per matmul in both passes (``shared``: per
    input, whether another equation reads it; the value facts'). Inputs of a
    matmul traced with mixed float dtypes stay."""
    invals = list(invals)
    floats = {np.dtype(d) for d, x in zip(original, invals) if is_float(d)}
    shared = shared or (True,) * len(invals)
    held = [is_held(x) for x in invals]
    if len(floats) > 1 or not any(held) or any(h and s for h, s in zip(held, shared)):
        return invals
    width = np.dtype(compute_dtype).itemsize
    return [
        cast(x, compute_dtype)
        if isinstance(x, jax.Array)
        and is_float(dtype_of(x))
        and x.dtype.itemsize > width
        and not is_held(x)
        else x
        for x in invals
    ]


def _as_held_narrow(invals: Sequence[Any], compute_dtype: np.dtype) -> list[Any]:
    """A matmul's inputs with each widened low-precision value (a bfloat16
    parameter read as float32, :func:`jaxamp._base._cast.widen`) replaced by
    the value it widens, where that is in the compute dtype: the rule would
    cast it back exactly, and the matmul then reads (and its backward pass
    saves) the parameter itself, not a float32 copy to re-cast."""
    out = list(invals)
    for i, x in enumerate(invals):
        source = narrow_source(x)
        if source is not None and dtype_of(source) == np.dtype(compute_dtype):
            out[i] = source
    return out


def _casts_only_held(invals: Sequence[Any], compute_dtype: np.dtype) -> bool:
    """Some input is a held float wider than the compute dtype, and every other
    float input is at most as wide (so nothing but held values gets narrowed)."""
    width = np.dtype(compute_dtype).itemsize
    wide = [
        x
        for x in invals
        if isinstance(x, jax.Array)
        and is_float(dtype_of(x))
        and x.dtype.itemsize > width
    ]
    return bool(wide) and all(is_held(x) for x in wide)


def recomputing_casts(apply: Callable, invals: Sequence[Any]) -> Any:
    """``apply(*invals)`` inside ``jax.checkpoint``: the backward pass saves the
    held wide inputs (alive anyway) and re-casts them, instead of saving their
    low-precision copies. ``prevent_cse`` stays on so that XLA cannot merge the
    recomputed cast with the forward one and keep the copy alive after all."""
    idx = [i for i, x in enumerate(invals) if isinstance(x, jax.Array)]

    def run(*arrays):
        vals = list(invals)
        for i, a in zip(idx, arrays):
            vals[i] = a
        with cast_cache():  # casts traced here must not leak to the outer walk
            return apply(*vals)

    with jax.named_scope(RECAST_SCOPE):
        return jax.checkpoint(run)(*(invals[i] for i in idx))


def residual_rule(dtype: Any, group_size: int | None = None) -> ResidualRule:
    """The policy value for the key ``"residuals"``: how saved values are stored.

    ``amp(residual_dtype=d)`` is ``amp_policy={..., "residuals":
    residual_rule(d)}``; inside a nested scope policy the rule applies to the
    scope, so a fragile scope can keep its residuals in the compute dtype, or
    a single scope can be the only one compressed.

    Each saved activation ``x`` (the inputs of non-linearities and norm
    regions, the XLA attention kernel's v, the inputs a user's
    ``jax.checkpoint`` saves at its boundary; for int8 also the input a
    product's weight gradient reads, which FP8's 2-3 mantissa bits would
    pass on to the weight gradient undamped, so FP8 leaves it in the compute
    dtype) is stored as ``dtype`` values with one float32 scale per ``group_size``
    consecutive values of its last axis, ``scale = amax / bound``, and decoded
    in the backward pass; the forward pass and the gradients keep their
    dtypes. A last axis no longer than the group is one group; a longer one
    that the group does not divide ends with a shorter group; a last axis
    shorter than 32 is not compressed. Held values (parameters, the batch)
    and values made from them by a transpose, reshape or cast are never
    compressed; nor are the inputs of ``exp``/``logistic`` and attention's
    q and k (their absolute error would become a relative error of the
    probabilities recomputed from them). A chain of cheap elementwise
    operations on one activation (a GELU) is stored as that activation once
    and recomputed from it.

    Sources: COAT (Xi et al., ICLR 2025, arXiv 2410.19313): FP8 inputs of
    linear and non-linear layers with per-group scales; DeepSeek-V3
    (arXiv 2412.19437, section 3.3): E4M3 with 1 x 128 activation tiles and
    online amax; Jetfire (Xi et al., ICML 2024, arXiv 2403.12422): INT8 with
    32-wide blocks.

    Args:
        dtype: ``jnp.float8_e4m3fn`` (``"fp8"``, ``"e4m3"``),
            ``jnp.float8_e5m2`` (``"e5m2"``) or ``"int8"``; None: stored in
            the dtype amp computes them in.
        group_size: values per scale along the last axis; None: 128 for FP8
            (DeepSeek-V3's tile), 32 for int8 (an outlier coarsens only its 32
            neighbours' evenly spaced levels).

    Returns:
        A :class:`jaxamp.rules.ResidualRule`, valid only under the key
        ``"residuals"``.

    Raises:
        ValueError: for another ``dtype`` or a ``group_size`` below 1.

    Example:
        >>> import jax.numpy as jnp, jaxamp
        >>> policy = {**jaxamp.default_amp_policy,
        ...           "head": {**jaxamp.default_amp_policy,
        ...                    "residuals": jaxamp.residual_rule(None)}}
        >>> f = jaxamp.amp(lambda w, x: jnp.tanh(x @ w).sum(),
        ...                compute_dtype=jnp.bfloat16, amp_policy=policy,
        ...                residual_dtype=jnp.float8_e4m3fn)
    """
    return ResidualRule(dtype, group_size)


def with_residual_dtype(amp_policy: Any, residual_dtype: Any) -> Any:
    """``amp_policy`` with ``"residuals": residual_rule(residual_dtype)`` at its
    top (``amp``'s ``residual_dtype`` argument); unchanged for None.

    Raises:
        ValueError: for a dtype other than FP8 E4M3/E5M2 or int8, or when
            ``amp_policy`` has its own ``"residuals"`` entry.
    """
    if residual_dtype is None:
        return amp_policy
    rule = ResidualRule(
        _residual_format.parse_dtype(residual_dtype, "amp(residual_dtype)")
    )
    if isinstance(amp_policy, Mapping) and RESIDUALS_KEY in amp_policy:
        raise ValueError(
            f"amp(residual_dtype={residual_dtype!r}) and amp_policy["
            f"{RESIDUALS_KEY!r}] both say how residuals are stored; give one."
        )
    if not isinstance(amp_policy, Mapping):
        return amp_policy  # AmpPolicy checks and names the argument
    return {**amp_policy, RESIDUALS_KEY: rule}
