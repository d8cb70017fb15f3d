"""8-bit matmuls side by side: kernels and a GPT training step, in one run.

    python benchmarks/quantized.py                  # CPU defaults (~10 min)
    python benchmarks/quantized.py --quick          # fewer shapes and repeats
    python benchmarks/quantized.py --error-breakdown   # only (c), ~4 min

(a) Each linear-layer matmul of the GPT (qkv, attention output, MLP up and
down) at d_model 512 and 2048 as float32, bf16 -> f32, bf16 -> bf16,
int8 -> int32 and float8 (E4M3 -> f32), in the canonical layout
``(M, K) x (K, N)``, the weight-gradient layout (contraction over dim 0 of both
operands, what JAX's transpose rule emits for ``x^T g``) and that layout with
the transpose written out first (what ``jaxamp``'s int8 wgrad emits). Times in
ms, best of N; ratio = float32 time / this time.

(b) A training step (``jit(value_and_grad)``) of ``benchmarks/run.py``'s GPT in
float32, bf16 (default policy), int8 (``int8_policy``) and FP8
(``fp8_policy``): step-time ratio vs float32, saved residual bytes, gradient
relative L2 error vs float32. The model is small, so the 8-bit policies run
with ``size_rule=None`` (their default size rules would skip every matmul).

(c) ``--error-breakdown``: where the 8-bit gradient error of (b) comes from.
The quantization noise of each format on two kinds of operand, then the
gradient error vs float32 of the same GPT step under variants of the int8 and
FP8 policies (forward / dgrad only, rounding, granularity, per named scope),
per parameter group, each next to a hand-written reference of the same recipe
(plain ``jnp`` per product; see ``hand_int8`` and ``hand_fp8``).

Other processes may share the CPU: every figure is the best of N, and all
are measured in the same run; compare ratios, not absolute times.
"""

from __future__ import annotations

import argparse
import json
import math
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

F32, BF16, I8, I32 = jnp.float32, jnp.bfloat16, jnp.int8, jnp.int32
E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
FORMATS = {  # name: (operand dtype, result dtype)
    "fp32": (F32, F32),
    "bf16->f32": (BF16, F32),
    "bf16->bf16": (BF16, BF16),
    "int8->int32": (I8, I32),
    "fp8->f32": (E4M3, F32),
}


def best_ms(fn, args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))  # compile
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return 1e3 * min(times)


def _operands(m, k, n, dtype, layout):
    key1, key2 = jax.random.split(jax.random.key(0))
    a = (jax.random.normal(key1, (m, k)) * 4).astype(dtype)
    if layout == "canonical":
        return a, (jax.random.normal(key2, (k, n)) * 4).astype(dtype)
    return a, (jax.random.normal(key2, (m, n)) * 4).astype(dtype)


def _kernel(layout, out):
    if layout == "canonical":
        dn = (((1,), (0,)), ((), ()))
        return jax.jit(
            lambda a, b: jax.lax.dot_general(a, b, dn, preferred_element_type=out)
        )
    if layout == "wgrad":  # x^T g as JAX's transpose rule emits it
        dn = (((0,), (0,)), ((), ()))
        return jax.jit(
            lambda a, b: jax.lax.dot_general(a, b, dn, preferred_element_type=out)
        )
    dn = (((1,), (0,)), ((), ()))  # wgrad_T: transpose first
    return jax.jit(
        lambda a, b: jax.lax.dot_general(a.T, b, dn, preferred_element_type=out)
    )


def kernels(widths, tokens, repeats):
    rows = []
    for d in widths:
        m = tokens[d]
        for name, (k, n) in {
            "qkv": (d, 3 * d),
            "attn_out": (d, d),
            "up": (d, 4 * d),
            "down": (4 * d, d),
        }.items():
            for layout in ("canonical", "wgrad", "wgrad_T"):
                ms = {}
                for fmt, (dt, out) in FORMATS.items():
                    args = _operands(m, k, n, dt, layout)
                    ms[fmt] = best_ms(_kernel(layout, out), args, repeats)
                rows.append(
                    {
                        "d_model": d,
                        "matmul": name,
                        "M": m,
                        "K": k,
                        "N": n,
                        "layout": layout,
                        "ms": ms,
                    }
                )
                print(_kernel_row(rows[-1]), flush=True)
    return rows


