"""``amp()``: automatic mixed precision by jaxpr rewriting; ``amp_stop``.

This module composes the pipeline (``docs/design.md``): it traces the user's
function (with the pattern rewrites' tracing contexts entered), hands the
interpreter its tables (the higher-order rules, the pattern rewrites) and
restores the output dtypes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from . import _compat, _nnx
from ._base import _overflow
from ._base._ambient_policy import policy_compute_dtype
from ._base._cast import cast_cache, restore
from ._base._dtypes import canonical_dtype, limited_range
from ._policy import _derived_sums, _residuals
from ._policy._lookup import AMP_REGION, AmpPolicy
from ._policy._rules import Rule, default_amp_policy
from ._rewrites import _attention, _layernorm, _rmsnorm
from ._walk import _higher_order
from ._walk._loop import AmpContext, Bind, Pipeline, eval_jaxpr


def _runnable_product(prim: Any, invals: Any, params: dict, bind: Bind, ctx) -> Any:
    """Bind step: a product the backend can run (``_compat.runnable_product``:
    the XLA:CPU barrier on a product the facts mark transposed)."""
    outs = bind(prim, invals, params)
    transposed = ctx is not None and ctx.facts.transposed
    return _compat.runnable_product(prim, invals, params, outs, transposed)


def _overflow_check(prim: Any, invals: Any, params: dict, bind: Bind, ctx) -> Any:
    """Bind step: NaN in place of a fresh forward overflow, when amp's
    ``overflow_check`` is on (``_overflow.poison``)."""
    return _overflow.poison(prim.name, invals, bind(prim, invals, params))


# The tables every amp walks with: the higher-order rules (a live view:
# rules registered later apply), the pattern rewrites, attention first, the
# steps that bind a ruled equation, innermost first, and the residual choice.
DEFAULT_PIPELINE = Pipeline(
    higher_order=_higher_order.higher_order_rules,
    rewrites=(_attention.REWRITE, _rmsnorm.REWRITE, _layernorm.REWRITE),
    bind_steps=(
        ("derived_sums", _derived_sums.bind),  # float32 sums of derived broadcasts
        ("runnable_product", _runnable_product),
        ("overflow_check", _overflow_check),
    ),
    residuals=_residuals.bind_saving_less,
)


# The compute dtype where none is given and no jaxamp.migration.haliax.mixed_precision
# block is
# open: float16, jaxamp 0.0.4's default (amp's signature is 0.0.4's).
DEFAULT_COMPUTE_DTYPE = np.dtype(np.float16)


class _AmpDefault:
    """The ``compute_dtype`` default where None means "without amp"
    (:func:`jaxamp.memory_report`): amp's default, as None is elsewhere."""

    def __repr__(self) -> str:
        return "AMP_DEFAULT"


AMP_DEFAULT = _AmpDefault()


def compute_dtype_or_default(compute_dtype: Any) -> np.dtype:
    """The NumPy dtype ``compute_dtype`` names or, where it is None (or
    :data:`AMP_DEFAULT`), the default compute dtype of :func:`amp`,
    :func:`jaxamp.find_overflows`, :func:`jaxamp.precision_report` and
    :func:`jaxamp.memory_report`: the compute dtype of the enclosing
    :func:`jaxamp.migration.haliax.mixed_precision` block, read now, else
    :data:`DEFAULT_COMPUTE_DTYPE` (float16).

    Raises:
        ValueError: if ``compute_dtype`` names no float dtype.
    """
    if compute_dtype is None or compute_dtype is AMP_DEFAULT:
        compute_dtype = policy_compute_dtype() or DEFAULT_COMPUTE_DTYPE
    return canonical_dtype(compute_dtype, argname="compute_dtype")


