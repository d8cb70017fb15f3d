"""Tests of loss scaling (jaxamp/_training/_scaler.py): the exact scaler state machine,
unscaling with the scale that produced the gradients, bounds that survive
jit / tree_map / savez, errors on bad input, and a float16 model that only trains
with scaling."""

import itertools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxamp

F16_MAX = float(jnp.finfo(jnp.float16).max)  # 65504


def cube(x):
    return x**3


def cube_aux(x):
    return x**3, {"half": x * 0.5}


def reference_sequence(n_steps, redo_on_nan, patience=10, start=2.0**15):
    """The scaler states after each call on x**3 at x=2 in float16.

    Derived from first principles: the scaled loss is 8*s and the scaled
    gradient 3*x**2*s = 12*s, both float16; for a power-of-two scale s they are
    exact unless they exceed 65504, so the gradient is finite iff 12*s <= 65504,
    i.e. s <= 2**12. The update rule is jaxamp 0.0.4's: non-finite -> s /= 2,
    count = 0, resets += 1; finite -> if count >= patience: s *= 2, count = 0,
    else count += 1. With redo_on_nan, a non-finite attempt shrinks the scale
    and the call recomputes, up to redo_on_nan times.
    """
    ok = lambda s: 12 * s <= F16_MAX
    s, count, resets, out = start, 0, 0, []
    for _ in range(n_steps):
        tries = 0
        while not ok(s) and tries < redo_on_nan:  # recomputed inside the call
            s, count, resets, tries = s / 2, 0, resets + 1, tries + 1
        if not ok(s):
            s, count, resets = s / 2, 0, resets + 1
        elif count >= patience:
            s, count = s * 2, 0
        else:
            count += 1
        out.append((s, count, resets))
    return out


def test_reference_sequence_matches_the_issue():
    seq = reference_sequence(16, redo_on_nan=0)
    scales = [s for s, _, _ in seq]
    # Three overflows (2**15, 2**14, 2**13) bring it to 2**12, where it settles;
    # after 10 finite steps (count 1..10) the next finite step grows it to 2**13,
    # which overflows on the next step and falls back to 2**12.
    assert scales[:3] == [2.0**14, 2.0**13, 2.0**12]
    assert [c for _, c, _ in seq[3:13]] == list(range(1, 11))
    assert scales[3:13] == [2.0**12] * 10
    assert scales[13] == 2.0**13 and seq[13][1] == 0
    assert scales[14] == 2.0**12 and seq[14][2] == 4
    # jaxamp 0.0.4's own test of redo_on_nan: the first call ends at 2**12 with
    # count 1; the 11th grows to 2**13 (count 0); the 12th recovers to 2**12,
    # count 1.
    redo = reference_sequence(12, redo_on_nan=100)
    assert redo[0][:2] == (2.0**12, 1)
    assert [c for _, c, _ in redo[:10]] == list(range(1, 11))
    assert redo[10][:2] == (2.0**13, 0) and redo[11][:2] == (2.0**12, 1)


CASES = list(itertools.product([True, False], [True, False], [True, False], [0, 3]))