def _kernel_row(r):
    cells = " | ".join(
        f"{v:.2f} ({r['ms']['fp32'] / v:.1f}x)" for v in r["ms"].values()
    )
    return (
        f"| {r['d_model']} | {r['matmul']} | {r['M']}x{r['K']}x{r['N']} "
        f"| {r['layout']} | {cells} |"
    )


def training_step(size, repeats):
    params, x, y = gpt_bench.init(size)
    loss = gpt_bench.make_loss(size)
    variants = {
        "fp32": loss,
        "bf16": jaxamp.amp(loss, compute_dtype=BF16),
        "int8": jaxamp.amp(
            loss, compute_dtype=BF16, amp_policy=jaxamp.int8_policy(size_rule=None)
        ),
        "int8 (wgrad int8)": jaxamp.amp(
            loss,
            compute_dtype=BF16,
            amp_policy=jaxamp.int8_policy(size_rule=None, wgrad=True),
        ),
        "fp8": jaxamp.amp(
            loss, compute_dtype=BF16, amp_policy=jaxamp.fp8_policy(size_rule=None)
        ),
    }
    steps = {k: jax.jit(jax.value_and_grad(f)) for k, f in variants.items()}
    _, ref = steps["fp32"](params, x, y)
    res32 = jaxamp.saved_residual_bytes(loss, params, x, y)
    rows, t32 = [], None
    for name, step in steps.items():
        ms = best_ms(step, (params, x, y), repeats)
        t32 = ms if name == "fp32" else t32
        _, g = step(params, x, y)
        grad_jaxpr = jax.make_jaxpr(jax.grad(variants[name]))(params, x, y)
        rows.append(
            {
                "variant": name,
                "ms": ms,
                "ratio_vs_fp32": t32 / ms,
                "residual_bytes": jaxamp.saved_residual_bytes(
                    variants[name], params, x, y
                ),
                "residual_vs_fp32": jaxamp.saved_residual_bytes(
                    variants[name], params, x, y
                )
                / res32,
                "grad_rel_err": common.rel_l2(g, ref),
                "eight_bit_flop_share": jaxamp.tools.eight_bit_flop_share(grad_jaxpr),
            }
        )
        r = rows[-1]
        print(
            f"| {name} | {ms:.1f} | {r['ratio_vs_fp32']:.2f}x | {r['residual_bytes']} "
            f"({r['residual_vs_fp32']:.2f}x) | {r['grad_rel_err']:.2e} "
            f"| {r['eight_bit_flop_share']:.2f} |",
            flush=True,
        )
    return rows


# --- (c) Gradient error breakdown ------------------------------------------
#
# Where the 8-bit gradient error comes from, and whether it is the recipe's or
# jaxamp's: the same GPT as (b) with jax.named_scope("attn" / "mlp" / "head")
# around its parts and the tied head weight passed separately (so that the
# embedding and head shares of its gradient are reported apart), trained one
# step under variants of jaxamp's policies and under a hand-written reference
# of the same recipes below (plain jnp, a custom_vjp per product, threefry
# noise for stochastic rounding instead of jaxamp's data hash), plugged into
# the same amp transform as an implementation rule for dot_general.

GROUPS = ("embedding", "attention", "mlp", "head", "norms")


def scoped_loss(size):
    """``benchmarks/run.py``'s GPT loss with named scopes and an untied head:
    ``loss(params, head, x, y)`` equals ``make_loss(size)(params, x, y)`` at
    ``head = params["emb"]``."""
    loss = common.gpt_loss(gpt_bench.SIZES[size], scopes=True, head="head")
    return lambda params, head, x, y: loss({**params, "head": head}, x, y)


