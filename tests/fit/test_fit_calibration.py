"""`jact.fit(calibration=...)` on a smaller batch than the step's: every residual of the step is
measured there (matched by name; segments compress residuals of any size on that batch)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jact
from jact._fit.search import _sensitivities, _Survey
from jact._fit.steps import configure, step_peak

N = 4


def mlp(w, x):
  return x + jnp.tanh(x @ w[0]) @ w[1]


SEGMENTS = [jact.segment(mlp, name=f"s{i}", compress_argnums=(1,)) for i in range(N)]


def loss(ws, x):
  for s, w in zip(SEGMENTS, ws):
    x = s(w, x)
  return jnp.sum(x**2) / x.shape[0]


def weights():
  k = jax.random.split(jax.random.key(0), 2 * N)
  return [
    (jax.random.normal(k[2 * i], (64, 256)) / 8, jax.random.normal(k[2 * i + 1], (256, 64)) / 16)
    for i in range(N)
  ]


X = jax.random.normal(jax.random.key(1), (512, 64))
SMALL = X[:8]  # 8 x 64 = 512 values: the blocks' inputs are below the 1024-value threshold here


def test_a_smaller_calibration_batch_measures_every_residual():
  # The blocks' inputs (s{i}.2, s{i}.remat.2) are compressed at batch 512 but would be kept
  # exact at batch 8; they must still get a measured sensitivity of the same share as on the
  # full batch (here within a factor 4: one estimate on 8 samples, seed 0), never a fallback.
  ws = weights()
  survey = _Survey.of(loss, (ws, X))
  full = _sensitivities(loss, survey, {}, None, (ws, X), (0,), 0)
  small = _sensitivities(loss, survey, {}, (ws, SMALL), (ws, X), (0,), 0)
  names = list(survey.sites0) + survey.remat_inputs()
  assert any(n.endswith(".2") for n in names)
  for n in names:
    assert np.isfinite(small[n]) and small[n] > 0, (n, small.get(n))
  share = lambda s, group: sum(s[n] for n in group) / sum(s[n] for n in survey.sites0)
  inputs = [n for n in survey.sites0 if n.endswith(".2")]
  assert share(small, inputs) == pytest.approx(share(full, inputs), rel=3.0)
  assert 0.25 < share(small, inputs) / share(full, inputs) < 4


def _relative_error(fitted, ws, x, exact):
  g = jax.jit(jax.grad(fitted.loss_fn))(ws, x, key=jax.random.key(5))
  num = sum(
    float(jnp.sum((a - b) ** 2)) for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(exact))
  )
  return (num / sum(float(jnp.sum(b**2)) for b in jax.tree.leaves(exact))) ** 0.5


@pytest.mark.slow
def test_a_smaller_calibration_batch_gives_about_the_full_batchs_gradient_error():
  # Same budget, calibrated on the step's batch or on 8 of its samples: the gradient errors
  # (one rounding key) are within 3x of each other (the was 0.002 -> 0.24), and no
  # warning about plan names is raised.
  ws = weights()
  budget = int(0.7 * step_peak(configure(loss, None, None), (ws, X), (0,)))
  exact = jax.grad(loss)(ws, X)
  full = jact.fit(loss, ws, X, budget_bytes=budget, max_candidates=3)
  import warnings

  with warnings.catch_warnings():
    warnings.simplefilter("error")
    small = jact.fit(loss, ws, X, budget_bytes=budget, max_candidates=3, calibration=(ws, SMALL))
  assert small.peak_bytes <= budget and full.peak_bytes <= budget
  e_full, e_small = _relative_error(full, ws, X, exact), _relative_error(small, ws, X, exact)
  assert e_small <= 3 * e_full + 1e-3, (e_small, e_full)


def test_a_residual_outside_segments_unmeasurable_on_the_calibration_batch_is_named():
  # jact.compressed written in the loss (no segment) keeps its 8 x 64 input exact at batch 8
  # (min_size): its sensitivity cannot be measured there, and fit says which one and the fix.
  body = jact.compressed(mlp, bits=4, name="body", compress_argnums=(1,))

  def written(ws, x, key):
    return jnp.sum(body(ws[0], x, key=key) ** 2)

  ws, key = weights(), jax.random.key(2)
  with pytest.raises(ValueError, match="'body.2'.*larger calibration batch.*sensitivity="):
    jact.fit(written, ws, X, key, budget_bytes=2**16, calibration=(ws, SMALL, key))
