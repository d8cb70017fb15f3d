"""What survives XLA:GPU's optimiser: jaxamp's programs compiled for an H100.

XLA:GPU (``xla_allow_excess_precision``, on by default) deletes float round trips
such as ``x.astype(bf16).astype(f32)`` (openxla/xla#41605); ``reduce-precision``
and integer/bit operations survive. A rounding that the CPU tests see in the
jaxpr can thus be missing from the GPU program. These tests compile for an H100
on this CPU-only machine (``benchmarks/gpu_target.py``: JAX's compile-only CUDA
topology; skipped without the CUDA plugin, with the install line as reason) and
count, in the optimised HLO and in the program JAX handed to XLA (lowered for
the H100), the instructions that carry each rounding or 8-bit kernel:

1. ``low_precision_optimizer`` (adamw, bf16 params; stochastic, Kahan, nearest;
   int8 state): every ``reduce-precision`` to bf16, every stochastic-rounding
   truncation (u32 ``and`` with ``0xFFFF0000``) and every int8 code
   (``convert`` to s8) survives, one for one. Control: the same optimizer with
   its nearest rounding written as an ``astype`` round trip loses those round
   trips, so the count distinguishes.
2. ``int8_policy`` / ``fp8_policy`` on a 2-layer MLP gradient: s8 x s8 -> s32
   and f8e4m3fn/f8e5m2 GEMMs (dots in Triton GEMM fusions, or cuBLAS custom
   calls) survive, none runs as a float dot of upcast 8-bit values.
   ``residual_dtype``: in a ``lax.scan`` stack, the activations the forward loop
   hands the backward loop are 8-bit buffers; in a flat MLP the int8 and FP8
   codes (where the rule chooses FP8: a tanh head's input) survive and are
   buffers between the forward and backward kernels
   (the encoding's optimization barrier: without it XLA:GPU deletes the FP8
   round trip and fuses the int8 encoding into its decoding).
3. ``attention_rule("cudnn")``: ``jax.nn.dot_product_attention`` reaches cuDNN's
   fused attention, forward and backward (``__cudnn$fmha*`` custom calls).

Compile only: small shapes, no device; run time and autotuned kernels are not
checked (without a device XLA picks Triton for every GEMM).
"""

from __future__ import annotations

import collections
import re
from typing import NamedTuple

import gpu_target
import jax
import jax.numpy as jnp
import optax
import pytest

import jaxamp
from jaxamp import _compat
from jaxamp._training import _low_precision, _rounding

REASON = gpu_target.available()  # None, or the install line
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")

S = jax.ShapeDtypeStruct
BF16, F32 = jnp.bfloat16, jnp.float32
EIGHT_BIT = ("s8", "u8", "f8e4m3fn", "f8e5m2")
SR_MASK = str(0xFFFF0000)  # round_stochastic_bf16's truncation of the low half


# --- a small reader of HLO text (pre-optimisation and optimised) ---------------


class Instr(NamedTuple):
    name: str
    dtype: str  # element type, or "tuple"
    shape: tuple
    type: str  # the result type as written (a tuple's element types)
    op: str
    operands: tuple
    text: str  # the rest of the line (attributes)


_LINE = re.compile(
    r"^\s*(?:ROOT\s+)?%?(?P<name>[^\s=]+)\s*=\s*"
    r"(?P<type>\((?:[^()]|\([^()]*\))*\)|[a-z0-9]+\[[0-9,]*\](?:\{[^}]*\})?)\s+"
    r"(?P<op>[a-z][a-z0-9-]*)\((?P<rest>.*)$"
)
_ARRAY = re.compile(r"([a-z0-9]+)\[([0-9,]*)\]")


def _operands(rest: str) -> tuple[tuple, str]:
    depth = 0
    for i, ch in enumerate(rest):
        depth += ch in "({"
        depth -= ch in ")}"
        if depth < 0:
            inner = re.sub(r"/\*.*?\*/", "", rest[:i])
            names = [a.split()[-1].lstrip("%") for a in inner.split(",") if a.strip()]
            return tuple(names), rest[i + 1 :]
    return (), rest


