"""Every JAX-version branch and every private JAX import of jaxamp lives here.

Each item names the JAX version that made it necessary. Supported: JAX 0.10.x
(Python 3.11), 0.11.x and 0.12.x (Python 3.12).
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax

# Private: partial_eval has no public equivalent of trace_to_jaxpr_dynamic, which
# retraces a function over *exact* avals (weak types, shardings and shard_map's
# varying-manual-axes included); jax.make_jaxpr over ShapeDtypeStructs drops vma.
from jax._src import core as _core  # JAX 0.10 / 0.11: private
from jax._src import source_info_util as _siu  # JAX 0.10 / 0.11: private
from jax._src.interpreters import partial_eval as _pe  # JAX 0.10 / 0.11: private
from jax.extend import core as jex_core
from jax.extend import linear_util as lu

JAX_VERSION = tuple(int(p) for p in jax.__version__.split(".")[:3] if p.isdigit())

ClosedJaxpr = jex_core.ClosedJaxpr
Jaxpr = jex_core.Jaxpr
Literal = jex_core.Literal
Primitive = jex_core.Primitive


# JAX >= 0.11: ClosedJaxpr and Jaxpr are one class (a Jaxpr carries its consts).
MERGED_JAXPR = ClosedJaxpr is Jaxpr


def is_jaxpr(x: Any) -> bool:
    """True for a Jaxpr or ClosedJaxpr (a sub-jaxpr parameter)."""
    return isinstance(x, (Jaxpr, ClosedJaxpr))


def is_tracer(x: Any) -> bool:
    """True for a value being traced (a jit/grad tracer), not a concrete array
    or literal. JAX 0.10 / 0.11: ``core.Tracer``."""
    return isinstance(x, _core.Tracer)


def sub_jaxprs(params: dict):
    """The jaxprs among an equation's params (single or in tuples/lists)."""
    for val in params.values():
        for sub in val if isinstance(val, (tuple, list)) else (val,):
            if is_jaxpr(sub):
                yield sub


def jaxpr_parts(j: Any) -> tuple[Any, list]:
    """``(jaxpr with constvars/invars/outvars/eqns, consts)`` of a (closed) jaxpr."""
    if MERGED_JAXPR:  # JAX >= 0.11
        return j, list(j.consts)
    if isinstance(j, ClosedJaxpr):  # JAX 0.10
        return j.jaxpr, list(j.consts)
    return j, []


def like(orig: Any, new: Any) -> Any:
    """``new`` (a closed jaxpr) in the form of ``orig``: closed or open.

    Returns None when ``orig`` is an open jaxpr (JAX 0.10 ``remat2``/``shard_map``
    params) but ``new`` needs consts it cannot carry.
    """
    if MERGED_JAXPR:  # JAX >= 0.11
        return None if (new.consts and not orig.consts) else new
    if isinstance(orig, ClosedJaxpr):
        return new
    return None if new.consts else new.jaxpr


def bind_params(primitive: Primitive, params: dict) -> dict:
    """Bind parameters of an equation as one dict.

    JAX >= 0.9.2: ``get_bind_params`` returns a dict, with ``subfuns`` (if any)
    passed by keyword. Older JAX returned ``(subfuns, params)``; we fold the
    subfuns into the dict under ``"subfuns"`` so :func:`bind` can unfold them.
    """
    out = primitive.get_bind_params(params)
    if isinstance(out, tuple):  # JAX < 0.9.2
        subfuns, out = out
        out = dict(out)
        if subfuns:
            out["subfuns"] = tuple(subfuns)
    return out


def bind(primitive: Primitive, invals: Sequence[Any], params: dict) -> Any:
    """``primitive.bind`` with params as returned by :func:`bind_params`."""
    if JAX_VERSION < (0, 9, 2) and "subfuns" in params:  # JAX < 0.9.2
        params = dict(params)
        subfuns = params.pop("subfuns")
        return primitive.bind(*subfuns, *invals, **params)
    return primitive.bind(*invals, **params)


