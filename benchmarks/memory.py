"""Memory per parameter and training quality of mixed-precision recipes, on the
main job's GPT (examples/train_charlm.py).

    python benchmarks/memory.py --out benchmarks/RESULTS_MEMORY.md

Variants (AdamW with clipping and the main job's schedule in every one):

* ``fp32``: float32 parameters, no amp;
* ``amp bf16, f32 master``: ``jaxamp.amp`` (bfloat16 matmuls), float32
  parameters and moments;
* ``amp, bf16 params + SR, bf16 state``: bfloat16 parameters,
  ``jaxamp.low_precision_optimizer`` with stochastic rounding, bfloat16 moments;
* ``... int8 state``: the same with block-wise int8 moments;
* ``... Kahan, bf16 state``: Kahan summation (a bfloat16 compensation buffer);
* ``naive bf16 params``: bfloat16 parameters and plain optax (round to nearest
  in ``optax.apply_updates``);
* ``jmp``: ``jmp.get_policy("params=float32,compute=bfloat16,output=float32")``;
* ``mpx``: ``mpx.cast_to_half_precision`` of the parameters in the loss.

Part 1 (compile only): bytes per parameter of parameters, gradients and
optimizer state (after one step: optax may change the state's dtypes), and
XLA's memory analysis of the jitted, donated training step at a GPU-like width
(``--width``) for two layer counts; the per-layer and fixed bytes of the linear
fit give the largest GPT (layers at that width) that fits 16 GiB and 80 GiB.
XLA:CPU's buffer assignment stands in for the GPU's.

Part 2: validation loss after ``--steps`` steps of the main job's model and
data, and the median step time relative to ``amp bf16, f32 master``, the
variants trained round-robin in this process (one step of each in turn).

``--map-check N``: the int8 map choice, AdamW's update direction from linear
and dynamic-map int8 moments after N float32 steps.

``--slope``: the step's peak per added parameter (compile only). For each
variant of ``SLOPE_VARIANTS`` (a table of named recipes: amp or hand-written
bfloat16 JAX, the parameter dtype, the optimizer, amp's options such as
``residual_dtype``) and each regime of ``REGIMES`` (parameter-dominated: seq
256, batch 1; activation-dominated: seq 1024, batch 8), XLA's memory analysis
(arguments + outputs - aliased + temp) of three jitted programs at
``--slope-layers`` (4 and 8) layers of width ``--width``: the whole step
(parameters and optimizer state donated), the gradient (``value_and_grad``)
and the update (``update`` and ``optax.apply_updates``, parameters, state and
gradients donated). The slope between the two layer counts divided by the
parameters added is the step's bytes per parameter; the gradient's temp
bytes per parameter (the slope of its ``temp_size_in_bytes`` alone) show what
the backward pass keeps; the step's per-layer slope and its fixed part give
the layers of that width that fit 16 and 80 GiB. Options of ``--slope``:

* ``--targets cpu h100`` (default ``cpu``): the compilers to measure with,
  each program compiled through ``benchmarks/gpu_target.py``'s
  ``compile_for``, one table per regime and target. ``cpu`` is this
  machine's XLA:CPU; ``h100`` is XLA:GPU for an NVIDIA H100 SXM, compiled
  ahead of time on this machine without a GPU (no autotuning: compare slopes,
  not absolute temp bytes). ``h100`` needs the CUDA plugin of the installed
  jax version, in this environment or a separate environment with that
  plugin (about 5.5 GB of compiler wheels, no GPU, driver or toolkit)::

      pip install "jax[cuda12]==$(python -c 'import jax; print(jax.__version__)')"
      JAX_PLATFORMS=cpu python benchmarks/memory.py --slope --targets cpu h100

  Without it, ``--targets h100`` exits with that install line.
* ``--model PATH``: measure the GPT of a Python file instead of the main
  job's: it defines ``init(key, vocab=96, d=..., layers=L, heads=..., seq=...)``
  returning a parameter dict, and ``loss_fn(params, tokens, heads=...)`` with
  int32 ``tokens`` of shape ``(batch, seq + 1)``. ``init`` gets ``d=--width``,
  ``heads=--heads`` (default 4 with ``--model``, 16 for the main job's GPT)
  and the regime's ``seq``; bfloat16 variants cast every leaf of its output
  to bfloat16.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import gpu_target  # noqa: E402
import train_charlm as tc  # noqa: E402

import jaxamp  # noqa: E402

GIB = 2**30


@dataclasses.dataclass(frozen=True)
class Variant:
    """One recipe: how the loss is wrapped and how parameters are stored.

    Attributes:
        name: the table's name.
        wrap: ``wrap(loss) -> loss`` (amp, jmp or mpx casting).
        param_dtype: ``"float32"`` or ``"bfloat16"``.
        rounding: ``train_charlm``'s ``param_rounding``.
        state: ``train_charlm``'s ``opt_state_dtype``.
        skip: the optimizer inside ``jaxamp.skip_nonfinite_updates`` (as the
            main job's); False: the plain step.
        scaler: differentiate with ``jaxamp.dynamic_scale_value_and_grad``
            (float16's dynamic loss scaling; the scaler state is the step's
            fifth argument and output).
        optimizer_update: skip through ``jaxamp.optimizer_update`` (the
            Equinox form: the plain optimizer, the decision passed in) instead
            of the wrapper; needs ``skip=False``.
    """

    name: str
    wrap: Callable
    param_dtype: str = "float32"
    rounding: str = "stochastic"
    state: str = "bfloat16"
    skip: bool = True
    scaler: bool = False
    optimizer_update: bool = False


def _amp(loss):
    return jaxamp.amp(loss, compute_dtype=jnp.bfloat16)


def _jmp(loss):
    import jmp

    policy = jmp.get_policy("params=float32,compute=bfloat16,output=float32")
    return lambda p, x, y: policy.cast_to_output(loss(policy.cast_to_compute(p), x, y))


def _mpx(loss):
    import mpx

    mpx.set_half_precision_datatype(jnp.bfloat16)
    return lambda p, x, y: loss(mpx.cast_to_half_precision(p), x, y).astype(jnp.float32)


VARIANTS = [
    Variant("fp32", lambda loss: loss),
    Variant("amp bf16, f32 master", _amp),
    Variant("amp, bf16 params + SR, bf16 state", _amp, "bfloat16"),
    Variant("amp, bf16 params + SR, int8 state", _amp, "bfloat16", state="int8"),
    Variant("amp, bf16 params + Kahan, bf16 state", _amp, "bfloat16", "kahan"),
    Variant("naive bf16 params (plain optax)", _amp, "bfloat16", "plain"),
    Variant("jmp (f32 params, bf16 compute)", _jmp),
    Variant("mpx (f32 params, bf16 compute)", _mpx),
]


def setup(v: Variant, cfg: tc.Config):
    """The variant's loss, optimizer, initial parameters and jitted step."""
    cfg = dataclasses.replace(
        cfg,
        param_dtype=v.param_dtype,
        param_rounding=v.rounding,
        opt_state_dtype=v.state,
    )
    loss = v.wrap(lambda p, x, y: tc.loss_fn(p, x, y, cfg.heads))
    opt = tc.make_optimizer(cfg, skip=v.skip)

    def step(params, opt_state, x, y, *scaler):
        if v.scaler:
            vg = jaxamp.dynamic_scale_value_and_grad(loss, filter=False)
            scaler, (value, grads) = vg(params, x, y, dynamic_scaler_state=scaler[0])
            value = (value, scaler)
        else:
            value, grads = jax.value_and_grad(loss)(params, x, y)
        with jax.numpy_dtype_promotion("standard"):  # optax's Adam (see train_charlm)
            if v.optimizer_update:
                finite = jaxamp.all_finite(grads)
                return (
                    *jaxamp.optimizer_update(params, opt, opt_state, grads, finite),
                    value,
                )
            updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    return loss, opt, step, cfg


def memory_row(v: Variant, cfg: tc.Config) -> dict:
    """Bytes per parameter and XLA's memory analysis of one donated step."""
    loss, opt, step, cfg = setup(v, cfg)
    params = jax.eval_shape(lambda: tc.initial_params(cfg))
    with jax.numpy_dtype_promotion("standard"):
        state = jax.eval_shape(opt.init, params)
    x = jax.ShapeDtypeStruct((cfg.batch_size, cfg.seq_len), jnp.int32)
    new_params, new_state, _ = jax.eval_shape(step, params, state, x, x)
    grads = jax.eval_shape(jax.grad(loss), params, x, x)
    per = tc.bytes_per_param(new_params, new_state, grads)
    compiled = jax.jit(step, donate_argnums=(0, 1)).lower(params, state, x, x).compile()
    m = compiled.memory_analysis()
    total = (
        m.argument_size_in_bytes
        + m.output_size_in_bytes
        - m.alias_size_in_bytes
        + m.temp_size_in_bytes
    )
    n = sum(a.size for a in jax.tree.leaves(params))
    return {**per, "temp": m.temp_size_in_bytes, "step_total": total, "n": n}


def fit(v: Variant, cfg: tc.Config, layers: tuple[int, int]) -> dict:
    """Per-layer and fixed bytes of a step (linear in layers) and the largest
    layer count within 16 and 80 GiB."""
    a, b = (memory_row(v, dataclasses.replace(cfg, layers=n)) for n in layers)
    per_layer = (b["step_total"] - a["step_total"]) / (layers[1] - layers[0])
    fixed = a["step_total"] - per_layer * layers[0]
    fits = {g: int((g * GIB - fixed) // per_layer) for g in (16, 80)}
    params_per_layer = (b["n"] - a["n"]) / (layers[1] - layers[0])
    return {
        "per_layer": per_layer,
        "fixed": fixed,
        "fits": fits,
        "row": b,
        "params_per_layer": params_per_layer,
    }


@dataclasses.dataclass(frozen=True)
class SlopeVariant:
    """One recipe of the ``--slope`` table.

    Attributes:
        name: the table's name.
        param_dtype: ``"float32"`` or ``"bfloat16"``: the stored parameters.
        optimizer: ``optimizer() -> GradientTransformation``.
        amp: run the loss under ``jaxamp.amp`` (bfloat16 compute); False: the
            loss as written, on parameters of ``param_dtype`` (hand-written
            bfloat16 JAX when that is bfloat16).
        amp_kwargs: further keyword arguments of ``jaxamp.amp`` (e.g.
            ``residual_dtype``), as ``(name, value)`` pairs.
        in_backward: the step is ``jaxamp.update_in_backward`` (the update
            inside the backward pass, no gradient tree).
        scaler: differentiate with ``jaxamp.dynamic_scale_value_and_grad``
            (float16's dynamic loss scaling; the scaler state is an argument
            and output of the step).
    """

    name: str
    param_dtype: str
    optimizer: Callable
    amp: bool = True
    amp_kwargs: tuple = ()
    in_backward: bool = False
    scaler: bool = False


def _adamw():
    return optax.adamw(1e-3, weight_decay=0.1)


def _low(**kw):
    return lambda: jaxamp.low_precision_optimizer(_adamw(), **kw)


def _clipped(skip: bool, **low):
    """``optax.chain(clip_by_global_norm(1), adamw)`` (the issues' reference
    GPT optimizer), inside ``low_precision_optimizer(**low)`` when ``low`` is
    given, inside ``jaxamp.skip_nonfinite_updates`` when ``skip``."""

    def make():
        tx = optax.chain(optax.clip_by_global_norm(1.0), _adamw())
        if low:
            tx = jaxamp.low_precision_optimizer(tx, **low)
        return jaxamp.skip_nonfinite_updates(tx) if skip else tx

    return make


def _skip_pairs() -> list:
    """Each recipe of the skip comparison with and without the wrapper."""
    e4m3 = (("residual_dtype", jnp.float8_e4m3fn),)
    f16 = (("compute_dtype", jnp.float16),)
    base = [
        ("amp bf16, f32 master", "float32", {}, (), False),
        ("amp, bf16 params + SR, bf16 state", "bfloat16", {"seed": 0}, (), False),
        (
            "amp, bf16 params + SR, int8 state",
            "bfloat16",
            {"state_dtype": "int8"},
            (),
            False,
        ),
        ("amp bf16, E4M3 residuals, f32 master", "float32", {}, e4m3, False),
        ("amp float16 + dynamic scaling, f32 master", "float32", {}, f16, True),
    ]
    return [
        SlopeVariant(
            f"{name}, clip + adamw, {'skip' if skip else 'no skip'}",
            dtype,
            _clipped(skip, **low),
            amp_kwargs=kw,
            scaler=scaler,
        )
        for name, dtype, low, kw, scaler in base
        for skip in (True, False)
    ]


def _lean(inner: Callable, state_dtype: Any) -> Callable:
    return lambda: jaxamp.low_precision_optimizer(inner(), state_dtype=state_dtype)


# Issue 62: the optimizers with one moment or none, bfloat16 parameters.
LEAN_OPTIMIZERS = {
    "layerwise adafactor, no momentum (leanest)": _lean(
        lambda: jaxamp.training.layerwise_adafactor(1e-3), None
    ),
    "layerwise adafactor, int8 momentum": _lean(
        lambda: jaxamp.training.layerwise_adafactor(1e-3, momentum=0.9), "int8"
    ),
    "lion, int8 state": _lean(lambda: optax.lion(1e-4, weight_decay=0.1), "int8"),
}

# 8-bit policies with every matmul quantized, the head's too
_ALL_MATMULS = {"size_rule": None, "quantize_last_matmul": True}

SLOPE_VARIANTS = [
    SlopeVariant("amp, f32 master, optax.adamw", "float32", _adamw),
    SlopeVariant("amp, bf16 params, plain optax.adamw", "bfloat16", _adamw),
    SlopeVariant("bf16 JAX (no amp), plain optax.adamw", "bfloat16", _adamw, False),
    SlopeVariant("amp, bf16 params + SR, bf16 state", "bfloat16", _low()),
    SlopeVariant(
        "amp, bf16 params + SR, int8 state", "bfloat16", _low(state_dtype="int8")
    ),
    SlopeVariant(
        "amp, bf16 params + Kahan, bf16 state", "bfloat16", _low(rounding="kahan")
    ),
    SlopeVariant(
        "amp, bf16 params + SR, bf16 state, E4M3 residuals",
        "bfloat16",
        _low(),
        amp_kwargs=(("residual_dtype", jnp.float8_e4m3fn),),
    ),
    SlopeVariant(
        "amp, f32 master, adamw in backward", "float32", _adamw, in_backward=True
    ),
    SlopeVariant(
        "amp, bf16 params + SR, bf16 state, in backward",
        "bfloat16",
        _low(),
        in_backward=True,
    ),
    SlopeVariant(
        "amp, bf16 params + SR, int8 state, in backward",
        "bfloat16",
        _low(state_dtype="int8"),
        in_backward=True,
    ),
    SlopeVariant(
        "amp, bf16 params + SR, int8 state, E4M3 residuals, in backward",
        "bfloat16",
        _low(state_dtype="int8"),
        amp_kwargs=(("residual_dtype", jnp.float8_e4m3fn),),
        in_backward=True,
    ),
    SlopeVariant(
        "amp, bf16 params + SR, int8 state, int8 residuals, in backward",
        "bfloat16",
        _low(state_dtype="int8"),
        amp_kwargs=(("residual_dtype", "int8"),),
        in_backward=True,
    ),
    # Issue 62: one-moment optimizers inside the backward pass.
    *(
        SlopeVariant(
            f"amp, bf16 params + SR, {name}, int8 residuals, in backward",
            "bfloat16",
            make,
            amp_kwargs=(("residual_dtype", "int8"),),
            in_backward=True,
        )
        for name, make in LEAN_OPTIMIZERS.items()
    ),
    # 8-bit matmuls (every one, the head's too) under the main job's
    # checkpointed layers: what the recompute saves besides the checkpoint's
    # inputs (the operands' amaxes).
    *(
        SlopeVariant(
            f"amp {name} matmuls, f32 master, optax.adamw",
            "float32",
            _adamw,
            amp_kwargs=(("amp_policy", make(**_ALL_MATMULS)),),
        )
        for name, make in (("FP8", jaxamp.fp8_policy), ("int8", jaxamp.int8_policy))
    ),
    *_skip_pairs(),
]

# --slope --targets: the table's mark of each target
TARGET_LABELS = {
    "cpu": "XLA:CPU",
    "h100": "H100 target, compiled on CPU, no autotuning",
    "local": "this machine's device (compiled with autotuning)",
}

# name -> (seq_len, batch_size)
REGIMES = {"parameter-dominated": (256, 1), "activation-dominated": (1024, 8)}


def load_model(path: str):
    """The module of a ``--model`` file (``init`` and ``loss_fn``)."""
    spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    if spec is None or spec.loader is None:
        raise ValueError(f"--model {path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for name in ("init", "loss_fn"):
        if not callable(getattr(module, name, None)):
            raise ValueError(f"--model {path}: defines no {name}()")
    return module


def _gpt(cfg: tc.Config, param_dtype: str, model=None):
    """The parameter shapes (``param_dtype``), the loss ``loss(params,
    *batch)`` and the batch shapes of the main job's GPT or of ``model``."""
    if model is None:
        params = jax.eval_shape(
            lambda: tc.initial_params(dataclasses.replace(cfg, param_dtype=param_dtype))
        )
        x = jax.ShapeDtypeStruct((cfg.batch_size, cfg.seq_len), jnp.int32)
        return params, lambda p, x, y: tc.loss_fn(p, x, y, cfg.heads), (x, x)

    def init():
        params = model.init(
            jax.random.key(cfg.seed),
            d=cfg.d_model,
            layers=cfg.layers,
            heads=cfg.heads,
            seq=cfg.seq_len,
        )
        return jax.tree.map(lambda a: a.astype(param_dtype), params)

    tokens = jax.ShapeDtypeStruct((cfg.batch_size, cfg.seq_len + 1), jnp.int32)
    loss = lambda p, t: model.loss_fn(p, t, heads=cfg.heads)  # noqa: E731
    return jax.eval_shape(init), loss, (tokens,)


def phase_peaks(
    v: SlopeVariant, cfg: tc.Config, target: str = "cpu", model=None
) -> dict:
    """XLA's peak bytes of the donated step, the gradient and the update of
    ``v`` on the GPT of ``cfg`` (the main job's, or ``model``'s), compiled for
    ``target`` (compile only), the gradient's temp bytes, and the parameter
    count."""
    params, loss, batch = _gpt(cfg, v.param_dtype, model)
    if v.amp:
        loss = jaxamp.amp(loss, **{"compute_dtype": jnp.bfloat16, **dict(v.amp_kwargs)})
    opt = v.optimizer()
    with jax.numpy_dtype_promotion("standard"):
        state = jax.eval_shape(opt.init, params)

    def update(params, state, grads):
        with jax.numpy_dtype_promotion("standard"):  # optax's Adam
            updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    def step(params, state, *batch):
        value, grads = jax.value_and_grad(loss)(params, *batch)
        return *update(params, state, grads), value

    if v.in_backward:
        fused = jaxamp.update_in_backward(loss, opt)

        def step(params, state, *batch):  # noqa: F811
            with jax.numpy_dtype_promotion("standard"):  # optax's Adam
                return fused(params, state, *batch)

    step_args = (params, state, *batch)
    if v.scaler:  # float16: the scaler state is the step's third argument
        vg = jaxamp.dynamic_scale_value_and_grad(loss, filter=False)

        def step(params, state, scaler, *batch):  # noqa: F811
            scaler, (value, grads) = vg(params, *batch, dynamic_scaler_state=scaler)
            return *update(params, state, grads), scaler, value

        step_args = (params, state, jax.eval_shape(jaxamp.DynamicScalerState), *batch)

    grads = jax.eval_shape(jax.grad(loss), params, *batch)
    compile_ = lambda f, donate, *a: gpu_target.compile_for(  # noqa: E731
        f, *a, target=target, donate_argnums=donate
    )
    grad = compile_(jax.value_and_grad(loss), (), params, *batch)
    return {
        "step": gpu_target.peak_bytes(compile_(step, (0, 1), *step_args)),
        "grad": gpu_target.peak_bytes(grad),
        "grad_temp": grad.memory_analysis().temp_size_in_bytes,
        "update": gpu_target.peak_bytes(
            compile_(update, (0, 1, 2), params, state, grads)
        ),
        "n": sum(a.size for a in jax.tree.leaves(params)),
    }


def slope(
    v: SlopeVariant,
    cfg: tc.Config,
    layers: tuple[int, int],
    target: str = "cpu",
    model=None,
) -> dict:
    """Bytes per added parameter of each phase (and of the gradient's temp
    buffers) between ``layers[0]`` and ``layers[1]`` layers, compiled for
    ``target``, and the layers that fit 16 and 80 GiB."""
    a, b = (
        phase_peaks(v, dataclasses.replace(cfg, layers=n), target, model)
        for n in layers
    )
    dn = b["n"] - a["n"]
    out = {k: (b[k] - a[k]) / dn for k in ("step", "grad", "grad_temp", "update")}
    per_layer = (b["step"] - a["step"]) / (layers[1] - layers[0])
    fixed = a["step"] - per_layer * layers[0]
    out["fits"] = {g: int((g * GIB - fixed) // per_layer) for g in (16, 80)}
    out["per_layer"], out["fixed"] = per_layer, fixed
    return out


def slope_report(rows: dict, args) -> str:
    """The ``--slope`` tables: one per regime and target (``rows[regime]
    [target][variant]``), and each variant's layers in 16 GiB relative to the
    first row's (amp, f32 master)."""
    model = (
        f"the GPT of `{args.model}` (heads {args.heads})"
        if args.model
        else f"the main job's GPT, examples/train_charlm.py (heads {args.heads})"
    )
    lines = [
        f"## The step's peak per added parameter (d_model {args.width}, layers "
        f"{args.slope_layers[0]} and {args.slope_layers[1]}, AdamW; compile only)",
        "",
        f"Command: `python benchmarks/memory.py {' '.join(sys.argv[1:])}` (JAX "
        f"{jax.__version__}, optax {optax.__version__}). Model: {model}.",
        "",
        "Bytes per parameter: slope of XLA's memory analysis (arguments + outputs "
        "- aliased + temp) between the two layer counts, divided by the parameters "
        "added. Step: the jitted step, parameters and optimizer state donated; "
        "grad: `value_and_grad` alone; grad temp: the slope of its temp buffers "
        "alone; update: `update` + `optax.apply_updates`, "
        "parameters, state and gradients donated. Layers in 16/80 GiB: from the "
        "step's per-layer slope and fixed part; ratio: layers in 16 GiB over the "
        "first row's. Targets: XLA:CPU (this machine's compiler) and/or the H100 "
        "target (XLA:GPU for an H100 SXM, compiled on this CPU without a GPU, no "
        "autotuning: compare slopes, not absolute temp bytes).",
    ]
    for regime, by_target in rows.items():
        seq, batch = REGIMES[regime]
        for target, res in by_target.items():
            label = TARGET_LABELS[target]
            lines += [
                "",
                f"### {regime} (seq {seq}, batch {batch}): {label}",
                "",
                "| variant | target | step B/param | grad B/param | grad temp B/param "
                "| update B/param | MiB per layer | layers in 16 GiB "
                "| layers in 80 GiB | ratio (16 GiB) |",
                "|---|---|---|---|---|---|---|---|---|---|",
            ]
            ref = next(iter(res.values()))["fits"][16]
            for name, r in res.items():
                lines.append(
                    f"| {name} | {label} | {r['step']:.2f} | {r['grad']:.2f} "
                    f"| {r['grad_temp']:.2f} | {r['update']:.2f} "
                    f"| {r['per_layer'] / 2**20:.1f} | {r['fits'][16]} "
                    f"| {r['fits'][80]} | {r['fits'][16] / ref:.2f}x |"
                )
    return "\n".join(lines) + "\n"


def train_all(chosen: list[Variant], cfg: tc.Config, data) -> dict:
    """Validation loss after ``cfg.steps`` steps and the median seconds per
    step of each variant, trained round-robin (one step of each in turn, same
    batches), so that a busy machine slows all of them alike."""
    runs = {}
    for v in chosen:
        loss, opt, step, vcfg = setup(v, cfg)
        params = tc.initial_params(vcfg)
        with jax.numpy_dtype_promotion("standard"):
            state = opt.init(params)
        runs[v.name] = [jax.jit(step, donate_argnums=(0, 1)), params, state, loss, []]
    it = tc.batches(data[0], cfg.batch_size, cfg.seq_len, cfg.seed)
    for i in range(cfg.steps):
        x, y = next(it)
        for run in runs.values():
            t = time.perf_counter()
            run[1], run[2], value = run[0](run[1], run[2], x, y)
            jax.block_until_ready(value)
            if i >= 2:  # after the compiling step and one warm step
                run[4].append(time.perf_counter() - t)
    out = {}
    for name, (_, params, _, loss, times) in runs.items():
        evaluate = jax.jit(loss)
        val_it = tc.batches(data[1], cfg.batch_size, cfg.seq_len, cfg.seed + 1)
        vals = [float(evaluate(params, *next(val_it))) for _ in range(cfg.eval_batches)]
        out[name] = {
            "val_loss": float(np.mean(vals)),
            "step_s": float(np.median(times)),
        }
        print(name, out[name], flush=True)
    return out


def map_check(steps: int) -> str:
    """Int8 map choice: AdamW's update direction m / (sqrt(v) + eps) computed
    from block-quantized moments (linear absmax codes vs bitsandbytes' dynamic
    map, block 256) against float32 moments, after ``steps`` float32 steps of
    the main job's model."""
    from jaxamp._base._codec import FlatBlocks
    from jaxamp._training import _rounding as r

    cfg = tc.Config(steps=steps)
    data = tc.load_corpus(cfg.data_dir, cfg.max_bytes)
    opt = optax.adam(cfg.lr)
    params = tc.initial_params(cfg)
    with jax.numpy_dtype_promotion("standard"):
        state = opt.init(params)

    @jax.jit
    def step(params, state, x, y):
        g = jax.grad(lambda p: tc.loss_fn(p, x, y, cfg.heads))(params)
        with jax.numpy_dtype_promotion("standard"):
            u, state = opt.update(g, state, params)
        return optax.apply_updates(params, u), state

    it = tc.batches(data[0], cfg.batch_size, cfg.seq_len, cfg.seed)
    for _ in range(steps):
        params, state = step(params, state, *next(it))
    mu, nu = state[0].mu, state[0].nu

    def linear(x):
        b = FlatBlocks(256).split(x)
        scale = jnp.max(jnp.abs(b), axis=1, keepdims=True)
        q = jnp.round(b / jnp.where(scale > 0, scale, 1.0) * 127.0) / 127.0 * scale
        return q.reshape(-1)[: x.size].reshape(x.shape)

    def dynamic(x):
        return r.dequantize_blockwise(r.quantize_blockwise(x, 256), 256)

    rows = []
    for name, fn in (("linear", linear), ("dynamic", dynamic)):
        errs, zeros = [], 0
        for m, v in zip(jax.tree.leaves(mu), jax.tree.leaves(nu)):
            ref = m / (jnp.sqrt(v) + 1e-8)
            got = fn(m) / (jnp.sqrt(fn(v)) + 1e-8)
            errs.append(common.rel_l2(got, ref))
            zeros += int(jnp.sum((fn(v) == 0) & (v > 0)))
        rows.append(f"| {name} | {max(errs):.3g} | {np.median(errs):.3g} | {zeros} |")
    return "\n".join(
        [
            f"## Int8 map: AdamW update error after {steps} steps (main job's model)",
            "",
            "Relative L2 error of m / (sqrt(v) + 1e-8) from block-quantized moments "
            "(block 256) against float32 moments, per parameter leaf; nonzero "
            "second moments quantized to 0.",
            "",
            "| map | worst leaf | median leaf | v > 0 coded as 0 |",
            "|---|---|---|---|",
            *rows,
        ]
    )


def report(mem: dict, train: dict, args) -> str:
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next(
        (
            ln.split(":", 1)[1].strip()
            for ln in cpu.splitlines()
            if ln.startswith("Model name")
        ),
        platform.processor(),
    )
    lines = [
        "# Memory per parameter and training quality",
        "",
        f"Command: `python benchmarks/memory.py {' '.join(sys.argv[1:])}` "
        f"({model}, {jax.device_count()} CPU device, {sys.platform}, JAX "
        f"{jax.__version__}, optax {optax.__version__}).",
        "",
        f"## Bytes per parameter and XLA memory of one training step (d_model "
        f"{args.width}, seq {args.seq_len}, batch {args.batch_size}, layers "
        f"{args.layers[0]} and {args.layers[1]}; compile only)",
        "",
        "Parameters, gradients, optimizer state: stored bytes / parameter count "
        f"at {args.layers[1]} layers. Temp: XLA's temp buffer bytes of the "
        "jitted step (parameters and state donated). Per layer / fixed: linear "
        "fit of the step's total bytes (arguments + outputs - aliased + temp). "
        "Layers in 16/80 GiB: the largest GPT at this width whose step fits.",
        "",
        "| variant | params | grads | opt state | total B/param | temp MiB "
        "| MiB per layer | fixed MiB | layers in 16 GiB | layers in 80 GiB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, f in mem.items():
        r = f["row"]
        lines.append(
            f"| {name} | {r['params']:.2f} | {r['grads']:.2f} | {r['opt_state']:.2f} "
            f"| {r['total']:.2f} | {r['temp'] / 2**20:.0f} "
            f"| {f['per_layer'] / 2**20:.1f} "
            f"| {f['fixed'] / 2**20:.0f} | {f['fits'][16]} | {f['fits'][80]} |"
        )
    if train:
        ref = train.get("amp bf16, f32 master", next(iter(train.values())))
        lines += [
            "",
            f"## Training quality: the main job's model ({args.steps} steps, "
            "examples/train_charlm.py defaults otherwise)",
            "",
            "Step time: median seconds per step relative to `amp bf16, f32 master`; "
            "the variants train round-robin in one process (one step of each in "
            "turn, same batches), so a busy machine slows all alike.",
            "",
            "| variant | val loss | vs f32 master | step time ratio |",
            "|---|---|---|---|",
        ]
        for name, t in train.items():
            rel = t["val_loss"] / ref["val_loss"] - 1
            lines.append(
                f"| {name} | {t['val_loss']:.3f} | {rel:+.1%} "
                f"| {t['step_s'] / ref['step_s']:.2f}x |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--width", type=int, default=1024, help="d_model of part 1")
    p.add_argument(
        "--heads",
        type=int,
        default=None,
        help="heads of part 1 and --slope (default 16; 4 with --model)",
    )
    p.add_argument("--seq-len", type=int, default=1024, help="part 1")
    p.add_argument("--batch-size", type=int, default=8, help="part 1")
    p.add_argument("--layers", type=int, nargs=2, default=(2, 4), help="part 1 fit")
    p.add_argument("--steps", type=int, default=300, help="part 2 (0: skip)")
    p.add_argument("--variants", nargs="*", default=None, help="names (default all)")
    p.add_argument("--map-check", type=int, default=0, help="steps (0: skip)")
    p.add_argument("--out", default=None, help="write the Markdown here")
    p.add_argument(
        "--slope", action="store_true", help="only the per-parameter slope tables"
    )
    p.add_argument("--slope-layers", type=int, nargs=2, default=(4, 8))
    p.add_argument(
        "--regimes",
        nargs="*",
        default=list(REGIMES),
        choices=list(REGIMES),
        help="--slope",
    )
    p.add_argument(
        "--targets",
        nargs="+",
        default=["cpu"],
        choices=list(gpu_target.TARGETS),
        help="--slope: compile for XLA:CPU and/or an H100 (compile only; h100 "
        "needs jax[cuda12])",
    )
    p.add_argument(
        "--model",
        default=None,
        metavar="PATH",
        help="--slope: a Python file defining init(key, vocab, d, layers, heads, "
        "seq) and loss_fn(params, tokens, heads) (default: the main job's GPT)",
    )
    args = p.parse_args(argv)
    if args.heads is None:
        args.heads = 4 if args.model else 16
    if not args.slope and (args.model or args.targets != ["cpu"]):
        p.error("--model and --targets apply to --slope only")
    if args.slope:
        missing = "h100" in args.targets and gpu_target.available()
        if missing:
            print(f"memory.py: {missing}", file=sys.stderr)
            return 2
        model = load_model(args.model) if args.model else None
        chosen = [
            v for v in SLOPE_VARIANTS if not args.variants or v.name in args.variants
        ]
        rows = {}
        for regime in args.regimes:
            seq, batch = REGIMES[regime]
            cfg = tc.Config(
                d_model=args.width, heads=args.heads, seq_len=seq, batch_size=batch
            )
            rows[regime] = {t: {} for t in dict.fromkeys(args.targets)}
            for v in chosen:
                for t in rows[regime]:
                    r = slope(v, cfg, tuple(args.slope_layers), t, model)
                    rows[regime][t][v.name] = r
                    print(regime, t, v.name, r, flush=True)
        text = slope_report(rows, args)
        print(text)
        if args.out:
            Path(args.out).write_text(text)
        return 0
    chosen = [v for v in VARIANTS if not args.variants or v.name in args.variants]
    big = tc.Config(
        d_model=args.width,
        heads=args.heads,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
    )
    mem = {}
    for v in chosen:
        mem[v.name] = fit(v, big, tuple(args.layers))
        print(v.name, mem[v.name]["row"], flush=True)
    train = {}
    if args.steps:
        cfg = tc.Config(steps=args.steps)
        data = tc.load_corpus(cfg.data_dir, cfg.max_bytes)
        train = train_all(chosen, cfg, data)
    text = report(mem, train, args)
    if args.map_check:
        text += "\n" + map_check(args.map_check) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