@pytest.mark.parametrize("value_and_grad, filt, has_aux, redo", CASES)
def test_exact_scaler_sequence(value_and_grad, filt, has_aux, redo):
    maker = (
        jaxamp.dynamic_scale_value_and_grad
        if value_and_grad
        else jaxamp.training.dynamic_scale_grad
    )
    g = jax.jit(
        maker(
            cube_aux if has_aux else cube,
            has_aux=has_aux,
            filter=filt,
            redo_on_nan=redo,
        )
    )
    state = jaxamp.DynamicScalerState(patience=10)
    x = jnp.asarray(2.0, jnp.float16)
    expected = reference_sequence(16, redo)
    for step, (s, count, resets) in enumerate(expected):
        state, res = g(x, dynamic_scaler_state=state)
        got = (float(state.scaler), int(state.count), int(state.total_resets))
        assert got == (s, count, resets), step
        assert float(state.min_scaler) == 1.0 and int(state.patience) == 10
        if value_and_grad:
            value, grads = res
            loss, aux = value if has_aux else (value, None)
        else:
            grads, aux = res if has_aux else (res, None)
        if has_aux:  # aux passes through untouched
            assert aux["half"].dtype == jnp.float16 and float(aux["half"]) == 1.0
        # A step is finite iff the scale that produced it (before a growth) was
        # <= 2**12; growth happens only on finite steps.
        assert grads.dtype == jnp.float32
        if bool(jnp.isfinite(grads)):
            # Unscaled with the scale that produced them, also on the step where
            # the scale grows (mpx's bug halved the gradients there).
            assert float(grads) == 12.0
            if value_and_grad:
                assert loss.dtype == jnp.float32 and float(loss) == 8.0
        else:
            assert redo == 0 and step in (0, 1, 2, 14)


def test_gradients_on_the_growth_step_equal_unscaled_float32_gradients():
    """The mpx bug: unscaling with the adjusted scale halves the gradients on
    every step where the scale grows. Here every third step is a growth step."""
    c = jnp.linspace(-2.0, 2.0, 8, dtype=jnp.float32)
    w32 = jnp.linspace(0.5, 1.5, 8, dtype=jnp.float32)
    w16 = w32.astype(jnp.float16)

    def loss(w):
        return jnp.sum(jnp.tanh(w * c.astype(w.dtype)) ** 2) / 8

    g = jax.jit(jaxamp.dynamic_scale_value_and_grad(loss, filter=False))
    # The float16 gradients at scale 1: for power-of-two scales without
    # overflow or underflow the scaled float16 computation is exact scaling, so
    # the unscaled gradients must equal these bit for bit.
    _, (v1, g1) = g(w16, dynamic_scaler_state=jaxamp.StaticScalerState())
    ref_value, ref_grads = jax.value_and_grad(loss)(w16.astype(jnp.float32))
    state = jaxamp.DynamicScalerState(patience=2, scaler=2.0**4)
    grew = 0
    for _ in range(9):
        before = float(state.scaler)
        state, (value, grads) = g(w16, dynamic_scaler_state=state)
        if float(state.scaler) > before:
            grew += 1
            assert grads.dtype == jnp.float32 and value.dtype == jnp.float32
            np.testing.assert_array_equal(grads, g1)
            assert float(value) == float(v1)
            # float16 forward/backward vs float32: within float16 rounding.
            np.testing.assert_allclose(grads, ref_grads, rtol=1e-2, atol=1e-3)
            np.testing.assert_allclose(value, ref_value, rtol=1e-2)
    assert grew == 3 and float(state.scaler) == 2.0**7


def test_redo_on_nan_recovers_within_one_call():
    g = jax.jit(jaxamp.training.dynamic_scale_grad(cube, redo_on_nan=5, filter=False))
    state, grads = g(
        jnp.asarray(2.0, jnp.float16), dynamic_scaler_state=jaxamp.DynamicScalerState()
    )
    # 2**15, 2**14, 2**13 overflow (12*s > 65504); 2**12 is finite.
    assert float(grads) == 12.0
    assert float(state.scaler) == 2.0**12 and int(state.total_resets) == 3
    assert int(state.count) == 1


def test_redo_on_nan_stops_at_min_scaler():
    g = jax.jit(jaxamp.training.dynamic_scale_grad(cube, redo_on_nan=5))
    state = jaxamp.DynamicScalerState(scaler=2.0**15, min_scaler=2.0**14)
    state, grads = g(jnp.asarray(2.0, jnp.float16), dynamic_scaler_state=state)
    # 2**15 overflows -> 2**14 (the floor); the retry overflows too; retrying at
    # the same scale would change nothing, so the loop stops; the final
    # adjustment keeps the floor.
    assert not bool(jnp.isfinite(grads))
    assert float(state.scaler) == 2.0**14 and int(state.total_resets) == 2


