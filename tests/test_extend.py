"""Tests of the extension API (jaxamp/extend): a format, a higher-order call, a
loop and a context rule added with ``jaxamp.extend`` alone, as a library
outside jaxamp adds them."""

import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import Primitive, jaxpr_as_fun
from jax.interpreters import mlir

import jaxamp
from jaxamp import extend

BF16, F16, F32 = (np.dtype(t) for t in (jnp.bfloat16, jnp.float16, jnp.float32))
E3M4 = np.dtype(jnp.float8_e3m4)


def test_extend_holds_the_registries_and_their_types():
    names = {
        "QFormat",
        "RuleContext",
        "Structure",
        "SubJaxpr",
        "describe_call",
        "register_format",
        "register_higher_order",
        "rewrite_jaxpr",
        "rewrite_subjaxprs",
        "unregister_format",
        "unregister_higher_order",
    }
    assert set(extend.__all__) == names
    assert list(extend.__all__) == sorted(extend.__all__)
    for name in extend.__all__:
        assert inspect.getdoc(getattr(extend, name)), name
    assert "extend" in jaxamp.__all__


# An 8-bit format ------------------------------------------------------------


@pytest.fixture
def e3m4():
    fmt = extend.register_format("ext_e3m4", jnp.float8_e3m4, label="e3m4")
    yield fmt
    extend.unregister_format("ext_e3m4")


def _mlp(p, x):
    with jax.named_scope("mlp"):
        h = jax.nn.gelu(x @ p["w1"])
    return jnp.mean(jnp.tanh(h @ p["w2"]))  # the tanh's input is stored


def _mlp_params():
    k = jax.random.split(jax.random.key(0), 3)
    p = {
        "w1": jax.random.normal(k[0], (64, 128)) / 8.0,
        "w2": jax.random.normal(k[1], (128, 64)) / 11.0,
    }
    return p, jax.random.normal(k[2], (128, 64))


def test_a_format_registered_through_extend_reaches_policies_and_residuals(e3m4):
    assert isinstance(e3m4, extend.QFormat)
    assert (e3m4.dtype, e3m4.bound, e3m4.scope) == (E3M4, 15.5, "jaxamp_e3m4_matmul")
    p, x = _mlp_params()
    policy = jaxamp.fp8_policy(
        format="ext_e3m4", size_rule=None, quantize_last_matmul=True
    )
    loss8 = jaxamp.amp(
        _mlp, compute_dtype=BF16, amp_policy=policy, residual_dtype="ext_e3m4"
    )
    closed = jax.make_jaxpr(jax.value_and_grad(loss8))(p, x)
    operands = {
        v.aval.dtype
        for e, _ in jaxamp.tools.iter_equations(closed)
        if e.primitive.name == "dot_general"
        for v in e.invars
    }
    assert E3M4 in operands
    memory = jaxamp.memory_report(
        _mlp, p, x, compute_dtype=BF16, residual_dtype="ext_e3m4", compile=False
    )
    assert "ext_e3m4" in memory.by("dtype")
    value, grads = jax.jit(jax.value_and_grad(loss8))(p, x)
    assert np.isfinite(float(value))
    assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))


def test_an_unregistered_format_is_refused(e3m4):
    extend.unregister_format("ext_e3m4")
    with pytest.raises(ValueError, match="not a registered 8-bit format"):
        jaxamp.fp8_policy(format="ext_e3m4")
    extend.register_format("ext_e3m4", jnp.float8_e3m4, label="e3m4")  # fixture's


# A higher-order call and a loop ------------------------------------------------


def _primitive(name, impl, out_avals):
    prim = Primitive(name)
    prim.multiple_results = True
    prim.def_impl(impl)
    prim.def_abstract_eval(out_avals)
    mlir.register_lowering(prim, mlir.lower_fun(impl, multiple_results=True))
    return prim


def _call_impl(*xs, jaxpr):
    return jaxpr_as_fun(jaxpr)(*xs)


def _repeat_impl(w, c, *, jaxpr, n):
    for _ in range(n):
        (c,) = jaxpr_as_fun(jaxpr)(w, c)
    return [c]


# call(*xs, jaxpr): the body takes the operands and gives the outputs.
CALL = _primitive(
    "jaxamp_test_extend_call",
    _call_impl,
    lambda *avals, jaxpr: [v.aval for v in jaxpr.jaxpr.outvars],
)
# repeat(w, c, jaxpr, n): c = body(w, c), n times.
REPEAT = _primitive(
    "jaxamp_test_extend_repeat", _repeat_impl, lambda w, c, *, jaxpr, n: [c]
)


