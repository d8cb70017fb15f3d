"""Compressed residuals (``jaxamp.amp(residual_dtype=...)``): bytes saved for
the backward pass, gradient error, and the step's per-layer peak.

    python benchmarks/residuals.py --out benchmarks/RESULTS_RESIDUALS.md

Part 1, on ``benchmarks/run.py``'s scanned GPT of size S (width 256, 4 layers,
seq 128, batch 8; float32 parameters pre-rounded to bfloat16): per compute
dtype (bfloat16; float16 with dynamic loss scaling at 2**15) and residual
dtype (None, E4M3, E5M2, int8), the saved residual bytes
(``jaxamp.saved_residual_bytes``, arguments excluded) relative to float32's,
and the gradients' relative L2 error against float32's, also relative to amp's
own (``residual_dtype=None``) at the same compute dtype; the same with each
scanned block under ``jax.checkpoint`` (bytes relative to float32 with the
same checkpoint).

Part 1b, the same model with each block under ``jax.checkpoint`` and a
policy, as large models are trained: ``save_only_these_names("act")`` (the
residual stream after attention, which the MLP's LayerNorm and matmul read,
named with ``checkpoint_name``) and ``dots_with_no_batch_dims_saveable`` (the
projections' outputs); bfloat16 compute; bytes and errors also relative to
amp bfloat16's with the same checkpoint, and the whole step's peak and FLOPs
(XLA:CPU's ``memory_analysis()`` and ``cost_analysis()`` of the jitted
``value_and_grad``, compile only: the recomputation the policy leaves).

Part 1c (``--only-blocks`` alone), block shapes (issue 52): 4 residual
blocks of width 256 on 128 rows (tanh, GELU and SiLU MLPs, an attention
block, a residual stream named between attention and an MLP), each under
``jax.checkpoint`` with each policy, E4M3 and int8 against amp bfloat16 with
the same checkpoint (``block_model``).

Part 2, activation-dominated (seq >= 2048): XLA's ``memory_analysis()`` of
the jitted ``value_and_grad`` (compile only) at two layer counts; the step's
peak is ``argument + output - alias + temp`` bytes, the per-layer peak the
slope between them (fixed costs cancel). XLA:CPU's buffer assignment stands
in for a GPU's.

Part 3 (``--gpu``), the activation-dominated regime as an H100 lays it out:
width 256, seq 1024, batch 8, 8 heads, the per-layer peak (slope between 2
and 4 layers) of the jitted ``value_and_grad`` compiled for XLA:CPU and for an
H100 on this machine (``gpu_target.compile_for``: deviceless, needs the CUDA
plugin, ``JAX_PLATFORMS=cpu``), with amp's XLA attention path
(``attention_rule("xla")``: float32 logits and softmax) and with cuDNN
attention (``attention_rule("cudnn")``, H100 only), each with E4M3 and int8
residuals; with ``--remat``, each scanned block under ``jax.checkpoint`` (what
the checkpoint saves, stored by the rule of ``_policy/_checkpoint.py``).
"""

from __future__ import annotations

import argparse
import functools
import platform
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

import jaxamp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import gpu_target  # noqa: E402
import run  # noqa: E402

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
STORED = {"none": None, "E4M3": E4M3, "E5M2": E5M2, "int8": "int8"}
# Activation-dominated: d_model, heads, seq, batch, vocab (the layer count
# varies); long sequences make the saved activations dwarf the parameters.
LONG = {"d": 256, "heads": 4, "seq": 2048, "batch": 2, "vocab": 256}


def _grads(loss, compute, params, x, y):
    if compute == "float16":
        return run.value_and_grad(run.LossScaled(loss))(params, x, y)[1]
    return jax.grad(loss)(params, x, y)


