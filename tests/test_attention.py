"""Fused attention under amp (jaxamp/_rewrites/_attention.py, issue 12).

Every model is checked twice: on the jaxpr (which equations were recognised,
that amp bound a re-dispatched attention, in the ``jaxamp_fused_attention``
scope, and that it computes its logits in float32 from bfloat16 q/k/v) and on the
numbers (output and gradients against float32 on inputs pre-rounded to
bfloat16; tolerance 2e-2 relative L2, about 5 bfloat16 ulps of the output).
"""

import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import rel_l2, round_bf16

import jaxamp
from jaxamp import _compat
from jaxamp._rewrites import _attention
from jaxamp._rewrites._attention import _kernels, _match  # noqa: F401 (the modules under test)

BF16 = np.dtype(jnp.bfloat16)
F32 = np.dtype(jnp.float32)
B, T, N, H = 2, 8, 4, 16
TOL = 2e-2


def _qkv(n_kv=N, seed=0, h=H):
    ks = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(ks[0], (B, T, N, h))
    k = jax.random.normal(ks[1], (B, T, n_kv, h))
    v = jax.random.normal(ks[2], (B, T, n_kv, h))
    return round_bf16((q, k, v))


PAD = jnp.ones((B, 1, T, T), bool).at[1, :, :, 5:].set(False)
BIAS = round_bf16(jax.random.normal(jax.random.key(7), (1, N, T, T)))


def _dots(fn, *args):
    """(input dtypes, preferred_element_type) of every dot_general, sub-jaxprs
    included, in the jaxpr of ``fn``."""
    return _dots_of(jax.make_jaxpr(fn)(*args))


def _dots_of(closed):
    out = []
    for eqn, _ in jaxamp.tools.iter_equations(closed):
        if eqn.primitive.name == "dot_general":
            ins = tuple(np.dtype(v.aval.dtype) for v in eqn.invars)
            out.append((ins, np.dtype(eqn.params["preferred_element_type"])))
    return out


def _names(fn, *args):
    return _names_of(jax.make_jaxpr(fn)(*args))


def _names_of(closed):
    return [
        str(e.params.get("name", e.primitive.name))
        for e, _ in jaxamp.tools.iter_equations(closed)
    ]


def _fused(fn, *args):
    """The number of equations amp bound for re-dispatched attentions (in the
    ``jaxamp_fused_attention`` scope); 0 when nothing was replaced."""
    return _fused_of(jax.make_jaxpr(fn)(*args))


def _fused_of(closed):
    return sum(
        _attention.FUSED_SCOPE in _compat.scope_names(eqn)
        for eqn, _ in jaxamp.tools.iter_equations(closed)
    )


def _check_fused(fn, args, grad_argnums=(0, 1, 2), ref=None):
    """amp(fn) runs attention with float32 logits from bfloat16 q/k/v, and its
    output and gradients match float32."""
    amp_fn = jaxamp.amp(fn, compute_dtype=jnp.bfloat16)
    closed = jax.make_jaxpr(amp_fn)(*args)  # amp traced once for three checks
    dots = _dots_of(closed)
    assert ((BF16, BF16), F32) in dots, dots  # q·k: bf16 in, float32 logits
    assert _fused_of(closed) > 0
    assert not any(n.startswith("jaxamp_attention__") for n in _names_of(closed))
    ref_fn = fn if ref is None else ref
    ref = ref_fn(*args)
    out = amp_fn(*args)
    assert out.dtype == ref.dtype
    assert rel_l2(out, ref) < TOL

    def loss(f):
        def weighted_sum(*a):
            y = f(*a)
            return jnp.sum(y * jnp.cos(jnp.arange(y.size)).reshape(y.shape))

        return weighted_sum

    g_ref = jax.grad(loss(ref_fn), grad_argnums)(*args)
    g = jax.grad(loss(amp_fn), grad_argnums)(*args)
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(g))
    assert rel_l2(g, g_ref) < TOL
    # Every matmul of the gradient, backward ones included, runs on bfloat16.
    grad_dots = _dots(jax.grad(loss(amp_fn), grad_argnums), *args)
    assert grad_dots and all(ins == (BF16, BF16) for ins, _ in grad_dots), grad_dots


