"""Every GPU check in one command, within a device lease (issue 34).

    python benchmarks/gpu_suite.py                   # on one NVIDIA GPU, ~7.5 min
    python benchmarks/gpu_suite.py --dry-run         # CPU, tiny sizes, < 1 min
    python benchmarks/gpu_suite.py --parts eight_bit,gpt1024 --budget-s 300

Parts, in the order they run: the most informative first, so that a budget that
runs short drops the figures we can best do without. Each has an estimated cost
on one H100 (``--dry-run``: on a 2-core CPU); a part whose estimate exceeds the
budget left is skipped with a printed reason, and the next, cheaper parts still
try. The estimates (guesses from earlier GPU runs of the same models, about
450 s in all) are scaled by how much slower than estimated the parts so far
ran. Parts with several sub-measurements (memory variants, fp16 and bf16
runs) skip the rest with a reason once the budget runs out inside them.

1. ``eight_bit`` (~130 s): FP8 and int8 against bf16 on the matmul-dominated
   GPT ``gpt4096`` of ``gpu_attention.py`` (d_model 4096, 4 layers, seq 512,
   batch 8; attention 2% of the FLOPs) with the policies' default size rules:
   ms/step, speed against bf16, MFU (against the bf16 peak), gradient error
   against float32, and the share of matmul FLOPs that ran in 8 bits
   (``jaxamp.tools.eight_bit_flop_share``). Never measured on a GPU before: the
   README's "8-bit at or above bf16's speed where it pays".
1c. ``gemm_probe`` (~30 s): one GEMM on operands already in its dtype, bf16
   against FP8 (E4M3 -> bf16 with a scale) and s8 (-> s32), at 8192^3 and at
   gpt4096's four per-layer shapes: TFLOP/s and ratios (the s8 rate on an H100
   decides whether int8 can pay there).
2. ``gpt1024`` (~120 s): the gpt1024 training step of ``gpu_attention.py``
   (d_model 1024, 12 layers, seq 1024, batch 8): fp32, jaxamp bf16, hand-written
   bf16 with cuDNN attention, jmp, mpx; interleaved timing (median of 5 rounds
   of 10 steps), ms/step, MFU, temp and residual MiB, gradient error and loss
   difference against float32, cuDNN/cuBLAS call sites. The README's headline.
3. ``memory`` (~60 s, compile only): the training step's peak bytes per added
   parameter, ``(peak(8 layers) - peak(4 layers)) / parameters added`` with
   peak = arguments + outputs - aliased + temp of XLA's ``memory_analysis()`` of
   the jitted step, parameters and AdamW state donated (``benchmarks/memory.py``'s
   measure), on the main job's GPT at width 1024 with seq 256, batch 1 (issue
   31's shape) and seq 1024, batch 8 (``memory.py``'s default): float32
   master weights, bf16 parameters + stochastic rounding with bf16 and with
   int8 state, and bf16 compute with FP8-stored residuals (skipped, with the
   reason printed, while ``jaxamp.amp`` has no ``residual_dtype=``).
4. ``precision`` (~60 s): ``jaxamp.precision_report``'s time over the first
   call of the jitted amp step at 4 and 24 scanned layers
   (``benchmarks/precision_report.py --depth 4 --depth 24``: width 256, seq
   128, batch 8, each row in a fresh process), and the ratio's growth with
   depth (issue 33's bounds: at most 4x at 24 layers, growth at most 1.5).
5. ``fp16_run`` (~40 s): 200 steps of the main job's model
   (``examples/train_charlm.py`` defaults) in float16 with dynamic loss
   scaling, and in bf16: skipped steps, forward overflows, final loss scale,
   validation loss of fp16 against bf16, tokens/s.
6. ``compile`` (~40 s): trace, lowering and compile seconds of the gpt1024 step,
   jaxamp bf16 against the hand-written bf16 model (cuDNN attention; the XLA
   attention where the backend has no cuDNN), caches cleared before each,
   interleaved, median of 2 repeats.
7. ``eight_bit_16k`` (~150 s): part 1 at 16k tokens a step (``gpt4096_16k``,
   batch 32), where Transformer Engine reports FP8's 1.55x; last, so a run on
   the default budget reaches it only when the parts before ran fast (give it
   ``--parts eight_bit_16k`` or a larger ``--budget-s``).

Budget: ``--budget-s`` (default 450 s), counted from the interpreter's start
(JAX's import and start included). A part starts only if its estimate fits in
what is left, so the run ends near the budget plus the last part's overrun:
within the 8 minutes of wall a device command is planned for. Both files are
rewritten after every part, so a run stopped from outside keeps what it
measured; they record the wall time, each part's seconds and every skip with
its reason.

Outputs: ``RESULTS_GPU.md`` and ``RESULTS_GPU.json`` in ``--out`` (a folder;
default ``benchmarks/``, so a GPU run replaces the committed results; with
``--dry-run`` a new temporary folder, never ``benchmarks/``). The Markdown has
the machine (device, driver, CPU), the versions (Python, JAX, jaxlib, jaxamp
and its git commit, optax, jmp, mpx), the UTC date ("Measured YYYY-MM-DD"),
the README's GPU rows ready to paste (each with that date), and one section
per part. The JSON holds the same figures (``meta``, ``parts``). Exit status 1
if a part raised (its traceback is printed and recorded), 2 without a GPU and
without ``--dry-run``.

``--dry-run`` (CPU, under a minute on 2 cores): every part at tiny sizes
(``gpu_attention.py``'s ``tiny``; the main job at width 32 and 3 steps), the
8-bit policies on every matmul (``size_rule=None``), gpt1024 without the
peers, the memory part on one shape with float32 master weights, int8 state
and float16 compiled (its other variants lowered), the precision rows in the
suite's process, the 16k-token part's variants built at their size and
measured with the 8-bit part's (``tiny``); XLA:CPU compiles without its MLIR
fusion emitters and LLVM optimisation (7x faster compiles). It checks that
every part runs and writes its figures; its timings are not measurements.
``tests/test_benchmarks.py`` runs it.

On the device machine (``run`` tool: JAX 0.11 with CUDA is preinstalled there;
jmp and mpx travel as wheels in ``.whl``, made as docs/guide.md says; the
copy of the checkout there has no ``.git``, so pass the commit), one call with
``carry: [".whl"]`` and ``timeout_s: 540``::

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \\
        --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit
    PYTHONUNBUFFERED=1 python3 benchmarks/gpu_suite.py --out $OUT \\
        --note "jaxamp commit <hash>" 2>&1 | tee $OUT/log

then copy ``RESULTS_GPU.md`` and ``RESULTS_GPU.json`` from the returned files
into ``benchmarks/`` and the "README rows" into the README's table.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.metadata
import inspect
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

T_START = time.perf_counter()  # before JAX's import: the run's wall time

if __name__ == "__main__" and "--dry-run" in sys.argv:
    # A dry run times nothing: XLA:CPU's cheapest code generation (no MLIR
    # fusion emitters, no LLVM optimisation) compiles the tiny steps about 7x
    # faster. Read when the backend starts, so set before any JAX call.
    # Only the flags this jaxlib knows: an unknown one aborts XLA at start.
    # Importing jaxamp does not start the backend.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from jaxamp._compat import known_xla_flags

    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "")
        + " "
        + known_xla_flags(
            "--xla_cpu_use_fusion_emitters=false --xla_backend_optimization_level=0"
            " --xla_llvm_disable_expensive_passes"
        )
    )

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's jaxamp
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_attention as ga  # noqa: E402
import run as _run  # noqa: E402
import train_charlm as tc  # noqa: E402

import jaxamp  # noqa: E402

BF16 = jnp.bfloat16
E4M3 = jnp.float8_e4m3fn


@dataclasses.dataclass
class Budget:
    """The suite's deadline: ``left()`` seconds remain of ``total_s``."""

    total_s: float
    start: float = dataclasses.field(default_factory=time.perf_counter)

    def left(self) -> float:
        return self.total_s - (time.perf_counter() - self.start)

    def skip_reason(self, what: str, need_s: float) -> str | None:
        """Why ``what`` (estimated ``need_s`` seconds) cannot run now, or None."""
        left = self.left()
        if need_s <= left:
            return None
        return (
            f"{what}: skipped, needs ~{need_s:.0f} s and {max(left, 0):.0f} s of "
            f"--budget-s {self.total_s:g} are left"
        )


