"""Tests of the jmp-style Policy and the cast_* pytree helpers
(jaxamp/migration/_jmp.py)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxamp

BF16, F16, F32 = np.dtype(jnp.bfloat16), np.dtype(jnp.float16), np.dtype(jnp.float32)


@pytest.mark.parametrize(
    "spec, want",
    [
        ("p=f32,c=bf16,o=f32", (F32, BF16, F32)),
        ("params=float32,compute=bfloat16,output=float32", (F32, BF16, F32)),
        # Order, case and spaces do not matter; jmp's defaults: params float32,
        # compute follows params, output follows compute.
        (" C=bf16 , p=f32 ", (F32, BF16, BF16)),
        ("c=f16", (F32, F16, F16)),
        ("p=bf16", (BF16, BF16, BF16)),
        ("p=f16,o=f32", (F16, F16, F32)),
        ("o=bf16", (F32, F32, BF16)),
    ],
)
def test_policy_parsing(spec, want):
    pol = jaxamp.migration.jmp.get_policy(spec)
    assert (pol.param_dtype, pol.compute_dtype, pol.output_dtype) == want
    assert jaxamp.migration.jmp.get_policy(str(pol)) == pol


def test_policy_str_is_jmps_grammar():
    assert (
        str(jaxamp.migration.jmp.get_policy("p=f32,c=bf16,o=f32"))
        == "p=full,c=bf16,o=full"
    )
    assert (
        str(jaxamp.migration.jmp.get_policy("p=f64,c=f16,o=e4m3"))
        == "p=f64,c=f16,o=e4m3"
    )
    assert repr(jaxamp.migration.jmp.get_policy("f32")).startswith(
        "Policy(param_dtype="
    )
    pol = jaxamp.migration.jmp.get_policy("p=f32,c=bf16,o=f32").with_output_dtype("f16")
    assert (pol.param_dtype, pol.compute_dtype, pol.output_dtype) == (F32, BF16, F16)
    with pytest.raises(ValueError, match="output_dtype must be a floating"):
        pol.with_output_dtype(jnp.int32)
    with pytest.raises(TypeError, match="Policy spec must be a str"):
        jaxamp.migration.jmp.get_policy(3)


def test_policy_single_dtype_and_errors():
    pol = jaxamp.migration.jmp.Policy.from_string("f16")
    assert pol.param_dtype == pol.compute_dtype == pol.output_dtype == F16
    with pytest.raises(ValueError, match="Unknown policy entry 'q=f32'"):
        jaxamp.migration.jmp.get_policy("p=f32,q=f32")
    with pytest.raises(ValueError, match="compute_dtype must be a floating"):
        jaxamp.migration.jmp.Policy(F32, jnp.int32, F32)
    with pytest.raises(ValueError, match="not a known floating-point dtype"):
        jaxamp.migration.jmp.get_policy("p=f33")


def test_policy_casts():
    pol = jaxamp.migration.jmp.get_policy("p=f32,c=bf16,o=f16")
    tree = {"w": jnp.ones(2), "i": jnp.arange(2)}
    assert pol.cast_to_compute(tree)["w"].dtype == BF16
    assert pol.cast_to_output(tree)["w"].dtype == F16
    assert pol.cast_to_param(pol.cast_to_compute(tree))["w"].dtype == F32
    assert pol.cast_to_compute(tree)["i"].dtype == jnp.int32


def test_cast_tree_only_touches_float_arrays():
    lin = eqx.nn.Linear(2, 3, key=jax.random.key(0))
    tree = {
        "m": lin,
        "i": jnp.arange(3),
        "b": jnp.ones(2, bool),
        "c": jnp.ones(2, jnp.complex64),
        "k": jax.random.key(1),
        "n": np.ones(2, np.float64),
        "s": "static",
        "f": 1.5,
    }
    out = jaxamp.migration.mpx.cast_to_bfloat16(tree)
    assert out["m"].weight.dtype == BF16 and out["m"].bias.dtype == BF16
    assert out["n"].dtype == BF16
    assert out["i"].dtype == jnp.int32 and out["b"].dtype == bool
    assert out["c"].dtype == jnp.complex64 and out["k"] is tree["k"]
    assert out["s"] == "static" and out["f"] == 1.5
    assert jaxamp.migration.mpx.cast_to_float16(tree)["m"].weight.dtype == F16
    assert jaxamp.migration.mpx.cast_to_float32(out)["m"].weight.dtype == F32
    assert jaxamp.migration.mpx.cast_to_full_precision(out)["n"].dtype == F32
    with pytest.raises(ValueError, match="floating"):
        jaxamp.migration.mpx.cast_tree(tree, jnp.int32)


def test_half_precision_dtype_is_configurable():
    x = {"w": jnp.ones(2)}
    assert jaxamp.migration.mpx.cast_to_half_precision(x)["w"].dtype == F16
    assert jaxamp.migration.mpx.half_precision_dtype() == F16
    jaxamp.migration.mpx.set_half_precision_dtype(jnp.bfloat16)
    try:
        assert jaxamp.migration.mpx.cast_to_half_precision(x)["w"].dtype == BF16
        assert jaxamp.migration.mpx.half_precision_dtype() == BF16
        assert jaxamp.migration.mpx.half_precision_datatype() == BF16
    finally:
        jaxamp.migration.mpx.set_half_precision_dtype(jnp.float16)
    assert jaxamp.migration.mpx.half_precision_dtype() == F16
