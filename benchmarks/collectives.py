"""Bytes moved by the collectives of one FSDP training step, and what each step
keeps between its forward and backward passes: jaxamp bf16, two hand-written
bf16 models and float32.

    python benchmarks/collectives.py          # RESULTS_COLLECTIVES.md's model
    python benchmarks/collectives.py --small  # tests/test_distributed.py's

A GPT (pre-LayerNorm, tied embedding head, layers unrolled) has every parameter
sharded over an 8-device mesh on its first dimension divisible by 8 (FSDP, ZeRO-3
style) and the batch sharded over the same axis. One jitted step
(``value_and_grad`` + ``jaxamp.skip_nonfinite_updates(optax.adamw)``) is compiled
for each variant (the same model, :func:`make_loss`):

* ``amp``: ``jax.value_and_grad(jaxamp.amp(loss, compute_dtype=jnp.bfloat16))``;
* ``hand``: the parameters cast to bfloat16 at the top of the loss
  (``jaxamp.migration.mpx.cast_to_bfloat16``): each weight is gathered once and the
  gathered
  bf16 copy is kept for the backward pass (an unsharded bf16 model per device);
* ``hand_zero3``: reshard after forward, as ZeRO-3 / PyTorch FSDP do by
  default: each matmul with a weight is
  ``jax.checkpoint(lambda x, w: x @ w.astype(jnp.bfloat16))(x, w)``
  (:func:`zero3_matmul`), so the backward pass re-casts and re-gathers the
  weight; the other parameters (embedding lookup, position table, LayerNorm
  gains) cast to bfloat16 where used;
* ``fp32``: no mixed precision.

All bf16 variants compute LayerNorm statistics and the logits in float32.

Collective bytes: the operand bytes (per device, per step) of every all-gather,
reduce-scatter and all-reduce in the HLO right after SPMD partitioning
(``xla_dump_to`` + ``xla_dump_hlo_pass_re=spmd-partitioning`` as compiler
options), by dtype. That dump is the faithful one: XLA:CPU later promotes
bfloat16 collectives to float32 (a GPU does not), so the optimized HLO of a CPU
compile would show float32 everywhere.

Memory: :func:`carried_bytes` of the same dump (per device: the arrays the
forward pass hands to the backward pass, gathered weights apart), and XLA:CPU's
``compiled.memory_analysis()``. The latter does not show the trade-off: XLA:CPU
schedules every all-gather, the backward pass's re-gathers included, at the
start of the program and holds each gathered weight (gathered in float32,
converted back) until its last use, and reduces full-size gradients with
all-reduce (no reduce-scatter), so every variant holds unsharded weights and
gradients at its peak.

Only compiles, never runs a step; needs 8 host devices (set here through
``XLA_FLAGS`` unless already set).
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


def _matmul(x, w, transpose: bool = False):
    return x @ (w.T if transpose else w)


def _identity(a):
    return a


def make_loss(
    dims: Dims, matmul: Callable = _matmul, param: Callable = _identity
) -> Callable:
    """``loss(params, x, y)``: mean next-token cross-entropy, logits in float32.

    ``matmul(x, w, transpose=False)`` computes every product with a weight (the
    tied head passes the embedding table with ``transpose=True``); ``param(a)``
    is applied to every other parameter where it is used (the embedding table
    for the lookup, the position table, the LayerNorm gains). The defaults
    leave the model as written; the hand-written ZeRO-3 variant casts in both."""

    def loss(params, x, y):
        B, T = x.shape
        h = param(params["emb"])[x] + param(params["pos"])
        for w in params["layers"]:
            q, k, v = jnp.split(matmul(_ln(h, param(w["ln1"])), w["qkv"]), 3, -1)
            sh = lambda t: t.reshape(B, T, dims.heads, -1)
            a = jax.nn.dot_product_attention(
                sh(q), sh(k), sh(v), is_causal=True, implementation="xla"
            )
            h = h + matmul(a.reshape(B, T, -1), w["o"])
            u = jax.nn.gelu(matmul(_ln(h, param(w["ln2"])), w["up"]))
            h = h + matmul(u, w["down"])
        hf = _ln(h, param(params["lnf"]))
        logits = matmul(hf, params["emb"], transpose=True).astype(jnp.float32)
        gold = jnp.take_along_axis(logits, y[..., None], -1)[..., 0]
        return (jax.nn.logsumexp(logits, -1) - gold).mean()

    return loss


def _to_bf16(a):
    return a.astype(jnp.bfloat16)


def zero3_matmul(x, w, transpose: bool = False):
    """``x @ bf16(w)`` with the cast inside one ``jax.checkpoint``: the backward
    pass re-casts (under FSDP: re-gathers) the weight instead of keeping the
    gathered bfloat16 copy from the forward pass (reshard after forward)."""
    return jax.checkpoint(lambda x, w: _matmul(x, _to_bf16(w), transpose))(x, w)


def variants(dims: Dims) -> dict[str, Callable]:
    """The loss of each variant: ``amp``, ``hand`` (every parameter cast to
    bfloat16 at the top of the loss: the gathered bf16 weights are residuals,
    kept until the backward pass), ``hand_zero3`` (each weight cast inside a
    checkpoint with its matmul, other parameters cast where used: reshard after
    forward) and ``fp32``."""
    loss = make_loss(dims)
    return {
        "amp": jaxamp.amp(loss, compute_dtype=jnp.bfloat16),
        "hand": lambda p, x, y: loss(jaxamp.migration.mpx.cast_to_bfloat16(p), x, y),
        "hand_zero3": make_loss(dims, matmul=zero3_matmul, param=_to_bf16),
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


_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%(\S+) = (.*?) ([a-z][\w-]*)\(([^)]*)\)(.*)$"
)
_ALIASES = ("parameter", "tuple", "get-tuple-element", "bitcast")  # no new buffer


def _shape_bytes(shape: str) -> int:
    return sum(
        _BYTES[dtype] * int(np.prod([int(s) for s in dims.split(",") if s]))
        for dtype, dims in re.findall(r"\b(pred|bf16|[suf]\d+)\[([\d,]*)\]", shape)
    )


def carried_bytes(hlo: str) -> dict[str, int]:
    """Bytes (per device) that the forward pass of a partitioned training step
    hands to its backward pass: the arrays computed by forward equations
    (``op_name`` ``.../jvp(...)/...``) that a backward equation
    (``.../transpose(jvp(...))/...``, recomputation under ``jax.checkpoint``
    included) reads, directly or through instructions of neither pass. Read
    from the ENTRY computation of the HLO right after SPMD partitioning, where
    a gathered weight used by both passes is one all-gather whose result stays
    alive in between: ``{"gathered": bytes of such all-gather results,
    "other": the rest (activations)}``. Parameters are not counted (alive for
    the whole step anyway). Hardware independent and before fusion: exact for
    gathered weights; a backend may fuse or recompute some of the "other"."""
    start = hlo.index("\nENTRY")
    entry = hlo[start : hlo.index("\n}", start)]
    phase, shape_of, op_of = {}, {}, {}
    users: dict[str, list[str]] = defaultdict(list)
    for line in entry.splitlines()[1:]:
        m = _INSTRUCTION.match(line)
        if not m:
            continue
        name, shape, op, operands, rest = m.groups()
        op_name = re.search(r'op_name="([^"]*)"', rest)
        op_name = op_name.group(1) if op_name else ""
        phase[name] = None
        if "transpose(" in op_name:
            phase[name] = "backward"
        elif "jvp(" in op_name:
            phase[name] = "forward"
        shape_of[name], op_of[name] = shape, op
        for operand in re.findall(r"%([\w.\-]+)", operands):
            users[operand].append(name)
    out = {"gathered": 0, "other": 0}
    for name, p in phase.items():
        if p != "forward" or op_of[name] in _ALIASES:
            continue
        seen, stack = set(), list(users[name])
        while stack:
            u = stack.pop()
            if u in seen:
                continue
            seen.add(u)
            if phase[u] == "backward":
                kind = "gathered" if op_of[name] == "all-gather" else "other"
                out[kind] += _shape_bytes(shape_of[name])
                break
            if phase[u] is None:
                stack.extend(users[u])
    return out


class Step(NamedTuple):
    """One variant's compiled FSDP step, per device."""

    collectives: dict[tuple[str, str], int]  # {(collective, dtype): operand bytes}
    carried: dict[str, int]  # carried_bytes(): forward -> backward, per device
    memory: dict[str, int]  # XLA:CPU memory_analysis(): argument / output / temp


