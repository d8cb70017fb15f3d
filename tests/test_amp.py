"""Tests of the public amp() entry point (jaxamp/_amp.py)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxamp

BF16, F16, F32 = np.dtype(jnp.bfloat16), np.dtype(jnp.float16), np.dtype(jnp.float32)

X = jnp.linspace(-1, 1, 12, dtype=jnp.float32).reshape(3, 4)
W = jnp.linspace(-1, 1, 20, dtype=jnp.float32).reshape(4, 5)


def eqns(closed):
    """All equations of a jaxpr and of its sub-jaxprs, depth first."""
    return (e for e, _ in jaxamp.tools.iter_equations(closed))


def dots(closed):
    """Operand dtype of each matmul (the precision it runs in; a matmul that
    feeds no other matmul keeps a float32 result by design)."""
    return [
        e.invars[0].aval.dtype
        for e in eqns(closed)
        if e.primitive.name == "dot_general"
    ]


def mlp(w, x):
    return jax.nn.softmax(jnp.tanh(x @ w)).sum()


def test_call_forms_are_equivalent():
    forms = [
        jaxamp.amp(mlp, compute_dtype=jnp.bfloat16),
        jaxamp.amp(compute_dtype=jnp.bfloat16)(mlp),
        jaxamp.amp(mlp, compute_dtype="bf16"),
    ]
    decorated = jaxamp.amp(mlp)  # jaxamp 0.0.4 default: float16
    ref = [dots(jax.make_jaxpr(f)(W, X)) for f in forms]
    assert ref == [[BF16]] * 3
    assert dots(jax.make_jaxpr(decorated)(W, X)) == [F16]

    @jaxamp.amp
    def g(w, x):
        return x @ w

    assert g(W, X).dtype == F32


def test_outputs_come_back_in_the_traced_dtypes_and_structure():
    def f(params, x, flag):
        h = x @ params["w"]
        return {"h": h, "half": h.astype(jnp.float16), "n": 3, "flag": flag}

    out = jaxamp.amp(f, compute_dtype=jnp.bfloat16)({"w": W}, X, "static")
    assert out["h"].dtype == F32 and out["half"].dtype == F16
    assert out["n"] == 3 and out["flag"] == "static"


def test_equinox_module_in_and_out():
    lin = eqx.nn.Linear(4, 5, key=jax.random.key(0))

    def f(m, x):
        return eqx.tree_at(lambda m: m.bias, m, jax.vmap(m)(x).mean(0))

    out = jaxamp.amp(f, compute_dtype=jnp.bfloat16)(lin, X)
    assert isinstance(out, eqx.nn.Linear)
    assert out.weight.dtype == F32 and out.bias.dtype == F32
    np.testing.assert_allclose(out.bias, f(lin, X).bias, rtol=2e-2, atol=2e-2)


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(TypeError, match="fn must be callable"):
        jaxamp.amp(3)
    with pytest.raises(ValueError, match="compute_dtype must be a floating"):
        jaxamp.amp(mlp, compute_dtype=jnp.int32)
    with pytest.raises(ValueError, match="compute_dtype="):
        jaxamp.amp(mlp, compute_dtype="bf17")
    with pytest.raises(TypeError, match="neither a primitive"):
        jaxamp.amp(mlp, amp_policy={1.5: jaxamp.use_compute_precision})
    with pytest.raises(TypeError, match="overflow_check=...\\): must be True, False"):
        jaxamp.amp(mlp, compute_dtype=jnp.float16, overflow_check="yes")


def test_amp_stop_context_manager_and_decorator():
    @jaxamp.amp_stop
    def stopped(x, w):
        return x @ w

    def f(w, x):
        with jaxamp.amp_stop():
            a = x @ w
        b = stopped(x, w)
        c = jax.jit(lambda: x @ w)()  # scope seen inside the jit body? no: outside
        return a.sum() + b.sum() + c.sum()

    def g(w, x):
        with jaxamp.amp_stop():
            return jax.jit(lambda: x @ w)().sum()  # ...and here, inside it

    assert dots(jax.make_jaxpr(jaxamp.amp(f, compute_dtype=BF16))(W, X)) == [
        F32,
        F32,
        BF16,
    ]
    assert dots(jax.make_jaxpr(jaxamp.amp(g, compute_dtype=BF16))(W, X)) == [F32]


def test_named_scope_policy_inside_scan():
    def f(ws, x):
        def layer(h, w):
            with jax.named_scope("attn"):
                a = h @ w
            with jax.named_scope("mlp"):
                b = a @ w
            return b, None

        return jax.lax.scan(layer, x, ws)[0].sum()

    policy = {**jaxamp.default_amp_policy, "attn": jaxamp.use_original_precision}
    ws = jnp.stack([jnp.eye(4, dtype=jnp.float32)] * 2)
    closed = jax.make_jaxpr(jaxamp.amp(f, compute_dtype=BF16, amp_policy=policy))(ws, X)
    assert dots(closed) == [F32, BF16]


def test_equinox_linear_keyed_policy():
    lin = eqx.nn.Linear(4, 5, key=jax.random.key(0))
    policy = {**jaxamp.default_amp_policy, "eqx.nn.Linear": jaxamp.use_full_precision}
    f = lambda m, x, w: jax.vmap(m)(x).sum() + (x @ w).sum()
    closed = jax.make_jaxpr(jaxamp.amp(f, compute_dtype=BF16, amp_policy=policy))(
        lin, X, W
    )
    assert dots(closed) == [F32, BF16]


def test_custom_rule():
    calls = []

    def exp_in_bf16(compute_dtype, original_dtypes, *invars, **params):
        calls.append(original_dtypes)
        return [x.astype(jnp.bfloat16) for x in invars], params

    policy = {**jaxamp.default_amp_policy, "exp": exp_in_bf16}
    closed = jax.make_jaxpr(
        jaxamp.amp(lambda x: jnp.exp(x).sum(), compute_dtype=F16, amp_policy=policy)
    )(X)
    (exp,) = [e for e in eqns(closed) if e.primitive.name == "exp"]
    assert exp.outvars[0].aval.dtype == BF16
    assert calls == [[F32]]


def test_nested_amp_inner_wins_inside():
    inner = jaxamp.amp(lambda x, w: x @ w, compute_dtype=F16)
    outer = jaxamp.amp(lambda w, x: (inner(x, w) @ w.T).sum(), compute_dtype=BF16)
    closed = jax.make_jaxpr(outer)(W, X)
    assert dots(closed) == [F16, BF16]
    np.testing.assert_allclose(outer(W, X), ((X @ W) @ W.T).sum(), rtol=2e-2, atol=1e-2)


def test_amp_under_jit_and_jit_under_amp():
    f = jaxamp.amp(mlp, compute_dtype=BF16)
    a = jax.jit(f)(W, X)
    b = jaxamp.amp(jax.jit(mlp), compute_dtype=BF16)(W, X)
    c = f(W, X)
    assert a.dtype == b.dtype == F32
    np.testing.assert_allclose(a, c, rtol=1e-6)
    np.testing.assert_allclose(b, c, rtol=1e-6)
    assert dots(jax.make_jaxpr(jaxamp.amp(jax.jit(mlp), compute_dtype=BF16))(W, X)) == [
        BF16
    ]


def test_vmap_with_axis_name_and_vjp():
    def f(x, w):
        h = jnp.tanh(x @ w)
        return h - jax.lax.pmean(h, "batch")

    amp_f = jaxamp.amp(f, compute_dtype=BF16)
    out = jax.vmap(amp_f, in_axes=(0, None), axis_name="batch")(X, W)
    ref = jax.vmap(f, in_axes=(0, None), axis_name="batch")(X, W)
    assert out.dtype == F32
    np.testing.assert_allclose(out, ref, atol=2e-2)
    sq = lambda w, x: jnp.square(jnp.tanh(x @ w)).sum()
    y, vjp = jax.vjp(lambda w: jaxamp.amp(sq, compute_dtype=BF16)(w, X), W)
    (gw,) = vjp(jnp.ones_like(y))
    assert gw.dtype == F32
    ref_g = jax.grad(sq)(W, X)
    assert float(jnp.linalg.norm(gw - ref_g) / jnp.linalg.norm(ref_g)) < 5e-2


def test_user_casts_are_respected():
    def f(w, x):
        h = x @ w
        return jnp.exp(h.astype(jnp.float16)).astype(jnp.float32).sum()

    closed = jax.make_jaxpr(jaxamp.amp(f, compute_dtype=BF16))(W, X)
    (exp,) = [e for e in eqns(closed) if e.primitive.name == "exp"]
    # exp is a float32 op, but the user's float16 cast happens before it.
    assert [v.aval.dtype for v in exp.invars] == [F32]
    convs = [
        e.params["new_dtype"]
        for e in eqns(closed)
        if e.primitive.name == "convert_element_type"
    ]
    assert F16 in convs


def test_force_full_precision():
    from jaxamp.migration._mpx import force_full_precision

    @force_full_precision  # float32 outputs (mpx's: float16)
    def head(x, w):
        return x @ w

    f = lambda w, x: head(x.astype(jnp.bfloat16), w).sum() + (x @ w).sum()
    closed = jax.make_jaxpr(jaxamp.amp(f, compute_dtype=BF16))(W, X)
    assert dots(closed) == [F32, BF16]


def test_float32_compute_dtype_is_the_identity_on_a_jaxpr():
    closed = jax.make_jaxpr(jaxamp.amp(mlp, compute_dtype=F32))(W, X)
    assert not [e for e in eqns(closed) if e.primitive.name == "convert_element_type"]
    np.testing.assert_allclose(jaxamp.amp(mlp, compute_dtype=F32)(W, X), mlp(W, X))


# --- Low-precision arguments: read as they are, widened at their uses


def _scanned_net(params, x):
    """Layers stacked in ``lax.scan``: LayerNorm with a gain, a GELU MLP."""

    def layer(h, p):
        mean = h.mean(-1, keepdims=True)
        var = jnp.square(h - mean).mean(-1, keepdims=True)
        n = (h - mean) * jax.lax.rsqrt(var + 1e-5) * p["gain"]
        return h + jax.nn.gelu(n @ p["w1"]) @ p["w2"], None

    h, _ = jax.lax.scan(layer, x, params["layers"])
    return jnp.mean(jax.nn.logsumexp(h @ params["head"], axis=-1))


def _stacked_params(dtype, layers=3, d=32):
    k = jax.random.split(jax.random.key(3), 4)
    params = {
        "layers": {
            "gain": 1.0 + 0.1 * jax.random.normal(k[0], (layers, d)),
            "w1": jax.random.normal(k[1], (layers, d, 4 * d)) / d**0.5,
            "w2": jax.random.normal(k[2], (layers, 4 * d, d)) / (4 * d) ** 0.5,
        },
        "head": jax.random.normal(k[3], (d, 8)) / d**0.5,
    }
    return jax.tree.map(lambda a: a.astype(dtype), params)


def test_bfloat16_parameters_stay_bfloat16_through_a_scan():
    # A stacked bfloat16 weight enters the loop as it is: no scan of the
    # gradient takes or returns a float32 array of a stacked weight's shape
    # (the float32 copy and the float32 gradient stack amp used to make).
    params = _stacked_params(jnp.bfloat16)
    x = (300.0 * jax.random.normal(jax.random.key(4), (16, 32))).astype(jnp.bfloat16)
    x = x.astype(jnp.float32)  # activations in the hundreds, bf16-exact
    loss = jaxamp.amp(_scanned_net, compute_dtype=jnp.bfloat16)
    grad = jax.grad(loss)
    stacked = {a.shape for a in jax.tree.leaves(params["layers"]) if a.ndim == 3}
    scans = [
        e for e in eqns(jax.make_jaxpr(grad)(params, x)) if e.primitive.name == "scan"
    ]
    assert len(scans) >= 2  # the forward loop and the transposed one
    for e in scans:
        wide = [
            v.aval
            for v in (*e.invars, *e.outvars)
            if v.aval.shape in stacked and v.aval.dtype != BF16
        ]
        assert not wide, (wide, e.params["jaxpr"])
    # The same values as amp with float32 parameters holding those values:
    # a weight's cotangent is the bfloat16 product's result either way; the
    # gains' float32 cotangents are rounded once.
    g = jax.jit(grad)(params, x)
    wide_params = jax.tree.map(lambda a: a.astype(jnp.float32), params)
    ref = jax.jit(grad)(wide_params, x)
    assert all(a.dtype == BF16 for a in jax.tree.leaves(g))
    for name in ("w1", "w2", "gain"):
        got, want = g["layers"][name], ref["layers"][name].astype(jnp.bfloat16)
        np.testing.assert_array_equal(np.asarray(got, F32), np.asarray(want, F32))
    np.testing.assert_array_equal(
        np.asarray(g["head"], F32), np.asarray(ref["head"].astype(jnp.bfloat16), F32)
    )
    # Against float32 arithmetic: bfloat16 matmuls, a few percent at most.
    exact = jax.grad(_scanned_net)(wide_params, x)
    for got, want in zip(jax.tree.leaves(g), jax.tree.leaves(exact)):
        err = jnp.linalg.norm(got.astype(F32) - want) / jnp.linalg.norm(want)
        assert float(err) < 0.03


def test_float16_parameters_with_loss_scaling_stay_finite_and_skip_overflow():
    # float16 parameters, float16 compute, dynamic loss scaling: the scaled
    # cotangent of a stacked weight is float16 per layer (the product's result)
    # and the scaler unscales it in float32; an overflowing scale is a
    # skipped step that leaves the parameters as they were.
    params = _stacked_params(jnp.float16)
    x = jax.random.normal(jax.random.key(5), (16, 32)).astype(jnp.float16)
    x = 100.0 * x.astype(jnp.float32)
    loss = jaxamp.amp(_scanned_net, compute_dtype=jnp.float16)
    vg = jaxamp.dynamic_scale_value_and_grad(loss, filter=False)
    tx = jaxamp.skip_nonfinite_updates(optax.sgd(1e-3))

    @jax.jit
    def step(p, s, scaler):
        scaler, (_, g) = vg(p, x, dynamic_scaler_state=scaler)
        u, s = tx.update(g, s, p)
        with jax.numpy_dtype_promotion("standard"):  # float32 updates
            return optax.apply_updates(p, u), s, scaler, g

    state = tx.init(params)
    p1, s1, sc1, g1 = step(params, state, jaxamp.DynamicScalerState(scaler=2.0**10))
    assert all(a.dtype == F16 for a in jax.tree.leaves(p1))
    assert all(a.dtype == F32 for a in jax.tree.leaves(g1))  # unscaled
    assert all(bool(jnp.isfinite(a).all()) for a in jax.tree.leaves(g1))
    assert int(s1.skipped_steps) == 0 and float(sc1.scaler) == 2.0**10
    exact = jax.grad(_scanned_net)(jax.tree.map(lambda a: a.astype(F32), params), x)
    err = optax.tree.norm(jax.tree.map(lambda a, b: a.astype(F32) - b, g1, exact))
    assert float(err / optax.tree.norm(exact)) < 0.03
    p2, s2, sc2, _ = step(p1, s1, jaxamp.DynamicScalerState(scaler=2.0**24))
    assert int(s2.skipped_steps) == 1 and float(sc2.scaler) == 2.0**23
    assert all(
        bool((a == b).all()) for a, b in zip(jax.tree.leaves(p2), jax.tree.leaves(p1))
    )


def test_ablated_takes_amps_residual_dtype():
    # ablated() returns a function with amp's signature, residual_dtype
    # included: the same saved set as amp's with that residual format.
    from jaxamp import _amp

    def f(w, x):
        return jnp.sum(jnp.tanh(x @ w) ** 2)

    w = jnp.linspace(-1, 1, 64 * 64, dtype=jnp.float32).reshape(64, 64)
    x = 100.0 * jnp.cos(jnp.arange(8 * 64, dtype=jnp.float32)).reshape(8, 64)
    kw = {"compute_dtype": jnp.bfloat16, "residual_dtype": "int8"}
    plain = jaxamp.saved_residual_bytes(jaxamp.amp(f, compute_dtype=jnp.bfloat16), w, x)
    full = jaxamp.saved_residual_bytes(jaxamp.amp(f, **kw), w, x)
    ablated = jaxamp.saved_residual_bytes(_amp.ablated()(f, **kw), w, x)
    assert ablated == full < plain