def eqn_context(eqn: Any, name_stack_prefix: Any = None):
    """Context that replays an equation's source info, name stack and eqn.ctx.

    Mirrors ``jax._src.core.eval_jaxpr`` (JAX 0.10): profiles and error messages
    keep pointing at user code.
    """
    ns = _siu.current_name_stack() + eqn.source_info.name_stack
    stack = contextlib.ExitStack()
    stack.enter_context(_siu.user_context(eqn.source_info.traceback, name_stack=ns))
    manager = getattr(getattr(eqn, "ctx", None), "manager", None)
    if manager is not None:
        stack.enter_context(manager)
    return stack


_TARGET: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "jaxamp_target_backend", default=None
)
# The device kind of the target (``Device.device_kind``), or None where the
# target names only a backend.
_TARGET_KIND: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "jaxamp_target_device_kind", default=None
)


@contextlib.contextmanager
def target_backend(name: str, device: Any = None):
    """Trace for backend ``name`` (``"gpu"``, ``"tpu"``, ``"cpu"``) instead of
    the default one: for a program compiled ahead of time for another device
    (an H100 or a TPU target compiled on a CPU, ``benchmarks/gpu_target.py``,
    ``benchmarks/tpu_target.py``), the choices that depend on the backend
    (:func:`bf16_slices_widen`, :func:`runnable_product`,
    :func:`cudnn_backend`) are that device's. ``device``: the target device
    (a compile-only topology's ``jax.Device``) or its ``device_kind`` string,
    for the choices that depend on the chip (:func:`target_device_kind`)."""
    kind = device if device is None or isinstance(device, str) else device.device_kind
    token, kind_token = _TARGET.set(name), _TARGET_KIND.set(kind)
    try:
        yield
    finally:
        _TARGET_KIND.reset(kind_token)
        _TARGET.reset(token)


def backend() -> str:
    """The backend jaxamp traces for: :func:`target_backend`'s, else JAX's
    default."""
    return _TARGET.get() or jax.default_backend()


def target_device_kind() -> str | None:
    """The ``device_kind`` of the device jaxamp traces for: the one given to
    :func:`target_backend`; None under a target backend named without a device
    (the chip is not known); else JAX's first default device's (``"TPU v5
    lite"``, ``"NVIDIA H100 80GB HBM3"``, ``"cpu"``)."""
    if _TARGET.get() is not None:
        return _TARGET_KIND.get()
    return jax.devices()[0].device_kind


def bf16_slices_widen() -> bool:
    """Whether the backend widens a bfloat16 ``dynamic_slice`` /
    ``dynamic_update_slice`` to float32 (XLA:CPU in jaxlib 0.10 / 0.11: its
    float normalization converts the whole operand, a float32 copy of a
    stacked buffer; GPUs and TPUs slice bfloat16 in place). Callers slice a
    uint16 view instead there."""
    return backend() == "cpu"


# XLA flags that not every supported jaxlib knows, with the last jaxlib minor
# that has each. XLA aborts the process at backend start on an unknown flag in
# XLA_FLAGS (and a compile raises on an unknown option), so a flag is set only
# where the installed XLA has it. jaxlib 0.11 removed XLA:CPU's older loop
# emitters, and with them --xla_cpu_use_fusion_emitters (checked: 0.10.2 knows
# it, 0.11.2 and 0.12.0 abort).
_XLA_FLAG_LAST_MINOR = {"xla_cpu_use_fusion_emitters": (0, 10)}


def _jaxlib_minor() -> tuple[int, int]:
    import jaxlib  # the XLA that reads the flags is jaxlib's, not jax's

    parts = jaxlib.__version__.split(".")
    return int(parts[0]), int(parts[1])


