"""Scope paths as policy keys (jaxamp/_policy/_lookup.py): ``"layer2/mlp"``
matches where its components occur as a contiguous run of an equation's
``jax.named_scope`` stack, through ``jit``, ``scan``, ``jax.checkpoint`` and
nested amps; the longest matching key wins; single components keep matching
every scope of that name; a path that matches nothing warns. The policy and
the three reports read one scope path (jaxamp/_base/_scopes.py): a report
names an equation by the path key that matched it."""

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxamp
from jaxamp._base._scopes import scope_path
from jaxamp._policy._lookup import AmpPolicy

BF16, F16, F32 = np.dtype(jnp.bfloat16), np.dtype(jnp.float16), np.dtype(jnp.float32)
E4M3 = np.dtype(jnp.float8_e4m3fn)
# Layer i maps DIMS[i] -> DIMS[i + 1]: every layer's weight has its own shape,
# so a matmul of the forward or backward pass names its layer by shape.
DIMS = (8, 12, 16, 20)
N_LAYERS = len(DIMS) - 1
FULL = jaxamp.use_full_precision


def _bf16_rounded(x):
    return jnp.asarray(x, jnp.bfloat16).astype(jnp.float32)


def _params():
    keys = jax.random.split(jax.random.key(0), N_LAYERS)
    return [
        _bf16_rounded(jax.random.normal(k, (a, b)) / np.sqrt(a))
        for k, a, b in zip(keys, DIMS, DIMS[1:])
    ]


# Activations in the hundreds, as a residual stream reaches in training.
X = _bf16_rounded(300.0 * jax.random.normal(jax.random.key(1), (4, DIMS[0])))


def _layer(w, x, i):
    with jax.named_scope(f"layer{i}"), jax.named_scope("mlp"):
        return jax.nn.relu(x @ w)


WRAPS = {
    "plain": lambda f: f,
    "jit": lambda f: jax.jit(f, static_argnums=2),
    "checkpoint": lambda f: jax.checkpoint(f, static_argnums=(2,)),
}


def _model(wrap):
    def loss(ws, x):
        with jax.named_scope("model"):
            for i, w in enumerate(ws):
                x = WRAPS[wrap](_layer)(w, x, i)
        return jnp.mean(x * x)

    return loss


def _dot_dtypes(closed, shapes):
    """Layer -> the input dtypes of the matmuls touching its weight's shape."""
    out = {}
    for eqn, _ in jaxamp.tools.iter_equations(closed):
        if eqn.primitive.name != "dot_general":
            continue
        avals = [v.aval for v in (*eqn.invars, *eqn.outvars)]
        for layer, shape in shapes.items():
            if any(tuple(a.shape) in (shape, shape[::-1]) for a in avals):
                dts = {np.dtype(v.aval.dtype) for v in eqn.invars}
                out.setdefault(layer, set()).update(dts)
    return out


def _layers(ws):
    return {i: tuple(w.shape) for i, w in enumerate(ws)}


def _grad_jaxpr(loss, ws, policy, compute_dtype=BF16):
    f = jaxamp.amp(loss, compute_dtype=compute_dtype, amp_policy=policy)
    return jax.make_jaxpr(jax.grad(f))(ws, X)


def _expect_only_layer2(dtypes, target=F32, others=BF16):
    assert set(dtypes) == set(range(N_LAYERS))
    for layer, dts in dtypes.items():
        assert dts == ({target} if layer == 2 else {others}), (layer, dts)


@pytest.mark.parametrize("wrap", sorted(WRAPS))
def test_path_targets_one_layer_forward_and_backward(wrap):
    ws = _params()
    loss = _model(wrap)
    policy = {**jaxamp.default_amp_policy, "layer2/mlp": FULL}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a path that matched never warns
        closed = _grad_jaxpr(loss, ws, policy)
    _expect_only_layer2(_dot_dtypes(closed, _layers(ws)))
    # Layer 2 in float32 brings the loss no further from float32's than the
    # all-bf16 run (bf16 rounding of the other layers dominates).
    ref = loss(ws, X)
    got = jaxamp.amp(loss, compute_dtype=BF16, amp_policy=policy)(ws, X)
    np.testing.assert_allclose(got, ref, rtol=3e-2)


