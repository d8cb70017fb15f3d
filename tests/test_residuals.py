"""Compressed residuals: ``amp(residual_dtype=...)`` and ``residual_rule``.

The stored form (``_policy/_residual_format.py``), what the backward pass saves (JAX's
saved-residuals listing), gradients against float32 under ``jax.jit``, the
higher-order primitives, per-scope policies, bad input, and the must-show
figures on the scanned GPT of ``benchmarks/run.py`` (size S).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import residuals as bench_residuals
import run as bench
from helpers import TINY_CHARLM, rel_l2, round_bf16
from jax.ad_checkpoint import checkpoint_name

import jaxamp
from jaxamp import _compat
from jaxamp._base._codec import LastAxisGroups
from jaxamp._policy._checkpoint import (
    AS_IS,
    EXACT_INPUT,
    STORED_DERIVATIVE,
    STORED_PRODUCT,
)
from jaxamp._policy._residual_format import (
    compressible,
    decode,
    encode,
    residual_recipe,
)

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
BF16 = jnp.bfloat16
EIGHT_BIT = {np.dtype(E4M3), np.dtype(E5M2), np.dtype(jnp.int8)}
K = jax.random.split(jax.random.key(32), 8)


def _saved(fn, *args):
    """``[(aval, source)]`` of the saved residuals that are not arguments."""
    return [
        (a, s)
        for a, s in _compat.saved_residuals(fn, *args)
        if not s.startswith("from the argument")
    ]


# The stored form ------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype, group, bound",
    [(E4M3, 128, 2.0**-4), (E5M2, 128, 2.0**-3), (jnp.int8, 32, None)],
)
def test_encode_decode_roundtrip_under_jit(dtype, group, bound):
    spread = jnp.exp(jax.random.normal(K[1], (4, 6, 1)))
    x = jax.random.normal(K[0], (4, 6, 256)) * spread
    fmt = residual_recipe(dtype, group)
    q, scale = jax.jit(lambda x: encode(x, fmt))(x)
    assert q.dtype == np.dtype(dtype) and q.shape == x.shape
    assert scale.dtype == np.float32 and scale.shape == (4, 6, 256 // group)
    back = jax.jit(lambda q, s: decode(q, s, fmt, jnp.float32))(q, scale)
    err = np.abs(np.asarray(back) - np.asarray(x))
    step = np.repeat(np.asarray(scale), group, axis=-1)  # one stored unit
    if bound is None:  # int8: round to the nearest of 255 even levels
        assert (err <= 0.5 * step + 1e-7 * np.abs(x)).all()
    else:  # FP8: half a unit in the last place of each value (normal range)
        normal = np.abs(np.asarray(x)) > step * 2.0**-6
        assert (err[normal] <= bound * np.abs(np.asarray(x))[normal] * 1.0001).all()
    # Each group's largest magnitude is stored at the format's bound.
    peak = np.abs(np.asarray(q, np.float32)).reshape(4, 6, -1, group).max(-1)
    np.testing.assert_allclose(peak, fmt.format.bound)


def test_short_and_odd_last_axes():
    fmt = residual_recipe(E4M3, 128)
    # 200 = one group of 128 and one of 72; 40 (<= 128) is one group per row.
    for length, groups in ((200, 2), (40, 1), (128, 1), (257, 3)):
        x = jax.random.normal(K[2], (3, length))
        q, scale = encode(x, fmt)
        assert scale.shape == (3, groups) and q.shape == x.shape
        back = decode(q, scale, fmt, jnp.float32)
        assert rel_l2(back, x) < 0.04
    # The short group has its own scale: an outlier in it leaves the first
    # 128 values' scale alone.
    x = jnp.ones((1, 200)).at[0, 150].set(1000.0)
    _, scale = encode(x, fmt)
    np.testing.assert_allclose(np.asarray(scale), [[1 / 448, 1000 / 448]], rtol=1e-6)
    assert not compressible(jnp.ones((8, 31)))  # a scale per < 32 values
    assert not compressible(jnp.ones((8, 64), E4M3))  # already 8-bit
    assert not compressible(jnp.ones((8, 64), jnp.int32))
    assert compressible(jnp.ones((8, 32), BF16))


def test_nonfinite_group_decodes_to_nan():
    fmt = residual_recipe(E4M3, 32)
    x = jnp.ones((2, 64)).at[0, 3].set(jnp.inf)
    back = decode(*encode(x, fmt), fmt, jnp.float32)
    assert np.isnan(np.asarray(back[0, :32])).all()
    np.testing.assert_array_equal(np.asarray(back[0, 32:]), 1.0)
    np.testing.assert_array_equal(np.asarray(back[1]), 1.0)


# What the backward pass saves ------------------------------------------------


def _mlp_params():
    w1 = jax.random.normal(K[3], (64, 256)) / 8
    w2 = jax.random.normal(K[4], (256, 64)) / 16
    x = jax.random.normal(K[5], (32, 64))
    return w1, w2, x


def mlp(w1, w2, x):
    h = jax.nn.gelu(x @ w1)
    with jax.named_scope("head"):
        y = jnp.tanh(h @ w2)
        return jnp.mean(y**2)


@pytest.mark.parametrize("dtype", [E4M3, E5M2, "int8"])
def test_one_residual_code_only_8_bit_values_and_scales(dtype):
    args = _mlp_params()
    f = jaxamp.amp(mlp, compute_dtype=BF16, residual_dtype=dtype)
    saved = _saved(f, *args)
    stored = np.dtype(jnp.int8 if dtype == "int8" else dtype)
    big = [a for a, _ in saved if np.prod(a.shape) >= 32 * 64]
    coded = sorted((a.shape, np.dtype(a.dtype)) for a in big)
    if dtype == "int8":
        # The GELU is stored as its input alone (its internals and output, the
        # input of h @ w2, are recomputed from it), the head's tanh likewise.
        want = [((32, 64), stored), ((32, 256), stored)]
    else:
        # FP8 leaves a product's input in the compute dtype: h @ w2 saves the
        # GELU's input in bfloat16 and recomputes the GELU from it; only the
        # head's tanh input is 8-bit, in int8 (the product form): the loss
        # squares the tanh's output, whose derivative 2 y g is a product of
        # it. One code for the tanh and the square, no float32 copy anywhere.
        want = [((32, 64), np.dtype(jnp.int8)), ((32, 256), np.dtype(BF16))]
    assert coded == want, saved
    small = [a for a, _ in saved if np.prod(a.shape) < 32 * 64]
    assert all(np.dtype(a.dtype) == np.float32 for a in small), small
    plain = jaxamp.saved_residual_bytes(jaxamp.amp(mlp, compute_dtype=BF16), *args)
    assert jaxamp.saved_residual_bytes(f, *args) < 0.6 * plain


def test_forward_is_exact_and_gradients_close_under_jit():
    args = _mlp_params()
    plain = jaxamp.amp(mlp, compute_dtype=BF16)
    ref = jax.jit(jax.value_and_grad(mlp, argnums=(0, 1)))(*args)
    base = jax.jit(jax.value_and_grad(plain, argnums=(0, 1)))(*args)
    for dtype, tol in ((E4M3, 0.06), ("int8", 0.03)):
        f = jaxamp.amp(mlp, compute_dtype=BF16, residual_dtype=dtype)
        value, grads = jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(*args)
        # The forward pass reads the exact values: only saved copies are 8-bit.
        np.testing.assert_allclose(value, base[0], rtol=1e-6)
        assert rel_l2(grads, ref[1]) < tol
        assert all(g.dtype == np.float32 for g in grads)


def test_cotangents_keep_their_dtype():
    # A bfloat16 cotangent stays bfloat16: gradients are not 8-bit.
    def f(w, x):
        return jnp.sum(jnp.tanh(x @ w).astype(jnp.float32))

    w, _, x = _mlp_params()
    g = jaxamp.amp(f, compute_dtype=BF16, residual_dtype=E4M3)
    jaxpr = jax.make_jaxpr(jax.grad(g))(w, x)
    dots = [
        e
        for e, _ in jaxamp.tools.iter_equations(jaxpr)
        if e.primitive.name == "dot_general"
    ]
    assert dots and all(
        np.dtype(v.aval.dtype) not in EIGHT_BIT for e in dots for v in e.invars
    )


# Higher-order primitives ----------------------------------------------------


def _scanned(remat=False, act=jax.nn.gelu):
    def layer(h, w):
        return h + act(h @ w) @ w.T, None

    body = jax.checkpoint(layer) if remat else layer

    def loss(ws, x):
        h, _ = jax.lax.scan(body, x, ws)
        return jnp.mean(h**2)

    ws = jax.random.normal(K[6], (3, 64, 64)) / 8
    x = jax.random.normal(K[7], (16, 64))
    return loss, ws, x


@pytest.mark.parametrize("remat", [False, True])
def test_scan_and_checkpoint_save_8_bit(remat):
    loss, ws, x = _scanned(remat)
    f32 = jaxamp.saved_residual_bytes(loss, ws, x)
    # Every saved activation is a product's input, the checkpoint's input h
    # too (h @ w in the recomputed block): int8 stores them, FP8 too, in its
    # product form (_residual_format.product_form).
    f = jaxamp.amp(loss, compute_dtype=BF16, residual_dtype="int8")
    saved = _saved(f, ws, x)
    stacked = [a for a, _ in saved if a.shape[:1] == (3,) and np.prod(a.shape) > 3 * 64]
    assert stacked and all(np.dtype(a.dtype) == np.int8 for a in stacked)
    assert jaxamp.saved_residual_bytes(f, ws, x) < 0.35 * f32
    ref = jax.grad(loss)(ws, x)
    assert rel_l2(jax.jit(jax.grad(f))(ws, x), ref) < 0.06


@jax.custom_jvp
def softsign(x):
    return x / (1 + jnp.abs(x))


@softsign.defjvp
def _softsign_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    return softsign(x), t / jnp.square(1 + jnp.abs(x))


def test_custom_jvp_function_runs_its_rule_on_decoded_inputs():
    # jax.nn.relu is a custom_jvp function too.
    def loss(w, x):
        h = jax.nn.relu(x @ w)
        return jnp.sum(softsign(h @ w.T) ** 2)

    w, _, x = _mlp_params()
    w = w[:, :64]
    # int8 stores products' inputs too (FP8 leaves relu's output in bfloat16).
    f = jaxamp.amp(loss, compute_dtype=BF16, residual_dtype="int8")
    saved = _saved(f, w, x)
    assert saved and all(
        np.prod(a.shape) < 32 * 64 or np.dtype(a.dtype) in EIGHT_BIT for a, _ in saved
    ), saved
    assert rel_l2(jax.jit(jax.grad(f))(w, x), jax.grad(loss)(w, x)) < 0.06


def test_choices_and_exponentials_are_not_recomputed_from_rounded_values():
    # jnp.sort is a jitted function: recomputed from 8-bit inputs in the
    # backward pass its order (which element the cotangent reaches) could
    # change; sort, max and exp inside it save what JAX saves.
    w, _, x = _mlp_params()

    def loss(w, x):
        h = jnp.sort(x @ w, axis=-1)[:, -8:]
        return jnp.sum(h) + jnp.sum(jax.nn.logsumexp(x @ w, axis=-1))

    f = jaxamp.amp(loss, compute_dtype=BF16, residual_dtype=E4M3)
    got = jax.jit(jax.grad(f))(w, x)
    assert rel_l2(got, jax.grad(loss)(w, x)) < 0.02


def test_vmap_of_grad():
    w, _, x = _mlp_params()

    def loss(w, x):
        return jnp.sum(jnp.tanh(x @ w) ** 2)

    f = jaxamp.amp(loss, compute_dtype=BF16, residual_dtype="int8")
    xs = jnp.stack([x, 2 * x])
    got = jax.jit(jax.vmap(jax.grad(f), in_axes=(None, 0)))(w, xs)
    ref = jax.vmap(jax.grad(loss), in_axes=(None, 0))(w, xs)
    assert got.shape == ref.shape and rel_l2(got, ref) < 0.03


def test_float16_with_loss_scaling_is_finite():
    loss, ws, x = _scanned()
    f = jaxamp.amp(loss, compute_dtype=jnp.float16, residual_dtype=E4M3)
    vg = jaxamp.dynamic_scale_value_and_grad(f, filter=False)
    state = jaxamp.DynamicScalerState()
    new_state, (_, grads) = jax.jit(vg)(ws, x, dynamic_scaler_state=state)
    assert bool(jnp.isfinite(grads).all())
    assert int(new_state.total_resets) == 0  # the step was not skipped
    assert rel_l2(grads, jax.grad(loss)(ws, x)) < 0.06


# Checkpoint boundaries: the rule follows each saved value ---------------------

L, WIDTH = 3, 64
NAMES = jax.checkpoint_policies.save_only_these_names("act")
DOTS = jax.checkpoint_policies.dots_with_no_batch_dims_saveable


_norm = bench_residuals._norm


def _block(h, w):
    # Each half: LayerNorm -> matmul -> GELU -> matmul, added to the stream.
    # The block's input h and the named stream "act" reach a matmul only
    # through a LayerNorm, which does not damp their error.
    a = checkpoint_name(h + jax.nn.gelu(_norm(h) @ w["up"]) @ w["down"], "act")
    return a + jax.nn.gelu(_norm(a) @ w["up"]) @ w["down"], None


def _checkpointed(policy=None):
    """Scanned blocks, each under ``jax.checkpoint(policy=policy)``; the loss
    is linear in the output, with constant weights (nothing saved after the
    blocks)."""
    ks = jax.random.split(K[0], 4)
    c = jax.random.normal(ks[2], (32, WIDTH))

    def loss(params, x):
        body = jax.checkpoint(_block, policy=policy)
        h, _ = jax.lax.scan(body, x, params)
        return jnp.sum(h * c) / h.size

    params = round_bf16(
        {
            "up": jax.random.normal(ks[0], (L, WIDTH, 4 * WIDTH)) / 8,
            "down": jax.random.normal(ks[1], (L, 4 * WIDTH, WIDTH)) / 16,
        }
    )
    # Activations in the hundreds, exactly representable in bfloat16.
    x = round_bf16(300.0 * jax.random.normal(ks[3], (32, WIDTH)))
    return loss, params, x


def _stacked(f, *args, width=WIDTH):
    """Sorted dtype names of the saved per-layer arrays of the given width."""
    return sorted(
        np.dtype(a.dtype).name for a, _ in _saved(f, *args) if a.shape == (L, 32, width)
    )


def _grads(loss, params, x, dtype="none"):
    if dtype == "none":
        f = loss
    else:
        f = jaxamp.amp(loss, compute_dtype=BF16, residual_dtype=dtype)
    return jax.jit(jax.grad(f))(params, x)


@pytest.mark.parametrize("policy", [None, NAMES, DOTS], ids=["plain", "names", "dots"])
def test_checkpointed_products_inputs_stored_int8_for_fp8_and_int8(policy):
    loss, params, x = _checkpointed(policy)
    amp = jaxamp.amp(loss, compute_dtype=BF16)
    fp8 = jaxamp.amp(loss, compute_dtype=BF16, residual_dtype=E4M3)
    int8 = jaxamp.amp(loss, compute_dtype=BF16, residual_dtype="int8")
    # What the checkpoint saves is what JAX saves for amp bfloat16 with the
    # same policy (its inputs h; "act"; the up-projections' outputs, which
    # the down-projections read through a GELU). Each reaches a matmul's
    # input in the recomputed block, so FP8 stores each in its product form,
    # int8 in 1 x 32 groups, as int8 does: never in FP8.
    for width in (WIDTH, 4 * WIDTH):
        want = _stacked(amp, params, x, width=width)
        assert _stacked(fp8, params, x, width=width) == ["int8"] * len(want)
        assert _stacked(int8, params, x, width=width) == ["int8"] * len(want)
    n = {None: 1, NAMES: 2, DOTS: 2}[policy]  # dots: the down-projection's too
    assert _stacked(amp, params, x) == ["bfloat16"] * n
    assert _stacked(amp, params, x, width=4 * WIDTH) == ["bfloat16"] * 2 * (
        policy is DOTS
    )
    ref, g_amp = _grads(loss, params, x), _grads(loss, params, x, None)
    err_amp = rel_l2(g_amp, ref)
    # int8 (0.5% per value) within the issue's 2x of amp bfloat16's error
    # (1.25x to 1.4x measured); FP8 stores the same int8 codes here.
    for dtype in ("int8", E4M3):
        assert rel_l2(_grads(loss, params, x, dtype), ref) <= 2.0 * err_amp


def _tanh_and_softmax(checkpoint):
    c = jax.checkpoint if checkpoint else (lambda f: f)

    def loss(w, x):
        h = x @ w
        t = c(lambda h: jnp.tanh(h / 300.0) * 3.0)(h)
        p = c(lambda h: jax.nn.softmax(h / 300.0, axis=-1))(h)
        return jnp.sum((t + p) @ w.T)

    return loss


def test_checkpoint_values_read_by_a_derivative_are_int8():
    # The boundary input of tanh(h / 300) * 3 reaches no product in the block,
    # but the tanh's derivative reads it (1 - tanh^2 of a rounded value):
    # int8 in both formats (FP8's product form), where FP8 would give 5x amp
    # bfloat16's error; the input of a softmax reaches an exponential: as it
    # is in any format.
    w = round_bf16(jax.random.normal(K[1], (WIDTH, WIDTH)) / 8)
    x = round_bf16(300.0 * jax.random.normal(K[2], (32, WIDTH)))
    loss = _tanh_and_softmax(True)
    ref = jax.grad(loss)(w, x)
    err_amp = rel_l2(jax.jit(jax.grad(jaxamp.amp(loss, compute_dtype=BF16)))(w, x), ref)
    for dtype in (E4M3, "int8"):
        r = jaxamp.memory_report(
            loss, w, x, compute_dtype=BF16, residual_dtype=dtype, compile=False
        )
        rules = sorted((c.dtype, c.rule) for c in r.checkpoints)
        assert rules == [("float32", EXACT_INPUT), ("int8", STORED_DERIVATIVE)], (
            r.checkpoints
        )
        # No worse than without the checkpoints (where E4M3 stores the tanh's
        # input in E4M3: 5x amp bfloat16's error), and within the issue's
        # bound (1.3x measured for both formats).
        err = {}
        for checkpoint in (True, False):
            f = jaxamp.amp(
                _tanh_and_softmax(checkpoint), compute_dtype=BF16, residual_dtype=dtype
            )
            err[checkpoint] = rel_l2(jax.jit(jax.grad(f))(w, x), ref)
        assert err[True] <= 1.05 * err[False]
        assert err[True] <= 2.0 * err_amp


# Issue 52: the bound on every block shape (benchmarks/residuals.py, part 1c):
# 4 residual blocks of width 256 on 128 rows, each under jax.checkpoint,
# inputs pre-rounded to bfloat16, the residual stream at rms 100.
BLOCK_POLICIES = {"names": NAMES, "dots": DOTS}
# Where amp bfloat16 saves every value in bfloat16, an 8-bit code of the same
# values costs 1 + 4 / G bytes (a float32 scale per 1 x G group) against 2:
# 0.5625x for int8 in 1 x 32 groups, above the 0.5x whatever the rule
# (the model met it through the float32 values its loss head saves).
INT8_FLOOR = (1 + 4 / 32) / 2


def _block_errors_and_bytes(loss, params, x):
    """Per residual format (None, E4M3, int8) under amp bfloat16: the gradient's
    error against float32 and the saved residual bytes."""
    ref = jax.jit(jax.grad(loss))(params, x)
    got = {}
    for dtype in (None, E4M3, "int8"):
        f = jaxamp.amp(loss, compute_dtype=BF16, residual_dtype=dtype)
        err = rel_l2(jax.jit(jax.grad(f))(params, x), ref)
        got[dtype] = (err, jaxamp.saved_residual_bytes(f, params, x))
    return got


@pytest.mark.parametrize("policy", list(BLOCK_POLICIES))
@pytest.mark.parametrize("shape", bench_residuals.BLOCKS)
def test_checkpointed_block_shapes_hold_the_bound(shape, policy):
    loss, params, x = bench_residuals.block_model(shape, BLOCK_POLICIES[policy])
    got = _block_errors_and_bytes(loss, params, x)
    err, size = got[None]
    # The bounds against amp bfloat16 with the same checkpoint
    # (measured: E4M3 1.04x to 1.29x at 0.62x to 0.81x; int8 1.23x to 1.38x
    # at 0.566x to 0.78x, RESULTS_RESIDUALS.md).
    assert got[E4M3][0] <= 2.5 * err and got[E4M3][1] <= 0.85 * size
    assert got["int8"][0] <= 2.0 * err
    # int8 at its floor, except where the dots policy saves attention's q and
    # k projections, kept as they are (they make the logits): 0.71x, 0.78x.
    logits = policy == "dots" and shape in ("attention", "stream")
    assert got["int8"][1] <= (0.80 if logits else INT8_FLOOR + 0.01) * size
    assert got["int8"][1] <= got[E4M3][1]
    # What the checkpoints save is int8, or as it is where it makes a
    # softmax's logits (attention's q and k with the dots policy): with E4M3
    # nothing a derivative or a product reads is stored in FP8.
    r = jaxamp.memory_report(
        loss, params, x, compute_dtype=BF16, residual_dtype=E4M3, compile=False
    )
    rules = {(c.value, c.dtype, c.rule) for c in r.checkpoints}
    assert {d for _, d, _ in rules} <= {"int8", "bfloat16", "float32"}, rules
    for value, dtype, rule in rules:
        assert (dtype == "int8") == (rule in (STORED_PRODUCT, STORED_DERIVATIVE))
        assert dtype == "int8" or rule in (EXACT_INPUT, AS_IS), (value, rule)


def test_tanh_output_read_by_its_derivative_is_int8():
    # Issue 52's model with the dots policy: the product h @ w is saved and
    # only the tanh reads it, whose derivative 1 - tanh^2 carries a stored
    # value's error into every gradient below (3.0x amp bfloat16's error with
    # it in E4M3, 1.3x in int8). memory_report names the rule.
    loss, params, x = bench_residuals.block_model("tanh", DOTS)
    r = jaxamp.memory_report(
        loss, params, x, compute_dtype=BF16, residual_dtype=E4M3, compile=False
    )
    got = {(c.value, c.dtype, c.rule) for c in r.checkpoints}
    assert got == {
        ("dot_general", "int8", STORED_DERIVATIVE),
        ("input h", "int8", STORED_PRODUCT),
    }
    assert "read by an elementwise derivative: int8" in str(r)


@pytest.mark.parametrize("policy", list(BLOCK_POLICIES))
def test_squared_loss_input_is_int8_with_fp8(policy):
    # Issue 52's model as filed: the tanh blocks under a checkpoint and the
    # loss mean(h ** 2), whose derivative 2 h g is a product of the stored
    # h: in E4M3 it carried FP8's error into every gradient (4.6x and 5.2x
    # amp bfloat16's error, names and dots policies, measured before); FP8
    # stores a square's input in its product form, int8 (1.67x, 1.72x, as
    # int8 does). amp bfloat16 saves that h in float32, so int8 meets 0.5x.
    loss, params, x = bench_residuals.block_model(
        "tanh", BLOCK_POLICIES[policy], head="square"
    )
    got = _block_errors_and_bytes(loss, params, x)
    err, size = got[None]
    assert got[E4M3][0] <= 2.5 * err and got[E4M3][1] <= 0.85 * size
    assert got["int8"][0] <= 2.0 * err and got["int8"][1] <= 0.5 * size
    f = jaxamp.amp(loss, compute_dtype=BF16, residual_dtype=E4M3)
    saved = {np.dtype(a.dtype).name for a, _ in _saved(f, params, x)}
    assert "float8_e4m3fn" not in saved and "int8" in saved


def test_offloading_policy_is_left_to_jax():
    # Offloaded values leave the device: jaxamp leaves such a checkpoint to
    # JAX (its inputs in bfloat16, nothing 8-bit in the blocks).
    policy = jax.checkpoint_policies.offload_dot_with_no_batch_dims(
        "device", "pinned_host"
    )
    loss, params, x = _checkpointed(policy)
    f = jaxamp.amp(loss, compute_dtype=BF16, residual_dtype="int8")
    assert "int8" not in _stacked(f, params, x)
    assert "int8" not in _stacked(f, params, x, width=4 * WIDTH)


def _fused_qkv():
    """A checkpointed attention block with one fused QKV projection."""

    def block(h, w):
        q, k, v = jnp.split(h @ w["qkv"], 3, -1)
        logits = jnp.einsum("bqd,bkd->bqk", q, k) / jnp.sqrt(1.0 * WIDTH)
        a = jnp.einsum("bqk,bkd->bqd", jax.nn.softmax(logits, -1), v)
        return h + jnp.tanh(a) @ w["o"]

    def loss(w, x):
        return jnp.mean(jax.checkpoint(block, policy=DOTS)(x, w) ** 2)

    w = round_bf16(
        {
            "qkv": jax.random.normal(K[5], (WIDTH, 3 * WIDTH)) / 16,
            "o": jax.random.normal(K[6], (WIDTH, WIDTH)) / 16,
        }
    )
    return loss, w, round_bf16(30.0 * jax.random.normal(K[7], (2, 32, WIDTH)))


@pytest.mark.parametrize("dtype", [E4M3, "int8"])
def test_fused_qkv_saved_in_pieces_q_and_k_as_they_are(dtype):
    # The dots policy saves the fused projection's output; its q and k make
    # the softmax's logits (kept as they are, as attention keeps them), its v
    # only reaches a product: stored in int8, the product form of both.
    loss, w, x = _fused_qkv()
    r = jaxamp.memory_report(
        loss, w, x, compute_dtype=BF16, residual_dtype=dtype, compile=False
    )
    got = {c.value: (c.dtype, c.rule) for c in r.checkpoints if "axis 2" in c.value}
    wide = [f"dot_general [{i * WIDTH}:{(i + 1) * WIDTH}] of axis 2" for i in range(3)]
    assert got == {
        wide[0]: ("bfloat16", EXACT_INPUT),
        wide[1]: ("bfloat16", EXACT_INPUT),
        wide[2]: ("int8", STORED_PRODUCT),
    }
    f = jaxamp.amp(loss, compute_dtype=BF16, residual_dtype=dtype)
    saved = [np.dtype(a.dtype).name for a, _ in _saved(f, w, x)]
    whole = [a for a, _ in _saved(f, w, x) if a.shape == (2, 32, 3 * WIDTH)]
    assert not whole and saved.count("int8") >= 1
    ref = jax.grad(loss)(w, x)
    err_amp = rel_l2(jax.jit(jax.grad(jaxamp.amp(loss, compute_dtype=BF16)))(w, x), ref)
    # v in int8 (0.5% per value): within the issue's 2x of amp bfloat16's.
    assert rel_l2(jax.jit(jax.grad(f))(w, x), ref) <= 2.0 * err_amp


def test_flax_remat_in_nn_scan_and_nnx_remat():
    import flax.linen as nn
    from flax import nnx

    class Block(nn.Module):
        @nn.compact
        def __call__(self, h, _):
            z = nn.Dense(4 * WIDTH, use_bias=False)(_norm(h))
            return h + nn.Dense(WIDTH, use_bias=False)(jax.nn.gelu(z)), None

    stack = nn.scan(
        nn.remat(Block),
        variable_axes={"params": 0},
        split_rngs={"params": True},
        length=L,
    )()
    x = round_bf16(300.0 * jax.random.normal(K[3], (32, WIDTH)))
    variables = stack.init(K[4], x, None)
    linen_loss = lambda v, x: jnp.mean(stack.apply(v, x, None)[0] ** 2)

    class NnxBlock(nnx.Module):
        def __init__(self, rngs):
            self.up = nnx.Linear(WIDTH, 4 * WIDTH, use_bias=False, rngs=rngs)
            self.down = nnx.Linear(4 * WIDTH, WIDTH, use_bias=False, rngs=rngs)

        @nnx.remat
        def __call__(self, h):
            return h + self.down(jax.nn.gelu(self.up(_norm(h))))

    model = NnxBlock(nnx.Rngs(0))
    graph, state = nnx.split(model)
    nnx_loss = lambda s, x: jnp.mean(nnx.merge(graph, s)(2.0 * x) ** 2)
    for loss, params in ((linen_loss, variables), (nnx_loss, state)):
        for dtype in (E4M3, "int8"):
            r = jaxamp.memory_report(
                loss, params, x, compute_dtype=BF16, residual_dtype=dtype, compile=False
            )
            # The checkpoint's input h feeds the up-projection through a
            # LayerNorm: int8 with either format.
            (choice,) = r.checkpoints
            assert choice.value.startswith("input") and choice.shape == (32, WIDTH)
            assert choice.dtype == "int8" and choice.rule.startswith("reaches a pro")
            f = jaxamp.amp(loss, compute_dtype=BF16, residual_dtype=dtype)
            ref = jax.grad(loss)(params, x)
            assert rel_l2(jax.jit(jax.grad(f))(params, x), ref) < 0.03


# Per-scope policies -----------------------------------------------------------


def _eight_bit_shapes(f, *args):
    """Shapes of the 8-bit residuals, and the dtypes saved per shape."""
    eight, by_shape = [], {}
    for a, _ in _saved(f, *args):
        by_shape.setdefault(a.shape, set()).add(np.dtype(a.dtype))
        if np.dtype(a.dtype) in EIGHT_BIT:
            eight.append(a.shape)
    return eight, by_shape


def test_scope_keeps_compute_dtype():
    args = _mlp_params()
    keep = {**jaxamp.default_amp_policy, "residuals": jaxamp.residual_rule(None)}
    policy = {**jaxamp.default_amp_policy, "head": keep}
    f = jaxamp.amp(mlp, compute_dtype=BF16, amp_policy=policy, residual_dtype=E4M3)
    eight, by_shape = _eight_bit_shapes(f, *args)
    # gelu outside the head is stored as its 8-bit input (32 x 256); the
    # head's values (its matmul's input, its tanh and square) keep amp's dtypes.
    assert eight == [(32, 256)]
    assert np.dtype(BF16) in by_shape[(32, 256)]
    assert np.dtype(jnp.float32) in by_shape[(32, 64)]
    everywhere = jaxamp.amp(mlp, compute_dtype=BF16, residual_dtype="int8")
    assert _eight_bit_shapes(everywhere, *args)[0] == [(32, 256), (32, 64)]


def test_compress_only_one_scope():
    args = _mlp_params()
    only = {**jaxamp.default_amp_policy, "residuals": jaxamp.residual_rule("int8")}
    policy = {**jaxamp.default_amp_policy, "head": only}
    f = jaxamp.amp(mlp, compute_dtype=BF16, amp_policy=policy)
    eight, by_shape = _eight_bit_shapes(f, *args)
    # The head's matmul input (32 x 256) and its tanh's input (32 x 64; the
    # square is recomputed from it) are int8; gelu's values outside it stay
    # bfloat16.
    assert sorted(eight) == [(32, 64), (32, 256)]
    assert np.dtype(BF16) in by_shape[(32, 256)]
    assert rel_l2(jax.jit(jax.grad(f))(*args), jax.grad(mlp)(*args)) < 0.03


def test_residual_rule_values():
    rule = jaxamp.residual_rule(E4M3)
    assert rule == jaxamp.rules.ResidualRule(np.dtype(E4M3))
    # The rule hands the codec its recipe: the format, 1 x G groups, a step.
    assert rule.recipe == residual_recipe(E4M3, 128)
    assert rule.recipe.group == LastAxisGroups(128) and rule.recipe.dtype == E4M3
    assert rule.recipe.scale_form == "step"
    assert jaxamp.residual_rule("int8").recipe.group.size == 32
    assert jaxamp.residual_rule("fp8", group_size=64).recipe.group.size == 64
    assert jaxamp.residual_rule(None).recipe is None
    with pytest.warns(DeprecationWarning, match=r"ResidualRule\.recipe"):
        assert rule.format == rule.recipe


def test_bad_input():
    with pytest.raises(ValueError, match=r"amp\(residual_dtype\)=.*float8_e4m3fn"):
        jaxamp.amp(mlp, residual_dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match=r"residual_rule\(group_size=0\)"):
        jaxamp.residual_rule(E4M3, group_size=0)
    with pytest.raises(ValueError, match="both say how residuals are stored"):
        jaxamp.amp(
            mlp,
            residual_dtype=E4M3,
            amp_policy={"residuals": jaxamp.residual_rule(E4M3)},
        )
    with pytest.raises(TypeError, match="'residuals' takes"):
        jaxamp.amp(mlp, amp_policy={"residuals": jaxamp.use_full_precision})
    with pytest.raises(TypeError, match="'residuals' takes"):
        jaxamp.amp(mlp, amp_policy={"head": jaxamp.residual_rule(E4M3)})


# Must-show figures: the scanned GPT of benchmarks/run.py, size S -------------


@pytest.fixture(scope="module")
def gpt():
    params, x, y = bench.init("S")
    return bench.make_loss("S"), (params, x, y)


def test_gpt_e4m3_bytes(gpt):
    loss, args = gpt
    f32 = jaxamp.saved_residual_bytes(loss, *args)
    f = jaxamp.amp(loss, compute_dtype=BF16, residual_dtype=E4M3)
    assert jaxamp.saved_residual_bytes(f, *args) <= 0.28 * f32


def test_gpt_checkpointed_blocks_bytes():
    # Each scanned block under jax.checkpoint: the blocks' inputs are what
    # is saved, and they reach the QKV matmul through a LayerNorm: int8
    # stores them, FP8 in its product form (int8 in 1 x 32 groups, never
    # FP8 or a bfloat16 copy). Within the issue's 0.30x of float32's bytes
    # (0.244x int8, 0.260x E4M3 measured; the rest is the loss head's).
    loss = bench.make_loss("S", remat=True)
    args = bench.init("S")
    f32 = jaxamp.saved_residual_bytes(loss, *args)
    f = {
        d: jaxamp.amp(loss, compute_dtype=BF16, residual_dtype=d)
        for d in (E4M3, "int8")
    }
    assert jaxamp.saved_residual_bytes(f["int8"], *args) <= 0.30 * f32
    assert jaxamp.saved_residual_bytes(f[E4M3], *args) <= 0.30 * f32
    d, n_layers, t, b = 256, 4, 128, 8
    for fn in f.values():
        inputs = [a for a, _ in _saved(fn, *args) if a.shape == (n_layers, b, t, d)]
        assert [np.dtype(a.dtype) for a in inputs] == [np.dtype(np.int8)]


@pytest.mark.slow
@pytest.mark.parametrize("policy", [None, *bench_residuals.POLICIES])
def test_gpt_checkpoint_policies(policy):
    # The bounds against amp bfloat16 with the same checkpoint:
    # E4M3 error <= 2.5x at <= 0.85x its bytes, int8 error <= 2.0x at <= 0.5x
    # (measured: 1.28x / 0.28x and 1.22x / 0.27x with the names policy; 1.25x
    # / 0.49x and 1.15x / 0.49x with the dots policy, which saves the fused
    # QKV output in pieces: q and k as they are, they make the logits, as
    # attention keeps them without the checkpoint; v in int8).
    if policy is None:
        base = bench.make_loss("S", remat=True)
    else:
        base = bench_residuals.checkpointed_loss("S", bench_residuals.POLICIES[policy])
    args = bench.init("S")
    ref = jax.jit(jax.grad(base))(*args)
    got = {}
    for dtype in (None, E4M3, "int8"):
        f = jaxamp.amp(base, compute_dtype=BF16, residual_dtype=dtype)
        err = rel_l2(jax.jit(jax.grad(f))(*args), ref)
        got[dtype] = (err, jaxamp.saved_residual_bytes(f, *args))
    err, size = got[None]
    assert got[E4M3][0] <= 2.5 * err and got["int8"][0] <= 2.0 * err
    if policy is not None:
        assert got[E4M3][1] <= 0.85 * size
        assert got["int8"][1] <= 0.5 * size


@pytest.mark.slow
def test_gpt_gradient_error(gpt):
    loss, args = gpt
    ref = jax.jit(jax.grad(loss))(*args)
    err = {}
    for dtype in (None, E4M3, "int8"):
        f = jaxamp.amp(loss, compute_dtype=BF16, residual_dtype=dtype)
        err[dtype] = rel_l2(jax.jit(jax.grad(f))(*args), ref)
    # int8 in 1 x 32 groups: within the issue's 2.5x of amp bfloat16's error.
    assert err["int8"] <= 2.5 * err[None]
    # E4M3 (inputs of products left in bfloat16, GELU stored as its input):
    # within the 2.5x too; 1.7x measured (RESULTS_RESIDUALS.md).
    assert err[E4M3] <= 2.5 * err[None]


# The main job's flag --------------------------------------------------------


@pytest.mark.slow
def test_charlm_residual_dtype_flag(capsys):
    import train_charlm

    cfg = train_charlm.Config(
        **TINY_CHARLM,
        steps=4,
        max_bytes=100_000,
        residual_dtype="fp8",
    )
    data = train_charlm.load_corpus(None, cfg.max_bytes)
    r = train_charlm.train(cfg, "bf16", data, progress=False)
    assert r["label"] == "bf16, fp8 residuals"
    assert np.isfinite(r["val_loss"]) and r["losses"][-1] < r["losses"][0]
    x = jnp.zeros((cfg.batch_size, cfg.seq_len), jnp.int32)
    params = train_charlm.initial_params(cfg)
    saved = _saved(train_charlm.mode_loss("bf16", cfg), params, x, x)
    assert any(np.dtype(a.dtype) == np.dtype(E4M3) for a, _ in saved)
    with pytest.raises(SystemExit):
        train_charlm.main(["--residual-dtype", "fp4"])
    assert "--residual-dtype: invalid choice" in capsys.readouterr().err