# --------------------------------------------------------------------------------
# jax.nn.dot_product_attention

NN_CASES = {
    "plain": (N, {}),
    "causal": (N, {"is_causal": True}),
    "padding_mask": (N, {"mask": PAD}),
    "bias": (N, {"bias": BIAS}),
    "gqa": (2, {"is_causal": True}),
    "mqa_window": (1, {"local_window_size": (2, 1)}),
    "seq_lengths": (N, {"key_value_seq_lengths": jnp.array([8, 5], jnp.int32)}),
}


@pytest.mark.parametrize("case", list(NN_CASES))
def test_jax_nn_attention_runs_xla_path_with_float32_logits(case):
    n_kv, kw = NN_CASES[case]
    implementation = "xla" if case == "bias" else None
    fn = lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, implementation=implementation, **kw
    )
    _check_fused(fn, _qkv(n_kv))


def test_cudnn_request_falls_back_on_cpu_with_warning():
    fn = lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, mask=PAD, is_causal=True, implementation="cudnn"
    )
    args = _qkv()
    with pytest.raises(RuntimeError, match="cuDNN"):  # without amp, on CPU
        fn(*args)
    ref = lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, mask=PAD, is_causal=True
    )
    site = r"test_attention.py:\d+ asked for implementation='cudnn'"
    with pytest.warns(UserWarning, match=site):
        _check_fused(fn, args, ref=ref)


def test_cudnn_request_under_grad_scan_and_checkpoint():
    """A scanned, checkpointed layer that asks for cuDNN: traces and
    differentiates under amp; the request is rewritten inside the scan body."""
    q, k, v = _qkv()

    def loss(w, x):
        def layer(h, wi):
            a = jax.nn.dot_product_attention(
                h @ wi, h, h, is_causal=True, implementation="cudnn"
            )
            return h + a, None

        h, _ = jax.lax.scan(jax.checkpoint(layer), x, w)
        return jnp.sum(h**2)

    w = round_bf16(jax.random.normal(jax.random.key(3), (2, H, H)) * 0.2)
    amp_loss = jaxamp.amp(loss, compute_dtype=jnp.bfloat16)
    with pytest.warns(UserWarning, match="cudnn"):
        names = _names(jax.grad(amp_loss), w, q)
        g = jax.grad(amp_loss)(w, q)
    assert not any(n.startswith("jaxamp_attention__") for n in names)
    assert np.isfinite(g).all()
    assert rel_l2(g, jax.grad(_reference_scan_loss)(w, q)) < 3e-2


def _reference_scan_loss(w, x):
    def layer(h, wi):
        a = jax.nn.dot_product_attention(h @ wi, h, h, is_causal=True)
        return h + a, None

    h, _ = jax.lax.scan(layer, x, w)
    return jnp.sum(h**2)


def test_layer_traced_outside_amp_first_is_still_fused():
    """JAX caches the trace of a scanned/jitted layer; the interception is part
    of its cache key, so a layer first traced in float32 is fused under amp."""
    q, k, v = _qkv()

    @jax.jit
    def layer(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True)

    fn = lambda q, k, v: layer(q, k, v) * 2.0
    fn(q, k, v)  # traced and cached without amp
    _check_fused(fn, (q, k, v))
    assert ((F32, F32), F32) in _dots(fn, q, k, v)  # and back, unchanged


def test_outside_amp_jax_is_unchanged():
    q, k, v = _qkv()
    fn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True)
    jaxamp.amp(fn, compute_dtype=jnp.bfloat16)(q, k, v)  # installs the wrappers
    names = _names(fn, q, k, v)
    assert not any(n.startswith("jaxamp_attention__") for n in names)
    assert ((F32, F32), F32) in _dots(fn, q, k, v)


