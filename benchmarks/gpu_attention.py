"""Fused attention under amp: one GPT training step on a GPU (issue 12).

    python benchmarks/gpu_attention.py                      # both GPU models
    python benchmarks/gpu_attention.py --size tiny --dry-run --out /tmp/r.md

GPT-style model: layers in ``lax.scan`` with ``jax.checkpoint``, causal
attention through ``jax.nn.dot_product_attention``, LayerNorm, GELU MLP, tied
embedding, cross-entropy; ``value_and_grad`` plus an SGD update with the
parameters donated. Models (d_model, layers, seq, batch, heads, vocab):
``gpt1024`` (1024, 12, 1024, 8, 16, 8192) and ``gpt2048`` (2048, 8, 512, 16,
16, 8192); ``tiny`` for the CPU smoke run; ``cpu`` (256, 4, 128, 8, 4, 512) for
ratios measured side by side on a CPU.

Variants: ``fp32``; ``jaxamp bf16`` / ``jaxamp fp16`` over the float32 model
(``implementation=None``: amp re-dispatches the attention; fp16 with dynamic
loss scaling, :class:`LossScaled`); ``jaxamp fp16, overflow check off`` (a
diagnostic: the cost of fp16's forward overflow check, not a safe way to
train); ``jaxamp bf16,
model asks cudnn`` (the model says ``implementation="cudnn"``); ``jaxamp bf16,
attention off`` (``attention_rule("off")``: the attention as before issue 12);
``hand bf16 xla`` / ``hand bf16 cudnn`` (parameters cast to bfloat16 at the top
of the loss, float32 LayerNorm statistics and loss); the cast-everything peers
``jmp bf16`` and ``mpx bf16`` (they cast parameters and run the float32 model's
code, so their attention is the XLA path on bfloat16).

Columns: step time (median of ``--rounds`` interleaved rounds of ``--steps``
steps), tokens/s, MFU against 989 TFLOP/s (model FLOPs: 6 x matmul parameters x
tokens plus 12 x B x T^2 x d per layer for attention, no recompute), XLA's
temp bytes (``compiled.memory_analysis().temp_size_in_bytes``), the bytes of
the residuals saved for the backward pass (``jaxamp.saved_residual_bytes``,
hardware independent; the arguments excluded), gradient
relative L2 error and loss difference against float32 computed at
``precision="highest"``, and the kernels the compiled HLO calls: custom-call
sites of cuDNN fused attention (``__cudnn$fmha...``, forward / backward) and of
cuBLAS (``__cublas$...``). Inside the scanned layer one forward and one backward
site run once per layer.

Writes ``--out`` (Markdown, default ``benchmarks/RESULTS_GPU.md``) and the same
rows as JSON next to it. ``--dry-run``: one step, one round, no timing claims;
variants that need cuDNN are reported as unavailable where the backend has
none.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's
sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import run as _run  # noqa: E402  (benchmarks/run.py: the same GPT on CPU)
from run import LossScaled  # noqa: E402

import jaxamp  # noqa: E402

SIZES = {  # d_model, layers, seq, batch, heads, vocab
    "tiny": (64, 2, 32, 2, 4, 128),
    "cpu": (256, 4, 128, 8, 4, 512),  # CPU side-by-side ratios, not GPU speed
    "gpt1024": (1024, 12, 1024, 8, 16, 8192),
    "gpt2048": (2048, 8, 512, 16, 16, 8192),
    # matmul-dominated (attention 2% of the FLOPs): gpu_suite.py's 8-bit part
    "gpt4096": (4096, 4, 512, 8, 32, 8192),
    # the same at 16k tokens a step (batch 32): Transformer Engine's FP8 regime
    "gpt4096_16k": (4096, 4, 512, 32, 32, 8192),
}
PEAK = 989e12  # H100 SXM dense bf16 FLOP/s (datasheet)
BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32


def init(size: str, seed: int = 0):
    """float32 parameters pre-rounded to bfloat16, and an int32 batch: the
    model of ``benchmarks/run.py`` at this module's sizes."""
    return common.gpt_init(SIZES[size], seed)


