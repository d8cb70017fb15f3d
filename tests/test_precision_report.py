"""``jaxamp.precision_report``: where low precision loses accuracy, per scope,
and a verified policy change that wins it back; the 8-bit policies keep the
loss-feeding matmul in the compute dtype by default."""

import json
from pathlib import Path

import common
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import rel_l2, round_bf16
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jaxamp
from jaxamp import _compat

ROOT = Path(__file__).resolve().parents[1]
BF16 = jnp.bfloat16
D, L, T, B, V = common.UNROLLED_DIMS
# The model the reports rank (benchmarks/common.py, shared with
# benchmarks/precision_report.py).
_ln = common.layer_norm
_gpt_params = common.unrolled_gpt_init
_block = common.unrolled_gpt_block
_xent = common.xent
_gpt_loss = common.unrolled_gpt_loss
_batch = common.unrolled_gpt_batch


def _ablation(loss, args, policy, scopes, override=None):
    """The reference ablation: per scope, amp's gradient (``jax.jit(jax.grad)``
    of ``jaxamp.amp``, compiled per scope) with that scope alone overridden
    (``override``, default the default policy: an 8-bit scope to bf16), and
    ``{"grad": {scope: 1 - e_s / e}, "loss": {scope: (|dl| - |dl_s|) / |dl|}}``
    with ``e`` the squared gradient error against float32 and ``dl`` the loss
    error."""
    override = jaxamp.default_amp_policy if override is None else override

    def run(pol):
        f = jaxamp.amp(loss, compute_dtype=BF16, amp_policy=pol)
        return jax.jit(jax.value_and_grad(f))(*args)

    l32, g32 = jax.jit(jax.value_and_grad(loss))(*args)
    flat32 = [np.asarray(v, np.float64) for v in jax.tree.leaves(g32)]

    def errs(pol):
        lo, g = run(pol)
        e = sum(
            float(np.sum((np.asarray(a, np.float64) - b) ** 2))
            for a, b in zip(jax.tree.leaves(g), flat32)
        )
        return e, abs(float(lo) - float(l32))

    e0, d0 = errs(policy)
    out = {"grad": {}, "loss": {}}
    for scope in scopes:
        e, d = errs({**policy, scope: override})
        out["grad"][scope] = 1 - e / e0
        out["loss"][scope] = (d0 - d) / d0
    return out


def _fp8_one_mlp(key, scope):
    fp8 = jaxamp.fp8_policy(size_rule=None)
    return {**jaxamp.default_amp_policy, key: fp8}, scope


@pytest.mark.parametrize("path_keys", [False, True])
def test_fp8_in_one_mlp_is_found_and_fixed(path_keys):
    # bf16 everywhere but FP8 (every matmul, forward and backward) in layer 2's
    # MLP: the ranking names that MLP, and one override meets 1.5x bf16's error.
    mlp = (lambda i: "mlp") if path_keys else (lambda i: f"layer{i}_mlp")
    key = "layer2/mlp" if path_keys else "layer2_mlp"
    loss = _gpt_loss(mlp)
    params, (x, y) = _gpt_params(jax.random.key(0)), _batch()
    policy = {**jaxamp.default_amp_policy, key: jaxamp.fp8_policy(size_rule=None)}
    report = jaxamp.precision_report(
        loss, params, x, y, compute_dtype=BF16, amp_policy=policy
    )
    assert report.top(1) == ["layer2/" + mlp(2)]
    fp8 = [r for r in report.records if r.format.startswith("float8")]
    assert fp8 and {r.scope for r in fp8} == {"layer2/" + mlp(2)}
    bf16_error, _ = report.runner.errors(jaxamp.default_amp_policy)
    assert report.grad_error > 2 * bf16_error  # FP8's error is visible at all
    fix = report.suggest(grad_error=1.5 * bf16_error)
    assert fix.met and 1 <= len(fix.overrides) <= 2
    assert list(fix.overrides)[0] == key
    assert fix.overrides[key] == "compute dtype"
    assert fix.grad_error <= 1.5 * bf16_error
    assert 0 < fix.eight_bit_moved <= 1 and fix.low_precision_moved == 0
    # The verified policy is what amp then runs: the MLP's matmuls leave FP8.
    # The suggestion is itself the policy mapping amp takes.
    assert dict(fix) == fix.policy and len(fix) == len(fix.policy)
    fixed = jaxamp.amp(loss, compute_dtype=BF16, amp_policy=fix)
    got = jaxamp.quantization_report(fixed, params, x, y)
    assert all(r.format != "fp8" for r in got)
    g = jax.jit(jax.grad(fixed))(params, x, y)
    g32 = jax.grad(loss)(params, x, y)
    np.testing.assert_allclose(rel_l2(g, g32), fix.grad_error, rtol=1e-3)


