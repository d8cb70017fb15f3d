"""Cast rules and THE default policy table (primitive -> rule).

A rule has jaxamp 0.0.4's signature::

    rule(compute_dtype, original_dtypes, *invars, **bind_params)
        -> (invars, bind_params)

``compute_dtype`` is the amp compute dtype (a numpy dtype), ``original_dtypes``
the dtypes the traced (un-transformed) jaxpr declared for each input,
``invars`` the current input values (jax arrays or tracers; literals of the
jaxpr arrive as numpy scalars) and ``bind_params`` the primitive's parameters.
A rule returns the (possibly cast) inputs, one per input, and the parameters to
bind with. The rules that read the equation's value facts take one context
argument instead of the two dtypes (``CastRule.with_context``:
``rule(ctx, *invars, **bind_params)``, ``_context.RuleContext``); called with
0.0.4's signature they read the walk's context. Integer, boolean, complex,
PRNG-key and float0 values must never be cast: the helpers here only touch
real floating values. Each rule here is a :class:`jaxamp.rules.CastRule`
(``_kinds.py``); the loop-carry rule a ``CarryRule``.

The default table follows PyTorch's autocast op lists
(https://pytorch.org/docs/stable/amp.html#autocast-op-reference) mapped onto
JAX primitives, in three families (``docs/design.md``, "The default policy"):

* lower: matmul and convolution run in the compute dtype;
* float32: range- or accuracy-critical ops (exp, log, sums, ...);
* follow: everything else runs in the compute dtype if one of its traced float
  inputs already is in it, otherwise in the dtypes the original jaxpr had.

The entry for ``scan`` is applied to the loop carries: by default they are
narrowed to bfloat16 when that is the compute dtype: it removes the float32
residual stream of a scanned transformer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import jax.numpy as jnp
import numpy as np

from .._base._cast import cast
from .._base._dtypes import (
    canonical_dtype,
    dtype_of,
    is_float,
    is_literal,
    is_weak,
    widest,
)
from .._base._prims import MATMULS
from ._context import RuleContext
from ._kinds import CarryRule, CastRule

Rule = Callable[..., tuple[list, dict]]


def _set_result_dtype(params: dict, dtype: Any, invars: Iterable[Any]) -> dict:
    if "preferred_element_type" in params and any(
        is_float(dtype_of(x)) for x in invars
    ):
        params = dict(params)
        params["preferred_element_type"] = np.dtype(dtype)
    return params


def use_precision(dtype: Any) -> CastRule:
    """A rule that casts every float input to ``dtype``.

    Args:
        dtype: a floating dtype or name (``jnp.float32``, ``"bf16"``).

    Returns:
        A :class:`jaxamp.rules.CastRule` that also sets ``preferred_element_type`` to
        ``dtype`` on primitives that have it (``dot_general``, convolutions).

    Raises:
        ValueError: if ``dtype`` is not a floating dtype.
    """
    dtype = canonical_dtype(dtype)

    def rule(compute_dtype, original_dtypes, *invars, **params):
        del compute_dtype, original_dtypes
        out = [cast(x, dtype) for x in invars]
        return out, _set_result_dtype(params, dtype, invars)

    rule.__name__ = f"use_precision({dtype.name})"
    return CastRule(rule)


@CastRule
def use_compute_precision(compute_dtype, original_dtypes, *invars, **params):
    """Rule: cast float inputs to the compute dtype; ``preferred_element_type``
    (matmul/conv output and accumulation type request) to the compute dtype.

    This is PyTorch autocast's ``lower_precision_fp`` policy. It never widens:
    an equation whose float inputs are all narrower than the compute dtype
    (e.g. a hand-written float8 matmul with a float32 result) is left as
    written, inputs and ``preferred_element_type`` included.
    """
    del original_dtypes
    width = np.dtype(compute_dtype).itemsize
    floats = [dtype_of(x) for x in invars if is_float(dtype_of(x))]
    if floats and all(d.itemsize < width for d in floats):
        return list(invars), params
    out = [cast(x, compute_dtype) for x in invars]
    return out, _set_result_dtype(params, compute_dtype, invars)


@CastRule
def use_original_precision(compute_dtype, original_dtypes, *invars, **params):
    """Rule: cast every float input back to the dtype the original jaxpr had."""
    del compute_dtype
    return [cast(x, d) for x, d in zip(invars, original_dtypes)], params


@CastRule
def use_widest_precision(compute_dtype, original_dtypes, *invars, **params):
    """Rule: cast float inputs to the widest float dtype among them (PyTorch
    autocast's ``promote`` policy)."""
    del compute_dtype, original_dtypes
    target = widest(dtype_of(x) for x in invars)
    if target is None:
        return list(invars), params
    return [cast(x, target) for x in invars], params


@CastRule
def use_full_precision(compute_dtype, original_dtypes, *invars, **params):
    """Rule: run in float32 (or the input's dtype if wider, e.g. float64).

    PyTorch autocast's ``fp32`` policy: exp, log, pow, sums, ...
    """
    del compute_dtype, original_dtypes
    target = widest([jnp.float32, *(dtype_of(x) for x in invars)])
    return [cast(x, target) for x in invars], params


def _mixed(original_dtypes, invars) -> bool:
    """The equation was traced with traced float inputs of different dtypes (a
    kernel such as cuDNN attention's backward takes bfloat16 q/k/v and float32
    softmax statistics by design): it must keep them."""
    floats = {
        np.dtype(d)
        for d, x in zip(original_dtypes, invars)
        if not is_literal(x) and is_float(d)
    }
    return len(floats) > 1


def _follow(compute_dtype, original_dtypes, invars):
    compute_dtype = np.dtype(compute_dtype)
    low = any(
        not is_literal(x) and not is_weak(x) and dtype_of(x) == compute_dtype
        for x in invars
    )
    if low:
        return [cast(x, compute_dtype) for x in invars]
    return [cast(x, d) for x, d in zip(invars, original_dtypes)]


def _original(invars, original_dtypes):
    return use_original_precision(None, original_dtypes, *invars)[0]


def _range_critical(compute_dtype) -> bool:
    """Whether a square can leave the compute dtype's range (float16: 65504)."""
    return np.dtype(compute_dtype).itemsize < 4 and np.dtype(compute_dtype) != np.dtype(
        jnp.bfloat16
    )


@CastRule.with_context
def follow_compute_precision(ctx: RuleContext, *invars, **params):
    """Rule "follow" (the default for unlisted primitives), reading the value
    facts of :mod:`jaxamp._values._facts` (``ctx.facts``):

    * an equation traced with mixed float input dtypes keeps them (known or
      unknown primitive: cuDNN attention's backward, a custom kernel);
    * in the function's tail (no output reaches a matmul: the loss chain after
      the last matmul) it runs in the traced dtypes, as PyTorch autocast runs
      ``cross_entropy``/``log_softmax``/``nll_loss`` in float32;
    * a value multiplied by itself runs in float32 when the compute dtype is
      float16 (its square can leave float16's range from in-range inputs) or
      when the product is summed (a sum of squares: a norm or a variance); with
      float16, so does an equation with an input of that magnitude class (a
      variance is never cast down to float16, ``h / jnp.var(h)``);
    * a value minus its own mean (``x - mean(x)``: LayerNorm, a variance) runs
      in float32, so the normalisation after it (``* rsqrt(var)``) follows in
      float32; the equations reading the normalised value (gain, bias) run in
      the compute dtype: LayerNorm as a careful hand-written model computes it
      (``((x - m) * rsqrt(v)).astype(bfloat16) * g``);
    * likewise a value scaled by the inverse root of its own mean square
      (RMSNorm, QK-norm, ``x / sqrt(sum(x * x))``) runs in float32 and its readers in
      the compute dtype: ``(x * rsqrt(mean(x * x) + eps)).astype(bfloat16) * g``
      as LLaMA's reference code and Flax's ``nnx.RMSNorm`` compute it (its
      square and Flax's shift of ``x`` by a zero mean in float32 as well);
    * otherwise, if any traced (non-literal, non-weak) float input is already in
      the compute dtype, all float inputs (literals too) are cast to it; if not,
      each float input goes back to its traced dtype.

    This keeps activations in the compute dtype between matmuls instead of
    casting back to float32 after every op, and satisfies lax's requirement that
    n-ary primitives see one dtype.
    """
    compute_dtype, original_dtypes, facts = (
        ctx.compute_dtype,
        ctx.original_dtypes,
        ctx.facts,
    )
    if _mixed(original_dtypes, invars) or facts.tail:
        return _original(invars, original_dtypes), params
    critical = _range_critical(compute_dtype)
    if (
        (facts.quadratic and (critical or facts.summed))
        or (critical and facts.squared_input)
        or facts.centring
        or facts.rms_scaling
        or facts.rms_operand
    ):
        return use_full_precision(compute_dtype, original_dtypes, *invars, **params)
    if facts.after_normalisation:
        return use_compute_precision(compute_dtype, original_dtypes, *invars, **params)
    return _follow(compute_dtype, original_dtypes, invars), params


@CastRule
def keep_current_precision(compute_dtype, original_dtypes, *invars, **params):
    """Rule: leave every input as it is (for primitives whose inputs are
    independent, e.g. ``device_put``, ``optimization_barrier``, user casts)."""
    del compute_dtype, original_dtypes
    return list(invars), params


@CastRule.with_context
def use_range_safe_precision(ctx: RuleContext, *invars, **params):
    """Rule for powers (``square``, ``integer_pow``): float32 when the compute
    dtype is float16 (``x**2`` overflows float16 once |x| > 256, ``x**3`` once
    |x| > 40) or when the result is summed (a variance, a norm: normalisation
    statistics are float32, as PyTorch autocast's ``layer_norm``/``norm``);
    otherwise as :func:`follow_compute_precision` (a bfloat16 GELU's ``x**3``
    has float32's range and saves a float32 residual)."""
    compute_dtype, original_dtypes, facts = (
        ctx.compute_dtype,
        ctx.original_dtypes,
        ctx.facts,
    )
    if _mixed(original_dtypes, invars) or facts.tail:
        return _original(invars, original_dtypes), params
    if _range_critical(compute_dtype) or facts.summed:
        return use_full_precision(compute_dtype, original_dtypes, *invars, **params)
    return _follow(compute_dtype, original_dtypes, invars), params


@CastRule.with_context
def use_lower_precision(ctx: RuleContext, *invars, **params):
    """Rule for matmuls and convolutions (PyTorch autocast's
    ``lower_precision_fp`` list): float inputs in the compute dtype, with float32
    accumulation. The result is in the compute dtype, except where the value
    facts say it must keep its traced dtype (``preferred_element_type``):

    * it feeds a softmax (attention logits: ``jax.nn.dot_product_attention``
      asks for float32 logits; the accumulation is float32 anyway, so a float32
      result costs no matmul time) or linear algebra (a covariance);
    * it reaches no other matmul (the head's logits feeding the loss);
    * with float16, a value multiplied by itself (a Gram matrix ``x @ x.T``).

    Never widens (a hand-written float8 product is left as written) and keeps an
    equation traced with mixed float input dtypes as traced.
    """
    compute_dtype, original_dtypes, facts = (
        ctx.compute_dtype,
        ctx.original_dtypes,
        ctx.facts,
    )
    if _mixed(original_dtypes, invars):
        return _original(invars, original_dtypes), params
    out, new = use_compute_precision(compute_dtype, original_dtypes, *invars, **params)
    square = facts.quadratic and _range_critical(compute_dtype)
    keep = facts.wide or facts.tail or square
    if keep and new is not params and "preferred_element_type" in new:
        traced = params.get("preferred_element_type") or widest(original_dtypes)
        new = dict(new)
        new["preferred_element_type"] = np.dtype(traced)
    return out, new


@CarryRule.with_context
def narrow_bfloat16_carries(ctx: RuleContext, *carries, **params):
    """Loop-carry rule (the policy entry for ``scan``): with a bfloat16 compute
    dtype, the float carries that the value facts mark as narrowable run in
    bfloat16; every other carry keeps its traced dtype.

    Narrowable (:mod:`jaxamp._values._facts`): the scan is not in the function's tail,
    the carry reaches a matmul in the body (an activation, e.g. the residual
    stream of a scanned transformer, whose float32 copy per layer would
    otherwise be a residual), and no matmul-free path into it passes an
    ``exp``/``log`` (CTC's and an HMM's log-space forward recursions keep
    float32). bfloat16 has float32's exponent range, so a narrowed activation
    cannot overflow; float16 could, so it keeps float32 carries (as PyTorch
    autocast keeps a float32 residual stream). Weakly typed carries are never
    narrowed; outside an analysed walk nothing is narrowed.
    """
    compute_dtype = ctx.compute_dtype
    if np.dtype(compute_dtype) != np.dtype(jnp.bfloat16):
        return list(carries), params
    narrow = ctx.facts.narrow_carries
    if len(narrow) != len(carries):
        return list(carries), params
    out = [
        cast(c, compute_dtype)
        if ok and not is_weak(c) and is_float(dtype_of(c)) and dtype_of(c).itemsize > 2
        else c
        for c, ok in zip(carries, narrow)
    ]
    return out, params


# --------------------------------------------------------------------------------
# THE default table, filled by small family helpers (jax's jet.py style).


class _DefaultPolicy(dict):
    """The default policy's type: a ``dict`` in every respect (equality,
    ``dict(p)``, ``{**p, ...}``, ``p | {...}``; copies and unpickled copies are
    plain dicts), except
    that its repr names it instead of listing its ~70 entries, so that the
    signatures of ``amp`` and the tools that default to it read in one line
    (``help(jaxamp.amp)``, ``inspect.signature``)."""

    __slots__ = ()

    def __reduce__(self):  # copies and pickles are plain dicts, like p.copy()
        return dict, (dict(self),)

    def __repr__(self) -> str:
        return f"<jaxamp.default_amp_policy: {len(self)} entries>"


default_amp_policy: dict[Any, Rule] = _DefaultPolicy()
"""The default policy: primitive name (plus ``"amp_stop"``, ``"amp_default"``
and a loop primitive's name for its carries' rule) -> rule. Copy and override
entries to change it:
``{**jaxamp.default_amp_policy, "square": jaxamp.use_full_precision}``."""


def _family(rule: Rule, *names: str) -> None:
    for name in names:
        default_amp_policy[name] = rule


# Matmul-like primitives (_prims.MATMULS): the "lower" family, and the ones whose
# casts of held inputs the interpreter recomputes in the backward pass.
_family(use_lower_precision, *MATMULS)
_family(
    use_full_precision,
    "exp",
    "exp2",
    "expm1",
    "log",
    "log1p",
    "pow",
    "sqrt",
    "rsqrt",
    "reduce_sum",
    "reduce_prod",
    "cumsum",
    "cumprod",
    "cumlogsumexp",
    "erf_inv",
    "lgamma",
    "digamma",
    "igamma",
    "igammac",
    "igamma_grad_a",
    "polygamma",
    "zeta",
    "bessel_i0e",
    "bessel_i1e",
    "random_gamma_grad",
    "tan",
    "acos",
    "asin",
    "sinh",
    "cosh",
)
_family(use_range_safe_precision, "square", "integer_pow")
# Linear algebra (LAPACK / cuSOLVER have no bfloat16 or float16 kernels, and
# factorisations lose what little precision a 16-bit input has).
_family(
    use_full_precision,
    "cholesky",
    "cholesky_update",
    "triangular_solve",
    "eigh",
    "eig",
    "lu",
    "lu_pivots_to_permutation",
    "qr",
    "geqrf",
    "geqp3",
    "householder_product",
    "svd",
    "schur",
    "hessenberg",
    "tridiagonal",
    "tridiagonal_solve",
    "custom_linear_solve",
)
_family(
    keep_current_precision,
    "convert_element_type",  # a user cast is respected as written
    "reduce_precision",
    "device_put",
    "optimization_barrier",
    "psum",
    "psum_invariant",
    "pmax",
    "pmin",
    "pvary",
    "all_gather",
    "all_to_all",
    "ppermute",
    "sort",
)
_family(
    use_original_precision,
    "amp_stop",  # scope key: restores the traced dtypes
    "bitcast_convert_type",  # reinterprets bits: the width must not change
    "pure_callback",  # host callbacks see the dtypes they were traced with
    "io_callback",
    "debug_callback",
    "debug_print",
)
# A loop primitive's entry (its carries' rule, narrow_bfloat16_carries for
# lax.scan) is added where the primitive is registered (_walk/_higher_order.py).
default_amp_policy["amp_default"] = follow_compute_precision
