"""Tests of the higher-order registry (jaxamp/_walk/_higher_order.py): every sub-jaxpr
is rewritten, signatures stay identical, and custom derivative rules still run."""

import functools
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import rel_l2, round_bf16, tree_dtypes
from jax import lax
from jax.extend.core import Primitive, jaxpr_as_fun
from jax.interpreters import ad, mlir
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import jaxamp
from jaxamp import _amp, _compat
from jaxamp._base import _structure
from jaxamp._base._jaxpr import is_prepare
from jaxamp._policy import _lookup, _rules
from jaxamp._walk import _higher_order, _loop

BF16, F32 = np.dtype(jnp.bfloat16), np.dtype(jnp.float32)
F16 = np.dtype(jnp.float16)


def eqns(closed):
    """All equations of a jaxpr and of its sub-jaxprs, depth first."""
    return (e for e, _ in jaxamp.tools.iter_equations(closed))


def _has_dot(eqn):
    return any(
        e.primitive.name == "dot_general"
        for j in _compat.sub_jaxprs(eqn.params)
        for e, _ in jaxamp.tools.iter_equations(j)
    )


def dot_dtypes(closed):
    return [
        tuple(v.aval.dtype for v in e.invars)
        for e in eqns(closed)
        if e.primitive.name == "dot_general"
    ]


def top_level(closed):
    return [e.primitive.name for e in getattr(closed, "jaxpr", closed).eqns]


W = jnp.asarray(np.linspace(-1, 1, 16).reshape(4, 4), jnp.float32)
X = jnp.asarray(np.linspace(-2, 2, 8).reshape(2, 4), jnp.float32)

CASES = {
    "jit": lambda w, x: jax.jit(lambda a, b: jnp.tanh(a @ b))(x, w).sum(),
    "remat": lambda w, x: jax.checkpoint(lambda a, b: jnp.tanh(a @ b))(x, w).sum(),
    "scan": lambda w, x: lax.scan(lambda c, _: (jnp.tanh(c @ w), None), x, None, 3)[
        0
    ].sum(),
    "cond": lambda w, x: lax.cond(
        x.sum() > 0, lambda a: a @ w, lambda a: (a @ w) * 2.0, x
    ).sum(),
    "switch": lambda w, x: lax.switch(
        1, [lambda a: a @ w, lambda a: jnp.tanh(a @ w), lambda a: a], x
    ).sum(),
    "while": lambda w, x: lax.while_loop(
        lambda c: c[0] < 3, lambda c: (c[0] + 1, jnp.tanh(c[1] @ w)), (0, x)
    )[1].sum(),
    "nested": lambda w, x: jax.jit(
        lambda a: lax.scan(
            lambda c, _: (jax.checkpoint(lambda z: jnp.tanh(z @ w))(c), None),
            a,
            None,
            2,
        )[0]
    )(x).sum(),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_sub_jaxprs_are_rewritten(name):
    f = CASES[name]
    amp_f = jaxamp.amp(f, compute_dtype=jnp.bfloat16)
    closed = jax.make_jaxpr(amp_f)(W, X)
    dots = dot_dtypes(closed)
    assert dots and all(d == (BF16, BF16) for d in dots)
    # The higher-order primitive is re-bound, not inlined.
    ref_top = [n for n in top_level(jax.make_jaxpr(f)(W, X)) if n != "reduce_sum"]
    hop = {"jit", "remat2", "scan", "cond", "while"} & set(ref_top)
    assert hop <= set(top_level(closed))
    # Same output, to bfloat16 accuracy.
    np.testing.assert_allclose(amp_f(W, X), f(W, X), rtol=5e-2, atol=5e-2)


@pytest.mark.parametrize("name", ["jit", "remat", "scan", "nested"])
def test_gradients_of_rewritten_sub_jaxprs(name):
    f = CASES[name]
    amp_f = jaxamp.amp(f, compute_dtype=jnp.bfloat16)
    closed = jax.make_jaxpr(jax.grad(amp_f))(W, X)
    assert all(d == (BF16, BF16) for d in dot_dtypes(closed))
    g, g_ref = jax.grad(amp_f)(W, X), jax.grad(f)(W, X)
    assert g.dtype == F32
    assert float(jnp.linalg.norm(g - g_ref) / jnp.linalg.norm(g_ref)) < 5e-2


def test_remat_policy_is_kept():
    policy = jax.checkpoint_policies.dots_saveable
    f = lambda w, x: jax.checkpoint(lambda a: jnp.tanh(a @ w), policy=policy)(x).sum()
    closed = jax.make_jaxpr(jaxamp.amp(f, compute_dtype=jnp.bfloat16))(W, X)
    (remat,) = [e for e in eqns(closed) if e.primitive.name == "remat2"]
    assert remat.params["policy"] is policy


@pytest.mark.parametrize(
    "compute, policy, carry",
    [
        (BF16, jaxamp.default_amp_policy, BF16),  # narrowed: no float32 stream
        (np.dtype(jnp.float16), jaxamp.default_amp_policy, F32),  # could overflow
        (
            BF16,
            {**jaxamp.default_amp_policy, "scan": jaxamp.use_original_precision},
            F32,
        ),
    ],
)
def test_scan_carry_dtype_is_chosen_by_the_scan_rule(compute, policy, carry):
    f = CASES["scan"]
    amp_f = jaxamp.amp(f, compute_dtype=compute, amp_policy=policy)
    closed = jax.make_jaxpr(amp_f)(W, X)
    (scan,) = [e for e in eqns(closed) if e.primitive.name == "scan"]
    assert [v.aval.dtype for v in scan.outvars] == [carry]
    body = scan.params["jaxpr"]
    assert [v.aval.dtype for v in getattr(body, "jaxpr", body).outvars] == [carry]
    assert amp_f(W, X).dtype == F32
    np.testing.assert_allclose(amp_f(W, X), f(W, X), rtol=5e-2, atol=5e-2)


def test_weak_typed_scan_carry_is_not_narrowed():
    f = lambda x: lax.scan(lambda c, a: (c + a.sum(), None), 0.0, x)[0]
    closed = jax.make_jaxpr(jaxamp.amp(f, compute_dtype=BF16))(X)
    (scan,) = [e for e in eqns(closed) if e.primitive.name == "scan"]
    assert scan.outvars[0].aval.dtype == F32


def test_jit_and_remat_let_dtypes_flow_through():
    def f(w, x):
        h = jnp.tanh(x @ w)
        h = jax.jit(lambda a: a * 2.0)(h)
        return (jax.checkpoint(lambda a: jnp.sin(a))(h) @ w.T).sum()

    closed = jax.make_jaxpr(jaxamp.amp(f, compute_dtype=BF16))(W, X)
    calls = [
        e
        for e in eqns(closed)
        if e.primitive.name in ("jit", "remat2") and not _has_dot(e)
    ]  # (the checkpoint around x @ w re-casts the arguments: tested elsewhere)
    assert len(calls) == 2
    for e in calls:  # no cast pair at the boundary: inputs and outputs stay low
        assert [v.aval.dtype for v in e.invars] == [BF16]
        assert [v.aval.dtype for v in e.outvars] == [BF16]

    # The same precision choices with and without jit around the function.
    def choices(fn):
        closed = jax.make_jaxpr(jaxamp.amp(fn, compute_dtype=BF16))(W, X)
        return [
            (e.primitive.name, [v.aval.dtype for v in e.outvars])
            for e in eqns(closed)
            if e.primitive.name != "jit"
        ]

    assert choices(jax.jit(f)) == choices(f)


def test_custom_jvp_rule_still_runs():
    @jax.custom_jvp
    def f(x):
        return jnp.sin(x)

    # A deliberately "wrong" derivative: if amp inlined the primal, grad would
    # be cos(x) instead of 3.
    f.defjvp(lambda p, t: (jnp.sin(p[0]), 3.0 * t[0]))
    loss = lambda w, x: f(x @ w).sum()
    g = jax.grad(jaxamp.amp(loss, compute_dtype=jnp.bfloat16), argnums=1)(W, X)
    np.testing.assert_allclose(g, jnp.broadcast_to(3.0 * W.sum(1), X.shape), rtol=2e-2)
    closed = jax.make_jaxpr(jaxamp.amp(loss, compute_dtype=jnp.bfloat16))(W, X)
    assert "custom_jvp_call" in top_level(closed)


def test_custom_vjp_fwd_and_bwd_still_run_in_low_precision():
    @jax.custom_vjp
    def lin(x, w):
        return x @ w

    def fwd(x, w):
        return x @ w, (x, w)

    def bwd(res, g):
        x, w = res
        return 2.0 * (g @ w.T), x.T @ g  # x-gradient doubled on purpose

    lin.defvjp(fwd, bwd)
    loss = lambda w, x: lin(x, w).sum()
    amp_loss = jaxamp.amp(loss, compute_dtype=jnp.bfloat16)
    gx = jax.grad(amp_loss, argnums=1)(W, X)
    np.testing.assert_allclose(
        gx, 2.0 * jnp.broadcast_to(W.sum(1), X.shape), rtol=2e-2, atol=1e-2
    )
    closed = jax.make_jaxpr(jax.grad(amp_loss, argnums=(0, 1)))(W, X)
    dots = dot_dtypes(closed)
    assert len(dots) == 3 and all(d == (BF16, BF16) for d in dots)


def test_shard_map_body_is_rewritten():
    mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Auto,))
    w = jnp.ones((4, 4), jnp.float32)

    def f(x):
        body = lambda a: lax.psum(jnp.tanh(a @ w), "x")
        return jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P())(x)

    x = jnp.asarray(np.linspace(-1, 1, 32).reshape(8, 4), jnp.float32)
    amp_f = jaxamp.amp(f, compute_dtype=jnp.bfloat16)
    closed = jax.make_jaxpr(amp_f)(x)
    assert "shard_map" in top_level(closed)
    assert dot_dtypes(closed) == [(BF16, BF16)]
    out = jax.jit(amp_f)(x)
    assert out.dtype == F32
    np.testing.assert_allclose(out, f(x), rtol=2e-2, atol=2e-2)


