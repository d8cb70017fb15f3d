"""The value-facts analysis (jaxamp/_values/_facts.py) and the default rules that
read it:
range safety for float16, the float32 loss chain, float32 logits of a softmax,
mixed-dtype primitives, linear algebra and per-carry scan decisions.

Inputs are pre-rounded to the compute dtype, so a tolerance measures the
transform's error only. Activations reach the thousands (|x - mean| up to 3e4):
where float16 squares overflow.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import rel_l2

import jaxamp
from jaxamp import _amp
from jaxamp._base import _state
from jaxamp._rewrites import _rmsnorm
from jaxamp._values import _facts
from jaxamp._walk import _scan_hoist

F32, BF16, F16 = jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)


def rounded(x, dtype):
    return jnp.asarray(x, jnp.float32).astype(dtype).astype(jnp.float32)


def eqn_dtypes(closed, name):
    return [
        (tuple(v.aval.dtype for v in e.invars), tuple(v.aval.dtype for v in e.outvars))
        for e, _ in jaxamp.tools.iter_equations(closed)
        if e.primitive.name == name
    ]


# ---------------------------------------------------------------- the analysis


def test_tail_and_wide_bits():
    def f(w, x):
        h = x @ w  # feeds a softmax and another matmul
        p = jax.nn.softmax(h / 2.0)
        return -jnp.log((p @ w.T).sum(-1)).mean()

    closed = jax.make_jaxpr(f)(jnp.ones((4, 4)), jnp.ones((2, 4)))
    facts = _facts.analyse(closed.jaxpr, (0,)).eqns
    names = [e.primitive.name for e in closed.jaxpr.eqns]
    dots = [k for k, n in enumerate(names) if n == "dot_general"]
    assert facts[dots[0]].wide and not facts[dots[0]].tail
    assert facts[dots[1]].tail and not facts[dots[1]].wide
    # Everything after the last matmul is the loss chain.
    assert all(facts[k].tail for k in range(dots[1] + 1, len(names)))
    # Unknown uses (None): nothing is tail.
    assert not any(f.tail for f in _facts.analyse(closed.jaxpr, None).eqns)


def test_quadratic_sees_through_casts_and_negation():
    def f(x, y):
        a = x * x
        b = x.astype(jnp.bfloat16).astype(jnp.float32) * (-x)
        c = x * y
        return a, b, c, x @ x.T

    closed = jax.make_jaxpr(f)(jnp.ones((3, 3)), jnp.ones((3, 3)))
    facts = _facts.analyse(closed.jaxpr, (0, 0, 0, 0)).eqns
    quad = {
        (e.primitive.name, f.quadratic)
        for e, f in zip(closed.jaxpr.eqns, facts)
        if e.primitive.name in ("mul", "dot_general")
    }
    muls = [
        f.quadratic
        for e, f in zip(closed.jaxpr.eqns, facts)
        if e.primitive.name == "mul"
    ]
    assert muls == [True, True, False]
    assert ("dot_general", True) in quad


# ---------------------------------------------------- range safety for float16

SCALE = 3e4  # |x - mean| up to 3e4: squares up to 9e8, far beyond float16's 65504


def _inputs(d=32):
    k = np.random.RandomState(0)
    x = rounded(k.randn(8, d), F16)
    w_in = rounded(np.eye(d) * SCALE / 4, F16)  # h = x @ w_in: |h| up to ~3e4
    w_out = rounded(k.randn(d, 4) / np.sqrt(d), F16)
    return w_in, w_out, x


def _layer_norm(h):
    mean = h.mean(-1, keepdims=True)
    var = jnp.square(h - mean).mean(-1, keepdims=True)
    return (h - mean) * jax.lax.rsqrt(var + 1e-5)


def _rms_norm(h):
    return h * jax.lax.rsqrt((h * h).mean(-1, keepdims=True) + 1e-5)


def _by_max(s):
    return s / jnp.max(s)


def _flax_layer_norm(d):
    from flax import nnx

    ln = nnx.LayerNorm(d, rngs=nnx.Rngs(0))
    return lambda h: ln(h)


NORMALISED = {
    "square": lambda h: _by_max(jnp.square(h)),
    "x*x": lambda h: _by_max(h * h),
    "x**2": lambda h: _by_max(h**2),
    "var": lambda h: h / jnp.var(h, -1, keepdims=True),
    "std": lambda h: h / jnp.std(h, -1, keepdims=True),
    "norm": lambda h: h / jnp.linalg.norm(h, axis=-1, keepdims=True),
    "layer_norm": _layer_norm,
    "rms_norm": _rms_norm,
    "eqx.nn.LayerNorm": jax.vmap(eqx.nn.LayerNorm(32)),
    "nnx.LayerNorm": "flax",
}


@pytest.mark.parametrize("name", sorted(NORMALISED))
def test_float16_squares_norms_and_statistics_match_float32(name):
    op = NORMALISED[name]
    if op == "flax":
        pytest.importorskip("flax", reason="flax is in the [dev] extra")
        op = _flax_layer_norm(32)

    def loss(w_in, w_out, x):
        # op(h) feeds a matmul: the range rule decides, not the loss chain's.
        return (op(x @ w_in) @ w_out).sum() * 0.25  # cotangent x activation < 65504

    args = _inputs()
    h = args[2] @ args[0]
    assert float(jnp.abs(h - h.mean(-1, keepdims=True)).max()) > 1e4
    amp_loss = jaxamp.amp(loss, compute_dtype=jnp.float16)
    np.testing.assert_allclose(amp_loss(*args), loss(*args), rtol=1e-2)
    g = jax.grad(amp_loss, argnums=(0, 1))(*args)
    g_ref = jax.grad(loss, argnums=(0, 1))(*args)
    assert all(np.isfinite(a).all() for a in g)
    assert rel_l2(g, g_ref) < 1e-2
    # Every square of the forward and backward pass runs in float32.
    closed = jax.make_jaxpr(jax.grad(amp_loss))(*args)
    for e, _ in jaxamp.tools.iter_equations(closed):
        if e.primitive.name == "square" or (
            e.primitive.name == "integer_pow" and abs(e.params["y"]) >= 2
        ):
            assert e.invars[0].aval.dtype == F32, e


def test_without_the_range_rule_float16_collapses_silently():
    """The check above can fail: with ``square`` forced to float16 the LayerNorm
    returns exact zeros, with no inf or NaN (the GPU run's collapse)."""
    bad = {**jaxamp.default_amp_policy, "square": jaxamp.use_compute_precision}
    f = jaxamp.amp(
        lambda w, x: _layer_norm(x @ w),
        compute_dtype=jnp.float16,
        amp_policy=bad,
        overflow_check=False,
    )
    w_in, _, x = _inputs()
    out = f(w_in, x)
    assert np.isfinite(out).all() and float(jnp.abs(out).max()) == 0.0


def test_bfloat16_statistics_in_float32_other_squares_follow():
    def f(w, x):
        h = x @ w
        gelu_cube = h**3  # an activation: bfloat16 has the range
        return (_layer_norm(h) @ w + gelu_cube @ w).sum()

    w, _, x = _inputs()
    closed = jax.make_jaxpr(jaxamp.amp(f, compute_dtype=jnp.bfloat16))(w, x)
    assert eqn_dtypes(closed, "square") == [((F32,), (F32,))]
    assert eqn_dtypes(closed, "integer_pow") == [((BF16,), (BF16,))]


LAYER_NORMS = {
    "hand-written": lambda h: _layer_norm(h) * jnp.linspace(0.5, 1.5, 32),
    "eqx.nn.LayerNorm": jax.vmap(eqx.nn.LayerNorm(32)),
    "nnx.LayerNorm": "flax",
}


@pytest.mark.parametrize("name", sorted(LAYER_NORMS))
def test_layer_norm_centring_float32_gain_bfloat16(name):
    """LayerNorm as a careful hand-written bf16 model computes it: ``x - mean``
    and the normalisation in float32, the gain (and bias) in bfloat16, one
    rounding between them."""
    op = LAYER_NORMS[name]
    if op == "flax":
        pytest.importorskip("flax", reason="flax is in the [dev] extra")
        op = _flax_layer_norm(32)

    def f(w, x):
        return (op(x @ w) @ w).sum()

    w, _, x = _inputs()
    closed = jax.make_jaxpr(jaxamp.amp(f, compute_dtype=jnp.bfloat16))(w, x)
    full = [
        (e.primitive.name, e.outvars[0].aval.dtype)
        for e, _ in jaxamp.tools.iter_equations(closed)
        if e.primitive.name in ("sub", "mul", "add")
        and e.outvars[0].aval.shape[-1:] == (32,)
        and e.outvars[0].aval.ndim >= 1
        and e.outvars[0].aval.size == x.size
    ]
    subs = [d for n, d in full if n == "sub"]
    assert subs and all(d == F32 for d in subs), full  # x - mean(x)
    # The normalisation in float32, what reads it (gain, or flax's bias after a
    # gain folded into rsqrt(var)) in bfloat16.
    assert F32 in [d for n, d in full if n == "mul"], full
    assert BF16 in [d for n, d in full if n in ("mul", "add")], full
    dots = eqn_dtypes(closed, "dot_general")
    assert all(ins == (BF16, BF16) for ins, _ in dots), dots


def test_layer_norm_of_offset_activations_matches_float32():
    """Activations with a common offset (mean ~1000, deviations ~16): in
    bfloat16, ``x - mean`` rounds the mean to bfloat16's spacing of 8 there; in
    float32 the centring is exact on bfloat16 inputs."""
    k = np.random.RandomState(1)
    x = rounded(1000.0 + 16.0 * k.randn(64, 128), BF16)
    eye = jnp.eye(128)  # h = x @ eye is x, exactly, in bfloat16
    w = rounded(k.randn(128, 16) / np.sqrt(128), BF16)
    ln = jax.vmap(eqx.nn.LayerNorm(128))

    def f(x, w):
        return ln(x @ eye) @ w

    ref = f(x, w)
    out = jaxamp.amp(f, compute_dtype=jnp.bfloat16)(x, w)
    assert rel_l2(out, ref) < 1e-2
    # The check can fail: with the centring in bfloat16 the error is larger.
    low_sub = {**jaxamp.default_amp_policy, "sub": jaxamp.use_compute_precision}
    bad = jaxamp.amp(f, compute_dtype=jnp.bfloat16, amp_policy=low_sub)(x, w)
    assert rel_l2(bad, ref) > 3 * rel_l2(out, ref)
    g = jax.grad(lambda x: jaxamp.amp(f, compute_dtype=jnp.bfloat16)(x, w).sum())(x)
    g_ref = jax.grad(lambda x: f(x, w).sum())(x)
    assert rel_l2(g, g_ref) < 3e-2


def test_subtracting_another_value_is_no_centring():
    def f(w, x, y):
        return ((x @ w - y.mean(-1, keepdims=True)) @ w).sum()

    w, _, x = _inputs()
    closed = jax.make_jaxpr(jaxamp.amp(f, compute_dtype=jnp.bfloat16))(w, x, x + 1)
    assert [o for _, (o,) in eqn_dtypes(closed, "sub")] == [BF16]


def test_widened_squares_save_no_float32_copy():
    """The float32 cast of a low-precision input to a square is recomputed in
    the backward pass, not saved: LayerNorm saves the same bytes as with the
    square in the compute dtype."""

    def f(w, x):
        return (_layer_norm(x @ w) @ w).sum()

    w, _, x = _inputs()
    unsafe = {
        **jaxamp.default_amp_policy,
        "square": jaxamp.rules.follow_compute_precision,
    }
    safe_bytes = jaxamp.saved_residual_bytes(
        jaxamp.amp(f, compute_dtype=jnp.bfloat16), w, x
    )
    low_bytes = jaxamp.saved_residual_bytes(
        jaxamp.amp(f, compute_dtype=jnp.bfloat16, amp_policy=unsafe), w, x
    )
    assert safe_bytes <= low_bytes


def test_squares_have_their_own_checkpoint_outside_a_users_only():
    """Outside a user's ``jax.checkpoint`` a square of a low-precision value runs
    in a checkpoint of its own: the backward pass recomputes it from its input
    instead of saving a second activation-sized residual (GELU's ``x**3``).
    Inside one, residuals are recomputed anyway, and the extra checkpoint would
    only keep XLA from fusing the backward pass (2 ms a step on the H100)."""

    def layer(h, w):
        return jax.nn.gelu(h @ w) @ w

    def plain(w, x):
        return layer(x @ w, w).sum()

    def checkpointed(w, x):
        return jax.checkpoint(layer)(x @ w, w).sum()

    def square_checkpoints(fn):
        closed = jax.make_jaxpr(jaxamp.amp(fn, compute_dtype=jnp.bfloat16))(*args)
        return sum(
            [e.primitive.name for e in r.params["jaxpr"].eqns] == ["integer_pow"]
            for r, _ in jaxamp.tools.iter_equations(closed)
            if r.primitive.name == "remat2"
        )

    args = _inputs()[::2]
    assert square_checkpoints(plain) == 1
    assert square_checkpoints(checkpointed) == 0
    by_hand = lambda w, x: plain(w.astype(BF16), x.astype(BF16))  # noqa: E731
    amp_bytes = jaxamp.saved_residual_bytes(
        jaxamp.amp(plain, compute_dtype=jnp.bfloat16), *args
    )
    assert amp_bytes < jaxamp.saved_residual_bytes(by_hand, *args)


# ------------------------------------------------------------------ RMSNorm


def _flax_rms_norm(d):
    from flax import nnx

    norm = nnx.RMSNorm(d, rngs=nnx.Rngs(0))
    return lambda h: norm(h)


RMS_GAIN = jnp.linspace(0.5, 1.5, 32)
RMS_NORMS = {
    "x*x": lambda h: _rms_norm(h) * RMS_GAIN,
    "square": lambda h: h * jax.lax.rsqrt(jnp.square(h).mean(-1, keepdims=True) + 1e-6),
    "x**2, eps clamp": lambda h: (
        h / jnp.maximum(jnp.sqrt((h**2).mean(-1, keepdims=True)), 1e-6)
    ),
    "eqx.nn.RMSNorm": jax.vmap(eqx.nn.RMSNorm(32)),
    "nnx.RMSNorm": "flax",
}


def _rms_op(name):
    op = RMS_NORMS[name]
    if op == "flax":
        pytest.importorskip("flax", reason="flax is in the [dev] extra")
        op = _flax_rms_norm(32)
    return op


def _facts_of(f, *args):
    closed = jax.make_jaxpr(f)(*args)
    facts = _facts.analyse(closed.jaxpr, (0,) * len(closed.jaxpr.outvars)).eqns
    return list(zip(closed.jaxpr.eqns, facts))


@pytest.mark.parametrize("name", sorted(RMS_NORMS))
def test_rms_scaling_and_its_operands_are_found(name):
    """One equation scales ``h`` by the inverse root of its own mean square; the
    square of that statistic (and Flax's ``h - 0``) is marked too: it shares
    the float32 copy of ``h``."""
    op = _rms_op(name)
    pairs = _facts_of(lambda h: op(h).sum(), jnp.ones((8, 32)))
    scaling = [
        (e.primitive.name, e.outvars[0].aval.shape) for e, f in pairs if f.rms_scaling
    ]
    assert [shape for _, shape in scaling] == [(8, 32)], scaling
    assert scaling[0][0] in ("mul", "div")
    operands = sorted(e.primitive.name for e, f in pairs if f.rms_operand)
    if name == "nnx.RMSNorm":  # x - 0 (Flax's zero mean), then the square
        assert operands == ["square", "sub"], operands
    else:
        assert len(operands) == 1, operands
        assert operands[0] in ("mul", "square", "integer_pow"), operands


RMS_NEAR_MISSES = {
    "another value's norm": lambda h, y: (
        h * jax.lax.rsqrt((y * y).mean(-1, keepdims=True))
    ),
    "no inverse root": lambda h, y: h * jnp.sqrt((h * h).mean(-1, keepdims=True)),
    "no square": lambda h, y: h * jax.lax.rsqrt(jnp.abs(h).mean(-1, keepdims=True)),
    "no root": lambda h, y: h / (h * h).mean(-1, keepdims=True),
    "root in the numerator": lambda h, y: jnp.sqrt((h * h).mean(-1, keepdims=True)) / h,
}


@pytest.mark.parametrize("name", sorted(RMS_NEAR_MISSES))
def test_rms_near_misses_are_no_rms_scaling(name):
    op = RMS_NEAR_MISSES[name]
    pairs = _facts_of(lambda h, y: op(h, y).sum(), jnp.ones((8, 32)), jnp.ones((8, 32)))
    assert not [e for e, f in pairs if f.rms_scaling or f.rms_operand]


@pytest.mark.parametrize("name", sorted(RMS_NORMS))
def test_rms_norm_scaling_float32_readers_bfloat16(name):
    """RMSNorm of a bfloat16 matmul output (QK-norm, a post-norm) as LLaMA's
    reference code and a careful hand-written model compute it: the scaling in
    float32, what reads it (the gain, the next matmul) in bfloat16."""
    op = _rms_op(name)

    def f(w, x):
        return jnp.tanh(op(x @ w) @ w).sum()

    w, _, x = _inputs()

    def scalings(amp=jaxamp.amp):
        closed = jax.make_jaxpr(amp(f, compute_dtype=jnp.bfloat16))(w, x)
        full = [
            (e.primitive.name, e.outvars[0].aval.dtype)
            for e, _ in jaxamp.tools.iter_equations(closed)
            if e.primitive.name in ("mul", "div") and e.outvars[0].aval.shape == x.shape
        ]
        dots = eqn_dtypes(closed, "dot_general")
        assert all(ins == (BF16, BF16) for ins, _ in dots), dots
        return full

    full = scalings()
    if name in ("x*x", "eqx.nn.RMSNorm"):  # the gain reads the normalised value
        assert full[-1] == ("mul", BF16), full
    # The check can fail: without the fact the scaling follows its bfloat16 input.
    low = scalings(_amp.ablated(facts=["rms_scaling"]))
    assert [d for _, d in full].count(F32) == [d for _, d in low].count(F32) + 1, (
        full,
        low,
    )


def _rms_model_inputs(seed=0, d=256):
    """A bfloat16 matmul output in the hundreds, RMS-normalised, a gain, a
    second matmul and a float32 loss: weights and inputs pre-rounded."""
    k = np.random.RandomState(seed)
    x = rounded(300 * k.randn(64, d), BF16)
    w1 = rounded(k.randn(d, d) / 16, BF16)
    w2 = rounded(k.randn(d, d) / 16, BF16)
    g = rounded(1 + 0.1 * k.randn(d), BF16)
    t = rounded(k.randn(64, d), BF16)
    return (w1, w2, g), x, t


def _rms_loss(p, x, t):
    w1, w2, g = p
    h = x @ w1
    n = h * jax.lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + 1e-6) * g
    return jnp.mean((n @ w2 - t) ** 2)


