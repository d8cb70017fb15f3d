"""Matching the hand-written attention form in a jaxpr.

The form Flax, Equinox and user code produce: q·k ``dot_general`` -> optional
scale by a scalar -> optional bias ``add`` / boolean-mask ``select_n`` (also
inside ``jnp.where``'s jit) -> softmax over the key axis (``jax.nn.softmax``'s
``custom_jvp_call`` or its inline form) -> p·v ``dot_general``, where the
intermediates have no other users. Only exact matches are replaced, as PyTorch
Inductor's ``fuse_attention`` patterns replace matmul-softmax-matmul with
``scaled_dot_product_attention``. An intercepted ``jax.nn`` call
(``_intercept.py``) is a one-equation group.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from typing import Any

import jax
import numpy as np

from ... import _compat
from ..._base._dtypes import is_float
from ..._base._structure import plain_call
from ._intercept import Spec, marked_spec
from ._kernels import run_hand, run_marked
from ._rule import mode as policy_mode

# A select_n fill at or below this (or -inf) makes the select a mask: exp of it
# minus any realistic logit is 0 in float32 (bfloat16/float16 code often uses
# -1e4 or finfo.min; -1e9 and -inf are common too).
_MASK_FILL_MAX = -1e4


@dataclasses.dataclass(eq=False)
class _Group:
    """One matched attention: its equations and how to compute its output."""

    eqns: tuple[int, ...]  # indices in the jaxpr, sorted
    run: Any  # run(read, rule context, mode, where) -> output value, or None
    marked: Spec | None = None
    scopes: tuple = ((),)  # the distinct named_scope stacks of its equations

    def mode(self, ctx: Any) -> str | None:
        """The policy's decision, if all equations get the same one (an
        ``amp_stop`` around part of the group leaves it alone)."""
        modes = {policy_mode(ctx, ctx.scopes + s) for s in self.scopes}
        return modes.pop() if len(modes) == 1 else None

    @property
    def first(self) -> int:
        return self.eqns[0]

    @property
    def last(self) -> int:
        return self.eqns[-1]


_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def plan(jaxpr: Any) -> dict[int, _Group]:
    """Equation index -> matched group, for every index of every group."""
    try:
        return _PLANS[jaxpr]
    except KeyError:
        pass
    except TypeError:  # not weak-referenceable
        return _match(jaxpr)
    plan = _PLANS[jaxpr] = _match(jaxpr)
    return plan


def _match(jaxpr: Any) -> dict[int, _Group]:
    eqns = list(jaxpr.eqns)
    producer: dict[Any, int] = {}
    users: dict[Any, list[int]] = {}
    for i, e in enumerate(eqns):
        for v in e.invars:
            if not isinstance(v, _compat.Literal):
                users.setdefault(v, []).append(i)
        for v in e.outvars:
            producer[v] = i
    for v in jaxpr.outvars:
        if not isinstance(v, _compat.Literal):
            users.setdefault(v, []).append(-1)  # an output: never internal
    g = _Graph(eqns, producer, users)
    plan: dict[int, _Group] = {}
    for i, e in enumerate(eqns):
        spec = marked_spec(e)
        if spec is not None:
            run = functools.partial(run_marked, e, spec)
            plan[i] = _Group((i,), run, spec, (_compat.scope_names(e),))
        elif e.primitive.name == "dot_general":
            group = _match_from(g, i)
            if group is not None and not any(j in plan for j in group.eqns):
                for j in group.eqns:
                    plan[j] = group
    return plan


class _Graph:
    def __init__(self, eqns, producer, users):
        self.eqns, self.producer, self.users = eqns, producer, users

    def single_user(self, v: Any) -> int | None:
        u = self.users.get(v, [])
        return u[0] if len(u) == 1 and u[0] >= 0 else None

    def eqn(self, i: int) -> Any:
        return self.eqns[i]


def _shape(v: Any) -> tuple:
    return tuple(v.aval.shape)


def _is_float_var(v: Any) -> bool:
    return is_float(v.aval.dtype)


@dataclasses.dataclass
class _Pieces:
    q: Any = None
    k: Any = None
    v: Any = None
    qdims: Any = None  # (batch dims, contracting dims) of q
    kdims: Any = None
    pv_dims: Any = None
    p_is_lhs: bool = True
    scale: Any = None  # (var or literal, "mul" | "div")
    bias: Any = None  # (var, chain of broadcast_in_dim params)
    mask: Any = None  # (var, chain, inverted)
    out_shape: tuple = ()
    perm: tuple | None = None  # transpose of the logits after the q·k product


def _match_from(g: _Graph, i0: int) -> _Group | None:
    """Match the hand-written form starting at the q·k ``dot_general`` ``i0``."""
    start = _qk(g, i0)
    if start is None:
        return None
    pieces, members, x, rank = start
    x = _through_softmax(g, x, rank - 1, pieces, members)
    if x is None:
        return None
    # softmax output -> optional converts -> p·v dot_general
    while True:
        j = g.single_user(x)
        if j is None:
            return None
        e = g.eqn(j)
        if e.primitive.name == "convert_element_type" and _is_float_var(e.outvars[0]):
            members.append(j)
            x = e.outvars[0]
            continue
        break
    nb = len(pieces.qdims[0])
    if e.primitive.name != "dot_general" or not _pv_ok(e, x, rank, nb, pieces):
        return None
    members.append(j)
    pieces.out_shape = _shape(e.outvars[0])
    idx = tuple(sorted(members))
    if len(set(idx)) != len(idx):
        return None
    scopes = tuple({_compat.scope_names(g.eqn(m)): None for m in idx})
    return _Group(idx, functools.partial(run_hand, pieces), scopes=scopes)


def _qk(g: _Graph, i0: int) -> tuple | None:
    """``(pieces, members, logits var, logits rank)`` of the q·k product
    ``i0`` (and an einsum's transpose after it), or None if it is not one."""
    qk = g.eqn(i0)
    (lc, rc), (lb, rb) = qk.params["dimension_numbers"]
    lhs, rhs = qk.invars
    if isinstance(lhs, _compat.Literal) or isinstance(rhs, _compat.Literal):
        return None
    if not (_is_float_var(lhs) and _is_float_var(rhs)) or len(lc) != 1:
        return None
    nb = len(lb)
    l_free = [d for d in range(len(_shape(lhs))) if d not in (*lb, *lc)]
    r_free = [d for d in range(len(_shape(rhs))) if d not in (*rb, *rc)]
    x = qk.outvars[0]
    rank = len(_shape(x))
    members = [i0]
    perm = tuple(range(rank))  # logits layout axis -> dot_general output axis
    j = g.single_user(x)
    if j is not None and g.eqn(j).primitive.name == "transpose":
        # einsum with an output order other than dot_general's
        perm = tuple(int(d) for d in g.eqn(j).params["permutation"])
        members.append(j)
        x = g.eqn(j).outvars[0]
    # The key is the operand whose one free axis the softmax runs over (last).
    if len(r_free) == 1 and perm[-1] == rank - 1:
        q, k, qd, kd = lhs, rhs, (lb, lc), (rb, rc)
        to_canon = list(range(rank))
    elif len(l_free) == 1 and perm[-1] == nb:  # key on the left: (b, S, t...)
        q, k, qd, kd = rhs, lhs, (rb, rc), (lb, lc)
        to_canon = [*range(nb), rank - 1, *range(nb, rank - 1)]
    else:
        return None
    pieces = _Pieces(q=q, k=k, qdims=qd, kdims=kd)
    pieces.perm = tuple(to_canon[d] for d in perm)  # layout axis -> canonical
    return pieces, members, x, rank


def _through_softmax(
    g: _Graph, x: Any, axis: int, pieces: _Pieces, members: list
) -> Any:
    """Follow the logits ``x`` through scale, bias / mask and the softmax over
    ``axis``, recording them in ``pieces`` and ``members``; the softmax output,
    or None where the chain is not the attention form."""
    scaled = False  # a scale is allowed only before a bias or mask
    while True:
        j = g.single_user(x)
        if j is None:
            # The inline softmax has two users of its input.
            soft = _inline_softmax(g, x, axis)
            if soft is None:
                return None
            members += soft[0]
            return soft[1]
        e = g.eqn(j)
        name = e.primitive.name
        if name == "convert_element_type" and _is_float_var(e.outvars[0]):
            pass
        elif name == "custom_jvp_call" and _is_softmax_call(e, x, axis):
            members.append(j)
            return e.outvars[0]
        elif not scaled and name in ("mul", "div") and pieces.scale is None:
            other = _other(e, x, allow_first=name == "mul")
            if other is None or _shape(other) != () or not _is_float_var(other):
                return None
            pieces.scale = (other, name, _const_scalar(g, other))
        elif not _bias_or_mask(g, e, x, pieces):
            return None
        scaled = scaled or name != "convert_element_type"
        members.append(j)
        x = e.outvars[0]


def _bias_or_mask(g: _Graph, e: Any, x: Any, pieces: _Pieces) -> bool:
    """Record ``e`` in ``pieces`` if it adds a bias to / masks the logits
    ``x`` (the first of each kind); False if it is neither."""
    name = e.primitive.name
    if name == "add" and pieces.bias is None:
        other = _other(e, x, allow_first=True)
        if (
            other is None
            or isinstance(other, _compat.Literal)
            or not _is_float_var(other)
            or not _broadcastable(_shape(other), _shape(x))
        ):
            return False
        pieces.bias = _peel_broadcasts(g, other)
        return True
    if name == "select_n" and pieces.mask is None:
        mask = _select_mask(g, e, x)
        if mask is None:
            return False
        pieces.mask = (*_peel_broadcasts(g, mask[0]), mask[1])
        return True
    if pieces.mask is None and plain_call(e) is not None:
        mask = _where_jit_mask(g, e, x)
        if mask is None:
            return False
        pieces.mask = mask
        return True
    return False


def _broadcastable(a: tuple, b: tuple) -> bool:
    """Same rank, each dim equal or 1 (lax's implicit size-1 broadcasting)."""
    return len(a) == len(b) and all(x in (y, 1) for x, y in zip(a, b))


def _other(e: Any, x: Any, allow_first: bool) -> Any:
    a, b = e.invars
    if a is x and b is not x:
        return b
    if allow_first and b is x and a is not x:
        return a
    return None


def _is_softmax_call(e: Any, x: Any, axis: int) -> bool:
    """``jax.nn.softmax`` as a custom_jvp_call (``jax_softmax_custom_jvp``):
    over ``axis`` only, no ``where``."""
    if not e.invars or e.invars[0] is not x or len(e.outvars) != 1:
        return False
    core, _ = _compat.jaxpr_parts(e.params["call_jaxpr"])
    info = getattr(core, "debug_info", None)
    if "_softmax" not in str(getattr(info, "func_src_info", "")):
        return False
    allowed = {
        "reduce_max",
        "convert_element_type",
        "max",
        "broadcast_in_dim",
        "stop_gradient",
        "sub",
        "exp",
        "reduce_sum",
        "div",
    }
    names = [q.primitive.name for q in core.eqns]
    if not set(names) <= allowed or names.count("exp") != 1:
        return False
    for q in core.eqns:
        if q.primitive.name in ("reduce_max", "reduce_sum"):
            if tuple(int(a) for a in q.params["axes"]) != (axis,):
                return False
    # Extra inputs are the -inf initial value.
    return all(_const_value(None, v) == -np.inf for v in e.invars[1:])


def _inline_softmax(g: _Graph, x: Any, axis: int):
    """The inline ``jax.nn.softmax`` (JAX 0.10 default): ``exp(x - stop_gradient(
    max(x))) / sum(...)`` over ``axis``. Returns (members, output var)."""
    us = g.users.get(x, [])
    if len(us) != 2 or -1 in us:
        return None
    by = {g.eqn(j).primitive.name: j for j in us}
    if set(by) != {"reduce_max", "sub"}:
        return None
    rm, sub = g.eqn(by["reduce_max"]), g.eqn(by["sub"])
    if tuple(int(a) for a in rm.params["axes"]) != (axis,) or sub.invars[0] is not x:
        return None
    members = [by["reduce_max"], by["sub"]]
    chain = _follow_chain(
        g, rm.outvars[0], {"max", "broadcast_in_dim", "stop_gradient"}, sub, members
    )
    if chain is None:
        return None
    j = g.single_user(sub.outvars[0])
    if j is None or g.eqn(j).primitive.name != "exp":
        return None
    members.append(j)
    ex = g.eqn(j).outvars[0]
    us = g.users.get(ex, [])
    if len(us) != 2 or -1 in us:
        return None
    by = {g.eqn(u).primitive.name: u for u in us}
    if set(by) != {"reduce_sum", "div"}:
        return None
    rs, div = g.eqn(by["reduce_sum"]), g.eqn(by["div"])
    if tuple(int(a) for a in rs.params["axes"]) != (axis,) or div.invars[0] is not ex:
        return None
    members += [by["reduce_sum"], by["div"]]
    if _follow_chain(g, rs.outvars[0], {"broadcast_in_dim"}, div, members) is None:
        return None
    return members, div.outvars[0]


def _follow_chain(g: _Graph, v: Any, allowed: set, target: Any, members: list):
    """Follow single users of ``v`` through ``allowed`` primitives until ``v``
    is the second operand of ``target``."""
    while True:
        j = g.single_user(v)
        if j is None:
            return None
        e = g.eqn(j)
        if e is target:
            return v if e.invars[1] is v else None
        if e.primitive.name not in allowed:
            return None
        if e.primitive.name == "max":
            other = _other(e, v, allow_first=True)
            if other is None or _const_value(None, other) != -np.inf:
                return None
        members.append(j)
        v = e.outvars[0]


def _const_value(g: _Graph | None, v: Any) -> Any:
    """The numpy value of a literal (also through converts/broadcasts of one)."""
    while True:
        if isinstance(v, _compat.Literal):
            return np.asarray(v.val).reshape(-1)[0] if np.size(v.val) == 1 else None
        if g is None or v not in g.producer:
            return None
        e = g.eqn(g.producer[v])
        if e.primitive.name not in ("broadcast_in_dim", "convert_element_type"):
            return None
        v = e.invars[0]


_CONST_OPS = ("sqrt", "rsqrt", "convert_element_type", "mul", "div", "integer_pow",
              "pow", "neg")  # fmt: skip


def _const_scalar(g: _Graph, v: Any, depth: int = 0) -> float | None:
    """A scalar computed from literals only (``jnp.sqrt(16.0)``), as a float."""
    if isinstance(v, _compat.Literal):
        return float(np.asarray(v.val))
    if depth > 8 or v not in g.producer:
        return None
    e = g.eqn(g.producer[v])
    if e.primitive.name not in _CONST_OPS or len(e.outvars) != 1:
        return None
    vals = [_const_scalar(g, x, depth + 1) for x in e.invars]
    if any(x is None for x in vals):
        return None
    args = [np.asarray(x, x_.aval.dtype) for x, x_ in zip(vals, e.invars)]
    with jax.ensure_compile_time_eval():
        out = _compat.bind(
            e.primitive, args, _compat.bind_params(e.primitive, e.params)
        )
    return float(np.asarray(out))


def _is_fill(value: Any) -> bool:
    return value is not None and float(value) <= _MASK_FILL_MAX


def _select_mask(g: _Graph, e: Any, x: Any):
    """``select_n(pred, fill, x)`` (or inverted): (pred var, inverted)."""
    if len(e.invars) != 3:
        return None
    pred, a, b = e.invars
    if isinstance(pred, _compat.Literal) or pred.aval.dtype != np.dtype(bool):
        return None
    if b is x and a is not x and _is_fill(_const_value(g, a)):
        return pred, False
    if a is x and b is not x and _is_fill(_const_value(g, b)):
        return pred, True
    return None


def _where_jit_mask(g: _Graph, e: Any, x: Any):
    """``jnp.where(mask, x, fill)``: a jit named ``_where`` whose body only
    broadcasts the mask and the fill and selects (no transposes of ``x``)."""
    if str(e.params.get("name")) != "_where" or len(e.outvars) != 1:
        return None
    core, consts = _compat.jaxpr_parts(plain_call(e))
    if consts or len(core.eqns) == 0:
        return None
    names = [q.primitive.name for q in core.eqns]
    if not set(names) <= {"broadcast_in_dim", "convert_element_type", "select_n"}:
        return None
    sel = core.eqns[-1]
    if names.count("select_n") != 1 or sel.primitive.name != "select_n":
        return None
    if core.outvars[0] is not sel.outvars[0] or len(sel.invars) != 3:
        return None
    outer = dict(zip(core.invars, e.invars))
    inner_x = [iv for iv, ov in outer.items() if ov is x]
    if len(inner_x) != 1:
        return None
    pred, a, b = sel.invars
    if b is inner_x[0]:
        fill, inverted = a, False
    elif a is inner_x[0]:
        fill, inverted = b, True
    else:
        return None
    prod = {ov: q for q in core.eqns for ov in q.outvars}
    fill_src = _trace_back(prod, fill)
    if fill_src is None:
        return None
    src = fill_src[0]
    if not isinstance(src, _compat.Literal):
        src = outer.get(src)
    if src is None or not _is_fill(_const_value(g, src)):
        return None
    pred_src = _trace_back(prod, pred)
    if pred_src is None or isinstance(pred_src[0], _compat.Literal):
        return None
    if pred_src[0] not in outer:
        return None
    src, chain = pred_src
    ov = outer[src]
    if isinstance(ov, _compat.Literal) or ov.aval.dtype != np.dtype(bool):
        return None
    return ov, chain, inverted


def _trace_back(prod: dict, v: Any):
    """(source var, broadcast chain outermost-last) through broadcast_in_dim and
    convert_element_type equations of one jaxpr."""
    chain = []
    while not isinstance(v, _compat.Literal) and v in prod:
        q = prod[v]
        if q.primitive.name == "broadcast_in_dim":
            chain.append((tuple(q.params["shape"]), q.params["broadcast_dimensions"]))
        elif q.primitive.name != "convert_element_type":
            return None
        v = q.invars[0]
    return v, tuple(reversed(chain))


def _peel_broadcasts(g: _Graph, v: Any):
    """(source var, chain): the value before ``broadcast_in_dim`` equations, so
    a broadcast mask or bias reaches the kernel unexpanded."""
    chain = []
    while not isinstance(v, _compat.Literal) and v in g.producer:
        e = g.eqn(g.producer[v])
        if e.primitive.name != "broadcast_in_dim" or len(e.invars) != 1:
            break
        if isinstance(e.invars[0], _compat.Literal):
            break
        chain.append((tuple(e.params["shape"]), e.params["broadcast_dimensions"]))
        v = e.invars[0]
    return v, tuple(reversed(chain))


def _pv_ok(e: Any, p: Any, rank: int, nb: int, pieces: _Pieces) -> bool:
    """``dot_general(p, v)`` contracting p's key axis against one axis of v,
    batching over exactly the logits' batch axes, with one free axis of v."""
    (c0, c1), (b0, b1) = e.params["dimension_numbers"]
    a, b = e.invars
    if a is p and b is not p:
        pc, vc, pb, vb, v, p_is_lhs = c0, c1, b0, b1, b, True
    elif b is p and a is not p:
        pc, vc, pb, vb, v, p_is_lhs = c1, c0, b1, b0, a, False
    else:
        return False
    if isinstance(v, _compat.Literal) or not _is_float_var(v):
        return False
    perm = pieces.perm
    if tuple(perm[d] for d in pc) != (rank - 1,) or len(vc) != 1:
        return False
    if sorted(perm[d] for d in pb) != list(range(nb)):
        return False
    v_free = [d for d in range(len(_shape(v))) if d not in (*vb, *vc)]
    if len(v_free) != 1:
        return False
    pieces.v, pieces.pv_dims, pieces.p_is_lhs = (
        v,
        e.params["dimension_numbers"],
        p_is_lhs,
    )
    return True