def test_scanned_int8_gpt_ranks_scopes_as_ablation_does():
    # The report's ranking of the scanned GPT's scopes under int8 matches the
    # ablation (one amp run per scope kept in bf16), and its per-group
    # gradient errors are benchmarks/quantized.py --error-breakdown's numbers.
    import quantized
    import run as gpt_bench

    params, x, y = gpt_bench.init("tiny")
    scoped = quantized.scoped_loss("tiny")

    def loss(p, x, y):
        return scoped({k: v for k, v in p.items() if k != "head"}, p["head"], x, y)

    both = {**params, "head": params["emb"]}
    policy = jaxamp.int8_policy(size_rule=None, quantize_last_matmul=True)
    report = jaxamp.precision_report(
        loss, both, x, y, compute_dtype=BF16, amp_policy=policy
    )
    # The ranking is what each fix buys: the share of the squared gradient
    # (and loss) error removed by keeping one scope in bf16, against a
    # reference ablation compiled per scope by hand, as a user would.
    ref_removed = _ablation(loss, (both, x, y), policy, ("attn", "mlp", "head"))
    for by in ("grad", "loss"):
        got, want = report.scopes(by), ref_removed[by]
        assert set(got) == set(want), (got, want)
        assert report.top(1, by) == [max(want, key=want.get)], (by, got, want)
        for scope, share in want.items():
            assert abs(got[scope] - share) < 0.05, (by, scope, got, want)
    assert report.ranking.startswith("measured: each of 3 scope(s)")
    assert report.estimated == {} and np.isnan(report.linear_fit)
    assert report.overrides["head"] == ("head", "compute dtype")
    iters = {r.iteration for r in report.records if r.scope == "mlp"}
    assert iters == {(i,) for i in range(gpt_bench.SIZES["tiny"][1])}

    split = lambda g: ({k: v for k, v in g.items() if k != "head"}, g["head"])  # noqa: E731
    ours = quantized._group_errors(split(report.grads), split(report.grads32))
    amp_loss = jaxamp.amp(loss, compute_dtype=BF16, amp_policy=policy)
    theirs = quantized._group_errors(
        split(jax.jit(jax.grad(amp_loss))(both, x, y)),
        split(jax.jit(jax.grad(loss))(both, x, y)),
    )
    for group in quantized.GROUPS:
        np.testing.assert_allclose(ours[group], theirs[group], rtol=2e-2)
    np.testing.assert_allclose(report.grad_errors["head"], theirs["head"], rtol=2e-2)


