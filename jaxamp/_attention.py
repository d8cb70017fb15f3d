"""Fused attention under amp: re-dispatch attention for the dtypes amp chose.

amp traces the user's function in float32, so ``jax.nn.dot_product_attention``
picks its XLA path (``implementation=None``) or refuses to trace
(``implementation="cudnn"``: cuDNN takes only 16-bit inputs). PyTorch's autocast
gets flash attention because ``scaled_dot_product_attention`` dispatches on the
dtypes it receives at run time; this module does the same for jaxamp:

* **Interception** (:func:`intercept`, active while ``amp`` traces the user's
  function): a ``jax.nn.dot_product_attention`` call on float32 (or wider)
  q/k/v is emitted as one ``jit`` equation named ``jaxamp_attention__<n>`` whose
  body is JAX's own XLA path; ``<n>`` indexes the call's static parameters
  (:class:`_Spec`). Left in place (``amp_stop`` regions, a jit cache reused
  outside amp) it computes exactly what the XLA path computes.
* **Pattern matching** (:func:`_plan`): the hand-written form that Flax,
  Equinox and user code produce (q·k ``dot_general`` -> optional scale by a
  scalar -> optional bias ``add`` / boolean-mask ``select_n`` (also inside
  ``jnp.where``'s jit) -> softmax over the key axis (``jax.nn.softmax``'s
  ``custom_jvp_call`` or its inline form) -> p·v ``dot_general``), where the
  intermediates have no other users and share one ``named_scope`` stack. Only
  exact matches are replaced, as PyTorch Inductor's ``fuse_attention`` patterns
  replace matmul-softmax-matmul with ``scaled_dot_product_attention``.
* **Dispatch** (:func:`dispatch`): q/k/v cast to the compute dtype; cuDNN
  (``jax.nn.dot_product_attention(implementation="cudnn")``) when they are
  bfloat16/float16, the default backend is an NVIDIA GPU and JAX accepts the
  call; otherwise JAX's XLA path, which computes the logits and softmax in
  float32 and the p·v product in the compute dtype.

The policy key ``"attention"`` (:func:`attention_rule`) turns this off or
forces an implementation; ``amp_stop`` regions are left alone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import warnings
import weakref
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import _compat, _reductions
from ._dtypes import is_float
from ._rules import cast, follow_compute_precision

ATTENTION_KEY = "attention"
IMPLEMENTATIONS = ("auto", "xla", "cudnn", "off")
_MARK = "jaxamp_attention__"
# The named_scope of the equations amp binds for an attention it re-dispatched.
FUSED_SCOPE = "jaxamp_fused_attention"
# A select_n fill at or below this (or -inf) makes the select a mask: exp of it
# minus any realistic logit is 0 in float32 (bfloat16/float16 code often uses
# -1e4 or finfo.min; -1e9 and -inf are common too).
_MASK_FILL_MAX = -1e4
_FUSED_DTYPES = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))


# --------------------------------------------------------------------------------
# The policy value


class AttentionRule:
    """Value of the ``"attention"`` policy key (see :func:`attention_rule`).

    Called as an ordinary rule (e.g. if also put under a primitive key) it acts
    as :func:`jaxamp.follow_compute_precision`.
    """

    __slots__ = ("implementation",)

    def __init__(self, implementation: str):
        self.implementation = implementation

    def __call__(self, compute_dtype, original_dtypes, *invars, **params):
        return follow_compute_precision(
            compute_dtype, original_dtypes, *invars, **params
        )

    def __repr__(self) -> str:
        return f"attention_rule({self.implementation!r})"

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, AttentionRule)
            and other.implementation == self.implementation
        )

    def __hash__(self) -> int:
        return hash((AttentionRule, self.implementation))


def attention_rule(implementation: str = "auto") -> AttentionRule:
    """The policy value for the key ``"attention"``: how amp runs attention.

    Without the key amp behaves as ``attention_rule("auto")``. Put it under
    ``amp_policy={**jaxamp.default_amp_policy, "attention": ...}``, or inside a
    nested scope policy (``{"encoder": {"attention": ...}}``).

    Args:
        implementation: ``"auto"``: cuDNN flash attention when the cast q/k/v
            are bfloat16/float16, the default backend is an NVIDIA GPU and JAX
            supports the call (head dim, bias, masks, sequence lengths, GQA,
            sliding window), else JAX's XLA path with float32 logits and
            softmax. ``"xla"``: always the XLA path with float32 logits.
            ``"cudnn"``: always cuDNN; JAX's own error if it cannot run the
            call (also on CPU). ``"off"``: no re-dispatch; the recognised
            equations run under the ordinary rules (a
            ``jax.nn.dot_product_attention`` call as its XLA path, also when it
            asked for ``"cudnn"``).

    Returns:
        An :class:`AttentionRule` (a callable, so policies validate it).

    Raises:
        ValueError: for another ``implementation``.

    Example:
        >>> import jaxamp
        >>> policy = {**jaxamp.default_amp_policy,
        ...           "attention": jaxamp.attention_rule("xla")}
    """
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"attention_rule(implementation={implementation!r}): expected one of "
            f"{IMPLEMENTATIONS}."
        )
    return AttentionRule(implementation)


class _Key:
    """Stands in for a primitive in ``AmpPolicy.lookup`` (looked up by name)."""

    name = ATTENTION_KEY


_KEY = _Key()


def _mode(ctx: Any, scopes: tuple[str, ...]) -> str | None:
    """The implementation the policy asks for here, or None: leave alone
    (``amp_stop``, or a scope rule that is not an attention rule)."""
    policy = ctx.policy
    rule = policy.lookup(_KEY, scopes)
    if isinstance(rule, AttentionRule):
        return rule.implementation
    if rule is policy.default_rule:
        return "auto"
    return None


# --------------------------------------------------------------------------------
# Interception of jax.nn.dot_product_attention while amp traces


@dataclasses.dataclass(frozen=True)
class _Spec:
    """Static parameters of one intercepted ``dot_product_attention`` call."""

    requested: str | None  # "cudnn" or None (None and "xla" both reach the XLA path)
    is_causal: bool
    scale: float
    local_window_size: tuple[int, int] | None
    has_bias: bool
    has_mask: bool
    has_q_seqlen: bool
    has_kv_seqlen: bool
    where: str = "dot_product_attention"  # the user's call site, for messages


_SPECS: list[_Spec] = []
_SPEC_INDEX: dict[_Spec, int] = {}
# Thread-local, and part of JAX's trace/jit cache keys (see _compat).
_INTERCEPTING = _compat.ATTENTION_INTERCEPT
_ORIGINALS: dict[str, Any] = {}


@contextlib.contextmanager
def intercept():
    """While active (in this thread/context), ``jax.nn.dot_product_attention``
    on float32 q/k/v is emitted as one recognisable equation (module doc)."""
    _install()
    with _INTERCEPTING(True):
        yield


@contextlib.contextmanager
def _not_intercepting():
    with _INTERCEPTING(False):
        yield


def _install() -> None:
    """Wrap the two functions JAX's ``dot_product_attention`` dispatches to.

    Installed once; the wrappers call the originals unless :func:`intercept` is
    active in the calling context, so other threads and code outside amp see
    JAX unchanged.
    """
    if _ORIGINALS:
        return
    mod = _compat.nn_functions_module()
    _ORIGINALS["xla"] = xla = mod._dot_product_attention_xla
    _ORIGINALS["cudnn"] = cudnn = mod.cudnn_dot_product_attention

    @functools.wraps(xla)
    def xla_wrapper(
        query,
        key,
        value,
        bias,
        mask,
        is_causal,
        scale,
        q_seqlen,
        kv_seqlen,
        local_window_size,
        return_residual=False,
    ):
        if not _INTERCEPTING.value or return_residual or not _wide(query, key, value):
            return xla(
                query,
                key,
                value,
                bias,
                mask,
                is_causal,
                scale,
                q_seqlen,
                kv_seqlen,
                local_window_size,
                return_residual,
            )
        spec = _Spec(
            None,
            bool(is_causal),
            float(scale),
            _window(local_window_size),
            bias is not None,
            mask is not None,
            q_seqlen is not None,
            kv_seqlen is not None,
            _call_site(),
        )
        return _emit(spec, query, key, value, bias, mask, q_seqlen, kv_seqlen)

    @functools.wraps(cudnn)
    def cudnn_wrapper(
        query,
        key,
        value,
        bias=None,
        mask=None,
        q_seqlen=None,
        kv_seqlen=None,
        *args,
        **kwargs,
    ):
        plain = not args and set(kwargs) <= {
            "scale",
            "mask_type",
            "sliding_window_length",
            "return_residual",
        }
        if (
            not _INTERCEPTING.value
            or not plain
            or kwargs.get("return_residual", False)
            or not _wide(query, key, value)
        ):
            return cudnn(
                query, key, value, bias, mask, q_seqlen, kv_seqlen, *args, **kwargs
            )
        causal = _compat.cudnn_mask_is_causal(kwargs.get("mask_type"))
        sw = kwargs.get("sliding_window_length")
        spec = _Spec(
            "cudnn",
            causal,
            float(kwargs.get("scale", 1.0)),
            None if sw is None else (int(sw) - 1, 0),
            bias is not None,
            mask is not None,
            q_seqlen is not None,
            kv_seqlen is not None,
            _call_site(),
        )
        return _emit(spec, query, key, value, bias, mask, q_seqlen, kv_seqlen)

    mod._dot_product_attention_xla = xla_wrapper
    mod.cudnn_dot_product_attention = cudnn_wrapper


def _call_site() -> str:
    """``dot_product_attention at file:line`` of the first frame outside JAX and
    jaxamp (the model's call)."""
    import os
    import traceback

    skip = (os.path.dirname(jax.__file__), os.path.dirname(__file__))
    for frame in reversed(traceback.extract_stack()):
        if not frame.filename.startswith(skip):
            return f"dot_product_attention at {frame.filename}:{frame.lineno}"
    return "dot_product_attention"


def _window(w: Any) -> tuple[int, int] | None:
    return None if w is None else (int(w[0]), int(w[1]))


def _wide(*xs: Any) -> bool:
    """q/k/v are floats wider than 16 bits: amp may narrow them."""
    return all(is_float(x.dtype) and x.dtype.itemsize > 2 for x in xs)


def _spec_index(spec: _Spec) -> int:
    idx = _SPEC_INDEX.get(spec)
    if idx is None:
        idx = _SPEC_INDEX[spec] = len(_SPECS)
        _SPECS.append(spec)
    return idx


@functools.cache
def _marked_fn(idx: int):
    """A jitted XLA-path attention named ``jaxamp_attention__<idx>``."""
    spec = _SPECS[idx]

    def body(*arrays):
        q, k, v, bias, mask, qs, kvs = _unpack(spec, arrays)
        return _ORIGINALS["xla"](
            q,
            k,
            v,
            bias,
            mask,
            spec.is_causal,
            spec.scale,
            qs,
            kvs,
            spec.local_window_size,
        )

    body.__name__ = body.__qualname__ = f"{_MARK}{idx}"
    return jax.jit(body)


def _emit(spec: _Spec, q, k, v, bias, mask, q_seqlen, kv_seqlen):
    arrays = [a for a in (q, k, v, bias, mask, q_seqlen, kv_seqlen) if a is not None]
    return _marked_fn(_spec_index(spec))(*arrays)


def _unpack(spec: _Spec, arrays) -> tuple:
    it = iter(arrays)
    q, k, v = next(it), next(it), next(it)
    flags = (spec.has_bias, spec.has_mask, spec.has_q_seqlen, spec.has_kv_seqlen)
    rest = [next(it) if f else None for f in flags]
    return (q, k, v, *rest)


def _marked_spec(eqn: Any) -> _Spec | None:
    if eqn.primitive.name not in ("jit", "pjit"):
        return None
    name = str(eqn.params.get("name", ""))
    if not name.startswith(_MARK):
        return None
    try:
        spec = _SPECS[int(name[len(_MARK) :])]
    except (ValueError, IndexError):
        return None
    # A marked jit that a transformation re-wrote keeps the name but not the
    # signature (partial evaluation, DCE, e.g. amp around value_and_grad): such
    # an equation is an ordinary jit, walked by the ordinary rules.
    flags = (spec.has_bias, spec.has_mask, spec.has_q_seqlen, spec.has_kv_seqlen)
    if len(eqn.invars) != 3 + sum(flags) or len(eqn.outvars) != 1:
        return None
    return spec


# --------------------------------------------------------------------------------
# Dispatch


def dispatch(
    q: Any,
    k: Any,
    v: Any,
    bias: Any = None,
    mask: Any = None,
    q_seqlen: Any = None,
    kv_seqlen: Any = None,
    *,
    compute_dtype: Any,
    mode: str = "auto",
    scale: float | None = None,
    is_causal: bool = False,
    local_window_size: tuple[int, int] | None = None,
    requested: str | None = None,
    where: str = "dot_product_attention",
) -> Any:
    """Attention on q/k/v cast to ``compute_dtype``, by the best kernel.

    Args:
        q: query, float array of shape ``(B, T, N, H)``.
        k: key, float array of shape ``(B, S, K, H)``, ``N % K == 0`` (GQA).
        v: value, float array of shape ``(B, S, K, Hv)``.
        bias: optional float array broadcastable to ``(B, N, T, S)`` (4-D).
        mask: optional bool array broadcastable to ``(B, N, T, S)``; True
            attends.
        q_seqlen: optional int32 ``(B,)`` query lengths.
        kv_seqlen: optional int32 ``(B,)`` key/value lengths.
        compute_dtype: amp's compute dtype; float inputs wider than it are cast.
        mode: ``"auto"``, ``"xla"`` or ``"cudnn"`` (see :func:`attention_rule`).
        scale: logit scale, ``1/sqrt(H)`` if None.
        is_causal: causal masking.
        local_window_size: ``(left, right)`` window, as in JAX.
        requested: the implementation the model asked for (``"cudnn"`` or
            None); an explicit ``"cudnn"`` that cannot run on a GPU raises
            JAX's error, on a backend without cuDNN it falls back with a
            warning.
        where: a name for the call in warnings.

    Returns:
        Array of shape ``(B, T, N, Hv)`` in the (cast) dtype of ``v``.

    Raises:
        NotImplementedError, ValueError, RuntimeError: JAX's own errors when
            cuDNN is forced (``mode="cudnn"``, or ``requested="cudnn"`` on a
            GPU) and cannot run the call.
    """
    q, k, v = (_narrow(x, compute_dtype) for x in (q, k, v))
    kwargs = dict(
        scale=scale,
        is_causal=is_causal,
        query_seq_lengths=q_seqlen,
        key_value_seq_lengths=kv_seqlen,
        local_window_size=local_window_size,
    )
    force = mode == "cudnn" or (requested == "cudnn" and mode == "auto")
    gpu = _compat.cudnn_backend()
    if force and not gpu and mode != "cudnn":
        warnings.warn(
            f"jaxamp.amp: {where} asked for implementation='cudnn', which the "
            f"'{jax.default_backend()}' backend does not have; running JAX's XLA "
            "path with float32 logits instead.",
            stacklevel=2,
        )
        force = False
    with jax.named_scope(FUSED_SCOPE):  # visible in jaxprs and profiles
        if force or (mode == "auto" and gpu and _cudnn_eligible(q, k, v, bias, mask)):
            try:
                return _bind_cudnn(q, k, v, bias, mask, **kwargs)
            except (NotImplementedError, ValueError, RuntimeError):
                if force:
                    raise
        return _bind_xla(q, k, v, bias, mask, **kwargs)


def _narrow(x: Any, dtype: Any) -> Any:
    d = np.dtype(x.dtype)
    if is_float(d) and d.itemsize > np.dtype(dtype).itemsize:
        return cast(x, dtype)
    return x


def _cudnn_eligible(q, k, v, bias, mask) -> bool:
    """What JAX checks only under ``jax.grad`` (so a failure there would come too
    late to fall back): a bias or mask needs even sequence lengths."""
    if np.dtype(q.dtype) not in _FUSED_DTYPES:
        return False
    T, S = q.shape[1], k.shape[1]
    return not ((bias is not None or mask is not None) and (T % 2 or S % 2))


def _full_ts(x: Any, T: int, S: int) -> Any:
    """cuDNN wants a bias with full T and S dims (batch/head dims may be 1)."""
    if x is None:
        return None
    shape = (*x.shape[:2], T, S)
    return x if x.shape == shape else jnp.broadcast_to(x, shape)


def _bind_cudnn(q, k, v, bias, mask, **kwargs):
    """JAX's cuDNN flash attention (separated so tests can observe the call)."""
    T, S = q.shape[1], k.shape[1]
    if bias is not None:
        bias = cast(bias, q.dtype) if is_float(bias.dtype) else bias
    with _not_intercepting(), jax.numpy_dtype_promotion("standard"):
        return jax.nn.dot_product_attention(
            q,
            k,
            v,
            _full_ts(bias, T, S),
            _full_ts(mask, T, S),
            implementation="cudnn",
            **kwargs,
        )


def _bind_xla(
    q,
    k,
    v,
    bias,
    mask,
    *,
    scale,
    is_causal,
    query_seq_lengths,
    key_value_seq_lengths,
    local_window_size,
):
    """The XLA path: float32 logits and softmax, p·v in the dtype of ``v``.

    Same computation as JAX's ``_dot_product_attention_xla`` (masks, GQA,
    padding) written with ``lax.dot_general`` and no ``DotAlgorithmPreset``: JAX
    0.10's preset on a mixed bfloat16/float32 backward product fails to lower
    under strict dtype promotion.
    """
    B, T, N, H = q.shape
    _, S, K, Hv = v.shape
    G = N // K
    f32 = jnp.float32
    qg = q.reshape(B, T, K, G, H)
    dims = (((4,), (3,)), ((0, 2), (0, 2)))  # -> (B, K, T, G, S)
    if np.dtype(qg.dtype) == np.dtype(k.dtype) and np.dtype(k.dtype).itemsize < 4:
        logits = _reductions.wide_dot_general(qg, k, dims)  # backward in bf16
    else:
        logits = jax.lax.dot_general(qg, k, dims, preferred_element_type=f32)
    logits = jnp.transpose(logits, (0, 1, 3, 2, 4)).reshape(B, N, T, S)
    logits = logits * jnp.asarray(1.0 / math.sqrt(H) if scale is None else scale, f32)
    if bias is not None:
        logits = logits + bias.astype(f32)
    keep = _combined_mask(
        mask,
        is_causal,
        query_seq_lengths,
        key_value_seq_lengths,
        local_window_size,
        T,
        S,
    )
    if keep is not None:
        logits = jnp.where(
            keep, logits, jnp.asarray(-0.7 * np.finfo(np.float32).max, f32)
        )
    probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    probs = probs.reshape(B, K, G, T, S)
    dims = (((4,), (1,)), ((0, 1), (0, 2)))  # -> (B, K, G, T, Hv)
    out = jax.lax.dot_general(probs, v, dims, preferred_element_type=v.dtype)
    out = jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(B, T, N, Hv)
    if query_seq_lengths is not None:
        valid = jnp.arange(T)[None, :] < query_seq_lengths[:, None]
        out = jnp.where(valid[:, :, None, None], out, jnp.zeros((), out.dtype))
    return out


def _combined_mask(mask, is_causal, q_seqlen, kv_seqlen, window, T, S):
    """JAX's ``_apply_masks`` as one boolean mask broadcastable to (B, N, T, S)."""
    keep = None

    def both(a, b):
        return b if a is None else jnp.logical_and(a, b)

    if mask is not None:
        keep = mask
    tpos = jnp.arange(T)[:, None]
    spos = jnp.arange(S)[None, :]
    if is_causal:
        keep = both(keep, (tpos >= spos)[None, None])
    if window is not None:
        left, right = window
        near = jnp.logical_and(tpos <= spos + left, tpos >= spos - right)
        keep = both(keep, near[None, None])
    if q_seqlen is not None:
        keep = both(
            keep, (jnp.arange(T)[None, :] < q_seqlen[:, None])[:, None, :, None]
        )
    if kv_seqlen is not None:
        keep = both(
            keep, (jnp.arange(S)[None, :] < kv_seqlen[:, None])[:, None, None, :]
        )
    return keep


# --------------------------------------------------------------------------------
# Matching the hand-written form


@dataclasses.dataclass(eq=False)
class _Group:
    """One matched attention: its equations and how to compute its output."""

    eqns: tuple[int, ...]  # indices in the jaxpr, sorted
    run: Any  # run(read, compute_dtype, mode, where) -> output value, or None
    marked: _Spec | None = None
    scopes: tuple = ((),)  # the distinct named_scope stacks of its equations

    def mode(self, ctx: Any) -> str | None:
        """The policy's decision, if all equations get the same one (an
        ``amp_stop`` around part of the group leaves it alone)."""
        modes = {_mode(ctx, ctx.scopes + s) for s in self.scopes}
        return modes.pop() if len(modes) == 1 else None

    @property
    def first(self) -> int:
        return self.eqns[0]

    @property
    def last(self) -> int:
        return self.eqns[-1]


_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _plan(jaxpr: Any) -> dict[int, _Group]:
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
        spec = _marked_spec(e)
        if spec is not None:
            run = functools.partial(_run_marked, e, spec)
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
    logits = qk.outvars[0]
    rank = len(_shape(logits))
    axis = rank - 1
    members = [i0]
    x = logits
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
    stage = 0  # 0: scale allowed; 1: bias/mask allowed; then softmax
    while True:
        j = g.single_user(x)
        if j is None:
            # The inline softmax has two users of its input.
            soft = _inline_softmax(g, x, axis)
            if soft is None:
                return None
            members += soft[0]
            x = soft[1]
            break
        e = g.eqn(j)
        name = e.primitive.name
        if name == "convert_element_type" and _is_float_var(e.outvars[0]):
            members.append(j)
            x = e.outvars[0]
            continue
        if name == "custom_jvp_call" and _is_softmax_call(e, x, axis):
            members.append(j)
            x = e.outvars[0]
            break
        if stage == 0 and name in ("mul", "div") and pieces.scale is None:
            other = _other(e, x, allow_first=name == "mul")
            if other is not None and _shape(other) == () and _is_float_var(other):
                pieces.scale = (other, name, _const_scalar(g, other))
                members.append(j)
                x = e.outvars[0]
                stage = 1
                continue
            return None
        if name == "add" and pieces.bias is None:
            other = _other(e, x, allow_first=True)
            if (
                other is None
                or isinstance(other, _compat.Literal)
                or not _is_float_var(other)
                or not _broadcastable(_shape(other), _shape(x))
            ):
                return None
            pieces.bias = _peel_broadcasts(g, other)
            members.append(j)
            x = e.outvars[0]
            stage = 1
            continue
        if name == "select_n" and pieces.mask is None:
            mask = _select_mask(g, e, x)
            if mask is None:
                return None
            pieces.mask = (*_peel_broadcasts(g, mask[0]), mask[1])
            members.append(j)
            x = e.outvars[0]
            stage = 1
            continue
        if name in ("jit", "pjit") and pieces.mask is None:
            mask = _where_jit_mask(g, e, x)
            if mask is None:
                return None
            pieces.mask = mask
            members.append(j)
            x = e.outvars[0]
            stage = 1
            continue
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
    if e.primitive.name != "dot_general" or not _pv_ok(e, x, rank, len(lb), pieces):
        return None
    members.append(j)
    pieces.out_shape = _shape(e.outvars[0])
    idx = tuple(sorted(members))
    if len(set(idx)) != len(idx):
        return None
    scopes = tuple({_compat.scope_names(g.eqn(m)): None for m in idx})
    return _Group(idx, functools.partial(_run_hand, pieces), scopes=scopes)


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
    chain = _follow(
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
    if _follow(g, rs.outvars[0], {"broadcast_in_dim"}, div, members) is None:
        return None
    return members, div.outvars[0]


def _follow(g: _Graph, v: Any, allowed: set, target: Any, members: list):
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
    core, consts = _compat.jaxpr_parts(e.params["jaxpr"])
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


# --------------------------------------------------------------------------------
# Running a matched group


def _expand(x: Any, chain: tuple) -> Any:
    """Replay broadcast_in_dim equations keeping broadcast dims of size 1."""
    for shape, bdims in chain:
        target = [1] * len(shape)
        for i, d in enumerate(bdims):
            target[int(d)] = x.shape[i]
        x = jax.lax.broadcast_in_dim(x, tuple(target), tuple(int(d) for d in bdims))
    return x


def _merge(x: Any, full: tuple, groups: list[list[int]]) -> Any:
    """Reshape a broadcastable ``x`` (rank of ``full``) to one axis per group:
    size 1 where x is broadcast over the whole group, else the group's product
    (broadcasting the group first where x is partly broadcast)."""
    target = list(x.shape)
    for grp in groups:
        sizes = [x.shape[a] for a in grp]
        if any(s == 1 for s in sizes) and any(s != 1 for s in sizes):
            for a in grp:
                target[a] = full[a]
    if tuple(target) != x.shape:
        x = jnp.broadcast_to(x, tuple(target))
    new = []
    for grp in groups:
        sizes = [x.shape[a] for a in grp]
        new.append(math.prod(sizes) if any(s != 1 for s in sizes) else 1)
    return x.reshape(tuple(new))


def _run_hand(pieces: _Pieces, read, compute_dtype, mode, where):
    (lb, lc), (rb, rc) = pieces.qdims, pieces.kdims
    q, k, v = read(pieces.q), read(pieces.k), read(pieces.v)
    nb = len(lb)
    q_free = [d for d in range(q.ndim) if d not in (*lb, *lc)]
    k_free = [d for d in range(k.ndim) if d not in (*rb, *rc)]
    qc = jnp.transpose(q, (*lb, *q_free, *lc))
    kc = jnp.transpose(k, (*rb, *k_free, *rc))
    (c0, c1), (b0, b1) = pieces.pv_dims
    pb, vb, vc = (b0, b1, c1) if pieces.p_is_lhs else (b1, b0, c0)
    lperm = pieces.perm
    pb = [lperm[d] for d in pb]  # p's batch dims as axes of the natural logits
    v_batch = [vb[pb.index(i)] for i in range(nb)]
    v_free = [d for d in range(v.ndim) if d not in (*vb, *vc)]
    vcan = jnp.transpose(v, (*v_batch, *vc, *v_free))
    batch = qc.shape[:nb]
    T = math.prod(qc.shape[nb:-1])
    S = kc.shape[nb]
    if nb >= 2:
        B, N = math.prod(batch[:-1]), batch[-1]
    else:
        B, N = (batch[0] if nb else 1), 1
    logits_shape = (*batch, *qc.shape[nb:-1], S)
    groups = [list(range(nb - 1)), [nb - 1]] if nb >= 2 else [list(range(nb)), []]
    groups += [list(range(nb, len(logits_shape) - 1)), [len(logits_shape) - 1]]

    def bthn(x, seq):  # (batch..., seq..., H) -> (B, seq, N, H)
        return jnp.transpose(x.reshape(B, N, seq, x.shape[-1]), (0, 2, 1, 3))

    scale = 1.0
    if pieces.scale is not None:
        var, op, const = pieces.scale
        if const is not None:
            scale = 1.0 / const if op == "div" else const
        else:  # a traced scalar: fold it into q (in q's dtype, before the cast)
            c = read(var).astype(qc.dtype)
            qc = qc / c if op == "div" else qc * c
    bias = mask = None
    inverse = tuple(int(i) for i in np.argsort(lperm))  # logits layout -> natural
    if pieces.bias is not None:
        src, chain = pieces.bias
        b = jnp.transpose(_expand(read(src), chain), inverse)
        bias = _merge(b, logits_shape, groups)
    if pieces.mask is not None:
        src, chain, inverted = pieces.mask
        m = jnp.transpose(_expand(read(src), chain), inverse)
        mask = _merge(jnp.logical_not(m) if inverted else m, logits_shape, groups)
    out = dispatch(
        bthn(qc, T),
        bthn(kc, S),
        bthn(vcan, S),
        bias,
        mask,
        compute_dtype=compute_dtype,
        mode=mode,
        scale=scale,
        where=where,
    )
    # (B, T, N, Hv) -> (batch..., q free..., Hv) -> the p·v equation's layout
    out = jnp.transpose(out, (0, 2, 1, 3)).reshape((*logits_shape[:-1], out.shape[-1]))
    hv = len(logits_shape) - 1
    # p's free dims in the order they have in the (transposed) logits
    p_free = [lperm[d] for d in range(hv + 1) if lperm[d] not in (*pb, hv)]
    perm = [*pb, *p_free, hv] if pieces.p_is_lhs else [*pb, hv, *p_free]
    return jnp.transpose(out, perm)


def _run_marked(eqn: Any, spec: _Spec, read, compute_dtype, mode, where):
    vals = [read(v) for v in eqn.invars]
    q, k, v, bias, mask, qs, kvs = _unpack(spec, vals)
    if any(getattr(x, "ndim", 0) != 4 for x in (q, k, v)):  # e.g. batched by vmap
        return None
    out = dispatch(
        q,
        k,
        v,
        bias,
        mask,
        qs,
        kvs,
        compute_dtype=compute_dtype,
        mode=mode,
        scale=spec.scale,
        is_causal=spec.is_causal,
        local_window_size=spec.local_window_size,
        requested=spec.requested,
        where=spec.where,
    )
    return [out]


# --------------------------------------------------------------------------------
# The interpreter hook


class Fusions:
    """Per jaxpr walk: which matched groups are replaced (the interpreter hook).

    ``handled(i, eqn, env, ctx)`` is True when this module took care of
    equation ``i``: an equation of a replaced group other than its last
    (skipped: its outputs have no users outside the group), or the group's last
    equation, whose outputs it wrote to ``env``. False: walk it as usual.
    """

    __slots__ = ("_plan", "_active")

    def __init__(self, jaxpr: Any):
        self._plan = _plan(jaxpr)
        self._active: set[int] = set()

    def handled(self, i: int, eqn: Any, env: dict, ctx: Any) -> bool:
        group = self._plan.get(i) if self._plan else None
        if group is None:
            return False
        if i == group.first:
            mode = group.mode(ctx)
            if mode is None and group.marked and group.marked.requested:
                with _compat.eqn_context(eqn):  # amp_stop: as written, cuDNN too
                    return _write(env, eqn, _as_traced(eqn, env))
            if mode in (None, "off"):
                return False
            self._active.add(group.first)
        if group.first not in self._active:
            return False
        if i != group.last:
            return True
        with _compat.eqn_context(eqn):
            out = group.run(
                lambda v: _read(env, v), ctx.compute_dtype, group.mode(ctx), _where(eqn)
            )
        if out is None:  # a single-equation group declined: walk it as usual
            return False
        return _write(env, eqn, out)


def _write(env: dict, eqn: Any, out: Any) -> bool:
    if eqn.primitive.multiple_results:
        env.update(zip(eqn.outvars, out))
    else:
        env[eqn.outvars[0]] = out
    return True


def _read(env: dict, v: Any) -> Any:
    return v.val if isinstance(v, _compat.Literal) else env[v]


def _where(eqn: Any) -> str:
    frame = _compat.user_frame(eqn)
    return "dot_product_attention" + (f" at {frame}" if frame else "")


def _as_traced(eqn: Any, env: dict) -> Any:
    """An intercepted call that asked for cuDNN, run as the model wrote it (in an
    ``amp_stop`` region): on its traced dtypes, JAX's own checks and errors."""
    spec = _marked_spec(eqn)
    vals = [_read(env, v) for v in eqn.invars]
    vals = [
        cast(x, v.aval.dtype) if is_float(np.dtype(x.dtype)) else x
        for x, v in zip(vals, eqn.invars)
    ]
    q, k, v, bias, mask, qs, kvs = _unpack(spec, vals)
    with _not_intercepting():
        out = jax.nn.dot_product_attention(
            q,
            k,
            v,
            bias,
            mask,
            scale=spec.scale,
            is_causal=spec.is_causal,
            query_seq_lengths=qs,
            key_value_seq_lengths=kvs,
            local_window_size=spec.local_window_size,
            implementation="cudnn",
        )
    return [out]
