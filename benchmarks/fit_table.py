"""What fits where: the full training step's peak of GPT configurations from
1B to 13B parameters, per training recipe, compiled (never run) for the H100
target or XLA:CPU, and the largest model each recipe fits in 24 and 80 GB.

    python benchmarks/fit_table.py --targets h100 --out FILE

Model: a pre-LayerNorm GPT (learned positions, causal attention, GELU MLP of
width 4d, untied head, 32k vocabulary), its layers one ``jax.checkpoint``-ed
function under ``lax.scan`` over stacked parameters; seq 2048, batch 1; the
sizes of GPT-3's table (Brown et al. 2020): 1.3B (d 2048, 24 layers), 2.7B
(d 2560, 32), 6.7B (d 4096, 32), 13B (d 5120, 40). Recipes: the step as a
training loop runs it, jitted with parameters and optimizer state donated:

- float32 master weights + AdamW: bf16 compute (``jaxamp.amp``), the ordinary
  step (``value_and_grad``, ``optax.adamw``);
- amp bf16 + ``low_precision_optimizer``: bf16 parameters + stochastic
  rounding, AdamW's moments in bfloat16, the ordinary step;
- int8 AdamW in the backward pass (the leanest before issue 62): bf16
  parameters + SR, int8 moments, int8 residuals, ``update_in_backward``;
- leanest: the same with ``jaxamp.training.layerwise_adafactor`` (factored
  second moment, no first moment, float32 statistics).

The peak is XLA's memory analysis (arguments + outputs - aliased + temp).
``--extrapolate``: where the largest size fits 80 GB, also compile it with half
its layers and report, from the per-layer slope, how many layers of that width
fit (peak linear in layers: layers repeat one scan body).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import optax

sys.path.insert(0, str(Path(__file__).parent))
import gpu_target  # noqa: E402

import jaxamp  # noqa: E402

GB = 1e9  # the fit budgets are decimal GB, as cards are sold (24 GB, 80 GB)


@dataclasses.dataclass(frozen=True)
class Size:
    name: str
    d: int
    layers: int
    heads: int


SIZES = [
    Size("1.3B", 2048, 24, 16),
    Size("2.7B", 2560, 32, 32),
    Size("6.7B", 4096, 32, 32),
    Size("13B", 5120, 40, 40),
]
VOCAB, SEQ = 32000, 2048


def init_shapes(s: Size, dtype) -> dict:
    """The parameters' shapes and dtypes (no allocation)."""
    d, n = s.d, s.layers
    f = lambda *shape: jax.ShapeDtypeStruct(shape, dtype)  # noqa: E731
    return {
        "emb": f(VOCAB, d),
        "pos": f(SEQ, d),
        "blocks": {
            "ln1": f(n, d),
            "ln2": f(n, d),
            "qkv": f(n, d, 3 * d),
            "proj": f(n, d, d),
            "fc": f(n, d, 4 * d),
            "b_fc": f(n, 4 * d),
            "out": f(n, 4 * d, d),
        },
        "lnf": f(d),
        "head": f(d, VOCAB),
    }


def _layernorm(x, g):
    m = jnp.mean(x, -1, keepdims=True)
    v = jnp.mean(jnp.square(x - m), -1, keepdims=True)
    return (x - m) * jax.lax.rsqrt(v + 1e-5) * g


