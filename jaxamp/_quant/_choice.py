"""The 8-bit format that pays on the device: :func:`eight_bit_policy` reads
the device kind, picks int8 or FP8 from the chip table
(``_quant/_chips.py``) with the chip's size rule, and marks the products it
quantizes so that :func:`jaxamp.quantization_report` says what it picked and
why."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

import jax

from .._policy._kinds import ImplementationRule
from ._chips import CHIPS, chip_of, device_kind_of
from ._common import (
    SizeRule,
    check_size_rule,
    min_matmul_size,
    scoped_policy,
    torchao_rowwise_size_rule,
    torchao_tensorwise_size_rule,
)
from ._fp8 import fp8_rule
from ._int8 import int8_rule


class EightBitChoice(NamedTuple):
    """What :func:`eight_bit_policy` picks for a device.

    Attributes:
        chip: the chip's name in jaxamp's table (``"TPU v5e"``, ``"H100"``).
        device_kind: the device kind it was read from (``"TPU v5 lite"``).
        format: ``"int8"`` or ``"fp8"``.
        why: the reason (the chip's rates).
        size_rule: the chip's ``(m, k, n) -> bool``: which products pay in
            8 bits there.
    """

    chip: str
    device_kind: str
    format: str
    why: str
    size_rule: SizeRule


_DEFAULT_SIZE_RULES = {
    "int8": torchao_rowwise_size_rule,
    "fp8": torchao_tensorwise_size_rule,
}


def eight_bit_choice(device: Any = None) -> EightBitChoice:
    """The 8-bit format that pays on ``device``, and why.

    Args:
        device: a ``jax.Device`` (a real one, or a compile-only topology's:
            ``jax.experimental.topologies.get_topology_desc("v5e=1x1",
            platform="tpu").devices[0]``), its ``device_kind`` string
            (``"TPU v5 lite"``, ``"NVIDIA A100-SXM4-80GB"``), or None: the
            device jaxamp traces for (JAX's first device, or the target of
            ``jaxamp._compat.target_backend``).

    Returns:
        An :class:`EightBitChoice`: int8 on TPU v5e, v6e, v5p, the A100 and
        the CPU; FP8 on TPU7x, the H100 / H200 and the B200.

    Raises:
        ValueError: for a device kind not in jaxamp's table (it names the
            known chips: pick a format with :func:`jaxamp.int8_policy` or
            :func:`jaxamp.fp8_policy`).
        TypeError: for a ``device`` that is none of the above.
    """
    kind = device_kind_of(device)
    chip = chip_of(kind)
    if chip is None:
        raise ValueError(
            f"jaxamp.eight_bit_policy: no 8-bit choice for device kind {kind!r}; "
            f"jaxamp knows {', '.join(c.name for c in CHIPS)}. Pick the format "
            "yourself: jaxamp.int8_policy() or jaxamp.fp8_policy()."
        )
    if chip.min_size is None:  # the format's own default (torchao's H100 crossover)
        rule = _DEFAULT_SIZE_RULES[chip.format]
    else:
        rule = min_matmul_size(k=chip.min_size, n=chip.min_size)
    return EightBitChoice(chip.name, kind, chip.format, chip.why, rule)


def eight_bit_policy(
    device: Any = None,
    scopes: Iterable[str] | None = None,
    exclude_scopes: Iterable[str] = (),
    *,
    size_rule: Any = "chip",
    quantize_last_matmul: bool = False,
    base: Mapping[Any, Any] | None = None,
) -> dict[Any, Any]:
    """An amp policy with 8-bit matmuls in the format that pays on ``device``.

    int8 on TPU v5e, v6e and v5p (their MXUs run s8 at twice the bf16 rate
    and have no FP8 rate) and on the A100 (int8 tensor cores, no FP8 ones);
    FP8 on TPU7x (FP8 at twice bf16's rate, s8 at bf16's), the H100 / H200
    and the B200. Each chip's products are chosen by its own size rule: for
    the TPUs the crossover of libtpu's cost model
    (``benchmarks/tpu_crossover.py``), for the GPUs torchao's H100 rules.
    The int8 policy is :func:`jaxamp.int8_policy`'s recipe, the FP8 one
    :func:`jaxamp.fp8_policy`'s; the quantized products run inside a marker
    (``jaxamp_8bit_for_<chip>``), so :func:`jaxamp.quantization_report`
    gives the chip and the reason for each. Asking for the other format on
    such a chip (``fp8_policy`` on v5e or an A100, ``int8_policy`` on
    TPU7x) warns once, naming the slowdown
    (``benchmarks/RESULTS_TPU.md``). Example::

        policy = jaxamp.eight_bit_policy()           # this process's device
        topo = jax.experimental.topologies.get_topology_desc(
            "tpu7x=1x1x1", platform="tpu")
        policy = jaxamp.eight_bit_policy(topo.devices[0])   # compile-only: FP8
        loss8 = jaxamp.amp(loss, compute_dtype=jnp.bfloat16, amp_policy=policy)

    Args:
        device: the device to pick for (see :func:`eight_bit_choice`): a
            ``jax.Device``, a device-kind string, or None for JAX's first
            device (decided when the policy is built).
        scopes: scope names whose matmuls are quantized; None for all.
        exclude_scopes: scope names whose matmuls keep the ``base`` rule.
        size_rule: ``"chip"`` (the chip's), a function ``(m, k, n) -> bool``,
            or None (every matmul).
        quantize_last_matmul: quantize a product that feeds the loss too
            (default False: it runs in the compute dtype).
        base: the policy for everything else; default
            ``jaxamp.default_amp_policy``.

    Returns:
        A policy dict for ``jaxamp.amp(..., amp_policy=...)`` (use a bfloat16
        compute dtype).

    Raises:
        ValueError: for a device kind jaxamp has no choice for (use
            :func:`jaxamp.int8_policy` or :func:`jaxamp.fp8_policy`).
        TypeError: for a bad ``device``, ``size_rule``, or a single string as
            ``scopes`` / ``exclude_scopes``.
    """
    choice = eight_bit_choice(device)
    if isinstance(size_rule, str):
        if size_rule != "chip":
            raise ValueError(
                f"eight_bit_policy(size_rule={size_rule!r}): 'chip' (the chip's "
                "rule), a function (m, k, n) -> bool, or None (every matmul)."
            )
        size_rule = choice.size_rule
    rule_of_size = check_size_rule(size_rule, "eight_bit_policy")
    last = bool(quantize_last_matmul)
    if choice.format == "int8":
        inner = int8_rule(size_rule=rule_of_size, quantize_last_matmul=last)
    else:
        inner = fp8_rule(size_rule=rule_of_size, quantize_last_matmul=last)
    scope = chip_of(choice.device_kind).scope

    def rule(ctx, lhs, rhs, **params):
        with jax.named_scope(scope):
            return inner.decide(ctx, lhs, rhs, **params)

    rule.__name__ = f"eight_bit_rule({choice.chip}: {choice.format})"
    rule = ImplementationRule.with_context(rule)
    return scoped_policy("eight_bit_policy", rule, scopes, exclude_scopes, base)
