"""Value facts: one dataflow pass per jaxpr that the default rules read.

Deciding an equation's dtype from its primitive alone is not enough (``docs/design.md``,
"The default policy"): the same ``sub`` is harmless between two matmuls and
ruinous in the cross-entropy after the last one, the same ``mul`` is a gate or a
square. This module computes, once per (jaxpr, facts of its outputs), what each
equation's values *are*:

* backward bits per value, propagated from the outputs to the inputs:

  - ``REACH``: the value reaches a matmul (``dot_general``, convolution). An
    equation none of whose outputs reaches one is in the function's *tail*:
    the loss chain after the last matmul (log-softmax, cross-entropy, the gold
    logit gather, means), which the default policy runs in the traced dtypes,
    as PyTorch autocast's float32 list does for ``cross_entropy``/``nll_loss``;
  - ``WIDE``: the value reaches an ``exp`` (a softmax's logits) or a linear
    algebra routine (a covariance entering ``cholesky``) through scale / mask /
    shift ops: a matmul producing it keeps its traced float32 result;
  - ``SUM``: the value reaches a ``reduce_sum`` through such ops: a square
    feeding it is a normalisation statistic, kept in float32;
  - ``TRANSPOSED``: the value is read by a ``transpose`` (seen through casts):
    XLA folds that transpose into the product computing it, a form XLA:CPU
    cannot run for bfloat16 x bfloat16 -> float32 (``_compat.runnable_product``).

* per equation: ``quadratic`` (``square``, ``integer_pow``, ``pow``, a value
  multiplied by itself or matmul'd with itself, seen through casts and negation):
  its output can leave float16's range from in-range inputs;

* per equation: ``centring``, a ``sub`` of a value's own mean (``x - mean(x)``,
  the mean seen through broadcasts, reshapes and the division by the count): the
  centring of a LayerNorm, a variance, a standardisation. It runs in float32,
  and so, by "follow", does the normalisation after it (the ``mul``/``div`` of
  the centred value by ``rsqrt(var)``); ``after_normalisation``: an equation
  reading such a normalised value (the gain, the bias) runs in the compute
  dtype again. That is LayerNorm as a careful hand-written model computes it
  (``((x - m) * rsqrt(v)).astype(bfloat16) * g``): float32 statistics and
  normalisation, one rounding, residuals of the compute dtype after it;

* per equation: ``rms_scaling``, a value multiplied by the inverse root of its
  own sum of squares or divided by that root (``x * rsqrt(mean(x * x) + eps)``,
  ``x / sqrt(sum(x * x))``, the statistic seen through broadcasts, reshapes,
  casts, the count, the epsilon and a gain folded into it): RMSNorm, QK-norm,
  an L2 normalisation. It runs in float32 like a LayerNorm's normalisation, and its
  readers get ``after_normalisation``: RMSNorm as LLaMA's and Flax's
  ``RMSNorm`` compute it (``(x * rsqrt(ms)).astype(bfloat16) * g``). The
  square of that statistic and Flax's shift of ``x`` by a constant zero mean
  get ``rms_operand``: they run in float32 on the same float32 copy of ``x`` as
  the scaling, so that the cotangents of ``x`` (which nearly cancel) are
  summed in float32 and rounded once, as by hand. The scaling equation also
  records those operand equations (``rms_operand_eqns``): the RMSNorm region
  rewrite (``_rmsnorm.py``) runs the square, statistic and scaling together;

* per equation: ``ln_region``, on a LayerNorm's normalisation (``centred *
  s`` / ``centred / s`` with ``s`` computed from the same ``x``), the
  equations computing it from ``x`` when no other equation reads their values
  (``_patterns.CentredRegions``), and ``ln_input``, that ``x``: the LayerNorm
  region rewrite (``_layernorm.py``) runs them together;

* per ``scan``: which float carries may be narrowed to the compute dtype. A
  carry is narrowed only if it reaches a matmul in the body (an activation such
  as the residual stream) and no matmul-free path from a carry into it passes
  an ``exp``/``log`` (a log-space recursion such as CTC's or an HMM's forward
  pass keeps its traced dtype).

Sub-jaxprs are analysed with the bits of the values their outputs feed in the
enclosing jaxpr (a loop's carries to a fixpoint), so facts cross ``jit``,
``scan``, ``while``, ``cond``, ``remat`` and custom-derivative boundaries: those
of every higher-order primitive with a registered description
(``_base/_structure.py``), read from it. Where
the bits of a sub-jaxpr's outputs are unknown (a user's jvp or bwd rule traced
lazily by JAX), every output is taken to reach a matmul: the conservative
choice, which keeps the compute dtype's memory savings.
"""

