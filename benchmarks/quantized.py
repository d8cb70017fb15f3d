"""8-bit matmuls side by side: kernels and a GPT training step, in one run.

    python benchmarks/quantized.py                  # CPU defaults (~10 min)
    python benchmarks/quantized.py --quick          # fewer shapes and repeats

(a) Each linear-layer matmul of the GPT (qkv, attention output, MLP up and
down) at d_model 512 and 2048 as float32, bf16 -> f32, bf16 -> bf16,
int8 -> int32 and float8 (E4M3 -> f32), in the canonical layout
``(M, K) x (K, N)``, the weight-gradient layout (contraction over dim 0 of both
operands, what JAX's transpose rule emits for ``x^T g``) and that layout with
the transpose written out first (what ``jaxamp``'s int8 wgrad emits). Times in
ms, best of N; ratio = float32 time / this time.

(b) A training step (``jit(value_and_grad)``) of ``benchmarks/run.py``'s GPT in
float32, bf16 (default policy), int8 (``int8_policy``) and FP8
(``fp8_policy``): step-time ratio vs float32, saved residual bytes, gradient
relative L2 error vs float32. The model is small, so the 8-bit policies run
with ``size_rule=None`` (their default size rules would skip every matmul).

Other processes may share the CPU: every figure is the best of N, and all
are measured in the same run; compare ratios, not absolute times.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent))

import run as gpt_bench  # noqa: E402

import jaxamp  # noqa: E402

F32, BF16, I8, I32 = jnp.float32, jnp.bfloat16, jnp.int8, jnp.int32
E4M3 = jnp.float8_e4m3fn
FORMATS = {  # name: (operand dtype, result dtype)
    "fp32": (F32, F32),
    "bf16->f32": (BF16, F32),
    "bf16->bf16": (BF16, BF16),
    "int8->int32": (I8, I32),
    "fp8->f32": (E4M3, F32),
}


def best_ms(fn, args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))  # compile
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return 1e3 * min(times)


def _operands(m, k, n, dtype, layout):
    key1, key2 = jax.random.split(jax.random.key(0))
    a = (jax.random.normal(key1, (m, k)) * 4).astype(dtype)
    if layout == "canonical":
        return a, (jax.random.normal(key2, (k, n)) * 4).astype(dtype)
    return a, (jax.random.normal(key2, (m, n)) * 4).astype(dtype)


def _kernel(layout, out):
    if layout == "canonical":
        dn = (((1,), (0,)), ((), ()))
        return jax.jit(
            lambda a, b: jax.lax.dot_general(a, b, dn, preferred_element_type=out)
        )
    if layout == "wgrad":  # x^T g as JAX's transpose rule emits it
        dn = (((0,), (0,)), ((), ()))
        return jax.jit(
            lambda a, b: jax.lax.dot_general(a, b, dn, preferred_element_type=out)
        )
    dn = (((1,), (0,)), ((), ()))  # wgrad_T: transpose first
    return jax.jit(
        lambda a, b: jax.lax.dot_general(a.T, b, dn, preferred_element_type=out)
    )


def kernels(widths, tokens, repeats):
    rows = []
    for d in widths:
        m = tokens[d]
        for name, (k, n) in {
            "qkv": (d, 3 * d),
            "attn_out": (d, d),
            "up": (d, 4 * d),
            "down": (4 * d, d),
        }.items():
            for layout in ("canonical", "wgrad", "wgrad_T"):
                ms = {}
                for fmt, (dt, out) in FORMATS.items():
                    args = _operands(m, k, n, dt, layout)
                    ms[fmt] = best_ms(_kernel(layout, out), args, repeats)
                rows.append(
                    {
                        "d_model": d,
                        "matmul": name,
                        "M": m,
                        "K": k,
                        "N": n,
                        "layout": layout,
                        "ms": ms,
                    }
                )
                print(_kernel_row(rows[-1]), flush=True)
    return rows


def _kernel_row(r):
    cells = " | ".join(
        f"{v:.2f} ({r['ms']['fp32'] / v:.1f}x)" for v in r["ms"].values()
    )
    return (
        f"| {r['d_model']} | {r['matmul']} | {r['M']}x{r['K']}x{r['N']} "
        f"| {r['layout']} | {cells} |"
    )


def _rel(g, ref):
    num = sum(
        float(jnp.sum(jnp.square(a - b)))
        for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(ref))
    )
    den = sum(float(jnp.sum(jnp.square(b))) for b in jax.tree.leaves(ref))
    return (num / den) ** 0.5


def training_step(size, repeats):
    params, x, y = gpt_bench.init(size)
    loss = gpt_bench.make_loss(size)
    variants = {
        "fp32": loss,
        "bf16": jaxamp.amp(loss, compute_dtype=BF16),
        "int8": jaxamp.amp(
            loss, compute_dtype=BF16, amp_policy=jaxamp.int8_policy(size_rule=None)
        ),
        "int8 (wgrad int8)": jaxamp.amp(
            loss,
            compute_dtype=BF16,
            amp_policy=jaxamp.int8_policy(size_rule=None, wgrad=True),
        ),
        "fp8": jaxamp.amp(
            loss, compute_dtype=BF16, amp_policy=jaxamp.fp8_policy(size_rule=None)
        ),
    }
    steps = {k: jax.jit(jax.value_and_grad(f)) for k, f in variants.items()}
    _, ref = steps["fp32"](params, x, y)
    res32 = jaxamp.saved_residual_bytes(loss, params, x, y)
    rows, t32 = [], None
    for name, step in steps.items():
        ms = best_ms(step, (params, x, y), repeats)
        t32 = ms if name == "fp32" else t32
        _, g = step(params, x, y)
        grad_jaxpr = jax.make_jaxpr(jax.grad(variants[name]))(params, x, y)
        rows.append(
            {
                "variant": name,
                "ms": ms,
                "ratio_vs_fp32": t32 / ms,
                "residual_bytes": jaxamp.saved_residual_bytes(
                    variants[name], params, x, y
                ),
                "residual_vs_fp32": jaxamp.saved_residual_bytes(
                    variants[name], params, x, y
                )
                / res32,
                "grad_rel_err": _rel(g, ref),
                "eight_bit_flop_share": jaxamp.eight_bit_flop_share(grad_jaxpr),
            }
        )
        r = rows[-1]
        print(
            f"| {name} | {ms:.1f} | {r['ratio_vs_fp32']:.2f}x | {r['residual_bytes']} "
            f"({r['residual_vs_fp32']:.2f}x) | {r['grad_rel_err']:.2e} "
            f"| {r['eight_bit_flop_share']:.2f} |",
            flush=True,
        )
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="d_model 512 only, 3 repeats")
    p.add_argument("--size", default="S", help="benchmarks/run.py model size")
    p.add_argument("--out", default=None, help="JSON file for the figures")
    a = p.parse_args(argv)
    repeats = 3 if a.quick else 5
    widths = (512,) if a.quick else (512, 2048)
    tokens = {512: 2048, 2048: 1024}
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}")
    print("| d_model | matmul | MxKxN | layout | " + " | ".join(FORMATS) + " |")
    print("|---|---|---|---|" + "---|" * len(FORMATS))
    kern = kernels(widths, tokens, repeats)
    print(f"\nTraining step, benchmarks/run.py size {a.size}:")
    print(
        "| variant | ms | speed vs fp32 | residual bytes | grad rel err | 8-bit FLOPs |"
    )
    print("|---|---|---|---|---|---|")
    step = training_step(a.size, repeats)
    if a.out:
        Path(a.out).write_text(json.dumps({"kernels": kern, "step": step}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