def test_int8_keeps_the_loss_feeding_matmul_in_the_compute_dtype(tmp_path):
    # The main job's model: every product in int8 but the head (tied embedding,
    # no named scope), which the value facts see feeding the loss.
    import train_charlm as charlm

    cfg = charlm.Config(d_model=16, layers=1, heads=2, seq_len=8, batch_size=2)
    params = charlm.init_params(jax.random.key(0), cfg)
    x, y = _batch()

    def recs(**kw):
        f = jaxamp.amp(
            lambda p, x, y: charlm.loss_fn(p, x, y, cfg.heads),
            compute_dtype=BF16,
            amp_policy=jaxamp.int8_policy(size_rule=None, **kw),
        )
        return [
            r for r in jaxamp.quantization_report(f, params, x, y) if r.shape[0] == 1
        ]

    default, last = recs(), recs(quantize_last_matmul=True)
    head = [r for r in default if r.shape[3] == 256]
    assert len(head) == 1
    assert head[0].format == "bfloat16"
    assert head[0].reason == "feeds the loss: kept in the compute dtype"
    assert {r.format for r in default if r.shape[3] != 256} == {"int8"}
    assert {r.format for r in last} == {"int8"}
    # The head's logits keep a float32 result, as under the default policy.
    jaxpr = jax.make_jaxpr(
        jaxamp.amp(
            lambda p, x: charlm.forward(p, x, cfg.heads),
            compute_dtype=BF16,
            amp_policy=jaxamp.int8_policy(size_rule=None),
        )
    )(params, x)
    assert jaxpr.out_avals[0].dtype == jnp.float32
    fp8 = jaxamp.amp(
        lambda p, x, y: charlm.loss_fn(p, x, y, cfg.heads),
        compute_dtype=BF16,
        amp_policy=jaxamp.fp8_policy(size_rule=None),
    )
    fmts = [r.format for r in jaxamp.quantization_report(fp8, params, x, y)]
    assert "bfloat16" in fmts and "fp8" in fmts
    # The main job's --report: the report of its model in int8, JSON and PNG.
    cfg.report_dir = str(tmp_path)
    got = charlm.precision_report("int8", cfg, params, x, y)
    assert got["dir"] == str(tmp_path / "precision_int8")
    saved = json.loads(
        (tmp_path / "precision_int8" / "precision_report.json").read_text()
    )
    heads = [r for r in saved["records"] if r["scope"] == "head"]
    assert {r["format"] for r in heads if r["primitive"] == "dot_general"} == {
        "bfloat16"
    }
    assert {"attn", "mlp", "head"} <= set(got["top"])
    assert (tmp_path / "precision_int8" / "precision_report.png").stat().st_size > 1000
    assert charlm.precision_report("fp32", cfg, params, x, y) is None


def _stacked_gpt_params(seed=3):
    """The unrolled GPT's parameters with its layers stacked for a scan."""
    params = _gpt_params(jax.random.key(seed))
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *params["layers"])
    return {**params, "layers": stacked}


def test_scan_remat_text_json_and_png(tmp_path):
    # Layers as a checkpointed scan body: one site per equation and iteration,
    # a plain-text table, a JSON file and a PNG.

    def loss(p, x, y):
        @jax.checkpoint
        def body(h, w):
            with jax.named_scope("block"):
                return _block(h, w, "mlp"), None

        h, _ = jax.lax.scan(body, p["emb"][x], p["layers"])
        with jax.named_scope("head"):
            return _xent(_ln(h) @ p["head"], y)

    x, y = _batch()
    p = _stacked_gpt_params()
    report = jaxamp.precision_report(loss, p, x, y, compute_dtype=BF16, group_depth=2)
    scopes = {r.scope for r in report.records}
    assert {"block/attn", "block/mlp", "head"} <= scopes
    assert {r.iteration for r in report.records if r.scope == "block/mlp"} == {
        (0,),
        (1,),
        (2,),
    }
    # bf16 rounding: local errors of the matmuls near bf16's unit roundoff.
    dots = [r for r in report.records if r.primitive == "dot_general"]
    assert all(r.format == "bfloat16" for r in dots)
    assert all(1e-4 < r.local_error < 2e-2 for r in dots)
    assert set(report.grad_errors) == {
        "total",
        "emb",
        "head",
        *(f"layers/{k}" for k in ("qkv", "o", "up", "down")),
    }
    assert 1e-4 < report.grad_error < 5e-2
    text = str(report)
    assert "block/mlp" in text and "gradient error" in text
    jpath, ppath = report.save(str(tmp_path))
    data = json.loads(Path(jpath).read_text())
    assert data["grad_errors"]["total"] == pytest.approx(report.grad_error)
    assert list(data["ranking_grad"]) == list(report.scopes("grad"))
    assert Path(ppath).read_bytes()[:4] == b"\x89PNG"


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
def test_float16_loss_scaling_counts_underflow_and_overflow():
    # float16 with a static loss scale: gradients of tiny activations underflow
    # without it. A value of 7e4 overflows float16 (max 65504): the record says
    # so, with its peak against the format's maximum.
    w = jnp.full((4, 4), 256.0)

    def loss(w, x):
        with jax.named_scope("big"):
            h = x @ w
        with jax.named_scope("small"):
            s = (x * np.float32(1e-10)) @ w
        with jax.named_scope("out"):
            h = jnp.tanh(h / np.float32(1e5)) @ w + (s * np.float32(1e5)) @ w
        return jnp.mean(h)

    x = jnp.full((2, 4), 70.0)
    report = jaxamp.precision_report(loss, w, x, compute_dtype=jnp.float16)
    big = [
        r for r in report.records if r.scope == "big" and r.primitive == "dot_general"
    ]
    small = [
        r for r in report.records if r.scope == "small" and r.primitive == "dot_general"
    ]
    assert big[0].overflow == 1.0 and big[0].peak == pytest.approx(4 * 70 * 256)
    assert big[0].format_max == 65504.0
    assert small[0].underflow == 1.0
    assert report.top(1) == ["big"]
    with pytest.raises(ValueError, match="target"):
        report.suggest()
    with pytest.raises(ValueError, match="grad_error"):
        report.suggest(grad_error=-1.0)


