"""What the 8-bit matmul rules (FP8 in ``_fp8.py``, Int8 in ``_int8.py``)
share: the size rule that keeps small matmuls in the compute dtype, the
dimension bookkeeping of ``dot_general`` operands and scales, the
compute-dtype fallback and the per-scope policy builder.

Size rule. An 8-bit matmul pays only when its product is large enough to hide
the extra passes (amax reductions, scaling, casts) that quantization adds;
every anchor skips small ones. torchao's ``_auto_filter_for_recipe``
(https://github.com/pytorch/ao/blob/main/torchao/float8/float8_linear_utils.py),
measured on an H100 for a linear layer ``(M, K) x (K, N)``:

* tensorwise scaling: skip when ``K <= 4096 and N <= 1024``;
* rowwise scaling: skip when ``N <= 2048``, ``K <= 1024``, or
  ``N <= 4096 and K <= 2048``.

qwix falls back to the float path under a contraction tile of 128
(https://github.com/google/qwix); Transformer Engine warns that small GEMMs
slow down (NVIDIA/TransformerEngine#445); AQT#325 and torchao#1297 report the
same. A size rule here is a function ``(m, k, n) -> bool`` (True: quantize)
of the forward product's per-batch sizes; the rule decides once per linear
layer, so its dgrad and wgrad follow the forward's decision.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax
import numpy as np

from .._base._dtypes import is_float
from .._base._scopes import marker
from .._policy._kinds import Delegate, ImplementationRule
from .._policy._lookup import builtin_rule
from .._policy._rules import (
    default_amp_policy,
    use_compute_precision,
    use_lower_precision,
)

SizeRule = Callable[[int, int, int], bool]

# Name-stack markers put around the equations an 8-bit rule emits (a format's
# own marker is its ``QFormat.scope``, ``jaxamp_<label>_matmul``); read by
# ``jaxamp.quantization_report`` to say why a matmul stayed unquantized.
SMALL_SCOPE = marker("jaxamp_small_matmul")
# A gradient product the int8 recipe keeps in the compute dtype (wgrad by default).
KEPT_SCOPE = marker("jaxamp_kept_matmul")
# A product feeding the loss (no other matmul after it: the head's logits)
# that an 8-bit policy keeps in the compute dtype (``quantize_last_matmul``).
LOSS_SCOPE = marker("jaxamp_loss_matmul")


def torchao_tensorwise_size_rule(m: int, k: int, n: int) -> bool:
    """Size rule of torchao's tensorwise float8 recipe (H100 crossover).

    Quantize unless ``K <= 4096 and N <= 1024`` (torchao
    ``float8_linear_utils._auto_filter_for_tensorwise``,
    https://github.com/pytorch/ao/blob/main/torchao/float8/float8_linear_utils.py).
    The default size rule of :func:`jaxamp.fp8_policy` (per-tensor scales).

    Args:
        m: rows of the forward product (lhs free elements per batch), int.
        k: contraction length, int.
        n: columns of the forward product (rhs free elements per batch), int.

    Returns:
        True if the matmul should run in 8 bits.
    """
    del m
    return not (k <= 4096 and n <= 1024)


def torchao_rowwise_size_rule(m: int, k: int, n: int) -> bool:
    """Size rule of torchao's rowwise float8 recipe (H100 crossover).

    Quantize unless ``N <= 2048``, ``K <= 1024``, or ``N <= 4096 and
    K <= 2048`` (torchao ``_auto_filter_for_rowwise``,
    https://github.com/pytorch/ao/blob/main/torchao/float8/float8_linear_utils.py).
    The default size rule of :func:`jaxamp.int8_policy` (rowwise scales cost
    the same extra passes as rowwise float8, and int8 tensor cores have the
    same 2x peak over bf16 on A100 / H100).

    Args:
        m: rows of the forward product, int.
        k: contraction length, int.
        n: columns of the forward product, int.

    Returns:
        True if the matmul should run in 8 bits.
    """
    del m
    return not (n <= 2048 or k <= 1024 or (n <= 4096 and k <= 2048))


@dataclasses.dataclass(frozen=True)
class min_matmul_size:  # noqa: N801 (used like a function)
    """Size rule: quantize a matmul when all of ``M, K, N`` reach the minimums.

    ``min_matmul_size()`` quantizes every matmul;
    ``min_matmul_size(k=512, n=512)`` skips products with a contraction or an
    output width below 512.

    Args:
        m: minimum rows of the forward product (lhs free elements per batch).
        k: minimum contraction length.
        n: minimum columns (rhs free elements per batch).

    Raises:
        ValueError: if a minimum is negative.
    """

    m: int = 0
    k: int = 0
    n: int = 0

    def __post_init__(self):
        for name in ("m", "k", "n"):
            if getattr(self, name) < 0:
                raise ValueError(
                    f"min_matmul_size({name}=...) must be >= 0, got "
                    f"{getattr(self, name)}; use 0 for no minimum."
                )

    def __call__(self, m: int, k: int, n: int) -> bool:
        return m >= self.m and k >= self.k and n >= self.n


def check_size_rule(size_rule: Any, owner: str) -> SizeRule:
    """``size_rule`` as a callable; None means quantize every matmul."""
    if size_rule is None:
        return min_matmul_size()
    if not callable(size_rule):
        raise TypeError(
            f"{owner}(size_rule=...) takes a function (m, k, n) -> bool such as "
            f"jaxamp.quant.min_matmul_size(k=1024) or None, got {size_rule!r}."
        )
    return size_rule


@dataclasses.dataclass(frozen=True)
class Dims:
    """Dimension bookkeeping of one ``dot_general``: contracting (``lc, rc``),
    batch (``lb, rb``) and free (``lf, rf``) dims of each operand. The output
    layout is ``batch + lhs free + rhs free``."""

    lc: tuple
    rc: tuple
    lb: tuple
    rb: tuple
    lf: tuple
    rf: tuple

    @classmethod
    def of(cls, dimension_numbers: Any, lhs_ndim: int, rhs_ndim: int) -> Dims:
        (lc, rc), (lb, rb) = dimension_numbers
        lc, rc, lb, rb = (tuple(int(d) for d in x) for x in (lc, rc, lb, rb))
        lf = tuple(d for d in range(lhs_ndim) if d not in lc + lb)
        rf = tuple(d for d in range(rhs_ndim) if d not in rc + rb)
        return cls(lc, rc, lb, rb, lf, rf)

    @property
    def out_lhs_free(self) -> tuple:
        """Output positions of the lhs free dims."""
        nb = len(self.lb)
        return tuple(range(nb, nb + len(self.lf)))

    @property
    def out_rhs_free(self) -> tuple:
        """Output positions of the rhs free dims."""
        nb, nl = len(self.lb), len(self.lf)
        return tuple(range(nb + nl, nb + nl + len(self.rf)))

    def mkn(self, lhs_shape: tuple, rhs_shape: tuple) -> tuple[int, int, int]:
        """Per-batch ``(M, K, N)`` of the product."""
        m = int(np.prod([lhs_shape[d] for d in self.lf], dtype=np.int64))
        k = int(np.prod([lhs_shape[d] for d in self.lc], dtype=np.int64))
        n = int(np.prod([rhs_shape[d] for d in self.rf], dtype=np.int64))
        return m, k, n

    # Scales are kept with the operand's rank (size 1 on reduced dims); these
    # move them between operand and output layouts.
    def lhs_to_out(self, s: jax.Array) -> jax.Array:
        """An lhs-shaped scale (size 1 on ``lc``) in the output layout."""
        nb, nl = len(self.lb), len(self.lf)
        s = jax.numpy.transpose(s, self.lb + self.lf + self.lc)
        return s.reshape(s.shape[: nb + nl] + (1,) * len(self.rf))

    def rhs_to_out(self, s: jax.Array) -> jax.Array:
        """An rhs-shaped scale (size 1 on ``rc``) in the output layout."""
        nb, nr = len(self.lb), len(self.rf)
        s = jax.numpy.transpose(s, self.rb + self.rf + self.rc)
        return s.reshape(s.shape[:nb] + (1,) * len(self.lf) + s.shape[nb : nb + nr])

    def out_to_lhs(self, s: jax.Array) -> jax.Array:
        """An output-shaped scale (size 1 on the rhs free dims) in lhs layout."""
        nb, nl = len(self.lb), len(self.lf)
        s = s.reshape(s.shape[: nb + nl] + (1,) * len(self.lc))
        return jax.numpy.transpose(s, np.argsort(self.lb + self.lf + self.lc))

    def out_to_rhs(self, s: jax.Array) -> jax.Array:
        """An output-shaped scale (size 1 on the lhs free dims) in rhs layout."""
        nb, nl = len(self.lb), len(self.lf)
        s = s.reshape(s.shape[:nb] + s.shape[nb + nl :] + (1,) * len(self.rc))
        return jax.numpy.transpose(s, np.argsort(self.rb + self.rf + self.rc))


WEIGHT_CHOICES = ("auto", "lhs", "rhs")


def _kernel_layout(contract: tuple, free: tuple) -> bool:
    # Contracted over leading dims, free dims after them: a kernel (in, out).
    return bool(free) and max(contract, default=-1) < min(free)


def weight_operand(lhs: Any, rhs: Any, dimension_numbers: Any) -> str:
    """Which operand of a forward ``dot_general`` is the layer's weight.

    An 8-bit rule treats the two gradient products of a linear layer
    differently (by default the input gradient, dgrad, in int8 and the weight
    gradient, wgrad, in the compute dtype), so it must tell the weight from
    the activation by what they hold, not where they stand: ``x @ w`` has the
    weight on the right, but ``eqx.nn.Linear`` computes ``weight @ x``, which
    vmapped over a batch binds ``dot_general(weight (out, in), x (batch, in))``
    with the weight on the left.

    The weight is the operand without token dims: an activation's free
    (non-contracting) dims are its tokens (batch, sequence, vmapped axes), a
    weight's are its output features. The first of these tests that tells the
    operands apart decides:

    1. Batched products (``dot_general`` batch dims, on both operands:
       attention's ``q k^T`` and ``p v``, per-expert weights): the rhs, the
       ``x @ w`` order.
    2. Kernel layout: a weight stored ``(in, out)`` (``x @ w``, Flax
       ``Dense`` / ``Einsum`` / NNX ``Linear``, Haiku) is contracted over its
       leading dims, an activation ``(tokens..., features)`` over its trailing
       ones. If exactly one operand is contracted over leading dims with free
       dims after them, it is the weight.
    3. Token dims: the operand with fewer free dims is the weight
       (``(B, T, D) x (D, F)``; an ``eqx.nn.Linear`` vmapped over batch and
       sequence).
    4. Storage dtype: under amp an activation comes out of an earlier
       operation in the compute dtype while a parameter arrives in its
       storage dtype, so the wider operand is the weight (a vmapped
       ``eqx.nn.Linear`` after the first layer: float32 weight, bfloat16
       input).
    5. Size: the operand with fewer free elements is the weight (a training
       batch has more tokens than a layer has outputs; a vmapped
       ``eqx.nn.Linear`` fed float32 data).
    6. Otherwise the rhs.

    Known misreadings: activations in column layout ``(features, tokens)``
    (``W @ X`` with ``X`` a matrix) look like a kernel at test 2, and a
    matrix-vector product reads the vector as the weight at test 3 (below
    every default size rule); a vmapped ``eqx.nn.Linear`` fed float32 data
    with fewer examples than outputs reads the data as the weight at test 5.
    ``jaxamp.int8_policy(weight="lhs")`` (or ``"rhs"``) fixes the choice.

    Args:
        lhs: the lhs operand (an array or anything with shape and dtype).
        rhs: the rhs operand.
        dimension_numbers: the product's ``dot_general`` dimension numbers.

    Returns:
        ``"lhs"`` or ``"rhs"``.
    """
    d = Dims.of(dimension_numbers, len(lhs.shape), len(rhs.shape))
    if d.lb:
        return "rhs"
    kernel = (_kernel_layout(d.lc, d.lf), _kernel_layout(d.rc, d.rf))
    if kernel[0] != kernel[1]:
        return "lhs" if kernel[0] else "rhs"
    if len(d.lf) != len(d.rf):
        return "lhs" if len(d.lf) < len(d.rf) else "rhs"
    widths = [np.dtype(x.dtype).itemsize for x in (lhs, rhs)]
    if widths[0] != widths[1]:
        return "lhs" if widths[0] > widths[1] else "rhs"
    m, _, n = d.mkn(lhs.shape, rhs.shape)
    return "lhs" if m < n else "rhs"


def weight_last(
    lhs: jax.Array, rhs: jax.Array, dimension_numbers: Any, weight: str
) -> tuple[jax.Array, jax.Array, Any, tuple | None]:
    """The operands as ``(activation, weight)`` and their dimension numbers.

    Args:
        lhs: the lhs operand.
        rhs: the rhs operand.
        dimension_numbers: ``dot_general`` dimension numbers of ``(lhs, rhs)``.
        weight: ``"auto"`` (:func:`weight_operand` decides), ``"lhs"`` or
            ``"rhs"``.

    Returns:
        ``(activation, weight, dimension_numbers, perm)``: ``perm`` is None
        when the weight already is the rhs; otherwise the permutation that
        takes the swapped product's output (batch, rhs free, lhs free) to the
        original layout (batch, lhs free, rhs free).
    """
    if weight == "auto":
        weight = weight_operand(lhs, rhs, dimension_numbers)
    if weight == "rhs":
        return lhs, rhs, dimension_numbers, None
    d = Dims.of(dimension_numbers, lhs.ndim, rhs.ndim)
    (lc, rc), (lb, rb) = dimension_numbers
    nb, nl, nr = len(d.lb), len(d.lf), len(d.rf)
    perm = (*range(nb), *range(nb + nr, nb + nr + nl), *range(nb, nb + nr))
    return rhs, lhs, ((rc, lc), (rb, lb)), perm


def dgrad(g: jax.Array, rhs: jax.Array, d: Dims, out_type: Any) -> jax.Array:
    """``d lhs = g . rhs^T`` for the product described by ``d``, in lhs layout.

    One ``dot_general`` with a canonical contraction (``g``'s rhs-free dims
    against ``rhs``'s free dims), then a transpose of the result into the
    lhs layout (as JAX's own transpose rule emits it).
    """
    nb = len(d.lb)
    dn = ((d.out_rhs_free, d.rf), (tuple(range(nb)), d.rb))
    out = jax.lax.dot_general(g, rhs, dn, preferred_element_type=out_type)
    # Output dims: batch, lhs free, then rhs's remaining (contracting) dims in
    # increasing order, each paired with an lhs contracting dim.
    src = list(d.lb) + list(d.lf) + [d.lc[d.rc.index(r)] for r in sorted(d.rc)]
    return jax.numpy.transpose(out, np.argsort(src))


def wgrad(
    lhs: jax.Array, g: jax.Array, d: Dims, out_type: Any, transpose_first: bool
) -> jax.Array:
    """``d rhs = lhs^T . g`` for the product described by ``d``, in rhs layout.

    ``transpose_first`` moves ``lhs``'s contracting (row) dims last before the
    product, so that the contraction is over the last dim of the lhs operand
    instead of dim 0 of both operands (the weight-gradient layout, which
    XLA:CPU runs on a slow path; ``benchmarks/quantized.py``).
    """
    nb = len(d.lb)
    g_rows = d.out_lhs_free
    if transpose_first:
        perm = d.lb + d.lc + d.lf  # batch, remaining, contracting last
        lhs = jax.numpy.transpose(lhs, perm)
        nlc = len(d.lc)
        l_contract = tuple(range(nb + nlc, nb + nlc + len(d.lf)))
        l_batch = tuple(range(nb))
        rest = [d.lc[i] for i in range(nlc)]
    else:
        l_contract, l_batch = d.lf, d.lb
        rest = sorted(d.lc)
    dn = ((l_contract, g_rows), (l_batch, tuple(range(nb))))
    out = jax.lax.dot_general(lhs, g, dn, preferred_element_type=out_type)
    # Output dims: batch, lhs's remaining dims (each an lhs contracting dim,
    # paired with an rhs contracting dim), then g's rhs-free dims.
    src = list(d.rb) + [d.rc[d.lc.index(c)] for c in rest] + list(d.rf)
    return jax.numpy.transpose(out, np.argsort(src))


def eight_bit_rule(
    name: str,
    size_rule: SizeRule,
    weight: str,
    scope: str,
    quantized: Callable[[jax.Array, jax.Array, Any, Any], jax.Array],
    quantize_last: bool = True,
) -> Callable:
    """An :class:`jaxamp.rules.ImplementationRule` for ``dot_general``
    that runs ``quantized(lhs, rhs, dimension_numbers, compute_dtype)`` inside
    ``jax.named_scope(scope)``, shared by the int8 and FP8 rules.

    Integer products take the compute-dtype rule; products with an 8-bit
    operand (quantized by the user) are bound unchanged; a product that
    ``size_rule`` rejects (on the forward product's ``(m, k, n)``, the weight
    per :func:`weight_last` with ``weight``) is left to the default policy's
    matmul rule (a :class:`jaxamp._policy._kinds.Delegate`, inside
    ``jax.named_scope(SMALL_SCOPE)``): amp runs it exactly as the
    compute-dtype step does (casts, residuals, result dtype), so a policy
    that quantizes nothing compiles to that step's program. With
    ``quantize_last`` False, a product that feeds the loss (the value facts'
    ``tail``: no other matmul reads its result, e.g. a language model's head)
    is left to it too, inside ``jax.named_scope(LOSS_SCOPE)``: the recipes
    of torchtitan (its MXFP8 converter skips the ``output`` layer) and
    DeepSeek-V3 keep the head in high precision, and its input gradient is
    int8's largest error source (``benchmarks/RESULTS_QUANT.md``).
    """

    def rule(ctx, lhs, rhs, **params):
        compute_dtype, original_dtypes = ctx.compute_dtype, ctx.original_dtypes
        if not (is_float(lhs.dtype) and is_float(rhs.dtype)):
            new_in, new_params = use_compute_precision(
                compute_dtype, original_dtypes, lhs, rhs, **params
            )
            return jax.lax.dot_general_p.bind(*new_in, **new_params)
        if np.dtype(lhs.dtype).itemsize == 1 or np.dtype(rhs.dtype).itemsize == 1:
            return jax.lax.dot_general_p.bind(lhs, rhs, **params)
        if not quantize_last and ctx.facts.tail:
            return Delegate(use_lower_precision, LOSS_SCOPE)
        dn = params["dimension_numbers"]
        a, w, dn_aw, _ = weight_last(lhs, rhs, dn, weight)
        if not size_rule(*Dims.of(dn_aw, a.ndim, w.ndim).mkn(a.shape, w.shape)):
            return Delegate(use_lower_precision, SMALL_SCOPE)
        with jax.named_scope(scope):
            return quantized(lhs, rhs, dn, compute_dtype)

    rule.__name__ = name
    return ImplementationRule.with_context(rule)


def narrowed(x: jax.Array, compute_dtype: Any) -> jax.Array:
    """``x`` in a bfloat16 compute dtype where it is wider (a float32 master
    weight), for an 8-bit product: quantized from there, as the compute-dtype
    step reads it. The cast is a plain ``convert_element_type``, which the scan
    rule hoists before the loop where only products read the weight inside a
    ``jax.checkpoint`` (``_walk/_scan_hoist.py``: one cast per step and a
    compute-dtype gradient stack, not a float32 master weight read for the
    amax, the quantization and the recompute at every use); the operand's
    gradient comes back in its own dtype. The 8-bit rounding (``2**-4`` for
    E4M3) dwarfs bfloat16's (``2**-9``). A float16 compute dtype leaves ``x``
    as it is (a float32 activation may exceed float16's range)."""
    cd = np.dtype(compute_dtype)
    if cd == np.dtype(jax.numpy.bfloat16) and np.dtype(x.dtype).itemsize > 2:
        return x.astype(cd)
    return x


def scoped_policy(
    owner: str,
    rule: Callable,
    scopes: Iterable[str] | None,
    exclude_scopes: Iterable[str],
    base: Mapping[Any, Any] | None,
) -> dict[Any, Any]:
    """A policy with ``rule`` for ``dot_general`` everywhere (``scopes`` None)
    or only inside the named scopes, never inside ``exclude_scopes``; see
    :func:`jaxamp.fp8_policy` for the nesting semantics."""
    for name, arg in (("scopes", scopes), ("exclude_scopes", exclude_scopes)):
        if isinstance(arg, str):
            raise TypeError(
                f"{owner}({name}=...) takes a collection of scope names, got "
                f"the string {arg!r}; write ({arg!r},)."
            )
    base = dict(default_amp_policy if base is None else base)
    excluded = {s: base for s in exclude_scopes}
    # jaxamp's own entry, never warned about as an unmatched amp_policy key.
    quant = {**base, "dot_general": builtin_rule(rule, "dot_general"), **excluded}
    if scopes is None:
        return quant
    return {**base, **{s: quant for s in scopes}, **excluded}