@pytest.mark.parametrize("grad_inside_amp", [False, True], ids=["grad_amp", "amp_grad"])
def test_path_matches_inside_a_checkpointed_scan_body(grad_inside_amp):
    """Layer 2 is a scanned stack of checkpointed square blocks under the
    scopes ``layer2``/``mlp``; differentiating inside amp gives its body's
    equations JAX's ``rematted_computation`` scope, which the path skips."""
    ws = _params()[:2]
    stack = jnp.stack([_bf16_rounded(jnp.eye(DIMS[2]) * 0.5)] * 3)

    def loss(params, x):
        ws, stack = params
        with jax.named_scope("model"):
            for i, w in enumerate(ws):
                x = _layer(w, x, i)

            def body(h, w):
                with jax.named_scope("mlp"):
                    return jax.checkpoint(lambda h, w: jax.nn.relu(h @ w))(h, w), None

            with jax.named_scope("layer2"):
                x, _ = jax.lax.scan(body, x, stack)
        return jnp.mean(x * x)

    policy = {**jaxamp.default_amp_policy, "layer2/mlp": FULL}
    params = (ws, stack)
    if grad_inside_amp:
        f = jaxamp.amp(jax.grad(loss), compute_dtype=BF16, amp_policy=policy)
        closed = jax.make_jaxpr(f)(params, X)
    else:
        closed = _grad_jaxpr(loss, params, policy)
    shapes = {0: tuple(ws[0].shape), 1: tuple(ws[1].shape), 2: (DIMS[2], DIMS[2])}
    _expect_only_layer2(_dot_dtypes(closed, shapes))


def test_path_in_a_nested_amp():
    """The inner amp's policy targets one layer; the outer amp (default policy)
    leaves the inner region to it."""
    ws = _params()
    policy = {**jaxamp.default_amp_policy, "layer2/mlp": FULL}

    def outer(ws, x):
        with jax.named_scope("outer"):
            inner = jaxamp.amp(_model("plain"), compute_dtype=BF16, amp_policy=policy)
            return inner(ws, x)

    closed = jax.make_jaxpr(jax.grad(jaxamp.amp(outer, compute_dtype=F16)))(ws, X)
    _expect_only_layer2(_dot_dtypes(closed, _layers(ws)))


def test_longest_matching_key_wins():
    ws = _params()
    policy = {
        **jaxamp.default_amp_policy,
        "mlp": jaxamp.rules.use_precision(F16),  # every layer's mlp
        "layer2/mlp": FULL,  # longer: wins in layer 2
    }
    closed = _grad_jaxpr(_model("plain"), ws, policy)
    _expect_only_layer2(_dot_dtypes(closed, _layers(ws)), F32, F16)
    # A three-component path beats a two-component one on the same equation.
    policy["model/layer2/mlp"] = jaxamp.rules.use_precision(BF16)
    closed = _grad_jaxpr(_model("plain"), ws, policy)
    _expect_only_layer2(_dot_dtypes(closed, _layers(ws)), BF16, F16)


def test_lookup_order_of_paths_and_names():
    a, b = jaxamp.use_full_precision, jaxamp.use_original_precision
    c, d = jaxamp.rules.use_widest_precision, jaxamp.use_compute_precision
    default = jaxamp.rules.follow_compute_precision
    exp_p = jax.lax.exp_p
    pol = AmpPolicy({"model": a, "layer2/mlp": b})
    assert pol.lookup(exp_p, ("model", "layer2", "mlp")) is b  # longer wins
    assert pol.lookup(exp_p, ("model", "layer1", "mlp")) is a  # the name
    pol = AmpPolicy({"layer2/mlp": b, "model/layer2": d})
    assert pol.lookup(exp_p, ("model", "layer2", "mlp")) is d  # tie: outermost
    pol = AmpPolicy({"layer2/mlp": c})
    stack = ("model", "layer2", "rematted_computation", "mlp")
    assert pol.lookup(exp_p, stack) is c  # JAX's checkpoint scope is skipped
    assert pol.lookup(exp_p, ("layer2", "attn", "mlp")) is default  # contiguous
    assert pol.lookup(exp_p, ("mlp", "layer2")) is default  # in order


def test_nested_policy_under_a_path():
    ws = _params()
    inner = {**jaxamp.default_amp_policy, "dot_general": FULL}
    policy = {**jaxamp.default_amp_policy, "layer2/mlp": inner}
    closed = _grad_jaxpr(_model("plain"), ws, policy)
    _expect_only_layer2(_dot_dtypes(closed, _layers(ws)))


def test_single_component_still_matches_every_layer():
    ws = _params()
    policy = {**jaxamp.default_amp_policy, "mlp": FULL}
    dtypes = _dot_dtypes(_grad_jaxpr(_model("jit"), ws, policy), _layers(ws))
    assert dtypes == {i: {F32} for i in range(N_LAYERS)}


def test_fp8_in_one_layer_by_path():
    ws = _params()
    # Layer 2 is the last: its product feeds the loss, which the FP8 policy
    # keeps in the compute dtype unless asked (quantize_last_matmul).
    policy = jaxamp.fp8_policy(
        scopes=("layer2/mlp",), size_rule=None, quantize_last_matmul=True
    )
    dtypes = _dot_dtypes(_grad_jaxpr(_model("plain"), ws, policy), _layers(ws))
    assert {d.itemsize for d in dtypes[2]} == {1}, dtypes[2]
    assert dtypes[0] == dtypes[1] == {BF16}