def test_shard_map_equinox_and_nnx_models():
    mesh = Mesh(np.array(jax.devices()[:2]), ("batch",))
    w = round_bf16(jax.random.normal(jax.random.key(0), (8, 8)))

    def dp_loss(w, x):
        def local(w, x):
            with jax.named_scope("dp"):
                return jax.lax.pmean(jnp.mean(jnp.tanh(x @ w) ** 2), "batch")

        return jax.shard_map(
            local, mesh=mesh, in_specs=(P(), P("batch")), out_specs=P()
        )(w, x)

    x = round_bf16(jax.random.normal(jax.random.key(1), (4, 8)) * 3)
    report = jaxamp.precision_report(dp_loss, w, x, compute_dtype=BF16)
    assert [r.primitive for r in report.records if r.primitive == "shard_map"]
    assert 1e-4 < report.grad_error < 5e-2

    mlp = eqx.nn.MLP(8, 8, 16, 2, key=jax.random.key(2))
    arrays, rest = eqx.partition(mlp, eqx.is_array)
    mlp = eqx.combine(round_bf16(arrays), rest)
    eqx_loss = lambda m, x: jnp.mean(jax.vmap(m)(x) ** 2)  # noqa: E731
    report = jaxamp.precision_report(eqx_loss, mlp, x, compute_dtype=BF16)
    assert set(report.grad_errors) == {"total", "layers"}
    assert 1e-4 < report.grad_errors["layers"] < 5e-2

    model = nnx.Linear(8, 8, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    nnx_loss = lambda s, x: jnp.mean(nnx.merge(graphdef, s)(x) ** 2)  # noqa: E731
    report = jaxamp.precision_report(nnx_loss, round_bf16(state), x, compute_dtype=BF16)
    assert set(report.grad_errors) == {"total", "bias", "kernel"}
    assert 1e-4 < report.grad_error < 5e-2


def test_bad_input_raises():
    with pytest.raises(TypeError, match="callable"):
        jaxamp.precision_report(3, jnp.ones(2))
    with pytest.raises(ValueError, match="float scalar"):
        jaxamp.precision_report(lambda w: w * 2, jnp.ones(2))
    with pytest.raises(ValueError, match="group_depth"):
        jaxamp.precision_report(lambda w: w.sum(), jnp.ones(2), group_depth=0)


def test_attention_mask_sentinel_is_no_error():
    # float32's lowest value masks the scores (Flax GPT-2's attention bias);
    # int8's product gives bfloat16 scores, and the masked sum holds the mask
    # as -inf, which masks as well: no infinite error, no overflow, and the
    # unmasked scores' error is what the sum reports.
    def loss(w, x):
        with jax.named_scope("attn"):
            s = (x @ w) @ x.T
            causal = jnp.tril(jnp.ones(s.shape, bool))
            s = s + jnp.where(causal, 0.0, jnp.finfo(jnp.float32).min)
            return jnp.mean(jax.nn.softmax(s, -1) @ x)

    w = round_bf16(jax.random.normal(jax.random.key(0), (8, 8)) / 3)
    x = round_bf16(jax.random.normal(jax.random.key(1), (4, 8)))
    policy = jaxamp.int8_policy(size_rule=None, quantize_last_matmul=True)
    report = jaxamp.precision_report(loss, w, x, compute_dtype=BF16, amp_policy=policy)
    for r in report.records:
        assert np.isfinite(r.propagated_error) and np.isfinite(r.local_error), r
        assert r.overflow == 0 and np.isfinite(r.loss_share), r
    (masked,) = [r for r in report.records if r.primitive == "add" and r.format]
    dots = [r for r in report.records if r.primitive == "dot_general"]
    assert (
        1e-3
        < masked.propagated_error
        == pytest.approx(dots[1].propagated_error, rel=0.5)
    )
    assert 0 < report.grad_error < 0.2


def test_custom_vjp_primal_body_is_walked():
    @jax.custom_vjp
    def f(x, w):
        return jnp.tanh(x @ w)

    def fwd(x, w):
        y = f(x, w)
        return y, (x, w, y)

    def bwd(res, g):
        x, w, y = res
        d = g * (1 - y * y)
        return d @ w.T, x.T @ d

    f.defvjp(fwd, bwd)

    def loss(w, x):
        with jax.named_scope("cv"):
            return jnp.mean(f(x, w) @ w)

    w = round_bf16(jax.random.normal(jax.random.key(0), (8, 8)))
    x = round_bf16(jax.random.normal(jax.random.key(1), (4, 8)) * 30)
    report = jaxamp.precision_report(loss, w, x, compute_dtype=BF16)
    prims = [(r.primitive, r.scope, r.format) for r in report.records]
    assert prims[:2] == [("dot_general", "cv", "bfloat16"), ("tanh", "cv", "float32")]
    assert report.top(1) == ["cv"]
    assert 1e-4 < report.grad_error < 5e-2


@pytest.fixture(scope="module")
def loop_reports():
    # A checkpointed scan over layers, a reversed scan inside it and a
    # fori_loop with a static trip count: walked as loops (each body traced
    # once) and unrolled (one site per equation and iteration, the reference).
    from jaxamp._tools import _precision_walk

    def loss(p, x, y):
        @jax.checkpoint
        def body(h, w):
            with jax.named_scope("block"):
                h = _block(h, w, "mlp")
            with jax.named_scope("mix"):
                h, _ = jax.lax.scan(
                    lambda c, s: (jnp.tanh(c @ w["o"]) * s + c, None),
                    h,
                    jnp.array([0.5, 0.25]),
                    reverse=True,
                )
            return h, None

        h, _ = jax.lax.scan(body, p["emb"][x], p["layers"])
        with jax.named_scope("head"):
            h = jax.lax.fori_loop(0, 2, lambda i, c: _ln(c) + c, h)
            return _xent(_ln(h) @ p["head"], y)

    x, y = _batch()
    p = _stacked_gpt_params()
    out = {}
    try:
        for unroll in (False, True):
            _precision_walk.UNROLL = unroll
            out[unroll] = jaxamp.precision_report(loss, p, x, y, compute_dtype=BF16)
    finally:
        _precision_walk.UNROLL = False
    return out


def test_loops_walked_once_match_the_unrolled_walk(loop_reports):
    looped, unrolled = loop_reports[False], loop_reports[True]
    key = lambda r: (r.scope, r.iteration, r.primitive, r.format, r.source)  # noqa: E731
    assert [key(r) for r in looped.records] == [key(r) for r in unrolled.records]
    its = {r.iteration for r in looped.records if r.scope == "mix"}
    assert its == {(i, j) for i in range(L) for j in range(2)}
    assert {r.iteration for r in looped.records if r.scope == "head"} == {
        (),
        (0,),
        (1,),
    }
    big = 2e-2 * max(q.grad_share for q in unrolled.records)
    for r, q in zip(looped.records, unrolled.records):
        for f in ("local_error", "overflow", "underflow", "peak", "loss_share"):
            np.testing.assert_allclose(getattr(r, f), getattr(q, f), 1e-3, 1e-8)
        # A local backward error is a bfloat16 rounding redrawn at float32
        # inputs that the loop and the unrolled program compute a few ulps
        # apart: 2% of each share, or 2% of the largest share (one small
        # share moved by 8% on JAX 0.12: 1.16e-4 against 1.07e-4).
        np.testing.assert_allclose(r.grad_share, q.grad_share, 2e-2, big)
        # Values carried through a loop are XLA's loop program's, as amp's
        # are, not the unrolled program's; after the fori_loop they part.
        if r.scope != "head":
            np.testing.assert_allclose(
                r.propagated_error, q.propagated_error, 5e-2, 1e-4
            )
    # The walked loss is amp's own: its error is the measured loss error.
    assert looped.records[-1].primitive == "div"
    np.testing.assert_allclose(
        looped.records[-1].propagated_error, looped.loss_error, 1e-3
    )
    got, want = looped.scopes("grad"), unrolled.scopes("grad")
    assert list(got) == list(want)
    np.testing.assert_allclose(list(got.values()), list(want.values()), 0, 5e-2)
    assert looped.grad_errors == pytest.approx(unrolled.grad_errors, rel=1e-4)


def _fake_report(layers):
    from jaxamp._tools._precision_report import SiteRecord

    def rec(scope, it, share):
        return SiteRecord(
            scope, it, "dot_general", "matmul", "", "bfloat16",
            *(0.0,) * 6, 0.0, share,
        )  # fmt: skip

    recs = [rec("", (), 0.5)]
    for t in range(layers):
        recs += [
            rec("attn", (t,), 1.0 + t),
            rec("mlp", (t,), 2.0),
            rec("mlp", (t,), 2.0),
        ]
    recs.append(rec("head", (), 3.0))
    return jaxamp.tools.PrecisionReport(recs, 0.0, 0.0, {"total": 0.0}, "bfloat16")


def test_heatmap_rows_follow_the_model_and_stay_readable_when_deep():
    from jaxamp._tools._precision_plot import heat

    rows, cells = heat(_fake_report(3))
    assert rows == [
        "(no scope)", "attn [0]", "mlp [0]", "attn [1]", "mlp [1]", "attn [2]",
        "mlp [2]", "head",
    ]  # fmt: skip
    assert cells[2][0] == pytest.approx(8**0.5)  # two mlp matmuls in quadrature
    rows, cells = heat(_fake_report(48), max_rows=48)
    assert len(rows) <= 48
    # 98 rows of one iteration each; 2 per row would still be 50.
    assert len(rows) == 34
    assert rows[:3] == ["(no scope)", "attn [0-2]", "mlp [0-2]"]
    assert rows[-2:] == ["mlp [45-47]", "head"]
    assert cells[1][0] == pytest.approx((1.0 + 4.0 + 9.0) ** 0.5)


class _Lowered:
    """A stand-in for ``jax.stages.Lowered`` recording the options passed."""

    def __init__(self, refuse: bool = False):
        self.refuse, self.calls = refuse, []

    def compile(self, options=None):
        self.calls.append(options)
        if self.refuse and options:
            raise ValueError("No such compile option")
        return "compiled"


def test_compile_analysis_runs_and_keeps_xla_flags(monkeypatch):
    x = jnp.arange(4.0)
    f = jax.jit(lambda v: jnp.sin(v) * 2.0)
    got = _compat.compile_analysis(f.lower(x))(x)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(f(x)))
    # An option XLA_FLAGS sets is left to it; an option this XLA refuses
    # falls back to the default compile.
    monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=0")
    monkeypatch.setattr(_compat, "_jaxlib_minor", lambda: (0, 10))
    low = _Lowered()
    assert _compat.compile_analysis(low) == "compiled"
    assert low.calls == [{"xla_cpu_use_fusion_emitters": False}]
    low = _Lowered(refuse=True)
    assert _compat.compile_analysis(low) == "compiled"
    assert low.calls == [{"xla_cpu_use_fusion_emitters": False}, None]
    # A jaxlib without the loop emitters (>= 0.11) gets no option at all.
    monkeypatch.setattr(_compat, "_jaxlib_minor", lambda: (0, 12))
    low = _Lowered(refuse=True)
    assert _compat.compile_analysis(low) == "compiled"
    assert low.calls == [None]