def _canonical(lhs, rhs, dn):
    """``lhs`` as ``(batch, M, K)``, ``rhs`` as ``(batch, K, N)``, and the
    ``dot_general`` output shape."""
    (lc, rc), (lb, rb) = dn
    lf = [i for i in range(lhs.ndim) if i not in (*lc, *lb)]
    rf = [i for i in range(rhs.ndim) if i not in (*rc, *rb)]
    size = lambda a, ds: math.prod(a.shape[i] for i in ds)
    nb = size(lhs, lb)
    a = jnp.transpose(lhs, (*lb, *lf, *lc)).reshape(nb, size(lhs, lf), -1)
    b = jnp.transpose(rhs, (*rb, *rc, *rf)).reshape(nb, size(rhs, rc), -1)
    shape = [lhs.shape[i] for i in (*lb, *lf)] + [rhs.shape[i] for i in rf]
    return a, b, tuple(shape)


def _bmm(a, b, contract, out=F32):
    """Batched product over dim 0; ``contract``: (dim of a, dim of b)."""
    dn = (((contract[0],), (contract[1],)), ((0,), (0,)))
    return jax.lax.dot_general(a, b, dn, preferred_element_type=out)


def hand_int8_quantize(x, axis, key=None):
    """``(q, step)``: ``x ~= q * step``, ``step = amax / 127`` over ``axis``
    (None: the whole tensor), rounded to nearest or, with ``key``,
    stochastically (``floor(x / step + u)``, ``u ~ U[0, 1)`` from threefry)."""
    amax = jnp.max(jnp.abs(x), axis=axis, keepdims=True)
    step = jnp.where(amax > 0, amax / 127, 1.0)
    y = x / step
    y = jnp.round(y) if key is None else jnp.floor(y + jax.random.uniform(key, y.shape))
    return jnp.clip(y, -127, 127).astype(I8), step


def hand_int8(cd, forward=True, dgrad=True, stochastic=True, rowwise=True, seed=0):
    """The int8 recipe written by hand on ``(B, M, K) x (B, K, N)``: forward
    and dgrad int8 x int8 -> int32, wgrad in ``cd`` from the forward's int8
    activations; the weight's per-column step folded into the gradient before
    the gradient is quantized per row for the dgrad (per tensor when the
    forward is not quantized, as jaxamp does)."""
    axis = (lambda a: a) if rowwise else (lambda a: None)

    def key_for(g):  # a fresh threefry stream per call: fold in the data's bits
        bits = jnp.sum(jax.lax.bitcast_convert_type(g, jnp.uint32), dtype=jnp.uint32)
        return jax.random.fold_in(jax.random.key(seed), bits) if stochastic else None

    def fwd(x, w):
        if forward:
            xq, sx = hand_int8_quantize(x, axis(2))  # per row of x
            wq, sw = hand_int8_quantize(w, axis(1))  # per column of w
            y = _bmm(xq, wq, (2, 1), I32).astype(F32) * sx * sw
            xd, wd = xq.astype(F32) * sx, wq.astype(F32) * sw  # the int8 grid
        else:
            xd, wd = x.astype(cd).astype(F32), w.astype(cd).astype(F32)
            y = _bmm(xd.astype(cd), wd.astype(cd), (2, 1), cd)
        return y.astype(cd), (xd, wd)

    def bwd(res, g):
        xd, wd = res
        g = g.astype(F32)
        if dgrad:  # d x = g . w^T = (g * step_w) . q_w^T
            wq, sw = hand_int8_quantize(wd, axis(1) if forward else None)
            gs = g * sw  # step per column of w: per column of g
            gq, sg = hand_int8_quantize(gs, axis(2), key_for(gs))
            dx = _bmm(gq, wq, (2, 2), I32).astype(F32) * sg
        else:
            dx = _bmm(g.astype(cd), wd.astype(cd), (2, 2), cd).astype(F32)
        dw = _bmm(xd.astype(cd), g.astype(cd), (1, 1), cd).astype(F32)
        return dx, dw

    f = jax.custom_vjp(lambda x, w: fwd(x, w)[0])
    f.defvjp(fwd, bwd)
    return f


