"""Where 8-bit matmuls start to pay on a TPU, by libtpu's cost model: one
linear layer's training step (forward, input gradient, weight gradient;
bfloat16 activations, float32 master weight) compiled for a TPU chip in the
compute dtype and in 8 bits, over a grid of ``(K, N)`` at ``M`` tokens.

Prints, per chip, the 8-bit step's estimated cycles over the bf16 step's
for each ``(K, N)``: the size rules of ``jaxamp/_quant/_chips.py`` are read
off these tables (``benchmarks/RESULTS_TPU.md``). Estimated by libtpu's cost
model (``tpu_target.estimated_cycles``), not measured. Needs libtpu
(``tpu_target.available()``)::

    JAX_PLATFORMS=cpu python benchmarks/tpu_crossover.py --chip v5e,v6e,v5p,tpu7x
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import tpu_target

import jaxamp

BF16, F32 = jnp.bfloat16, jnp.float32
SIZES = (512, 1024, 2048, 4096, 8192)


def layer_step(policy):
    """``(x, w) -> (dx, dw)`` of ``sum(amp(x @ w) ** 2)`` under ``policy``."""

    def loss(x, w):
        return jnp.sum(jnp.square((x @ w).astype(F32)))

    return jax.grad(jaxamp.amp(loss, compute_dtype=BF16, amp_policy=policy), (0, 1))


def policies(fmt: str) -> dict:
    """The bf16 step and the 8-bit one (every product quantized)."""
    every = dict(size_rule=None, quantize_last_matmul=True)
    eight = {"int8": jaxamp.int8_policy, "fp8": jaxamp.fp8_policy}[fmt](**every)
    return {"bf16": jaxamp.default_amp_policy, fmt: eight}


def ratio(chip: str, fmt: str, m: int, k: int, n: int) -> float:
    """The 8-bit step's estimated cycles over the bf16 step's."""
    x, w = jax.ShapeDtypeStruct((m, k), BF16), jax.ShapeDtypeStruct((k, n), F32)
    cycles = {
        name: tpu_target.estimated_cycles(
            tpu_target.compile_for(layer_step(p), x, w, chip=chip)
        )
        for name, p in policies(fmt).items()
    }
    return cycles[fmt] / cycles["bf16"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chip", default="v5e", help="comma-separated: v5e,v6e,v5p,tpu7x")
    ap.add_argument("--format", default="", help="int8 or fp8 (default: the chip's)")
    ap.add_argument("--m", type=int, default=4096, help="tokens (rows of x)")
    ap.add_argument(
        "--sizes",
        default=",".join(map(str, SIZES)),
        help="K and N of the grid, comma-separated",
    )
    ap.add_argument(
        "--points",
        default="",
        help="K:N pairs instead of the grid, e.g. 4096:16384,16384:4096",
    )
    a = ap.parse_args(argv)
    reason = tpu_target.available()
    if reason:
        print(reason, file=sys.stderr)
        return 1
    sizes = [int(s) for s in a.sizes.split(",")]
    points = [tuple(map(int, p.split(":"))) for p in a.points.split(",") if p]
    for chip in a.chip.split(","):
        kind = tpu_target.device(chip).device_kind
        fmt = a.format or jaxamp.quant.eight_bit_choice(kind).format
        print(
            f"\n{chip} ({kind}): {fmt} step / bf16 step, estimated cycles "
            f"(libtpu's cost model, not measured), M = {a.m}"
        )
        if points:
            print("| K | N | ratio |\n|---|---|---|")
            for k, n in points:
                print(f"| {k} | {n} | {ratio(chip, fmt, a.m, k, n):.3f} |", flush=True)
            continue
        print("| K \\ N | " + " | ".join(map(str, sizes)) + " |")
        print("|---" * (len(sizes) + 1) + "|")
        for k in sizes:
            cells = [f"{ratio(chip, fmt, a.m, k, n):.3f}" for n in sizes]
            print(f"| {k} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
