"""Tests of the equation loop (jaxamp/_walk/_loop.py): policy lookup order,
cast deduplication, values that are never cast, and rule-result checks."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxamp
from jaxamp import _amp
from jaxamp._policy._lookup import AmpPolicy

BF16, F16, F32 = np.dtype(jnp.bfloat16), np.dtype(jnp.float16), np.dtype(jnp.float32)


def eqns(closed):
    """All equations of a jaxpr and of its sub-jaxprs, depth first."""
    return (e for e, _ in jaxamp.tools.iter_equations(closed))


def out_dtype(closed, name):
    return [e.outvars[0].aval.dtype for e in eqns(closed) if e.primitive.name == name]


def in_dtype(closed, name):
    return [e.invars[0].aval.dtype for e in eqns(closed) if e.primitive.name == name]


X = jnp.linspace(-1, 1, 12, dtype=jnp.float32).reshape(3, 4)
W = jnp.linspace(-1, 1, 20, dtype=jnp.float32).reshape(4, 5)


def test_policy_key_errors():
    with pytest.raises(TypeError, match="neither a primitive"):
        AmpPolicy({3: jaxamp.use_compute_precision})
    with pytest.raises(TypeError, match=r"amp_policy\['exp'\] must be a rule"):
        AmpPolicy({"exp": "float32"})
    with pytest.raises(TypeError, match="must be a mapping"):
        AmpPolicy([("exp", jaxamp.use_full_precision)])


def test_lookup_order_scope_then_primitive_then_name_then_default():
    full, low, orig = (
        jaxamp.use_full_precision,
        jaxamp.use_compute_precision,
        jaxamp.use_original_precision,
    )
    pol = AmpPolicy(
        {"outer": full, "inner": orig, jax.lax.exp_p: low, "exp": orig, "tanh": low}
    )
    exp_p, tanh_p, sin_p = jax.lax.exp_p, jax.lax.tanh_p, jax.lax.sin_p
    assert pol.lookup(exp_p, ("outer", "inner")) is full  # outermost scope wins
    assert pol.lookup(exp_p, ("x", "inner")) is orig
    assert pol.lookup(exp_p, ()) is low  # primitive object before name
    assert pol.lookup(tanh_p, ()) is low  # then name
    assert pol.lookup(sin_p, ()) is jaxamp.rules.follow_compute_precision  # default
    assert pol.lookup(sin_p, ("amp_stop",)) is orig  # amp_stop always known


def test_named_scope_matches_whole_components_only():
    def f(x, w):
        with jax.named_scope("block"), jax.named_scope("eqx.nn.LinearX"):
            a = x @ w
        with jax.named_scope("block/eqx.nn.Linear"):
            b = x @ w
        return a, b

    policy = {**jaxamp.default_amp_policy, "eqx.nn.Linear": jaxamp.use_full_precision}
    closed = jax.make_jaxpr(jaxamp.amp(f, compute_dtype=BF16, amp_policy=policy))(X, W)
    assert in_dtype(closed, "dot_general") == [BF16, F32]


def test_one_parameter_used_by_many_matmuls_is_cast_once():
    def f(w, x):
        return (x @ w).sum() + (jnp.tanh(x) @ w).sum() + ((2 * x) @ w).sum()

    closed = jax.make_jaxpr(jaxamp.amp(f, compute_dtype=BF16))(W, X)
    w_var = closed.jaxpr.invars[0]
    casts = [
        e
        for e in closed.jaxpr.eqns
        if e.primitive.name == "convert_element_type" and e.invars[0] is w_var
    ]
    assert len(casts) == 1


def test_integer_bool_key_and_complex_values_are_never_cast():
    def f(x, i, key, c):
        k1, _ = jax.random.split(key)
        noise = jax.random.normal(k1, x.shape, x.dtype)
        j = i * 3 + 1
        z = (c * c).real.astype(x.dtype).sum()
        mask = x > 0
        return (jnp.where(mask, x, 0.0) @ x.T).sum() + z + noise.sum(), j

    i = jnp.arange(3, dtype=jnp.int32)
    args = (X, i, jax.random.key(0), jnp.ones(2, "complex64"))

    def converts(closed):
        return {
            (e.invars[0].aval.dtype, e.params["new_dtype"])
            for e in eqns(closed)
            if e.primitive.name == "convert_element_type"
        }

    ref = converts(jax.make_jaxpr(f)(*args))
    added = converts(jax.make_jaxpr(jaxamp.amp(f, compute_dtype=BF16))(*args)) - ref
    assert added  # amp did cast something...
    for src, dst in added:  # ...but only floats, to floats
        assert jnp.issubdtype(src, jnp.floating) and jnp.issubdtype(dst, jnp.floating)
    out, j = jaxamp.amp(f, compute_dtype=BF16)(*args)
    assert j.dtype == jnp.int32 and out.dtype == F32
    np.testing.assert_array_equal(j, i * 3 + 1)


def test_python_scalars_follow_the_other_operand():
    def f(x, w):
        h = x @ w
        return ((h * 0.5 + 1.0) / 3.0) @ w.T  # not the tail: feeds a matmul

    closed = jax.make_jaxpr(jaxamp.amp(f, compute_dtype=BF16))(X, W)
    for name in ("mul", "add", "div"):
        assert out_dtype(closed, name) == [BF16]


def test_rule_returning_wrong_arity_names_the_primitive():
    bad = lambda compute_dtype, original_dtypes, *xs, **params: (xs[:1], params)
    f = jaxamp.amp(lambda a, b: a + b, amp_policy={"add": bad})
    with pytest.raises(TypeError, match="primitive 'add'"):
        f(X, X)
    worse = lambda compute_dtype, original_dtypes, *xs, **params: xs[0]
    with pytest.raises(TypeError, match=r"must return \(invars, bind_params\)"):
        jaxamp.amp(lambda a, b: a * b, amp_policy={"mul": worse})(X, X)


def test_source_info_is_kept():
    def f(x, w):
        with jax.named_scope("my_layer"):
            return jnp.tanh(x @ w)

    closed = jax.make_jaxpr(jaxamp.amp(f, compute_dtype=BF16))(X, W)
    (dot,) = [e for e in eqns(closed) if e.primitive.name == "dot_general"]
    # The scope reaches the compiled op's name (profiles), through the
    # checkpoint that recomputes the casts of the arguments x and w.
    hlo = (
        jax.jit(jaxamp.amp(f, compute_dtype=BF16)).lower(X, W).as_text(debug_info=True)
    )
    assert re.search(r'loc\("[^"]*/my_layer/[^"]*dot_general"', hlo)
    assert "test_loop.py" in str(jax.extend.source_info_util.summarize(dot.source_info))


# ---------------------------------------------------------------------------
# Casts of held inputs (arguments, closed-over values, scan/jit inputs bound to
# them) feeding a matmul are recomputed in the backward pass, not saved.


def residuals(fn, *args):
    from jaxamp import _compat

    return [(a.dtype, a.shape, src) for a, src in _compat.saved_residuals(fn, *args)]


LW = jnp.linspace(-1, 1, 3 * 4 * 4, dtype=jnp.float32).reshape(3, 4, 4)


def scanned(ws, x):
    h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)
    return h.sum()


def test_no_low_precision_copies_of_scanned_weights_are_saved():
    saved = residuals(jaxamp.amp(scanned, compute_dtype=BF16), LW, X)
    assert (jnp.dtype(jnp.float32), LW.shape, "from the argument ws") in saved
    assert not [r for r in saved if r[1] in (LW.shape, LW.shape[1:])][1:]
    # Without amp the scan stacks the same number of activations, in float32.
    acts = [r for r in saved if "scan" in r[2]]
    ref = [r for r in residuals(scanned, LW, X) if "scan" in r[2]]
    assert len(acts) == len(ref) and {r[0] for r in acts} == {BF16}


def test_held_through_jit_and_closures():
    w_closed = W
    w_out = jnp.ones((5, 2), jnp.float32)

    def f(x):
        h = jax.jit(lambda x, w: jnp.tanh(x @ w))(x, w_closed)
        return (h @ w_out).sum()  # tanh is an activation, not the loss chain

    saved = residuals(jax.jit(jaxamp.amp(f, compute_dtype=BF16)), X)
    # The closed-over float32 w itself (alive anyway), no bfloat16 copy of it.
    assert [r[:2] for r in saved if r[1] == W.shape] == [
        (jnp.dtype(jnp.float32), W.shape)
    ]
    # tanh's derivative (two arrays on JAX 0.10, one on 0.11), in bfloat16
    others = [r[0] for r in saved if r[1] not in (W.shape, w_out.shape)]
    assert others and set(others) == {BF16}


def test_intermediate_inputs_are_cast_and_held_weights_recomputed():
    """A matmul of an intermediate float32 value (``sin(x)``) and a held weight:
    the intermediate's bfloat16 copy is saved (recomputing it from float32 would
    save more), the weight's cast is recomputed in the backward pass (the
    float32 weight is saved as the argument anyway)."""
    f = lambda w, x: jnp.tanh(jnp.sin(x) @ w).sum()
    f32 = jnp.dtype(jnp.float32)
    saved = residuals(jaxamp.amp(f, compute_dtype=BF16), W, X)
    shapes = [r[:2] for r in saved]
    assert (BF16, X.shape) in shapes
    assert shapes.count((f32, X.shape)) == 1  # cos(x), sin's derivative
    assert (f32, W.shape, "from the argument w") in saved
    assert (BF16, W.shape) not in shapes
    # The check can fail: without the early cast of sin(x) the matmul takes the
    # plain path and saves a bfloat16 copy of the weight.
    plain = _amp.ablated(choices=["narrow_activations"])
    saved = residuals(plain(f, compute_dtype=BF16), W, X)
    assert (BF16, W.shape) in [r[:2] for r in saved]


@pytest.mark.parametrize("held", [True, False], ids=["held", "not_held"])
def test_recomputed_casts_give_the_same_gradients(held):
    f = jaxamp.amp(scanned, compute_dtype=BF16)
    g = jax.grad(f, argnums=(0, 1))(LW, X)
    # The same computation with the inputs not held (a no-op copy first).
    plain = jaxamp.amp(
        lambda ws, x: scanned(*(jax.lax.optimization_barrier((ws, x)))),
        compute_dtype=BF16,
    )
    g_ref = jax.grad(plain, argnums=(0, 1))(LW, X)
    if held:
        for a, b in zip(g, g_ref):
            np.testing.assert_array_equal(a, b)
    closed = jax.make_jaxpr(jax.grad(plain if not held else f))(LW, X)
    kinds = [e.primitive.name for e in eqns(closed)]
    assert ("remat2" in kinds) == held


def test_a_users_checkpoint_policy_still_decides():
    """Inside jax.checkpoint(policy=dots_saveable) the dot's output is saved
    (as the user asked), not recomputed by an inner checkpoint."""
    policy = jax.checkpoint_policies.dots_saveable
    f = lambda w, x: (
        jax.checkpoint(lambda a: jnp.sin(a @ w), policy=policy)(x) @ w.T
    ).sum()
    saved = residuals(jaxamp.amp(f, compute_dtype=BF16), W, X)
    assert (BF16, (3, 5)) in {r[:2] for r in saved}
    closed = jax.make_jaxpr(jaxamp.amp(f, compute_dtype=BF16))(W, X)
    assert [e.primitive.name for e in eqns(closed)].count("remat2") == 1


def test_amp_stop_regions_are_not_wrapped():
    def f(w, x):
        with jaxamp.amp_stop():
            return jnp.tanh(x @ w).sum()

    closed = jax.make_jaxpr(jax.grad(jaxamp.amp(f, compute_dtype=BF16)))(W, X)
    kinds = [e.primitive.name for e in eqns(closed)]
    assert "remat2" not in kinds and "custom_jvp_call" not in kinds
    assert {
        i for n, i, _ in jaxamp.tools.primitive_dtypes(closed) if n == "dot_general"
    } == {(F32, F32)}
