"""Whole-model tests of amp (issue 2, "Must show").

1. compute_dtype=float32 is the identity on a corpus of common functions
   (outputs and gradients).
2./3. A small GPT (layers in ``lax.scan``, a ``jax.checkpoint``-ed layer, a
   ``jax.jit`` and a ``jax.custom_vjp`` inside): accuracy against float32 on
   bfloat16-representable inputs, and the dtypes of every equation of
   ``jax.grad(amp(loss))``, sub-jaxprs included.
4. Data-parallel training steps on 8 host CPU devices (``NamedSharding`` and
   ``shard_map`` + ``pmean``): same shardings with and without amp.
5. amp composed with ``vmap`` collectives, ``vjp``, ``jit`` and itself.
"""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_tree_allclose, rel_l2, round_bf16, tree_dtypes
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxamp

F32, BF16, F16 = np.dtype(jnp.float32), np.dtype(jnp.bfloat16), np.dtype(jnp.float16)
K = jax.random.split(jax.random.key(0), 12)

# These tests check dtypes and numerics, not generated code: skipping LLVM's
# optimisations halves XLA:CPU compile time, which dominates this file.
jit = functools.partial(jax.jit, compiler_options={"xla_backend_optimization_level": 0})

# ---------------------------------------------------------------------------
# 1. compute_dtype=float32 is the identity.

X = jax.random.normal(K[0], (4, 8))
LABELS = jax.random.randint(K[1], (4,), 0, 8)
PROBS = jax.nn.softmax(jax.random.normal(K[2], (4, 8)))


def _mha():
    m = eqx.nn.MultiheadAttention(2, 8, key=K[3])
    return lambda x: m(x, x, x)


def _gru_scan():
    cell = eqx.nn.GRUCell(8, 6, key=K[4])
    return lambda x: lax.scan(lambda h, xi: (cell(xi, h), h), jnp.zeros(6), x)[0]


def _conv():
    conv = eqx.nn.Conv2d(1, 3, 3, key=K[5])
    return lambda x: conv(x.reshape(1, 4, 8))


def _attention(x):
    q = x.reshape(1, 4, 2, 4)
    return jax.nn.dot_product_attention(q, q, q, is_causal=True, implementation="xla")


def _batchnorm():
    """BatchNorm's batch statistics are a collective over the vmap axis name."""
    bn, state = eqx.nn.make_with_state(eqx.nn.BatchNorm)(8, "batch", mode="batch")
    bn = jax.vmap(bn, in_axes=(0, None), out_axes=(0, None), axis_name="batch")
    return bn, state


def _batchnorm_out():
    bn, state = _batchnorm()
    return lambda x: bn(x, state)[0]


CORPUS = {
    # jax.nn activations
    "relu": jax.nn.relu,
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_exact": lambda x: jax.nn.gelu(x, approximate=False),
    "silu": jax.nn.silu,
    "softplus": jax.nn.softplus,
    "sigmoid": jax.nn.sigmoid,
    "log_sigmoid": jax.nn.log_sigmoid,
    "elu": jax.nn.elu,
    "selu": jax.nn.selu,
    "celu": jax.nn.celu,
    "mish": jax.nn.mish,
    "leaky_relu": jax.nn.leaky_relu,
    "glu": jax.nn.glu,
    "tanh": jnp.tanh,
    # normalisers and attention
    "softmax": jax.nn.softmax,
    "log_softmax": jax.nn.log_softmax,
    "logsumexp": lambda x: jax.nn.logsumexp(x, axis=-1),
    "standardize": jax.nn.standardize,
    "dot_product_attention": _attention,
    "norm": lambda x: jnp.linalg.norm(x, axis=-1),
    "cumsum_var": lambda x: jnp.cumsum(x, -1) * jnp.var(x),
    # optax losses
    "softmax_cross_entropy": lambda x: optax.softmax_cross_entropy(x, PROBS),
    "ce_integer_labels": lambda x: optax.softmax_cross_entropy_with_integer_labels(
        x, LABELS
    ),
    "sigmoid_bce": lambda x: optax.sigmoid_binary_cross_entropy(x, PROBS),
    "sigmoid_focal_loss": lambda x: optax.sigmoid_focal_loss(x, PROBS),
    "kl_divergence": lambda x: optax.kl_divergence(jax.nn.log_softmax(x), PROBS),
    "l2_loss": lambda x: optax.l2_loss(x, PROBS),
    "huber_loss": lambda x: optax.huber_loss(x, PROBS),
    "log_cosh": lambda x: optax.log_cosh(x, PROBS),
    "cosine_similarity": lambda x: optax.cosine_similarity(x, PROBS),
    # Equinox layers
    "eqx_linear": jax.vmap(eqx.nn.Linear(8, 5, key=K[6])),
    "eqx_mlp": jax.vmap(eqx.nn.MLP(8, 3, 16, 2, key=K[7])),
    "eqx_conv2d": _conv(),
    "eqx_layernorm": jax.vmap(eqx.nn.LayerNorm(8)),
    "eqx_rmsnorm": jax.vmap(eqx.nn.RMSNorm(8)),
    "eqx_mha": _mha(),
    "eqx_gru_scan": _gru_scan(),
    "eqx_batchnorm_vmap_axis_name": _batchnorm_out(),
}