def make_loss(heads: int) -> Callable:
    """``loss(params, tokens)``: next-token cross-entropy, tokens ``(B, T+1)``."""

    def loss(params, tokens):
        x, y = tokens[:, :-1], tokens[:, 1:]
        b, t = x.shape
        d = params["emb"].shape[1]
        h = params["emb"][x] + params["pos"][:t]
        mask = jnp.tril(jnp.ones((t, t), bool))

        @jax.checkpoint
        def block(h, p):
            a = _layernorm(h, p["ln1"]) @ p["qkv"]
            q, k, v = jnp.split(a.reshape(b, t, 3 * heads, d // heads), 3, axis=2)
            s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(d // heads)
            s = jnp.where(mask, s, -1e9)
            o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v)
            h = h + o.reshape(b, t, d) @ p["proj"]
            m = jax.nn.gelu(_layernorm(h, p["ln2"]) @ p["fc"] + p["b_fc"])
            return h + m @ p["out"], None

        h, _ = jax.lax.scan(block, h, params["blocks"])
        logits = _layernorm(h, params["lnf"]) @ params["head"]
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), -1)
        return -jnp.mean(jnp.take_along_axis(logp, y[..., None], -1))

    return loss


@dataclasses.dataclass(frozen=True)
class Recipe:
    name: str
    param_dtype: object
    optimizer: Callable
    residual_dtype: object = None
    in_backward: bool = False


RECIPES = [
    Recipe(
        "float32 master weights + AdamW",
        jnp.float32,
        lambda: optax.adamw(1e-4, weight_decay=0.1),
    ),
    Recipe(
        "amp bf16 + low_precision_optimizer (bf16 state)",
        jnp.bfloat16,
        lambda: jaxamp.low_precision_optimizer(optax.adamw(1e-4, weight_decay=0.1)),
    ),
    Recipe(
        "int8 AdamW + int8 residuals, in backward (before)",
        jnp.bfloat16,
        lambda: jaxamp.low_precision_optimizer(
            optax.adamw(1e-4, weight_decay=0.1), state_dtype="int8"
        ),
        "int8",
        True,
    ),
    Recipe(
        "leanest: layerwise adafactor + int8 residuals, in backward",
        jnp.bfloat16,
        lambda: jaxamp.low_precision_optimizer(
            jaxamp.training.layerwise_adafactor(1e-4), state_dtype=None
        ),
        "int8",
        True,
    ),
]


def step_peak(r: Recipe, s: Size, target: str) -> tuple[int, int]:
    """(peak bytes of the donated step, parameter count)."""
    params = init_shapes(s, r.param_dtype)
    loss = jaxamp.amp(
        make_loss(s.heads), compute_dtype=jnp.bfloat16, residual_dtype=r.residual_dtype
    )
    opt = r.optimizer()
    with jax.numpy_dtype_promotion("standard"):
        state = jax.eval_shape(opt.init, params)
    tokens = jax.ShapeDtypeStruct((1, SEQ + 1), jnp.int32)
    if r.in_backward:
        fused = jaxamp.update_in_backward(loss, opt)

        def step(params, state, tokens):
            with jax.numpy_dtype_promotion("standard"):
                return fused(params, state, tokens)

    else:

        def step(params, state, tokens):
            value, grads = jax.value_and_grad(loss)(params, tokens)
            with jax.numpy_dtype_promotion("standard"):
                updates, state = opt.update(grads, state, params)
            return optax.apply_updates(params, updates), state, value

    compiled = gpu_target.compile_for(
        step, params, state, tokens, target=target, donate_argnums=(0, 1)
    )
    n = sum(a.size for a in jax.tree.leaves(params))
    return gpu_target.peak_bytes(compiled), n


def report(rows: dict, extra: dict, target: str) -> str:
    """The Markdown table of one target."""
    names = [s.name for s in SIZES]
    lines = [
        f"| recipe | {' | '.join(f'{n} (GB)' for n in names)} | largest in 24 GB "
        "| largest in 80 GB |",
        "|---|" + "---|" * (len(names) + 2),
    ]
    for r in RECIPES:
        got = rows.get(r.name, {})
        cells = [f"{got[n][0] / GB:.1f}" if n in got else "" for n in names]
        fits = []
        for budget in (24, 80):
            ok = [n for n in names if n in got and got[n][0] <= budget * GB]
            best = ok[-1] if ok else "none"
            more = extra.get((r.name, budget))
            fits.append(f"{best}{more or ''}")
        lines.append(f"| {r.name} | {' | '.join(cells)} | {' | '.join(fits)} |")
    return "\n".join(lines) + "\n"


