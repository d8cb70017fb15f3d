"""Typed policy values (jaxamp/_policy/_kinds.py) and the bind steps as
pipeline configuration (jaxamp/_walk/_loop.py: ``Pipeline.bind_steps``)."""

import copy

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxamp
from jaxamp import _amp
from jaxamp._policy._lookup import AmpPolicy, builtin_rule
from jaxamp._walk._loop import Pipeline

BF16, F16, F32 = np.dtype(jnp.bfloat16), np.dtype(jnp.float16), np.dtype(jnp.float32)
W = jnp.asarray(np.linspace(-2, 2, 64).reshape(8, 8), jnp.bfloat16).astype(F32)
X = jnp.asarray(np.linspace(-300, 300, 32).reshape(4, 8), jnp.bfloat16).astype(F32)


def _dtypes(f, *args, name="dot_general"):
    table = jaxamp.tools.primitive_dtypes(jax.make_jaxpr(f)(*args))
    return [tuple(np.dtype(d).name for d in ins) for n, ins, _ in table if n == name]


def test_ready_made_rules_are_typed_and_callable():
    for rule in (
        jaxamp.rules.use_lower_precision,
        jaxamp.use_full_precision,
        jaxamp.rules.follow_compute_precision,
        jaxamp.rules.use_precision("f16"),
    ):
        assert isinstance(rule, jaxamp.rules.CastRule)
    assert isinstance(jaxamp.default_amp_policy["scan"], jaxamp.rules.CarryRule)
    assert isinstance(
        jaxamp.fp8_amp_policy["dot_general"], jaxamp.rules.ImplementationRule
    )
    # Called directly with jaxamp 0.0.4's signature, as a user's rule calls them.
    x = jnp.ones(3, F16)
    (out,), params = jaxamp.use_full_precision(BF16, [F16], x)
    assert out.dtype == F32 and params == {}
    assert jaxamp.use_full_precision.__name__ == "use_full_precision"
    assert "float32" in jaxamp.use_full_precision.__doc__


def test_plain_function_rule_is_wrapped_and_applied():
    def exp_in_f16(compute_dtype, original_dtypes, *invars, **params):
        return [v.astype(F16) for v in invars], params

    pol = AmpPolicy({"exp": exp_in_f16})
    rule = pol.lookup(jax.lax.exp_p, ())
    assert rule == jaxamp.rules.CastRule(exp_in_f16) and rule.fn is exp_in_f16
    policy = {**jaxamp.default_amp_policy, "exp": exp_in_f16}
    f = jaxamp.amp(
        lambda x: jnp.exp(x / 300.0).sum(), compute_dtype=BF16, amp_policy=policy
    )
    assert _dtypes(f, X, name="exp") == [("float16",)]


def _dot_in(dtype):
    """An implementation rule: the matmul in ``dtype``, float32 result."""

    def impl(compute_dtype, original_dtypes, lhs, rhs, **params):
        params = {**params, "preferred_element_type": F32}
        return jax.lax.dot_general_p.bind(
            lhs.astype(dtype), rhs.astype(dtype), **params
        )

    return impl


@pytest.mark.parametrize("typed", [True, False], ids=["class", "amp_impl_marker"])
def test_implementation_rule_runs_the_equation(typed):
    impl = _dot_in(F16)
    if typed:
        rule = jaxamp.rules.ImplementationRule(impl)
    else:  # a function marked with the attribute jaxamp 0.0.x read
        impl.amp_impl = True
        rule = impl
    policy = {**jaxamp.default_amp_policy, "dot_general": rule}
    f = jaxamp.amp(lambda w, x: x @ w, compute_dtype=BF16, amp_policy=policy)
    assert _dtypes(f, W, X) == [("float16", "float16")]
    out = f(W, X)
    assert out.dtype == F32
    ref = np.asarray(X, np.float64) @ np.asarray(W, np.float64)
    np.testing.assert_allclose(out, ref, rtol=2e-3, atol=0.5)


