"""mpx's cast, dtype, loss-scaling and gradient-tool tests, adapted to jaxamp.

Source: Data-Science-in-Mechanical-Engineering/mixed_precision_for_JAX at
commit 00c097edfc953723d9e074e0c7ad56612fc454bc, ``tests/test_cast.py``,
``tests/test_dtypes.py``, ``tests/test_loss_scaling.py`` and
``tests/test_grad_tools.py``; semantics checked against the released package
mixed-precision-for-jax 0.1.8 (``mpx/_cast.py``, ``_dtypes.py``,
``_loss_scaling.py``, ``_grad_tools.py``), which is also the reference where
both run. Adaptations: mpx's tests build loss scales of shape ``(1,)``, which
mpx 0.1.8 itself rejects (``ndim == 0`` asserts), so scales are scalars here;
every name is jaxamp's (``jaxamp.migration.mpx.DynamicLossScaling`` for
``mpx.DynamicLossScaling`` and so on). Deliberate differences are asserted:
``@force_full_precision`` without a dtype keeps float32 outputs (mpx:
float16); gradients are unscaled by the scale that produced them (mpx: by the
adjusted one); a string given to ``set_half_precision_datatype`` is applied
(mpx ignores it).
"""

import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxamp
from jaxamp.migration._mpx import force_full_precision

F16, BF16, F32 = np.dtype(jnp.float16), np.dtype(jnp.bfloat16), np.dtype(jnp.float32)
F16_MAX = float(jnp.finfo(jnp.float16).max)  # (2 - 2**-10) * 2**15


# test_cast.py


class EQXModuleBase(eqx.Module):
    a: jax.Array
    b: jax.Array

    def __init__(self):
        self.a = jnp.ones(10, dtype=jnp.float32)
        self.b = jnp.ones(10, dtype=jnp.float32)


class LeafClass:
    """Not a pytree: its arrays are not cast."""

    def __init__(self):
        self.a = jnp.ones(10, dtype=jnp.float32)
        self.b = jnp.ones(10, dtype=jnp.float32)


class EQXModule1(eqx.Module):
    a: list
    b: jax.Array
    c: LeafClass

    def __init__(self):
        self.a = [EQXModuleBase() for _ in range(10)]
        self.b = jnp.ones(10, dtype=jnp.float32)
        self.c = LeafClass()


def nested_dict():
    return {
        "a": jnp.array([1.0, 2.0, 3.0], dtype=jnp.float32),
        "b": {
            "c": jnp.array([1.0, 2.0, 3.0], dtype=jnp.float16),
            "d": jnp.array([1.0, 2.0, 3.0], dtype=jnp.bfloat16),
        },
    }


def dtypes(tree):
    return [x.dtype for x in jax.tree_util.tree_leaves(tree)]


@pytest.mark.parametrize("dtype", [F16, BF16, F32])
def test_cast_eqx_module(dtype):
    module = EQXModule1()
    result = jaxamp.migration.mpx.cast_tree(module, dtype)
    for base in result.a:
        assert (base.a.dtype, base.b.dtype) == (dtype, dtype)
    assert result.b.dtype == dtype
    assert (result.c.a.dtype, result.c.b.dtype) == (F32, F32)


@pytest.mark.parametrize(
    "fn, dtype",
    [
        (lambda t: jaxamp.migration.mpx.cast_tree(t, jnp.float32), F32),
        (jaxamp.migration.mpx.cast_to_float32, F32),
        (jaxamp.migration.mpx.cast_to_float16, F16),
        (jaxamp.migration.mpx.cast_to_bfloat16, BF16),
        (jaxamp.migration.mpx.cast_to_full_precision, F32),
        (jaxamp.migration.mpx.cast_to_half_precision, F16),  # mpx's default half dtype
    ],
)
def test_cast_functions(fn, dtype):
    assert fn(jnp.array([1.0, 2.0], dtype=jnp.float16)).dtype == dtype
    assert dtypes(fn(nested_dict())) == [dtype] * 3