from __future__ import annotations

import collections
import dataclasses
import weakref
from typing import Any

from .._base._jaxpr import is_var, named_subs
from .._base._prims import DATA_MOVEMENT, MATMULS
from .._base._structure import Structure, SubJaxpr, call_body, describe
from ._patterns import (
    COLLECTIVE_SUMS,
    CentredRegions,
    centring,
    quadratic,
    rms_operands,
)

REACH, WIDE, SUM, TRANSPOSED = 1, 2, 4, 8
ALL = REACH  # conservative bits for an output whose consumers are unknown

# Ops through which a value still "is" the logits of a softmax (WIDE) or the terms
# of a sum (SUM): scaling, masking, shifting and moving data around.
_PASS = DATA_MOVEMENT | frozenset(
    """add sub mul div neg max min select_n convert_element_type reduce_precision
    stop_gradient""".split()
)
# Where a value needs its float32 digits: a softmax's exp, linear algebra.
_WIDE_USES = frozenset(
    {
        "exp",
        "cholesky",
        "triangular_solve",
        "eigh",
        "eig",
        "lu",
        "qr",
        "geqrf",
        "svd",
        "schur",
        "hessenberg",
        "tridiagonal_solve",
    }
)
# Log-space ops: a carry recursion through them keeps its traced dtype.
_LOG_OPS = frozenset({"exp", "exp2", "expm1", "log", "log1p", "cumlogsumexp"})


@dataclasses.dataclass(frozen=True)
class EqnFacts:
    """What the dataflow pass knows about one equation.

    Attributes:
        out_bits: per output, the OR of ``REACH``/``WIDE``/``SUM`` of its uses.
        quadratic: the equation squares a value (see the module docstring).
        centring: the equation subtracts a value's own mean (module docstring).
        rms_scaling: the equation scales a value by the inverse root of its own
            sum of squares (module docstring).
        rms_operand: the equation computes, from ``x``, an operand of an
            ``rms_scaling`` equation: the square of its statistic, or ``x``
            minus a constant (Flax's zero mean).
        rms_operand_eqns: for an ``rms_scaling`` equation, the equations
            computing its operands from ``x``: the square of the statistic,
            then Flax's shift if there is one.
        ln_region: for a LayerNorm normalisation, the indices of the
            equations computing it from its input (ascending, itself last):
            the means, centrings, variance and its root (module docstring).
        ln_input: for such an equation, that input variable ``x``.
        shared_inputs: per input, whether another equation (or the jaxpr's
            outputs) reads the same value too (a weight used by many matmuls).
        after_normalisation: an input is a centred value multiplied or divided
            by something, or the output of an ``rms_scaling`` equation (a
            normalised value: module docstring).
        narrow_carries: for a ``scan``, per carry, whether it may be narrowed.
        sub_out_bits: ``id(sub-jaxpr param) -> out bits`` for higher-order
            equations, the facts the sub-jaxpr's analysis starts from.
        in_squared: per input, whether its magnitude is that of a square (a
            sum of squares, a variance: see :func:`squared_flags`).
        sub_in_squared: ``id(sub-jaxpr param) -> in_squared`` of its inputs.
    """

    out_bits: tuple[int, ...] = ()
    quadratic: bool = False
    centring: bool = False
    rms_scaling: bool = False
    rms_operand: bool = False
    rms_operand_eqns: tuple = ()
    ln_region: tuple[int, ...] = ()
    ln_input: Any = None
    after_normalisation: bool = False
    shared_inputs: tuple[bool, ...] = ()
    narrow_carries: tuple[bool, ...] = ()
    sub_out_bits: Any = None  # dict, or None
    in_squared: tuple[bool, ...] = ()
    sub_in_squared: Any = None  # dict, or None

    @property
    def known(self) -> bool:
        """False for the conservative facts of an equation outside any analysis."""
        return bool(self.out_bits)

    @property
    def tail(self) -> bool:
        """No output reaches a matmul: the function's loss chain."""
        return self.known and not any(b & REACH for b in self.out_bits)

    @property
    def wide(self) -> bool:
        """Some output reaches a softmax's ``exp`` or linear algebra through
        scale/mask/shift ops."""
        return any(b & WIDE for b in self.out_bits)

    @property
    def transposed(self) -> bool:
        """Some output is read by a ``transpose`` (seen through casts)."""
        return any(b & TRANSPOSED for b in self.out_bits)

    @property
    def summed(self) -> bool:
        """Some output reaches a ``reduce_sum`` through such ops."""
        return any(b & SUM for b in self.out_bits)

    @property
    def squared_input(self) -> bool:
        """Some input has the magnitude of a square (float16 cannot hold it)."""
        return any(self.in_squared)

    def boundary_for(self, sub: Any) -> tuple | None:
        """``(out bits, in_squared)`` of sub-jaxpr ``sub`` (a param of this
        equation), or None where unknown."""
        out = (self.sub_out_bits or {}).get(id(sub))
        sq = (self.sub_in_squared or {}).get(id(sub))
        if out is None and sq is None:
            return None
        return (out, sq)


