"""The LayerNorm region (``jaxamp/_rewrites/_layernorm.py``): a LayerNorm's
centring, variance and normalisation run in one ``jax.checkpoint`` (scope
``jaxamp_layer_norm``) when a low-precision input enters it, so the backward
pass saves that input instead of float32 centred values, with the gradients of
the float32 normalisation."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import rel_l2

import jaxamp
from jaxamp import _amp, _compat
from jaxamp._base import _state
from jaxamp._rewrites._layernorm import LN_SCOPE
from jaxamp._values import _facts

BF16, F16, F32 = (np.dtype(d) for d in (jnp.bfloat16, jnp.float16, jnp.float32))
NO_REGION = _amp.ablated(rewrites=["layer_norm"])
D = 64


def layer_norm(x, gain):
    """The main job's LayerNorm (examples/train_charlm.py)."""
    mean = x.mean(-1, keepdims=True)
    var = jnp.square(x - mean).mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + 1e-5) * gain


def rounded(a, dtype):
    """``a`` rounded to ``dtype`` and held in float32 (exact in ``dtype``)."""
    return jnp.asarray(np.asarray(a, np.float32)).astype(dtype).astype(jnp.float32)


def _inputs(dtype=BF16, offset=1000.0, scale=200.0, seed=0):
    """Weights and inputs exact in ``dtype``; ``x @ w`` has a common offset
    ``offset`` and deviations ``scale``: activations in the hundreds and
    thousands, where a low-precision centring would lose most digits."""
    k = np.random.RandomState(seed)
    w = rounded(np.eye(D) + k.randn(D, D) / 64, dtype)
    x = rounded(offset + scale * k.randn(32, D), dtype)
    g = rounded(1.0 + 0.1 * k.randn(D), dtype)
    w2 = rounded(k.randn(D, 16) / 8, dtype)
    return (w, g, w2), x


def _loss(p, x, norm=layer_norm):
    w, g, w2 = p
    return jnp.tanh(norm(x @ w, g) @ w2).sum()


def _scopes(fn, *args):
    """The named scopes of every checkpoint in ``fn``'s jaxpr."""
    closed = jax.make_jaxpr(fn)(*args)
    return [
        str(e.source_info.name_stack).rsplit("/", 1)[-1]
        for e, _ in jaxamp.tools.iter_equations(closed)
        if e.primitive.name in ("remat2", "checkpoint")
    ]


def _big_residuals(fn, *args, size):
    """Dtype names of the saved residuals of ``size`` elements (activations),
    arguments excluded."""
    return sorted(
        a.dtype.name
        for a, src in _compat.saved_residuals(fn, *args)
        if a.size == size and not src.startswith("from the argument")
    )


def _grad_errors(loss, p, x, dtype):
    """Relative L2 errors of the gradients (parameters and input) of ``loss``
    under amp with and without the region, against float32."""
    with jax.default_matmul_precision("highest"):
        ref = jax.grad(loss, (0, 1))(p, x)
        region = jax.grad(jaxamp.amp(loss, compute_dtype=dtype), (0, 1))(p, x)
        plain = jax.grad(NO_REGION(loss, compute_dtype=dtype), (0, 1))(p, x)
    assert all(a.dtype == F32 for a in jax.tree.leaves(region))
    return rel_l2(region, ref), rel_l2(plain, ref)


@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "fp16"])
def test_region_saves_the_low_precision_input(dtype):
    """The checkpoint with the scope is there; the activation-sized residuals
    are the low-precision ``x @ w`` and the normalised value's low-precision
    copies (for the gain and the next matmul), no float32 centred value."""
    p, x = _inputs(dtype, offset=300.0, scale=50.0)
    low = dtype.name
    assert LN_SCOPE in _scopes(jaxamp.amp(_loss, compute_dtype=dtype), p, x)
    saved = _big_residuals(jaxamp.amp(_loss, compute_dtype=dtype), p, x, size=x.size)
    assert saved == [low] * 3, saved
    # The check can fail: without the region the float32 centred value and the
    # square's derivative (2 * centred) are saved, and no input copy.
    assert LN_SCOPE not in _scopes(NO_REGION(_loss, compute_dtype=dtype), p, x)
    plain = _big_residuals(NO_REGION(_loss, compute_dtype=dtype), p, x, size=x.size)
    assert plain == [low, low, "float32", "float32"], plain
    less = jaxamp.saved_residual_bytes(jaxamp.amp(_loss, compute_dtype=dtype), p, x)
    more = jaxamp.saved_residual_bytes(NO_REGION(_loss, compute_dtype=dtype), p, x)
    assert more - less >= x.size * (4 + 4 - 2)


@pytest.mark.parametrize(
    "dtype, offset, scale, bound",
    [
        (BF16, 1000.0, 200.0, 1.5e-2),
        (BF16, 2000.0, 30.0, 1.5e-2),
        (F16, 300.0, 50.0, 3e-3),
    ],
    ids=["bf16-1000", "bf16-offset-2000", "fp16-300"],
)
def test_gradients_match_the_float32_normalisation(dtype, offset, scale, bound):
    """Gradients against float32 at activations in the hundreds and thousands:
    within ``bound`` and within 2% of amp without the region (which runs the
    same float32 normalisation without recomputing it). Measured: 2.5e-3 and
    2.1e-3 (bfloat16), 3.6e-4 (float16), the same with and without."""
    p, x = _inputs(dtype, offset, scale)
    err, plain = _grad_errors(_loss, p, x, dtype)
    assert np.isfinite(err) and err < bound, (err, plain)
    assert err <= 1.02 * plain + 1e-6, (err, plain)


