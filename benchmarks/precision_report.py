"""What ``jaxamp.precision_report`` costs: its time against the first call
(trace, compile, run) of the jitted amp training step of the same model, in
one process, side by side.

    python benchmarks/precision_report.py               # sizes tiny and S
    python benchmarks/precision_report.py --size S

The model is ``benchmarks/quantized.py``'s scoped GPT (``benchmarks/run.py``'s
GPT, layers in ``lax.scan``, named scopes ``attn`` / ``mlp`` / ``head``) under
bf16 (the default policy) and int8 (``int8_policy(size_rule=None)``). Each
row runs in a fresh process (JAX started by one tiny jitted call first): the
step's first call in seconds, then the report's time in seconds, their ratio,
the report's top scope and its gradient error. Other processes may share
the CPU: compare the ratio, not absolute times.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))

import quantized  # noqa: E402
import run as gpt_bench  # noqa: E402

import jaxamp  # noqa: E402


def model(size: str):
    """``(loss(params, x, y), params, x, y)``: the scoped GPT with its head
    weight as ``params["head"]``."""
    params, x, y = gpt_bench.init(size)
    scoped = quantized.scoped_loss(size)
    params = {**params, "head": params["emb"]}

    def loss(p, x, y):
        return scoped({k: v for k, v in p.items() if k != "head"}, p["head"], x, y)

    return loss, params, x, y


def row(size: str, name: str, policy) -> dict:
    """Time the first call of the jitted amp step, then the report."""
    loss, params, x, y = model(size)
    f = jaxamp.amp(loss, compute_dtype=jnp.bfloat16, amp_policy=policy)
    t0 = time.perf_counter()
    jax.block_until_ready(jax.jit(jax.value_and_grad(f))(params, x, y))
    step = time.perf_counter() - t0
    t0 = time.perf_counter()
    report = jaxamp.precision_report(loss, params, x, y, amp_policy=policy)
    took = time.perf_counter() - t0
    return {
        "size": size,
        "policy": name,
        "step_first_call_s": step,
        "report_s": took,
        "ratio": took / step,
        "top": report.top(1)[0],
        "grad_error": report.grad_error,
    }


POLICIES = {
    "bf16": lambda: jaxamp.default_amp_policy,
    "int8": lambda: jaxamp.int8_policy(size_rule=None),
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", action="append", help="benchmarks/run.py sizes")
    p.add_argument("--row", nargs=2, help=argparse.SUPPRESS)  # size policy
    a = p.parse_args(argv)
    if a.row:  # one row, in a fresh process
        jax.block_until_ready(jax.jit(lambda v: v + 1)(jnp.ones(2)))  # JAX's start-up
        print(json.dumps(row(a.row[0], a.row[1], POLICIES[a.row[1]]())))
        return 0
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}")
    print(
        "| size | policy | step first call (s) | report (s) | ratio | top scope "
        "| grad error |"
    )
    print("|---|---|---|---|---|---|---|")
    for size in a.size or ["tiny", "S"]:
        for name in POLICIES:
            cmd = [sys.executable, __file__, "--row", size, name]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True)
            r = json.loads(out.stdout.strip().splitlines()[-1])
            print(
                f"| {size} | {name} | {r['step_first_call_s']:.2f} | "
                f"{r['report_s']:.2f} | {r['ratio']:.2f}x | {r['top']} | "
                f"{r['grad_error']:.2e} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
