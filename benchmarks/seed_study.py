"""Seed study of the main job: every recipe the README and guide offer, trained
over seeds, its final validation loss against float32's, paired by seed.

    python benchmarks/seed_study.py             # the whole study, resumable
    python benchmarks/seed_study.py --recipes fp32,bf16,fp16 --seeds 5 --steps 300
    python benchmarks/seed_study.py --report    # table + plots of the finished runs

Each run is ``examples/train_charlm.py``'s ``train`` (same model, data, optimizer
and step) with one recipe (a mode plus ``Config`` fields, ``RECIPES``) at one seed
(the seed of the initial parameters, the order of the training batches, the
validation batches, and ``low_precision_optimizer``'s stochastic rounding; int8's
stochastic rounding hashes the rounded data, so it follows them). A finished run
is written at once to ``OUT/<recipe>/<steps>/seed<k>.json`` (training loss of
every step, validation loss every tenth of the run, final validation loss in
nats and bits/char, skipped steps, forward overflows, final loss scale, the
divergence flag, wall time, commit); a rerun skips the runs whose file exists
with the same configuration, so an interrupted study continues where it stopped.

Without ``--steps``, the plan is the main job's 300 steps for every recipe, then
1500 steps (5x) for ``LONG_RECIPES``, in ``RECIPES``' order (most asked first),
seed by seed within each group of ``PRIORITY`` so a stopped study still has
paired seeds.

``--report`` writes ``benchmarks/RESULTS_SEEDS.md``'s table (``--results``) and
one plot per run length beside it: per recipe, the mean and standard deviation
of the final validation loss over seeds, the difference to float32 paired by
seed with its 95% t-interval, and the verdict (``verdict``); skipped steps,
forward overflows and divergences summed over the seeds, never dropped.

Runs are sequential: each already uses every core (XLA:CPU's threads).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

import train_charlm  # noqa: E402

SHORT_STEPS, LONG_STEPS = 300, 1500
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "seed_study"
DEFAULT_RESULTS = ROOT / "benchmarks" / "RESULTS_SEEDS.md"
# A recipe "matches float32" when the 95% interval of its paired difference to
# float32 lies within this fraction of float32's mean final validation loss
# (RESULTS_SEEDS.md says why 0.5%).
MATCH_BAND = 0.005
CONFIDENCE = 0.95
DIVERGED_NATS = math.log(256)  # the loss of a uniform guess over the 256 bytes


@dataclasses.dataclass(frozen=True)
class Recipe:
    """One configuration of the main job.

    Attributes:
        mode: a key of ``train_charlm.MODES``.
        fields: ``train_charlm.Config`` fields set on top of the defaults.
        text: what the recipe is, for the table.
    """

    mode: str
    fields: tuple[tuple[str, object], ...] = ()
    text: str = ""


_BF16_PARAMS = (("param_dtype", "bfloat16"), ("param_rounding", "stochastic"))
RECIPES: dict[str, Recipe] = {
    "fp32": Recipe("fp32", (), "float32, no amp"),
    "bf16": Recipe("bf16", (), "jaxamp.amp bfloat16"),
    "fp16": Recipe("fp16", (), "jaxamp.amp float16, dynamic loss scaling"),
    "fp8": Recipe("fp8", (), "FP8 matmuls (fp8_policy, every matmul)"),
    "int8": Recipe("int8", (), "int8 matmuls (int8_policy, every matmul)"),
    "bf16_params_sr": Recipe(
        "bf16",
        (*_BF16_PARAMS, ("opt_state_dtype", "bfloat16")),
        "bf16 + bfloat16 parameters, stochastic rounding, bfloat16 moments",
    ),
    "int8_state": Recipe(
        "bf16",
        (*_BF16_PARAMS, ("opt_state_dtype", "int8")),
        "bf16 + bfloat16 parameters, stochastic rounding, int8 moments",
    ),
    "update_in_backward": Recipe(
        "bf16",
        (
            *_BF16_PARAMS,
            ("opt_state_dtype", "int8"),
            ("residual_dtype", "int8"),
            ("update_in_backward", True),
        ),
        "bf16 + update in backward, bfloat16 parameters, int8 moments, "
        "int8 residuals (no clipping)",
    ),
    "e4m3_residuals": Recipe(
        "bf16", (("residual_dtype", "fp8"),), "bf16 + E4M3 residuals"
    ),
    "int8_residuals": Recipe(
        "bf16", (("residual_dtype", "int8"),), "bf16 + int8 residuals"
    ),
    "jmp_bf16": Recipe("jmp_bf16", (), "jmp cast-everything bfloat16 (baseline)"),
    "hand_bf16": Recipe("hand_bf16", (), "hand-written bfloat16 model (baseline)"),
}
LONG_RECIPES = ("fp32", "bf16", "fp8", "int8", "bf16_params_sr")
# Groups of the default plan, run seed by seed within a group.
PRIORITY = (("fp32", "bf16", "fp16"), ("fp8", "int8", "bf16_params_sr"))
REFERENCE = "fp32"


def plan(
    recipes: list[str], seeds: list[int], steps: list[int] | None
) -> list[tuple[str, int, int]]:
    """The runs to make, in order.

    Args:
        recipes: keys of ``RECIPES``.
        seeds: the seeds of each recipe.
        steps: run lengths for every recipe; None: the default plan
            (``SHORT_STEPS`` for every recipe, then ``LONG_STEPS`` for those in
            ``LONG_RECIPES``).

    Returns:
        ``(recipe, steps, seed)`` triples: run lengths in order, within one
        the groups of ``PRIORITY`` (then the other recipes) in turn, seed by
        seed within a group, ``REFERENCE`` first.
    """
    lengths = (
        [(s, recipes) for s in steps]
        if steps is not None
        else [
            (SHORT_STEPS, recipes),
            (LONG_STEPS, [r for r in recipes if r in LONG_RECIPES]),
        ]
    )
    out = []
    for n, names in lengths:
        rest = [r for r in names if not any(r in g for g in PRIORITY)]
        for group in (*PRIORITY, rest):
            chosen = [r for r in names if r in group]
            chosen.sort(key=lambda r: r != REFERENCE)
            out += [(r, n, s) for s in seeds for r in chosen]
    return out


def run_path(out: Path, recipe: str, steps: int, seed: int) -> Path:
    """Where a run's JSON lives: ``out/<recipe>/<steps>/seed<seed>.json``."""
    return Path(out) / recipe / str(steps) / f"seed{seed}.json"


