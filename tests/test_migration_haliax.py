"""The examples of Haliax's mixed precision page, on jaxamp's names.

Source: stanford-crfm/haliax, ``docs/mixed-precision.md`` (commit 3a203ba6f850)
and ``src/haliax/_src/mixed_precision.py`` / ``resource_env.py``. Name map:
``jmp.get_policy`` -> ``jaxamp.migration.jmp.get_policy``; ``hmp.cast_floating(x, dtype,
mp)`` -> ``jaxamp.migration.haliax.cast_floating(x, dtype, policy)``; ``with
hax.resource_env(mp=...)`` -> ``with jaxamp.migration.haliax.mixed_precision(...)``;
``hax.current_mp_policy()`` -> ``jaxamp.migration.haliax.current_policy()`` (None
outside every
block, where Haliax returns its float32 default). Named arrays become plain
arrays (``hax.arange(D, dtype=float)`` -> ``jnp.arange(16.0)``).
"""

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxamp

F16, BF16, F32 = np.dtype(jnp.float16), np.dtype(jnp.bfloat16), np.dtype(jnp.float32)
x = jnp.arange(16, dtype=float)


def test_jmp_policy_casts():
    policy = jaxamp.migration.jmp.get_policy("p=f32,c=bf16,o=f32")
    assert policy.cast_to_compute(x).dtype == jnp.bfloat16
    assert policy.cast_to_output(x).dtype == jnp.float32
    assert policy.cast_to_param(x).dtype == jnp.float32


def test_semantic_dtypes_with_an_explicit_policy():
    policy = jaxamp.migration.jmp.get_policy("p=f32,c=bf16,o=f32")
    assert (
        jaxamp.migration.haliax.cast_floating(x, "compute", policy).dtype
        == jnp.bfloat16
    )
    assert (
        jaxamp.migration.haliax.cast_floating(x, "param", policy).dtype == jnp.float32
    )
    assert (
        jaxamp.migration.haliax.cast_floating(x, "output", "p=f32,c=bf16,o=f16").dtype
        == F16
    )
    # SemanticDType members, Haliax's "parameter" spelling, real dtypes, None.
    assert jaxamp.migration.haliax.SemanticDType.COMPUTE.to_dtype(policy) == BF16
    assert (
        jaxamp.migration.haliax.cast_floating(
            x, jaxamp.migration.haliax.SemanticDType.PARAM, policy
        ).dtype
        == F32
    )
    assert jaxamp.migration.haliax.cast_floating(x, "parameter", "p=f16").dtype == F16
    assert jaxamp.migration.haliax.cast_floating(x, jnp.float16, policy).dtype == F16
    assert jaxamp.migration.haliax.cast_floating(x, "bf16").dtype == BF16
    assert jaxamp.migration.haliax.cast_floating(x, None) is x


def test_resource_env_context_and_the_float32_default():
    with jaxamp.migration.haliax.mixed_precision("p=f32,c=bf16,o=f32"):
        assert jaxamp.migration.haliax.cast_floating(x, "compute").dtype == jnp.bfloat16
        assert jaxamp.migration.haliax.cast_floating(x, "param").dtype == jnp.float32
    # Outside every block, semantic dtypes resolve to float32 (Haliax's
    # default policy), and current_policy() says there is none.
    assert jaxamp.migration.haliax.cast_floating(x, "compute").dtype == jnp.float32
    assert jaxamp.migration.haliax.cast_floating(x, "param").dtype == jnp.float32
    assert jaxamp.migration.haliax.current_policy() is None


