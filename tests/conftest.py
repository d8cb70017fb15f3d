"""Test configuration: 8 host CPU devices, unoptimised XLA:CPU kernels and strict
dtype promotion.

Strict promotion (``jax_numpy_dtype_promotion="strict"``) makes any silent upcast
in jaxamp or in the tests fail loudly instead of hiding a dtype bug.

Compile-target tests (``tests/test_*_target.py``: an H100 or a TPU compiled for
on this CPU) skip, with the install line as reason, where the target's compiler
(the CUDA plugin, libtpu) is not installed. With ``JAXAMP_REQUIRE_TARGETS=1``
(what ``.ci/run`` sets on the leg that installs them) such a skip is a failure:
a target test that cannot run in CI would check nothing there.
"""

import os
import re

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

# libtpu, loaded to compile for a TPU (tests/test_*_target.py; no chip is
# used), takes a machine-wide lock (/tmp/libtpu_lockfile): a second process
# that loads it, another pytest-xdist worker, aborts ("Internal error when
# accessing libtpu multi-process lockfile") unless allowed to share it.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402

jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_platforms", "cpu")


# --- compile targets: a skip is a failure under JAXAMP_REQUIRE_TARGETS=1 ---------

import pytest  # noqa: E402

TARGET_MODULE = re.compile(r"test_\w+_target\.py$")
REQUIRE_TARGETS = "JAXAMP_REQUIRE_TARGETS"


def _targets_required(path) -> bool:
    """A compile-target test module, run where its targets must run."""
    required = os.environ.get(REQUIRE_TARGETS, "") not in ("", "0")
    return required and TARGET_MODULE.search(str(path)) is not None


def _as_failure(report) -> None:
    """Turn a skip's report into a failure's, with the skip's reason."""
    skip = report.longrepr  # (path, line, "Skipped: reason") for a skip
    reason = skip[-1] if isinstance(skip, tuple) else str(skip)
    report.outcome = "failed"
    report.longrepr = (
        f"{REQUIRE_TARGETS}=1: compile-target tests must run here, but this one "
        f"was skipped ({reason})"
    )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    xfail = hasattr(report, "wasxfail")  # an expected failure is not a skip
    if report.skipped and not xfail and _targets_required(item.path):
        _as_failure(report)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    report = yield  # a module skipped as a whole (allow_module_level, importorskip)
    if report.skipped and _targets_required(collector.path):
        _as_failure(report)
    return report