def xla_flag_known(flag: str) -> bool:
    """Whether the installed XLA knows ``flag`` (a name such as
    ``"xla_cpu_use_fusion_emitters"``, with or without ``--`` and ``=value``).

    Flags not listed in :data:`_XLA_FLAG_LAST_MINOR` are taken as known.
    """
    name = flag.lstrip("-").split("=", 1)[0]
    last = _XLA_FLAG_LAST_MINOR.get(name)
    return last is None or _jaxlib_minor() <= last


def known_xla_flags(flags: str) -> str:
    """``flags`` (an ``XLA_FLAGS``-style string) without the flags the installed
    XLA lacks (:func:`xla_flag_known`): safe to append to ``XLA_FLAGS``."""
    return " ".join(f for f in flags.split() if xla_flag_known(f))


# XLA:CPU debug options for a one-off analysis: LLVM at optimisation level 1
# and, where the jaxlib has them (<= 0.10), the older loop emitters instead of
# the MLIR fusion emitters. A module of many small kernels (the precision
# report's analysis) compiles several percent faster and runs as fast; at
# level 0 it runs slower than the compile saves. Other backends ignore them.
_FAST_COMPILE_CPU = {
    "xla_cpu_use_fusion_emitters": False,
    "xla_backend_optimization_level": 1,
}


def compile_analysis(lowered: Any) -> Any:
    """``lowered.compile()`` for a one-off analysis: on XLA:CPU with those of
    :data:`_FAST_COMPILE_CPU` that this XLA knows and ``XLA_FLAGS`` does not
    set, falling back to the default options if the compile refuses them (a
    real compile error raises from the fallback)."""
    if jax.default_backend() == "cpu":
        # Options set in XLA_FLAGS (the tests' level 0, a user's) win.
        flags = os.environ.get("XLA_FLAGS", "")
        opts = {
            k: v
            for k, v in _FAST_COMPILE_CPU.items()
            if f"--{k}=" not in flags and xla_flag_known(k)
        }
        if opts:
            try:
                return lowered.compile(opts)
            except Exception:  # noqa: BLE001 - an option this XLA refuses
                pass
    return lowered.compile()


def runnable_product(
    prim: Any, invals: Sequence[Any], params: dict, outs: Any, transposed: bool
) -> Any:
    """``outs`` of a bound product, made safe to run on this backend.

    XLA:CPU (jaxlib 0.10.2) fails at run time on a bfloat16 x bfloat16 ->
    float32 ``dot_general`` into which it folds the transpose of its result
    (``Unsupported element type for DotThunk::Execute: BF16 x BF16 = F32``):
    the logits of a ``jax.vmap``-ed ``eqx.nn.Linear`` are one. An
    ``optimization_barrier`` on such a result keeps the transpose out of the
    dot; the values are unchanged. Only a result the value facts mark
    ``transposed`` gets one (a barrier costs fusions); other backends, dtypes
    and primitives get ``outs`` as they are.
    """
    if not transposed or prim.name != "dot_general":
        return outs
    if backend() != "cpu":
        return outs
    out_dtype = params.get("preferred_element_type")
    if out_dtype is None or jax.numpy.dtype(out_dtype).itemsize <= 2:
        return outs
    bf16 = jax.numpy.dtype(jax.numpy.bfloat16)
    if not all(getattr(x, "dtype", None) == bf16 for x in invals):
        return outs
    return jax.lax.optimization_barrier(outs)


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def source_line(eqn: Any) -> str:
    """``"file.py:LINE:COL (function)"`` of the user code behind an equation:
    the innermost frame outside JAX and jaxamp (an equation jaxamp emits for
    the user's call, e.g. re-dispatched attention, names that call). JAX 0.10
    / 0.11: only the private source_info_util walks and summarises frames."""
    tb = eqn.source_info.traceback
    for frame in _siu.user_frames(tb):
        if not frame.file_name.startswith(_PACKAGE_DIR):
            line, col = frame.start_line, frame.start_column
            where = f"{line}:{col}" if col else f"{line}"
            return f"{frame.file_name}:{where} ({frame.function_name})"
    return _siu.summarize(eqn.source_info)


