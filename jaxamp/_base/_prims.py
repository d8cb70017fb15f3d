"""Primitive-name lists shared by the passes: one copy each.

Names, not primitive objects: ``pjit`` became ``jit`` in JAX 0.7 and
``remat2`` is also spelled ``checkpoint``, so the lists carry both spellings.
"""

from __future__ import annotations

# Matmul-like primitives: the "lower" family of the default policy, the ones
# whose held inputs are re-cast in the backward pass.
MATMULS = ("dot_general", "conv_general_dilated", "ragged_dot_general")

# jax.checkpoint.
REMATS = frozenset({"remat2", "checkpoint"})

# Call-like primitives whose one body runs once, as called: its inputs and
# outputs are the equation's (a use inside the body is a use of the input).
PLAIN_CALLS = frozenset({"jit", "pjit", "closed_call", "core_call"}) | REMATS

# Custom derivatives: one primal body, plus user rules traced lazily.
CUSTOM_CALLS = frozenset({"custom_jvp_call", "custom_vjp_call"})

# Every call-like primitive: one sub-jaxpr whose inputs and outputs are the
# equation's (the facts pass enters them).
CALLS = PLAIN_CALLS | CUSTOM_CALLS | frozenset({"shard_map"})