@dataclasses.dataclass(frozen=True)
class Part:
    """One check of the suite.

    Attributes:
        name: the ``--parts`` name and JSON key.
        title: the Markdown section's title.
        run: ``run(dry_run, budget) -> dict`` with ``md`` (Markdown lines) and
            the figures; ``skipped`` lists the reasons of sub-steps not run.
        estimate_s: ``(on a GPU, dry run on 2 CPU cores)`` seconds.
    """

    name: str
    title: str
    run: Callable[[bool, Budget], dict]
    estimate_s: tuple[float, float]


# --- 1. 8-bit against bf16 ----------------------------------------------------


def eight_bit_variants(
    size: str, dry_run: bool, recipes: bool = True
) -> dict[str, Callable]:
    """fp32, bf16, int8 and FP8 losses of ``gpu_attention``'s model ``size``.

    The 8-bit policies keep their default size rules (torchao's H100
    crossovers) except in a dry run, whose tiny matmuls they would all skip.
    With ``recipes``, ``jaxamp int8 wgrad`` (and ``... nearest``) run the
    weight gradient in int8 too (and round gradients to nearest): the bound of
    int8's speed on a GPU once the recipe gives up SwitchBack's 16-bit weight
    gradient (and unbiased rounding), timed beside the default recipe. On a
    CPU (not a dry run: the compile-only tools), ``jaxamp 8-bit <target>``
    is :func:`jaxamp.eight_bit_policy` for each of :data:`TARGET_KINDS`.
    """
    base = ga.make_loss(size, None, hand=False)
    kw = {"size_rule": None} if dry_run else {}
    amp = lambda policy: jaxamp.amp(base, compute_dtype=BF16, amp_policy=policy)
    found = {
        "fp32": base,
        "jaxamp bf16": jaxamp.amp(base, compute_dtype=BF16),
        "jaxamp int8": amp(jaxamp.int8_policy(**kw)),
        "jaxamp fp8": amp(jaxamp.fp8_policy(**kw)),
    }
    if recipes:
        found["jaxamp int8 wgrad"] = amp(jaxamp.int8_policy(wgrad=True, **kw))
        found["jaxamp int8 wgrad nearest"] = amp(
            jaxamp.int8_policy(wgrad=True, stochastic_rounding=False, **kw)
        )
    if not dry_run and jax.default_backend() == "cpu":
        # Compiled for a target on a CPU (tpu_roofline.py, gpu_roofline.py
        # --gpu): the chip's choice for each target, by name. On a GPU the
        # chip's choice is "jaxamp fp8" (H100, B200) or "jaxamp int8" (A100).
        for target, kind in TARGET_KINDS.items():
            found[f"jaxamp 8-bit {target}"] = amp(jaxamp.eight_bit_policy(kind))
    return found


# The device kinds of the compile-only targets (tpu_target.py's topologies;
# gpu_target.py's H100 and gpu_roofline.py's --gpu a100 / b200 target texts).
TARGET_KINDS = {
    "v5e": "TPU v5 lite",
    "v6e": "TPU v6 lite",
    "v5p": "TPU v5",
    "tpu7x": "TPU7x",
    "h100": "NVIDIA H100 80GB HBM3",
    "b200": "NVIDIA B200",
    "a100": "NVIDIA A100-SXM4-80GB",
}


EIGHT_BIT_COLUMNS = [
    ("step ms", "step_ms", "{:.1f}"),
    ("speed vs bf16", "speedup_vs_bf16", "{:.2f}x"),
    ("MFU (bf16 peak)", "mfu", "{:.1%}"),
    ("8-bit FLOP share", "eight_bit_flop_share", "{:.2f}"),
    ("temp MiB", "temp_mib", "{:.0f}"),
    ("grad rel. L2 vs fp32", "grad_rel_l2", "{:.1e}"),
    ("loss diff", "loss_diff", "{:.1e}"),
    ("compile s", "compile_s", "{:.1f}"),
]


