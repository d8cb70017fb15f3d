"""One process of ``tests/test_distributed.py``'s two-process training run.

Not collected by pytest (no ``test_`` prefix). Run as

    python tests/_distributed_worker.py PROCESS_ID NUM_PROCESSES PORT STEPS

with ``XLA_FLAGS=--xla_force_host_platform_device_count=2`` (two local CPU
devices) in the environment: it joins ``jax.distributed`` on
``127.0.0.1:PORT`` with gloo CPU collectives, runs ``STEPS`` jaxamp bfloat16
training steps of a small GPT on a global 2 x 2 ("data", "model") mesh and
prints one JSON line ``{"losses": [...], "param_norm": ...}`` (floats as
``float.hex`` strings, so the comparison is bit-exact).

The test imports this module too, for the same model, batch and step on one
process's local devices (the reference run); importing it starts nothing. The
model is ``benchmarks/collectives.py``'s, so ``benchmarks/`` must be on
``PYTHONPATH``.
"""

from __future__ import annotations

import json
import sys

import collectives  # benchmarks/: on PYTHONPATH (tests/test_distributed.py sets it)
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxamp

# benchmarks/collectives.py's unrolled GPT (float32 parameters, tied embedding
# head) at a size two processes train in seconds; BATCH is the global batch.
DIMS = collectives.Dims(vocab=64, d=32, layers=2, seq=16, batch=8, heads=2)
BATCH = DIMS.batch


def init_params(seed: int = 0) -> dict:
    """float32 parameters of the pre-LayerNorm GPT, NumPy."""
    return collectives.init_params(DIMS, seed)


def global_batch(seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """The global batch ``(x, y)``: int32 tokens ``[BATCH, T]``, next-token targets."""
    return collectives.batch(DIMS, seed)


# Mean next-token cross-entropy of the float32 model (amp rewrites it).
loss_fn = collectives.make_loss(DIMS)


def mesh_of(devices) -> Mesh:
    """A 2 x 2 ("data", "model") mesh; row i holds ``devices[2i:2i+2]`` (with
    ``jax.devices()`` of the two-process run: row i is process i's devices)."""
    return Mesh(np.asarray(devices).reshape(2, 2), ("data", "model"))


def param_specs(params) -> dict:
    """Megatron-style tensor parallelism over "model"; replicated over "data"."""
    layer = {
        "ln1": P(),
        "qkv": P(None, "model"),
        "o": P("model", None),
        "ln2": P(),
        "up": P(None, "model"),
        "down": P("model", None),
    }
    return {
        "emb": P(None, "model"),
        "pos": P(),
        "layers": [layer] * len(params["layers"]),
        "lnf": P(),
    }


def train(mesh: Mesh, params, x, y, steps: int) -> tuple[list[float], float]:
    """``steps`` jaxamp bf16 AdamW steps from ``params`` (placed on ``mesh`` here)
    on the sharded batch ``x, y``; the loss of each step and the final parameters'
    L2 norm, read from this process's first local shard (both are replicated).
    Compiled with LLVM optimisation off (``xla_backend_optimization_level=0``),
    half the compile time on a 2-core machine; the same in every run compared."""
    shardings = jax.tree.map(
        lambda s: NamedSharding(mesh, s),
        param_specs(params),
        is_leaf=lambda s: isinstance(s, P),
    )
    params = jax.tree.map(
        lambda a, s: jax.make_array_from_callback(a.shape, s, lambda i: a[i]),
        params,
        shardings,
    )
    amp_loss = jaxamp.amp(loss_fn, compute_dtype=jnp.bfloat16)
    opt = jaxamp.skip_nonfinite_updates(optax.adamw(1e-2))

    def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(amp_loss)(params, x, y)
        updates, opt_state = opt.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, loss, optax.tree.norm(params)

    # Every input sharding fixed, outputs the same: one compile for all steps.
    # (moments sharded as their parameters, counters replicated).
    scalar = NamedSharding(mesh, P())
    like_params = lambda t: jax.tree.structure(t) == jax.tree.structure(params)
    opt_shardings = jax.tree.map(
        lambda t: shardings if like_params(t) else scalar,
        jax.eval_shape(opt.init, params),
        is_leaf=like_params,
    )
    opt_state = jax.jit(opt.init, out_shardings=opt_shardings)(params)
    keep = (shardings, opt_shardings)
    compiled = (
        jax.jit(step, out_shardings=(*keep, scalar, scalar))
        .lower(params, opt_state, x, y)
        .compile(compiler_options={"xla_backend_optimization_level": 0})
    )
    losses = []
    for _ in range(steps):
        params, opt_state, loss, norm = compiled(params, opt_state, x, y)
        losses.append(float(loss.addressable_data(0)))
    return losses, float(norm.addressable_data(0))


def main(argv: list[str]) -> int:
    process_id, num_processes, port, steps = map(int, argv)
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=num_processes,
        process_id=process_id,
        initialization_timeout=30,
    )
    try:
        assert jax.process_count() == 2 and jax.local_device_count() == 2
        mesh = mesh_of(jax.devices())  # sorted by process: row i is process i
        assert set(mesh.devices[process_id]) == set(jax.local_devices())
        gx, gy = global_batch()
        rows = slice(process_id * BATCH // 2, (process_id + 1) * BATCH // 2)
        batch = NamedSharding(mesh, P("data"))
        x = jax.make_array_from_process_local_data(batch, gx[rows], gx.shape)
        y = jax.make_array_from_process_local_data(batch, gy[rows], gy.shape)
        losses, norm = train(mesh, init_params(), x, y, steps)
        out = {"losses": [v.hex() for v in losses], "param_norm": norm.hex()}
        print(json.dumps(out), flush=True)
    finally:
        jax.distributed.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