def _unknown_hop():
    """A higher-order primitive jaxamp has never heard of (like pallas_call)."""
    prim = Primitive("my_unknown_hop")
    prim.multiple_results = True
    prim.def_impl(lambda *xs, jaxpr: jaxpr_as_fun(jaxpr)(*xs))
    prim.def_abstract_eval(lambda *avals, jaxpr: [v.aval for v in jaxpr.jaxpr.outvars])
    return prim


def test_unknown_higher_order_primitive_runs_unchanged():
    prim = _unknown_hop()
    inner = jax.make_jaxpr(lambda a, b: a @ b)(X, W)

    def f(w, x):
        (y,) = prim.bind(jnp.tanh(x), w, jaxpr=inner)
        return y.sum()

    amp_f = jaxamp.amp(lambda w, x: f(w, x @ w), compute_dtype=jnp.bfloat16)
    closed = jax.make_jaxpr(amp_f)(W, X)
    (hop,) = [e for e in eqns(closed) if e.primitive is prim]
    # Inputs restored to the traced dtypes; the body untouched (float32 dot).
    assert [v.aval.dtype for v in hop.invars] == [F32, F32]
    assert hop.params["jaxpr"] is inner
    np.testing.assert_allclose(amp_f(W, X), f(W, X @ W), rtol=2e-2, atol=1e-2)


def test_jitted_layer_is_rewritten_once(monkeypatch):
    calls = []
    retrace = _higher_order._retrace
    monkeypatch.setattr(
        _higher_order, "_retrace", lambda j, *a: calls.append(j) or retrace(j, *a)
    )
    layer = jax.jit(lambda a, b: jnp.tanh(a @ b))

    def f(w, x):
        for _ in range(5):
            x = layer(x, w)
        return (x @ w).sum()  # every layer feeds a matmul: one fact signature

    jax.make_jaxpr(jaxamp.amp(f, compute_dtype=jnp.bfloat16))(W, X)
    # Once per input dtype signature: float32 x on the first call, then the
    # bfloat16 output of the previous layer on the four others.
    assert len(calls) == 2


def test_register_higher_order_adds_a_rule():
    prim = _unknown_hop()
    jaxamp.extend.register_higher_order(prim.name)(_higher_order.rewrite_subjaxprs)
    try:
        inner = jax.make_jaxpr(lambda a, b: a @ b)(X, W)
        f = lambda w, x: prim.bind(x, w, jaxpr=inner)[0].sum()
        closed = jax.make_jaxpr(jaxamp.amp(f, compute_dtype=jnp.bfloat16))(W, X)
        assert dot_dtypes(closed) == [(BF16, BF16)]
    finally:
        _higher_order.unregister_higher_order(prim.name)


def test_register_higher_order_takes_names():
    with pytest.raises(TypeError, match="give primitive names as strings"):
        jaxamp.extend.register_higher_order(_unknown_hop())
    with pytest.raises(TypeError, match="give primitive names as strings"):
        jaxamp.extend.register_higher_order()


@functools.partial(jax.custom_vjp, nondiff_argnums=())
def _identity_with_zero_cotangent(x, y):
    return x + y


_identity_with_zero_cotangent.defvjp(lambda x, y: (x + y, None), lambda _, g: (g, None))


def test_custom_vjp_bwd_returning_none_cotangents():
    f = lambda x, y: (_identity_with_zero_cotangent(x, y) * x).sum()
    amp_f = jaxamp.amp(f, compute_dtype=jnp.bfloat16)
    gx, gy = jax.grad(amp_f, argnums=(0, 1))(X, X)
    assert gy.dtype == F32 and float(jnp.abs(gy).max()) == 0.0
    np.testing.assert_allclose(gx, jax.grad(f)(X, X), rtol=2e-2, atol=2e-2)


def test_relu_custom_jvp_lets_bfloat16_flow_through():
    def f(w, x):
        return jnp.square(jax.nn.relu(x @ w) @ w).sum()

    amp_f = jaxamp.amp(f, compute_dtype=BF16)
    closed = jax.make_jaxpr(amp_f)(W, X)
    # relu's custom_jvp comes first (the last matmul, whose float32 result feeds
    # the loss, is bound through a jaxamp custom_jvp too).
    call = [e for e in eqns(closed) if e.primitive.name == "custom_jvp_call"][0]
    assert [v.aval.dtype for v in call.invars] == [BF16]
    assert [v.aval.dtype for v in call.outvars] == [BF16]
    g, g_ref = jax.grad(amp_f)(W, X), jax.grad(f)(W, X)
    assert g.dtype == F32
    assert float(jnp.linalg.norm(g - g_ref) / jnp.linalg.norm(g_ref)) < 5e-2
    # Forward mode too: the rewritten jvp rule returns the primal's dtypes.
    _, t = jax.jvp(lambda w: amp_f(w, X), (W,), (W,))
    _, t_ref = jax.jvp(lambda w: f(w, X), (W,), (W,))
    np.testing.assert_allclose(t, t_ref, rtol=5e-2)


def test_custom_jvp_with_symbolic_zero_tangents():
    @jax.custom_jvp
    def scaled(x, s):
        return x * s

    @scaled.defjvp
    def _(primals, tangents):
        (x, s), (tx, ts) = primals, tangents
        return x * s, 5.0 * tx * s + ts * x  # 5.0: marks the user's rule

    def f(w, x, s):
        return scaled(x @ w, s).sum()

    s = jnp.float32(0.5)
    amp_f = jaxamp.amp(f, compute_dtype=BF16)
    gx = jax.grad(amp_f, argnums=1)(W, X, s)  # tangent of s is a symbolic zero
    np.testing.assert_allclose(
        gx, jnp.broadcast_to(5.0 * 0.5 * W.sum(1), X.shape), rtol=2e-2
    )
    gs = jax.grad(amp_f, argnums=2)(W, X, s)
    np.testing.assert_allclose(gs, (X @ W).sum(), rtol=2e-2, atol=2e-2)