def part1(remat: bool) -> list[dict]:
    """Residual bytes and gradient error per compute and residual dtype."""
    params, x, y = run.init("S")
    base = run.make_loss("S", remat=remat)
    f32 = jaxamp.saved_residual_bytes(base, params, x, y)
    ref = jax.jit(jax.grad(base))(params, x, y)
    rows = []
    for compute in ("bfloat16", "float16"):
        amp_err = None
        for name, stored in STORED.items():
            loss = jaxamp.amp(base, compute_dtype=compute, residual_dtype=stored)
            grads = jax.jit(
                lambda p, a, b, loss=loss, c=compute: _grads(loss, c, p, a, b)
            )(params, x, y)
            finite = all(bool(jnp.isfinite(g).all()) for g in jax.tree.leaves(grads))
            err = common.rel_l2(grads, ref)
            amp_err = err if amp_err is None else amp_err
            rows.append(
                {
                    "compute": compute,
                    "residuals": name,
                    "bytes_vs_fp32": jaxamp.saved_residual_bytes(loss, params, x, y)
                    / f32,
                    "grad_err": err,
                    "err_vs_amp": err / amp_err,
                    "finite": finite,
                }
            )
    return rows


POLICIES = {
    'save_only_these_names("act")': jax.checkpoint_policies.save_only_these_names(
        "act"
    ),
    "dots_with_no_batch_dims_saveable": (
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    ),
}


def checkpointed_loss(size: str, policy):
    """``run.make_loss(size)``'s model with each scanned block under
    ``jax.checkpoint(block, policy=policy)``; the residual stream after
    attention is named ``"act"``."""
    return common.gpt_loss(run.SIZES[size], remat=True, policy=policy, act_name="act")


def part1b() -> list[dict]:
    """Blocks checkpointed with a policy: bytes and error against amp
    bfloat16's with the same checkpoint."""
    params, x, y = run.init("S")
    rows = []
    for policy_name, policy in POLICIES.items():
        base = checkpointed_loss("S", policy)
        f32 = jaxamp.saved_residual_bytes(base, params, x, y)
        ref = jax.jit(jax.grad(base))(params, x, y)
        amp = None
        for name, stored in STORED.items():
            loss = jaxamp.amp(base, compute_dtype=jnp.bfloat16, residual_dtype=stored)
            grads = jax.jit(jax.grad(loss))(params, x, y)
            row = {
                "policy": policy_name,
                "residuals": name,
                "bytes": jaxamp.saved_residual_bytes(loss, params, x, y),
                "grad_err": common.rel_l2(grads, ref),
                **dict(zip(("peak", "flops"), compiled_stats(loss, (params, x, y)))),
                "finite": all(
                    bool(jnp.isfinite(g).all()) for g in jax.tree.leaves(grads)
                ),
            }
            amp = row if amp is None else amp
            row["bytes_vs_fp32"] = row["bytes"] / f32
            row["bytes_vs_amp"] = row["bytes"] / amp["bytes"]
            row["err_vs_amp"] = row["grad_err"] / amp["grad_err"]
            row["flops_vs_amp"] = row["flops"] / amp["flops"]
            rows.append(row)
    return rows


# Checkpointed block shapes (issue 52): 4 residual blocks, width 256, 128
# rows, each block under ``jax.checkpoint``; the value each names "act".
BLOCKS = ("tanh", "gelu", "silu", "attention", "stream")
BLOCK_DEPTH, BLOCK_WIDTH, BLOCK_ROWS, BLOCK_HEADS = 4, 256, 128, 4


def _norm(x):
    # LayerNorm without a gain, ``x - m`` computed before the variance: the
    # equations (and so the figures) of RESULTS_RESIDUALS.md's block rows.
    m = x.mean(-1, keepdims=True)
    return (x - m) * jax.lax.rsqrt(jnp.square(x - m).mean(-1, keepdims=True) + 1e-5)