# --------------------------------------------------------------------------------
# The fused kernel where one exists (GPU): observed through _bind_cudnn


def _fake_gpu(monkeypatch):
    calls = []

    def fake_cudnn(q, k, v, bias, mask, **kw):
        calls.append(
            dict(
                dtypes={str(x.dtype) for x in (q, k, v)},
                shapes=(q.shape, k.shape, v.shape),
                bias=None if bias is None else bias.shape,
                mask=None if mask is None else mask.shape,
                **{k_: kw[k_] for k_ in ("scale", "is_causal")},
            )
        )
        return _attention._kernels._bind_xla(q, k, v, bias, mask, **kw)

    monkeypatch.setattr(_compat, "cudnn_backend", lambda: True)
    monkeypatch.setattr(_attention._kernels, "_bind_cudnn", fake_cudnn)
    return calls


@pytest.mark.parametrize("implementation", [None, "cudnn"])
def test_gpu_binds_cudnn_for_jax_nn_call(monkeypatch, implementation):
    calls = _fake_gpu(monkeypatch)
    q, k, v = _qkv(n_kv=2)
    fn = lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, mask=PAD, is_causal=True, implementation=implementation
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no CPU-fallback warning on a "GPU"
        out = jaxamp.amp(fn, compute_dtype=jnp.bfloat16)(q, k, v)
    assert (
        rel_l2(out, jax.nn.dot_product_attention(q, k, v, mask=PAD, is_causal=True))
        < TOL
    )
    (call,) = calls
    assert call["dtypes"] == {"bfloat16"} and call["is_causal"]
    assert call["shapes"] == ((B, T, N, H), (B, T, 2, H), (B, T, 2, H))
    assert call["mask"] == (B, 1, T, T)


def test_gpu_float16_and_policy_xla(monkeypatch):
    calls = _fake_gpu(monkeypatch)
    q, k, v = _qkv()
    fn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v)
    jaxamp.amp(fn, compute_dtype=jnp.float16)(q, k, v)
    assert calls and calls[-1]["dtypes"] == {"float16"}
    n = len(calls)
    policy = {**jaxamp.default_amp_policy, "attention": jaxamp.attention_rule("xla")}
    jaxamp.amp(fn, compute_dtype=jnp.bfloat16, amp_policy=policy)(q, k, v)
    assert len(calls) == n  # forced XLA path


def test_gpu_binds_cudnn_for_hand_written_form(monkeypatch):
    calls = _fake_gpu(monkeypatch)
    q, k, v = _qkv()
    mask = PAD[:, :, :1, :]  # (B, 1, 1, S): key padding, broadcast
    out = jaxamp.amp(_hand(mask=mask), compute_dtype=jnp.bfloat16)(q, k, v)
    assert rel_l2(out, _hand(mask=mask)(q, k, v)) < TOL
    (call,) = calls
    assert call["dtypes"] == {"bfloat16"}
    assert call["shapes"] == ((B, T, N, H),) * 3
    assert call["mask"] == (B, 1, 1, T)  # reaches the kernel unexpanded
    assert call["scale"] == pytest.approx(H**-0.5)


# --------------------------------------------------------------------------------
# Hand-written forms


def _hand(mask=None, bias=None, scale="div", fill=-1e9, axis=-1):
    def fn(q, k, v):
        s = jnp.einsum("btnh,bsnh->bnts", q, k)
        if scale == "div":
            s = s / jnp.sqrt(jnp.float32(H))
        elif scale == "mul":
            s = s * (H**-0.5)
        if bias is not None:
            s = s + bias
        if mask is not None:
            s = jnp.where(mask, s, fill)
        p = jax.nn.softmax(s, axis=axis)
        return jnp.einsum("bnts,bsnh->btnh", p, v)

    return fn