def model_flops(size: str) -> float:
    """Forward + backward FLOPs of one step (no recompute)."""
    d, L, T, B, _, V = SIZES[size]
    matmul_params = L * 12 * d * d + V * d
    return 6 * matmul_params * B * T + 12 * B * T * T * d * L


_ln = common.layer_norm  # float32 statistics in the hand-written variant


def make_loss(size: str, implementation: str | None, hand: bool) -> Callable:
    """``loss(params, x, y)``, each scanned block under ``jax.checkpoint``;
    ``hand``: bfloat16 parameters and activations with float32 LayerNorm
    statistics and loss, written by hand (``common.gpt_loss``)."""
    return common.gpt_loss(SIZES[size], attention=implementation, hand=hand, remat=True)


def variants(size: str) -> dict[str, Callable | str]:
    """name -> loss, or a string saying why the variant is missing."""
    base = make_loss(size, None, hand=False)
    off = {**jaxamp.default_amp_policy, "attention": jaxamp.attention_rule("off")}
    out: dict[str, Callable | str] = {
        "fp32": base,
        "jaxamp bf16": jaxamp.amp(base, compute_dtype=BF16),
        "jaxamp fp16": LossScaled(jaxamp.amp(base, compute_dtype=F16)),
        # Diagnostic: what the forward overflow check costs (unsafe to train with).
        "jaxamp fp16, overflow check off": LossScaled(
            jaxamp.amp(base, compute_dtype=F16, overflow_check=False)
        ),
        "jaxamp bf16, model asks cudnn": jaxamp.amp(
            make_loss(size, "cudnn", hand=False), compute_dtype=BF16
        ),
        "jaxamp bf16, attention off": jaxamp.amp(
            base, compute_dtype=BF16, amp_policy=off
        ),
        "hand bf16 xla": make_loss(size, "xla", hand=True),
        "hand bf16 cudnn": make_loss(size, "cudnn", hand=True),
    }
    try:
        import jmp

        policy = jmp.get_policy("p=f32,c=bf16,o=f32")
        out["jmp bf16"] = lambda p, x, y: policy.cast_to_output(
            base(policy.cast_to_compute(p), x, y)
        )
    except ImportError as e:
        out["jmp bf16"] = f"missing: {e} (pip install -e '.[bench]')"
    try:
        import mpx

        mpx.set_half_precision_datatype(BF16)

        def mpx_loss(p, x, y):
            p, x = mpx.cast_to_half_precision((p, x))
            return base(p, x, y).astype(F32)

        out["mpx bf16"] = mpx_loss
    except ImportError as e:
        out["mpx bf16"] = f"missing: {e} (pip install -e '.[bench]')"
    return out


def kernels(hlo: str) -> dict[str, int]:
    """Custom-call sites in compiled HLO text: cuDNN attention fwd/bwd, cuBLAS."""
    targets = re.findall(r'custom_call_target="([^"]+)"', hlo)
    fmha = [t for t in targets if t.startswith("__cudnn$fmha")]
    return {
        "fmha_fwd": sum("Backward" not in t for t in fmha),
        "fmha_bwd": sum("Backward" in t for t in fmha),
        "cublas": sum(t.startswith("__cublas") for t in targets),
    }


def _unavailable(e: Exception) -> str:
    return f"unavailable on {jax.default_backend()}: {type(e).__name__}: {e}"[:160]


def sgd_step(vg: Callable) -> Callable:
    """``step(p, x, y) -> (p - 1e-3 * grad, loss)`` from ``vg(p, x, y) ->
    (loss, grad)``: the timed training step (jit it with ``donate_argnums=0``)."""

    def step(p, x, y):
        value, g = vg(p, x, y)
        return jax.tree.map(lambda a, b: a - 1e-3 * b, p, g), value

    return step


