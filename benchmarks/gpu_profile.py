"""Where a variant of benchmarks/gpu_attention.py spends its GPU time.

    python benchmarks/gpu_profile.py --size gpt1024 --out DIR \
        --variants "jaxamp bf16,hand bf16 cudnn"

For each variant: the compiled training step's HLO text (``DIR/<variant>.hlo.txt``),
and a ``jax.profiler`` trace of ``--steps`` steps whose GPU kernels are summed by
name (``DIR/<variant>.kernels.tsv``: kernel, calls, total microseconds per step),
read from the Perfetto trace JAX writes (``create_perfetto_trace=True``). Prints
the top kernels of each variant side by side. A diagnostic for closing the gap to
the hand-written model, not a benchmark: time steps with gpu_attention.py.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import sys
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_attention as ga  # noqa: E402
from run import value_and_grad  # noqa: E402


def kernel_times(trace_dir: Path, steps: int) -> dict[str, tuple[int, float]]:
    """kernel name -> (calls per step, microseconds per step) from the newest
    Perfetto trace under ``trace_dir``."""
    files = sorted(trace_dir.rglob("*.trace.json.gz"), key=lambda p: p.stat().st_mtime)
    if not files:
        files = sorted(trace_dir.rglob("perfetto_trace.json.gz"))
    if not files:
        return {}
    with gzip.open(files[-1]) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    pids = {
        e["pid"]
        for e in events
        if e.get("ph") == "M"
        and e.get("name") == "process_name"
        and "/device:GPU" in str(e.get("args", {}).get("name", ""))
    }
    total: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])
    for e in events:
        if e.get("ph") == "X" and (not pids or e.get("pid") in pids):
            t = total[e["name"]]
            t[0] += 1
            t[1] += float(e.get("dur", 0.0))
    return {k: (v[0] // steps, v[1] / steps) for k, v in total.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="gpt1024")
    ap.add_argument("--variants", default="jaxamp bf16,hand bf16 cudnn")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out", default="/tmp/gpu_profile")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    params, x, y = ga.init(args.size)
    table = {}
    found = ga.variants(args.size)
    for name in ga.pick_variants(args.variants, list(found)) or list(found):
        loss = found[name]
        if isinstance(loss, str):
            print(f"{name}: {loss}")
            continue
        step = ga.sgd_step(value_and_grad(loss))  # fp16: the loss-scaled gradient
        compiled = jax.jit(step).lower(params, x, y).compile()
        slug = name.replace(" ", "_").replace(",", "")
        (out / f"{slug}.hlo.txt").write_text(compiled.as_text())
        p, _ = compiled(params, x, y)
        jax.block_until_ready(p)
        tdir = out / f"trace_{slug}"
        with jax.profiler.trace(str(tdir), create_perfetto_trace=True):
            for _ in range(args.steps):
                p, _ = compiled(params, x, y)
            jax.block_until_ready(p)
        times = kernel_times(tdir, args.steps)
        table[name] = times
        rows = sorted(times.items(), key=lambda kv: -kv[1][1])
        with open(out / f"{slug}.kernels.tsv", "w") as f:
            for k, (n, us) in rows:
                f.write(f"{k}\t{n}\t{us:.1f}\n")
        print(
            f"\n== {name}: {sum(v[1] for v in times.values()) / 1e3:.2f} ms of "
            f"kernels per step, {len(times)} kernel names"
        )
        for k, (n, us) in rows[: args.top]:
            print(f"{us:10.1f} us  {n:5d}x  {k[:110]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
