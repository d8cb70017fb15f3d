"""tests/conftest.py's rule for compile-target tests: under
``JAXAMP_REQUIRE_TARGETS=1`` a skipped test of a ``tests/test_*_target.py``
module fails (CI's target leg), elsewhere it stays a skip."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent

SKIPPING = """
import pytest

pytestmark = pytest.mark.skipif(True, reason="the X target needs its plugin")


def test_compiles():
    pass
"""
MODULE_SKIP = """
import pytest

pytest.skip("the Y target needs libY", allow_module_level=True)
"""
OTHER = """
import pytest


@pytest.mark.skip(reason="not a target test")
def test_other():
    pass


@pytest.mark.xfail(reason="an expected failure", strict=True)
def test_xfail():
    assert False
"""


def run_pytest(tmp_path: Path, require: str | None) -> subprocess.CompletedProcess:
    """pytest on three modules in ``tmp_path`` under this conftest: a target
    test skipped by a mark, a target module skipped as a whole, and a plain
    module with a skip and an xfail."""
    shutil.copy(HERE / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_x_target.py").write_text(SKIPPING)
    (tmp_path / "test_y_target.py").write_text(MODULE_SKIP)
    (tmp_path / "test_plain.py").write_text(OTHER)
    env = {k: v for k, v in os.environ.items() if k != "JAXAMP_REQUIRE_TARGETS"}
    if require is not None:
        env["JAXAMP_REQUIRE_TARGETS"] = require
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider"]
    # a collection error stops the run before any test, unless told to go on
    cmd += ["-p", "no:xdist", "-p", "no:benchmark", "--continue-on-collection-errors"]
    return subprocess.run(
        [*cmd, str(tmp_path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_target_skips_are_skips_by_default(tmp_path):
    out = run_pytest(tmp_path, None)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "3 skipped, 1 xfailed" in out.stdout
    assert "the X target needs its plugin" in out.stdout


def test_target_skips_fail_when_required(tmp_path):
    out = run_pytest(tmp_path, "1")
    assert out.returncode == 1, out.stdout + out.stderr
    tail = out.stdout.splitlines()[-1]
    # the marked target test is an error at its setup (where its skip mark is
    # read), the skipped target module an error at collection; the plain
    # module's skip and xfail stay as they are
    assert "1 skipped, 1 xfailed, 2 errors" in tail, out.stdout
    assert "JAXAMP_REQUIRE_TARGETS=1: compile-target tests must run here" in out.stdout
    assert "the X target needs its plugin" in out.stdout
    assert "the Y target needs libY" in out.stdout
