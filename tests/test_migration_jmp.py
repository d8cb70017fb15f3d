"""jmp's policy and loss-scale tests, adapted to jaxamp's names.

Source: google-deepmind/jmp at commit 9c1cdbbf78da (release 0.0.4),
``jmp/_src/policy_test.py`` and ``jmp/_src/loss_scale_test.py``. Name map:
``jmp.Policy`` / ``get_policy`` / ``half_dtype`` / ``cast_to_full`` /
``cast_to_half`` / ``all_finite`` / ``select_tree`` keep their names;
``DynamicLossScale(loss_scale, counter, period, factor, min_loss_scale)`` is
``DynamicScalerState(scaler=..., count=..., patience=period - 1,
adjust_factor=factor, min_scaler=...)``; ``StaticLossScale(s)`` is
``StaticScalerState(s)`` and ``NoOpLossScale()`` is ``StaticScalerState()``.
Where jaxamp deliberately differs (a scale of 0, an int scale, a non-float
policy dtype, a non-scalar predicate) the adapted case asserts jaxamp's error
or conversion. The installed jmp package is the reference where both run.
"""

import itertools as it

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxamp

HALF_DTYPES = (np.float16, jnp.float16, jnp.bfloat16)
FULL_DTYPES = (np.float32, jnp.float32)
DTYPES = HALF_DTYPES + FULL_DTYPES
NUMPYS = (np, jnp)
NAMES = {np.dtype(np.float16): "float16", np.dtype(jnp.bfloat16): "bfloat16"}
NAMES[np.dtype(np.float32)] = "float32"
F32 = np.dtype(np.float32)


def name(dtype):
    return NAMES[np.dtype(dtype)]


# policy_test.py


@pytest.mark.parametrize("dtype, np_", list(it.product(DTYPES, NUMPYS)))
@pytest.mark.parametrize("kind", ["param", "compute", "output"])
def test_policy_cast_to(kind, dtype, np_):
    policy = jaxamp.migration.jmp.Policy(dtype, dtype, dtype)
    assert getattr(policy, f"{kind}_dtype") == dtype
    out = getattr(policy, f"cast_to_{kind}")({"a": np_.ones([])})
    assert out["a"].dtype == np.dtype(dtype)


@pytest.mark.parametrize("dtype, np_", list(it.product(DTYPES, NUMPYS)))
def test_policy_with_output_dtype(dtype, np_):
    policy = jaxamp.migration.jmp.Policy(np_.float32, np_.float32, np_.float32)
    policy = policy.with_output_dtype(dtype)
    assert policy.output_dtype == dtype
    assert (policy.param_dtype, policy.compute_dtype) == (F32, F32)


@pytest.mark.parametrize(
    "dtype_name, dtype",
    [("float16", np.float16), ("float32", np.float32), ("bfloat16", jnp.bfloat16)],
)
def test_get_policy(dtype_name, dtype):
    policy = jaxamp.migration.jmp.get_policy(dtype_name)
    assert policy.param_dtype == policy.compute_dtype == policy.output_dtype == dtype


def test_get_policy_almost_dtype():
    # jmp: "Unknown dtype"; jaxamp names the bad value and the known names.
    with pytest.raises(ValueError, match="'compute_float16' is not a known"):
        jaxamp.migration.jmp.get_policy("compute_float16")