def test_builtin_rule_marks_a_copy():
    rule = jaxamp.quant.fp8_rule()
    marked = builtin_rule(rule, "dot_general")
    assert marked.builtin_keys == {"dot_general"} and rule.builtin_keys == frozenset()
    assert marked.fn is rule.fn
    with pytest.raises(TypeError, match="ImplementationRule"):
        builtin_rule(jaxamp.use_full_precision, "exp")
    # The user's own fp8 rule is the user's key: unmatched, it warns.
    no_matmul = jaxamp.amp(
        lambda x: jnp.exp(x).sum(), compute_dtype=BF16, amp_policy={"dot_general": rule}
    )
    with pytest.warns(UserWarning, match="'dot_general'"):
        no_matmul(X)


def test_attention_rule_only_under_its_key():
    assert jaxamp.attention_rule("xla") == jaxamp.rules.AttentionRule("xla")
    assert hash(jaxamp.attention_rule("xla")) == hash(jaxamp.rules.AttentionRule("xla"))
    assert not callable(jaxamp.attention_rule("xla"))
    with pytest.raises(TypeError, match="belongs under the key 'attention'"):
        AmpPolicy({"mlp": jaxamp.attention_rule("off")})
    with pytest.raises(TypeError, match="belongs under the key 'attention'"):
        AmpPolicy({"enc": {"dot_general": jaxamp.attention_rule("off")}})
    with pytest.raises(ValueError, match="expected one of"):
        jaxamp.rules.AttentionRule("flash")


def test_attention_rule_is_no_rule_for_a_scope_named_attention():
    """A user scope named ``attention`` keeps the default rules (its matmul in
    the compute dtype) when the policy sets ``"attention"``."""

    def f(w, x):
        with jax.named_scope("attention"):
            return jnp.tanh(x @ w).sum()

    policy = {**jaxamp.default_amp_policy, "attention": jaxamp.attention_rule("xla")}
    g = jaxamp.amp(f, compute_dtype=BF16, amp_policy=policy)
    assert _dtypes(g, W, X) == [("bfloat16", "bfloat16")]
    assert AmpPolicy(policy).lookup("attention", ("attention",)) == policy["attention"]


def test_scope_policy_values():
    nested = {**jaxamp.default_amp_policy, "dot_general": jaxamp.use_full_precision}

    def f(w, x):
        with jax.named_scope("head"):
            return (x @ w).sum() + (jnp.tanh(x / 300.0) @ w).sum()

    for value in (nested, jaxamp.ScopePolicy(nested)):
        policy = {**jaxamp.default_amp_policy, "head": value}
        g = jaxamp.amp(f, compute_dtype=BF16, amp_policy=policy)
        assert _dtypes(g, W, X) == [("float32", "float32")] * 2
    with pytest.raises(TypeError, match="must be a mapping"):
        jaxamp.ScopePolicy([("exp", jaxamp.use_full_precision)])
    with pytest.raises(TypeError, match="only a jax.named_scope name or path"):
        AmpPolicy({jax.lax.exp_p: jaxamp.ScopePolicy(nested)})
    with pytest.raises(TypeError, match=r"amp_policy\['amp_default'\]"):
        AmpPolicy({"amp_default": nested})
    with pytest.raises(TypeError, match="must be callable"):
        jaxamp.rules.CastRule("float32")


def test_default_policy_is_a_dict_with_a_short_repr():
    p = jaxamp.default_amp_policy
    plain = dict(p)
    assert isinstance(p, dict) and p == plain and plain == p
    assert repr(p) == f"<jaxamp.default_amp_policy: {len(plain)} entries>"
    assert len(plain) > 60  # the whole table, not a view of part of it
    assert str(p) == repr(p)
    # Merges and copies are plain dicts with every entry and the usual repr.
    extra = {"exp": jaxamp.use_compute_precision}
    for merged in ({**p, **extra}, p | extra, dict(p, **extra)):
        assert type(merged) is dict
        assert merged == {**plain, **extra}
    assert (extra | p) == {**extra, **plain}
    for copied in (p.copy(), copy.copy(p), copy.deepcopy(p)):
        assert type(copied) is dict and copied == plain
        assert repr(copied).startswith("{'dot_general': CastRule(use_lower_precision)")
    assert list(p) == list(plain) and list(p.items()) == list(plain.items())
    assert p["exp"] is plain["exp"] and "scan" in p and p.get("nope") is None
    # Under amp it is the same policy as its plain copy (same jaxpr).
    f = lambda w, x: jnp.exp(x @ w).sum()
    jaxprs = [
        str(jax.make_jaxpr(jaxamp.amp(f, compute_dtype=BF16, amp_policy=q))(W, X))
        for q in (p, plain)
    ]
    assert jaxprs[0] == jaxprs[1]


