"""The seed study's harness (benchmarks/seed_study.py): its statistics on known
numbers, its plan, and a tiny study that trains, resumes and reports."""

import json
import math

import jax
import numpy as np
import pytest
import seed_study
import train_charlm
from scipy import stats

TINY = dict(
    batch_size=4,
    seq_len=32,
    d_model=32,
    layers=1,
    heads=2,
    warmup=2,
    eval_batches=1,
    max_bytes=200_000,
)


def test_paired_interval_on_known_numbers():
    # differences 1, 2, 3: mean 2, sd 1; Student's t with 2 degrees of freedom
    # has the closed-form quantile (2p - 1) / sqrt(2 p (1 - p)), 4.3027 at 0.975
    mean, lo, hi = seed_study.paired_interval([11.0, 12.0, 13.0], [10.0, 10.0, 10.0])
    half = 0.95 / math.sqrt(2 * 0.975 * 0.025) / math.sqrt(3)
    assert mean == 2.0
    assert lo == pytest.approx(2 - half, rel=1e-12)
    assert hi == pytest.approx(2 + half, rel=1e-12)


def test_paired_interval_matches_scipy_ttest_rel():
    rng = np.random.default_rng(3)
    ref = 2.44 + 0.01 * rng.standard_normal(5)
    val = ref + 0.004 + 0.003 * rng.standard_normal(5)
    ci = stats.ttest_rel(val, ref).confidence_interval(0.95)
    mean, lo, hi = seed_study.paired_interval(list(val), list(ref))
    assert mean == pytest.approx(float(np.mean(val - ref)), rel=1e-12)
    assert (lo, hi) == pytest.approx((ci.low, ci.high), rel=1e-10)


def test_paired_interval_refuses_one_pair():
    with pytest.raises(ValueError, match="at least 2 pairs"):
        seed_study.paired_interval([2.4], [2.5])
    with pytest.raises(ValueError, match="equal length"):
        seed_study.paired_interval([2.4, 2.5, 2.6], [2.5, 2.4])


def test_verdict_band_is_half_a_percent_of_the_reference():
    ref = 2.0  # band +-0.01 nats
    assert seed_study.verdict(-0.009, 0.0099, ref) == "matches float32"
    assert seed_study.verdict(-0.009, 0.0101, ref).startswith("undecided")
    assert seed_study.verdict(0.0101, 0.05, ref) == "above float32"
    assert seed_study.verdict(-0.05, -0.0101, ref) == "below float32"
    assert seed_study.verdict(float("nan"), 0.0, ref) == "diverged"


def test_plan_runs_the_reference_first_and_seed_by_seed():
    runs = seed_study.plan(["bf16", "fp8", "fp32", "jmp_bf16"], [0, 1], None)
    assert runs[:4] == [
        ("fp32", 300, 0),
        ("bf16", 300, 0),
        ("fp32", 300, 1),
        ("bf16", 300, 1),
    ]
    assert runs[4:6] == [("fp8", 300, 0), ("fp8", 300, 1)]
    assert runs[6:8] == [("jmp_bf16", 300, 0), ("jmp_bf16", 300, 1)]
    # the long runs: only the recipes of LONG_RECIPES
    assert runs[8:] == [
        ("fp32", 1500, 0),
        ("bf16", 1500, 0),
        ("fp32", 1500, 1),
        ("bf16", 1500, 1),
        ("fp8", 1500, 0),
        ("fp8", 1500, 1),
    ]