@pytest.mark.parametrize(
    "key, closest",
    [
        ("layer2/mpl", "layer2/mlp"),
        ("laier1/mlp", "layer1/mlp"),
        ("model/mlp", "model/layer2"),  # not contiguous: matches nothing
    ],
)
def test_unmatched_path_warns_naming_the_closest(key, closest):
    policy = {**jaxamp.default_amp_policy, key: FULL}
    f = jaxamp.amp(_model("plain"), compute_dtype=BF16, amp_policy=policy)
    match = f"'{key}' matched no primitive.*Did you mean '{closest}'"
    with pytest.warns(UserWarning, match=match):
        f(_params(), X)


@pytest.mark.parametrize("key", ["layer2//mlp", "/mlp", "layer2/"])
def test_malformed_path_raises(key):
    with pytest.raises(ValueError, match="non-empty components"):
        AmpPolicy({key: FULL})


# One equation, one scope string in the three reports (jaxamp/_base/_scopes.py):
# the path the user wrote, as a policy key takes it.
def _einsum_in_scope(w, x):
    with jax.named_scope("mlp"):
        h = jnp.einsum("bi,ij->bj", x, w)  # jnp.einsum opens its own scope
    return jnp.mean(h * h)


@jax.jit
def _jitted_product(w, x):
    return x @ w


def _jit_in_scope(w, x):
    with jax.named_scope("block"):
        h = _jitted_product(w, x)
    return jnp.mean(h * h)


def _scan_of_scoped_layers(w, x):
    def layer(h, _):
        with jax.named_scope("layer"):
            return h @ w, None

    with jax.named_scope("stack"):
        h, _ = jax.lax.scan(layer, x, None, length=3)
    return jnp.mean(h * h)


@pytest.mark.parametrize(
    "loss, path",
    [
        (_einsum_in_scope, "mlp"),
        (_jit_in_scope, "block"),
        (_scan_of_scoped_layers, "stack/layer"),
    ],
)
def test_reports_give_one_scope_string_per_equation(loss, path):
    w, x = _bf16_rounded(jnp.eye(8) / 2), X[:, :8]
    step = jax.grad(jaxamp.amp(loss, compute_dtype=BF16))
    quant = {r.scope for r in jaxamp.quantization_report(step, w, x)}
    memory = jaxamp.memory_report(loss, w, x, compute_dtype=BF16, compile=False)
    saved = {r.scope for r in memory.rows if r.primitive == "dot_general"}
    report = jaxamp.precision_report(loss, w, x, compute_dtype=BF16)
    sites = {r.scope for r in report.records if r.primitive == "dot_general"}
    assert quant == saved == sites == {path}
    # The string is a policy key that matches the product.
    f = jaxamp.amp(loss, compute_dtype=BF16, amp_policy={path: FULL})
    dots = [e for e, _ in jaxamp.tools.iter_equations(jax.make_jaxpr(f)(w, x))]
    dots = [e for e in dots if e.primitive.name == "dot_general"]
    assert dots and all(v.aval.dtype == F32 for e in dots for v in e.invars)


@pytest.mark.parametrize(
    "scopes, path",
    [
        (("jaxamp.amp", "mlp", "bi,ij->bj", "jaxamp_recast"), "mlp"),
        (("model", "layer0", "model", "layer0", "mlp"), "model/layer0/mlp"),
        (("a", "a", "rematted_computation", "b", "jaxamp_int8_matmul"), "a/b"),
        (("jaxamp.amp",), ""),
        # A user's scope whose name starts with "jax" is the user's.
        (("jaxamp.amp", "jaxformer", "mlp", "jaxamp_recast"), "jaxformer/mlp"),
        (("jax_stack", "layer", "layer", "rematted_computation"), "jax_stack/layer"),
    ],
)
def test_scope_path_keeps_the_users_components_once(scopes, path):
    assert scope_path(scopes) == path


# Every equation of a model with nested scopes (names starting with "jax"
# too), an einsum, a jit, a scan and a jax.checkpoint: the scope string each
# report gives it is the path of the policy key that matched it in the walk.
# Each layer's weight has its own shape and each layer is one source line, so
# an equation of a report names its layer by its line.
W_SHAPES = {"attn": (8, 12), "mlp": (12, 16), "layer": (16, 16), "head": (16, 20)}
KEYS = {  # layer -> the path of its scope, each a key of the policy below
    "attn": "jaxformer/attn",
    "mlp": "jaxformer/mlp",
    "layer": "jaxformer/jax_stack/layer",
    "head": "head",
}


