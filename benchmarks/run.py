"""jaxamp side by side with the alternatives, on one GPT-style training step.

    python benchmarks/run.py --size S --out benchmarks/RESULTS_S.md
    python benchmarks/run.py --size M --device gpu --out gpu.md

Every variant computes the same model (layers in ``lax.scan``, causal
attention, LayerNorm, GELU MLP, cross-entropy) on the same float32 parameters
and batch (pre-rounded to bfloat16 so that every variant sees exactly
representable inputs):

* ``fp32``: no mixed precision;
* ``jaxamp bf16`` / ``jaxamp fp16``: ``jaxamp.amp`` with the default policy
  (fp16 trained with dynamic loss scaling, :class:`LossScaled`);
* ``mpx``: ``mpx.cast_to_half_precision`` (bfloat16) on parameters and inputs;
* ``jmp``: ``jmp.get_policy("p=f32,c=bf16,o=f32")``, cast to compute;
* ``hand bf16``: parameters cast to bfloat16 at the top of the loss, float32
  LayerNorm statistics, softmax and loss written by hand;
* ``jaxamp bf16 + E4M3 residuals``: ``jaxamp.amp(residual_dtype=
  jnp.float8_e4m3fn)``, the saved activations stored in 8 bits.

Figures: low-precision share of matmul FLOPs in the gradient jaxpr (scan
bodies weighted by length); bytes of residuals saved for the backward pass
(``jax.ad_checkpoint``'s analysis, arguments excluded) relative to fp32; trace
time of ``make_jaxpr(value_and_grad)`` relative to fp32 (median, caches
cleared); compile time; steady-state step time relative to fp32 (median of
``--steps`` steps after warm-up); ``convert_element_type`` count; gradient
relative L2 error and loss difference against fp32. A second table times the
transform on 4, 16 and 64 unrolled layers (no scan) to show its cost is linear
in the number of equations.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp

# The model kit beside this file, also under `python -m benchmarks.run`.
sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

import jaxamp  # noqa: E402

SIZES = {  # d_model, layers, seq, batch, heads, vocab
    "tiny": (32, 2, 16, 2, 2, 64),
    "S": (256, 4, 128, 8, 4, 256),
    "M": (512, 8, 256, 8, 8, 256),
    "L": (1024, 16, 1024, 16, 16, 256),
}
H100_BF16_PEAK = 989e12  # dense bf16 FLOP/s, NVIDIA H100 SXM datasheet
BF16 = jnp.bfloat16


class LossScaled:
    """A float16 variant trained as float16 must be: gradients through
    ``jaxamp.dynamic_scale_value_and_grad`` at the initial loss scale (2**15),
    unscaled in float32 (the timed step includes the scaler's finite checks).
    Without it float16 gradients of this size underflow, and their error
    measures the missing loss scaling, not the transform."""

    def __init__(self, loss: Callable):
        self.loss = loss

    def value_and_grad(self) -> Callable:
        vg = jaxamp.dynamic_scale_value_and_grad(self.loss, filter=False)
        state = jaxamp.DynamicScalerState()

        def value_and_grad(p, x, y):
            _, (value, grads) = vg(p, x, y, dynamic_scaler_state=state)
            return value, grads

        return value_and_grad


def value_and_grad(variant: Callable | LossScaled) -> Callable:
    """The ``(params, x, y) -> (loss, grads)`` a variant is trained with."""
    if isinstance(variant, LossScaled):
        return variant.value_and_grad()
    return jax.value_and_grad(variant)


def plain_loss(variant: Callable | LossScaled) -> Callable:
    """The variant's loss function, without loss scaling."""
    return variant.loss if isinstance(variant, LossScaled) else variant


def init(size: str, seed: int = 0, sizes: dict | None = None):
    """float32 parameters (pre-rounded to bfloat16) and an int32 batch of the
    size named ``size`` in ``sizes`` (default: this module's ``SIZES``)."""
    return common.gpt_init((SIZES if sizes is None else sizes)[size], seed)


_ln = common.layer_norm  # float32 statistics in the hand-written variant


def make_loss(
    size: str, hand: bool = False, unroll: int | None = None, remat: bool = False
) -> Callable:
    """The model's loss ``loss(params, x, y)`` (``common.gpt_loss``). ``hand``:
    the hand-written bfloat16 variant (its softmax written out in float32);
    ``unroll``: that many layers in a Python loop (no scan); ``remat``: each
    scanned block under ``jax.checkpoint``."""
    return common.gpt_loss(
        SIZES[size],
        attention="softmax" if hand else "xla",
        hand=hand,
        unroll=unroll,
        remat=remat,
    )


def variants(size: str) -> dict[str, Callable | str]:
    """name -> loss function, or a string saying why it is missing."""
    base = make_loss(size)
    out: dict[str, Callable | str] = {
        "fp32": base,
        "jaxamp bf16": jaxamp.amp(base, compute_dtype=BF16),
        "jaxamp fp16": LossScaled(jaxamp.amp(base, compute_dtype=jnp.float16)),
    }
    try:
        import mpx

        mpx.set_half_precision_datatype(BF16)

        def mpx_loss(params, x, y):
            p, x = mpx.cast_to_half_precision((params, x))
            return base(p, x, y).astype(jnp.float32)

        out["mpx bf16"] = mpx_loss
    except ImportError as e:
        out["mpx bf16"] = f"missing: {e} (pip install -e '.[bench]')"
    try:
        import jmp

        policy = jmp.get_policy("p=f32,c=bf16,o=f32")

        def jmp_loss(params, x, y):
            return policy.cast_to_output(base(policy.cast_to_compute(params), x, y))

        out["jmp bf16"] = jmp_loss
    except ImportError as e:
        out["jmp bf16"] = f"missing: {e} (pip install -e '.[bench]')"
    out["hand bf16"] = make_loss(size, hand=True)
    # Saved activations in E4M3 with 1 x 128 scales (benchmarks/residuals.py).
    out["jaxamp bf16 + E4M3 residuals"] = jaxamp.amp(
        base, compute_dtype=BF16, residual_dtype=jnp.float8_e4m3fn
    )
    return out


def _median_time(fn: Callable, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _trace_times(fns: dict[str, Callable], args: tuple, repeats: int) -> dict:
    """Median time of ``make_jaxpr(value_and_grad(f))`` per function, caches
    cleared and garbage collected before each, the functions interleaved within
    each repeat so that drifts of the machine hit all of them alike."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, f in fns.items():
            jax.clear_caches()
            gc.collect()
            gc.disable()
            try:
                t0 = time.perf_counter()
                jax.make_jaxpr(value_and_grad(f))(*args)
                times[name].append(time.perf_counter() - t0)
            finally:
                gc.enable()
    return {name: statistics.median(t) for name, t in times.items()}


def measure(size: str, steps: int, trace_repeats: int, device: str) -> list[dict]:
    """One row of figures per variant, fp32 first."""
    params, x, y = init(size)
    d, L, T, B, _, V = SIZES[size]
    rows, ref = [], None
    found = variants(size)
    present = {k: v for k, v in found.items() if not isinstance(v, str)}
    traces = _trace_times(present, (params, x, y), trace_repeats)
    for name, loss in found.items():
        if isinstance(loss, str):
            rows.append({"variant": name, "missing": loss})
            continue
        vg = value_and_grad(loss)
        loss = plain_loss(loss)
        trace_s = traces[name]
        closed = jax.make_jaxpr(jax.grad(loss))(params, x, y)

        @jax.jit
        def step(p, x, y, vg=vg):
            value, g = vg(p, x, y)
            return jax.tree.map(lambda a, b: a - 1e-3 * b, p, g), value

        t0 = time.perf_counter()
        compiled = step.lower(params, x, y).compile()
        compile_s = time.perf_counter() - t0
        p = params
        for _ in range(2):  # warm-up
            p, value = compiled(p, x, y)
            jax.block_until_ready(p)

        def one_step(compiled=compiled):
            jax.block_until_ready(compiled(params, x, y))

        step_s = _median_time(one_step, steps)
        value, grads = jax.jit(vg)(params, x, y)
        row = {
            "variant": name,
            "low_precision_flop_share": jaxamp.tools.low_precision_flop_share(closed),
            "residual_bytes": jaxamp.saved_residual_bytes(loss, params, x, y),
            "trace_s": trace_s,
            "compile_s": compile_s,
            "step_s": step_s,
            "converts": jaxamp.tools.count_primitive(
                jax.make_jaxpr(vg)(params, x, y), "convert_element_type"
            ),
            "loss": float(value),
            "grads": grads,
        }
        if device == "gpu":
            flops = sum(jaxamp.tools.matmul_flops_by_dtype(closed).values()) + 2 * (
                sum(
                    v
                    for v in jaxamp.tools.matmul_flops_by_dtype(
                        jax.make_jaxpr(loss)(params, x, y)
                    ).values()
                )
            )
            row["tokens_per_s"] = B * T / step_s
            row["mfu"] = flops / 2 / step_s / H100_BF16_PEAK  # fwd+bwd matmul FLOPs
        if ref is None:
            ref = row
        rows.append(row)
    for r in rows:
        if "missing" in r:
            continue
        r["residual_ratio"] = r["residual_bytes"] / ref["residual_bytes"]
        r["trace_ratio"] = r["trace_s"] / ref["trace_s"]
        r["step_ratio"] = r["step_s"] / ref["step_s"]
        r["grad_rel_l2"] = common.rel_l2(r["grads"], ref["grads"])
        r["loss_diff"] = abs(r["loss"] - ref["loss"])
    for r in rows:
        r.pop("grads", None)
    return rows


def scaling(trace_repeats: int, layer_counts=(4, 16, 64)) -> list[dict]:
    """Trace time of value_and_grad, plain and amp, on unrolled layers."""
    params, x, y = init("tiny")
    out = []
    for layers in layer_counts:
        base = make_loss("tiny", unroll=layers)
        amp = jaxamp.amp(base, compute_dtype=BF16)
        n_eqns = sum(
            1 for _ in jaxamp.tools.iter_equations(jax.make_jaxpr(base)(params, x, y))
        )
        times = _trace_times({"fp32": base, "amp": amp}, (params, x, y), trace_repeats)
        overhead = times["amp"] - times["fp32"]
        out.append(
            {
                "layers": layers,
                "forward_equations": n_eqns,
                "trace_fp32_s": times["fp32"],
                "trace_amp_s": times["amp"],
                "overhead_s": overhead,
                "overhead_us_per_equation": 1e6 * overhead / n_eqns,
            }
        )
    return out


def markdown(rows: list[dict], scale: list[dict], meta: dict) -> str:
    """The two Markdown tables."""
    gpu = meta["device_mode"] == "gpu"
    cols = [
        ("variant", "variant", "{}"),
        ("low-precision FLOP share", "low_precision_flop_share", "{:.2f}"),
        ("residual bytes vs fp32", "residual_ratio", "{:.2f}x"),
        ("trace vs fp32", "trace_ratio", "{:.2f}x"),
        ("compile s", "compile_s", "{:.2f}"),
        ("step vs fp32", "step_ratio", "{:.2f}x"),
        ("converts", "converts", "{}"),
        ("grad rel. L2 err", "grad_rel_l2", "{:.2e}"),
        ("loss diff", "loss_diff", "{:.1e}"),
    ]
    if gpu:
        cols += [("tokens/s", "tokens_per_s", "{:.0f}"), ("MFU", "mfu", "{:.1%}")]
    lines = [
        f"Size {meta['size']} (d_model, layers, seq, batch, heads, vocab = "
        f"{meta['dims']}), {meta['device']}, JAX {meta['jax']}; step times are "
        f"medians of {meta['steps']} steps.",
        "",
        "| " + " | ".join(c[0] for c in cols) + " |",
        "|" + "---|" * len(cols),
    ]
    for r in rows:
        if "missing" in r:
            lines.append(
                f"| {r['variant']} | {r['missing']} |" + " |" * (len(cols) - 2)
            )
            continue
        lines.append(
            "| " + " | ".join(fmt.format(r[key]) for _, key, fmt in cols) + " |"
        )
    lines += [
        "",
        "Transform cost on unrolled layers (size tiny, no scan; trace of "
        "value_and_grad):",
        "",
        "| layers | forward equations | trace fp32 s | trace amp s | overhead s "
        "| overhead us/equation |",
        "|---|---|---|---|---|---|",
    ]
    for s in scale:
        lines.append(
            f"| {s['layers']} | {s['forward_equations']} | {s['trace_fp32_s']:.3f} "
            f"| {s['trace_amp_s']:.3f} | {s['overhead_s']:.3f} "
            f"| {s['overhead_us_per_equation']:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", default="S", choices=list(SIZES))
    p.add_argument("--device", default="cpu", choices=["cpu", "gpu"])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--trace-repeats", type=int, default=5)
    p.add_argument("--scaling-layers", default="4,16,64")
    p.add_argument("--out", default=None, help="Markdown file; JSON beside it")
    args = p.parse_args(argv)
    if args.device == "gpu" and jax.default_backend() != "gpu":
        print("error: --device gpu but JAX sees no GPU", file=sys.stderr)
        return 2
    meta = {
        "size": args.size,
        "dims": SIZES[args.size],
        "device_mode": args.device,
        "device": f"{jax.devices()[0].device_kind} ({jax.default_backend()})",
        "jax": jax.__version__,
        "steps": args.steps,
    }
    rows = measure(args.size, args.steps, args.trace_repeats, args.device)
    layer_counts = [int(n) for n in args.scaling_layers.split(",")]
    scale = scaling(args.trace_repeats, layer_counts)
    md = markdown(rows, scale, meta)
    print(md)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(md + "\n")
        out.with_suffix(".json").write_text(
            json.dumps({"meta": meta, "rows": rows, "scaling": scale}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