def _extrapolate(r: Recipe, s: Size, full: int, target: str) -> dict:
    """Layers of ``s``'s width that fit each budget, from ``s`` and ``s``
    with half its layers."""
    half = dataclasses.replace(s, layers=s.layers // 2)
    peak_half, _ = _Cache.current.get(r, half, target)
    per_layer = (full - peak_half) / (s.layers - half.layers)
    fixed = full - per_layer * s.layers
    n_layer = 12 * s.d * s.d + 6 * s.d  # weights of one block
    n_fixed = 2 * VOCAB * s.d + SEQ * s.d + s.d
    out = {}
    for budget in (24, 80):
        layers = int((budget * GB - fixed) // per_layer)
        if layers > s.layers:
            n = (n_fixed + layers * n_layer) / 1e9
            out[(r.name, budget)] = (
                f" (extrapolated: d {s.d} x {layers} layers, {n:.1f}B)"
            )
    return out


class _Cache:
    """Compiled peaks by (target, recipe, d, layers), kept in a JSON-lines file
    so that a table is assembled across runs (each compile takes minutes)."""

    current: _Cache

    def __init__(self, path: str | None):
        self.path, self.rows = path, {}
        if path and Path(path).exists():
            for line in Path(path).read_text().splitlines():
                r = json.loads(line)
                self.rows[tuple(r["key"])] = (r["peak"], r["n"])
        _Cache.current = self

    def get(self, r: Recipe, s: Size, target: str) -> tuple[int, int]:
        key = (target, r.name, s.d, s.layers)
        if key not in self.rows:
            self.rows[key] = step_peak(r, s, target)
            if self.path:
                peak, n = self.rows[key]
                with open(self.path, "a") as f:
                    f.write(json.dumps({"key": key, "peak": peak, "n": n}) + "\n")
        return self.rows[key]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--targets", nargs="+", default=["h100"], choices=["cpu", "h100"])
    p.add_argument("--sizes", nargs="*", default=[s.name for s in SIZES])
    p.add_argument("--recipes", nargs="*", type=int, default=None, help="indices")
    p.add_argument("--extrapolate", action="store_true")
    p.add_argument("--out", default=None)
    p.add_argument(
        "--cache",
        default=None,
        help="a JSON-lines file of compiled peaks: read (compiled once) and appended",
    )
    args = p.parse_args(argv)
    cache = _Cache(args.cache)
    chosen = [RECIPES[i] for i in args.recipes] if args.recipes else RECIPES
    text = []
    for target in args.targets:
        rows, extra = {}, {}
        for r in chosen:
            for s in SIZES:
                if s.name not in args.sizes:
                    continue
                peak, n = cache.get(r, s, target)
                rows.setdefault(r.name, {})[s.name] = (peak, n)
                print(
                    target,
                    r.name,
                    s.name,
                    f"{n / 1e9:.2f}B params",
                    f"{peak / GB:.2f} GB",
                    flush=True,
                )
            last = SIZES[-1]
            fits = rows.get(r.name, {}).get(last.name, (80 * GB + 1,))[0] <= 80 * GB
            if args.extrapolate and fits:  # the largest size fits: how far beyond
                extra.update(_extrapolate(r, last, rows[r.name][last.name][0], target))
        label = gpu_target_label(target)
        text.append(f"#### {label}\n\n" + report(rows, extra, target))
    out = "\n".join(text)
    print(out)
    if args.out:
        Path(args.out).write_text(out)
    return 0


def gpu_target_label(target: str) -> str:
    return {
        "h100": "H100 target, compiled on CPU, no autotuning",
        "cpu": "XLA:CPU",
    }[target]


if __name__ == "__main__":
    sys.exit(main())
