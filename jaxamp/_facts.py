"""Value facts: one dataflow pass per jaxpr that the default rules read.

Deciding an equation's dtype from its primitive alone is not enough (DESIGN.md,
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
    feeding it is a normalisation statistic, kept in float32.

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
  summed in float32 and rounded once, as by hand. Where the statistic's
  intermediate values have no other reader, the scaling equation also gets
  ``rms_region`` (the indices of the equations from the square to it) and
  those equations ``rms_member``: the interpreter runs them together, inside
  one ``jax.checkpoint`` that saves the low-precision ``x`` and recomputes the
  float32 normalisation in the backward pass;

* per ``scan``: which float carries may be narrowed to the compute dtype. A
  carry is narrowed only if it reaches a matmul in the body (an activation such
  as the residual stream) and no matmul-free path from a carry into it passes
  an ``exp``/``log`` (a log-space recursion such as CTC's or an HMM's forward
  pass keeps its traced dtype).

* per ``scan`` input, read on the body amp has rewritten
  (:func:`narrowed_inputs`): the one narrower float dtype that every use of
  the input converts it to (a weight that every matmul reads in the compute
  dtype), and (:func:`recomputed_inputs`, on the traced body) whether every
  use is inside a user's ``jax.checkpoint``. The scan rule casts such inputs
  once, before the loop (see ``_higher_order``).

Sub-jaxprs are analysed with the bits of the values their outputs feed in the
enclosing jaxpr (a scan's carries to a fixpoint), so facts cross ``jit``,
``scan``, ``while``, ``cond``, ``remat`` and custom-derivative boundaries. Where
the bits of a sub-jaxpr's outputs are unknown (a user's jvp or bwd rule traced
lazily by JAX), every output is taken to reach a matmul: the conservative
choice, which keeps the compute dtype's memory savings.
"""

from __future__ import annotations

import collections
import contextvars
import dataclasses
import weakref
from typing import Any

import numpy as np

from . import _compat
from ._dtypes import is_float
from ._overflow import CHECK_SCOPE

REACH, WIDE, SUM = 1, 2, 4
ALL = REACH  # conservative bits for an output whose consumers are unknown

MATMULS = ("dot_general", "conv_general_dilated", "ragged_dot_general")

# Ops through which a value still "is" the logits of a softmax (WIDE) or the terms
# of a sum (SUM): scaling, masking, shifting and moving data around.
_PASS = frozenset(
    {
        "add",
        "sub",
        "mul",
        "div",
        "neg",
        "max",
        "min",
        "select_n",
        "convert_element_type",
        "reduce_precision",
        "copy",
        "copy_p",
        "reshape",
        "transpose",
        "broadcast_in_dim",
        "squeeze",
        "expand_dims",
        "slice",
        "dynamic_slice",
        "concatenate",
        "pad",
        "stop_gradient",
    }
)
# Ops that keep a value's magnitude (seen through when asking "x times itself?").
_SAME_MAGNITUDE = frozenset(
    {
        "convert_element_type",
        "neg",
        "abs",
        "copy",
        "copy_p",
        "reduce_precision",
        "real",
        "transpose",
    }
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
# Call-like primitives: one sub-jaxpr whose inputs and outputs are the equation's.
_CALLS = frozenset(
    {
        "jit",
        "pjit",
        "closed_call",
        "core_call",
        "remat2",
        "checkpoint",
        "custom_jvp_call",
        "custom_vjp_call",
        "shard_map",
    }
)


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
        rms_region: for an ``rms_scaling`` equation whose statistic's values
            have no other reader, the indices (ascending, itself last) of the
            equations from the square to it (module docstring).
        rms_member: the equation is in another equation's ``rms_region``.
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
    rms_region: tuple[int, ...] = ()
    rms_member: bool = False
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

_CURRENT: contextvars.ContextVar[EqnFacts] = contextvars.ContextVar(
    "jaxamp_eqn_facts", default=UNKNOWN
)


_NO_WIDE: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "jaxamp_no_wide", default=False
)


