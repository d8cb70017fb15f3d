"""What the backward pass saves: re-cast held inputs instead of saving copies.

JAX derives the backward pass from the rewritten forward pass and saves, as
residuals, the values its derivatives read. Three choices keep those lean, as
a careful hand-written model keeps them (see ``docs/design.md``, "Residuals"):

* A matmul whose down-cast inputs are all *held* (alive for the whole step
  anyway: :attr:`jaxamp._state.WalkState.held`) runs inside a
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
``"residuals"``, :func:`stash_format`), an equation whose backward pass reads
an input that is not held is bound by :func:`store_compressed` instead: a
``jax.custom_vjp`` whose forward pass computes exactly what amp would and
saves that input as 8-bit values with per-group scales (``_stash.py``), and
whose backward pass decodes it and differentiates the equation again
(``jax.vjp``: a product's forward result is dead code there, an elementwise
function is recomputed). The same wrapping applies, from
``_walk/_higher_order.py`` and the rewrites, to a user's ``jax.checkpoint``
(its boundary inputs), a ``custom_jvp`` function, a jitted function with no
product (``jax.nn.gelu``), a norm region and the XLA attention kernel (its
q, k, v: the probabilities are recomputed, as FlashAttention's backward
pass does). Cotangents stay in the dtypes amp computes them in; only the
values saved are 8-bit. See ``docs/design.md``, "Compressed residuals".
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero
from jax.extend import core as jex_core

from .. import _compat
from .._base import _state
from .._base._cast import cast, cast_cache
from .._base._dtypes import dtype_of, is_float, is_low
from .._base._prims import MATMULS
from .._base._structure import describe
from .._values._facts import current_facts
from . import _stash
from ._kinds import RESIDUALS_KEY, ResidualRule
from ._rules import use_lower_precision
from ._stash import Format, compressible, decode, encode

# Scope of the checkpoints added around an equation to re-cast its inputs in
# the backward pass: the scan rule inlines one whose casts it moved before the
# loop (is_recast).
RECAST_SCOPE = "jaxamp_recast"


def is_held(x: Any) -> bool:
    """True if ``x`` is an input of the current walk that is alive for the step."""
    held = _state.current().held
    return held is not None and held.get(id(x)) is x


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
            ``call.rule``, ``call.original`` (its traced input dtypes),
            ``call.compute_dtype``, ``call.decide(*vals) -> (inputs, params)``,
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
        invals = _narrow_activations(invals, call.original, call.compute_dtype)
    fmt = stash_format()
    if fmt is not None and call.name in _RESHAPES and _of_held(invals):
        out = call.apply(*invals)
        _mark_of_held(out)  # a transposed weight is a weight
        return out
    if fmt is not None and call.name not in _READS_NO_VALUE | _EXPONENTIALS:
        outs = store_compressed(call.apply, invals, fmt)
        if outs is not None:
            return outs
    if call.name in MATMULS and _casts_only_held(invals, call.compute_dtype):
        return recomputing_casts(call.apply, invals)
    # A square widened to float32 re-casts its low-precision input. An
    # RMSNorm's square casts outside and recomputes only itself (2 * x): its
    # float32 copy of x is the one the scaling saves, and sharing it sums the
    # two cotangents of x (which nearly cancel) in float32 before one rounding.
    facts = current_facts()
    if facts.quadratic and any(map(is_low, invals)) and not _state.current().recomputed:
        if facts.rms_operand:
            new_in, new_params = call.decide(*invals)
            return recomputing_casts(functools.partial(call.bind, new_params), new_in)
        return recomputing_casts(call.apply, invals)
    return call.apply(*invals)


def _narrow_activations(
    invals: Sequence[Any], original: Sequence[Any], compute_dtype: np.dtype
) -> list[Any]:
    """Cast the wide float inputs of a default-rule matmul that are not held
    (activations: a float32 RMSNorm output) to the compute dtype, as the rule
    would, before the held ones (weights) are left to :func:`_casts_only_held`:
    the activation's low-precision copy is a residual either way, the weight's
    copy need not be. Only where no held input is read by another equation
    too: a weight that several matmuls read keeps its one cached copy (the cast
    cache), instead of a cast per matmul in both passes. Inputs of a matmul
    traced with mixed float dtypes stay."""
    invals = list(invals)
    floats = {np.dtype(d) for d, x in zip(original, invals) if is_float(d)}
    shared = current_facts().shared_inputs or (True,) * len(invals)
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


# Primitives whose derivative reads no float input value (linear, structural
# or comparison-free selection): never wrapped, nothing of theirs is saved.
_READS_NO_VALUE = frozenset(
    {
        "add",
        "add_any",
        "sub",
        "neg",
        "convert_element_type",
        "reshape",
        "broadcast_in_dim",
        "transpose",
        "squeeze",
        "expand_dims",
        "slice",
        "dynamic_slice",
        "dynamic_update_slice",
        "concatenate",
        "pad",
        "reduce_sum",
        "select_n",
        "copy",
        "copy_p",
        "cumsum",
        "rev",
        "reduce_precision",
        "real",
        "imag",
        "stop_gradient",
        "iota",
        "eq",
        "ne",
        "lt",
        "le",
        "gt",
        "ge",
        "sign",
        "floor",
        "ceil",
        "round",
        "is_finite",
    }
)
# Their inputs are saved as JAX saves them: exp turns an absolute error of its
# input into a relative error of its output (a softmax's probabilities).
_EXPONENTIALS = frozenset({"exp", "exp2", "expm1", "logistic"})
STASH_SCOPE = "jaxamp_stash"
# Equations that re-lay out or re-type their input: applied to held values
# (a weight's transpose or cast), their output is a weight too, never stored
# compressed (an 8-bit weight would coarsen the cotangents it carries back).
_RESHAPES = frozenset(
    {
        "transpose",
        "reshape",
        "broadcast_in_dim",
        "convert_element_type",
        "squeeze",
        "expand_dims",
        "slice",
        "dynamic_slice",
        "copy",
        "copy_p",
    }
)


def _of_held(invals: Sequence[Any]) -> bool:
    """Every array input is held or made from held values by :data:`_RESHAPES`."""
    arrays = [x for x in invals if isinstance(x, jax.Array)]
    return bool(arrays) and all(map(_held_or_weight, arrays))


def _held_or_weight(x: Any) -> bool:
    if is_held(x):
        return True
    cache = _state.current().casts
    hit = None if cache is None else cache.get((id(x), "of_held"))
    return hit is not None and hit[0] is x


def _mark_of_held(out: Any) -> None:
    cache = _state.current().casts
    if cache is not None and isinstance(out, jax.Array):
        cache[(id(out), "of_held")] = (out, True)


def stash_format() -> Format | None:
    """The stored form of the values saved where the walk is now: the
    ``"residuals"`` entry of the policy in force for the current scopes
    (:meth:`AmpPolicy.residual_rule`), None for none, inside a user's
    ``jax.checkpoint`` (recomputed anyway) and in rules JAX differentiates
    itself (``WalkState.stash_off``)."""
    state = _state.current()
    if state.policy is None or state.recomputed or state.stash_off:
        return None
    rule = state.policy.residual_rule(state.scopes)
    return None if rule is None else rule.format


def encoded(x: Any, fmt: Format) -> tuple[Any, Any]:
    """``x`` in the stored form ``fmt``, ``(q, scale)``, made once per value
    and trace (the cast cache holds it), outside any gradient: every equation
    that saves ``x`` saves the same two arrays, and JAX saves them once."""
    cache = _state.current().casts
    key = (id(x), fmt)
    hit = None if cache is None else cache.get(key)
    if hit is not None and hit[0] is x:
        return hit[1]
    with jax.named_scope(STASH_SCOPE):
        out = encode(jax.lax.stop_gradient(x), fmt)
    if cache is not None:
        cache[key] = (x, out)
    return out


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["arrays"],
    meta_fields=["kind", "shape", "dtype", "perturbed", "fmt"],
)
@dataclasses.dataclass(frozen=True)
class _Saved:
    """What the backward pass keeps of one input: ``kind`` ``"raw"`` (the
    value), ``"code"`` (``(q, scale)``) or ``"none"`` (nothing: its derivative
    reads no input value)."""

    kind: str
    arrays: tuple
    shape: tuple
    dtype: Any
    perturbed: bool
    fmt: Format | None

    def value(self) -> Any:
        if self.kind == "raw":
            return self.arrays[0]
        if self.kind == "code":
            return decode(*self.arrays, self.fmt, self.dtype)
        return jnp.zeros(self.shape, self.dtype)


def _reads(closed: Any, perturbed: Sequence[bool]) -> list[bool]:
    """Per input of ``closed``: whether the cotangents of its ``perturbed``
    inputs read its value (dead-code elimination of the traced backward)."""
    core, _ = _compat.jaxpr_parts(closed)
    n = len(core.invars)
    fn = jex_core.jaxpr_as_fun(closed)
    idx = [i for i, p in enumerate(perturbed) if p]
    if not idx:
        return [False] * n

    def backward(*vals_cts):
        vals = list(vals_cts[:n])

        def of_perturbed(*xs):
            full = list(vals)
            for i, x in zip(idx, xs):
                full[i] = x
            return fn(*full)

        _, vjp = jax.vjp(of_perturbed, *(vals[i] for i in idx))
        return vjp(list(vals_cts[n:]))

    avals = [v.aval for v in core.invars] + [v.aval for v in core.outvars]
    traced = _compat.trace_to_closed_jaxpr(backward, avals)
    return _compat.used_inputs(_compat.jaxpr_parts(traced)[0])[:n]


def store_compressed(
    fn: Callable,
    invals: Sequence[Any],
    fmt: Format,
    recomputed: bool = False,
    keep: Collection[int] = (),
) -> Any:
    """``fn(*invals)``, its backward pass reading 8-bit copies of its inputs.

    The inputs the derivative reads that are not held and are compressible
    (``_stash.compressible``) are saved as ``(q, scale)`` in ``fmt``; held
    ones (alive for the step anyway) and small ones as they are; the others
    not at all. The forward result is computed from the exact inputs.

    Args:
        fn: the computation (one equation under its rule, a call, a region):
            ``fn(*invals)`` returns an array or a list of arrays.
        invals: its inputs: arrays, and literals that stay constants.
        fmt: the stored form.
        recomputed: trace ``fn`` as inside a checkpoint (its own equations
            are recomputed by the backward pass, so none of them compresses
            or re-casts on its own).
        keep: indices of ``invals`` saved as they are, never compressed.

    Returns:
        ``fn``'s outputs, or None where nothing would be stored compressed (no
        input read by the derivative is compressible, an output is not a
        float, ``fn`` closes over a traced value): the caller binds as usual.
    """
    idx = [i for i, x in enumerate(invals) if isinstance(x, jax.Array)]
    args = [invals[i] for i in idx]
    candidates = [
        compressible(x) and not _held_or_weight(x) and i not in keep
        for i, x in zip(idx, args)
    ]
    if not any(candidates):
        return None
    tree: list = []

    def flat(*arrays):
        vals = list(invals)
        for i, a in zip(idx, arrays):
            vals[i] = a
        with cast_cache(), _state.recomputing(recomputed):
            leaves, treedef = jax.tree_util.tree_flatten(fn(*vals))
        tree.append(treedef)
        return leaves

    closed = _compat.trace_to_closed_jaxpr(flat, [jax.typeof(a) for a in args])
    core, consts = _compat.jaxpr_parts(closed)
    outs_float = all(is_float(v.aval.dtype) for v in core.outvars)
    if not core.outvars or not outs_float or any(map(_compat.is_tracer, consts)):
        return None
    floats = [is_float(a.dtype) for a in args]
    reads = _reads(closed, floats)
    coded = {j for j, c in enumerate(candidates) if c and reads[j]}
    if not coded:
        return None
    codes = [a for j in sorted(coded) for a in encoded(args[j], fmt)]
    outs = _stored(closed, args, codes, sorted(coded), floats, reads, fmt)
    return jax.tree_util.tree_unflatten(tree[0], outs)


def _stored(closed, args, codes, coded, floats, reads, fmt) -> list:
    """Bind ``closed`` on ``args`` as a ``custom_vjp`` that saves ``codes``
    (``(q, scale)`` per input index in ``coded``) for those inputs."""
    n = len(args)
    fn = jex_core.jaxpr_as_fun(closed)
    slot = {j: 2 * k for k, j in enumerate(coded)}

    @jax.custom_vjp
    def stored(*xs):
        return fn(*xs[:n])

    def fwd(*primals):
        vals = [p.value for p in primals]
        perturbed = [p.perturbed for p in primals[:n]]
        need = reads if perturbed == floats else _reads(closed, perturbed)
        saved = []
        for j, x in enumerate(vals[:n]):
            meta = (x.shape, x.dtype, perturbed[j])
            if not need[j]:
                saved.append(_Saved("none", (), *meta, None))
            elif j in slot:
                k = n + slot[j]
                saved.append(_Saved("code", tuple(vals[k : k + 2]), *meta, fmt))
            else:
                saved.append(_Saved("raw", (x,), *meta, None))
        return fn(*vals[:n]), tuple(saved)

    def bwd(saved, cts):
        vals = [s.value() for s in saved]
        idx = [j for j, s in enumerate(saved) if s.perturbed]
        core, _ = _compat.jaxpr_parts(closed)
        cts = [
            jnp.zeros(v.aval.shape, v.aval.dtype) if isinstance(c, SymbolicZero) else c
            for c, v in zip(cts, core.outvars)
        ]

        def of_perturbed(*xs):
            full = list(vals)
            for j, x in zip(idx, xs):
                full[j] = x
            return fn(*full)

        _, vjp = jax.vjp(of_perturbed, *(vals[j] for j in idx))
        grads = dict(zip(idx, vjp(cts)))
        return (*(grads.get(j) for j in range(n)), *([None] * len(codes)))

    stored.defvjp(fwd, bwd, symbolic_zeros=True)
    return stored(*args, *codes)


def with_residual_dtype(amp_policy: Any, residual_dtype: Any) -> Any:
    """``amp_policy`` with ``"residuals": residual_rule(residual_dtype)`` at its
    top (``amp``'s ``residual_dtype`` argument); unchanged for None.

    Raises:
        ValueError: for a dtype other than FP8 E4M3/E5M2 or int8, or when
            ``amp_policy`` has its own ``"residuals"`` entry.
    """
    if residual_dtype is None:
        return amp_policy
    rule = ResidualRule(_stash.parse_dtype(residual_dtype, "amp(residual_dtype)"))
    if isinstance(amp_policy, Mapping) and RESIDUALS_KEY in amp_policy:
        raise ValueError(
            f"amp(residual_dtype={residual_dtype!r}) and amp_policy["
            f"{RESIDUALS_KEY!r}] both say how residuals are stored; give one."
        )
    if not isinstance(amp_policy, Mapping):
        return amp_policy  # AmpPolicy checks and names the argument
    return {**amp_policy, RESIDUALS_KEY: rule}