def _attention(h, w):
    n, d = BLOCK_ROWS, BLOCK_WIDTH // BLOCK_HEADS
    q, k, v = (
        (h @ w[name]).reshape(n, BLOCK_HEADS, d).transpose(1, 0, 2)
        for name in ("q", "k", "v")
    )
    logits = jnp.einsum("hqd,hkd->hqk", q, k) / d**0.5
    mask = jnp.tril(jnp.ones((n, n), bool))
    p = jax.nn.softmax(jnp.where(mask, logits, -1e9), -1)
    return jnp.einsum("hqk,hkd->hqd", p, v).transpose(1, 0, 2).reshape(n, -1)


def block_fn(shape: str):
    """One residual block of ``shape`` (:data:`BLOCKS`), ``(h, w) -> h``:
    ``tanh``: ``h + name(tanh(h @ w))`` (issue 52's model); ``gelu`` /
    ``silu``: ``h + name(act(norm(h) @ up)) @ down``; ``attention``: ``h +
    name(causal softmax attention of norm(h)) @ o``; ``stream``: the residual
    stream named between an attention half and a GELU MLP half."""
    mlp = {"gelu": jax.nn.gelu, "silu": jax.nn.silu}

    def block(h, w):
        if shape == "tanh":
            return h + checkpoint_name(jnp.tanh(h @ w["w"]), "act")
        if shape in mlp:
            a = checkpoint_name(mlp[shape](_norm(h) @ w["up"]), "act")
            return h + a @ w["down"]
        if shape == "attention":
            return h + checkpoint_name(_attention(_norm(h), w), "act") @ w["o"]
        a = checkpoint_name(h + _attention(_norm(h), w) @ w["o"], "act")
        return a + jax.nn.gelu(_norm(a) @ w["up"]) @ w["down"]

    return block


def block_model(shape: str, policy, head: str = "readout"):
    """``(loss, params, x)``: :data:`BLOCK_DEPTH` blocks of ``shape``, each
    under ``jax.checkpoint(policy=policy)``; inputs pre-rounded to bfloat16,
    the residual stream in the hundreds (rms 100), the products' inputs of
    order one (the tanh's pre-activation ``h @ w``, rms 1). ``head``:
    ``"readout"``, a linear readout to 8 outputs and a squared loss on them;
    ``"square"``, ``mean(h ** 2)`` of the last block's output (issue 52's
    model as filed)."""
    d, ks = BLOCK_WIDTH, jax.random.split(jax.random.key(52), 8)
    scale = {"w": 1 / (100 * d**0.5), "up": 1 / d**0.5, "down": 30 / d**0.5}
    scale.update(q=1 / d**0.5, k=1 / d**0.5, v=1 / d**0.5, o=30 / d**0.5)
    names = {
        "tanh": ("w",),
        "gelu": ("up", "down"),
        "silu": ("up", "down"),
        "attention": ("q", "k", "v", "o"),
        "stream": ("q", "k", "v", "o", "up", "down"),
    }[shape]
    params = {
        "blocks": [
            {
                n: scale[n] * jax.random.normal(jax.random.fold_in(ks[i], j), (d, d))
                for j, n in enumerate(names)
            }
            for i in range(BLOCK_DEPTH)
        ],
        "out": jax.random.normal(ks[-2], (d, 8)) / d**0.5,
    }
    params = common.round_bf16(params)
    x = common.round_bf16(100.0 * jax.random.normal(ks[-1], (BLOCK_ROWS, d)))
    body = jax.checkpoint(block_fn(shape), policy=policy)

    def loss(params, x):
        h = x
        for w in params["blocks"]:
            h = body(h, w)
        if head == "square":
            return jnp.mean(h**2)
        # The readout's input is a product's: the same bits with E4M3 as with
        # amp bfloat16 (outside a checkpoint), so the comparison is the blocks'.
        return jnp.mean(jnp.square(h @ params["out"] / 100.0))

    return loss, params, x


