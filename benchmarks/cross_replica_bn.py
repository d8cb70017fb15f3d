"""Cross-replica BatchNorm under amp: Flax's ImageNet ResNet, gradient error
against float32, locally and with statistics reduced over replicas.

    python benchmarks/cross_replica_bn.py --compare-xla-default \
        --out benchmarks/RESULTS_SCALEOUT.md

The model is Flax's ImageNet ResNet V1 (``ResNetBlock`` / ``ResNet`` of
https://github.com/google/flax/blob/main/examples/imagenet/models.py: a 7x7
stride-2 conv stem, BatchNorm, relu, 3x3 stride-2 max pool, stages of basic
blocks whose second BatchNorm has a zero-initialised scale, 1x1 projections
where the shape changes, a global mean pool and a Dense head), rewritten here
with ``flax.linen`` in a small configuration (ResNet18's stage sizes, 16
filters, 32x32 images, 10 classes) with one addition: BatchNorm's
``axis_name``, for batch statistics reduced across replicas. The loss is the
mean softmax cross-entropy, as in Flax's ImageNet example.

Each draw initialises the model (Flax's initialisers) and draws 16 images with
labels; parameters and images are pre-rounded to bfloat16. Images are uint8
noise, either normalised as Flax's ImageNet input pipeline does (minus the
per-channel ImageNet mean, over its standard deviation) or left as raw pixel
values 0..255 ("offset": the stem's conv outputs carry large per-channel
means). Variants, each a gradient with respect to the parameters:

* ``fp32 local``: the reference: the whole batch of 16 on one device in
  float32 under ``jax.default_matmul_precision("highest")``;
* ``amp local``: ``jaxamp.amp(loss, compute_dtype=jnp.bfloat16)`` on the same
  whole-batch model (no ``axis_name``);
* ``amp vmap``: BatchNorm with ``axis_name="batch"`` under
  ``jax.vmap(..., axis_name="batch")`` over 4 replicas of 4 images, loss
  averaged over replicas, the whole under ``jaxamp.amp``;
* ``amp shard_map``: the same under ``jax.shard_map`` over 4 host CPU devices
  (the loss ``pmean``'d), under ``jaxamp.amp``;
* ``hand local`` / ``hand vmap``: a careful hand-written bfloat16 model, on
  the whole batch and under the same vmap: Conv and Dense with
  ``dtype=jnp.bfloat16, param_dtype=jnp.float32``, BatchNorm with
  ``dtype=jnp.float32`` (statistics and normalisation in float32), logits
  cast to float32 for the loss;
* ``fp32 vmap``: a check of the setup: float32 under the same vmap (its error
  is float32 rounding, since the cross-replica statistics equal the whole
  batch's);
* ``fp32, pool input rounded``: a diagnostic: the float32 model whose only
  bfloat16 step is rounding the stem's max_pool input (forward only, the
  gradient passed straight through). Its error is what argmax flips in the
  max pool alone cost: bfloat16 values near a window's maximum change which
  element gets the window's gradient.

XLA, by default (``xla_allow_excess_precision=True``), may skip a rounding
to bfloat16 that the jaxpr states, depending on how it fuses, so two programs
with the same roundings (the same model locally and under vmap) give
different errors. Every gradient here is compiled with that option off
(``jax.jit(..., compiler_options=...)``); ``--compare-xla-default`` measures
the same draws again with XLA's default.

Figures: the relative L2 error of the gradient (all parameters, float64
accumulation) against ``fp32 local`` per draw and the median, the median
against ``amp local``'s, the median relative L2 distance of each bf16
variant's gradient to ``amp local``'s (the same roundings give ~0: this
separates a change of numerics from the draw-to-draw spread), and the number
of bfloat16 ``sub`` equations in each variant's gradient jaxpr
(``jaxamp.tools.iter_equations`` over ``jax.make_jaxpr(jax.grad(...))``): a
``x - mean`` of a BatchNorm in bfloat16 is what loses the normalisation's
precision.

Needs 4 host devices for shard_map (8 are requested through ``XLA_FLAGS``
unless already set, before JAX starts).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

# The model kit beside this file, also under `python -m benchmarks.cross_replica_bn`.
sys.path.insert(0, str(Path(__file__).resolve().parent))

if __name__ == "__main__":  # before JAX starts: 8 host CPU devices
    _flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in _flags:
        os.environ["XLA_FLAGS"] = _flags + " --xla_force_host_platform_device_count=8"

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from common import rel_l2, round_bf16  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxamp  # noqa: E402

BF16, F32 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)
AXIS = "batch"
# Flax's ImageNet input pipeline (examples/imagenet/input_pipeline.py).
MEAN_RGB = np.array([0.485, 0.456, 0.406]) * 255
STDDEV_RGB = np.array([0.229, 0.224, 0.225]) * 255
VARIANTS = (
    "amp local",
    "amp vmap",
    "amp shard_map",
    "hand local",
    "hand vmap",
    "fp32 vmap",
    "fp32, pool input rounded",
)
AMP_VARIANTS = ("amp local", "amp vmap", "amp shard_map")


# --- Flax's ImageNet ResNet (examples/imagenet/models.py), small ------------


class ResNetBlock(nn.Module):
    """Flax's ``ResNetBlock``: conv, norm, act, conv, norm (scale zero-
    initialised), a 1x1 projection where the shape changes, act."""

    filters: int
    conv: Any
    norm: Any
    act: Callable
    strides: tuple[int, int] = (1, 1)

    @nn.compact
    def __call__(self, x):
        residual = x
        y = self.conv(self.filters, (3, 3), self.strides)(x)
        y = self.norm()(y)
        y = self.act(y)
        y = self.conv(self.filters, (3, 3))(y)
        y = self.norm(scale_init=nn.initializers.zeros_init())(y)
        if residual.shape != y.shape:
            residual = self.conv(self.filters, (1, 1), self.strides, name="conv_proj")(
                residual
            )
            residual = self.norm(name="norm_proj")(residual)
        return self.act(residual + y)


class ResNet(nn.Module):
    """Flax's ``ResNet`` (V1) with BatchNorm's ``axis_name`` and a separate
    ``norm_dtype`` (Flax passes ``dtype`` to both; a careful bf16 model keeps
    BatchNorm in float32)."""

    stage_sizes: Sequence[int]
    num_classes: int
    num_filters: int = 64
    dtype: Any = jnp.float32
    norm_dtype: Any = jnp.float32
    axis_name: str | None = None
    round_pool_input: bool = False  # diagnostic: see the module docstring

    @nn.compact
    def __call__(self, x, train: bool = True):
        conv = functools.partial(
            nn.Conv, use_bias=False, dtype=self.dtype, param_dtype=jnp.float32
        )
        norm = functools.partial(
            nn.BatchNorm,
            use_running_average=not train,
            momentum=0.9,
            epsilon=1e-5,
            dtype=self.norm_dtype,
            axis_name=self.axis_name,
        )
        x = conv(
            self.num_filters, (7, 7), (2, 2), padding=[(3, 3), (3, 3)], name="conv_init"
        )(x)
        x = norm(name="bn_init")(x)
        x = nn.relu(x)
        if self.round_pool_input:  # rounded forward, gradient straight through
            x = x + jax.lax.stop_gradient(x.astype(jnp.bfloat16).astype(x.dtype) - x)
        x = nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
        for i, block_size in enumerate(self.stage_sizes):
            for j in range(block_size):
                strides = (2, 2) if i > 0 and j == 0 else (1, 1)
                x = ResNetBlock(
                    self.num_filters * 2**i,
                    strides=strides,
                    conv=conv,
                    norm=norm,
                    act=nn.relu,
                )(x)
        x = jnp.mean(x, axis=(1, 2))
        x = nn.Dense(self.num_classes, dtype=self.dtype, param_dtype=jnp.float32)(x)
        return jnp.asarray(x, self.dtype)


# --- losses -------------------------------------------------------------------


def xent(logits, labels, num_classes: int):
    """Flax's ImageNet example's loss: mean softmax cross-entropy, in float32."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32))
    onehot = jax.nn.one_hot(labels, num_classes, dtype=jnp.float32)
    return -jnp.mean(jnp.sum(onehot * logp, axis=-1))


