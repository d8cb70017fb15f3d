"""``memory_report``: where a training step's bytes go.

The memory twin of :func:`jaxamp.precision_report`. The saved residuals are
found as JAX finds them (``jax.ad_checkpoint.print_saved_residuals``: the
values ``jax.vjp``'s backward function holds, each counted once, arguments
apart), and each is traced back through ``scan``, ``jit``, ``checkpoint`` and
custom-derivative bodies to the equation that made it: its ``named_scope``
path, primitive and stored dtype, with the user's source line. The compiled
step's argument, output and temp bytes come from XLA's
``memory_analysis()`` of ``jax.jit(jax.value_and_grad(fn))``.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Mapping
from typing import Any

import equinox as eqx
import jax
import numpy as np

from .. import _compat
from .._amp import AMP_DEFAULT, amp, compute_dtype_or_default
from .._base._formats import name_of
from .._base._scopes import eqn_scopes, scope_path
from .._base._structure import plain_call
from .._policy._checkpoint import SavedChoice, recording
from .._policy._compressed import RESIDUAL_SCOPE
from .._policy._rules import default_amp_policy


@dataclasses.dataclass(frozen=True)
class MemoryRow:
    """Saved residuals of one kind: same scope path, primitive, stored dtype
    and source line.

    Attributes:
        scope: the user's ``named_scope`` path (``""`` for none).
        primitive: the primitive that made the value (inside ``scan``, ``jit``
            and ``checkpoint`` bodies; ``"argument"`` never appears: arguments
            are alive anyway and not counted).
        dtype: the stored dtype's name (``"float8_e4m3fn"``, ``"bfloat16"``;
            an 8-bit format added by :func:`jaxamp.extend.register_format` by its
            name).
        shape: the shape of one of them (with a stacked ``scan`` axis).
        count: how many such arrays are saved.
        bytes: their total bytes.
        source: ``file:line (function)`` of the user code behind it.
    """

    scope: str
    primitive: str
    dtype: str
    shape: tuple
    count: int
    bytes: int
    source: str


def _producers(jaxpr: Any) -> dict:
    return {v: e for e in jaxpr.eqns for v in e.outvars}


def _origin(eqn: Any, k: int, scopes: tuple, where: Any = None) -> tuple:
    """``(equation, scopes, source equation)`` of output ``k`` of ``eqn``:
    the equation that computes it, followed into the one sub-jaxpr with as
    many outputs (``scan``, ``jit``, ``checkpoint``, custom derivatives), the
    scopes on the way, and the equation whose source line names it: inside a
    ``jit`` body the ``jit`` call itself (JAX reuses a traced ``jit`` body,
    with the source lines of its first caller)."""
    scopes = eqn_scopes(scopes, eqn)
    where = eqn if where is None else where
    subs = [
        s
        for s in _compat.sub_jaxprs(eqn.params)
        if len(_compat.jaxpr_parts(s)[0].outvars) == len(eqn.outvars)
    ]
    if len(subs) != 1:
        return eqn, scopes, where
    core, _ = _compat.jaxpr_parts(subs[0])
    inner = _producers(core).get(core.outvars[k])
    if inner is None:  # forwarded from the body's inputs
        return eqn, scopes, where
    frozen = plain_call(eqn) is not None or where is not eqn
    return _origin(
        inner,
        inner.outvars.index(core.outvars[k]),
        scopes,
        where if frozen else None,
    )


def saved_rows(fn: Callable, *args: Any, **kwargs: Any) -> list[MemoryRow]:
    """The residuals ``jax.grad(fn)`` saves, as :class:`MemoryRow` s, largest
    first (arguments of ``fn`` excluded, literals and constants included)."""
    leaves, tree = jax.tree_util.tree_flatten((args, kwargs))

    def flat(*xs):
        a, kw = jax.tree_util.tree_unflatten(tree, xs)
        return fn(*a, **kw)

    closed, shape = jax.make_jaxpr(lambda *xs: jax.vjp(flat, *xs), return_shape=True)(
        *leaves
    )
    core = closed.jaxpr
    n_res = len(jax.tree_util.tree_leaves(shape[1]))
    outs = core.outvars[len(core.outvars) - n_res :]
    made = _producers(core)
    # reduce_precision is looked through, as JAX's own listing does.
    subst = {
        e.outvars[0]: e.invars[0]
        for e in core.eqns
        if e.primitive.name == "reduce_precision"
    }
    found, seen = {}, set()
    for v in outs:
        literal = isinstance(v, _compat.Literal)
        if not literal:
            v = subst.get(v, v)
            if v in seen or v in core.invars:
                continue
            seen.add(v)
        aval = v.aval
        eqn = None if literal else made.get(v)
        if eqn is None:
            key = ("", "constant", name_of(aval.dtype), "")
        else:
            origin, scopes, where = _origin(eqn, eqn.outvars.index(v), ())
            # An 8-bit copy made for amp's residual_dtype (_policy/_compressed.py)
            name = "encode" if RESIDUAL_SCOPE in scopes else origin.primitive.name
            key = (
                scope_path(scopes),
                name,
                name_of(aval.dtype),  # a registered 8-bit format's name
                _compat.source_line(where),
            )
        size = int(np.prod(aval.shape)) * np.dtype(aval.dtype).itemsize
        count, total, shp = found.get(key, (0, 0, tuple(aval.shape)))
        found[key] = (count + 1, total + size, shp)
    rows = [
        MemoryRow(scope, prim, dtype, shp, n, size, src)
        for (scope, prim, dtype, src), (n, size, shp) in found.items()
    ]
    return sorted(rows, key=lambda r: -r.bytes)


def _tree_bytes(tree: Any) -> int:
    return sum(
        int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
        for x in jax.tree_util.tree_leaves(tree)
        if hasattr(x, "dtype") and hasattr(x, "shape")
    )


@dataclasses.dataclass
class MemoryReport:
    """Where one step's bytes go (see :func:`jaxamp.memory_report`).

    Attributes:
        rows: the saved residuals by scope path, primitive, stored dtype and
            source line (:class:`MemoryRow`), largest first.
        argument_bytes: bytes of the step's arguments (parameters, batch).
        compiled: XLA's ``memory_analysis()`` of the jitted
            ``value_and_grad``: ``argument``, ``output``, ``alias`` and
            ``temp`` bytes (empty where the backend gives none).
        settings: the compute dtype, residual dtype and policy used.
        checkpoints: with a residual dtype, each value a ``jax.checkpoint``
            saves (its inputs, what its policy names) with the dtype it is
            stored in and the rule that chose it
            (``jaxamp._policy._checkpoint.SavedChoice``: ``scopes``,
            ``value``, ``shape``, ``dtype``, ``rule``, ``source``).
    """

    rows: list[MemoryRow]
    argument_bytes: int
    compiled: dict[str, int]
    settings: dict[str, str]
    checkpoints: list[SavedChoice] = dataclasses.field(default_factory=list)

    @property
    def residual_bytes(self) -> int:
        """Total bytes of the saved residuals (arguments excluded)."""
        return int(sum(r.bytes for r in self.rows))

    @property
    def temp_bytes(self) -> int | None:
        """The compiled step's temp bytes (None where unknown)."""
        return self.compiled.get("temp")

    def by(self, field: str) -> dict[str, int]:
        """Residual bytes summed per ``"scope"``, ``"primitive"`` or
        ``"dtype"``, largest first.

        Raises:
            ValueError: for another ``field``.
        """
        if field not in ("scope", "primitive", "dtype"):
            raise ValueError(
                f"MemoryReport.by(field={field!r}): one of 'scope', 'primitive', "
                "'dtype'."
            )
        out: dict[str, int] = {}
        for r in self.rows:
            key = getattr(r, field) or "(no scope)"
            out[key] = out.get(key, 0) + r.bytes
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))

    def to_json(self) -> dict:
        """The report as JSON-ready data."""
        return {
            "settings": self.settings,
            "residual_bytes": self.residual_bytes,
            "argument_bytes": self.argument_bytes,
            "compiled": self.compiled,
            "rows": [
                dict(dataclasses.asdict(r), shape=list(r.shape)) for r in self.rows
            ],
            "checkpoints": [
                dict(
                    dataclasses.asdict(c),
                    scopes=scope_path(c.scopes),
                    shape=list(c.shape),
                )
                for c in self.checkpoints
            ],
        }

    def save(self, directory: str) -> tuple[str, str]:
        """Write ``memory_report.json`` and ``memory_report.png`` (residual
        bytes per scope, stacked by stored dtype) into ``directory`` (created
        if missing).

        Returns:
            The two paths.

        Raises:
            ImportError: if matplotlib is not installed.
        """
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise ImportError("MemoryReport.save needs matplotlib.") from e
        os.makedirs(directory, exist_ok=True)
        jpath = os.path.join(directory, "memory_report.json")
        with open(jpath, "w") as f:
            json.dump(self.to_json(), f, indent=1)
        scopes = list(self.by("scope"))[:16][::-1]
        dtypes = list(self.by("dtype"))
        fig, ax = plt.subplots(figsize=(9, max(2.5, 0.4 * len(scopes) + 1.5)))
        left = np.zeros(len(scopes))
        for d in dtypes:
            widths = np.array(
                [
                    sum(
                        r.bytes
                        for r in self.rows
                        if (r.scope or "(no scope)") == s and r.dtype == d
                    )
                    for s in scopes
                ],
                float,
            )
            ax.barh(scopes, widths / 2**20, left=left, label=d)
            left += widths / 2**20
        ax.set_xlabel("saved residual MiB")
        temp = self.temp_bytes
        extra = f", compiled temp {temp / 2**20:.1f} MiB" if temp is not None else ""
        ax.set_title(f"residuals {self.residual_bytes / 2**20:.2f} MiB{extra}")
        ax.legend(title="stored dtype")
        fig.tight_layout()
        ppath = os.path.join(directory, "memory_report.png")
        fig.savefig(ppath, dpi=110)
        plt.close(fig)
        return jpath, ppath

    def __str__(self) -> str:
        mib = 2**20
        settings = ", ".join(f"{k}={v}" for k, v in self.settings.items())
        compiled = "".join(
            f", compiled {k} {v / mib:.3f} MiB" for k, v in self.compiled.items()
        )
        head = f"{'MiB':>9} {'n':>3}  {'dtype':<14} {'primitive':<18} {'scope':<24}"
        lines = [
            f"memory_report ({settings})",
            f"saved residuals {self.residual_bytes / mib:.3f} MiB, arguments "
            f"{self.argument_bytes / mib:.3f} MiB{compiled}",
            "",
            head + " source",
        ]
        for r in self.rows:
            src = r.source.rsplit("/", 1)[-1]
            lines.append(
                f"{r.bytes / mib:9.3f} {r.count:3d}  {r.dtype:<14} {r.primitive:<18} "
                f"{(r.scope or '-'):<24} {src}"
            )
        return "\n".join(lines + _checkpoint_lines(self.checkpoints))


