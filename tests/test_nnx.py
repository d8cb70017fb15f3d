"""Tests of Flax NNX graph nodes as amp arguments (jaxamp/_nnx.py): every
Variable update the function makes reaches the caller's objects, in the
Variable's own dtype, eagerly and under NNX's transforms; and NNX's functional
API (States through jax.jit / jax.value_and_grad) runs as it does without amp."""

import functools
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_tree_allclose, rel_l2, round_bf16, tree_dtypes

import jaxamp

nnx = pytest.importorskip("flax.nnx")
flax_errors = pytest.importorskip("flax.errors")

BF16, F32 = np.dtype(jnp.bfloat16), np.dtype(jnp.float32)


class Counter(nnx.Variable):
    pass


class Tally(nnx.Module):
    """A linear layer that counts its calls and keeps a running input mean."""

    def __init__(self, rngs):
        self.lin = nnx.Linear(4, 4, rngs=rngs)
        self.calls = Counter(jnp.zeros((), jnp.uint32))
        self.mean = nnx.BatchStat(jnp.zeros((4,), jnp.float32))

    def __call__(self, x):
        self.calls[...] += 1
        self.mean[...] = 0.5 * self.mean[...] + 0.5 * x.mean(0)
        return self.lin(x)


X = jnp.asarray(np.linspace(-1, 1, 8).reshape(2, 4), jnp.float32)


def _mutate_only(model, x):
    model(x)  # returns nothing about the updates


@pytest.mark.parametrize("wrap", ["eager", "nnx.jit"])
def test_update_without_returning_it_reaches_the_caller(wrap):
    model = Tally(nnx.Rngs(0))
    f = jaxamp.amp(_mutate_only, compute_dtype=BF16)
    if wrap == "nnx.jit":
        f = nnx.jit(f)
    assert f(model, X) is None
    f(model, X)
    assert model.calls[...].dtype == np.uint32 and int(model.calls[...]) == 2
    assert model.mean[...].dtype == F32
    np.testing.assert_allclose(model.mean[...], 0.75 * X.mean(0), rtol=1e-6)


def test_variables_rngs_and_returned_modules_are_the_callers():
    model, rngs = Tally(nnx.Rngs(0)), nnx.Rngs(dropout=3)
    step = nnx.Variable(jnp.zeros((), jnp.int32))

    def f(model, pair, x):
        rngs, step = pair
        step[...] += 1
        y = model(x + jax.random.normal(rngs.dropout(), x.shape))
        return model, {"y": y, "n": 2}

    out_model, out = jaxamp.amp(f, compute_dtype=BF16)(model, (rngs, step), X)
    assert out_model is model and out["n"] == 2 and out["y"].dtype == F32
    assert int(step[...]) == 1 and int(model.calls[...]) == 1
    assert int(rngs.dropout.count[...]) == 1
    # The same random numbers as without amp: the counter was read, then moved.
    ref_rngs = nnx.Rngs(dropout=3)
    noise = jax.random.normal(ref_rngs.dropout(), X.shape)
    np.testing.assert_allclose(model.mean[...], 0.5 * (X + noise).mean(0), rtol=1e-5)


def _loss_grad(model, x):
    return jnp.square(model(x)).mean()


@pytest.mark.parametrize("transform", ["nnx.grad", "nnx.remat", "nnx.scan"])
def test_updates_propagate_through_nnx_transforms(transform):
    model = Tally(nnx.Rngs(0))
    amp_loss = jaxamp.amp(_loss_grad, compute_dtype=BF16)
    if transform == "nnx.grad":
        grads = nnx.jit(nnx.grad(amp_loss))(model, X)
        assert set(tree_dtypes(nnx.state(grads, nnx.Param))) == {F32}
        calls = 1
    elif transform == "nnx.remat":
        nnx.jit(nnx.grad(nnx.remat(amp_loss)))(model, X)
        calls = 1
    else:

        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0))
        def loop(model, x):
            return model, amp_loss(model, x)

        _, losses = loop(model, jnp.stack([X, 2.0 * X, 3.0 * X]))
        assert losses.shape == (3,) and losses.dtype == F32
        calls = 3
    assert int(model.calls[...]) == calls
    assert model.mean[...].dtype == F32 and float(jnp.abs(model.mean[...]).max()) > 0


