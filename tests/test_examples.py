"""End-to-end runs of the examples on tiny settings (the main job must not rot)."""

import io
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import train_charlm
import train_digits
from helpers import TINY_CHARLM

import jaxamp

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_charlm_all_modes_end_to_end(tmp_path):
    # Runs under conftest's strict dtype promotion: the model and the amp'd
    # losses must not rely on implicit promotion (only optax's update is
    # traced under standard promotion, inside the example).
    assert jax.config.jax_numpy_dtype_promotion == "strict"
    cfg = train_charlm.Config(
        steps=25,
        batch_size=8,
        seq_len=32,
        d_model=32,
        layers=2,
        heads=2,
        warmup=3,
        max_bytes=200_000,
        eval_batches=2,
        sample_chars=16,
        out=str(tmp_path),
    )
    report = train_charlm.run(cfg, progress=False)
    saved = json.loads((tmp_path / "charlm_results.json").read_text())
    assert (tmp_path / "charlm_loss.png").stat().st_size > 1000
    assert [r["mode"] for r in saved["results"]] == ["fp32", "bf16", "fp16"]
    assert saved["total_wall_s"] >= sum(r["wall_s"] for r in saved["results"])
    assert saved["unigram_entropy_bits"] == pytest.approx(
        report["unigram_entropy_bits"]
    )
    for r in saved["results"]:
        for key in (
            "final_train_loss",
            "val_loss",
            "val_bits_per_char",
            "tokens_per_s",
            "skipped_steps",
            "final_loss_scale",
            "low_precision_flop_share",
            "residual_bytes_vs_fp32",
            "sample",
            "wall_s",
        ):
            assert key in r, key
        losses = r["losses"]
        assert len(losses) == 25
        assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.3  # it learned
        assert np.isfinite(r["val_loss"])
        assert len(r["sample"]) > 0
        assert r["val_bits_per_char"] == pytest.approx(r["val_loss"] / math.log(2))
    assert f"| {saved['results'][-1]['mode']} |" in saved["table"]
    fp32, bf16, fp16 = saved["results"]
    for low in (bf16, fp16):  # same seed, data and step count as fp32
        assert abs(low["val_loss"] - fp32["val_loss"]) < 0.02 * fp32["val_loss"]
    assert fp32["residual_bytes_vs_fp32"] == 1.0
    assert fp32["low_precision_flop_share"] == 0.0
    assert bf16["low_precision_flop_share"] == 1.0
    assert fp16["low_precision_flop_share"] == 1.0
    # Both save a low-precision copy of the checkpointed, scanned layers' weights
    # (cast once before the loop, as by hand), which weighs in this tiny model.
    assert bf16["residual_bytes_vs_fp32"] < 1.0
    assert fp16["residual_bytes_vs_fp32"] < 1.0
    assert np.isfinite(fp16["final_loss_scale"]) and fp16["final_loss_scale"] >= 1
    assert fp32["final_loss_scale"] == 1.0  # static (no-op) scaler


