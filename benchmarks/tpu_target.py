"""Compile for a TPU on a machine without one (deviceless ahead-of-time
compilation), to read what libtpu's compiler decides: the optimised HLO (which
MXU products a policy reaches, what each fusion holds) and libtpu's own cost
model (every scheduled instruction's ``"estimated_cycles"``).

Needs libtpu, no TPU: ``pip install "jax[tpu]"`` on Python 3.12 (JAX 0.12
with libtpu 0.0.50 here; about 1.3 GB). Run the process with
``JAX_PLATFORMS=cpu``: the TPU serves only as a compile-only topology
(``jax.experimental.topologies.get_topology_desc("v5e=1x1", platform="tpu")``)
and jaxamp traces for it (``jaxamp._compat.target_backend("tpu", device)``:
the device kind decides :func:`jaxamp.eight_bit_policy`'s format and the
warnings about a format the chip has no rate for). Not measured: run time.
Every figure read here is an estimate by libtpu's cost model, not a
measurement; ``../shared/tools/tpu_roofline.py`` sums it over whole training
steps (loops times their trip counts).

This module is the TPU half of the compile targets; ``gpu_target.py`` is the
NVIDIA half (another JAX plugin, another venv). They share nothing but the
``jax.jit(...).lower(...).compile()`` call: what a chip is to jaxamp (its
device kind, its 8-bit format, its size rule) lives in one table,
``jaxamp/_quant/_chips.py``.

    from tpu_target import available, compile_for, estimated_cycles
    compiled = compile_for(step, params, batch, chip="v5e", donate_argnums=(0,))
    compiled.as_text(), estimated_cycles(compiled)
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax

from jaxamp import _compat

# libtpu takes a lock file (/tmp/libtpu_lockfile) for the TPU it drives; a
# compile-only topology drives none, so several processes (pytest-xdist
# workers, a benchmark beside the tests) may load it at once. Read by libtpu
# when it loads, before the first topology is made.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

# chip -> topology of one device: a v5e or v6e chip (one TensorCore), a v5p
# chip (its two TensorCores as one megacore device), one of TPU7x's two
# TensorCores (the topology's device: half a chip).
CHIPS = {
    "v5e": "v5e=1x1",
    "v6e": "v6e=1x1",
    "v5p": "v5p=1x1x1",
    "tpu7x": "tpu7x=1x1x1",
}
TARGETS = tuple(CHIPS)

_CYCLES = re.compile(r'"estimated_cycles":"(\d+)"')
_ENTRY = re.compile(r"^ENTRY .*?\{$(.*?)^\}$", re.S | re.M)
_CONTROL = re.compile(r" (while|call|conditional)\(")


def available() -> str | None:
    """None when the TPU targets can be compiled for, else the reason they
    cannot (the install line)."""
    if importlib.util.find_spec("libtpu") is None:
        return (
            'the TPU targets need libtpu: pip install "jax[tpu]" on Python '
            f"3.12 (no TPU needed; this is Python with jax {jax.__version__})"
        )
    return None


@functools.cache
def device(chip: str) -> Any:
    """The compile-only device of ``chip`` (a key of :data:`CHIPS`): its
    ``device_kind`` is what a TPU of that kind reports (``"TPU v5 lite"``,
    ``"TPU v6 lite"``, ``"TPU v5"``, ``"TPU7x"``).

    Raises:
        ValueError: for another ``chip``.
        RuntimeError: without libtpu (names the install line).
    """
    if chip not in CHIPS:
        raise ValueError(f"tpu_target: chip={chip!r}; one of {TARGETS}.")
    if available() is not None:
        raise RuntimeError(available())
    from jax.experimental import topologies

    return topologies.get_topology_desc(CHIPS[chip], platform="tpu").devices[0]


def compile_for(
    fn: Callable,
    *args: Any,
    chip: str = "v5e",
    donate_argnums: Sequence[int] = (),
) -> Any:
    """``jax.jit(fn, donate_argnums=...)`` lowered and compiled for ``chip``.

    Args:
        fn: the function to compile.
        *args: pytrees of ``jax.ShapeDtypeStruct`` (or arrays): the argument
            shapes and dtypes, placed on the chip's compile-only device.
        chip: ``"v5e"``, ``"v6e"``, ``"v5p"`` or ``"tpu7x"``.
        donate_argnums: the arguments whose buffers the program may reuse.

    Returns:
        The compiled executable (``as_text()``, ``memory_analysis()``).

    Raises:
        ValueError: for another ``chip``.
        RuntimeError: without libtpu (names the install line).
    """
    dev = device(chip)
    sharding = jax.sharding.SingleDeviceSharding(dev)
    shapes = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), args
    )
    jitted = jax.jit(fn, donate_argnums=tuple(donate_argnums))
    # jaxamp's backend- and chip-dependent choices are the target's.
    with _compat.target_backend("tpu", dev):
        return jitted.lower(*shapes).compile()


def estimated_cycles(compiled: Any) -> int:
    """libtpu's estimate of a straight-line program's cycles: the sum of the
    ``"estimated_cycles"`` of the entry computation's instructions (libtpu
    estimates each instruction it schedules: a fusion as a whole; DMAs it
    overlaps carry none).

    Args:
        compiled: a program compiled by :func:`compile_for`, or its
            optimised HLO text.

    Returns:
        Cycles of one TensorCore at the chip's clock (an estimate, not a
        measurement).

    Raises:
        ValueError: for a program with a loop, call or conditional at its
            top level (their bodies' cycles need trip counts:
            ``../shared/tools/tpu_roofline.py`` sums those).
    """
    text = compiled if isinstance(compiled, str) else compiled.as_text()
    entry = _ENTRY.search(text)
    if entry is None:
        raise ValueError("estimated_cycles: no ENTRY computation in the HLO text.")
    if _CONTROL.search(entry.group(1)):
        raise ValueError(
            "estimated_cycles: the program has a while loop, call or conditional; "
            "only straight-line programs are summed here (tpu_roofline.py "
            "weighs loop bodies by their trip counts)."
        )
    return sum(int(c) for c in _CYCLES.findall(entry.group(1)))
