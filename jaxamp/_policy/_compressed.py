"""Compressed residuals: an equation whose backward pass reads 8-bit copies.

:func:`store_compressed` binds a computation (one equation under its rule, a
call, a region) as a ``jax.custom_vjp`` whose forward pass computes exactly
what amp would and saves the inputs the derivative reads that are not held
(``_residual_format.py``: 8-bit values with per-group float32 scales), and whose
backward pass decodes them and differentiates the computation again
(``jax.vjp``: a product's forward result is dead code there, an elementwise
function is recomputed). Each value is encoded once per trace, outside any
gradient, so every equation that saves it saves the same two arrays and JAX
saves them once. See ``docs/design.md``, "Compressed residuals".
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Collection, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend import core as jex_core

from .. import _compat
from .._base import _state
from .._base._cast import cast_cache
from .._base._codec import Recipe
from .._base._dtypes import is_float
from .._base._prims import (
    CHEAP_ELEMENTWISE,
    CHOOSERS,
    EXPONENTIALS,
    MATMULS,
    READS_NO_VALUE,
)
from .._base._scopes import marker
from ._residual_format import compressible, decode, encode, product_form


def is_held(x: Any) -> bool:
    """True if ``x`` is an input of the current walk that is alive for the step."""
    held = _state.current().held
    return held is not None and held.get(id(x)) is x


def bind_compressed(call: Any, invals: Sequence[Any], fmt: Recipe) -> Any:
    """Bind one ruled equation (``_walk._loop.RuleCall``) with its saved
    inputs stored in ``fmt``; None where the caller binds it as usual."""
    if call.name in _RESHAPES:
        source = _weight_source(invals)
        if source is not None:  # a transposed weight is a weight
            out = call.apply(*invals)
            _mark_weight(out, call, invals, *source)
            return out
    if call.name == "exp":
        return _exp_storing_output(call, invals, fmt)
    if call.name in MATMULS and not fmt.format.stores_products:
        # Its inputs saved as they are (a weight remade from its held source).
        return store_compressed(call.apply, invals, fmt, keep=range(len(invals)))
    if call.name in _ELEMENTWISE:
        root = _elementwise_root(invals)
        if root is not None:  # stored as its root, remade from it
            new_in, params = call.decide(*invals)
            out = call.bind(params, *new_in)
            if call.name not in READS_NO_VALUE:
                # Its own backward pass reads the root's code (store_compressed
                # remakes the inputs); dead wherever a reader remakes ``out``.
                form = product_form(fmt) if _is_square(call, invals) else fmt
                stored = store_compressed(call.apply, invals, form)
                out = out if stored is None else stored
            _mark_derived(out, call, invals, new_in, params, root)
            return out
    if call.name in READS_NO_VALUE | EXPONENTIALS | CHOOSERS:
        return None
    return store_compressed(call.apply, invals, fmt)


# Cheap elementwise primitives whose value, recomputed from a rounded input,
# is as close as the input (no exponential, no choice): a chain of them from
# one activation (a GELU: cube, scale, tanh, cdf, product) is stored as that
# activation alone and recomputed from its code in the backward pass.
_ELEMENTWISE = CHEAP_ELEMENTWISE


def _is_square(call: Any, invals: Sequence[Any]) -> bool:
    """Whether the equation squares one value (``x ** 2``, ``square``, ``x *
    x``, a squared loss): its derivative ``2 x g`` is a product of the value,
    which inherits the stored value's error undamped (as a weight gradient
    ``x^T g`` does), so FP8 stores it in its product form (int8 in 1 x 32
    groups, 0.5% per value) where the other elementwise equations' inputs are
    FP8."""
    if call.name == "square":
        return True
    if call.name == "integer_pow":
        return call.params.get("y") == 2
    return call.name == "mul" and len(invals) == 2 and invals[0] is invals[1]


def _elementwise_root(invals: Sequence[Any]) -> Any:
    """The one activation every array input of an elementwise equation is,
    or is derived from (:func:`_mark_derived`), where it is compressible and
    not held; else None."""
    arrays = [x for x in invals if isinstance(x, jax.Array)]
    if not arrays:
        return None
    roots = set()
    root = None
    for x in arrays:
        found = weight_source_of(x)
        src = x if found is None else found[0]
        roots.add(id(src))
        root = src
    if len(roots) != 1 or is_held(root) or not compressible(root):
        return None
    if any(getattr(x, "shape", None) != root.shape for x in arrays):
        return None
    return root


def _mark_derived(out, call, invals, new_in, params, root) -> None:
    """Record ``out`` as remade from the activation ``root``: the inputs
    remade from ``root`` and cast as the rule decided (``new_in``), bound with
    the rule's ``params`` (decided once, here: the facts of a later reader
    must not change it)."""
    cache = _state.current().casts
    if cache is None or not isinstance(out, jax.Array):
        return
    derive = []
    for x in invals:
        found = weight_source_of(x) if isinstance(x, jax.Array) else None
        derive.append(None if found is None else found[1])

    def remake(src):
        vals = []
        for x, d, n in zip(invals, derive, new_in):
            if not isinstance(x, jax.Array):
                vals.append(n)
                continue
            v = src if d is None else d(src)
            if isinstance(n, jax.Array) and v.dtype != n.dtype:
                v = jax.lax.convert_element_type(v, n.dtype)
            vals.append(v)
        return call.bind(params, *vals)

    cache[(id(out), "weight")] = (out, (root, remake))


def recomputable(jaxpr: Any) -> bool:
    """``jaxpr`` (and its sub-jaxprs) can be recomputed from stored inputs:
    no product (its cost), no :data:`CHOOSERS` or :data:`EXPONENTIALS`
    (their results from rounded inputs could differ in kind)."""
    core, _ = _compat.jaxpr_parts(jaxpr)
    unsafe = CHOOSERS | EXPONENTIALS | set(MATMULS)
    for eqn in core.eqns:
        if eqn.primitive.name in unsafe:
            return False
        if not all(map(recomputable, _compat.sub_jaxprs(eqn.params))):
            return False
    return True


def _exp_storing_output(call: Any, invals: Sequence[Any], fmt: Recipe) -> Any:
    """``exp`` whose backward pass reads its output stored in ``fmt``."""
    (x,) = invals
    y = call.apply(x)
    if not (isinstance(x, jax.Array) and compressible(y)) or is_held(x):
        return y
    codes = encoded(y, fmt)

    @jax.custom_vjp
    def stored(x, q, scale):
        return call.apply(x)

    def fwd(x, q, scale):
        return call.apply(x), (q, scale)

    def bwd(saved, g):
        out = g * decode(*saved, fmt, g.dtype)
        return out.astype(x.dtype), None, None

    stored.defvjp(fwd, bwd)
    return stored(x, *codes)


RESIDUAL_SCOPE = marker("jaxamp_residual_code")
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


def _weight_source(invals: Sequence[Any]) -> tuple | None:
    """``(position, held source, derive)`` where the only array input (at
    ``position``) is held or made from a held value by :data:`_RESHAPES`
    (``derive(source)`` remakes it); else None."""
    arrays = [i for i, x in enumerate(invals) if isinstance(x, jax.Array)]
    if len(arrays) != 1:
        return None
    (i,) = arrays
    x = invals[i]
    if is_held(x):
        return i, x, None
    found = weight_source_of(x)
    return None if found is None else (i, *found)


def weight_source_of(x: Any) -> tuple | None:
    """``(held source, derive)`` of a value :func:`_mark_weight` recorded."""
    cache = _state.current().casts
    hit = None if cache is None else cache.get((id(x), "weight"))
    return hit[1] if hit is not None and hit[0] is x else None


def _mark_weight(out, call, invals, i, source, derive) -> None:
    """Record ``out = call(invals)`` as remade from the held ``source``."""
    cache = _state.current().casts
    if cache is None or not isinstance(out, jax.Array):
        return

    def remake(src):
        vals = list(invals)
        vals[i] = src if derive is None else derive(src)
        return call.apply(*vals)

    cache[(id(out), "weight")] = (out, (source, remake))


def encoded(x: Any, fmt: Recipe) -> tuple[Any, Any]:
    """``x`` in the stored form ``fmt``, ``(q, scale)``, made once per value
    and trace (the cast cache holds it), outside any gradient: every equation
    that saves ``x`` saves the same two arrays, and JAX saves them once."""
    cache = _state.current().casts
    key = (id(x), fmt)
    hit = None if cache is None else cache.get(key)
    if hit is not None and hit[0] is x:
        return hit[1]
    with jax.named_scope(RESIDUAL_SCOPE):
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
class Saved:
    """What the backward pass keeps of one input: ``kind`` ``"raw"`` (the
    value), ``"code"`` (``(q, scale)``), ``"cast"`` (a copy in a narrower
    dtype) or ``"none"`` (nothing: its derivative reads no input value);
    ``perturbed``: a float input, whose cotangent the backward pass
    computes."""

    kind: str
    arrays: tuple
    shape: tuple
    dtype: Any
    perturbed: bool
    fmt: Recipe | None

    def value(self) -> Any:
        if self.kind == "raw":
            return self.arrays[0]
        if self.kind == "code":
            return decode(*self.arrays, self.fmt, self.dtype)
        if self.kind == "cast":
            return self.arrays[0].astype(self.dtype)
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
        return partial_vjp(fn, vals_cts[:n], idx, vals_cts[n:])

    avals = [v.aval for v in core.invars] + [v.aval for v in core.outvars]
    traced = _compat.trace_to_closed_jaxpr(backward, avals)
    return _compat.used_inputs(_compat.jaxpr_parts(traced)[0])[:n]


def store_compressed(
    fn: Callable,
    invals: Sequence[Any],
    fmt: Recipe,
    recomputed: bool = False,
    keep: Collection[int] = (),
) -> Any:
    """``fn(*invals)``, its backward pass reading 8-bit copies of its inputs.

    The inputs the derivative reads that are not held and are compressible
    (``_residual_format.compressible``) are saved as ``(q, scale)`` in ``fmt``; held
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
        keep: indices of ``invals`` saved as they are, never compressed;
            with ``keep``, ``fn`` is bound here if some input is remade from
            another value (a transposed weight) even when none is compressed.

    Returns:
        ``fn``'s outputs, or None where nothing would be stored compressed (no
        input read by the derivative is compressible, an output is not a
        float, ``fn`` closes over a traced value): the caller binds as usual.
    """
    idx = [i for i, x in enumerate(invals) if isinstance(x, jax.Array)]
    # A value made from a held one (a transposed weight) is remade from it in
    # both passes: the held value is saved, not a copy.
    weights = [weight_source_of(invals[i]) for i in idx]
    args = [invals[i] if w is None else w[0] for i, w in zip(idx, weights)]
    candidates = [
        compressible(x) and not is_held(x) and i not in keep for i, x in zip(idx, args)
    ]
    # With ``keep``, a call whose inputs are remade from held or stored
    # sources is bound here even when nothing is compressed.
    remade = bool(keep) and any(w is not None for w in weights)
    if not any(candidates) and not remade:
        return None
    tree: list = []

    def flat(*arrays):
        vals = list(invals)
        for i, a, w in zip(idx, arrays, weights):
            vals[i] = a if w is None else w[1](a)
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
    if not coded and not remade:
        return None
    codes = [a for j in sorted(coded) for a in encoded(args[j], fmt)]
    outs = _stored(closed, args, codes, sorted(coded), floats, reads, fmt)
    return jax.tree_util.tree_unflatten(tree[0], outs)


def _stored(closed, args, codes, coded, floats, reads, fmt) -> list:
    """Bind ``closed`` on ``args`` as a ``custom_vjp`` that saves ``codes``
    (``(q, scale)`` per input index in ``coded``) for those inputs.

    What is saved depends only on the avals (JAX may trace the forward rule
    more than once, e.g. while a ``scan`` settles which carries are perturbed,
    and needs one residual structure); cotangents are computed for every
    float input (JAX drops those of unperturbed ones)."""
    n = len(args)
    fn = jex_core.jaxpr_as_fun(closed)
    slot = {j: 2 * k for k, j in enumerate(coded)}

    @jax.custom_vjp
    def stored(*xs):
        return fn(*xs[:n])

    def fwd(*vals):
        saved = []
        for j, x in enumerate(vals[:n]):
            meta = (x.shape, x.dtype, floats[j])
            if not reads[j]:
                saved.append(Saved("none", (), *meta, None))
            elif j in slot:
                k = n + slot[j]
                saved.append(Saved("code", tuple(vals[k : k + 2]), *meta, fmt))
            else:
                saved.append(Saved("raw", (x,), *meta, None))
        return fn(*vals[:n]), tuple(saved)

    def bwd(saved, cts):
        vals = [s.value() for s in saved]
        idx = [j for j, s in enumerate(saved) if s.perturbed]
        grads = dict(zip(idx, partial_vjp(fn, vals, idx, cts)))
        return (*(grads.get(j) for j in range(n)), *([None] * len(codes)))

    stored.defvjp(fwd, bwd)
    return stored(*args, *codes)


def partial_vjp(fn: Any, vals: Sequence[Any], idx: list[int], cts: Sequence[Any]):
    """The VJP of ``fn(*vals)`` with respect to the positions ``idx`` of
    ``vals`` only (the others held constant), for output cotangents ``cts``."""

    def of(*xs):
        full = list(vals)
        for i, x in zip(idx, xs):
            full[i] = x
        return fn(*full)

    _, vjp = jax.vjp(of, *(vals[i] for i in idx))
    return vjp(list(cts))