class Hlo:
    """The instructions of an HLO module, by computation, and who calls whom."""

    def __init__(self, text: str):
        self.text = text
        self.comps: dict[str, dict[str, Instr]] = {}
        self.caller: dict[str, tuple[str, Instr]] = {}  # fused comp -> fusion
        self.entry = self.root = ""
        comp = None
        for line in text.splitlines():
            m = _LINE.match(line)
            if m is None:
                head = re.match(r"^(?:ENTRY\s+)?%?([^\s(]+)\s.*\{\s*$", line)
                if head and not line.startswith(" "):
                    comp = head.group(1)
                    self.comps[comp] = {}
                    if line.startswith("ENTRY"):
                        self.entry = comp
                continue
            t = m.group("type")
            arr = _ARRAY.match(t)
            dtype, shape = (
                ("tuple", ())
                if t.startswith("(") or arr is None
                else (
                    arr.group(1),
                    tuple(int(d) for d in arr.group(2).split(",") if d),
                )
            )
            ops, attrs = _operands(m.group("rest"))
            ins = Instr(m.group("name"), dtype, shape, t, m.group("op"), ops, attrs)
            self.comps[comp][ins.name] = ins
            if comp == self.entry and line.lstrip().startswith("ROOT"):
                self.root = ins.name
            for called in re.findall(r"calls=%?([^\s,}]+)", attrs):
                self.caller[called] = (comp, ins)

    def instrs(self):
        for comp, body in self.comps.items():
            for ins in body.values():
                yield comp, ins

    def count(self, pred) -> int:
        return sum(1 for comp, ins in self.instrs() if pred(self, comp, ins))

    def operand(self, comp: str, ins: Instr, i: int) -> tuple[str, Instr]:
        """Operand ``i``, followed out of a fusion's parameter to its caller."""
        arg = self.comps[comp][ins.operands[i]]
        while arg.op == "parameter" and comp in self.caller:
            comp, fusion = self.caller[comp]
            arg = self.comps[comp][fusion.operands[int(arg.operands[0])]]
        return comp, arg

    def source(self, comp: str, ins: Instr, i: int) -> Instr:
        """Operand ``i`` before any convert, bitcast, copy, reshape, transpose or
        broadcast (across fusion boundaries)."""
        comp, arg = self.operand(comp, ins, i)
        while arg.op in (
            "convert",
            "bitcast",
            "copy",
            "reshape",
            "transpose",
            "broadcast",
        ):
            comp, arg = self.operand(comp, arg, 0)
        return arg


def _rp_bf16(h, comp, ins):  # a reduce-precision to bf16's format
    return ins.op == "reduce-precision" and re.search(
        r"exponent_bits=8,\s*mantissa_bits=7", ins.text
    )


def _sr_truncation(h, comp, ins):  # u32 and with 0xFFFF0000
    if ins.op != "and" or ins.dtype != "u32":
        return False
    srcs = [h.source(comp, ins, i) for i in range(len(ins.operands))]
    return any(s.op == "constant" and s.operands == (SR_MASK,) for s in srcs)


def _convert_to(dtype):
    return lambda h, comp, ins: ins.op == "convert" and ins.dtype == dtype


def _round_trip(h, comp, ins):  # f32 -> bf16 -> f32, within one computation
    if ins.op != "convert" or ins.dtype != "f32":
        return False
    mid = h.comps[comp].get(ins.operands[0])
    if mid is None or mid.op != "convert" or mid.dtype != "bf16":
        return False
    src = h.comps[comp].get(mid.operands[0])
    return src is not None and src.dtype == "f32"


def gemms(h: Hlo) -> list[tuple[tuple, str, tuple]]:
    """Every matmul: (operand dtypes, result dtype, operand source dtypes), for
    ``dot`` instructions and cuBLAS custom calls."""
    out = []
    for comp, ins in h.instrs():
        cublas = ins.op == "custom-call" and "__cublas" in ins.text
        if ins.op != "dot" and not cublas:
            continue
        ops = tuple(h.operand(comp, ins, i)[1].dtype for i in range(2))
        srcs = tuple(h.source(comp, ins, i).dtype for i in range(2))
        res = _ARRAY.search(ins.type)[1]  # a custom call's first result
        out.append((ops, res, srcs))
    return out


def compiled(fn, *args) -> Hlo:
    """``fn``'s program as XLA:GPU optimised it for an H100."""
    return Hlo(gpu_target.compile_for(fn, *args, target="h100").as_text())


