"""The 8-bit format for the chip (``jaxamp/_quant/_choice.py``, the table in
``_chips.py``): which format ``eight_bit_policy`` picks per device kind, the
size rule and the reason it carries into ``quantization_report``, and the
once-only warning for a format the chip has no rate for. Device kinds are
the strings JAX reports (a real device, or a compile-only topology's: the
TPU targets' are checked in ``tests/test_tpu_target.py``); tracing for a
chip is ``jaxamp._compat.target_backend(backend, device_kind)``."""

from __future__ import annotations

import collections
import types
import warnings

import jax
import jax.numpy as jnp
import pytest

import jaxamp
from jaxamp import _compat

S = jax.ShapeDtypeStruct
BF16, F32 = jnp.bfloat16, jnp.float32

# device_kind -> (the table's chip, the format that pays there)
KINDS = {
    "TPU v5 lite": ("TPU v5e", "int8"),
    "TPU v6 lite": ("TPU v6e", "int8"),
    "TPU v5": ("TPU v5p", "int8"),
    "TPU7x": ("TPU7x", "fp8"),
    "NVIDIA H100 80GB HBM3": ("H100", "fp8"),
    "NVIDIA H100 PCIe": ("H100", "fp8"),
    "NVIDIA H200": ("H100", "fp8"),
    "NVIDIA B200": ("B200", "fp8"),
    "NVIDIA A100-SXM4-80GB": ("A100", "int8"),
    "NVIDIA A100-PCIE-40GB": ("A100", "int8"),
    "cpu": ("CPU", "int8"),
}


@pytest.mark.parametrize("kind", list(KINDS))
def test_choice_per_device_kind(kind):
    chip, fmt = KINDS[kind]
    for device in (kind, types.SimpleNamespace(device_kind=kind)):
        choice = jaxamp.quant.eight_bit_choice(device)
        assert (choice.chip, choice.format, choice.device_kind) == (chip, fmt, kind)
        assert choice.why and callable(choice.size_rule)


def test_choice_of_this_process_device():
    # conftest runs the suite on the CPU backend
    assert jaxamp.quant.eight_bit_choice().chip == "CPU"
    with _compat.target_backend("tpu", "TPU7x"):  # the target's, when tracing for one
        assert jaxamp.quant.eight_bit_choice().format == "fp8"


def test_choice_errors():
    with pytest.raises(ValueError, match="int8_policy.*fp8_policy"):
        jaxamp.eight_bit_policy("TPU v4")
    with pytest.raises(TypeError, match="device="):
        jaxamp.eight_bit_policy(3)
    with pytest.raises(ValueError, match="pass device="):
        with _compat.target_backend("tpu"):  # a target without a device
            jaxamp.eight_bit_policy()
    with pytest.raises(ValueError, match="size_rule='H100'"):
        jaxamp.eight_bit_policy("cpu", size_rule="H100")
    with pytest.raises(TypeError, match="scopes"):
        jaxamp.eight_bit_policy("cpu", scopes="mlp")


@pytest.mark.parametrize(
    "kind,small,large",
    [
        # TPUs: libtpu's crossover; the GPUs: torchao's H100 rules
        ("TPU v5 lite", (4096, 1024, 8192), (4096, 2048, 8192)),
        ("TPU v6 lite", (4096, 2048, 8192), (4096, 4096, 4096)),
        ("TPU7x", (4096, 1024, 4096), (4096, 2048, 8192)),
        ("NVIDIA H100 80GB HBM3", (4096, 4096, 1024), (4096, 4096, 4096)),
        ("NVIDIA A100-SXM4-80GB", (4096, 1024, 8192), (4096, 4096, 4096)),
    ],
)
def test_size_rule_per_chip(kind, small, large):
    rule = jaxamp.quant.eight_bit_choice(kind).size_rule
    assert not rule(*small) and rule(*large)


# --- the policy, traced for a chip --------------------------------------------