@pytest.mark.parametrize("name", sorted(CORPUS))
def test_float32_compute_dtype_is_the_identity(name):
    f = CORPUS[name]
    loss = lambda x: jnp.sum(jnp.sin(f(x)))
    # Output and gradient in one program (one compile per side).
    run = lambda f, loss: jit(lambda x: (f(x), jax.grad(loss)(x)))(X)
    ref = run(f, loss)
    assert tree_dtypes(ref) == [F32, F32]  # the corpus item is a float32 function
    out = run(jaxamp.amp(f, compute_dtype=F32), jaxamp.amp(loss, compute_dtype=F32))
    assert_tree_allclose(out, ref, rtol=1e-6, atol=1e-7)


def test_corpus_size():
    assert len(CORPUS) >= 25


@pytest.mark.parametrize("name", ["eqx_mha", "eqx_gru_scan", "ce_integer_labels"])
def test_float32_identity_outside_jit(name):
    """Op by op (amp re-traces on every call outside jit): still the identity."""
    f = CORPUS[name]
    assert_tree_allclose(
        jaxamp.amp(f, compute_dtype=F32)(X), f(X), rtol=1e-6, atol=1e-7
    )


def test_batchnorm_state_under_vmap_with_axis_name():
    bn, state = _batchnorm()
    ref, ref_state = jit(bn)(X, state)
    # float32: the identity, for the output and the updated state.
    out, new_state = jit(jaxamp.amp(bn, compute_dtype=F32))(X, state)
    assert_tree_allclose((out, new_state), (ref, ref_state), rtol=1e-6, atol=1e-7)
    # bfloat16: state comes back in float32 and close; the batch statistics
    # are still a collective over the vmapped axis (a per-example "batch"
    # would normalise every row to zero).
    low, low_state = jit(jaxamp.amp(bn, compute_dtype=BF16))(X, state)
    assert tree_dtypes((low, low_state)) == tree_dtypes((ref, ref_state))
    assert rel_l2(low, ref) < 2e-2
    assert rel_l2(low_state, ref_state) < 2e-2
    # gradients through the collective, in bfloat16
    loss = lambda x, s: jnp.sum(jnp.sin(bn(x, s)[0]) * PROBS)
    g = jit(jax.grad(jaxamp.amp(loss, compute_dtype=BF16)))(X, state)
    g_ref = jit(jax.grad(loss))(X, state)
    assert g.dtype == F32
    assert rel_l2(g, g_ref) < 5e-2


# ---------------------------------------------------------------------------
# 2./3. A GPT-style model: layers in lax.scan, jax.checkpoint on the layer,
# jax.jit inside, attention + LayerNorm + GELU MLP and a custom_vjp.

