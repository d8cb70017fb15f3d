"""Primitive-name lists shared by the passes: one copy each.

Names, not primitive objects. Higher-order primitives are described in
``_structure.py``, registered beside their rewrite rules.
"""

from __future__ import annotations

# Matmul-like primitives: the "lower" family of the default policy, the ones
# whose held inputs are re-cast in the backward pass.
MATMULS = ("dot_general", "conv_general_dilated", "ragged_dot_general")
