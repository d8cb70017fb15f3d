"""The sums JAX derives when differentiating amp's low-precision equations run
in float32, without extra residuals and with the same values."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import rel_l2

import jaxamp

BF16, F16, F32 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32)
K = jax.random.split(jax.random.key(3), 6)


def rounded(key, shape, dtype=BF16, scale=1.0):
    """Float32 values exactly representable in ``dtype``."""
    return (scale * jax.random.normal(key, shape)).astype(dtype).astype(F32)


X = rounded(K[0], (64, 16))
W = rounded(K[1], (16, 32), scale=0.25)
G = rounded(K[2], (32,)) + 1.0
BIAS = rounded(K[3], (32,))


def layer(x, w, g, b):
    """Bias add, a subtracted row mean, a gain, a divided row norm: every kind
    of implicit size-1 / rank-0 broadcast a model has."""
    h = x @ w + b
    h = h - h.mean(-1, keepdims=True)
    h = h / jnp.sqrt((h * h).mean(-1, keepdims=True) + 1e-5)
    return h * g


def loss(x, w, g, b):
    # The layer feeds a matmul (not the float32 loss chain after the last one).
    h = layer(x, w, g, b) + jnp.max(x @ w, axis=-1, keepdims=True)
    return ((h @ w.T) ** 2).mean()


def low_sums(closed):
    """Low-precision reduce_sums that add more than one term (a sum over size-1
    axes, the transpose of a keepdims broadcast, is exact in any dtype)."""
    out = []
    for e, _ in jaxamp.tools.iter_equations(closed):
        if e.primitive.name != "reduce_sum":
            continue
        (x,), (y,) = e.invars, e.outvars
        terms = np.prod([x.aval.shape[a] for a in e.params["axes"]])
        if terms > 1 and min(x.aval.dtype.itemsize, y.aval.dtype.itemsize) < 4:
            out.append((x.aval.dtype, y.aval.dtype))
    return out


@pytest.mark.parametrize("compute", [BF16, F16], ids=["bf16", "f16"])
def test_backward_sums_of_broadcasts_run_in_float32(compute):
    grad = jax.grad(jaxamp.amp(loss, compute_dtype=compute), argnums=(0, 1, 2, 3))
    closed = jax.make_jaxpr(grad)(X, W, G, BIAS)
    sums = [n for n, _, _ in jaxamp.tools.primitive_dtypes(closed) if n == "reduce_sum"]
    assert len(sums) >= 8  # the forward statistics and the backward sums
    assert low_sums(closed) == []
    # The elementwise ops still run in the compute dtype.
    muls = [i for n, i, _ in jaxamp.tools.primitive_dtypes(closed) if n == "mul"]
    assert any(i == (compute, compute) for i in muls)


def test_without_the_wrappers_the_backward_sums_would_be_low():
    """The check above can fail: the same function cast by hand to bfloat16
    (what amp binds, minus the wrappers) has bfloat16 backward sums."""

    def by_hand(x, w, g, b):
        x, w, g, b = (a.astype(BF16) for a in (x, w, g, b))
        return ((x @ w + b) * g).astype(F32).sum()

    closed = jax.make_jaxpr(jax.grad(by_hand, argnums=(2, 3)))(X, W, G, BIAS)
    assert len(low_sums(closed)) >= 2


@pytest.mark.parametrize("compute", [BF16, F16], ids=["bf16", "f16"])
def test_gradients_close_to_float32(compute):
    grads = jax.grad(jaxamp.amp(loss, compute_dtype=compute), argnums=(0, 1, 2, 3))(
        X, W, G, BIAS
    )
    ref = jax.grad(loss, argnums=(0, 1, 2, 3))(X, W, G, BIAS)
    assert [g.dtype for g in grads] == [F32] * 4
    # 16-bit activations through a normalisation: a few 2**-8 roundings.
    assert rel_l2(grads, ref) < 0.03
    for a, b in zip(grads, ref):
        assert rel_l2([a], [b]) < 0.05


def test_forward_mode_and_second_order():
    f = jaxamp.amp(lambda g, b: (layer(X, W, g, b) ** 2).sum(), compute_dtype=BF16)
    ref = lambda g, b: (layer(X, W, g, b) ** 2).sum()  # noqa: E731
    tg, tb = rounded(K[4], G.shape), rounded(K[5], BIAS.shape)
    _, t = jax.jvp(f, (G, BIAS), (tg, tb))
    _, t_ref = jax.jvp(ref, (G, BIAS), (tg, tb))
    assert t.dtype == F32
    np.testing.assert_allclose(t, t_ref, rtol=0.03)
    h = jax.hessian(f)(G, BIAS)
    h_ref = jax.hessian(ref)(G, BIAS)
    assert rel_l2([h], [h_ref]) < 0.05


def test_no_extra_residuals():
    """The wrappers save what the same bfloat16 computation saves by hand.
    (``h`` minus the mean of *another* value: a centring ``h - mean(h)`` runs in
    float32 by design, tests/test_facts.py.)"""

    def f(x, w, g, b):
        h = x @ w + b
        h = (h - (x @ w).mean(-1, keepdims=True)) * g / (1.0 + b * b)
        return (h @ w.T).astype(F32).sum()  # feeds a matmul: not the loss chain

    def by_hand(x, w, g, b):
        return f(*(a.astype(BF16) for a in (x, w, g, b)))

    amp_bytes = jaxamp.saved_residual_bytes(
        jaxamp.amp(f, compute_dtype=BF16), X, W, G, BIAS
    )
    hand_bytes = jaxamp.saved_residual_bytes(by_hand, X, W, G, BIAS)
    assert amp_bytes <= hand_bytes


def test_max_ties_share_the_gradient_with_float32_counts():
    """reduce_max's JVP divides the tangent among tied maxima; the count is a
    float32 sum (a bfloat16 count of 301 ties would round to 300)."""
    x = jnp.ones((4, 8), F32)
    w = jnp.ones((8, 301), F32)  # every column of x @ w ties
    f = jaxamp.amp(lambda x, w: jnp.max(x @ w, axis=-1).sum(), compute_dtype=BF16)
    closed = jax.make_jaxpr(jax.grad(f, argnums=1))(x, w)
    assert low_sums(closed) == []
    gw = jax.grad(f, argnums=1)(x, w)
    ref = jax.grad(lambda x, w: jnp.max(x @ w, axis=-1).sum(), argnums=1)(x, w)
    np.testing.assert_allclose(gw, ref, rtol=2**-8)


def test_float32_compute_binds_plain_primitives():
    closed = jax.make_jaxpr(jaxamp.amp(loss, compute_dtype=F32))(X, W, G, BIAS)
    names = {n for n, _, _ in jaxamp.tools.primitive_dtypes(closed)}
    assert "custom_jvp_call" not in names
