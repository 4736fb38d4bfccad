"""The comparison job, end to end on the fallback dataset with tiny settings."""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import compare
from experiments.lib.models import (
  ResNet18,
  ResNet50,
  SmallCNN,
  TransformerEncoder,
  jact_layers,
  plain_layers,
)

pytestmark = pytest.mark.slow  # the comparison job trains small models end to end


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  empty = tmp_path_factory.mktemp("no_data")
  out = tmp_path_factory.mktemp("out") / "rows.json"
  mp = pytest.MonkeyPatch()
  mp.setenv("JACT_DATA", str(empty))  # no data kit: "auto" falls back to sklearn digits
  try:
    rows = compare.main(
      [
        "--steps",
        "3",
        "--batch",
        "16",
        "--bits",
        "8",
        "2",
        "--dataset",
        "auto",
        "--widths",
        "4",
        "8",
        "8",
        "--no-progress",
        "--json",
        str(out),
      ]
    )
  finally:
    mp.undo()
  return rows, out


def test_rows_for_plain_and_each_bits(run):
  rows, _ = run
  assert [r["variant"] for r in rows] == ["plain", "jact8", "jact2"]
  assert [r["bits"] for r in rows] == [None, 8, 2]
  assert all(r["dataset"] == "sklearn_digits" and r["steps"] == 3 for r in rows)


def test_losses_finite_and_same_start(run):
  rows, _ = run
  for r in rows:
    assert len(r["losses"]) == 3 and all(math.isfinite(v) for v in r["losses"])
    assert math.isfinite(r["final_loss"]) and 0.0 <= r["test_accuracy"] <= 1.0
  # Same initial parameters and the same first batch, and the twins' forward is
  # exact: the first loss agrees (up to float reassociation, rtol 1e-5).
  first = [r["losses"][0] for r in rows]
  np.testing.assert_allclose(first, first[0], rtol=1e-5)
  assert abs(first[0] - math.log(10)) < 1.0  # an untrained 10-class classifier


def test_memory_columns(run):
  rows, _ = run
  plain, j8, j2 = rows
  assert j2["residual_bytes"] * 8 <= plain["residual_bytes"]
  assert j2["residual_bytes"] < j8["residual_bytes"] < plain["residual_bytes"]
  assert plain["residual_ratio"] == 1.0
  assert j2["residual_ratio"] == pytest.approx(j2["residual_bytes"] / plain["residual_bytes"])
  assert all(r["temp_bytes"] > 0 and r["step_time_s"] > 0 for r in rows)


def test_json_and_table(run):
  rows, out = run
  written = json.loads(out.read_text())
  assert written["rows"] == rows
  assert {"date", "command", "jax", "flax", "device"} <= set(written["meta"])
  table = compare.format_table(rows)
  lines = table.splitlines()
  assert lines[0].split()[0] == "variant" and len(lines) == 2 + len(rows) + 1
  assert lines[2].split()[0] == "plain" and lines[4].split()[0] == "jact2"


def test_residual_bytes_excludes_arguments():
  x = jnp.ones((64, 32))
  w = jnp.ones((32, 16))
  # tanh saves its output (a new array); the matmul's operands are arguments.
  f = lambda x, w: jnp.tanh(x @ w).sum()
  saved = compare.residual_bytes(f, x, w)
  assert saved >= 64 * 16 * 4
  assert compare.residual_bytes(lambda x, w: (x @ w).sum(), x, w) == 0


def test_bad_settings():
  with pytest.raises(ValueError, match="optimizer must be"):
    compare.run_comparison(steps=1, optimizer="lbfgs", dataset="sklearn_digits")
  with pytest.raises(ValueError, match="steps must be"):
    compare.run_comparison(steps=0, dataset="sklearn_digits")
  with pytest.raises(ValueError, match="unknown dataset"):
    compare.run_comparison(steps=1, dataset="imagenet")


@pytest.mark.parametrize(
  "make, x",
  [
    (lambda L: SmallCNN(widths=(4, 8, 8), layers=L), jnp.zeros((2, 8, 8, 1))),
    (lambda L: ResNet18(width=4, layers=L), jnp.zeros((2, 16, 16, 3))),
    (lambda L: ResNet50(width=2, stem="imagenet", layers=L), jnp.zeros((1, 32, 32, 3))),
    (
      lambda L: TransformerEncoder(2, 16, 4, 32, vocab_size=20, num_classes=3, layers=L),
      jnp.zeros((2, 6), jnp.int32),
    ),
  ],
)
def test_twin_models_share_the_plain_variables(make, x):
  # Shapes only (jax.eval_shape traces, nothing compiles).
  plain, twin = make(plain_layers()), make(jact_layers(4))
  key = jax.random.key(0)
  v_plain = jax.eval_shape(lambda k: plain.init(k, x, train=False), key)
  v_twin = jax.eval_shape(lambda k: twin.init(k, x, train=False), key)
  assert jax.tree.structure(v_plain) == jax.tree.structure(v_twin)
  assert jax.tree.leaves(v_plain) == jax.tree.leaves(v_twin)  # shapes and dtypes
  # The twin runs in training mode on the plain variables with a 'jact' stream.
  out = jax.eval_shape(
    lambda v: twin.apply(v, x, train=True, mutable=["batch_stats"], rngs={"jact": key})[0], v_plain
  )
  assert out.shape == jax.eval_shape(lambda v: plain.apply(v, x, train=False), v_plain).shape