def hand_fp8_quantize(x, dtype):
    """Per-tensor current scaling: ``x * fp8_max / amax`` cast to ``dtype``,
    returned dequantized (float32 values on the float8 grid)."""
    amax = jnp.max(jnp.abs(x))
    s = jnp.where(amax > 0, float(jnp.finfo(dtype).max) / amax, 1.0)
    return (x * s).astype(dtype).astype(F32) / s


def hand_fp8(cd, grad_dtype=E5M2, forward=True, backward=True):
    """The FP8 recipe written by hand: E4M3 operands forward, ``grad_dtype``
    gradient backward, both gradient products from the forward's E4M3
    operands; float32 products of float8-grid values are exact."""

    def fwd(x, w):
        if forward:
            xd, wd = hand_fp8_quantize(x, E4M3), hand_fp8_quantize(w, E4M3)
        else:
            xd, wd = x.astype(cd).astype(F32), w.astype(cd).astype(F32)
        return _bmm(xd, wd, (2, 1)).astype(cd), (xd, wd)

    def bwd(res, g):
        xd, wd = res
        g = g.astype(F32)
        if backward:
            g = hand_fp8_quantize(g, grad_dtype)
        else:
            g, xd, wd = (a.astype(cd).astype(F32) for a in (g, xd, wd))
        return _bmm(g, wd, (2, 2)), _bmm(xd, g, (1, 1))

    f = jax.custom_vjp(lambda x, w: fwd(x, w)[0])
    f.defvjp(fwd, bwd)
    return f


def hand_policy(make, **kw):
    """The default amp policy with every float ``dot_general`` run through the
    hand recipe ``make(compute_dtype, **kw)`` (an implementation rule)."""

    def rule(compute_dtype, original_dtypes, lhs, rhs, **params):
        del original_dtypes
        a, b, shape = _canonical(lhs, rhs, params["dimension_numbers"])
        f = make(np.dtype(compute_dtype), **kw)
        return f(a.astype(F32), b.astype(F32)).reshape(shape)

    rule.amp_impl = True
    return {**jaxamp.default_amp_policy, "dot_general": rule}


def _group_errors(g, ref):
    """Relative L2 error of the gradient, in total (the tied embedding's two
    parts summed, as training sees them) and per parameter group."""
    sq = lambda xs: sum(float(jnp.sum(jnp.square(a.astype(F32)))) for a in xs)

    def groups(grads):
        (p, head), lay = grads, grads[0]["layers"]
        tied = {**p, "emb": p["emb"] + head}
        return {
            "total": jax.tree.leaves(tied),
            "embedding": [p["emb"], p["pos"]],
            "attention": [lay["qkv"], lay["o"]],
            "mlp": [lay["up"], lay["down"]],
            "head": [head],
            "norms": [lay["ln1"], lay["ln2"], p["lnf"]],
        }

    got, want = groups(g), groups(ref)
    return {
        k: (sq([a - b for a, b in zip(got[k], want[k])]) / sq(want[k])) ** 0.5
        for k in want
    }


