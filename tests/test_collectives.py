"""Statistics summed across devices keep their float32 normalisation
(jaxamp/_values/_patterns.py, ``COLLECTIVE_SUMS`` and ``_PACKING``): a mean or a sum of
squares reduced with ``psum`` / ``pmean`` (``shard_map``, ``vmap`` with an
``axis_name``), or gathered with ``all_gather`` and summed, is recognised as it
is locally, so cross-replica BatchNorm and tensor-parallel LayerNorm / RMSNorm
normalise in float32, as their local forms do."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import rel_l2, round_bf16
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jaxamp
from jaxamp._values import _patterns

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
        for e, _ in jaxamp.tools.iter_equations(closed)
        if e.primitive.name == "sub" and e.outvars[0].aval.dtype == BF16
    ]


def _errors(loss_local, loss_sharded, p, x):
    with jax.default_matmul_precision("highest"):
        ref = jax.grad(loss_local)(p, x)
    local = jax.grad(jaxamp.amp(loss_local, compute_dtype=BF16))(p, x)
    sharded = jax.grad(jaxamp.amp(loss_sharded, compute_dtype=BF16))(p, x)
    return rel_l2(local, ref), rel_l2(sharded, ref)


def _mlp_losses(local_norm, sharded_norm):
    """``loss(p, x)`` of a two-layer MLP with a norm between the layers: the
    local norm, and ``sharded_norm`` on 4 devices' feature shards."""
    mesh = Mesh(np.array(jax.devices()[:4]), ("model",))
    tp = jax.shard_map(
        sharded_norm, mesh=mesh, in_specs=P(None, "model"), out_specs=P(None, "model")
    )

    def loss(fn, p, x):
        w1, w2 = p
        return jnp.mean(jnp.tanh(fn(x @ w1) @ w2))

    return functools.partial(loss, local_norm), functools.partial(loss, tp)


@pytest.mark.parametrize("norm", [_layer_norm, _rms_norm], ids=["layer", "rms"])
def test_tensor_parallel_norm_in_shard_map(norm):
    """Hidden dimension sharded over 4 devices, statistics by psum: the same
    dtypes and the same gradient error as the local norm."""

    def body(x):  # x: (B, D / 4), this device's features
        return norm(x, D, "model")

    local, sharded = _mlp_losses(lambda h: norm(h, D), body)
    p, x = _inputs()
    amp_jaxpr = jax.make_jaxpr(jax.grad(jaxamp.amp(sharded, compute_dtype=BF16)))(p, x)
    assert not _low_subs(amp_jaxpr)
    err_local, err_sharded = _errors(local, sharded, p, x)
    assert err_sharded < 1.3 * err_local + 1e-6, (err_sharded, err_local)
    assert err_local < 2e-2


def test_all_gathered_statistics_in_shard_map():
    """Per-device sums gathered with ``all_gather`` and summed (instead of a
    psum): the LayerNorm's centring is still recognised."""

    def gathered_ln(h):  # h: (B, D / 4)
        s = jnp.sum(jax.lax.all_gather(jnp.sum(h, -1), "model"), 0)[:, None]
        c = h - s / D
        q = jnp.sum(jax.lax.all_gather(jnp.sum(c * c, -1), "model"), 0)[:, None]
        return c * jax.lax.rsqrt(q / D + 1e-5)

    local, sharded = _mlp_losses(lambda h: _layer_norm(h, D), gathered_ln)
    p, x = _inputs(1)
    # The facts pass marks the body's ``h - mean`` as a centring.
    (body,) = [
        e.params["jaxpr"]
        for e, _ in jaxamp.tools.iter_equations(jax.make_jaxpr(sharded)(p, x))
        if e.primitive.name == "shard_map"
    ]
    body = getattr(body, "jaxpr", body)
    producer = {o: e for e in body.eqns for o in e.outvars}
    subs = [e for e in body.eqns if e.primitive.name == "sub"]
    assert [_patterns.centring(e, producer) for e in subs] == [True]
    amp_jaxpr = jax.make_jaxpr(jax.grad(jaxamp.amp(sharded, compute_dtype=BF16)))(p, x)
    assert not _low_subs(amp_jaxpr)
    err_local, err_sharded = _errors(local, sharded, p, x)
    assert err_sharded < 1.3 * err_local + 1e-6, (err_sharded, err_local)


