"""Tests of the optax integration (jaxamp/_training/_optax.py): a step with non-finite
gradients changes nothing and is counted; the next finite step updates."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxamp

# optax's adam mixes Python floats with int32 counters, which the suite's strict
# promotion rejects; these tests run optax itself under standard promotion.
pytestmark = pytest.mark.usefixtures("standard_promotion")


@pytest.fixture
def standard_promotion():
    with jax.numpy_dtype_promotion("standard"):
        yield


def test_all_finite():
    assert bool(jaxamp.all_finite({"a": jnp.ones(3), "i": jnp.arange(2), "n": None}))
    assert not bool(jaxamp.all_finite([jnp.ones(2), jnp.array([1.0, jnp.inf])]))
    assert not bool(jaxamp.all_finite(jnp.array([jnp.nan], jnp.bfloat16)))
    assert bool(jaxamp.all_finite({"s": "static"}))


def test_select_tree():
    a, b = {"x": jnp.ones(2), "s": "a"}, {"x": jnp.zeros(2), "s": "b"}
    out = jaxamp.training.select_tree(jnp.asarray(False), a, b)
    np.testing.assert_array_equal(out["x"], jnp.zeros(2))
    assert out["s"] == "a"
    out = jaxamp.training.select_tree(True, a, b)
    np.testing.assert_array_equal(out["x"], jnp.ones(2))
    with pytest.raises(ValueError, match="pred must be a scalar"):
        jaxamp.training.select_tree(jnp.ones(2, bool), a, b)
    with pytest.raises(ValueError, match=r"leaf \['x'\] is float32\[2\] in a but"):
        jaxamp.training.select_tree(True, a, {"x": jnp.zeros(2, jnp.float16), "s": "b"})


def _tree_equal(a, b):
    return all(
        bool(jnp.array_equal(x, y))
        for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b))
    )


OPTIMIZERS = {
    "sgd": lambda: optax.sgd(0.1),
    "momentum": lambda: optax.sgd(0.1, momentum=0.9),
    "adam": lambda: optax.adam(0.1),
    "adamw": lambda: optax.adamw(0.1),
    "chain": lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adam(0.1)),
    "inject": lambda: optax.inject_hyperparams(optax.adam)(learning_rate=0.1),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_skip_nonfinite_updates(name):
    make = OPTIMIZERS[name]
    params = {"w": jnp.arange(3.0), "b": jnp.ones(())}
    opt = jaxamp.skip_nonfinite_updates(make())

    @jax.jit
    def step(params, state, grads):
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, updates

    good1 = {"w": jnp.ones(3), "b": jnp.ones(())}
    good2 = {"w": jnp.array([0.5, -1.0, 2.0]), "b": -jnp.ones(())}
    bad = [
        {"w": jnp.array([1.0, jnp.inf, 1.0]), "b": jnp.ones(())},
        {"w": jnp.ones(3), "b": jnp.asarray(jnp.nan)},
    ]

    state = opt.init(params)
    p1, s1, _ = step(params, state, good1)
    assert not _tree_equal(p1, params)
    for i, g in enumerate(bad):  # injected inf, then NaN: nothing changes
        p2, s2, updates = step(p1, s1, g)
        assert _tree_equal(updates, jax.tree_util.tree_map(jnp.zeros_like, params))
        assert _tree_equal(p2, p1) and _tree_equal(s2.inner_state, s1.inner_state)
        assert int(s2.skipped_steps) == i + 1 and not bool(s2.last_finite)
        p1, s1 = p2, s2
    p3, s3, _ = step(p1, s1, good2)
    assert int(s3.skipped_steps) == 2 and bool(s3.last_finite)

    # As if the bad steps never happened: the inner optimizer on good1, good2.
    inner = make()
    ref_state = inner.init(params)
    ref = params
    for g in (good1, good2):
        u, ref_state = inner.update(g, ref_state, ref)
        ref = optax.apply_updates(ref, u)
    for a, b in zip(jax.tree_util.tree_leaves(p3), jax.tree_util.tree_leaves(ref)):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    for a, b in zip(
        jax.tree_util.tree_leaves(s3.inner_state),
        jax.tree_util.tree_leaves(ref_state),
    ):
        np.testing.assert_allclose(a, b, rtol=1e-6)


def test_skip_wrapper_forwards_extra_args_and_decides_from_the_gradients():
    def inner_update(updates, state, params=None, *, factor):
        return jax.tree_util.tree_map(lambda u: u * factor, updates), state

    inner = optax.GradientTransformationExtraArgs(
        lambda p: optax.EmptyState(), inner_update
    )
    opt = jaxamp.skip_nonfinite_updates(inner)
    state = opt.init({"w": jnp.ones(2)})
    u, state = opt.update({"w": jnp.ones(2)}, state, factor=3.0)
    np.testing.assert_array_equal(u["w"], [3.0, 3.0])
    # Finite gradients, an inner optimizer that overflows: by default the skip
    # is decided before the update, from the gradients, so it is applied ...
    u, state = opt.update({"w": jnp.ones(2)}, state, factor=jnp.inf)
    np.testing.assert_array_equal(u["w"], [jnp.inf, jnp.inf])
    assert int(state.skipped_steps) == 0 and bool(state.last_finite)
    # ... and with check_updates=True the updates are checked too: skipped.
    checked = jaxamp.skip_nonfinite_updates(inner, check_updates=True)
    state = checked.init({"w": jnp.ones(2)})
    u, state = checked.update({"w": jnp.ones(2)}, state, factor=jnp.inf)
    np.testing.assert_array_equal(u["w"], [0.0, 0.0])
    assert int(state.skipped_steps) == 1 and not bool(state.last_finite)


def test_skip_wrapper_rejects_non_optimizer():
    with pytest.raises(TypeError, match="must be an optax GradientTransformation"):
        jaxamp.skip_nonfinite_updates(lambda g: g)


def test_optax_apply_if_finite_is_an_alternative():
    params = {"w": jnp.arange(3.0)}
    opt = optax.apply_if_finite(optax.adam(0.1), max_consecutive_errors=5)
    state = opt.init(params)
    updates, state1 = opt.update({"w": jnp.array([jnp.nan, 1.0, 1.0])}, state, params)
    assert float(jnp.abs(updates["w"]).max()) == 0.0
    assert int(state1.notfinite_count) == 1
    updates, state2 = opt.update({"w": jnp.ones(3)}, state1, params)
    assert float(jnp.abs(updates["w"]).min()) > 0
    assert int(state2.notfinite_count) == 0


def test_optimizer_update_for_equinox():
    model = eqx.nn.Linear(3, 2, key=jax.random.key(0))
    opt = optax.adam(0.1)
    opt_state = opt.init(eqx.filter(model, eqx.is_array))
    grads = jax.tree_util.tree_map(jnp.ones_like, eqx.filter(model, eqx.is_array))
    bad = jax.tree_util.tree_map(lambda g: g * jnp.inf, grads)
    update = eqx.filter_jit(jaxamp.optimizer_update)

    m1, s1 = update(model, opt, opt_state, bad, jaxamp.all_finite(bad))
    assert _tree_equal(m1, model) and _tree_equal(s1, opt_state)
    m2, s2 = update(model, opt, opt_state, grads, jaxamp.all_finite(grads))
    # Adam's first step is lr * sign(g) (up to eps): every parameter moves by -0.1.
    np.testing.assert_allclose(m2.weight, model.weight - 0.1, rtol=1e-5)
    np.testing.assert_allclose(m2.bias, model.bias - 0.1, rtol=1e-5)
    assert int(s2[0].count) == 1 and int(s1[0].count) == 0
    # A Python bool works as the predicate.
    m3, _ = jaxamp.optimizer_update(model, opt, opt_state, grads, False)
    assert _tree_equal(m3, model)
    with pytest.raises(TypeError, match="must be an optax GradientTransformation"):
        jaxamp.optimizer_update(model, lambda g: g, opt_state, grads, True)
    with pytest.raises(ValueError, match="grads_finite must be a scalar"):
        jaxamp.optimizer_update(model, opt, opt_state, grads, jnp.ones(2, bool))


def test_optimizer_update_keeps_float16_parameters_float16():
    """float32 gradients (what dynamic_scale_* return) on float16 parameters:
    the sum is formed in float32 and stored as float16."""
    model = {"w": jnp.asarray([1.0, 2.0], jnp.float16), "tag": "static"}
    opt = optax.sgd(1e-3)
    opt_state = opt.init(eqx.filter(model, eqx.is_array))
    grads = {"w": jnp.asarray([1.0, -1.0], jnp.float32), "tag": None}
    with jax.numpy_dtype_promotion("strict"):
        new, _ = jaxamp.optimizer_update(model, opt, opt_state, grads, True)
    assert new["w"].dtype == jnp.float16 and new["tag"] == "static"
    want = (np.float32([1.0, 2.0]) - 1e-3 * np.float32([1.0, -1.0])).astype(np.float16)
    np.testing.assert_array_equal(new["w"], want)


def _scanned_loss(params, x):
    """A 3-layer scanned tanh MLP (stacked weights: the low-precision
    optimizer's layer-by-layer path) with a mean-square loss."""

    def layer(h, w):
        return jnp.tanh(h @ w), None

    h, _ = jax.lax.scan(layer, x, params["w"])
    return jnp.mean((h + params["b"]).astype(jnp.float32) ** 2)


SKIP_RECIPES = {
    "bf16 params + SR": dict(param=jnp.bfloat16, compute=jnp.bfloat16, state=None),
    "int8 state": dict(param=jnp.bfloat16, compute=jnp.bfloat16, state="int8"),
    "float16 + dynamic scaling": dict(param=jnp.float32, compute=jnp.float16),
}


def _same_bits(a, b) -> bool:
    """Bit-for-bit equality (a negative zero differs from a positive one)."""
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@pytest.mark.parametrize("form", ["skip_nonfinite_updates", "optimizer_update"])
@pytest.mark.parametrize("recipe", sorted(SKIP_RECIPES))
def test_skipped_step_is_bit_identical_under_jit_with_donation(recipe, form):
    r = SKIP_RECIPES[recipe]
    key = jax.random.key(0)
    params = {
        "w": (jax.random.normal(key, (3, 128, 128)) / 12).astype(r["param"]),
        "b": jnp.zeros((128,), r["param"]),
    }
    if r["param"] == jnp.bfloat16:
        opt = jaxamp.low_precision_optimizer(
            optax.adamw(1e-2),
            state_dtype=r["state"] or jnp.bfloat16,
            min_quantized_size=1,
        )
    else:
        opt = optax.adamw(1e-2)
    wrapped = form == "skip_nonfinite_updates"
    if wrapped:
        opt = jaxamp.skip_nonfinite_updates(opt)
    amp_loss = jaxamp.amp(_scanned_loss, compute_dtype=r["compute"])
    vg = jaxamp.dynamic_scale_value_and_grad(amp_loss, filter=False)

    def step(params, state, scaler, x):
        scaler, (loss, grads) = vg(params, x, dynamic_scaler_state=scaler)
        if not wrapped:
            finite = jaxamp.all_finite(grads)
            return (*jaxamp.optimizer_update(params, opt, state, grads, finite), scaler)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, scaler

    donated = jax.jit(step, donate_argnums=(0, 1))
    x = jax.random.normal(jax.random.key(1), (16, 128)).astype(r["param"])
    bad = x.at[3, 5].set(jnp.inf)
    copy = lambda t: jax.tree.map(lambda a: jnp.array(a, copy=True), t)  # noqa: E731
    scaler = (
        jaxamp.DynamicScalerState()
        if r["compute"] == jnp.float16
        else jaxamp.StaticScalerState()
    )
    state = opt.init(params)
    params, state, scaler = donated(params, state, scaler, x)  # one real step
    # a negative zero stays one through a skipped step (p + -0.0 is p)
    params["b"] = params["b"].at[:4].set(-0.0)
    before_p, before_s = copy(params), copy(state)
    p2, s2, scaler2 = donated(params, state, scaler, bad)
    for a, b in zip(jax.tree.leaves(p2), jax.tree.leaves(before_p)):
        assert _same_bits(a, b)
    unchanged = (s2.inner_state, before_s.inner_state) if wrapped else (s2, before_s)
    for a, b in zip(*map(jax.tree.leaves, unchanged)):
        assert _same_bits(a, b)
    if wrapped:
        assert int(s2.skipped_steps) == int(before_s.skipped_steps) + 1
        assert not bool(s2.last_finite)
    # the next finite step updates every leaf
    p3, s3, _ = donated(p2, s2, scaler2, x)
    if wrapped:
        assert int(s3.skipped_steps) == 1 and bool(s3.last_finite)
    for a, b in zip(jax.tree.leaves(p3), jax.tree.leaves(before_p)):
        assert not np.array_equal(np.asarray(a), np.asarray(b))