def wide_results_allowed() -> bool:
    """False inside a region where low-precision products must not produce a
    float32 result (a ``shard_map`` body on a backend that cannot run them)."""
    return not _NO_WIDE.get()


def no_wide_results(active: bool = True) -> contextvars.Token:
    """Forbid float32 results of low-precision products (returns the token)."""
    return _NO_WIDE.set(active or _NO_WIDE.get())


def allow_wide_results(token: contextvars.Token) -> None:
    """Undo :func:`no_wide_results`."""
    _NO_WIDE.reset(token)


def current_facts() -> EqnFacts:
    """The facts of the equation the interpreter is binding (for rules).

    Outside a jaxamp walk (a rule called by hand) every fact is unknown and
    false: rules then behave as they did without the analysis.
    """
    return _CURRENT.get()


def set_current(facts: EqnFacts) -> contextvars.Token:
    """Make ``facts`` the current equation's facts; returns the reset token."""
    return _CURRENT.set(facts)


def reset_current(token: contextvars.Token) -> None:
    """Undo :func:`set_current`."""
    _CURRENT.reset(token)


@dataclasses.dataclass(frozen=True)
class JaxprFacts:
    """The analysis of one jaxpr: per equation facts and per input bits."""

    eqns: tuple[EqnFacts, ...]
    in_bits: tuple[int, ...]


_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def analyse(jaxpr: Any, out_bits: tuple[int, ...] | None) -> JaxprFacts:
    """Facts of every equation of ``jaxpr`` given the bits of its outputs.

    Args:
        jaxpr: an open jaxpr (``invars``, ``eqns``, ``outvars``).
        out_bits: per output, the bits of its uses outside (``()``-length
            mismatches and None mean unknown: every output reaches a matmul).

    Returns:
        A :class:`JaxprFacts`, cached per (jaxpr, out_bits).
    """
    if out_bits is None or len(out_bits) != len(jaxpr.outvars):
        out_bits = (ALL,) * len(jaxpr.outvars)
    out_bits = tuple(out_bits)
    try:
        per = _CACHE.setdefault(jaxpr, {})
    except TypeError:  # not weak-referenceable
        per = {}
    if out_bits not in per:
        per[out_bits] = _analyse(jaxpr, out_bits)
    return per[out_bits]


def _is_var(v: Any) -> bool:
    return not isinstance(v, _compat.Literal)


def _named_subs(params: dict) -> list[tuple[Any, Any]]:
    """``(param value, core jaxpr)`` of each sub-jaxpr of an equation."""
    out = []
    for val in params.values():
        for sub in val if isinstance(val, (tuple, list)) else (val,):
            if _compat.is_jaxpr(sub):
                out.append((sub, _compat.jaxpr_parts(sub)[0]))
    return out


def _analyse(jaxpr: Any, out_bits: tuple[int, ...]) -> JaxprFacts:
    bits: dict[Any, int] = {}
    for v, b in zip(jaxpr.outvars, out_bits):
        if _is_var(v):
            bits[v] = bits.get(v, 0) | b
    producer = {v: e for e in jaxpr.eqns for v in e.outvars}
    facts: list[EqnFacts] = [UNKNOWN] * len(jaxpr.eqns)
    operands: set[int] = set()  # ids of the rms_operand equations
    scalings: dict[int, tuple] = {}  # index of an rms_scaling equation -> operands
    uses = collections.Counter(
        v for e in jaxpr.eqns for v in {u for u in e.invars if _is_var(u)}
    )
    uses.update(v for v in jaxpr.outvars if _is_var(v))
    for k in range(len(jaxpr.eqns) - 1, -1, -1):
        eqn = jaxpr.eqns[k]
        outs = tuple(bits.get(v, 0) for v in eqn.outvars)
        in_bits, extra = _eqn_in_bits(eqn, outs)
        for v, b in zip(eqn.invars, in_bits):
            if _is_var(v) and b:
                bits[v] = bits.get(v, 0) | b
        found = _rms_operands(eqn, producer)
        if found is not None:
            operands.update(id(e) for e in found)
            scalings[k] = found
        facts[k] = EqnFacts(
            out_bits=outs,
            quadratic=_quadratic(eqn, producer),
            centring=_centring(eqn, producer),
            rms_scaling=found is not None,
            rms_operand=id(eqn) in operands,
            shared_inputs=tuple(_is_var(v) and uses[v] > 1 for v in eqn.invars),
            **extra,
        )
    _mark_rms_regions(jaxpr, facts, scalings)
    _mark_normalisations(jaxpr, facts)
    in_bits = tuple(bits.get(v, 0) for v in jaxpr.invars)
    return JaxprFacts(tuple(facts), in_bits)