class _ResBlock(nn.Module):
    """Flax's ImageNet ResNet block (examples/imagenet/models.py): conv,
    BatchNorm, relu, conv, BatchNorm, residual; batch statistics over
    ``axis_name`` when given (cross-replica BatchNorm)."""

    axis_name: str | None = None

    @nn.compact
    def __call__(self, x):
        norm = functools.partial(
            nn.BatchNorm,
            use_running_average=False,
            momentum=0.9,
            epsilon=1e-5,
            axis_name=self.axis_name,
        )
        y = nn.relu(norm()(nn.Conv(16, (3, 3), use_bias=False)(x)))
        y = norm()(nn.Conv(16, (3, 3), use_bias=False)(y))
        return nn.relu(x + y)


R = 4  # replicas


def _block_loss(block, p, stats, x):
    y, _ = block.apply({"params": p, "batch_stats": stats}, x, mutable=["batch_stats"])
    return jnp.mean(jnp.tanh(y / 100.0))


def _resnet_inputs():
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    # Offset images: conv outputs with per-channel means in the hundreds.
    x = round_bf16(300.0 + 3.0 * jax.random.normal(k2, (R, 4, 8, 8, 16)))
    v = _ResBlock().init(k1, x[0])
    return round_bf16(v["params"]), v["batch_stats"], x


def _local_loss(p, stats, x):  # all replicas' images in one batch
    return _block_loss(_ResBlock(), p, stats, x.reshape(-1, *x.shape[2:]))


def _vmap_loss(p, stats, x):
    one = functools.partial(_block_loss, _ResBlock(axis_name="batch"), p, stats)
    return jnp.mean(jax.vmap(one, axis_name="batch")(x))


def _shard_map_loss(p, stats, x):
    mesh = Mesh(np.array(jax.devices()[:R]), ("batch",))
    block = _ResBlock(axis_name="batch")

    def body(xr):  # (1, N, H, W, C): this device's images
        return jax.lax.pmean(_block_loss(block, p, stats, xr[0]), "batch")

    return jax.shard_map(body, mesh=mesh, in_specs=P("batch"), out_specs=P())(x)


@functools.cache
def _local_grads():
    """The block on all replicas' images locally: float32's gradient and amp's
    (both variants of the next test compare against them)."""
    p, stats, x = _resnet_inputs()
    with jax.default_matmul_precision("highest"):
        ref = jax.grad(_local_loss)(p, stats, x)
    return ref, jax.grad(jaxamp.amp(_local_loss, compute_dtype=BF16))(p, stats, x)


@pytest.mark.parametrize(
    "sharded", [_vmap_loss, _shard_map_loss], ids=["vmap", "shard_map"]
)
def test_cross_replica_batch_norm(sharded):
    """Flax BatchNorm with ``axis_name`` (statistics by ``pmean`` over 4
    replicas, packed into one collective) normalises in float32: no bfloat16
    ``sub`` in the gradient's jaxpr, and the gradient error against float32
    within 1.3x of the same block on the whole batch locally (measured: local
    2.2e-3, vmap 2.2e-3, shard_map 2.2e-3)."""
    p, stats, x = _resnet_inputs()
    amp_jaxpr = jax.make_jaxpr(jax.grad(jaxamp.amp(sharded, compute_dtype=BF16)))(
        p, stats, x
    )
    assert not _low_subs(amp_jaxpr)
    ref, local = _local_grads()
    dist = jax.grad(jaxamp.amp(sharded, compute_dtype=BF16))(p, stats, x)
    err_local, err_sharded = rel_l2(local, ref), rel_l2(dist, ref)
    assert err_sharded < 1.3 * err_local + 1e-6, (err_sharded, err_local)
    assert err_local < 1e-2
