"""Int8 training as one more amp rule: int8 x int8 -> int32 matmuls with
float32 scales, per linear layer forward, dgrad and wgrad each switchable.

Recipe (defaults first), following AQT (https://github.com/google/aqt,
``aqt/jax/v2/config.py``; its paper ``papers/aqt``), its successor qwix
(https://github.com/google/qwix, ``qwix/_src/core/dot_general_qt.py``) and
torchao's int8 mixed-precision training
(https://github.com/pytorch/ao/tree/main/torchao/prototype/quantized_training):

* forward: both operands quantized symmetrically to int8 (``[-127, 127]``,
  round to nearest) with **rowwise** scales: one ``amax`` per row of the lhs
  and per column of the rhs, i.e. reduced over the contracting dims only
  (AQT / torchao rowwise); or one per tensor (``granularity="tensorwise"``).
  ``dot_general`` runs int8 x int8 -> **int32** (never an int8 output: XLA
  falls back to a naive loop for it, jax#17688); the int32 result is
  multiplied in float32 by the two inverse scales, one at a time, and cast to
  the compute dtype.
* which operand is the weight: decided by what the operands hold, not by
  their position (``eqx.nn.Linear`` computes ``weight @ x``); see
  :func:`jaxamp._quant._common.weight_operand` for the rule. The product is
  then run with the activation as lhs and the weight as rhs, below.
* dgrad (``d lhs = g . rhs^T``, the input gradient, int8 by default) and
  wgrad (``d rhs = lhs^T . g``, the weight gradient, compute dtype by
  default, as AQT and MaxText run it): the saved residuals are the
  forward's int8 operands and scales, reused as they are. A rowwise scale
  of the rhs is per *output column*, which is the dgrad's contracting dim,
  so it cannot scale the dgrad's result; instead it is folded into the
  gradient before the gradient is quantized (qwix's residual-scale
  folding): ``g . (rq * s_r)^T = (g * s_r) . rq^T``.
  The same holds for the lhs's per-row scales in the wgrad. The folded
  gradient is quantized with rowwise scales along its non-contracting dims
  for that product. A product left in the compute dtype uses the int8
  residual cast to the compute dtype (exact: |q| <= 127) with the folded
  gradient, so no 16-bit copy of an operand is saved either way.
* stochastic rounding of the gradient operand (on by default, AQT's choice
  for dgrad; torchao finds it unnecessary): ``q = floor(x * s + u)`` with
  ``u`` uniform in ``[0, 1)``, unbiased: ``E[q] = x * s``.

Where the rounding noise comes from. An amp rule owns no state and sees one
trace, so it cannot advance a PRNG key from step to step; a key baked into
the policy and reused every step makes the "noise" a fixed pattern, i.e. a
bias (Haliax's ``Int8DotGeneralOp`` falls back to ``PRNGKey(42)``). The noise
is therefore derived from the data being rounded: each element's float32 bits
and flat index are mixed by an integer hash (Wellons' ``lowbias32``,
https://nullprogram.com/blog/2018/07/31/) together with a digest of the whole
tensor (the wrapping sum of the element hashes). Consequences: the noise
changes whenever the gradient changes (every step, every microbatch), is
identical for identical inputs (reruns, recomputation under
``jax.checkpoint``, every data-parallel replica of a replicated tensor), and
needs no key threaded through the training step. An optional ``key`` adds an
independent stream (e.g. ``jax.random.fold_in(key, step)`` for a policy built
inside the step); it is mixed with the data digest, so even a fixed key
cannot freeze the noise. A concrete key enters the trace as its 32-bit seed
(a literal); a key traced by the enclosing ``jit`` cannot enter the body of a
``jax.checkpoint`` region (amp would leave the region in float32), and the
rule says so (ValueError) instead.

Quantization happens once per operand and product: the forward quantizes each
operand once; the backward reuses those int8 arrays and quantizes only the
(folded) gradient. Under a user's ``jax.checkpoint`` the forward, its
quantization included, is recomputed in the backward pass as everything else
in the checkpointed function is.

Limits: int32 accumulation is exact for contractions up to
``2**31 / 127**2 = 133144`` terms; longer contractions may wrap.

The quantization and the noise are the codec's (``_base/_codec.py``: one
scale per row along the reduced axes, a multiplier, a NaN scale for a
non-finite row).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._base import _state
from .._base._codec import PerAxes, Recipe, quantize
from .._base._codec import rounding_noise as rounding_noise  # this module's noise
from .._base._dtypes import is_float
from .._base._formats import INT8
from .._base._jaxpr import prepare_operand
from ._common import (
    KEPT_SCOPE,
    WEIGHT_CHOICES,
    Dims,
    check_size_rule,
    dgrad,
    eight_bit_rule,
    narrowed,
    scoped_policy,
    torchao_rowwise_size_rule,
    weight_last,
    wgrad,
)

F32, I8, I32, U32 = (np.dtype(t) for t in (jnp.float32, jnp.int8, jnp.int32, "uint32"))
GRANULARITIES = ("rowwise", "tensorwise")
_WGRAD_SALT = np.uint32(0x9E3779B9)


def _reduce_axes(granularity: str, contracting: Iterable[int], ndim: int) -> tuple:
    return tuple(contracting) if granularity == "rowwise" else tuple(range(ndim))


def int8_quantize(
    x: jax.Array,
    axes: Iterable[int] | None = None,
    *,
    stochastic: bool = False,
    seed: Any = 0,
) -> tuple[jax.Array, jax.Array]:
    """Symmetric int8 quantization with ``amax`` scales: ``q ~= x * scale``.

    ``scale = 127 / amax`` with ``amax = max |x|`` over ``axes`` (AQT /
    torchao absmax calibration), so the largest element of each slice maps
    to +-127; values are clipped to ``[-127, 127]`` (symmetric: -128 unused).

    Args:
        x: float array, any shape and float dtype.
        axes: the dims ``amax`` is reduced over; for a matmul operand, its
            contracting dims (rowwise scales); None for one per-tensor scale.
        stochastic: round stochastically (``floor(x * scale + u)``, unbiased)
            instead of to nearest, with the codec's ``rounding_noise``.
        seed: uint32 seed mixed into the noise (stochastic rounding only).

    Returns:
        ``(q, scale)``: ``q`` int8 of ``x``'s shape; ``scale`` float32 with
        ``x``'s rank, size 1 on ``axes``. An all-zero slice gets scale 1; a
        slice with a non-finite ``amax`` gets scale NaN, so the product that
        unscales it is NaN where a loss scaler sees it. Scales are capped at
        ``2**126`` (their inverses stay normal float32 numbers).

    Raises:
        ValueError: if ``x`` is not a float array or an axis is out of range.
    """
    if not is_float(x.dtype):
        raise ValueError(
            f"int8_quantize(x): x must be a float array, got dtype {x.dtype}; "
            "integer arrays are already quantized."
        )
    axes = tuple(range(x.ndim)) if axes is None else tuple(int(a) for a in axes)
    if any(not -x.ndim <= a < x.ndim for a in axes):
        raise ValueError(
            f"int8_quantize(x, axes={axes}): axes must index x's {x.ndim} dims."
        )
    recipe = Recipe(
        format=INT8,
        group=PerAxes(tuple(a % x.ndim for a in axes)),
        rounding="stochastic" if stochastic else "nearest",
        seed=seed,
        nonfinite="nan",
    )
    return quantize(x.astype(F32), recipe)  # the float32 values' amax


@dataclasses.dataclass(frozen=True, kw_only=True)
class Int8Recipe:
    """How int8 trains a matmul: every knob of :func:`jaxamp.int8_policy`,
    :func:`int8_rule` and :func:`int8_dot_general` in one value, passed through
    them as it is (qwix's ``QuantizationRule``: a frozen dataclass with one
    field per knob, compared by value).

    Example::

        recipe = jaxamp.quant.Int8Recipe(wgrad=True, size_rule=None)
        policy = jaxamp.int8_policy(recipe=recipe)
        # the same policy: jaxamp.int8_policy(wgrad=True, size_rule=None)

    Attributes:
        granularity: ``"rowwise"`` or ``"tensorwise"`` scales.
        forward: quantize the forward product.
        dgrad: quantize the input-gradient product.
        wgrad: quantize the weight-gradient product.
        stochastic_rounding: round the gradient operand stochastically.
        key: a typed PRNG key mixed into the rounding noise, or None.
        weight: which operand is the weight: ``"auto"``, ``"lhs"``, ``"rhs"``.
        size_rule: ``(m, k, n) -> bool``, which matmuls the rule quantizes;
            None: every one.
        quantize_last_matmul: quantize a product that feeds the loss.

    Raises:
        ValueError: for an unknown ``granularity`` or ``weight``.
        TypeError: for a switch that is not a bool, a ``size_rule`` that is
            neither callable nor None, or a ``key`` that is not a typed PRNG
            key.
    """

    # "rowwise": one scale per row of each operand, its amax reduced over the
    # contracting dims (AQT, torchao rowwise); "tensorwise": one per tensor.
    granularity: str = "rowwise"
    # Quantize the forward product; else it runs in the compute dtype.
    forward: bool = True
    # Quantize the input-gradient product (dgrad, ``d lhs = g . rhs^T``).
    dgrad: bool = True
    # Quantize the weight-gradient product (wgrad, ``d rhs = lhs^T . g``);
    # off by default: the compute dtype, as AQT and MaxText run it.
    wgrad: bool = False
    # Round the gradient operand stochastically (``floor(x * s + u)``,
    # unbiased); else to nearest.
    stochastic_rounding: bool = True
    # A typed PRNG key mixed into the rounding noise (an independent stream,
    # e.g. ``jax.random.fold_in(key, step)``); None: the data-derived noise
    # alone. Not compared: a key traced by the step has no value.
    key: Any = dataclasses.field(default=None, compare=False)
    # Which operand is the weight (its gradient is the wgrad product):
    # "auto" reads it from the operands (``_common.weight_operand``), "lhs" or
    # "rhs" fixes it.
    weight: str = "auto"
    # Which matmuls the rule quantizes: ``(m, k, n) -> bool`` on the forward
    # product's rows, contraction and columns (torchao's rowwise crossover by
    # default); None: every one. Read by the rule, not by int8_dot_general.
    size_rule: Any = torchao_rowwise_size_rule
    # Quantize a product that feeds the loss (a language model's head); off
    # by default: it runs in the compute dtype with a float32 result. Read
    # by the rule, not by int8_dot_general.
    quantize_last_matmul: bool = False

    def __post_init__(self):
        if self.granularity not in GRANULARITIES:
            raise ValueError(
                f"Int8Recipe(granularity=...) must be one of {GRANULARITIES}, got "
                f"{self.granularity!r}."
            )
        for name in ("forward", "dgrad", "wgrad", "stochastic_rounding"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"Int8Recipe({name}=...) must be True or False.")
        if self.weight not in WEIGHT_CHOICES:
            raise ValueError(
                f"Int8Recipe(weight=...) must be one of {WEIGHT_CHOICES}, got "
                f"{self.weight!r}."
            )
        check_size_rule(self.size_rule, "Int8Recipe")
        _check_key(self.key)
        last = self.quantize_last_matmul
        object.__setattr__(self, "quantize_last_matmul", bool(last))

    def __repr__(self) -> str:
        """The fields that differ from their defaults."""
        changed = [
            f"{f.name}={'<key>' if f.name == 'key' else repr(getattr(self, f.name))}"
            for f in dataclasses.fields(self)
            if getattr(self, f.name) is not f.default
            and not (f.compare and getattr(self, f.name) == f.default)
        ]
        return f"Int8Recipe({', '.join(changed)})"


_OPTIONS = tuple(f.name for f in dataclasses.fields(Int8Recipe))


def _recipe(owner: str, recipe: Int8Recipe | None, options: dict) -> Int8Recipe:
    """``recipe`` (default :class:`Int8Recipe`) with the fields ``options``
    names replaced."""
    if recipe is None:
        recipe = Int8Recipe()
    elif not isinstance(recipe, Int8Recipe):
        raise TypeError(
            f"{owner}(recipe=...): a jaxamp.quant.Int8Recipe, got "
            f"{type(recipe).__name__}."
        )
    unknown = sorted(set(options) - set(_OPTIONS))
    if unknown:
        raise TypeError(
            f"{owner}() got unexpected keyword arguments {unknown}; its options "
            f"are the fields of jaxamp.quant.Int8Recipe: {', '.join(_OPTIONS)}."
        )
    return dataclasses.replace(recipe, **options) if options else recipe


# The weight-gradient product moves its lhs's contracting dims last first
# (XLA:CPU runs a contraction over dim 0 of both operands on a slow path).
_TRANSPOSE_WGRAD = True


def _weight_last_dot(
    lhs, rhs, seed, dimension_numbers, out_dtype, recipe, narrow=False
):
    # The product with the weight as rhs (the operand whose gradient is wgrad),
    # its output put back in the original layout. The weight's forward
    # quantization is a prepared operand: inside lax.scan the scan rule runs it
    # on the stacked weight before the loop (_walk/_scan_hoist.py), once per
    # step instead of in the forward pass and again in a checkpoint's recompute.
    # ``narrow``: the weight's gradient is taken through its copy in a bfloat16
    # compute dtype (bf16 weight gradients, as the bf16 step's; the scan rule
    # then casts the stacked weight once, before the loop); it is quantized
    # from its own values.
    a, w, dn, perm = weight_last(lhs, rhs, dimension_numbers, recipe.weight)
    if recipe.forward:
        axes = _reduce_axes(recipe.granularity, Dims.of(dn, a.ndim, w.ndim).rc, w.ndim)
        wq, ws = prepare_operand(functools.partial(int8_quantize, axes=axes), w)
    else:  # not read: the forward product runs in the compute dtype
        wq, ws = jnp.zeros((), I8), jnp.ones((), F32)
    carrier = narrowed(w, out_dtype) if narrow else w
    out = _int8_dot(a, carrier, wq, ws, seed, dn, np.dtype(out_dtype), recipe)
    return out if perm is None else jnp.transpose(out, perm)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _int8_dot(lhs, rhs, rq, rs, seed, dimension_numbers, out_dtype, recipe):
    """The product of ``lhs`` and the weight ``rhs``, whose int8 form and
    scales ``(rq, rs)`` come prepared; ``rhs`` takes the weight gradient."""
    args = (seed, dimension_numbers, out_dtype, recipe)
    return _fwd(lhs, rhs, rq, rs, *args)[0]


def _fwd(lhs, rhs, rq, rs, seed, dimension_numbers, out_dtype, recipe):
    d = Dims.of(dimension_numbers, lhs.ndim, rhs.ndim)
    if recipe.forward:
        gran = recipe.granularity
        lq, ls = int8_quantize(lhs, _reduce_axes(gran, d.lc, lhs.ndim))
        acc = jax.lax.dot_general(lq, rq, dimension_numbers, preferred_element_type=I32)
        linv, rinv = np.float32(1) / ls, np.float32(1) / rs
        out = acc.astype(F32) * d.lhs_to_out(linv) * d.rhs_to_out(rinv)
    else:
        lq, rq = lhs.astype(out_dtype), rhs.astype(out_dtype)
        linv = jnp.ones((1,) * lhs.ndim, F32)
        rinv = jnp.ones((1,) * rhs.ndim, F32)
        out = jax.lax.dot_general(
            lq, rq, dimension_numbers, preferred_element_type=out_dtype
        )
    # Empty arrays carry the operand dtypes (residuals must be arrays).
    types = (jnp.zeros(0, lhs.dtype), jnp.zeros(0, rhs.dtype))
    return out.astype(out_dtype), (lq, linv, rq, rinv, seed, *types)


def _grad_product(g, other, product, d, recipe, quantized, seed, cd):
    """One gradient product with the saved operand ``other``: ``product`` is
    :func:`dgrad` or :func:`wgrad`; ``g`` already carries the folded scale."""
    contract = d.out_rhs_free if product is dgrad else d.out_lhs_free
    to_layout = d.out_to_lhs if product is dgrad else d.out_to_rhs
    call = (
        (lambda a, b, t: dgrad(a, b, d, t))
        if product is dgrad
        else (lambda a, b, t: wgrad(b, a, d, t, _TRANSPOSE_WGRAD))
    )
    if not quantized:
        # Output in the compute dtype, as the default rule emits it: XLA:CPU
        # rejects bf16 x bf16 -> f32 dots inside loops (DotThunk).
        with jax.named_scope(KEPT_SCOPE):
            return call(g.astype(cd), other.astype(cd), cd)
    if other.dtype != I8:  # forward not quantized: per-tensor weight scale
        other, s_other = int8_quantize(other)
        g = g * (np.float32(1) / s_other.reshape(()))
    axes = _reduce_axes(recipe.granularity, contract, g.ndim)
    gq, gs = int8_quantize(g, axes, stochastic=recipe.stochastic_rounding, seed=seed)
    return call(gq, other, I32).astype(F32) * to_layout(np.float32(1) / gs)


def _bwd(dimension_numbers, out_dtype, recipe, res, g):
    lv, linv, rv, rinv, seed, ltype, rtype = res
    d = Dims.of(dimension_numbers, lv.ndim, rv.ndim)
    g = g.astype(F32)
    cd = np.dtype(out_dtype)
    dl = _grad_product(
        g * d.rhs_to_out(rinv), rv, dgrad, d, recipe, recipe.dgrad, seed, cd
    )
    dr = _grad_product(
        g * d.lhs_to_out(linv),
        lv,
        wgrad,
        d,
        recipe,
        recipe.wgrad,
        seed ^ _WGRAD_SALT,
        cd,
    )
    return dl.astype(ltype.dtype), dr.astype(rtype.dtype), None, None, None


_int8_dot.defvjp(_fwd, _bwd)


def _traced_seed(key: jax.Array) -> jax.Array:
    if _state.current().recomputed:
        raise ValueError(
            "int8 policy key=...: a key traced by an enclosing jit (a policy built "
            "inside the training step) cannot reach the matmuls inside a "
            "jax.checkpoint region: amp would leave the region in float32. Build "
            "the policy outside the step with a concrete key, or pass key=None "
            "(rounding noise derived from the data, fresh at every step)."
        )
    return jax.random.bits(key, (), U32)


def _check_key(key: Any) -> None:
    if key is not None and not (
        isinstance(key, jax.Array) and jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
    ):
        raise TypeError(
            "key=... must be a typed PRNG key such as jax.random.key(0) (or None "
            f"for data-derived rounding noise), got {type(key).__name__}."
        )


def _seed_source(key: Any) -> Callable[[], jax.Array]:
    """A function giving the uint32 seed of ``key`` in the trace that calls it.

    A concrete key becomes its seed once, here, as a number: a scalar enters
    every trace as a literal. The key array itself would be a constant of the
    rule's trace, and the body of a user's ``jax.checkpoint`` cannot carry
    constants (amp would leave the whole region unconverted, in float32).
    """
    if key is None:
        return lambda: jnp.asarray(0, U32)
    _check_key(key)
    if isinstance(key, jax.core.Tracer):  # a policy built inside a traced step
        return functools.partial(_traced_seed, key)
    seed = np.uint32(jax.random.bits(key, (), U32))
    return lambda: jnp.asarray(seed, U32)


def int8_dot_general(
    lhs: jax.Array,
    rhs: jax.Array,
    dimension_numbers: Any,
    out_dtype: Any = jnp.bfloat16,
    *,
    recipe: Int8Recipe | None = None,
    **options: Any,
) -> jax.Array:
    """``lax.dot_general`` trained in int8: int8 x int8 -> int32 products.

    The recipe of the module docstring (AQT, qwix, torchao): the forward
    product, the input gradient (dgrad) and the weight gradient (wgrad) each
    run int8 x int8 -> int32 with float32 scales or in ``out_dtype``; the
    backward pass reuses the forward's int8 operands. Which operand is the
    weight is read from the operands (``weight="auto"``), not their order:
    the rule of :func:`jaxamp._quant._common.weight_operand`, in short the
    operand contracted over its leading dims (a kernel ``(in, out)``), else
    the one with fewer free dims, else the wider dtype, else fewer free
    elements, else the rhs; batched products (attention) take the rhs.

    Args:
        lhs: float array, any float dtype, shape as for ``lax.dot_general``.
        rhs: float array, any float dtype.
        dimension_numbers: ``((lhs_contract, rhs_contract), (lhs_batch,
            rhs_batch))`` as for ``lax.dot_general``.
        out_dtype: result dtype (the amp compute dtype); also the dtype of
            the backward products that are not quantized.
        recipe: the :class:`Int8Recipe` (granularity, which products are
            int8, rounding, key, which operand is the weight); None: the
            default one. Its ``size_rule`` and ``quantize_last_matmul`` are
            the rule's: this product is always quantized.
        **options: fields of :class:`Int8Recipe` replacing the recipe's
            (``wgrad=True``).

    Returns:
        The product, ``lax.dot_general``'s shape, dtype ``out_dtype``;
        gradients come back in ``lhs``'s and ``rhs``'s dtypes. A non-finite
        operand (or cotangent) gives NaN in the rows it touches.

    Raises:
        ValueError: for an unknown ``granularity`` or ``weight``.
        TypeError: for an option that is no field of :class:`Int8Recipe`, a
            non-bool switch or a ``key`` that is not a typed PRNG key; from
            ``lax.dot_general`` if the shapes do not match.
    """
    recipe = _recipe("int8_dot_general", recipe, options)
    dn = tuple(tuple(tuple(int(i) for i in x) for x in p) for p in dimension_numbers)
    seed = _seed_source(recipe.key)()
    # The key enters as its seed; the product reads the other fields.
    product = dataclasses.replace(recipe, key=None)
    return _weight_last_dot(lhs, rhs, seed, dn, out_dtype, product)


def int8_rule(recipe: Int8Recipe | None = None, **options: Any):
    """An amp implementation rule (:class:`jaxamp.rules.ImplementationRule`) running
    float
    ``dot_general`` equations through :func:`int8_dot_general`.

    A matmul that ``size_rule`` rejects runs in the compute dtype as under the
    default policy; integer products fall back to the compute-dtype rule;
    products with an 8-bit operand (quantized by the user) are bound
    unchanged.

    Args:
        recipe: the :class:`Int8Recipe`; None: the default one. Its
            ``size_rule`` (``(m, k, n) -> bool`` on the forward product's
            per-batch rows, contraction and columns: True to quantize;
            default :func:`jaxamp.quant.torchao_rowwise_size_rule`, None:
            every matmul, :class:`jaxamp.quant.min_matmul_size` builds
            thresholds) and ``quantize_last_matmul`` (default False: a
            product that feeds the loss, a language model's head, runs in
            the compute dtype with a float32 result, as torchtitan's float8
            recipes and DeepSeek-V3 keep the output head: its int8 input
            gradient is int8's largest gradient error,
            ``benchmarks/RESULTS_QUANT.md``) choose the products.
        **options: fields of :class:`Int8Recipe` replacing the recipe's.

    Returns:
        The rule, for the ``"dot_general"`` key of a policy.

    Raises:
        ValueError, TypeError: for invalid options (naming the field), or an
            option that is no field of :class:`Int8Recipe`.
    """
    recipe = _recipe("int8_rule", recipe, options)
    size_rule = check_size_rule(recipe.size_rule, "int8_rule")
    seed_source = _seed_source(recipe.key)
    # The key enters each trace as its seed; the product reads the other fields.
    product = dataclasses.replace(recipe, key=None)

    def quantized(lhs, rhs, dn, compute_dtype):
        seed = seed_source()
        return _weight_last_dot(lhs, rhs, seed, dn, compute_dtype, product, True)

    name = f"int8_rule({recipe!r})"
    last = recipe.quantize_last_matmul
    return eight_bit_rule(name, size_rule, recipe.weight, INT8.scope, quantized, last)


def int8_policy(
    scopes: Iterable[str] | None = None,
    exclude_scopes: Iterable[str] = (),
    *,
    recipe: Int8Recipe | None = None,
    base: Mapping[Any, Any] | None = None,
    **options: Any,
) -> dict[Any, Any]:
    """An amp policy training matmuls in int8, everywhere or per named scope.

    Examples::

        int8_policy()                              # == jaxamp.int8_amp_policy
        int8_policy(size_rule=None)                # every matmul, small ones too
        int8_policy(wgrad=True)                    # all three matmuls in int8
        int8_policy(quantize_last_matmul=True)     # the head in int8 too
        int8_policy(scopes=("mlp",), exclude_scopes=("head",))
        int8_policy(recipe=Int8Recipe(wgrad=True, size_rule=None))

    Scope semantics are those of :func:`jaxamp.fp8_policy`.

    Args:
        scopes: scope names whose matmuls are quantized; None for all.
        exclude_scopes: scope names whose matmuls keep the ``base`` rule.
        recipe: the :class:`Int8Recipe` of :func:`int8_rule`; None: the
            default one (torchao's rowwise size rule; the product feeding the
            loss stays in the compute dtype).
        base: the policy for everything else; default
            ``jaxamp.default_amp_policy``.
        **options: fields of :class:`Int8Recipe` replacing the recipe's
            (``size_rule=None``, ``wgrad=True``).

    Returns:
        A policy dict for ``jaxamp.amp(..., amp_policy=...)`` (use a bfloat16
        compute dtype).

    Raises:
        TypeError: if ``scopes`` or ``exclude_scopes`` is a single string, or
            for invalid options or one that is no field of :class:`Int8Recipe`.
        ValueError: for an unknown ``granularity`` or ``weight``.
    """
    rule = int8_rule(_recipe("int8_policy", recipe, options))
    return scoped_policy("int8_policy", rule, scopes, exclude_scopes, base)


int8_amp_policy: dict[Any, Any] = int8_policy()
"""The default policy with int8 training for every float ``dot_general``
that passes torchao's rowwise size rule, but the one feeding the loss: forward
and dgrad int8 x int8 -> int32 with rowwise scales, stochastic rounding of the
gradient, wgrad in the compute dtype (use ``jnp.bfloat16``); :func:`int8_policy`
builds variants."""