def _symbolic_zero_vjp(log):
    """A ``symbolic_zeros=True`` custom_vjp that logs what its rules receive."""

    @jax.custom_vjp
    def f(x, s):
        return x * s, jnp.sin(x)

    def fwd(x, s):
        log.append(("fwd", x.perturbed, s.perturbed))
        return f(x.value, s.value), (x.value, s.value, 2.0, None)

    def bwd(res, g):
        x, s, two, none = res  # Python-valued and None residuals too
        zero = [type(t) is jax.custom_derivatives.SymbolicZero for t in g]
        log.append(("bwd", *zero, type(two).__name__, none))
        g0, g1 = (jnp.zeros_like(x) if z else t for z, t in zip(zero, g))
        # 3.0: marks the user's rule (the true x-cotangent is g0 * s).
        return 3.0 * g0 * s + g1 * jnp.cos(x), jax.custom_derivatives.SymbolicZero(
            jax.typeof(s).to_tangent_aval()
        )

    f.defvjp(fwd, bwd, symbolic_zeros=True)
    return f


def _logged_grad(use_amp):
    log = []
    f = _symbolic_zero_vjp(log)
    loss = lambda w, x: f(x @ w, jnp.float32(0.5))[0].sum()  # 2nd output unused
    if use_amp:
        loss = jaxamp.amp(loss, compute_dtype=BF16)
    return jax.grad(loss, argnums=1)(W, X), log


def test_custom_vjp_symbolic_zeros_pass_through_as_without_amp():
    ref, ref_log = _logged_grad(use_amp=False)
    got, log = _logged_grad(use_amp=True)
    # fwd sees the same perturbed flags, bwd the same symbolic zeros.
    assert log == ref_log
    assert log[0] == ("fwd", True, False) and log[1][:3] == ("bwd", False, True)
    assert got.dtype == F32
    np.testing.assert_allclose(got, ref, rtol=2e-2, atol=1e-2)
    np.testing.assert_allclose(
        ref, jnp.broadcast_to(1.5 * W.sum(1), X.shape), rtol=1e-5
    )


def test_equinox_filter_custom_vjp_with_non_differentiated_inputs():
    @eqx.filter_custom_vjp
    def layer(params, x, scale):
        w, b = params
        return jnp.tanh(x @ w) * scale + b

    @layer.def_fwd
    def _(perturbed, params, x, scale):
        return layer(params, x, scale), None

    @layer.def_bwd
    def _(res, g, perturbed, params, x, scale):
        # x and scale are not differentiated: only params get cotangents.
        w, b = params
        h = jnp.tanh(x @ w)
        gw = x.T @ (g * scale * (1.0 - h * h))
        return 2.0 * gw, (g.sum(0) if perturbed[1] else None)  # 2.0: the user's

    def loss(w, b, x):
        return jnp.square(layer((w, b), x, jnp.float32(0.5))).sum()

    b = jnp.zeros((4,), jnp.float32)
    ref = jax.grad(loss, argnums=(0, 1))(W, b, X)
    got = jax.grad(jaxamp.amp(loss, compute_dtype=BF16), argnums=(0, 1))(W, b, X)
    assert [g.dtype for g in got] == [F32, F32]
    assert rel_l2(got, ref) < 5e-2
    got_w = jax.grad(jaxamp.amp(loss, compute_dtype=BF16))(W, b, X)
    assert rel_l2(got_w, ref[0]) < 5e-2
    closed = jax.make_jaxpr(jax.grad(jaxamp.amp(loss, compute_dtype=BF16)))(W, b, X)
    assert jaxamp.tools.low_precision_flop_share(closed) == 1.0


@pytest.mark.parametrize("adjoint", ["RecursiveCheckpointAdjoint", "BacksolveAdjoint"])
def test_diffrax_neural_ode_gradients(adjoint):
    diffrax = pytest.importorskip("diffrax")
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
    params = round_bf16(
        {
            "w1": jax.random.normal(k1, (4, 32)) / 2.0,
            "w2": jax.random.normal(k2, (32, 4)) / np.sqrt(32.0),
        }
    )
    y0 = round_bf16(jax.random.normal(k3, (16, 4)))

    def loss(p, y0):
        term = diffrax.ODETerm(lambda t, y, p: jnp.tanh(y @ p["w1"]) @ p["w2"])
        sol = diffrax.diffeqsolve(
            term,
            diffrax.Tsit5(),
            0.0,
            1.0,
            0.1,
            y0,
            args=p,
            stepsize_controller=diffrax.PIDController(rtol=1e-3, atol=1e-4),
            adjoint=getattr(diffrax, adjoint)(),
            max_steps=64,
        )
        return jnp.mean(jnp.square(sol.ys[-1]))

    grad_amp = jax.grad(jaxamp.amp(loss, compute_dtype=BF16))
    got = jax.jit(grad_amp)(params, y0)
    ref = jax.jit(jax.grad(loss))(params, y0)
    assert tree_dtypes(got) == [F32, F32]
    assert rel_l2(got, ref) < 5e-2
    share = jaxamp.tools.low_precision_flop_share(jax.make_jaxpr(grad_amp)(params, y0))
    assert share >= 0.99


# --- scan inputs cast once, before the loop (issue 12: hand-cast speed) ---

L_, D_ = 4, 16
_rng = np.random.default_rng(7)
STACK = round_bf16(
    {
        "up": jnp.asarray(_rng.normal(0, 0.3, (L_, D_, 2 * D_)), jnp.float32),
        "down": jnp.asarray(_rng.normal(0, 0.3, (L_, 2 * D_, D_)), jnp.float32),
        "gain": jnp.asarray(_rng.normal(1, 0.1, (L_, D_)), jnp.float32),
    }
)
# Residual-stream activations in the hundreds, as real training reaches.
H0 = round_bf16(jnp.asarray(_rng.normal(0, 300, (8, D_)), jnp.float32))


def _layer(h, w):
    return h + jax.nn.gelu(h @ w["up"]) @ w["down"], None


def _scanned(checkpoint, up_in_f32=False):
    def loss(p, h):
        def layer(h, w):
            if up_in_f32:  # a matmul weight also read by a float32 reduction
                h = h + jnp.sum(w["up"]) * 1e-3
            return _layer(h, w)

        body = jax.checkpoint(layer) if checkpoint else layer
        h, _ = lax.scan(body, h, p)
        return jnp.mean(jnp.square(h / 100.0))

    return loss


def _scan_eqns(closed):
    return [e for e in eqns(closed) if e.primitive.name == "scan"]


def _xs_dtypes(scan):
    n_consts, n_carry = _compat.scan_carry_range(scan.params)
    return [v.aval.dtype for v in scan.invars[n_consts + n_carry :]]


def _converts_of_stacks(closed):
    """f32 -> bf16 converts of arrays shaped like a stacked weight, each counted
    as often as it runs in one step (scan bodies weighted by their length)."""
    shapes = {a.shape[1:] for a in jax.tree.leaves(STACK)}
    shapes |= {a.shape for a in jax.tree.leaves(STACK)}
    return sum(
        w
        for e, w in jaxamp.tools.iter_equations(closed)
        if e.primitive.name == "convert_element_type"
        and e.outvars[0].aval.dtype == BF16
        and e.invars[0].aval.dtype == F32
        and e.invars[0].aval.shape in shapes
        and len(e.invars[0].aval.shape) > 1
    )


def test_checkpointed_scan_casts_its_weights_once_before_the_loop():
    amp_loss = jaxamp.amp(_scanned(checkpoint=True), compute_dtype=BF16)
    closed = jax.make_jaxpr(amp_loss)(STACK, H0)
    (scan,) = _scan_eqns(closed)
    # xs leaves in tree order: down, gain, up. The matmul weights enter the loop
    # in bfloat16; the gain, unused, is not cast.
    assert _xs_dtypes(scan) == [BF16, F32, BF16]
    # One cast per weight per step, outside the loop: casts of a layer's weight
    # slice inside the body would count once per layer (8 with the casts inside).
    assert _converts_of_stacks(closed) == 2