def local_loss(model: ResNet, params, stats, x, y):
    logits, _ = model.apply(
        {"params": params, "batch_stats": stats}, x, mutable=["batch_stats"]
    )
    return xent(logits, y, model.num_classes)


def vmap_loss(model: ResNet, replicas: int, params, stats, x, y):
    """``model`` (BatchNorm over ``axis_name``) on ``replicas`` slices of the
    batch under ``vmap(axis_name=...)``; the replicas' losses averaged."""
    xs = x.reshape(replicas, -1, *x.shape[1:])
    ys = y.reshape(replicas, -1)
    one = functools.partial(local_loss, model, params, stats)
    return jnp.mean(jax.vmap(one, axis_name=AXIS)(xs, ys))


def shard_map_loss(model: ResNet, mesh: Mesh, params, stats, x, y):
    """``model`` (BatchNorm over ``axis_name``) in ``shard_map``: the batch
    split over ``mesh``'s devices, parameters replicated, the loss pmean'd."""

    def body(p, s, xr, yr):
        return jax.lax.pmean(local_loss(model, p, s, xr, yr), AXIS)

    fn = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(P(), P(), P(AXIS), P(AXIS)),
        out_specs=P(),
    )
    return fn(params, stats, x, y)


def losses(args) -> tuple[Callable, dict[str, Callable], ResNet]:
    """The reference loss and each variant's loss, all ``(params, stats, x, y)``."""
    cfg = dict(
        stage_sizes=args.stages, num_classes=args.classes, num_filters=args.filters
    )
    plain = ResNet(**cfg)
    replicated = ResNet(**cfg, axis_name=AXIS)
    hand = ResNet(**cfg, dtype=jnp.bfloat16, axis_name=AXIS)
    hand_local = ResNet(**cfg, dtype=jnp.bfloat16)
    pool_rounded = ResNet(**cfg, round_pool_input=True)
    mesh = Mesh(np.array(jax.devices()[: args.replicas]), (AXIS,))
    amp = functools.partial(jaxamp.amp, compute_dtype=jnp.bfloat16)
    ref = functools.partial(local_loss, plain)
    variants = {
        "amp local": amp(ref),
        "amp vmap": amp(functools.partial(vmap_loss, replicated, args.replicas)),
        "amp shard_map": amp(functools.partial(shard_map_loss, replicated, mesh)),
        "hand local": functools.partial(local_loss, hand_local),
        "hand vmap": functools.partial(vmap_loss, hand, args.replicas),
        "fp32 vmap": functools.partial(vmap_loss, replicated, args.replicas),
        "fp32, pool input rounded": functools.partial(local_loss, pool_rounded),
    }
    assert tuple(variants) == VARIANTS
    return ref, variants, plain