def programs(fn, *args) -> tuple[Hlo, Hlo]:
    """``fn``'s program as JAX hands it to XLA for an H100, and optimised."""
    sharding = gpu_target._sharding("h100")  # where compile_for places them
    placed = [S(a.shape, a.dtype, sharding=sharding) for a in jax.tree.leaves(args)]
    flat = lambda *leaves: fn(*jax.tree.unflatten(jax.tree.structure(args), leaves))
    pre = jax.jit(flat).lower(*placed).as_text(dialect="hlo")
    return Hlo(pre), compiled(fn, *args)


def custom_calls(h: Hlo) -> collections.Counter:
    return collections.Counter(re.findall(r'custom_call_target="([^"]+)"', h.text))


# --- 1. low_precision_optimizer's roundings ------------------------------------

PARAMS = {"w": S((256, 256), BF16), "b": S((256,), BF16)}


def optimizer_step(rounding: str, state_dtype=BF16):
    tx = jaxamp.low_precision_optimizer(
        optax.adamw(1e-3), rounding=rounding, state_dtype=state_dtype
    )
    state = jax.eval_shape(tx.init, PARAMS)

    def step(params, grads, state):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return step, (PARAMS, PARAMS, state)


# (rounding, state) -> the survivors expected (= the roundings JAX emits):
# (reduce-precision to bf16, stochastic truncations, converts to s8), over the
# two bf16 leaves w and b. reduce-precision, per leaf: _exact_step's 5, one per
# stochastic rounding (its non-finite fallback), "nearest"'s parameter write and
# bf16 moments (3), Kahan's parameter write, reached value and compensation (3).
# Stochastic truncations: the parameter write (not "kahan") and the moments mu,
# nu (not "nearest", not int8). int8: w's mu and nu (b, 256 elements, stays bf16
# under min_quantized_size=4096).
OPTIMIZER_CASES = {
    ("stochastic", "bfloat16"): (16, 6, 0),
    ("kahan", "bfloat16"): (20, 4, 0),
    ("nearest", "bfloat16"): (16, 0, 0),
    ("stochastic", "int8"): (14, 4, 2),
}


@pytest.mark.parametrize("rounding,state", list(OPTIMIZER_CASES), ids=str)
def test_optimizer_roundings_survive(rounding, state):
    step, args = optimizer_step(rounding, BF16 if state == "bfloat16" else state)
    with jax.numpy_dtype_promotion("standard"):  # optax's adamw is not strict
        pre, post = programs(step, *args)
    rp, sr, s8 = OPTIMIZER_CASES[rounding, state]
    for name, pred, want in (
        ("reduce-precision", _rp_bf16, rp),
        ("stochastic truncation", _sr_truncation, sr),
        ("convert to s8", _convert_to("s8"), s8),
    ):
        assert (pre.count(pred), post.count(pred)) == (want, want), name
    # jaxamp writes no rounding as a float round trip XLA may delete
    assert pre.count(_round_trip) == 0
    if state == "int8":  # the moments of w are stored and returned as codes
        entry = post.comps[post.entry]
        outs = [entry[o] for o in entry[post.root].operands]
        assert sum(o.dtype == "s8" and o.shape == (256, 256) for o in outs) == 2


def test_astype_rounding_is_deleted(monkeypatch):
    # Control: the same optimizer with round_nearest_bf16 written as a float
    # round trip. XLA:GPU deletes the f32 -> bf16 -> f32 pairs (new32 = new
    # .astype(f32) becomes the unrounded target), so survival counts detect it.
    for module in (_low_precision, _rounding):  # the write and the state codec
        monkeypatch.setattr(
            module, "round_nearest_bf16", lambda x: x.astype(F32).astype(BF16)
        )
    step, args = optimizer_step("nearest")
    with jax.numpy_dtype_promotion("standard"):
        pre, post = programs(step, *args)
    assert pre.count(_rp_bf16) == post.count(_rp_bf16) == 0
    assert pre.count(_round_trip) == 4  # new and d widened again, for w and b
    assert post.count(_round_trip) == 0


# --- 2. int8 / FP8 matmuls and 8-bit residuals ---------------------------------

MLP = {"w1": S((512, 1024), F32), "w2": S((1024, 512), F32)}
X = S((256, 512), F32)


def mlp_loss(p, x):
    h = jax.nn.gelu(x @ p["w1"])
    return jnp.mean((h @ p["w2"]) ** 2)


def mlp_grad(**amp_kw):
    return jax.grad(jaxamp.amp(mlp_loss, compute_dtype=BF16, **amp_kw))