def test_checkpointed_scan_stacks_weight_gradients_in_the_compute_dtype():
    amp_loss = jaxamp.amp(_scanned(checkpoint=True), compute_dtype=BF16)
    closed = jax.make_jaxpr(jax.grad(amp_loss))(STACK, H0)
    stacked = {(L_, D_, 2 * D_), (L_, 2 * D_, D_)}
    # The backward loop's stacked weight cotangents (its ys) are bfloat16 ...
    ys = [
        v.aval.dtype
        for s in _scan_eqns(closed)
        for v in s.outvars[_compat.scan_carry_range(s.params)[1] :]
        if v.aval.shape in stacked
    ]
    assert ys and set(ys) == {BF16}
    # ... and the gradients leave in the parameters' dtype.
    grads = jax.grad(amp_loss)(STACK, H0)
    assert tree_dtypes(grads) == [F32] * 3


def test_casting_before_the_loop_keeps_the_numbers():
    # Inputs rounded to bfloat16: the tolerance measures only the transform.
    ref = jax.jit(jax.value_and_grad(_scanned(checkpoint=False)))
    with jax.default_matmul_precision("highest"):
        ref_loss, ref_grads = ref(STACK, H0)
    hoisted = jaxamp.amp(_scanned(checkpoint=True), compute_dtype=BF16)
    in_loop = jaxamp.amp(_scanned(checkpoint=False), compute_dtype=BF16)
    loss_h, grads_h = jax.jit(jax.value_and_grad(hoisted))(STACK, H0)
    loss_l, grads_l = jax.jit(jax.value_and_grad(in_loop))(STACK, H0)
    assert np.isfinite(float(loss_h)) and float(ref_loss) > 1.0
    # bfloat16 matmuls over activations in the hundreds: within 2e-2 of float32,
    assert abs(float(loss_h) - float(ref_loss)) < 2e-2 * abs(float(ref_loss))
    assert rel_l2(grads_h, ref_grads) < 3e-2
    # and the same bfloat16 computation as with the casts inside the loop.
    assert abs(float(loss_h) - float(loss_l)) <= 1e-3 * abs(float(loss_l))
    assert rel_l2(grads_h, grads_l) < 1e-3


def test_scan_without_checkpoint_keeps_per_matmul_casts():
    # No weight copy among the residuals: the backward pass re-casts the
    # float32 weights (held: the amp'd function's arguments).
    amp_loss = jaxamp.amp(_scanned(checkpoint=False), compute_dtype=BF16)
    (scan,) = _scan_eqns(jax.make_jaxpr(amp_loss)(STACK, H0))
    assert _xs_dtypes(scan) == [F32, F32, F32]
    hoisted = jaxamp.amp(_scanned(checkpoint=True), compute_dtype=BF16)
    copies = 2 * sum(a.size for k, a in STACK.items() if k != "gain")
    # The checkpointed variant saves the bfloat16 weight copy and one carry per
    # layer; the plain one saves per-layer activations but no weight copy.
    saved = [
        a
        for a, src in _compat.saved_residuals(amp_loss, STACK, H0)
        if not src.startswith("from the argument")
    ]
    assert not any(a.dtype == BF16 and a.shape == STACK["up"].shape for a in saved)
    assert jaxamp.saved_residual_bytes(hoisted, STACK, H0) >= copies


def test_a_weight_also_read_in_float32_stays_in_the_loop():
    loss = _scanned(checkpoint=True, up_in_f32=True)
    (scan,) = _scan_eqns(
        jax.make_jaxpr(jaxamp.amp(loss, compute_dtype=BF16))(STACK, H0)
    )
    # "up" is read by a float32 reduction as well as by a matmul: it enters the
    # loop in float32; "down" is still cast before it.
    assert _xs_dtypes(scan) == [BF16, F32, F32]


def test_a_weight_returned_by_the_body_stays_in_the_loop():
    def loss(p, h):
        def layer(h, w):
            h, _ = _layer(h, w)
            return h, w["up"]  # the weight is also a ys output

        h, ups = lax.scan(jax.checkpoint(layer), h, p)
        return jnp.mean(h) + jnp.mean(ups)

    closed = jax.make_jaxpr(jaxamp.amp(loss, compute_dtype=BF16))(STACK, H0)
    (scan,) = _scan_eqns(closed)
    assert _xs_dtypes(scan) == [BF16, F32, F32]


def _rnn_inputs(steps):
    """A float32 weight matrix and a float32 input sequence, bfloat16-exact."""
    w = round_bf16(jnp.asarray(_rng.normal(0, 0.2, (D_, D_)), jnp.float32))
    xs = round_bf16(jnp.asarray(_rng.normal(0, 1, (steps, 8, D_)), jnp.float32))
    return w, xs


def test_loop_invariant_weight_is_cast_once_not_once_per_step():
    # An RNN: the scan closes over a float32 weight matrix (a const of the loop).
    w, xs = _rnn_inputs(steps=12)

    def loss(w, xs):
        def step(h, x):
            h = jnp.tanh(h @ w + x)
            return h, h

        _, hs = lax.scan(step, jnp.zeros((8, D_), jnp.float32), xs)
        return jnp.mean(jnp.square(hs))

    amp_loss = jaxamp.amp(loss, compute_dtype=BF16)
    closed = jax.make_jaxpr(amp_loss)(w, xs)
    (scan,) = _scan_eqns(closed)
    n_consts, _ = _compat.scan_carry_range(scan.params)
    assert [v.aval.dtype for v in scan.invars[:n_consts]] == [BF16]
    casts = sum(
        wt
        for e, wt in jaxamp.tools.iter_equations(
            jax.make_jaxpr(jax.grad(amp_loss))(w, xs)
        )
        if e.primitive.name == "convert_element_type"
        and e.invars[0].aval.shape == (D_, D_)
        and e.outvars[0].aval.dtype == BF16
    )
    assert casts == 1  # 13 with the casts in the loop (one per step, and more)
    # amp's re-casting checkpoint around the matmul had nothing left to re-cast:
    # it is gone from the body (no optimization barrier in the loop).
    assert [e for e in eqns(scan.params["jaxpr"]) if e.primitive.name == "remat2"] == []
    with jax.default_matmul_precision("highest"):
        ref = jax.grad(loss)(w, xs)
    got = jax.grad(amp_loss)(w, xs)
    assert got.dtype == F32
    assert rel_l2(got, ref) < 3e-2


def _tanh_scanned(p, h):
    """A scanned layer whose float16 overflow tanh would absorb."""

    def layer(h, w):
        return h + jnp.tanh(h @ w["up"] / 64) @ w["down"] * w["gain"], None

    h, _ = lax.scan(jax.checkpoint(layer), h, p)
    return jnp.mean(jnp.square(h / 100.0))


def test_float16_casts_move_before_the_loop_with_their_overflow_check():
    # The cast before the loop checks each float32 stack once; in the body the
    # weights arrive in float16, the finite tests left there read float16 values
    # and the casts' NaN factors are gone.
    amp_loss = jaxamp.amp(_tanh_scanned, compute_dtype=F16)
    closed = jax.make_jaxpr(amp_loss)(STACK, H0)
    (scan,) = _scan_eqns(closed)
    assert _xs_dtypes(scan) == [F16, F32, F16]
    stacks = {STACK["up"].shape, STACK["down"].shape}
    tested = lambda es: [
        e.invars[0].aval for e in es if e.primitive.name == "is_finite"
    ]
    assert {a.shape for a in tested(closed.jaxpr.eqns) if a.dtype == F32} == stacks
    layers = {s[1:] for s in stacks}
    assert not [
        a
        for a in tested(eqns(scan.params["jaxpr"]))
        if a.dtype == F32 and a.shape in layers
    ]
    grad = lambda f: jax.jit(jax.grad(lambda p, h: f(p, h) * 2.0**12))(STACK, H0)
    grads = grad(amp_loss)  # a static loss scale: no float16 underflow

    in_loop = _amp.ablated(choices=["loop_casts"])(_tanh_scanned, compute_dtype=F16)
    assert _xs_dtypes(_scan_eqns(jax.make_jaxpr(in_loop)(STACK, H0))[0]) == [F32] * 3
    grads_in_loop = grad(in_loop)
    with jax.default_matmul_precision("highest"):
        ref = grad(_tanh_scanned)
    # Inputs are float16-exact (bfloat16-rounded, in range); activations in the
    # hundreds.
    assert tree_dtypes(grads) == [F32] * 3
    assert rel_l2(grads, grads_in_loop) < 1e-3  # measured: 0
    assert rel_l2(grads, ref) < 5e-3  # measured: 1.3e-3

    # One weight of layer 2 beyond float16's range: tanh absorbs the inf, so
    # without the check the loss is finite; with it, hoisted or not, it is NaN.
    bad = {**STACK, "up": STACK["up"].at[2, 0, 0].set(1e5)}
    hoisted = jaxamp.amp(_tanh_scanned, compute_dtype=F16)
    silent = jaxamp.amp(_tanh_scanned, compute_dtype=F16, overflow_check=False)
    assert np.isfinite(float(silent(bad, H0)))
    assert np.isnan(float(hoisted(bad, H0)))
    assert np.isnan(float(in_loop(bad, H0)))
    assert not np.isfinite(np.asarray(jax.grad(hoisted)(bad, H0)["up"])).all()


