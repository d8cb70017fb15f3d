"""Tests of the dtype helpers (jaxamp/_base/_dtypes.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxamp._base._dtypes import canonical_dtype, is_float, widest


@pytest.mark.parametrize(
    "name, dtype",
    [
        ("bf16", jnp.bfloat16),
        ("BFloat16", jnp.bfloat16),
        ("f16", jnp.float16),
        ("half", jnp.float16),
        ("float32", jnp.float32),
        ("e4m3", jnp.float8_e4m3fn),
        (jnp.bfloat16, jnp.bfloat16),
        (np.dtype("float16"), jnp.float16),
    ],
)
def test_canonical_dtype(name, dtype):
    assert canonical_dtype(name) == np.dtype(dtype)


def test_canonical_dtype_errors_name_the_argument():
    with pytest.raises(ValueError, match="compute_dtype must be a floating"):
        canonical_dtype(jnp.int32, argname="compute_dtype")
    with pytest.raises(ValueError, match=r"my_arg='b16' is not a known"):
        canonical_dtype("b16", argname="my_arg")
    with pytest.raises(ValueError, match="is not a dtype"):
        canonical_dtype(object(), argname="x")


def test_is_float():
    assert is_float(jnp.bfloat16) and is_float(jnp.float8_e5m2) and is_float("float64")
    for dt in (jnp.int32, bool, jnp.complex64, jax.dtypes.float0):
        assert not is_float(dt)
    assert not is_float(jax.random.key(0).dtype)


def test_widest_prefers_bfloat16_on_a_16_bit_tie():
    assert widest([jnp.float16, jnp.bfloat16]) == np.dtype(jnp.bfloat16)
    assert widest([jnp.bfloat16, jnp.float32, jnp.int64]) == np.dtype(jnp.float32)
    assert widest([jnp.int32, bool]) is None


def test_int8_compute_dtype_names_the_int8_policy():
    # int8 matmuls are a policy over a float compute dtype: the error says so.
    for bad in ("int8", jnp.int8):
        with pytest.raises(ValueError, match=r"amp_policy=jaxamp\.int8_amp_policy"):
            canonical_dtype(bad, argname="compute_dtype")