def _hand_rms_loss(p, x, t):
    """The careful hand-written bfloat16 model: bfloat16 matmuls, the statistic
    and the scaling in float32, one rounding, the gain in bfloat16."""
    w1, w2, g = p
    hf = (x.astype(BF16) @ w1.astype(BF16)).astype(jnp.float32)
    n = hf * jax.lax.rsqrt(jnp.mean(hf * hf, -1, keepdims=True) + 1e-6)
    n = n.astype(BF16) * g.astype(BF16)
    out = jnp.matmul(n, w2.astype(BF16), preferred_element_type=jnp.float32)
    return jnp.mean((out - t) ** 2)


def test_rms_norm_gradients_as_accurate_as_hand_written():
    """Gradients against float32 (``precision="highest"``): amp's error on the
    weight before the RMSNorm is within 10% of the hand-written model's
    (measured 4.6e-3 vs 4.3e-3; the rest is the cotangent of the last matmul,
    rounded to bfloat16 for a bfloat16 backward matmul); with the scaling in
    bfloat16, as "follow" ran it before, 1.5x the hand-written error."""
    p, x, t = _rms_model_inputs()
    with jax.default_matmul_precision("highest"):
        ref = jax.grad(_rms_loss)(p, x, t)
        hand = jax.grad(_hand_rms_loss)(p, x, t)
        amp = jax.grad(jaxamp.amp(_rms_loss, compute_dtype=BF16))(p, x, t)
        hand_err = rel_l2(hand[0], ref[0])
        assert all(a.dtype == F32 and np.isfinite(a).all() for a in amp)
        assert rel_l2(amp[0], ref[0]) < 1.1 * hand_err
        assert rel_l2(amp[1], ref[1]) < 1.2 * rel_l2(hand[1], ref[1])
        # The check can fail: without the fact the scaling runs in bfloat16.
        rule_off = _amp.ablated(facts=["rms_scaling"])
        low = jax.grad(rule_off(_rms_loss, compute_dtype=BF16))(p, x, t)
    assert rel_l2(low[0], ref[0]) > 1.3 * hand_err