def _checkpoint_lines(choices: list[SavedChoice]) -> list[str]:
    """The table of the values checkpoints save: stored dtype and rule."""
    if not choices:
        return []
    lines = ["", "saved at jax.checkpoint boundaries (stored as, and why):"]
    for c in choices:
        shape = "x".join(map(str, c.shape))
        lines.append(
            f"  {(scope_path(c.scopes) or '-'):<16} {c.value:<14} {shape:<16} "
            f"{c.dtype:<14} {c.rule:<38} {c.source.rsplit('/', 1)[-1]}"
        )
    return lines


def _compiled_bytes(fn: Callable, args: tuple, kwargs: dict) -> dict[str, int]:
    dynamic, static = eqx.partition((args, kwargs), eqx.is_array)

    def step(dyn):
        a, kw = eqx.combine(dyn, static)
        return jax.value_and_grad(lambda p: fn(p, *a[1:], **kw))(a[0])

    stats = jax.jit(step).lower(dynamic).compile().memory_analysis()
    if stats is None:
        return {}
    names = {
        "argument": "argument_size_in_bytes",
        "output": "output_size_in_bytes",
        "alias": "alias_size_in_bytes",
        "temp": "temp_size_in_bytes",
    }
    return {k: int(getattr(stats, v)) for k, v in names.items() if hasattr(stats, v)}


