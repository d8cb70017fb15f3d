"""Running an attention on the kernel its dtypes allow: cuDNN or JAX's XLA path.

:func:`dispatch` casts q/k/v to the compute dtype and binds cuDNN flash
attention (``jax.nn.dot_product_attention(implementation="cudnn")``) where the
dtypes, the backend and JAX allow it, else JAX's XLA path with float32 logits
and softmax. :func:`run_hand` and :func:`run_marked` bring a matched group's
operands into the ``(B, T, N, H)`` layout first and its output back.
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ... import _compat
from ..._base._cast import cast
from ..._base._dtypes import is_float
from ..._base._scopes import marker
from ..._policy import _derived_sums
from ..._policy._compressed import store_compressed
from ._intercept import Spec, not_intercepting, unpack

# The named_scope of the equations amp binds for an attention it re-dispatched.
FUSED_SCOPE = marker("jaxamp_fused_attention")
_FUSED_DTYPES = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))


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
    residual_format: Any = None,
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
        residual_format: the stored form of the residuals saved here (the
            equation's ``RuleContext.residual_format``), None for none.

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
        return _bind_xla_storing(q, k, v, bias, mask, kwargs, residual_format)


def _bind_xla_storing(q, k, v, bias, mask, kwargs: dict, fmt: Any) -> Any:
    """:func:`_bind_xla`; with a residual format ``fmt``
    (``_policy/_residuals.py``) its backward pass reads v stored in it and q,
    k as they are, and recomputes the logits and softmax (q and k stay exact:
    exp turns an absolute error of a logit into a relative error of a
    probability)."""
    if fmt is not None:
        lengths = [kwargs["query_seq_lengths"], kwargs["key_value_seq_lengths"]]
        outs = store_compressed(
            functools.partial(_bind_xla_positional, kwargs),
            [q, k, v, bias, mask, *lengths],
            fmt,
            recomputed=True,
            keep=(0, 1),
        )
        if outs is not None:
            return outs
    return _bind_xla(q, k, v, bias, mask, **kwargs)


def _bind_xla_positional(kwargs: dict, q, k, v, bias, mask, q_seqlen, kv_seqlen):
    """:func:`_bind_xla` with the sequence lengths as positional arguments."""
    kwargs = dict(kwargs, query_seq_lengths=q_seqlen, key_value_seq_lengths=kv_seqlen)
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
    with not_intercepting(), jax.numpy_dtype_promotion("standard"):
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
        logits = _derived_sums.wide_dot_general(qg, k, dims)  # backward in bf16
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


def _replay_broadcasts(x: Any, chain: tuple) -> Any:
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


def run_hand(pieces: Any, read, ctx, mode, where):
    """A matched hand-written attention (matmul, softmax, matmul) re-dispatched
    to the fused kernel for ``mode``, its output in the matched layout; ``ctx``:
    the ``RuleContext`` of its last equation."""
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
        b = jnp.transpose(_replay_broadcasts(read(src), chain), inverse)
        bias = _merge(b, logits_shape, groups)
    if pieces.mask is not None:
        src, chain, inverted = pieces.mask
        m = jnp.transpose(_replay_broadcasts(read(src), chain), inverse)
        mask = _merge(jnp.logical_not(m) if inverted else m, logits_shape, groups)
    out = dispatch(
        bthn(qc, T),
        bthn(kc, S),
        bthn(vcan, S),
        bias,
        mask,
        compute_dtype=ctx.compute_dtype,
        mode=mode,
        scale=scale,
        where=where,
        residual_format=ctx.residual_format,
    )
    # (B, T, N, Hv) -> (batch..., q free..., Hv) -> the p·v equation's layout
    out = jnp.transpose(out, (0, 2, 1, 3)).reshape((*logits_shape[:-1], out.shape[-1]))
    hv = len(logits_shape) - 1
    # p's free dims in the order they have in the (transposed) logits
    p_free = [lperm[d] for d in range(hv + 1) if lperm[d] not in (*pb, hv)]
    perm = [*pb, *p_free, hv] if pieces.p_is_lhs else [*pb, hv, *p_free]
    return jnp.transpose(out, perm)


def run_marked(eqn: Any, spec: Spec, read, ctx, mode, where):
    """An intercepted ``jax.nn.dot_product_attention`` call re-dispatched for
    ``mode``: ``[output]``, or None when its operands are not 4-D (batched);
    ``ctx``: the ``RuleContext`` of its equation."""
    vals = [read(v) for v in eqn.invars]
    q, k, v, bias, mask, qs, kvs = unpack(spec, vals)
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
        compute_dtype=ctx.compute_dtype,
        mode=mode,
        scale=spec.scale,
        is_causal=spec.is_causal,
        local_window_size=spec.local_window_size,
        requested=spec.requested,
        where=spec.where,
        residual_format=ctx.residual_format,
    )
    return [out]