# The name-stack component JAX 0.10 to 0.12 gives the body of a jax.checkpoint
# when it is differentiated or partially evaluated (jax/_src/ad_checkpoint.py);
# _base/_scopes.py leaves it out of every scope path.
REMAT_BODY_SCOPE = "rematted_computation"


def scope_names(eqn: Any) -> tuple[str, ...]:
    """The ``jax.named_scope`` components on an equation's name stack, outermost
    first. Transform markers (``jvp(...)``, ``transpose(...)``) are skipped."""
    stack = getattr(eqn.source_info.name_stack, "stack", ())
    out = []
    for item in stack:
        name = getattr(item, "name", None)
        if name is not None and type(item).__name__ == "Scope":
            out.extend(p for p in str(name).split("/") if p)
    return tuple(out)


def trace_to_closed_jaxpr(
    fn: Callable, in_avals: Sequence[Any], name: str = "jaxamp"
) -> ClosedJaxpr:
    """Trace ``fn(*args)`` (flat list in, flat list out) over exact ``in_avals``.

    Uses the current trace context (axis env, abstract mesh), so collectives
    with ``vmap``/``shard_map`` axis names stay valid.
    """
    dbg = _debug_info(name, fn, len(in_avals))
    wrapped = lu.wrap_init(fn, debug_info=dbg)
    jaxpr, _, consts = _pe.trace_to_jaxpr_dynamic(wrapped, list(in_avals))
    return ClosedJaxpr(jaxpr, consts)


def used_inputs(jaxpr: Any) -> list[bool]:
    """Per input of the open ``jaxpr``: whether any of its outputs depends on
    it (after dead-code elimination). JAX 0.10 / 0.11: ``dce_jaxpr`` is
    private (``partial_eval``), same signature in both."""
    _, used = _pe.dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars))
    return list(used)


def dce(jaxpr: Any, used_outputs: Sequence[bool]) -> tuple[Any, list[bool]]:
    """``(open jaxpr computing only the used outputs, used inputs)``. JAX 0.10
    / 0.11: ``dce_jaxpr`` is private (``partial_eval``); the returned jaxpr
    keeps every input (``instantiate=True``)."""
    new, _ = _pe.dce_jaxpr(jaxpr, list(used_outputs), instantiate=True)
    return new, used_inputs(new)


def _debug_info(name: str, fn: Callable, nargs: int):
    # JAX >= 0.5: DebugInfo(traced_for, func_src_info, arg_names, result_paths).
    return jex_core.DebugInfo(
        name,
        getattr(fn, "__name__", name),
        tuple(f"x{i}" for i in range(nargs)),
        None,
    )


def wrap_fun(fn: Callable, like: Any) -> Any:
    """A ``lu.WrappedFun`` of ``fn`` carrying the debug info of ``like``."""
    return lu.wrap_init(fn, debug_info=like.debug_info)


def shard_map_context(params: dict):
    """The context ``shard_map`` traces its body in: axis env of the manual mesh
    axes, the manual abstract mesh, and the check_vma flag.

    Mirrors ``jax._src.shard_map._shard_map_staging`` (JAX 0.10).
    """
    from jax._src import config as _config  # JAX 0.10 / 0.11: private
    from jax._src.mesh import use_abstract_mesh  # JAX 0.10 / 0.11: private

    mesh = params["mesh"]
    newly = params.get("newly_manual_axes", frozenset(mesh.axis_names))
    manual = set(newly) | set(getattr(mesh, "manual_axes", ()))
    stack = contextlib.ExitStack()
    stack.enter_context(
        _core.extend_axis_env_nd([(k, v) for k, v in mesh.shape.items() if k in manual])
    )
    from jax.sharding import AxisType

    inner = mesh.abstract_mesh.update_axis_types({n: AxisType.Manual for n in newly})
    stack.enter_context(use_abstract_mesh(inner))
    if "check_vma" in params:
        stack.enter_context(_config._check_vma(params["check_vma"]))
    return stack


