"""What ``jaxamp.precision_report`` costs, and whether its ranking names the
scope whose fix buys the most.

    python benchmarks/precision_report.py                  # both tables
    python benchmarks/precision_report.py --depth 4 --depth 24
    python benchmarks/precision_report.py --ranking
    python benchmarks/precision_report.py --depth 1 --depth 2 --size 32,16,2
    python benchmarks/precision_report.py --breakdown 4 --breakdown 24
    python benchmarks/precision_report.py --timeline 4 --timeline 24
    python benchmarks/precision_report.py --fidelity

**Depth sweep** (``--depth``): against the first call (trace, compile, run)
of the jitted amp training step of the same model, in one process, side by
side: ``precision_report(...)`` then ``report.top()`` (the ranking alone),
then the full report (``str(report)``, whose equation table runs the
per-equation analysis). The model is the scoped reference GPT
(``common.gpt_loss(scopes=True)``, as ``benchmarks/quantized.py``'s: layers in
``lax.scan``, named scopes ``attn`` / ``mlp`` / ``head``) at width 256, seq
128, batch 8 with 4, 12 or 24 layers, under bf16 (the default
policy). Each row runs in a fresh process (JAX started by one tiny jitted call
first). Other processes may
share the CPU: compare the ratio, not absolute times.

**Ranking against ablation** (``--ranking``): per case, the report's
share of the squared gradient error each scope's restoring removes
(:meth:`jaxamp.tools.PrecisionReport.scopes`, measured inside the report by
amp's step with that scope alone overridden) against a reference ablation
compiled separately per scope after the report (``report.runner.errors``: amp
re-run with that scope alone overridden, an 8-bit scope to the compute dtype,
a bf16 scope to float32, as ``suggest`` does), ``1 - (error /
error_all)**2``; "max diff" is the largest difference of a scope's two
shares, in points.

**Timeline** (``--timeline``): one report and its printout on the depth
sweep's model, each part (each step's trace, and its compile and run; the
scope discovery; the analysis' trace, compile and run) with the thread it ran
in and its start and end, in seconds from the report's start: what the second
thread overlaps.

**Fidelity** (``--fidelity``): how far an ablation's shares are a property of
the policy and not of the compiled program: per case, the shares of a reference
ablation (amp's step per scope overridden, as ``--ranking``'s) compiled with
XLA's default options and again with ``xla_allow_excess_precision=False``
(every rounding to bfloat16 the program asks for is made; by default XLA may
keep a bfloat16 value in float32 between fused operations). "max diff" is the
largest difference of a scope's two shares, in points.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
import run as gpt_bench  # noqa: E402

import jaxamp  # noqa: E402
from jaxamp._tools._precision_suggest import _override, policy_key  # noqa: E402


def model(size: str):
    """``(loss(params, x, y), params, x, y)``: the scoped GPT with its head
    weight as ``params["head"]``."""
    params, x, y = gpt_bench.init(size)
    params = {**params, "head": params["emb"]}
    loss = common.gpt_loss(gpt_bench.SIZES[size], scopes=True, head="head")
    return loss, params, x, y


def _size(width: int, layers: int, seq: int, batch: int) -> str:
    """Register a ``benchmarks/run.py`` size (4 heads, vocabulary 256)."""
    name = f"w{width}-L{layers}-T{seq}-B{batch}"
    gpt_bench.SIZES[name] = (width, layers, seq, batch, 4, 256)
    return name


def depth_row(layers: int, width: int = 256, seq: int = 128, batch: int = 8) -> dict:
    """Time the first call of the jitted amp step, then the report."""
    loss, params, x, y = model(_size(width, layers, seq, batch))
    f = jaxamp.amp(loss, compute_dtype=jnp.bfloat16)
    t0 = time.perf_counter()
    jax.block_until_ready(jax.jit(jax.value_and_grad(f))(params, x, y))
    step = time.perf_counter() - t0
    t0 = time.perf_counter()
    report = jaxamp.precision_report(loss, params, x, y, compute_dtype=jnp.bfloat16)
    top = report.top(1)[0]
    ranked = time.perf_counter() - t0
    text = str(report)  # the printout: its equation table runs the analysis
    took = time.perf_counter() - t0
    return {
        "layers": layers,
        "size": [width, seq, batch],
        "step_first_call_s": step,
        "top_s": ranked,
        "top_ratio": ranked / step,
        "report_s": took,
        "ratio": took / step,
        "printout_lines": len(text.splitlines()),
        "top": top,
        "ranking": report.ranking,
        "grad_error": report.grad_error,
        "records": len(report.records),
    }


def breakdown_row(
    layers: int, width: int = 256, seq: int = 128, batch: int = 8
) -> dict:
    """Where the report's time goes, each part run alone (no second thread):
    the first call of the jitted step, the analysis' trace, compile and run,
    and each step the ranking compiles (amp's own and one per measured scope)
    under default options and under the analysis' fast ones
    (``_compat.compile_analysis``)."""
    from jaxamp import _compat
    from jaxamp._tools import _precision_ablate, _precision_records, _precision_report

    loss, params, x, y = model(_size(width, layers, seq, batch))
    args, cd, policy = (params, x, y), np.dtype(jnp.bfloat16), jaxamp.default_amp_policy
    f = jaxamp.amp(loss, compute_dtype=cd)
    t0 = time.perf_counter()
    jax.block_until_ready(jax.jit(jax.value_and_grad(f))(params, x, y))
    row = {"layers": layers, "step_first_call_s": time.perf_counter() - t0}
    t0 = time.perf_counter()
    trace = _precision_report._trace(loss, args, {}, cd, policy, False)
    analysis = _precision_records.Analysis(trace, {}, 1.0)
    lowered, box = _precision_records.lower_walk(*trace, analysis.fmt, 1.0)
    t1 = time.perf_counter()
    compiled = _compat.compile_analysis(lowered)
    t2 = time.perf_counter()
    jax.block_until_ready(compiled(box["leaves"]))
    t3 = time.perf_counter()
    row.update(walk_trace_s=t1 - t0, walk_compile_s=t2 - t1, walk_run_s=t3 - t2)
    todo = _precision_ablate.plan(box["measure"], box["paths"], box["formats"], policy)
    policies = [policy] + [p for p, _, _ in todo.values()]
    for name, compile_fn in (
        ("default", lambda lw: lw.compile()),
        ("fast", _compat.compile_analysis),
    ):
        comp = run = 0.0
        for pol in policies:
            lw, dyn = _precision_report._amp_step(loss, args, {}, cd, pol, False, 1.0)
            t0 = time.perf_counter()
            c = compile_fn(lw)
            t1 = time.perf_counter()
            jax.block_until_ready(c(dyn))
            comp, run = comp + t1 - t0, run + time.perf_counter() - t1
        row[f"steps_{name}"] = [len(policies), comp, run]
    return row


def timeline_row(layers: int, width: int = 256, seq: int = 128, batch: int = 8) -> dict:
    """The first call of the jitted step, then one report with each of its
    parts logged: ``(part, thread, start, end)`` in seconds from the
    report's start."""
    import threading

    from jaxamp import _compat
    from jaxamp._tools import _precision_ablate, _precision_records, _precision_report

    t_start, log = [0.0], []

    def logged(module, name, part):
        fn = getattr(module, name)

        def wrapper(*args, **kwargs):
            t0 = time.perf_counter() - t_start[0]
            out = fn(*args, **kwargs)
            t1 = time.perf_counter() - t_start[0]
            log.append((part, threading.current_thread().name, t0, t1))
            return out

        setattr(module, name, wrapper)

    logged(_precision_report, "_f32_step", "float32 step trace")
    logged(_precision_report, "_amp_step", "amp step trace")
    logged(_precision_report, "find_scopes", "scope discovery")
    logged(_precision_ablate, "run_step", "step compile and run")
    logged(_precision_records, "lower_walk", "analysis trace")
    logged(_compat, "compile_analysis", "analysis compile")
    logged(_precision_records, "run_walk", "analysis compile and run")
    loss, params, x, y = model(_size(width, layers, seq, batch))
    f = jaxamp.amp(loss, compute_dtype=jnp.bfloat16)
    t0 = time.perf_counter()
    jax.block_until_ready(jax.jit(jax.value_and_grad(f))(params, x, y))
    first = time.perf_counter() - t0
    t_start[0] = time.perf_counter()
    report = jaxamp.precision_report(loss, params, x, y, compute_dtype=jnp.bfloat16)
    str(report)  # the printout: the analysis
    took = time.perf_counter() - t_start[0]
    log.sort(key=lambda r: r[2])
    return {"layers": layers, "step_first_call_s": first, "report_s": took, "log": log}


def _fidelity_cases() -> dict:
    """``name -> (loss, args, policy, scopes, override)``: the test's int8
    GPT with both rounding recipes, and the depth sweep's bf16 GPT."""
    import quantized

    params, x, y = gpt_bench.init("tiny")
    scoped = quantized.scoped_loss("tiny")

    def tiny_loss(p, x, y):
        return scoped({k: v for k, v in p.items() if k != "head"}, p["head"], x, y)

    tiny = (tiny_loss, ({**params, "head": params["emb"]}, x, y))
    scopes = ("attn", "mlp", "head")
    int8 = lambda sr: jaxamp.int8_policy(  # noqa: E731
        size_rule=None, quantize_last_matmul=True, stochastic_rounding=sr
    )
    loss, p, x2, y2 = model(_size(256, 4, 128, 8))
    f32 = {"amp_default": jaxamp.use_original_precision}
    return {
        "int8 (stochastic rounding), scanned GPT tiny": (
            *tiny, int8(True), scopes, jaxamp.default_amp_policy
        ),
        "int8 (round to nearest), scanned GPT tiny": (
            *tiny, int8(False), scopes, jaxamp.default_amp_policy
        ),
        "bf16, scanned GPT w256 L4 T128 B8": (
            loss, (p, x2, y2), jaxamp.default_amp_policy, scopes, f32
        ),
    }  # fmt: skip


def fidelity_row(name: str) -> dict:
    """One case's ablation shares under default options and without excess
    precision (see the module docstring)."""
    from jaxamp._tools import _precision_report

    loss, args, policy, scopes, override = _fidelity_cases()[name]
    g32 = jax.tree.leaves(jax.jit(jax.grad(loss))(*args))
    g32 = [np.asarray(g, np.float64) for g in g32]
    cd = np.dtype(jnp.bfloat16)
    out = {"case": name}
    for label, options in (("default", None), ("strict", _STRICT)):

        def error(pol, options=options):
            lw, dyn = _precision_report._amp_step(loss, args, {}, cd, pol, False, 1.0)
            _, got = lw.compile(options)(dyn)
            diffs = (np.asarray(a, np.float64) - b for a, b in zip(got, g32))
            return sum(float(np.sum(d**2)) for d in diffs)

        e0 = error(policy)
        out[label] = {
            "error": e0,
            "shares": {s: 1 - error({**policy, s: override}) / e0 for s in scopes},
        }
    return out


_STRICT = {"xla_allow_excess_precision": False}


def _fp8_layer_case():
    """The unrolled GPT of tests/test_precision_report.py (``common``, 3
    layers) in bf16 with FP8 in layer 2's MLP only."""
    loss = common.unrolled_gpt_loss(lambda i: "mlp")
    params = common.unrolled_gpt_init(jax.random.key(0))
    x, y = common.unrolled_gpt_batch()
    fp8 = jaxamp.fp8_policy(size_rule=None)
    return loss, params, x, y, {**jaxamp.default_amp_policy, "layer2/mlp": fp8}


def _scanned_case(size: str, policy):
    loss, params, x, y = model(size)
    return loss, params, x, y, policy


CASES = {
    "int8, scanned GPT w256 L4 T64 B8 (issue 33)": lambda: _scanned_case(
        _size(256, 4, 64, 8),
        jaxamp.int8_policy(size_rule=None, quantize_last_matmul=True),
    ),
    "int8, scanned GPT tiny": lambda: _scanned_case(
        "tiny", jaxamp.int8_policy(size_rule=None, quantize_last_matmul=True)
    ),
    "fp8, scanned GPT w256 L4 T64 B8": lambda: _scanned_case(
        _size(256, 4, 64, 8),
        jaxamp.fp8_policy(size_rule=None, quantize_last_matmul=True),
    ),
    "fp8 in layer2/mlp only, bf16 elsewhere": _fp8_layer_case,
}


def ranking_row(name: str) -> dict:
    """The report's ranking and the ablation's, for one case."""
    loss, params, x, y, policy = CASES[name]()
    t0 = time.perf_counter()
    report = jaxamp.precision_report(
        loss, params, x, y, compute_dtype=jnp.bfloat16, amp_policy=policy
    )
    took = time.perf_counter() - t0
    paths = report.paths
    est = {k: v for k, v in report.scopes("grad").items() if k}
    measured = {}
    for path in est:
        value, _ = _override(report, path)
        g, _ = report.runner.errors({**policy, policy_key(path, paths): value})
        measured[path] = 1 - (g / report.grad_error) ** 2
    ablation = dict(sorted(measured.items(), key=lambda kv: -kv[1]))
    return {
        "case": name,
        "grad_error": report.grad_error,
        "report_s": took,
        "estimate": est,
        "ablation": ablation,
        "ranking": report.ranking,
    }


def _fresh(args: list[str]) -> dict:
    """One row, run by this script in a fresh process; a failure raises
    ``RuntimeError`` with the end of the child's output."""
    cmd = [sys.executable, __file__, *args]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode:
        tail = (out.stdout + out.stderr)[-3000:]
        raise RuntimeError(f"{' '.join(args)} exited {out.returncode}:\n{tail}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _shares(d: dict, k: int = 4) -> str:
    return ", ".join(f"{s} {v:.0%}" for s, v in list(d.items())[:k])


def _max_diff(row: dict) -> float:
    """The largest difference, in points, of a scope's report and ablation
    shares."""
    est, abl = row["estimate"], row["ablation"]
    return max((100 * abs(est[k] - abl[k]) for k in abl), default=0.0)


def _size_arg(text: str) -> str:
    parts = text.split(",")
    if len(parts) != 3 or not all(v.isdigit() and int(v) > 0 for v in parts):
        raise argparse.ArgumentTypeError(
            f"--size takes width,seq,batch as three positive integers, got {text!r}"
        )
    return text


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--depth", type=int, action="append", help="layers in the scan")
    p.add_argument("--ranking", action="store_true", help="only the ranking table")
    p.add_argument(
        "--breakdown",
        type=int,
        action="append",
        help="where the report's time goes at this many layers (parts run alone)",
    )
    p.add_argument(
        "--size",
        default="256,128,8",
        type=_size_arg,
        help="depth sweep's width,seq,batch (default 256,128,8)",
    )
    p.add_argument(
        "--timeline",
        type=int,
        action="append",
        help="each part of one report at this many layers, with its thread",
    )
    p.add_argument(
        "--fidelity",
        action="store_true",
        help="ablation shares with XLA's excess precision on (default) and off",
    )
    p.add_argument("--row", nargs=2, help=argparse.SUPPRESS)  # kind, argument
    a = p.parse_args(argv)
    if a.row:  # one row, in a fresh process
        jax.block_until_ready(jax.jit(lambda v: v + 1)(jnp.ones(2)))  # JAX's start-up
        kind, arg = a.row
        size = (int(v) for v in a.size.split(","))
        if kind == "depth":
            row = depth_row(int(arg), *size)
        elif kind == "breakdown":
            row = breakdown_row(int(arg), *size)
        elif kind == "timeline":
            row = timeline_row(int(arg), *size)
        elif kind == "fidelity":
            row = fidelity_row(arg)
        else:
            row = ranking_row(arg)
        print(json.dumps(row))
        return 0
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}")
    if a.breakdown:
        print(
            "\n| layers | step first call (s) | analysis trace / compile / run (s) "
            "| steps | their compile / run, default options (s) "
            "| their compile / run, fast options (s) |"
        )
        print("|---|---|---|---|---|---|")
        for layers in a.breakdown:
            r = _fresh(["--row", "breakdown", str(layers), "--size", a.size])
            (n, cd, rd), (_, cf, rf) = r["steps_default"], r["steps_fast"]
            print(
                f"| {layers} | {r['step_first_call_s']:.2f} | {r['walk_trace_s']:.2f} "
                f"/ {r['walk_compile_s']:.2f} / {r['walk_run_s']:.2f} | {n} | "
                f"{cd:.2f} / {rd:.2f} | {cf:.2f} / {rf:.2f} |",
                flush=True,
            )
        return 0
    if a.timeline:
        for layers in a.timeline:
            r = _fresh(["--row", "timeline", str(layers), "--size", a.size])
            print(
                f"\n{layers} layers: step first call {r['step_first_call_s']:.2f} s, "
                f"report {r['report_s']:.2f} s\n"
            )
            print("| part | thread | start (s) | end (s) |")
            print("|---|---|---|---|")
            for part, thread, t0, t1 in r["log"]:
                print(f"| {part} | {thread} | {t0:.2f} | {t1:.2f} |")
        return 0
    if a.fidelity:
        print(
            "\n| case | squared grad error, default / strict | shares removed, "
            "default options | shares removed, no excess precision | max diff |"
        )
        print("|---|---|---|---|---|")
        for name in _fidelity_cases():
            r = _fresh(["--row", "fidelity", name])
            d, st = r["default"], r["strict"]
            diff = max(abs(d["shares"][k] - st["shares"][k]) for k in d["shares"])
            print(
                f"| {name} | {d['error']:.3e} / {st['error']:.3e} | "
                f"{_shares(d['shares'])} | {_shares(st['shares'])} | "
                f"{100 * diff:.1f} |",
                flush=True,
            )
        return 0
    if not a.ranking:
        print(
            "\n| layers | step first call (s) | report + top() (s) | ratio "
            "| full report: + printout (s) | ratio | records | top scope "
            "| grad error |"
        )
        print("|---|---|---|---|---|---|---|---|---|")
        ratios = {}
        for layers in a.depth or [4, 12, 24]:
            r = _fresh(["--row", "depth", str(layers), "--size", a.size])
            ratios[layers] = r["ratio"]
            print(
                f"| {layers} | {r['step_first_call_s']:.2f} | {r['top_s']:.2f} | "
                f"{r['top_ratio']:.2f}x | {r['report_s']:.2f} | {r['ratio']:.2f}x | "
                f"{r['records']} | {r['top']} | {r['grad_error']:.2e} |",
                flush=True,
            )
        lo, hi = min(ratios), max(ratios)
        if hi != lo:
            print(f"\nratio at {hi} / ratio at {lo}: {ratios[hi] / ratios[lo]:.2f}")
    if a.ranking or not a.depth:
        print(
            "\n| case | grad error | report top-1 | ablation top-1 | report "
            "(share removed) | ablation (share removed) | max diff | report (s) |"
        )
        print("|---|---|---|---|---|---|---|---|")
        for name in CASES:
            r = _fresh(["--row", "ranking", name])
            top_r, top_a = next(iter(r["estimate"])), next(iter(r["ablation"]))
            print(
                f"| {name} | {r['grad_error']:.2e} | {top_r} | {top_a} "
                f"{'(same)' if top_r == top_a else '(DIFFERENT)'} | "
                f"{_shares(r['estimate'])} | {_shares(r['ablation'])} | "
                f"{_max_diff(r):.1f} | {r['report_s']:.1f} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    np.set_printoptions(precision=3)
    sys.exit(main())