def amp(
    fn: Callable | None = None,
    *,
    compute_dtype: Any = None,
    amp_policy: Mapping[Any, Rule] = default_amp_policy,
    overflow_check: bool | None = None,
    residual_dtype: Any = None,
) -> Callable:
    """Run ``fn`` in automatic mixed precision.

    ``fn`` is traced to a jaxpr; every equation, including those inside
    ``jit``, ``scan``, ``while``, ``cond``, ``remat``, ``custom_jvp``,
    ``custom_vjp`` and ``shard_map``, is re-bound with its inputs cast by the
    rule ``amp_policy`` gives it: by default matmuls and convolutions in
    ``compute_dtype``, range-critical ops (exp, log, sums, ...) in float32, the
    rest following their inputs (PyTorch autocast's op lists,
    https://pytorch.org/docs/stable/amp.html, mapped onto JAX primitives).

    Example:
        >>> import jax, jax.numpy as jnp, jaxamp
        >>> f = jaxamp.amp(lambda w, x: jnp.tanh(x @ w).sum(),
        ...                compute_dtype=jnp.bfloat16)
        >>> f(jnp.ones((3, 2)), jnp.ones((4, 3))).dtype
        dtype('float32')

    Usable as ``amp(fn)``, ``amp(fn, compute_dtype=...)``, ``@amp`` and
    ``amp(compute_dtype=...)(fn)`` (jaxamp 0.0.4's signature). Composes with
    ``jit``, ``grad``, ``vjp``, ``vmap`` (with ``axis_name`` collectives) and
    with itself: inside a nested ``amp`` the innermost one decides (its region
    is ``amp_stop`` to the enclosing one).

    The backward pass JAX derives sums derived broadcasts in float32 and
    re-casts ``fn``'s arguments (alive for the step anyway) instead of saving
    low-precision copies (``docs/design.md``, "Residuals").

    Args:
        fn: a function of any pytrees (Equinox modules, dicts, ...); array leaves
            are traced, other leaves are static. Flax NNX graph nodes (modules,
            Variables, ``nnx.Rngs``, ``nnx.Optimizer``) are passed as ``nnx.jit``
            passes them: the Variable updates ``fn`` makes reach the caller's
            objects after the call, each in its Variable's dtype.
        compute_dtype: the low-precision dtype for matmuls (``jnp.bfloat16``
            needs no loss scaling), or a name such as ``"bf16"``. None: that of
            the :func:`jaxamp.migration.haliax.mixed_precision` block open when ``amp``
            is called,
            else ``jnp.float16`` (jaxamp 0.0.4's); the default, which
            ``find_overflows``, ``precision_report`` and ``memory_report`` share.
        amp_policy: mapping from primitive objects, primitive names,
            ``jax.named_scope`` names or ``/``-separated scope paths
            (``"layer2/mlp"``; plus ``"amp_stop"`` and ``"amp_default"``) to
            rules ``rule(compute_dtype, original_dtypes, *invars, **params)``
            or typed policy values (:class:`jaxamp.rules.CastRule`, ...).
        overflow_check: make forward overflows visible: where a sum, product,
            power, matmul or narrowing cast turns finite inputs into a
            non-finite float16 (or FP8) value, that value becomes NaN, so the
            loss and the gradients are NaN and loss scaling skips and counts the
            step instead of training on a value that ``rsqrt``/``tanh``/``exp``
            silently absorbed. One reduction per checked value. Default (None):
            on when ``compute_dtype`` is float16. Locate an overflow with
            :func:`jaxamp.find_overflows`.
        residual_dtype: None, or the 8-bit form of saved activations
            (``jnp.float8_e4m3fn``, ``"int8"``: :func:`jaxamp.residual_rule`).

    Returns:
        ``fn`` with its outputs' structure and dtypes; bfloat16/float16
        arguments are traced as float32, their gradients keep their dtype.

    Raises:
        TypeError: if ``fn`` is not callable, a policy key/value is invalid,
            or ``overflow_check`` is not True, False or None.
        ValueError: for a non-float ``compute_dtype`` or a bad ``residual_dtype``.

    Warns:
        UserWarning: once, when ``fn`` is traced, for each ``amp_policy`` key
            you added that matched no primitive and no ``jax.named_scope`` in
            ``fn`` (a typo), naming the closest name.
    """
    compute_dtype = compute_dtype_or_default(compute_dtype)
    amp_policy = _residuals.with_residual_dtype(amp_policy, residual_dtype)
    return amp_with(fn, compute_dtype, amp_policy, overflow_check, DEFAULT_PIPELINE)