def convert(x: Any, dtype: Any, weak_type: bool = False) -> Any:
    """``lax.convert_element_type`` that can also produce a weak-typed result
    (needed to give a sub-jaxpr output exactly its declared aval)."""
    if not weak_type:
        return jax.lax.convert_element_type(x, dtype)
    from jax._src.lax import lax as _lax  # JAX 0.10 / 0.11: private

    return _lax._convert_element_type(x, dtype, weak_type=True)


def scan_carry_range(params: dict) -> tuple[int, int]:
    """``(num_consts, num_carry)`` of a ``scan`` equation.

    JAX 0.10: explicit ``num_consts``/``num_carry`` params. JAX >= 0.11: a
    flat-tree tuple ``ft_in`` of (consts, carry, xs).
    """
    if "num_carry" in params:  # JAX <= 0.10
        return params["num_consts"], params["num_carry"]
    ft_in = params["ft_in"]  # JAX >= 0.11
    consts, carry, _ = ft_in.update(list(range(len(ft_in)))).unpack()
    return len(list(consts)), len(list(carry))


def scan_params_with_inputs(params: dict, consts: int, xs: int) -> dict:
    """A ``scan`` equation's params for ``consts`` more consts after its own
    consts and ``xs`` more xs after its own xs.

    JAX 0.10: ``num_consts`` counts the consts. JAX >= 0.11: the flat-tree
    tuple ``ft_in`` (consts, carry, xs) gets the leaves
    (``jax._src.flattree``, private).
    """
    if "num_carry" in params:  # JAX <= 0.10
        return {**params, "num_consts": params["num_consts"] + consts}
    from jax._src import flattree  # JAX >= 0.11, private

    def more(tree, k):
        leaves = (flattree.FTSingleton(None) for _ in range(k))
        return flattree.FTTuple(tree, flattree.FTTuple(*leaves)) if k else tree

    c, carry, x = params["ft_in"].elts
    return {**params, "ft_in": flattree.FTTuple(more(c, consts), carry, more(x, xs))}


def saved_residuals(fn: Callable, *args: Any, **kwargs: Any) -> list:
    """``[(aval, source description)]`` of the residuals the backward pass of
    ``fn`` saves. JAX 0.10 / 0.11: only ``print_saved_residuals`` is public."""
    from jax._src.ad_checkpoint import saved_residuals as _saved  # private

    return _saved(fn, *args, **kwargs)


def dot_general_transpose_lhs(
    g: Any, lhs: Any, rhs: Any, dimension_numbers, out_dtype: Any = None
) -> Any:
    """Cotangent of a ``dot_general``'s lhs for cotangent ``g``, the product's
    result in ``out_dtype`` (default float32).

    JAX 0.10 to 0.12: lax's transpose rules are private; same signature in all.
    """
    from jax._src.lax import lax as _lax  # private

    return _lax._dot_general_transpose_lhs(
        g,
        _Typed(lhs, out_dtype),
        rhs,
        dimension_numbers=dimension_numbers,
        precision=None,
        preferred_element_type=out_dtype or jax.numpy.float32,
        out_sharding=None,
    )


def dot_general_transpose_rhs(
    g: Any, lhs: Any, rhs: Any, dimension_numbers, out_dtype: Any = None
) -> Any:
    """Cotangent of a ``dot_general``'s rhs (result in ``out_dtype``, default
    float32); see above."""
    from jax._src.lax import lax as _lax  # private

    return _lax._dot_general_transpose_rhs(
        g,
        lhs,
        _Typed(rhs, out_dtype),
        dimension_numbers=dimension_numbers,
        precision=None,
        preferred_element_type=out_dtype or jax.numpy.float32,
        out_sharding=None,
    )


