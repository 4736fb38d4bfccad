"""Statistical assertions shared by the tests (fixed seeds, stated tolerances).

How many draws `assert_unbiased` needs to see a bias of 1% of a rounding step.
Stochastic rounding to a grid of step D leaves a zero-mean error of variance
f(1-f) D^2 <= D^2/4 (f: the value's fractional position), so a bias
b = 0.01 D is at least r = b / sigma = 0.02 noise standard deviations per
value. Over K draws an element's z = (mean - exact) / (sigma / sqrt(K)) has
E[z^2] = 1 + K r^2:

* the per-element check (mean z^2 < 1.6) catches a bias of either sign --
  the case of a gradient, where each element mixes many rounding errors with
  weights of both signs, so that the biases cancel in the pooled sum but not
  in an element's own z. It needs K r^2 well above 0.6: K = 2048 gives
  E[mean z^2] >= 1 + 2048 * 0.02^2 = 1.82 (2.23 at the mean variance D^2/6),
  about 10 of its standard errors sqrt(2/n) above 1.6 for n >= 4096 noisy
  elements, while an unbiased run reaches 1.6 only 0.6 / sqrt(2/n) standard
  errors above its mean of 1 (> 3 for n >= 64);
* the pooled check (|pooled z| < 4) catches a bias of one sign over n
  independent elements once r sqrt(nK) >= 4 + 1.645 (95% power): n K >= 80,000.

So op-level unbiasedness tests draw `DRAWS` = 2048 keys (a multiple of 128 for
`over_keys`); tests/test_stats.py plants such biases in jact's quantizer and
checks that `assert_unbiased` fails.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jact._compat.testing import saved_residuals

DRAWS = 2048
"""Draws per unbiasedness test: enough to detect a bias of 1% of a rounding step."""


def assert_unbiased(
  samples,
  exact,
  *,
  max_pooled_z: float = 4.0,
  max_mean_z2: float = 1.6,
  rel_floor: float = 1e-6,
  atol: float = 1e-5,
  correlated: bool = False,
) -> dict:
  """Checks that `samples` (K draws stacked on axis 0) average to `exact`.

  Three checks, each a stated tolerance:
    * pooled z = sum(mean - exact) / sqrt(sum(var) / K) within +-max_pooled_z
      (catches a systematic bias of one sign, even a tiny one);
    * mean of per-element z^2 below max_mean_z2 (~1 when unbiased; catches
      element-wise biases of either sign);
    * elements whose standard error is negligible (deterministic given the
      inputs) equal the exact value within atol.
  With `correlated` (a few values that share the same rounding draws, e.g.
  the gradient of a 16-channel BatchNorm bias), the pooled z divides by the
  spread of the per-draw sums instead (right whatever the correlation; the
  independent-element formula understates it up to sqrt(d)-fold), and the
  z^2 average, then only a few effective chi-square draws, is not checked.
  Returns the statistics, for messages.
  """
  s = np.asarray(samples, np.float64)
  e = np.asarray(exact, np.float64)
  k = s.shape[0]
  mean = s.mean(0)
  var = s.var(0, ddof=1)
  se = np.sqrt(var / k)
  scale = max(np.abs(e).max(), 1e-30)
  noisy = se > rel_floor * scale
  err = mean - e
  stats = {"k": k, "noisy_fraction": float(noisy.mean())}
  if noisy.any():
    if correlated:
      sums = s.reshape(k, -1)[:, noisy.reshape(-1)].sum(1)
      pooled = (sums.mean() - e[noisy].sum()) / np.sqrt(sums.var(ddof=1) / k)
    else:
      pooled = err[noisy].sum() / np.sqrt((var[noisy] / k).sum())
    z2 = float(np.mean((err[noisy] / se[noisy]) ** 2))
    stats.update(pooled_z=float(pooled), mean_z2=z2)
    assert abs(pooled) < max_pooled_z, f"biased: pooled z = {pooled:.2f} ({stats})"
    if not correlated:
      assert z2 < max_mean_z2, f"biased per element: mean z^2 = {z2:.2f} ({stats})"
  if (~noisy).any():
    worst = float(np.abs(err[~noisy]).max())
    stats["deterministic_max_err"] = worst
    assert worst <= atol + 1e-4 * scale, f"deterministic elements differ: {worst} ({stats})"
  return stats


def over_keys(one, keys):
  """jit(vmap(one)) over the keys, in chunks of at most 2**16 output values.

  Chunked because XLA:CPU in jaxlib 0.10.2 miscompiles (YNN fusion) a row
  reduction whose operand is broadcast along a leading batch axis once the
  batched tensor reaches ~2**18 values (e.g. an unbatched cotangent against
  batched residuals under vmap): every row after the first 512 came out
  wrong. K must be a multiple of 128.
  """
  size = sum(a.size for a in jax.tree.leaves(jax.eval_shape(one, keys[0])))
  chunk = 128
  while chunk > 1 and chunk * size > 2**16:
    chunk //= 2
  run = jax.jit(jax.vmap(one))
  outs = [run(keys[i : i + chunk]) for i in range(0, len(keys), chunk)]
  return jax.tree.map(lambda *a: jnp.concatenate(a), *outs)


def residual_bytes(f, *args):
  """Bytes saved for the backward pass, excluding the function's own arguments."""
  return sum(
    a.size * a.dtype.itemsize
    for a, d in saved_residuals(f, *args)
    if not d.startswith("from the argument")
  )


def saved_under_names(f, names, *args):
  """(names, bytes) of what `jax.checkpoint` saves under save_only_these_names(*names)."""
  pol = jax.checkpoint_policies.save_only_these_names(*names)
  res = [
    (a, d)
    for a, d in saved_residuals(jax.checkpoint(f, policy=pol), *args)
    if not d.startswith("from the argument")
  ]
  return (
    {d.split("'")[1] for _, d in res if d.startswith("named")},
    sum(a.size * a.dtype.itemsize for a, _ in res),
  )


def assert_same_tree(a, b):
  """Same structure, shapes, dtypes and values, leaf by leaf."""
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    assert u.shape == v.shape and u.dtype == v.dtype
    np.testing.assert_array_equal(u, v)


def tree_rel_err(a, b):
  """Largest per-leaf relative L2 error of `a` against `b`; leaves whose exact
  value is ~0 (attention's key bias gradient) are measured against 5% of the
  whole tree's norm."""
  total = float(jnp.sqrt(sum(jnp.sum(v**2) for v in jax.tree.leaves(b))))
  return max(
    float(jnp.linalg.norm(u - v)) / max(float(jnp.linalg.norm(v)), 5e-2 * total)
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b))
  )