def memory_report(
    fn: Callable,
    *args: Any,
    compute_dtype: Any = AMP_DEFAULT,
    amp_policy: Mapping[Any, Any] = default_amp_policy,
    residual_dtype: Any = None,
    compile: bool = True,
    **kwargs: Any,
) -> MemoryReport:
    """Where a training step's bytes go: saved residuals by scope, primitive
    and stored dtype; arguments; the compiled step's temp bytes.

    Args:
        fn: ``fn(params, *rest, **kwargs)`` returning a float scalar loss;
            gradients are taken w.r.t. ``params`` (a pytree of arrays).
        *args: its arguments (arrays; float32, bfloat16, ...).
        compute_dtype: amp's compute dtype; left out, amp's default
            (:func:`jaxamp.amp`: the enclosing
            :func:`jaxamp.migration.haliax.mixed_precision`
            block's compute dtype, else float16); None: ``fn`` as it is,
            without amp (the float32 or hand-written baseline).
        amp_policy: amp's policy.
        residual_dtype: amp's ``residual_dtype`` (None, ``jnp.float8_e4m3fn``,
            ``jnp.float8_e5m2``, ``"int8"``).
        compile: also compile ``jax.jit(jax.value_and_grad(fn))`` for XLA's
            ``memory_analysis()`` (argument, output, alias and temp bytes).
        **kwargs: keyword arguments of ``fn``.

    Returns:
        A :class:`MemoryReport`: ``.residual_bytes`` (int, equal to
        :func:`jaxamp.saved_residual_bytes`), ``.rows``, ``.argument_bytes``,
        ``.temp_bytes``, ``.compiled``, ``.checkpoints`` (per value a
        ``jax.checkpoint`` saves: stored dtype and the rule that chose it);
        ``print(report)`` gives a table,
        ``report.save(directory)`` a JSON file and a PNG bar chart.

    Raises:
        TypeError: if ``fn`` is not callable or no ``params`` are given.
        ValueError: for a bad ``compute_dtype`` or ``residual_dtype``.

    Example:
        >>> import jax.numpy as jnp, jaxamp
        >>> loss = lambda w, x: jnp.tanh(x @ w).sum()
        >>> r = jaxamp.memory_report(loss, jnp.ones((64, 64)), jnp.ones((8, 64)),
        ...                          residual_dtype=jnp.float8_e4m3fn)
        >>> r.rows[0].dtype
        'float8_e4m3fn'
    """
    if not callable(fn) or not args:
        raise TypeError(
            "memory_report(fn, params, *rest): fn must be a callable loss and "
            f"params given; got fn={type(fn).__name__} and {len(args)} arguments."
        )
    settings = {"compute_dtype": "none (fn as is)"}
    if compute_dtype is not None:
        compute_dtype = compute_dtype_or_default(compute_dtype)
        fn = amp(
            fn,
            compute_dtype=compute_dtype,
            amp_policy=amp_policy,
            residual_dtype=residual_dtype,
        )
        settings = {
            "compute_dtype": compute_dtype.name,
            "residual_dtype": str(getattr(residual_dtype, "__name__", residual_dtype)),
        }
    with recording() as choices:  # each checkpoint's saved values, and why
        rows = saved_rows(fn, *args, **kwargs)
    compiled = _compiled_bytes(fn, args, kwargs) if compile else {}
    return MemoryReport(rows, _tree_bytes((args, kwargs)), compiled, settings, choices)
