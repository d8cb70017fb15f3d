"""``AmpPolicy``: a policy key the user added that matches nothing in the traced
function warns, naming the closest name; jaxamp's own policies never warn."""

import warnings

import jax
import jax.numpy as jnp
import pytest

import jaxamp

BF16 = jnp.bfloat16
W = jnp.ones((4, 4))
X = jnp.ones((2, 4))


def mlp(w, x):
    """Matmuls and a tanh inside an ``mlp`` scope: no convolution, no attention."""
    with jax.named_scope("mlp"):
        h = jnp.tanh(x @ w)
    return jnp.sum(h @ w)


def _run(policy, fn=mlp):
    return jaxamp.amp(fn, compute_dtype=BF16, amp_policy=policy)(W, X)


def _quiet(policy, fn=mlp):
    """Run under a policy; any warning fails."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _run(policy, fn)


def test_typo_warns_and_names_the_primitive():
    policy = {**jaxamp.default_amp_policy, "dot_genral": jaxamp.use_full_precision}
    with pytest.warns(UserWarning, match="'dot_genral'.*Did you mean 'dot_general'"):
        _run(policy)


def test_typo_warns_once_per_function():
    policy = {"dot_genral": jaxamp.use_full_precision}
    f = jaxamp.amp(mlp, compute_dtype=BF16, amp_policy=policy)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        f(W, X)
        f(W, jnp.ones((3, 4)))  # a re-trace
        jax.grad(f)(W, X)
    assert len([w for w in caught if "dot_genral" in str(w.message)]) == 1


def test_correct_keys_do_not_warn():
    _quiet({"dot_general": jaxamp.use_full_precision})
    _quiet(
        {
            jax.lax.tanh_p: jaxamp.use_full_precision,
            "amp_default": jaxamp.use_original_precision,
        }
    )
    _quiet({**jaxamp.default_amp_policy, "tanh": jaxamp.use_full_precision})


def test_scope_key_of_an_existing_scope_does_not_warn():
    _quiet({**jaxamp.default_amp_policy, "mlp": jaxamp.use_full_precision})
    _quiet({"mlp": {**jaxamp.default_amp_policy, "tanh": jaxamp.use_full_precision}})


def test_scope_typo_warns():
    policy = {**jaxamp.default_amp_policy, "mlpp": jaxamp.use_full_precision}
    with pytest.warns(UserWarning, match="'mlpp'.*Did you mean 'mlp'"):
        _run(policy)


def test_nested_typo_warns_naming_its_scope():
    policy = {"mlp": {**jaxamp.default_amp_policy, "tahn": jaxamp.use_full_precision}}
    with pytest.warns(UserWarning, match="'tahn' \\(in the policy of scope 'mlp'\\)"):
        _run(policy)


@pytest.mark.parametrize(
    "policy",
    [
        jaxamp.default_amp_policy,
        jaxamp.fp8_amp_policy,
        jaxamp.int8_amp_policy,
        {**jaxamp.default_amp_policy},
        {**jaxamp.fp8_amp_policy, "mlp": jaxamp.default_amp_policy},
        jaxamp.fp8_policy(scopes=("mlp",)),
        jaxamp.int8_policy(exclude_scopes=("mlp",)),
    ],
    ids=["default", "fp8", "int8", "merged", "fp8-nested", "fp8-scopes", "int8-excl"],
)
def test_builtin_policies_do_not_warn(policy):
    # A function with no convolution, no attention, no scan: most of the
    # built-in keys match nothing, and none of them is the user's.
    _quiet(policy)


def test_builtin_policy_on_a_function_without_matmuls_does_not_warn():
    _quiet(jaxamp.fp8_amp_policy, lambda w, x: jnp.sum(jnp.exp(w)))


def test_excluded_scope_typo_warns():
    with pytest.warns(UserWarning, match="'haed'"):
        _run(jaxamp.fp8_policy(exclude_scopes=("haed",)))
