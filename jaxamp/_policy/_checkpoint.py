"""Compressed residuals at a user's ``jax.checkpoint``: the rule per saved value.

A checkpoint saves its inputs and, under a policy
(``save_only_these_names``, ``dots_saveable``, ...), the values inside its
body the policy names; the backward pass recomputes the rest from them. With
a residual format in force, :func:`store_checkpoint` binds the (rewritten)
body as a ``jax.custom_vjp`` that saves each such value by what reads it in
the recomputed block: int8 stores every one; FP8 (``QFormat.stores_products``
False) stores in FP8 only the values that, in the recomputed block, reach no
product's operand through elementwise chains, normalisations or data
movement, and that no elementwise derivative reads (``_values/_operands.py``:
a weight gradient ``x^T g`` inherits a stored ``x``'s error undamped). The others are
stored in its :func:`product_form` (int8 in 1 x 32 groups, 0.5% rms error per
value, for ``residual_dtype`` FP8): outside a checkpoint the product keeps
its own input in the compute dtype, but here that input is recomputed from
the saved value, whose compute-dtype copy would be as large as the input and
whose FP8 copy gives the recomputed input FP8's 2.6% error. So are, for
the same reason, the values an elementwise derivative reads (``tanh``'s
``1 - tanh^2``, a SiLU's, a norm's ``rsqrt``: ``_values/_operands.DERIVATIVE``),
whose error reaches every gradient below the block. Held values (the step's
arguments) are saved as they are, and what the backward pass does not read is
not saved at all (dead-code elimination of its traced form).

The backward pass decodes the saved values, evaluates the body with each
policy-saved value substituted for its recomputation (the cotangent still
flows through the equation that made it) and differentiates that: JAX's
recomputation, from the stored copies. A policy that offloads values to host
memory (``offload_dot_with_no_batch_dims``) is left to JAX: its copies leave
the device, and compressing them would need the transfers made here.

Each decision is logged for :func:`jaxamp.memory_report` (:func:`recording`).

Whatever the residual format and the policy, a checkpoint whose body
quantizes an operand to 8 bits also saves that operand's amax
(:class:`SavingAmax`), so that its recompute reduces none again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator
from typing import Any

import jax
from jax.extend import core as jex_core

from .. import _compat
from .._base import _state
from .._base._cast import cast_cache
from .._base._codec import AMAX_NAME, Recipe
from .._base._dtypes import is_float
from .._base._jaxpr import bind_eqn, iter_equations, read
from .._base._structure import describe
from .._values._operands import DERIVATIVE, EXACT, PRODUCT, product_operands
from ._compressed import (
    RESIDUAL_SCOPE,
    Saved,
    encoded,
    is_held,
    partial_vjp,
    weight_source_of,
)
from ._residual_format import compressible_aval, encode, product_form

# The rule that decided a saved value's stored form (memory_report shows it).
STORED_PRODUCT = "reaches a product: int8"
STORED_DERIVATIVE = "read by an elementwise derivative: int8"
STORED = "read by no product or derivative: stored"
AS_IS = "not compressible: as it is"
EXACT_INPUT = "reaches exp, a choice or logits: as it is"


@dataclasses.dataclass(frozen=True)
class SavedChoice:
    """How one value a checkpoint saves is stored, and why.

    Attributes:
        scopes: the ``named_scope`` path of the checkpoint.
        value: ``"input i"`` (a boundary input), ``"name 'act'"`` (a
            ``checkpoint_name``), or the primitive whose output the policy
            saves (``"dot_general"``).
        shape: the value's shape.
        dtype: the stored dtype's name (the 8-bit one, or the value's own).
        rule: :data:`STORED_PRODUCT`, :data:`STORED_DERIVATIVE`,
            :data:`STORED`, :data:`EXACT_INPUT` or :data:`AS_IS`.
        source: the user's source line of the value (the checkpoint's call
            for an input).
    """

    scopes: tuple
    value: str
    shape: tuple
    dtype: str
    rule: str
    source: str


@contextlib.contextmanager
def recording() -> Iterator[list]:
    """Within the block, each checkpoint's choices are appended to the
    yielded list as :class:`SavedChoice` s (once each)."""
    log: list = []
    with _state.updated(saved_choices=log):
        yield log


def _note(choice: SavedChoice) -> None:
    log = _state.current().saved_choices
    if log is not None and choice not in log:
        log.append(choice)


def _case(policy: Any, eqn: Any) -> str:
    """``"save"``, ``"offload"`` or ``"recompute"``: what ``policy`` does with
    ``eqn``'s outputs (JAX asks it the same way)."""
    if policy is None or _call_body(eqn) is not None:
        return "recompute"
    got = policy(eqn.primitive, *(v.aval for v in eqn.invars), **eqn.params)
    kind = type(got).__name__
    if kind == "Offloadable":
        return "offload"
    return "save" if got is True or kind == "SaveableType" else "recompute"