def breakdown_variants():
    """Rows ``(name, jaxamp policies, hand policies)``: each a list (one
    policy per stochastic-rounding draw where there are several), empty where
    that side has no such variant."""
    # The head quantized too, as the hand recipes do (quantize_last_matmul=True);
    # the policies' defaults keep it in bf16 (the "default" rows).
    i8 = lambda **kw: jaxamp.int8_policy(
        size_rule=None, quantize_last_matmul=True, **kw
    )
    f8 = lambda **kw: jaxamp.fp8_policy(size_rule=None, quantize_last_matmul=True, **kw)
    h8 = lambda **kw: hand_policy(hand_int8, **kw)
    hf8 = lambda **kw: hand_policy(hand_fp8, **kw)
    keys = (None, jax.random.key(1), jax.random.key(2))
    return [
        ("bf16", [jaxamp.default_amp_policy], []),
        (
            "int8: fwd + dgrad int8, SR, rowwise (3 draws)",
            [i8(key=k) for k in keys],
            [h8(seed=s) for s in range(3)],
        ),
        ("int8, forward only", [i8(dgrad=False)], [h8(dgrad=False)]),
        ("int8, dgrad only", [i8(forward=False)], [h8(forward=False)]),
        (
            "int8, round to nearest",
            [i8(stochastic_rounding=False)],
            [h8(stochastic=False)],
        ),
        ("int8, tensorwise", [i8(granularity="tensorwise")], [h8(rowwise=False)]),
        ("int8, wgrad int8 too", [i8(wgrad=True)], []),
        ("int8, head in bf16", [i8(exclude_scopes=("head",))], []),
        (
            "int8 default (head kept by the value facts)",
            [jaxamp.int8_policy(size_rule=None)],
            [],
        ),
        ("int8, only the head", [i8(scopes=("head",))], []),
        ("int8, only attn (qkv, o)", [i8(scopes=("attn",))], []),
        ("int8, only mlp", [i8(scopes=("mlp",))], []),
        ("fp8: E4M3 fwd, E5M2 grads", [f8()], [hf8()]),
        ("fp8, head in bf16", [f8(exclude_scopes=("head",))], []),
        (
            "fp8 default (head kept by the value facts)",
            [jaxamp.fp8_policy(size_rule=None)],
            [],
        ),
        ("fp8, forward only (bf16 backward)", [], [hf8(backward=False)]),
        ("fp8, E4M3 gradients", [], [hf8(grad_dtype=E4M3)]),
    ]


def error_breakdown(size):
    """Print and return the gradient error of each variant of
    :func:`breakdown_variants` vs float32, one step on one batch."""
    params, x, y = gpt_bench.init(size)
    loss = scoped_loss(size)
    same = loss(params, params["emb"], x, y) - gpt_bench.make_loss(size)(params, x, y)
    assert abs(float(same)) < 1e-5, "scoped_loss must be run.py's model"

    def grads(policy=None):
        f = loss
        if policy is not None:
            f = jaxamp.amp(loss, compute_dtype=BF16, amp_policy=policy)
        return jax.jit(jax.grad(f, (0, 1)))(params, params["emb"], x, y)

    ref = grads()
    print("| variant | jaxamp | hand recipe | jaxamp: " + " | ".join(GROUPS) + " |")
    print("|---|---|---|" + "---|" * len(GROUPS))
    rows, bf16 = [], None
    for name, ours, hand in breakdown_variants():
        e_ours = [_group_errors(grads(p), ref) for p in ours]
        e_hand = [_group_errors(grads(p), ref)["total"] for p in hand]
        row = {"variant": name, "jaxamp": e_ours, "hand": e_hand}
        bf16 = bf16 or e_ours[0]["total"]
        rows.append(row)
        print(_breakdown_row(row, bf16), flush=True)
    return rows


def _spread(xs, bf16):
    if not xs:
        return "-"
    mean = sum(xs) / len(xs)
    cell = f"{mean:.2e} ({mean / bf16:.1f}x)"
    return cell if len(xs) == 1 else f"{cell}, {min(xs):.2e}-{max(xs):.2e}"


def _breakdown_row(row, bf16):
    ours = row["jaxamp"]
    groups = [
        f"{sum(e[k] for e in ours) / len(ours):.1e}" if ours else "-" for k in GROUPS
    ]
    total = _spread([e["total"] for e in ours], bf16)
    return (
        f"| {row['variant']} | {total} | {_spread(row['hand'], bf16)} | "
        + " | ".join(groups)
        + " |"
    )


