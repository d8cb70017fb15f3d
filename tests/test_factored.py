"""Tests of the per-matrix Adafactor (jaxamp/_training/_factored.py) and of the
one-moment optimizers inside the backward pass (``update_in_backward``)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import STACK_D as D
from helpers import STACK_L as L
from helpers import hundreds_batch as _batch
from helpers import stacked_mlp as _net
from helpers import stacked_mlp_params as _params

import jaxamp
from jaxamp import _compat
from jaxamp._training import _factored
from jaxamp.training import layerwise_adafactor

LOSS = jaxamp.amp(_net, compute_dtype=jnp.bfloat16, residual_dtype="int8")


def _ordinary(tx):
    def step(params, state, x):
        value, grads = jax.value_and_grad(LOSS)(params, x)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value

    return step


def _ada(**kw):
    # D = 32: factor every matrix of the test model (its second-largest axis)
    return layerwise_adafactor(1e-2, min_dim_size_to_factor=D, **kw)


OPTIMIZERS = {
    "leanest": lambda: jaxamp.low_precision_optimizer(_ada(), state_dtype=None),
    "adafactor_int8_momentum": lambda: jaxamp.low_precision_optimizer(
        _ada(momentum=0.9, weight_decay=1e-4),
        state_dtype="int8",
        min_quantized_size=1024,  # the row and column statistics in bfloat16
    ),
    "lion_int8": lambda: jaxamp.low_precision_optimizer(
        optax.lion(1e-3, weight_decay=0.1), state_dtype="int8", min_quantized_size=256
    ),
}


def test_matches_optax_adafactor_per_matrix():
    # On a leaf of one or two axes the transform is optax.adafactor with the
    # same arguments; a stacked leaf (3 axes) is updated as if each layer
    # were its own parameter (optax.adafactor on each layer alone).
    kw = dict(
        min_dim_size_to_factor=8,
        multiply_by_parameter_scale=True,
        weight_decay=1e-3,
        momentum=0.9,
    )
    ours = layerwise_adafactor(1e-2, **kw)
    ref = optax.adafactor(
        1e-2,
        min_dim_size_to_factor=8,
        multiply_by_parameter_scale=True,
        weight_decay_rate=1e-3,
        momentum=0.9,
    )
    k = jax.random.split(jax.random.key(3), 3)
    params = {
        "w": jax.random.normal(k[0], (L, 16, 24)),
        "m": jax.random.normal(k[1], (16, 24)),
        "v": jax.random.normal(k[2], (24,)),
    }
    per_layer = [
        {"w": params["w"][i], "m": params["m"], "v": params["v"]} for i in range(L)
    ]
    s, s_ref = ours.init(params), [ref.init(p) for p in per_layer]
    for step in range(4):
        g = jax.tree.map(lambda p, t=step: (t + 1.0) * jnp.cos(3.0 * p + t), params)
        u, s = ours.update(g, s, params)
        for i, p in enumerate(per_layer):
            g_i = {**g, "w": g["w"][i]}
            u_i, s_ref[i] = ref.update(g_i, s_ref[i], p)
            np.testing.assert_allclose(u["w"][i], u_i["w"], rtol=2e-6, atol=1e-9)
            np.testing.assert_allclose(u["m"], u_i["m"], rtol=2e-6, atol=1e-9)
            np.testing.assert_allclose(u["v"], u_i["v"], rtol=2e-6, atol=1e-9)
    # one row and one column statistic per layer: the state is factored
    rows = s[0].v_row["w"]
    assert rows.shape == (L, 16) and s[0].v_col["w"].shape == (L, 24)
    assert float(jnp.abs(u["w"]).max()) > 0


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_ten_steps_in_the_backward_pass_match_the_ordinary_step(name):
    # bf16 parameters + stochastic rounding: the per-layer update inside the
    # transposed loop binds the same primitives on the same elements as the
    # ordinary step, so parameters and state are bit-identical after 10 steps.
    tx = OPTIMIZERS[name]()
    params = _params()
    state = tx.init(params)
    fused = jax.jit(jaxamp.update_in_backward(LOSS, tx), donate_argnums=(0, 1))
    ordinary = jax.jit(_ordinary(tx))
    a, b = (params, state), (params, state)
    a = jax.tree.map(jnp.copy, a)  # donated
    for i in range(10):
        *b, loss_b = ordinary(*b, _batch(i))
        *a, loss_a = fused(*a, _batch(i))
        assert float(loss_a) == float(loss_b)
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype, path
        np.testing.assert_array_equal(x, y, err_msg=jax.tree_util.keystr(path))
    assert a[0]["layers"]["w1"].dtype == jnp.bfloat16
    assert not np.array_equal(
        np.asarray(a[0]["layers"]["w1"]), _params()["layers"]["w1"]
    )


def _stacked_scan_outputs(jaxpr, shapes):
    """Per scan: the stacked outputs (ys) whose shape is a stacked weight's."""
    out = []
    for eqn, _ in jaxamp.tools.iter_equations(jaxpr):
        if eqn.primitive.name == "scan":
            n_carry = _compat.scan_carry_range(eqn.params)[1]
            out.append(
                [v.aval for v in eqn.outvars[n_carry:] if v.aval.shape in shapes]
            )
    return out


