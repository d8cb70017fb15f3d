"""Tests of the update inside the backward pass (jaxamp/_training/_in_backward.py
and _layer_update.py)."""

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

BF16, F32 = np.dtype(jnp.bfloat16), np.dtype(jnp.float32)
LOSS = jaxamp.amp(_net, compute_dtype=jnp.bfloat16)


def _ordinary(loss, tx):
    def step(params, state, x):
        with jax.numpy_dtype_promotion("standard"):  # optax's Adam
            value, grads = jax.value_and_grad(loss)(params, x)
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state, value

    return step


def _fused(loss, tx):
    step = jaxamp.update_in_backward(loss, tx)

    def run(params, state, x):
        with jax.numpy_dtype_promotion("standard"):
            return step(params, state, x)

    return run


def _low(**kw):
    return jaxamp.low_precision_optimizer(optax.adamw(1e-3), **kw)


CASES = {
    "sgd": (lambda: optax.sgd(1e-2, momentum=0.9), F32),
    "adamw": (lambda: optax.adamw(1e-3, weight_decay=0.1), F32),
    "sr_bf16_state": (_low, BF16),
    "int8_state": (lambda: _low(state_dtype="int8", min_quantized_size=512), BF16),
    "kahan": (lambda: _low(rounding="kahan"), BF16),
}


@pytest.mark.parametrize("case", list(CASES))
def test_ten_steps_match_the_ordinary_step(case):
    # The same primitives on the same elements, one layer at a time: the
    # parameters and their state are bit-identical after 10 steps (SR's
    # rounding bits come from the global element index; int8 blocks lie within
    # one layer). Float32 AdamW: XLA's algebraic simplifier rewrites Adam's
    # (m / c1) / (sqrt(v / c2) + eps) as m / (c1 * (sqrt(v / c2) + eps)) in the
    # ordinary program's update of the head (a parameter left for after the
    # backward pass) but not in the fused one: one unit in the last place of
    # some updates, which training then carries to every parameter.
    make, dtype = CASES[case]
    tx = make()
    params = _params(dtype)
    state = tx.init(params)
    fused, ordinary = jax.jit(_fused(LOSS, tx)), jax.jit(_ordinary(LOSS, tx))
    a, b = (params, state), (params, state)
    for i in range(10):
        *a, loss_a = fused(*a, _batch(i))
        *b, loss_b = ordinary(*b, _batch(i))
        if case != "adamw":
            assert float(loss_a) == float(loss_b)
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype, path
        if case == "adamw":
            np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-6)
        else:
            np.testing.assert_array_equal(x, y, err_msg=jax.tree_util.keystr(path))


def _stacked_scan_outputs(jaxpr, shapes):
    """Per scan: the stacked outputs (ys) whose shape is a stacked weight's."""
    out = []
    for eqn, _ in jaxamp.tools.iter_equations(jaxpr):
        if eqn.primitive.name == "scan":
            n_carry = _compat.scan_carry_range(eqn.params)[1]
            ys = eqn.outvars[n_carry:]
            out.append([v.aval for v in ys if v.aval.shape in shapes])
    return out


def test_the_stacked_gradient_never_exists():
    tx = _low()
    params = _params(BF16)
    state = tx.init(params)
    shapes = {x.shape for x in jax.tree.leaves(params["layers"]) if x.ndim == 3}
    ordinary = jax.make_jaxpr(_ordinary(LOSS, tx))(params, state, _batch(0))
    fused = jax.make_jaxpr(_fused(LOSS, tx))(params, state, _batch(0))
    # The ordinary step's transposed loop stacks the weight gradients ...
    assert any(len(s) == 2 for s in _stacked_scan_outputs(ordinary, shapes))
    # ... the fused one carries the weights and their state instead.
    assert all(s == [] for s in _stacked_scan_outputs(fused, shapes))


def test_a_model_without_a_scan_is_updated_at_the_end():
    def mlp(params, x):
        return jnp.mean(jnp.tanh(x @ params["w"]) @ params["v"])

    k = jax.random.split(jax.random.key(1), 2)
    params = {"w": jax.random.normal(k[0], (D, D)), "v": jax.random.normal(k[1], (D,))}
    loss = jaxamp.amp(mlp, compute_dtype=jnp.bfloat16)
    tx = optax.adamw(1e-3)
    state = tx.init(params)
    a = jax.jit(_fused(loss, tx))(params, state, _batch(0))
    b = jax.jit(_ordinary(loss, tx))(params, state, _batch(0))
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6)


def test_nonfinite_gradients_reach_the_parameters_as_with_plain_optax():
    # No step is skipped: a NaN in the batch makes the loss, the gradients
    # and the updated parameters NaN, as the ordinary step without a skip.
    tx = _low()
    params = _params(BF16)
    state = tx.init(params)
    x = _batch(0).at[0, 0].set(jnp.nan)
    a = jax.jit(_fused(LOSS, tx))(params, state, x)
    b = jax.jit(_ordinary(LOSS, tx))(params, state, x)
    assert bool(jnp.isnan(a[2])) and bool(jnp.isnan(b[2]))
    for p, q in zip(jax.tree.leaves(a[0]), jax.tree.leaves(b[0])):
        np.testing.assert_array_equal(np.isnan(np.asarray(p, F32)), np.isnan(q))
        assert bool(jnp.isnan(p).any())