def _noise_operands(rows=1024, width=256):
    """Two operand kinds of the GPT step: Gaussian rows (layer-norm outputs,
    weights) and the head's logit gradients ``softmax(l) - onehot`` (logits of
    std 0.3, as at initialization), the dgrad operand of the head."""
    k1, k2, k3 = jax.random.split(jax.random.key(5), 3)
    gauss = jax.random.normal(k1, (rows, width))
    logits = 0.3 * jax.random.normal(k2, (rows, width))
    gold = jax.nn.one_hot(jax.random.randint(k3, (rows,), 0, width), width)
    return {
        "Gaussian rows": gauss,
        "logit gradient rows": jax.nn.softmax(logits) - gold,
    }


def _quantizers():
    """name -> x -> its quantized value (dequantized, float32)."""
    key = jax.random.key(6)

    def int8(x, axis, sr=False):
        q, step = hand_int8_quantize(x, axis, key if sr else None)
        return q.astype(F32) * step

    return {
        "bf16": lambda x: x.astype(BF16).astype(F32),
        "int8 rowwise, nearest": lambda x: int8(x, 1),
        "int8 rowwise, stochastic": lambda x: int8(x, 1, True),
        "int8 tensorwise, nearest": lambda x: int8(x, None),
        "E4M3 per tensor": lambda x: hand_fp8_quantize(x, E4M3),
        "E5M2 per tensor": lambda x: hand_fp8_quantize(x, E5M2),
    }


def noise_model():
    """Print the quantization noise of each format on the two operand kinds:
    relative L2 error of the elements, and of the column sums (over the 1024
    rows: a bias shows there, zero-mean noise averages out)."""
    ops = _noise_operands()
    rel = common.rel_l2
    print(
        "| format | "
        + " | ".join(f"{k}: elements | {k}: column sums" for k in ops)
        + " |"
    )
    print("|---|" + "---|---|" * len(ops))
    rows = []
    for name, q in _quantizers().items():
        row = {"format": name}
        for k, x in ops.items():
            qx = q(x)
            row[k] = (rel(qx, x), rel(qx.sum(0), x.sum(0)))
        rows.append(row)
        cells = " | ".join(f"{row[k][0]:.1e} | {row[k][1]:.1e}" for k in ops)
        print(f"| {name} | {cells} |", flush=True)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="d_model 512 only, 3 repeats")
    p.add_argument("--size", default="S", help="benchmarks/run.py model size")
    p.add_argument("--out", default=None, help="JSON file for the figures")
    p.add_argument(
        "--error-breakdown",
        action="store_true",
        help="only (c): the gradient error per variant, jaxamp vs a hand recipe",
    )
    a = p.parse_args(argv)
    if a.error_breakdown:
        print(f"jax {jax.__version__}; quantization noise per format:")
        noise = noise_model()
        print(f"\nGradient error vs float32, benchmarks/run.py size {a.size}:")
        rows = error_breakdown(a.size)
        if a.out:
            out = {"noise": noise, "breakdown": rows}
            Path(a.out).write_text(json.dumps(out, indent=1))
        return 0
    repeats = 3 if a.quick else 5
    widths = (512,) if a.quick else (512, 2048)
    tokens = {512: 2048, 2048: 1024}
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}")
    print("| d_model | matmul | MxKxN | layout | " + " | ".join(FORMATS) + " |")
    print("|---|---|---|---|" + "---|" * len(FORMATS))
    kern = kernels(widths, tokens, repeats)
    print(f"\nTraining step, benchmarks/run.py size {a.size}:")
    print(
        "| variant | ms | speed vs fp32 | residual bytes | grad rel err | 8-bit FLOPs |"
    )
    print("|---|---|---|---|---|---|")
    step = training_step(a.size, repeats)
    if a.out:
        Path(a.out).write_text(json.dumps({"kernels": kern, "step": step}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