def _mark_rms_regions(jaxpr: Any, facts: list, scalings: dict) -> None:
    """``rms_region`` / ``rms_member``: per RMSNorm scaling ``k``, the equations
    that are both descendants of its square and ancestors of ``k`` (plus the
    square and Flax's shift), where no value they compute is read outside that
    set or returned; regions never overlap."""
    eqns = jaxpr.eqns
    index = {id(e): j for j, e in enumerate(eqns)}
    readers: dict[Any, set[int]] = collections.defaultdict(set)
    for j, e in enumerate(eqns):
        for v in e.invars:
            if _is_var(v):
                readers[v].add(j)
    returned = {v for v in jaxpr.outvars if _is_var(v)}
    taken: set[int] = set()
    for k, operands in sorted(scalings.items()):
        s = index[id(operands[0])]  # the square
        desc = set(eqns[s].outvars)
        below: set[int] = set()
        for j in range(s + 1, k + 1):
            if any(_is_var(v) and v in desc for v in eqns[j].invars):
                below.add(j)
                desc.update(eqns[j].outvars)
        need = {v for v in eqns[k].invars if _is_var(v)}
        above: set[int] = set()
        for j in range(k - 1, s - 1, -1):
            if any(v in need for v in eqns[j].outvars):
                above.add(j)
                need.update(v for v in eqns[j].invars if _is_var(v))
        region = (below & above) | {s, k} | {index[id(e)] for e in operands[1:]}
        members = region - {k}
        exclusive = all(
            v not in returned and readers[v] <= region
            for j in members
            for v in eqns[j].outvars
        )
        if (
            not exclusive
            or region & taken
            or any(
                eqns[j].primitive.multiple_results or _named_subs(eqns[j].params)
                for j in region
            )
        ):
            continue
        taken |= region
        facts[k] = dataclasses.replace(facts[k], rms_region=tuple(sorted(region)))
        for j in members:
            facts[j] = dataclasses.replace(facts[j], rms_member=True)


def _mark_normalisations(jaxpr: Any, facts: list) -> None:
    """Forward: the readers of ``centred * s`` / ``centred / s`` and of an
    ``rms_scaling`` output get ``after_normalisation`` (within one jaxpr)."""
    centred: set = set()
    normalised: set = set()
    for k, eqn in enumerate(jaxpr.eqns):
        ins = [v for v in eqn.invars if _is_var(v)]
        if facts[k].centring:
            centred.update(eqn.outvars)
        elif facts[k].rms_scaling:
            normalised.update(eqn.outvars)
        elif eqn.primitive.name in ("mul", "div") and any(v in centred for v in ins):
            normalised.update(eqn.outvars)
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
    if name == "scan":
        return _scan_bits(eqn, outs)
    if name in _CALLS:
        subs = _named_subs(eqn.params)
        if len(subs) == 1 and len(subs[0][1].invars) == n:
            sub, core = subs[0]
            inner = analyse(core, outs)
            return list(inner.in_bits), {"sub_out_bits": {id(sub): outs}}
    if name == "cond":
        branches = eqn.params["branches"]
        ins = [0] * n
        for br in branches:
            inner = analyse(_compat.jaxpr_parts(br)[0], outs)
            for i, b in enumerate(inner.in_bits):
                ins[i + 1] |= b
        return ins, {"sub_out_bits": {id(br): outs for br in branches}}
    if name == "while":
        return _while_bits(eqn, outs)
    if _named_subs(eqn.params):  # unknown higher-order primitive: conservative
        return [REACH] * n, {}
    passed = 0
    if name in _PASS:
        passed = 0
        for b in outs:
            passed |= b & (WIDE | SUM)
    elif name in _WIDE_USES:
        passed = WIDE
    elif name == "reduce_sum":
        passed = SUM
    return [reach | passed] * n, {}