def test_no_region_for_float32_input_or_inside_a_users_checkpoint():
    """A float32 ``x`` (the amp'd function's own argument) or a LayerNorm
    inside the user's ``jax.checkpoint`` (whose residuals are recomputed
    anyway) runs as without the region."""
    p, x = _inputs()

    def on_input(p, x):
        w, g, w2 = p
        return jnp.tanh(layer_norm(x, g) @ w2).sum()

    amp_f = jaxamp.amp(on_input, compute_dtype=BF16)
    assert LN_SCOPE not in _scopes(amp_f, p, x)
    assert jaxamp.saved_residual_bytes(amp_f, p, x) == jaxamp.saved_residual_bytes(
        NO_REGION(on_input, compute_dtype=BF16), p, x
    )
    remat = jax.checkpoint(_loss)
    assert LN_SCOPE not in _scopes(jaxamp.amp(remat, compute_dtype=BF16), p, x)
    with _state.recomputing():
        assert LN_SCOPE not in _scopes(jaxamp.amp(_loss, compute_dtype=BF16), p, x)


def test_layer_norm_in_a_scan_over_layers():
    """Two layers in ``lax.scan``: the region runs in the body, the scan saves
    no float32 activations (stacked per layer), and the gradients match
    (measured 4.9e-3, the same without the region)."""
    (w, g, w2), x = _inputs(offset=500.0, scale=100.0)
    ws = jnp.stack([w, rounded(w.T, BF16)])
    gs = jnp.stack([g, g[::-1]])

    def loss(p, x):
        ws, gs, w2 = p

        def layer(h, wg):
            return layer_norm(h, wg[1]) @ wg[0] + h, None

        h, _ = jax.lax.scan(layer, x @ ws[0], (ws, gs))
        return jnp.tanh(layer_norm(h, gs[0]) @ w2).sum()

    p = (ws, gs, w2)
    amp_f = jaxamp.amp(loss, compute_dtype=BF16)
    assert LN_SCOPE in _scopes(amp_f, p, x)
    stacked = _big_residuals(amp_f, p, x, size=2 * x.size)
    assert stacked and "float32" not in stacked, stacked
    assert "float32" in _big_residuals(
        NO_REGION(loss, compute_dtype=BF16), p, x, size=2 * x.size
    )
    err, plain = _grad_errors(loss, p, x, BF16)
    assert err < 1e-2 and err <= 1.02 * plain + 1e-6, (err, plain)


def _flax_nnx():
    nnx = pytest.importorskip("flax.nnx")
    ln = nnx.LayerNorm(D, rngs=nnx.Rngs(0), epsilon=1e-5)
    return lambda h, g: ln(h) * g


def _flax_linen():
    nn = pytest.importorskip("flax.linen")
    m = nn.LayerNorm(epsilon=1e-5)
    params = m.init(jax.random.PRNGKey(0), jnp.ones((1, D)))
    return lambda h, g: m.apply(params, h) * g


def _equinox():
    return lambda h, g: jax.vmap(eqx.nn.LayerNorm(D, eps=1e-5))(h) * g


LIBRARY_NORMS = {"nnx": _flax_nnx, "linen": _flax_linen, "eqx-vmap": _equinox}


@pytest.mark.parametrize("name", sorted(LIBRARY_NORMS))
def test_library_layer_norms(name):
    """Flax's (mean of squares minus squared mean, gain folded into the
    factor) and Equinox's (variance in a ``jit``) LayerNorms get the region
    and the float32 normalisation's gradients (measured 2.5e-3 and 2.6e-3;
    Flax's without the region 2.5e-3)."""
    norm = LIBRARY_NORMS[name]()
    p, x = _inputs(offset=1000.0, scale=200.0)

    def loss(p, x):
        return _loss(p, x, norm)

    amp_f = jaxamp.amp(loss, compute_dtype=BF16)
    assert LN_SCOPE in _scopes(amp_f, p, x)
    assert "float32" not in _big_residuals(amp_f, p, x, size=x.size)
    err, plain = _grad_errors(loss, p, x, BF16)
    assert err < 5e-3 and err <= 1.02 * plain + 1e-6, (err, plain)


def _ln_facts(fn, *args, n_out=1):
    closed = jax.make_jaxpr(fn)(*args)
    return closed.jaxpr, _facts.analyse(closed.jaxpr, (0,) * n_out).eqns


def test_region_only_where_it_replaces_float32_residuals():
    """No region where the statistics are read elsewhere (the variance
    returned beside the output) or where the factor does not come from ``x``
    (``(x - mean) * 0.5`` saves nothing); the region ends at the
    normalisation and holds the means, centrings and the variance's root."""
    (w, g, _), x = _inputs()

    def with_var(w, x):
        h = x @ w
        v = jnp.var(h, -1, keepdims=True)
        return (h - h.mean(-1, keepdims=True)) * jax.lax.rsqrt(v + 1e-5), v

    jaxpr, facts = _ln_facts(with_var, w, x, n_out=2)
    assert not [f for f in facts if f.ln_region]
    jaxpr, facts = _ln_facts(
        lambda w, x: (x @ w - (x @ w).mean(-1)[:, None]) * 0.5, w, x
    )
    assert not [f for f in facts if f.ln_region]
    jaxpr, facts = _ln_facts(lambda w, x: layer_norm(x @ w, g), w, x)
    (k,) = [j for j, f in enumerate(facts) if f.ln_region]
    region = facts[k].ln_region
    names = [jaxpr.eqns[j].primitive.name for j in region]
    assert region[-1] == k and list(region) == sorted(region)
    assert names.count("sub") == 2 and "rsqrt" in names and "dot_general" not in names
    assert facts[k].ln_input is jaxpr.eqns[0].outvars[0]  # x @ w
