"""Interception of ``jax.nn.dot_product_attention`` while amp traces.

While :func:`intercept` is active (in this thread), a call on float32 (or
wider) q/k/v is emitted as one ``jit`` equation named
``jaxamp_attention__<n>`` whose body is JAX's own XLA path; ``<n>`` indexes the
call's static parameters (:class:`Spec`). Left in place (``amp_stop`` regions,
a jit cache reused outside amp) it computes exactly what the XLA path computes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any

import jax

from ... import _compat
from ..._base._dtypes import is_float
from ..._base._structure import plain_call

_MARK = "jaxamp_attention__"


@dataclasses.dataclass(frozen=True)
class Spec:
    """Static parameters of one intercepted ``dot_product_attention`` call."""

    requested: str | None  # "cudnn" or None (None and "xla" both reach the XLA path)
    is_causal: bool
    scale: float
    local_window_size: tuple[int, int] | None
    has_bias: bool
    has_mask: bool
    has_q_seqlen: bool
    has_kv_seqlen: bool
    where: str = "dot_product_attention"  # the user's call site, for messages


_SPECS: list[Spec] = []
_SPEC_INDEX: dict[Spec, int] = {}
# Thread-local, and part of JAX's trace/jit cache keys (see _compat).
_INTERCEPTING = _compat.ATTENTION_INTERCEPT
_ORIGINALS: dict[str, Any] = {}


@contextlib.contextmanager
def intercept():
    """While active (in this thread/context), ``jax.nn.dot_product_attention``
    on float32 q/k/v is emitted as one recognisable equation (module doc)."""
    _install()
    with _INTERCEPTING(True):
        yield


@contextlib.contextmanager
def not_intercepting():
    """Within it, ``jax.nn.dot_product_attention`` runs as JAX writes it (the
    kernels re-dispatching a marked call must not be marked again)."""
    with _INTERCEPTING(False):
        yield


def _install() -> None:
    """Wrap the two functions JAX's ``dot_product_attention`` dispatches to.

    Installed once; the wrappers call the originals unless :func:`intercept` is
    active in the calling context, so other threads and code outside amp see
    JAX unchanged.
    """
    if _ORIGINALS:
        return
    mod = _compat.nn_functions_module()
    _ORIGINALS["xla"] = xla = mod._dot_product_attention_xla
    _ORIGINALS["cudnn"] = cudnn = mod.cudnn_dot_product_attention

    xla_wrapper = _xla_wrapper(xla)
    cudnn_wrapper = _cudnn_wrapper(cudnn)
    mod._dot_product_attention_xla = xla_wrapper
    mod.cudnn_dot_product_attention = cudnn_wrapper


def _xla_wrapper(xla: Any) -> Any:
    """JAX's XLA-path attention, emitting a marked equation while intercepting."""

    @functools.wraps(xla)
    def xla_wrapper(
        query,
        key,
        value,
        bias,
        mask,
        is_causal,
        scale,
        q_seqlen,
        kv_seqlen,
        local_window_size,
        return_residual=False,
    ):
        if not _INTERCEPTING.value or return_residual or not _wide(query, key, value):
            return xla(
                query,
                key,
                value,
                bias,
                mask,
                is_causal,
                scale,
                q_seqlen,
                kv_seqlen,
                local_window_size,
                return_residual,
            )
        spec = Spec(
            None,
            bool(is_causal),
            float(scale),
            _window(local_window_size),
            bias is not None,
            mask is not None,
            q_seqlen is not None,
            kv_seqlen is not None,
            _call_site(),
        )
        return _emit(spec, query, key, value, bias, mask, q_seqlen, kv_seqlen)

    return xla_wrapper