def test_int8_matmuls_run_on_int8():
    policy = jaxamp.int8_policy(size_rule=None, quantize_last_matmul=True)
    pre, post = programs(mlp_grad(amp_policy=policy), MLP, X)
    int8 = [g for g in gemms(post) if g[0] == ("s8", "s8")]
    # forward (2) and the hidden layer's dgrad (1); wgrad stays bf16 (default)
    assert len(int8) == 3
    assert all(g[1] == "s32" for g in int8)
    assert len([g for g in gemms(pre) if g[0] == ("s8", "s8")]) == 3
    # no product of two 8-bit sources runs as a float dot of upcast values
    upcast = [g for g in gemms(post) if all(s in EIGHT_BIT for s in g[2])]
    assert upcast == int8


def test_fp8_matmuls_run_on_fp8():
    policy = jaxamp.fp8_policy(size_rule=None, quantize_last_matmul=True)
    pre, post = programs(mlp_grad(amp_policy=policy), MLP, X)
    fp8 = [g for g in gemms(post) if all(d.startswith("f8") for d in g[0])]
    # forward (2), dgrad (1) and wgrad (2); gradients in E5M2 (HYBRID)
    assert len(fp8) == 5 == len(gemms(post))
    assert sum("f8e5m2" in g[0] for g in fp8) == 3
    assert len([g for g in gemms(pre) if all(d.startswith("f8") for d in g[0])]) == 5
    upcast = [g for g in gemms(post) if all(s in EIGHT_BIT for s in g[2])]
    assert upcast == fp8


def _stacks(h: Hlo, shape: tuple) -> list[collections.Counter]:
    """Per while loop, the dtypes of its state's buffers of ``shape``."""
    out = []
    for _, ins in h.instrs():
        if ins.op == "while":
            dims = ",".join(map(str, shape))
            out.append(collections.Counter(re.findall(rf"(\w+)\[{dims}\]", ins.type)))
    return out


def scan_grad(residual_dtype):
    def loss(w, x):
        def layer(h, wl):
            return jax.nn.gelu(h @ wl), None

        h, _ = jax.lax.scan(layer, x, w)
        return jnp.mean(h**2)

    return jax.grad(jaxamp.amp(loss, compute_dtype=BF16, residual_dtype=residual_dtype))


@pytest.mark.parametrize(
    "residual_dtype,stored",
    # stored: the stacked [L, B, D] activations the forward loop saves. Without
    # compression: 5 bf16 with XLA 0.10 and 0.11, 4 with XLA 0.12 (its
    # optimised HLO keeps one stack fewer in the loop). FP8 keeps products' inputs in
    # bf16 (QFormat.stores_products) and stores gelu's input in
    # E4M3; int8 stores both.
    [(None, {"bf16": 5 if _compat.JAX_VERSION < (0, 12) else 4})]
    + [(jnp.float8_e4m3fn, {"bf16": 1, "f8e4m3fn": 1})]
    + [("int8", {"s8": 2})],
    ids=["none", "e4m3", "int8"],
)
def test_scan_residuals_are_8bit(residual_dtype, stored):
    L, B, D = 4, 256, 512
    post = compiled(scan_grad(residual_dtype), S((L, D, D), F32), S((B, D), F32))
    loops = _stacks(post, (L, B, D))
    assert len(loops) == 2  # the forward scan and its transpose
    assert dict(loops[0]) == stored  # the forward loop's state ...
    for dt, n in stored.items():  # ... all read by the backward loop
        assert loops[1][dt] == n


def tanh_mlp_loss(p, x):
    return jnp.mean(jnp.tanh(jax.nn.gelu(x @ p["w1"]) @ p["w2"]))


# (model, residual_dtype) -> the residual codes the flat MLP's gradient stores,
# by HLO element type (_residuals.residual_rule, _compressed.bind_compressed):
# - int8 stores every saved activation in int8: gelu's input and the squared
#   loss's input.
# - E4M3 on the squared loss stores no E4M3 code: the square's input is saved
#   in its product form, int8 (its derivative 2 h g passes FP8's error undamped
#   into every gradient: _compressed._is_square), and gelu's input stays bf16
#   (w2's weight gradient reads gelu's output, which FP8 keeps in the compute
#   dtype: QFormat.stores_products; it is recomputed from gelu's input, so one
#   bf16 buffer serves both derivatives and an E4M3 copy would only add bytes).
# - E4M3 is the chosen form for the input of a non-linearity no product reads:
#   a tanh head's input (the last matmul's output; mean reads no value).
FLAT_CASES = {
    ("squared", "int8"): {"s8": 2, "f8e4m3fn": 0},
    ("squared", "e4m3"): {"s8": 1, "f8e4m3fn": 0},
    ("tanh", "e4m3"): {"s8": 0, "f8e4m3fn": 1},
}
FLAT_LOSSES = {"squared": mlp_loss, "tanh": tanh_mlp_loss}
FLAT_IDS = [f"{model}-{rd}" for model, rd in FLAT_CASES]


