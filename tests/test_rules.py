"""Tests of the rule functions and the default policy table
(jaxamp/_policy/_rules.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxamp
from jaxamp._base import _cast

BF16, F16, F32 = np.dtype(jnp.bfloat16), np.dtype(jnp.float16), np.dtype(jnp.float32)


def _dtypes(xs):
    return [x.dtype if isinstance(x, jax.Array) else np.asarray(x).dtype for x in xs]


def test_use_compute_precision_casts_floats_and_sets_preferred_type():
    x, i = jnp.ones((2, 2), jnp.float32), jnp.ones((2, 2), jnp.int32)
    out, params = jaxamp.use_compute_precision(
        BF16, [F32, np.dtype(jnp.int32)], x, i, preferred_element_type=F32, other=1
    )
    assert _dtypes(out) == [BF16, np.dtype(jnp.int32)]
    assert params == {"preferred_element_type": BF16, "other": 1}


def test_use_compute_precision_leaves_integer_matmul_alone():
    i = jnp.ones((2, 2), jnp.int32)
    out, params = jaxamp.use_compute_precision(
        BF16, [i.dtype, i.dtype], i, i, preferred_element_type=np.dtype(jnp.int32)
    )
    assert _dtypes(out) == [np.dtype(jnp.int32)] * 2
    assert params["preferred_element_type"] == np.dtype(jnp.int32)


def test_use_compute_precision_never_widens_a_float8_matmul():
    """A hand-written FP8 matmul (float8 operands, float32 result) stays as
    written under bfloat16 amp, in the rule and end to end."""
    e4m3 = np.dtype(jnp.float8_e4m3fn)
    a = jnp.ones((2, 4), e4m3)
    out, params = jaxamp.use_compute_precision(
        BF16, [e4m3, e4m3], a, a, preferred_element_type=F32
    )
    assert _dtypes(out) == [e4m3, e4m3] and params["preferred_element_type"] == F32

    def f(x, w):
        y = jax.lax.dot_general(
            x.astype(e4m3),
            w.astype(e4m3),
            (((1,), (0,)), ((), ())),
            preferred_element_type=jnp.float32,
        )
        return y.sum()

    x, w = jnp.ones((3, 4)), jnp.ones((4, 5))
    closed = jax.make_jaxpr(jaxamp.amp(f, compute_dtype=BF16))(x, w)
    dots = [
        (i, o)
        for n, i, o in jaxamp.tools.primitive_dtypes(closed)
        if n == "dot_general"
    ]
    assert dots == [((e4m3, e4m3), (F32,))]
    assert jaxamp.amp(f, compute_dtype=BF16)(x, w) == f(x, w)


def test_follow_goes_low_when_a_traced_input_is_low():
    low, full = jnp.ones(3, jnp.bfloat16), jnp.ones(3, jnp.float32)
    out, _ = jaxamp.rules.follow_compute_precision(BF16, [F32, F32], low, full)
    assert _dtypes(out) == [BF16, BF16]


def test_follow_restores_original_dtypes_otherwise():
    a, b = jnp.ones(3, jnp.float32), jnp.ones(3, jnp.float16)
    # Neither input is in the compute dtype: each goes back to its traced dtype.
    out, _ = jaxamp.rules.follow_compute_precision(BF16, [F32, F32], a, b)
    assert _dtypes(out) == [F32, F32]


def test_follow_ignores_literals_and_weak_values_when_deciding():
    # A bfloat16 literal alone must not pull a float32 operand down.
    lit = np.asarray(2.0, dtype=BF16)
    full = jnp.ones(3, jnp.float32)
    out, _ = jaxamp.rules.follow_compute_precision(BF16, [F32, F32], full, lit)
    assert _dtypes(out) == [F32, F32]
    # ...but a literal follows a traced low operand.
    low = jnp.ones(3, jnp.bfloat16)
    out, _ = jaxamp.rules.follow_compute_precision(
        BF16, [F32, F32], low, np.float32(2.0)
    )
    assert _dtypes(out) == [BF16, BF16]
    assert not isinstance(out[1], jax.Array)  # stays a literal (numpy) value


def test_use_full_precision_is_float32_but_never_narrows():
    out, _ = jaxamp.use_full_precision(BF16, [F32], jnp.ones(2, jnp.bfloat16))
    assert _dtypes(out) == [F32]
    f64 = np.ones(2, np.float64)
    out, _ = jaxamp.use_full_precision(BF16, [np.dtype(np.float64)], f64)
    assert _dtypes(out) == [np.dtype(np.float64)]


def test_use_widest_and_use_precision():
    a, b = jnp.ones(2, jnp.bfloat16), jnp.ones(2, jnp.float32)
    out, _ = jaxamp.rules.use_widest_precision(BF16, [F32, F32], a, b)
    assert _dtypes(out) == [F32, F32]
    rule = jaxamp.rules.use_precision("f16")
    out, params = rule(BF16, [F32, F32], a, b, preferred_element_type=F32)
    assert _dtypes(out) == [F16, F16]
    assert params["preferred_element_type"] == F16


def test_use_precision_rejects_non_float():
    with pytest.raises(ValueError, match="floating"):
        jaxamp.rules.use_precision(jnp.int32)


def test_use_original_precision():
    a = jnp.ones(2, jnp.bfloat16)
    out, _ = jaxamp.use_original_precision(BF16, [F32], a)
    assert _dtypes(out) == [F32]


@pytest.mark.parametrize("compute, expected", [(F16, F32), (BF16, BF16)])
def test_integer_pow_is_float32_only_for_float16(compute, expected):
    rule = jaxamp.default_amp_policy["integer_pow"]
    x = jnp.ones(2, compute)
    out, _ = rule(compute, [F32], x, y=3)
    assert _dtypes(out) == [expected]


def test_never_cast_non_float_values():
    key = jax.random.key(0)
    c = jnp.ones(2, jnp.complex64)
    b = jnp.ones(2, bool)
    for rule in (
        jaxamp.use_compute_precision,
        jaxamp.use_full_precision,
        jaxamp.rules.follow_compute_precision,
        jaxamp.use_original_precision,
    ):
        out, _ = rule(BF16, [key.dtype, c.dtype, b.dtype], key, c, b)
        assert out[0] is key and out[1] is c and out[2] is b


def test_default_table_families():
    p = jaxamp.default_amp_policy
    for name in ("dot_general", "conv_general_dilated"):
        assert p[name] is jaxamp.rules.use_lower_precision
    for name in ("square", "integer_pow"):
        assert p[name] is jaxamp.rules.use_range_safe_precision
    for name in ("cholesky", "triangular_solve", "eigh", "lu", "qr", "svd", "schur"):
        assert p[name] is jaxamp.use_full_precision
    for name in ("exp", "log", "log1p", "pow", "rsqrt", "reduce_sum", "cumsum"):
        assert p[name] is jaxamp.use_full_precision
    assert p["amp_default"] is jaxamp.rules.follow_compute_precision
    assert p["amp_stop"] is jaxamp.use_original_precision
    assert p["convert_element_type"] is jaxamp.rules.keep_current_precision
    assert "add" not in p and "tanh" not in p  # they follow


def test_casts_are_deduplicated_within_a_walk():
    x = jnp.ones(3, jnp.float32)
    with _cast.cast_cache():
        a = _cast.cast(x, BF16)
        b = _cast.cast(x, BF16)
    assert a is b
    assert _cast.cast(x, BF16) is not _cast.cast(x, BF16)  # no cache outside


def test_bfloat16_result_matmuls_accumulate_in_float32():
    # amp's jaxpr of an MLP's hidden layer says preferred_element_type=bfloat16
    # (the result's dtype); the kernels sum in float32 and round once (the note
    # in the README's policy table and the guide). 1 + 4095 * 2**-9 = 8.998 in
    # float32, 9 once rounded to bfloat16; a bfloat16 running sum stays at 1.
    mlp = jaxamp.amp(
        lambda w1, w2, x: (jnp.tanh(x @ w1) @ w2).sum(), compute_dtype=jnp.bfloat16
    )
    w1, w2, x = jnp.ones((3, 4)), jnp.ones((4, 2)), jnp.ones((5, 3))
    text = str(jax.make_jaxpr(mlp)(w1, w2, x))
    assert "preferred_element_type=bfloat16" in text
    assert "bf16[5,4] = dot_general" in text
    n = 4096
    terms = np.concatenate([[1.0], np.full(n - 1, 2.0**-9)])
    a = jnp.asarray(terms, jnp.bfloat16)
    ones = jnp.ones(n, jnp.bfloat16)
    dot = jax.jit(
        lambda a, b: jax.lax.dot_general(
            a, b, (((0,), (0,)), ((), ())), preferred_element_type=jnp.bfloat16
        )
    )
    conv = jax.jit(
        lambda a, b: jax.lax.conv_general_dilated(
            a[None, None], b[None, None], (1,), "VALID"
        )
    )
    for result in (dot(a, ones), conv(a, ones)):
        assert result.dtype == jnp.bfloat16
        assert float(result.reshape(())) == 9.0


# Rules receive their context ---------------------------------------------------


def _layernorm_loss(w, x):
    with jax.named_scope("norm"):
        h = x @ w
        c = h - h.mean(-1, keepdims=True)
        y = c * jax.lax.rsqrt((c * c).mean(-1, keepdims=True) + 1e-5)
    return jnp.sum((y @ w) ** 2)


def _sub_dtypes(f, *args):
    jaxpr = jax.make_jaxpr(f)(*args)
    return [
        e.invars[0].aval.dtype
        for e, _ in jaxamp.tools.iter_equations(jaxpr)
        if e.primitive.name == "sub"
    ]


def test_context_rule_gets_facts_scopes_policy_and_residual_format():
    seen = []

    @jaxamp.rules.CastRule.with_context
    def record(ctx, *invars, **params):
        seen.append(ctx)
        return jaxamp.rules.follow_compute_precision.decide(ctx, *invars, **params)

    policy = {**jaxamp.default_amp_policy, "sub": record}
    w = jnp.ones((32, 32)) / 32
    x = 100.0 * jax.random.normal(jax.random.key(0), (8, 32))
    f = jaxamp.amp(
        _layernorm_loss, compute_dtype=BF16, amp_policy=policy, residual_dtype="int8"
    )
    # The centring runs in float32 (the facts reached the rule), as by default.
    assert _sub_dtypes(f, w, x) == [F32]
    (ctx,) = {id(c): c for c in seen}.values()
    assert ctx.facts.centring and ctx.scopes == ("norm",)
    assert ctx.compute_dtype == BF16 and ctx.original_dtypes == (F32, F32)
    assert ctx.residual_format.dtype == np.dtype(np.int8)
    assert ctx.policy.lookup(jax.lax.sub_p, ("norm",)) is record


def test_rule_with_0_0_4_signature_delegating_to_a_context_rule():
    # A user's rule with jaxamp 0.0.4's signature calls the built-in rule as
    # it did; the built-in reads the walk's facts through the adapter, so the
    # centring still runs in float32 (with every fact unknown it would follow
    # the bfloat16 matmul output).
    def mine(compute_dtype, original_dtypes, *invars, **params):
        assert isinstance(original_dtypes, list)
        return jaxamp.rules.follow_compute_precision(
            compute_dtype, original_dtypes, *invars, **params
        )

    policy = {**jaxamp.default_amp_policy, "sub": mine}
    w = jnp.ones((32, 32)) / 32
    x = 100.0 * jax.random.normal(jax.random.key(0), (8, 32))
    f = jaxamp.amp(_layernorm_loss, compute_dtype=BF16, amp_policy=policy)
    assert _sub_dtypes(f, w, x) == [F32]
    # Called by hand, outside a walk: every fact unknown, plain "follow".
    low = jnp.ones((2, 32), BF16)
    out, _ = jaxamp.rules.follow_compute_precision(BF16, [F32, F32], low, jnp.ones(32))
    assert _dtypes(out) == [BF16, BF16]
