"""bench_fit's pieces: the measured gradient variance and the table of its rows."""

import json

import jax
import jax.numpy as jnp

import jact
from experiments.bench.bench_fit import measured_variance
from experiments.lib import fit_demo


def _loss(stochastic: bool):
  block = jact.segment(lambda w, x: jnp.tanh(x @ w), name="b", compress_argnums=(1,))

  def loss(w, x):
    return jnp.sum(block(w, x) ** 2)

  from jact._fit.segments import Layout
  from jact._fit.steps import configure

  plan = jact.BitPlan({}, default=2 if stochastic else None)
  return configure(loss, Layout(), plan)


def test_measured_variance_is_zero_without_rounding_and_positive_with_it():
  w, x = jnp.eye(256) * 0.3, jax.random.normal(jax.random.key(0), (64, 256))
  assert measured_variance(_loss(False), (w, x), keys=3) == 0.0
  assert measured_variance(_loss(True), (w, x), keys=3) > 0.0


def test_bench_table_shows_fitting_and_failing_rows(tmp_path):
  rows = [
    dict(
      fraction="1/2",
      budget_bytes=2**20,
      fits=True,
      peak_bytes=2**19,
      remat=["b0"],
      compilations=5,
      search_seconds=1.0,
      variance=1e-3,
      uniform_bits=4,
      uniform_variance=2e-3,
    ),
    dict(fraction="1/12", budget_bytes=2**16, fits=False, smallest_peak_bytes=2**18),
  ]
  path = tmp_path / "bench_fit.json"
  path.write_text(json.dumps({"subjects": {"stack8": {"rows": rows}}}))
  table = fit_demo.bench_table(path)
  assert "| stack8 | 1/2 (1.0 MiB) | 0.5 | 1 | 5 | 1.0 | 0.001 | 4 bits | 0.002 |" in table
  assert "nothing fits (smallest 0.2)" in table
