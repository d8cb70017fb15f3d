"""Whole-model tests of amp: the float32 identity on a corpus of common
functions, a GPT-style model's dtypes and accuracy in bfloat16, and
data-parallel training steps on 8 host CPU devices."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxamp

F32, BF16, F16 = np.dtype(jnp.float32), np.dtype(jnp.bfloat16), np.dtype(jnp.float16)
K = jax.random.split(jax.random.key(0), 8)
X = jax.random.normal(K[0], (4, 8))
LABELS = jax.random.randint(K[1], (4,), 0, 8)
PROBS = jax.nn.softmax(jax.random.normal(K[2], (4, 8)))


def _mha():
    m = eqx.nn.MultiheadAttention(2, 8, key=K[3])
    return lambda x: m(x, x, x)


def _gru_scan():
    cell = eqx.nn.GRUCell(8, 6, key=K[4])
    return lambda x: lax.scan(lambda h, xi: (cell(xi, h), h), jnp.zeros(6), x)[0]


def _conv():
    conv = eqx.nn.Conv2d(1, 3, 3, key=K[5])
    return lambda x: conv(x.reshape(1, 4, 8))


def _attention(x):
    q = x.reshape(1, 4, 2, 4)
    return jax.nn.dot_product_attention(q, q, q, is_causal=True, implementation="xla")


CORPUS = {
    "relu": jax.nn.relu,
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_exact": lambda x: jax.nn.gelu(x, approximate=False),
    "silu": jax.nn.silu,
    "softplus": jax.nn.softplus,
    "sigmoid": jax.nn.sigmoid,
    "elu": jax.nn.elu,
    "leaky_relu": jax.nn.leaky_relu,
    "tanh": jnp.tanh,
    "softmax": jax.nn.softmax,
    "log_softmax": jax.nn.log_softmax,
    "logsumexp": lambda x: jax.nn.logsumexp(x, axis=-1),
    "standardize": jax.nn.standardize,
    "dot_product_attention": _attention,
    "softmax_cross_entropy": lambda x: optax.softmax_cross_entropy(x, PROBS),
    "ce_integer_labels": lambda x: optax.softmax_cross_entropy_with_integer_labels(
        x, LABELS
    ),
    "sigmoid_bce": lambda x: optax.sigmoid_binary_cross_entropy(x, PROBS),
    "l2_loss": lambda x: optax.l2_loss(x, PROBS),
    "huber_loss": lambda x: optax.huber_loss(x, PROBS),
    "cosine_similarity": lambda x: optax.cosine_similarity(x, PROBS),
    "eqx_linear": jax.vmap(eqx.nn.Linear(8, 5, key=K[6])),
    "eqx_conv2d": _conv(),
    "eqx_layernorm": jax.vmap(eqx.nn.LayerNorm(8)),
    "eqx_rmsnorm": jax.vmap(eqx.nn.RMSNorm(8)),
    "eqx_mha": _mha(),
    "eqx_gru_scan": _gru_scan(),
    "norm": lambda x: jnp.linalg.norm(x, axis=-1),
    "cumsum_var": lambda x: jnp.cumsum(x, -1) * jnp.var(x),
}


@pytest.mark.parametrize("name", sorted(CORPUS))
def test_float32_compute_dtype_is_the_identity(name):
    f = CORPUS[name]
    loss = lambda x: jnp.sum(jnp.sin(f(x)))
    amp_loss = jaxamp.amp(loss, compute_dtype=jnp.float32)
    np.testing.assert_allclose(jaxamp.amp(f, compute_dtype=F32)(X), f(X), rtol=1e-6)
    np.testing.assert_allclose(
        jax.grad(amp_loss)(X), jax.grad(loss)(X), rtol=1e-6, atol=1e-7
    )


def test_batchnorm_under_vmap_with_axis_name_is_the_identity():
    bn, state = eqx.nn.make_with_state(eqx.nn.BatchNorm)(8, "batch", mode="batch")

    def f(x, state):
        out, state = jax.vmap(
            bn, in_axes=(0, None), out_axes=(0, None), axis_name="batch"
        )(x, state)
        return out, state

    out, new_state = jaxamp.amp(f, compute_dtype=F32)(X, state)
    ref, ref_state = f(X, state)
    np.testing.assert_allclose(out, ref, rtol=1e-6, atol=1e-6)
    for a, b in zip(jax.tree.leaves(new_state), jax.tree.leaves(ref_state)):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    # ...and in bfloat16 it still runs, with the batch statistics collective.
    low, _ = jaxamp.amp(f, compute_dtype=BF16)(X, state)
    assert low.dtype == F32
    np.testing.assert_allclose(low, ref, atol=5e-2)


# ---------------------------------------------------------------------------
# A GPT-style model: layers in lax.scan, jax.checkpoint on the layer, jax.jit
# inside, attention + LayerNorm + GELU MLP and a custom_vjp.

D, T, B, H, V, L = 32, 16, 4, 2, 48, 3


@jax.custom_vjp
def _residual(x, y):
    return x + y


_residual.defvjp(lambda x, y: (x + y, None), lambda _, g: (g, g))


def _round_bf16(tree):
    return jax.tree.map(lambda a: a.astype(BF16).astype(a.dtype), tree)


def gpt_params(key=K[7]):
    ks = jax.random.split(key, 6)
    n = lambda k, s, sc: jax.random.normal(k, s) * sc
    return _round_bf16(
        {
            "emb": n(ks[0], (V, D), 0.5),
            "qkv": n(ks[1], (L, D, 3 * D), D**-0.5),
            "o": n(ks[2], (L, D, D), D**-0.5),
            "up": n(ks[3], (L, D, 4 * D), D**-0.5),
            "down": n(ks[4], (L, 4 * D, D), (4 * D) ** -0.5),
            "g": jnp.ones((L, 2, D)),
        }
    )


def _ln(x, g):
    m = x.mean(-1, keepdims=True)
    return (x - m) * lax.rsqrt(jnp.square(x - m).mean(-1, keepdims=True) + 1e-5) * g


def gpt_loss(params, tokens):
    x = params["emb"][tokens[:, :-1]]

    @jax.checkpoint
    def layer(x, w):
        h = _ln(x, w["g"][0])
        q, k, v = jnp.split(jax.jit(lambda a, b: a @ b)(h, w["qkv"]), 3, -1)
        sh = lambda t: t.reshape(B, T, H, D // H)
        a = jax.nn.dot_product_attention(
            sh(q), sh(k), sh(v), is_causal=True, implementation="xla"
        )
        x = _residual(x, a.reshape(B, T, D) @ w["o"])
        h = _ln(x, w["g"][1])
        return x + jax.nn.gelu(h @ w["up"]) @ w["down"], None

    x, _ = lax.scan(layer, x, {k: params[k] for k in ("qkv", "o", "up", "down", "g")})
    logits = x @ params["emb"].T
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


TOKENS = jax.random.randint(K[0], (B, T + 1), 0, V)


@pytest.mark.parametrize("compute", [BF16, F16])
def test_gpt_structure_under_grad(compute):
    amp_loss = jaxamp.amp(gpt_loss, compute_dtype=compute)
    closed = jax.make_jaxpr(jax.grad(amp_loss))(gpt_params(), TOKENS)
    assert jaxamp.low_precision_flop_share(closed) == 1.0
    flops = jaxamp.matmul_flops_by_dtype(closed)
    assert list(flops) == [compute.name]
    for name, ins, outs in jaxamp.primitive_dtypes(closed):
        if name in ("exp", "log"):
            assert all(np.dtype(d).itemsize >= 4 for d in ins + outs), (name, ins)
    # Every reduce_sum amp binds runs in float32. (Known limit, README: the
    # backward reduce_sums JAX derives from implicit size-1 broadcasting, e.g.
    # of a LayerNorm gain, run in the dtype of the low-precision cotangent.)
    fwd = jax.make_jaxpr(amp_loss)(gpt_params(), TOKENS)
    sums = [ins for n, ins, _ in jaxamp.primitive_dtypes(fwd) if n == "reduce_sum"]
    assert sums and all(ins == (F32,) for ins in sums)
    grads = jax.grad(amp_loss)(gpt_params(), TOKENS)
    assert all(g.dtype == F32 for g in jax.tree.leaves(grads))
    # Every higher-order primitive was rewritten, not inlined.
    kinds = {n for n, _, _ in jaxamp.primitive_dtypes(closed)}
    assert {"scan", "remat2", "jit"} <= kinds
    assert "custom_vjp_call" in {n for n, _, _ in jaxamp.primitive_dtypes(fwd)}


def test_gpt_accuracy_in_bfloat16():
    params = gpt_params()
    amp_loss = jaxamp.amp(gpt_loss, compute_dtype=BF16)
    loss, ref = float(amp_loss(params, TOKENS)), float(gpt_loss(params, TOKENS))
    assert abs(loss - ref) < 0.01 * abs(ref)
    g, g_ref = jax.grad(amp_loss)(params, TOKENS), jax.grad(gpt_loss)(params, TOKENS)
    num = sum(
        float(jnp.sum(jnp.square(a - b)))
        for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref))
    )
    den = sum(float(jnp.sum(jnp.square(b))) for b in jax.tree.leaves(g_ref))
    assert (num / den) ** 0.5 < 0.05


# ---------------------------------------------------------------------------
# Data parallelism on 8 host CPU devices.


def _mesh():
    return jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))


def _sgd_step(loss):
    def step(params, tokens):
        value, grads = jax.value_and_grad(loss)(params, tokens)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), value

    return step


def test_named_sharding_train_step_keeps_shardings():
    assert len(jax.devices()) == 8
    mesh = _mesh()
    tokens = jax.device_put(
        jax.random.randint(K[1], (8, T + 1), 0, V), NamedSharding(mesh, P("data"))
    )
    params = jax.device_put(gpt_params(), NamedSharding(mesh, P()))
    loss = lambda p, t: gpt_loss_batch(p, t)
    ref_p, ref_v = jax.jit(_sgd_step(loss))(params, tokens)
    amp_p, amp_v = jax.jit(_sgd_step(jaxamp.amp(loss, compute_dtype=BF16)))(
        params, tokens
    )
    for a, b in zip(jax.tree.leaves(amp_p), jax.tree.leaves(ref_p)):
        assert a.sharding == b.sharding and a.dtype == b.dtype
        np.testing.assert_allclose(a, b, atol=5e-3)
    assert amp_v.sharding == ref_v.sharding
    assert abs(float(amp_v) - float(ref_v)) < 0.01 * float(ref_v)


def gpt_loss_batch(params, tokens):
    """gpt_loss on a batch of any size (vmapped over groups of B)."""
    groups = tokens.reshape(-1, B, T + 1)
    return jax.vmap(gpt_loss, in_axes=(None, 0))(params, groups).mean()


def test_shard_map_train_step_keeps_shardings():
    mesh = _mesh()
    tokens = jax.random.randint(K[2], (8 * B, T + 1), 0, V)
    params = gpt_params()

    def make(loss):
        def local(params, tokens):
            value, grads = jax.value_and_grad(loss)(params, tokens)
            grads = lax.pmean(grads, "data")
            new = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
            return new, lax.pmean(value, "data")

        return jax.jit(
            jax.shard_map(
                local, mesh=mesh, in_specs=(P(), P("data")), out_specs=(P(), P())
            )
        )

    ref_p, ref_v = make(gpt_loss)(params, tokens)
    amp_step = make(jaxamp.amp(gpt_loss, compute_dtype=BF16))
    amp_p, amp_v = amp_step(params, tokens)
    for a, b in zip(jax.tree.leaves(amp_p), jax.tree.leaves(ref_p)):
        assert a.sharding == b.sharding and a.dtype == b.dtype
        np.testing.assert_allclose(a, b, atol=5e-3)
    assert amp_v.sharding == ref_v.sharding
    assert abs(float(amp_v) - float(ref_v)) < 0.01 * float(ref_v)
    # amp also works around the whole shard_map (its body is rewritten).
    outer = jaxamp.amp(make(gpt_loss), compute_dtype=BF16)
    closed = jax.make_jaxpr(outer)(params, tokens)
    assert jaxamp.low_precision_flop_share(closed) == 1.0