def test_each_semantic_dtype_inside_and_outside():
    policy = "p=bf16,c=f16,o=f32"
    want = {"compute": F16, "param": BF16, "output": F32}
    with jaxamp.migration.haliax.mixed_precision(policy) as active:
        assert (
            active
            == jaxamp.migration.jmp.get_policy(policy)
            == jaxamp.migration.haliax.current_policy()
        )
        assert jaxamp.migration.haliax.policy_compute_dtype() == F16
        for name, dtype in want.items():
            assert (
                jaxamp.migration.haliax.cast_floating({"a": x}, name)["a"].dtype
                == dtype
            )
            assert (
                jaxamp.migration.haliax.resolve_dtype(
                    jaxamp.migration.haliax.SemanticDType(name)
                )
                == dtype
            )
            # Wherever jaxamp takes a dtype, the name resolves too.
            assert jaxamp.migration.mpx.cast_tree(x, name).dtype == dtype
    for name in want:
        assert jaxamp.migration.haliax.cast_floating(x, name).dtype == F32
    assert jaxamp.migration.haliax.policy_compute_dtype() is None


def test_a_layer_with_a_compute_dtype_argument():
    """Haliax's nn modules take ``compute_dtype="compute"``: the layer follows
    the policy of the block it runs in."""

    def linear(w, b, h, compute_dtype="compute"):
        w, b, h = jaxamp.migration.haliax.cast_floating((w, b, h), compute_dtype)
        return h @ w + b

    w, b, h = jnp.ones((16, 32)), jnp.zeros(32), jnp.arange(16, dtype=jnp.bfloat16)
    assert linear(w, b, h).dtype == jnp.float32
    with jaxamp.migration.haliax.mixed_precision("p=f32,c=bf16,o=f32"):
        assert linear(w, b, h).dtype == jnp.bfloat16
        assert linear(w, b, h, compute_dtype="param").dtype == jnp.float32
        # Under jit the policy is read when the function is traced.
        assert jax.jit(linear)(w, b, h).dtype == jnp.bfloat16


def test_blocks_nest_restore_and_are_per_thread():
    with jaxamp.migration.haliax.mixed_precision("c=bf16"):
        with jaxamp.migration.haliax.mixed_precision(
            jaxamp.migration.jmp.get_policy("c=f16")
        ):
            assert jaxamp.migration.haliax.policy_compute_dtype() == F16
            with jaxamp.migration.haliax.mixed_precision(None):
                assert jaxamp.migration.haliax.current_policy() is None
            seen = []
            worker = threading.Thread(
                target=lambda: seen.append(jaxamp.migration.haliax.current_policy())
            )
            worker.start()
            worker.join()
            assert seen == [None]
        assert jaxamp.migration.haliax.policy_compute_dtype() == BF16
        with pytest.raises(RuntimeError, match="boom"):
            with jaxamp.migration.haliax.mixed_precision("f32"):
                raise RuntimeError("boom")
        assert jaxamp.migration.haliax.policy_compute_dtype() == BF16
    assert jaxamp.migration.haliax.current_policy() is None

    @jaxamp.migration.haliax.mixed_precision("c=f16")
    def decorated():
        return jaxamp.migration.haliax.policy_compute_dtype()

    assert decorated() == F16 and decorated() == F16
    assert jaxamp.migration.haliax.current_policy() is None


def test_errors_name_the_argument_and_the_fix():
    with pytest.raises(ValueError, match="dtype='compute' names the current"):
        jaxamp.migration.mpx.cast_tree(x, "compute")
    with pytest.raises(
        ValueError, match=r"jaxamp.migration.haliax.mixed_precision\('p=f32"
    ):
        jaxamp.migration.mpx.cast_tree(x, jaxamp.migration.haliax.SemanticDType.OUTPUT)
    with pytest.raises(ValueError, match="Unknown policy entry 'q=f32'"):
        jaxamp.migration.haliax.mixed_precision(
            "q=f32"
        )  # raised at the call, not on entry
    with pytest.raises(TypeError, match="Policy spec must be a str"):
        jaxamp.migration.haliax.mixed_precision(16)
    with pytest.raises(ValueError, match="dtype='computer' is not a known"):
        jaxamp.migration.haliax.cast_floating(x, "computer")
    assert str(jaxamp.migration.haliax.SemanticDType.COMPUTE) == "compute"
    assert jaxamp.migration.haliax.SemanticDType.PARAM == "param"
