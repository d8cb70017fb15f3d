"""What libtpu's compiler makes of jaxamp's programs: compiled for TPU chips on
this CPU-only machine (``benchmarks/tpu_target.py``: JAX's compile-only TPU
topology; skipped without libtpu, with the install line as reason).

1. int8 (the chip's choice on v5e and v6e): every int8 product reaches the
   MXU as an ``s8 x s8 -> s32`` convolution whose rescale is in the same
   fusion: no s32 buffer leaves a fusion.
2. FP8 (the chip's choice on TPU7x): the products are ``f8e4m3fn`` /
   ``f8e5m2`` convolutions, none of upcast values.
3. bf16: jaxamp's step has no float32 product the hand-written bf16 step
   lacks; an 8-bit policy that quantizes nothing compiles to the bf16 step's
   program.
4. The chip's choice read from each target's device.

Compile only: small shapes, no device; run time is not checked (libtpu's
cost estimates are ``benchmarks/RESULTS_TPU.md``'s).
"""

from __future__ import annotations

import collections
import re
from typing import NamedTuple

import gpu_attention as ga
import jax
import jax.numpy as jnp
import pytest
import tpu_target

import jaxamp

REASON = tpu_target.available()  # None, or the install line
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")

S = jax.ShapeDtypeStruct
BF16, F32 = jnp.bfloat16, jnp.float32
FP8 = ("f8e4m3fn", "f8e5m2")


# --- a small reader of libtpu's optimised HLO -------------------------------


class Instr(NamedTuple):
    name: str
    type: str  # the result type as written (a tuple's element types)
    op: str
    operands: tuple
    attrs: str

    @property
    def dtype(self) -> str:
        return "tuple" if self.type.startswith("(") else self.type.split("[")[0]


_HEAD = re.compile(r"^(?:ENTRY )?%([\w.\-]+) \(.*\{\s*$")
_LINE = re.compile(
    r"^\s*(?:ROOT )?%(?P<name>[\w.\-]+) = "
    r"(?P<type>\((?:[^()]|\([^()]*\))*\)|\w+\[[\d,]*\](?:\{[^}]*\})?) "
    r"(?P<op>[\w\-]+)\((?P<args>[^)]*)\)(?P<attrs>.*)$"
)
_ARRAYS = re.compile(r"(\w+)\[([\d,]*)\]")


class Hlo:
    """Computations by name, their instructions, and which fusion calls each
    fused computation."""

    def __init__(self, text: str):
        self.comps: dict[str, dict[str, Instr]] = {}
        self.caller: dict[str, tuple[str, Instr]] = {}
        comp = None
        for line in text.splitlines():
            head = _HEAD.match(line)
            if head:
                comp = head.group(1)
                self.comps[comp] = {}
                continue
            m = _LINE.match(line)
            if m is None or comp is None:
                continue
            ops = tuple(re.findall(r"%([\w.\-]+)", m["args"]))
            ins = Instr(m["name"], m["type"], m["op"], ops, m["attrs"])
            self.comps[comp][ins.name] = ins
            for called in re.findall(r"calls=%([\w.\-]+)", ins.attrs):
                self.caller[called] = (comp, ins)

    def instrs(self):
        for comp, body in self.comps.items():
            for ins in body.values():
                yield comp, ins

    def outermost_fusion(self, comp: str) -> Instr:
        """The fusion in a scheduled computation that holds ``comp``."""
        fusion = None
        while comp in self.caller:
            comp, fusion = self.caller[comp]
        return fusion

    def products(self) -> list[tuple[tuple, str, str, Instr]]:
        """Every MXU product: (operand dtypes as the convolution reads them,
        result dtype, its computation, the outermost fusion holding it)."""
        out = []
        for comp, ins in self.instrs():
            if ins.op in ("convolution", "dot"):
                ops = tuple(self.comps[comp][o].dtype for o in ins.operands[:2])
                out.append((ops, ins.dtype, comp, self.outermost_fusion(comp)))
        return out

    def buffers(self, dtype: str) -> list[Instr]:
        """Instructions of scheduled (not fused) computations with a non-scalar
        ``dtype`` array in their result: buffers in HBM between fusions."""
        return [
            ins
            for comp, ins in self.instrs()
            if comp not in self.caller
            and any(d == dtype and dims for d, dims in _ARRAYS.findall(ins.type))
        ]


def compiled(fn, *args, chip: str) -> Hlo:
    return Hlo(tpu_target.compile_for(fn, *args, chip=chip).as_text())


# --- 1. and 2.: int8 and FP8 products on the MXU -----------------------------

MLP = {"w1": S((256, 512), F32), "w2": S((512, 256), F32)}
X = S((128, 256), F32)


def mlp_loss(p, x):
    h = jax.nn.gelu(x @ p["w1"])
    return jnp.mean((h @ p["w2"]) ** 2)