def block_rows(shape: str, policy_name: str, head: str = "readout") -> list[dict]:
    """Bytes and gradient error of :func:`block_model` per residual format,
    against amp bfloat16's with the same checkpoint."""
    base, params, x = block_model(shape, POLICIES[policy_name], head)
    ref = jax.jit(jax.grad(base))(params, x)
    rows, amp = [], None
    for name in ("none", "E4M3", "int8"):
        stored = STORED[name]
        loss = jaxamp.amp(base, compute_dtype=jnp.bfloat16, residual_dtype=stored)
        grads = jax.jit(jax.grad(loss))(params, x)
        row = {
            "block": shape if head == "readout" else f"{shape}, loss mean(h**2)",
            "policy": policy_name,
            "residuals": name,
            "bytes": jaxamp.saved_residual_bytes(loss, params, x),
            "grad_err": common.rel_l2(grads, ref),
        }
        amp = row if amp is None else amp
        row["bytes_vs_amp"] = row["bytes"] / amp["bytes"]
        row["err_vs_amp"] = row["grad_err"] / amp["grad_err"]
        rows.append(row)
    return rows


def part1c() -> list[dict]:
    """Each block shape of :data:`BLOCKS` under each policy (issue 52)."""
    rows = [r for s in BLOCKS for p in POLICIES for r in block_rows(s, p)]
    return rows + [r for p in POLICIES for r in block_rows("tanh", p, "square")]


def _long_loss(layers: int):
    sizes = {
        "long": (LONG["d"], layers, LONG["seq"], LONG["batch"], LONG["heads"], 256)
    }
    run.SIZES.update(sizes)
    return run.make_loss("long"), run.init("long", sizes=sizes)


def peak(loss, args) -> int:
    """Peak bytes of the jitted value_and_grad (compile only)."""
    return compiled_stats(loss, args)[0]


def compiled_stats(loss, args) -> tuple[int, float]:
    """``(peak bytes, FLOPs)`` of the jitted value_and_grad (compile only;
    XLA's ``memory_analysis()`` and ``cost_analysis()``)."""
    c = jax.jit(jax.value_and_grad(loss)).lower(*args).compile()
    m = c.memory_analysis()
    cost = c.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    size = (
        m.argument_size_in_bytes
        + m.output_size_in_bytes
        - m.alias_size_in_bytes
        + m.temp_size_in_bytes
    )
    return size, float(cost.get("flops", float("nan")))


def part2(layers=(2, 4)) -> list[dict]:
    """Per-layer peak of the activation-dominated configuration."""
    variants = {
        "fp32": lambda f: f,
        "amp bf16": lambda f: jaxamp.amp(f, compute_dtype=jnp.bfloat16),
        "amp bf16 + E4M3": lambda f: jaxamp.amp(
            f, compute_dtype=jnp.bfloat16, residual_dtype=E4M3
        ),
        "amp bf16 + int8": lambda f: jaxamp.amp(
            f, compute_dtype=jnp.bfloat16, residual_dtype="int8"
        ),
    }
    rows = []
    for name, wrap in variants.items():
        peaks, residual = [], []
        for n in layers:
            base, args = _long_loss(n)
            loss = wrap(base)
            peaks.append(peak(loss, args))
            residual.append(jaxamp.saved_residual_bytes(loss, *args))
        per_layer = (peaks[1] - peaks[0]) / (layers[1] - layers[0])
        res_layer = (residual[1] - residual[0]) / (layers[1] - layers[0])
        rows.append(
            {"variant": name, "per_layer": per_layer, "residual_per_layer": res_layer}
        )
    amp = next(r for r in rows if r["variant"] == "amp bf16")
    for r in rows:
        r["vs_amp"] = r["per_layer"] / amp["per_layer"]
    return rows


GPU = {"d": 256, "heads": 8, "seq": 1024, "batch": 8, "vocab": 256}


def _gpu_variants() -> dict:
    bf16 = jnp.bfloat16
    xla, cudnn = (
        {**jaxamp.default_amp_policy, "attention": jaxamp.attention_rule(a)}
        for a in ("xla", "cudnn")
    )
    out = {"fp32": lambda f: f}
    for attention, policy in (("", xla), (" + cuDNN", cudnn)):
        for name, stored in (("", None), (" + E4M3", E4M3), (" + int8", "int8")):
            out[f"amp bf16{attention}{name}"] = functools.partial(
                jaxamp.amp, compute_dtype=bf16, amp_policy=policy, residual_dtype=stored
            )
    return out