def test_redo_on_nan_carries_non_array_aux_and_works_under_filter_jit():
    def f(x):
        return x**3, ("label", x)

    g = eqx.filter_jit(
        jaxamp.dynamic_scale_value_and_grad(f, has_aux=True, redo_on_nan=4)
    )
    state, ((value, (label, x_out)), grads) = g(
        jnp.asarray(2.0, jnp.float16), dynamic_scaler_state=jaxamp.DynamicScalerState()
    )
    assert label == "label" and float(x_out) == 2.0
    assert (float(value), float(grads), float(state.scaler)) == (8.0, 12.0, 2.0**12)


def test_argnums_with_filter_false():
    f = lambda a, b: (a * b).astype(jnp.float32).sum()
    g = jaxamp.training.dynamic_scale_grad(f, filter=False, argnums=(0, 1))
    a, b = jnp.asarray(3.0, jnp.float16), jnp.asarray(5.0, jnp.float16)
    state = jaxamp.DynamicScalerState(scaler=256)
    _, (ga, gb) = g(a, b, dynamic_scaler_state=state)
    assert (float(ga), float(gb)) == (5.0, 3.0)
    _, (v, gb) = jaxamp.dynamic_scale_value_and_grad(f, filter=False, argnums=1)(
        a, b, dynamic_scaler_state=state
    )
    assert (float(v), float(gb)) == (15.0, 3.0)
    with pytest.raises(ValueError, match="argnums=1 needs filter=False"):
        jaxamp.training.dynamic_scale_grad(f, filter=True, argnums=1)


def test_a_loss_that_is_not_callable_is_named_at_once():
    for make in (
        jaxamp.training.dynamic_scale_grad,
        jaxamp.dynamic_scale_value_and_grad,
    ):
        with pytest.raises(TypeError, match="fun must be the loss function"):
            make(jnp.ones(3))
    with pytest.raises(TypeError, match="transform must be a gradient transformation"):
        jaxamp.training.dynamic_scale_tx(None)


def test_filter_true_differentiates_the_model_arrays_only():
    model = {"w": jnp.full((3,), 2.0, jnp.float16), "n": 3, "act": jnp.tanh}

    def loss(m, x):
        return jnp.sum(m["w"] * x) * m["n"]

    g = jaxamp.training.dynamic_scale_grad(loss)  # filter=True is the default
    state = jaxamp.DynamicScalerState(scaler=2.0**10)
    _, grads = g(model, jnp.ones(3, jnp.float16), dynamic_scaler_state=state)
    assert grads["n"] is None and grads["act"] is None
    np.testing.assert_array_equal(grads["w"], np.full(3, 3.0, np.float32))


def test_dynamic_scale_tx_has_the_0_0_4_call_shape():
    # dynamic_scale_tx(transform, redo_on_nan)(fun, **transform_kwargs)
    g = jax.jit(
        jaxamp.training.dynamic_scale_tx(jax.value_and_grad, redo_on_nan=100)(
            cube_aux, has_aux=True
        )
    )
    state = jaxamp.DynamicScalerState(patience=10)
    x = jnp.asarray(2.0, jnp.float16)
    for s, count, resets in reference_sequence(12, redo_on_nan=100):
        state, ((v, aux), grads) = g(x, dynamic_scaler_state=state)
        assert (float(v), float(aux["half"]), float(grads)) == (8.0, 1.0, 12.0)
        assert (float(state.scaler), int(state.count)) == (s, count)
        assert int(state.total_resets) == resets


