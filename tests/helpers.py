"""Small helpers shared by the tests: pytree comparisons and the main job's
smallest configuration; bfloat16 rounding and the relative L2 error are the
model kit's (benchmarks/common.py), re-exported here.

Jaxpr walking lives in the package (``jaxamp.tools.primitive_dtypes``,
``jaxamp.tools.matmul_flops_by_dtype``, ``jaxamp.tools.iter_equations``).
"""

import jax
import jax.numpy as jnp
import numpy as np
from common import rel_l2, round_bf16  # noqa: F401  (re-exported)

# The main job (examples/train_charlm.py) at the smallest size its flag tests
# train: one layer, a few steps' worth of shapes; `Config(**TINY_CHARLM, ...)`.
TINY_CHARLM = dict(
    batch_size=4,
    seq_len=32,
    d_model=64,
    layers=1,
    heads=2,
    warmup=2,
    eval_batches=1,
    sample_chars=4,
)


def tree_dtypes(tree):
    """The dtypes of a pytree's array leaves, as a list of numpy dtypes."""
    return [np.dtype(x.dtype) for x in jax.tree.leaves(tree)]


def assert_tree_allclose(tree, ref, *, rtol, atol=0.0):
    """Same structure, same dtypes and shapes, and values within tolerance."""
    assert jax.tree.structure(tree) == jax.tree.structure(ref)
    for x, y in zip(jax.tree.leaves(tree), jax.tree.leaves(ref)):
        assert x.dtype == y.dtype and x.shape == y.shape, (x.dtype, y.dtype)
        np.testing.assert_allclose(
            np.asarray(x, np.float64), np.asarray(y, np.float64), rtol=rtol, atol=atol
        )


# The model of the update-inside-the-backward tests (tests/test_in_backward.py,
# tests/test_factored.py): layers stacked in lax.scan, activations in the hundreds.
STACK_L, STACK_D = 3, 32


def stacked_mlp(params, x):
    """LayerNorm with a gain, a GELU MLP, layers stacked in ``lax.scan``."""

    def layer(h, p):
        mean = h.mean(-1, keepdims=True)
        var = jnp.square(h - mean).mean(-1, keepdims=True)
        n = (h - mean) * jax.lax.rsqrt(var + 1e-5) * p["gain"]
        return h + jax.nn.gelu(n @ p["w1"] + p["b1"]) @ p["w2"], None

    h, _ = jax.lax.scan(layer, x, params["layers"])
    return jnp.mean(jax.nn.logsumexp(h @ params["head"], axis=-1))


def stacked_mlp_params(dtype=jnp.bfloat16):
    k = jax.random.split(jax.random.key(0), 5)
    n, d = STACK_L, STACK_D
    params = {
        "layers": {
            "gain": 1.0 + 0.1 * jax.random.normal(k[0], (n, d)),
            "w1": jax.random.normal(k[1], (n, d, 4 * d)) / d**0.5,
            "b1": 0.1 * jax.random.normal(k[4], (n, 4 * d)),
            "w2": jax.random.normal(k[2], (n, 4 * d, d)) / (4 * d) ** 0.5,
        },
        "head": jax.random.normal(k[3], (d, 8)) / d**0.5,
    }
    return jax.tree.map(lambda a: a.astype(dtype), params)


def hundreds_batch(i):
    x = 100.0 * jax.random.normal(jax.random.key(10 + i), (16, STACK_D))
    return x.astype(jnp.bfloat16).astype(jnp.float32)  # hundreds, bf16-exact
