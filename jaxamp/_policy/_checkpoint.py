"""Compressed residuals at a user's ``jax.checkpoint``: the rule per saved value.

A checkpoint saves its inputs and, under a policy
(``save_only_these_names``, ``dots_saveable``, ...), the values inside its
body the policy names; the backward pass recomputes the rest from them. With
a residual format in force, :func:`store_checkpoint` binds the (rewritten)
body as a ``jax.custom_vjp`` that saves each such value as the same value
would be saved without the checkpoint (``_compressed.py``): int8 stores every
one; FP8 (``Format.stores_products`` False) leaves in the compute dtype the
values that, in the recomputed block, reach a product's operand through
elementwise chains, normalisations or data movement
(``_values/_operands.py``: a weight gradient ``x^T g`` inherits a stored
``x``'s error undamped), and stores the others. Held values (the step's
arguments) are saved as they are, and what the backward pass does not read is
not saved at all (dead-code elimination of its traced form).

The backward pass decodes the saved values, evaluates the body with each
policy-saved value substituted for its recomputation (the cotangent still
flows through the equation that made it) and differentiates that: JAX's
recomputation, from the stored copies. A policy that offloads values to host
memory (``offload_dot_with_no_batch_dims``) is left to JAX: its copies leave
the device, and compressing them would need the transfers made here.

Each decision is logged for :func:`jaxamp.memory_report` (:func:`recording`).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core

from .. import _compat
from .._base import _state
from .._base._cast import cast_cache
from .._base._dtypes import is_float
from .._base._jaxpr import bind_eqn, read
from .._base._structure import describe
from .._values._operands import EXACT, PRODUCT, product_operands
from ._compressed import (
    STASH_SCOPE,
    Saved,
    encoded,
    is_held,
    partial_vjp,
    weight_source_of,
)
from ._stash import Format, compressible_aval, encode

# The rule that decided a saved value's stored form (memory_report shows it).
KEPT = "reaches a product: compute dtype (FP8)"
STORED_PRODUCT = "reaches a product: int8"
STORED = "reaches no product: stored"
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
        rule: :data:`KEPT`, :data:`STORED_PRODUCT`, :data:`STORED`,
            :data:`EXACT_INPUT` or :data:`AS_IS`.
        source: the user's source line of the value (the checkpoint's call
            for an input).
    """

    scopes: tuple
    value: str
    shape: tuple
    dtype: str
    rule: str
    source: str


_LOG: contextvars.ContextVar[list | None] = contextvars.ContextVar(
    "jaxamp_checkpoint_log", default=None
)


@contextlib.contextmanager
def recording() -> Iterator[list]:
    """Within the block, each checkpoint's choices are appended to the
    yielded list as :class:`SavedChoice` s (once each)."""
    log: list = []
    token = _LOG.set(log)
    try:
        yield log
    finally:
        _LOG.reset(token)


def _note(choice: SavedChoice) -> None:
    log = _LOG.get()
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


def _choose(x: Any, bits: int, fmt: Format, compute: Any) -> tuple[str, str]:
    """``(how, rule)`` for a saved value ``x`` with ``bits``
    (``_values/_operands.py``): ``how`` is ``"code"`` (in ``fmt``),
    ``"cast"`` (a copy in the ``compute`` dtype) or ``"raw"``."""
    if not compressible_aval(x):
        return "raw", AS_IS
    if bits & EXACT:
        return "raw", EXACT_INPUT
    if not bits & PRODUCT:
        return "code", STORED
    if fmt.stores_products:
        return "code", STORED_PRODUCT
    # A float32 value (a residual stream outside a scan) is saved as the
    # product reads it, in bfloat16; float16 (its range) keeps it as it is.
    wider = np.dtype(x.dtype).itemsize > np.dtype(compute).itemsize
    return ("cast" if wider and compute == jnp.bfloat16 else "raw"), KEPT


def _name(eqn: Any) -> str:
    if eqn.primitive.name == "name":
        return f"name {eqn.params.get('name')!r}"
    return eqn.primitive.name