D, T, B, H, V, L = 32, 16, 4, 2, 48, 3


@jax.custom_vjp
def _damped_residual(x, y):
    """``x + y`` whose backward pass halves the branch's gradient: if amp
    dropped the user's bwd rule (inlining the primal), the attention
    parameters' gradients would double and the accuracy test would fail."""
    return x + y


_damped_residual.defvjp(lambda x, y: (x + y, None), lambda _, g: (g, 0.5 * g))


def gpt_params(key=K[8]):
    ks = jax.random.split(key, 6)
    n = lambda k, s, sc: jax.random.normal(k, s) * sc
    return round_bf16(
        {
            "emb": n(ks[0], (V, D), 0.2),
            "qkv": n(ks[1], (L, D, 3 * D), D**-0.5),
            "o": n(ks[2], (L, D, D), D**-0.5),
            "up": n(ks[3], (L, D, 4 * D), D**-0.5),
            "down": n(ks[4], (L, 4 * D, D), (4 * D) ** -0.5),
            "g": 1.0 + n(ks[5], (L, 2, D), 0.1),
        }
    )


def _ln(x, g):
    m = x.mean(-1, keepdims=True)
    return (x - m) * lax.rsqrt(jnp.square(x - m).mean(-1, keepdims=True) + 1e-5) * g


def gpt_logits(params, tokens):
    x = params["emb"][tokens]

    @jax.checkpoint
    def layer(x, w):
        h = _ln(x, w["g"][0])
        q, k, v = jnp.split(jax.jit(lambda a, b: a @ b)(h, w["qkv"]), 3, -1)
        sh = lambda t: t.reshape(B, T, H, D // H)
        a = jax.nn.dot_product_attention(
            sh(q), sh(k), sh(v), is_causal=True, implementation="xla"
        )
        x = _damped_residual(x, a.reshape(B, T, D) @ w["o"])
        h = _ln(x, w["g"][1])
        return x + jax.nn.gelu(h @ w["up"]) @ w["down"], None

    x, _ = lax.scan(layer, x, {k: params[k] for k in ("qkv", "o", "up", "down", "g")})
    return x @ params["emb"].T


def gpt_loss(params, tokens):
    logits = gpt_logits(params, tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


TOKENS = jax.random.randint(K[9], (B, T + 1), 0, V)


@functools.cache
def gpt_value_and_grad(compute=None):
    """(loss, grads) of the GPT on TOKENS: float32, or amp in ``compute``."""
    loss = gpt_loss if compute is None else jaxamp.amp(gpt_loss, compute_dtype=compute)
    return jit(jax.value_and_grad(loss))(gpt_params(), TOKENS)


@functools.cache
def gpt_grad_jaxpr(compute):
    amp_loss = jaxamp.amp(gpt_loss, compute_dtype=compute)
    return jax.make_jaxpr(jax.grad(amp_loss))(gpt_params(), TOKENS)


@pytest.mark.parametrize("compute", [BF16, F16], ids=["bf16", "f16"])
def test_gpt_accuracy(compute):
    ref_loss, ref_grads = gpt_value_and_grad()
    loss, grads = gpt_value_and_grad(compute)
    assert loss.dtype == F32
    assert tree_dtypes(grads) == [F32] * len(jax.tree.leaves(ref_grads))
    assert abs(float(loss) - float(ref_loss)) < 0.01 * abs(float(ref_loss))
    assert rel_l2(grads, ref_grads) < 0.05
    # Every parameter gets a gradient of the right size, not just the total.
    for name in ref_grads:
        assert rel_l2(grads[name], ref_grads[name]) < 0.1, name


@pytest.mark.parametrize("compute", [BF16, F16], ids=["bf16", "f16"])
def test_gpt_grad_matmuls_all_in_compute_dtype(compute):
    closed = gpt_grad_jaxpr(compute)
    flops = jaxamp.tools.matmul_flops_by_dtype(closed)
    assert list(flops) == [compute.name]
    assert jaxamp.tools.low_precision_flop_share(closed) == 1.0
    # The forward and backward matmuls of all L layers are counted (scan
    # bodies weighted by their length): at least 3x the forward FLOPs.
    fwd_layer = 2 * B * T * D * (3 * D + D + 8 * D) + 4 * B * T * T * D
    assert flops[compute.name] >= 3 * (L * fwd_layer + 2 * B * T * D * V)
    # Every higher-order primitive was rewritten, not inlined away.
    kinds = {name for name, _, _ in jaxamp.tools.primitive_dtypes(closed)}
    assert {"scan", "remat2", "jit"} <= kinds
    fwd = jax.make_jaxpr(jaxamp.amp(gpt_loss, compute_dtype=compute))(
        gpt_params(), TOKENS
    )
    assert "custom_vjp_call" in {n for n, _, _ in jaxamp.tools.primitive_dtypes(fwd)}


@pytest.mark.parametrize("prim", ["exp", "log", "reduce_sum"])
@pytest.mark.parametrize("compute", [BF16, F16], ids=["bf16", "f16"])
def test_gpt_grad_range_critical_ops_in_float32(compute, prim):
    """No exp/log/reduce_sum of jax.grad(amp(loss)) runs below float32, forward
    or backward, in any sub-jaxpr: also the backward sums JAX derives from
    broadcasting (LayerNorm gain and bias gradients, per-row statistics)."""
    found = [
        (ins, outs)
        for name, ins, outs in jaxamp.tools.primitive_dtypes(gpt_grad_jaxpr(compute))
        if name == prim
    ]
    assert found
    low = [(i, o) for i, o in found if any(d.itemsize < 4 for d in i + o)]
    assert not low, f"{len(low)} of {len(found)} {prim} below float32: {low}"


# ---------------------------------------------------------------------------
# 4. Data parallelism on 8 host CPU devices.


def _mesh():
    return jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))


