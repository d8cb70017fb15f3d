"""The migration namespaces (jaxamp/migration/): ``from jaxamp.migration import jmp``
(and ``mpx``, ``haliax``) holds that library's names, so a port is an import
change (docs/migration.md)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxamp
from jaxamp.migration import haliax, jmp, mpx

F16, F32, BF16 = np.dtype(jnp.float16), np.dtype(jnp.float32), np.dtype(jnp.bfloat16)

# Names of the installed libraries that are deliberately not ported under that
# name (docs/migration.md): module globals and mpx's internal gradient helper.
NOT_PORTED = {
    "mpx": {"HALF_PRECISION_DATATYPE", "calculate_scaled_grad", "jnp", "sys", "types"},
    "jmp": {"LossScale"},  # jmp's abstract base class
}


@pytest.mark.parametrize("namespace", [jmp, mpx, haliax])
def test_namespaces_have_sorted_complete_all(namespace):
    names = list(namespace.__all__)
    assert names == sorted(names) and len(set(names)) == len(names)
    for name in names:
        assert hasattr(namespace, name), name


@pytest.mark.parametrize("library", ["jmp", "mpx"])
def test_every_public_name_of_the_library_is_ported(library):
    original = pytest.importorskip(library)
    ours = {"jmp": jmp, "mpx": mpx}[library]
    public = {n for n in dir(original) if not n.startswith("_")}
    missing = sorted(public - NOT_PORTED[library] - set(ours.__all__))
    assert not missing, f"jaxamp.migration.{library} lacks {missing}"


def test_top_level_names_are_the_namespaces_objects():
    # Code written against ``jaxamp.X`` keeps working for a release, with the
    # same objects and a warning naming the namespace.
    served = set()
    for ns in (jmp, mpx, haliax):
        for name in ns.__all__:
            if jaxamp._MOVED.get(name, "").startswith("migration."):
                with pytest.warns(DeprecationWarning, match="jaxamp.migration"):
                    obj = getattr(jaxamp, name)
                assert obj is getattr(ns, name), name
                served.add(name)
    assert served == {n for n, h in jaxamp._MOVED.items() if "migration" in h}
    assert "migration" in jaxamp.__all__
    assert not {"get_policy", "cast_to_half", "filter_grad"} & set(jaxamp.__all__)


def test_mpx_force_full_precision_casts_outputs_to_float16_as_mpx():
    def f(x):
        assert x.dtype == F32  # runs in float32
        return x * 2, x + 1

    x = jnp.ones(3, jnp.bfloat16)
    a, b = mpx.force_full_precision(f)(x)
    assert a.dtype == b.dtype == F16
    (c, _) = mpx.force_full_precision(f, jnp.bfloat16)(x)
    assert c.dtype == BF16
    # The deprecated top-level name keeps float32 unless a return dtype is given.
    from jaxamp.migration._mpx import force_full_precision

    assert force_full_precision(f)(x)[0].dtype == F32
    real = pytest.importorskip("mpx")
    assert real.force_full_precision(f)(x)[0].dtype == a.dtype


def test_jmp_dynamic_loss_scale_follows_jmp_step_for_step():
    real = pytest.importorskip("jmp")
    ours = jmp.DynamicLossScale(jnp.float32(2**15), period=3, factor=4)
    theirs = real.DynamicLossScale(jnp.float32(2**15), period=3, factor=4)
    finite = [True, True, True, False, False, True, True, True, True, False]
    seen = []
    for f in finite:
        ours = ours.adjust(jnp.bool_(f))
        with jax.numpy_dtype_promotion("standard"):  # jmp's own code needs it
            theirs = theirs.adjust(jnp.bool_(f))
        assert type(ours) is jmp.DynamicLossScale
        assert float(ours.loss_scale) == float(theirs.loss_scale)
        assert int(ours.counter) == int(theirs.counter)
        seen.append(float(ours.loss_scale))
    assert seen[2] == 2.0**17 and seen[3] == 2.0**15  # it grew, then shrank
    assert int(ours.period) == 3 and float(ours.factor) == 4.0
    assert float(ours.min_loss_scale) == 1.0


def test_jmp_loss_scales_scale_and_unscale_as_jmp():
    x = {"a": jnp.ones(3, jnp.float16), "b": jnp.full((2,), 3.0)}
    s = jmp.StaticLossScale(8.0)
    assert float(s.loss_scale) == 8.0
    scaled = s.scale(x)
    assert scaled["a"].dtype == F16 and float(scaled["a"][0]) == 8.0
    assert float(s.unscale(scaled)["b"][0]) == 3.0
    assert s.adjust(jnp.bool_(False)) is s
    noop = jmp.NoOpLossScale()
    assert float(noop.loss_scale) == 1.0
    assert float(noop.scale(x)["b"][1]) == 3.0


def test_jmp_loss_scales_are_scaler_states_under_jit():
    # Accepted where a jaxamp scaler state is: through jit as a pytree, and by
    # dynamic_scale_value_and_grad.
    state = jmp.DynamicLossScale(jnp.float32(2**10), period=2)
    vg = jaxamp.dynamic_scale_value_and_grad(lambda w: (w * w).sum(), filter=False)
    new, (loss, grad) = jax.jit(lambda w, s: vg(w, dynamic_scaler_state=s))(
        jnp.ones(2), state
    )
    assert type(new) is jmp.DynamicLossScale
    assert float(loss) == 2.0 and np.allclose(grad, 2.0)
    assert int(new.counter) == 1


def test_jmp_dynamic_loss_scale_rejects_a_bad_period():
    with pytest.raises(ValueError, match="period"):
        jmp.DynamicLossScale(jnp.float32(2**15), period=0)


def test_haliax_namespace_reads_the_current_policy():
    assert haliax.current_mp_policy() is None
    with haliax.mixed_precision("p=f32,c=bf16,o=f32"):
        assert haliax.current_mp_policy().compute_dtype == BF16
        x = haliax.cast_floating(jnp.ones(2), "compute")
        assert x.dtype == BF16
        assert haliax.policy_compute_dtype() == BF16