def part_eight_bit(dry_run: bool, budget: Budget) -> dict:
    """Part 1: :func:`eight_bit_variants` at gpt4096 (4k tokens a step)."""
    return eight_bit_rows("tiny" if dry_run else "gpt4096", dry_run)


def part_eight_bit_16k(dry_run: bool, budget: Budget) -> dict:
    """Part 1b: the same at 16k tokens a step (``gpt4096_16k``, batch 32). A
    dry run builds the variants at that size (shapes only, no compile) and
    measures them at ``tiny``, where part 1's dry run has measured them
    already if it ran."""
    if dry_run:  # the full size builds: its variants, its shapes
        eight_bit_variants("gpt4096_16k", False, recipes=False)
        x = jax.eval_shape(lambda: ga.init("gpt4096_16k"))[1]
        if x.shape[0] * x.shape[1] < 16384:
            raise ValueError(f"gpt4096_16k's batch has {x.shape} tokens, not 16k")
    return eight_bit_rows("tiny" if dry_run else "gpt4096_16k", dry_run, recipes=False)


# Dry runs' rows of eight_bit_rows per (size, variant): a variant measured at
# tiny size once, however many parts ask for it (figures of a dry run are not
# measurements).
_DRY_ROWS: dict[tuple[str, str], dict] = {}


def eight_bit_rows(size: str, dry_run: bool, recipes: bool = True) -> dict:
    """:func:`eight_bit_variants` of ``size`` through ``gpu_attention.measure``
    (interleaved timing, errors against float32) plus each variant's 8-bit FLOP
    share of its gradient jaxpr and its speed against bf16."""
    steps, rounds = (1, 1) if dry_run else (10, 5)
    found = eight_bit_variants(size, dry_run, recipes)
    if dry_run and all((size, n) in _DRY_ROWS for n in found):
        rows = [dict(_DRY_ROWS[size, n]) for n in found]
    else:
        rows = _eight_bit_measure(size, steps, rounds, found)
    if dry_run:
        _DRY_ROWS.update({(size, r["variant"]): dict(r) for r in rows})
    note = (
        "Dry run: every matmul quantized (`size_rule=None`), one step."
        if dry_run
        else "Default size rules (torchao's H100 crossovers); median of 5 "
        "interleaved rounds of 10 steps."
    )
    md = [ga.size_heading(size), "", note, "", *ga.table(rows, EIGHT_BIT_COLUMNS)]
    return {"size": size, "rows": rows, "md": md}


def _eight_bit_measure(size: str, steps: int, rounds: int, found: dict) -> list:
    """:func:`eight_bit_rows`' rows: ``gpu_attention.measure`` of ``found``
    with each variant's 8-bit FLOP share and speed against bf16."""
    rows = ga.measure(size, steps, rounds, found=found)
    shapes = jax.eval_shape(lambda: ga.init(size))
    bf16 = next(r for r in rows if r["variant"] == "jaxamp bf16")
    for r in rows:
        if "missing" in r:
            continue
        grad = jax.make_jaxpr(jax.grad(found[r["variant"]]))(*shapes)
        r["eight_bit_flop_share"] = jaxamp.tools.eight_bit_flop_share(grad)
        if "step_ms" in bf16:
            r["speedup_vs_bf16"] = bf16["step_ms"] / r["step_ms"]
    return rows


# --- 1c. one GEMM: bf16 against FP8 and s8 ------------------------------------

# (M, K, N) of the probe: 8192^3 and gpt4096's four per-layer products at 4k tokens
GEMM_SHAPES = [(8192, 8192, 8192), (4096, 4096, 12288), (4096, 4096, 4096),
               (4096, 4096, 16384), (4096, 16384, 4096)]  # fmt: skip
GEMM_COLUMNS = [  # the table's first column ("variant") is the shape M x K x N
    ("bf16 TFLOP/s", "bf16_tflops", "{:.0f}"),
    ("FP8 TFLOP/s", "fp8_tflops", "{:.0f}"),
    ("s8 TOP/s", "s8_tflops", "{:.0f}"),
    ("FP8 / bf16", "fp8_vs_bf16", "{:.2f}x"),
    ("s8 / bf16", "s8_vs_bf16", "{:.2f}x"),
]


def gemm_products() -> dict[str, Callable]:
    """The three GEMMs of the probe on operands already in their dtype: bf16 x
    bf16 -> bf16; E4M3 x E4M3 -> bf16 times a float32 scale (the pattern XLA
    folds into one cuBLASLt FP8 call, as ``jaxamp.quant.fp8_dot_general``
    binds it); s8 x s8 -> s32 (what ``jaxamp.int8_policy`` binds)."""
    nn = (((1,), (0,)), ((), ()))
    dot = jax.lax.dot_general
    return {
        "bf16": lambda a, b, s: dot(a, b, nn, preferred_element_type=BF16),
        "fp8": lambda a, b, s: (
            dot(a, b, nn, preferred_element_type=BF16) * s.astype(BF16)
        ),
        "s8": lambda a, b, s: dot(a, b, nn, preferred_element_type=jnp.int32),
    }