@pytest.mark.parametrize("name", ["leanest", "adafactor_int8_momentum"])
def test_factored_moments_are_updated_inside_the_transposed_loop(name):
    tx = OPTIMIZERS[name]()
    params = _params()
    state = tx.init(params)
    shapes = {x.shape for x in jax.tree.leaves(params["layers"]) if x.ndim == 3}
    fused = jaxamp.update_in_backward(LOSS, tx)
    ordinary = jax.make_jaxpr(_ordinary(tx))(params, state, _batch(0))
    assert any(len(s) == 2 for s in _stacked_scan_outputs(ordinary, shapes))
    jaxpr = jax.make_jaxpr(fused)(params, state, _batch(0))
    assert all(s == [] for s in _stacked_scan_outputs(jaxpr, shapes))
    # optax.adafactor's whole-leaf RMS clip needs every layer's gradient:
    # its stacked gradients exist (updated after the backward pass)
    whole = jaxamp.low_precision_optimizer(
        optax.adafactor(1e-2, min_dim_size_to_factor=D), state_dtype=None
    )
    jaxpr = jax.make_jaxpr(jaxamp.update_in_backward(LOSS, whole))(
        params, whole.init(params), _batch(0)
    )
    assert any(len(s) == 2 for s in _stacked_scan_outputs(jaxpr, shapes))


def test_the_leanest_state_is_nearly_free():
    params = _params()
    state = OPTIMIZERS["leanest"]().init(params)
    n = sum(x.size for x in jax.tree.leaves(params))
    big = sum(x.size for x in jax.tree.leaves(params["layers"]) if x.ndim == 3)
    state_bytes = sum(x.nbytes for x in jax.tree.leaves(state))
    # row + column statistics of each matrix, float32; full ones for the rest
    factored = 4 * L * 2 * (D + 4 * D)
    assert state_bytes <= factored + 4 * (n - big) + 64
    # 0.27 bytes per parameter at width 32 (4 (r + c) / (r c) per matrix),
    # against 4 for AdamW's moments in bfloat16
    assert state_bytes < 0.3 * n


def test_resume_from_orbax_checkpoint_is_bit_identical(tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    tx = OPTIMIZERS["adafactor_int8_momentum"]()
    step = jax.jit(jaxamp.update_in_backward(LOSS, tx))
    params = _params()
    run = (params, tx.init(params))
    straight = run
    for i in range(4):
        *straight, _ = step(*straight, _batch(i))
    for i in range(2):
        *run, _ = step(*run, _batch(i))
    path = tmp_path / "ckpt"
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path, tuple(run))
        ckptr.wait_until_finished()
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, tuple(run))
    with ocp.StandardCheckpointer() as ckptr:
        run = list(ckptr.restore(path, abstract))
    for i in range(2, 4):
        *run, _ = step(*run, _batch(i))
    assert jax.tree.structure(tuple(run)) == jax.tree.structure(tuple(straight))
    for x, y in zip(jax.tree.leaves(run), jax.tree.leaves(straight)):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_global_norm_clipping_is_refused_by_name():
    tx = jaxamp.low_precision_optimizer(
        optax.chain(optax.clip_by_global_norm(1.0), _ada()), state_dtype=None
    )
    params = _params()
    with pytest.raises(ValueError, match=r"optimizer=.*clip_by_global_norm"):
        jaxamp.update_in_backward(LOSS, tx)(params, tx.init(params), _batch(0))


def test_scale_by_matrix_rms_needs_params():
    tx = _factored.scale_by_matrix_rms()
    params = {"w": jnp.ones((4, 4))}
    with pytest.raises(ValueError, match=r"scale_by_matrix_rms.*params"):
        tx.update(params, tx.init(params))


def test_layers_too_large_for_one_block_are_updated_whole(monkeypatch):
    # Blocks of rows cannot hold a column statistic (a sum over every row of
    # the layer): with blocks smaller than a layer, the factored leaves are
    # updated one whole layer at a time, still inside the loop, same bits.
    from jaxamp._training import _in_backward, _layer_update

    monkeypatch.setattr(_layer_update, "_BLOCK", 1024)
    plan, chunks = _in_backward.plan_leaf, {}

    def spy(*args):
        upd = plan(*args)
        if upd is not None:
            chunks[upd.k] = upd.chunks
        return upd

    monkeypatch.setattr(_in_backward, "plan_leaf", spy)
    tx = OPTIMIZERS["leanest"]()
    params = _params()
    state = tx.init(params)
    fused = jax.jit(jaxamp.update_in_backward(LOSS, tx))
    ordinary = jax.jit(_ordinary(tx))
    a = b = (params, state)
    for i in range(3):
        *a, _ = fused(*a, _batch(i))
        *b, _ = ordinary(*b, _batch(i))
    names = [
        jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_leaves_with_path(params)
    ]
    got = {names[k]: c for k, c in chunks.items()}
    # w1 and w2 (4096 elements per layer) whole; gain and b1 (two axes: one
    # RMS clip over the leaf, across layers) after the backward pass
    assert got == {"['layers']['w1']": 1, "['layers']['w2']": 1}
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
