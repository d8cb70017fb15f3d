"""A small CNN on scikit-learn's bundled handwritten digits (8x8, 1797 images, no
download), trained in fp32, bf16 and fp16 mixed precision; reports test accuracy.

    python examples/train_digits.py [--steps 300] [--mode all|fp32|bf16|fp16]

The convolutions are ``lax.conv_general_dilated`` (via ``lax.conv``), so under
``jaxamp.amp`` they run in the compute dtype; ``relu`` (a ``custom_jvp``) keeps
the activations in it too.
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxamp

# mode: (amp compute dtype, None for no amp; dynamic loss scaling)
MODES = {
    "fp32": (None, False),
    "bf16": (jnp.bfloat16, False),
    "fp16": (jnp.float16, True),
}


def load(seed: int = 0) -> tuple[np.ndarray, ...]:
    """Loads the digits and splits them 80/20 into training and test sets.

    Args:
        seed: seed of the shuffle before the split.

    Returns:
        ``(x_train, y_train, x_test, y_test)``: images ``(n, 1, 8, 8)``
        float32 in [0, 1] and int32 labels.
    """
    from sklearn.datasets import load_digits

    d = load_digits()
    x = (d.images / 16.0).astype(np.float32)[:, None]
    y = d.target.astype(np.int32)
    perm = np.random.default_rng(seed).permutation(len(y))
    x, y = x[perm], y[perm]
    n = int(0.8 * len(y))
    return x[:n], y[:n], x[n:], y[n:]


def init(key: jax.Array) -> dict:
    """Initial float32 CNN parameters (He-normal weights, zero biases).

    Args:
        key: PRNG key.

    Returns:
        A dict of arrays: two 3x3 convolutions (16 and 32 channels) and a
        dense layer to the 10 classes.
    """
    k1, k2, k3 = jax.random.split(key, 3)
    he = lambda k, shape, fan_in: jax.random.normal(k, shape) * (2.0 / fan_in) ** 0.5
    return {
        "c1": he(k1, (16, 1, 3, 3), 9),
        "b1": jnp.zeros((16, 1, 1)),
        "c2": he(k2, (32, 16, 3, 3), 144),
        "b2": jnp.zeros((32, 1, 1)),
        "w": he(k3, (32 * 4 * 4, 10), 512),
        "b": jnp.zeros(10),
    }


def logits(p: dict, x: jax.Array) -> jax.Array:
    """The CNN's class logits.

    Args:
        p: as returned by ``init``.
        x: images ``(n, 1, 8, 8)``.

    Returns:
        Logits ``(n, 10)``.
    """
    h = jax.nn.relu(jax.lax.conv(x, p["c1"], (1, 1), "SAME") + p["b1"])
    h = jax.nn.relu(jax.lax.conv(h, p["c2"], (2, 2), "SAME") + p["b2"])  # 4x4
    return h.reshape(h.shape[0], -1) @ p["w"] + p["b"]


def loss(p: dict, x: jax.Array, y: jax.Array) -> jax.Array:
    """Mean cross-entropy.

    Args:
        p: as returned by ``init``.
        x: images ``(n, 1, 8, 8)``.
        y: int32 labels ``(n,)``.

    Returns:
        A float32 scalar.
    """
    return optax.softmax_cross_entropy_with_integer_labels(logits(p, x), y).mean()


def train(mode: str, steps: int = 300, batch: int = 128, seed: int = 0) -> dict:
    """Trains one mode with Adam and measures it on the test set.

    Args:
        mode: a key of ``MODES``.
        steps: optimizer steps.
        batch: images per step (drawn with replacement).
        seed: seed of the split, the parameters and the batches.

    Returns:
        ``mode``, ``test_accuracy``, ``final_loss`` (of the last step),
        ``loss_scale`` (final) and ``skipped_steps``.
    """
    compute, dynamic = MODES[mode]
    xtr, ytr, xte, yte = load(seed)
    lf = loss if compute is None else jaxamp.amp(loss, compute_dtype=compute)
    fwd = logits if compute is None else jaxamp.amp(logits, compute_dtype=compute)
    vg = jaxamp.dynamic_scale_value_and_grad(lf, filter=False)
    scaler = jaxamp.DynamicScalerState() if dynamic else jaxamp.StaticScalerState()
    opt = jaxamp.skip_nonfinite_updates(optax.adam(3e-3))
    params = init(jax.random.key(seed))
    state = opt.init(params)

    @jax.jit
    def step(params, state, scaler, x, y):
        scaler, (value, grads) = vg(params, x, y, dynamic_scaler_state=scaler)
        with jax.numpy_dtype_promotion("standard"):  # optax: float ** int32 count
            updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, scaler, value

    rng = np.random.default_rng(seed)
    for _ in range(steps):
        idx = rng.integers(0, len(ytr), batch)
        params, state, scaler, value = step(params, state, scaler, xtr[idx], ytr[idx])
    pred = np.asarray(jax.jit(fwd)(params, xte)).argmax(-1)
    return {
        "mode": mode,
        "test_accuracy": float((pred == yte).mean()),
        "final_loss": float(value),
        "loss_scale": float(scaler.scaler),
        "skipped_steps": int(state.skipped_steps),
    }


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point: prints a Markdown table, one row per mode.

    Args:
        argv: the arguments (default ``sys.argv[1:]``).

    Returns:
        The exit status, 0.
    """
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mode", default="all", choices=["all", *MODES])
    p.add_argument("--steps", type=int, default=300)
    args = p.parse_args(argv)
    modes = list(MODES) if args.mode == "all" else [args.mode]
    print("| mode | test accuracy | final loss | loss scale | skipped steps |")
    print("|---|---|---|---|---|")
    for m in modes:
        r = train(m, args.steps)
        print(
            f"| {m} | {r['test_accuracy']:.3f} | {r['final_loss']:.3f} "
            f"| {r['loss_scale']:g} | {r['skipped_steps']} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