def measure(
    size: str,
    steps: int,
    rounds: int,
    only: list[str] | None = None,
    found: dict[str, Callable | str] | None = None,
) -> list[dict]:
    """One row per variant (fp32 first), timed in interleaved rounds.

    Args:
        size: a key of ``SIZES``.
        steps: timed steps per round.
        rounds: interleaved rounds; the row's step time is their median.
        only: the variants to measure besides fp32 (None: all).
        found: name -> loss (or a string saying why it is missing), with an
            ``"fp32"`` entry; default :func:`variants`.

    Returns:
        One dict per variant: its figures, or ``missing`` (why not).
    """
    params, x, y = init(size)
    d, L, T, B, _, V = SIZES[size]
    with jax.default_matmul_precision("highest"):
        ref_loss, ref_grads = jax.jit(jax.value_and_grad(make_loss(size, None, False)))(
            params, x, y
        )
    rows: dict[str, dict] = {}
    steps_fn: dict[str, Callable] = {}
    for name, loss in (variants(size) if found is None else found).items():
        if only and name not in only and name != "fp32":
            continue
        if isinstance(loss, str):
            rows[name] = {"variant": name, "missing": loss}
            continue
        vg, loss = _run.value_and_grad(loss), _run.plain_loss(loss)
        step = sgd_step(vg)
        try:
            with _warnings_quiet():
                t0 = time.perf_counter()
                lowered = jax.jit(step, donate_argnums=0).lower(params, x, y)
                compiled = lowered.compile()
                compile_s = time.perf_counter() - t0
                value, grads = jax.jit(vg)(params, x, y)
        except Exception as e:  # e.g. cuDNN asked for on a backend without it
            rows[name] = {"variant": name, "missing": _unavailable(e)}
            continue
        mem = compiled.memory_analysis()
        rows[name] = {
            "variant": name,
            "compile_s": compile_s,
            "temp_mib": getattr(mem, "temp_size_in_bytes", 0) / 2**20,
            "residual_mib": jaxamp.saved_residual_bytes(loss, params, x, y) / 2**20,
            "grad_rel_l2": common.rel_l2(grads, ref_grads),
            "loss_diff": abs(float(value) - float(ref_loss)),
            **kernels(compiled.as_text()),
        }
        steps_fn[name] = compiled
    times: dict[str, list[float]] = {n: [] for n in steps_fn}
    for _ in range(rounds):  # interleaved: every variant sees the same machine
        for name, compiled in steps_fn.items():
            p = jax.tree.map(jnp.copy, params)
            p, _ = compiled(p, x, y)  # warm-up
            jax.block_until_ready(p)
            t0 = time.perf_counter()
            for _ in range(steps):
                p, _ = compiled(p, x, y)
            jax.block_until_ready(p)
            times[name].append((time.perf_counter() - t0) / steps)
    flops = model_flops(size)
    for name, ts in times.items():
        s = statistics.median(ts)
        rows[name].update(step_ms=1e3 * s, tokens_per_s=B * T / s, mfu=flops / s / PEAK)
    fp32 = rows["fp32"].get("step_ms")
    for r in rows.values():
        if "step_ms" in r and fp32:
            r["speedup_vs_fp32"] = fp32 / r["step_ms"]
    return list(rows.values())


class _warnings_quiet:
    """The CPU-fallback warning of a cuDNN request is expected on CPU runs."""

    def __enter__(self):
        import warnings

        self._ctx = warnings.catch_warnings()
        self._ctx.__enter__()
        warnings.simplefilter("ignore", UserWarning)

    def __exit__(self, *exc):
        return self._ctx.__exit__(*exc)


COLUMNS = [
    ("step ms", "step_ms", "{:.1f}"),
    ("vs fp32", "speedup_vs_fp32", "{:.2f}x"),
    ("tokens/s", "tokens_per_s", "{:,.0f}"),
    ("MFU", "mfu", "{:.1%}"),
    ("temp MiB", "temp_mib", "{:.0f}"),
    ("residual MiB", "residual_mib", "{:.0f}"),
    ("grad rel. L2 vs fp32", "grad_rel_l2", "{:.1e}"),
    ("loss diff", "loss_diff", "{:.1e}"),
    ("cuDNN fmha fwd/bwd", None, None),
    ("cuBLAS calls", "cublas", "{}"),
    ("compile s", "compile_s", "{:.1f}"),
]


