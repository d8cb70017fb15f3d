"""The outputs of :class:`jaxamp.tools.PrecisionReport`: a plain-text table, a
JSON dict and a PNG (a heatmap of scopes x op groups and the ranking, drawn
with matplotlib, imported only when saving)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

GROUPS = ("matmul", "elementwise", "exp/log/root", "reduction", "region")


def _num(x: float) -> float | None:
    return float(x) if math.isfinite(x) else None


def to_json(report: Any) -> dict:
    """The report as a JSON-serialisable dict: totals, per-group gradient
    errors, the ranking by gradient and by loss share, and every record."""
    recs = []
    for r in report.records:
        d = dataclasses.asdict(r)
        d["iteration"] = list(r.iteration)
        recs.append({k: _num(v) if isinstance(v, float) else v for k, v in d.items()})
    return {
        "compute_dtype": report.compute_dtype,
        "loss_float32": report.loss32,
        "loss_amp": report.loss,
        "loss_error": _num(report.loss_error),
        "grad_errors": report.grad_errors,
        "ranking_grad": {k: _num(v) for k, v in report.scopes("grad").items()},
        "ranking_loss": {k: _num(v) for k, v in report.scopes("loss").items()},
        "ranking": report.ranking,
        "linear_fit": _num(report.linear_fit),
        "records": recs,
    }


def scope_table(report: Any) -> dict[str, dict[str, Any]]:
    """Per scope path, in the ranking's order (:meth:`scopes`; then scopes
    without a reduced-precision equation): the estimated shares of the
    gradient and loss error its restoring removes, its sites' local backward
    error (in quadrature), largest local and propagated error, worst
    over/underflow, formats, first source line."""
    out: dict[str, dict[str, Any]] = {}
    for r in report.records:
        row = out.setdefault(
            r.scope,
            {
                "grad": 0.0,
                "loss": 0.0,
                "local": 0.0,
                "prop": 0.0,
                "over": 0.0,
                "under": 0.0,
                "formats": set(),
                "source": r.source,
            },
        )
        row["grad"] += r.grad_share**2
        row["loss"] += r.loss_share
        row["local"] = max(row["local"], r.local_error)
        row["prop"] = max(row["prop"], r.propagated_error)
        row["over"] = max(row["over"], r.overflow)
        row["under"] = max(row["under"], r.underflow)
        if r.format:
            row["formats"].add(r.format)
    grad, loss = report.scopes("grad"), report.scopes("loss")
    for k, row in out.items():
        row["grad"] = row["grad"] ** 0.5
        row["removed"] = grad.get(k, 0.0)
        row["removed_loss"] = loss.get(k, 0.0)
    order = list(grad) + [k for k in out if k not in grad]
    return {k: out[k] for k in order if k in out}


def text(report: Any) -> str:
    """The plain-text table ``print(report)`` shows."""
    head = (
        f"precision report ({report.compute_dtype}): loss {report.loss:.6g} vs "
        f"float32 {report.loss32:.6g} (rel {report.loss_error:.2e}); gradient "
        f"error {report.grad_error:.2e}\n"
    )
    groups = "  ".join(
        f"{k} {v:.2e}" for k, v in report.grad_errors.items() if k != "total"
    )
    lines = [head + f"per parameter group: {groups}", ""]
    lines.append(
        "grad / loss removed: measured share of the error removed by running the "
        "scope alone in higher precision (8-bit: compute dtype, else float32); "
        f"ranking {report.ranking or 'not measured'}"
    )
    lines.append(
        f"{'scope':<28} {'grad rem.':>9} {'loss rem.':>9} {'bwd local':>9} "
        f"{'local':>9} {'propag.':>9} {'overfl.':>8} {'underfl.':>8}  formats / source"
    )
    for scope, r in scope_table(report).items():
        lines.append(
            f"{(scope or '(no scope)')[:28]:<28} {r['removed']:9.1%} "
            f"{r['removed_loss']:9.1%} {r['grad']:9.2e} "
            f"{r['local']:9.2e} {r['prop']:9.2e} {r['over']:8.1%} {r['under']:8.1%}  "
            f"{','.join(sorted(r['formats']))} {os.path.basename(r['source'])}"
        )
    return "\n".join(lines)


# Most heatmap rows drawn: more scope iterations than this are drawn in
# blocks of consecutive iterations (labels stay readable at any depth).
MAX_ROWS = 48


def heat(report: Any, max_rows: int = MAX_ROWS) -> tuple[list[str], list[list[float]]]:
    """The heatmap's rows and cells: one row per scope path and scan
    iteration (``"attn [3]"``), in the order the step runs them (layer 0's
    scopes, layer 1's, ..., the head); cells are the gradient shares of the
    row's equations per op group, added in quadrature. With more than
    ``max_rows`` rows, consecutive iterations of a scope share a row
    (``"attn [0-3]"``), as few per row as keeps the rows within ``max_rows``.
    """

    def key(r, block):
        if not r.iteration:
            return r.scope, r.iteration, None
        *outer, t = r.iteration
        return r.scope, tuple(outer), t // block

    n_rows = len({key(r, 1) for r in report.records})
    block = max(1, -(-n_rows // max_rows))
    while block > 1 and len({key(r, block) for r in report.records}) > max_rows:
        block += 1
    cells: dict[tuple, dict[str, float]] = {}
    spans: dict[tuple, list[int]] = {}
    for r in report.records:  # in the order the walk visits them
        k = key(r, block)
        row = cells.setdefault(k, dict.fromkeys(GROUPS, 0.0))
        row[r.group] = row.get(r.group, 0.0) + r.grad_share**2
        if r.iteration:
            spans.setdefault(k, []).append(r.iteration[-1])
    names = []
    for k in cells:
        scope, outer, _ = k
        label = scope or "(no scope)"
        if k in spans:
            lo, hi = min(spans[k]), max(spans[k])
            its = [*map(str, outer), f"{lo}" if lo == hi else f"{lo}-{hi}"]
            label += f" [{','.join(its)}]"
        names.append(label)
    return names, [[cells[k][g] ** 0.5 for g in GROUPS] for k in cells]


def save(report: Any, directory: str) -> tuple[str, str]:
    """Write ``precision_report.json`` and ``precision_report.png`` into
    ``directory`` (created if missing); returns their paths.

    Raises:
        ImportError: if matplotlib is not installed (``pip install
            matplotlib``, or jaxamp's ``examples`` extra).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "PrecisionReport.save needs matplotlib: pip install matplotlib."
        ) from e
    os.makedirs(directory, exist_ok=True)
    jpath = os.path.join(directory, "precision_report.json")
    with open(jpath, "w") as f:
        json.dump(to_json(report), f, indent=1)
    rows, cells = heat(report)
    ranking = list(report.scopes("grad").items())[:12][::-1]
    fig, (ax0, ax1) = plt.subplots(
        1,
        2,
        figsize=(12, max(3.0, 0.35 * len(rows) + 1.5)),
        gridspec_kw={"width_ratios": [3, 2]},
    )
    im = ax0.imshow(cells, aspect="auto", cmap="magma_r")
    ax0.set_xticks(range(len(GROUPS)), GROUPS, rotation=30, ha="right")
    ax0.set_yticks(range(len(rows)), rows)
    ax0.set_title("gradient-error share per scope [scan iteration] and op group")
    fig.colorbar(im, ax=ax0, fraction=0.04)
    ax1.barh([k or "(no scope)" for k, _ in ranking], [v for _, v in ranking])
    ax1.ticklabel_format(axis="x", style="sci", scilimits=(0, 0))
    ax1.set_title(f"ranking (gradient error {report.grad_error:.2e})")
    fig.tight_layout()
    ppath = os.path.join(directory, "precision_report.png")
    fig.savefig(ppath, dpi=110)
    plt.close(fig)
    return jpath, ppath
