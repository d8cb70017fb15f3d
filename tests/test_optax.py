"""Tests of the optax integration (jaxamp/_optax.py): a step with non-finite
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
    out = jaxamp.select_tree(jnp.asarray(False), a, b)
    np.testing.assert_array_equal(out["x"], jnp.zeros(2))
    assert out["s"] == "a"
    with pytest.raises(ValueError, match="pred must be a scalar"):
        jaxamp.select_tree(jnp.ones(2, bool), a, b)


def _tree_equal(a, b):
    return all(
        bool(jnp.array_equal(x, y))
        for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b))
    )


@pytest.mark.parametrize("make", [optax.adam, optax.sgd, optax.adamw])
def test_skip_nonfinite_updates(make):
    params = {"w": jnp.arange(3.0), "b": jnp.ones(())}
    opt = jaxamp.skip_nonfinite_updates(make(0.1))
    state = opt.init(params)
    update = jax.jit(opt.update)
    good = {"w": jnp.ones(3), "b": jnp.ones(())}
    bad = {"w": jnp.array([1.0, jnp.inf, 1.0]), "b": jnp.ones(())}

    updates, state1 = update(bad, state, params)
    assert _tree_equal(updates, jax.tree_util.tree_map(jnp.zeros_like, params))
    assert _tree_equal(state1.inner_state, state.inner_state)
    assert int(state1.skipped_steps) == 1 and not bool(state1.last_finite)

    updates, state2 = update(good, state1, params)
    ref_updates, _ = jax.jit(make(0.1).update)(good, make(0.1).init(params), params)
    for u, r in zip(
        jax.tree_util.tree_leaves(updates), jax.tree_util.tree_leaves(ref_updates)
    ):
        np.testing.assert_allclose(u, r, rtol=1e-6)  # as if the bad step never happened
    assert int(state2.skipped_steps) == 1 and bool(state2.last_finite)


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

    m1, s1 = jaxamp.optimizer_update(model, opt, opt_state, bad, jaxamp.all_finite(bad))
    assert _tree_equal(m1, model) and _tree_equal(s1, opt_state)
    m2, _ = jaxamp.optimizer_update(
        model, opt, opt_state, grads, jaxamp.all_finite(grads)
    )
    np.testing.assert_allclose(m2.weight, model.weight - 0.1, rtol=1e-5)