def _updates(new, old):
    return jax.tree.map(lambda a, b: a - b, new, old)


def _check_same_step(amp_out, ref_out, params):
    """Same shardings and dtypes, and numerically close, for a train step's
    (new params, loss) with and without amp."""
    (amp_p, amp_v), (ref_p, ref_v) = amp_out, ref_out
    assert jax.tree.structure(amp_p) == jax.tree.structure(ref_p)
    for a, b in zip(jax.tree.leaves(amp_p), jax.tree.leaves(ref_p)):
        assert a.sharding == b.sharding
        assert a.dtype == b.dtype == F32
    assert amp_v.sharding == ref_v.sharding and amp_v.dtype == ref_v.dtype
    assert abs(float(amp_v) - float(ref_v)) < 0.01 * abs(float(ref_v))
    upd, ref_upd = _updates(amp_p, params), _updates(ref_p, params)
    assert rel_l2(upd, ref_upd) < 0.05


def gpt_loss_batch(params, tokens):
    """gpt_loss on a batch of any multiple of B (vmapped over groups of B)."""
    groups = tokens.reshape(-1, B, T + 1)
    return jax.vmap(gpt_loss, in_axes=(None, 0))(params, groups).mean()


def _sgd_step(loss):
    def step(params, tokens):
        value, grads = jax.value_and_grad(loss)(params, tokens)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), value

    return step


def test_named_sharding_train_step():
    assert len(jax.devices()) == 8
    mesh = _mesh()
    tokens = jax.device_put(
        jax.random.randint(K[10], (8 * B, T + 1), 0, V), NamedSharding(mesh, P("data"))
    )
    params = jax.device_put(gpt_params(), NamedSharding(mesh, P()))
    amp_step = _sgd_step(jaxamp.amp(gpt_loss_batch, compute_dtype=BF16))
    ref = jit(_sgd_step(gpt_loss_batch))(params, tokens)
    out = jit(amp_step)(params, tokens)
    _check_same_step(out, ref, params)
    assert all(p.sharding == NamedSharding(mesh, P()) for p in jax.tree.leaves(out[0]))
    # ...and the step really ran its matmuls in bfloat16.
    closed = jax.make_jaxpr(amp_step)(params, tokens)
    assert jaxamp.tools.low_precision_flop_share(closed) == 1.0