def test_flax_nn_scan_remat_int8_ranking_and_suggestion():
    # Flax nn.scan over nn.remat blocks (one scope switch covers every
    # iteration), int8 everywhere: the measured ranking is the reference
    # ablation's, and suggest()'s policy meets its target when amp re-runs it.
    import flax.linen as nn

    class Block(nn.Module):
        @nn.compact
        def __call__(self, h, _):
            with jax.named_scope("attn"):
                a = nn.Dense(D, use_bias=False)(_ln(h))
                h = h + nn.Dense(D, use_bias=False)(jnp.tanh(a))
            with jax.named_scope("mlp"):
                z = nn.Dense(4 * D, use_bias=False)(_ln(h))
                return h + nn.Dense(D, use_bias=False)(jax.nn.gelu(z)), None

    stack = nn.scan(
        nn.remat(Block), variable_axes={"params": 0},
        split_rngs={"params": True}, length=L,
    )()  # fmt: skip
    x = round_bf16(jax.random.normal(jax.random.key(4), (B * T, D)))
    variables = round_bf16(stack.init(jax.random.key(5), x, None))
    head = round_bf16(jax.random.normal(jax.random.key(6), (D, V)) * D**-0.5)
    y = jax.random.randint(jax.random.key(7), (B * T,), 0, V)

    def loss(p, x, y):
        h = stack.apply(p["stack"], x, None)[0]
        with jax.named_scope("head"):
            return _xent(_ln(h) @ p["head"], y)

    params = {"stack": variables, "head": head}
    policy = jaxamp.int8_policy(size_rule=None, quantize_last_matmul=True)
    report = jaxamp.precision_report(
        loss, params, x, y, compute_dtype=BF16, amp_policy=policy
    )
    assert {r.iteration for r in report.records if r.scope.endswith("mlp")} == {
        (i,) for i in range(L)
    }
    keys = {path: key for path, (key, _) in report.overrides.items()}
    want = _ablation(loss, (params, x, y), policy, list(keys.values()))
    got = {keys[p]: v for p, v in report.scopes("grad").items()}
    assert max(got, key=got.get) == max(want["grad"], key=want["grad"].get)
    for k, share in want["grad"].items():
        assert abs(got[k] - share) < 0.05, (k, got, want)
    # Flax names each Dense as a scope of its own (Block/mlp/Dense_3); one
    # of them alone removes about half of the squared error here (int8
    # roundings of the others partly cancel: some shares are negative).
    target = 0.8 * report.grad_error
    fix = report.suggest(grad_error=target)
    assert fix.met and fix.grad_error <= target and len(fix.overrides) == 1
    assert set(fix.overrides.values()) == {"compute dtype"}
    fixed = jaxamp.amp(loss, compute_dtype=BF16, amp_policy=fix)
    g = jax.jit(jax.grad(fixed))(params, x, y)
    g32 = jax.grad(loss)(params, x, y)
    rerun = rel_l2(g, g32)
    assert rerun <= target * 1.001
    np.testing.assert_allclose(rerun, fix.grad_error, rtol=1e-3)


def test_many_scopes_are_shortlisted_by_the_estimate(monkeypatch):
    # Past MAX_MEASURED scopes the first-order estimate picks the scopes the
    # ablation measures, and the report says so.
    from jaxamp._tools import _precision_ablate

    monkeypatch.setattr(_precision_ablate, "MAX_MEASURED", 2)
    loss = _gpt_loss(lambda i: "mlp")
    params, (x, y) = _gpt_params(jax.random.key(0)), _batch()
    policy = {
        **jaxamp.default_amp_policy,
        "layer2/mlp": jaxamp.fp8_policy(size_rule=None),
    }
    report = jaxamp.precision_report(
        loss, params, x, y, compute_dtype=BF16, amp_policy=policy
    )
    # Three layers' attn and mlp and the head: 7 scopes, 2 measured.
    assert len(report.estimated["grad"]) == 7 and len(report.scopes()) == 2
    assert "measured for 2 of 7 scopes, shortlisted" in report.ranking
    assert "shortlisted" in str(report)
    est = report.estimated["grad"]
    assert set(report.scopes()) == set(sorted(est, key=est.get)[-2:])
    assert report.top(1) == ["layer2/mlp"] and np.isfinite(report.linear_fit)