def run_config(
    recipe: str, steps: int, seed: int, overrides: dict | None = None
) -> train_charlm.Config:
    """The ``train_charlm.Config`` of one run: the defaults, the recipe's
    fields, ``overrides`` (e.g. a tiny model), the seed and the length; the
    validation loss measured every tenth of the run; no sampled text."""
    r = RECIPES[recipe]
    cfg = train_charlm.Config(mode=r.mode, **dict(r.fields), **(overrides or {}))
    return dataclasses.replace(
        cfg, steps=steps, seed=seed, eval_every=max(1, steps // 10), sample_chars=0
    )


def _commit() -> str:
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def _nudged_initial_params(cfg):
    """``train_charlm.initial_params`` with every float32 parameter moved up by
    one unit in the last place (``jnp.nextafter``) before the cast to
    ``cfg.param_dtype``: a change the size of one rounding."""
    import jax
    import jax.numpy as jnp

    params = train_charlm.init_params(jax.random.key(cfg.seed), cfg)
    params = jax.tree.map(lambda a: jnp.nextafter(a, jnp.inf), params)
    return jax.tree.map(lambda a: a.astype(cfg.param_dtype), params)


# The commit checked out when this process started: the code its runs run
# ("+dirty": with uncommitted changes).
STARTED_AT = _commit()


def train_one(
    recipe: str, steps: int, seed: int, data, overrides=None, nudge: bool = False
) -> dict:
    """Trains one run and returns its record (what ``run_path`` holds).

    Args:
        recipe: a key of ``RECIPES``.
        steps: optimizer steps.
        seed: the run's seed.
        data: ``(train, val)`` from ``train_charlm.load_corpus``.
        overrides: further ``Config`` fields.
        nudge: start from the seed's parameters each moved by one unit in the
            last place (``_nudged_initial_params``): how far a run's final loss
            moves from a rounding-sized change alone (another machine's
            arithmetic, say), against how far another seed moves it.

    Returns:
        The record: recipe, steps, seed, config, the figures of
        ``train_charlm.train`` the study reads, the metadata, and
        ``diverged``: the final validation loss is not finite or above
        ``DIVERGED_NATS`` (worse than predicting every byte uniformly, where
        training starts).
    """
    import jax

    cfg = run_config(recipe, steps, seed, overrides)
    initial = train_charlm.initial_params
    if nudge:
        train_charlm.initial_params = _nudged_initial_params
    try:
        r = train_charlm.train(cfg, cfg.mode, data, progress=False)
    finally:
        train_charlm.initial_params = initial
    val = r["val_loss"]
    return {
        "recipe": recipe,
        "steps": steps,
        "seed": seed,
        "config": dataclasses.asdict(cfg),
        "label": r["label"],
        "losses": r["losses"],
        "val_curve": r["val_curve"],
        "val_loss": val,
        "val_bits_per_char": r["val_bits_per_char"],
        "final_train_loss": r["final_train_loss"],
        "skipped_steps": r["skipped_steps"],
        "forward_overflows": r["forward_overflows"],
        "final_loss_scale": r["final_loss_scale"],
        "diverged": not math.isfinite(val) or val > DIVERGED_NATS,
        "nudged_init": nudge,
        "tokens_per_s": r["tokens_per_s"],
        "wall_s": r["wall_s"],
        "commit": STARTED_AT,
        "jax_version": jax.__version__,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "finished_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(
            timespec="seconds"
        ),
    }