def test_shard_map_train_step():
    mesh = _mesh()
    tokens = jax.random.randint(K[11], (8 * B, T + 1), 0, V)
    params = gpt_params()

    def make(loss):
        def local(params, tokens):
            value, grads = jax.value_and_grad(loss)(params, tokens)
            grads = lax.pmean(grads, "data")
            new = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
            return new, lax.pmean(value, "data")

        return jax.shard_map(
            local, mesh=mesh, in_specs=(P(), P("data")), out_specs=(P(), P())
        )

    ref = jit(make(gpt_loss))(params, tokens)
    amp_step = make(jaxamp.amp(gpt_loss, compute_dtype=BF16))
    _check_same_step(jit(amp_step)(params, tokens), ref, params)
    assert (
        jaxamp.tools.low_precision_flop_share(jax.make_jaxpr(amp_step)(params, tokens))
        == 1
    )
    # amp around the whole shard_map step rewrites its body too.
    outer = jaxamp.amp(make(gpt_loss), compute_dtype=BF16)
    assert (
        jaxamp.tools.low_precision_flop_share(jax.make_jaxpr(outer)(params, tokens))
        == 1
    )
    _check_same_step(jit(outer)(params, tokens), ref, params)


# ---------------------------------------------------------------------------
# 5. Composition: vmap collectives, vjp, jit outside and inside, nested amp.

MLP = round_bf16(
    {
        "w1": jax.random.normal(K[1], (8, 16)) * 8**-0.5,
        "g": jnp.ones(16),
        "w2": jax.random.normal(K[2], (16, 4)) * 16**-0.5,
    }
)


def per_example(params, x):
    """One example of a batch vmapped with axis_name="b": batch-centred
    hidden units and a batch-wide normaliser (collectives inside)."""
    h = jax.nn.gelu(x @ params["w1"])
    h = (h - lax.pmean(h, "b")) * params["g"]
    scale = lax.rsqrt(lax.psum(jnp.sum(h * h), "b"))
    return jnp.tanh(h @ params["w2"]) * scale


def _batched(f):
    return jax.vmap(f, in_axes=(None, 0), axis_name="b")


XS = round_bf16(jax.random.normal(K[3], (6, 8)))


@pytest.mark.parametrize("where", ["amp_inside_vmap", "vmap_inside_amp"])
def test_vmap_with_axis_name_collectives(where):
    amp = functools.partial(jaxamp.amp, compute_dtype=BF16)
    f = (
        _batched(amp(per_example))
        if where == "amp_inside_vmap"
        else amp(_batched(per_example))
    )
    ref_f = _batched(per_example)
    out, ref = jit(f)(MLP, XS), jit(ref_f)(MLP, XS)
    assert out.dtype == F32 and out.shape == ref.shape
    assert rel_l2(out, ref) < 2e-2
    loss = lambda fn: lambda p: jnp.sum(fn(p, XS) * jnp.arange(4.0))
    g, g_ref = jit(jax.grad(loss(f)))(MLP), jit(jax.grad(loss(ref_f)))(MLP)
    assert tree_dtypes(g) == tree_dtypes(g_ref)
    assert rel_l2(g, g_ref) < 5e-2
    assert (
        jaxamp.tools.low_precision_flop_share(jax.make_jaxpr(jax.grad(loss(f)))(MLP))
        == 1
    )


def test_vjp_of_amp_model():
    params = gpt_params()
    tokens = TOKENS[:, :-1]
    ct = round_bf16(jax.random.normal(K[4], (B, T, V)))

    @functools.partial(jit, static_argnums=0)
    def run(f, params):
        out, pull = jax.vjp(lambda p: f(p, tokens), params)
        return out, pull(ct)[0]

    out, cts = run(jaxamp.amp(gpt_logits, compute_dtype=BF16), params)
    ref_out, ref_cts = run(gpt_logits, params)
    assert out.dtype == F32 and out.shape == (B, T, V)
    assert rel_l2(out, ref_out) < 2e-2
    assert tree_dtypes(cts) == tree_dtypes(ref_cts) == [F32] * len(ref_cts)
    assert rel_l2(cts, ref_cts) < 5e-2