UNKNOWN = EqnFacts()


@dataclasses.dataclass(frozen=True)
class JaxprFacts:
    """The analysis of one jaxpr: per equation facts and per input bits."""

    eqns: tuple[EqnFacts, ...]
    in_bits: tuple[int, ...]


_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def analyse(
    jaxpr: Any, out_bits: tuple[int, ...] | None, ignore: frozenset = frozenset()
) -> JaxprFacts:
    """Facts of every equation of ``jaxpr`` given the bits of its outputs.

    Args:
        jaxpr: an open jaxpr (``invars``, ``eqns``, ``outvars``).
        out_bits: per output, the bits of its uses outside (``()``-length
            mismatches and None mean unknown: every output reaches a matmul).
        ignore: names of pattern facts not to derive (``"rms_scaling"``: no
            equation is an RMSNorm scaling), for ablations. The bits of the
            inputs do not depend on them.

    Returns:
        A :class:`JaxprFacts`, cached per (jaxpr, out_bits, ignore).
    """
    if out_bits is None or len(out_bits) != len(jaxpr.outvars):
        out_bits = (ALL,) * len(jaxpr.outvars)
    out_bits = tuple(out_bits)
    try:
        per = _CACHE.setdefault(jaxpr, {})
    except TypeError:  # not weak-referenceable
        per = {}
    key = (out_bits, ignore)
    if key not in per:
        per[key] = _analyse(jaxpr, out_bits, ignore)
    return per[key]


def _analyse(jaxpr: Any, out_bits: tuple[int, ...], ignore: frozenset) -> JaxprFacts:
    bits: dict[Any, int] = {}
    for v, b in zip(jaxpr.outvars, out_bits):
        if is_var(v):
            bits[v] = bits.get(v, 0) | b
    producer = {v: e for e in jaxpr.eqns for v in e.outvars}
    facts: list[EqnFacts] = [UNKNOWN] * len(jaxpr.eqns)
    operands: set[int] = set()  # ids of the rms_operand equations
    uses = collections.Counter(
        v for e in jaxpr.eqns for v in {u for u in e.invars if is_var(u)}
    )
    uses.update(v for v in jaxpr.outvars if is_var(v))
    for k in range(len(jaxpr.eqns) - 1, -1, -1):
        eqn = jaxpr.eqns[k]
        outs = tuple(bits.get(v, 0) for v in eqn.outvars)
        in_bits, extra = _eqn_in_bits(eqn, outs)
        for v, b in zip(eqn.invars, in_bits):
            if is_var(v) and b:
                bits[v] = bits.get(v, 0) | b
        found = None if "rms_scaling" in ignore else rms_operands(eqn, producer)
        if found is not None:
            operands.update(id(e) for e in found)
        facts[k] = EqnFacts(
            out_bits=outs,
            quadratic=quadratic(eqn, producer),
            centring=centring(eqn, producer),
            rms_scaling=found is not None,
            rms_operand=id(eqn) in operands,
            rms_operand_eqns=found or (),
            shared_inputs=tuple(is_var(v) and uses[v] > 1 for v in eqn.invars),
            **extra,
        )
    _mark_normalisations(jaxpr, facts)
    in_bits = tuple(bits.get(v, 0) for v in jaxpr.invars)
    return JaxprFacts(tuple(facts), in_bits)


def _mark_normalisations(jaxpr: Any, facts: list) -> None:
    """Forward: the readers of ``centred * s`` / ``centred / s`` and of an
    ``rms_scaling`` output get ``after_normalisation``, and a LayerNorm's
    normalisation its ``ln_region`` (within one jaxpr)."""
    centred: dict = {}  # centred value -> the variable that was centred
    normalised: set = set()
    regions = CentredRegions(jaxpr)
    for k, eqn in enumerate(jaxpr.eqns):
        ins = [v for v in eqn.invars if is_var(v)]
        if facts[k].centring:
            centred.update((v, eqn.invars[0]) for v in eqn.outvars)
        elif facts[k].rms_scaling:
            normalised.update(eqn.outvars)
        elif eqn.primitive.name in ("mul", "div") and any(v in centred for v in ins):
            normalised.update(eqn.outvars)
            c = eqn.invars[: 2 if eqn.primitive.name == "mul" else 1]
            c = [v for v in c if is_var(v) and v in centred]
            if c and not facts[k].quadratic:
                x, region = regions.find(k, centred[c[0]])
                if region:
                    facts[k] = dataclasses.replace(
                        facts[k], ln_region=region, ln_input=x
                    )
        elif any(v in normalised for v in ins):
            facts[k] = dataclasses.replace(facts[k], after_normalisation=True)


