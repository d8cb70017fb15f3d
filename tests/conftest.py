"""Test configuration: 8 host CPU devices and strict dtype promotion.

Strict promotion (``jax_numpy_dtype_promotion="strict"``) makes any silent upcast
in jaxamp or in the tests fail loudly instead of hiding a dtype bug.
"""

import os

os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402

jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_platforms", "cpu")