def part3(targets=("cpu", "h100"), layers=(2, 4), remat=False) -> list[dict]:
    """Per-layer peak of the activation-dominated step per compile target;
    ``remat``: each scanned block under ``jax.checkpoint``."""
    rows = []
    for target in targets:
        if target == "h100" and gpu_target.available() is not None:
            print(f"part 3, h100: skipped ({gpu_target.available()})", file=sys.stderr)
            continue
        for name, wrap in _gpu_variants().items():
            if "cuDNN" in name and target != "h100":
                continue  # cuDNN attention runs on an NVIDIA GPU only
            peaks = []
            for n in layers:
                sizes = {"gpu": (GPU["d"], n, GPU["seq"], GPU["batch"], GPU["heads"])}
                sizes["gpu"] += (GPU["vocab"],)
                run.SIZES.update(sizes)
                loss = wrap(run.make_loss("gpu", remat=remat))
                args = run.init("gpu", sizes=sizes)
                step = jax.value_and_grad(loss)
                compiled = gpu_target.compile_for(step, *args, target=target)
                peaks.append(gpu_target.peak_bytes(compiled))
            slope = (peaks[1] - peaks[0]) / (layers[1] - layers[0])
            rows.append({"target": target, "variant": name, "per_layer": slope})
    for r in rows:
        same = {
            x["variant"]: x["per_layer"] for x in rows if x["target"] == r["target"]
        }
        base = "amp bf16 + cuDNN" if "cuDNN" in r["variant"] else "amp bf16"
        r["vs_amp"] = r["per_layer"] / same["amp bf16"]
        r["vs_base"] = r["per_layer"] / same[base]
    return rows