MLP = {"w1": S((256, 512), F32), "w2": S((512, 256), F32)}
X = S((128, 256), F32)


def mlp_loss(p, x):
    h = jax.nn.gelu(x @ p["w1"])
    return jnp.mean((h @ p["w2"]) ** 2)


def report(policy, kind):
    loss = jaxamp.amp(mlp_loss, compute_dtype=BF16, amp_policy=policy)
    with _compat.target_backend("tpu", kind):
        return jaxamp.quantization_report(jax.grad(loss), MLP, X)


@pytest.mark.parametrize("kind", ["TPU v5 lite", "TPU7x", "NVIDIA A100-SXM4-80GB"])
def test_policy_runs_the_chips_format_and_says_why(kind):
    chip, fmt = KINDS[kind]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the chip's choice never warns
        rows = report(jaxamp.eight_bit_policy(kind, size_rule=None), kind)
    eight = [r for r in rows if r.format != "bfloat16"]
    # layer 1's forward and dgrad (int8; FP8 also its wgrad); layer 2 feeds
    # the loss: its three products stay bf16
    assert {r.format for r in eight} == {fmt}
    assert len(eight) == (2 if fmt == "int8" else 3)
    assert {r.reason for r in eight} == {
        f"{fmt} pays on {chip}: {jaxamp.quant.eight_bit_choice(kind).why}"
    }
    kept = collections.Counter(r.reason for r in rows if r.format == "bfloat16")
    assert kept["feeds the loss: kept in the compute dtype"] == 3
    assert kept["kept in the compute dtype by the recipe"] == (fmt == "int8")


def test_policy_applies_the_chips_size_rule():
    # (128, 256, 512) is below every chip's rule: nothing quantized
    rows = report(jaxamp.eight_bit_policy("TPU v5 lite"), "TPU v5 lite")
    assert {r.format for r in rows} == {"bfloat16"}
    assert "below the size rule" in {r.reason for r in rows}


def test_explicit_8bit_policies_keep_an_empty_reason():
    rows = report(jaxamp.int8_policy(size_rule=None), "TPU v5 lite")
    assert {r.reason for r in rows if r.format == "int8"} == {""}


# --- a format the chip has no rate for warns once -------------------------------


@pytest.mark.parametrize(
    "make,kind,match",
    [
        (jaxamp.fp8_policy, "TPU v5 lite", r"FP8 matmuls on TPU v5e.*1\.027x.*int8"),
        (jaxamp.int8_policy, "TPU7x", r"int8 matmuls on TPU7x.*1\.031x.*FP8 pays"),
        (jaxamp.fp8_policy, "NVIDIA A100-SXM4-80GB", r"FP8 matmuls on A100.*1\.07x"),
    ],
)
def test_unpaid_format_warns_once(make, kind, match):
    policy = make(size_rule=None)
    with pytest.warns(UserWarning, match=match) as caught:
        report(policy, kind)
        report(policy, kind)  # the same policy, traced again: no second warning
    assert len(caught) == 1
    with pytest.warns(UserWarning, match=match):  # another policy warns again
        report(make(size_rule=None), kind)


@pytest.mark.parametrize(
    "make,kind",
    [
        (jaxamp.int8_policy, "TPU v5 lite"),
        (jaxamp.fp8_policy, "TPU7x"),
        (jaxamp.fp8_policy, "NVIDIA H100 80GB HBM3"),
        (jaxamp.int8_policy, "NVIDIA A100-SXM4-80GB"),
        (jaxamp.fp8_policy, "cpu"),
        (jaxamp.fp8_policy, "TPU v4"),  # a chip jaxamp has no row for
    ],
)
def test_paid_or_unknown_format_does_not_warn(make, kind):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        report(make(size_rule=None), kind)


def test_no_warning_where_nothing_is_quantized():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        report(jaxamp.fp8_policy(), "TPU v5 lite")  # below torchao's rule
