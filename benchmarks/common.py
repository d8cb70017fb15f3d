"""The model kit the benchmarks and the tests share: the reference GPT, the
norms, the relative L2 error and bfloat16 pre-rounding.

Importable as ``common``: a benchmark run as ``python benchmarks/x.py`` has
``benchmarks/`` first on ``sys.path``; the tests get it from pytest's
``pythonpath`` setting (pyproject.toml). It holds no benchmark logic, so a
test importing it runs nothing.

Every RESULTS row and every test figure measured on these functions depends on
their exact equations: a variant is a keyword of one function, never a copy,
and a change here is a change of every figure built on it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

BF16, F32 = jnp.bfloat16, jnp.float32


def round_bf16(tree):
    """Round every float leaf to bfloat16 and back (inputs bfloat16 can represent
    exactly, so a mixed-precision run sees the same inputs as the reference)."""
    return jax.tree.map(lambda a: a.astype(BF16).astype(a.dtype), tree)


def rel_l2(tree, ref) -> float:
    """Relative L2 error ``||tree - ref|| / ||ref||`` over all leaves, in float64."""
    a, b = jax.tree.leaves(tree), jax.tree.leaves(ref)
    assert len(a) == len(b), (len(a), len(b))
    num = sum(
        float(np.sum(np.square(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
        for x, y in zip(a, b)
    )
    den = sum(float(np.sum(np.square(np.asarray(y, np.float64)))) for y in b)
    return (num / den) ** 0.5


def layer_norm(x, g=None, f32_stats=False, eps=1e-5):
    """LayerNorm over the last axis, times the gain ``g`` (None: no gain).
    ``f32_stats``: mean, variance and normalisation in float32, rounded once to
    ``x``'s dtype before the gain (what a hand-written bfloat16 model does)."""
    xs = x.astype(F32) if f32_stats else x
    m = xs.mean(-1, keepdims=True)
    v = jnp.square(xs - m).mean(-1, keepdims=True)
    n = ((xs - m) * jax.lax.rsqrt(v + eps)).astype(x.dtype)
    return n if g is None else n * g


def rms_norm(x, g=None, f32_stats=False, eps=1e-6):
    """``x * rsqrt(mean(x * x) + eps)`` over the last axis, times the gain ``g``
    (None: no gain); ``f32_stats`` as in :func:`layer_norm`."""
    xs = x.astype(F32) if f32_stats else x
    n = xs * jax.lax.rsqrt(jnp.mean(xs * xs, -1, keepdims=True) + eps)
    n = n.astype(x.dtype)
    return n if g is None else n * g


# --- The reference GPT -----------------------------------------------------------
#
# Layers stacked in lax.scan, pre-LayerNorm blocks (causal multi-head attention,
# GELU MLP), learned positions, a tied embedding head, float32 logits and
# cross-entropy. ``dims`` is ``(d_model, layers, seq, batch, heads, vocab)``, the
# rows of benchmarks/run.py's and gpu_attention.py's SIZES.


def gpt_init(dims, seed: int = 0):
    """``(params, x, y)``: float32 parameters pre-rounded to bfloat16 and an int32
    batch of next-token pairs."""
    d, L, T, B, _, V = dims
    ks = jax.random.split(jax.random.key(seed), 8)
    n = lambda k, s, sc: (jax.random.normal(k, s) * sc).astype(BF16).astype(F32)
    params = {
        "emb": n(ks[0], (V, d), 0.02),
        "pos": n(ks[1], (T, d), 0.01),
        "layers": {
            "ln1": jnp.ones((L, d)),
            "qkv": n(ks[2], (L, d, 3 * d), d**-0.5),
            "o": n(ks[3], (L, d, d), (2 * L * d) ** -0.5),
            "ln2": jnp.ones((L, d)),
            "up": n(ks[4], (L, d, 4 * d), d**-0.5),
            "down": n(ks[5], (L, 4 * d, d), (8 * L * d) ** -0.5),
        },
        "lnf": jnp.ones(d),
    }
    tok = jax.random.randint(ks[6], (B, T + 1), 0, V)
    return params, tok[:, :-1], tok[:, 1:]


def _no_scope(name):
    return contextlib.nullcontext()


