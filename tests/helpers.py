"""Small helpers shared by the tests: pytree comparisons and the main job's
smallest configuration; bfloat16 rounding and the relative L2 error are the
model kit's (benchmarks/common.py), re-exported here.

Jaxpr walking lives in the package (``jaxamp.tools.primitive_dtypes``,
``jaxamp.tools.matmul_flops_by_dtype``, ``jaxamp.tools.iter_equations``).
"""

import jax
import numpy as np
from common import rel_l2, round_bf16  # noqa: F401  (re-exported)

# The main job (examples/train_charlm.py) at the smallest size its flag tests
# train: one layer, a few steps' worth of shapes; `Config(**TINY_CHARLM, ...)`.
TINY_CHARLM = dict(
    batch_size=4,
    seq_len=32,
    d_model=64,
    layers=1,
    heads=2,
    warmup=2,
    eval_batches=1,
    sample_chars=4,
)


def tree_dtypes(tree):
    """The dtypes of a pytree's array leaves, as a list of numpy dtypes."""
    return [np.dtype(x.dtype) for x in jax.tree.leaves(tree)]


def assert_tree_allclose(tree, ref, *, rtol, atol=0.0):
    """Same structure, same dtypes and shapes, and values within tolerance."""
    assert jax.tree.structure(tree) == jax.tree.structure(ref)
    for x, y in zip(jax.tree.leaves(tree), jax.tree.leaves(ref)):
        assert x.dtype == y.dtype and x.shape == y.shape, (x.dtype, y.dtype)
        np.testing.assert_allclose(
            np.asarray(x, np.float64), np.asarray(y, np.float64), rtol=rtol, atol=atol
        )