def test_charlm_unreadable_data_dir_is_a_one_line_error(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / "train_charlm.py"),
            "--data-dir",
            str(tmp_path / "nowhere"),
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        # the example imports jaxamp from this checkout, installed or not
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join(
                [str(ROOT), os.environ.get("PYTHONPATH", "")]
            ),
            # a JAX newer than tested warns at import; not this test's subject
            "PYTHONWARNINGS": "ignore:jaxamp is tested with JAX:UserWarning",
        },
    )
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: data folder")
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--heads", "3"], "not divisible by --heads 3"),
        (["--steps", "0"], "--steps must be at least 1"),
        (["--eval-every", "-1"], "--eval-every must be at least 0"),
    ],
)
def test_charlm_bad_flags_are_usage_errors(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        train_charlm.main(flags)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_charlm_empty_data_dir(tmp_path):
    with pytest.raises(train_charlm.DataError, match="no readable Python files"):
        train_charlm.load_corpus(str(tmp_path), 1000)
    for i in range(3):
        (tmp_path / f"m{i}.py").write_text("x = 1\n")
    with pytest.raises(train_charlm.DataError, match="too few Python files"):
        train_charlm.load_corpus(str(tmp_path), 1000)


def test_charlm_split_shorter_than_a_window_is_a_data_error(tmp_path):
    for i in range(10):  # file 9, the validation split, is 6 bytes long
        (tmp_path / f"m{i}.py").write_text("x = 1\n" * (1 if i == 9 else 100))
    cfg = train_charlm.Config(data_dir=str(tmp_path), seq_len=64, out=str(tmp_path))
    with pytest.raises(train_charlm.DataError, match="validation split is shorter"):
        train_charlm.run(cfg, progress=False)


def test_corpus_split_is_deterministic_and_whole_files(tmp_path):
    for i in range(20):
        (tmp_path / f"m{i:02d}.py").write_text(f"x = {i}\n")
    (tmp_path / "test").mkdir()
    (tmp_path / "test" / "t.py").write_text("excluded = 1\n")
    train, val = train_charlm.load_corpus(str(tmp_path), 10**6)
    assert bytes(val) == b"x = 9\nx = 19\n"  # files 9 and 19, whole
    assert b"excluded" not in bytes(train) + bytes(val)
    assert train_charlm.unigram_entropy_bits(np.frombuffer(b"abab", np.uint8)) == 1.0


def _curves(offset):
    losses = np.linspace(5.5, 2.5, 30)
    return [
        {
            "mode": mode,
            "losses": list(losses + k * offset),
            "val_bits_per_char": (2.6 + k * offset) / math.log(2),
        }
        for k, mode in enumerate(("fp32", "bf16", "fp16"))
    ]


def test_charlm_plot_is_in_bits_per_char_and_says_why_curves_overlap():
    import matplotlib.pyplot as plt

    results = _curves(0.01)  # nats: 0.0289 bits between the extreme modes
    fig = train_charlm.loss_figure(results, unigram_bits=4.5)
    try:
        ax = fig.axes[0]
        assert ax.get_ylabel() == "cross-entropy (bits/char)"
        lines = ax.get_lines()
        for r, train, val in zip(results, lines[0:6:2], lines[1:6:2]):
            np.testing.assert_allclose(
                train.get_ydata(), np.asarray(r["losses"]) / math.log(2), rtol=1e-12
            )
            assert val.get_ydata()[0] == r["val_bits_per_char"]
            assert val.get_xdata()[0] == len(r["losses"]) - 1
        assert list(lines[6].get_ydata()) == [4.5, 4.5]  # unigram entropy, bits
        assert ax.get_title() == (
            "the curves overlap because the modes train alike "
            f"(mean gap between the modes {0.02 / math.log(2):.3f} bits/char)"
        )
        assert fig.texts[0].get_text() == "char-level GPT on the Python stdlib"
    finally:
        plt.close(fig)
    apart = train_charlm.loss_figure(_curves(0.2))
    try:  # 0.577 bits apart: no claim that they overlap
        assert apart.axes[0].get_title() == (
            f"mean gap between the modes {0.4 / math.log(2):.3f} bits/char"
        )
    finally:
        plt.close(apart)


def test_charlm_progress_bar_flushes_the_lines_printed_before_it(monkeypatch):
    events = []

    class Out(io.StringIO):
        def flush(self):
            events.append("stdout flushed")

    class Err(io.StringIO):
        def write(self, s):
            events.append("bar drawn")
            return super().write(s)

    monkeypatch.setattr(sys, "stdout", Out())
    monkeypatch.setattr(sys, "stderr", Err())
    bar = train_charlm._progress(3, "bf16", enabled=True)
    bar.close()
    assert events[0] == "stdout flushed" and "bar drawn" in events
    assert train_charlm._progress(3, "bf16", enabled=False) is None


@pytest.mark.slow
def test_digits_learns_in_each_mode():
    for mode in ("fp32", "bf16", "fp16"):
        r = train_digits.train(mode, steps=60)
        assert r["test_accuracy"] > 0.85, r
        assert np.isfinite(r["loss_scale"])


@pytest.mark.parametrize("mode", ["int8", "fp8"])
def test_charlm_8bit_modes_run_their_matmuls_in_8_bits(mode):
    # The small model is below the default size rules: the example quantizes
    # every matmul but the head (it feeds the loss), so most of the step's
    # matmul FLOPs are 8-bit.
    cfg = train_charlm.Config(batch_size=2, seq_len=16, d_model=64, layers=2, heads=2)
    params = train_charlm.init_params(jax.random.key(0), cfg)
    x = np.zeros((2, 16), np.int32)
    loss = train_charlm.mode_loss(mode, cfg)
    share = jaxamp.tools.eight_bit_flop_share(
        jax.make_jaxpr(jax.grad(loss))(params, x, x)
    )
    assert share > 0.5


@pytest.mark.parametrize(
    "rounding, state, total",
    [
        ("stochastic", "bfloat16", 8.0),
        ("kahan", "int8", 8.0),
        ("plain", "bfloat16", None),
    ],
)
def test_charlm_bfloat16_parameters(rounding, state, total):
    # bf16 parameters: 2 bytes each, bf16 gradients (2), AdamW state 4 (bf16
    # moments), 2.03 + 2 (int8 moments + Kahan buffer) with a few small tensors
    # in bf16; the naive recipe's state is whatever optax makes of it.
    cfg = train_charlm.Config(
        **TINY_CHARLM,
        steps=12,
        max_bytes=200_000,
        param_dtype="bfloat16",
        param_rounding=rounding,
        opt_state_dtype=state,
    )
    data = train_charlm.load_corpus(None, cfg.max_bytes)
    r = train_charlm.train(cfg, "bf16", data, progress=False)
    assert r["label"].startswith("bf16, bf16 params")
    per = r["bytes_per_param"]
    assert per["params"] == 2.0 and per["grads"] == 2.0
    if total is not None:
        assert abs(per["total"] - total) < 0.25, per
    assert np.isfinite(r["val_loss"]) and r["losses"][-1] < r["losses"][0] - 0.3


def test_charlm_param_dtype_flag_is_checked(capsys):
    with pytest.raises(SystemExit) as exit_info:
        train_charlm.main(["--param-dtype", "float16"])
    assert exit_info.value.code == 2
    assert "--param-dtype: invalid choice" in capsys.readouterr().err


@pytest.mark.parametrize(
    "optimizer, state", [("adafactor", "float32"), ("lion", "int8")]
)
def test_charlm_one_moment_optimizers_in_the_backward_pass(optimizer, state):
    # The leanest recipe and Lion with int8 state, updated inside
    # the backward pass: no gradient tree, bf16 parameters (2 bytes) and
    # nearly no state for the factored moments, 1 byte for Lion's int8 one.
    cfg = train_charlm.Config(
        **{**TINY_CHARLM, "d_model": 128},  # factored: both axes >= 128
        steps=12,
        max_bytes=200_000,
        param_dtype="bfloat16",
        opt_state_dtype=state,
        residual_dtype="int8",
        update_in_backward=True,
        optimizer=optimizer,
    )
    data = train_charlm.load_corpus(None, cfg.max_bytes)
    r = train_charlm.train(cfg, "bf16", data, progress=False)
    assert f"update in backward, {optimizer}, bf16 params" in r["label"]
    per = r["bytes_per_param"]
    assert per["params"] == 2.0 and per["grads"] == 0.0, per
    want = 2.0 if optimizer == "adafactor" else 3.0
    assert want <= per["total"] < want + 0.35, per
    assert np.isfinite(r["val_loss"]) and r["losses"][-1] < r["losses"][0] - 0.3


@pytest.mark.parametrize("mode", ["jmp_bf16", "hand_bf16"])
def test_charlm_baseline_modes_run_in_bfloat16_without_amp(mode):
    # jmp's cast-everything policy and the hand-written model: every matmul of
    # the gradient in bfloat16, a float32 loss within bfloat16's rounding of
    # float32's at initialisation, float32 gradients for float32 parameters.
    cfg = train_charlm.Config(batch_size=2, seq_len=16, d_model=64, layers=2, heads=2)
    params = train_charlm.init_params(jax.random.key(0), cfg)
    x = np.random.default_rng(0).integers(0, 256, (2, 16)).astype(np.int32)
    loss = train_charlm.mode_loss(mode, cfg)
    # jax.nn.dot_product_attention on bfloat16 inputs promotes with float32 in
    # JAX's own code, which strict promotion (conftest) rejects
    with jax.numpy_dtype_promotion("standard"):
        _check_bfloat16_baseline(mode, cfg, params, x, loss)


def _check_bfloat16_baseline(mode, cfg, params, x, loss):
    jaxpr = jax.make_jaxpr(jax.grad(loss))(params, x, x)
    # all but the attention scores (float32 in jax.nn.dot_product_attention)
    assert jaxamp.tools.low_precision_flop_share(jaxpr) > 0.95
    value, grads = jax.value_and_grad(loss)(params, x, x)
    ref = train_charlm.mode_loss("fp32", cfg)(params, x, x)
    assert value.dtype == np.float32
    assert abs(float(value) - float(ref)) < 1e-2 * float(ref)
    assert {g.dtype for g in jax.tree.leaves(grads)} == {np.dtype(np.float32)}
    # LayerNorm's normalisation (its rsqrt): float32 in the hand-written
    # model, bfloat16 under jmp's cast-everything policy
    rsqrt_dtypes = {
        e.outvars[0].aval.dtype
        for e, _ in jaxamp.tools.iter_equations(jax.make_jaxpr(loss)(params, x, x))
        if e.primitive.name == "rsqrt"
    }
    expected = np.float32 if mode == "hand_bf16" else jnp.bfloat16
    assert rsqrt_dtypes == {np.dtype(expected)}


def test_charlm_validation_curve_leaves_training_unchanged():
    # --eval-every measures the validation loss on the final evaluation's
    # batches along the run; the training losses and the final validation loss
    # are those of a run without it, bit for bit.
    cfg = train_charlm.Config(**TINY_CHARLM, steps=6, max_bytes=200_000)
    data = train_charlm.load_corpus(None, cfg.max_bytes)
    plain = train_charlm.train(cfg, "bf16", data, progress=False)
    cfg.eval_every = 4
    curve = train_charlm.train(cfg, "bf16", data, progress=False)
    assert curve["losses"] == plain["losses"]
    assert curve["val_loss"] == plain["val_loss"]
    assert [s for s, _ in curve["val_curve"]] == [4, 6]
    assert plain["val_curve"] == [(6, plain["val_loss"])]
    assert curve["val_curve"][0][1] != curve["val_loss"]  # measured at step 4
