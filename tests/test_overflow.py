"""Forward overflows are never silent (jaxamp/_base/_overflow.py): find_overflows names
the equation and its source line, overflow_check turns a fresh float16 overflow
into NaN so that the step is skipped and counted, and a float16 model whose
residual stream grows past 256 trains like float32.

The overflow scenario is the GPU run's collapse: a LayerNorm ``square`` in
float16 overflows once |x - mean| > 256, ``rsqrt(inf) = 0`` zeroes the output,
and no inf or NaN reaches the loss or the gradients.
"""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import rel_l2

import jaxamp

F16 = np.dtype(jnp.float16)
# The policy without the range rule: squares follow the compute dtype.
NO_RANGE_RULE = {**jaxamp.default_amp_policy, "square": jaxamp.use_compute_precision}


def rounded(x):
    return jnp.asarray(x, jnp.float32).astype(jnp.float16).astype(jnp.float32)


def layer_norm(h):
    m = h.mean(-1, keepdims=True)
    var = jnp.square(h - m).mean(-1, keepdims=True)  # SQUARE_LINE
    return (h - m) * jax.lax.rsqrt(var + 1e-5)


SQUARE_LINE = next(
    i + 1
    for i, line in enumerate(Path(__file__).read_text().splitlines())
    if line.rstrip().endswith("# SQUARE_LINE")
)


def model(params, x):
    """x @ w_in (activations in the thousands), two residual blocks in a
    checkpointed scan, a LayerNorm head."""

    def block(h, w):
        return h + jax.nn.gelu(layer_norm(h) @ w[0]) @ w[1], None

    h = x @ params["w_in"]
    h, _ = jax.lax.scan(jax.checkpoint(block), h, params["blocks"])
    return layer_norm(h) @ params["w_out"]


def init(scale):
    k = np.random.RandomState(0)
    d = 16
    return {
        "w_in": rounded(k.randn(d, d) * scale / np.sqrt(d)),
        "blocks": rounded(k.randn(2, 2, d, d) / np.sqrt(d) * 0.5),
        "w_out": rounded(k.randn(d, 4) / np.sqrt(d)),
    }


X = rounded(np.random.RandomState(1).randn(32, 16))
Y = rounded(np.random.RandomState(2).randn(32, 4))


def loss(params, x=X, y=Y):
    return jnp.mean(jnp.square(model(params, x) - y))


def test_find_overflows_names_the_square_and_its_line():
    params = init(scale=2000.0)  # |x - mean| in the thousands
    h = X @ params["w_in"]
    assert float(jnp.abs(h - h.mean(-1, keepdims=True)).max()) > 1000
    found = jaxamp.find_overflows(loss, params, amp_policy=NO_RANGE_RULE)
    assert found, "the float16 square must overflow"
    first = found[0]
    assert first.primitive == "square"
    assert f"test_overflow.py:{SQUARE_LINE}" in first.source, first.source
    assert first.dtype == F16
    assert 256 < first.max_input < 65504 and first.count > 0
    assert "square" in first.equation
    # The default policy keeps the statistic in float32: nothing overflows.
    assert jaxamp.find_overflows(loss, params) == []


def test_without_the_check_the_collapse_is_silent_with_it_the_step_is_skipped():
    params = init(scale=2000.0)
    silent = jaxamp.amp(
        loss, compute_dtype=jnp.float16, amp_policy=NO_RANGE_RULE, overflow_check=False
    )
    value, grads = jax.value_and_grad(silent)(params)
    # Finite loss and gradients: loss scaling alone cannot see anything.
    assert np.isfinite(value) and all(
        np.isfinite(g).all() for g in jax.tree.leaves(grads)
    )

    checked = jaxamp.amp(loss, compute_dtype=jnp.float16, amp_policy=NO_RANGE_RULE)
    opt = jaxamp.skip_nonfinite_updates(optax.sgd(1e-3))
    vg = jaxamp.dynamic_scale_value_and_grad(checked, filter=False)
    scaler = jaxamp.DynamicScalerState(scaler=2.0**8)
    opt_state = opt.init(params)
    scaler, (value, grads) = vg(params, dynamic_scaler_state=scaler)
    updates, opt_state = opt.update(grads, opt_state, params)
    assert np.isnan(value)  # the forward overflow is reported as a non-finite loss
    assert int(opt_state.skipped_steps) == 1 and int(scaler.total_resets) == 1
    assert all(float(jnp.abs(u).max()) == 0.0 for u in jax.tree.leaves(updates))