def _describe_repeat(eqn):
    body = extend.SubJaxpr(eqn.params["jaxpr"], (0, 1), (0,), carries=((0, 1),))
    return extend.Structure((body,), trips=eqn.params["n"])


def _run_repeat(eqn, invals, eval_sub):
    w, c = invals
    for _ in range(eqn.params["n"]):
        (c,) = eval_sub(eqn.params["jaxpr"], [w, c])
    return [c]


@pytest.fixture
def registered():
    extend.register_higher_order(
        CALL.name, describe=functools.partial(extend.describe_call, dtypes_flow=True)
    )(extend.rewrite_subjaxprs)
    extend.register_higher_order(
        REPEAT.name, describe=_describe_repeat, run=_run_repeat
    )(extend.rewrite_subjaxprs)
    yield
    extend.unregister_higher_order(CALL.name, REPEAT.name)


W = jnp.asarray(np.linspace(-1, 1.5, 64).reshape(8, 8), jnp.float32)
C0 = jnp.asarray(np.linspace(0.1, 0.9, 8).reshape(1, 8), jnp.float32)
N = 5


def _cell(w, c):
    return jnp.tanh(c @ w)


def _loss(w, c):
    (h,) = CALL.bind(w, c, jaxpr=jax.make_jaxpr(_cell)(w, c))
    (c,) = REPEAT.bind(w, h, jaxpr=jax.make_jaxpr(_cell)(w, h), n=N)
    return jnp.sum(c)


def _flops(fn):
    closed = jax.make_jaxpr(jaxamp.amp(fn, compute_dtype=BF16))(W, C0)
    return jaxamp.tools.matmul_flops_by_dtype(closed)


def test_registered_call_and_loop_are_rewritten_and_counted(registered):
    # One product in the call, one per trip of the loop, each (1x8)x(8x8).
    assert _flops(_loss) == {"bfloat16": 2 * 8 * 8 * (1 + N)}
    amp_loss = jaxamp.amp(_loss, compute_dtype=BF16)
    np.testing.assert_allclose(amp_loss(W, C0), _loss(W, C0), rtol=2e-2)
    np.testing.assert_allclose(jax.jit(amp_loss)(W, C0), _loss(W, C0), rtol=2e-2)


def test_unregistered_primitives_run_unchanged(registered):
    extend.unregister_higher_order(CALL.name, REPEAT.name)
    try:
        # Opaque: the bodies stay float32, each counted once.
        assert _flops(_loss) == {"float32": 2 * 8 * 8 * 2}
    finally:
        extend.register_higher_order(
            CALL.name,
            describe=functools.partial(extend.describe_call, dtypes_flow=True),
        )(extend.rewrite_subjaxprs)
        extend.register_higher_order(
            REPEAT.name, describe=_describe_repeat, run=_run_repeat
        )(extend.rewrite_subjaxprs)


def _growing(w, c):
    (c,) = REPEAT.bind(w, c, jaxpr=jax.make_jaxpr(lambda w, c: c @ w)(w, c), n=3)
    return jnp.sum(c)


def test_find_overflows_runs_a_registered_loop_trip_by_trip(registered):
    # c grows 300x per trip: float16 overflows on the second trip only.
    w = jnp.eye(8, dtype=jnp.float32) * 300.0
    (found,) = jaxamp.find_overflows(_growing, w, jnp.ones((1, 8)))
    assert found.primitive == "dot_general" and found.dtype == F16


# A rule that reads its context -----------------------------------------------


def test_a_context_rule_is_given_a_rule_context():
    seen = []

    @jaxamp.rules.CastRule.with_context
    def tanh_rule(ctx: extend.RuleContext, *invars, **params):
        seen.append(ctx)
        return jaxamp.use_compute_precision(
            ctx.compute_dtype, ctx.original_dtypes, *invars, **params
        )

    policy = {**jaxamp.default_amp_policy, "tanh": tanh_rule}
    jax.make_jaxpr(jaxamp.amp(_cell, compute_dtype=BF16, amp_policy=policy))(W, C0)
    assert seen and all(isinstance(c, extend.RuleContext) for c in seen)
    assert seen[0].compute_dtype == BF16 and seen[0].original_dtypes == (F32,)