def measure(
    dims: Dims, n_devices: int = 8, fast_compile: bool = True
) -> dict[str, Step]:
    """Collective bytes by (collective, dtype) and the compiled memory of one
    FSDP step of each variant. ``fast_compile``: LLVM optimisation off
    (``xla_backend_optimization_level=0``), half the compile time; the
    collectives and the buffer assignment are fixed before code generation."""
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
            compiled = (
                jax.jit(step)
                .lower(params, opt_state, x, y)
                .compile(
                    compiler_options={
                        "xla_dump_to": dump,
                        "xla_dump_hlo_pass_re": "spmd-partitioning",
                        **options,
                    }
                )
            )
            (path,) = glob.glob(os.path.join(dump, "*after_spmd-partitioning*.txt"))
            with open(path) as f:
                hlo = f.read()
        m = compiled.memory_analysis()
        memory = {
            "argument": m.argument_size_in_bytes,
            "output": m.output_size_in_bytes,
            "alias": m.alias_size_in_bytes,
            "temp": m.temp_size_in_bytes,
        }
        result[name] = Step(collective_bytes(hlo), carried_bytes(hlo), memory)
    return result


def total(by_kind: dict[tuple[str, str], int], op: str | None = None) -> int:
    return sum(b for (o, _), b in by_kind.items() if op is None or o == op)


