"""Tests of the test helpers: the unbiasedness check sees a bias of 1% of a
rounding step, and the XLA flag workaround of conftest.py is safe and needed."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import conftest
import jact
from jact.ops import _norm as norm
from stats import DRAWS, assert_unbiased

N = 4096  # values: 16 samples x one group of 256
X = jnp.asarray(np.random.default_rng(0).standard_normal((16, 256)), jnp.float32)


@pytest.fixture(scope="module")
def draws_and_step():
  """DRAWS dequantized 2-bit draws of X and each value's rounding step,
  (max - min) / 3 of its group, computed here from X."""
  roundtrip = jax.jit(jax.vmap(lambda k: jact.dequantize(jact.quantize(X, k, bits=2))))
  draws = np.asarray(roundtrip(jax.random.split(jax.random.key(1), DRAWS)), np.float64)
  x = np.asarray(X, np.float64)
  step = (x.max(1, keepdims=True) - x.min(1, keepdims=True)) / 3 * np.ones_like(x)
  return draws, step


def _atol(step):
  """Values within c/K of a level (rounding step units) land on it in all K
  draws with probability (1 - c/K)^K ~ e^-c: with c = 10 they look
  deterministic and sit up to 10 steps / K from their mean."""
  return 10 * float(step.max()) / DRAWS


def test_unbiased_quantizer_passes(draws_and_step):
  draws, step = draws_and_step
  stats = assert_unbiased(draws, X, atol=_atol(step))
  assert stats["noisy_fraction"] > 0.99  # every value but the group extremes is rounded


def test_bias_of_one_percent_of_a_step_fails(draws_and_step):
  draws, step = draws_and_step
  with pytest.raises(AssertionError, match="pooled z"):  # one sign: the pooled check
    assert_unbiased(draws + 0.01 * step, X, atol=_atol(step))
  signs = np.where(np.random.default_rng(2).random(step.shape) < 0.5, -1.0, 1.0)
  planted = draws + 0.01 * step * signs
  # either sign: the pooled sum cancels, the per-element check fails
  assert abs(np.sum(0.01 * step * signs)) < 0.05 * np.sum(0.01 * step)
  with pytest.raises(AssertionError, match="per element"):
    assert_unbiased(planted, X, atol=_atol(step))


@pytest.mark.slow
def test_unknown_xla_flag_is_not_set(monkeypatch):
  """XLA aborts on an unknown flag in XLA_FLAGS: conftest probes a flag in a
  subprocess and only sets it where this jaxlib knows it."""
  monkeypatch.setenv("XLA_FLAGS", "")
  assert not conftest.add_xla_flag("--xla_jact_no_such_flag=")
  assert os.environ["XLA_FLAGS"] == ""
  supported = conftest.add_xla_flag(conftest.YNN_FLAG)  # True with jaxlib 0.10.2
  assert os.environ["XLA_FLAGS"] == (conftest.YNN_FLAG if supported else "")


@pytest.mark.slow
def test_vmap_over_keys_matches_each_key():
  """A layer-norm gradient vmapped over 128 keys (the unbatched cotangent is
  reduced against batched residuals) equals the gradient for each key alone.
  With jaxlib 0.10.2's YNN fusion enabled the vmapped rows came out wrong
  (error 0.76); conftest.py turns the fusion off where the flag exists."""
  x = jax.random.normal(jax.random.key(1), (64, 64)) * 2.0 - 0.5
  cot = jax.random.normal(jax.random.key(7), x.shape)

  def one(key):
    return jax.grad(lambda x: jnp.vdot(norm.layer_norm(x, key=key, bits=2), cot))(x)

  keys = jax.random.split(jax.random.key(0), 128)
  batched = jax.jit(jax.vmap(one))(keys)
  single = jax.jit(one)
  for i in (0, 1, 63, 127):
    np.testing.assert_allclose(batched[i], single(keys[i]), rtol=1e-5, atol=1e-5)