def _call_body(eqn: Any) -> Any:
    """The sub-jaxpr of a call equation (``jit``; not a nested checkpoint),
    as the higher-order registry describes it, else None."""
    structure = describe(eqn)
    if structure is None or not structure.call or structure.recomputed:
        return None
    return structure.subs[0].jaxpr if structure.dtypes_flow else None


def policy_cases(policy: Any, jaxpr: Any) -> frozenset:
    """The cases (:func:`_case`) ``policy`` gives the equations of ``jaxpr``
    and of the calls in it, as JAX's partial evaluation enters them."""
    if policy is None:
        return frozenset()
    core, _ = _compat.jaxpr_parts(jaxpr)
    found: set = set()
    for eqn in core.eqns:
        body = _call_body(eqn)
        found |= {_case(policy, eqn)} if body is None else policy_cases(policy, body)
    return frozenset(found)


@dataclasses.dataclass(frozen=True)
class SavingAmax:
    """A ``jax.checkpoint`` policy: the user's ``policy`` (None: save
    nothing), and every amax jaxamp's codec names (``_base/_codec.AMAX_NAME``)
    saved as well.

    The checkpoint's recompute then quantizes each recomputed 8-bit operand
    with the scale of the forward pass instead of reducing its amax again (one
    float32 per tensor or row saved; JAX's partial evaluation enters the
    quantizing ``jit`` and keeps only the scaling and the cast). The backward
    pass then scales as the forward did; an amax reduced again could differ
    where XLA rounds the recomputed activation differently from the forward's
    (XLA:CPU's fusions keep some bfloat16 values in float32).
    """

    policy: Any

    def __call__(self, prim: Any, *avals: Any, **params: Any) -> Any:
        if prim.name == "name" and params.get("name") == AMAX_NAME:
            return True
        return False if self.policy is None else self.policy(prim, *avals, **params)


def saving_amax(policy: Any, body: Any) -> Any:
    """``policy`` (a ``jax.checkpoint`` policy or None) that also saves the
    amaxes named in the checkpoint's rewritten ``body`` (:class:`SavingAmax`);
    ``policy`` itself where ``body`` names none (no 8-bit value) or it
    already saves them."""
    named = any(
        e.primitive.name == "name" and e.params.get("name") == AMAX_NAME
        for e, _ in iter_equations(body)
    )
    if not named or isinstance(policy, SavingAmax):
        return policy
    return SavingAmax(policy)


def offloads(policy: Any, jaxpr: Any) -> bool:
    """Whether ``policy`` moves values of ``jaxpr`` to another memory."""
    return "offload" in policy_cases(policy, jaxpr)


def _collect(core: Any, consts: list, args: list, policy: Any, found: list) -> list:
    """Evaluate ``core``, the calls whose bodies ``policy`` saves in entered;
    append ``(equation, value)`` for each value it saves to ``found``."""
    env = dict(zip(core.constvars, consts))
    env.update(zip(core.invars, args))
    for eqn in core.eqns:
        invals = [read(env, v) for v in eqn.invars]
        body = _call_body(eqn)
        if body is not None and "save" in policy_cases(policy, body):
            inner, inner_consts = _compat.jaxpr_parts(body)
            outs = _collect(inner, inner_consts, invals, policy, found)
        else:
            outs = bind_eqn(eqn, invals)
            if _case(policy, eqn) == "save":  # (integers are recomputed)
                found.extend((eqn, x) for x in outs if is_float(x.dtype))
        env.update(zip(eqn.outvars, outs))
    return [read(env, v) for v in core.outvars]