def test_force_full_precision_decorator():
    seen = []

    def test_func(x, y):
        seen.append((x.dtype, y.dtype))
        return x + y, x * y

    x = jnp.array([1.0, 2.0], dtype=jnp.float16)
    y = jnp.array([3.0, 4.0], dtype=jnp.float16)
    # mpx's force_full_precision(fn, return_dtype) casts the outputs back.
    result1, result2 = force_full_precision(test_func, jnp.float16)(x, y)
    assert (result1.dtype, result2.dtype) == (F16, F16)
    assert [float(v) for v in result2] == [3.0, 8.0]
    # Deliberate difference: mpx's default return_dtype is float16; jaxamp's
    # decorator form keeps the float32 the body computed.
    result1, result2 = force_full_precision(test_func)(x, y)
    assert (result1.dtype, result2.dtype) == (F32, F32)
    assert seen == [(F32, F32)] * 2


def test_mixed_tree_handling():
    tree = {
        "array": jnp.ones(3, jnp.float32),
        "scalar": 42,
        "nested": {"array": jnp.ones(3, jnp.float16), "none": None},
    }
    result = jaxamp.migration.mpx.cast_to_float32(tree)
    assert result["array"].dtype == F32 and result["nested"]["array"].dtype == F32
    assert result["scalar"] == 42 and result["nested"]["none"] is None


def test_empty_structures():
    assert jaxamp.migration.mpx.cast_to_float32({}) == {}
    assert jaxamp.migration.mpx.cast_to_float32([]) == []


def test_cast_function():
    def f(x, *, scale):
        return x * scale, (x + scale).astype(jnp.float32)

    g = jaxamp.migration.mpx.cast_function(f, jnp.bfloat16)
    a, b = g(jnp.ones(2, jnp.float32), scale=jnp.float32(3.0))
    assert (a.dtype, b.dtype) == (BF16, BF16)  # return_dtype defaults to dtype
    a, b = jaxamp.migration.mpx.cast_function(f, "bf16", jnp.float16)(
        jnp.ones(2), scale=2.0
    )
    assert (a.dtype, b.dtype) == (F16, F16) and float(a[0]) == 2.0
    # An array output is cast too; a non-array static output passes through.
    assert (
        jaxamp.migration.mpx.cast_function(lambda x: x, jnp.float16)(jnp.ones(2)).dtype
        == F16
    )
    assert (
        jaxamp.migration.mpx.cast_function(lambda x: "s", jnp.float16)(jnp.ones(2))
        == "s"
    )
    with pytest.raises(ValueError, match="return_dtype must be a floating"):
        jaxamp.migration.mpx.cast_function(f, jnp.float16, jnp.int32)
    with pytest.raises(TypeError, match="func must be callable"):
        jaxamp.migration.mpx.cast_function(None, jnp.float16)


def test_dict_outputs_are_cast_with_a_warning():
    # mpx casts only a tuple's elements or a single array; jaxamp casts every
    # float leaf and says where mpx would not have.
    f = jaxamp.migration.mpx.cast_function(
        lambda x: {"y": x * 2}, jnp.float16, jnp.float32
    )
    with pytest.warns(UserWarning, match="returned a dict; jaxamp casts its float"):
        out = f(jnp.ones(2))
    assert out["y"].dtype == F32  # mpx: float16
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # already in the dtype: same as mpx
        assert (
            jaxamp.migration.mpx.cast_function(lambda x: {"y": x}, "f16")(jnp.ones(2))[
                "y"
            ].dtype
            == F16
        )
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a tuple: as mpx, no warning
        assert force_full_precision(lambda x: (x,), "f16")(jnp.ones(2))[0].dtype == F16


def test_force_full_precision_inside_amp_runs_float32():
    def attention_logits(q, k):
        return q @ k.T

    def loss(q, k):
        s = force_full_precision(attention_logits, jnp.bfloat16)(q, k)
        assert s.dtype == BF16  # traced: the body's result cast to the dtype
        return (s.astype(jnp.float32) @ k).sum()

    q, k = jnp.ones((4, 8)), jnp.ones((4, 8))
    jaxpr = jax.make_jaxpr(jaxamp.amp(loss, compute_dtype=jnp.bfloat16))(q, k)
    dots = [
        ins
        for name, ins, _ in jaxamp.tools.primitive_dtypes(jaxpr)
        if name == "dot_general"
    ]
    # The forced matmul keeps float32 operands; the other one runs in bfloat16.
    assert (F32, F32) in dots and (BF16, BF16) in dots


# test_dtypes.py


