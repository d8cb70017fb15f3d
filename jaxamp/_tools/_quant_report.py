"""Which matmuls ran in which format: a per-matmul report of a traced function
and the share of matmul FLOPs that ran in 8 bits."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np

from .. import _compat
from .._base import _structure
from .._base._dtypes import is_float
from .._base._formats import label_of
from .._base._scopes import eqn_scopes, scope_path
from .._quant._chips import SCOPES as CHIP_SCOPES
from .._quant._common import (
    KEPT_SCOPE,
    LOSS_SCOPE,
    SMALL_SCOPE,
    Dims,
)
from .._rewrites._attention import FUSED_SCOPE
from ._measure import matmul_flops_by_dtype

_REASONS = (
    (LOSS_SCOPE, "feeds the loss: kept in the compute dtype"),
    (SMALL_SCOPE, "below the size rule"),
    (KEPT_SCOPE, "kept in the compute dtype by the recipe"),
    (FUSED_SCOPE, "fused attention"),
)


def _is_8bit(name: str) -> bool:
    return np.dtype(name).itemsize == 1


def eight_bit_flop_share(closed: Any) -> float:
    """Share of matrix-product FLOPs whose two operands are 8-bit (int8 or a
    float8 type), counted as :func:`jaxamp.tools.matmul_flops_by_dtype` counts.

    Args:
        closed: a ``ClosedJaxpr`` or ``Jaxpr``, e.g.
            ``jax.make_jaxpr(jax.grad(amp(loss)))(params, batch)``.

    Returns:
        A float in [0, 1]; 0.0 for a jaxpr without matrix products.

    Raises:
        TypeError: if ``closed`` is not a jaxpr.
    """
    flops = matmul_flops_by_dtype(closed)
    total = sum(flops.values())
    low = sum(f for k, f in flops.items() if all(map(_is_8bit, k.split(" x "))))
    return low / total if total else 0.0


class MatmulRecord(NamedTuple):
    """One ``dot_general`` of a traced function (see :func:`quantization_report`).

    Attributes:
        scope: the user's ``jax.named_scope`` path, e.g. ``"block/mlp"``
            (``""`` outside any scope).
        source: ``"file.py:LINE:COL (function)"`` of the user code.
        shape: ``(batch, M, K, N)`` of the product (per-batch rows, contraction
            and columns).
        format: an 8-bit product's format label (``"int8"``; ``"fp8"`` for
            E4M3 and E5M2 operands; a format added by
            :func:`jaxamp.extend.register_format` by its label, else the dtype
            name), or the operand dtype name (``"bfloat16"``;
            ``"float32 x bfloat16"`` when they differ).
        flops: FLOPs per call of the function (``scan`` bodies weighted by
            their length).
        reason: why an unquantized product stayed in its format: ``"feeds
            the loss: kept in the compute dtype"`` (an 8-bit policy's
            ``quantize_last_matmul=False``), ``"below
            the size rule"`` (an 8-bit policy skipped it), ``"kept in the
            compute dtype by the recipe"`` (int8's default wgrad),
            ``"fused attention"`` (re-dispatched attention, never quantized),
            ``"integer operands"``, or ``"not quantized by the policy"``;
            for an 8-bit product of :func:`jaxamp.eight_bit_policy`, the
            format it picked, for which chip and why (``"int8 pays on TPU
            v5e: TPU v5e's MXU runs s8 x s8 -> s32 at twice its bf16 rate
            ..."``); ``""`` for another 8-bit product.
    """

    scope: str
    source: str
    shape: tuple
    format: str
    flops: float
    reason: str


def _walk(closed: Any, weight: float, outer: tuple):
    core, _ = _compat.jaxpr_parts(closed)
    for eqn in core.eqns:
        scopes = eqn_scopes(outer, eqn)
        yield eqn, weight, scopes
        inner = weight * _structure.trips(eqn)  # a loop's static trip count
        for sub in _compat.sub_jaxprs(eqn.params):
            yield from _walk(sub, inner, scopes)


def _record(eqn: Any, weight: float, scopes: tuple) -> MatmulRecord:
    lhs, rhs = (v.aval for v in eqn.invars[:2])
    dn = eqn.params["dimension_numbers"]
    d = Dims.of(dn, len(lhs.shape), len(rhs.shape))
    m, k, n = d.mkn(lhs.shape, rhs.shape)
    batch = int(np.prod([lhs.shape[i] for i in d.lb], dtype=np.int64))
    names = [np.dtype(lhs.dtype).name, np.dtype(rhs.dtype).name]
    if all(map(_is_8bit, names)):
        labels = [label_of(lhs.dtype), label_of(rhs.dtype)]  # registered formats'
        fmt = labels[0] if labels[0] == labels[1] else " x ".join(labels)
        chips = [CHIP_SCOPES[s] for s in scopes if s in CHIP_SCOPES]
        reason = (
            f"{chips[0].format} pays on {chips[0].name}: {chips[0].why}"
            if chips
            else ""
        )
    else:
        fmt = names[0] if names[0] == names[1] else " x ".join(names)
        reasons = [text for scope, text in _REASONS if scope in scopes]
        if reasons:
            reason = reasons[0]
        elif not all(map(is_float, names)):
            reason = "integer operands"
        else:
            reason = "not quantized by the policy"
    flops = 2.0 * batch * m * k * n * weight
    return MatmulRecord(
        scope_path(scopes),
        _compat.source_line(eqn),
        (batch, m, k, n),
        fmt,
        flops,
        reason,
    )


def quantization_report(fn: Callable, *args: Any, **kwargs: Any) -> list[MatmulRecord]:
    """Every matmul of ``fn`` with its format, shape and source.

    Traces ``fn`` (``jax.make_jaxpr``) and lists each ``dot_general`` of its
    jaxpr and sub-jaxprs. Pass the amp-transformed loss to see the forward
    products (one per linear layer: an 8-bit policy's dgrad and wgrad follow
    the forward's size decision), or ``jax.grad`` of it to see all three
    products of every layer.

    Example::

        loss8 = jaxamp.amp(loss, compute_dtype=jnp.bfloat16,
                           amp_policy=jaxamp.int8_amp_policy)
        for r in jaxamp.quantization_report(loss8, params, batch):
            print(r.scope, r.shape, r.format, r.reason)

    Args:
        fn: a function of arrays.
        *args: its positional inputs (arrays or ``jax.ShapeDtypeStruct``).
        **kwargs: its keyword inputs.

    Returns:
        A list of :class:`MatmulRecord`, in jaxpr order (depth first).

    Raises:
        TypeError: if ``fn`` is not callable.
    """
    if not callable(fn):
        raise TypeError(
            "quantization_report(fn, *args): fn must be callable (e.g. the "
            f"amp-transformed loss), got {type(fn).__name__}."
        )
    closed = jax.make_jaxpr(fn)(*args, **kwargs)
    return [
        _record(eqn, w, scopes)
        for eqn, w, scopes in _walk(closed, 1.0, ())
        if eqn.primitive.name == "dot_general"
    ]
