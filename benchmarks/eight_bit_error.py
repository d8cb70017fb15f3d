"""Gradient error of the main job's 8-bit modes against float32, batch by batch.

    python benchmarks/eight_bit_error.py --batches 1 3 4 5 --modes bf16 fp8 int8
    python benchmarks/eight_bit_error.py --modes int8 "int8 wgrad" "int8 wgrad nearest"

The main job's GPT (``examples/train_charlm.py``) at d_model 256, 4 layers, seq
128, batch 8, float32 parameters from its seed; one batch of random tokens per
``--batches`` seed (inputs from ``key(seed)``, targets from ``key(seed + 100)``).
For each mode of ``train_charlm.MODES`` it prints the relative L2 error of the
whole gradient of ``jaxamp.amp`` (with the mode's compute dtype and policy)
against ``jax.grad`` in float32: the figure issue 47 compares before and after a
change to the 8-bit matmuls (``benchmarks/RESULTS_QUANT.md``). :data:`RECIPES`
adds the int8 recipes ``gpu_suite.eight_bit_variants`` prices beside the
default one (every matmul quantized, as the main job's ``--mode int8``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's jaxamp
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "benchmarks"))
import common  # noqa: E402
import train_charlm as tc  # noqa: E402

import jaxamp  # noqa: E402

# int8 recipes beside the main job's modes: the weight gradient in int8 too
# (SwitchBack keeps it in 16 bits), with and without stochastic rounding.
RECIPES = {
    "int8 wgrad": lambda: jaxamp.int8_policy(size_rule=None, wgrad=True),
    "int8 wgrad nearest": lambda: jaxamp.int8_policy(
        size_rule=None, wgrad=True, stochastic_rounding=False
    ),
}


def _mode(name: str) -> dict:
    if name in RECIPES:
        return {"compute": jnp.bfloat16, "policy": RECIPES[name]}
    return tc.MODES[name]


def grad_errors(seed: int, modes: list[str]) -> dict[str, float]:
    """mode -> relative L2 error of its gradient against float32's on batch
    ``seed``."""
    cfg = tc.Config(d_model=256, heads=4, layers=4, seq_len=128, batch_size=8)
    params = tc.initial_params(cfg)
    x = jax.random.randint(jax.random.key(seed), (8, 128), 0, 96)
    y = jax.random.randint(jax.random.key(seed + 100), (8, 128), 0, 96)

    def loss(p, x, y):
        return tc.loss_fn(p, x, y, cfg.heads)

    ref = jax.grad(loss)(params, x, y)
    out = {}
    for mode in modes:
        m = _mode(mode)
        kw = {"amp_policy": m["policy"]()} if "policy" in m else {}
        f = jaxamp.amp(loss, compute_dtype=m["compute"], **kw)
        out[mode] = common.rel_l2(jax.jit(jax.grad(f))(params, x, y), ref)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 3, 4, 5])
    p.add_argument("--modes", nargs="+", default=["bf16", "fp8", "int8"])
    args = p.parse_args(argv)
    known = sorted([*tc.MODES, *RECIPES])
    bad = [m for m in args.modes if m not in known]
    if bad:
        p.error(f"--modes: unknown {bad}; choose from {known}")
    print("| batch | " + " | ".join(args.modes) + " |")
    print("|---" * (len(args.modes) + 1) + "|")
    for seed in args.batches:
        errs = grad_errors(seed, args.modes)
        print(f"| {seed} | " + " | ".join(f"{errs[m]:.4e}" for m in args.modes) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