def markdown(
    p1: list[dict],
    p1_remat: list[dict],
    p1b: list[dict],
    p2: list[dict],
    meta: str,
    p3: list[dict] = (),
    p1c: list[dict] = (),
) -> str:
    out = [
        "# Compressed residuals",
        "",
        meta,
        "",
        "## Size S (width 256, 4 layers, seq 128, batch 8)",
        "",
    ]
    for title, rows in (
        ("layers in `lax.scan`", p1),
        ("each block under `jax.checkpoint`", p1_remat),
    ):
        if not rows:
            continue
        out += [
            f"{title}; bytes relative to float32 with the same structure:",
            "",
            "| compute | residuals | residual bytes vs fp32 | grad rel. L2 err "
            "| err vs amp (same compute) | finite |",
            "|---|---|---|---|---|---|",
        ]
        out += [
            f"| {r['compute']} | {r['residuals']} | {r['bytes_vs_fp32']:.3f}x "
            f"| {r['grad_err']:.2e} | {r['err_vs_amp']:.2f}x | {r['finite']} |"
            for r in rows
        ]
        out.append("")
    if p1b:
        out += [
            "each block under `jax.checkpoint(block, policy=...)`, bfloat16 compute; "
            "bytes and error also relative to amp bf16 with the same checkpoint:",
            "",
            "| policy | residuals | bytes vs fp32 | bytes vs amp bf16 "
            "| grad rel. L2 err | err vs amp bf16 | finite | step peak MiB "
            "| step FLOPs vs amp bf16 |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        out += [
            f"| `{r['policy']}` | {r['residuals']} | {r['bytes_vs_fp32']:.3f}x "
            f"| {r['bytes_vs_amp']:.3f}x | {r['grad_err']:.2e} "
            f"| {r['err_vs_amp']:.2f}x | {r['finite']} | {r['peak'] / 2**20:.1f} "
            f"| {r['flops_vs_amp']:.3f}x |"
            for r in p1b
        ]
        out.append("")
    if p1c:
        out += [
            f"block shapes (issue 52): {BLOCK_DEPTH} residual blocks, width "
            f"{BLOCK_WIDTH}, {BLOCK_ROWS} rows, each under `jax.checkpoint(block, "
            "policy=...)`, bfloat16 compute; bytes and error relative to amp bf16 "
            "with the same checkpoint:",
            "",
            "| block | policy | residuals | saved KiB | bytes vs amp bf16 "
            "| grad rel. L2 err | err vs amp bf16 |",
            "|---|---|---|---|---|---|---|",
        ]
        out += [
            f"| {r['block']} | `{r['policy']}` | {r['residuals']} "
            f"| {r['bytes'] / 2**10:.0f} | {r['bytes_vs_amp']:.3f}x "
            f"| {r['grad_err']:.2e} | {r['err_vs_amp']:.2f}x |"
            for r in p1c
        ]
        out.append("")
    d = LONG
    if p2:
        out += [
            f"## Activation-dominated: width {d['d']}, seq {d['seq']}, "
            f"batch {d['batch']}, {d['heads']} heads (compile only)",
            "",
            "| variant | per-layer peak MiB | vs amp bf16 "
            "| saved residuals per layer MiB |",
            "|---|---|---|---|",
        ]
    out += [
        f"| {r['variant']} | {r['per_layer'] / 2**20:.1f} | {r['vs_amp']:.2f}x "
        f"| {r['residual_per_layer'] / 2**20:.1f} |"
        for r in p2
    ]
    if p3:
        g = GPU
        out += [
            "",
            f"## Activation-dominated per compile target: width {g['d']}, seq "
            f"{g['seq']}, batch {g['batch']}, {g['heads']} heads (compile only)",
            "",
            "| target | variant | per-layer peak MiB | vs amp bf16 "
            "| vs the same attention without compressed residuals |",
            "|---|---|---|---|---|",
        ]
        out += [
            f"| {r['target']} | {r['variant']} | {r['per_layer'] / 2**20:.1f} "
            f"| {r['vs_amp']:.2f}x | {r['vs_base']:.2f}x |"
            for r in p3
        ]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="write the markdown table here")
    p.add_argument(
        "--remat",
        action="store_true",
        help="with --gpu: each scanned block under jax.checkpoint",
    )
    p.add_argument("--skip-long", action="store_true", help="part 1 only")
    p.add_argument(
        "--only-blocks", action="store_true", help="the block shapes of part 1c only"
    )
    p.add_argument("--only-long", action="store_true", help="part 2 only")
    p.add_argument(
        "--gpu",
        action="store_true",
        help="part 3 only: the activation-dominated step compiled for XLA:CPU and "
        "an H100 (run with JAX_PLATFORMS=cpu and the CUDA plugin installed)",
    )
    a = p.parse_args(argv)
    t0 = time.time()
    part1_off = a.only_long or a.gpu or a.only_blocks
    p1, p1r = ([], []) if part1_off else (part1(False), part1(True))
    p1b = [] if part1_off else part1b()
    p1c = part1c() if a.only_blocks or not (a.only_long or a.gpu) else []
    p2 = [] if a.skip_long or a.gpu or a.only_blocks else part2()
    p3 = part3(remat=a.remat) if a.gpu else []
    flags = " --skip-long" * a.skip_long + " --only-long" * a.only_long
    flags += " --gpu" * a.gpu + " --remat" * a.remat + " --only-blocks" * a.only_blocks
    meta = (
        "`python benchmarks/residuals.py --out benchmarks/RESULTS_RESIDUALS.md"
        f"{flags}` "
        f"on {platform.processor() or platform.machine()} ({jax.default_backend()}), "
        f"JAX {jax.__version__}, {time.time() - t0:.0f} s."
    )
    text = markdown(p1, p1r, p1b, p2, meta, p3, p1c)
    print(text)
    if a.out:
        Path(a.out).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