def _same_config(path: Path, cfg: train_charlm.Config, nudge: bool) -> bool:
    saved = json.loads(path.read_text())
    same = saved["config"] == json.loads(json.dumps(dataclasses.asdict(cfg)))
    return same and saved.get("nudged_init", False) == nudge


def run_study(
    runs: list[tuple[str, int, int]],
    out: Path,
    overrides: dict | None = None,
    log=print,
    nudge: bool = False,
) -> list[Path]:
    """Trains the runs whose JSON is missing, writing each as it ends.

    Args:
        runs: ``(recipe, steps, seed)`` triples (``plan``).
        out: the study's folder.
        overrides: further ``Config`` fields of every run.
        log: prints one line per run.
        nudge: ``train_one``'s ``nudge`` for every run.

    Returns:
        The paths of the runs trained now.

    Raises:
        ValueError: a run's file exists with another configuration (another
            model size, say): pass another ``--out``.
    """
    todo = []
    for recipe, steps, seed in runs:
        path = run_path(out, recipe, steps, seed)
        if path.exists():
            cfg = run_config(recipe, steps, seed, overrides)
            if not _same_config(path, cfg, nudge):
                raise ValueError(
                    f"{path} holds a run with another configuration; pass "
                    "another --out for this one"
                )
            continue
        todo.append((recipe, steps, seed, path))
    log(f"{len(runs) - len(todo)} of {len(runs)} runs already done, {len(todo)} to go")
    if not todo:
        return []
    cfg = train_charlm.Config(**(overrides or {}))
    data = train_charlm.load_corpus(cfg.data_dir, cfg.max_bytes)
    done = []
    for i, (recipe, steps, seed, path) in enumerate(todo):
        t0 = time.perf_counter()
        record = train_one(recipe, steps, seed, data, overrides, nudge)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(record, indent=0))
        tmp.replace(path)  # a file that exists is a finished run
        done.append(path)
        log(
            f"[{i + 1}/{len(todo)}] {recipe} {steps} steps seed {seed}: val "
            f"{record['val_loss']:.4f} nats, skipped {record['skipped_steps']}, "
            f"diverged {record['diverged']}, {time.perf_counter() - t0:.0f} s"
        )
    return done


# ---------------------------------------------------------------------------
# Statistics


def load_runs(out: Path) -> list[dict]:
    """Every finished run's record under ``out``."""
    return [json.loads(p.read_text()) for p in sorted(Path(out).glob("*/*/seed*.json"))]


