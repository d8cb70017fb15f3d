"""jaxamp: automatic mixed precision for JAX.

``jaxamp.amp(loss_fn)`` rewrites every equation of ``loss_fn``'s jaxpr, including
those inside ``jit``, ``scan``, ``while``, ``cond``, ``remat``, ``custom_jvp``,
``custom_vjp`` and ``shard_map``, so that matmuls run in a low compute dtype and
numerically fragile operations stay in float32. Loss scaling and optax
integration complete the training story.
"""

__version__ = "0.1.0"

__all__ = ()