# --- inputs and figures ---------------------------------------------------------


def draw(model: ResNet, args, inputs: str, seed: int):
    """Parameters (Flax's init), batch statistics, images and labels of a draw."""
    kp, kx, ky = jax.random.split(jax.random.key(seed), 3)
    n = args.replicas * args.per_replica
    pixels = jax.random.randint(kx, (n, args.image, args.image, 3), 0, 256)
    x = pixels.astype(jnp.float32)
    if inputs == "normalized":
        x = (x - jnp.asarray(MEAN_RGB, F32)) / jnp.asarray(STDDEV_RGB, F32)
    elif inputs != "offset":
        raise ValueError(f"--inputs: unknown kind {inputs!r}")
    y = jax.random.randint(ky, (n,), 0, args.classes)
    v = model.init(kp, x[: args.per_replica])
    return round_bf16(v["params"]), v["batch_stats"], round_bf16(x), y


def low_subs(fn: Callable, *operands) -> list:
    """The bfloat16 ``sub`` equations of ``jax.grad(fn)``'s jaxpr."""
    closed = jax.make_jaxpr(jax.grad(fn))(*operands)
    return [
        e
        for e, _ in jaxamp.tools.iter_equations(closed)
        if e.primitive.name == "sub" and e.outvars[0].aval.dtype == BF16
    ]


def describe(eqn) -> str:
    """Operand types and source line of an equation (for a bf16 ``sub``)."""
    from jax._src import source_info_util

    shapes = " - ".join(str(getattr(v, "aval", v)) for v in eqn.invars)
    return f"{shapes} at {source_info_util.summarize(eqn.source_info)}"


def measure(args, exact: bool = True) -> dict:
    """Per input kind and variant: the errors of each draw, their median, the
    median distance to ``amp local``'s gradient, and the bf16 ``sub``s.
    ``exact``: every rounding the jaxpr states happens (XLA's
    ``xla_allow_excess_precision`` off); else XLA's default."""
    ref_loss, variants, plain = losses(args)
    jit = functools.partial(
        jax.jit, compiler_options={"xla_allow_excess_precision": not exact}
    )
    ref_grad = jit(jax.grad(ref_loss))
    grads = {name: jit(jax.grad(fn)) for name, fn in variants.items()}
    results: dict[str, Any] = {}
    for inputs in args.inputs:
        errs: dict[str, list[float]] = {name: [] for name in variants}
        dist: dict[str, list[float]] = {name: [] for name in variants}
        subs: dict[str, list[str]] = {}
        for d in range(args.draws):
            p, s, x, y = draw(plain, args, inputs, seed=args.seed + d)
            with jax.default_matmul_precision("highest"):
                ref = ref_grad(p, s, x, y)
            got = {name: grads[name](p, s, x, y) for name in variants}
            for name, g in got.items():
                errs[name].append(rel_l2(g, ref))
                dist[name].append(rel_l2(g, got["amp local"]))
            if d == 0:  # the jaxpr does not depend on the values
                subs = {
                    name: [describe(e) for e in low_subs(fn, p, s, x, y)]
                    for name, fn in variants.items()
                }
        results[inputs] = {
            name: {
                "errors": errs[name],
                "median": statistics.median(errs[name]),
                "median_distance_to_amp_local": statistics.median(dist[name]),
                "bf16_subs": subs[name],
            }
            for name in variants
        }
    return results