def test_default_and_set_half_precision_datatype():
    assert jaxamp.migration.mpx.half_precision_datatype() == F16
    try:
        jaxamp.migration.mpx.set_half_precision_datatype(jnp.bfloat16)
        assert jaxamp.migration.mpx.half_precision_datatype() == BF16
        assert jaxamp.migration.mpx.cast_to_half_precision(jnp.ones(2)).dtype == BF16
        jaxamp.migration.mpx.set_half_precision_datatype(jnp.float16)
        assert jaxamp.migration.mpx.half_precision_datatype() == F16
        # mpx silently ignores a string; jaxamp applies it.
        jaxamp.migration.mpx.set_half_precision_datatype("bfloat16")
        assert jaxamp.migration.mpx.half_precision_datatype() == BF16
        with pytest.raises(ValueError, match="datatype=float32 is not a half"):
            jaxamp.migration.mpx.set_half_precision_datatype(jnp.float32)
        with pytest.raises(ValueError, match="datatype='f8' is not a known"):
            jaxamp.migration.mpx.set_half_precision_datatype("f8")
    finally:
        jaxamp.migration.mpx.set_half_precision_datatype(jnp.float16)


# test_loss_scaling.py


def make_scaling(scale=2.0**14, period=2000):
    return jaxamp.migration.mpx.DynamicLossScaling(
        loss_scaling=jnp.array(scale, dtype=jnp.float32),
        min_loss_scaling=jnp.array(2.0**-14, dtype=jnp.float32),
        factor=2,
        period=period,
    )


FINITE_TREE = {"a": jnp.array([1.0, 2.0, 3.0]), "b": {"c": jnp.array([4.0, 5.0])}}
INFINITE_TREE = {
    "a": jnp.array([1.0, jnp.inf, 3.0]),
    "b": {"c": jnp.array([4.0, jnp.nan])},
}


def test_all_finite():
    assert jaxamp.all_finite(FINITE_TREE)
    assert not jaxamp.all_finite(INFINITE_TREE)
    assert jaxamp.all_finite({})


def test_scale_unscale():
    scaling = make_scaling()
    scaled = scaling.scale(FINITE_TREE)
    assert scaled["a"].dtype == F32
    np.testing.assert_array_equal(scaled["a"], FINITE_TREE["a"] * 2**14)
    unscaled = scaling.unscale(scaled)
    assert unscaled["a"].dtype == F32
    np.testing.assert_array_equal(unscaled["a"], FINITE_TREE["a"])


_adjust = jax.jit(lambda s, finite: s.adjust(finite))


def test_adjust_finite_grads():
    scaling = make_scaling()
    for _ in range(2000):  # one full period
        scaling = _adjust(scaling, jnp.array(True))
    assert isinstance(scaling, jaxamp.migration.mpx.DynamicLossScaling)
    assert float(scaling.loss_scaling) == 2.0**15 and int(scaling.counter) == 0
    for _ in range(2000):
        scaling = _adjust(scaling, jnp.array(True))
    # Not doubled but clipped to float16's largest value.
    assert float(scaling.loss_scaling) == F16_MAX and int(scaling.counter) == 0


def test_adjust_infinite_grads():
    scaling = make_scaling().adjust(jnp.array(False))
    assert float(scaling.loss_scaling) == 2.0**13 and int(scaling.counter) == 0


def test_scaling_clipping():
    above = make_scaling(2.0**16).adjust(jnp.array(True))
    assert float(above.loss_scaling) == F16_MAX  # mpx: <= F16_MAX
    below = make_scaling(2.0**-15).adjust(jnp.array(False))
    assert float(below.loss_scaling) == 2.0**-14  # mpx: >= 2**-14


def test_scaled_decorator():
    scaling = make_scaling()
    result = jaxamp.migration.mpx.scaled(lambda x: x, scaling)(FINITE_TREE)
    np.testing.assert_array_equal(result["a"], FINITE_TREE["a"] * 2**14)
    value, aux = jaxamp.migration.mpx.scaled(lambda x: (x, x), scaling, has_aux=True)(
        jnp.float32(2.0)
    )
    assert (float(value), float(aux)) == (2.0**15, 2.0)
    with pytest.raises(
        TypeError, match="scaling must be a jaxamp.migration.mpx.DynamicLoss"
    ):
        jaxamp.migration.mpx.scaled(lambda x: x, 2.0**15)