def test_tiny_study_trains_resumes_and_reports(tmp_path):
    out, results = tmp_path / "runs", tmp_path / "RESULTS_SEEDS.md"
    runs = seed_study.plan(["fp32", "bf16"], [0, 1], [5])
    done = seed_study.run_study(runs, out, TINY, log=lambda s: None)
    assert len(done) == 4
    rec = {(r["recipe"], r["seed"]): r for r in seed_study.load_runs(out)}
    assert set(rec) == {("fp32", 0), ("fp32", 1), ("bf16", 0), ("bf16", 1)}
    for r in rec.values():
        assert len(r["losses"]) == 5 and r["steps"] == 5
        assert [s for s, _ in r["val_curve"]] == [1, 2, 3, 4, 5]
        assert r["val_curve"][-1][1] == r["val_loss"]
        assert r["val_bits_per_char"] == pytest.approx(r["val_loss"] / math.log(2))
        assert r["skipped_steps"] == 0 and r["forward_overflows"] == 0
        assert r["diverged"] is False
    # the seed moves initialisation and data: different losses from step 1
    assert rec["fp32", 0]["losses"][0] != rec["fp32", 1]["losses"][0]

    # resume: nothing is retrained; a deleted run is the only one retrained
    stamp = {p: p.stat().st_mtime_ns for p in done}
    assert seed_study.run_study(runs, out, TINY, log=lambda s: None) == []
    assert {p: p.stat().st_mtime_ns for p in done} == stamp
    gone = seed_study.run_path(out, "bf16", 5, 1)
    gone.unlink()
    assert seed_study.run_study(runs, out, TINY, log=lambda s: None) == [gone]
    again = json.loads(gone.read_text())
    assert again["val_loss"] == rec["bf16", 1]["val_loss"]  # deterministic
    # a run of another configuration in the same folder is refused
    with pytest.raises(ValueError, match="another configuration"):
        seed_study.run_study(runs, out, {**TINY, "d_model": 16}, log=lambda s: None)

    # one unit in the last place of every initial parameter: close at first,
    # not the same run; such runs belong in another folder
    with pytest.raises(ValueError, match="another configuration"):
        seed_study.run_study(runs, out, TINY, log=lambda s: None, nudge=True)
    (path,) = seed_study.run_study(
        [("fp32", 5, 0)], tmp_path / "nudged", TINY, log=lambda s: None, nudge=True
    )
    nudged = json.loads(path.read_text())
    assert nudged["nudged_init"] and not rec["fp32", 0]["nudged_init"]
    assert nudged["losses"][0] == pytest.approx(rec["fp32", 0]["losses"][0], abs=1e-5)
    cfg = seed_study.run_config("fp32", 5, 0, TINY)
    plain = jax.tree.leaves(train_charlm.initial_params(cfg))
    moved = jax.tree.leaves(seed_study._nudged_initial_params(cfg))
    for a, b in zip(plain, moved):  # every element one float32 step up
        a, b = np.asarray(a), np.asarray(b)
        assert np.array_equal(b, np.nextafter(a, np.float32(np.inf)))

    table = seed_study.report(out, results)
    row = next(
        r
        for r in seed_study.summarize(seed_study.load_runs(out))
        if r["recipe"] == "bf16"
    )
    diffs = [rec["bf16", s]["val_loss"] - rec["fp32", s]["val_loss"] for s in (0, 1)]
    assert row["paired"] == 2 and row["diff"] == pytest.approx(np.mean(diffs))
    assert row["std"] == pytest.approx(
        np.std([rec["bf16", s]["val_loss"] for s in (0, 1)], ddof=1)
    )
    text = results.read_text()
    assert table in text and "| 5 | bf16 | 2 |" in table
    assert seed_study.plot_path(results, 5).stat().st_size > 10_000
    # a second report replaces its block and keeps the prose around it
    results.write_text("prose before\n" + text + "prose after\n")
    seed_study.report(out, results)
    assert results.read_text().count(seed_study.BEGIN) == 1
    assert results.read_text().startswith("prose before")
    assert results.read_text().endswith("prose after\n")


def test_seeds_flag_is_a_count_or_a_list():
    assert seed_study._parse_seeds("5") == [0, 1, 2, 3, 4]
    assert seed_study._parse_seeds("0-0") == [0]
    assert seed_study._parse_seeds("0,3-4") == [0, 3, 4]
    with pytest.raises(ValueError, match="at least 1"):
        seed_study._parse_seeds("0")