def test_dynamic_scale_tx_other_transforms_and_custom_scaling():
    # A transform without aux: every float leaf of its results is unscaled.
    jac = jaxamp.training.dynamic_scale_tx(jax.jacrev)(cube)
    _, d = jac(
        jnp.asarray(2.0, jnp.float16),
        dynamic_scaler_state=jaxamp.StaticScalerState(8.0),
    )
    assert float(d) == 12.0 and d.dtype == jnp.float32
    with pytest.raises(ValueError, match="pass has_value=True"):
        jaxamp.training.dynamic_scale_tx(jax.jacrev)(cube_aux, has_aux=True)
    jac_aux = jaxamp.training.dynamic_scale_tx(jax.jacrev, has_value=False)(
        cube_aux, has_aux=True
    )
    _, (d, aux) = jac_aux(
        jnp.asarray(2.0, jnp.float16),
        dynamic_scaler_state=jaxamp.StaticScalerState(8.0),
    )
    assert (float(d), float(aux["half"])) == (12.0, 1.0)
    # jaxamp 0.0.4's hooks: scale_fn(output, state), unscale_fn(results, state).
    calls = []
    tx = jaxamp.training.dynamic_scale_tx(
        jax.grad,
        scale_fn=lambda out, st: (
            calls.append("scale") or out * st.scaler.astype(out.dtype)
        ),
        unscale_fn=lambda res, st: calls.append("unscale") or res / st.scaler,
    )
    _, d = tx(cube)(
        jnp.asarray(2.0, jnp.float32),
        dynamic_scaler_state=jaxamp.StaticScalerState(4.0),
    )
    assert float(d) == 12.0 and calls == ["scale", "unscale"]


def test_static_scaler_has_the_same_call_shape():
    """float16 <-> bfloat16 is a one-line switch of the state."""
    g = jax.jit(jaxamp.dynamic_scale_value_and_grad(cube, filter=False, redo_on_nan=2))
    x = jnp.asarray(2.0, jnp.bfloat16)
    state, (value, grads) = g(x, dynamic_scaler_state=jaxamp.StaticScalerState())
    assert isinstance(state, jaxamp.StaticScalerState) and float(state.scaler) == 1.0
    assert (float(value), float(grads)) == (8.0, 12.0)
    assert grads.dtype == jnp.float32
    state, (_, grads) = g(x, dynamic_scaler_state=jaxamp.StaticScalerState(4.0))
    assert float(grads) == 12.0 and float(state.scaler) == 4.0
    # A static scale never adjusts, even on overflow (float16, 12 * 2**13 > 65504).
    x16 = jnp.asarray(2.0, jnp.float16)
    state, (_, grads) = g(x16, dynamic_scaler_state=jaxamp.StaticScalerState(2.0**13))
    assert not bool(jnp.isfinite(grads)) and float(state.scaler) == 2.0**13


def test_bad_inputs():
    with pytest.raises(ValueError, match="scaler=0 must be > 0"):
        jaxamp.DynamicScalerState(scaler=0)
    with pytest.raises(ValueError, match="scaler=-1.0 must be > 0"):
        jaxamp.DynamicScalerState(scaler=np.float32(-1.0))
    with pytest.raises(ValueError, match="adjust_factor=1.0 must be > 1"):
        jaxamp.DynamicScalerState(adjust_factor=1.0)
    with pytest.raises(ValueError, match="adjust_factor=0.5 must be > 1"):
        jaxamp.DynamicScalerState(adjust_factor=0.5)
    with pytest.raises(ValueError, match="min_scaler=8.0 > max_scaler=4.0"):
        jaxamp.DynamicScalerState(min_scaler=8.0, max_scaler=4.0)
    with pytest.raises(ValueError, match="min_scaler=0 must be > 0"):
        jaxamp.DynamicScalerState(min_scaler=0)
    with pytest.raises(ValueError, match="patience=-1 must be >= 0"):
        jaxamp.DynamicScalerState(patience=-1)
    with pytest.raises(ValueError, match="scaler must be a scalar"):
        jaxamp.DynamicScalerState(scaler=np.ones(2))
    with pytest.raises(ValueError, match="StaticScalerState: scaler=0.0 must be > 0"):
        jaxamp.StaticScalerState(0.0)
    g = jaxamp.training.dynamic_scale_grad(cube)
    with pytest.raises(TypeError, match="passed positionally; pass it by keyword"):
        g(jnp.ones(()), jaxamp.DynamicScalerState())
    with pytest.raises(TypeError, match="passed positionally; pass it by keyword"):
        g(jnp.ones(()), jaxamp.StaticScalerState())
    with pytest.raises(
        TypeError, match="missing keyword argument dynamic_scaler_state"
    ):
        g(jnp.ones(()))
    with pytest.raises(TypeError, match="must be a jaxamp.DynamicScalerState"):
        g(jnp.ones(()), dynamic_scaler_state=2.0**15)
    with pytest.raises(ValueError, match="redo_on_nan must be an int >= 0"):
        jaxamp.training.dynamic_scale_grad(cube, redo_on_nan=-1)
    with pytest.raises(ValueError, match="redo_on_nan must be an int >= 0"):
        jaxamp.dynamic_scale_value_and_grad(cube, redo_on_nan=1.5)


