"""Tests of the measuring helpers (jaxamp/_analysis.py), against FLOP and byte
counts computed by hand."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jaxamp

A = jnp.ones((4, 8), jnp.float32)
B = jnp.ones((8, 16), jnp.float32)
MATMUL = 2 * 4 * 8 * 16  # 1024


def test_dot_flops_and_recursion():
    def f(a, b):
        x = a @ b  # 1024
        x = jax.jit(lambda u: u @ b.T)(x)  # (4,16)@(16,8): 1024
        x = jax.checkpoint(lambda u: u @ b)(x)  # 1024
        y, _ = lax.scan(lambda c, _: (c @ b.T @ b, None), x, None, length=3)  # 3*2048
        z = lax.cond(True, lambda u: u @ b.T, lambda u: u[:, :8] * 2, y)  # 1024
        return z

    flops = jaxamp.matmul_flops_by_dtype(jax.make_jaxpr(f)(A, B))
    assert flops == {"float32": 1024 * 3 + 3 * 2048 + 1024}


def test_batched_dot_and_conv_flops():
    a, b = jnp.ones((5, 4, 8)), jnp.ones((5, 8, 16))
    flops = jaxamp.matmul_flops_by_dtype(jax.make_jaxpr(jnp.matmul)(a, b))
    assert flops == {"float32": 5 * MATMUL}
    x, k = jnp.ones((2, 3, 10, 10)), jnp.ones((6, 3, 3, 3))  # NCHW, OIHW
    conv = lambda x, k: lax.conv(x, k, (1, 1), "VALID")  # out (2, 6, 8, 8)
    flops = jaxamp.matmul_flops_by_dtype(jax.make_jaxpr(conv)(x, k))
    assert flops == {"float32": 2 * (2 * 6 * 8 * 8) * 3 * 9}


def test_low_precision_share_and_mixed_keys():
    def f(a, b):
        low = a.astype(jnp.bfloat16) @ b.astype(jnp.bfloat16)
        return low.astype(jnp.float32).sum() + (a @ b).sum()

    assert jaxamp.low_precision_flop_share(jax.make_jaxpr(f)(A, B)) == 0.5
    g = lambda a, b: lax.dot(
        a.astype(jnp.bfloat16), b, preferred_element_type=jnp.float32
    )
    with jax.numpy_dtype_promotion("standard"):  # a mixed-dtype product on purpose
        mixed = jax.make_jaxpr(g)(A, B)
    assert jaxamp.matmul_flops_by_dtype(mixed) == {"bfloat16 x float32": MATMUL}
    assert jaxamp.low_precision_flop_share(mixed) == 0.0
    assert jaxamp.low_precision_flop_share(jax.make_jaxpr(jnp.sin)(A)) == 0.0


def test_count_and_primitive_dtypes():
    f = lambda a: jax.jit(lambda u: jnp.exp(u.astype(jnp.bfloat16)))(a)
    closed = jax.make_jaxpr(f)(A)
    assert jaxamp.count_primitive(closed, "convert_element_type") == 1
    table = jaxamp.primitive_dtypes(closed)
    assert ("exp", (np.dtype(jnp.bfloat16),), (np.dtype(jnp.bfloat16),)) in table


def test_saved_residual_bytes_by_hand():
    # grad of sum(tanh(x @ w)) saves float32 (2, 3) arrays of 24 bytes: JAX 0.10
    # keeps tanh's output and (1 - tanh^2), JAX 0.11 only the former. The
    # arguments w and x are not counted.
    f = lambda w, x: jnp.tanh(x @ w).sum()
    w, x = jnp.ones((4, 3)), jnp.ones((2, 4))
    full = jaxamp.saved_residual_bytes(f, w, x)
    assert full in (24, 48)
    n_arrays = full // 24
    # Under bfloat16 amp: bfloat16 copies of x (16 B) and w (24 B) for the
    # backward matmuls, plus the same tanh residuals in bfloat16 (12 B each).
    half = jaxamp.amp(f, compute_dtype=jnp.bfloat16)
    assert jaxamp.saved_residual_bytes(half, w, x) == 16 + 24 + n_arrays * 12


def test_not_a_jaxpr():
    with pytest.raises(TypeError, match="expected a jaxpr"):
        jaxamp.matmul_flops_by_dtype(lambda x: x)
