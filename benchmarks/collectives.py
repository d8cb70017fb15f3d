"""Bytes moved by the collectives of one FSDP training step: jaxamp bf16, a
hand-written bf16 model, and float32.

    python benchmarks/collectives.py

A GPT (pre-LayerNorm, tied embedding head, layers unrolled) has every parameter
sharded over an 8-device mesh on its first dimension divisible by 8 (FSDP, ZeRO-3
style) and the batch sharded over the same axis. One jitted step
(``value_and_grad`` + ``jaxamp.skip_nonfinite_updates(optax.adamw)``) is compiled
for each variant:

* ``amp``: ``jax.value_and_grad(jaxamp.amp(loss, compute_dtype=jnp.bfloat16))``;
* ``hand``: the parameters cast to bfloat16 by hand at the top of the loss
  (``jaxamp.cast_to_bfloat16``), LayerNorm statistics and logits in float32;
* ``fp32``: no mixed precision.

The figure is the sum of the operand bytes (per device, per step) of every
all-gather, reduce-scatter and all-reduce in the HLO right after SPMD
partitioning (``xla_dump_to`` + ``xla_dump_hlo_pass_re=spmd-partitioning`` as
compiler options), by dtype. That dump is the faithful one: XLA:CPU later
promotes bfloat16 collectives to float32 (a GPU does not), so the optimized HLO
of a CPU compile would show float32 everywhere. Only compiles, never runs a step;
needs 8 host devices (set here through ``XLA_FLAGS`` unless already set).
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from typing import NamedTuple

if __name__ == "__main__":  # before JAX starts: 8 host CPU devices
    _flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in _flags:
        os.environ["XLA_FLAGS"] = _flags + " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxamp  # noqa: E402

MiB = 2**20
COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2}
_BYTES |= {"f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}


class Dims(NamedTuple):
    vocab: int
    d: int
    layers: int
    seq: int
    batch: int  # global
    heads: int


SMALL = Dims(vocab=256, d=64, layers=2, seq=32, batch=8, heads=2)  # the test's
LARGE = Dims(vocab=4096, d=512, layers=6, seq=128, batch=16, heads=8)  # this script's


def init_params(dims: Dims, seed: int = 0) -> dict:
    """float32 GPT parameters (NumPy), layers as a list (unrolled, no scan)."""
    V, d, L, T = dims.vocab, dims.d, dims.layers, dims.seq
    rng = np.random.default_rng(seed)
    n = lambda s, sc: (rng.standard_normal(s) * sc).astype(np.float32)
    layer = lambda: {
        "ln1": np.ones(d, np.float32),
        "qkv": n((d, 3 * d), d**-0.5),
        "o": n((d, d), (2 * L * d) ** -0.5),
        "ln2": np.ones(d, np.float32),
        "up": n((d, 4 * d), d**-0.5),
        "down": n((4 * d, d), (8 * L * d) ** -0.5),
    }
    return {
        "emb": n((V, d), 0.02),
        "pos": n((T, d), 0.01),
        "layers": [layer() for _ in range(L)],
        "lnf": np.ones(d, np.float32),
    }


def batch(dims: Dims, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    tok = np.random.default_rng(seed).integers(
        0, dims.vocab, (dims.batch, dims.seq + 1), np.int32
    )
    return tok[:, :-1], tok[:, 1:]


def _ln(x, g):  # statistics in float32 (a no-op upcast for the float32 model)
    xs = x.astype(jnp.float32)
    m = xs.mean(-1, keepdims=True)
    v = jnp.square(xs - m).mean(-1, keepdims=True)
    return ((xs - m) * jax.lax.rsqrt(v + 1e-5)).astype(x.dtype) * g


def make_loss(dims: Dims) -> Callable:
    """``loss(params, x, y)``: mean next-token cross-entropy, logits in float32."""

    def loss(params, x, y):
        B, T = x.shape
        h = params["emb"][x] + params["pos"]
        for w in params["layers"]:
            q, k, v = jnp.split(_ln(h, w["ln1"]) @ w["qkv"], 3, -1)
            sh = lambda t: t.reshape(B, T, dims.heads, -1)
            a = jax.nn.dot_product_attention(
                sh(q), sh(k), sh(v), is_causal=True, implementation="xla"
            )
            h = h + a.reshape(B, T, -1) @ w["o"]
            h = h + jax.nn.gelu(_ln(h, w["ln2"]) @ w["up"]) @ w["down"]
        logits = (_ln(h, params["lnf"]) @ params["emb"].T).astype(jnp.float32)
        gold = jnp.take_along_axis(logits, y[..., None], -1)[..., 0]
        return (jax.nn.logsumexp(logits, -1) - gold).mean()

    return loss


def variants(dims: Dims) -> dict[str, Callable]:
    """The loss of each variant, ``amp``, ``hand`` and ``fp32``."""
    loss = make_loss(dims)
    return {
        "amp": jaxamp.amp(loss, compute_dtype=jnp.bfloat16),
        "hand": lambda p, x, y: loss(jaxamp.cast_to_bfloat16(p), x, y),
        "fp32": loss,
    }


def fsdp_spec(shape: tuple[int, ...], n: int) -> P:
    """Sharded over "fsdp" on the first dimension divisible by ``n``."""
    for i, size in enumerate(shape):
        if size % n == 0:
            return P(*[None] * i, "fsdp")
    return P()


def collective_bytes(hlo: str) -> dict[tuple[str, str], int]:
    """``{(collective, dtype): operand bytes}`` of an HLO module's text (per
    device). Operands are looked up by name; a module with a ``while`` loop is
    refused (its body's collectives would need the trip count)."""
    shapes, found = {}, []
    for m in re.finditer(
        r"^\s*(?:ROOT\s+)?%(\S+) = (.*?) ([a-z][\w-]*)\(([^)]*)\)", hlo, re.M
    ):
        name, shape, op, operands = m.groups()
        shapes[name] = shape
        if op == "while":
            raise ValueError("while loop in the module: bytes per step unknown")
        if op.removesuffix("-start") in COLLECTIVES:
            found.append(
                (op.removesuffix("-start"), re.findall(r"%([\w.\-]+)", operands))
            )
    out: dict[tuple[str, str], int] = defaultdict(int)
    for op, names in found:
        for name in names:
            for dtype, dims in re.findall(r"(\w+)\[([\d,]*)\]", shapes[name]):
                size = int(np.prod([int(s) for s in dims.split(",") if s]))
                out[op, dtype] += _BYTES[dtype] * size
    return dict(out)


def measure(
    dims: Dims, n_devices: int = 8, fast_compile: bool = True
) -> dict[str, dict[tuple[str, str], int]]:
    """Collective bytes by (collective, dtype) of one FSDP step of each variant.
    ``fast_compile``: LLVM optimisation off (``xla_backend_optimization_level=0``),
    half the compile time; the collectives are fixed before code generation."""
    options = {"xla_backend_optimization_level": 0} if fast_compile else {}
    mesh = Mesh(np.asarray(jax.devices()[:n_devices]), ("fsdp",))
    params = jax.tree.map(
        lambda a: jax.device_put(a, NamedSharding(mesh, fsdp_spec(a.shape, n_devices))),
        init_params(dims),
    )
    x, y = (jax.device_put(a, NamedSharding(mesh, P("fsdp"))) for a in batch(dims))
    opt = jaxamp.skip_nonfinite_updates(optax.adamw(3e-4))
    opt_state = jax.jit(opt.init)(params)
    result = {}
    for name, loss in variants(dims).items():

        def step(params, opt_state, x, y, loss=loss):
            value, grads = jax.value_and_grad(loss)(params, x, y)
            updates, opt_state = opt.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, value

        with tempfile.TemporaryDirectory() as dump:
            jax.jit(step).lower(params, opt_state, x, y).compile(
                compiler_options={
                    "xla_dump_to": dump,
                    "xla_dump_hlo_pass_re": "spmd-partitioning",
                    **options,
                }
            )
            (path,) = glob.glob(os.path.join(dump, "*after_spmd-partitioning*.txt"))
            with open(path) as f:
                result[name] = collective_bytes(f.read())
    return result


def total(by_kind: dict[tuple[str, str], int], op: str | None = None) -> int:
    return sum(b for (o, _), b in by_kind.items() if op is None or o == op)


def table(result: dict[str, dict[tuple[str, str], int]]) -> str:
    """Markdown: MiB per device per step, by collective and dtype, per variant."""
    keys = sorted({k for r in result.values() for k in r})
    head = "| variant | total MiB | vs fp32 | " + " | ".join(
        f"{o} {t}" for o, t in keys
    )
    lines = [head + " |", "|" + "---|" * (3 + len(keys))]
    fp32 = total(result["fp32"])
    for name, r in result.items():
        cells = [f"{r.get(k, 0) / MiB:.3f}" for k in keys]
        row = f"| {name} | {total(r) / MiB:.3f} | {total(r) / fp32:.3f} | "
        lines.append(row + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="the test's model instead")
    args = ap.parse_args(argv)
    dims = SMALL if args.small else LARGE
    t0 = time.perf_counter()
    result = measure(dims)
    n_params = sum(a.size for a in jax.tree.leaves(init_params(dims)))
    print(f"{dims}, {n_params / 1e6:.2f}M parameters, 8-device FSDP mesh")
    print(f"jax {jax.__version__}, {time.perf_counter() - t0:.0f} s\n")
    print(table(result))
    amp, hand, fp32 = (total(result[k]) for k in ("amp", "hand", "fp32"))
    print(f"\namp / hand = {amp / hand:.4f}, amp / fp32 = {amp / fp32:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