def _gqa(q, k, v):
    """GQA written by hand: q heads grouped (K=2, G=2) over shared k/v heads."""
    qg = q.reshape(B, T, 2, 2, H)
    s = jnp.einsum("btkgh,bskh->bkgts", qg, k) * (H**-0.5)
    s = jnp.where(jnp.tril(jnp.ones((T, T), bool)), s, jnp.finfo(s.dtype).min)
    p = jax.nn.softmax(s)
    return jnp.einsum("bkgts,bskh->btkgh", p, v).reshape(B, T, N, H)


def _matmul_form(q, k, v):
    """(B, N, T, H) layout with @ and a transposed key, scale on q first."""
    q, k, v = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))
    p = jax.nn.softmax((q * H**-0.5) @ jnp.swapaxes(k, -1, -2), axis=-1)
    return jnp.swapaxes(p @ v, 1, 2)


HAND = {
    "scale_div_mask": (_hand(mask=PAD), N),
    "scale_mul_bias": (_hand(bias=BIAS, scale="mul"), N),
    "bias_and_padding_mask": (_hand(bias=BIAS, mask=PAD, fill=-jnp.inf), N),
    "gqa_causal": (_gqa, 2),
    "matmul_no_scale": (_matmul_form, N),
}


@pytest.mark.parametrize("custom_jvp_softmax", [False, True])
@pytest.mark.parametrize("case", list(HAND))
def test_hand_written_forms_are_replaced(case, custom_jvp_softmax):
    fn, n_kv = HAND[case]
    args = _qkv(n_kv)
    with jax.softmax_custom_jvp(custom_jvp_softmax):
        group = _groups(fn, *args)
        assert len(group) == 1, group
        names = group[0]
        assert names[0] == "dot_general" and names[-1] == "dot_general"
        assert ("custom_jvp_call" in names) == custom_jvp_softmax
        _check_fused(fn, args)


def _groups(fn, *args):
    """The primitive names of each matched group of fn's top-level jaxpr."""
    closed = jax.make_jaxpr(fn)(*args)
    core, _ = _compat.jaxpr_parts(closed)
    plan = _attention._match.plan(core)
    groups = {id(g): g for g in plan.values()}.values()
    return [[core.eqns[i].primitive.name for i in g.eqns] for g in groups]


def test_equinox_multihead_attention():
    att = eqx.nn.MultiheadAttention(N, N * H, key=jax.random.key(1))
    att = jax.tree.map(lambda a: round_bf16(a) if eqx.is_inexact_array(a) else a, att)
    x = round_bf16(jax.random.normal(jax.random.key(2), (T, N * H)))
    mask = jnp.tril(jnp.ones((T, T), bool))
    fn = lambda att, x: att(x, x, x, mask=mask)
    assert len(_groups(lambda x: fn(att, x), x)) == 1
    amp_fn = jaxamp.amp(fn, compute_dtype=jnp.bfloat16)
    assert ((BF16, BF16), F32) in _dots(lambda x: amp_fn(att, x), x)
    assert _fused(lambda x: amp_fn(att, x), x) > 0
    assert rel_l2(amp_fn(att, x), fn(att, x)) < TOL
    g = eqx.filter_grad(lambda a: jnp.sum(amp_fn(a, x) ** 2))(att)
    g_ref = eqx.filter_grad(lambda a: jnp.sum(fn(a, x) ** 2))(att)
    assert rel_l2(g, g_ref) < TOL


def test_flax_multihead_attention():
    nnx = pytest.importorskip("flax.nnx")
    model = nnx.MultiHeadAttention(
        N, N * H, decode=False, rngs=nnx.Rngs(0), deterministic=True
    )
    graphdef, state = nnx.split(model)
    state = round_bf16(state)
    x = round_bf16(jax.random.normal(jax.random.key(2), (B, T, N * H)))

    def fn(state, x):
        return nnx.merge(graphdef, state)(x, mask=PAD)

    amp_fn = jaxamp.amp(fn, compute_dtype=jnp.bfloat16)
    assert ((BF16, BF16), F32) in _dots(amp_fn, state, x)
    assert _fused(amp_fn, state, x) > 0
    assert rel_l2(amp_fn(state, x), fn(state, x)) < TOL