def flat_grad(model: str, residual_dtype: str):
    rd = jnp.float8_e4m3fn if residual_dtype == "e4m3" else residual_dtype
    f = jaxamp.amp(FLAT_LOSSES[model], compute_dtype=BF16, residual_dtype=rd)
    return jax.grad(f)


@pytest.mark.parametrize("model,residual_dtype", list(FLAT_CASES), ids=FLAT_IDS)
def test_flat_mlp_residual_codes_survive(model, residual_dtype):
    pre, post = programs(flat_grad(model, residual_dtype), MLP, X)
    for dtype, want in FLAT_CASES[model, residual_dtype].items():
        assert pre.count(_convert_to(dtype)) == want, dtype
        assert post.count(_convert_to(dtype)) == want, dtype


@pytest.mark.parametrize("model,residual_dtype", list(FLAT_CASES), ids=FLAT_IDS)
def test_flat_mlp_residual_codes_reach_memory(model, residual_dtype):
    # The codes are buffers between the forward and the backward kernels (the
    # encoding ends in an optimization barrier): XLA neither fuses the
    # encoding into its decoding, which would keep the activation alive
    # instead, nor deletes an FP8 round trip. A format the rule does not
    # choose on the model is in no buffer.
    post = compiled(flat_grad(model, residual_dtype), MLP, X)
    entry = post.comps[post.entry].values()  # the buffers between kernels
    for dtype, want in FLAT_CASES[model, residual_dtype].items():
        assert any(f"{dtype}[" in ins.type for ins in entry) == (want > 0), dtype


# --- 3. fused attention ------------------------------------------------------

QKV = S((2, 128, 4, 64), F32)  # (B, T, N, H): a shape cuDNN's flash kernel takes


def attention_grad(rule: str):
    def loss(q, k, v):
        return jnp.sum(jax.nn.dot_product_attention(q, k, v, is_causal=True) ** 2)

    policy = {**jaxamp.default_amp_policy, "attention": jaxamp.attention_rule(rule)}
    f = jaxamp.amp(loss, compute_dtype=BF16, amp_policy=policy)
    return jax.grad(f, argnums=(0, 1, 2))


def test_cudnn_attention_reaches_cudnn():
    post = compiled(attention_grad("cudnn"), QKV, QKV, QKV)
    calls = custom_calls(post)
    assert calls["__cudnn$fmhaSoftmax"] == 1
    assert calls["__cudnn$fmhaSoftmaxBackward"] == 1
    assert gemms(post) == []  # no attention product left to XLA
    for _, ins in post.instrs():
        if ins.op == "custom-call" and "__cudnn$fmha" in ins.text:
            # q, k, v (and the backward's saved output and cotangent) in bf16
            layout = re.search(r"operand_layout_constraints=\{(.*?)\}, ", ins.text)
            assert set(_ARRAY.findall(layout[1])) <= {
                ("bf16", "2,128,4,64"),
                ("f32", "2,4,128"),
                ("bf16", "2,4,128,64"),
            }


def test_xla_attention_control():
    # The same model with attention_rule("xla"): no cuDNN call, XLA's dots.
    post = compiled(attention_grad("xla"), QKV, QKV, QKV)
    assert not any("cudnn" in c for c in custom_calls(post))
    assert len(gemms(post)) >= 4  # q k^T and p v, and their gradients


# --- 4. the 8-bit format for the chip ----------------------------------------


def test_h100_target_picks_fp8():
    device = gpu_target._sharding("h100").mesh.devices.flat[0]
    choice = jaxamp.quant.eight_bit_choice(device)
    assert (choice.chip, choice.format) == ("H100", "fp8")
    policy = jaxamp.eight_bit_policy(device, size_rule=None, quantize_last_matmul=True)
    post = compiled(mlp_grad(amp_policy=policy), MLP, X)
    assert len(gemms(post)) == 5
    assert all(all(d.startswith("f8") for d in g[0]) for g in gemms(post))
