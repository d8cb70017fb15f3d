"""Tests of FP8 matmuls (jaxamp/_fp8.py); XLA:CPU emulates the float8 products."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jaxamp

E4M3, E5M2 = np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2)
F32, BF16 = np.dtype(jnp.float32), np.dtype(jnp.bfloat16)
DN = (((1,), (0,)), ((), ()))
U_E4M3 = 2.0**-4  # unit roundoff: 3 mantissa bits
HALF_SUBNORMAL_E4M3 = 2.0**-10  # half the spacing of e4m3fn subnormals (2**-9)


def representable(key, shape, amax):
    """Random values exactly representable after scaling by 448 / amax = 1."""
    x = jax.random.normal(key, shape).astype(E4M3).astype(F32)
    return x.at[0, 0].set(amax)


def test_products_of_representable_inputs_are_exact():
    x = representable(jax.random.key(0), (8, 32), 448.0)
    w = representable(jax.random.key(1), (32, 16), 448.0)
    out = jaxamp.fp8_dot_general(x, w, DN, F32)
    # Products of e4m3 values are exact in float32; only summation order differs.
    np.testing.assert_allclose(out, x @ w, rtol=1e-6, atol=1e-3)


def test_random_inputs_within_the_fp8_error_bound():
    x = jax.random.normal(jax.random.key(2), (16, 64))
    w = jax.random.normal(jax.random.key(3), (64, 8)) * 3.0
    out = jaxamp.fp8_dot_general(x, w, DN, F32)
    _, sx = jaxamp.quantize(x, E4M3)
    _, sw = jaxamp.quantize(w, E4M3)
    # |fl(a) fl(b) - ab| <= (2u + u^2)|a||b| + da|b| + db|a| + da db, where
    # da, db are the absolute errors of subnormals (in unscaled units).
    da, db = HALF_SUBNORMAL_E4M3 / sx, HALF_SUBNORMAL_E4M3 / sw
    ax, aw = jnp.abs(x), jnp.abs(w)
    bound = (
        (2 * U_E4M3 + U_E4M3**2) * (ax @ aw) + da * aw.sum(0) + db * ax.sum(1)[:, None]
    )
    bound = bound + da * db * x.shape[1]
    err = jnp.abs(out - x @ w)
    assert bool(jnp.all(err <= bound * 1.001 + 1e-5))
    assert float(err.max()) > 0  # it really is quantized


def test_zeros_large_and_non_finite_inputs():
    z = jnp.zeros((4, 8))
    w = jax.random.normal(jax.random.key(4), (8, 3))
    assert float(jnp.abs(jaxamp.fp8_dot_general(z, w, DN, F32)).max()) == 0.0
    big = jax.random.normal(jax.random.key(5), (4, 8)) * 1e30
    out = jaxamp.fp8_dot_general(big, w, DN, F32)
    ref = np.asarray(big, np.float64) @ np.asarray(w, np.float64)
    assert bool(jnp.all(jnp.isfinite(out)))
    out64 = np.asarray(out, np.float64)
    rel = np.linalg.norm(out64 - ref) / np.linalg.norm(ref)
    assert rel < 4 * U_E4M3
    for bad in (jnp.inf, jnp.nan):
        x = z.at[1, 2].set(bad)
        assert not bool(jnp.all(jnp.isfinite(jaxamp.fp8_dot_general(x, w, DN, F32))))


def test_quantize_scales_to_the_format_maximum():
    x = jnp.array([[-2.0, 0.5], [1.0, 0.25]])
    q, s = jaxamp.quantize(x, E4M3)
    assert q.dtype == E4M3 and float(s) == 448.0 / 2.0
    assert float(jnp.abs(q.astype(F32)).max()) == 448.0
    _, s1 = jaxamp.quantize(x, E4M3, margin=1)
    assert float(s1) == float(s) / 2


def _model(ws, x):
    @jax.custom_vjp
    def ident(h):
        return h

    ident.defvjp(lambda h: (h, None), lambda _, g: (g,))

    def layer(h, w):
        h = jax.jit(lambda a: jnp.tanh(a @ w))(h)
        with jax.named_scope("mlp"):
            h = ident(h) @ w.T
        return h, None

    h, _ = lax.scan(layer, x, ws)
    return jnp.square(h).mean()


WS = jax.random.normal(jax.random.key(6), (2, 16, 16)) * 0.25
X = jax.random.normal(jax.random.key(7), (8, 16))


def test_forward_and_backward_dots_take_float8_operands():
    f = jaxamp.amp(_model, compute_dtype=BF16, amp_policy=jaxamp.fp8_amp_policy)
    table = jaxamp.primitive_dtypes(jax.make_jaxpr(jax.grad(f))(WS, X))
    dots = [ins for name, ins, _ in table if name == "dot_general"]
    assert len(dots) == 2 + 2 * 2  # forward, and two gradient products per matmul
    fwd = [d for d in dots if d == (E4M3, E4M3)]
    bwd = [d for d in dots if set(d) == {E4M3, E5M2}]
    assert len(fwd) == 2 and len(bwd) == 4
    assert (E5M2, E5M2) not in dots


def test_fp8_gradients_close_to_float32():
    f = jaxamp.amp(_model, compute_dtype=BF16, amp_policy=jaxamp.fp8_amp_policy)
    g, g_ref = jax.grad(f)(WS, X), jax.grad(_model)(WS, X)
    rel = float(jnp.linalg.norm(g - g_ref) / jnp.linalg.norm(g_ref))
    # E5M2 gradients carry a unit roundoff of 2**-3 (RMS ~ 2**-3 / sqrt(3)).
    assert rel < 0.15, rel
    assert abs(float(f(WS, X)) - float(_model(WS, X))) < 0.05 * float(_model(WS, X))


def test_per_scope_selection_with_nested_policies():
    only_mlp = {**jaxamp.default_amp_policy, "mlp": jaxamp.fp8_amp_policy}
    f = jaxamp.amp(_model, compute_dtype=BF16, amp_policy=only_mlp)
    table = jaxamp.primitive_dtypes(jax.make_jaxpr(f)(WS, X))
    assert [ins for n, ins, _ in table if n == "dot_general"] == [
        (BF16, BF16),
        (E4M3, E4M3),
    ]
    all_but_mlp = {**jaxamp.fp8_amp_policy, "mlp": jaxamp.default_amp_policy}
    f = jaxamp.amp(_model, compute_dtype=BF16, amp_policy=all_but_mlp)
    table = jaxamp.primitive_dtypes(jax.make_jaxpr(f)(WS, X))
    assert [ins for n, ins, _ in table if n == "dot_general"] == [
        (E4M3, E4M3),
        (BF16, BF16),
    ]


def test_integer_matmul_is_not_quantized():
    f = lambda a, b: a @ b
    i = jnp.arange(6, dtype=jnp.int32).reshape(2, 3)
    out = jaxamp.amp(f, compute_dtype=BF16, amp_policy=jaxamp.fp8_amp_policy)(i, i.T)
    np.testing.assert_array_equal(out, i @ i.T)


@pytest.mark.parametrize("margin", [0, 2])
def test_fp8_rule_margin(margin):
    rule = jaxamp.fp8_rule(margin=margin)
    assert rule.amp_impl
    x = jax.random.normal(jax.random.key(8), (4, 8))
    out = rule(
        F32,
        [F32, F32],
        x,
        x.T,
        dimension_numbers=DN,
        precision=None,
        preferred_element_type=F32,
    )
    assert out.dtype == F32
    np.testing.assert_allclose(out, x @ x.T, rtol=0.2, atol=0.3)