def test_validation_leaves_tracers_and_sentinels_alone():
    state = jaxamp.DynamicScalerState()
    # Trees that jax and users build from a state's structure are not states
    # to validate: in_axes trees, sentinels, None.
    zeros = jax.tree_util.tree_map(lambda _: 0, state)
    assert isinstance(zeros, jaxamp.DynamicScalerState) and zeros.scaler == 0
    treedef = jax.tree_util.tree_structure(state)
    sentinels = jax.tree_util.tree_unflatten(treedef, [object()] * len(state))
    assert type(sentinels) is jaxamp.DynamicScalerState
    # Batched states under vmap (tracers) and a state built from a tracer.
    batched = jax.tree_util.tree_map(lambda x: jnp.stack([x, x]), state)
    finite = jnp.asarray([True, False])
    out = jax.vmap(lambda s, f: s.adjust(f), in_axes=(zeros, 0))(batched, finite)
    np.testing.assert_array_equal(out.scaler, [2.0**15, 2.0**14])
    built = jax.jit(lambda s: jaxamp.DynamicScalerState(scaler=s))(jnp.float32(0.0))
    assert float(built.scaler) == 0.0  # not validated: a traced value
    # Key paths name the fields.
    paths = [
        jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(state)
    ]
    assert paths == [f".{name}" for name in state._fields]


def test_bounds_and_fields_survive_jit_tree_map_and_savez(tmp_path):
    state = jaxamp.DynamicScalerState(
        patience=7,
        adjust_factor=3.0,
        scaler=2.0**10,
        count=6,
        total_resets=5,
        min_scaler=2.0**9,
        max_scaler=2.0**11,
    )
    want = [7, 3.0, 2.0**10, 6, 5, 2.0**9, 2.0**11]
    dtypes = [jnp.int32, jnp.float32, jnp.float32, jnp.int32, jnp.int32]
    dtypes += [jnp.float32, jnp.float32]

    def check(s):
        assert isinstance(s, jaxamp.DynamicScalerState)
        assert [float(x) for x in s] == want
        assert [x.dtype for x in s] == dtypes

    check(state)
    check(jax.jit(lambda s: s)(state))
    check(jax.tree_util.tree_map(lambda x: x, state))
    check(jax.tree_util.tree_map(np.asarray, state))
    np.savez(tmp_path / "s.npz", **state._asdict())
    loaded = jaxamp.DynamicScalerState(**np.load(tmp_path / "s.npz"))
    check(loaded)
    # The bounds act after the round trips: 2**10 / 3 is clamped at 2**9, and
    # the growth after patience=7 finite steps (count 6 -> 7, then grow) at 2**11.
    down = jax.jit(lambda s: s.adjust(jnp.asarray(False)))(loaded)
    assert float(down.scaler) == 2.0**9 and int(down.total_resets) == 6
    up = jax.jit(lambda s: s.adjust(True).adjust(True))(loaded)
    assert float(up.scaler) == 2.0**11 and int(up.count) == 0
    # A jaxamp 0.0.4 state (four fields) loads with default bounds and counters.
    old = jaxamp.DynamicScalerState(
        patience=10, adjust_factor=2.0, scaler=2.0**15, count=3
    )
    assert (float(old.min_scaler), float(old.max_scaler)) == (1.0, 2.0**24)
    np.savez(tmp_path / "static.npz", **jaxamp.StaticScalerState(8.0)._asdict())
    static = jaxamp.StaticScalerState(**np.load(tmp_path / "static.npz"))
    assert float(static.scaler) == 8.0 and static.scaler.dtype == jnp.float32