def part_gemm_probe(dry_run: bool, budget: Budget) -> dict:
    """Part 1c: the rate of one bf16, FP8 and s8 GEMM at :data:`GEMM_SHAPES`
    (median of 5 rounds of 20 calls each, the three interleaved): the s8
    rate on an H100 has never been measured, and int8's size rule needs it."""
    shapes = [(64, 64, 64)] if dry_run else GEMM_SHAPES
    reps, rounds = (2, 1) if dry_run else (20, 5)
    dtypes = {"bf16": BF16, "fp8": jnp.float8_e4m3fn, "s8": jnp.int8}
    rows = []
    for m, k, n in shapes:
        key = jax.random.key(m + k + n)
        a32 = jax.random.normal(key, (m, k), jnp.float32)
        b32 = jax.random.normal(jax.random.fold_in(key, 1), (k, n), jnp.float32)
        scale = jnp.asarray(1.0, jnp.float32)
        fns, args = {}, {}
        for name, fn in gemm_products().items():
            dt = dtypes[name]
            args[name] = (a32.astype(dt), b32.astype(dt), scale)
            fns[name] = jax.jit(fn)
            jax.block_until_ready(fns[name](*args[name]))  # compile
        times = {name: [] for name in fns}
        for _ in range(rounds):
            for name, fn in fns.items():
                t0 = time.perf_counter()
                for _ in range(reps):
                    out = fn(*args[name])
                jax.block_until_ready(out)
                times[name].append((time.perf_counter() - t0) / reps)
        row = {"variant": f"{m} x {k} x {n}", "shape": [m, k, n]}
        flops = 2 * m * k * n
        for name in fns:
            row[f"{name}_tflops"] = flops / statistics.median(times[name]) / 1e12
        for name in ("fp8", "s8"):
            row[f"{name}_vs_bf16"] = row[f"{name}_tflops"] / row["bf16_tflops"]
        rows.append(row)
    md = [
        "One GEMM on operands already in its dtype (no quantization), jitted; "
        f"median of {rounds} interleaved rounds of {reps} calls. FP8: E4M3 x E4M3 "
        "-> bf16 times a float32 scale; s8: s8 x s8 -> s32.",
        "",
        *ga.table(rows, GEMM_COLUMNS),
    ]
    return {"rows": rows, "md": md}


# --- 2. the gpt1024 step --------------------------------------------------------

GPT1024_VARIANTS = ["fp32", "jaxamp bf16", "hand bf16 cudnn", "jmp bf16", "mpx bf16"]


def part_gpt1024(dry_run: bool, budget: Budget) -> dict:
    """Part 2: ``gpu_attention.measure`` of :data:`GPT1024_VARIANTS`.

    Raises:
        ValueError: if ``gpu_attention.py`` no longer has one of them.
    """
    missing = set(GPT1024_VARIANTS) - set(ga.variants("tiny"))
    if missing:
        raise ValueError(f"gpu_attention.py has no variants {sorted(missing)}")
    size = "tiny" if dry_run else "gpt1024"
    steps, rounds = (1, 1) if dry_run else (10, 5)
    # A dry run leaves out the peers (each one compile; gpu_attention's test
    # runs them): on the GPU they are the comparison.
    only = GPT1024_VARIANTS[:3] if dry_run else GPT1024_VARIANTS
    rows = ga.measure(size, steps, rounds, only=only)
    md = [ga.size_heading(size), "", *ga.table(rows)]
    return {"size": size, "rows": rows, "md": md}


# --- 3. 200 float16 steps of the main job ------------------------------------------


def fp16_config(dry_run: bool) -> tc.Config:
    """The main job's configuration (200 steps, no sampling); tiny in a dry run."""
    if dry_run:
        return tc.Config(
            steps=3, batch_size=2, seq_len=16, d_model=32, layers=1, heads=2,
            warmup=1, max_bytes=200_000, eval_batches=1, sample_chars=0,
        )  # fmt: skip
    return tc.Config(steps=200, sample_chars=0)


FP16_KEYS = [
    "val_loss",
    "skipped_steps",
    "forward_overflows",
    "final_loss_scale",
    "tokens_per_s",
    "wall_s",
]


