"""Train a character-level transformer on the Python standard library's source,
in float32, bfloat16 and float16 mixed precision, side by side.

    python examples/train_charlm.py                 # all modes, defaults
    python examples/train_charlm.py --mode bf16 --steps 100 --out /tmp/run

Data: the ``*.py`` files of the running interpreter's standard library (found
with ``sysconfig``), in sorted order, test suites and ``site-packages``
excluded; every 10th file is held out whole for validation. Vocabulary: the
256 byte values (UTF-8 bytes, no tokenizer, nothing unknown).

Model: a small GPT (token + learned position embeddings, pre-LayerNorm blocks
of causal ``jax.nn.dot_product_attention`` and a GELU MLP) whose layers are one
``jax.checkpoint``-ed function under ``lax.scan`` over stacked parameters;
AdamW with linear warmup + cosine decay and global-norm gradient clipping.

Modes (one table entry each): ``fp32`` (no amp), ``bf16`` (``jaxamp.amp``, no
loss scaling), ``fp16`` (``jaxamp.amp`` + dynamic loss scaling + skipped
non-finite steps), ``fp8`` (FP8 matmuls) and ``int8`` (int8 training: int8
forward and dgrad, bfloat16 wgrad). The 8-bit policies' default size rules
(torchao's GPU crossovers) would keep every matmul of this small model in
bfloat16, so the ``fp8`` and ``int8`` modes quantize every matmul
(``size_rule=None``); the table's "8-bit matmul FLOPs" column says which share
of the step's matmul FLOPs ran in 8 bits. Two baselines without ``jaxamp.amp``:
``jmp_bf16`` (jmp's cast-everything policy, ``params=float32,compute=bfloat16,
output=float32``) and ``hand_bf16`` (the hand-written bfloat16 model: parameters
cast at the top, LayerNorm statistics in float32, float32 logits).

Parameter storage (any mode): ``--param-dtype float32`` (the default: float32
master weights, float32 AdamW moments) or ``--param-dtype bfloat16`` (parameters
cast to bfloat16 at initialisation). With bfloat16 parameters,
``--param-rounding`` picks the optimizer: ``stochastic`` (the default),
``kahan`` or ``nearest`` run AdamW in float32 inside
``jaxamp.low_precision_optimizer`` with that rounding and the moments in
``--opt-state-dtype`` (bfloat16, int8 or float32); ``plain`` is the naive
recipe, plain optax on bfloat16 parameters (round-to-nearest in
``optax.apply_updates``, bfloat16 moments), to show what the rounding buys:

    python examples/train_charlm.py --mode bf16 --param-dtype bfloat16
    python examples/train_charlm.py --mode bf16 --param-dtype bfloat16 \
        --param-rounding plain

The table's "bytes/param" column counts parameters + optimizer state + gradients.

Activation storage (amp modes): ``--residual-dtype compute`` (the default: the
values saved for the backward pass in amp's dtypes), ``fp8`` (E4M3 with one
float32 scale per 128 values) or ``int8`` (one scale per 32), decoded in the
backward pass (``jaxamp.amp(residual_dtype=...)``); the table's "residual bytes
vs fp32" column shows what it saves:

    python examples/train_charlm.py --mode bf16 --residual-dtype fp8
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import sys
import sysconfig
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxamp

EXCLUDE_DIRS = {"test", "tests", "site-packages", "idle_test", "__pycache__"}


@dataclasses.dataclass
class Config:
    """Run configuration; each field is a command-line flag of the same name.

    The defaults train all three modes in under 10 minutes on a 2-core CPU.

    Attributes:
        mode: ``"all"`` (fp32, bf16, fp16 in turn) or one mode of ``MODES``.
        steps: optimizer steps per mode.
        batch_size: sequences per step.
        seq_len: bytes per sequence (also the model's context length).
        d_model: model width.
        layers: transformer blocks.
        heads: attention heads.
        lr: peak learning rate.
        warmup: linear warmup steps.
        seed: seed of the parameters, batches and sampling.
        max_bytes: stop reading source files after this many bytes.
        eval_batches: validation batches (of ``batch_size``) to average.
        sample_chars: characters to sample from each trained model.
        data_dir: folder of ``*.py`` files; None: the running interpreter's
            standard library.
        out: folder for ``charlm_results.json`` and ``charlm_loss.png``.
        report: after training each amp mode, write ``jaxamp.precision_report``'s
            JSON and PNG for the trained model on one training batch (where
            the mode loses accuracy against float32, per named scope).
        report_dir: folder for the reports (one subfolder per mode); None:
            ``examples/results``.
        param_dtype: storage of the parameters, ``"float32"`` or ``"bfloat16"``.
        param_rounding: with bfloat16 parameters, ``"stochastic"``, ``"kahan"``
            or ``"nearest"`` (``jaxamp.low_precision_optimizer``), or ``"plain"``
            (plain optax on bfloat16 parameters, the naive recipe).
        opt_state_dtype: with bfloat16 parameters and a rounding other than
            plain, the AdamW moments' storage: ``"bfloat16"``, ``"int8"`` or
            ``"float32"``.
        residual_dtype: in the amp modes, how the activations saved for the
            backward pass are stored: ``"compute"`` (amp's dtypes), ``"fp8"``
            (E4M3, one float32 scale per 128 values) or ``"int8"`` (one per 32)
            (``jaxamp.amp``'s ``residual_dtype``).
        update_in_backward: apply AdamW inside the backward pass
            (``jaxamp.update_in_backward``): each layer's weights and moments
            are updated as soon as their gradient is ready, and no gradient
            tree exists. Global-norm clipping needs every gradient first, so
            this optimizer clips nothing; float16 (loss scaling) is refused.
        optimizer: ``"adamw"`` (the default), ``"adafactor"``
            (``jaxamp.training.layerwise_adafactor``: factored second moment
            per matrix, no first moment, each matrix's update clipped at RMS
            1, weight decay ``0.1 * lr`` per step) or ``"lion"``
            (``optax.lion`` at a third of ``lr``, weight decay 0.3), each on
            the same warmup + cosine schedule. The leanest recipe
            is ``--mode bf16 --param-dtype bfloat16 --optimizer adafactor
            --opt-state-dtype float32 --residual-dtype int8
            --update-in-backward``.
        eval_every: also measure the validation loss (on the same
            ``eval_batches`` batches as the final one) after every this many
            steps, into the result's ``val_curve``; 0: at the end only.
    """

    mode: str = "all"
    steps: int = 300
    batch_size: int = 16
    seq_len: int = 128
    d_model: int = 128
    layers: int = 4
    heads: int = 4
    lr: float = 3e-3
    warmup: int = 30
    seed: int = 0
    max_bytes: int = 3_000_000
    eval_batches: int = 8
    sample_chars: int = 300
    data_dir: str | None = None
    out: str = "out"
    report: bool = False
    report_dir: str | None = None
    param_dtype: str = "float32"
    param_rounding: str = "stochastic"
    opt_state_dtype: str = "bfloat16"
    residual_dtype: str = "compute"
    update_in_backward: bool = False
    optimizer: str = "adamw"
    eval_every: int = 0


CHOICES = {
    "param_dtype": ("float32", "bfloat16"),
    "param_rounding": ("stochastic", "kahan", "nearest", "plain"),
    "opt_state_dtype": ("bfloat16", "int8", "float32"),
    "residual_dtype": ("compute", "fp8", "int8"),
    "optimizer": ("adamw", "adafactor", "lion"),
}
# --residual-dtype: jaxamp.amp's residual_dtype.
RESIDUAL_DTYPES = {"compute": None, "fp8": jnp.float8_e4m3fn, "int8": "int8"}


# ---------------------------------------------------------------------------
# Data


class DataError(Exception):
    """The data folder cannot be read; the CLI prints it as one line."""


def load_corpus(data_dir: str | None, max_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """Reads the training and validation bytes from a folder of ``*.py`` files.

    The folder is walked without descending into ``EXCLUDE_DIRS`` (test suites,
    ``site-packages``, caches); the files are read in sorted path order until
    ``max_bytes`` have been read, and every 10th file goes to validation, whole.

    Args:
        data_dir: the folder; ``None`` for the running interpreter's standard
            library (``sysconfig.get_paths()["stdlib"]``).
        max_bytes: stop reading files once this many bytes have been read.

    Returns:
        ``(train, val)``: the concatenated bytes of each split, uint8 arrays.

    Raises:
        DataError: if the folder does not exist, cannot be read, or holds too
            few Python files for a split.
    """
    root = Path(data_dir or sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise DataError(f"data folder {root} does not exist or is not a folder")
    try:
        os.listdir(root)
    except OSError as e:
        raise DataError(f"cannot read data folder {root}: {e.strerror}") from None
    found = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in EXCLUDE_DIRS]
        found += [Path(folder) / n for n in names if n.endswith(".py")]
    train, val, total = [], [], 0
    for i, path in enumerate(sorted(found)):
        try:
            data = path.read_bytes()
        except OSError:
            continue
        (val if i % 10 == 9 else train).append(np.frombuffer(data, np.uint8))
        total += len(data)
        if total >= max_bytes:
            break
    if not train or not val:
        raise DataError(
            f"no readable Python files under {root}"
            if not train
            else f"too few Python files under {root} (every 10th is held out "
            "for validation; it needs at least 10)"
        )
    return np.concatenate(train), np.concatenate(val)


def unigram_entropy_bits(data: np.ndarray) -> float:
    """Entropy of the byte distribution of ``data``.

    A model that ignores context cannot beat it; the trained models' validation
    bits per character are compared against it.

    Args:
        data: uint8 array of bytes.

    Returns:
        The entropy in bits per character.
    """
    p = np.bincount(data, minlength=256) / len(data)
    p = p[p > 0]
    return float(-(p * np.log2(p)).sum())


def batches(data: np.ndarray, batch: int, seq: int, seed: int):
    """Yields random windows of ``data`` as next-byte prediction batches.

    Args:
        data: uint8 array of bytes, longer than ``seq + 1``.
        batch: windows per batch.
        seq: window length.
        seed: seed of the window positions (same seed, same batches).

    Yields:
        ``(inputs, targets)``: int32 arrays of shape ``(batch, seq)``, the
        targets shifted by one byte.
    """
    rng = np.random.default_rng(seed)
    while True:
        idx = rng.integers(0, len(data) - seq - 1, batch)
        chunk = np.stack([data[i : i + seq + 1] for i in idx]).astype(np.int32)
        yield chunk[:, :-1], chunk[:, 1:]


# ---------------------------------------------------------------------------
# Model


def init_params(key: jax.Array, cfg: Config) -> dict:
    """Initial float32 parameters.

    Args:
        key: PRNG key.
        cfg: sizes (``d_model``, ``layers``, ``seq_len``).

    Returns:
        A dict of arrays; the per-layer weights under ``"layers"`` are stacked
        on a leading axis of length ``cfg.layers`` (what ``lax.scan`` slices).
    """
    d, L = cfg.d_model, cfg.layers
    ks = jax.random.split(key, 6)
    n = lambda k, shape, scale: jax.random.normal(k, shape, jnp.float32) * scale
    return {
        "tok": n(ks[0], (256, d), 0.02),
        "pos": n(ks[1], (cfg.seq_len, d), 0.01),
        "layers": {
            "ln1": jnp.ones((L, d)),
            "qkv": n(ks[2], (L, d, 3 * d), d**-0.5),
            "proj": n(ks[3], (L, d, d), (2 * L * d) ** -0.5),
            "ln2": jnp.ones((L, d)),
            "up": n(ks[4], (L, d, 4 * d), d**-0.5),
            "down": n(ks[5], (L, 4 * d, d), (2 * L * 4 * d) ** -0.5),
        },
        "ln_f": jnp.ones((d,)),
    }


def layer_norm(x: jax.Array, gain: jax.Array, f32_stats: bool = False) -> jax.Array:
    """LayerNorm over the last axis, with a gain and no bias.

    Args:
        x: activations ``(..., d)``.
        gain: ``(d,)``.
        f32_stats: mean, variance and normalisation in float32, rounded once
            to ``x``'s dtype before the gain (what a hand-written bfloat16
            model does).

    Returns:
        The normalised activations, shaped and typed like ``x``.
    """
    xs = x.astype(jnp.float32) if f32_stats else x
    mean = xs.mean(-1, keepdims=True)
    var = jnp.square(xs - mean).mean(-1, keepdims=True)
    normed = (xs - mean) * jax.lax.rsqrt(var + 1e-5)
    return (normed.astype(x.dtype) if f32_stats else normed) * gain


def forward(
    params: dict, tokens: jax.Array, heads: int, hand: bool = False
) -> jax.Array:
    """The GPT's next-byte logits.

    Args:
        params: as returned by ``init_params``.
        tokens: int32 bytes ``(batch, seq)``, ``seq <= cfg.seq_len``.
        heads: attention heads (``d_model`` must be divisible by it).
        hand: the hand-written bfloat16 model (the ``hand_bf16`` mode): the
            parameters cast to bfloat16 at the top, LayerNorm statistics in
            float32, float32 logits.

    Returns:
        Logits ``(batch, seq, 256)``; the output embedding is the input one.
    """
    b, t = tokens.shape
    if hand:
        params = jax.tree.map(lambda a: a.astype(jnp.bfloat16), params)
    x = params["tok"][tokens] + params["pos"][:t]

    @jax.checkpoint
    def block(x, w):
        with jax.named_scope("attn"):
            h = layer_norm(x, w["ln1"], hand)
            q, k, v = jnp.split(h @ w["qkv"], 3, axis=-1)
            split = lambda z: z.reshape(b, t, heads, -1)
            a = jax.nn.dot_product_attention(
                split(q), split(k), split(v), is_causal=True, implementation="xla"
            )
            x = x + a.reshape(b, t, -1) @ w["proj"]
        with jax.named_scope("mlp"):
            h = layer_norm(x, w["ln2"], hand)
            x = x + jax.nn.gelu(h @ w["up"]) @ w["down"]
        return x, None

    x, _ = jax.lax.scan(block, x, params["layers"])
    with jax.named_scope("head"):
        logits = layer_norm(x, params["ln_f"], hand) @ params["tok"].T
        return logits.astype(jnp.float32) if hand else logits


def loss_fn(
    params: dict, x: jax.Array, y: jax.Array, heads: int, hand: bool = False
) -> jax.Array:
    """Mean next-byte cross-entropy.

    Args:
        params: as returned by ``init_params``.
        x: int32 input bytes ``(batch, seq)``.
        y: int32 target bytes ``(batch, seq)``.
        heads: attention heads.
        hand: the hand-written bfloat16 model (see ``forward``).

    Returns:
        The loss in nats per byte, a float32 scalar.
    """
    logits = forward(params, x, heads, hand)
    # float32 mean: a float32 loss for bfloat16 parameters too
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, y)
    return ce.mean(dtype=jnp.float32)


# ---------------------------------------------------------------------------
# Modes: one entry each. compute: amp compute dtype (None: no amp);
# scaler: "dynamic" for float16 loss scaling, None for a static (no-op) scale;
# policy: amp policy; wrap: without amp, a cast around the float32 model
# (jmp's); hand: the hand-written bfloat16 model (``forward(hand=True)``).
# jmp_bf16 and hand_bf16 are the baselines a user would otherwise pick
# (benchmarks/seed_study.py trains them against the amp modes).


def _fp8_policy():
    # Every matmul in FP8: the default size rule (torchao's H100 crossover,
    # K > 4096 or N > 1024) would skip all of this small model's matmuls.
    return jaxamp.fp8_policy(size_rule=None)


def _int8_policy():
    # Every matmul in int8 (same reason); otherwise jaxamp's default recipe:
    # rowwise scales, int8 forward and dgrad with stochastic rounding, bf16 wgrad.
    return jaxamp.int8_policy(size_rule=None)


def _fp16_policy():
    # The default policy keeps float32 scan carries under float16 (a residual
    # stream could overflow 65504); this small model's cannot, so the example
    # opts in to float16 carries, which halves what the checkpointed layers save.
    return {**jaxamp.default_amp_policy, "scan": jaxamp.use_compute_precision}


def _jmp_cast(fn: Callable) -> Callable:
    # jmp's cast-everything recipe ("params=float32,compute=bfloat16,
    # output=float32"): the float32 model run on bfloat16 parameters, its
    # LayerNorms, softmax and cross-entropy in bfloat16 too.
    try:
        import jmp
    except ImportError:  # jaxamp's port has jmp's Policy, cast for cast
        from jaxamp.migration import jmp
    policy = jmp.get_policy("params=float32,compute=bfloat16,output=float32")
    return lambda p, *a: policy.cast_to_output(fn(policy.cast_to_compute(p), *a))


MODES: dict[str, dict[str, Any]] = {
    "fp32": {"compute": None, "scaler": None},
    "bf16": {"compute": jnp.bfloat16, "scaler": None},
    "fp16": {"compute": jnp.float16, "scaler": "dynamic", "policy": _fp16_policy},
    "fp8": {"compute": jnp.bfloat16, "scaler": None, "policy": _fp8_policy},
    "int8": {"compute": jnp.bfloat16, "scaler": None, "policy": _int8_policy},
    "jmp_bf16": {"compute": None, "scaler": None, "wrap": _jmp_cast},
    "hand_bf16": {"compute": None, "scaler": None, "hand": True},
}
ALL_MODES = ["fp32", "bf16", "fp16"]  # what --mode all trains, in this order


def mode_loss(mode: str, cfg: Config) -> Callable:
    """The loss function a mode trains.

    Args:
        mode: a key of ``MODES``.
        cfg: the run configuration (``heads``).

    Returns:
        ``loss(params, x, y) -> float32 scalar``: ``loss_fn`` as is for fp32,
        wrapped in ``jaxamp.amp`` with the mode's compute dtype and policy
        otherwise.
    """
    hand = MODES[mode].get("hand", False)
    fn = lambda p, x, y: loss_fn(p, x, y, cfg.heads, hand)  # noqa: E731
    return _amp_for(mode, fn, cfg.residual_dtype)


def _amp_for(mode: str, fn: Callable, residual_dtype: str = "compute") -> Callable:
    spec = MODES[mode]
    if spec["compute"] is None:
        return spec.get("wrap", lambda f: f)(fn)
    kw = {"residual_dtype": RESIDUAL_DTYPES[residual_dtype]}
    if "policy" in spec:
        kw["amp_policy"] = spec["policy"]()
    return jaxamp.amp(fn, compute_dtype=spec["compute"], **kw)


def make_optimizer(cfg: Config, skip: bool = True) -> optax.GradientTransformation:
    """The optimizer of every mode.

    Args:
        cfg: ``lr``, ``warmup`` and ``steps``.
        skip: wrap it in ``jaxamp.skip_nonfinite_updates`` (False: the plain
            step, for the memory benchmark's with/without comparison).

    Returns:
        AdamW (weight decay 0.1; or ``cfg.optimizer``) on a linear-warmup +
        cosine schedule (down to a tenth of ``lr``) after global-norm clipping
        at 1 (none with ``update_in_backward``), inside
        ``jaxamp.skip_nonfinite_updates`` (a step with non-finite gradients
        changes nothing and is counted; only float16 ever has one). With
        bfloat16 parameters and ``param_rounding`` other than ``"plain"``, the
        chain runs inside ``jaxamp.low_precision_optimizer``. With
        ``"plain"`` (the naive recipe) the chain is returned as is: optax's
        AdamW returns float32 moments for bfloat16 parameters, so its state
        changes dtype after the first step, which a skip ``cond`` cannot hold.
    """
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, cfg.lr, cfg.warmup, max(cfg.steps, cfg.warmup + 1), cfg.lr * 0.1
    )
    tx = _base_optimizer(cfg, schedule)
    if not cfg.update_in_backward:  # clipping reads every gradient
        tx = optax.chain(optax.clip_by_global_norm(1.0), tx)
    if cfg.param_dtype == "bfloat16" and cfg.param_rounding == "plain":
        return tx
    if cfg.param_dtype == "bfloat16":
        state = {"bfloat16": jnp.bfloat16, "int8": "int8", "float32": None}
        tx = jaxamp.low_precision_optimizer(
            tx,
            rounding=cfg.param_rounding,
            state_dtype=state[cfg.opt_state_dtype],
            seed=cfg.seed,
        )
    if cfg.update_in_backward or not skip:
        return tx
    return jaxamp.skip_nonfinite_updates(tx)


def _base_optimizer(cfg: Config, schedule: Callable) -> optax.GradientTransformation:
    """``cfg.optimizer`` on ``schedule`` (see :class:`Config`)."""
    if cfg.optimizer == "adafactor":
        return jaxamp.training.layerwise_adafactor(schedule, weight_decay=0.1 * cfg.lr)
    if cfg.optimizer == "lion":
        return optax.lion(lambda n: schedule(n) / 3, weight_decay=0.3)
    return optax.adamw(schedule, 0.1)


def initial_params(cfg: Config) -> dict:
    """``init_params`` from ``cfg.seed``, cast to ``cfg.param_dtype``."""
    params = init_params(jax.random.key(cfg.seed), cfg)
    return jax.tree.map(lambda a: a.astype(cfg.param_dtype), params)


def variant_label(mode: str, cfg: Config) -> str:
    """The table's name of a run: the mode, plus the parameter storage when it
    is bfloat16 (e.g. ``"bf16, bf16 params, stochastic, bfloat16 state"``) and
    the residual storage when it is 8-bit (``"bf16, fp8 residuals"``)."""
    if cfg.residual_dtype != "compute" and MODES[mode]["compute"] is not None:
        mode = f"{mode}, {cfg.residual_dtype} residuals"
    if cfg.update_in_backward:
        mode = f"{mode}, update in backward"
    if cfg.optimizer != "adamw":
        mode = f"{mode}, {cfg.optimizer}"
    if cfg.param_dtype == "float32":
        return mode
    if cfg.param_rounding == "plain":
        return f"{mode}, bf16 params, plain optax"
    return f"{mode}, bf16 params, {cfg.param_rounding}, {cfg.opt_state_dtype} state"


def bytes_per_param(params: Any, opt_state: Any, grads: Any) -> dict:
    """Stored bytes per parameter of the parameters, the optimizer state and the
    gradients (arrays or ShapeDtypeStructs), and their sum ``"total"``."""
    nbytes = lambda t: sum(
        x.size * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(t)
    )
    n = sum(x.size for x in jax.tree.leaves(params))
    out = {
        "params": nbytes(params) / n,
        "opt_state": nbytes(opt_state) / n,
        "grads": nbytes(grads) / n,
    }
    out["total"] = sum(out.values())
    return out


def train(
    cfg: Config, mode: str, data: tuple[np.ndarray, np.ndarray], progress: bool = True
) -> dict:
    """Trains one mode from ``cfg.seed`` and measures it.

    Args:
        cfg: the run configuration.
        mode: a key of ``MODES``.
        data: ``(train, val)`` byte arrays from ``load_corpus``.
        progress: show a tqdm progress bar with the loss and tokens/s.

    Returns:
        The mode's figures: ``losses`` (every step's training loss),
        ``final_train_loss`` (mean of the last 10), ``val_loss`` (nats),
        ``val_bits_per_char``, ``val_curve`` (``(step, validation loss)``
        pairs every ``cfg.eval_every`` steps and at the end),
        ``tokens_per_s`` (steady state, after the compiling step and one warm
        step, the validations' time excluded), ``skipped_steps``,
        ``forward_overflows`` (steps whose loss was non-finite: a float16
        overflow in the forward pass, made visible by amp's overflow check),
        ``final_loss_scale``, ``low_precision_flop_share`` (of the matmul
        FLOPs of the gradient's jaxpr), ``residual_bytes`` (activations saved
        for the backward pass), ``sample`` (text generated by the trained
        model) and ``wall_s`` (the mode's wall time, compilation, evaluation
        and sampling included).
    """
    t_start = time.perf_counter()
    train_data, val_data = data
    loss = mode_loss(mode, cfg)
    scaler = (
        jaxamp.DynamicScalerState()
        if MODES[mode]["scaler"] == "dynamic"
        else jaxamp.StaticScalerState()
    )
    value_and_grad = jaxamp.dynamic_scale_value_and_grad(loss, filter=False)
    if cfg.param_dtype == "bfloat16" and MODES[mode]["scaler"] is None:
        # A static scale of 1 is a no-op; the scaler's float32 unscale would
        # double the bytes of bfloat16 gradients.
        value_and_grad = _plain_value_and_grad(loss)
    opt = make_optimizer(cfg)
    params = initial_params(cfg)
    with jax.numpy_dtype_promotion("standard"):  # optax's init (see step)
        opt_state = opt.init(params)

    @jax.jit
    def step(params, opt_state, scaler, x, y):
        scaler, (value, grads) = value_and_grad(
            params, x, y, dynamic_scaler_state=scaler
        )
        # optax's Adam raises float constants to its int32 step count, which
        # jax_numpy_dtype_promotion="strict" rejects; the model and jaxamp are
        # strict-clean, so only the update is traced under standard promotion.
        with jax.numpy_dtype_promotion("standard"):
            updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, scaler, value

    if cfg.update_in_backward:
        step = _step_in_backward(loss, opt)
    eval_loss = jax.jit(loss)
    val_it = batches(val_data, cfg.batch_size, cfg.seq_len, cfg.seed + 1)
    val_batches = [next(val_it) for _ in range(cfg.eval_batches)]
    validate = lambda: float(  # noqa: E731
        np.mean([float(eval_loss(params, *b)) for b in val_batches])
    )
    val_curve = []  # (step, validation loss) every cfg.eval_every steps
    it = batches(train_data, cfg.batch_size, cfg.seq_len, cfg.seed)
    tokens_per_step = cfg.batch_size * cfg.seq_len
    losses, t_steady, eval_s = [], None, 0.0
    bar = _progress(cfg.steps, mode, progress)
    for i in range(cfg.steps):
        x, y = next(it)
        params, opt_state, scaler, value = step(params, opt_state, scaler, x, y)
        losses.append(float(value))
        if cfg.eval_every and (i + 1) % cfg.eval_every == 0 and i + 1 < cfg.steps:
            t_eval = time.perf_counter()
            val_curve.append((i + 1, validate()))
            eval_s += time.perf_counter() - t_eval if i >= 2 else 0.0
        if i == 1:
            t_steady = time.perf_counter()  # after compilation and one warm step
        if bar is not None:
            postfix = {"loss_nats": f"{losses[-1]:.3f}"}
            if i >= 2:  # steady state: steps after the compile and warm-up steps
                rate = (i - 1) * tokens_per_step / (time.perf_counter() - t_steady)
                postfix["tok_s"] = f"{rate:.0f}"
            bar.set_postfix(postfix, refresh=False)
            bar.update()
    if bar is not None:
        bar.close()
    elapsed = time.perf_counter() - t_steady - eval_s if t_steady else float("nan")
    val = validate()
    val_curve.append((cfg.steps, val))
    x0, y0 = next(batches(train_data, cfg.batch_size, cfg.seq_len, cfg.seed + 2))
    grad_jaxpr = jax.make_jaxpr(jax.grad(loss))(params, x0, y0)
    precision = precision_report(mode, cfg, params, x0, y0) if cfg.report else None
    grads_shape = jax.eval_shape(
        lambda p: value_and_grad(p, x0, y0, dynamic_scaler_state=scaler)[1][1], params
    )
    if cfg.update_in_backward:  # one layer's gradient at a time, no tree
        grads_shape = {}
    return {
        "mode": mode,
        "label": variant_label(mode, cfg),
        "bytes_per_param": bytes_per_param(params, opt_state, grads_shape),
        "steps": cfg.steps,
        "losses": losses,
        "final_train_loss": float(np.mean(losses[-10:])),
        "val_loss": val,
        "val_bits_per_char": val / math.log(2),
        "val_curve": val_curve,
        "tokens_per_s": (cfg.steps - 2) * tokens_per_step / elapsed
        if cfg.steps > 2
        else None,
        "skipped_steps": int(getattr(opt_state, "skipped_steps", 0)),
        # amp's overflow_check (on for float16) turns a float16 overflow in the
        # forward pass into a NaN loss, so these steps are seen and skipped.
        "forward_overflows": int(sum(not math.isfinite(v) for v in losses)),
        "final_loss_scale": float(scaler.scaler),
        "low_precision_flop_share": jaxamp.tools.low_precision_flop_share(grad_jaxpr),
        "eight_bit_flop_share": jaxamp.tools.eight_bit_flop_share(grad_jaxpr),
        "residual_bytes": jaxamp.saved_residual_bytes(loss, params, x0, y0),
        "sample": sample(loss_forward(mode, cfg), params, val_data, cfg),
        "precision_report": precision,
        "wall_s": time.perf_counter() - t_start,
    }


def precision_report(mode: str, cfg: Config, params: dict, x, y) -> dict | None:
    """Write ``jaxamp.precision_report``'s JSON and PNG for ``mode`` (an amp
    mode) at ``params`` on one batch ``(x, y)`` into
    ``cfg.report_dir/precision_MODE``.

    Returns:
        ``{"dir", "grad_error", "loss_error", "top"}``, or None for fp32.
    """
    spec = MODES[mode]
    if spec["compute"] is None:
        return None
    kw = {"amp_policy": spec["policy"]()} if "policy" in spec else {}
    report = jaxamp.precision_report(
        lambda p, x, y: loss_fn(p, x, y, cfg.heads),
        params,
        x,
        y,
        compute_dtype=spec["compute"],
        group_depth=2,
        **kw,
    )
    base = Path(cfg.report_dir or Path(__file__).resolve().parent / "results")
    report.save(str(base / f"precision_{mode}"))
    return {
        "dir": str(base / f"precision_{mode}"),
        "grad_error": report.grad_error,
        "grad_errors": report.grad_errors,
        "loss_error": report.loss_error,
        "top": report.top(5),
    }


def _step_in_backward(loss: Callable, opt) -> Callable:
    """The step with AdamW applied inside the backward pass, parameters and
    state donated (updated in place, one layer at a time)."""
    fused = jaxamp.update_in_backward(loss, opt)

    def step(params, opt_state, scaler, x, y):
        with jax.numpy_dtype_promotion("standard"):  # optax's Adam (see train)
            params, opt_state, value = fused(params, opt_state, x, y)
        return params, opt_state, scaler, value

    return jax.jit(step, donate_argnums=(0, 1))


def _plain_value_and_grad(loss: Callable) -> Callable:
    """``jax.value_and_grad`` with the scaler's call shape (scaler unchanged),
    the gradients in the parameters' dtype."""

    def value_and_grad(params, x, y, dynamic_scaler_state):
        return dynamic_scaler_state, jax.value_and_grad(loss)(params, x, y)

    return value_and_grad


def loss_forward(mode: str, cfg: Config) -> Callable:
    """The mode's forward pass, transformed like its loss (used for sampling).

    Args:
        mode: a key of ``MODES``.
        cfg: the run configuration (``heads``).

    Returns:
        ``fwd(params, tokens) -> logits``.
    """
    hand = MODES[mode].get("hand", False)
    return _amp_for(mode, lambda p, x: forward(p, x, cfg.heads, hand))


def sample(fwd: Callable, params: dict, prompt_src: np.ndarray, cfg: Config) -> str:
    """Generates text from a trained model at temperature 0.8.

    Args:
        fwd: ``fwd(params, tokens) -> logits``, e.g. from ``loss_forward``.
        params: the trained parameters.
        prompt_src: bytes whose first ``cfg.seq_len`` are the prompt.
        cfg: ``seq_len``, ``sample_chars`` and ``seed``.

    Returns:
        The ``cfg.sample_chars`` generated bytes, decoded as UTF-8 (invalid
        sequences replaced).
    """
    fwd = jax.jit(fwd)
    ctx = list(prompt_src[: cfg.seq_len])
    key = jax.random.key(cfg.seed)
    out = []
    for _ in range(cfg.sample_chars):
        window = np.asarray(ctx[-cfg.seq_len :], np.int32)[None]
        logits = fwd(params, window)[0, -1]
        key, sub = jax.random.split(key)
        nxt = int(jax.random.categorical(sub, logits / 0.8))
        ctx.append(nxt)
        out.append(nxt)
    return bytes(out).decode("utf-8", errors="replace")


def _progress(total: int, mode: str, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    # tqdm draws on stderr; a line printed before the bar sits in stdout's buffer
    # when the output is a file, and would land after the bars without this.
    sys.stdout.flush()
    # Redrawn at most once a second when the output is a log file, not a
    # terminal (every redraw is a line there).
    interval = 0.1 if sys.stdout.isatty() else 1.0
    return tqdm(
        total=total, desc=f"{mode:>4}", unit="step", leave=True, mininterval=interval
    )


# ---------------------------------------------------------------------------
# Reporting


def table(results: list[dict], fp32_residual: int | None) -> str:
    """Formats the figures of each mode as a Markdown table.

    Args:
        results: the dicts returned by ``train``.
        fp32_residual: fp32's residual bytes, the reference of the last column.

    Returns:
        The table, one row per mode.
    """
    head = (
        "| mode | train loss (nats) | val loss (nats) | val bits/char | tokens/s "
        "| skipped steps "
        "| forward overflows | final loss scale | low-precision matmul FLOPs "
        "| 8-bit matmul FLOPs | residual bytes vs fp32 | bytes/param |"
    )
    rows = [head, "|" + "---|" * 12]
    for r in results:
        ratio = r["residual_bytes"] / fp32_residual if fp32_residual else float("nan")
        tps = f"{r['tokens_per_s']:.0f}" if r["tokens_per_s"] else "-"
        rows.append(
            f"| {r.get('label', r['mode'])} | {r['final_train_loss']:.3f} "
            f"| {r['val_loss']:.3f} "
            f"| {r['val_bits_per_char']:.3f} | {tps} | {r['skipped_steps']} "
            f"| {r.get('forward_overflows', 0)} | {r['final_loss_scale']:g} "
            f"| {r['low_precision_flop_share']:.2f} "
            f"| {r.get('eight_bit_flop_share', 0.0):.2f} "
            f"| {ratio:.2f}x | {r['bytes_per_param']['total']:.2f} |"
        )
    return "\n".join(rows)


# The mean gap between the modes' training curves (bits per character) below
# which the plot's subtitle says they overlap (about 2% of the ~5-bit range
# the default run's curves span).
OVERLAP_BITS = 0.1


def loss_figure(results: list[dict], unigram_bits: float | None = None):
    """The figure of the training-loss curves of the modes, in bits per
    character (the unit of the table and the text; the losses are in nats).

    The subtitle gives the mean gap between the modes' curves (the spread of
    the modes' losses at a step, averaged over the steps) and, at most
    ``OVERLAP_BITS``, says that the curves overlap because the modes train
    alike: with the default settings fp32, bf16 and fp16 do.

    Args:
        results: the dicts returned by ``train``.
        unigram_bits: the corpus's unigram entropy in bits per character,
            drawn as a reference line; None for none.

    Returns:
        A matplotlib ``Figure`` (Agg backend; close it with
        ``matplotlib.pyplot.close``).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bits = [np.asarray(r["losses"], np.float64) / math.log(2) for r in results]
    fig, ax = plt.subplots(figsize=(7, 4.3))
    for r, curve in zip(results, bits):
        name = r.get("label", r["mode"])
        (line,) = ax.plot(curve, label=f"{name} train", linewidth=1)
        ax.plot(
            len(curve) - 1,
            r["val_bits_per_char"],
            "o",
            color=line.get_color(),
            label=f"{name} validation ({r['val_bits_per_char']:.2f} bits/char)",
        )
    if unigram_bits is not None:
        ax.axhline(
            unigram_bits,
            color="gray",
            linestyle="--",
            linewidth=1,
            label=f"unigram entropy ({unigram_bits:.2f} bits/char)",
        )
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (bits/char)")
    fig.suptitle("char-level GPT on the Python stdlib")
    if len(bits) > 1:
        steps = min(len(c) for c in bits)
        gap = float(np.ptp(np.stack([c[:steps] for c in bits]), axis=0).mean())
        text = f"mean gap between the modes {gap:.3f} bits/char"
        if gap <= OVERLAP_BITS:
            text = f"the curves overlap because the modes train alike ({text})"
        ax.set_title(text, fontsize="small")
    ax.legend(fontsize="small")
    fig.tight_layout()
    return fig


def plot(results: list[dict], path: Path, unigram_bits: float | None = None) -> None:
    """Writes :func:`loss_figure` as a PNG.

    Args:
        results: the dicts returned by ``train``.
        path: the PNG file to write.
        unigram_bits: the corpus's unigram entropy in bits per character;
            None for none.
    """
    import matplotlib.pyplot as plt

    fig = loss_figure(results, unigram_bits)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(cfg: Config, progress: bool = True) -> dict:
    """Trains the requested modes and writes the JSON and PNG to ``cfg.out``.

    ``cfg.mode == "all"`` trains fp32, bf16 and fp16 one after another, with
    the same seed, initial parameters and batches.

    Args:
        cfg: the run configuration.
        progress: show a progress bar per mode.

    Returns:
        The report written to ``charlm_results.json``: the configuration, JAX
        version, device and machine, corpus sizes, the corpus's unigram
        entropy, the figures of each mode (with ``residual_bytes_vs_fp32``),
        the table and ``total_wall_s``.

    Raises:
        DataError: if the data folder cannot be read.
    """
    data = load_corpus(cfg.data_dir, cfg.max_bytes)
    if min(len(d) for d in data) <= cfg.seq_len + 1:
        raise DataError(
            f"the {'training' if len(data[0]) <= cfg.seq_len + 1 else 'validation'}"
            f" split is shorter than --seq-len {cfg.seq_len}; raise --max-bytes"
        )
    t_start = time.perf_counter()
    modes = ALL_MODES if cfg.mode == "all" else [cfg.mode]
    results = [train(cfg, m, data, progress) for m in modes]
    fp32 = next((r for r in results if r["mode"] == "fp32"), None)
    if fp32 is not None:
        fp32_res = fp32["residual_bytes"]
    else:
        x0, y0 = next(batches(data[0], cfg.batch_size, cfg.seq_len, cfg.seed + 2))
        params = init_params(jax.random.key(cfg.seed), cfg)  # float32 reference
        fp32_res = jaxamp.saved_residual_bytes(mode_loss("fp32", cfg), params, x0, y0)
    for r in results:
        r["residual_bytes_vs_fp32"] = r["residual_bytes"] / fp32_res
    report = {
        "config": dataclasses.asdict(cfg),
        "jax_version": jax.__version__,
        "device": str(jax.devices()[0].device_kind),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "train_bytes": int(len(data[0])),
        "val_bytes": int(len(data[1])),
        "unigram_entropy_bits": unigram_entropy_bits(data[0]),
        "results": results,
        "table": table(results, fp32_res),
        "total_wall_s": time.perf_counter() - t_start,
    }
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "charlm_results.json").write_text(json.dumps(report, indent=1))
    plot(results, out / "charlm_loss.png", report["unigram_entropy_bits"])
    return report


def _field_docs() -> dict[str, str]:
    """The ``Attributes`` of ``Config``'s docstring, by field name."""
    docs, name = {}, None
    for line in Config.__doc__.split("Attributes:")[1].splitlines():
        head, sep, text = line.strip().partition(": ")
        if sep and head.isidentifier():
            name, docs[head] = head, text.replace("``", "")
        elif name and line.strip():
            docs[name] += " " + line.strip().replace("``", "")
    return docs


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point: trains, prints the table and the samples.

    Args:
        argv: the arguments (default ``sys.argv[1:]``).

    Returns:
        The exit status: 0, or 2 with a one-line error on stderr when the data
        folder cannot be read.
    """
    p = argparse.ArgumentParser(
        description=" ".join(__doc__.split("\n\n")[0].split()),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    helps = _field_docs()
    p.add_argument("--mode", default="all", choices=["all", *MODES], help=helps["mode"])
    for f in dataclasses.fields(Config):
        if f.name == "mode":
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(f.default, bool):
            p.add_argument(flag, action="store_true", help=helps[f.name])
            continue
        typ = str if f.name in ("data_dir", "out", "report_dir") else type(f.default)
        p.add_argument(
            flag,
            type=typ,
            default=f.default,
            choices=CHOICES.get(f.name),
            help=helps[f.name],
        )
    cfg = Config(**vars(p.parse_args(argv)))
    for name in ("steps", "batch_size", "seq_len", "d_model", "layers", "heads"):
        if getattr(cfg, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if cfg.eval_every < 0:
        p.error("--eval-every must be at least 0 (0: validate at the end only)")
    if cfg.d_model % cfg.heads:
        p.error(f"--d-model {cfg.d_model} is not divisible by --heads {cfg.heads}")
    if cfg.update_in_backward and cfg.mode in ("all", "fp16"):
        p.error(
            "--update-in-backward: float16 needs loss scaling, whose skip of a "
            "non-finite step cannot follow an update made during the backward "
            "pass; use --mode bf16 (or fp32, fp8, int8)"
        )

    try:
        report = run(cfg)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(
        f"\ntrain {report['train_bytes']} bytes, val {report['val_bytes']} bytes; "
        f"unigram entropy {report['unigram_entropy_bits']:.3f} bits/char\n"
    )
    print(report["table"])
    for r in report["results"]:
        print(f"\n--- sample ({r.get('label', r['mode'])}) ---\n{r['sample']}")
        if r.get("precision_report"):
            pr = r["precision_report"]
            print(
                f"precision report ({r['mode']}): gradient error "
                f"{pr['grad_error']:.2e}, top scopes {pr['top']}; wrote {pr['dir']}"
            )
    print(
        f"\n{len(report['results'])} mode(s) in {report['total_wall_s']:.0f} s; "
        f"wrote {cfg.out}/charlm_results.json and {cfg.out}/charlm_loss.png"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