def test_dynamic_loss_scaling_fields_and_errors():
    scaling = make_scaling(period=5)
    assert (int(scaling.period), float(scaling.factor)) == (5, 2.0)
    assert (int(scaling.patience), float(scaling.max_scaler)) == (4, F16_MAX)
    assert float(scaling.min_loss_scaling) == 2.0**-14
    leaves = jax.tree_util.tree_leaves(scaling)
    rebuilt = jax.tree_util.tree_unflatten(
        jax.tree_util.tree_structure(scaling), leaves
    )
    assert type(rebuilt) is jaxamp.migration.mpx.DynamicLossScaling
    with pytest.raises(ValueError, match="period=0 must be >= 1"):
        make_scaling(period=0)
    with pytest.raises(ValueError, match="scaler=-1.0 must be > 0"):
        jaxamp.migration.mpx.DynamicLossScaling(jnp.float32(-1.0), jnp.float32(1.0))


@pytest.mark.parametrize("period", [1, 3])
def test_scale_sequence_equals_mpxs(period):
    """Beyond mpx's tests: the installed mpx's DynamicLossScaling and jaxamp's
    produce the same scales and counters on one pattern of steps, clipping at
    float16's largest value included."""
    mpx = pytest.importorskip("mpx")
    pattern = [True] * 9 + [False, True, False, False] + [True] * 7
    ref = mpx.DynamicLossScaling(
        jnp.float32(2.0**13), jnp.float32(1.0), factor=2, period=period
    )
    ours = jaxamp.migration.mpx.DynamicLossScaling(
        jnp.float32(2.0**13), jnp.float32(1.0), 2, period
    )
    for finite in pattern:
        with jax.numpy_dtype_promotion("standard"):  # mpx mixes bool and int32
            ref = ref.adjust(jnp.bool_(finite))
        ours = _adjust(ours, jnp.bool_(finite))
        assert float(ours.loss_scaling) == float(ref.loss_scaling)
        assert int(ours.counter) == int(ref.counter)


# test_grad_tools.py


class SimpleModel(eqx.Module):
    weight: jax.Array
    bias: jax.Array

    def __init__(self):
        self.weight = jnp.array([1.0, 2.0], dtype=jnp.float32)
        self.bias = jnp.array([0.5], dtype=jnp.float32)

    def __call__(self, x):
        return jnp.dot(x, self.weight) + self.bias


X, Y = jnp.array([1.0, 2.0]), jnp.array([2.0])


def loss_fn(model, x, y):
    return jnp.mean((model(x) - y) ** 2)


def loss_fn_with_aux(model, x, y):
    pred = model(x)
    return jnp.mean((pred - y) ** 2), {"pred": pred}


def bad_loss_fn(model, x, y):
    return jnp.inf * loss_fn(model, x, y)


def test_select_tree():
    tree_a = {"a": jnp.array([1.0, 2.0]), "b": jnp.array([3.0, 4.0])}
    tree_b = {"a": jnp.array([5.0, 6.0]), "b": jnp.array([7.0, 8.0])}
    for pred, want in ((True, tree_a), (False, tree_b)):
        result = jaxamp.training.select_tree(jnp.array(pred), tree_a, tree_b)
        for k in "ab":
            np.testing.assert_array_equal(result[k], want[k])


def test_filter_grad():
    scaling = make_scaling(2.0**10)
    new, grads_finite, grad = jax.jit(
        jaxamp.migration.mpx.filter_grad(loss_fn, scaling)
    )(SimpleModel(), X, Y)
    assert bool(grads_finite) and isinstance(grad, SimpleModel)
    assert (
        isinstance(new, jaxamp.migration.mpx.DynamicLossScaling)
        and int(new.counter) == 1
    )
    # pred = 5.5, loss = 3.5**2: float16-exact, so the unscaled gradients are
    # exact: d/dw = 2 * 3.5 * x, d/db = 7, in float32.
    assert (grad.weight.dtype, grad.bias.dtype) == (F32, F32)
    assert grad.weight.tolist() == [7.0, 14.0] and grad.bias.tolist() == [7.0]
    new, grads_finite, grad = jaxamp.migration.mpx.filter_grad(bad_loss_fn, scaling)(
        SimpleModel(), X, Y
    )
    assert not bool(grads_finite) and float(new.loss_scaling) == 2.0**9
    _, finite, grad, aux = jaxamp.migration.mpx.filter_grad(
        loss_fn_with_aux, scaling, has_aux=True
    )(SimpleModel(), X, Y)
    assert bool(finite) and grad.weight.tolist() == [7.0, 14.0]
    assert aux["pred"].dtype == F16 and aux["pred"].tolist() == [5.5]


