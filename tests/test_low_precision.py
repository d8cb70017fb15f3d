"""Tests of low_precision_optimizer (jaxamp/_training/_low_precision.py and
_rounding.py): bfloat16 parameters trained by any optax optimizer with
stochastic rounding, Kahan summation or round-to-nearest, and optimizer state in
bfloat16 or block-wise int8; all under jax.jit."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxamp
from jaxamp._training._rounding import (
    BlockQuantized,
    dequantize_blockwise,
    noise_bits,
    quantize_blockwise,
    round_nearest_bf16,
    round_stochastic_bf16,
)

BF16, F32 = np.dtype(jnp.bfloat16), np.dtype(jnp.float32)
ROUNDINGS = ("stochastic", "kahan", "nearest")
STATES = (jnp.bfloat16, "int8", None)

# optax's adam mixes Python floats with int32 counters, which the suite's strict
# promotion rejects; optax itself runs under standard promotion here.
pytestmark = pytest.mark.usefixtures("standard_promotion")


@pytest.fixture
def standard_promotion():
    with jax.numpy_dtype_promotion("standard"):
        yield


def _leaves_equal(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(
        x.dtype == y.dtype and bool(jnp.array_equal(x, y, equal_nan=True))
        for x, y in zip(la, lb)
    )


def _dtypes(tree):
    return [np.dtype(x.dtype) for x in jax.tree.leaves(tree)]


def _scan_steps(tx, params, n):
    """``n`` steps of gradient -1 (so sgd(lr) adds lr) inside lax.scan under jit."""

    @jax.jit
    def run(params):
        def body(carry, _):
            p, s = carry
            g = jax.tree.map(lambda x: -jnp.ones_like(x), p)
            u, s = tx.update(g, s, p)
            return (optax.apply_updates(p, u), s), None

        return jax.lax.scan(body, (params, tx.init(params)), None, length=n)[0][0]

    return run(params)


@pytest.mark.parametrize("rounding", [*ROUNDINGS, "plain optax"])
def test_small_updates_accumulate_in_scan_under_jit(rounding):
    # 1000 updates of 1e-4 (a 78th of a bfloat16 step at 1.0) to bf16 ones.
    params = {"w": jnp.ones((256,), jnp.bfloat16)}
    sgd = optax.sgd(1e-4)
    if rounding == "plain optax":
        tx = sgd
    else:
        tx = jaxamp.low_precision_optimizer(sgd, rounding=rounding)
    w = _scan_steps(tx, params, 1000)["w"]
    assert w.dtype == BF16
    mean = float(w.astype(jnp.float32).mean())
    if rounding in ("stochastic", "kahan"):
        assert abs(mean - 1.1) <= 0.02 * 1.1, mean
        # stochastic: each element is ~Binomial(1000, 1e-4 / 2**-7) steps of
        # 2**-7, std 0.028; Kahan: every element within one step of 1.1.
        spread = 0.15 if rounding == "stochastic" else 2.0**-7
        assert float(jnp.abs(w.astype(jnp.float32) - 1.1).max()) <= spread
    else:
        assert mean == 1.0  # round-to-nearest loses every update


@pytest.mark.parametrize("frac", [0.1, 0.25, 0.5, 0.9])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_stochastic_rounding_probability_between_neighbours(frac, sign):
    # Between the bfloat16 neighbours 1000 and 1004 (activation-range values):
    # P(round up) == frac. 2**16 draws: std sqrt(f(1-f)/n) <= 0.002; tolerance 0.01.
    n = 2**16
    x = jnp.full((n,), sign * (1000.0 + 4.0 * frac), jnp.float32)
    y = jax.jit(round_stochastic_bf16)(x, noise_bits(x.shape, 3, jnp.int32(7), 1))
    assert y.dtype == BF16
    mags = np.abs(np.asarray(y.astype(jnp.float32)))
    assert set(np.unique(mags)) <= {1000.0, 1004.0}
    assert abs(float((mags == 1004.0).mean()) - frac) < 0.01
    assert abs(float(mags.mean()) - (1000.0 + 4.0 * frac)) < 0.04


def test_stochastic_rounding_mean_over_steps_is_the_value():
    # One value per element, rounded at 400 steps with fresh bits: the mean of
    # the roundings equals the float32 value (std of the mean < ulp/40).
    x = jax.random.uniform(jax.random.key(0), (512,), jnp.float32, 100.0, 5000.0)

    @jax.jit
    def mean_rounding(x):
        def one(step):
            bits = noise_bits(x.shape, 0, step, 0)
            return round_stochastic_bf16(x, bits).astype(jnp.float32)

        return jax.vmap(one)(jnp.arange(400, dtype=jnp.int32)).mean(0)

    ulp = 2.0 ** (np.floor(np.log2(np.asarray(x))) - 7)
    err = np.abs(np.asarray(mean_rounding(x)) - np.asarray(x)) / ulp
    assert err.max() < 0.2 and err.mean() < 0.05, (err.max(), err.mean())


def test_rounding_edge_cases_and_exact_values():
    x = jnp.array([1.0, -2.5, 0.0, jnp.inf, -jnp.inf, 3.4e38, -3.4e38], jnp.float32)
    bits = jnp.full(x.shape, 0xFFFFFFFF, jnp.uint32)  # always round away from 0
    y = np.asarray(jax.jit(round_stochastic_bf16)(x, bits).astype(jnp.float32))
    bf16_max = float(jnp.finfo(jnp.bfloat16).max)
    np.testing.assert_array_equal(
        y, [1.0, -2.5, 0.0, np.inf, -np.inf, bf16_max, -bf16_max]
    )
    nan = jax.jit(round_stochastic_bf16)(jnp.array([jnp.nan]), bits[:1])
    assert bool(jnp.isnan(nan[0]))
    z = jnp.array([1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, 3.4e38], jnp.float32)
    np.testing.assert_array_equal(  # ties to even; overflow to inf
        np.asarray(jax.jit(round_nearest_bf16)(z).astype(jnp.float32)),
        [1.0, 1.0 + 2.0**-6, np.inf],
    )


def test_noise_bits_differ_by_stream_step_and_seed():
    base = noise_bits((64, 64), 0, jnp.int32(1), 0)
    for other in (
        noise_bits((64, 64), 0, jnp.int32(1), 1),
        noise_bits((64, 64), 0, jnp.int32(2), 0),
        noise_bits((64, 64), 1, jnp.int32(1), 0),
    ):
        assert float((base == other).mean()) < 0.01
    low16 = np.asarray(base & 0xFFFF, np.float64) / 2**16
    assert abs(low16.mean() - 0.5) < 0.01  # 4096 draws: std 0.0045


def test_blockwise_int8_roundtrip_error():
    # Adam-like second moments spanning four decades, one large outlier per block.
    key = jax.random.key(1)
    x = jnp.exp(jax.random.uniform(key, (100, 41), jnp.float32, -9.0, 0.0))
    q = jax.jit(quantize_blockwise, static_argnums=1)(x, 256)
    assert isinstance(q, BlockQuantized) and q.codes.dtype == np.int8
    assert q.codes.shape == x.shape and q.scales.shape == (17,)  # ceil(4100 / 256)
    back = dequantize_blockwise(q, 256)
    rel = np.abs(np.asarray(back) - np.asarray(x)) / np.asarray(x)
    # dynamic map: 2**i codes per decade 10**(i-6); worst relative error in the
    # decades used here is 0.45 / 2**i / 0.1 at the decade's bottom.
    big = np.asarray(x) >= 0.01 * np.asarray(q.scales).repeat(256)[:4100].reshape(
        100, 41
    )
    assert rel[big].max() < 0.15 and np.median(rel[big]) < 0.03
    assert np.all(np.asarray(back) > 0)  # no second moment collapses to zero


def _state_bytes(tree):
    return sum(x.size * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


@pytest.mark.parametrize(
    "state_dtype, limit", [(jnp.bfloat16, 6.1), ("int8", 4.2), ("float32", 12.01)]
)
def test_bytes_per_parameter_adamw(state_dtype, limit):
    # 1.05M parameters in 4096-element-or-larger matrices plus small vectors.
    shapes = {f"w{i}": (512, 512) for i in range(4)} | {"b": (512,), "g": (512,)}
    if state_dtype == "float32":  # the float32-master reference: params + 2 moments
        params = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in shapes.items()}
        state = jax.eval_shape(optax.adamw(1e-3).init, params)
    else:
        params = {k: jax.ShapeDtypeStruct(s, jnp.bfloat16) for k, s in shapes.items()}
        tx = jaxamp.low_precision_optimizer(optax.adamw(1e-3), state_dtype=state_dtype)
        state = jax.eval_shape(tx.init, params)
    n = sum(int(np.prod(s)) for s in shapes.values())
    per_param = (_state_bytes(params) + _state_bytes(state)) / n
    assert per_param <= limit, per_param
    assert per_param > limit - 0.2  # the figure is the stored bytes, not a bound


def _loss(params, x):
    h = jnp.tanh(x @ params["w1"].astype(jnp.float32))
    y = h @ params["w2"].astype(jnp.float32)
    return jnp.mean((y - jnp.sin(x[:, :8])) ** 2)


def _mlp(dtype=jnp.bfloat16):
    k1, k2 = jax.random.split(jax.random.key(0))
    return {
        "w1": (jax.random.normal(k1, (64, 128)) / 8).astype(dtype),
        "w2": (jax.random.normal(k2, (128, 8)) / 11).astype(dtype),
    }


def _elementwise_loss(params, x):
    # Gradients an elementwise function of the parameters: identical on any
    # mesh, so the runs compare the optimizer alone (a sharded matmul's
    # gradient sums in another order).
    return sum(
        jnp.sum(jnp.cos(3.0 * params[k].astype(jnp.float32)) * jnp.tanh(x[k][:, :1]))
        for k in params
    )


def _train(tx, params, x, steps, shard=None, loss=_loss):
    def step(p, s):
        g = jax.grad(loss)(p, x)
        u, s = tx.update(g, s, p)
        p = optax.apply_updates(p, u)
        if shard is not None:
            p = jax.lax.with_sharding_constraint(p, shard)
        return p, s

    step = jax.jit(step)
    s = jax.jit(tx.init)(params)
    for _ in range(steps):
        params, s = step(params, s)
    return params, s


@pytest.mark.parametrize("state_dtype", [jnp.bfloat16, "int8"])
def test_fsdp_sharded_and_unsharded_runs_are_bit_identical(state_dtype):
    assert jax.device_count() == 8  # conftest forces 8 host devices
    mesh = Mesh(np.array(jax.devices()), ("fsdp",))
    # w1 has 8192 elements: int8 blocks of 256 cross the 8 shards' boundaries.
    params = _mlp()
    x = jax.random.normal(jax.random.key(2), (128, 8), jnp.float32)
    x = {"w1": x[:64], "w2": x}
    tx = jaxamp.low_precision_optimizer(
        optax.adamw(1e-2), rounding="stochastic", state_dtype=state_dtype, seed=5
    )
    shard = {k: NamedSharding(mesh, P("fsdp")) for k in params}
    sharded = jax.device_put(params, shard)
    ref, ref_state = _train(tx, params, x, 20, loss=_elementwise_loss)
    out, out_state = _train(tx, sharded, x, 20, shard, loss=_elementwise_loss)
    assert out["w1"].sharding.spec == P("fsdp")
    assert len(out["w1"].addressable_shards) == 8
    assert _leaves_equal(ref, out) and _leaves_equal(ref_state, out_state)
    assert not _leaves_equal(ref, params)  # the run moved the parameters
    kinds = {
        type(leaf).__name__
        for leaf in jax.tree.leaves(
            out_state.inner_state, is_leaf=lambda z: isinstance(z, BlockQuantized)
        )
    }
    assert ("BlockQuantized" in kinds) == (state_dtype == "int8")


@pytest.mark.parametrize(
    "rounding, state_dtype, guard",
    [(r, d, "skip_nonfinite_updates") for r in ROUNDINGS for d in STATES]
    + [("kahan", "int8", "apply_if_finite")],
)
def test_skipped_step_changes_nothing(rounding, state_dtype, guard):
    params = _mlp()
    x = jax.random.normal(jax.random.key(2), (16, 64), jnp.float32)
    inner = jaxamp.low_precision_optimizer(
        optax.adamw(1e-2), rounding=rounding, state_dtype=state_dtype
    )
    if guard == "skip_nonfinite_updates":
        tx = jaxamp.skip_nonfinite_updates(inner)
    else:
        tx = optax.apply_if_finite(inner, max_consecutive_errors=10)

    @jax.jit
    def step(p, s, poison):
        g = jax.grad(_loss)(p, x)
        g = jax.tree.map(lambda a: jnp.where(poison, jnp.nan, a).astype(a.dtype), g)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    p1, s1 = step(params, tx.init(params), False)  # non-zero state, compensation
    p2, s2 = step(p1, s1, True)
    assert _dtypes(p2) == _dtypes(params)
    assert _leaves_equal(p2, p1)
    assert _leaves_equal(s2.inner_state, s1.inner_state)  # moments, compensation
    p3, s3 = step(p2, s2, False)
    assert _dtypes(s3) == _dtypes(s1) and not _leaves_equal(p3, p2)


def test_equinox_apply_updates():
    model = eqx.nn.MLP(16, 4, 32, 1, key=jax.random.key(0))
    model = jax.tree.map(
        lambda a: a.astype(jnp.bfloat16) if eqx.is_inexact_array(a) else a, model
    )
    x = jax.random.normal(jax.random.key(1), (64, 16), jnp.bfloat16)
    y = jnp.sin(x[:, :4].astype(jnp.float32))
    tx = jaxamp.low_precision_optimizer(optax.adamw(3e-3))
    state = tx.init(eqx.filter(model, eqx.is_array))

    def loss(m):
        return jnp.mean((jax.vmap(m)(x).astype(jnp.float32) - y) ** 2)

    @eqx.filter_jit
    def step(m, s):
        val, g = eqx.filter_value_and_grad(loss)(m)
        u, s = tx.update(g, s, eqx.filter(m, eqx.is_array))
        return eqx.apply_updates(m, u), s, val

    first = None
    for _ in range(20):
        model, state, val = step(model, state)
        first = val if first is None else first
    assert all(d == BF16 for d in _dtypes(eqx.filter(model, eqx.is_inexact_array)))
    assert float(loss(model)) < 0.7 * float(first)


def test_nnx_optimizer_update():
    nnx = pytest.importorskip("flax.nnx")
    model = nnx.Linear(16, 4, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(
        model, jaxamp.low_precision_optimizer(optax.adamw(1e-2)), wrt=nnx.Param
    )
    x = jax.random.normal(jax.random.key(1), (64, 16), jnp.float32)
    y = x[:, :4] * 0.5

    def loss(m):
        return jnp.mean((m(x.astype(jnp.bfloat16)).astype(jnp.float32) - y) ** 2)

    @nnx.jit
    def step(m, o):
        val, g = nnx.value_and_grad(loss)(m)
        o.update(m, g)
        return val

    first = float(step(model, opt))
    for _ in range(40):
        step(model, opt)
    assert model.kernel[...].dtype == BF16 and model.bias[...].dtype == BF16
    assert float(loss(model)) < 0.5 * first


def test_float32_leaves_pass_through_exactly():
    params = {"w": _mlp()["w1"], "g": jnp.linspace(0.5, 1.5, 64, dtype=jnp.float32)}
    grads = {
        "w": jnp.full((64, 128), 0.01, jnp.bfloat16),
        "g": jnp.linspace(-1.0, 1.0, 64, dtype=jnp.float32),
    }
    inner = optax.chain(optax.clip(0.5), optax.adamw(1e-2))
    tx = jaxamp.low_precision_optimizer(inner, state_dtype="int8")
    # The reference: the inner optimizer on the same tree, bf16 leaves upcast.
    # Op by op (no jit): two compiled programs may fuse float32 ops differently
    # (1 ulp), which is XLA's choice, not the wrapper's.
    u, s = tx.update(grads, tx.init(params), params)
    up = jax.tree.map(lambda a: a.astype(jnp.float32), (grads, params))
    u_ref = inner.update(up[0], inner.init(up[1]), up[1])[0]["g"]
    assert u["g"].dtype == F32 and u["w"].dtype == BF16
    np.testing.assert_array_equal(np.asarray(u["g"]), np.asarray(u_ref))


def test_updates_make_apply_updates_exact():
    # The returned bf16 update lands optax.apply_updates (bf16 arithmetic under
    # jit) exactly on the rounded p + u whenever the new value is within a factor
    # 2 of p (Sterbenz: new - p is then a bf16 value), and within one bf16 step
    # of it for any update (sign changes, growth by 10x, shrinking by 1e6).
    n = 2**14
    key_p, key_u = jax.random.split(jax.random.key(4))
    p = (jax.random.normal(key_p, (n,)) * 300.0).astype(jnp.bfloat16)
    scale = 10.0 ** jax.random.uniform(key_u, (n,), jnp.float32, -6.0, 1.0)
    u = scale * jnp.abs(p.astype(jnp.float32)) * jnp.sign(jnp.sin(jnp.arange(n * 1.0)))
    tx = jaxamp.low_precision_optimizer(optax.sgd(1.0), rounding="nearest")

    @jax.jit
    def step(p):
        d, _ = tx.update({"p": -u}, tx.init({"p": p}), {"p": p})
        return optax.apply_updates({"p": p}, d)["p"], d["p"]

    new, d = step(p)
    assert d.dtype == BF16 and new.dtype == BF16
    p32 = np.asarray(p.astype(jnp.float32))
    want = (p32 + np.asarray(u)).astype(jnp.bfloat16)
    got32, want32 = np.asarray(new, np.float32), want.astype(np.float32)
    ratio = want32 / p32
    near = (ratio >= 0.5) & (ratio <= 2.0)
    assert near.sum() > n // 2
    np.testing.assert_array_equal(got32[near], want32[near])
    ulp = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(want32), 1e-30))) - 7)
    assert np.all(np.abs(got32 - want32) <= ulp + np.abs(p32) * 2.0**-8)
    assert np.mean(got32 != want32) < 0.05


@pytest.mark.parametrize(
    "make",
    [
        lambda: optax.adafactor(1e-2),
        lambda: optax.lion(1e-3),
        lambda: optax.sgd(0.05, momentum=0.9),
        lambda: optax.chain(
            optax.clip_by_global_norm(1.0),
            optax.adamw(optax.warmup_cosine_decay_schedule(0.0, 1e-2, 5, 40)),
        ),
    ],
    ids=["adafactor", "lion", "sgd-momentum", "clip+adamw+schedule"],
)
def test_other_optimizers_train(make):
    params = _mlp()
    x = jax.random.normal(jax.random.key(2), (64, 64), jnp.float32)
    tx = jaxamp.low_precision_optimizer(make(), state_dtype="int8")
    out, state = _train(tx, params, x, 40)
    assert _dtypes(out) == [BF16, BF16]
    assert float(_loss(out, x)) < 0.8 * float(_loss(params, x))
    # no float32 buffer of a parameter's size is stored
    big = [a for a in jax.tree.leaves(state.inner_state) if a.size >= 128]
    assert big and all(np.dtype(a.dtype) != F32 for a in big)


def test_bad_input_raises():
    tx = optax.adamw(1e-3)
    with pytest.raises(TypeError, match="tx must be an optax GradientTransformation"):
        jaxamp.low_precision_optimizer(lambda g: g)
    with pytest.raises(ValueError, match="rounding='floor' is not supported"):
        jaxamp.low_precision_optimizer(tx, rounding="floor")
    with pytest.raises(ValueError, match="state_dtype=.*float16.* not supported"):
        jaxamp.low_precision_optimizer(tx, state_dtype=jnp.float16)
    with pytest.raises(ValueError, match="block_size must be an int >= 1"):
        jaxamp.low_precision_optimizer(tx, block_size=0)
    lp = jaxamp.low_precision_optimizer(tx)
    with pytest.raises(ValueError, match=r"parameter \['a'\] is float16"):
        lp.init({"a": jnp.ones(3, jnp.float16)})
    with pytest.raises(ValueError, match="update needs params"):
        lp.update({"a": jnp.ones(3)}, lp.init({"a": jnp.ones(3)}))


def _lm_loss(params, tokens, labels):
    """Embedding, LayerNorm with gain and bias, softmax attention, tied logits."""
    x = params["emb"][tokens]
    mean = x.mean(-1, keepdims=True)
    var = jnp.square(x - mean).mean(-1, keepdims=True)
    h = (x - mean) * jax.lax.rsqrt(var + 1e-5) * params["gain"] + params["bias"]
    att = jax.nn.softmax(h @ h.swapaxes(-1, -2) / 4.0, axis=-1)
    h = att @ (h @ params["w"])
    logits = h @ params["emb"].T
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def test_amp_with_bfloat16_parameters_keeps_statistics_and_loss_in_float32():
    k = jax.random.split(jax.random.key(7), 4)
    params = {  # activations in the hundreds, as in real training
        "emb": (300.0 * jax.random.normal(k[0], (64, 16))).astype(jnp.bfloat16),
        "gain": (1.0 + 0.1 * jax.random.normal(k[1], (16,))).astype(jnp.bfloat16),
        "bias": (0.1 * jax.random.normal(k[2], (16,))).astype(jnp.bfloat16),
        "w": (jax.random.normal(k[3], (16, 16)) / 4.0).astype(jnp.bfloat16),
    }
    tokens = jnp.arange(32, dtype=jnp.int32).reshape(2, 16) % 64
    labels = (tokens * 7 + 3) % 64
    amp_loss = jaxamp.amp(_lm_loss, compute_dtype=jnp.bfloat16)
    grad_fn = jax.value_and_grad(amp_loss)
    jaxpr = jax.make_jaxpr(grad_fn)(params, tokens, labels)
    eqns = [e for e, _ in jaxamp.tools.iter_equations(jaxpr)]
    # LayerNorm statistics (mean, variance), softmax and the loss's
    # log-softmax run in float32, forward and backward; the only bfloat16 sums
    # are exact ones over size-1 axes (the gain's and bias' broadcasts).
    for prim in ("reduce_sum", "reduce_max", "exp", "log", "rsqrt", "sub", "div"):
        found = [e for e in eqns if e.primitive.name == prim]
        assert found, prim
        for e in found:
            out = e.outvars[0].aval
            if out.dtype == F32 or not jnp.issubdtype(out.dtype, jnp.floating):
                continue
            shape = e.invars[0].aval.shape
            assert prim == "reduce_sum", (prim, e)
            assert all(shape[a] == 1 for a in e.params["axes"]), e
    dots = [e for e in eqns if e.primitive.name == "dot_general"]
    assert dots and all(v.aval.dtype == BF16 for e in dots for v in e.invars)
    value, grads = jax.jit(grad_fn)(params, tokens, labels)
    assert _dtypes(grads) == [BF16] * 4  # gradients in the parameters' dtype
    ref_params = jax.tree.map(lambda a: a.astype(jnp.float32), params)
    ref_value, ref_grads = jax.value_and_grad(_lm_loss)(ref_params, tokens, labels)
    assert abs(float(value) - float(ref_value)) < 0.02 * float(ref_value)
    for name in params:  # bf16 matmuls: a few percent of the gradient's norm
        g, r = grads[name].astype(jnp.float32), ref_grads[name]
        assert float(jnp.linalg.norm(g - r) / jnp.linalg.norm(r)) < 0.05, name


def test_dynamic_loss_scaling_overflow_is_a_skipped_step():
    # float16 amp with a loss scale that overflows: the scaler halves, the
    # skip wrapper keeps bf16 parameters, moments and Kahan buffers unchanged.
    params = _mlp()
    x = jax.random.normal(jax.random.key(2), (16, 64), jnp.float32)
    tx = jaxamp.skip_nonfinite_updates(
        jaxamp.low_precision_optimizer(optax.adamw(1e-2), rounding="kahan")
    )
    loss = jaxamp.amp(_loss, compute_dtype=jnp.float16)
    vg = jaxamp.dynamic_scale_value_and_grad(loss, filter=False)

    @jax.jit
    def step(p, s, scaler):
        scaler, (_, g) = vg(p, x, dynamic_scaler_state=scaler)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, scaler

    p1, s1, sc1 = step(params, tx.init(params), jaxamp.DynamicScalerState(scaler=1.0))
    assert int(s1.skipped_steps) == 0 and not _leaves_equal(p1, params)
    p2, s2, sc2 = step(p1, s1, jaxamp.DynamicScalerState(scaler=2.0**30))
    assert int(s2.skipped_steps) == 1 and int(sc2.total_resets) == 1
    assert _leaves_equal(p2, p1) and _dtypes(p2) == [BF16, BF16]
    assert _leaves_equal(s2.inner_state, s1.inner_state)


# --- Stacked leaves updated one slice at a time (jaxamp/_training/_chunked.py)


def _with_slices(tx, slices, rounding="stochastic", state="bfloat16"):
    from jaxamp._training import _low_precision as lp

    codec = lp._Codec(rounding, state, 3, 4096, 256, slices)
    return lp._wrap(optax.with_extra_args_support(tx), codec)


def _stacked_params():
    k = jax.random.split(jax.random.key(1), 3)
    return {
        "w": (jax.random.normal(k[0], (3, 64, 96)) * 0.1).astype(jnp.bfloat16),
        "ln": jnp.ones((3, 64), jnp.bfloat16),
        "emb": (jax.random.normal(k[1], (50, 64)) * 0.1).astype(jnp.bfloat16),
        "f32": jax.random.normal(k[2], (3, 8, 4)),
    }


def _run_steps(tx, params, steps=3):
    @jax.jit
    def step(p, s, i):
        g = jax.tree.map(
            lambda x: (jnp.sin(x.astype(F32) * (i + 1.0)) * 1e-2).astype(x.dtype), p
        )
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    s = tx.init(params)
    for i in range(steps):
        params, s = step(params, s, jnp.float32(i))
    return params, s


@pytest.mark.parametrize(
    "rounding,state",
    [
        ("stochastic", "bfloat16"),
        ("stochastic", "int8"),
        ("kahan", "int8"),
        ("nearest", None),
    ],
)
def test_slices_bit_identical_to_whole_leaves(rounding, state):
    # A schedule and weight decay: parameters, updates and every state buffer
    # match bit for bit.
    tx = optax.adamw(optax.linear_schedule(1e-2, 1e-3, 10), weight_decay=0.1)
    params = _stacked_params()
    a = _run_steps(_with_slices(tx, "always", rounding, state), params)
    b = _run_steps(_with_slices(tx, "never", rounding, state), params)
    assert _leaves_equal(a, b)
    assert not _leaves_equal(a[0], params)  # it trained


def test_slices_read_clipping_norm_from_whole_leaves():
    # Clipping's global norm is a reduction over all leaves: the slice update
    # takes it from the whole-leaf evaluation. XLA may sum in another order in
    # the two programs, so the parameters agree to one bfloat16 step where
    # they differ at all.
    tx = optax.chain(optax.clip_by_global_norm(0.05), optax.adamw(1e-2, 0.1))
    params = _stacked_params()
    a, _ = _run_steps(_with_slices(tx, "always"), params)
    b, _ = _run_steps(_with_slices(tx, "never"), params)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        low = x.dtype == BF16
        x, y = np.asarray(x, F32), np.asarray(y, F32)
        np.testing.assert_allclose(x, y, rtol=2**-7, atol=1e-6)
        assert not low or np.mean(x != y) < 0.01


def _has_loop(tx, params):
    s = tx.init(params)
    jaxpr = jax.make_jaxpr(tx.update)(params, s, params)
    return any(e.primitive.name in ("while", "scan") for e in jaxpr.jaxpr.eqns)


def test_int8_state_updates_stacked_leaves_in_a_loop():
    params = _stacked_params()
    tx = optax.adamw(1e-3)
    assert _has_loop(jaxamp.low_precision_optimizer(tx, state_dtype="int8"), params)
    assert not _has_loop(jaxamp.low_precision_optimizer(tx), params)


def test_slices_fall_back_for_non_elementwise_updates():
    # Adafactor factors the moments of each leaf (reductions along the stacked
    # leaf's own axes): no slice update, the whole-leaf one, same bits.
    params = _stacked_params()
    tx = optax.adafactor(1e-2, min_dim_size_to_factor=8)
    assert not _has_loop(_with_slices(tx, "always"), params)
    a = _run_steps(_with_slices(tx, "always"), params, 2)
    b = _run_steps(_with_slices(tx, "never"), params, 2)
    assert _leaves_equal(a, b)


@pytest.mark.parametrize("spec", [P(None, "fsdp"), P(None, None, "fsdp")])
def test_layerwise_int8_state_is_mesh_invariant(spec):
    # The layer loop slices the stacked axis; shards along the other axes give
    # the unsharded run's bits (rounding bits and int8 blocks from the global
    # index).
    mesh = Mesh(np.array(jax.devices()), ("fsdp",))
    params = {"w": _stacked_params()["w"][:, :, :64].repeat(4, axis=2)}
    x = {"w": jnp.full((1, 1), 0.7)}
    tx = jaxamp.low_precision_optimizer(optax.adamw(1e-2), state_dtype="int8")
    shard = {"w": NamedSharding(mesh, spec)}
    ref, ref_state = _train(tx, params, x, 4, loss=_elementwise_loss)
    out, out_state = _train(
        tx, jax.device_put(params, shard), x, 4, shard, loss=_elementwise_loss
    )
    assert len(out["w"].addressable_shards) == 8
    assert _leaves_equal(ref, out) and _leaves_equal(ref_state, out_state)
    assert not _leaves_equal(ref, params)
