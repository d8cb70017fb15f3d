"""RMSNorm and QK-norm under amp, along a training run, against hand-written bf16.

    python benchmarks/rmsnorm.py --out benchmarks/RESULTS_RMSNORM.md

A LLaMA-style GPT (pre-RMSNorm blocks in ``lax.scan``, RMSNorm on each head's
queries and keys before the logits, as OLMo 2 and Gemma 3 do, embeddings
multiplied by sqrt(d_model) as Gemma does, a SiLU-gated MLP,
a final RMSNorm and a byte-level cross-entropy) is trained in float32 with AdamW
on the Python standard library's source (the main job's corpus,
``examples/train_charlm.py``). At evenly spaced steps of that one trajectory
the gradients of ``--eval-batches`` fixed held-out batches are taken by:

* ``fp32``: the reference, ``precision="highest"``;
* ``jaxamp bf16``: ``jaxamp.amp`` with the default policy;
* ``jaxamp bf16, RMSNorm rule off``: the same with the ``rms_scaling`` fact
  switched off, i.e. the scaling ``x * rsqrt(ms)`` following its bfloat16
  input as in the release before it;
* ``hand bf16``: a careful hand-written model: bfloat16 parameters, matmuls
  and residual stream, the RMSNorm statistic and scaling in float32 with one
  rounding before the gain, float32 softmax and loss (as ``run.py``'s).

Figures per step: the gradient's relative L2 error against fp32 (all
parameters, and the attention projection ``qkv`` alone, which QK-norm
differentiates through), the loss difference, and the largest activation
entering an RMSNorm (they grow as the model trains); once: the bytes of the
residuals saved for the backward pass, against fp32's.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "examples"))

import common  # noqa: E402
import train_charlm as _charlm  # noqa: E402  (the main job's corpus and batches)

import jaxamp  # noqa: E402

BF16, F32 = jnp.bfloat16, jnp.float32


def init(d: int, layers: int, heads: int, vocab: int, seed: int) -> dict:
    """float32 parameters, pre-rounded to bfloat16."""
    ks = jax.random.split(jax.random.key(seed), 6)

    def n(k, shape, scale):
        return (jax.random.normal(k, shape) * scale).astype(BF16).astype(F32)

    return {
        "emb": n(ks[0], (vocab, d), 1.0),
        "layers": {
            "norm1": jnp.ones((layers, d)),
            "qkv": n(ks[1], (layers, d, 3 * d), d**-0.5),
            "q_norm": jnp.ones((layers, d // heads)),
            "k_norm": jnp.ones((layers, d // heads)),
            "o": n(ks[2], (layers, d, d), (2 * layers * d) ** -0.5),
            "norm2": jnp.ones((layers, d)),
            "gate_up": n(ks[3], (layers, d, 8 * d), d**-0.5),
            "down": n(ks[4], (layers, 4 * d, d), (8 * layers * d) ** -0.5),
        },
        "norm_f": jnp.ones(d),
        "head": n(ks[5], (d, vocab), d**-0.5),
    }


rms_norm = common.rms_norm  # its third argument: statistic and scaling in float32


def make_loss(heads: int, emb_scale: float, hand: bool = False, probe: bool = False):
    """``loss(params, x, y)``; the embeddings are multiplied by ``emb_scale``
    (Gemma's sqrt(d_model)); ``probe``: also return the largest activation
    entering an RMSNorm."""

    def block(carry, w):
        x, peak = carry
        B, T, D = x.shape
        h = rms_norm(x, w["norm1"], hand)
        q, k, v = jnp.split(h @ w["qkv"], 3, -1)
        q, k, v = (t.reshape(B, T, heads, D // heads) for t in (q, k, v))
        qk_peak = jnp.maximum(jnp.abs(q).max(), jnp.abs(k).max())
        peak = jnp.maximum(peak, qk_peak.astype(peak.dtype))
        q, k = rms_norm(q, w["q_norm"], hand), rms_norm(k, w["k_norm"], hand)
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k)
        if hand:
            s = s.astype(F32)
        s = s / np.float32(np.sqrt(D // heads))
        mask = jnp.tril(jnp.ones((T, T), bool))
        p = jax.nn.softmax(jnp.where(mask, s, -1e9), -1).astype(v.dtype)
        a = jnp.einsum("bhqk,bkhd->bqhd", p, v).reshape(B, T, D)
        x = x + a @ w["o"]
        h = rms_norm(x, w["norm2"], hand)
        gate, up = jnp.split(h @ w["gate_up"], 2, -1)
        x = x + (jax.nn.silu(gate) * up) @ w["down"]
        peak = jnp.maximum(peak, jnp.abs(x).max().astype(peak.dtype))
        return (x, peak), None

    def loss(params, x, y):
        p = jaxamp.migration.mpx.cast_to_bfloat16(params) if hand else params
        h = p["emb"][x] * jnp.asarray(emb_scale, p["emb"].dtype)  # stays bf16 by hand
        (h, peak), _ = jax.lax.scan(block, (h, jnp.zeros((), F32)), p["layers"])
        logits = (rms_norm(h, p["norm_f"], hand) @ p["head"]).astype(F32)
        lse = jax.nn.logsumexp(logits, -1)
        gold = jnp.take_along_axis(logits, y[..., None], -1)[..., 0]
        out = (lse - gold).mean()
        return (out, peak) if probe else out

    return loss


def rms_rule_off():
    """``jaxamp.amp`` without the ``rms_scaling`` fact: no equation is an
    RMSNorm scaling, so it follows its input's dtype (an ablation)."""
    from jaxamp import _amp

    return _amp.ablated(facts=["rms_scaling"])


def measure(args) -> tuple[list[dict], dict]:
    train, val = _charlm.load_corpus(args.data_dir, args.max_bytes)
    scale = args.d_model**0.5 if args.emb_scale is None else args.emb_scale
    loss = make_loss(args.heads, scale)
    probe = jax.jit(make_loss(args.heads, scale, probe=True))
    params = init(args.d_model, args.layers, args.heads, 256, args.seed)
    held_out = _charlm.batches(val, args.batch_size, args.seq_len, args.seed + 1)
    evals = [next(held_out) for _ in range(args.eval_batches)]
    xe, ye = evals[0]
    tx = optax.adamw(args.lr, weight_decay=0.1)
    opt = tx.init(params)

    @jax.jit
    def step(params, opt, x, y):
        g = jax.grad(loss)(params, x, y)
        up, opt = tx.update(g, opt, params)
        return optax.apply_updates(params, up), opt

    ref_grad = jax.jit(jax.value_and_grad(loss))  # traced under "highest" below
    amp_loss = jaxamp.amp(loss, compute_dtype=BF16)
    hand_loss = make_loss(args.heads, scale, hand=True)
    amp_grad = jax.jit(jax.value_and_grad(amp_loss))
    hand_grad = jax.jit(jax.value_and_grad(hand_loss))
    fp32_bytes = jaxamp.saved_residual_bytes(loss, params, xe, ye)
    residuals = {
        "jaxamp bf16": jaxamp.saved_residual_bytes(amp_loss, params, xe, ye),
        "hand bf16": jaxamp.saved_residual_bytes(hand_loss, params, xe, ye),
    }
    off_loss = rms_rule_off()(loss, compute_dtype=BF16)
    off_grad = jax.jit(jax.value_and_grad(off_loss))
    residuals["jaxamp bf16, RMSNorm rule off"] = jaxamp.saved_residual_bytes(
        off_loss, params, xe, ye
    )
    residuals = {k: v / fp32_bytes for k, v in residuals.items()}
    variants = {
        "jaxamp bf16": amp_grad,
        "jaxamp bf16, RMSNorm rule off": off_grad,
        "hand bf16": hand_grad,
    }
    checkpoints = set(np.linspace(0, args.steps, args.points).astype(int).tolist())
    batches = _charlm.batches(train, args.batch_size, args.seq_len, args.seed)
    rows = []
    for t in range(args.steps + 1):
        if t in checkpoints:
            rows.append(_errors(t, params, evals, ref_grad, probe, variants))
            print(json.dumps(rows[-1]), flush=True)
        if t < args.steps:
            x, y = next(batches)
            params, opt = step(params, opt, x, y)
    return rows, residuals


def _errors(t, params, evals, ref_grad, probe, variants) -> dict:
    """Errors of each variant against fp32 at step ``t``, averaged over the
    held-out batches ``evals``."""
    acc: dict = {
        name: {"grad_rel_l2": [], "qkv_grad_rel_l2": [], "loss_abs_err": []}
        for name in variants
    }
    losses, peaks = [], []
    for x, y in evals:
        with jax.default_matmul_precision("highest"):
            ref_l, ref_g = ref_grad(params, x, y)
            peaks.append(float(probe(params, x, y)[1]))
        losses.append(float(ref_l))
        for name, fn in variants.items():
            lv, g = fn(params, x, y)
            acc[name]["grad_rel_l2"].append(common.rel_l2(g, ref_g))
            acc[name]["qkv_grad_rel_l2"].append(
                common.rel_l2(g["layers"]["qkv"], ref_g["layers"]["qkv"])
            )
            acc[name]["loss_abs_err"].append(abs(float(lv) - float(ref_l)))
    row = {"step": t, "loss": float(np.mean(losses)), "peak_activation": max(peaks)}
    for name, figs in acc.items():
        row[name] = {k: float(np.mean(v)) for k, v in figs.items()}
    return row


def markdown(rows: list[dict], meta: dict) -> str:
    names = [k for k in rows[0] if isinstance(rows[0][k], dict)]
    lines = [
        "# RMSNorm and QK-norm under amp along a float32 training run",
        "",
        f"Command: `{meta['command']}`",
        "",
        f"JAX {meta['jax']}, {meta['device']}, {meta['wall_s']:.0f} s. "
        'Gradient relative L2 error against float32 (`precision="highest"`), mean'
        f" over {meta['args']['eval_batches']} fixed held-out batches, at steps of"
        " one float32 AdamW trajectory; "
        "`qkv`: the attention projection alone (QK-norm differentiates through it).",
        "",
        "| step | fp32 loss | peak activation | "
        + " | ".join(f"{n}: grad / qkv / loss err" for n in names)
        + " |",
        "|---|---|---|" + "---|" * len(names),
    ]
    for r in rows:
        cells = [
            f"{r[n]['grad_rel_l2']:.2e} / {r[n]['qkv_grad_rel_l2']:.2e} / "
            f"{r[n]['loss_abs_err']:.1e}"
            for n in names
        ]
        lines.append(
            f"| {r['step']} | {r['loss']:.3f} | {r['peak_activation']:.0f} | "
            + " | ".join(cells)
            + " |"
        )
    trained = rows[1:] or rows

    def mean(name, key):
        return float(np.mean([r[name][key] for r in trained]))

    hand = "hand bf16" if "hand bf16" in names else None
    lines += [
        "",
        "Means over the trained steps (after step 0), and relative to hand bf16:",
        "",
        "| variant | grad error | qkv grad error | loss error | residuals vs fp32 |",
        "|---|---|---|---|---|",
    ]
    residuals = meta.get("residual_bytes_vs_fp32", {})
    for n in names:
        cells = []
        for key in ("grad_rel_l2", "qkv_grad_rel_l2", "loss_abs_err"):
            ratio = f" ({mean(n, key) / mean(hand, key):.2f}x)" if hand else ""
            cells.append(f"{mean(n, key):.2e}{ratio}")
        res = f"{residuals[n]:.3f}x" if n in residuals else "n/a"
        lines.append(f"| {n} | " + " | ".join(cells) + f" | {res} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Runs the measurement and writes the markdown (and a JSON beside it)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--points", type=int, default=4, help="checkpoints incl. step 0")
    ap.add_argument("--eval-batches", type=int, default=4, help="averaged per point")
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--emb-scale",
        type=float,
        default=None,
        help="embedding multiplier (default sqrt(d_model), as Gemma)",
    )
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--max-bytes", type=int, default=3_000_000)
    ap.add_argument("--out", default=None, help="markdown file (default: stdout)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    rows, residuals = measure(args)
    meta = {
        "residual_bytes_vs_fp32": residuals,
        "command": shlex.join(
            ["python", "benchmarks/rmsnorm.py", *(argv or sys.argv[1:])]
        ),
        "jax": jax.__version__,
        "device": str(jax.devices()[0].device_kind),
        "wall_s": time.perf_counter() - t0,
        "args": vars(args),
    }
    text = markdown(rows, meta)
    if args.out:
        Path(args.out).write_text(text)
        Path(args.out).with_suffix(".json").write_text(
            json.dumps({"meta": meta, "rows": rows}, indent=1)
        )
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