def size_heading(size: str) -> str:
    """The model's dimensions and FLOPs per step, one line."""
    d, L, T, B, H, V = SIZES[size]
    return (
        f"{size}: d_model {d}, {L} layers (scan + checkpoint), seq {T}, batch {B}, "
        f"{H} heads, vocab {V}; {model_flops(size) / 1e12:.2f} TFLOP/step"
    )


def table(rows: list[dict], columns: list[tuple] = COLUMNS) -> list[str]:
    """Markdown table lines of :func:`measure`'s rows; ``columns`` as
    ``COLUMNS``: (header, row key or None for the fmha sites, format)."""
    lines = [
        "| variant | " + " | ".join(c for c, _, _ in columns) + " |",
        "|---" * (len(columns) + 1) + "|",
    ]
    for r in rows:
        if "missing" in r:
            lines.append(f"| {r['variant']} | {r['missing']} |")
            continue
        cells = []
        for _, key, fmt in columns:
            if key is None:
                cells.append(f"{r.get('fmha_fwd', 0)}/{r.get('fmha_bwd', 0)}")
            else:
                cells.append(fmt.format(r[key]) if key in r else "")
        lines.append(f"| {r['variant']} | " + " | ".join(cells) + " |")
    return lines


def markdown(results: dict[str, list[dict]], meta: dict) -> str:
    lines = [
        "# Fused attention under amp: one GPT training step",
        "",
        f"Command: `{meta['command']}`",
        "",
        f"Device: {meta['device']}; JAX {meta['jax']}; {meta['note']}",
        "",
    ]
    for size, rows in results.items():
        lines += ["## " + size_heading(size), "", *table(rows), ""]
    return "\n".join(lines)


def pick_variants(spec: str, names: list[str]) -> list[str] | None:
    """The variants a ``--variants`` string names, in its order; None for all.

    Names may contain commas ("jaxamp bf16, attention off"): the string is split
    at commas and, from each position, the longest run of pieces that spells a
    name is taken.

    Raises:
        SystemExit: if some piece names no variant (the message lists them).
    """
    pieces = spec.split(",") if spec.strip() else []
    picked, i = [], 0
    while i < len(pieces):
        for j in range(len(pieces), i, -1):
            if ",".join(pieces[i:j]).strip() in names:
                picked.append(",".join(pieces[i:j]).strip())
                i = j
                break
        else:
            raise SystemExit(
                f"--variants: no variant named {pieces[i].strip()!r}; choose from "
                + "; ".join(names)
            )
    return picked or None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="gpt1024,gpt2048", help="comma-separated")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dry-run", action="store_true", help="1 step, 1 round")
    ap.add_argument("--variants", default="", help="comma-separated subset")
    ap.add_argument("--out", default=str(Path(__file__).with_name("RESULTS_GPU.md")))
    args = ap.parse_args(argv)
    if args.dry_run:
        args.steps, args.rounds = 1, 1
    sizes = [s for s in args.size.split(",") if s]
    only = pick_variants(args.variants, list(variants("tiny")))
    results = {s: measure(s, args.steps, args.rounds, only) for s in sizes}
    dev = jax.devices()[0]
    meta = {
        "command": "python benchmarks/gpu_attention.py "
        + shlex.join(argv if argv is not None else sys.argv[1:]),
        "device": getattr(dev, "device_kind", dev.platform),
        "jax": jax.__version__,
        "note": "dry run: timings are not measurements"
        if args.dry_run
        else f"median of {args.rounds} interleaved rounds of {args.steps} steps",
    }
    md = markdown(results, meta)
    out = Path(args.out)
    out.write_text(md + "\n")
    out.with_suffix(".json").write_text(
        json.dumps({"meta": meta, "results": results}, indent=1, default=float)
    )
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