@jax.custom_vjp
def _substitute(computed: Any, saved: Any) -> Any:
    """``saved`` in place of ``computed``, whose cotangent it passes on."""
    del computed
    return saved


_substitute.defvjp(lambda c, s: (s, None), lambda _, g: (g, None))


def _replayed(core, consts, saved_vars, saved, n_out, *args) -> list:
    """The first ``n_out`` outputs of ``core`` on ``args``, each variable of
    ``saved_vars`` taking the value in ``saved`` (:func:`_substitute`)."""
    sub = dict(zip(saved_vars, saved))
    env = dict(zip(core.constvars, consts))
    env.update(zip(core.invars, args))
    for eqn in core.eqns:
        outs = bind_eqn(eqn, [read(env, v) for v in eqn.invars])
        for v, x in zip(eqn.outvars, outs):
            env[v] = _substitute(x, sub[v]) if v in sub else x
    return [read(env, v) for v in core.outvars[:n_out]]


def _reads(traced: Any, n_out: int, floats: list[bool]) -> tuple[list, list]:
    """Per input and per policy-saved output of ``traced``: whether the
    backward pass reads it (dead-code elimination of its traced form)."""
    core, consts = _compat.jaxpr_parts(traced)
    n, m = len(core.invars), len(core.outvars) - n_out
    idx = [j for j, f in enumerate(floats) if f]
    saved_vars = core.outvars[n_out:]

    def backward(*xs):
        fn = functools.partial(
            _replayed, core, consts, saved_vars, xs[n : n + m], n_out
        )
        return partial_vjp(fn, xs[:n], idx, xs[n + m :])

    avals = [v.aval for v in [*core.invars, *saved_vars, *core.outvars[:n_out]]]
    back = _compat.trace_to_closed_jaxpr(backward, avals)
    used = _compat.used_inputs(_compat.jaxpr_parts(back)[0])
    return used[:n], used[n : n + m]


def _choose(x: Any, bits: int, fmt: Recipe) -> tuple[Any, str]:
    """``(how, rule)`` for a saved value ``x`` with ``bits``
    (``_values/_operands.py``): ``how`` is a :class:`Recipe` (stored by it:
    ``fmt``, or its :func:`product_form` for a value a product's input is
    recomputed from or an elementwise derivative reads) or ``"raw"``."""
    if not compressible_aval(x):
        return "raw", AS_IS
    if bits & EXACT:
        return "raw", EXACT_INPUT
    if bits & PRODUCT:
        return product_form(fmt), STORED_PRODUCT
    if bits & DERIVATIVE:
        return product_form(fmt), STORED_DERIVATIVE
    return fmt, STORED


def _name(eqn: Any) -> str:
    if eqn.primitive.name == "name":
        return f"name {eqn.params.get('name')!r}"
    return eqn.primitive.name


