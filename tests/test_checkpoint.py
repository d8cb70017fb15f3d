"""Checkpoint and resume with orbax-checkpoint: bfloat16 parameters, the state
of low_precision_optimizer (bfloat16, int8 and Kahan buffers) inside
skip_nonfinite_updates, and DynamicScalerState, saved mid-run with
``ocp.StandardCheckpointer`` and restored into an abstract target, train on bit
for bit as the uninterrupted run, a skipped (overflowing) step included."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxamp

ocp = pytest.importorskip("orbax.checkpoint")

STEPS, SAVE_AFTER = 6, 3
OVERFLOW_STEPS = (1, 4)  # one skipped step before the checkpoint, one after


def _params():
    k = jax.random.split(jax.random.key(0), 3)
    return {
        # stacked like lax.scan's layers: int8 state updates them per layer
        "layers": (jax.random.normal(k[0], (2, 32, 256)) / 6).astype(jnp.bfloat16),
        "out": (jax.random.normal(k[1], (32, 8)) / 6).astype(jnp.bfloat16),
        "bias": jnp.zeros((8,), jnp.float32),
    }


def _loss(params, x):
    h = x
    for i in range(params["layers"].shape[0]):
        h = jnp.tanh(h @ params["layers"][i][:, :32])
    y = h @ params["out"] + params["bias"]
    return jnp.mean(jnp.square(y - jnp.sin(x[:, :8])))


def _batch(i):
    x = jax.random.normal(jax.random.fold_in(jax.random.key(1), i), (16, 32))
    # float16 matmuls overflow on this batch: a non-finite gradient, a skip
    return x * 1e6 if i in OVERFLOW_STEPS else x


def _setup(rounding, state_dtype):
    tx = jaxamp.skip_nonfinite_updates(
        jaxamp.low_precision_optimizer(
            optax.adamw(3e-3, weight_decay=0.1),
            rounding=rounding,
            state_dtype=state_dtype,
            min_quantized_size=256,
        )
    )
    vg = jaxamp.dynamic_scale_value_and_grad(
        jaxamp.amp(_loss, compute_dtype=jnp.float16), filter=False
    )

    @jax.jit
    def step(params, opt_state, scaler, x):
        scaler, (_, grads) = vg(params, x, dynamic_scaler_state=scaler)
        with jax.numpy_dtype_promotion("standard"):  # optax's Adam
            updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, scaler

    params = _params()
    with jax.numpy_dtype_promotion("standard"):
        opt_state = tx.init(params)
    return step, (params, opt_state, jaxamp.DynamicScalerState(scaler=2.0**10))


def _train(step, run, start, stop):
    for i in range(start, stop):
        run = step(*run, _batch(i))
    return run


def _assert_bit_identical(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(la, lb):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize(
    "rounding,state_dtype",
    [("stochastic", jnp.bfloat16), ("stochastic", "int8"), ("kahan", "int8")],
)
def test_resume_from_orbax_checkpoint_is_bit_identical(tmp_path, rounding, state_dtype):
    step, start = _setup(rounding, state_dtype)
    straight = _train(step, start, 0, STEPS)

    run = _train(step, start, 0, SAVE_AFTER)
    path = tmp_path / "ckpt"
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path, run)
        ckptr.wait_until_finished()
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, run)
    del run
    with ocp.StandardCheckpointer() as ckptr:
        restored = ckptr.restore(path, abstract)
    resumed = _train(step, tuple(restored), SAVE_AFTER, STEPS)

    _assert_bit_identical(resumed, straight)
    params, opt_state, scaler = resumed
    # the overflowing batches were skipped (one before, one after the save),
    # the stored buffers kept their low-precision dtypes through the restore
    assert int(opt_state.skipped_steps) == len(OVERFLOW_STEPS)
    assert int(scaler.total_resets) == len(OVERFLOW_STEPS)
    assert params["layers"].dtype == jnp.bfloat16
    inner = opt_state.inner_state
    leaves = jax.tree.leaves(inner.inner_state)
    want = jnp.int8 if state_dtype == "int8" else jnp.bfloat16
    assert any(x.dtype == want for x in leaves)
    if rounding == "kahan":
        assert inner.compensation["layers"].dtype == jnp.bfloat16
    assert not np.array_equal(np.asarray(params["layers"]), _params()["layers"])