def test_state_methods_scale_and_unscale():
    state = jaxamp.DynamicScalerState(scaler=4.0)
    tree = {"a": jnp.asarray(3.0, jnp.float16), "i": jnp.asarray(3), "n": None}
    scaled = state.scale(tree)
    assert scaled["a"].dtype == jnp.float16 and float(scaled["a"]) == 12.0
    assert int(scaled["i"]) == 3
    un = state.unscale(scaled)
    assert un["a"].dtype == jnp.float32 and float(un["a"]) == 3.0


@pytest.mark.slow
def test_float16_model_trains_only_with_loss_scaling():
    """A regression whose float16 gradients underflow to exactly zero: amp +
    dynamic loss scaling + the skip wrapper train it, a no-op scale does not."""
    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (64, 16), jnp.float32)
    w_true = jax.random.normal(kw, (16, 1), jnp.float32)
    x = x.astype(jnp.float16).astype(jnp.float32)
    y = x @ w_true

    def loss(w):
        # 1e-8 * mean squared error: the residual's cotangent 1e-8 * 2 * |r| / 64
        # (the loss chain runs in float32) is below float16's smallest subnormal
        # (6e-8) when it reaches the float16 matmul, whose backward pass
        # receives zeros.
        return 1e-8 * jnp.mean(jnp.square(x @ w - y))

    amp_loss = jaxamp.amp(loss, compute_dtype=jnp.float16)
    w0 = jnp.zeros((16, 1), jnp.float32)
    assert float(jnp.abs(jax.grad(amp_loss)(w0)).max()) == 0.0  # underflow

    opt = jaxamp.skip_nonfinite_updates(optax.adam(0.1))
    vg = jaxamp.dynamic_scale_value_and_grad(amp_loss, filter=False)

    @jax.jit
    def step(w, opt_state, scaler):
        scaler, (value, grads) = vg(w, dynamic_scaler_state=scaler)
        updates, opt_state = opt.update(grads, opt_state, w)
        return optax.apply_updates(w, updates), opt_state, scaler, value

    def train(scaler, steps=60):
        w, opt_state = w0, opt.init(w0)
        # optax's adam mixes Python floats with its int32 step count, which strict
        # promotion rejects; the promotion mode only affects optax's own code.
        with jax.numpy_dtype_promotion("standard"):
            for _ in range(steps):
                w, opt_state, scaler, _ = step(w, opt_state, scaler)
        return w, opt_state, scaler

    first = float(loss(w0))
    # Too large a start: the first steps overflow float16 and are skipped.
    start = jaxamp.DynamicScalerState(scaler=2.0**60, max_scaler=2.0**60)
    w, opt_state, scaler = train(start)
    skipped = int(opt_state.skipped_steps)
    print(f"skipped steps: {skipped}, final loss scale: {float(scaler.scaler)}")
    assert float(loss(w)) < 0.5 * first
    # Every overflow shrank the scale once and skipped exactly one step.
    assert skipped > 0 and skipped == int(scaler.total_resets)
    assert float(scaler.scaler) < 2.0**60
    # The one-line switch to no scaling: gradients stay zero, nothing is learnt.
    w, opt_state, _ = train(jaxamp.StaticScalerState(), steps=5)
    assert float(loss(w)) == first and int(opt_state.skipped_steps) == 0