def test_filter_value_and_grad():
    scaling = make_scaling(2.0**10)
    value, new, grads_finite, grad = jaxamp.migration.mpx.filter_value_and_grad(
        loss_fn, scaling
    )(SimpleModel(), X, Y)
    assert value.dtype == F32 and float(value) == 12.25
    assert bool(grads_finite) and isinstance(grad, SimpleModel)
    assert isinstance(new, jaxamp.migration.mpx.DynamicLossScaling)
    vg = jaxamp.migration.mpx.filter_value_and_grad(
        loss_fn_with_aux, scaling, has_aux=True
    )
    (value, aux), new, grads_finite, grad = vg(SimpleModel(), X, Y)
    assert float(value) == 12.25 and "pred" in aux and bool(grads_finite)
    assert grad.bias.tolist() == [7.0]


def test_without_mixed_precision_nothing_is_cast_or_scaled():
    model = SimpleModel()
    out = jaxamp.migration.mpx.filter_grad(loss_fn, None, use_mixed_precision=False)(
        model, X, Y
    )
    assert out[0] is None and bool(out[1]) and out[2].weight.tolist() == [7.0, 14.0]
    vg = jaxamp.migration.mpx.filter_value_and_grad(
        loss_fn, None, use_mixed_precision=False
    )
    value, scaling, finite, grad = vg(model, X, Y)
    assert (float(value), value.dtype, scaling, bool(finite)) == (
        12.25,
        F32,
        None,
        True,
    )
    with pytest.raises(
        TypeError, match="scaling must be a jaxamp.migration.mpx.DynamicLoss"
    ):
        jaxamp.migration.mpx.filter_grad(loss_fn, None)


def test_gradients_on_a_growth_step_are_not_halved():
    """mpx unscales with the adjusted scale, so on a step where the scale grows
    its gradients are 1/factor of the true ones; jaxamp's are the true ones."""
    mpx = pytest.importorskip("mpx")
    ours = jaxamp.migration.mpx.filter_grad(loss_fn, make_scaling(2.0**4, period=1))
    new, _, grad = ours(SimpleModel(), X, Y)
    assert float(new.loss_scaling) == 2.0**5  # the scale grew on this step
    assert grad.weight.tolist() == [7.0, 14.0]
    ref_scaling = mpx.DynamicLossScaling(
        jnp.float32(2.0**4), jnp.float32(2.0**-14), factor=2, period=1
    )
    with jax.numpy_dtype_promotion("standard"):
        _, _, ref = mpx.filter_grad(loss_fn, ref_scaling)(SimpleModel(), X, Y)
    assert ref.weight.tolist() == [3.5, 7.0]


def test_optimizer_update():
    model, optimizer = SimpleModel(), optax.sgd(learning_rate=0.1)
    opt_state = optimizer.init(eqx.filter(model, eqx.is_array))
    scaling = make_scaling(2.0**10)
    _, grads_finite, grads = jaxamp.migration.mpx.filter_grad(loss_fn, scaling)(
        model, X, Y
    )
    new_model, new_state = jaxamp.optimizer_update(
        model, optimizer, opt_state, grads, grads_finite
    )
    assert isinstance(new_model, SimpleModel) and isinstance(new_state, tuple)
    np.testing.assert_allclose(new_model.weight, [0.3, 0.6], rtol=1e-6)
    _, grads_finite, grads = jaxamp.migration.mpx.filter_grad(bad_loss_fn, scaling)(
        model, X, Y
    )
    new_model, _ = jaxamp.optimizer_update(
        model, optimizer, opt_state, grads, grads_finite
    )
    np.testing.assert_array_equal(new_model.weight, model.weight)
    np.testing.assert_array_equal(new_model.bias, model.bias)