@pytest.mark.parametrize("name", sorted(RMS_NORMS))
def test_rms_norm_casts_its_input_to_float32_once(name):
    """Scaling, square (and Flax's ``h - 0``) read one float32 copy of the
    bfloat16 ``h``: in the backward pass their cotangents meet in float32 and
    are rounded to bfloat16 once."""
    op = _rms_op(name)

    def f(w, x):
        return jnp.tanh(op(x @ w) @ w).sum()

    w, _, x = _inputs()
    closed = jax.make_jaxpr(jaxamp.amp(f, compute_dtype=jnp.bfloat16))(w, x)
    widened = [
        e
        for e, _ in jaxamp.tools.iter_equations(closed)
        if e.primitive.name == "convert_element_type"
        and e.invars[0].aval.dtype == BF16
        and e.outvars[0].aval.dtype == F32
        and e.outvars[0].aval.shape == x.shape
    ]
    assert len(widened) == 1, widened


def test_rms_norm_saves_its_bfloat16_input_not_a_float32_copy():
    """The square, statistic and scaling run in one ``jax.checkpoint``: the
    backward pass saves the bfloat16 ``h`` and recomputes the float32
    normalisation (the two cotangents of ``h`` still meet in float32 inside
    it). Besides ``h`` only the normalised value's bfloat16 copy (the next
    matmul's input) is an activation-sized residual."""

    def f(w, x):
        h = x @ w
        n = h * jax.lax.rsqrt(jnp.square(h).mean(-1, keepdims=True) + 1e-6)
        return jnp.tanh(n @ w[:, :8]).sum()

    w, x = rounded(np.eye(32) * 300, BF16), rounded(np.ones((8, 32)), BF16)

    def copies(amp=jaxamp.amp):
        from jaxamp import _compat

        amp_f = amp(f, compute_dtype=BF16)
        return sorted(
            a.dtype.name
            for a, src in _compat.saved_residuals(amp_f, w, x)
            if a.shape == x.shape and not src.startswith("from the argument")
        )

    assert copies() == ["bfloat16", "bfloat16"]
    # The check can fail: without the region the scaling saves a float32 copy
    # of h (shared with the square, whose 2 * h is recomputed).
    no_region = _amp.ablated(rewrites=["rms_norm"])
    assert copies(no_region) == ["bfloat16", "float32"]
    # ... and without the square's own checkpoint its 2 * h is a second one
    # (as if inside a user's jax.checkpoint, where neither applies).
    with _state.recomputing():
        assert copies(no_region) == ["bfloat16", "float32", "float32"]


