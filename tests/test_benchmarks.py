"""Runs the benchmarks on tiny sizes so that they cannot rot."""

import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import jax
import pytest
import run as bench

ROOT = Path(__file__).resolve().parents[1]

VARIANTS = [
    "fp32",
    "jaxamp bf16",
    "jaxamp fp16",
    "mpx bf16",
    "jmp bf16",
    "hand bf16",
    "jaxamp bf16 + E4M3 residuals",
]
PEERS = {"mpx bf16": "mpx", "jmp bf16": "jmp"}  # variant -> the module it needs


@pytest.fixture(autouse=True)
def standard_promotion():
    # The peers' cast-everything variants (mpx, jmp) rely on implicit promotion
    # inside jax.nn; the benchmark measures them as users run them.
    with jax.numpy_dtype_promotion("standard"):
        yield


_RUNS: dict[str, dict] = {}  # the tiny run's rows, for the peer checks below


@pytest.mark.slow
def test_benchmark_tables_and_json(tmp_path, capsys):
    out = tmp_path / "r.md"
    args = ["--size", "tiny", "--steps", "2", "--trace-repeats", "1"]
    args += ["--scaling-layers", "2,4", "--out", str(out)]
    assert bench.main(args) == 0
    md = out.read_text()
    assert md.strip() in capsys.readouterr().out
    header = next(line for line in md.splitlines() if line.startswith("| variant"))
    for col in (
        "low-precision FLOP share",
        "residual bytes vs fp32",
        "trace vs fp32",
        "compile s",
        "step vs fp32",
        "converts",
        "grad rel. L2 err",
        "loss diff",
    ):
        assert col in header
    data = json.loads(out.with_suffix(".json").read_text())
    rows = {r["variant"]: r for r in data["rows"]}
    assert list(rows) == VARIANTS
    fp32 = rows["fp32"]
    assert fp32["residual_ratio"] == 1.0 and fp32["grad_rel_l2"] == 0.0
    for name in VARIANTS[1:]:
        if "missing" in rows[name]:
            # Only a peer that is not installed may be missing (its own test
            # below then skips, naming it).
            assert rows[name]["missing"].startswith("missing")
            assert importlib.util.find_spec(PEERS[name]) is None, rows[name]
            continue
        assert 0 < rows[name]["residual_ratio"] < 1
        assert rows[name]["grad_rel_l2"] < 0.1
    assert rows["jaxamp bf16"]["low_precision_flop_share"] == 1.0
    # fp16, loss-scaled as it is trained, shows its 3 more mantissa bits than
    # bfloat16 (at size S, unscaled, its gradients underflowed: 1.7e-2).
    fp16, bf16 = rows["jaxamp fp16"], rows["jaxamp bf16"]
    assert fp16["grad_rel_l2"] < bf16["grad_rel_l2"] / 2, (fp16, bf16)
    _RUNS["tiny"] = rows
    assert [s["layers"] for s in data["scaling"]] == [2, 4]
    assert (
        data["scaling"][1]["forward_equations"]
        > data["scaling"][0]["forward_equations"]
    )


@pytest.mark.slow
@pytest.mark.parametrize("variant", sorted(PEERS))
def test_peer_variant_ran(variant, tmp_path):
    """A peer (mpx, jmp) that is installed is measured, never reported missing;
    one that is not installed skips here, visibly, with its name."""
    if importlib.util.find_spec(PEERS[variant]) is None:
        pytest.skip(f"{PEERS[variant]} is not installed: pip install -e '.[bench]'")
    if "tiny" not in _RUNS:
        out = tmp_path / "r.md"
        args = ["--size", "tiny", "--steps", "1", "--trace-repeats", "1"]
        assert bench.main([*args, "--scaling-layers", "2", "--out", str(out)]) == 0
        data = json.loads(out.with_suffix(".json").read_text())
        _RUNS["tiny"] = {r["variant"]: r for r in data["rows"]}
    row = _RUNS["tiny"][variant]
    assert "missing" not in row, row
    assert 0 < row["residual_ratio"] < 1 and row["grad_rel_l2"] < 0.1