def test_recasting_checkpoint_stays_while_it_still_recasts_an_input():
    # x_t (a slice of the held float32 batch, in a scan without checkpoint) and
    # the const w meet in one matmul: w moves before the loop, x_t is still
    # re-cast in the backward pass by amp's checkpoint, which therefore stays.
    w, xs = _rnn_inputs(steps=6)

    def loss(w, xs):
        def step(c, x):
            y = jnp.tanh(x @ w)
            return c + jnp.sum(y), None

        return lax.scan(step, jnp.zeros((), jnp.float32), xs)[0]

    amp_loss = jaxamp.amp(loss, compute_dtype=BF16)
    (scan,) = _scan_eqns(jax.make_jaxpr(amp_loss)(w, xs))
    n_consts, n_carry = _compat.scan_carry_range(scan.params)
    assert [v.aval.dtype for v in scan.invars[:n_consts]] == [BF16]
    assert _xs_dtypes(scan) == [F32]
    remats = [e for e in eqns(scan.params["jaxpr"]) if e.primitive.name == "remat2"]
    assert len(remats) == 1
    assert [v.aval.dtype for v in remats[0].invars] == [F32, BF16]
    with jax.default_matmul_precision("highest"):
        ref = jax.grad(loss)(w, xs)
    assert rel_l2(jax.grad(amp_loss)(w, xs), ref) < 3e-2


def test_float16_loop_invariant_weight_is_cast_once_with_its_check():
    # The RNN-like scan of the test above in float16: the const enters the loop
    # in float16, checked once before it; an overflowing weight that tanh
    # would absorb still makes the loss NaN.
    w, xs = _rnn_inputs(steps=6)

    def loss(w, xs):
        def step(c, x):
            return c + jnp.sum(jnp.tanh(x @ w)), None

        return lax.scan(step, jnp.zeros((), jnp.float32), xs)[0]

    amp_loss = jaxamp.amp(loss, compute_dtype=F16)
    closed = jax.make_jaxpr(amp_loss)(w, xs)
    (scan,) = _scan_eqns(closed)
    n_consts, _ = _compat.scan_carry_range(scan.params)
    assert [v.aval.dtype for v in scan.invars[:n_consts]] == [F16]
    tested = [
        e.invars[0].aval
        for e in closed.jaxpr.eqns
        if e.primitive.name == "is_finite" and e.invars[0].aval.shape == w.shape
    ]
    assert sorted(a.dtype.name for a in tested) == ["float16", "float32"]
    with jax.default_matmul_precision("highest"):
        ref = jax.grad(lambda *a: loss(*a) * 1024)(w, xs)
    got = jax.grad(lambda *a: amp_loss(*a) * 1024)(w, xs)
    assert got.dtype == F32 and rel_l2(got, ref) < 5e-3  # measured: 6e-4

    bad = w.at[0, 0].set(1e5)
    silent = jaxamp.amp(loss, compute_dtype=F16, overflow_check=False)
    assert np.isfinite(float(silent(bad, xs)))
    assert np.isnan(float(amp_loss(bad, xs)))


def _layer_h(h, w):
    return _layer(h, w)[0]


def _stack_scan(body, h, p, **kw):
    return lax.scan(body, h, p, **kw)[0]


def _micro_steps(h, w):  # a scan inside the checkpointed layer
    return lax.scan(lambda c, _: (_layer_h(c, w) / 4, None), h, None, 2)[0], None


SCAN_FORMS = {
    "reverse": lambda p, h: _stack_scan(jax.checkpoint(_layer), h, p, reverse=True),
    "unroll": lambda p, h: _stack_scan(jax.checkpoint(_layer), h, p, unroll=2),
    "dots saveable": lambda p, h: _stack_scan(
        jax.checkpoint(_layer, policy=jax.checkpoint_policies.dots_saveable), h, p
    ),
    "jit in checkpoint": lambda p, h: _stack_scan(
        jax.checkpoint(jax.jit(_layer)), h, p
    ),
    "lax.map": lambda p, h: lax.map(jax.checkpoint(lambda w: _layer_h(h, w)), p),
    "nested scan": lambda p, h: _stack_scan(jax.checkpoint(_micro_steps), h, p),
}


# Per compute dtype: the residual stream's scale (float16: small enough that no
# matmul output passes 65504 in the four layers), the static loss scale that keeps
# float16 gradients above underflow, and the bound against float32.
SCAN_FORM_DTYPES = {
    "bfloat16": (BF16, 1.0, 1.0, 3e-2),
    "float16": (F16, 1 / 8, 2.0**12, 5e-3),
}


@functools.cache
def _float32_scan_form_grad(form):
    """The float32 reference gradient of a scan form, compiled once for both
    compute dtypes (the stream's scale and the loss scale are arguments)."""

    def scaled_loss(p, h, loss_scale):
        return jnp.mean(jnp.square(SCAN_FORMS[form](p, h) / 100.0)) * loss_scale

    return jax.jit(jax.grad(scaled_loss))


@pytest.mark.parametrize("dtype_name", sorted(SCAN_FORM_DTYPES))
@pytest.mark.parametrize("form", sorted(SCAN_FORMS))
def test_casting_before_the_loop_in_other_scan_forms(form, dtype_name):
    """Reverse and unrolled scans, a checkpoint policy, a jit inside the
    checkpoint, ``lax.map`` and a scan nested in the checkpointed layer: the
    stacked weights enter the loop in the compute dtype (float16 with its
    overflow check on), and the gradients equal those with the casts left in
    the loop (CPU may keep excess float32 precision there: 5e-3) and float32's
    within the compute dtype's tolerance."""
    form_fn = SCAN_FORMS[form]
    dtype, h_scale, loss_scale, tol = SCAN_FORM_DTYPES[dtype_name]
    h0 = H0 * h_scale

    def loss(p, h):
        return jnp.mean(jnp.square(form_fn(p, h) / 100.0))

    def first_scan_xs(fn):
        return _xs_dtypes(_scan_eqns(jax.make_jaxpr(fn)(STACK, h0))[0])

    def grad(fn):
        return jax.jit(jax.grad(lambda p, h: fn(p, h) * loss_scale))(STACK, h0)

    hoisted = jaxamp.amp(loss, compute_dtype=dtype)
    assert first_scan_xs(hoisted) == [dtype, F32, dtype]  # down, gain, up
    grads = grad(hoisted)

    in_loop = _amp.ablated(choices=["loop_casts"])(loss, compute_dtype=dtype)
    assert first_scan_xs(in_loop) == [F32, F32, F32]
    grads_in_loop = grad(in_loop)

    with jax.default_matmul_precision("highest"):
        ref = _float32_scan_form_grad(form)(STACK, h0, loss_scale)
    assert tree_dtypes(grads) == [F32] * 3
    assert rel_l2(grads, grads_in_loop) < 5e-3
    assert rel_l2(grads, ref) < tol


# --- weights quantized once, before the loop (issue 47: FP8 that pays) ---

FP8_ALL = jaxamp.quant.fp8_policy(size_rule=None)
E4M3 = np.dtype(jnp.float8_e4m3fn)