def test_minus_infinity_masks_are_not_poisoned():
    """A -inf mask is non-finite before amp touches it: left alone."""

    def f(w, x):
        s = x @ w
        mask = jnp.arange(s.shape[-1]) < 8
        return jax.nn.softmax(jnp.where(mask, s, -jnp.inf), -1) @ w.T

    w = rounded(np.random.RandomState(3).randn(16, 16) / 4)
    out = jaxamp.amp(f, compute_dtype=jnp.float16)(w, X)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, f(w, X), atol=2e-2)


def test_a_float16_overflow_becomes_nan_only_with_the_check():
    """``tanh(inf) = 1``: without the check the overflow of the first matmul
    vanishes into a finite output; with it, the overflowing value is NaN as a
    whole (one reduction per value), so the loss is NaN and the step skipped.
    Without an overflow the check changes nothing."""
    w = rounded(np.full((16, 16), 30.0))

    def f(w, x, scale):
        return jnp.tanh((x * scale) @ w) @ w

    for scale, overflows in ((1000.0, True), (10.0, False)):
        big = np.abs(np.asarray((X * scale) @ w)).max() > 65504
        assert big == overflows
        on = jaxamp.amp(f, compute_dtype=jnp.float16)(w, X, scale)
        off = jaxamp.amp(f, compute_dtype=jnp.float16, overflow_check=False)(
            w, X, scale
        )
        assert np.isfinite(off).all()
        if overflows:
            assert np.isnan(on).all()
        else:
            np.testing.assert_array_equal(on, off)


@pytest.mark.parametrize("scale", [1.0, 2000.0])
def test_float16_training_with_a_growing_residual_stream_tracks_float32(scale):
    """30 steps of SGD with momentum: residual-stream activations in the
    thousands (scale 2000) and unit scale. The float16 run (amp, dynamic loss
    scaling, skipped non-finite steps) follows float32's losses within 3%."""
    params = init(scale)
    opt = jaxamp.skip_nonfinite_updates(optax.sgd(3e-3, momentum=0.9))

    def train(loss_fn, scaled):
        vg = (
            jaxamp.dynamic_scale_value_and_grad(loss_fn, filter=False)
            if scaled
            else None
        )

        @jax.jit
        def step(p, s, scaler):
            if scaled:
                scaler, (value, g) = vg(p, dynamic_scaler_state=scaler)
            else:
                value, g = jax.value_and_grad(loss_fn)(p)
            updates, s = opt.update(g, s, p)
            return optax.apply_updates(p, updates), s, scaler, value

        p, s, scaler = params, opt.init(params), jaxamp.DynamicScalerState()
        values = []
        for _ in range(30):
            p, s, scaler, value = step(p, s, scaler)
            values.append(float(value))
        return np.array(values), int(s.skipped_steps)

    ref, _ = train(loss, scaled=False)
    low, skipped = train(jaxamp.amp(loss, compute_dtype=jnp.float16), scaled=True)
    h = X @ params["w_in"]
    assert float(jnp.abs(h).max()) > (256 if scale > 1 else 0)
    finite = np.isfinite(low)
    assert finite.sum() >= 30 - skipped and skipped <= 5
    assert ref[-1] < 0.9 * ref[0]  # it learns
    assert rel_l2([low[finite]], [ref[finite]]) < 0.03, (low, ref)