class _Typed:
    """Stands in for the undefined primal of a transpose rule: its aval in
    ``dtype`` (the rule casts its result to that dtype)."""

    def __init__(self, x: Any, dtype: Any = None):
        self.aval = jax.typeof(x).update(dtype=dtype or jax.numpy.float32)


def nn_functions_module() -> Any:
    """The module whose globals ``jax.nn.dot_product_attention`` dispatches to
    (``_dot_product_attention_xla``, ``cudnn_dot_product_attention``), looked up
    at call time. JAX 0.10 / 0.11: private, ``jax._src.nn.functions``."""
    from jax._src.nn import functions  # JAX 0.10 / 0.11: private

    return functions


def cudnn_mask_is_causal(mask_type: Any) -> bool:
    """Whether a cuDNN ``MaskType`` is causal (``CAUSAL``/``PADDING_CAUSAL``).
    JAX 0.10 / 0.11: ``jax._src.cudnn.fused_attention_stablehlo.MaskType``."""
    return mask_type is not None and "CAUSAL" in getattr(mask_type, "name", "")


def cudnn_backend() -> bool:
    """True when the default backend is an NVIDIA GPU (cuDNN's fused attention
    can run). JAX 0.10 / 0.11: the CUDA plugin reports ``platform == "gpu"``
    and a ``platform_version`` naming CUDA; ROCm's names ``rocm``."""
    if backend() != "gpu":
        return False
    if _TARGET.get() == "gpu":  # compiled ahead of time for a CUDA target
        return True
    try:
        from jax.extend.backend import get_backend

        return "cuda" in get_backend().platform_version.lower()
    except Exception:  # an unusual plugin: let JAX's own checks decide
        return True


def user_frame(eqn: Any) -> str:
    """``file:line (function)`` of the user code that traced ``eqn`` (for
    messages). JAX 0.10 / 0.11: ``source_info_util.summarize`` is private."""
    try:
        return _siu.summarize(eqn.source_info)
    except Exception:
        return ""


def _attention_state() -> Any:
    """A thread-local JAX config state that is part of JAX's trace and jit cache
    keys: set while amp traces the user's function, so a function traced with
    attention interception (``jaxamp._rewrites._attention``) is never served from, or
    into, JAX's caches for code traced without it (a jitted or scanned layer
    traced outside amp first would otherwise reach amp unrecognisable).
    JAX 0.10 / 0.11: ``jax._src.config.bool_state`` is private."""
    from jax._src import config as _config  # JAX 0.10 / 0.11: private

    name = "jaxamp_attention_intercept"
    existing = getattr(_config, "config_states", {}).get(name)
    if existing is not None:  # module reloaded
        return existing
    return _config.bool_state(
        name,
        False,
        help="jaxamp: jax.nn.dot_product_attention is being intercepted.",
        include_in_jit_key=True,
        include_in_trace_context=True,
    )


ATTENTION_INTERCEPT = _attention_state()


# the JAX minor versions the project is tested on
TESTED_JAX = ((0, 10), (0, 11), (0, 12))


def warn_untested_jax(version: str | None = None) -> bool:
    """Warn once (``UserWarning``) when JAX is newer than :data:`TESTED_JAX`:
    jaxamp reads JAX's jaxprs and private internals, which change between
    minor versions. Returns whether it warned.

    Args:
        version: a JAX version string; None: the installed one.
    """
    version = version or jax.__version__
    parts = version.split(".")
    try:
        minor = (int(parts[0]), int(parts[1]))
    except (IndexError, ValueError):
        return False
    if minor <= max(TESTED_JAX):
        return False
    lo, hi = TESTED_JAX[0], TESTED_JAX[-1]
    warnings.warn(
        f"jaxamp is tested with JAX {lo[0]}.{lo[1]} to {hi[0]}.{hi[1]}; JAX "
        f"{version} is newer. If amp "
        "fails or a jaxpr looks wrong, report it with the JAX version at "
        "https://github.com/jaxamp/jaxamp/issues.",
        UserWarning,
        stacklevel=3,
    )
    return True