def _triple(state):
    return float(state.scaler), int(state.count), int(state.total_resets)


def test_every_adjust_clips_to_the_bounds():
    """A scale built above max_scaler (2**16 > 65504, float16's largest value)
    is back within the bound after a finite step that does not grow it, and
    stays clipped through growth and shrinking."""
    state = jaxamp.DynamicScalerState(scaler=2.0**16, max_scaler=F16_MAX, patience=2)
    adjust = jax.jit(lambda s, f: s.adjust(f))
    steps = [True, True, True, False, True, True, True]
    got = []
    for finite in steps:
        state = adjust(state, jnp.asarray(finite))
        got.append(_triple(state))
    assert got == [
        (F16_MAX, 1, 0),  # no growth, clipped
        (F16_MAX, 2, 0),
        (F16_MAX, 0, 0),  # growth to 131008, clipped
        (F16_MAX / 2, 0, 1),
        (F16_MAX / 2, 1, 1),
        (F16_MAX / 2, 2, 1),
        (F16_MAX, 0, 1),
    ]
    # A shrinking step from far above the bound lands on the bound too.
    high = jaxamp.DynamicScalerState(scaler=2.0**20, max_scaler=2.0**16)
    assert _triple(high.adjust(False)) == (2.0**16, 0, 1)
    # Below min_scaler: clipped up on a finite step.
    low = jaxamp.DynamicScalerState(scaler=2.0**-15, min_scaler=2.0**-14)
    assert _triple(low.adjust(True)) == (2.0**-14, 1, 0)


def test_unbounded_max_keeps_a_finite_scale():
    # max_scaler=inf means no upper bound; a growth that overflows float32
    # keeps the scale instead of making it inf (jmp's first_finite).
    state = jaxamp.DynamicScalerState(scaler=2.0**127, patience=0, max_scaler=np.inf)
    assert _triple(state.adjust(True)) == (2.0**127, 0, 0)
    assert _triple(state.adjust(True).adjust(False)) == (2.0**126, 0, 1)


def test_non_finite_and_out_of_order_states_are_rejected():
    bad = [
        (dict(scaler=np.inf), "scaler=inf must be finite"),
        (dict(scaler=float("nan")), "scaler=nan must be finite"),
        (dict(scaler=jnp.asarray(-1.0)), "scaler=-1.0 must be > 0"),
        (dict(scaler=jnp.asarray(0.0)), r"scaler=0.0 must be > 0; a loss scale"),
        (dict(min_scaler=np.inf, max_scaler=np.inf), "min_scaler=inf must be"),
        (dict(max_scaler=np.nan), "max_scaler=nan must be finite"),
        (dict(adjust_factor=np.inf), r"adjust_factor=inf must be > 1 \(and finite"),
        (
            dict(min_scaler=jnp.asarray(8.0), max_scaler=jnp.asarray(4.0)),
            "min_scaler=8.0 > max_scaler=4.0; the bounds are out of order",
        ),
    ]
    for kwargs, match in bad:
        with pytest.raises(ValueError, match=match):
            jaxamp.DynamicScalerState(**kwargs)
    with pytest.raises(ValueError, match="StaticScalerState: scaler=inf must be"):
        jaxamp.StaticScalerState(np.inf)
    with pytest.raises(ValueError, match="grads_finite must be a scalar bool"):
        jaxamp.DynamicScalerState().adjust(jnp.ones(2, bool))
    # Concrete JAX arrays are validated and stored as float32 / int32.
    state = jaxamp.DynamicScalerState(
        scaler=jnp.asarray(8, jnp.int32), patience=jnp.asarray(3.0)
    )
    assert state.scaler.dtype == jnp.float32 and float(state.scaler) == 8.0
    assert state.patience.dtype == jnp.int32 and int(state.patience) == 3
    assert float(jaxamp.DynamicScalerState(max_scaler=np.inf).max_scaler) == np.inf