def part_fp16_run(dry_run: bool, budget: Budget) -> dict:
    """Part 4: ``train_charlm.train`` in fp16 (dynamic loss scaling), then in
    bf16 if the time fp16 took is still left."""
    cfg = fp16_config(dry_run)
    data = tc.load_corpus(cfg.data_dir, cfg.max_bytes)
    runs, skipped = {}, []
    for mode in ("fp16", "bf16"):
        need = runs["fp16"]["wall_s"] if runs else 0.0
        reason = budget.skip_reason(f"mode {mode}", need)
        if reason:
            skipped.append(reason)
            continue
        r = tc.train(cfg, mode, data, progress=False)
        runs[mode] = {k: r[k] for k in FP16_KEYS}
    lines = [
        f"examples/train_charlm.py's model: d_model {cfg.d_model}, {cfg.layers} "
        f"layers, seq {cfg.seq_len}, batch {cfg.batch_size}; {cfg.steps} steps, "
        "AdamW; fp16 with dynamic loss scaling (initial scale 2**15) and "
        "non-finite steps skipped.",
        "",
        "| mode | val loss | vs bf16 | skipped steps | forward overflows "
        "| final loss scale | tokens/s | wall s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for mode, r in runs.items():
        rel = (
            f"{r['val_loss'] - runs['bf16']['val_loss']:+.3f}" if "bf16" in runs else ""
        )
        tps = f"{r['tokens_per_s']:,.0f}" if r["tokens_per_s"] else ""
        lines.append(
            f"| {mode} | {r['val_loss']:.3f} | {rel} | {r['skipped_steps']} "
            f"| {r['forward_overflows']} | {r['final_loss_scale']:g} | {tps} "
            f"| {r['wall_s']:.1f} |"
        )
    return {
        "config": dataclasses.asdict(cfg),
        "runs": runs,
        "md": lines,
        "skipped": skipped,
    }


# --- 4. memory slopes ------------------------------------------------------------


def step_peak_bytes(step: Callable, args: tuple, donate_argnums: tuple) -> int:
    """Peak bytes of one jitted call: arguments + outputs - aliased + temp of
    XLA's ``compiled.memory_analysis()`` (compile only; ``args`` may be
    ``jax.ShapeDtypeStruct`` trees).

    Raises:
        RuntimeError: if the backend gives no memory analysis.
    """
    compiled = jax.jit(step, donate_argnums=donate_argnums).lower(*args).compile()
    m = compiled.memory_analysis()
    if m is None:
        raise RuntimeError(f"no memory_analysis() on {jax.default_backend()}")
    return (
        m.argument_size_in_bytes
        + m.output_size_in_bytes
        - m.alias_size_in_bytes
        + m.temp_size_in_bytes
    )


def peak_slope(build: Callable, layers: tuple[int, int]) -> dict:
    """Bytes per added parameter of a step's peak between two layer counts.

    Args:
        build: ``build(n_layers) -> (step, args, donate_argnums)``; ``args[0]``
            is the parameter tree (arrays or shape structs).
        layers: two layer counts, e.g. ``(4, 8)``.

    Returns:
        ``peak`` (bytes at each count), ``params`` (parameter counts),
        ``bytes_per_param`` (the slope), ``per_layer`` and ``fixed`` bytes.
    """
    peaks, counts = [], []
    for n in layers:
        step, args, donate = build(n)
        peaks.append(step_peak_bytes(step, args, donate))
        counts.append(sum(a.size for a in jax.tree.leaves(args[0])))
    per_layer = (peaks[1] - peaks[0]) / (layers[1] - layers[0])
    return {
        "layers": list(layers),
        "peak": peaks,
        "params": counts,
        "bytes_per_param": (peaks[1] - peaks[0]) / (counts[1] - counts[0]),
        "per_layer": per_layer,
        "fixed": peaks[0] - per_layer * layers[0],
    }


def has_residual_dtype() -> bool:
    """Whether ``jaxamp.amp`` takes ``residual_dtype=`` (FP8-stored residuals)."""
    return "residual_dtype" in inspect.signature(jaxamp.amp).parameters


def memory_variants() -> list:
    """``benchmarks/memory.py`` Variants of the memory part, each with and
    without ``jaxamp.skip_nonfinite_updates`` (the main job wraps its optimizer
    in it), and float16 with dynamic loss scaling; the FP8-residual one only
    where ``jaxamp.amp`` takes ``residual_dtype=``; bf16 parameters with the
    skip through ``jaxamp.optimizer_update`` (Equinox's form)."""
    import memory

    bf16 = lambda loss: jaxamp.amp(loss, compute_dtype=BF16)
    f16 = lambda loss: jaxamp.amp(loss, compute_dtype=jnp.float16)
    V = memory.Variant
    base = [
        V("amp bf16, f32 master", bf16),
        V("amp, bf16 params + SR, bf16 state", bf16, "bfloat16"),
        V("amp, bf16 params + SR, int8 state", bf16, "bfloat16", state="int8"),
    ]
    if has_residual_dtype():
        fp8 = lambda loss: jaxamp.amp(loss, compute_dtype=BF16, residual_dtype=E4M3)
        base.append(V("amp bf16, FP8 residuals, f32 master", fp8))
    base.append(V("amp float16 + dynamic scaling, f32 master", f16, scaler=True))
    out = []
    for v in base:
        out.append(dataclasses.replace(v, name=f"{v.name}, skip"))
        out.append(dataclasses.replace(v, name=f"{v.name}, no skip", skip=False))
    for v in base[1:3]:  # the Equinox form of the skip, bf16 parameters
        out.append(
            dataclasses.replace(
                v, name=f"{v.name}, optimizer_update", skip=False, optimizer_update=True
            )
        )
    return out


def memory_regimes(dry_run: bool) -> dict[str, tc.Config]:
    """name -> the main job's Config at a GPU-like width: seq 256, batch 1
    (issue 31's shape, where parameters and optimizer state dominate the
    step) and seq 1024, batch 8 (``benchmarks/memory.py``'s default shape);
    one tiny shape in a dry run."""
    if dry_run:
        return {
            "seq 8, batch 1": tc.Config(d_model=32, heads=2, seq_len=8, batch_size=1)
        }
    c = tc.Config(d_model=1024, heads=16)
    return {
        f"seq {t}, batch {b}": dataclasses.replace(c, seq_len=t, batch_size=b)
        for t, b in ((256, 1), (1024, 8))
    }


def main_job_step(variant, cfg: tc.Config) -> Callable:
    """``build(n_layers)`` for :func:`peak_slope`: ``benchmarks/memory.py``'s
    step of ``variant`` on shape structs (nothing allocated)."""
    import memory

    def build(n: int):
        _, opt, step, c = memory.setup(variant, dataclasses.replace(cfg, layers=n))
        params = jax.eval_shape(lambda: tc.initial_params(c))
        with jax.numpy_dtype_promotion("standard"):  # optax (see train_charlm)
            state = jax.eval_shape(opt.init, params)
        x = jax.ShapeDtypeStruct((c.batch_size, c.seq_len), jnp.int32)
        if variant.scaler:
            scaler = jax.eval_shape(jaxamp.DynamicScalerState)
            return step, (params, state, x, x, scaler), (0, 1)
        return step, (params, state, x, x), (0, 1)

    return build


MEMORY_LAYERS = (4, 8)  # the two layer counts of the slope
# The variants a dry run compiles, each with and without the skip wrapper; it
# lowers the others (FP8 residuals, the Equinox form of the skip): each compile
# costs seconds on a CPU.
DRY_COMPILED = (
    "amp bf16, f32 master,",
    "amp, bf16 params + SR, int8 state,",
    "amp float16 + dynamic scaling, f32 master,",
)
MEMORY_COLUMNS = [
    ("shape", "regime", "{}"),
    ("B per added param", "bytes_per_param", "{:.2f}"),
    ("MiB per layer", "per_layer_mib", "{:.1f}"),
    ("fixed MiB", "fixed_mib", "{:.0f}"),
    (
        "peak MiB at {} / {} layers".format(*MEMORY_LAYERS),
        "peak_mib",
        "{0[0]:.0f} / {0[1]:.0f}",
    ),
]


def part_memory(dry_run: bool, budget: Budget) -> dict:
    """Part 3: :func:`peak_slope` of each :func:`memory_variants` entry in each
    :func:`memory_regimes` regime, while the last one's time is left."""
    layers = MEMORY_LAYERS
    rows, skipped, last_s = [], [], 0.0
    if not has_residual_dtype():
        skipped.append(
            "FP8 residuals: skipped, jaxamp.amp has no residual_dtype= (issue 32)"
        )
    regimes, variants = memory_regimes(dry_run), memory_variants()
    width = next(iter(regimes.values())).d_model
    lowered_only = []
    if dry_run:  # compile only, but each compile costs seconds on the CPU
        variants = [v for v in variants if "bf16 state" not in v.name]
        lowered_only = [
            v
            for v in variants
            if not (v.name.startswith(DRY_COMPILED) and v.name.endswith("skip"))
        ]
        variants = [v for v in variants if v not in lowered_only]
    for regime, cfg in regimes.items():
        for v in lowered_only:  # a dry run checks that they build
            for n in layers:
                step, args, donate = main_job_step(v, cfg)(n)
                jax.jit(step, donate_argnums=donate).lower(*args)
        for v in variants:
            reason = budget.skip_reason(f"{v.name}, {regime}", last_s)
            if reason:
                skipped.append(reason)
                continue
            t0 = time.perf_counter()
            fit = peak_slope(main_job_step(v, cfg), layers)
            last_s = time.perf_counter() - t0
            mib = {f"{k}_mib": fit[k] / 2**20 for k in ("per_layer", "fixed")}
            mib["peak_mib"] = [b / 2**20 for b in fit["peak"]]
            rows.append({"variant": v.name, "regime": regime, **fit, **mib})
    lines = [
        f"The main job's GPT (examples/train_charlm.py) at d_model {width}, its "
        f"AdamW (clipping, schedule), layers {layers[0]} and {layers[1]}; peak = "
        "arguments + outputs - "
        "aliased + temp of the donated step's `memory_analysis()`.",
        "",
        *ga.table(rows, MEMORY_COLUMNS),
    ]
    if lowered_only:
        names = ", ".join(v.name for v in lowered_only)
        lines += ["", f"Dry run: lowered at both layer counts, not compiled: {names}."]
    out = {"rows": rows, "md": lines, "skipped": skipped}
    return {**out, "lowered_only": [v.name for v in lowered_only]}


# --- 5. compile time ----------------------------------------------------------------


def compile_variants(size: str) -> tuple[dict[str, Callable], str | None]:
    """jaxamp bf16 and the hand-written bf16 loss with cuDNN attention, or
    with XLA attention (and the reason) where cuDNN cannot be lowered here."""
    shapes = jax.eval_shape(lambda: ga.init(size))
    hand = ga.make_loss(size, "cudnn", hand=True)
    note = None
    try:  # lowering is enough: JAX refuses cuDNN attention there
        with ga._warnings_quiet():
            jax.jit(jax.grad(hand)).lower(*shapes)
        name = "hand bf16 cudnn"
    except Exception as e:
        why = ga._unavailable(e).rstrip(".")
        note = f"hand bf16 cudnn {why}: hand bf16 xla instead."
        hand, name = ga.make_loss(size, "xla", hand=True), "hand bf16 xla"
    base = ga.make_loss(size, None, hand=False)
    return {"jaxamp bf16": jaxamp.amp(base, compute_dtype=BF16), name: hand}, note


def part_compile(dry_run: bool, budget: Budget) -> dict:
    """Part 5: trace, lowering and compile seconds of :func:`compile_variants`."""
    size = "tiny" if dry_run else "gpt1024"
    repeats = 1 if dry_run else 2
    fns, note = compile_variants(size)
    shapes = jax.eval_shape(lambda: ga.init(size))
    trace = _run._trace_times(fns, shapes, repeats)
    lower: dict[str, list[float]] = {n: [] for n in fns}
    comp: dict[str, list[float]] = {n: [] for n in fns}
    for _ in range(repeats):  # interleaved, caches cleared before each
        for name, f in fns.items():
            jax.clear_caches()
            step = ga.sgd_step(jax.value_and_grad(f))
            t0 = time.perf_counter()
            lowered = jax.jit(step, donate_argnums=0).lower(*shapes)
            t1 = time.perf_counter()
            with ga._warnings_quiet():
                lowered.compile()
            lower[name].append(t1 - t0)
            comp[name].append(time.perf_counter() - t1)
    rows = [
        {
            "variant": n,
            "trace_s": trace[n],
            "lower_s": statistics.median(lower[n]),
            "compile_s": statistics.median(comp[n]),
        }
        for n in fns
    ]
    for r in rows:
        r["total_s"] = r["lower_s"] + r["compile_s"]
    hand = rows[1]
    for r in rows:
        r["vs_hand"] = r["total_s"] / hand["total_s"]
    columns = [
        ("trace s", "trace_s", "{:.2f}"),
        ("lower s", "lower_s", "{:.2f}"),
        ("compile s", "compile_s", "{:.2f}"),
        ("lower + compile s", "total_s", "{:.2f}"),
        (f"vs {hand['variant']}", "vs_hand", "{:.2f}x"),
    ]
    lines = [ga.size_heading(size), ""]
    if note:
        lines += [note, ""]
    lines += [
        f"Median of {repeats} interleaved repeats, `jax.clear_caches()` before "
        "each; trace: `make_jaxpr(value_and_grad)`; lower and compile: the "
        "donated SGD step.",
        "",
        *ga.table(rows, columns),
    ]
    return {"size": size, "rows": rows, "md": lines}


# --- the precision debugger at depth ---------------------------------------------

PRECISION_COLUMNS = [
    ("amp step first call s", "step_first_call_s", "{:.2f}"),
    ("report + top() s", "top_s", "{:.2f}"),
    ("ratio", "top_ratio", "{:.2f}x"),
    ("full report s", "report_s", "{:.2f}"),
    ("ratio", "ratio", "{:.2f}x"),
    ("records", "records", "{}"),
    ("top scope", "top", "{}"),
]


def part_precision(dry_run: bool, budget: Budget) -> dict:
    """Part 4: ``benchmarks/precision_report.py``'s depth sweep at 4 and 24
    scanned layers, each row in a fresh process (dry run: 1 and 2 at width
    32, in this process): the report's time over the jitted amp step's first
    call."""
    import precision_report as pr

    depths, size = ((1, 2), "32,16,2") if dry_run else ((4, 24), "256,128,8")
    rows, skipped = [], []
    for layers in depths:
        # the deeper row costs about twice the shallower one
        need = 2 * rows[0]["wall_s"] if rows else 0.0
        reason = budget.skip_reason(f"precision_report at {layers} layers", need)
        if reason:
            skipped.append(reason)
            continue
        t0 = time.perf_counter()
        if dry_run:  # in this process: a dry run checks, it does not time
            row = pr.depth_row(layers, *(int(v) for v in size.split(",")))
        else:
            row = pr._fresh(["--row", "depth", str(layers), "--size", size])
        wall = time.perf_counter() - t0
        name = f"{layers} layer" + "s" * (layers > 1)
        rows.append({**row, "variant": name, "wall_s": wall})
    width, seq, batch = size.split(",")
    lines = [
        f"`benchmarks/precision_report.py`'s scoped GPT (layers in `lax.scan`, "
        f"scopes attn / mlp / head), width {width}, seq {seq}, batch {batch}, "
        "bf16 default policy; each row in a fresh process. Ratios: "
        "`precision_report(...)` and `report.top()` (the ranking), then the "
        "full report (its printout, which runs the per-equation analysis), "
        "over the jitted amp step's first call (trace, compile, run), in the "
        "same process.",
        "",
        *ga.table(rows, PRECISION_COLUMNS),
    ]
    out = {"size": size, "rows": rows, "skipped": skipped, "md": lines}
    if len(rows) == 2:
        out["ratio_growth"] = rows[1]["ratio"] / rows[0]["ratio"]
        lines += ["", f"Ratio at {depths[1]} / ratio at {depths[0]}: "
                  f"{out['ratio_growth']:.2f}"]  # fmt: skip
    return out


PARTS = [
    Part("eight_bit", "FP8 and int8 against bf16 (matmul-dominated GPT)",
         part_eight_bit, (130, 12)),
    Part("gemm_probe", "One GEMM: bf16 against FP8 and s8",
         part_gemm_probe, (30, 4)),
    Part("gpt1024", "The gpt1024 training step", part_gpt1024, (120, 12)),
    Part("memory", "Peak bytes per added parameter of the training step",
         part_memory, (60, 12)),
    Part("precision", "precision_report against the step, at depth",
         part_precision, (60, 16)),
    Part("fp16_run", "200 float16 steps of the main job, dynamic loss scaling",
         part_fp16_run, (40, 8)),
    Part("compile", "Compile time against the hand-written model",
         part_compile, (40, 6)),
    Part("eight_bit_16k", "FP8 and int8 against bf16 at 16k tokens a step",
         part_eight_bit_16k, (150, 12)),
]  # fmt: skip


def run_parts(
    parts: list[Part],
    dry_run: bool,
    budget: Budget,
    after_each: Callable[[dict], None] = lambda results: None,
) -> dict[str, dict]:
    """Run ``parts`` in order within ``budget``: a part whose estimate exceeds
    the time left is skipped with a printed reason; one that raises is
    recorded with its traceback and the next runs. Estimates are scaled by
    how much slower than estimated the parts run so far were (never below
    1x), so a slow machine stops early rather than overrun. ``after_each
    (results)`` is called after every part (the results so far), e.g. to
    write them."""
    out: dict[str, dict] = {}
    estimated = spent = 0.0
    for part in parts:
        est = part.estimate_s[1 if dry_run else 0]
        need = est * max(1.0, spent / estimated if estimated else 1.0)
        reason = budget.skip_reason(part.name, need)
        if reason:
            print(f"[{part.name}] {reason}", flush=True)
            out[part.name] = {"skipped": [reason]}
            after_each(out)
            continue
        print(f"[{part.name}] {part.title} (~{need:.0f} s) ...", flush=True)
        t0, c0 = time.perf_counter(), _cpu_s()
        try:
            res = part.run(dry_run, budget)
        except Exception as e:
            tb = traceback.format_exc()
            print(tb, flush=True)
            res = {"error": f"{type(e).__name__}: {e}", "traceback": tb}
        res["seconds"] = time.perf_counter() - t0
        res["cpu_seconds"] = _cpu_s() - c0
        estimated, spent = estimated + est, spent + res["seconds"]
        for r in res.get("skipped", []):
            print(f"[{part.name}] {r}", flush=True)
        print(
            f"[{part.name}] done in {res['seconds']:.1f} s "
            f"({res['cpu_seconds']:.1f} s of CPU)",
            flush=True,
        )
        out[part.name] = res
        after_each(out)
    return out


def _cpu_s() -> float:
    """CPU seconds (user and system) of this process and its waited-for
    children so far: a part's cost on a machine shared with other jobs,
    where its wall time is not."""
    import resource

    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


# --- the report -----------------------------------------------------------------------


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _command_output(cmd: list[str]) -> str:
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=20, cwd=ROOT)
    except (OSError, subprocess.SubprocessError):
        return ""
    return r.stdout.strip() if r.returncode == 0 else ""