def paired_interval(
    values: list[float], reference: list[float], confidence: float = CONFIDENCE
) -> tuple[float, float, float]:
    """Mean difference ``values - reference`` (paired by index) and its
    Student-t confidence interval.

    Args:
        values, reference: one number per seed each, same length, at least 2.
        confidence: the interval's coverage.

    Returns:
        ``(mean, low, high)``: ``mean +- t_{(1+c)/2, n-1} * sd / sqrt(n)`` with
        ``sd`` the differences' sample standard deviation (ddof 1).

    Raises:
        ValueError: fewer than 2 pairs, or lengths that differ.
    """
    from scipy import stats

    if len(values) != len(reference) or len(values) < 2:
        raise ValueError(
            f"paired_interval needs at least 2 pairs of equal length, got "
            f"{len(values)} and {len(reference)} values"
        )
    d = np.asarray(values, np.float64) - np.asarray(reference, np.float64)
    half = stats.t.ppf((1 + confidence) / 2, d.size - 1) * d.std(ddof=1)
    half /= math.sqrt(d.size)
    return float(d.mean()), float(d.mean() - half), float(d.mean() + half)


def verdict(low: float, high: float, reference_mean: float, band=MATCH_BAND) -> str:
    """The table's verdict on a paired interval ``[low, high]`` (nats).

    Returns:
        ``"matches float32"`` when the interval lies within ``+-band`` of
        ``reference_mean``; ``"above float32"`` / ``"below float32"`` when it
        lies wholly above ``+band`` / below ``-band``; otherwise
        ``"undecided (interval wider than the band)"``; ``"diverged"`` for a
        non-finite interval.
    """
    b = band * reference_mean
    if not (math.isfinite(low) and math.isfinite(high)):
        return "diverged"
    if -b <= low and high <= b:
        return "matches float32"
    if low > b:
        return "above float32"
    if high < -b:
        return "below float32"
    return "undecided (interval wider than the band)"


def summarize(runs: list[dict]) -> list[dict]:
    """One row per (steps, recipe): seeds, mean and std of the final
    validation loss (nats and bits/char), the paired difference to
    ``REFERENCE`` on the seeds both have, its interval in nats and percent of
    the reference's mean, the verdict, and the sums of skipped steps, forward
    overflows and diverged runs over the seeds."""
    by = {}
    for r in runs:
        by.setdefault((r["steps"], r["recipe"]), {})[r["seed"]] = r
    rows = []
    for (steps, recipe), seeds in sorted(
        by.items(), key=lambda kv: (kv[0][0], list(RECIPES).index(kv[0][1]))
    ):
        vals = np.array([seeds[s]["val_loss"] for s in sorted(seeds)])
        row = {
            "steps": steps,
            "recipe": recipe,
            "seeds": sorted(seeds),
            "mean": float(vals.mean()),
            "std": float(vals.std(ddof=1)) if vals.size > 1 else float("nan"),
            "skipped": sum(r["skipped_steps"] for r in seeds.values()),
            "overflows": sum(r["forward_overflows"] for r in seeds.values()),
            "diverged": sum(bool(r["diverged"]) for r in seeds.values()),
        }
        ref = by.get((steps, REFERENCE), {})
        common = sorted(set(seeds) & set(ref))
        if recipe != REFERENCE and len(common) >= 2:
            a = [seeds[s]["val_loss"] for s in common]
            b = [ref[s]["val_loss"] for s in common]
            mean, lo, hi = paired_interval(a, b)
            ref_mean = float(np.mean(b))
            row.update(
                paired=len(common),
                diff=mean,
                low=lo,
                high=hi,
                diff_pct=100 * mean / ref_mean,
                low_pct=100 * lo / ref_mean,
                high_pct=100 * hi / ref_mean,
                verdict=verdict(lo, hi, ref_mean),
            )
            if row["diverged"]:
                row["verdict"] = f"diverged in {row['diverged']} of {len(seeds)}"
        elif recipe != REFERENCE:
            row["verdict"] = f"not enough seeds paired with {REFERENCE} ({len(common)})"
        rows.append(row)
    return rows


# ---------------------------------------------------------------------------
# Report


def _mean_std(mean: float, std: float) -> str:
    return f"{mean:.4f} ± {std:.4f}" if math.isfinite(std) else f"{mean:.4f} (one seed)"


