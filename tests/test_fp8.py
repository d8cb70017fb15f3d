"""Tests of FP8 matmuls (jaxamp/_fp8.py); XLA:CPU emulates the float8 products.

Error model used by the bounds below. Rounding to a float format with ``p``
mantissa bits has relative error at most ``u = 2**-(p+1)`` for normal values
(E4M3: ``p = 3``, ``u = 2**-4``; E5M2: ``p = 2``, ``u = 2**-3``) and absolute
error at most half the subnormal spacing ``d`` below the smallest normal
(E4M3: ``2**-10``; E5M2: ``2**-17``), in the scaled units the cast sees; in the
caller's units ``d`` is divided by the tensor's scale. Hence for one product

    |fl(a) fl(b) - a b| <= (ua + ub + ua ub)|a||b| + (1 + ua)|a| db
                           + (1 + ub) da |b| + da db,

summed over the contraction, plus float32 accumulation (``K * 2**-24`` of the
sum of absolute products for ``K`` terms) and rounding of the scaling steps.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jaxamp
from jaxamp import _amp

E4M3, E5M2 = np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2)
F32, BF16 = np.dtype(jnp.float32), np.dtype(jnp.bfloat16)
DN = (((1,), (0,)), ((), ()))  # x @ w
U = {E4M3: 2.0**-4, E5M2: 2.0**-3}  # unit roundoff: 3 and 2 mantissa bits
HALF_SUBNORMAL = {E4M3: 2.0**-10, E5M2: 2.0**-17}  # half the subnormal spacing
# The test models are small: without a size rule every matmul runs in FP8.
FP8_ALL = jaxamp.fp8_policy(size_rule=None, quantize_last_matmul=True)


def matmul_error_bound(a, b, fmt_a=E4M3, fmt_b=E4M3, scale_a=None, scale_b=None):
    """Elementwise bound on |fp8(a) @ fp8(b) - a @ b| (module docstring), in
    float64 numpy."""
    if scale_a is None:
        scale_a = jaxamp.quant.fp8_quantize(a, fmt_a)[1]
    if scale_b is None:
        scale_b = jaxamp.quant.fp8_quantize(b, fmt_b)[1]
    ua, ub = U[fmt_a], U[fmt_b]
    da = HALF_SUBNORMAL[fmt_a] / float(scale_a)
    db = HALF_SUBNORMAL[fmt_b] / float(scale_b)
    aa, ab = np.abs(np.asarray(a, np.float64)), np.abs(np.asarray(b, np.float64))
    k = aa.shape[-1]
    prod = aa @ ab
    bound = (
        (ua + ub + ua * ub) * prod
        + (1 + ua) * db * aa.sum(-1)[:, None]
        + (1 + ub) * da * ab.sum(0)[None, :]
        + da * db * k
    )
    # float32 accumulation and the (at most 4) float32 roundings of scaling.
    return bound + (k + 4) * 2.0**-24 * (1 + ua) * (1 + ub) * prod * 1.01


def f64(x):
    return np.asarray(x, np.float64)


def representable(key, shape, amax):
    """Random float32 values exactly representable in E4M3, max |x| = amax."""
    x = jax.random.normal(key, shape).astype(E4M3).astype(F32)
    return x.at[0, 0].set(amax)


def test_products_of_representable_inputs_are_exact():
    # amax 448: scale 1, so quantization is the identity.
    x = representable(jax.random.key(0), (8, 32), 448.0)
    w = representable(jax.random.key(1), (32, 16), 448.0)
    out = jaxamp.quant.fp8_dot_general(x, w, DN, F32)
    # Products of e4m3 values are exact in float32; only summation order differs:
    # at most K * 2**-24 of the sum of |products|.
    tol = 32 * 2.0**-24 * (np.abs(f64(x)) @ np.abs(f64(w)))
    assert np.all(np.abs(f64(out) - f64(x) @ f64(w)) <= tol)


def test_random_inputs_within_the_fp8_error_bound():
    x = jax.random.normal(jax.random.key(2), (16, 64))
    w = jax.random.normal(jax.random.key(3), (64, 8)) * 3.0
    out = jaxamp.quant.fp8_dot_general(x, w, DN, F32)
    err = np.abs(f64(out) - f64(x) @ f64(w))
    assert np.all(err <= matmul_error_bound(x, w))
    assert err.max() > 0  # it really is quantized


def test_power_of_two_scales_are_exact_on_scaled_representable_inputs():
    # amax 320 * 2**-20: the plain scale 1.4 * 2**20 re-rounds every element;
    # the power-of-two scale 2**20 maps the values onto E4M3 exactly.
    x = representable(jax.random.key(9), (8, 32), 320.0) * 2.0**-20
    w = representable(jax.random.key(10), (32, 16), 320.0)
    q, s = jaxamp.quant.fp8_quantize(x, E4M3, power_of_two=True)
    assert float(s) == 2.0**20
    _, s_plain = jaxamp.quant.fp8_quantize(x, E4M3)
    assert float(s) <= float(s_plain) < 2 * float(s)
    ref = f64(x) @ f64(w)
    tol = 32 * 2.0**-24 * (np.abs(f64(x)) @ np.abs(f64(w)))
    exact = jaxamp.quant.fp8_dot_general(x, w, DN, F32, 0, True)
    assert np.all(np.abs(f64(exact) - ref) <= tol)
    plain = jaxamp.quant.fp8_dot_general(x, w, DN, F32)
    assert np.abs(f64(plain) - ref).max() > 10 * tol.max()


def test_zeros_large_and_non_finite_inputs():
    z = jnp.zeros((4, 8))
    w = jax.random.normal(jax.random.key(4), (8, 3))
    assert float(jnp.abs(jaxamp.quant.fp8_dot_general(z, w, DN, F32)).max()) == 0.0
    big = jax.random.normal(jax.random.key(5), (4, 8)) * 1e30
    out = jaxamp.quant.fp8_dot_general(big, w, DN, F32)
    assert bool(jnp.all(jnp.isfinite(out)))
    err = np.abs(f64(out) - f64(big) @ f64(w))
    assert np.all(err <= matmul_error_bound(big, w))
    for bad in (jnp.inf, -jnp.inf, jnp.nan):
        x = z.at[1, 2].set(bad)
        out = jaxamp.quant.fp8_dot_general(x, w, DN, F32)
        assert not bool(jnp.all(jnp.isfinite(out[1])))


@pytest.mark.parametrize("sx, sw", [(1e-37, 1.0), (1e-17, 1e-17), (1e19, 1e-19)])
def test_tiny_scales_neither_overflow_nor_vanish(sx, sw):
    # 448 / 1e-37 overflows float32 and (448 / 1e-17)**2 does too: products of
    # the scales must never be formed, and scales are capped at 2**126.
    x = jax.random.normal(jax.random.key(11), (4, 8)) * sx
    w = jax.random.normal(jax.random.key(12), (8, 3)) * sw
    out = jaxamp.quant.fp8_dot_general(x, w, DN, F32)
    assert bool(jnp.all(jnp.isfinite(out)))
    ref = f64(x) @ f64(w)
    assert np.all(np.abs(f64(out) - ref) <= matmul_error_bound(x, w))
    assert np.all(np.abs(ref) > 0) and np.all(np.abs(f64(out)) > 0)


def test_quantize_scales_to_the_format_maximum():
    x = jnp.array([[-2.0, 0.5], [1.0, 0.25]])
    q, s = jaxamp.quant.fp8_quantize(x, E4M3)
    assert q.dtype == E4M3 and float(s) == 448.0 / 2.0
    assert float(jnp.abs(q.astype(F32)).max()) == 448.0
    q1, s1 = jaxamp.quant.fp8_quantize(x, E4M3, margin=1)
    assert float(s1) == float(s) / 2
    assert float(jnp.abs(q1.astype(F32)).max()) == 224.0
    q5, s5 = jaxamp.quant.fp8_quantize(x, E5M2)
    assert q5.dtype == E5M2 and float(s5) == 57344.0 / 2.0
    _, s0 = jaxamp.quant.fp8_quantize(jnp.zeros(3), E4M3)
    assert float(s0) == 1.0


def test_gradients_are_fp8_products_within_their_bound():
    x = jax.random.normal(jax.random.key(13), (16, 32))
    w = jax.random.normal(jax.random.key(14), (32, 8)) * 0.5
    g = jax.random.normal(jax.random.key(15), (16, 8)) * 1e-3
    out, vjp = jax.vjp(lambda a, b: jaxamp.quant.fp8_dot_general(a, b, DN, F32), x, w)
    dx, dw = vjp(g)
    assert out.dtype == F32 and dx.dtype == F32 and dw.dtype == F32
    # dx = g @ w.T (E5M2 x E4M3), dw = x.T @ g (E4M3 x E5M2).
    sx, sw = (
        jaxamp.quant.fp8_quantize(x, E4M3)[1],
        jaxamp.quant.fp8_quantize(w, E4M3)[1],
    )
    err_dx = np.abs(f64(dx) - f64(g) @ f64(w).T)
    err_dw = np.abs(f64(dw) - f64(x).T @ f64(g))
    assert np.all(err_dx <= matmul_error_bound(g, w.T, E5M2, E4M3, None, sw))
    assert np.all(err_dw <= matmul_error_bound(x.T, g, E4M3, E5M2, sx, None))
    assert err_dx.max() > 0 and err_dw.max() > 0  # really quantized


def test_non_finite_cotangent_reaches_the_gradients():
    x = jax.random.normal(jax.random.key(16), (4, 8))
    w = jax.random.normal(jax.random.key(17), (8, 3))
    _, vjp = jax.vjp(lambda a, b: jaxamp.quant.fp8_dot_general(a, b, DN, BF16), x, w)
    g = jnp.ones((4, 3), BF16).at[2, 1].set(jnp.inf)
    grads = vjp(g)
    assert not bool(jaxamp.all_finite(grads))
    assert bool(jaxamp.all_finite(vjp(jnp.ones((4, 3), BF16))))


def test_batched_dimension_numbers_match_float32_gradients():
    # Attention scores: "bqd,bkd->bqk" with a batch dimension.
    dn = (((2,), (2,)), ((0,), (0,)))
    q = jax.random.normal(jax.random.key(18), (3, 5, 16))
    k = jax.random.normal(jax.random.key(19), (3, 7, 16))

    def loss(dot, a, b):
        return jnp.square(dot(a, b)).mean()

    fp8 = lambda a, b: jaxamp.quant.fp8_dot_general(a, b, dn, F32)
    ref = lambda a, b: lax.dot_general(a, b, dn)
    out = fp8(q, k)
    assert out.shape == (3, 5, 7)
    # Relative L2 error: each operand's rounding error is at most u relative
    # and roughly uniform, so about sqrt(2/3) u = 0.05 for the product
    # (measured 0.039); 2u leaves room without accepting a broken scale.
    rel = jnp.linalg.norm(out - ref(q, k)) / jnp.linalg.norm(ref(q, k))
    assert float(rel) < 2 * U[E4M3]
    g8 = jax.jit(jax.grad(lambda a, b: loss(fp8, a, b), (0, 1)))(q, k)
    g32 = jax.jit(jax.grad(lambda a, b: loss(ref, a, b), (0, 1)))(q, k)
    for a, b in zip(g8, g32):
        assert a.shape == b.shape and a.dtype == F32
        rel = float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))
        # The forward error (about 0.05, above) enters the cotangent, then the
        # E5M2 x E4M3 products add about sqrt(((2**-3)**2 + (2**-4)**2) / 3) =
        # 0.09 RMS (measured 0.08 for both); 0.3 bounds the sum with room.
        assert rel < 0.3, rel


def test_data_parallel_scales_are_global():
    # Under jit with a batch-sharded input the amax reduction spans all shards,
    # so the sharded FP8 step quantizes exactly like the unsharded one: only
    # float32 summation order differs.
    from jax.sharding import AxisType, NamedSharding, PartitionSpec

    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    x = jax.random.normal(jax.random.key(23), (64, 32))
    w = jax.random.normal(jax.random.key(24), (32, 16))
    c = jax.random.normal(jax.random.key(25), (64, 16))

    def loss(w, x, c):
        return jnp.sum(jaxamp.quant.fp8_dot_general(x, w, DN, F32) * c)

    step = jax.jit(jax.value_and_grad(loss, (0, 1)))
    ref_v, ref_g = step(w, x, c)
    shard = NamedSharding(mesh, PartitionSpec("data"))
    v, g = step(w, jax.device_put(x, shard), jax.device_put(c, shard))
    assert g[1].sharding.spec == PartitionSpec("data")
    np.testing.assert_allclose(v, ref_v, rtol=1e-5)
    for a, b in zip(g, ref_g):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * float(jnp.abs(b).max()))


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


def _dot_dtypes(closed):
    """Operand dtypes of every dot_general, and how many sit in sub-jaxprs."""
    top = {id(e) for e in closed.eqns}  # the outermost jaxpr's own equations
    dots, nested = [], 0
    for eqn, _ in jaxamp.tools.iter_equations(closed):
        if eqn.primitive.name == "dot_general":
            dots.append(tuple(np.dtype(v.aval.dtype) for v in eqn.invars))
            nested += id(eqn) not in top
    return dots, nested


def test_forward_and_backward_dots_take_float8_operands():
    f = jaxamp.amp(_model, compute_dtype=BF16, amp_policy=FP8_ALL)
    dots, nested = _dot_dtypes(jax.make_jaxpr(jax.grad(f))(WS, X))
    assert len(dots) == 2 + 2 * 2  # forward, and two gradient products per matmul
    assert nested == len(dots)  # all inside scan / jit / custom_vjp bodies
    fwd = [d for d in dots if d == (E4M3, E4M3)]
    bwd = [d for d in dots if sorted(map(str, d)) == ["float8_e4m3fn", "float8_e5m2"]]
    assert len(fwd) == 2 and len(bwd) == 4
    assert (E5M2, E5M2) not in dots


def test_fp8_gradients_close_to_float32():
    f = jaxamp.amp(_model, compute_dtype=BF16, amp_policy=FP8_ALL)
    (v, g), (v_ref, g_ref) = (
        jax.jit(jax.value_and_grad(f))(WS, X),
        jax.jit(jax.value_and_grad(_model))(WS, X),
    )
    rel = float(jnp.linalg.norm(g - g_ref) / jnp.linalg.norm(g_ref))
    # E5M2 gradients carry a unit roundoff of 2**-3 (RMS ~ 2**-3 / sqrt(3)),
    # E4M3 operands 2**-4, through two layers; measured 0.08.
    assert rel < 0.15, rel
    assert abs(float(v) - float(v_ref)) < 0.05 * float(v_ref)


def _dots(f):
    table = jaxamp.tools.primitive_dtypes(jax.make_jaxpr(f)(WS, X))
    return [ins for n, ins, _ in table if n == "dot_general"]


def test_per_scope_selection_with_nested_policies():
    only_mlp = {**jaxamp.default_amp_policy, "mlp": FP8_ALL}
    f = jaxamp.amp(_model, compute_dtype=BF16, amp_policy=only_mlp)
    assert _dots(f) == [(BF16, BF16), (E4M3, E4M3)]
    all_but_mlp = {**FP8_ALL, "mlp": jaxamp.default_amp_policy}
    f = jaxamp.amp(_model, compute_dtype=BF16, amp_policy=all_but_mlp)
    assert _dots(f) == [(E4M3, E4M3), (BF16, BF16)]


def _scoped_model(ws, x):
    with jax.named_scope("embed"):
        h = x @ ws[0]
    with jax.named_scope("block"):
        with jax.named_scope("mlp"):
            h = jnp.tanh(h @ ws[1])
            with jax.named_scope("head"):
                h = h @ ws[0]
        with jax.named_scope("mlp_out"):  # not "mlp": whole components only
            h = h @ ws[1]
    return jnp.square(h).mean()


@pytest.mark.parametrize(
    "kwargs, expected",
    [
        ({}, ["fp8", "fp8", "fp8", "fp8"]),
        ({"exclude_scopes": ("embed", "head")}, ["bf16", "fp8", "bf16", "fp8"]),
        ({"scopes": ("mlp",)}, ["bf16", "fp8", "fp8", "bf16"]),
        (
            {"scopes": ("mlp",), "exclude_scopes": ("head",)},
            ["bf16", "fp8", "bf16", "bf16"],
        ),
        (
            {"scopes": ("block",), "exclude_scopes": ("mlp",)},
            ["bf16", "bf16", "bf16", "fp8"],
        ),
    ],
)
def test_fp8_policy_scopes(kwargs, expected):
    policy = jaxamp.fp8_policy(**kwargs, size_rule=None, quantize_last_matmul=True)
    f = jaxamp.amp(_scoped_model, compute_dtype=BF16, amp_policy=policy)
    names = {(E4M3, E4M3): "fp8", (BF16, BF16): "bf16"}
    assert [names[d] for d in _dots(f)] == expected
    # Other primitives in an FP8 scope keep the default rules: tanh follows bf16,
    # the final sum of squares runs in float32.
    table = jaxamp.tools.primitive_dtypes(jax.make_jaxpr(f)(WS, X))
    assert [ins for n, ins, _ in table if n == "tanh"] == [(BF16,)]
    assert [ins for n, ins, _ in table if n == "reduce_sum"] == [(F32,)]


def test_fp8_policy_rejects_a_bare_string():
    with pytest.raises(TypeError, match=r"\('mlp',\)"):
        jaxamp.fp8_policy(scopes="mlp")
    with pytest.raises(TypeError, match="exclude_scopes"):
        jaxamp.fp8_policy(exclude_scopes="head")


def test_quantize_rejects_a_dtype_that_is_not_8_bit():
    with pytest.raises(ValueError, match="dtype must be an 8-bit float"):
        jaxamp.quant.fp8_quantize(jnp.ones(3), jnp.float16)


def test_fp8_policy_equals_the_preset():
    policy = jaxamp.fp8_policy()
    assert policy.keys() == jaxamp.fp8_amp_policy.keys()
    assert policy["dot_general"].amp_impl
    for key, rule in jaxamp.default_amp_policy.items():
        if key != "dot_general":
            assert policy[key] is rule


def test_integer_matmul_is_not_quantized():
    f = lambda a, b: a @ b
    i = jnp.arange(6, dtype=jnp.int32).reshape(2, 3)
    out = jaxamp.amp(f, compute_dtype=BF16, amp_policy=FP8_ALL)(i, i.T)
    np.testing.assert_array_equal(out, i @ i.T)


def test_user_quantized_operands_are_bound_unchanged():
    def f(a, b):
        a8, b8 = a.astype(E4M3), b.astype(E5M2)
        return lax.dot_general(a8, b8, DN, preferred_element_type=F32)

    x = jax.random.normal(jax.random.key(20), (4, 8))
    w = jax.random.normal(jax.random.key(21), (8, 3))
    g = jaxamp.amp(f, compute_dtype=BF16, amp_policy=FP8_ALL)
    table = jaxamp.tools.primitive_dtypes(jax.make_jaxpr(g)(x, w))
    assert [(i, o) for n, i, o in table if n == "dot_general"] == [
        ((E4M3, E5M2), (F32,))
    ]
    np.testing.assert_array_equal(g(x, w), f(x, w))


@pytest.mark.parametrize("margin, power_of_two", [(0, False), (2, False), (1, True)])
def test_fp8_rule_options(margin, power_of_two):
    rule = jaxamp.quant.fp8_rule(
        margin=margin,
        power_of_two=power_of_two,
        size_rule=None,
        quantize_last_matmul=True,
    )
    assert rule.amp_impl
    x = jax.random.normal(jax.random.key(8), (4, 8))
    w = jax.random.normal(jax.random.key(22), (8, 5))
    params = dict(dimension_numbers=DN, precision=None, preferred_element_type=F32)
    out = rule(F32, [F32, F32], x, w, **params)
    assert out.dtype == F32
    sx = jaxamp.quant.fp8_quantize(x, E4M3, margin, power_of_two)[1]
    sw = jaxamp.quant.fp8_quantize(w, E4M3, margin, power_of_two)[1]
    assert float(sx) * float(jnp.abs(x).max()) <= 448.0 / 2**margin * (1 + 1e-6)
    bound = matmul_error_bound(x, w, scale_a=sx, scale_b=sw)
    assert np.all(np.abs(f64(out) - f64(x) @ f64(w)) <= bound)
    assert rule(BF16, [F32, F32], x, w, **params).dtype == BF16


def test_default_size_rule_keeps_small_matmuls_in_the_compute_dtype():
    # torchao's tensorwise filter: skip K <= 4096 and N <= 1024.
    def f(x, w_small, w_wide):
        return jnp.sum(x @ w_small) + jnp.sum(x @ w_wide)

    x = jnp.ones((8, 64))
    args = (x, jnp.ones((64, 16)), jnp.ones((64, 1040)))
    g = jaxamp.amp(
        f, compute_dtype=BF16, amp_policy=jaxamp.fp8_policy(quantize_last_matmul=True)
    )
    assert _dots_of(g, *args) == [(BF16, BF16), (E4M3, E4M3)]
    report = jaxamp.quantization_report(g, *args)
    assert [(r.shape, r.format, r.reason) for r in report] == [
        ((1, 8, 64, 16), "bfloat16", "below the size rule"),
        ((1, 8, 64, 1040), "fp8", ""),
    ]
    small = jaxamp.fp8_policy(
        size_rule=jaxamp.quant.min_matmul_size(n=17), quantize_last_matmul=True
    )
    g = jaxamp.amp(f, compute_dtype=BF16, amp_policy=small)
    assert _dots_of(g, *args) == [(BF16, BF16), (E4M3, E4M3)]
    g = jaxamp.amp(f, compute_dtype=BF16, amp_policy=FP8_ALL)
    assert _dots_of(g, *args) == [(E4M3, E4M3), (E4M3, E4M3)]
    with pytest.raises(TypeError, match="size_rule"):
        jaxamp.fp8_policy(size_rule=1024)


def _dots_of(f, *args):
    table = jaxamp.tools.primitive_dtypes(jax.make_jaxpr(f)(*args))
    return [ins for n, ins, _ in table if n == "dot_general"]


def test_fp8_residuals_are_the_float8_operands():
    # The backward pass saves the E4M3 operands (1 byte per element) and their
    # scalar scales: the activation's residual is half its bf16 copy; the
    # weight costs its E4M3 copy, which the bf16 policy avoids by re-casting
    # the float32 argument, so activations must outweigh weights to gain.
    x = jax.random.normal(jax.random.key(30), (1024, 128))
    w = jax.random.normal(jax.random.key(31), (128, 128))

    def loss(x, w):
        return jnp.sum(jnp.tanh(x) @ w)

    res8 = jaxamp.saved_residual_bytes(
        jaxamp.amp(loss, compute_dtype=BF16, amp_policy=FP8_ALL), x, w
    )
    res16 = jaxamp.saved_residual_bytes(jaxamp.amp(loss, compute_dtype=BF16), x, w)
    # bf16 activation copy (2 bytes) -> E4M3 (1 byte), plus the E4M3 weight
    # and two float32 scales.
    assert res8 == res16 - 1024 * 128 + 128 * 128 + 8


def test_fp8_products_return_bf16_and_read_bf16_weights():
    # Every FP8 product (forward, input and weight gradients) asks for a bf16
    # result, the pattern XLA folds into one cuBLASLt FP8 call with its scales;
    # the float32 weights are cast to bf16 before they are quantized.
    @jax.checkpoint
    def layer(h, w):
        return jnp.tanh(h @ w) @ w, None

    def model(ws, x):  # checkpointed layers: their weight casts leave the loop
        return jnp.square(lax.scan(layer, x, ws)[0]).mean()

    f = jaxamp.amp(model, compute_dtype=BF16, amp_policy=FP8_ALL)
    closed = jax.make_jaxpr(jax.grad(f))(WS, X)
    outs, reads, writes = [], [], []
    for eqn, _ in jaxamp.tools.iter_equations(closed):
        if eqn.primitive.name == "dot_general":
            outs.append(np.dtype(eqn.outvars[0].aval.dtype))
        if eqn.primitive.name == "scan":  # the stacked weights and their gradients
            reads += [
                np.dtype(v.aval.dtype) for v in eqn.invars if v.aval.shape == WS.shape
            ]
            writes += [
                np.dtype(v.aval.dtype) for v in eqn.outvars if v.aval.shape == WS.shape
            ]
    assert outs and all(o == BF16 for o in outs), outs
    # the loops read the E4M3 weights quantized before them (and the bf16 copy
    # whose gradient the backward loop writes, in bf16): no float32 stack
    assert E4M3 in reads and set(reads) <= {BF16, E4M3}, reads
    assert writes == [BF16], writes


@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float16])
def test_fp8_product_holds_results_whose_unscaled_sum_overflows_float16(out_dtype):
    # Constant operands quantize to 448 each: the unscaled product is
    # 256 * 448**2 = 5.1e7, past float16's 65504; the result, 256 * 3 * 5, is not.
    x, w = jnp.full((8, 256), 3.0), jnp.full((256, 8), 5.0)
    nn = (((1,), (0,)), ((), ()))
    fp8 = jaxamp.quant.fp8_dot_general
    out = jax.jit(fp8, static_argnums=(2, 3))(x, w, nn, out_dtype)
    assert out.dtype == np.dtype(out_dtype)
    np.testing.assert_allclose(np.asarray(out, np.float32), 3840.0, rtol=2**-7)
    gx, gw = jax.grad(lambda a, b: fp8(a, b, nn, out_dtype).astype(F32).sum(), (0, 1))(
        x, w
    )
    np.testing.assert_allclose(np.asarray(gx), 5.0 * 8, rtol=2**-6)  # sum over w's rows
    np.testing.assert_allclose(np.asarray(gw), 3.0 * 8, rtol=2**-6)


@pytest.mark.parametrize(
    "policy",
    [FP8_ALL, jaxamp.int8_policy(size_rule=None, quantize_last_matmul=True)],
    ids=["fp8", "int8"],
)
def test_checkpoint_recompute_scales_by_the_forward_amax(policy):
    # A user's jax.checkpoint recomputes its 8-bit layer in the backward pass.
    # The forward's amaxes are saved (one float32 per tensor, or per row for
    # int8), so the recompute quantizes without reducing them again: the only
    # amax reductions left in the backward are the two cotangents' (E5M2 for
    # FP8; int8's weight gradients stay bf16). The gradients are those of the
    # same layer without the checkpoint.
    def layer(x, w):
        return jnp.tanh(x @ w / 64) @ w

    def loss(w, x, ck):
        body = jax.checkpoint(layer) if ck else layer
        return jnp.square(body(x, w)).mean()

    # activations in the hundreds, weights pre-rounded to bf16
    x = (300 * jax.random.normal(jax.random.key(40), (64, 128))).astype(BF16)
    w = jax.random.normal(jax.random.key(41), (128, 128)).astype(BF16).astype(F32)
    amp = jaxamp.amp(loss, compute_dtype=BF16, amp_policy=policy)
    grad = jax.jit(jax.grad(amp), static_argnums=2)

    def names(jaxpr, name):
        eqns = jaxamp.tools.iter_equations(jaxpr)
        return [e for e, _ in eqns if e.primitive.name == name]

    def amax_reductions(amp):
        closed = jax.make_jaxpr(jax.grad(amp), static_argnums=2)(w, x, True)
        # the user's checkpoint, differentiated: the recompute and the backward
        (remat,) = [
            e
            for e in names(closed, "remat2")
            if e.params["differentiated"] and names(e.params["jaxpr"], "dot_general")
        ]
        return len(names(remat.params["jaxpr"], "reduce_max"))

    assert amax_reductions(amp) == 2
    np.testing.assert_allclose(
        np.asarray(grad(w, x, True)), np.asarray(grad(w, x, False)), rtol=1e-6
    )
    # the ablation: the recompute reduces the two operands' amaxes of both
    # products again
    off = _amp.ablated(choices=["checkpoint_amax"])
    assert amax_reductions(off(loss, compute_dtype=BF16, amp_policy=policy)) == 6
