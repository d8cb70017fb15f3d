"""Primitive-name lists shared by the passes: one copy each.

Names, not primitive objects. Higher-order primitives are described in
``_structure.py``, registered beside their rewrite rules.
"""

from __future__ import annotations

# Matmul-like primitives: the "lower" family of the default policy, the ones
# whose held inputs are re-cast in the backward pass.
MATMULS = ("dot_general", "conv_general_dilated", "ragged_dot_general")

# Cheap elementwise primitives whose value, recomputed from a rounded input, is
# as close as the input (no exponential, no choice): arithmetic, roots, cheap
# odd functions and casts.
CHEAP_ELEMENTWISE = frozenset(
    """abs add convert_element_type cos div erf integer_pow mul neg rsqrt sin sqrt
    square sub tanh""".split()
)

# Primitives that move data without changing values (and the identity ones).
DATA_MOVEMENT = frozenset(
    """broadcast_in_dim concatenate copy copy_p dynamic_slice expand_dims pad
    reshape slice squeeze transpose""".split()
)

# Exponentials: exp turns an absolute error of its input into a relative error
# of its output (a softmax's probabilities), so their inputs are never stored in
# 8 bits (exp stores its output, its derivative).
EXPONENTIALS = frozenset({"exp", "exp2", "expm1", "logistic"})

# Choices: their derivative routes the cotangent by comparing input values
# (which element is the largest, the sort order); recomputed from rounded values
# the choice could change.
CHOOSERS = frozenset(
    """argmax argmin cummax cummin reduce_max reduce_min sort top_k""".split()
)

# Primitives whose derivative reads no float input value (linear, structural
# or comparison-free selection): never wrapped, nothing of theirs is saved.
READS_NO_VALUE = frozenset(
    {
        "add",
        "add_any",
        "sub",
        "neg",
        "convert_element_type",
        "reshape",
        "broadcast_in_dim",
        "transpose",
        "squeeze",
        "expand_dims",
        "slice",
        "dynamic_slice",
        "dynamic_update_slice",
        "concatenate",
        "pad",
        "reduce_sum",
        "select_n",
        "copy",
        "copy_p",
        "cumsum",
        "rev",
        "reduce_precision",
        "real",
        "imag",
        "stop_gradient",
        "iota",
        "eq",
        "ne",
        "lt",
        "le",
        "gt",
        "ge",
        "sign",
        "floor",
        "ceil",
        "round",
        "is_finite",
    }
)
