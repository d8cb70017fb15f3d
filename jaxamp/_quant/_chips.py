"""Which 8-bit format pays on which chip: one table, keyed by the device kind
JAX reports (``jax.Device.device_kind``; a compile-only topology's device
reports the same), read by :func:`jaxamp.eight_bit_policy` (the format it
picks, its size rule, the reason it gives) and by the int8 and FP8 rules (a
format asked for on a chip that has no rate for it warns once).

The rates are the chips' published peaks; the step figures are estimates,
libtpu's cost model for the TPUs and ``gpu_roofline.py``'s for the A100
(``benchmarks/RESULTS_TPU.md`` holds the tables and the commands), not
measurements. A chip not in the table gets no warning and no choice
(:func:`chip_of` returns None).
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

from .. import _compat
from .._base._formats import E4M3, INT8
from .._base._scopes import marker

FORMATS = ("int8", "fp8")
_NAMES = {"int8": "int8", "fp8": "FP8"}  # as messages write them
# The matmul scope marker of each format family's products (E5M2 shares
# E4M3's label, so its scope too).
_FAMILY_OF_SCOPE = {INT8.scope: "int8", E4M3.scope: "fp8"}


@dataclasses.dataclass(frozen=True)
class Chip:
    """One row of the table.

    Attributes:
        name: the chip as people call it (``"TPU v5e"``).
        kinds: lower-case ``device_kind`` names or prefixes (a prefix matches
            a kind that continues with a space or a hyphen).
        format: ``"int8"`` or ``"fp8"``: the format that pays there.
        why: the reason, for the docstring, the report and the warnings.
        min_size: the chip's size rule: quantize a product whose contraction
            ``K`` and output width ``N`` both reach it (the smallest
            ``d_model`` of ``benchmarks/tpu_crossover.py``'s MLP stack whose
            8-bit step the cost model prices below the bf16 step's); None: the
            format's own default (torchao's H100 crossover).
        slow: format -> what it costs there (for a format the chip has no
            rate for; asking for it warns once).
    """

    name: str
    kinds: tuple[str, ...]
    format: str
    why: str
    min_size: int | None = None
    slow: dict = dataclasses.field(default_factory=dict)

    @property
    def scope(self) -> str:
        """The marker around the products :func:`jaxamp.eight_bit_policy`
        quantizes for this chip (read by ``quantization_report``)."""
        return "jaxamp_8bit_for_" + self.name.lower().replace(" ", "_")

    def matches(self, kind: str) -> bool:
        return any(
            kind == k or kind.startswith(k + " ") or kind.startswith(k + "-")
            for k in self.kinds
        )


_TPU_EST = "estimated by libtpu's cost model, not measured"
# First match wins: "tpu v5 lite" (v5e) before "tpu v5" (v5p).
CHIPS = (
    Chip(
        "TPU v5e",
        ("tpu v5 lite", "tpu v5e", "tpu v5litepod"),
        "int8",
        "TPU v5e's MXU runs s8 x s8 -> s32 at twice its bf16 rate (394 vs 197 "
        "TOP/s) and has no FP8 rate",
        2048,  # d_model 1024: 1.21x the bf16 step's cycles; 2048: 0.90x
        {
            "fp8": "1.027x the bf16 step's cycles for gpt4096 (e4m3 products at "
            f"0.96x bf16's rate; {_TPU_EST}), int8 0.878x"
        },
    ),
    Chip(
        "TPU v6e",
        ("tpu v6 lite", "tpu v6e"),
        "int8",
        "TPU v6e runs s8 x s8 -> s32 at twice its bf16 rate (1836 vs 918 "
        "TOP/s) and publishes no FP8 rate (libtpu prices e4m3 products at "
        "0.80x bf16's)",
        4096,  # the gpt4096 step pays (0.95x); 2048 not priced here
    ),
    Chip(
        "TPU v5p",
        ("tpu v5p", "tpu v5"),
        "int8",
        "TPU v5p runs s8 x s8 -> s32 at twice its bf16 rate (918 vs 459 "
        "TOP/s) and has no FP8 rate",
        2048,  # v5e's (not priced here): its HBM per FLOP is higher
    ),
    Chip(
        "TPU7x",
        ("tpu7x", "tpu v7x", "tpu7"),
        "fp8",
        "TPU7x runs FP8 at twice its bf16 rate (4614 vs 2307 TFLOP/s per chip) "
        "and s8 at bf16's (libtpu's cost model)",
        2048,  # d_model 1024: 1.06x the bf16 step's cycles; 2048: 0.81x
        {
            "int8": "1.031x the bf16 step's cycles for gpt4096 (s8 products at "
            f"bf16's rate; {_TPU_EST}), FP8 0.718x"
        },
    ),
    Chip(
        "H100",
        ("nvidia h100", "nvidia h200", "nvidia gh200", "nvidia h800"),
        "fp8",
        "Hopper's FP8 tensor cores run at twice its bf16 rate (1979 vs 989 "
        "TFLOP/s) and XLA fuses FP8 scaling into cuBLASLt's GEMM",
    ),
    Chip(
        "B200",
        ("nvidia b200", "nvidia gb200", "nvidia b100"),
        "fp8",
        "the B200 runs FP8 at twice its bf16 rate (4500 vs 2250 TFLOP/s)",
    ),
    Chip(
        "A100",
        ("nvidia a100", "nvidia a800"),
        "int8",
        "the A100 runs s8 x s8 -> s32 at twice its bf16 rate (624 vs 312 "
        "TOP/s) and has no FP8 tensor cores",
        None,
        {
            "fp8": "1.07x the bf16 step's time for gpt4096 (XLA upcasts every FP8 "
            "operand to bf16; estimated by gpu_roofline.py, not measured), int8 "
            "0.78x"
        },
    ),
    Chip(
        "CPU",
        ("cpu",),
        "int8",
        "XLA:CPU runs s8 x s8 -> s32 dots natively and emulates FP8 products",
    ),
)

for _chip in CHIPS:
    marker(_chip.scope)
SCOPES = {c.scope: c for c in CHIPS}


def chip_of(device_kind: str | None) -> Chip | None:
    """The table's row for ``device_kind`` (any case), or None."""
    if not device_kind:
        return None
    kind = " ".join(str(device_kind).lower().split())
    return next((c for c in CHIPS if c.matches(kind)), None)