def test_refused_configurations_name_the_argument_and_the_alternative():
    params = _params(F32)
    clipped = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    with pytest.raises(ValueError, match=r"optimizer=.*clip_by_global_norm"):
        _fused(LOSS, clipped)(params, clipped.init(params), _batch(0))
    skip = jaxamp.skip_nonfinite_updates(optax.adamw(1e-3))
    with pytest.raises(ValueError, match=r"skip_nonfinite_updates.*inner optimizer"):
        _fused(LOSS, skip)(params, skip.init(params), _batch(0))
    fp16 = jaxamp.amp(_net, compute_dtype=jnp.float16)
    tx = optax.sgd(1e-3)
    with pytest.raises(ValueError, match=r"float16 compute.*bfloat16"):
        _fused(fp16, tx)(params, tx.init(params), _batch(0))
    with pytest.raises(TypeError, match=r"update_in_backward\(optimizer\)"):
        jaxamp.update_in_backward(LOSS, lambda g: g)
    with pytest.raises(TypeError, match=r"update_in_backward\(loss_fn\)"):
        jaxamp.update_in_backward(3, tx)


@pytest.mark.parametrize("state", ["bfloat16", "int8"])
def test_layers_updated_in_blocks_of_rows_give_the_same_bits(monkeypatch, state):
    # A layer's update in blocks of rows (so that its float32 moments exist
    # for one block at a time): the same bits as the ordinary step, int8
    # blocks and the rounding bits' element indices included.
    from jaxamp._training import _in_backward, _layer_update

    monkeypatch.setattr(_layer_update, "_BLOCK", 1024)
    plan, chunks = _in_backward.plan_leaf, []

    def spy(*args):
        upd = plan(*args)
        chunks.append(upd.chunks)
        return upd

    monkeypatch.setattr(_in_backward, "plan_leaf", spy)
    tx = _low(state_dtype=state, min_quantized_size=512)
    params = _params(BF16)
    state0 = tx.init(params)
    a = b = (params, state0)
    fused, ordinary = jax.jit(_fused(LOSS, tx)), jax.jit(_ordinary(LOSS, tx))
    for i in range(3):
        *a, _ = fused(*a, _batch(i))
        *b, _ = ordinary(*b, _batch(i))
    assert max(chunks) == 4  # w1, w2: 4096 elements per layer, 4 blocks
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_sharded_parameters_give_the_ordinary_steps_bits():
    # FSDP-style: every leaf sharded on its last axis over 4 devices. The
    # fused step equals the ordinary step on the same mesh, bit for bit (the
    # rounding bits come from global element indices; the gradient's own
    # reduction order is the mesh's, alike in both).
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((4,), ("fsdp",))

    def shard(x):
        last = x.ndim and x.shape[-1] % 4 == 0
        spec = P(*([None] * (x.ndim - 1)), "fsdp") if last else P()
        return jax.device_put(x, NamedSharding(mesh, spec))

    tx = _low()
    params = jax.tree.map(shard, _params(BF16))
    state = jax.tree.map(shard, tx.init(params))
    fused, ordinary = jax.jit(_fused(LOSS, tx)), jax.jit(_ordinary(LOSS, tx))
    a = b = (params, state)
    for i in range(3):
        *a, _ = fused(*a, _batch(i))
        *b, _ = ordinary(*b, _batch(i))
    assert a[0]["layers"]["w1"].sharding.spec == P(None, None, "fsdp")
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_flax_linen_scan_layers_are_updated_in_the_loop():
    # Flax's nn.scan stacks each layer's parameters on a leading axis: every
    # one of them (Dense kernels and biases, LayerNorm scale and bias) is
    # updated inside the transposed loop, with the ordinary step's bits.
    import flax.linen as nn

    class Block(nn.Module):
        @nn.compact
        def __call__(self, h, _):
            z = nn.Dense(4 * D)(nn.LayerNorm()(h))
            return h + nn.Dense(D)(jax.nn.gelu(z)), None

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            stack = nn.scan(
                Block,
                variable_axes={"params": 0},
                split_rngs={"params": True},
                length=L,
            )
            h, _ = stack()(x, None)
            return jnp.mean(jax.nn.logsumexp(nn.Dense(8)(h), axis=-1))

    net = Net()
    params = net.init(jax.random.key(1), _batch(0))
    params = jax.tree.map(lambda a: a.astype(jnp.bfloat16), params)
    loss = jaxamp.amp(net.apply, compute_dtype=jnp.bfloat16)
    tx = _low()
    state = tx.init(params)
    stacked = [x for x in jax.tree.leaves(params) if x.shape[:1] == (L,)]
    jaxpr = jax.make_jaxpr(_fused(loss, tx))(params, state, _batch(0))
    shapes = {x.shape for x in stacked if x.ndim == 3}
    assert all(s == [] for s in _stacked_scan_outputs(jaxpr, shapes))
    a = jax.jit(_fused(loss, tx))(params, state, _batch(0))
    b = jax.jit(_ordinary(loss, tx))(params, state, _batch(0))
    assert len(stacked) == 6  # two kernels, two biases, LayerNorm scale and bias
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("name", ["adafactor", "clip_by_block_rms"])
def test_updates_reading_a_whole_leaf_are_made_after_the_backward_pass(name):
    # Adafactor's factored moments and a per-leaf RMS clip read values of the
    # gradient across layers: those leaves are updated after the backward
    # pass (as in the ordinary step), not refused.
    tx = {
        "adafactor": optax.adafactor(1e-3),
        "clip_by_block_rms": optax.chain(optax.clip_by_block_rms(1.0), optax.sgd(1e-2)),
    }[name]
    params = _params(F32)
    state = tx.init(params)
    a = jax.jit(_fused(LOSS, tx))(params, state, _batch(0))
    b = jax.jit(_ordinary(LOSS, tx))(params, state, _batch(0))
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