def machine_meta(argv: list[str], note: str, dry_run: bool) -> dict:
    """The machine, versions, date and command of this run."""
    dev = jax.devices()[0]
    cpu = next(
        (
            ln.split(":", 1)[1].strip()
            for ln in _command_output(["lscpu"]).splitlines()
            if ln.startswith("Model name")
        ),
        platform.processor() or platform.machine(),
    )
    driver = _command_output(
        ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
    )
    now = datetime.datetime.now(datetime.timezone.utc)
    return {
        "date": now.strftime("%Y-%m-%d"),
        "time_utc": now.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": "python benchmarks/gpu_suite.py " + shlex.join(argv),
        "dry_run": dry_run,
        "note": note,
        "backend": jax.default_backend(),
        "device": getattr(dev, "device_kind", dev.platform),
        "device_count": jax.device_count(),
        "driver": driver.splitlines()[0] if driver else "",
        "cpu": cpu,
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jaxlib": _version("jaxlib"),
        "jaxamp": getattr(jaxamp, "__version__", "?"),
        "commit": _command_output(["git", "rev-parse", "--short", "HEAD"])
        or "unknown (no git checkout)",
        "optax": _version("optax"),
        "jmp": _version("jmp"),
        "mpx": _version("mixed-precision-for-jax"),
        "features": {"amp residual_dtype=": has_residual_dtype()},
    }