def _weight_quantizations(closed):
    """Prepared-operand calls (an 8-bit rule's quantizations) of arrays shaped
    like a stacked weight or one layer's slice, each counted as often as it
    runs in one step (loop bodies weighted by their trip counts)."""
    shapes = {a.shape for a in (STACK["up"], STACK["down"])}
    shapes |= {s[1:] for s in shapes}
    return sum(
        w
        for e, w in jaxamp.tools.iter_equations(closed)
        if is_prepare(e) and e.invars and e.invars[0].aval.shape in shapes
    )


@pytest.mark.parametrize("form", sorted(SCAN_FORMS) + ["no checkpoint"])
def test_fp8_weights_are_quantized_once_per_step_before_the_loop(form):
    """Every checkpointed scan form: the stacked weights are quantized before the loop,
    each layer with its own scale (E4M3 stacks and (layers,) float32 scales
    among the loop's inputs), once per step (forward, recompute and backward
    read them); the gradients are bit for bit those with the quantization
    left in the loop, and within FP8's tolerance of float32's."""
    form_fn = SCAN_FORMS.get(form, lambda p, h: _stack_scan(_layer, h, p))

    def loss(p, h):
        return jnp.mean(jnp.square(form_fn(p, h) / 100.0))

    hoisted = jaxamp.amp(loss, compute_dtype=BF16, amp_policy=FP8_ALL)
    in_loop = _amp.ablated(choices=["loop_quantization"])(
        loss, compute_dtype=BF16, amp_policy=FP8_ALL
    )
    # lax.map's down-projection feeds the loss: it runs in bf16 (the policy's
    # quantize_last_matmul=False), so one weight is quantized there.
    n = 1 if form == "lax.map" else 2
    # without the hoist: once per layer (per micro-step in the nested scan), in
    # the forward pass and again in a checkpoint's recompute
    assert _weight_quantizations(jax.make_jaxpr(in_loop)(STACK, H0)) >= n * L_
    if form == "no checkpoint":
        # float32 weights are cast in the loop (no bf16 copy among the
        # residuals, _scan_hoist.loop_casts), so the cast and the quantization
        # of each layer's slice stay there, once per layer
        assert _weight_quantizations(jax.make_jaxpr(hoisted)(STACK, H0)) == n * L_
        return
    assert _weight_quantizations(jax.make_jaxpr(hoisted)(STACK, H0)) == n
    scan = _scan_eqns(jax.make_jaxpr(hoisted)(STACK, H0))[0]
    n_consts, n_carry = _compat.scan_carry_range(scan.params)
    loop_in = [v.aval for v in scan.invars]
    stacked = [a.shape for a in loop_in if a.dtype == E4M3]
    want = [STACK["up"].shape, STACK["down"].shape][:n]
    assert sorted(stacked) == sorted(want)
    assert [a.shape for a in loop_in if a.dtype == F32 and a.ndim == 1] == [(L_,)] * n

    grads = jax.jit(jax.grad(hoisted))(STACK, H0)
    same = jax.jit(jax.grad(in_loop))(STACK, H0)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(same)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with jax.default_matmul_precision("highest"):
        ref = jax.grad(loss)(STACK, H0)
    assert tree_dtypes(grads) == [F32] * 3
    assert rel_l2(grads, ref) < 0.2  # E5M2 gradients: measured 0.10 to 0.15


def test_fp8_weight_read_by_every_iteration_is_quantized_once():
    """A weight closed over by the loop (an RNN cell's, a scan const) is
    quantized once, before the loop, not once per iteration."""
    w = STACK["up"][0] @ STACK["down"][0]  # (D, D)

    def loss(w, h):
        def cell(c, _):
            return jnp.tanh(c @ w) * 30.0, None

        return jnp.mean(jnp.square(lax.scan(cell, h, None, length=6)[0]))

    hoisted = jaxamp.amp(loss, compute_dtype=BF16, amp_policy=FP8_ALL)
    in_loop = _amp.ablated(choices=["loop_quantization"])(
        loss, compute_dtype=BF16, amp_policy=FP8_ALL
    )

    def quantizations(fn):
        closed = jax.make_jaxpr(fn)(w, H0)
        return sum(
            n
            for e, n in jaxamp.tools.iter_equations(closed)
            if is_prepare(e) and e.invars and e.invars[0].aval.shape == w.shape
        )

    assert quantizations(hoisted) == 1 and quantizations(in_loop) == 6
    g, g_loop = (jax.jit(jax.grad(f))(w, H0) for f in (hoisted, in_loop))
    np.testing.assert_array_equal(np.asarray(g), np.asarray(g_loop))


# --------------------------------------------------------------------------------
# One registration per higher-order primitive: a toy primitive of the test's own,
# registered once, gets the value facts, find_overflows and FLOP counts.


def _toy_call():
    """A call-like higher-order primitive: its ``jaxpr`` param is a closed
    sub-jaxpr that takes the operands and gives the outputs."""
    prim = Primitive("jaxamp_test_toy_call")
    prim.multiple_results = True

    def impl(*xs, jaxpr):
        return jaxpr_as_fun(jaxpr)(*xs)

    prim.def_impl(impl)
    prim.def_abstract_eval(lambda *avals, jaxpr: [v.aval for v in jaxpr.jaxpr.outvars])
    mlir.register_lowering(prim, mlir.lower_fun(impl, multiple_results=True))
    return prim


TOY = _toy_call()


@pytest.fixture
def toy_registered():
    """The toy's one registration: its rewrite rule and its description."""
    jaxamp.extend.register_higher_order(TOY.name, describe=_higher_order.describe_call)(
        _higher_order.rewrite_subjaxprs
    )
    yield TOY
    _higher_order.unregister_higher_order(TOY.name)


@pytest.fixture
def toy_rule_only():
    """The toy with a rewrite rule but no description (opaque to the passes)."""
    jaxamp.extend.register_higher_order(TOY.name)(_higher_order.rewrite_subjaxprs)
    yield TOY
    _higher_order.unregister_higher_order(TOY.name)


# Activations in the hundreds, pre-rounded to bfloat16.
W1 = round_bf16(jnp.asarray(np.linspace(-3, 3, 32).reshape(4, 8), jnp.float32))
W2 = round_bf16(jnp.asarray(np.linspace(2, -2, 32).reshape(8, 4), jnp.float32))
XA = round_bf16(jnp.asarray(np.linspace(-200, 300, 8).reshape(2, 4), jnp.float32))


def _mlp(x, w1, w2):
    return jnp.tanh(x @ w1 / 100.0) @ w2


def _toy_loss(w1, w2, x):
    body = jax.make_jaxpr(_mlp)(x, w1, w2)
    (y,) = TOY.bind(x, w1, w2, jaxpr=body)
    return jnp.mean(jnp.square(y))


def _jit_loss(w1, w2, x):
    return jnp.mean(jnp.square(jax.jit(_mlp)(x, w1, w2)))


def _dot_out_dtypes(fn):
    closed = jax.make_jaxpr(jaxamp.amp(fn, compute_dtype=BF16))(W1, W2, XA)
    return [
        (*(v.aval.dtype for v in e.invars), e.outvars[0].aval.dtype)
        for e in eqns(closed)
        if e.primitive.name == "dot_general"
    ]


def test_toy_primitive_gets_value_facts(toy_registered):
    # The last matmul feeds the loss (the tail): its float32 result is kept,
    # exactly as through jax.jit; the first one reaches a matmul: bfloat16.
    dots = _dot_out_dtypes(_toy_loss)
    assert dots == [(BF16, BF16, BF16), (BF16, BF16, F32)]
    assert dots == _dot_out_dtypes(_jit_loss)
    amp_loss = jaxamp.amp(_toy_loss, compute_dtype=BF16)
    np.testing.assert_allclose(amp_loss(W1, W2, XA), _toy_loss(W1, W2, XA), rtol=2e-2)
    np.testing.assert_allclose(
        jax.jit(amp_loss)(W1, W2, XA), _toy_loss(W1, W2, XA), rtol=2e-2
    )


def test_toy_primitive_without_description_is_opaque(toy_rule_only):
    # No description: the facts of the loss do not reach into the body, whose
    # outputs are taken to reach a matmul (the last product gives bfloat16).
    assert _dot_out_dtypes(_toy_loss) == [(BF16, BF16, BF16), (BF16, BF16, BF16)]