def table(rows: list[dict]) -> str:
    """The Markdown table of ``summarize``'s rows."""
    head = (
        "| steps | recipe | seeds | val loss (nats), mean ± std | val bits/char, "
        "mean ± std | paired diff to fp32 (nats) [95% CI] | diff % of fp32 "
        "[95% CI] | verdict | skipped steps | forward overflows | diverged |"
    )
    out = [head, "|" + "---|" * 11]
    ln2 = math.log(2)
    for r in rows:
        if "diff" in r:
            diff = (
                f"{r['diff']:+.4f} [{r['low']:+.4f}, {r['high']:+.4f}] "
                f"({r['paired']} pairs)"
            )
            pct = f"{r['diff_pct']:+.2f} [{r['low_pct']:+.2f}, {r['high_pct']:+.2f}]"
        else:
            diff = pct = "-"
        out.append(
            f"| {r['steps']} | {r['recipe']} | {len(r['seeds'])} "
            f"| {_mean_std(r['mean'], r['std'])} "
            f"| {_mean_std(r['mean'] / ln2, r['std'] / ln2)} | {diff} | {pct} "
            f"| {r.get('verdict', 'reference')} | {r['skipped']} | {r['overflows']} "
            f"| {r['diverged']} |"
        )
    return "\n".join(out)


