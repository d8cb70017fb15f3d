"""Tests of loss scaling (jaxamp/_scaler.py): the exact scaler state machine,
unscaling with the scale that produced the gradients, bounds that survive
jit / tree_map / savez, and a float16 model that only trains with scaling."""

import itertools

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
    """The scaler sequence on x**3 at x=2 in float16, from first principles.

    The scaled loss 8*s and the scaled gradient 3*x**2*s = 12*s are float16
    values: finite iff 12*s <= 65504, i.e. s <= 2**12 for powers of two.
    """
    ok = lambda s: 12 * s <= F16_MAX
    s, count, resets, out = start, 0, 0, []
    for _ in range(n_steps):
        tries = 0
        while not ok(s) and tries < redo_on_nan:  # recomputed inside the call
            s, count, resets, tries = s / 2, 0, resets + 1, tries + 1
        if ok(s):
            count += 1
            if count >= patience:
                s, count = s * 2, 0
        else:
            s, count, resets = s / 2, 0, resets + 1
        out.append((s, count, resets))
    return out


def test_reference_sequence_matches_the_issue():
    seq = reference_sequence(16, redo_on_nan=0)
    scales = [s for s, _, _ in seq]
    # Three overflows (2**15, 2**14, 2**13), settles at 2**12, grows to 2**13
    # after 10 finite steps, and falls back on the next overflow.
    assert scales[:3] == [2.0**14, 2.0**13, 2.0**12]
    assert scales[3:12] == [2.0**12] * 9 and scales[12] == 2.0**13
    assert scales[13] == 2.0**12


CASES = list(itertools.product([True, False], [True, False], [True, False], [0, 3]))


