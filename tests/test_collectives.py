"""Statistics summed across devices keep their float32 normalisation
(jaxamp/_patterns.py, ``COLLECTIVE_SUMS``): a mean or a sum of squares reduced
with ``psum`` (``shard_map``, ``vmap`` with an ``axis_name``) is recognised as it
is locally, so tensor-parallel LayerNorm / RMSNorm normalise in float32, as
their local forms do."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import rel_l2, round_bf16
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jaxamp

BF16, F32 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)
D, B = 64, 16


def _inputs(seed=0):
    k = jax.random.split(jax.random.PRNGKey(seed), 3)
    w1 = round_bf16(jax.random.normal(k[0], (D, D)) / D**0.5)
    w2 = round_bf16(jax.random.normal(k[1], (D, D)) / D**0.5)
    # Offset activations: a mean in the hundreds, a spread of a few units.
    x = round_bf16(300.0 + 3.0 * jax.random.normal(k[2], (B, D)))
    return (w1, w2), x


def _layer_norm(h, total, axis=None):
    s = jnp.sum(h, -1, keepdims=True)
    mean = (s if axis is None else jax.lax.psum(s, axis)) / total
    c = h - mean
    q = jnp.sum(c * c, -1, keepdims=True)
    var = (q if axis is None else jax.lax.psum(q, axis)) / total
    return c * jax.lax.rsqrt(var + 1e-5)


def _rms_norm(h, total, axis=None):
    q = jnp.sum(h * h, -1, keepdims=True)
    ms = (q if axis is None else jax.lax.psum(q, axis)) / total
    return h * jax.lax.rsqrt(ms + 1e-6)


def _low_subs(closed):
    return [
        e
        for e, _ in jaxamp.iter_equations(closed)
        if e.primitive.name == "sub" and e.outvars[0].aval.dtype == BF16
    ]


def _errors(loss_local, loss_sharded, p, x):
    with jax.default_matmul_precision("highest"):
        ref = jax.grad(loss_local)(p, x)
    local = jax.grad(jaxamp.amp(loss_local, compute_dtype=BF16))(p, x)
    sharded = jax.grad(jaxamp.amp(loss_sharded, compute_dtype=BF16))(p, x)
    return rel_l2(local, ref), rel_l2(sharded, ref)


@pytest.mark.parametrize("norm", [_layer_norm, _rms_norm], ids=["layer", "rms"])
def test_tensor_parallel_norm_in_shard_map(norm):
    """Hidden dimension sharded over 4 devices, statistics by psum: the same
    dtypes and the same gradient error as the local norm."""
    mesh = Mesh(np.array(jax.devices()[:4]), ("model",))

    def body(x):  # x: (B, D / 4), this device's features
        return norm(x, D, "model")

    tp = jax.shard_map(
        body, mesh=mesh, in_specs=P(None, "model"), out_specs=P(None, "model")
    )

    def loss(fn, p, x):
        w1, w2 = p
        return jnp.mean(jnp.tanh(fn(x @ w1) @ w2))

    local = functools.partial(loss, lambda h: norm(h, D))
    sharded = functools.partial(loss, tp)
    p, x = _inputs()
    amp_jaxpr = jax.make_jaxpr(jax.grad(jaxamp.amp(sharded, compute_dtype=BF16)))(p, x)
    assert not _low_subs(amp_jaxpr)
    err_local, err_sharded = _errors(local, sharded, p, x)
    assert err_sharded < 1.3 * err_local + 1e-6, (err_sharded, err_local)
    assert err_local < 2e-2