def table(results: dict) -> str:
    draws = len(next(iter(next(iter(results.values())).values()))["errors"])
    head = ["inputs", "variant"] + [f"draw {d + 1}" for d in range(draws)]
    head += ["median", "vs amp local", "distance to amp local", "bf16 `sub`s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for inputs, rows in results.items():
        base = rows["amp local"]["median"]
        for name, r in rows.items():
            cells = [inputs, name] + [f"{100 * e:.2f}%" for e in r["errors"]]
            cells += [f"**{100 * r['median']:.2f}%**", f"{r['median'] / base:.2f}x"]
            bf16 = not name.startswith("fp32")  # fp32's distance is amp's error
            cells.append(_pct(r["median_distance_to_amp_local"]) if bf16 else "-")
            cells.append(str(len(r["bf16_subs"])))
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _pct(v: float) -> str:
    return f"{100 * v:.2f}%"


def findings(results: dict, default_xla: dict | None) -> list[str]:
    out = []
    for inputs, rows in results.items():
        med = {name: r["median"] for name, r in rows.items()}
        base = med["amp local"]
        dists = [rows[n]["median_distance_to_amp_local"] for n in AMP_VARIANTS[1:]]
        subs = sum(len(rows[n]["bf16_subs"]) for n in AMP_VARIANTS)
        out.append(
            f"- {inputs} inputs: cross-replica amp's median error is "
            f"{med['amp vmap'] / base:.2f}x (vmap) and "
            f"{med['amp shard_map'] / base:.2f}x (shard_map) the local amp error "
            f"({_pct(base)}); its gradients are within {_pct(max(dists))} of amp "
            f"local's; the hand-written bf16 model is {_pct(med['hand vmap'])} "
            f"({med['hand vmap'] / base:.2f}x). bf16 `sub`s in amp's three "
            f"gradient jaxprs: {subs}."
        )
    pool = {
        i: rows["fp32, pool input rounded"]["median"] for i, rows in results.items()
    }
    out.append(
        "- What remains is bf16 itself, largely the max pool's argmax, not "
        "BatchNorm: a float32 model whose only bf16 step is rounding the stem's "
        "max_pool input (gradient passed straight through) already has a median "
        "error of "
        + " / ".join(f"{_pct(v)} ({i})" for i, v in pool.items())
        + ". A bf16 value near its window's maximum can flip the argmax, an O(1) "
        "change of one gradient entry (relu's step does the same); amp and the "
        "hand model round the same conv outputs and share it."
    )
    if default_xla:
        spread = []
        for inputs, rows in default_xla.items():
            local, vm = rows["amp local"]["median"], rows["amp vmap"]["median"]
            hl, hv = rows["hand local"]["median"], rows["hand vmap"]["median"]
            d = rows["amp vmap"]["median_distance_to_amp_local"]
            spread.append(
                f"{inputs}: amp local {_pct(local)} / vmap {_pct(vm)}, hand "
                f"local {_pct(hl)} / vmap {_pct(hv)}; amp vmap's gradient "
                f"{_pct(d)} from amp local's"
            )
        out.append(
            "- With XLA's default `xla_allow_excess_precision=True`, XLA:CPU "
            "skips some bf16 roundings the jaxpr states, depending on fusion, so "
            "the same model gives different errors locally and under vmap, for "
            "amp and for the hand model alike ("
            + "; ".join(spread)
            + "). The table above is measured with it off."
        )
    return out


def summarise_subs(results: dict) -> list[str]:
    """The bf16 ``sub``s of amp's gradient jaxprs, grouped (none expected)."""
    lines = []
    for inputs, rows in results.items():
        for name in AMP_VARIANTS:
            found = rows[name]["bf16_subs"]
            for desc in sorted(set(found)):
                lines.append(f"- {inputs}, {name}: {found.count(desc)} x `{desc}`")
    if lines:
        lines = ["", "bfloat16 `sub` equations in amp's gradient jaxprs:", ""] + lines
    return lines


def markdown(results: dict, meta: dict, default_xla: dict | None = None) -> str:
    a = meta["args"]
    n = a["replicas"] * a["per_replica"]
    stages = ",".join(map(str, a["stages"]))
    lines = [
        "# Cross-replica BatchNorm under amp: Flax's ImageNet ResNet",
        "",
        "```bash",
        meta["command"],
        "```",
        "",
        f"Flax's ImageNet ResNet V1 (examples/imagenet/models.py; stage sizes "
        f"{stages}, {a['filters']} filters, {a['image']}x{a['image']} images, "
        f"{a['classes']} classes), batch {n} = {a['replicas']} replicas x "
        f"{a['per_replica']}. Gradient of the mean cross-entropy with respect to "
        f"all parameters; relative L2 error against the float32 gradient of the "
        f'whole batch on one device (`precision="highest"`); {a["draws"]} draws '
        f"(fresh Flax init and images each; parameters and images pre-rounded to "
        f"bf16). `amp`: `jaxamp.amp(loss, compute_dtype=jnp.bfloat16)`. `vmap` / "
        f'`shard_map`: `BatchNorm(axis_name="batch")` under '
        f'`jax.vmap(..., axis_name="batch")` / `jax.shard_map` over '
        f"{a['replicas']} host CPU devices. `hand`: Conv and Dense "
        f"`dtype=bfloat16, param_dtype=float32`, BatchNorm `dtype=float32`, "
        f"float32 loss. `fp32 vmap`: a check of the setup. `fp32, pool input "
        f"rounded`: float32 except the stem's max_pool input rounded to bf16 "
        f"(straight-through gradient). `normalized`: uint8 noise normalised with "
        f"the ImageNet mean and standard deviation (Flax's input pipeline); "
        f'`offset`: raw pixel values 0..255. "distance to amp local": relative '
        f"L2 distance between the variant's gradient and `amp local`'s (median); "
        f'"bf16 `sub`s": bfloat16 `sub` equations in the gradient\'s jaxpr.',
        "",
        f"jax {meta['jax']}, flax {meta['flax']}, {meta['device']}, compiled with "
        f"`xla_allow_excess_precision=False`, {meta['wall_s']:.0f} s.",
        "",
        table(results),
        "",
        "Findings:",
        "",
        *findings(results, default_xla),
        *summarise_subs(results),
    ]
    if default_xla:
        lines += [
            "",
            "The same draws compiled with XLA's default "
            "(`xla_allow_excess_precision=True`):",
            "",
            table(default_xla),
        ]
    return "\n".join(lines) + "\n"


def _ints(text: str) -> list[int]:
    return [int(t) for t in text.split(",") if t]


def main(argv: list[str] | None = None) -> int:
    """Runs the measurement, prints the markdown and writes it to ``--out``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stages", type=_ints, default=[2, 2, 2, 2])
    ap.add_argument("--filters", type=int, default=16)
    ap.add_argument("--image", type=int, default=32)
    ap.add_argument("--classes", type=int, default=10)
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--per-replica", type=int, default=4)
    ap.add_argument("--draws", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--inputs",
        type=lambda t: t.split(","),
        default=["normalized", "offset"],
        help="comma-separated: normalized, offset",
    )
    ap.add_argument(
        "--compare-xla-default",
        action="store_true",
        help="also measure with XLA's default xla_allow_excess_precision=true",
    )
    ap.add_argument("--out", default=None, help="markdown file (default: stdout)")
    ap.add_argument("--json", default=None, help="results as JSON")
    args = ap.parse_args(argv)
    if len(jax.devices()) < args.replicas:
        raise SystemExit(
            f"shard_map needs {args.replicas} devices, JAX has {len(jax.devices())}: "
            "set XLA_FLAGS=--xla_force_host_platform_device_count=8"
        )
    import flax

    t0 = time.perf_counter()
    results = measure(args)
    default_xla = measure(args, exact=False) if args.compare_xla_default else None
    meta = {
        "command": shlex.join(["python", "benchmarks/cross_replica_bn.py", *argv]),
        "jax": jax.__version__,
        "flax": flax.__version__,
        "device": f"{jax.devices()[0].platform.upper()} "
        f"({os.cpu_count()} cores, {len(jax.devices())} host devices)",
        "wall_s": time.perf_counter() - t0,
        "args": vars(args),
    }
    text = markdown(results, meta, default_xla)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    if args.json:
        blob = {"meta": meta, "results": results, "xla_default": default_xla}
        Path(args.json).write_text(json.dumps(blob, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