def store_checkpoint(
    eqn: Any, body: Any, invals: list, fmt: Recipe, scopes: tuple[str, ...]
) -> Any:
    """The checkpoint ``eqn`` (scope components ``scopes``) with its
    rewritten ``body`` on ``invals``, its saved values stored by the rule of
    the module docstring.

    Returns:
        The outputs, or None where it cannot be bound so (an output is not a
        float, the body closes over a traced value, no float input): the
        caller binds it as usual.
    """
    policy = eqn.params.get("policy")
    idx = [i for i, x in enumerate(invals) if isinstance(x, jax.Array)]
    # A value made from a held one (a transposed weight) is remade from it.
    weights = [weight_source_of(invals[i]) for i in idx]
    args = [invals[i] if w is None else w[0] for i, w in zip(idx, weights)]
    core, consts = _compat.jaxpr_parts(body)
    n_out = len(core.outvars)
    eqns: list = []

    def collect(*arrays):
        vals = list(invals)
        for i, a, w in zip(idx, arrays, weights):
            vals[i] = a if w is None else w[1](a)
        found: list = []
        with cast_cache(), _state.recomputing():
            outs = _collect(core, consts, vals, policy, found)
        eqns[:] = [e for e, _ in found]
        return [*outs, *(x for _, x in found)]

    traced = _compat.trace_to_closed_jaxpr(collect, [jax.typeof(a) for a in args])
    tcore, tconsts = _compat.jaxpr_parts(traced)
    floats = [is_float(a.dtype) for a in args]
    outs_float = all(is_float(v.aval.dtype) for v in tcore.outvars[:n_out])
    if not n_out or not outs_float or any(map(_compat.is_tracer, tconsts)):
        return None
    if not any(floats):
        return None
    reads_in, reads_saved = _reads(traced, n_out, floats)
    operands = product_operands(tcore)
    where, names = _described(eqn, scopes)
    in_plan = []
    for j, a in enumerate(args):
        how = "raw" if is_held(a) else "none"
        if reads_in[j] and not is_held(a):
            how, rule = _choose(a, operands.inputs[j], fmt)
            _log(where, f"input {names(idx[j])}", a, how, rule)
        in_plan.append(how)
    plan = []
    for k, v in enumerate(tcore.outvars[n_out:]):
        how = "none"
        if reads_saved[k]:
            src = (where[0], _compat.source_line(eqns[k]))
            how = _plan_saved(tcore, v, operands, fmt, src, _name(eqns[k]))
        plan.append(how)
    coded = [j for j, how in enumerate(in_plan) if isinstance(how, Recipe)]
    codes = [c for j in coded for c in encoded(args[j], in_plan[j])]
    return _bound(traced, n_out, args, codes, in_plan, plan)


@dataclasses.dataclass(frozen=True)
class Split:
    """A saved value stored in pieces along ``axis`` (``sizes``), each as
    ``hows`` says (a :class:`Recipe`, ``"raw"``)."""

    axis: int
    sizes: tuple[int, ...]
    hows: tuple


@functools.partial(
    jax.tree_util.register_dataclass, data_fields=["parts"], meta_fields=["axis"]
)
@dataclasses.dataclass(frozen=True)
class Pieces:
    """The saved pieces of one value (:class:`Split`), joined when read."""

    parts: tuple
    axis: int

    def value(self) -> Any:
        return jax.lax.concatenate([p.value() for p in self.parts], self.axis)


def _split_bits(core: Any, v: Any, operands: Any) -> tuple | None:
    """``(axis, sizes, bits per piece)`` where every equation of ``core``
    that reads ``v`` is a ``split`` along one axis into the same sizes (a
    fused QKV projection's output), else None."""
    key, bits = None, None
    for eqn in core.eqns:
        if not any(x is v for x in eqn.invars):
            continue
        if eqn.primitive.name != "split":
            return None
        here = (int(eqn.params["axis"]), tuple(int(n) for n in eqn.params["sizes"]))
        if key not in (None, here):
            return None
        key = here
        outs = [operands.bits.get(o, 0) for o in eqn.outvars]
        bits = outs if bits is None else [a | b for a, b in zip(bits, outs)]
    return None if key is None else (*key, bits)


def _plan_saved(core, v, operands, fmt, where, name) -> Any:
    """How a policy-saved value ``v`` of ``core`` is stored (:func:`_choose`),
    in :class:`Split` pieces where only some of the splits that read it reach
    an exponential (a fused projection's q and k, not its v); logged."""
    how, rule = _choose(v.aval, operands.bits.get(v, 0), fmt)
    split = _split_bits(core, v, operands) if rule == EXACT_INPUT else None
    if split is None or all(b & EXACT for b in split[2]):
        _log(where, name, v.aval, how, rule)
        return how
    axis, sizes, bits = split
    hows, start = [], 0
    for size, b in zip(sizes, bits):
        shape = list(v.aval.shape)
        shape[axis] = size
        piece = jax.ShapeDtypeStruct(tuple(shape), v.aval.dtype)
        how, rule = _choose(piece, b, fmt)
        _log(where, f"{name} [{start}:{start + size}] of axis {axis}", piece, how, rule)
        hows.append(how)
        start += size
    return Split(axis, sizes, tuple(hows))