def _square_in_toy(w, x):
    body = jax.make_jaxpr(lambda a, b: jnp.square(a @ b))(x, w)
    (y,) = TOY.bind(x, w, jaxpr=body)
    return y.sum()


SQUARE_IN_F16 = {**jaxamp.default_amp_policy, "square": jaxamp.use_compute_precision}


def test_find_overflows_sees_inside_the_toy_primitive(toy_registered):
    w, x = jnp.full((2, 2), 300.0), jnp.ones((1, 2))  # (x @ w)^2 = 360000
    (found,) = jaxamp.find_overflows(_square_in_toy, w, x, amp_policy=SQUARE_IN_F16)
    assert found.primitive == "square" and found.dtype == F16
    assert "test_higher_order.py" in found.source and "<lambda>" in found.source
    assert found.max_input == 600.0 and found.count == 1


def test_find_overflows_binds_an_undescribed_primitive(toy_rule_only):
    # Bound as a whole: its float32 outputs are not low precision, nothing named.
    w, x = jnp.full((2, 2), 300.0), jnp.ones((1, 2))
    assert jaxamp.find_overflows(_square_in_toy, w, x, amp_policy=SQUARE_IN_F16) == []


def test_flops_are_counted_inside_the_toy_primitive(toy_registered):
    closed = jax.make_jaxpr(jaxamp.amp(_toy_loss, compute_dtype=BF16))(W1, W2, XA)
    # Two products of 2 * (2 x 4 x 8) FLOPs, both with bfloat16 operands.
    assert jaxamp.tools.matmul_flops_by_dtype(closed) == {
        "bfloat16": 2 * 2 * 2 * 4 * 8.0
    }
    assert jaxamp.tools.low_precision_flop_share(closed) == 1.0
    ref = jax.make_jaxpr(jaxamp.amp(_jit_loss, compute_dtype=BF16))(W1, W2, XA)
    assert jaxamp.tools.matmul_flops_by_dtype(
        ref
    ) == jaxamp.tools.matmul_flops_by_dtype(closed)


def test_register_higher_order_checks_its_description():
    with pytest.raises(TypeError, match=r"register_higher_order\(describe=...\)"):
        jaxamp.extend.register_higher_order("my_call", describe="call")
    with pytest.raises(TypeError, match=r"register_higher_order\(run=...\)"):
        jaxamp.extend.register_higher_order("my_call", run=1)


def test_the_loop_carry_rule_is_registered_with_the_loop():
    assert jaxamp.default_amp_policy["scan"] is _rules.narrow_bfloat16_carries


# --------------------------------------------------------------------------------
# One registration per higher-order primitive, read where it is needed: a region
# primitive of the test's own (a sub-jaxpr in its params; grad works through it,
# the values its derivative needs are outputs of the region itself), registered
# once, is rewritten by amp, seen through by the reports and handled by a policy
# built before it was registered.

# Built at import, before any registration of the region primitive below.
INT8_BEFORE = jaxamp.int8_policy(size_rule=None)


def _region_primitive():
    prim = Primitive("jaxamp_test_region")
    prim.multiple_results = True

    def impl(*xs, jaxpr):
        return jaxpr_as_fun(jaxpr)(*xs)

    def jvp(primals, tangents, *, jaxpr):
        # The region runs the body's linearization: its outputs and the
        # residuals its derivative needs; the tangents are computed outside.
        avals = [
            jax.ShapeDtypeStruct(jnp.shape(p), jnp.result_type(p)) for p in primals
        ]
        lin = lambda *xs: jax.linearize(jaxpr_as_fun(jaxpr), *xs)
        known, shape = jax.make_jaxpr(lin, return_shape=True)(*avals)
        tree = jax.tree_util.tree_structure(shape)
        outs, push = jax.tree_util.tree_unflatten(
            tree, prim.bind(*primals, jaxpr=known)
        )
        return outs, push(*map(ad.instantiate_zeros, tangents))

    prim.def_impl(impl)
    prim.def_abstract_eval(lambda *avals, jaxpr: [v.aval for v in jaxpr.jaxpr.outvars])
    mlir.register_lowering(prim, mlir.lower_fun(impl, multiple_results=True))
    ad.primitive_jvps[prim] = jvp
    return prim


REGION = _region_primitive()


def _region_rule(eqn, invals, ctx):
    """The region's operands enter in the dtypes of its policy entry; its body
    is rewritten as a plain call's, dtypes flowing through."""
    entry = ctx.policy.lookup(eqn.primitive, ctx.scopes)
    result = entry(ctx.compute_dtype, [v.aval.dtype for v in eqn.invars], *invals)
    invals, _ = _loop.check_rule_result(result, eqn.primitive, entry, len(invals))
    return _higher_order._call(eqn, list(invals), ctx)


@pytest.fixture
def region():
    """The region primitive's one registration, removed afterwards."""
    jaxamp.extend.register_higher_order(
        REGION.name,
        describe=functools.partial(_structure.describe_call, dtypes_flow=True),
        default_rule=jaxamp.use_compute_precision,
    )(_region_rule)
    yield REGION
    _higher_order.unregister_higher_order(REGION.name)


def _region_body(x, w1, w2):
    with jax.named_scope("inside_region"):
        h = x @ w1  # its output is a residual: h * tanh(h) needs it
    return (h * jnp.tanh(h / 100.0)) @ w2


def _region_loss(p, x):
    body = jax.make_jaxpr(_region_body)(x, p["w1"], p["w2"])
    (y,) = REGION.bind(x, p["w1"], p["w2"], jaxpr=body)
    return jnp.mean(jnp.square(y / 100.0))


RP = {"w1": W1, "w2": W2}


def _region_eqn(fn, policy=jaxamp.default_amp_policy):
    amp_fn = jaxamp.amp(fn, compute_dtype=BF16, amp_policy=policy)
    closed = jax.make_jaxpr(amp_fn)(RP, XA)
    (eqn,) = [e for e in eqns(closed) if e.primitive is REGION]
    return eqn


def test_amp_rewrites_inside_a_registered_region(region):
    eqn = _region_eqn(_region_loss)
    # Its operands in the registered default rule's dtype, its products bf16.
    assert [v.aval.dtype for v in eqn.invars] == [BF16, BF16, BF16]
    assert dot_dtypes(eqn.params["jaxpr"]) == [(BF16, BF16), (BF16, BF16)]
    amp_loss = jaxamp.amp(_region_loss, compute_dtype=BF16)
    np.testing.assert_allclose(amp_loss(RP, XA), _region_loss(RP, XA), rtol=3e-2)
    grads, ref = jax.grad(amp_loss)(RP, XA), jax.grad(_region_loss)(RP, XA)
    assert tree_dtypes(grads) == tree_dtypes(ref)
    assert rel_l2(grads, ref) < 3e-2


def test_reports_see_through_a_registered_region(region):
    memory = jaxamp.memory_report(
        _region_loss, RP, XA, compute_dtype=BF16, compile=False
    )
    (row,) = [r for r in memory.rows if r.primitive == "dot_general"]
    assert row.dtype == "bfloat16" and "inside_region" in row.scope
    assert row.shape == (2, 8)
    precision = jaxamp.precision_report(_region_loss, RP, XA, compute_dtype=BF16)
    inside = [r for r in precision.records if "inside_region" in r.scope]
    assert [(r.primitive, r.format) for r in inside] == [("dot_general", "bfloat16")]


def test_a_region_without_description_is_one_site_of_the_precision_report():
    jaxamp.extend.register_higher_order(REGION.name)(_region_rule)
    try:
        precision = jaxamp.precision_report(_region_loss, RP, XA, compute_dtype=BF16)
    finally:
        _higher_order.unregister_higher_order(REGION.name)
    assert not [r for r in precision.records if "inside_region" in r.scope]
    assert "jaxamp_test_region" in [r.primitive for r in precision.records]


def _int8_products(jaxpr):
    return [
        e
        for e in eqns(jaxpr)
        if e.primitive.name == "dot_general"
        and [v.aval.dtype for v in e.invars] == [np.dtype(jnp.int8)] * 2
    ]