def amp_with(
    fn: Callable | None,
    compute_dtype: Any,
    amp_policy: Mapping[Any, Rule],
    overflow_check: bool | None,
    pipeline: Pipeline,
) -> Callable:
    """:func:`amp` with the interpreter's tables given: ``pipeline`` (e.g. the
    default one without a pattern rewrite, for an ablation)."""
    compute_dtype = canonical_dtype(compute_dtype, argname="compute_dtype")
    policy = AmpPolicy(amp_policy)
    if fn is None:
        return functools.partial(
            amp_with,
            compute_dtype=compute_dtype,
            amp_policy=policy,
            overflow_check=overflow_check,
            pipeline=pipeline,
        )
    if not callable(fn):
        raise TypeError(
            f"amp(fn): fn must be callable, got {type(fn).__name__}. Use "
            "jaxamp.amp(loss_fn) or @jaxamp.amp."
        )
    if overflow_check is not None and not isinstance(overflow_check, (bool, np.bool_)):
        raise TypeError(
            f"amp(overflow_check=...): must be True, False or None (the default: "
            f"on where compute_dtype's range is below float32's, e.g. float16), "
            f"got {overflow_check!r}."
        )
    ctx = AmpContext(compute_dtype, policy, pipeline)
    if overflow_check is None:
        overflow_check = limited_range(compute_dtype)
    amp_call = functools.partial(_amp_call, ctx, bool(overflow_check))

    @functools.wraps(fn)
    def amp_fn(*args, **kwargs):
        # Flax NNX graph nodes among the arguments: their Variable updates are
        # carried out of the trace and written back to them (see _nnx.py).
        return _nnx.call(amp_call, fn, args, kwargs)

    return amp_fn


_CHOICES = frozenset(
    {"narrow_activations", "loop_casts", "loop_quantization", "checkpoint_amax"}
)
_BIND_STEPS = frozenset(name for name, _ in DEFAULT_PIPELINE.bind_steps)


def ablated(
    *,
    rewrites: Iterable[str] = (),
    facts: Iterable[str] = (),
    choices: Iterable[str] = (),
) -> Callable:
    """:func:`amp` with pattern rewrites, pattern facts or residual choices
    switched off, for ablations (what a rule or a rewrite is worth, measured
    side by side).

    Args:
        rewrites: names of pattern rewrites to leave out (``"attention"``,
            ``"rms_norm"``, ``"layer_norm"``).
        facts: pattern facts the analysis does not derive (``"rms_scaling"``:
            no equation is an RMSNorm scaling).
        choices: residual and loop choices not made
            (``"narrow_activations"``: a matmul of an activation and a held
            weight casts nothing early; ``"loop_casts"``: ``scan`` inputs are
            cast in the loop body, not once before it;
            ``"loop_quantization"``: stacked weights are quantized in the loop
            body, not once before it; ``"checkpoint_amax"``: a
            ``jax.checkpoint``'s recompute reduces its 8-bit operands' amaxes
            again instead of saving them) and bind steps skipped
            (``"derived_sums"``: derived broadcasts' sums in the compute dtype;
            ``"runnable_product"``: no XLA:CPU barrier; ``"overflow_check"``:
            no check even where ``overflow_check`` asks for one).

    Returns:
        A function with :func:`amp`'s signature.

    Raises:
        ValueError: for a name that is not a rewrite, a known fact or a known
            choice.
    """
    rewrites, facts, choices = map(frozenset, (rewrites, facts, choices))
    known = {r.name for r in DEFAULT_PIPELINE.rewrites}
    all_choices = _CHOICES | _BIND_STEPS
    if not (rewrites <= known and facts <= {"rms_scaling"} and choices <= all_choices):
        raise ValueError(
            f"ablated(rewrites={sorted(rewrites)}, facts={sorted(facts)}, "
            f"choices={sorted(choices)}): rewrites are {sorted(known)}, facts "
            f"['rms_scaling'], choices {sorted(all_choices)}."
        )
    base = DEFAULT_PIPELINE
    pipeline = dataclasses.replace(
        base,
        rewrites=tuple(r for r in base.rewrites if r.name not in rewrites),
        ignore_facts=base.ignore_facts | facts,
        off=base.off | choices,
    )

    def amp_ablated(
        fn: Callable | None = None,
        *,
        compute_dtype: Any = None,
        amp_policy: Mapping[Any, Rule] = default_amp_policy,
        overflow_check: bool | None = None,
        residual_dtype: Any = None,
    ) -> Callable:
        policy = _residuals.with_residual_dtype(amp_policy, residual_dtype)
        dtype = compute_dtype_or_default(compute_dtype)
        return amp_with(fn, dtype, policy, overflow_check, pipeline)

    return amp_ablated


