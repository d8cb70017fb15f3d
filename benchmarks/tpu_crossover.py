"""Where 8-bit matmuls start to pay on a TPU, by libtpu's cost model: the
training step of a stack of MLP blocks (``x + gelu(x @ w_up) @ w_down``,
``d_model -> 4 d_model -> d_model``, scanned over two layers under
``jax.checkpoint`` as ``benchmarks/gpu_attention.py``'s GPT is; float32 master
weights, bfloat16 compute) compiled for a TPU chip in bf16 and in the chip's
8-bit format, every product quantized but the head's, at a range of
``d_model``.

The 8-bit step pays where its estimated cycles fall below the bf16 step's:
the size rules of ``jaxamp/_quant/_chips.py`` quantize a product whose
contraction and output width both reach the smallest such ``d_model``
(``benchmarks/RESULTS_TPU.md``). The scan is unrolled (a straight-line
program, as ``tpu_target.estimated_cycles`` sums); jaxamp still quantizes each
stacked weight once before it. Estimated by libtpu's cost model, not
measured. Needs libtpu (``tpu_target.available()``)::

    JAX_PLATFORMS=cpu python benchmarks/tpu_crossover.py --chip v5e,v6e,tpu7x
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import tpu_target

import jaxamp

BF16, F32 = jnp.bfloat16, jnp.float32
LAYERS, HEAD = 2, 256


def loss(p, x):
    """The MLP stack's loss: scanned checkpointed blocks, a small head."""

    @jax.checkpoint
    def block(h, w):
        up, down = w
        return h + jax.nn.gelu(h @ up) @ down, None

    h, _ = jax.lax.scan(block, x, (p["up"], p["down"]), unroll=True)
    return jnp.mean(jnp.square(h @ p["head"]))


def shapes(m: int, d: int) -> tuple:
    s = jax.ShapeDtypeStruct
    p = {
        "up": s((LAYERS, d, 4 * d), F32),
        "down": s((LAYERS, 4 * d, d), F32),
        "head": s((d, HEAD), F32),
    }
    return p, s((m, d), F32)


def step_cycles(chip: str, policy, m: int, d: int) -> int:
    """libtpu's estimated cycles of one SGD step of the stack under ``policy``."""
    grad = jax.grad(jaxamp.amp(loss, compute_dtype=BF16, amp_policy=policy))

    def step(p, x):
        return jax.tree.map(lambda a, g: a - 1e-3 * g, p, grad(p, x))

    compiled = tpu_target.compile_for(
        step, *shapes(m, d), chip=chip, donate_argnums=(0,)
    )
    return tpu_target.estimated_cycles(compiled)


def eight_bit(fmt: str):
    make = {"int8": jaxamp.int8_policy, "fp8": jaxamp.fp8_policy}[fmt]
    return make(size_rule=None)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chip", default="v5e", help="comma-separated: v5e,v6e,v5p,tpu7x")
    ap.add_argument("--format", default="", help="int8 or fp8 (default: the chip's)")
    ap.add_argument("--m", type=int, default=4096, help="tokens a step")
    ap.add_argument("--d", default="1024,2048,4096", help="d_model values")
    a = ap.parse_args(argv)
    reason = tpu_target.available()
    if reason:
        print(reason, file=sys.stderr)
        return 1
    for chip in a.chip.split(","):
        kind = tpu_target.device(chip).device_kind
        fmt = a.format or jaxamp.quant.eight_bit_choice(kind).format
        print(
            f"\n{chip} ({kind}), {a.m} tokens, {LAYERS} scanned MLP blocks: estimated "
            "cycles per step (libtpu's cost model, not measured)\n\n"
            f"| d_model | products (K, N) | bf16 M cycles | {fmt} M cycles | "
            f"{fmt} / bf16 |\n|---|---|---|---|---|",
            flush=True,
        )
        for d in map(int, a.d.split(",")):
            bf16 = step_cycles(chip, jaxamp.default_amp_policy, a.m, d)
            low = step_cycles(chip, eight_bit(fmt), a.m, d)
            print(
                f"| {d} | ({d}, {4 * d}), ({4 * d}, {d}) | {bf16 / 1e6:.2f} | "
                f"{low / 1e6:.2f} | {low / bf16:.3f} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
