"""Test configuration: 8 host CPU devices, unoptimised XLA:CPU kernels and strict
dtype promotion.

Strict promotion (``jax_numpy_dtype_promotion="strict"``) makes any silent upcast
in jaxamp or in the tests fail loudly instead of hiding a dtype bug.
"""

import os

os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
# The tests check dtypes, jaxprs and numerics, not generated code: without LLVM's
# optimisation passes XLA:CPU compiles (most of the suite's time) a third faster
# (tests/test_examples.py: 55 s of CPU instead of 83 s). Results may differ from
# optimised kernels in the last bits (e.g. fused multiply-adds); every comparison
# here is between programs compiled alike or within a stated tolerance.
if "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"
# The same reasoning for XLA:CPU's code generation: the older loop emitters (where
# this jaxlib has them: an unknown flag aborts XLA, see jaxamp/_compat.py) and no
# expensive LLVM passes compile the suite's many small programs faster
# (benchmarks/gpu_suite.py's dry run uses the same flags). HLO passes, where a
# rounding could be folded away, run as in production. Importing jaxamp does not
# start the backend, so the flags set here are still read.
from jaxamp._compat import known_xla_flags  # noqa: E402

if "xla_llvm_disable_expensive_passes" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " " + known_xla_flags(
        "--xla_cpu_use_fusion_emitters=false --xla_llvm_disable_expensive_passes"
    )

import jax  # noqa: E402

jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_platforms", "cpu")