def _amp_call(ctx: AmpContext, check: bool, fn: Callable, args, kwargs) -> Any:
    """Trace ``fn(*args, **kwargs)``, walk its jaxpr under ``ctx`` and return
    its outputs in the dtypes ``fn`` returns."""
    dynamic, static = eqx.partition((args, kwargs), eqx.is_array)
    leaves, treedef = jax.tree_util.tree_flatten(dynamic)
    out_tree = []

    def flat_fn(*flat):
        a, kw = eqx.combine(jax.tree_util.tree_unflatten(treedef, flat), static)
        out = fn(*a, **kw)
        out_dyn, out_static = eqx.partition(out, eqx.is_array)
        out_leaves, out_def = jax.tree_util.tree_flatten(out_dyn)
        out_tree.append((out_def, out_static))
        return out_leaves

    with contextlib.ExitStack() as stack:  # e.g. attention calls stay recognisable
        for rewrite in ctx.pipeline.rewrites:
            if rewrite.tracing is not None:
                stack.enter_context(rewrite.tracing())
        avals = [jax.typeof(x) for x in leaves]
        wide = [_widened(a) for a in avals]
        name = getattr(fn, "__name__", "amp")
        if wide != avals:
            # bfloat16/float16 arguments (low-precision parameters) are the
            # float32 values they hold: traced in float32, the policy keeps
            # statistics, softmax and the loss chain in float32 as with float32
            # parameters; the walk widens them only where a use reads them in
            # float32, so each argument's cotangent keeps its dtype.
            # The outputs keep the dtypes fn gives them on the real arguments
            # (a trace under standard promotion: where strict promotion traces,
            # both give the same dtypes; JAX's own bfloat16 attention does not).
            with jax.numpy_dtype_promotion("standard"):
                real = _compat.trace_to_closed_jaxpr(flat_fn, avals, name)
            out_avals = [v.aval for v in _compat.jaxpr_parts(real)[0].outvars]
            closed = _compat.trace_to_closed_jaxpr(flat_fn, wide, name)
        else:
            closed = _compat.trace_to_closed_jaxpr(flat_fn, avals, name)
            out_avals = [v.aval for v in _compat.jaxpr_parts(closed)[0].outvars]
    core, consts = _compat.jaxpr_parts(closed)
    with _overflow.checking(check), cast_cache(), jax.named_scope(AMP_REGION):
        # The arguments (parameters, batch) and closed-over values are held:
        # alive for the step, so casts of them are recomputed, not saved.
        held = [True] * len(leaves)
        # The outputs feed nothing in the function: no matmul, no softmax.
        edge = ((0,) * len(core.outvars), None)
        # Low-precision arguments enter the walk as they are: widened where a
        # use reads them in float32, read as they are by the compute-dtype
        # matmuls and by the loops that slice them (docs/design.md, "A
        # bfloat16-parameter step").
        narrow = [w != a for w, a in zip(wide, avals)]
        outs = eval_jaxpr(core, consts, leaves, ctx, held, True, edge, narrow)
        outs = [restore(x, a) for x, a in zip(outs, out_avals)]
    # A key the user wrote that matched nothing (a typo) warns.
    ctx.policy.warn_unmatched(getattr(fn, "__name__", "fn"))
    out_def, out_static = out_tree[0]
    return eqx.combine(jax.tree_util.tree_unflatten(out_def, outs), out_static)


def _widened(aval: Any) -> Any:
    """``aval`` with a float dtype narrower than float32 widened to float32."""
    dtype = getattr(aval, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        return aval
    if jnp.finfo(dtype).bits >= 32:
        return aval
    return aval.update(dtype=jnp.dtype(jnp.float32), weak_type=False)


@contextlib.contextmanager
def _amp_stop_scope():
    with jax.named_scope("amp_stop"):
        yield


def amp_stop(fn: Callable | None = None):
    """Keep a region in the dtypes it was traced with (no mixed precision).

    Usable as a context manager (``with jaxamp.amp_stop(): ...``) or as a
    decorator (``@jaxamp.amp_stop``). It opens the ``jax.named_scope``
    ``"amp_stop"``, which every policy maps to ``use_original_precision``; the
    scope is seen inside ``jit``/``scan``/... bodies too.

    Args:
        fn: the function to decorate, or None for the context manager form.

    Returns:
        The decorated function, or a context manager.
    """
    if fn is None:
        return _amp_stop_scope()
    if not callable(fn):
        raise TypeError(f"amp_stop(fn): fn must be callable, got {type(fn).__name__}.")

    @functools.wraps(fn)
    def stopped(*args, **kwargs):
        with _amp_stop_scope():
            return fn(*args, **kwargs)

    return stopped
