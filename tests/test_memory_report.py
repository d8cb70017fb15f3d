"""``jaxamp.memory_report``: saved residuals by scope, primitive and stored
dtype, their total against JAX's saved-residuals listing, the compiled step's
bytes, the table and the saved JSON/PNG."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import checkpoint_name

import jaxamp
from jaxamp._policy._checkpoint import STORED_PRODUCT

K = jax.random.split(jax.random.key(7), 4)
BF16 = jnp.bfloat16


def loss(params, x):
    def layer(h, w):
        with jax.named_scope("block"):
            return h + jnp.tanh(h @ w) @ w.T, None

    h, _ = jax.lax.scan(layer, x, params["layers"])
    with jax.named_scope("head"):
        return jnp.mean(jax.nn.gelu(h @ params["out"]) ** 2)


@pytest.fixture(scope="module")
def args():
    params = {
        "layers": jax.random.normal(K[0], (3, 64, 64)) / 8,
        "out": jax.random.normal(K[1], (64, 128)) / 8,
    }
    return params, jax.random.normal(K[2], (16, 64))


@pytest.mark.parametrize("residual_dtype", [None, jnp.float8_e4m3fn, "int8"])
def test_total_equals_jax_saved_residuals(args, residual_dtype):
    r = jaxamp.memory_report(
        loss, *args, compute_dtype=BF16, residual_dtype=residual_dtype, compile=False
    )
    amp = jaxamp.amp(loss, compute_dtype=jnp.bfloat16, residual_dtype=residual_dtype)
    want = jaxamp.saved_residual_bytes(amp, *args)
    assert isinstance(r.residual_bytes, int)
    assert abs(r.residual_bytes - want) <= 0.02 * want
    assert sum(row.count for row in r.rows) >= len(r.by("dtype"))


def test_rows_name_scope_primitive_dtype_and_source(args):
    # int8: the block's values are all products' inputs (FP8 leaves those in
    # bfloat16).
    r = jaxamp.memory_report(loss, *args, compute_dtype=BF16, residual_dtype="int8")
    # The scanned block's values are 8-bit copies with a stacked axis of 3,
    # traced back into the scan body: scope "block", this file's lines.
    block = [row for row in r.rows if row.scope == "block"]
    assert block and {row.dtype for row in block} >= {"int8", "float32"}
    assert all(row.shape[0] == 3 for row in block)
    assert all("test_memory_report.py" in row.source for row in block)
    assert any(row.primitive == "encode" for row in block)
    assert set(r.by("scope")) >= {"block", "head"}
    assert sum(r.by("dtype").values()) == r.residual_bytes
    # Arguments and the compiled step (memory_analysis) are reported.
    assert r.argument_bytes == (3 * 64 * 64 + 64 * 128 + 16 * 64) * 4
    assert r.compiled["argument"] >= r.argument_bytes and r.temp_bytes > 0
    plain = jaxamp.memory_report(loss, *args, compute_dtype=None, compile=False)
    assert {row.dtype for row in plain.rows} == {"float32"}
    assert r.residual_bytes < 0.5 * plain.residual_bytes


def test_table_and_save(args, tmp_path):
    r = jaxamp.memory_report(
        loss, *args, compute_dtype="bf16", residual_dtype="int8", compile=False
    )
    assert r.settings == {"compute_dtype": "bfloat16", "residual_dtype": "int8"}
    text = str(r)
    assert "saved residuals" in text and "int8" in text and "block" in text
    assert len(text.splitlines()) == 4 + len(r.rows)
    jpath, ppath = r.save(str(tmp_path / "out"))
    with open(jpath) as f:
        data = json.load(f)
    assert data["residual_bytes"] == r.residual_bytes
    assert [row["bytes"] for row in data["rows"]] == [row.bytes for row in r.rows]
    with open(ppath, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def checkpointed(params, x):
    def layer(h, w):
        a = checkpoint_name(h + jnp.tanh(h @ w) @ w.T, "act")
        return a + jnp.tanh(a @ w) @ w.T, None

    policy = jax.checkpoint_policies.save_only_these_names("act")
    h, _ = jax.lax.scan(jax.checkpoint(layer, policy=policy), x, params["layers"])
    return jnp.mean(h @ params["out"])


@pytest.mark.parametrize("residual_dtype", [jnp.float8_e4m3fn, "int8"])
def test_checkpoint_values_with_stored_dtype_and_rule(args, residual_dtype):
    # The checkpoint saves its input h and the named "act"; both feed a
    # matmul in the recomputed block: both formats store them in int8 (FP8
    # through its product form). The report names each, its stored dtype
    # and the rule.
    stored, rule = "int8", STORED_PRODUCT
    r = jaxamp.memory_report(
        checkpointed,
        *args,
        compute_dtype=BF16,
        residual_dtype=residual_dtype,
        compile=False,
    )
    got = {c.value: (c.shape, c.dtype, c.rule) for c in r.checkpoints}
    assert got == {
        "input h": ((16, 64), stored, rule),
        "name 'act'": ((16, 64), stored, rule),
    }
    assert all("test_memory_report.py" in c.source for c in r.checkpoints)
    text = str(r)
    assert "saved at jax.checkpoint boundaries" in text
    assert text.count(rule) == 2 and "name 'act'" in text
    assert [c["value"] for c in r.to_json()["checkpoints"]] == list(got)
    # Their stacked saved arrays (3 layers) are in that dtype.
    per_layer = [row for row in r.rows if row.shape == (3, 16, 64)]
    assert sum(row.count for row in per_layer if row.dtype == stored) == 2
    plain = jaxamp.memory_report(checkpointed, *args, compute_dtype=BF16, compile=False)
    assert plain.checkpoints == [] and "boundaries" not in str(plain)


def test_bad_input(args):
    with pytest.raises(TypeError, match=r"memory_report\(fn, params"):
        jaxamp.memory_report(np.ones(3), *args)
    with pytest.raises(ValueError, match="residual_dtype"):
        jaxamp.memory_report(loss, *args, residual_dtype=jnp.float16)
    r = jaxamp.memory_report(loss, *args, compile=False)
    with pytest.raises(ValueError, match="one of 'scope'"):
        r.by("line")