def _eqn_in_bits(eqn: Any, outs: tuple[int, ...]) -> tuple[list[int], dict]:
    """Bits of an equation's inputs from those of its outputs, plus the extra
    facts of higher-order equations."""
    name = eqn.primitive.name
    n = len(eqn.invars)
    reach = REACH if any(b & REACH for b in outs) else 0
    if name in MATMULS:
        return [REACH] * n, {}
    structure = describe(eqn)
    if structure is not None:
        return _sub_jaxpr_bits(structure, n, outs)
    if named_subs(eqn.params):  # unknown higher-order primitive: conservative
        return [REACH] * n, {}
    passed = 0
    if name == "transpose":
        passed = TRANSPOSED
    elif name in ("convert_element_type", "copy", "copy_p", "reduce_precision"):
        for b in outs:
            passed |= b & (WIDE | SUM | TRANSPOSED)
    elif name in _PASS:
        for b in outs:
            passed |= b & (WIDE | SUM)
    elif name in _WIDE_USES:
        passed = WIDE
    elif name == "reduce_sum":
        passed = SUM
    return [reach | passed] * n, {}


def _sub_jaxpr_bits(
    structure: Structure, n: int, outs: tuple[int, ...]
) -> tuple[list[int], dict]:
    """Bits of a higher-order equation's ``n`` operands from those of its
    outputs, through its sub-jaxprs (``jaxamp._base._structure``), plus the
    facts its rewrite reads: the out bits each sub-jaxpr is analysed with
    and, for a loop, which carries may be narrowed."""
    ins = [0] * n
    sub_out_bits = {}
    extra: dict = {}
    for sub in structure.subs:
        start = tuple(0 if k is None else outs[k] for k in sub.outputs)
        in_bits, sub_out = _carried_bits(sub, start)
        for j, i in enumerate(sub.inputs):
            ins[i] |= in_bits[j]
        sub_out_bits[id(sub.jaxpr)] = sub_out
        if sub.carries:
            extra["narrow_carries"] = _narrow_carries(sub, in_bits)
    return ins, {"sub_out_bits": sub_out_bits, **extra}


def _carried_bits(sub: SubJaxpr, start: tuple[int, ...]) -> tuple[tuple, tuple]:
    """``(in bits, out bits)`` of a sub-jaxpr whose outputs' uses outside have
    bits ``start``; a carried output also has the bits of the input it feeds
    (a fixpoint over monotone bits)."""
    core = sub.core
    sub_out = list(start)
    for _ in range(4):
        inner = analyse(core, tuple(sub_out))
        new = list(start)
        for o, i in sub.carries:
            new[o] |= inner.in_bits[i]
        if new == sub_out:
            break
        sub_out = new
    return inner.in_bits, tuple(sub_out)


def _narrow_carries(sub: SubJaxpr, in_bits: tuple[int, ...]) -> tuple[bool, ...]:
    """Per carry: it reaches a matmul and is no log-space recursion."""
    logspace = _log_space_carries(sub.core, sub.carries)
    return tuple(
        bool(in_bits[i] & REACH) and c not in logspace
        for c, (_, i) in enumerate(sub.carries)
    )


# Ops whose output keeps the magnitude class of a squared input: sums, means,
# shifts, products, data movement. sqrt/rsqrt/log bring it back into range.
_SQUARE_KEEPS = (
    _PASS
    | COLLECTIVE_SUMS
    | frozenset({"reduce_sum", "reduce_max", "reduce_min", "cumsum", "add_any", "abs"})
)
_SQ_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def squared_flags(jaxpr: Any, in_sq: tuple[bool, ...] | None) -> tuple:
    """Forward range classes: which values have the magnitude of a square.

    A square's output, and sums, means, products and shifts of it (a variance,
    a sum of squares) can exceed float16's range while the values they came
    from do not; a rule must not cast such a float32 value down to float16
    (``h / jnp.var(h)``). ``sqrt``, ``rsqrt``, ``log`` and division by it end
    the class.

    Args:
        jaxpr: an open jaxpr.
        in_sq: per input, whether it is squared (None: none is).

    Returns:
        ``(per-equation (in flags, sub-jaxpr in flags), output flags)``, cached.
    """
    if in_sq is None or len(in_sq) != len(jaxpr.invars):
        in_sq = (False,) * len(jaxpr.invars)
    in_sq = tuple(in_sq)
    try:
        per = _SQ_CACHE.setdefault(jaxpr, {})
    except TypeError:
        per = {}
    if in_sq not in per:
        per[in_sq] = _squared(jaxpr, in_sq)
    return per[in_sq]