@pytest.mark.slow
def test_gpu_attention_benchmark_dry_run(tmp_path):
    """benchmarks/gpu_attention.py (issue 12) runs end to end on CPU: the
    columns exist, jaxamp's gradient is close to float32, and the cuDNN-only
    variant is reported unavailable instead of failing."""
    import gpu_attention

    out = tmp_path / "gpu.md"
    picked = "jaxamp bf16,hand bf16 cudnn"
    args = ["--size", "tiny", "--dry-run", "--variants", picked, "--out", str(out)]
    assert gpu_attention.main(args) == 0
    md = out.read_text()
    for col in ("step ms", "tokens/s", "MFU", "temp MiB", "residual MiB", "fmha"):
        assert col in md
    assert "grad rel. L2" in md
    rows = {
        r["variant"]: r
        for r in json.loads(out.with_suffix(".json").read_text())["results"]["tiny"]
    }
    assert list(rows) == ["fp32", "jaxamp bf16", "hand bf16 cudnn"]
    assert rows["jaxamp bf16"]["grad_rel_l2"] < 3e-2
    assert rows["jaxamp bf16"]["fmha_fwd"] == 0  # no cuDNN on CPU
    if jax.default_backend() == "cpu":
        assert "unavailable" in rows["hand bf16 cudnn"]["missing"]


def test_gpu_attention_variant_names_may_hold_commas():
    """--variants of gpu_attention.py / gpu_profile.py: names with commas are
    picked whole (the longest name wins), and a name that matches no variant
    stops the run instead of silently measuring fp32 alone."""
    import gpu_attention

    names = list(gpu_attention.variants("tiny"))
    assert "jaxamp fp16, overflow check off" in names
    spec = "jaxamp fp16,jaxamp fp16, overflow check off,jaxamp bf16, attention off"
    assert gpu_attention.pick_variants(spec, names) == [
        "jaxamp fp16",
        "jaxamp fp16, overflow check off",
        "jaxamp bf16, attention off",
    ]
    assert gpu_attention.pick_variants("", names) is None
    with pytest.raises(SystemExit, match="--variants: no variant named 'jaxamp fp17'"):
        gpu_attention.pick_variants("jaxamp bf16,jaxamp fp17", names)


def test_gpu_attention_kernel_census():
    import gpu_attention

    hlo = (
        'custom_call_target="__cudnn$fmhaSoftmax" '
        'custom_call_target="__cudnn$fmhaSoftmaxBackward" '
        'custom_call_target="__cublas$gemm" custom_call_target="__cublas$lt$matmul"'
    )
    assert gpu_attention.kernels(hlo) == {"fmha_fwd": 1, "fmha_bwd": 1, "cublas": 2}


def test_rmsnorm_benchmark_tiny(tmp_path):
    """benchmarks/rmsnorm.py on a tiny model for two steps: every variant's
    gradient error is finite and below bfloat16-level bounds, and the rule-off
    ablation really is another trace (its figures differ from jaxamp bf16's)."""
    import rmsnorm

    out = tmp_path / "rms.md"
    args = ["--steps", "2", "--points", "2", "--eval-batches", "1", "--d-model", "32"]
    args += ["--heads", "2", "--seq-len", "16", "--batch-size", "4"]
    args += ["--max-bytes", "300000", "--out", str(out)]
    assert rmsnorm.main(args) == 0  # standard promotion: optax's AdamW needs it
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert [r["step"] for r in rows] == [0, 2]
    names = ["jaxamp bf16", "jaxamp bf16, RMSNorm rule off", "hand bf16"]
    for r in rows:
        for n in names:
            assert 0 < r[n]["grad_rel_l2"] < 5e-2, (n, r)
            assert r[n]["loss_abs_err"] < 1e-2, (n, r)
    assert rows[0][names[0]] != rows[0][names[1]]
    residuals = json.loads(out.with_suffix(".json").read_text())["meta"][
        "residual_bytes_vs_fp32"
    ]
    assert sorted(residuals) == sorted(names)
    assert all(0 < r < 1 for r in residuals.values()), residuals
    md = out.read_text()
    assert "| jaxamp bf16 |" in md and "| hand bf16 |" in md


