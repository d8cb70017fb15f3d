"""Tests of the one 8-bit codec (jaxamp/_base/_codec.py) and the registered
formats (jaxamp/_base/_formats.py): a new format is one registration, made
from outside the package, and works as an amp matmul policy, as amp's
residual_dtype and in the three reports under its own name."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import rel_l2

import jaxamp
from jaxamp import _compat
from jaxamp._base import _codec, _formats
from jaxamp._base._codec import (
    FlatBlocks,
    LastAxisGroups,
    PerAxes,
    PerTensor,
    Recipe,
    dequantize,
    quantize,
)

BF16, F32 = np.dtype(jnp.bfloat16), np.dtype(jnp.float32)
E3M4 = np.dtype(jnp.float8_e3m4)  # JAX's float8_e3m4 (ml_dtypes): max 15.5
K = jax.random.split(jax.random.key(0), 8)


rel = rel_l2  # relative L2 error of one array, in float64


@pytest.fixture
def e3m4():
    """The new format, registered the way a user outside jaxamp does it."""
    fmt = jaxamp.extend.register_format("e3m4", jnp.float8_e3m4)
    yield fmt
    jaxamp.extend.unregister_format("e3m4")
    assert _formats.lookup("e3m4") is None and _formats.lookup(E3M4) is None


def mlp(p, x):
    with jax.named_scope("mlp"):
        h = jax.nn.gelu(x @ p["w1"])
    return jnp.mean(jnp.square(h @ p["w2"]))


def mlp_tanh(p, x):
    """``mlp`` with a tanh head: the tanh's input is stored in the format (a
    squared loss's input is stored in int8, the product form of an 8-bit float
    format: its derivative ``2 y g`` is a product of it)."""
    with jax.named_scope("mlp"):
        h = jax.nn.gelu(x @ p["w1"])
    return jnp.mean(jnp.tanh(h @ p["w2"]))


def mlp_params():
    return {
        "w1": jax.random.normal(K[0], (64, 128)) / 8.0,
        "w2": jax.random.normal(K[1], (128, 64)) / 11.0,
    }, jax.random.normal(K[2], (256, 64))


# A new format in one registration ------------------------------------------


def test_a_registered_format_is_an_amp_matmul_policy(e3m4):
    p, x = mlp_params()
    policy = jaxamp.fp8_policy(format="e3m4", size_rule=None, quantize_last_matmul=True)
    loss8 = jaxamp.amp(mlp, compute_dtype=BF16, amp_policy=policy)
    closed = jax.make_jaxpr(jax.value_and_grad(loss8))(p, x)
    dots = [
        e
        for e, _ in jaxamp.tools.iter_equations(closed)
        if e.primitive.name == "dot_general"
    ]
    # 2 forward products, 2 x 2 gradient products: every operand in E3M4 (the
    # format's gradient format is itself), each inside the format's scope.
    assert len(dots) == 6
    assert all(v.aval.dtype == E3M4 for e in dots for v in e.invars[:2])
    assert all(e3m4.scope in _compat.scope_names(e) for e in dots)
    assert e3m4.scope == "jaxamp_e3m4_matmul"
    # Close to float32: 4 mantissa bits (2**-5 relative rounding) with one
    # per-tensor scale; measured 0.05% (loss) and 2.6% / 1.8% (gradients;
    # bfloat16 amp: 0.03%, 0.5% / 0.3%).
    (v8, g8), (v32, g32) = (
        jax.jit(jax.value_and_grad(loss8))(p, x),
        jax.value_and_grad(mlp)(p, x),
    )
    assert abs(float(v8) / float(v32) - 1) < 0.005
    for name in p:
        assert rel(g8[name], g32[name]) < 0.05, name


def test_a_registered_format_stores_residuals(e3m4):
    p, x = mlp_params()
    amp = jaxamp.amp(mlp_tanh, compute_dtype=BF16, residual_dtype="e3m4")
    _, vjp = jax.vjp(amp, p, x)
    saved = {np.dtype(r.dtype) for r in jax.tree.leaves(vjp)}
    # The tanh's input in E3M4; the products' inputs stay in bfloat16 (a
    # format registered with stores_products=False, as FP8 is).
    assert saved == {E3M4, BF16, F32}
    by_dtype = jaxamp.amp(mlp_tanh, compute_dtype=BF16, residual_dtype=jnp.float8_e3m4)
    g8, g32 = jax.jit(jax.grad(by_dtype))(p, x), jax.grad(mlp_tanh)(p, x)
    for name in p:  # measured 0.62% and 0.22% (the bfloat16 residuals: 0.44%, 0.19%)
        assert rel(g8[name], g32[name]) < 0.015, name
    assert (
        repr(jaxamp.residual_rule("e3m4")) == "residual_rule('e3m4', group_size=None)"
    )
    assert jaxamp.residual_rule("E3M4").recipe.group.size == e3m4.group == 128


def test_a_registered_format_is_named_in_the_three_reports(e3m4):
    p, x = mlp_params()
    policy = jaxamp.fp8_policy(format="e3m4", size_rule=None)
    loss8 = jaxamp.amp(mlp, compute_dtype=BF16, amp_policy=policy)
    records = jaxamp.quantization_report(jax.grad(loss8), p, x)
    # The first layer's three products in E3M4; the last layer's (it feeds
    # the loss) in bfloat16.
    eight = [r for r in records if r.reason == ""]
    assert [(r.format, r.scope) for r in eight] == [("e3m4", "mlp")] * 3
    assert all("bfloat16" in r.format for r in records if r.reason)
    memory = jaxamp.memory_report(
        mlp_tanh, p, x, compute_dtype=BF16, residual_dtype="e3m4", compile=False
    )
    assert "e3m4" in memory.by("dtype")
    assert any(r.dtype == "e3m4" and r.primitive == "encode" for r in memory.rows)
    report = jaxamp.precision_report(mlp, p, x, compute_dtype=BF16, amp_policy=policy)
    products = [r for r in report.records if r.primitive == "dot_general"]
    assert {r.format for r in products} == {"e3m4", "bfloat16"}
    assert {r.format_max for r in products if r.format == "e3m4"} == {15.5}


def test_registration_is_by_value_and_checked(e3m4):
    # The same value again is the registration that exists (a rerun cell).
    assert jaxamp.extend.register_format("e3m4", jnp.float8_e3m4) is e3m4
    with pytest.raises(ValueError, match="float8_e3m4 is the dtype of"):
        jaxamp.extend.register_format("other", jnp.float8_e3m4)
    with pytest.raises(ValueError, match="'fp8' is registered"):
        jaxamp.extend.register_format("fp8", jnp.float8_e4m3fnuz)
    with pytest.raises(ValueError, match="8-bit dtype"):
        jaxamp.extend.register_format("half", jnp.float16)
    with pytest.raises(ValueError, match="no 8-bit float format"):
        jaxamp.fp8_policy(format="int8")
    with pytest.raises(ValueError, match="not a registered 8-bit format.*'e3m4'"):
        jaxamp.quant.fp8_rule(format="e2m5")
    with pytest.raises(ValueError, match=r"residual_dtype\)=.*'e3m4'"):
        jaxamp.amp(mlp, residual_dtype=jnp.float8_e4m3fnuz)


def test_the_builtin_formats_are_registered_values():
    names = {f.name: f for f in _formats.registered()}
    assert set(names) >= {"int8", "float8_e4m3fn", "float8_e5m2"}
    assert _formats.lookup("fp8") is _formats.lookup(jnp.float8_e4m3fn)
    assert _formats.E4M3.grad_format is _formats.E5M2
    assert [f.scope for f in (_formats.INT8, _formats.E4M3, _formats.E5M2)] == [
        "jaxamp_int8_matmul",
        "jaxamp_fp8_matmul",
        "jaxamp_fp8_matmul",
    ]
    assert (_formats.INT8.bound, _formats.E4M3.bound, _formats.E5M2.bound) == (
        127.0,
        448.0,
        57344.0,
    )
    assert [f.group for f in (_formats.INT8, _formats.E4M3)] == [32, 128]


# The codec -------------------------------------------------------------------


@pytest.mark.parametrize(
    "group, scale_shape",
    [
        (PerTensor(), ()),
        (PerAxes((1,)), (6, 1)),
        (PerAxes(None), (1, 1)),
        (LastAxisGroups(32), (6, 5)),
        (FlatBlocks(64), (13,)),  # 780 values: 12 blocks and a short one
    ],
)
@pytest.mark.parametrize("fmt", ["int8", "float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("form", ["multiplier", "step"])
def test_quantize_dequantize_round_trip(group, scale_shape, fmt, form):
    x = jax.random.normal(K[3], (6, 130)) * jnp.exp(jax.random.normal(K[4], (6, 1)))
    recipe = Recipe(format=fmt, group=group, scale_form=form)
    q, scale = jax.jit(quantize, static_argnums=1)(x, recipe)
    assert q.shape == x.shape and q.dtype == _formats.lookup(fmt).dtype
    assert scale.shape == scale_shape and scale.dtype == F32
    back = dequantize(q, scale, recipe)
    # int8: half a step of 255 levels (rows 0.1x to 10x apart share a
    # per-tensor step); E4M3 / E5M2: 3 / 2 mantissa bits.
    limit = {"int8": 0.02, "float8_e4m3fn": 0.04, "float8_e5m2": 0.08}[fmt]
    assert rel(back, x) < limit
    # Each group's largest magnitude lands on the format's bound.
    peak = float(jnp.max(jnp.abs(q.astype(F32))))
    assert peak == _formats.lookup(fmt).bound


def test_one_scale_cap_and_special_groups():
    tiny = jnp.full((4, 8), 1e-37, F32)  # bound / amax overflows float32
    _, s8 = jaxamp.quant.int8_quantize(tiny)
    _, sf = jaxamp.quant.fp8_quantize(tiny, jnp.float8_e4m3fn)
    assert float(s8.reshape(())) == float(sf) == 2.0**126 == float(_codec.MAX_SCALE)
    bad = jnp.ones((2, 64)).at[0, 3].set(jnp.inf)
    pass_, nan_ = (
        Recipe(format="int8", group=PerAxes((1,)), nonfinite=n) for n in ("pass", "nan")
    )
    assert np.asarray(quantize(bad, pass_)[1]).ravel().tolist() == [1.0, 127.0]
    assert np.isnan(np.asarray(quantize(bad, nan_)[1])[0, 0])
    # FP8 operands: a non-finite tensor passes unscaled, inf reaching the codes.
    q, s = jaxamp.quant.fp8_quantize(bad, jnp.float8_e5m2)
    assert float(s) == 1.0 and np.isinf(np.asarray(q, F32)[0, 3])
    # A stored step of a zero group: 1 ("pass") or 0 as computed ("nan").
    zero = jnp.zeros((1, 64))
    for nonfinite, want in (("pass", 1.0), ("nan", 0.0)):
        step = Recipe(
            format="int8", group=FlatBlocks(32), scale_form="step", nonfinite=nonfinite
        )
        assert np.asarray(quantize(zero, step)[1]).tolist() == [want, want]


def test_stochastic_rounding_is_for_integer_formats_and_unbiased():
    with pytest.raises(ValueError, match="stochastic"):
        Recipe(format="float8_e4m3fn", rounding="stochastic")
    with pytest.raises(ValueError, match="power_of_two"):
        Recipe(format="int8", scale_form="step", power_of_two=True)
    with pytest.raises(TypeError, match="PerTensor"):
        Recipe(format="int8", group=(1,))
    with pytest.raises(ValueError, match="rounding"):
        Recipe(format="int8", rounding="floor")
    # 0.3 of a step: stochastic codes average 0.3 over many elements (std of
    # the mean 1.8e-3); nearest rounds them all to 0.
    x = jnp.r_[jnp.ones(1), jnp.full(2**16 - 1, 0.3 / 127)]
    recipe = Recipe(format="int8", rounding="stochastic", seed=7)
    q, _ = quantize(x, recipe)
    assert abs(float(jnp.mean(q[1:].astype(F32))) - 0.3) < 0.01
    assert float(jnp.max(quantize(x, Recipe(format="int8"))[0][1:])) == 0


def _lowbias32(h: int) -> int:  # Wellons' reference, in Python integers
    m = 0xFFFFFFFF
    h ^= h >> 16
    h = (h * 0x7FEB352D) & m
    h ^= h >> 15
    h = (h * 0x846CA68B) & m
    return h ^ (h >> 16)


def test_one_hash_for_all_noise():
    h = np.asarray(jax.random.bits(K[5], (64,), jnp.uint32))
    got = np.asarray(_codec.mix32(jnp.asarray(h)))
    assert got.tolist() == [_lowbias32(int(v)) for v in h]
    assert np.asarray(_codec.flat_index((3, 4), 5)).ravel().tolist() == list(
        range(5, 17)
    )
    # The optimizer's noise and the int8 noise are built from it.
    from jaxamp._training import _rounding

    assert _rounding.noise_bits((4, 4), 1, jnp.int32(2), 3).dtype == jnp.uint32
    assert jaxamp.quant.int8_quantize.__module__ == "jaxamp._quant._int8"
    assert _rounding.DYNAMIC8.kind == "codes" and _rounding.DYNAMIC8.bound == 1.0