def readme_rows(meta: dict, parts: dict[str, dict]) -> list[str]:
    """The README's GPU rows, each with the date, from this run's figures."""
    where = f"{meta['device']}, {meta['date']}"
    link = "[RESULTS_GPU.md](benchmarks/RESULTS_GPU.md)"
    lines = []
    rows = {r["variant"]: r for r in parts.get("gpt1024", {}).get("rows", [])}
    cell = lambda n, k, f: f.format(rows[n][k]) if k in rows.get(n, {}) else "-"
    if rows:
        lines += [
            f"| step time, gpt1024 on one {where} | "
            f"{cell('jaxamp bf16', 'step_ms', '{:.1f} ms')} | "
            f"{cell('hand bf16 cudnn', 'step_ms', '{:.1f} ms')} (with cuDNN) | "
            f"{cell('jmp bf16', 'step_ms', '{:.1f}')} / "
            f"{cell('mpx bf16', 'step_ms', '{:.1f} ms')} | {link} |",
            f"| gradient error, gpt1024 on one {where} | "
            f"{cell('jaxamp bf16', 'grad_rel_l2', '{:.1e}')} | "
            f"{cell('hand bf16 cudnn', 'grad_rel_l2', '{:.1e}')} | "
            f"{cell('jmp bf16', 'grad_rel_l2', '{:.1e}')} / "
            f"{cell('mpx bf16', 'grad_rel_l2', '{:.1e}')} | {link} |",
        ]
    eight = {r["variant"]: r for r in parts.get("eight_bit", {}).get("rows", [])}
    if "speedup_vs_bf16" in eight.get("jaxamp int8", {}):
        i8, f8 = eight["jaxamp int8"], eight.get("jaxamp fp8", {})
        lines += [
            "",
            f"8-bit on one {where} ({parts['eight_bit']['size']}): int8 "
            f"{i8['speedup_vs_bf16']:.2f}x bf16's speed "
            f"({i8['eight_bit_flop_share']:.0%} of matmul FLOPs in 8 bits), FP8 "
            f"{f8.get('speedup_vs_bf16', float('nan')):.2f}x "
            f"({f8.get('eight_bit_flop_share', float('nan')):.0%}) {link}",
        ]
    return lines