def test_jit_outside_and_inside_amp_agree():
    # jit(amp(f)) vs jit(amp(jit(f))): the model already has a jit inside
    # (the qkv projection); here the whole loss is one more.
    outside = gpt_value_and_grad(BF16)
    amp_of_jit = jaxamp.amp(jax.jit(gpt_loss), compute_dtype=BF16)
    both = jit(jax.value_and_grad(amp_of_jit))(gpt_params(), TOKENS)
    # Same dtype choices (call-like primitives let dtypes flow through), so
    # amp(jit(f)) is the same computation as amp(f).
    assert_tree_allclose(both, outside, rtol=1e-5, atol=1e-7)
    closed = jax.make_jaxpr(jax.grad(amp_of_jit))(gpt_params(), TOKENS)
    assert jaxamp.tools.matmul_flops_by_dtype(closed).keys() == {"bfloat16"}
    # The outer jit stays a jit equation (rewritten, not inlined).
    assert {e.primitive.name for e in closed.jaxpr.eqns} == {"jit"}


def test_nested_amp():
    params = gpt_params()
    amp = jaxamp.amp
    run = lambda f: jit(jax.value_and_grad(f))(params, TOKENS)
    # amp of an amp'ed function with the same dtype changes nothing.
    twice = amp(amp(gpt_loss, compute_dtype=BF16), compute_dtype=BF16)
    assert_tree_allclose(run(twice), gpt_value_and_grad(BF16), rtol=1e-6, atol=1e-7)
    # The innermost amp decides inside its region...
    inner_bf16 = amp(amp(gpt_loss, compute_dtype=BF16), compute_dtype=F16)
    closed = jax.make_jaxpr(jax.grad(inner_bf16))(params, TOKENS)
    assert list(jaxamp.tools.matmul_flops_by_dtype(closed)) == ["bfloat16"]
    # ...also when it asks for float32: the outer bfloat16 amp leaves it alone.
    inner_f32 = amp(amp(gpt_loss, compute_dtype=F32), compute_dtype=BF16)
    closed = jax.make_jaxpr(jax.grad(inner_f32))(params, TOKENS)
    assert list(jaxamp.tools.matmul_flops_by_dtype(closed)) == ["float32"]
    assert_tree_allclose(run(inner_f32), gpt_value_and_grad(), rtol=1e-6, atol=1e-7)


def test_vmapped_equinox_mlp_logits_run_on_xla_cpu():
    """A ``jax.vmap``-ed ``eqx.nn.MLP`` whose logits feed the loss: the head's
    bfloat16 x bfloat16 -> float32 product is followed by the transpose vmap
    adds, which XLA:CPU folds into the dot and then cannot run ("Unsupported
    element type for DotThunk::Execute: BF16 x BF16 = F32") unless amp keeps
    them apart (``_compat.runnable_product``). The jitted gradient runs and is
    within 3e-2 of float32's (bfloat16 matmuls over 32-64 features)."""
    mlp = eqx.nn.MLP(32, 10, 64, 2, key=K[2])
    mlp = jax.tree.map(lambda a: round_bf16(a) if eqx.is_array(a) else a, mlp)
    x = round_bf16(jax.random.normal(K[3], (16, 32)))
    y = jnp.arange(16) % 10

    def loss(m, x, y):
        logits = jax.vmap(m)(x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    g = eqx.filter_jit(eqx.filter_grad(jaxamp.amp(loss, compute_dtype=BF16)))(mlp, x, y)
    with jax.default_matmul_precision("highest"):
        ref = eqx.filter_grad(loss)(mlp, x, y)
    assert tree_dtypes(g) == tree_dtypes(ref)
    assert rel_l2(g, ref) < 3e-2