def test_policy_value_reprs_are_short():
    default = jaxamp.ScopePolicy(jaxamp.default_amp_policy)
    assert repr(default) == f"ScopePolicy({jaxamp.default_amp_policy!r})"
    n = len(jaxamp.default_amp_policy)
    assert repr(jaxamp.ScopePolicy(dict(jaxamp.default_amp_policy))) == (
        f"ScopePolicy(<{n} entries>)"
    )
    small = jaxamp.ScopePolicy({"exp": jaxamp.use_full_precision})
    assert repr(small) == "ScopePolicy({'exp': CastRule(use_full_precision)})"
    assert repr(jaxamp.rules.use_lower_precision) == "CastRule(use_lower_precision)"
    assert repr(jaxamp.attention_rule("xla")) == "attention_rule('xla')"
    carry = jaxamp.default_amp_policy["scan"]
    assert repr(carry) == "CarryRule(narrow_bfloat16_carries)"
    for value in jaxamp.default_amp_policy.values():
        assert len(repr(value)) <= 60, repr(value)


def _recording(name, log):
    def step(prim, invals, params, bind, ctx):
        log.append(f"{name}>")
        out = bind(prim, invals, params)
        log.append(f"<{name}")
        return out

    return step


def test_bind_steps_compose_innermost_first_and_switch_off_by_name():
    log = []
    steps = tuple((n, _recording(n, log)) for n in ("a", "b", "c"))
    args = (jax.lax.add_p, [jnp.ones(2), jnp.ones(2)], {})
    out = Pipeline({}, bind_steps=steps).binder()(*args)
    np.testing.assert_array_equal(out, [2.0, 2.0])
    assert log == ["c>", "b>", "a>", "<a", "<b", "<c"]
    log.clear()
    Pipeline({}, bind_steps=steps, off=frozenset({"b"})).binder()(*args)
    assert log == ["c>", "a>", "<a", "<c"]


def test_overflow_check_is_a_bind_step():
    """Without the step a float16 overflow of the first matmul vanishes into
    ``tanh``'s 1; with it the output is NaN."""
    w = jnp.full((8, 8), 30.0)
    x = jnp.abs(X) / 300.0  # in [0, 1]: finite in float16 after the scaling
    f = lambda w, x: jnp.tanh((x * 1000.0) @ w) @ w
    on = jaxamp.amp(f, compute_dtype=F16)(w, x)
    off = _amp.ablated(choices=["overflow_check"])(f, compute_dtype=F16)(w, x)
    assert np.isnan(on).all() and np.isfinite(off).all()


def test_derived_sums_step_switched_off_changes_the_backward_pass():
    """The gradient of a bias added to a bfloat16 activation (the sum over the
    broadcast batch axis) sums in float32 with the step, in bfloat16 without."""
    b = jnp.ones(8)
    f = lambda b, w, x: jnp.sum(jnp.tanh(x @ w + b) @ w)

    def sum_dtypes(amp):
        grad = jax.grad(amp(f, compute_dtype=BF16))
        return [ins[0] for ins in _dtypes(grad, b, W, X, name="reduce_sum")]

    assert "bfloat16" not in sum_dtypes(jaxamp.amp)
    assert "bfloat16" in sum_dtypes(_amp.ablated(choices=["derived_sums"]))


def test_ablated_rejects_unknown_step_names():
    with pytest.raises(ValueError, match="overflow_check"):
        _amp.ablated(choices=["overflow"])