def gpt_loss(
    dims,
    *,
    attention: str | None = "xla",
    hand: bool = False,
    remat: bool = False,
    policy: Callable | None = None,
    act_name: str | None = None,
    scopes: bool = False,
    head: str = "emb",
    unroll: int | None = None,
) -> Callable:
    """The reference GPT's loss ``loss(params, x, y)`` (mean next-token
    cross-entropy), for :func:`gpt_init`'s parameters.

    Args:
        attention: ``jax.nn.dot_product_attention``'s ``implementation``
            (``"xla"``, ``"cudnn"``, None: JAX's choice), or ``"softmax"``: the
            causal softmax written out, its logits and softmax in float32.
        hand: the hand-written bfloat16 model: parameters cast to bfloat16 at
            the top, LayerNorm statistics in float32.
        remat: each scanned block under ``jax.checkpoint(policy=policy)``.
        act_name: ``checkpoint_name`` of the residual stream after attention
            (what a ``save_only_these_names`` policy keeps).
        scopes: ``jax.named_scope`` "attn", "mlp" and "head" around the parts.
        head: the parameter the logits are read from (``"emb"``: tied; a new
            key: an untied head of the embedding's shape).
        unroll: that many layers in a Python loop instead of the scan (the
            stacked layers reused cyclically).
    """
    _, _, T, B, H, _ = dims
    scope = jax.named_scope if scopes else _no_scope

    def block(x, w):
        with scope("attn"):
            h = layer_norm(x, w["ln1"], hand)
            q, k, v = jnp.split(h @ w["qkv"], 3, -1)
            sh = lambda t: t.reshape(B, T, H, -1)
            if attention == "softmax":
                s = jnp.einsum("bqhd,bkhd->bhqk", sh(q), sh(k)).astype(F32)
                s = s / np.float32(np.sqrt(q.shape[-1] // H))
                mask = jnp.tril(jnp.ones((T, T), bool))
                p = jax.nn.softmax(jnp.where(mask, s, -1e9), -1).astype(x.dtype)
                a = jnp.einsum("bhqk,bkhd->bqhd", p, sh(v))
            else:
                a = jax.nn.dot_product_attention(
                    sh(q), sh(k), sh(v), is_causal=True, implementation=attention
                )
            x = x + a.reshape(B, T, -1) @ w["o"]
            if act_name is not None:
                x = checkpoint_name(x, act_name)
        with scope("mlp"):
            h = layer_norm(x, w["ln2"], hand)
            return x + jax.nn.gelu(h @ w["up"]) @ w["down"], None

    def loss(params, x, y):
        if hand:
            from jaxamp.migration import mpx

            p = mpx.cast_to_bfloat16(params)
        else:
            p = params
        h = p["emb"][x] + p["pos"]
        if unroll is None:
            body = jax.checkpoint(block, policy=policy) if remat else block
            h, _ = jax.lax.scan(body, h, p["layers"])
        else:
            n_stacked = p["layers"]["qkv"].shape[0]
            for i in range(unroll):
                w = {k: a[i % n_stacked] for k, a in p["layers"].items()}
                h, _ = block(h, w)
        with scope("head"):
            logits = (layer_norm(h, p["lnf"], hand) @ p[head].T).astype(F32)
        lse = jax.nn.logsumexp(logits, -1)
        gold = jnp.take_along_axis(logits, y[..., None], -1)[..., 0]
        return (lse - gold).mean()

    return loss


# --- The unrolled GPT ------------------------------------------------------------
#
# The model whose scopes the precision reports rank (tests/test_precision_report.py,
# benchmarks/precision_report.py): layers as a Python list, layer i under
# jax.named_scope(f"layer{i}") with its "attn" scope and an MLP scope the caller
# names, single-head attention without a mask, LayerNorms without gains, no
# positions, an untied head in scope "head". Small enough that every equation's
# error is measured in a test.

UNROLLED_DIMS = (16, 3, 8, 2, 32)  # d_model, layers, seq, batch, vocab


def unrolled_gpt_init(key, scale=1.0):
    """Parameters pre-rounded to bfloat16, each weight's spread times ``scale``."""
    D, L, _, _, V = UNROLLED_DIMS
    ks = jax.random.split(key, 6)
    n = lambda k, s, sc: jax.random.normal(k, s) * sc * scale
    layers = [
        {
            "qkv": n(jax.random.fold_in(ks[0], i), (D, 3 * D), D**-0.5),
            "o": n(jax.random.fold_in(ks[1], i), (D, D), D**-0.5),
            "up": n(jax.random.fold_in(ks[2], i), (D, 4 * D), D**-0.5),
            "down": n(jax.random.fold_in(ks[3], i), (4 * D, D), (4 * D) ** -0.5),
        }
        for i in range(L)
    ]
    params = {"emb": n(ks[4], (V, D), 1.0), "layers": layers}
    params["head"] = n(ks[5], (D, V), D**-0.5)
    return round_bf16(params)


def unrolled_gpt_block(h, w, mlp_scope: str):
    D = UNROLLED_DIMS[0]
    with jax.named_scope("attn"):
        q, k, v = jnp.split(layer_norm(h) @ w["qkv"], 3, -1)
        s = q @ k.swapaxes(-1, -2) / np.float32(D**0.5)
        h = h + jax.nn.softmax(s, -1) @ v @ w["o"]
    with jax.named_scope(mlp_scope):
        return h + jax.nn.gelu(layer_norm(h) @ w["up"]) @ w["down"]


def xent(logits, y):
    """Mean cross-entropy of integer labels ``y`` under ``logits``."""
    gold = jnp.take_along_axis(logits, y[..., None], -1)[..., 0]
    return (jax.nn.logsumexp(logits, -1) - gold).mean()


def unrolled_gpt_loss(mlp_scope: Callable[[int], str]) -> Callable:
    """``loss(params, x, y)``; layer i's MLP in the scope ``mlp_scope(i)``."""

    def loss(p, x, y):
        h = p["emb"][x]
        for i, w in enumerate(p["layers"]):
            with jax.named_scope(f"layer{i}"):
                h = unrolled_gpt_block(h, w, mlp_scope(i))
        with jax.named_scope("head"):
            logits = layer_norm(h) @ p["head"]
        return xent(logits, y)

    return loss


def unrolled_gpt_batch(seed: int = 1):
    """``(x, y)``: int32 tokens and their next tokens."""
    _, _, T, B, V = UNROLLED_DIMS
    tok = jax.random.randint(jax.random.key(seed), (B, T + 1), 0, V)
    return tok[:, :-1], tok[:, 1:]