# --------------------------------------------------------------------------------
# Near-misses run as before

NEAR = {
    "softmax_over_query_axis": _hand(mask=PAD, axis=-2),
    "where_fill_is_not_a_mask": _hand(mask=PAD, fill=0.0),
    "extra_op_between_products": lambda q, k, v: jnp.einsum(
        "bnts,bsnh->btnh", _probs(q, k) ** 2, v
    ),
    "logits_used_twice": lambda q, k, v: _logits_used_twice(q, k, v),
}


def _logits_used_twice(q, k, v):
    s = jnp.einsum("btnh,bsnh->bnts", q, k)
    o = jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(s), v)
    return o * jnp.mean(s)


def _probs(q, k):
    return jax.nn.softmax(jnp.einsum("btnh,bsnh->bnts", q, k))


@pytest.mark.parametrize("case", list(NEAR))
def test_near_misses_are_not_replaced(case):
    fn = NEAR[case]
    args = _qkv()
    assert _groups(fn, *args) == []
    amp_fn = jaxamp.amp(fn, compute_dtype=jnp.bfloat16)
    assert _fused(amp_fn, *args) == 0  # the ordinary rules run
    assert rel_l2(amp_fn(*args), fn(*args)) < 5e-2


# --------------------------------------------------------------------------------
# Policy


def test_policy_off_and_amp_stop_leave_attention_alone():
    args = _qkv()
    nn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v)
    off = {**jaxamp.default_amp_policy, "attention": jaxamp.attention_rule("off")}
    for fn in (nn, _hand(mask=PAD)):
        amp_off = jaxamp.amp(fn, compute_dtype=jnp.bfloat16, amp_policy=off)
        assert _fused(amp_off, *args) == 0
        stopped = jaxamp.amp(jaxamp.amp_stop(fn), compute_dtype=jnp.bfloat16)
        assert all(d == ((F32, F32), F32) for d in _dots(stopped, *args))
        np.testing.assert_allclose(stopped(*args), fn(*args), rtol=1e-6, atol=1e-6)


def test_amp_stop_keeps_an_explicit_cudnn_request():
    """In an amp_stop region a cuDNN request on float32 gets JAX's own error."""
    fn = jaxamp.amp_stop(
        lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="cudnn")
    )
    with pytest.raises(RuntimeError, match="cuDNN"):
        jaxamp.amp(fn, compute_dtype=jnp.bfloat16)(*_qkv())


def test_policy_forced_cudnn_raises_jax_error_on_cpu():
    policy = {**jaxamp.default_amp_policy, "attention": jaxamp.attention_rule("cudnn")}
    fn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v)
    with pytest.raises(RuntimeError, match="cuDNN"):
        jaxamp.amp(fn, compute_dtype=jnp.bfloat16, amp_policy=policy)(*_qkv())


def test_nested_scope_policy_and_bad_rule():
    scoped = {"enc": {"attention": jaxamp.attention_rule("off")}}

    def fn(q, k, v):
        with jax.named_scope("enc"):
            return jax.nn.dot_product_attention(q, k, v)

    assert (
        _fused(jaxamp.amp(fn, compute_dtype=jnp.bfloat16, amp_policy=scoped), *_qkv())
        == 0
    )
    assert _fused(jaxamp.amp(fn, compute_dtype=jnp.bfloat16), *_qkv()) > 0
    with pytest.raises(ValueError, match="implementation"):
        jaxamp.attention_rule("flash")


def test_amp_around_grad_of_attention():
    """amp over an already-differentiated function: the marked jits that
    value_and_grad re-wrote (partial evaluation) are ordinary jits; the
    gradients still match float32."""
    args = _qkv()
    loss = lambda q, k, v: jnp.sum(jax.nn.dot_product_attention(q, k, v) ** 2)
    grad = jax.grad(loss, (0, 1, 2))
    g = jaxamp.amp(grad, compute_dtype=jnp.bfloat16)(*args)
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(g))
    assert rel_l2(g, grad(*args)) < TOL
