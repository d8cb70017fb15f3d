"""Print the gradient jaxprs amp produces for a set of reference models.

Used to check that a refactoring of the core leaves the rewrite unchanged:
run it before and after and ``diff`` the outputs.

    python benchmarks/jaxpr_snapshot.py > before.txt
    ... change the code ...
    python benchmarks/jaxpr_snapshot.py > after.txt && diff before.txt after.txt

The models: the main job's GPT (``examples/train_charlm.py``: scanned,
checkpointed layers, LayerNorm, ``jax.nn.dot_product_attention``, tied
embedding) in bf16, fp16 (loss-scaled policy, overflow check on) and fp8; a
hand-written attention + RMSNorm block (the two pattern rewrites); and an
unrolled RNN in ``lax.scan`` with a loop-invariant weight (scan input hoisting).
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

import train_charlm as charlm  # noqa: E402

import jaxamp  # noqa: E402


def _gpt() -> list[tuple[str, object, tuple]]:
    cfg = charlm.Config(d_model=64, layers=2, heads=4, seq_len=32, batch_size=2)
    params = charlm.init_params(jax.random.PRNGKey(0), cfg)
    x = jnp.zeros((cfg.batch_size, cfg.seq_len), jnp.int32)
    out = []
    for mode in ("bf16", "fp16", "fp8"):
        out.append((f"charlm {mode}", charlm.mode_loss(mode, cfg), (params, x, x)))
    return out


def _hand_block(w, x):
    b, t, d = x.shape
    h = x @ w["qkv"]
    q, k, v = jnp.split(h, 3, axis=-1)
    s = jnp.einsum("btd,bsd->bts", q, k) / jnp.sqrt(jnp.float32(d))
    p = jax.nn.softmax(s, axis=-1)
    a = jnp.einsum("bts,bsd->btd", p, v)
    ms = jnp.mean(a * a, -1, keepdims=True)
    r = a * jax.lax.rsqrt(ms + 1e-6) * w["g"]
    return jnp.mean((r @ w["o"]) ** 2)


def _rnn(w, xs):
    def step(h, x):
        h = jnp.tanh(h @ w["h"] + x @ w["x"])
        return h, h

    _, hs = jax.lax.scan(step, jnp.zeros((xs.shape[1], 16)), xs)
    return jnp.mean(hs**2)


def models() -> list[tuple[str, object, tuple]]:
    """``(name, loss, args)`` of every reference model."""
    k = jax.random.split(jax.random.PRNGKey(1), 6)
    blk = {
        "qkv": jax.random.normal(k[0], (32, 96)) * 0.2,
        "o": jax.random.normal(k[1], (32, 32)) * 0.2,
        "g": jnp.ones((32,)),
    }
    xb = jax.random.normal(k[2], (2, 8, 32)) * 100.0
    rnn = {
        "h": jax.random.normal(k[3], (16, 16)),
        "x": jax.random.normal(k[4], (8, 16)),
    }
    xs = jax.random.normal(k[5], (5, 3, 8))
    out = _gpt()
    for name, dt in (("bf16", jnp.bfloat16), ("fp16", jnp.float16)):
        out.append(
            (f"hand block {name}", jaxamp.amp(_hand_block, compute_dtype=dt), (blk, xb))
        )
        out.append((f"rnn {name}", jaxamp.amp(_rnn, compute_dtype=dt), (rnn, xs)))
    return out


def main() -> int:
    for name, loss, args in models():
        print(f"==== {name}")
        print(jax.make_jaxpr(jax.grad(loss))(*args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