class Block(nnx.Module):
    def __init__(self, d, rngs):
        self.ln1 = nnx.LayerNorm(d, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(
            num_heads=2, in_features=d, decode=False, rngs=rngs
        )
        self.drop1 = nnx.Dropout(0.1, rngs=rngs)
        self.ln2 = nnx.LayerNorm(d, rngs=rngs)
        self.up = nnx.Linear(d, 2 * d, rngs=rngs)
        self.down = nnx.Linear(2 * d, d, rngs=rngs)
        self.drop2 = nnx.Dropout(0.1, rngs=rngs)

    def __call__(self, x, mask):
        x = x + self.drop1(self.attn(self.ln1(x), mask=mask))
        return x + self.drop2(self.down(nnx.gelu(self.up(self.ln2(x)))))


class TinyTransformer(nnx.Module):
    def __init__(self, vocab, d, rngs):
        self.embed = nnx.Embed(vocab, d, rngs=rngs)
        self.blocks = nnx.List([Block(d, rngs) for _ in range(2)])
        self.head = nnx.Linear(d, vocab, rngs=rngs)

    def __call__(self, tokens):
        mask = nnx.make_causal_mask(tokens)
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(x)


def _lm_loss(model, tokens):
    logits = model(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


class ConvBN(nnx.Module):
    def __init__(self, rngs):
        self.conv = nnx.Conv(3, 8, (3, 3), rngs=rngs)
        self.bn = nnx.BatchNorm(8, rngs=rngs)
        self.head = nnx.Linear(8, 1, rngs=rngs)

    def __call__(self, x):
        h = nnx.relu(self.bn(self.conv(x)))
        return self.head(h.mean((1, 2)))[:, 0]


def _regression_loss(model, batch):
    x, y = batch
    return jnp.square(model(x) - y).mean()


def _data(kind):
    key = jax.random.PRNGKey(1)
    if kind == "transformer":
        make = lambda: TinyTransformer(32, 16, nnx.Rngs(0, dropout=1))
        return make, _lm_loss, jax.random.randint(key, (8, 17), 0, 32)
    x = round_bf16(1.0 + jax.random.normal(key, (8, 8, 8, 3)))
    y = round_bf16(jax.random.normal(jax.random.PRNGKey(2), (8,)))
    return (lambda: ConvBN(nnx.Rngs(0))), _regression_loss, (x, y)


def _train(kind, use_amp, steps=20):
    make, loss, batch = _data(kind)
    model = make()
    nnx.update(model, round_bf16(nnx.state(model, nnx.Param)))
    optimizer = nnx.Optimizer(model, optax.sgd(0.03, momentum=0.9), wrt=nnx.Param)
    if use_amp:
        loss = jaxamp.amp(loss, compute_dtype=BF16)

    @nnx.jit
    def step(model, optimizer, batch):
        value, grads = nnx.value_and_grad(loss)(model, batch)
        optimizer.update(model, grads)
        return value, grads

    losses = []
    for _ in range(steps):
        value, grads = step(model, optimizer, batch)
        losses.append(float(value))
    return model, np.asarray(losses), grads


@pytest.mark.parametrize("kind", ["transformer", "conv_batchnorm"])
def test_nnx_training_matches_float32(kind):
    ref_model, ref_losses, _ = _train(kind, use_amp=False)
    model, losses, grads = _train(kind, use_amp=True)
    # The loss curve tracks float32 and gradients come back in float32.
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-2)
    assert losses[-1] < 0.9 * losses[0]
    assert set(tree_dtypes(grads)) == {F32}
    # RNG counters equal, batch statistics match, each in its own dtype.
    counts = nnx.state(model, nnx.RngCount)
    ref_counts = nnx.state(ref_model, nnx.RngCount)
    assert tree_dtypes(counts) == tree_dtypes(ref_counts)
    assert jax.tree.leaves(counts) == jax.tree.leaves(ref_counts)
    stats = nnx.state(model, nnx.BatchStat)
    ref_stats = nnx.state(ref_model, nnx.BatchStat)
    assert tree_dtypes(stats) == tree_dtypes(ref_stats)
    if kind == "transformer":
        assert sorted(int(c) for c in jax.tree.leaves(counts) if c) == [20] * 4
    else:
        assert_tree_allclose(stats, ref_stats, rtol=5e-2)
        # They moved as far from their initial values as in float32.
        initial = nnx.state(_data(kind)[0](), nnx.BatchStat)
        moved = lambda s: jax.tree.map(jnp.subtract, s, initial)
        assert rel_l2(moved(stats), moved(ref_stats)) < 5e-2


def test_flax_is_not_imported_for_plain_arguments():
    code = (
        "import sys, jax.numpy as jnp, jaxamp\n"
        "jaxamp.amp(lambda w: (w @ w).sum())(jnp.ones((2, 2)))\n"
        "assert 'flax' not in sys.modules, 'flax imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def _train_step(model, optimizer, x):
    value, grads = nnx.value_and_grad(_loss_grad)(model, x)
    optimizer.update(model, grads)
    return value


@pytest.mark.parametrize("use_jit", [False, True])
def test_optimizer_update_inside_amp(use_jit):
    results = []
    for use_amp in (False, True):
        model = Tally(nnx.Rngs(0))
        opt = nnx.Optimizer(model, optax.sgd(0.1, momentum=0.9), wrt=nnx.Param)
        f = jaxamp.amp(_train_step, compute_dtype=BF16) if use_amp else _train_step
        f = nnx.jit(f) if use_jit else f
        losses = [float(f(model, opt, X)) for _ in range(3)]
        results.append((losses, opt, model))
    (ref_losses, ref_opt, ref_model), (losses, opt, model) = results
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-2)
    assert losses[2] < losses[0]
    assert int(opt.step[...]) == int(ref_opt.step[...]) == 3
    assert int(model.calls[...]) == 3
    momentum, ref_momentum = nnx.state(opt.opt_state), nnx.state(ref_opt.opt_state)
    assert tree_dtypes(momentum) == tree_dtypes(ref_momentum)
    assert rel_l2(momentum, ref_momentum) < 2e-2
    assert rel_l2(nnx.state(model, nnx.Param), nnx.state(ref_model, nnx.Param)) < 1e-2


class Sower(nnx.Module):
    def __init__(self):
        self.lin = nnx.Linear(4, 4, rngs=nnx.Rngs(0))

    def __call__(self, x):
        h = self.lin(x)
        self.hidden = nnx.Intermediate(h)  # a Variable created by the call
        return h.sum()


def test_variables_created_by_the_call_reach_the_caller():
    model = Sower()
    jaxamp.amp(lambda m, x: m(x), compute_dtype=BF16)(model, X)
    ref = Sower()
    ref(X)
    assert model.hidden[...].dtype == F32
    np.testing.assert_allclose(model.hidden[...], ref.hidden[...], atol=2e-2)


# The functional API (Flax's "Flax NNX vs JAX transformations" guide): split the
# model, pass the States through jax.jit / jax.value_and_grad, merge inside the
# loss and return the new non-Param state. States are values to amp (_nnx.py).


@functools.cache
def _functional_setup(kind):
    """Model states, loss and batch with activations in the hundreds (inputs
    and parameters pre-rounded to bfloat16, so amp sees what float32 sees);
    built once per kind, for the float32 run and the amp run alike."""
    make, model_loss, batch = _data(kind)
    model = make()
    if kind == "transformer":
        # Embeddings of standard deviation ~100 (0.25 at init): the residual
        # stream, LayerNorm's input, is in the hundreds.
        model.embed.embedding[...] = 400.0 * model.embed.embedding[...]
    else:
        x, y = batch
        batch = (round_bf16(100.0 * x), y)  # convolution outputs in the hundreds
    nnx.update(model, round_bf16(nnx.state(model, nnx.Param)))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(params, rest, batch):
        # copy=True: rest's Variables belong to jax.jit's trace, and a dropout
        # layer or BatchNorm in train mode updates them inside value_and_grad's.
        model = nnx.merge(graphdef, params, rest, copy=True)
        return model_loss(model, batch), nnx.state(model, nnx.Not(nnx.Param))

    return loss, params, rest, batch


def _functional_run(kind, use_amp, steps=3):
    loss, params, rest, batch = _functional_setup(kind)
    if use_amp:
        loss = jaxamp.amp(loss, compute_dtype=BF16)
    step = jax.jit(jax.value_and_grad(loss, has_aux=True))
    values, first_grads = [], None
    for _ in range(steps):
        (value, rest), grads = step(params, rest, batch)
        first_grads = grads if first_grads is None else first_grads
        values.append(float(value))
        # Parameters fixed: every step differentiates the same model, and only
        # the non-Param state (RNG counters, batch statistics) moves.
    return np.asarray(values), rest, first_grads


# Gradient tolerances (relative L2 against float32; measured 1.05% and 0.24%):
# bfloat16 keeps 8 significant bits (rounding error 2**-9, 0.2%) and the error
# grows with depth: two attention blocks, one convolution.
@pytest.mark.parametrize(
    "kind, grad_tol", [("transformer", 2.5e-2), ("conv_batchnorm", 1e-2)]
)
def test_functional_api_under_jit_and_value_and_grad(kind, grad_tol):
    ref_values, ref_rest, ref_grads = _functional_run(kind, use_amp=False)
    values, rest, grads = _functional_run(kind, use_amp=True)
    assert set(tree_dtypes(grads)) == {F32}
    dtypes = lambda tree: [x.dtype for x in jax.tree.leaves(tree)]  # noqa: E731
    assert dtypes(rest) == dtypes(ref_rest)  # RNG keys, uint32 counters, float32
    np.testing.assert_allclose(values, ref_values, rtol=2e-2)
    # Gradients of the same parameters and batch as float32's, within grad_tol.
    assert rel_l2(grads, ref_grads) < grad_tol
    counts = jax.tree.leaves(nnx.state(rest, nnx.RngCount))
    assert counts == jax.tree.leaves(nnx.state(ref_rest, nnx.RngCount))
    if kind == "transformer":
        # Four dropout layers, one key each per step: the same masks as float32.
        assert sorted(int(c) for c in counts if c) == [3] * 4
    else:
        stats = nnx.state(rest, nnx.BatchStat)
        ref_stats = nnx.state(ref_rest, nnx.BatchStat)
        for name in ("mean", "var"):
            got = jax.tree.leaves(stats["bn"][name])
            ref = jax.tree.leaves(ref_stats["bn"][name])
            assert rel_l2(got, ref) < 1e-2, name


def _read_only_loss(model, x):
    """Reads the model's Variables and changes none of them."""
    return jnp.square(model.lin(x)).mean()


def test_outer_trace_variables_in_a_module_argument_are_read_only():
    model = Tally(nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(params, fn):
        # rest's Variables belong to the caller's trace, not to grad's: the
        # merged module mixes them with grad's parameters.
        merged = nnx.merge(graphdef, params, rest)
        return fn(merged, X)

    ref = jax.grad(loss)(params, _read_only_loss)
    grads = jax.grad(loss)(params, jaxamp.amp(_read_only_loss, compute_dtype=BF16))
    assert rel_l2(grads, ref) < 2e-2
    assert int(rest["calls"][...]) == 0
    # A change to such a Variable (Tally counts its calls) fails as it does
    # without amp.
    with pytest.raises(flax_errors.TraceContextError):
        jax.grad(loss)(params, _loss_grad)
    with pytest.raises(flax_errors.TraceContextError, match="Counter"):
        jax.grad(loss)(params, jaxamp.amp(_loss_grad, compute_dtype=BF16))