def chip_grad(chip: str):
    """The MLP's gradient under the chip's choice, every product quantized."""
    policy = jaxamp.eight_bit_policy(
        tpu_target.device(chip), size_rule=None, quantize_last_matmul=True
    )
    return jax.grad(jaxamp.amp(mlp_loss, compute_dtype=BF16, amp_policy=policy))


@pytest.mark.parametrize("chip", ["v5e", "v6e"])
def test_int8_products_are_s8_convolutions_with_fused_rescale(chip):
    h = compiled(chip_grad(chip), MLP, X, chip=chip)
    int8 = [p for p in h.products() if p[0] == ("s8", "s8")]
    # forward (2) and the hidden layer's dgrad (1); wgrad in bf16 (the recipe)
    assert len(int8) == 3
    for _, result, comp, fusion in int8:
        assert result == "s32"
        # the s32 result is rescaled in its fusion: the fusion returns floats
        assert "s32[" not in fusion.type, fusion
        assert any(i.op == "multiply" for i in h.comps[comp].values())
    assert h.buffers("s32") == []  # no s32 buffer between fusions
    # no other product reads 8-bit values converted to a float first
    assert all(p[0] in (("s8", "s8"), ("bf16", "bf16")) for p in h.products())


def test_fp8_products_are_f8_convolutions_on_tpu7x():
    h = compiled(chip_grad("tpu7x"), MLP, X, chip="tpu7x")
    fp8 = [p for p in h.products() if all(d in FP8 for d in p[0])]
    # forward (2), dgrad (1) and wgrad (2), every product of the step; the
    # gradient operand in E5M2
    assert len(fp8) == 5 == len(h.products())
    assert sum("f8e5m2" in p[0] for p in fp8) == 3


# --- 3. the bf16 step ------------------------------------------------------------

SIZE = "tiny"  # gpu_attention's GPT: 2 scanned blocks, d_model 64


def gpt_step(loss):
    return ga.sgd_step(jax.value_and_grad(loss))


def gpt_hlo(loss, chip: str = "v5e") -> Hlo:
    shapes = jax.eval_shape(lambda: ga.init(SIZE))
    # JAX 0.12's jax.nn.dot_product_attention promotes bf16 logits with
    # float32 itself (the hand-written model calls it as it is)
    with jax.numpy_dtype_promotion("standard"):
        return compiled(gpt_step(loss), *shapes, chip=chip)


def _float32_products(h: Hlo) -> collections.Counter:
    return collections.Counter(p[0] for p in h.products() if "f32" in p[0])


def test_bf16_step_has_no_float32_product_the_hand_written_lacks():
    base = ga.make_loss(SIZE, None, hand=False)
    ours = gpt_hlo(jaxamp.amp(base, compute_dtype=BF16))
    hand = gpt_hlo(ga.make_loss(SIZE, "xla", hand=True))
    assert len(ours.products()) >= 12  # the blocks' forward and backward
    extra = _float32_products(ours) - _float32_products(hand)
    assert not extra, extra


def _program(h_text: str) -> list[str]:
    """The optimised HLO without metadata (scope names, source lines)."""
    text = re.sub(r", metadata=\{[^}]*\}", "", h_text)
    return [line for line in text.splitlines() if line.strip()]


@pytest.mark.parametrize("policy", ["int8_policy", "fp8_policy"])
def test_policy_that_quantizes_nothing_is_the_bf16_program(policy):
    # tiny's products (K, N <= 256) are all below torchao's size rules
    base = ga.make_loss(SIZE, None, hand=False)
    shapes = jax.eval_shape(lambda: ga.init(SIZE))
    texts = []
    for p in (jaxamp.default_amp_policy, getattr(jaxamp, policy)()):
        loss = jaxamp.amp(base, compute_dtype=BF16, amp_policy=p)
        texts.append(tpu_target.compile_for(gpt_step(loss), *shapes).as_text())
    assert "s8[" not in texts[1] and "f8e4m3fn[" not in texts[1]
    assert _program(texts[1]) == _program(texts[0])


# --- 4. the chip's choice ----------------------------------------------------------


@pytest.mark.parametrize(
    "chip,fmt", [("v5e", "int8"), ("v6e", "int8"), ("v5p", "int8"), ("tpu7x", "fp8")]
)
def test_chip_choice_from_the_target_device(chip, fmt):
    choice = jaxamp.quant.eight_bit_choice(tpu_target.device(chip))
    assert (choice.format, choice.device_kind) == (
        fmt,
        tpu_target.device(chip).device_kind,
    )


def test_compile_for_traces_for_the_chip():
    # fp8_policy on v5e warns (no FP8 rate there): compile_for names the chip.
    policy = jaxamp.fp8_policy(size_rule=None, quantize_last_matmul=True)
    grad = jax.grad(jaxamp.amp(mlp_loss, compute_dtype=BF16, amp_policy=policy))
    with pytest.warns(UserWarning, match="TPU v5e.*int8 pays there"):
        tpu_target.compile_for(grad, MLP, X, chip="v5e")