def _scan_bits(eqn: Any, outs: tuple[int, ...]) -> tuple[list[int], dict]:
    n_consts, n_carry = _compat.scan_carry_range(eqn.params)
    body = eqn.params["jaxpr"]
    core = _compat.jaxpr_parts(body)[0]
    sub_out = list(outs)
    for _ in range(4):  # carries: a fixpoint over monotone bits
        inner = analyse(core, tuple(sub_out))
        carry_in = inner.in_bits[n_consts : n_consts + n_carry]
        new = [o | c for o, c in zip(outs[:n_carry], carry_in)] + list(outs[n_carry:])
        if new == sub_out:
            break
        sub_out = new
    logspace = _log_space_carries(core, n_consts, n_carry)
    narrow = tuple(
        bool(carry_in[c] & REACH) and c not in logspace for c in range(n_carry)
    )
    extra = {"sub_out_bits": {id(body): tuple(sub_out)}, "narrow_carries": narrow}
    return list(inner.in_bits), extra


def _while_bits(eqn: Any, outs: tuple[int, ...]) -> tuple[list[int], dict]:
    cn, bn = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
    cond, body = eqn.params["cond_jaxpr"], eqn.params["body_jaxpr"]
    core = _compat.jaxpr_parts(body)[0]
    sub_out = list(outs)
    for _ in range(4):
        inner = analyse(core, tuple(sub_out))
        new = [o | c for o, c in zip(outs, inner.in_bits[bn:])]
        if new == sub_out:
            break
        sub_out = new
    cond_in = analyse(_compat.jaxpr_parts(cond)[0], (0,)).in_bits
    ins = list(cond_in[:cn]) + list(inner.in_bits[:bn])
    ins += [a | b for a, b in zip(inner.in_bits[bn:], cond_in[cn:])]
    return ins, {"sub_out_bits": {id(body): tuple(sub_out), id(cond): (0,)}}