def _mib(b: int) -> str:
    return f"{b / MiB:.3f}"


def table(result: dict[str, Step]) -> str:
    """Markdown: collective MiB per device per step (all-gather; all-reduce and
    reduce-scatter; by collective and dtype), per variant."""
    keys = sorted({k for r in result.values() for k in r.collectives})
    head = ["variant", "total MiB", "vs fp32", "all-gather", "all-reduce + r-s"]
    head += [f"{o} {t}" for o, t in keys]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    fp32 = total(result["fp32"].collectives)
    for name, r in result.items():
        c = r.collectives
        gather = total(c, "all-gather")
        cells = [name, _mib(total(c)), f"{total(c) / fp32:.3f}", _mib(gather)]
        cells += [_mib(total(c) - gather)] + [_mib(c.get(k, 0)) for k in keys]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def memory_table(result: dict[str, Step]) -> str:
    """Markdown: MiB per device that each step carries from its forward to its
    backward pass (:func:`carried_bytes`), and XLA:CPU's memory analysis."""
    head = ["variant", "carried fwd->bwd", "of which gathered", "other"]
    head += ["XLA:CPU arguments", "outputs", "temp"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, r in result.items():
        g, o = r.carried["gathered"], r.carried["other"]
        cells = [name, _mib(g + o), _mib(g), _mib(o)]
        cells += [_mib(r.memory[k]) for k in ("argument", "output", "temp")]
        lines.append("| " + " | ".join(cells) + " |")
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
    print("Collectives, MiB per device per step:\n")
    print(table(result))
    print("\nMemory, MiB per device:\n")
    print(memory_table(result))
    c = {k: r.collectives for k, r in result.items()}
    amp, gather = total(c["amp"]), total(c["amp"], "all-gather")
    print()
    for ref in ("hand", "hand_zero3", "fp32"):
        g = total(c[ref], "all-gather")
        print(
            f"amp / {ref}: total {amp / total(c[ref]):.4f}, "
            f"all-gather {gather / g:.4f} ({gather - g:+d} bytes)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
