"""Adafactor with per-matrix statistics for weights stacked on a layers axis,
the form ``update_in_backward`` can apply one layer at a time."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax


def _matrix_axes(ndim: int) -> tuple[int, ...]:
    """The axes one matrix spans: the last two of a leaf with three or more
    (the leading ones stack layers), every axis of a smaller one."""
    return tuple(range(ndim - 2, ndim)) if ndim >= 3 else tuple(range(ndim))


def _rms(x: jax.Array) -> jax.Array:
    """Root mean square of each matrix of ``x`` (:func:`_matrix_axes`), with
    its axes kept for broadcasting."""
    return jnp.sqrt(jnp.mean(jnp.square(x), axis=_matrix_axes(x.ndim), keepdims=True))


def clip_by_matrix_rms(threshold: float) -> optax.GradientTransformation:
    """``optax.clip_by_block_rms`` with one block per matrix: each matrix of a
    leaf (:func:`_matrix_axes`) divided by ``max(1, rms / threshold)``."""

    def update(updates, state, params=None):
        del params
        return (
            jax.tree.map(lambda u: u / jnp.maximum(1.0, _rms(u) / threshold), updates),
            state,
        )

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def scale_by_matrix_rms(min_scale: float = 1e-3) -> optax.GradientTransformation:
    """``optax.scale_by_param_block_rms`` with one block per matrix: each
    matrix's update times ``max(min_scale, rms(parameter matrix))``."""

    def update(updates, state, params=None):
        if params is None:
            raise ValueError(
                "scale_by_matrix_rms: update needs params "
                "(call tx.update(grads, opt_state, params))."
            )
        return (
            jax.tree.map(
                lambda u, p: u * jnp.maximum(min_scale, _rms(p)), updates, params
            ),
            state,
        )

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def layerwise_adafactor(
    learning_rate: Any,
    *,
    momentum: float | None = None,
    decay_rate: float = 0.8,
    clipping_threshold: float | None = 1.0,
    multiply_by_parameter_scale: bool = False,
    weight_decay: float | None = None,
    weight_decay_mask: Any = None,
    min_dim_size_to_factor: int = 128,
    eps: float = 1e-30,
) -> optax.GradientTransformation:
    """Adafactor (Shazeer & Stern 2018, arXiv 1804.04235) whose every step is
    per matrix, for weights stacked on a leading layers axis (``lax.scan``).

    The factored second moment is optax's ``scale_by_factored_rms``: for a
    leaf ``(layers, rows, cols)`` it keeps a row statistic ``(layers, rows)``
    and a column statistic ``(layers, cols)``, already one pair per layer.
    ``optax.adafactor`` then clips the update by its RMS over the whole leaf
    (``clip_by_block_rms``) and scales the step by the parameter's RMS over the
    whole leaf (``scale_by_param_block_rms``): across layers, so a stacked
    leaf's update needs every layer's gradient first, and a scanned model
    trains differently from the same model with one leaf per layer. Here
    both are taken per matrix (:func:`clip_by_matrix_rms`,
    :func:`scale_by_matrix_rms`): the last two axes of a leaf with three or
    more, the whole of a smaller leaf. So each layer's update reads only that
    layer, and :func:`jaxamp.update_in_backward` applies it inside the
    transposed loop; on a leaf of one or two axes this is ``optax.adafactor``
    with the same arguments (a stacked bias or norm gain, ``(layers, d)``, is
    one block: updated after the backward pass, its gradient is small).

    The second moment of a ``rows x cols`` matrix costs ``4 (rows + cols)``
    bytes in float32 (about 0.005 bytes per parameter at width 1024): with
    ``momentum=None`` (the default, as AdaLomo, Lv et al. 2023, arXiv
    2310.10195) the state is nearly free; a ``momentum`` adds an exponential
    moving average of the updates (optax's ``ema``, no debiasing), stored as
    :func:`jaxamp.low_precision_optimizer` says (int8: 1 byte per parameter).

    Args:
        learning_rate: a float or an optax schedule (the step size, not
            relative to the parameter's scale unless
            ``multiply_by_parameter_scale``).
        momentum: the first moment's decay, or None (no first moment).
        decay_rate: the second moment's decay exponent (``1 - t**-decay_rate``
            at step ``t``).
        clipping_threshold: the largest RMS of a matrix's update, or None.
        multiply_by_parameter_scale: scale each matrix's step by its RMS
            (at least 1e-3), as ``optax.adafactor`` does by default.
        weight_decay: ``weight_decay * p`` added to the step after the
            learning rate (``optax.adafactor``'s ``weight_decay_rate``: not
            scaled by the learning rate), or None.
        weight_decay_mask: optax's mask of the leaves to decay.
        min_dim_size_to_factor: a matrix is factored when its two largest
            axes are at least this long (else a full second moment). optax
            factors a leaf's two largest axes: a stack of more layers than a
            matrix's shorter side is factored across layers, and updated after
            the backward pass.
        eps: added to the squared gradient.

    Returns:
        An optax ``GradientTransformation`` (``FactoredState``, then ``EmaState``).
    """
    tx = [
        optax.scale_by_factored_rms(
            decay_rate=decay_rate,
            min_dim_size_to_factor=min_dim_size_to_factor,
            epsilon=eps,
        )
    ]
    if clipping_threshold is not None:
        tx.append(clip_by_matrix_rms(clipping_threshold))
    tx.append(optax.scale_by_learning_rate(learning_rate, flip_sign=False))
    if multiply_by_parameter_scale:
        tx.append(scale_by_matrix_rms())
    if momentum is not None:
        tx.append(optax.ema(momentum, debias=False))
    if weight_decay is not None:
        tx.append(optax.add_decayed_weights(weight_decay, weight_decay_mask))
    tx.append(optax.scale(-1.0))
    return optax.chain(*tx)