# Ops whose output keeps the magnitude class of a squared input: sums, means,
# shifts, products, data movement. sqrt/rsqrt/log bring it back into range.
_SQUARE_KEEPS = _PASS | frozenset(
    {"reduce_sum", "reduce_max", "reduce_min", "cumsum", "add_any", "abs"}
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
        ins = tuple(bool(_is_var(v) and sq.get(v, False)) for v in eqn.invars)
        subs = _named_subs(eqn.params)
        sub_in: dict = {}
        if _quadratic(eqn, producer):
            outs = [True] * len(eqn.outvars)
        elif name in _CALLS and len(subs) == 1 and len(subs[0][1].invars) == len(ins):
            sub_in = {id(subs[0][0]): ins}
            outs = list(squared_flags(subs[0][1], ins)[1])
        elif name == "div":
            outs = [ins[0]]
        elif name in _SQUARE_KEEPS:
            outs = [any(ins)] * len(eqn.outvars)
        else:
            outs = [False] * len(eqn.outvars)
        for v, f in zip(eqn.outvars, outs):
            sq[v] = f
        per_eqn.append((ins, sub_in))
    outs = tuple(bool(_is_var(v) and sq.get(v, False)) for v in jaxpr.outvars)
    return tuple(per_eqn), outs


def with_boundary(jaxpr: Any, boundary: tuple | None) -> tuple[EqnFacts, ...]:
    """The facts of every equation of ``jaxpr`` for the interpreter.

    Args:
        jaxpr: an open jaxpr.
        boundary: ``(out bits, in_squared)`` from the enclosing equation (see
            :meth:`EqnFacts.boundary_for`), or None where unknown.

    Returns:
        One :class:`EqnFacts` per equation.
    """
    out_bits, in_sq = boundary if boundary is not None else (None, None)
    back = analyse(jaxpr, out_bits).eqns
    fwd, _ = squared_flags(jaxpr, in_sq)
    return tuple(
        dataclasses.replace(f, in_squared=ins, sub_in_squared=sub or None)
        for f, (ins, sub) in zip(back, fwd)
    )


def _root(v: Any, producer: dict) -> Any:
    """``v`` seen through casts, negation and abs (ops that keep |v|)."""
    for _ in range(16):
        eqn = producer.get(v)
        if eqn is None or eqn.primitive.name not in _SAME_MAGNITUDE:
            return v
        v = eqn.invars[0]
    return v


def _quadratic(eqn: Any, producer: dict) -> bool:
    name = eqn.primitive.name
    if name in ("square", "pow"):
        return True
    if name == "integer_pow":
        return eqn.params.get("y") not in (0, 1)
    if name in ("mul", "dot_general") and len(eqn.invars) == 2:
        a, b = eqn.invars
        return _is_var(a) and _is_var(b) and _root(a, producer) is _root(b, producer)
    return False


# Steps from a reduce_sum to the mean that is subtracted: broadcasts, reshapes,
# casts and the division (or multiplication) by the count.
_MEAN_STEPS = frozenset(
    {
        "broadcast_in_dim",
        "reshape",
        "squeeze",
        "expand_dims",
        "convert_element_type",
        "div",
        "mul",
    }
)


def _centring(eqn: Any, producer: dict) -> bool:
    """``sub(x, m)`` where ``m`` is a mean of ``x`` (both seen through casts)."""
    if eqn.primitive.name != "sub" or len(eqn.invars) != 2:
        return False
    x, v = eqn.invars
    if not (_is_var(x) and _is_var(v)):
        return False
    for _ in range(8):
        step = producer.get(v)
        if step is None:
            return False
        if step.primitive.name == "reduce_sum":
            a = step.invars[0]
            return _is_var(a) and _root(a, producer) is _root(x, producer)
        if step.primitive.name not in _MEAN_STEPS:
            return False
        operands = [u for u in step.invars if _is_var(u)]
        if len(operands) != 1:  # a mean divides by a constant count
            return False
        v = operands[0]
    return False


# Steps from a sum of squares to the factor that scales the value: the mean's
# count, the epsilon, a clamp, broadcasts, casts and a gain folded into the
# factor (Flax's RMSNorm multiplies rsqrt(ms) by its scale first).
_NORM_STEPS = _MEAN_STEPS | frozenset({"add", "max", "sub"})
_INVERSE_ROOTS = {"mul": "rsqrt", "div": "sqrt"}


def _rms_operands(eqn: Any, producer: dict) -> tuple | None:
    """For ``x * rsqrt(f(sum(x * x)))`` or ``x / sqrt(f(sum(x * x)))`` (``x``
    seen through casts, negation, abs and a constant shift; ``f`` through
    :data:`_NORM_STEPS`), the equations computing ``x * x`` and the shift (if
    any); else None."""
    name = eqn.primitive.name
    if name not in _INVERSE_ROOTS or len(eqn.invars) != 2:
        return None
    a, b = eqn.invars
    if not (_is_var(a) and _is_var(b)):
        return None
    pairs = [(a, b), (b, a)] if name == "mul" else [(a, b)]
    for x, factor in pairs:
        unshifted = _unshifted(x, producer)
        x_root = _root(unshifted, producer)
        square = _own_square(factor, x_root, _INVERSE_ROOTS[name], producer)
        if square is not None:
            return (square,) if unshifted is x else (square, producer[x])
    return None


def _own_square(v: Any, x_root: Any, inverse: str, producer: dict) -> Any:
    """The equation squaring ``x`` if ``v`` is ``inverse`` (``rsqrt`` /
    ``sqrt``) of a statistic derived from ``sum(x * x)`` (depth-first, at most
    12 steps), else None."""
    stack = [(v, False, 0)]
    while stack:
        v, rooted, depth = stack.pop()
        step = producer.get(v) if _is_var(v) else None
        if step is None or depth > 12:
            continue
        name = step.primitive.name
        if name == "reduce_sum":
            sq = producer.get(step.invars[0]) if _is_var(step.invars[0]) else None
            if (
                rooted
                and sq is not None
                and _quadratic(sq, producer)
                and _is_var(sq.invars[0])
                and _root(sq.invars[0], producer) is x_root
            ):
                return sq
            continue
        if name == inverse and not rooted:
            stack.append((step.invars[0], True, depth + 1))
        elif name in _NORM_STEPS:
            stack.extend((u, rooted, depth + 1) for u in step.invars if _is_var(u))
    return None


def _unshifted(v: Any, producer: dict) -> Any:
    """``v`` without a constant shift: Flax's RMSNorm subtracts a broadcast
    zero (its mean, for LayerNorm) before scaling."""
    eqn = producer.get(v)
    if eqn is None or eqn.primitive.name not in ("sub", "add"):
        return v
    x, c = eqn.invars
    return x if _is_var(x) and _is_constant(c, producer) else v


def _is_constant(v: Any, producer: dict) -> bool:
    """A literal, or a broadcast / reshape / cast of literals only."""
    for _ in range(8):
        if not _is_var(v):
            return True
        eqn = producer.get(v)
        if eqn is None or eqn.primitive.name not in (
            "broadcast_in_dim",
            "reshape",
            "convert_element_type",
        ):
            return False
        v = eqn.invars[0]
    return False


def _log_space_carries(core: Any, n_consts: int, n_carry: int) -> set[int]:
    """Carry indices of a scan body that a matmul-free path through an exp/log
    op connects to some carry (a log-space recursion)."""
    plain: dict[Any, int] = {}
    logged: dict[Any, int] = {}
    for c in range(n_carry):
        plain[core.invars[n_consts + c]] = 1 << c
    _forward_masks(core, plain, logged)
    out = set()
    for c in range(n_carry):
        v = core.outvars[c]
        mask = logged.get(v, 0) if _is_var(v) else 0
        if mask:
            out.add(c)
            out.update(i for i in range(n_carry) if mask >> i & 1)
    return out


def _forward_masks(core: Any, plain: dict, logged: dict) -> None:
    """Propagate carry bitmasks forward through matmul-free paths, marking those
    that pass a log-space op. Sub-jaxprs of call-like equations are entered."""
    for eqn in core.eqns:
        name = eqn.primitive.name
        ins = [v for v in eqn.invars if _is_var(v)]
        p = 0
        lg = 0
        for v in ins:
            p |= plain.get(v, 0)
            lg |= logged.get(v, 0)
        if not (p or lg) or name in MATMULS:
            continue
        subs = _named_subs(eqn.params)
        if name in _CALLS and len(subs) == 1:
            inner = subs[0][1]
            if len(inner.invars) == len(eqn.invars):
                ip: dict = {}
                il: dict = {}
                for iv, v in zip(inner.invars, eqn.invars):
                    if _is_var(v):
                        ip[iv] = plain.get(v, 0)
                        il[iv] = logged.get(v, 0)
                _forward_masks(inner, ip, il)
                for ov, v in zip(inner.outvars, eqn.outvars):
                    if _is_var(ov):
                        plain[v] = ip.get(ov, 0)
                        logged[v] = il.get(ov, 0)
                continue
        if name in _LOG_OPS:
            lg |= p
        for v in eqn.outvars:
            plain[v] = p
            logged[v] = lg


# Call-like primitives whose body runs once, as called: a use inside the body is
# a use of the equation's input (custom derivatives are not entered: their rules
# may read the input in any dtype).
_PLAIN_CALLS = frozenset(
    {"jit", "pjit", "closed_call", "core_call", "remat2", "checkpoint"}
)
_REMATS = frozenset({"remat2", "checkpoint"})


def _leaf_uses(core: Any, var: Any, in_remat: bool = False):
    """``(eqn, in_remat)`` for every equation using ``var`` in ``core``, the
    bodies of call-like equations entered; ``eqn`` is None where ``var`` is an
    output. ``in_remat``: the use is inside a ``jax.checkpoint`` body."""
    if any(v is var for v in core.outvars):
        yield None, in_remat
    for eqn in core.eqns:
        subs = _named_subs(eqn.params)
        for pos, v in enumerate(eqn.invars):
            if v is not var:
                continue
            name = eqn.primitive.name
            if (
                name in _PLAIN_CALLS
                and len(subs) == 1
                and len(subs[0][1].invars) == len(eqn.invars)
            ):
                inner = subs[0][1]
                yield from _leaf_uses(
                    inner, inner.invars[pos], in_remat or name in _REMATS
                )
            else:
                yield eqn, in_remat


def _is_check(eqn: Any) -> bool:
    """A finite test that a float16 overflow check added (:mod:`jaxamp._overflow`)."""
    return eqn.primitive.name == "is_finite" and CHECK_SCOPE in _compat.scope_names(eqn)


def narrowed_inputs(jaxpr: Any) -> tuple[Any, ...]:
    """Per input of ``jaxpr``: the narrower float dtype that *every* use of it
    converts it to, else None.

    Read on a body amp has already rewritten: an input all of whose uses are
    ``convert_element_type`` to one dtype narrower than its own (a float32
    weight read only by bfloat16 matmuls, directly or inside ``jit``/``remat``
    bodies) can be passed in that dtype instead, with the same results. The
    finite tests of a float16 cast's overflow check do not count as reads: the
    cast before the loop carries the check (the body's own check of the
    narrowed value then finds nothing fresh). An input that is also an output,
    read by any other equation, or converted to two different dtypes gets None.

    Args:
        jaxpr: an open or closed jaxpr.

    Returns:
        One numpy dtype or None per input.
    """
    core, _ = _compat.jaxpr_parts(jaxpr)
    out = []
    for var in core.invars:
        seen = set()
        for eqn, _ in _leaf_uses(core, var):
            if eqn is not None and _is_check(eqn):
                continue  # the finite test of a cast's overflow check
            if eqn is None or eqn.primitive.name != "convert_element_type":
                seen = None
                break
            seen.add(np.dtype(eqn.params["new_dtype"]))
        src = var.aval.dtype
        ok = seen is not None and len(seen) == 1 and is_float(src)
        dtype = next(iter(seen)) if ok else None
        if dtype is not None and (
            not is_float(dtype) or dtype.itemsize >= np.dtype(src).itemsize
        ):
            dtype = None
        out.append(dtype)
    return tuple(out)


def recomputed_inputs(jaxpr: Any) -> tuple[bool, ...]:
    """Per input of ``jaxpr``: whether it is used, and only inside the body of
    a ``jax.checkpoint`` (``remat``), whose backward pass re-runs every use.

    Args:
        jaxpr: an open or closed jaxpr, as traced (before amp's rewrite, which
            adds checkpoints of its own).

    Returns:
        One bool per input.
    """
    core, _ = _compat.jaxpr_parts(jaxpr)
    out = []
    for var in core.invars:
        uses = list(_leaf_uses(core, var))
        out.append(bool(uses) and all(e is not None and r for e, r in uses))
    return tuple(out)