def test_rms_norm_region_only_where_its_values_have_no_other_reader():
    """A statistic read elsewhere too (``ms`` returned beside the output) keeps
    the equations in place: no region, the same gradients."""

    def f(w, x):
        h = x @ w
        ms = jnp.mean(h * h, -1, keepdims=True)
        return (h * jax.lax.rsqrt(ms + 1e-6)) @ w, ms

    w, _, x = _inputs()
    closed = jax.make_jaxpr(f)(w, x)
    facts = _facts.analyse(closed.jaxpr, (0, 0)).eqns
    assert [f.rms_scaling for f in facts].count(True) == 1
    assert _rmsnorm.region_indices(closed.jaxpr, facts) == []
    g = jax.grad(lambda w: jaxamp.amp(f, compute_dtype=BF16)(w, x)[0].sum())(w)
    g_ref = jax.grad(lambda w: f(w, x)[0].sum())(w)
    assert g.dtype == F32 and rel_l2(g, g_ref) < 2e-2
    # Without the second reader the region is found.
    closed = jax.make_jaxpr(lambda w, x: f(w, x)[0])(w, x)
    facts = _facts.analyse(closed.jaxpr, (0,)).eqns
    (region,) = _rmsnorm.region_indices(closed.jaxpr, facts)
    (k,) = [j for j, f in enumerate(facts) if f.rms_scaling]
    assert region[-1] == k
    assert list(region[:-1]) == sorted(region[:-1]) and len(region) > 2


