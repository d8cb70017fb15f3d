"""FP8 matmuls as one more amp rule: per-tensor current scaling, direct
quantization, E4M3 forward and E5M2 gradients.

Recipe (Micikevicius et al. 2022, "FP8 Formats for Deep Learning",
https://arxiv.org/abs/2209.05433; NVIDIA Transformer Engine's
``Float8CurrentScaling`` with its ``HYBRID`` format,
https://nvidia.github.io/TransformerEngine/api/common.html; torchao's float8
training with dynamic scaling, https://github.com/pytorch/ao/tree/main/torchao/float8):

* forward: each operand is scaled by ``fp8_max / amax / 2**margin`` (``amax``
  its current absolute maximum) and cast to real ``float8_e4m3fn`` arrays;
  ``dot_general`` runs on the float8 operands with a bfloat16 result times the
  product of the inverse scales (one cuBLASLt FP8 call on a GPU,
  :func:`_scaled_gemm`), or, for other result dtypes, with a float32 result
  multiplied by the inverse scales one at a time and cast;
* backward (``jax.custom_vjp``): the incoming gradient is scaled the same way
  and cast to ``float8_e5m2``; both gradient products are E5M2 x E4M3 (never
  E5M2 x E5M2, which cuBLASLt lacks); the float8 operands are the saved
  residuals (1 byte per element).

*Current* scaling, not delayed scaling: delayed scaling (an amax history,
1024 steps in Transformer Engine, 16 in torchao's former default) needs
per-layer state carried from step to step. An amp rule sees one trace of the
loss and owns no state: the user would have to thread the histories through
the training step by hand (Flax's "overwrite with gradient" collection,
Haliax's ``OverwriteWithGradient`` modules), which is exactly what jaxamp
avoids. Current scaling is also the more accurate of the two; torchao deleted
delayed scaling in 2025 (pytorch/ao#1753) for that reason and for lack of
users. The price is one extra reduction (amax) per operand per matmul, once:
a user's ``jax.checkpoint`` saves each amax (one float32) and its recompute
scales by it (``_policy/_checkpoint.SavingAmax``), where a hand-written
checkpointed FP8 layer reduces every activation's amax again.

Direct quantization, not quantize-dequantize: the product really is bound on
float8 operands rather than left to a compiler pattern match that silently
falls back to a 16-bit GEMM (Transformer Engine moved JAX to direct
quantization in NVIDIA/TransformerEngine#1819; Flax deprecated its QDQ op).

The quantization is the codec's (``_base/_codec.py``: one scale per tensor, a
multiplier). The formats are registered values (``_base/_formats.py``):
``format=`` runs the same recipe with another 8-bit float format, its
gradients in that format's ``grad`` format.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import _compat
from .._base import _formats
from .._base._codec import PerTensor, Recipe
from .._base._codec import quantize as _quantize
from .._base._dtypes import is_float
from .._base._jaxpr import prepare_operand
from ._common import (
    check_size_rule,
    eight_bit_rule,
    narrowed,
    scoped_policy,
    torchao_tensorwise_size_rule,
)

E4M3 = np.dtype(jnp.float8_e4m3fn)
E5M2 = np.dtype(jnp.float8_e5m2)


def _is_fp8(dtype: Any) -> bool:
    return np.dtype(dtype).itemsize == 1 and is_float(dtype)


def fp8_quantize(
    x: jax.Array, dtype: Any, margin: int = 0, power_of_two: bool = False
) -> tuple[jax.Array, jax.Array]:
    """Scale ``x`` by ``fp8_max / amax / 2**margin`` and cast it to ``dtype``.

    Per-tensor current scaling (Transformer Engine's ``Float8CurrentScaling``):
    ``amax`` is ``max(|x|)`` of this very tensor, so the largest element lands
    on the format's maximum (448 for E4M3, 57344 for E5M2) less the margin.

    Args:
        x: a float array of any shape and float dtype.
        dtype: the 8-bit float dtype, ``jnp.float8_e4m3fn`` or
            ``jnp.float8_e5m2``.
        margin: power-of-two headroom below the format's maximum
            (Transformer Engine's ``margin``; 0 uses the full range).
        power_of_two: round the scale down to a power of two (Transformer
            Engine's ``power_2_scale``), so that scaling and unscaling are
            exact and only the cast to ``dtype`` rounds.

    Returns:
        ``(q, scale)``: ``q`` of ``x``'s shape in ``dtype``, and the float32
        scalar ``scale`` with ``q ~= x * scale``. An all-zero ``x`` gets scale 1
        (zeros stay zeros); a non-finite amax gets scale 1 too, so inf/NaN
        reach the float8 array (as NaN: ``float8_e4m3fn`` has no inf) and the
        product, where a loss scaler sees them. Scales are capped at
        ``2**126`` (so that ``1 / scale`` is a normal float32): a tensor with
        amax below ``fp8_max * 2**-126`` (5.3e-36 for E4M3) uses less than the
        full float8 range instead of overflowing the scale to inf (Transformer
        Engine caps at float32's maximum instead).

    Raises:
        ValueError: if ``dtype`` is not an 8-bit float dtype.
    """
    if not _is_fp8(dtype):
        raise ValueError(
            f"fp8_quantize(x, dtype): dtype must be an 8-bit float such as "
            f"jnp.float8_e4m3fn or jnp.float8_e5m2, got {dtype!r}."
        )
    return _per_tensor(x, _formats.as_format(dtype, "dtype"), margin, power_of_two)


def _per_tensor(x, fmt, margin, power_of_two):
    recipe = Recipe(
        format=fmt, group=PerTensor(), margin=margin, power_of_two=power_of_two
    )
    return _quantize(x, recipe)


def _unscale(out: jax.Array, scale_a: jax.Array, scale_b: jax.Array) -> jax.Array:
    # One factor at a time: scale_a * scale_b can overflow (two tiny operands)
    # or underflow (two huge ones) where the product of the operands does not.
    return out * (np.float32(1) / scale_a) * (np.float32(1) / scale_b)


def _scaled_gemm(product: Any, qa, sa, qb, sb, out_dtype) -> jax.Array:
    """``product(qa, qb, preferred_element_type)`` of two 8-bit operands,
    unscaled by their per-tensor scales ``sa`` and ``sb`` (``q = x * s``), in
    ``out_dtype``.

    For a bfloat16 ``out_dtype`` the product's result is bfloat16 itself and
    the two inverse scales, multiplied in float32, are one scalar multiply on
    it: the pattern XLA's GEMM rewriter folds into the cuBLASLt FP8 call
    (``__cublas$lt$matmul$f8`` with a bf16 result and its scale operand), so no
    float32 result is written and no kernel rescales it (NVIDIA, "Using FP8
    with Transformer Engine"; openxla ``gemm_rewriter``). The scalar is
    rounded to ``out_dtype`` (relative error at most ``2**-9`` for bfloat16,
    the same for every element, below the result's own rounding). Other
    dtypes take a float32 result, unscaled one factor at a time, then cast:
    float16 could not hold the unscaled product (up to ``448**2`` per term)
    wherever XLA does not fold the scale into the GEMM.
    """
    dt = np.dtype(out_dtype)
    if dt == np.dtype(jnp.bfloat16):
        inv = (np.float32(1) / sa) * (np.float32(1) / sb)
        return product(qa, qb, dt) * inv.astype(dt)
    return _unscale(product(qa, qb, jnp.float32), sa, sb).astype(dt)


def fp8_dot_general(
    lhs: jax.Array,
    rhs: jax.Array,
    dimension_numbers: Any,
    out_dtype: Any = jnp.bfloat16,
    margin: int = 0,
    power_of_two: bool = False,
    format: Any = "float8_e4m3fn",
) -> jax.Array:
    """``lax.dot_general`` computed in FP8 (E4M3 operands, E5M2 gradients).

    Forward: ``lhs`` and ``rhs`` are quantized to ``float8_e4m3fn`` with
    per-tensor current scales (:func:`fp8_quantize`), each in a call of its own
    (``_base/_jaxpr.prepare_operand``: inside ``lax.scan``, a stacked weight's
    quantization moves before the loop, one per layer and step), multiplied by
    ``lax.dot_general`` on the float8 arrays, and the result is multiplied by
    the two inverse scales (a bfloat16 result for a bfloat16 ``out_dtype``,
    else float32; :func:`_scaled_gemm`). Backward (``jax.grad``,
    ``jax.vjp``): the output cotangent is quantized to ``float8_e5m2`` and
    the two gradient products are E5M2 x E4M3 with the saved float8 operands.

    Error: each quantized element carries a relative rounding error of at most
    ``2**-4`` (E4M3, 3 mantissa bits) or ``2**-3`` (E5M2, 2 mantissa bits),
    plus an absolute error of half the smallest subnormal for elements far
    below ``amax``; products are exact in float32, sums are float32.

    Args:
        lhs: float array, any float dtype, shape as for ``lax.dot_general``.
        rhs: float array, any float dtype.
        dimension_numbers: ``((lhs_contract, rhs_contract), (lhs_batch,
            rhs_batch))`` as for ``lax.dot_general``.
        out_dtype: dtype of the result (the amp compute dtype or float32).
        margin: power-of-two headroom of the per-tensor scales.
        power_of_two: round every scale down to a power of two.
        format: the operands' 8-bit float format, a registered name or dtype
            (:func:`jaxamp.extend.register_format`); the cotangent takes the format's
            gradient format (E5M2 for the default E4M3).

    Returns:
        The product, shape as ``lax.dot_general``'s, dtype ``out_dtype``.
        Gradients come back in ``lhs``'s and ``rhs``'s dtypes. Zero operands
        give zeros; an inf or NaN anywhere in an operand (or, backward, in the
        cotangent) gives NaNs in the result (or gradients).

    Raises:
        TypeError: from ``lax.dot_general`` if the shapes do not match
            ``dimension_numbers``.
        ValueError: if ``format`` is not a registered 8-bit float format.
    """
    fmt = _float_format(format, "fp8_dot_general(format)")
    lq, ls = _prepared(lhs, fmt, margin, power_of_two)
    rq, rs = _prepared(rhs, fmt, margin, power_of_two)
    args = (dimension_numbers, out_dtype, margin, power_of_two, fmt)
    return _fp8_product(lhs, rhs, lq, ls, rq, rs, *args)


def _float_format(spec: Any, argname: str) -> _formats.QFormat:
    fmt = _formats.require(spec, argname)
    if fmt.kind != "float":
        raise ValueError(f"{argname}={spec!r}: {fmt.name} is no 8-bit float format.")
    return fmt


def _prepared(x, fmt, margin, power_of_two):
    """``(q, scale)`` of ``x``: per-tensor current scaling, as a prepared
    operand (no gradient; hoisted out of a scan over stacked weights)."""
    quantize = functools.partial(
        _per_tensor, fmt=fmt, margin=margin, power_of_two=power_of_two
    )
    return prepare_operand(quantize, x)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9, 10))
def _fp8_product(lhs, rhs, lq, ls, rq, rs, dn, out_dtype, margin, power_of_two, fmt):
    """The FP8 product of the quantized ``(lq, ls)`` and ``(rq, rs)``;
    ``lhs`` and ``rhs`` (not read) take the gradients, in their dtypes."""
    args = (dn, out_dtype, margin, power_of_two, fmt)
    return _fp8_fwd(lhs, rhs, lq, ls, rq, rs, *args)[0]


def _fp8_fwd(lhs, rhs, lq, ls, rq, rs, dn, out_dtype, margin, power_of_two, fmt):
    product = lambda a, b, dt: jax.lax.dot_general(  # noqa: E731
        a, b, dn, preferred_element_type=dt
    )
    out = _scaled_gemm(product, lq, ls, rq, rs, out_dtype)
    # Empty arrays carry the operand dtypes (residuals must be arrays).
    return out, (lq, ls, rq, rs, jnp.zeros(0, lhs.dtype), jnp.zeros(0, rhs.dtype))


def _fp8_bwd(dn, out_dtype, margin, power_of_two, fmt, res, g):
    lq, ls, rq, rs, ldt, rdt = res
    gq, gs = _per_tensor(g, fmt.grad_format, margin, power_of_two)

    # Each gradient GEMM's result in bf16 where the forward's is (bf16
    # gradients, as the bf16 step's), then the operand's dtype.
    def dl_product(a, b, dt):
        return _compat.dot_general_transpose_lhs(a, lq, b, dn, dt)

    def dr_product(a, b, dt):
        return _compat.dot_general_transpose_rhs(a, b, rq, dn, dt)

    gdt = _grad_dtype(out_dtype)
    dl = _scaled_gemm(dl_product, gq, gs, rq, rs, gdt).astype(ldt.dtype)
    dr = _scaled_gemm(dr_product, gq, gs, lq, ls, gdt).astype(rdt.dtype)
    return dl, dr, None, None, None, None


_fp8_product.defvjp(_fp8_fwd, _fp8_bwd)


def _grad_dtype(out_dtype) -> np.dtype:
    """The gradient GEMMs' result dtype: bfloat16 where the forward's result is
    (the compute dtype, with float32's range), else float32 (a float16 weight
    gradient, summed over every token, can exceed float16's range)."""
    dt = np.dtype(out_dtype)
    return dt if dt == np.dtype(jnp.bfloat16) else np.dtype(np.float32)


def fp8_rule(
    margin: int = 0,
    out_dtype: Any = None,
    power_of_two: bool = False,
    *,
    size_rule: Any = torchao_tensorwise_size_rule,
    quantize_last_matmul: bool = False,
    format: Any = "float8_e4m3fn",
):
    """An amp *implementation rule* for ``dot_general`` that runs it in FP8.

    Implementation rules (:class:`jaxamp.rules.ImplementationRule`) have the rule
    signature but return the equation's outputs instead of
    ``(invars, bind_params)``; the interpreter uses them as they are. This one
    binds :func:`fp8_dot_general` for products of two floats that pass
    ``size_rule``; smaller products run in the compute dtype as under the
    default policy (the quantization passes would cost more than the 8-bit
    product saves). Integer products fall back to the compute-dtype rule;
    products that already have an 8-bit operand (the user quantized them) are
    bound unchanged.

    Args:
        margin: power-of-two headroom of the scales (Transformer Engine's
            ``margin``, default 0).
        out_dtype: result dtype; None for the amp compute dtype.
        power_of_two: round the scales down to powers of two.
        size_rule: ``(m, k, n) -> bool`` on the forward product's per-batch
            rows (the activation's free elements), contraction and columns
            (the weight's, as :func:`jaxamp.quant.int8_rule` reads them): True to
            run it in FP8. Default
            :func:`jaxamp.quant.torchao_tensorwise_size_rule` (torchao's H100
            crossover for per-tensor scales: skip ``K <= 4096 and
            N <= 1024``); None runs every matmul in FP8;
            :class:`jaxamp.quant.min_matmul_size` builds thresholds.
        quantize_last_matmul: run a product that feeds the loss (no other
            matmul reads it: a language model's head) in FP8 too. Default
            False: it runs in the compute dtype with a float32 result
            (torchtitan's MXFP8 converter skips the ``output`` layer;
            DeepSeek-V3 keeps the output head in BF16).
        format: the operands' 8-bit float format, a registered name or dtype
            (default E4M3; gradients in its gradient format, E5M2); its
            matmuls run inside the scope ``jaxamp_<label>_matmul``.

    Returns:
        The rule, to put under the ``"dot_general"`` key of a policy (or use
        :func:`fp8_policy`).

    Raises:
        ValueError: if ``format`` is not a registered 8-bit float format.
    """
    fmt = _float_format(format, "fp8_rule(format)")

    def quantized(lhs, rhs, dn, compute_dtype):
        dtype = np.dtype(compute_dtype if out_dtype is None else out_dtype)
        # Per-tensor scales treat both operands alike: both are narrowed.
        lhs, rhs = (narrowed(x, compute_dtype) for x in (lhs, rhs))
        return fp8_dot_general(lhs, rhs, dn, dtype, margin, power_of_two, fmt)

    size_rule = check_size_rule(size_rule, "fp8_rule")
    name = f"fp8_rule(margin={margin}, power_of_two={power_of_two})"
    if fmt.dtype != E4M3:
        name = f"{name[:-1]}, format={fmt.name!r})"
    last = bool(quantize_last_matmul)
    return eight_bit_rule(name, size_rule, "auto", fmt.scope, quantized, last)


def fp8_policy(
    scopes: Iterable[str] | None = None,
    exclude_scopes: Iterable[str] = (),
    *,
    margin: int = 0,
    power_of_two: bool = False,
    size_rule: Any = torchao_tensorwise_size_rule,
    quantize_last_matmul: bool = False,
    format: Any = "float8_e4m3fn",
    base: Mapping[Any, Any] | None = None,
) -> dict[Any, Any]:
    """An amp policy with FP8 matmuls everywhere or only inside named scopes.

    Built from nested policies: a ``jax.named_scope`` key whose value is a
    policy applies that policy to every equation inside the scope, and the
    outermost scope component found in a policy wins over primitive keys. A
    scope key therefore never maps to the FP8 rule itself (it would be
    applied to *every* primitive in the scope) but to ``base`` with its
    ``dot_general`` entry replaced.

    Examples::

        fp8_policy()                                  # == jaxamp.fp8_amp_policy
        fp8_policy(exclude_scopes=("embed", "head"))  # all but first/last layer
        fp8_policy(scopes=("mlp",))                   # only the MLPs
        fp8_policy(size_rule=None)                    # small matmuls too
        fp8_policy(format="e3m4")                     # a registered format
        # expands to {**default_amp_policy,
        #             "mlp": {**default_amp_policy, "dot_general": fp8_rule()}}

    Scope names match whole components of the ``jax.named_scope`` stack
    (``"mlp"`` matches ``block/mlp`` but not ``mlp_out``). An excluded scope
    wins wherever it appears: outside an included scope, inside it, or
    enclosing it.

    Args:
        scopes: scope names whose matmuls run in FP8; None for all matmuls.
        exclude_scopes: scope names whose matmuls keep the ``base`` rule.
        margin: passed to :func:`fp8_rule`.
        power_of_two: passed to :func:`fp8_rule`.
        size_rule: passed to :func:`fp8_rule`: which matmuls are large
            enough to pay for FP8 (default torchao's tensorwise filter).
        quantize_last_matmul: passed to :func:`fp8_rule` (default False:
            the product feeding the loss stays in the compute dtype).
        format: passed to :func:`fp8_rule`: the operands' 8-bit float
            format (default E4M3, gradients E5M2).
        base: the policy for everything else; default
            ``jaxamp.default_amp_policy``.

    Returns:
        A policy dict for ``jaxamp.amp(..., amp_policy=...)`` (use a bfloat16
        compute dtype).

    Raises:
        TypeError: if ``scopes`` or ``exclude_scopes`` is a single string
            rather than a collection of names.
        ValueError: if ``format`` is not a registered 8-bit float format.
    """
    rule = fp8_rule(
        margin,
        None,
        power_of_two,
        size_rule=size_rule,
        quantize_last_matmul=quantize_last_matmul,
        format=format,
    )
    return scoped_policy("fp8_policy", rule, scopes, exclude_scopes, base)


fp8_amp_policy: dict[Any, Any] = fp8_policy()
"""The default policy with every float ``dot_general`` that passes torchao's
tensorwise size rule in FP8, but the one feeding the loss (use a
``jnp.bfloat16`` compute dtype);
:func:`fp8_policy` builds per-scope and tuned variants. Equivalent nested forms:
``{**default_amp_policy, "mlp": fp8_amp_policy}`` (FP8 only inside ``mlp``
scopes), ``{**fp8_amp_policy, "head": default_amp_policy}`` (all but the
``head`` scope)."""