def figure(runs: list[dict], steps: int):
    """Validation loss (bits/char) against step, one panel per recipe run at
    ``steps``: each recipe's mean over seeds (line) and its range over seeds
    (band), ``REFERENCE``'s mean and band in every panel.

    Returns:
        A matplotlib ``Figure`` (Agg backend), or None if no run has that length.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves: dict[str, list] = {}
    for r in runs:
        if r["steps"] == steps:
            curves.setdefault(r["recipe"], []).append(r["val_curve"])
    if not curves:
        return None
    names = [n for n in RECIPES if n in curves]
    cols = min(4, len(names))
    rows = math.ceil(len(names) / cols)
    fig, axes = plt.subplots(
        rows,
        cols,
        figsize=(3.4 * cols, 2.8 * rows),
        sharex=True,
        sharey=True,
        squeeze=False,
    )

    def band(name):
        n = min(len(c) for c in curves[name])
        arr = np.array([[v for _, v in c[:n]] for c in curves[name]]) / math.log(2)
        x = [s for s, _ in curves[name][0][:n]]
        return x, arr.mean(0), arr.min(0), arr.max(0)

    lows = []
    for ax, name in zip(axes.flat, names):
        if REFERENCE in curves and name != REFERENCE:
            x, m, lo, hi = band(REFERENCE)
            ax.fill_between(x, lo, hi, color="gray", alpha=0.25, linewidth=0)
            ax.plot(x, m, color="gray", linewidth=1.2, label=f"{REFERENCE} mean")
        x, m, lo, hi = band(name)
        ax.fill_between(x, lo, hi, color="C0", alpha=0.3, linewidth=0)
        ax.plot(x, m, color="C0", linewidth=1.4, label=f"{name} mean")
        lows.append(m[len(m) // 3 :])
        ax.set_title(f"{name} ({len(curves[name])} seeds)", fontsize="small")
        ax.legend(fontsize="x-small")
        ax.grid(alpha=0.3)
    for ax in axes.flat[len(names) :]:
        ax.set_visible(False)
    tail = np.concatenate(lows)
    pad = 0.15 * (tail.max() - tail.min()) + 0.01
    axes[0, 0].set_ylim(tail.min() - pad, tail.max() + pad)
    for ax in axes[:, 0]:
        ax.set_ylabel("val loss (bits/char)")
    for ax in axes[-1, :]:
        ax.set_xlabel("step")
    fig.suptitle(
        f"main job, {steps} steps: validation loss, mean over seeds (line) and "
        "min-max over seeds (band); float32 in gray",
        fontsize="small",
    )
    fig.tight_layout()
    return fig


def plot_path(results: Path, steps: int) -> Path:
    """The PNG beside ``results`` for one run length: ``RESULTS_SEEDS_<steps>.png``."""
    return Path(results).with_name(f"{Path(results).stem}_{steps}.png")


def report(out: Path, results: Path) -> str:
    """Writes the table to ``results`` and a plot per run length beside it.

    Returns:
        The table.
    """
    import matplotlib.pyplot as plt

    runs = load_runs(out)
    if not runs:
        raise ValueError(f"no finished runs under {out}")
    rows = summarize(runs)
    text = table(rows)
    wall = sum(r["wall_s"] for r in runs)
    commits = sorted({r["commit"] for r in runs})
    lines = [
        "<!-- generated by python benchmarks/seed_study.py --report -->",
        f"Runs: {len(runs)}, {wall / 3600:.2f} h of training wall time in all "
        f"(one run at a time), commits {', '.join(commits)}, JAX "
        f"{', '.join(sorted({r['jax_version'] for r in runs}))}, "
        f"{', '.join(sorted({r['machine'] for r in runs}))}.",
        "",
        text,
    ]
    for steps in sorted({r["steps"] for r in runs}):
        fig = figure(runs, steps)
        fig.savefig(plot_path(results, steps), dpi=110)
        plt.close(fig)
        lines.append(f"\n![{steps} steps]({plot_path(results, steps).name})")
    _splice(Path(results), "\n".join(lines))
    return text


BEGIN, END = "<!-- seed-study:begin -->", "<!-- seed-study:end -->"


def _splice(path: Path, body: str) -> None:
    """Replaces the text between ``BEGIN`` and ``END`` in ``path`` (the
    hand-written prose around it stays); a new file holds just that block."""
    block = f"{BEGIN}\n{body}\n{END}"
    old = path.read_text() if path.exists() else ""
    if BEGIN in old and END in old:
        head, rest = old.split(BEGIN, 1)
        new = head + block + rest.split(END, 1)[1]
    else:
        new = (old + "\n" if old else "") + block + "\n"
    path.write_text(new)


def _parse_seeds(text: str) -> list[int]:
    if "," in text or "-" in text:
        seeds = []
        for part in text.split(","):
            lo, _, hi = part.partition("-")
            seeds += list(range(int(lo), int(hi or lo) + 1))
        return seeds
    if int(text) < 1:
        raise ValueError(
            f"--seeds {text}: a count must be at least 1 (seed 0 alone: 0-0)"
        )
    return list(range(int(text)))


def main(argv: list[str] | None = None) -> int:
    """Command line: trains the plan (resumable), or ``--report``."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipes", default="all", help="comma-separated keys of RECIPES")
    p.add_argument(
        "--seeds", default="5", help="a count N (seeds 0..N-1) or a list: 0-0, 0,3-4"
    )
    p.add_argument(
        "--steps",
        default=None,
        help="comma-separated run lengths for every recipe (default: 300 for "
        "all, then 1500 for LONG_RECIPES)",
    )
    p.add_argument("--out", default=str(DEFAULT_OUT), help="folder of the run JSONs")
    p.add_argument("--results", default=str(DEFAULT_RESULTS), help="Markdown file")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="a train_charlm.Config field for every run (e.g. d_model=32)",
    )
    p.add_argument(
        "--nudge-init",
        action="store_true",
        help="start every run from its seed's parameters moved by one unit in the "
        "last place (how far rounding alone moves a run; use another --out)",
    )
    p.add_argument("--report", action="store_true", help="write the table and plots")
    a = p.parse_args(argv)
    if a.report:
        print(report(Path(a.out), Path(a.results)))
        return 0
    names = list(RECIPES) if a.recipes == "all" else a.recipes.split(",")
    bad = [n for n in names if n not in RECIPES]
    if bad:
        p.error(f"--recipes: unknown {bad}; choose from {list(RECIPES)}")
    fields = {f.name: f for f in dataclasses.fields(train_charlm.Config)}
    overrides = {}
    for item in a.set:
        key, _, value = item.partition("=")
        if key not in fields or not _:
            p.error(f"--set {item!r}: expected FIELD=VALUE with FIELD a Config field")
        default = fields[key].default
        if isinstance(default, bool):
            overrides[key] = value.lower() in ("1", "true", "yes")
        else:
            overrides[key] = value if default is None else type(default)(value)
    steps = None if a.steps is None else [int(s) for s in a.steps.split(",")]
    try:
        seeds = _parse_seeds(a.seeds)
    except ValueError as e:
        p.error(str(e))
    runs = plan(names, seeds, steps)
    log = lambda s: print(s, flush=True)  # noqa: E731
    run_study(runs, Path(a.out), overrides, log, nudge=a.nudge_init)
    return 0


if __name__ == "__main__":
    sys.exit(main())