@pytest.mark.parametrize("value_and_grad, filt, has_aux, redo", CASES)
def test_exact_scaler_sequence(value_and_grad, filt, has_aux, redo):
    maker = (
        jaxamp.dynamic_scale_value_and_grad
        if value_and_grad
        else jaxamp.dynamic_scale_grad
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
        produced_by = float(state.scaler)
        state, res = g(x, dynamic_scaler_state=state)
        assert (float(state.scaler), int(state.count), int(state.total_resets)) == (
            s,
            count,
            resets,
        ), step
        if value_and_grad:
            value, grads = res
            loss = value[0] if has_aux else value
        else:
            grads = res[0] if has_aux else res
        finite = bool(jnp.isfinite(grads))
        if finite:
            # Unscaled with the scale that produced them, also on the step where
            # the scale grows (mpx's bug halved the gradients there).
            assert grads.dtype == jnp.float32 and float(grads) == 12.0
            if value_and_grad:
                assert float(loss) == 8.0
        else:
            assert redo < 3 and produced_by > 2.0**12


def test_redo_on_nan_recovers_within_one_call():
    g = jax.jit(jaxamp.dynamic_scale_grad(cube, redo_on_nan=5, filter=False))
    state, grads = g(
        jnp.asarray(2.0, jnp.float16), dynamic_scaler_state=jaxamp.DynamicScalerState()
    )
    assert float(grads) == 12.0
    assert float(state.scaler) == 2.0**12 and int(state.total_resets) == 3


def test_argnums_with_filter_false():
    f = lambda a, b: (a * b).astype(jnp.float32).sum()
    g = jaxamp.dynamic_scale_grad(f, filter=False, argnums=(0, 1))
    a, b = jnp.asarray(3.0, jnp.float16), jnp.asarray(5.0, jnp.float16)
    _, (ga, gb) = g(a, b, dynamic_scaler_state=jaxamp.DynamicScalerState(scaler=256))
    assert (float(ga), float(gb)) == (5.0, 3.0)
    with pytest.raises(ValueError, match="argnums is only supported"):
        jaxamp.dynamic_scale_grad(f, filter=True, argnums=1)


def test_static_scaler_has_the_same_call_shape():
    g = jaxamp.dynamic_scale_value_and_grad(cube, filter=False)
    x = jnp.asarray(2.0, jnp.bfloat16)
    state, (value, grads) = g(x, dynamic_scaler_state=jaxamp.StaticScalerState())
    assert isinstance(state, jaxamp.StaticScalerState)
    assert float(value) == 8.0 and float(grads) == 12.0
    state, (_, grads) = g(x, dynamic_scaler_state=jaxamp.StaticScalerState(4.0))
    assert float(grads) == 12.0 and float(state.scaler) == 4.0


def test_bad_inputs():
    with pytest.raises(ValueError, match="scaler=0"):
        jaxamp.DynamicScalerState(scaler=0)
    with pytest.raises(ValueError, match="adjust_factor=1.0 must be > 1"):
        jaxamp.DynamicScalerState(adjust_factor=1.0)
    with pytest.raises(ValueError, match="min_scaler=8.0 > max_scaler=4.0"):
        jaxamp.DynamicScalerState(min_scaler=8.0, max_scaler=4.0)
    g = jaxamp.dynamic_scale_grad(cube)
    with pytest.raises(TypeError, match="pass it by keyword"):
        g(jnp.ones(()), jaxamp.DynamicScalerState())
    with pytest.raises(TypeError, match="missing keyword argument"):
        g(jnp.ones(()))
    with pytest.raises(ValueError, match="redo_on_nan"):
        jaxamp.dynamic_scale_grad(cube, redo_on_nan=-1)


def test_bounds_and_fields_survive_jit_tree_map_and_savez(tmp_path):
    state = jaxamp.DynamicScalerState(
        patience=7,
        adjust_factor=3.0,
        scaler=2.0**10,
        min_scaler=2.0**9,
        max_scaler=2.0**11,
    )
    fields = lambda s: [float(x) for x in s]
    jitted = jax.jit(lambda s: s)(state)
    assert isinstance(jitted, jaxamp.DynamicScalerState)
    assert fields(jitted) == fields(state)
    mapped = jax.tree_util.tree_map(lambda x: x, state)
    assert fields(mapped) == fields(state)
    np.savez(tmp_path / "s.npz", **state._asdict())
    loaded = jaxamp.DynamicScalerState(**np.load(tmp_path / "s.npz"))
    assert fields(loaded) == fields(state)
    # The bounds act after the round trips: clamped at 2**9 and 2**11.
    down = jax.jit(lambda s: s.adjust(jnp.asarray(False)))(loaded)
    assert float(down.scaler) == 2.0**9
    up = jaxamp.DynamicScalerState(**{**loaded._asdict(), "count": 6}).adjust(True)
    assert float(up.scaler) == 2.0**11 and int(up.count) == 0


def test_float16_model_trains_only_with_loss_scaling():
    """A regression whose float16 gradients underflow to exactly zero."""
    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (64, 16), jnp.float32)
    w_true = jax.random.normal(kw, (16, 1), jnp.float32)
    x = x.astype(jnp.float16).astype(jnp.float32)
    y = x @ w_true

    def loss(w):
        return 1e-7 * jnp.mean(jnp.square(x @ w - y))

    amp_loss = jaxamp.amp(loss, compute_dtype=jnp.float16)
    w0 = jnp.zeros((16, 1), jnp.float32)
    assert float(jnp.abs(jax.grad(amp_loss)(w0)).max()) == 0.0  # underflow

    opt = jaxamp.skip_nonfinite_updates(optax.adam(0.1))
    # Too large a start: the first steps overflow and are skipped.
    scaler = jaxamp.DynamicScalerState(scaler=2.0**40, max_scaler=2.0**40)
    vg = jaxamp.dynamic_scale_value_and_grad(amp_loss, filter=False)

    @jax.jit
    def step(w, opt_state, scaler):
        scaler, (value, grads) = vg(w, dynamic_scaler_state=scaler)
        updates, opt_state = opt.update(grads, opt_state, w)
        return optax.apply_updates(w, updates), opt_state, scaler, value

    w, opt_state = w0, opt.init(w0)
    first = float(loss(w0))
    # optax's adam mixes Python floats with its int32 step count, which strict
    # promotion rejects; the promotion mode only affects optax's own code here.
    with jax.numpy_dtype_promotion("standard"):
        for _ in range(60):
            w, opt_state, scaler, value = step(w, opt_state, scaler)
    skipped = int(opt_state.skipped_steps)
    print(f"skipped steps: {skipped}, final loss scale: {float(scaler.scaler)}")
    assert float(loss(w)) < 0.5 * first
    assert skipped > 0 and skipped == int(scaler.total_resets)
    assert bool(jnp.isfinite(scaler.scaler))