def _squared(jaxpr: Any, in_sq: tuple[bool, ...]) -> tuple:
    sq: dict[Any, bool] = dict(zip(jaxpr.invars, in_sq))
    producer = {v: e for e in jaxpr.eqns for v in e.outvars}
    per_eqn = []
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        ins = tuple(bool(is_var(v) and sq.get(v, False)) for v in eqn.invars)
        structure = describe(eqn)
        sub_in: dict = {}
        if quadratic(eqn, producer):
            outs = [True] * len(eqn.outvars)
        elif structure is not None and structure.call:
            (sub,) = structure.subs
            sub_in = {id(sub.jaxpr): ins}
            outs = list(squared_flags(sub.core, ins)[1])
        elif name == "div":
            outs = [ins[0]]
        elif name in _SQUARE_KEEPS:
            outs = [any(ins)] * len(eqn.outvars)
        else:
            outs = [False] * len(eqn.outvars)
        for v, f in zip(eqn.outvars, outs):
            sq[v] = f
        per_eqn.append((ins, sub_in))
    outs = tuple(bool(is_var(v) and sq.get(v, False)) for v in jaxpr.outvars)
    return tuple(per_eqn), outs


def with_boundary(
    jaxpr: Any, boundary: tuple | None, ignore: frozenset = frozenset()
) -> tuple[EqnFacts, ...]:
    """The facts of every equation of ``jaxpr`` for the interpreter.

    Args:
        jaxpr: an open jaxpr.
        boundary: ``(out bits, in_squared)`` from the enclosing equation (see
            :meth:`EqnFacts.boundary_for`), or None where unknown.
        ignore: pattern facts not to derive (see :func:`analyse`).

    Returns:
        One :class:`EqnFacts` per equation.
    """
    out_bits, in_sq = boundary if boundary is not None else (None, None)
    back = analyse(jaxpr, out_bits, ignore).eqns
    fwd, _ = squared_flags(jaxpr, in_sq)
    return tuple(
        dataclasses.replace(f, in_squared=ins, sub_in_squared=sub or None)
        for f, (ins, sub) in zip(back, fwd)
    )


def _log_space_carries(core: Any, carries: tuple[tuple[int, int], ...]) -> set[int]:
    """Carry indices (into ``carries``, ``(output, input)`` pairs of a loop
    body) that a matmul-free path through an exp/log op connects to some
    carry (a log-space recursion)."""
    plain: dict[Any, int] = {}
    logged: dict[Any, int] = {}
    n_carry = len(carries)
    for c, (_, i) in enumerate(carries):
        plain[core.invars[i]] = 1 << c
    _forward_masks(core, plain, logged)
    out = set()
    for c, (o, _) in enumerate(carries):
        v = core.outvars[o]
        mask = logged.get(v, 0) if is_var(v) else 0
        if mask:
            out.add(c)
            out.update(i for i in range(n_carry) if mask >> i & 1)
    return out


def _forward_masks(core: Any, plain: dict, logged: dict) -> None:
    """Propagate carry bitmasks forward through matmul-free paths, marking those
    that pass a log-space op. The sub-jaxprs of calls are entered."""
    for eqn in core.eqns:
        name = eqn.primitive.name
        ins = [v for v in eqn.invars if is_var(v)]
        p = 0
        lg = 0
        for v in ins:
            p |= plain.get(v, 0)
            lg |= logged.get(v, 0)
        if not (p or lg) or name in MATMULS:
            continue
        inner = call_body(eqn)
        if inner is not None:
            ip: dict = {}
            il: dict = {}
            for iv, v in zip(inner.invars, eqn.invars):
                if is_var(v):
                    ip[iv] = plain.get(v, 0)
                    il[iv] = logged.get(v, 0)
            _forward_masks(inner, ip, il)
            for ov, v in zip(inner.outvars, eqn.outvars):
                if is_var(ov):
                    plain[v] = ip.get(ov, 0)
                    logged[v] = il.get(ov, 0)
            continue
        if name in _LOG_OPS:
            lg |= p
        for v in eqn.outvars:
            plain[v] = p
            logged[v] = lg