def _cudnn_wrapper(cudnn: Any) -> Any:
    """JAX's cuDNN attention, emitting a marked equation while intercepting."""

    @functools.wraps(cudnn)
    def cudnn_wrapper(
        query,
        key,
        value,
        bias=None,
        mask=None,
        q_seqlen=None,
        kv_seqlen=None,
        *args,
        **kwargs,
    ):
        plain = not args and set(kwargs) <= {
            "scale",
            "mask_type",
            "sliding_window_length",
            "return_residual",
        }
        if (
            not _INTERCEPTING.value
            or not plain
            or kwargs.get("return_residual", False)
            or not _wide(query, key, value)
        ):
            return cudnn(
                query, key, value, bias, mask, q_seqlen, kv_seqlen, *args, **kwargs
            )
        causal = _compat.cudnn_mask_is_causal(kwargs.get("mask_type"))
        sw = kwargs.get("sliding_window_length")
        spec = Spec(
            "cudnn",
            causal,
            float(kwargs.get("scale", 1.0)),
            None if sw is None else (int(sw) - 1, 0),
            bias is not None,
            mask is not None,
            q_seqlen is not None,
            kv_seqlen is not None,
            _call_site(),
        )
        return _emit(spec, query, key, value, bias, mask, q_seqlen, kv_seqlen)

    return cudnn_wrapper


def _call_site() -> str:
    """``dot_product_attention at file:line`` of the first frame outside JAX and
    jaxamp (the model's call)."""
    import os
    import traceback

    jaxamp_dir = os.path.dirname(os.path.dirname(__file__))
    skip = (os.path.dirname(jax.__file__), jaxamp_dir)
    for frame in reversed(traceback.extract_stack()):
        if not frame.filename.startswith(skip):
            return f"dot_product_attention at {frame.filename}:{frame.lineno}"
    return "dot_product_attention"


def _window(w: Any) -> tuple[int, int] | None:
    return None if w is None else (int(w[0]), int(w[1]))


def _wide(*xs: Any) -> bool:
    """q/k/v are floats wider than 16 bits: amp may narrow them."""
    return all(is_float(x.dtype) and x.dtype.itemsize > 2 for x in xs)


def _spec_index(spec: Spec) -> int:
    idx = _SPEC_INDEX.get(spec)
    if idx is None:
        idx = _SPEC_INDEX[spec] = len(_SPECS)
        _SPECS.append(spec)
    return idx


@functools.cache
def _marked_fn(idx: int):
    """A jitted XLA-path attention named ``jaxamp_attention__<idx>``."""
    spec = _SPECS[idx]

    def body(*arrays):
        q, k, v, bias, mask, qs, kvs = unpack(spec, arrays)
        return _ORIGINALS["xla"](
            q,
            k,
            v,
            bias,
            mask,
            spec.is_causal,
            spec.scale,
            qs,
            kvs,
            spec.local_window_size,
        )

    body.__name__ = body.__qualname__ = f"{_MARK}{idx}"
    return jax.jit(body)


def _emit(spec: Spec, q, k, v, bias, mask, q_seqlen, kv_seqlen):
    arrays = [a for a in (q, k, v, bias, mask, q_seqlen, kv_seqlen) if a is not None]
    return _marked_fn(_spec_index(spec))(*arrays)


def unpack(spec: Spec, arrays) -> tuple:
    """``(q, k, v, bias, mask, q_seqlen, kv_seqlen)`` from a marked call's
    operands, None for the optional ones ``spec`` says it was not given."""
    it = iter(arrays)
    q, k, v = next(it), next(it), next(it)
    flags = (spec.has_bias, spec.has_mask, spec.has_q_seqlen, spec.has_kv_seqlen)
    rest = [next(it) if f else None for f in flags]
    return (q, k, v, *rest)


def marked_spec(eqn: Any) -> Spec | None:
    """The :class:`Spec` of an intercepted ``dot_product_attention`` call
    (a ``jit`` equation, a plain call of the higher-order registry, carrying
    the mark in its name), or None."""
    name = str(eqn.params.get("name", ""))
    if not name.startswith(_MARK) or plain_call(eqn) is None:
        return None
    try:
        spec = _SPECS[int(name[len(_MARK) :])]
    except (ValueError, IndexError):
        return None
    # A marked jit that a transformation re-wrote keeps the name but not the
    # signature (partial evaluation, DCE, e.g. amp around value_and_grad): such
    # an equation is an ordinary jit, walked by the ordinary rules.
    flags = (spec.has_bias, spec.has_mask, spec.has_q_seqlen, spec.has_kv_seqlen)
    if len(eqn.invars) != 3 + sum(flags) or len(eqn.outvars) != 1:
        return None
    return spec