def store_checkpoint(
    eqn: Any, body: Any, invals: list, fmt: Format, compute: Any
) -> Any:
    """The checkpoint ``eqn`` with its rewritten ``body`` on ``invals``, its
    saved values stored by the rule of the module docstring; ``compute``:
    amp's compute dtype.

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
    where, names = _described(eqn)
    in_plan = []
    for j, a in enumerate(args):
        how = "raw" if is_held(a) else "none"
        if reads_in[j] and not is_held(a):
            how, rule = _choose(a, operands.inputs[j], fmt, compute)
            _log(where, f"input {names(idx[j])}", a, how, fmt, compute, rule)
        in_plan.append(how)
    plan = []
    for k, v in enumerate(tcore.outvars[n_out:]):
        how = "none"
        if reads_saved[k]:
            how, rule = _choose(v.aval, operands.bits.get(v, 0), fmt, compute)
            src = (where[0], _compat.source_line(eqns[k]))
            _log(src, _name(eqns[k]), v.aval, how, fmt, compute, rule)
        plan.append(how)
    coded = [j for j, how in enumerate(in_plan) if how == "code"]
    codes = [c for j in coded for c in encoded(args[j], fmt)]
    return _bound(traced, n_out, args, codes, in_plan, plan, (fmt, compute))


def _described(eqn: Any) -> tuple[tuple, Callable[[int], str]]:
    """``((scopes, source), name of input i)`` of a checkpoint equation: its
    call's source line or the function it checkpoints, its argument names."""
    info = getattr(_compat.jaxpr_parts(eqn.params["jaxpr"])[0], "debug_info", None)
    names = tuple(getattr(info, "arg_names", None) or ())
    source = _compat.source_line(eqn) or str(getattr(info, "func_src_info", ""))

    def name(i: int) -> str:
        return names[i] if i < len(names) and names[i] else str(i)

    return (_state.current().scopes, source), name


def _log(where, value, x, how, fmt, compute, rule) -> None:
    dtype = {"code": fmt.dtype, "cast": compute}.get(how, x.dtype)
    _note(SavedChoice(where[0], value, tuple(x.shape), str(dtype), rule, where[1]))


def _bound(traced, n_out, args, codes, in_plan, plan, forms) -> list:
    """Bind ``traced`` (outputs, then the policy-saved values) on ``args`` as
    a ``custom_vjp`` saving each input as ``in_plan`` says (``"code"``: from
    ``codes``, in order; ``"cast"``, ``"raw"``, ``"none"``) and each
    policy-saved value as ``plan`` says; ``forms``: ``(format, compute
    dtype)``."""
    core, consts = _compat.jaxpr_parts(traced)
    n = len(args)
    fn = jex_core.jaxpr_as_fun(traced)
    coded = [j for j, how in enumerate(in_plan) if how == "code"]
    slot = {j: n + 2 * k for k, j in enumerate(coded)}
    saved_vars = core.outvars[n_out:]

    @jax.custom_vjp
    def stored(*xs):
        return fn(*xs[:n])[:n_out]

    def fwd(*vals):
        every = fn(*vals[:n])
        ins = [
            _saved_value(
                x, how, forms, vals[slot[j] : slot[j] + 2] if j in slot else ()
            )
            for j, (x, how) in enumerate(zip(vals[:n], in_plan))
        ]
        inner = [_saved_value(x, how, forms) for x, how in zip(every[n_out:], plan)]
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


def _saved_value(x: Any, how: str, forms: tuple, code: Any = ()) -> Saved:
    """What the backward pass keeps of ``x``: ``"code"`` (``code`` if given,
    else encoded here), ``"cast"`` (a copy in the compute dtype), ``"raw"``
    or ``"none"``."""
    fmt, compute = forms
    meta = (x.shape, x.dtype, is_float(x.dtype))
    if how == "code":
        if not code:
            with jax.named_scope(STASH_SCOPE):
                code = encode(jax.lax.stop_gradient(x), fmt)
        return Saved("code", tuple(code), *meta, fmt)
    if how == "cast":
        return Saved("cast", (x.astype(compute),), *meta, None)
    if how == "raw":
        return Saved("raw", (x,), *meta, None)
    return Saved("none", (), *meta, None)