@pytest.mark.parametrize("dtype", DTYPES)
def test_get_policy_mixed(dtype):
    # Unspecified output follows compute: "c=bf16" is p=f32,c=bf16,o=bf16.
    policy = jaxamp.migration.jmp.get_policy(f"c={name(dtype)}")
    assert (policy.param_dtype, policy.compute_dtype, policy.output_dtype) == (
        F32,
        dtype,
        dtype,
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_get_policy_compute(dtype):
    policy = jaxamp.migration.jmp.get_policy(f"c={name(dtype)},o=full")
    assert (policy.param_dtype, policy.compute_dtype, policy.output_dtype) == (
        F32,
        dtype,
        F32,
    )


def test_half_dtype():
    on_tpu = jax.local_devices()[0].platform == "tpu"
    assert jaxamp.migration.jmp.half_dtype() == (
        jnp.bfloat16 if on_tpu else jnp.float16
    )


def _tree(dtype):
    return dict(
        o=object(),
        h=jnp.ones([], dtype=dtype),
        f=jnp.ones([]),
        i=jnp.ones([], dtype=jnp.int16),
    )


def test_cast_to_full():
    half_tree = _tree(jaxamp.migration.jmp.half_dtype())
    full = jaxamp.migration.jmp.cast_to_full(half_tree)
    assert full["o"] is half_tree["o"]
    assert [full[k].dtype for k in "hfi"] == [F32, F32, np.dtype(np.int16)]
    assert all(float(full[k]) == 1.0 for k in "hfi")


def test_cast_to_half():
    dtype = jaxamp.migration.jmp.half_dtype()
    half = jaxamp.migration.jmp.cast_to_half(_tree(jnp.float32))
    assert [half[k].dtype for k in "hfi"] == [dtype, dtype, np.dtype(np.int16)]


# jmp's dtype_to_names: the first name of each dtype is what str() prints.
JMP_FIRST_NAME = {np.dtype(jnp.bfloat16): "bf16", np.dtype(np.float16): "f16"}
JMP_FIRST_NAME[F32] = "full"


@pytest.mark.parametrize("dtype", DTYPES)
def test_str(dtype):
    policy = jaxamp.migration.jmp.Policy(dtype, dtype, dtype)
    for piece in str(policy).split(","):
        assert piece.split("=")[1] == JMP_FIRST_NAME[np.dtype(dtype)]
    assert jaxamp.migration.jmp.get_policy(str(policy)) == policy


@pytest.mark.parametrize(
    "spec",
    ["c=f16", "p=f16", "p=bf16,c=f32", "o=bf16", "p=f32,c=bf16,o=f32", "f32", "half"],
)
def test_policy_strings_agree_with_jmp(spec):
    """Beyond jmp's own tests: the installed jmp parses every spec to the same
    dtypes, and each library parses the other's str()."""
    jmp = pytest.importorskip("jmp")
    ours, theirs = jaxamp.migration.jmp.get_policy(spec), jmp.get_policy(spec)
    fields = ("param_dtype", "compute_dtype", "output_dtype")
    assert [getattr(ours, f) for f in fields] == [getattr(theirs, f) for f in fields]
    assert jaxamp.migration.jmp.get_policy(str(theirs)) == ours
    back = jmp.get_policy(str(ours))
    assert [getattr(back, f) for f in fields] == [getattr(theirs, f) for f in fields]


def test_non_float_policy_dtypes_raise():
    # jmp keeps any dtype; jaxamp rejects one it could never cast to.
    with pytest.raises(ValueError, match="compute_dtype must be a floating"):
        jaxamp.migration.jmp.Policy(jnp.float32, jnp.int32, jnp.float32)


# loss_scale_test.py


def test_no_op_loss_scale():
    # NoOpLossScale -> StaticScalerState(): scale 1, values and dtypes kept
    # (jmp returns the same tree object; jaxamp multiplies by 1).
    loss_scale = jaxamp.StaticScalerState()
    tree = {"a": jnp.ones([])}
    assert float(loss_scale.scale(tree)["a"]) == 1.0
    assert float(loss_scale.unscale(tree)["a"]) == 1.0
    assert loss_scale.adjust(jnp.bool_(False)) is loss_scale


@pytest.mark.parametrize(
    "cls, scale",
    [(jaxamp.StaticScalerState, s) for s in (2, 3, 4)]
    + [(lambda s: jaxamp.DynamicScalerState(scaler=s), s) for s in (2.0, 3.0, 4.0)],
)
def test_static_loss_scale(cls, scale):
    loss_scale = cls(scale)
    tree = {"a": jnp.array(1.0)}
    scaled = loss_scale.scale(tree)
    assert scaled["a"].dtype == F32 and float(scaled["a"]) == 1.0 * scale
    assert float(loss_scale.unscale(scaled)["a"]) == 1.0


def test_static_loss_scale_of_zero_raises():
    # jmp's test_static_empty_trees builds StaticLossScale(0); jaxamp rejects
    # a scale that would zero every gradient. Its state is one leaf (saved with
    # the checkpoint), where jmp's static scales have none.
    with pytest.raises(ValueError, match="scaler=0 must be > 0"):
        jaxamp.StaticScalerState(0)
    assert len(jax.tree_util.tree_leaves(jaxamp.StaticScalerState())) == 1


def test_dynamic_loss_scale_no_warnings(recwarn):
    jaxamp.DynamicScalerState(scaler=2.0**15)
    assert len(recwarn) == 0


def test_dynamic_loss_scale_tree():
    scale, counter = jnp.ones([]), jnp.zeros([], jnp.int32)
    loss_scale = jaxamp.DynamicScalerState(
        scaler=scale, count=counter, patience=2000 - 1, adjust_factor=2
    )
    leaves = jax.tree_util.tree_leaves(loss_scale)
    # Every field is a leaf (jmp keeps period and factor as static metadata).
    assert [float(x) for x in leaves] == [1999, 2, 1, 0, 0, 1, 2.0**24]
    same = jax.tree_util.tree_map(lambda x: x, loss_scale)
    assert [float(x) for x in jax.tree_util.tree_leaves(same)] == [
        float(x) for x in leaves
    ]


_adjust = jax.jit(lambda state, finite: state.adjust(finite))


@pytest.mark.parametrize("period, factor", [(20, 2), (30, 3)])
def test_dynamic_loss_scale_adjust_increases_on_finite(period, factor):
    loss_scale = jaxamp.DynamicScalerState(
        scaler=jnp.float32(10),
        count=jnp.int32(0),
        patience=period - 1,
        adjust_factor=factor,
    )
    for i in range(1, period):
        loss_scale = _adjust(loss_scale, jnp.bool_(True))
        assert float(loss_scale.scaler) == 10 and int(loss_scale.count) == i
        assert int(loss_scale.patience) == period - 1
        assert float(loss_scale.adjust_factor) == factor
    # The period-th finite step grows the scale (jaxamp: after patience counted).
    loss_scale = _adjust(loss_scale, jnp.bool_(True))
    assert float(loss_scale.scaler) == 10 * factor and int(loss_scale.count) == 0


@pytest.mark.parametrize(
    "period, factor, min_loss_scale",
    [(20, 2, 1.0), (30, 3, 1.0), (20, 2, 0.3125), (30, 3, 0.37)],
)
def test_dynamic_loss_scale_adjust_reduce_on_non_finite(period, factor, min_loss_scale):
    # jmp's test_dynamic_loss_scale_adjust_reduce_on_non_finite (min 1, jmp's
    # default) and test_dynamic_loss_scale_explicit_min_loss_scale.
    init = np.float32(10)
    loss_scale = jaxamp.DynamicScalerState(
        scaler=jnp.asarray(init),
        patience=period - 1,
        adjust_factor=factor,
        min_scaler=min_loss_scale,
    )
    assert float(init) / factor**100 < 1, "should cover max(min, S)"
    for i in range(100):
        loss_scale = _adjust(loss_scale, jnp.bool_(False))
        np.testing.assert_allclose(
            loss_scale.scaler,
            max(min_loss_scale, float(init) / factor ** (i + 1)),
            rtol=1e-5,
        )
        assert int(loss_scale.count) == 0 and int(loss_scale.total_resets) == i + 1


def test_min_loss_scale_of_zero_raises():
    # jmp's explicit-min case (5., 2., 0.) lets the scale decay to 0, after
    # which every gradient is 0; jaxamp asks for a positive bound.
    with pytest.raises(ValueError, match="min_scaler=0.0 must be > 0"):
        jaxamp.DynamicScalerState(scaler=10.0, min_scaler=0.0)


def test_dynamic_loss_scale_adjust_requires_scalar_input():
    # An empty test in jmp; jaxamp checks it.
    with pytest.raises(ValueError, match="grads_finite must be a scalar bool"):
        jaxamp.DynamicScalerState().adjust(jnp.array([True, False]))


def test_int_loss_scales_are_stored_as_float32():
    # jmp warns "Expected floating type for loss_scale"; jaxamp's fields have
    # fixed dtypes, so an int scale or bound is converted, value kept.
    state = jaxamp.DynamicScalerState(
        scaler=jnp.asarray(1, dtype=jnp.int32),
        min_scaler=jnp.asarray(1, dtype=jnp.int32),
    )
    assert (state.scaler.dtype, state.min_scaler.dtype) == (F32, F32)
    assert float(state.scaler) == float(state.min_scaler) == 1.0


@pytest.mark.parametrize("non_finite", [jnp.inf, jnp.nan])
def test_all_finite(non_finite):
    assert jaxamp.all_finite(None)
    assert jaxamp.all_finite({})
    assert not jaxamp.all_finite({"a": jnp.array(non_finite)})
    assert not jaxamp.all_finite({"a": jnp.ones([]), "b": jnp.array(non_finite)})
    assert not jaxamp.all_finite({"a": jnp.array(non_finite), "b": jnp.ones([])})
    assert jaxamp.all_finite({"a": jnp.ones([]), "b": jnp.ones([])})


def test_select_tree():
    a = {"a": jnp.ones([]), "b": jnp.zeros([])}
    b = {"a": jnp.zeros([]), "b": jnp.ones([])}
    assert jaxamp.training.select_tree(jnp.bool_(True), None, None) is None
    assert jaxamp.training.select_tree(jnp.bool_(False), None, None) is None
    for pred, want in ((True, a), (False, b)):
        got = jaxamp.training.select_tree(jnp.bool_(pred), a, b)
        assert {k: float(v) for k, v in got.items()} == {
            k: float(v) for k, v in want.items()
        }


def test_select_tree_rejects_non_scalar():
    # jmp: AssertionError "expected boolean scalar"; jaxamp: ValueError.
    with pytest.raises(ValueError, match="pred must be a scalar"):
        jaxamp.training.select_tree(jnp.ones([1]), None, None)


@pytest.mark.parametrize("period, factor", [(3, 2), (1, 2), (4, 3)])
def test_scale_sequence_equals_jmps(period, factor):
    """Beyond jmp's tests: on one pattern of finite / non-finite steps the
    installed jmp's DynamicLossScale and DynamicScalerState(patience=period - 1)
    produce the same scales and counters, step by step."""
    jmp = pytest.importorskip("jmp")
    pattern = [True] * 7 + [False, True, False, False] + [True] * 9
    ref = jmp.DynamicLossScale(jnp.float32(2.0**10), jnp.int32(0), period, factor)
    ours = jaxamp.DynamicScalerState(
        scaler=2.0**10, patience=period - 1, adjust_factor=factor
    )
    for finite in pattern:
        with jax.numpy_dtype_promotion("standard"):  # jmp mixes bool and int32
            ref = ref.adjust(jnp.bool_(finite))
        ours = _adjust(ours, jnp.bool_(finite))
        assert float(ours.scaler) == float(ref.loss_scale)
        assert int(ours.count) == int(ref.counter)