def _mlp(x, w):
    return jnp.tanh(x @ w)


def _nested_scopes_model(ws, x):
    with jax.named_scope("jaxformer"):
        with jax.named_scope("attn"):
            x = jnp.tanh(jnp.einsum("bi,ij->bj", x, ws["attn"]))
        with jax.named_scope("mlp"):
            x = jax.jit(_mlp)(x, ws["mlp"])

        def body(h, _):
            with jax.named_scope("layer"):
                return jax.checkpoint(lambda h: jnp.tanh(h @ ws["layer"]))(h), None

        with jax.named_scope("jax_stack"):
            x, _ = jax.lax.scan(body, x, None, length=2)
    with jax.named_scope("head"):
        y = x @ ws["head"]
    return jnp.mean(y * y)


def _recording_policy(seen):
    """The default policy, under one key per scope path of the model (and
    their prefixes): each scope's rules are the default ones, recording
    ``(key, scope path the rule was told, operand shapes)`` per equation."""
    base = jaxamp.default_amp_policy

    def recorder(key, rule):
        @jaxamp.rules.CastRule.with_context
        def record(ctx, *invars, **params):
            shapes = tuple(tuple(np.shape(v)) for v in invars)
            seen.append((key, scope_path(ctx.scopes), shapes))
            return rule.decide(ctx, *invars, **params)

        return record

    def nested(key):
        return {
            **base,
            **{
                name: recorder(key, rule)
                for name, rule in base.items()
                if isinstance(name, str)
                and type(rule) is jaxamp.rules.CastRule
                and name not in ("amp_stop", "amp_default")
            },
        }

    keys = {*KEYS.values(), "jaxformer", "jaxformer/jax_stack"}
    return {**base, **{k: nested(k) for k in sorted(keys)}}


def _line(source):
    """``file:LINE`` of a report's ``file:LINE:COL (function)``."""
    return re.match(r"(.*?:\d+)", source).group(1)


def _layer_of(dims):
    """The layer whose weight's dimensions are all among ``dims`` (the most
    specific one), or None."""
    found = [(len(set(s)), name) for name, s in W_SHAPES.items() if set(s) <= set(dims)]
    return max(found)[1] if found else None


# The recording policy holds every primitive's rule under every scope key.
@pytest.mark.filterwarnings("ignore:jaxamp.amp. amp_policy key .* matched no primitive")
def test_every_report_names_an_equation_by_the_key_that_matched_it():
    ws = {k: _bf16_rounded(jnp.eye(*s) / 2) for k, s in W_SHAPES.items()}
    x = X[:, :8]
    seen: list = []
    policy = _recording_policy(seen)
    step = jax.grad(
        jaxamp.amp(_nested_scopes_model, compute_dtype=BF16, amp_policy=policy)
    )
    quant = jaxamp.quantization_report(step, ws, x)
    # In the walk, each rule was told the scope path of the key that matched.
    assert seen and all(key == path for key, path, _ in seen), set(seen)
    matched = {}  # layer -> the key that matched its product
    for key, _, shapes in seen:
        if len(shapes) == 2 and len(shapes[1]) == 2:
            matched.setdefault(_layer_of(shapes[0] + shapes[1]), set()).add(key)
    assert matched == {layer: {KEYS[layer]} for layer in KEYS}
    assert KEYS["mlp"] == "jaxformer/mlp"  # not "mlp": "jaxformer" is the user's
    # Each product of the gradient step (forward, both backward) names its layer
    # by the key that matched its forward product; a layer is one source line.
    line = {}
    for r in quant:
        layer = _layer_of(r.shape[1:])
        assert r.scope == KEYS[layer], r
        line[_line(r.source)] = KEYS[layer]
    assert len(quant) == 3 * len(KEYS) and len(set(line.values())) == len(KEYS)
    memory = jaxamp.memory_report(
        _nested_scopes_model,
        ws,
        x,
        compute_dtype=BF16,
        amp_policy=policy,
        compile=False,
    )
    report = jaxamp.precision_report(
        _nested_scopes_model, ws, x, compute_dtype=BF16, amp_policy=policy
    )
    rows = [(_line(r.source), r.scope) for r in memory.rows]
    sites = [(_line(r.source), r.scope) for r in report.records]
    rows, sites = [r for r in rows if r[0] in line], [r for r in sites if r[0] in line]
    assert rows and {scope for _, scope in sites} == set(KEYS.values())
    for source, scope in rows + sites:
        assert scope == line[source], (source, scope)
    # Equations on other lines (the loss) are in no scope.
    others = [r.scope for r in report.records if _line(r.source) not in line]
    assert set(others) <= {""}, others