def markdown(meta: dict, parts: dict[str, dict], wall_s: float, budget_s: float) -> str:
    lines = [
        "# GPU checks: benchmarks/gpu_suite.py",
        "",
        f"Measured {meta['date']} ({meta['time_utc']}) on {meta['device']} "
        f"(backend {meta['backend']}, driver {meta['driver'] or 'n/a'}; CPU "
        f"{meta['cpu']}). Python {meta['python']}, JAX {meta['jax']}, jaxlib "
        f"{meta['jaxlib']}, jaxamp {meta['jaxamp']} (commit {meta['commit']}), "
        f"optax {meta['optax']}, jmp {meta['jmp']}, mpx {meta['mpx']}."
        + (f" {meta['note']}." if meta["note"] else ""),
        "",
        f"Command: `{meta['command']}` (JSON: `RESULTS_GPU.json`). Wall "
        f"{wall_s:.0f} s, budget {budget_s:g} s.",
        "",
    ]
    if meta["dry_run"]:
        lines += [
            "**Dry run** on the CPU at tiny sizes: it checks that every part "
            "runs; its timings are not measurements.",
            "",
        ]
    rows = readme_rows(meta, parts)
    if rows:
        lines += ["## README rows", "", *rows, ""]
    titles = {p.name: p.title for p in PARTS}
    for name, res in parts.items():
        lines += [f"## {titles[name]} (`{name}`, {res.get('seconds', 0):.0f} s)", ""]
        if "error" in res:
            lines += [f"Failed: {res['error']}", ""]
            continue
        if res.get("md"):
            lines += [*res["md"], ""]
        if res.get("skipped"):
            lines += [f"- {r}" for r in res["skipped"]] + [""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes")
    ap.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="seconds for all parts (default 450; dry run 300)",
    )
    ap.add_argument(
        "--parts",
        default=",".join(p.name for p in PARTS),
        help="comma-separated subset, run in the suite's order",
    )
    ap.add_argument("--out", default=None, help="folder for RESULTS_GPU.md/.json")
    ap.add_argument("--note", default="", help="free text for the header")
    args = ap.parse_args(argv)
    names = [n for n in args.parts.split(",") if n]
    unknown = sorted(set(names) - {p.name for p in PARTS})
    if unknown:
        ap.error(f"--parts: unknown {unknown}; choose from {[p.name for p in PARTS]}")
    if not args.dry_run and jax.default_backend() != "gpu":
        print(
            f"error: JAX sees no GPU (backend {jax.default_backend()}); "
            "use --dry-run on a CPU",
            file=sys.stderr,
        )
        return 2
    if args.out is None:
        out = (
            Path(tempfile.mkdtemp(prefix="gpu_suite_"))
            if args.dry_run
            else ROOT / "benchmarks"
        )
    else:
        out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    budget_s = args.budget_s
    if budget_s is None:
        budget_s = 300.0 if args.dry_run else 450.0
    budget = Budget(budget_s, start=T_START)  # imports and JAX start count
    meta = machine_meta(argv, args.note, args.dry_run)
    print(f"{meta['device']}, JAX {meta['jax']}, budget {budget_s:g} s", flush=True)

    def write(results: dict[str, dict]) -> str:
        # after every part: a run stopped from outside keeps what it measured
        wall = budget.total_s - budget.left()
        md = markdown(meta, results, wall, budget_s)
        (out / "RESULTS_GPU.md").write_text(md + "\n")
        data = {
            "meta": {**meta, "wall_s": wall, "budget_s": budget_s},
            "parts": {
                k: {f: v for f, v in r.items() if f != "md"} for k, r in results.items()
            },
        }
        (out / "RESULTS_GPU.json").write_text(json.dumps(data, indent=1, default=float))
        return md

    chosen = [p for p in PARTS if p.name in names]
    parts = run_parts(chosen, args.dry_run, budget, after_each=write)
    print(write(parts))
    print(f"\nwrote {out / 'RESULTS_GPU.md'} and {out / 'RESULTS_GPU.json'}")
    return 1 if any("error" in r for r in parts.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