def warn_unpaid(scope: str, warned: set) -> None:
    """Warn, once per ``warned`` set and chip, when the 8-bit format whose
    matmul marker is ``scope`` has no rate on the chip jaxamp traces for."""
    family = _FAMILY_OF_SCOPE.get(scope)
    if family is None:
        return
    kind = _compat.target_device_kind()
    chip = chip_of(kind)
    if chip is None or family not in chip.slow or kind in warned:
        return
    warned.add(kind)
    name, pays = _NAMES[family], _NAMES[chip.format]
    warnings.warn(
        f"jaxamp: {name} matmuls on {chip.name} (device kind {kind!r}), which "
        f"has no {name} rate: {chip.slow[family]}. {pays} pays there: "
        f"{chip.why}; jaxamp.eight_bit_policy() picks it for the device.",
        UserWarning,
        stacklevel=2,
    )


def device_kind_of(device: Any) -> str:
    """``device``'s kind: a ``jax.Device`` (or anything with a
    ``device_kind``), a device-kind string, or None for the device jaxamp
    traces for (:func:`jaxamp._compat.target_device_kind`)."""
    if device is None:
        kind = _compat.target_device_kind()
        if kind is None:
            raise ValueError(
                "jaxamp.eight_bit_policy(device=None): jaxamp traces for a target "
                "backend with no device; pass device= (the target's jax.Device or "
                "its device_kind, e.g. 'TPU v5 lite')."
            )
        return kind
    if isinstance(device, str):
        return device
    kind = getattr(device, "device_kind", None)
    if not isinstance(kind, str):
        raise TypeError(
            "jaxamp.eight_bit_policy(device=...): a jax.Device, a device_kind "
            f"string or None, got {type(device).__name__}."
        )
    return kind