@pytest.mark.slow
def test_cross_replica_bn_benchmark_tiny(tmp_path, capsys):
    """benchmarks/cross_replica_bn.py on a one-block ResNet, one draw: Flax's
    cross-replica BatchNorm under amp (vmap axis_name and shard_map) leaves no
    bfloat16 ``sub`` in the gradient and matches amp on the whole batch."""
    import cross_replica_bn

    out, js = tmp_path / "scaleout.md", tmp_path / "r.json"
    args = ["--stages", "1", "--filters", "8", "--image", "16", "--draws", "1"]
    args += ["--inputs", "offset", "--out", str(out), "--json", str(js)]
    assert cross_replica_bn.main(args) == 0
    md = out.read_text()
    assert md.strip() in capsys.readouterr().out
    assert "| offset | amp shard_map |" in md and "Findings:" in md
    rows = json.loads(js.read_text())["results"]["offset"]
    assert list(rows) == list(cross_replica_bn.VARIANTS)
    local = rows["amp local"]["median"]
    for name in ("amp local", "amp vmap", "amp shard_map"):
        assert rows[name]["bf16_subs"] == [], (name, rows[name]["bf16_subs"])
        assert 0 < rows[name]["median"] < 0.1, (name, rows[name])
    for name in ("amp vmap", "amp shard_map"):
        assert rows[name]["median"] < 1.3 * local + 1e-6, (name, rows[name], local)
    assert rows["fp32 vmap"]["median"] < 1e-5


SUITE_PARTS = [
    "eight_bit",
    "gemm_probe",
    "gpt1024",
    "memory",
    "precision",
    "fp16_run",
    "compile",
    "eight_bit_16k",
]