def _described(eqn: Any, scopes: tuple) -> tuple[tuple, Callable[[int], str]]:
    """``((scopes, source), name of input i)`` of a checkpoint equation: its
    call's source line or the function it checkpoints, its argument names."""
    info = getattr(_compat.jaxpr_parts(eqn.params["jaxpr"])[0], "debug_info", None)
    names = tuple(getattr(info, "arg_names", None) or ())
    source = _compat.source_line(eqn) or str(getattr(info, "func_src_info", ""))

    def name(i: int) -> str:
        return names[i] if i < len(names) and names[i] else str(i)

    return (scopes, source), name


def _log(where, value, x, how, rule) -> None:
    dtype = how.dtype if isinstance(how, Recipe) else x.dtype
    _note(SavedChoice(where[0], value, tuple(x.shape), str(dtype), rule, where[1]))


def _bound(traced, n_out, args, codes, in_plan, plan) -> list:
    """Bind ``traced`` (outputs, then the policy-saved values) on ``args`` as
    a ``custom_vjp`` saving each input as ``in_plan`` says (a
    :class:`Recipe`: from ``codes``, in order; ``"raw"``, ``"none"``) and
    each policy-saved value as ``plan`` says."""
    core, consts = _compat.jaxpr_parts(traced)
    n = len(args)
    fn = jex_core.jaxpr_as_fun(traced)
    coded = [j for j, how in enumerate(in_plan) if isinstance(how, Recipe)]
    slot = {j: n + 2 * k for k, j in enumerate(coded)}
    saved_vars = core.outvars[n_out:]

    @jax.custom_vjp
    def stored(*xs):
        return fn(*xs[:n])[:n_out]

    def fwd(*vals):
        every = fn(*vals[:n])
        ins = [
            _saved_value(x, how, vals[slot[j] : slot[j] + 2] if j in slot else ())
            for j, (x, how) in enumerate(zip(vals[:n], in_plan))
        ]
        inner = [_saved_value(x, how) for x, how in zip(every[n_out:], plan)]
        return every[:n_out], (tuple(ins), tuple(inner))

    def bwd(res, cts):
        # The barrier keeps XLA from reusing the forward pass's values for
        # the recomputation (what jax.checkpoint's prevent_cse does).
        vals, inner = jax.lax.optimization_barrier(
            ([s.value() for s in res[0]], [s.value() for s in res[1]])
        )
        idx = [j for j, s in enumerate(res[0]) if s.perturbed]
        replay = functools.partial(_replayed, core, consts, saved_vars, inner, n_out)
        grads = dict(zip(idx, partial_vjp(replay, vals, idx, cts)))
        return (*(grads.get(j) for j in range(n)), *([None] * len(codes)))

    stored.defvjp(fwd, bwd)
    return stored(*args, *codes)


def _saved_value(x: Any, how: Any, code: Any = ()) -> Saved | Pieces:
    """What the backward pass keeps of ``x``: a :class:`Recipe` (``code`` if
    given, else encoded here), a :class:`Split`, ``"raw"`` or ``"none"``."""
    meta = (x.shape, x.dtype, is_float(x.dtype))
    if isinstance(how, Split):
        parts = jax.lax.split(x, how.sizes, how.axis)
        return Pieces(tuple(map(_saved_value, parts, how.hows)), how.axis)
    if isinstance(how, Recipe):
        if not code:
            with jax.named_scope(RESIDUAL_SCOPE):
                code = encode(jax.lax.stop_gradient(x), how)
        return Saved("code", tuple(code), *meta, how)
    if how == "raw":
        return Saved("raw", (x,), *meta, None)
    return Saved("none", (), *meta, None)
