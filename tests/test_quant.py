"""Tests of Int8 training (jaxamp/_quant.py) and the 8-bit size rule / report.

Error model for the accuracy bounds: symmetric int8 rounding to nearest with an
``amax / 127`` step has absolute error at most half a step per element, i.e.
relative RMS error about ``1 / (127 * sqrt(12)) = 2.3e-3`` of a slice's amax
for uniformly spread values (more for heavy-tailed ones: the step is set by
the largest element); stochastic rounding doubles the variance.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jaxamp
from jaxamp._quant import rounding_noise

BF16, F32, I8, I32 = (np.dtype(t) for t in (jnp.bfloat16, jnp.float32, "int8", "int32"))
DN = (((1,), (0,)), ((), ()))
D, T, B, H, V = 64, 32, 4, 4, 32
# Quantize the model's linear layers (K, N >= 64); attention products
# (K = head dim 16) and the vocabulary head (N = 32) stay in bfloat16.
RULE = jaxamp.min_matmul_size(k=64, n=64)


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def init(key, layers=2):
    ks = jax.random.split(key, 6)
    n = lambda k, s, sc: jax.random.normal(k, s) * sc
    return {
        "emb": n(ks[0], (V, D), 1.0),
        "head": n(ks[1], (D, V), D**-0.5),
        "layers": {
            "qkv": n(ks[2], (layers, D, 3 * D), D**-0.5),
            "proj": n(ks[3], (layers, D, D), D**-0.5 / 2),
            "up": n(ks[4], (layers, D, 4 * D), D**-0.5),
            "down": n(ks[5], (layers, 4 * D, D), (4 * D) ** -0.5 / 2),
        },
    }


def gpt(params, tokens, checkpoint=True):
    """A GPT-style model: scanned (optionally checkpointed) pre-norm blocks."""

    def norm(x):
        return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-5)

    def block(x, w):
        with jax.named_scope("attn"):
            q, k, v = jnp.split(norm(x) @ w["qkv"], 3, -1)
            split = lambda z: z.reshape(B, T, H, D // H)
            a = jax.nn.dot_product_attention(
                split(q), split(k), split(v), is_causal=True
            )
            x = x + a.reshape(B, T, D) @ w["proj"]
        with jax.named_scope("mlp"):
            x = x + jax.nn.gelu(norm(x) @ w["up"]) @ w["down"]
        return x, None

    body = jax.checkpoint(block) if checkpoint else block
    x, _ = jax.lax.scan(body, params["emb"][tokens], params["layers"])
    with jax.named_scope("head"):
        logits = norm(x) @ params["head"]
    return -jnp.mean(
        jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[..., None], -1)
    )


TOKENS = jax.random.randint(jax.random.key(1), (B, T), 0, V)
PARAMS = init(jax.random.key(0))
WEIGHT_SHAPES = {(D, 3 * D), (D, D), (D, 4 * D), (4 * D, D)}


def dots(closed):
    """(lhs dtype, rhs dtype, out dtype, out shape) of every dot_general."""
    return [
        (*(np.dtype(v.aval.dtype) for v in e.invars), np.dtype(e.outvars[0].aval.dtype))
        + (e.outvars[0].aval.shape,)
        for e, _ in jaxamp.iter_equations(closed)
        if e.primitive.name == "dot_general"
    ]


def int8_casts(closed):
    return sum(
        1
        for e, _ in jaxamp.iter_equations(closed)
        if e.primitive.name == "convert_element_type" and e.params["new_dtype"] == I8
    )


@functools.lru_cache
def grad_jaxpr_for(wgrad, checkpoint=True):
    return grad_jaxpr(jaxamp.int8_policy(size_rule=RULE, wgrad=wgrad), checkpoint)


def grad_jaxpr(policy, checkpoint=True):
    f = jaxamp.amp(
        functools.partial(gpt, checkpoint=checkpoint),
        compute_dtype=BF16,
        amp_policy=policy,
    )
    return jax.make_jaxpr(jax.grad(f))(PARAMS, TOKENS)


@pytest.mark.parametrize("wgrad", [False, True])
def test_gpt_gradient_matmuls_run_in_int8(wgrad):
    closed = grad_jaxpr_for(wgrad)
    table = dots(closed)
    s8 = [d for d in table if d[:2] == (I8, I8)]
    assert all(d[2] == I32 for d in s8)  # never an int8 output
    # Weight gradients (output shaped like a weight): bf16 unless asked for.
    wg = [d for d in table if d[3] in WEIGHT_SHAPES]
    assert len(wg) == 4 and all(
        d[:2] == ((I8, I8) if wgrad else (BF16, BF16)) for d in wg
    )
    # Forward (4 linear layers), dgrad (4), and the forward recomputed under
    # jax.checkpoint (3: the last product's output is not needed backward,
    # so only its quantized operands are recomputed).
    assert len(s8) == 4 * (2 + wgrad) + 3
    # Everything else (attention products K = 16, head N = 32) stays in bf16.
    rest = [d for d in table if d[:2] != (I8, I8)]
    assert rest and all(d[:2] == (BF16, BF16) for d in rest), rest
    share = jaxamp.eight_bit_flop_share(closed)
    assert 0.5 < share < 1.0


def test_default_size_rule_skips_the_small_gpt():
    # torchao's rowwise crossover (N > 2048, K > 1024): nothing here pays.
    table = dots(grad_jaxpr(jaxamp.int8_amp_policy))
    assert all(d[:2] == (BF16, BF16) for d in table)
    report = jaxamp.quantization_report(
        jaxamp.amp(gpt, compute_dtype=BF16, amp_policy=jaxamp.int8_amp_policy),
        PARAMS,
        TOKENS,
    )
    linear = [r for r in report if r.shape[0] == 1]
    assert {r.reason for r in linear} == {"below the size rule"}


def test_report_names_scopes_shapes_and_formats():
    f = jaxamp.amp(
        gpt, compute_dtype=BF16, amp_policy=jaxamp.int8_policy(size_rule=RULE)
    )
    report = jaxamp.quantization_report(f, PARAMS, TOKENS)
    got = {(r.scope, r.shape[1:], r.format, r.reason) for r in report}
    assert ("attn", (B * T, D, 3 * D), "int8", "") in got
    assert ("mlp", (B * T, 4 * D, D), "int8", "") in got
    assert ("head", (B * T, D, V), "bfloat16", "below the size rule") in got
    assert all(
        r.source.split(":")[0].endswith("test_quant.py")
        for r in report
        if r.format == "int8"
    )
    layers = sum(r.flops for r in report if r.format == "int8")
    assert layers == 2 * 2 * B * T * D * D * (3 + 1 + 4 + 4)  # 2 layers (scan)


@pytest.mark.parametrize("granularity", ["rowwise", "tensorwise"])
def test_scales_are_per_row_and_column_or_per_tensor(granularity):
    x = jax.random.normal(jax.random.key(2), (B, T, D))
    w = jax.random.normal(jax.random.key(3), (D, 3 * D))
    dn = (((2,), (0,)), ((), ()))
    f = lambda x, w: jaxamp.int8_dot_general(x, w, dn, F32, granularity=granularity)
    amax_shapes = {
        e.outvars[0].aval.shape
        for e, _ in jaxamp.iter_equations(jax.make_jaxpr(f)(x, w))
        if e.primitive.name == "reduce_max"
    }
    assert amax_shapes == ({(B, T), (3 * D,)} if granularity == "rowwise" else {()})
    q, s = jaxamp.int8_quantize(x, (2,))
    assert q.dtype == I8 and s.shape == (B, T, 1)
    assert np.all(np.abs(np.asarray(q)).max(-1) == 127)  # every row uses the range
    q, s = jaxamp.int8_quantize(w, (0,))
    assert s.shape == (1, 3 * D)
    err = rel(f(x, w), np.asarray(x, np.float64) @ np.asarray(w, np.float64))
    assert err < (0.01 if granularity == "rowwise" else 0.02), err


def test_each_operand_is_quantized_once():
    # No checkpoint: the forward quantizes x and w of each of the 4 linear
    # layers once; the backward quantizes only the gradient (dgrad; and wgrad
    # when asked) and reuses the forward's int8 operands.
    for wgrad, per_layer in ((False, 3), (True, 4)):
        assert int8_casts(grad_jaxpr_for(wgrad, False)) == 4 * per_layer
        # Under jax.checkpoint the forward (its 2 quantizations) is recomputed.
        assert int8_casts(grad_jaxpr_for(wgrad)) == 4 * (per_layer + 2)


def test_residuals_are_int8_and_below_bfloat16():
    # An MLP whose activations (2048 tokens) outweigh its weights: the int8
    # policy saves 1-byte activations and weights where bf16 saves 2-byte
    # activations (and re-casts the float32 weights).
    x = jax.random.normal(jax.random.key(17), (2048, D))
    w = (jax.random.normal(jax.random.key(18), (D, 4 * D)) * 0.1,) * 2

    def mlp(w, x):
        return jnp.mean(jnp.square(jax.nn.gelu(x @ w[0]) @ w[1].T))

    pol = jaxamp.int8_policy(size_rule=RULE)
    r8 = jaxamp.saved_residual_bytes(
        jaxamp.amp(mlp, compute_dtype=BF16, amp_policy=pol), w, x
    )
    r16 = jaxamp.saved_residual_bytes(jaxamp.amp(mlp, compute_dtype=BF16), w, x)
    assert r8 < 0.9 * r16, (r8, r16)


def test_stochastic_rounding_is_unbiased():
    # 0.3 * 127 = 38.1: rounds to 38 or 39, on average 38.1.
    x = jnp.full((2**16,), 0.3).at[0].set(1.0)
    q, s = jaxamp.int8_quantize(x, stochastic=True)
    assert float(s.reshape(())) == 127.0
    mean = float(jnp.mean(q[1:].astype(F32)))
    # Std of the mean: sqrt(0.1 * 0.9 / 65535) = 1.2e-3.
    assert abs(mean - 38.1) < 6e-3, mean
    assert abs(float(jnp.mean(jnp.round(x[1:] * 127))) - 38.1) > 0.09  # nearest: 38
    # Per element over many keys: the mean of the draws converges to x * s.
    y = jax.random.normal(jax.random.key(4), (512,))
    draws = jax.vmap(lambda k: jaxamp.int8_quantize(y, stochastic=True, seed=k)[0])(
        jnp.arange(400, dtype=jnp.uint32)
    )
    scaled = np.asarray(y * jaxamp.int8_quantize(y)[1])
    # Per element: std of a 400-draw mean <= 0.5 / 20 = 0.025.
    assert np.abs(np.asarray(draws, np.float64).mean(0) - scaled).max() < 0.13
    u = rounding_noise(y)
    assert abs(float(u.mean()) - 0.5) < 0.05 and abs(float(u.var()) - 1 / 12) < 0.01


def test_rounding_noise_changes_with_the_data_and_repeats_for_equal_inputs():
    g1 = jax.random.normal(jax.random.key(5), (64, 64))
    g2 = g1.at[3, 7].add(1e-3)  # the next step's gradient: one element differs
    n1, n2 = rounding_noise(g1), rounding_noise(g2)
    assert np.array_equal(n1, rounding_noise(g1))  # identical inputs, identical noise
    assert np.array_equal(n1, jax.jit(rounding_noise)(g1))
    assert float(jnp.mean(n1 == n2)) < 0.01  # all elements get fresh noise
    assert abs(float(jnp.corrcoef(n1.ravel(), n2.ravel())[0, 1])) < 0.05
    # A key (seed) gives an independent stream, reproducible for the same key.
    k1, k2 = rounding_noise(g1, 1), rounding_noise(g1, 2)
    assert (
        np.array_equal(k1, rounding_noise(g1, 1)) and float(jnp.mean(k1 == k2)) < 0.01
    )
    # Through the policy: identical gradients for identical inputs and key.
    pol = jaxamp.int8_policy(size_rule=RULE, key=jax.random.key(7))
    f = jax.jit(jax.grad(jaxamp.amp(gpt, compute_dtype=BF16, amp_policy=pol)))
    a, b = f(PARAMS, TOKENS), f(PARAMS, TOKENS)
    assert all(
        np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
    )


def test_gradients_track_float32():
    ref = jax.grad(gpt)(PARAMS, TOKENS)
    pol = jaxamp.int8_policy(size_rule=RULE)
    g = jax.grad(jaxamp.amp(gpt, compute_dtype=BF16, amp_policy=pol))(PARAMS, TOKENS)
    for name in ("qkv", "up", "down"):
        # Int8 (7 bits + sign, per-row scales, stochastic rounding of the
        # gradient) vs float32: measured 0.01-0.03.
        assert rel(g["layers"][name], ref["layers"][name]) < 0.05, name


def test_training_with_large_activations_tracks_float32():
    # Inputs in the hundreds: scales absorb the range (no overflow, no loss
    # scaling); int8 training follows float32's loss curve within 3%.
    kx, kw1, kw2, kt = jax.random.split(jax.random.key(8), 4)
    x = jax.random.normal(kx, (256, 64)) * 300.0
    w_true = jax.random.normal(kt, (64, 8)) / 300.0
    y = jnp.tanh(x @ w_true)
    p0 = (
        jax.random.normal(kw1, (64, 128)) / 300.0,
        jax.random.normal(kw2, (128, 8)) * 0.1,
    )

    def loss(p, x, y):
        return jnp.mean(jnp.square(jnp.tanh(x @ p[0]) @ p[1] - y))

    pol = jaxamp.int8_policy(size_rule=None)

    def train(f):
        step = jax.jit(
            lambda p: jax.tree.map(lambda a, g: a - 0.1 * g, p, jax.grad(f)(p, x, y))
        )
        p, out = p0, []
        for _ in range(60):
            p = step(p)
            out.append(float(loss(p, x, y)))
        return np.array(out)

    l32, l8 = train(loss), train(jaxamp.amp(loss, compute_dtype=BF16, amp_policy=pol))
    assert l32[-1] < 0.5 * l32[0]  # it learns
    # Measured: at most 5.5% apart early on (the loss falls 10x in 10 steps),
    # 2.7% at the end.
    assert np.all(np.abs(l8 - l32) <= 0.08 * l32), np.abs(l8 / l32 - 1).max()
    assert abs(l8[-1] - l32[-1]) <= 0.04 * l32[-1]


def test_equinox_and_flax_nnx_models():
    eqx = pytest.importorskip("equinox")
    nnx = pytest.importorskip("flax.nnx")
    x = jax.random.normal(jax.random.key(9), (32, 64))
    pol = jaxamp.int8_policy(size_rule=None)
    mlp = eqx.nn.MLP(64, 8, 128, 2, key=jax.random.key(10))
    loss = lambda m, x: jnp.mean(jnp.square(jax.vmap(m)(x)))
    g8 = eqx.filter_grad(jaxamp.amp(loss, compute_dtype=BF16, amp_policy=pol))(mlp, x)
    g32 = eqx.filter_grad(loss)(mlp, x)
    # eqx.nn.Linear computes weight @ x: the weight is the lhs, so its
    # gradient is the int8 "dgrad" product (stochastically rounded, over a
    # contraction of only 32 examples): measured 0.09.
    assert rel(g8.layers[0].weight, g32.layers[0].weight) < 0.15
    amp_loss = jaxamp.amp(loss, compute_dtype=BF16, amp_policy=pol)
    closed = jax.make_jaxpr(lambda x: amp_loss(mlp, x))(x)
    assert sum(d[:2] == (I8, I8) for d in dots(closed)) == 3

    model = nnx.Sequential(
        nnx.Linear(64, 128, rngs=nnx.Rngs(0)), nnx.Linear(128, 8, rngs=nnx.Rngs(1))
    )
    nloss = lambda m, x: jnp.mean(jnp.square(m(x)))
    g8 = nnx.grad(jaxamp.amp(nloss, compute_dtype=BF16, amp_policy=pol))(model, x)
    g32 = nnx.grad(nloss)(model, x)
    assert rel(g8.layers[0].kernel[...], g32.layers[0].kernel[...]) < 0.05


def test_data_parallel_shard_map():
    mesh = Mesh(np.array(jax.devices()[:4]), ("data",))
    w = jax.random.normal(jax.random.key(11), (64, 64)) * 0.125
    x = jax.random.normal(jax.random.key(12), (64, 64))

    def local(w, x):
        return jax.lax.pmean(jnp.mean(jnp.square(jnp.tanh(x @ w) @ w)), "data")

    sharded = jax.shard_map(local, mesh=mesh, in_specs=(P(), P("data")), out_specs=P())
    pol = jaxamp.int8_policy(size_rule=None)
    g8 = jax.jit(jax.grad(jaxamp.amp(sharded, compute_dtype=BF16, amp_policy=pol)))(
        w, x
    )
    g32 = jax.jit(jax.grad(sharded))(w, x)
    assert rel(g8, g32) < 0.05
    closed = jax.make_jaxpr(
        jax.grad(jaxamp.amp(sharded, compute_dtype=BF16, amp_policy=pol))
    )(w, x)
    assert sum(d[:2] == (I8, I8) for d in dots(closed)) == 2 * 2


def test_non_finite_and_zero_inputs():
    w = jax.random.normal(jax.random.key(13), (8, 3))
    z = jnp.zeros((4, 8))
    assert float(jnp.abs(jaxamp.int8_dot_general(z, w, DN, F32)).max()) == 0.0
    for bad in (jnp.inf, jnp.nan):
        out = jaxamp.int8_dot_general(z.at[1, 2].set(bad), w, DN, F32)
        assert not bool(jnp.all(jnp.isfinite(out[1])))
        assert bool(jnp.all(jnp.isfinite(out[0])))  # rowwise: other rows intact
    _, vjp = jax.vjp(lambda a, b: jaxamp.int8_dot_general(a, b, DN, F32), z + 1, w)
    assert not bool(jaxamp.all_finite(vjp(jnp.ones((4, 3)).at[2, 1].set(jnp.inf))))


def test_forward_in_compute_dtype_with_int8_backward():
    x = jax.random.normal(jax.random.key(14), (16, 64))
    w = jax.random.normal(jax.random.key(15), (64, 32))
    c = jax.random.normal(jax.random.key(16), (16, 32))
    f = lambda a, b: jnp.sum(
        jaxamp.int8_dot_general(a, b, DN, F32, forward=False, wgrad=True) * c
    )
    dx, dw = jax.grad(f, (0, 1))(x, w)
    assert rel(dx, c @ w.T) < 0.03 and rel(dw, x.T @ c) < 0.03
    closed = jax.make_jaxpr(jax.grad(f, (0, 1)))(x, w)
    assert [d[:2] for d in dots(closed)].count((I8, I8)) == 2


def test_bad_arguments_name_the_argument():
    with pytest.raises(ValueError, match="granularity"):
        jaxamp.int8_policy(granularity="blockwise")
    with pytest.raises(TypeError, match="dgrad"):
        jaxamp.int8_rule(dgrad=1)
    with pytest.raises(TypeError, match="size_rule"):
        jaxamp.int8_policy(size_rule=512)
    with pytest.raises(TypeError, match=r"\('mlp',\)"):
        jaxamp.int8_policy(scopes="mlp")
    with pytest.raises(TypeError, match="key"):
        jaxamp.int8_policy(key=0)
    with pytest.raises(ValueError, match="min_matmul_size"):
        jaxamp.min_matmul_size(k=-1)
    with pytest.raises(ValueError, match="float array"):
        jaxamp.int8_quantize(jnp.ones(3, jnp.int32))
    with pytest.raises(TypeError, match="callable"):
        jaxamp.quantization_report(3)


def test_size_rules_follow_torchao():
    assert not jaxamp.torchao_rowwise_size_rule(8192, 4096, 2048)
    assert not jaxamp.torchao_rowwise_size_rule(8192, 1024, 8192)
    assert not jaxamp.torchao_rowwise_size_rule(8192, 2048, 4096)
    assert jaxamp.torchao_rowwise_size_rule(8192, 4096, 4096)
    assert not jaxamp.torchao_tensorwise_size_rule(8192, 4096, 1024)
    assert jaxamp.torchao_tensorwise_size_rule(8192, 4096, 2048)
    assert jaxamp.torchao_tensorwise_size_rule(8192, 8192, 1024)