@pytest.mark.slow
def test_gpu_suite_dry_run(tmp_path):
    """``python benchmarks/gpu_suite.py --dry-run`` (issue 34) runs every part
    on the CPU at tiny sizes, as a user runs it, and writes the Markdown and
    JSON with the machine, versions, date and each part's figures. How long it
    takes is the suite's to report (each part's seconds, checked present), not
    a bound here: a timed assertion fails on a loaded machine."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)  # conftest's 8 host devices are not the suite's
    # No part may be skipped here: the budget's skipping has its own test, and
    # the default 450 s runs out on a loaded 2-core machine.
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu_suite.py"), "--dry-run"]
    cmd += ["--budget-s", "3600"]
    r = subprocess.run(
        [*cmd, "--out", str(tmp_path)], env=env, capture_output=True, text=True
    )
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    md = (tmp_path / "RESULTS_GPU.md").read_text()
    data = json.loads((tmp_path / "RESULTS_GPU.json").read_text())
    meta = data["meta"]
    for key in ("device", "cpu", "python", "jax", "jaxlib", "jaxamp", "commit"):
        assert meta[key], key
    assert meta["dry_run"] and meta["backend"] == "cpu"
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", meta["date"])
    assert f"Measured {meta['date']}" in md and "**Dry run**" in md
    assert f"JAX {meta['jax']}" in md and "## README rows" in md
    parts = data["parts"]
    assert list(parts) == SUITE_PARTS  # the suite's order, none skipped
    for name, p in parts.items():
        assert "error" not in p and p["seconds"] > 0, (name, p)
        assert f"(`{name}`," in md

    gemm = parts["gemm_probe"]["rows"]
    assert [r["shape"] for r in gemm] == [[64, 64, 64]]
    for key in ("bf16_tflops", "fp8_tflops", "s8_tflops", "fp8_vs_bf16"):
        assert gemm[0][key] > 0, (key, gemm)
    sixteen = [r["variant"] for r in parts["eight_bit_16k"]["rows"]]
    assert sixteen == ["fp32", "jaxamp bf16", "jaxamp int8", "jaxamp fp8"]

    eight = {r["variant"]: r for r in parts["eight_bit"]["rows"]}
    assert list(eight) == [*sixteen, "jaxamp int8 wgrad", "jaxamp int8 wgrad nearest"]
    assert eight["jaxamp bf16"]["eight_bit_flop_share"] == 0
    for name in list(eight)[2:]:
        assert 0.5 < eight[name]["eight_bit_flop_share"] <= 1, eight[name]
        assert eight[name]["step_ms"] > 0 and eight[name]["speedup_vs_bf16"] > 0
        # 8-bit noise on top of bf16's, far from a broken gradient
        assert eight["jaxamp bf16"]["grad_rel_l2"] < eight[name]["grad_rel_l2"] < 0.5

    gpt = {r["variant"]: r for r in parts["gpt1024"]["rows"]}
    assert list(gpt) == ["fp32", "jaxamp bf16", "hand bf16 cudnn"]
    assert gpt["jaxamp bf16"]["grad_rel_l2"] < 3e-2 and gpt["fp32"]["mfu"] >= 0
    assert "unavailable on cpu" in gpt["hand bf16 cudnn"]["missing"]

    runs = parts["fp16_run"]["runs"]
    assert list(runs) == ["fp16", "bf16"]
    assert runs["fp16"]["final_loss_scale"] >= 1 and runs["bf16"]["skipped_steps"] == 0
    assert abs(runs["fp16"]["val_loss"] - runs["bf16"]["val_loss"]) < 0.05, runs

    mem = {r["variant"]: r for r in parts["memory"]["rows"]}
    for name in (
        "amp bf16, f32 master",
        "amp, bf16 params + SR, int8 state",
        "amp float16 + dynamic scaling, f32 master",
    ):  # each with and without the skip wrapper
        assert f"{name}, skip" in mem and f"{name}, no skip" in mem, list(mem)
    for r in mem.values():
        assert r["layers"] == [4, 8] and r["params"][1] > r["params"][0]
        # at least the parameters themselves (2 or 4 bytes) per added parameter
        assert 2 < r["bytes_per_param"] < 100, r
    skipped = " ".join(parts["memory"]["skipped"])
    assert ("FP8 residuals" in skipped) != gpu_suite_has_residual_dtype()
    # the dry run lowers (builds) the variants it does not compile
    lowered = parts["memory"]["lowered_only"]
    assert "amp, bf16 params + SR, int8 state, optimizer_update" in lowered
    fp8_rows = [n for n in lowered if "FP8 residuals" in n]
    assert len(fp8_rows) == (2 if gpu_suite_has_residual_dtype() else 0), lowered
    assert not set(lowered) & set(mem)

    prec = parts["precision"]
    assert [r["layers"] for r in prec["rows"]] == [1, 2] and not prec["skipped"]
    for r in prec["rows"]:
        assert r["size"] == [32, 16, 2] and r["records"] > 0, r
        assert r["ratio"] == pytest.approx(r["report_s"] / r["step_first_call_s"])
        assert r["top_ratio"] == pytest.approx(r["top_s"] / r["step_first_call_s"])
        assert 0 < r["top_s"] < r["report_s"]  # the analysis runs after top()
        assert r["top"] in {"attn", "mlp", "head"}, r
    assert prec["ratio_growth"] == pytest.approx(
        prec["rows"][1]["ratio"] / prec["rows"][0]["ratio"]
    )

    comp = {r["variant"]: r for r in parts["compile"]["rows"]}
    assert list(comp) == ["jaxamp bf16", "hand bf16 xla"]  # no cuDNN on CPU
    assert all(r["compile_s"] > 0 and r["trace_s"] > 0 for r in comp.values())


def gpu_suite_has_residual_dtype() -> bool:
    import gpu_suite

    return gpu_suite.has_residual_dtype()


def test_gpu_suite_budget_skips_with_reasons(capsys):
    """Parts run in the suite's order; one whose estimate exceeds the budget
    left is skipped with a printed reason while cheaper later parts still run;
    one that raises is recorded and the next runs."""
    import gpu_suite as gs

    ran = []

    def make(name, fail=False):
        def run(dry_run, budget):
            ran.append(name)
            if fail:
                raise RuntimeError("boom")
            return {"md": [f"{name} ran"], "skipped": [] if dry_run else ["x"]}

        return run

    parts = [
        gs.Part("a", "A", make("a"), (1e9, 0.0)),
        gs.Part("big", "Big", make("big"), (1e9, 1e9)),
        gs.Part("bad", "Bad", make("bad", fail=True), (0.0, 0.0)),
        gs.Part("c", "C", make("c"), (1e9, 0.0)),
    ]
    out = gs.run_parts(parts, dry_run=True, budget=gs.Budget(100.0))
    assert ran == ["a", "bad", "c"]
    assert list(out) == ["a", "big", "bad", "c"]
    (reason,) = out["big"]["skipped"]
    assert (
        reason.startswith("big: skipped, needs ~1000000000 s")
        and "--budget-s 100" in reason
    )
    assert reason in capsys.readouterr().out
    assert out["bad"]["error"] == "RuntimeError: boom"
    assert "c ran" in out["c"]["md"]
    assert gs.Budget(0.0).skip_reason("x", 1.0).startswith("x: skipped")
    assert gs.Budget(10.0).skip_reason("x", 1.0) is None

    # A part 3x slower than estimated scales the next estimate: 4 s -> 12 s,
    # more than the 10 s budget (4 s alone would fit).
    slow = gs.Part("slow", "Slow", lambda d, b: time.sleep(0.3) or {}, (0.0, 0.1))
    nxt = gs.Part("next", "Next", make("next"), (0.0, 4.0))
    out = gs.run_parts([slow, nxt], dry_run=True, budget=gs.Budget(10.0))
    assert "next" not in ran and out["next"]["skipped"][0].startswith("next: skipped")


def test_gpu_suite_names_and_features(monkeypatch):
    """The suite's gpt1024 variants exist in gpu_attention.py (a rename would
    otherwise drop them silently), and the FP8-residual memory variant appears
    exactly when ``jaxamp.amp`` takes ``residual_dtype=``."""
    import gpu_attention
    import gpu_suite as gs

    assert set(gs.GPT1024_VARIANTS) <= set(gpu_attention.variants("tiny"))
    names = lambda: [v.name for v in gs.memory_variants()]
    monkeypatch.setattr(gs, "has_residual_dtype", lambda: False)
    assert not any("FP8" in n for n in names())
    monkeypatch.setattr(gs, "has_residual_dtype", lambda: True)
    assert "amp bf16, FP8 residuals, f32 master, skip" in names()


def test_gpu_suite_refuses_a_cpu_without_dry_run(tmp_path, capsys):
    """Without a GPU and without --dry-run the suite stops before measuring
    and writes nothing (the committed results stay); unknown parts are named."""
    import gpu_suite as gs

    if jax.default_backend() == "gpu":
        pytest.skip("a GPU is present")
    assert gs.main(["--out", str(tmp_path)]) == 2
    assert "JAX sees no GPU" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())
    with pytest.raises(SystemExit):
        gs.main(["--dry-run", "--parts", "eight_bit,bogus"])
    assert "unknown ['bogus']" in capsys.readouterr().err


def test_readme_gpu_rows_name_their_date():
    """Every README table row that cites RESULTS_GPU.md names the date of its
    figures, and RESULTS_GPU.md says it measured on that date."""
    readme = (ROOT / "README.md").read_text()
    results = (ROOT / "benchmarks" / "RESULTS_GPU.md").read_text()
    rows = [
        ln
        for ln in readme.splitlines()
        if ln.startswith("|") and "RESULTS_GPU.md" in ln
    ]
    assert rows
    for row in rows:
        dates = re.findall(r"\d{4}-\d{2}-\d{2}", row)
        assert dates, f"README row without a date: {row}"
        for d in dates:
            assert re.search(rf"Measured[^.]*{d}", results), (d, row)


def test_fit_table_orders_the_recipes_by_their_peak(monkeypatch, tmp_path):
    # fit_table.py's step, compiled for XLA:CPU on a small GPT: float32 master
    # weights peak highest and the leanest recipe lowest, and the cache reused.
    # The two recipes between them (bf16 + SR, int8 AdamW in the backward pass)
    # are not ordered at this size: on JAX 0.12's XLA:CPU the in-backward
    # step's temporaries outweigh its smaller state at width 256 (22.7 MB
    # against 21.6 MB); the H100 target's order at 1B+ is fit_table's table.
    import fit_table

    monkeypatch.setattr(fit_table, "SEQ", 64)
    monkeypatch.setattr(fit_table, "VOCAB", 256)
    size = fit_table.Size("tiny", 256, 2, 4)
    monkeypatch.setattr(fit_table, "SIZES", [size])
    cache = tmp_path / "cache.jsonl"
    fit_table.main(["--targets", "cpu", "--cache", str(cache)])
    rows = [json.loads(line) for line in cache.read_text().splitlines()]
    assert [r["key"][1] for r in rows] == [r.name for r in fit_table.RECIPES]
    peaks = [r["peak"] for r in rows]
    assert peaks[0] == max(peaks) and peaks[-1] == min(peaks), peaks
    assert len(set(peaks)) == len(peaks), peaks
    n = rows[0]["n"]
    # float32 master weights: 16 bytes stored per parameter, and more at the peak
    assert peaks[0] / n > 16 and peaks[-1] < peaks[0] / 2, (peaks, n)
    calls = []
    monkeypatch.setattr(fit_table, "step_peak", lambda *a: calls.append(a))
    fit_table.main(["--targets", "cpu", "--cache", str(cache)])
    assert calls == []