def test_an_int8_policy_built_before_the_registration_handles_the_region(region):
    assert REGION.name not in INT8_BEFORE and REGION.name in jaxamp.default_amp_policy
    eqn = _region_eqn(_region_loss, INT8_BEFORE)
    # The registered default rule applies (amp_default would keep float32) and
    # the first product (not the one feeding the loss) runs in int8.
    assert [v.aval.dtype for v in eqn.invars] == [BF16, BF16, BF16]
    (product,) = _int8_products(eqn.params["jaxpr"])
    assert [v.aval.shape for v in product.invars] == [(2, 4), (4, 8)]
    # The import-time int8_amp_policy too (its size rule skips such products).
    eqn = _region_eqn(_region_loss, jaxamp.int8_amp_policy)
    assert [v.aval.dtype for v in eqn.invars] == [BF16, BF16, BF16]
    assert _int8_products(eqn.params["jaxpr"]) == []


def test_a_policy_written_from_scratch_keeps_its_own_default(region):
    # No copy of the default table: its "amp_default" rule decides, as for
    # every primitive it does not name.
    scratch = {"amp_default": jaxamp.use_original_precision}
    eqn = _region_eqn(_region_loss, scratch)
    assert [v.aval.dtype for v in eqn.invars] == [F32, F32, F32]
    policy = _lookup.AmpPolicy(INT8_BEFORE)
    assert policy.lookup(REGION, ()) is jaxamp.use_compute_precision
    assert _lookup.AmpPolicy(scratch).lookup(REGION, ()) is not policy.lookup(
        REGION, ()
    )


def test_unregistering_leaves_no_trace(region):
    _higher_order.unregister_higher_order(REGION.name)
    try:
        assert REGION.name not in jaxamp.default_amp_policy
        assert REGION.name not in _higher_order.higher_order_rules
        eqn = _region_eqn(_region_loss)  # unknown again: runs unchanged
        assert [v.aval.dtype for v in eqn.invars] == [F32, F32, F32]
        assert dot_dtypes(eqn.params["jaxpr"]) == [(F32, F32), (F32, F32)]
        with pytest.raises(ValueError, match="no registration of"):
            _higher_order.unregister_higher_order(REGION.name)
    finally:  # the fixture removes it once more
        jaxamp.extend.register_higher_order(REGION.name)(_region_rule)


def test_registering_a_builtin_again_is_undone_by_unregistering():
    builtin = _structure.registered("scan")
    log = []

    def logged(eqn, invals, ctx):
        log.append(eqn.primitive.name)
        return builtin.rule(eqn, invals, ctx)

    jaxamp.extend.register_higher_order("scan")(logged)
    try:
        entry = _structure.registered("scan")
        # A registration without a description keeps the replaced one's.
        assert entry.describe is builtin.describe
        assert entry.default_rule is builtin.default_rule
        jax.make_jaxpr(jaxamp.amp(CASES["scan"], compute_dtype=BF16))(W, X)
        assert log == ["scan"]
    finally:
        _higher_order.unregister_higher_order("scan")
    assert _structure.registered("scan") is builtin
    assert jaxamp.default_amp_policy["scan"] is _rules.narrow_bfloat16_carries


@pytest.mark.parametrize(
    "word", ["jit", "pjit", "closed_call", "remat2", "custom_vjp_call", "shard_map"]
)
def test_call_primitives_are_named_only_where_they_are_registered(word):
    """The walk, the reports, the chunked optimizer and the attention matcher
    read the registry (``_base/_structure.py``) for what a call is."""
    root = Path(jaxamp.__file__).parent
    naming = sorted(
        str(p.relative_to(root))
        for p in root.rglob("*.py")
        if f'"{word}"' in p.read_text() or f"'{word}'" in p.read_text()
    )
    assert set(naming) <= {"_walk/_higher_order.py", "_compat.py"}, naming


# The rewrite cache keys on the policy's value (AmpPolicy.value_key): amp
# wrapping the same jitted layer again with an equal policy reuses the rewrite.
@jax.custom_jvp
def _signed_relu(x):
    return jnp.maximum(x, 0.0)


@_signed_relu.defjvp
def _signed_relu_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    # sign appears only in this rule, traced under jax.grad.
    return _signed_relu(x), t * (jnp.sign(x) + 1.0) / 2.0


def _layer_loss():
    """A fresh jitted layer (its own traced body) and a loss calling it."""

    @jax.jit
    def layer(w, x):
        with jax.named_scope("mlp"):
            return _signed_relu(x @ w)

    return lambda w, x: jnp.mean(layer(w, x) ** 2)


def _equal_policy():
    # A new mapping each time, equal in value, with a nested scope policy.
    return {**jaxamp.default_amp_policy, "mlp": {**jaxamp.default_amp_policy}}


def _cache_entries() -> int:
    return sum(len(v) for v in _higher_order._REWRITES.values())


def test_rewrapping_with_an_equal_policy_reuses_the_rewrite():
    import tracemalloc

    loss, w, x = _layer_loss(), jnp.ones((64, 64)) / 8, jnp.ones((8, 64))

    def wrap_and_trace():
        f = jaxamp.amp(loss, compute_dtype=BF16, amp_policy=_equal_policy())
        return jax.make_jaxpr(jax.grad(f))(w, x)

    before = _cache_entries()
    first = wrap_and_trace()
    entries = _cache_entries()
    assert entries > before  # the layer's body was rewritten
    tracemalloc.start()
    try:
        start = tracemalloc.get_traced_memory()[0]
        for _ in range(99):
            again = wrap_and_trace()
        grown = tracemalloc.get_traced_memory()[0] - start
    finally:
        tracemalloc.stop()
    assert _cache_entries() == entries
    # One rewrite per (sub-jaxpr, policy value): a 64-wide layer's rewrite
    # kept per wrap would add about 75 KiB each.
    assert grown < 1.5 * 2**20, grown
    assert str(again) == str(first)
    # An unequal policy is a rewrite of its own.
    full = {**jaxamp.default_amp_policy, "mlp": jaxamp.use_full_precision}
    jax.make_jaxpr(jax.grad(jaxamp.amp(loss, compute_dtype=BF16, amp_policy=full)))(
        w, x
    )
    assert _cache_entries() > entries


@pytest.mark.parametrize(
    "key, warns",
    [
        ("mlp", False),  # a scope seen only inside the jitted body
        ("sign", False),  # a primitive seen only in a jvp rule in that body
        ("mlpp", True),  # a typo: each amp warns about its own policy
    ],
)
def test_a_reused_rewrite_replays_what_the_policy_was_asked(key, warns):
    import warnings

    loss, w, x = _layer_loss(), jnp.ones((8, 8)) / 8, jnp.ones((4, 8))
    for _ in range(2):  # the second wrap reuses the first one's rewrites
        policy = {**jaxamp.default_amp_policy, key: jaxamp.use_full_precision}
        f = jaxamp.amp(loss, compute_dtype=BF16, amp_policy=policy)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            jax.grad(f)(w, x)
        unmatched = [m for m in caught if "matched no primitive" in str(m.message)]
        assert bool(unmatched) == warns, [str(m.message) for m in unmatched]


def test_policy_value_key_compares_the_entries_as_built():
    default = jaxamp.default_amp_policy
    inner = {**default}
    a = _lookup.AmpPolicy({**default, "mlp": inner})
    b = _lookup.AmpPolicy({**default, "mlp": jaxamp.ScopePolicy(dict(inner))})
    assert a.value_key == b.value_key and hash(a.value_key) == hash(b.value_key)
    inner["attn"] = jaxamp.use_full_precision  # a keeps what it was built from
    assert a.value_key == b.value_key
    assert _lookup.AmpPolicy({**default, "mlp": inner}).value_key != a.value_key

    class Unhashable:
        __hash__ = None

        def __call__(self, *args, **params):
            return jaxamp.use_full_precision(*args, **params)

    odd = _lookup.AmpPolicy({**default, "exp": Unhashable()})
    assert odd.value_key is odd  # compared by identity
