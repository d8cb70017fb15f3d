"""FP8 matmuls as one more amp rule: per-tensor current scaling, direct
quantization, E4M3 forward and E5M2 gradients.

Recipe (Micikevicius et al. 2022, "FP8 Formats for Deep Learning",
https://arxiv.org/abs/2209.05433; NVIDIA Transformer Engine's
``Float8CurrentScaling`` with its ``HYBRID`` format; torchao's float8 training):

* forward: each operand is scaled by ``fp8_max / amax`` (``amax`` its current
  absolute maximum, ``2**-margin`` headroom) and cast to real
  ``float8_e4m3fn`` arrays; ``dot_general`` runs on the float8 operands with a
  float32 result, multiplied by the inverse scales and cast to the compute dtype;
* backward (``jax.custom_vjp``): the incoming gradient is scaled and cast to
  ``float8_e5m2``; both gradient products are E5M2 x E4M3 (never E5M2 x E5M2,
  which cuBLASLt lacks); the float8 operands are the saved residuals.

*Current* scaling, not delayed scaling: delayed scaling (an amax history,
1024 steps in Transformer Engine) needs per-layer state threaded through the
training step by the user, which an amp rule cannot own; torchao removed
delayed scaling in 2025 in favour of current scaling. Direct quantization,
not quantize-dequantize: the product really is bound on float8 operands
rather than left to a compiler pattern match that silently falls back to a
16-bit GEMM.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import _compat
from ._dtypes import is_float
from ._rules import default_amp_policy, use_compute_precision

E4M3 = np.dtype(jnp.float8_e4m3fn)
E5M2 = np.dtype(jnp.float8_e5m2)


def quantize(x: jax.Array, dtype: Any, margin: int = 0) -> tuple[jax.Array, jax.Array]:
    """Scale ``x`` by ``fp8_max / amax / 2**margin`` and cast it to ``dtype``.

    Args:
        x: a float array of any shape.
        dtype: ``jnp.float8_e4m3fn`` or ``jnp.float8_e5m2``.
        margin: power-of-two headroom below the format's maximum.

    Returns:
        ``(q, scale)``: ``q`` of ``x``'s shape in ``dtype``, and the float32
        scalar ``scale`` with ``q ~= x * scale``. An all-zero ``x`` gets scale 1
        (zeros stay zeros); a non-finite amax gets scale 1 too, so inf/NaN reach
        the float8 array (as NaN) and the product, where a loss scaler sees them.
    """
    fmax = float(jnp.finfo(dtype).max)
    amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
    ok = (amax > 0) & jnp.isfinite(amax)
    scale = jnp.where(ok, np.float32(fmax / 2.0**margin) / jnp.where(ok, amax, 1), 1)
    scale = scale.astype(jnp.float32)
    return (x.astype(jnp.float32) * scale).astype(dtype), scale


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def fp8_dot_general(
    lhs: jax.Array,
    rhs: jax.Array,
    dimension_numbers: Any,
    out_dtype: Any = jnp.bfloat16,
    margin: int = 0,
) -> jax.Array:
    """``lax.dot_general`` computed in FP8 (E4M3 operands, E5M2 gradients).

    Args:
        lhs, rhs: float arrays, any float dtype (shapes as for
            ``lax.dot_general``).
        dimension_numbers: ``((lhs_contract, rhs_contract), (lhs_batch,
            rhs_batch))``.
        out_dtype: dtype of the result (the amp compute dtype or float32).
        margin: power-of-two headroom of the per-tensor scales.

    Returns:
        The product, shape as ``lax.dot_general``'s, dtype ``out_dtype``.
        Gradients come back in ``lhs``'s and ``rhs``'s dtypes.
    """
    return _fp8_fwd(lhs, rhs, dimension_numbers, out_dtype, margin)[0]


def _fp8_fwd(lhs, rhs, dimension_numbers, out_dtype, margin):
    lq, ls = quantize(lhs, E4M3, margin)
    rq, rs = quantize(rhs, E4M3, margin)
    out = jax.lax.dot_general(
        lq, rq, dimension_numbers, preferred_element_type=jnp.float32
    )
    out = (out / (ls * rs)).astype(out_dtype)
    # Empty arrays carry the operand dtypes (residuals must be arrays).
    return out, (lq, ls, rq, rs, jnp.zeros(0, lhs.dtype), jnp.zeros(0, rhs.dtype))


def _fp8_bwd(dimension_numbers, out_dtype, margin, res, g):
    del out_dtype
    lq, ls, rq, rs, ldt, rdt = res
    gq, gs = quantize(g, E5M2, margin)
    dl = _compat.dot_general_transpose_lhs(gq, lq, rq, dimension_numbers)
    dr = _compat.dot_general_transpose_rhs(gq, lq, rq, dimension_numbers)
    return (dl / (gs * rs)).astype(ldt.dtype), (dr / (ls * gs)).astype(rdt.dtype)


fp8_dot_general.defvjp(_fp8_fwd, _fp8_bwd)


def fp8_rule(margin: int = 0, out_dtype: Any = None):
    """An amp *implementation rule* for ``dot_general`` that runs it in FP8.

    Implementation rules (attribute ``amp_impl = True``) return the outputs
    instead of ``(invars, params)``. Non-float products (integer matmuls) fall
    back to the compute dtype rule.

    Args:
        margin: power-of-two headroom of the scales (Transformer Engine's
            ``margin``, default 0).
        out_dtype: result dtype; None for the amp compute dtype.

    Returns:
        The rule, to put under the ``"dot_general"`` key of a policy.
    """

    def rule(compute_dtype, original_dtypes, lhs, rhs, **params):
        if not (is_float(lhs.dtype) and is_float(rhs.dtype)):
            new_in, new_params = use_compute_precision(
                compute_dtype, original_dtypes, lhs, rhs, **params
            )
            return jax.lax.dot_general_p.bind(*new_in, **new_params)
        dtype = compute_dtype if out_dtype is None else out_dtype
        return fp8_dot_general(
            lhs, rhs, params["dimension_numbers"], np.dtype(dtype), margin
        )

    rule.amp_impl = True
    rule.__name__ = f"fp8_rule(margin={margin})"
    return rule


fp8_amp_policy: dict[Any, Any] = {**default_amp_policy, "dot_general": fp8_rule()}
"""The default policy with every float ``dot_general`` in FP8 (compute dtype:
use ``jnp.bfloat16``). Per-scope selection uses nested policies, e.g.
``{**default_amp_policy, "mlp": fp8_amp_policy}`` (FP8 only inside ``mlp``
scopes) or ``{**fp8_amp_policy, "head": default_amp_policy}`` (all but the
``head`` scope)."""
