"""Tests of the measuring helpers (jaxamp/_tools/_measure.py), against FLOP and byte
counts computed by hand."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import jaxamp

A = jnp.ones((4, 8), jnp.float32)
B = jnp.ones((8, 16), jnp.float32)
MATMUL = 2 * 4 * 8 * 16  # 1024
F32, BF16 = np.dtype(jnp.float32), np.dtype(jnp.bfloat16)


@jax.custom_vjp
def _vjp_matmul(a, b):
    return a @ b


_vjp_matmul.defvjp(lambda a, b: (a @ b, (a, b)), lambda r, g: (g @ r[1].T, r[0].T @ g))


@jax.custom_jvp
def _jvp_matmul(a, b):
    return a @ b


_jvp_matmul.defjvp(lambda p, t: (p[0] @ p[1], t[0] @ p[1] + p[0] @ t[1]))


def test_dot_flops_and_recursion():
    def f(a, b):
        x = a @ b  # 1024
        x = jax.jit(lambda u: u @ b.T)(x)  # (4,16)@(16,8): 1024
        x = jax.checkpoint(lambda u: u @ b)(x)  # 1024
        y, _ = lax.scan(lambda c, _: (c @ b.T @ b, None), x, None, length=3)  # 3*2048
        z = _vjp_matmul(y, b.T)  # 1024
        z = _jvp_matmul(z, b)  # 1024
        return z

    flops = jaxamp.tools.matmul_flops_by_dtype(jax.make_jaxpr(f)(A, B))
    assert flops == {"float32": 1024 * 3 + 3 * 2048 + 2 * 1024}


def test_nested_scan_weights_multiply():
    def f(a, b):
        inner = lambda c, _: (c @ b @ b.T, None)  # 2048 per step
        outer = lambda c, _: (lax.scan(inner, c, None, length=3)[0], None)
        return lax.scan(outer, a, None, length=5)[0]

    assert jaxamp.tools.matmul_flops_by_dtype(jax.make_jaxpr(f)(A, B)) == {
        "float32": 5 * 3 * 2048
    }


def test_cond_counts_costliest_branch_and_while_counts_once():
    def f(p, a, b):
        two = lambda u: u @ b @ b.T  # 2048
        one = lambda u: (u @ b)[:, :8]  # 1024
        return lax.cond(p, one, two, a)

    assert jaxamp.tools.matmul_flops_by_dtype(jax.make_jaxpr(f)(True, A, B)) == {
        "float32": 2048
    }

    def g(a, b):
        body = lambda c: (c[0] + 1, c[1] @ b @ b.T)
        return lax.while_loop(lambda c: c[0] < 10, body, (0, a))[1]

    # The trip count (10) is not static: the body counts once.
    assert jaxamp.tools.matmul_flops_by_dtype(jax.make_jaxpr(g)(A, B)) == {
        "float32": 2048
    }
    # count_primitive counts code, not executions: one dot_general per branch.
    assert (
        jaxamp.tools.count_primitive(jax.make_jaxpr(f)(True, A, B), "dot_general") == 3
    )


def test_batched_dot_and_conv_flops():
    a, b = jnp.ones((5, 4, 8)), jnp.ones((5, 8, 16))
    flops = jaxamp.tools.matmul_flops_by_dtype(jax.make_jaxpr(jnp.matmul)(a, b))
    assert flops == {"float32": 5 * MATMUL}
    # Batch dimension in the middle of both operands: 'bik,kbj'-like layouts.
    dn = (((2,), (0,)), ((1,), (1,)))
    lhs, rhs = jnp.ones((4, 5, 8)), jnp.ones((8, 5, 16))
    closed = jax.make_jaxpr(lambda u, v: lax.dot_general(u, v, dn))(lhs, rhs)
    assert jaxamp.tools.matmul_flops_by_dtype(closed) == {"float32": 5 * MATMUL}
    x, k = jnp.ones((2, 3, 10, 10)), jnp.ones((6, 3, 3, 3))  # NCHW, OIHW
    conv = lambda x, k: lax.conv(x, k, (1, 1), "VALID")  # out (2, 6, 8, 8)
    flops = jaxamp.tools.matmul_flops_by_dtype(jax.make_jaxpr(conv)(x, k))
    assert flops == {"float32": 2 * (2 * 6 * 8 * 8) * 3 * 9}


def test_grouped_conv_flops():
    # 6 input channels in 3 groups: each output channel sees 2 of them.
    x, k = jnp.ones((2, 6, 10, 10)), jnp.ones((9, 2, 3, 3))
    conv = lambda x, k: lax.conv_general_dilated(
        x, k, (1, 1), "VALID", feature_group_count=3
    )  # out (2, 9, 8, 8)
    flops = jaxamp.tools.matmul_flops_by_dtype(jax.make_jaxpr(conv)(x, k))
    assert flops == {"float32": 2 * (2 * 9 * 8 * 8) * 2 * 9}


def test_ragged_dot_flops():
    # 6 rows split into 3 groups, each row times its group's (8, 16) matrix:
    # 2 * 6 * 8 * 16, not 3 times that.
    lhs, rhs = jnp.ones((6, 8)), jnp.ones((3, 8, 16))
    sizes = jnp.array([1, 2, 3], jnp.int32)
    closed = jax.make_jaxpr(lax.ragged_dot)(lhs, rhs, sizes)
    assert jaxamp.tools.matmul_flops_by_dtype(closed) == {"float32": 2 * 6 * 8 * 16}


def test_shard_map_flops_are_global():
    mesh = jax.make_mesh((4,), ("d",), axis_types=(AxisType.Auto,))
    f = jax.shard_map(
        lambda x, w: x @ w, mesh=mesh, in_specs=(P("d"), P()), out_specs=P("d")
    )
    x = jnp.ones((16, 8))
    closed = jax.make_jaxpr(f)(x, B)
    assert jaxamp.tools.matmul_flops_by_dtype(closed) == {"float32": 2 * 16 * 8 * 16}


def test_low_precision_share_and_mixed_keys():
    def f(a, b):
        low = a.astype(jnp.bfloat16) @ b.astype(jnp.bfloat16)
        return low.astype(jnp.float32).sum() + (a @ b).sum()

    assert jaxamp.tools.low_precision_flop_share(jax.make_jaxpr(f)(A, B)) == 0.5
    g = lambda a, b: lax.dot(
        a.astype(jnp.bfloat16), b, preferred_element_type=jnp.float32
    )
    with jax.numpy_dtype_promotion("standard"):  # a mixed-dtype product on purpose
        mixed = jax.make_jaxpr(g)(A, B)
    assert jaxamp.tools.matmul_flops_by_dtype(mixed) == {"bfloat16 x float32": MATMUL}
    assert jaxamp.tools.low_precision_flop_share(mixed) == 0.0
    assert jaxamp.tools.low_precision_flop_share(jax.make_jaxpr(jnp.sin)(A)) == 0.0
    assert jaxamp.tools.matmul_flops_by_dtype(jax.make_jaxpr(jnp.sin)(A)) == {}


def test_share_of_amp_gradient():
    f = lambda a, b: jnp.tanh(a @ b).sum()
    closed = jax.make_jaxpr(jax.grad(jaxamp.amp(f, compute_dtype=jnp.bfloat16)))
    flops = jaxamp.tools.matmul_flops_by_dtype(closed(A, B))
    # Forward product and the cotangent of a: (4,16)@(16,8), 1024 each.
    assert flops == {"bfloat16": 2 * MATMUL}
    assert jaxamp.tools.low_precision_flop_share(closed(A, B)) == 1.0


def test_count_and_primitive_dtypes():
    f = lambda a: jax.jit(lambda u: jnp.exp(u.astype(jnp.bfloat16)))(a)
    closed = jax.make_jaxpr(f)(A)
    assert jaxamp.tools.count_primitive(closed, "convert_element_type") == 1
    assert jaxamp.tools.count_primitive(closed, "jit") == 1
    table = jaxamp.tools.primitive_dtypes(closed)
    assert table[0][0] == "jit"  # depth first: the jit before its body
    assert ("exp", (BF16,), (BF16,)) in table
    # Under amp the same exp runs in float32 (DESIGN.md's float32 family).
    g = jaxamp.amp(lambda a: jnp.exp(a @ B).sum(), compute_dtype=jnp.bfloat16)
    exps = [
        e for e in jaxamp.tools.primitive_dtypes(jax.make_jaxpr(g)(A)) if e[0] == "exp"
    ]
    assert exps == [("exp", (F32,), (F32,))]


def test_scan_body_counted_once_by_count_primitive():
    f = lambda a: lax.scan(lambda c, _: (jnp.sin(c), None), a, None, length=7)[0]
    assert jaxamp.tools.count_primitive(jax.make_jaxpr(f)(A), "sin") == 1


def test_saved_residual_bytes_by_hand():
    # grad of sum(tanh(x @ w)) saves tanh's derivative as (2,3) float32 arrays of
    # 24 B: tanh and 1 - tanh^2 on JAX 0.10, only 1 - tanh^2 on JAX 0.11. The
    # arguments w and x are not counted.
    f = lambda w, x: jnp.tanh(x @ w).sum()
    w, x = jnp.ones((4, 3)), jnp.ones((2, 4))
    fp32 = jaxamp.saved_residual_bytes(f, w, x)
    assert fp32 in (24, 48)
    # Under bfloat16 amp: tanh follows the last matmul, so it is the loss chain
    # and stays float32 (the same arrays); the backward matmul re-casts the
    # arguments w and x instead of saving copies.
    half = jaxamp.amp(f, compute_dtype=jnp.bfloat16)
    assert jaxamp.saved_residual_bytes(half, w, x) == fp32
    # Between two matmuls tanh runs in bfloat16: its arrays take 12 B each.
    w2 = jnp.ones((3, 2))
    mid = lambda w, x, w2: (jnp.tanh(x @ w) @ w2).sum()
    n_mid = jaxamp.saved_residual_bytes(mid, w, x, w2) // 24
    half_mid = jaxamp.amp(mid, compute_dtype=jnp.bfloat16)
    assert jaxamp.saved_residual_bytes(half_mid, w, x, w2) == n_mid * 12
    # x * 2 is not an argument: its bfloat16 copy (16 B) is saved; the argument
    # w is re-cast in the backward pass (no 24 B copy).
    g = jaxamp.amp(lambda w, x: f(w, x * 2), compute_dtype=jnp.bfloat16)
    assert jaxamp.saved_residual_bytes(g, w, x) == 16 + fp32
    # x * 2 read by two matmuls: one bfloat16 copy of it (16 B), and w read by
    # both keeps one cached copy (24 B) instead of a cast per matmul.
    g2 = jaxamp.amp(
        lambda w, x: f(w, x * 2) + f(w, x * 2 + 1), compute_dtype=jnp.bfloat16
    )
    assert jaxamp.saved_residual_bytes(g2, w, x) == 16 + 16 + 24 + 2 * fp32
    # Keyword arguments reach fn and are arguments too.
    assert jaxamp.saved_residual_bytes(lambda w, *, x: f(w, x), w, x=x) == fp32


def test_saved_residual_bytes_of_a_product_is_zero():
    # d(sum(x * w))/dw = x, an argument: nothing extra is saved.
    f = lambda w, x: (x * w).sum()
    assert jaxamp.saved_residual_bytes(f, A, A) == 0
    # sin's derivative needs cos(x): one (4, 8) float32 array of 128 bytes.
    assert jaxamp.saved_residual_bytes(lambda x: jnp.sin(x).sum(), A) == 128


@pytest.mark.parametrize(
    "helper",
    [
        jaxamp.tools.matmul_flops_by_dtype,
        jaxamp.tools.low_precision_flop_share,
        jaxamp.tools.primitive_dtypes,
        lambda c: jaxamp.tools.count_primitive(c, "exp"),
        lambda c: list(jaxamp.tools.iter_equations(c)),
    ],
)
def test_not_a_jaxpr(helper):
    with pytest.raises(TypeError, match="expected a jaxpr"):
        helper(lambda x: x)


def test_saved_residual_bytes_needs_a_function():
    with pytest.raises(TypeError, match=r"saved_residual_bytes\(fn, \*args\): fn"):
        jaxamp.saved_residual_bytes(jnp.ones(3), jnp.ones(3))