# --------------------------------------------------------- the loss chain


def test_cross_entropy_after_the_last_matmul_is_float32():
    """256 x 8192 logits: amp's loss is within 2x the error of "bfloat16 logits,
    float32 loss" (a hand-written model); follow-everything was 60x."""
    k = np.random.RandomState(1)
    h = rounded(k.randn(256, 64), BF16)
    w = rounded(k.randn(64, 8192) / 8.0, BF16)
    labels = jnp.asarray(k.randint(0, 8192, 256))

    def loss(w, h):
        logits = h @ w
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    def by_hand(w, h):
        logits = (h.astype(BF16) @ w.astype(BF16)).astype(F32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    ref = float(jax.jit(loss)(w, h))
    hand_err = abs(float(jax.jit(by_hand)(w, h)) - ref) / ref
    amp_err = (
        abs(float(jax.jit(jaxamp.amp(loss, compute_dtype=BF16))(w, h)) - ref) / ref
    )
    assert amp_err <= 2 * max(hand_err, 1e-7), (amp_err, hand_err)
    closed = jax.make_jaxpr(jaxamp.amp(loss, compute_dtype=BF16))(w, h)
    (dot,) = eqn_dtypes(closed, "dot_general")
    assert dot == ((BF16, BF16), (F32,))  # bfloat16 product, float32 logits
    for name in ("sub", "exp", "log", "reduce_max"):
        assert all(o == (F32,) for _, o in eqn_dtypes(closed, name)), name
    # The backward matmuls run in bfloat16 (the cotangent is narrowed once).
    g_closed = jax.make_jaxpr(jax.grad(jaxamp.amp(loss, compute_dtype=BF16)))(w, h)
    assert all(i == (BF16, BF16) for i, _ in eqn_dtypes(g_closed, "dot_general"))


def test_attention_logits_stay_float32():
    k = np.random.RandomState(2)
    q, kk, v = (rounded(k.randn(2, 16, 4, 8), BF16) for _ in range(3))
    wq = rounded(k.randn(8, 8) / 3, BF16)

    def f(wq, q, k, v):
        out = jax.nn.dot_product_attention(q @ wq, k, v, implementation="xla")
        return (out @ wq).sum()

    closed = jax.make_jaxpr(jaxamp.amp(f, compute_dtype=BF16))(wq, q, kk, v)
    dots = eqn_dtypes(closed, "dot_general")
    # q @ wq and the probabilities @ v stay bfloat16; q.k logits are float32.
    assert ((BF16, BF16), (F32,)) in dots
    assert ((BF16, BF16), (BF16,)) in dots
    g = jax.grad(jaxamp.amp(f, compute_dtype=BF16), argnums=(0, 1, 2, 3))(wq, q, kk, v)
    g_ref = jax.grad(f, argnums=(0, 1, 2, 3))(wq, q, kk, v)
    assert rel_l2(g, g_ref) < 2e-2


# ------------------------------------------------------ mixed-dtype primitives


def _mixed_primitive():
    prim = jax.extend.core.Primitive("jaxamp_test_mixed")

    def abstract(x, s):
        if x.dtype != BF16 or s.dtype != F32:
            raise TypeError(f"mixed takes (bf16, f32), got ({x.dtype}, {s.dtype})")
        return jax.core.ShapedArray(x.shape, F32)

    prim.def_abstract_eval(abstract)
    prim.def_impl(lambda x, s: x.astype(F32) * s)
    jax.interpreters.mlir.register_lowering(
        prim, jax.interpreters.mlir.lower_fun(lambda x, s: x.astype(F32) * s, False)
    )
    return prim


MIXED = _mixed_primitive()


def test_a_primitive_with_a_mixed_signature_keeps_it():
    s = jnp.full((3, 4), 1000.5, F32)  # not representable in bfloat16

    def f(w, x):
        h = (x @ w).astype(BF16)
        return (MIXED.bind(h, s) @ w).sum()

    w, x = jnp.eye(4) / 2, jnp.ones((3, 4))
    amp_f = jaxamp.amp(f, compute_dtype=BF16)
    closed = jax.make_jaxpr(amp_f)(w, x)
    assert eqn_dtypes(closed, "jaxamp_test_mixed") == [((BF16, F32), (F32,))]
    np.testing.assert_allclose(amp_f(w, x), f(w, x), rtol=1e-2)


@jax.custom_vjp
def _scaled(x, s):
    return MIXED.bind(x, s)


def _scaled_fwd(x, s):
    return MIXED.bind(x, s), (x, s)


def _scaled_bwd(res, g):
    x, s = res
    # The residuals mix bfloat16 and float32 (cuDNN attention's do the same).
    gx = MIXED.bind(g.astype(BF16), s).astype(BF16)
    return gx, (g * x.astype(F32))


_scaled.defvjp(_scaled_fwd, _scaled_bwd)


def test_checkpointed_custom_vjp_with_mixed_residuals_same_gradients():
    s = jnp.full((3, 4), 1000.5, F32)

    def f(w, x):
        layer = jax.checkpoint(lambda w: _scaled((x @ w).astype(BF16), s))
        return (layer(w) @ w).sum()

    w, x = rounded(jnp.eye(4) / 2, BF16), jnp.ones((3, 4))
    g = jax.grad(jaxamp.amp(f, compute_dtype=BF16))(w, x)
    g_ref = jax.grad(f)(w, x)
    assert np.isfinite(g).all()
    np.testing.assert_allclose(g, g_ref, rtol=1e-2)


# ----------------------------------------------- linear algebra and scan carries


def test_multivariate_normal_head_runs_in_float32():
    k = np.random.RandomState(3)
    x = rounded(k.randn(16, 8), BF16)
    w = rounded(k.randn(8, 4) / 3, BF16)
    a = rounded(k.randn(4, 4) / 2, BF16)
    y = rounded(k.randn(16, 4), BF16)

    def nll(w, a, x, y):
        mean = x @ w
        cov = a @ a.T + jnp.eye(4)
        return -jax.scipy.stats.multivariate_normal.logpdf(y, mean, cov).mean()

    amp_nll = jaxamp.amp(nll, compute_dtype=BF16)
    np.testing.assert_allclose(amp_nll(w, a, x, y), nll(w, a, x, y), rtol=1e-2)
    g = jax.grad(amp_nll, argnums=(0, 1))(w, a, x, y)
    assert rel_l2(g, jax.grad(nll, argnums=(0, 1))(w, a, x, y)) < 2e-2
    closed = jax.make_jaxpr(amp_nll)(w, a, x, y)
    assert eqn_dtypes(closed, "cholesky") == [((F32,), (F32,))]


def test_ctc_loss_gradients_under_bfloat16():
    k = np.random.RandomState(4)
    b, t, d, n_labels = 4, 24, 16, 6
    x = rounded(k.randn(b, t, d), BF16)
    w = rounded(k.randn(d, n_labels + 1) / 2, BF16)
    labels = jnp.asarray(k.randint(1, n_labels + 1, (b, 8)))
    pad_in, pad_lab = jnp.zeros((b, t)), jnp.zeros((b, 8))

    def loss(w, x):
        return optax.ctc_loss(x @ w, pad_in, labels, pad_lab).mean()

    g = jax.grad(jaxamp.amp(loss, compute_dtype=BF16))(w, x)
    assert rel_l2(g, jax.grad(loss)(w, x)) < 5e-2


def _hmm_forward(log_a, log_e):
    def step(alpha, e):
        alpha = jax.nn.logsumexp(alpha[:, None] + log_a, axis=0) + e
        return alpha, None

    return jax.lax.scan(step, log_e[0], log_e[1:])[0]


def test_log_space_carry_is_not_narrowed_residual_stream_is():
    """A log-space recursion in the middle of a model keeps float32 carries;
    a residual stream of matmul layers is narrowed to bfloat16."""

    def f(w, x):
        log_e = jax.nn.log_softmax(x @ w)  # (T, S): emission log-probabilities
        alpha = _hmm_forward(jnp.log(jnp.full((4, 4), 0.25)), log_e)
        h, _ = jax.lax.scan(lambda h, _: (h + jnp.tanh(h @ w), None), x, None, 3)
        return ((alpha @ w.T) + h.sum()).sum()  # alpha feeds a matmul

    w, x = jnp.eye(4) / 2, jnp.ones((6, 4))
    closed = jax.make_jaxpr(jaxamp.amp(f, compute_dtype=BF16))(w, x)
    scans = [
        e for e, _ in jaxamp.tools.iter_equations(closed) if e.primitive.name == "scan"
    ]
    assert [s.outvars[0].aval.dtype for s in scans] == [F32, BF16]


# --- loop inputs: narrowed_inputs / recomputed_inputs ---

_BF16, _F32, _F16 = np.dtype(jnp.bfloat16), np.dtype(jnp.float32), np.dtype(jnp.float16)
_V = jnp.ones((4, 4), jnp.float32)


def test_narrowed_inputs_sees_through_jit_and_checkpoint():
    def f(a, b, c, d, e, g):
        bf = lambda x: x.astype(jnp.bfloat16)
        inner = jax.checkpoint(lambda x: bf(x) @ bf(x))  # a: only inside remat
        return (
            inner(a),
            jax.jit(lambda x: bf(x) * 2)(b),  # b: only inside jit
            bf(c) + c.astype(jnp.float16).astype(jnp.bfloat16),  # c: two dtypes
            bf(d) + jnp.sum(d).astype(jnp.bfloat16),  # d: also read in float32
            e,  # e: an output
            g * 2,  # g: read in float32 only
        )

    closed = jax.make_jaxpr(f)(*[_V] * 6)
    assert _scan_hoist.narrowed_inputs(closed) == (_BF16, _BF16, None, None, None, None)


def test_narrowed_inputs_ignores_unused_and_non_float_inputs():
    closed = jax.make_jaxpr(
        lambda a, i, w: (i.astype(jnp.int8), w.astype(jnp.float16))
    )(_V, jnp.ones(3, jnp.int32), _V)
    assert _scan_hoist.narrowed_inputs(closed) == (None, None, _F16)


def test_recomputed_inputs_only_inside_a_checkpoint():
    def f(a, b, c, d):
        layer = jax.checkpoint(lambda x, y: jnp.tanh(x @ y))
        return layer(a, b) + jax.jit(layer)(a, c) + c * 2, jnp.zeros(())

    closed = jax.make_jaxpr(f)(*[_V] * 4)
    # a, b: used inside checkpoints only (also through a jit); c: also outside
    # one; d: unused.
    assert _scan_hoist.recomputed_inputs(closed) == (True, True, False, False)


def test_transposed_products_are_found_through_casts_and_calls():
    """``TRANSPOSED``: a product read by a ``transpose`` (directly, through a
    cast, or as the output of a ``jit``) is marked; one read by other ops is
    not. amp puts an ``optimization_barrier`` only on those on XLA:CPU."""
    w, x = jnp.ones((10, 64)), jnp.ones((16, 64))
    direct = lambda w, x: jnp.tanh((w @ x.T).T)
    cast = lambda w, x: (w @ x.T).astype(jnp.bfloat16).T
    called = lambda w, x: jax.jit(lambda a, b: a @ b.T)(w, x).T
    plain = lambda w, x: jnp.tanh(w @ x.T)
    for f, expected in ((direct, True), (cast, True), (plain, False)):
        facts = [
            ef for e, ef in _facts_of(f, w, x) if e.primitive.name == "dot_general"
        ]
        assert [ef.transposed for ef in facts] == [expected], f
    closed = jax.make_jaxpr(called)(w, x)
    (call,) = [e for e in closed.jaxpr.eqns if e.primitive.name in ("pjit", "jit")]
    outer = _facts.analyse(closed.jaxpr, (0,)).eqns
    (k,) = [i for i, e in enumerate(closed.jaxpr.eqns) if e is call]
    inner_jaxpr = call.params["jaxpr"].jaxpr
    inner = zip(inner_jaxpr.eqns, _facts.analyse(inner_jaxpr, outer[k].out_bits).eqns)
    assert [f.transposed for e, f in inner if e.primitive.name == "dot_general"] == [
        True
    ]


def test_barrier_only_on_transposed_float32_products():
    """On CPU the vmapped head's product gets an ``optimization_barrier``; the
    same head without vmap (no transpose) does not."""
    w = jnp.ones((10, 64)) / 64
    x = jnp.ones((16, 64))

    def barriers(f):
        closed = jax.make_jaxpr(jaxamp.amp(f, compute_dtype=jnp.bfloat16))(w, x)
        names = [e.primitive.name for e, _ in jaxamp.tools.iter_equations(closed)]
        return [n for n in names if n == "optimization_barrier"]

    vmapped = lambda w, x: jax.nn.logsumexp(jax.vmap(lambda r: w @ r)(x), -1).sum()
    plain = lambda w, x: jax.nn.logsumexp(x @ w.T, -1).sum()
    on_cpu = jax.default_backend() == "cpu"
    assert len(barriers(vmapped)) == int(on_cpu)
    assert barriers(plain) == []
