"""Hash-PRNG dropout: mask statistics, forward/backward consistency, a 4-byte residual."""

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jact._compat.testing import saved_residuals

from jact.ops._dropout import dropout
from stats import DRAWS, assert_unbiased, over_keys

D = importlib.import_module("jact.ops._dropout")  # the module (jact.ops.dropout is the function)

X = jax.random.uniform(jax.random.key(0), (16, 256), minval=0.5, maxval=2.0)  # no zeros


def residuals(f, *args):
  return [(a, d) for a, d in saved_residuals(f, *args) if not d.startswith("from the argument")]


@pytest.mark.slow
@pytest.mark.parametrize("rate", [0.1, 0.5, 0.9])
def test_keep_fraction_is_binomial(rate):
  # 2**18 values: |fraction - (1 - rate)| < 5 binomial standard deviations.
  x = jnp.ones((64, 4096))
  y = jax.jit(lambda x, k: dropout(x, rate, key=k))(x, jax.random.key(1))
  p, n = 1 - rate, x.size
  frac = float((y != 0).mean())
  assert abs(frac - p) < 5 * np.sqrt(p * (1 - p) / n), frac
  # Kept values are scaled like flax: x / (1 - rate), in x's dtype.
  np.testing.assert_array_equal(y[y != 0], (x / jnp.float32(p))[y != 0])


def test_masks_of_different_keys_are_independent():
  # P(both keep) = p^2 for independent masks; 5 standard deviations.
  rate, p = 0.5, 0.5
  x = jnp.ones((64, 4096))
  a = dropout(x, rate, key=jax.random.key(1)) != 0
  b = dropout(x, rate, key=jax.random.key(2)) != 0
  both = float((a & b).mean())
  assert abs(both - p * p) < 5 * np.sqrt(p * p * (1 - p * p) / x.size)
  # neighbouring elements are uncorrelated too (no striping from the index hash)
  same = float((a[:, 1:] == a[:, :-1]).mean())
  assert abs(same - 0.5) < 5 * np.sqrt(0.25 / a[:, 1:].size)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_backward_regenerates_the_forward_mask(dtype):
  x = X.astype(dtype)
  cot = jax.random.normal(jax.random.key(3), X.shape).astype(dtype)
  key = jax.random.key(4)
  y, vjp = jax.vjp(lambda x: dropout(x, 0.3, key=key), x)
  (g,) = vjp(cot)
  assert y.dtype == g.dtype == dtype
  kept = np.asarray(y != 0)
  assert 0 < kept.mean() < 1
  np.testing.assert_array_equal(np.asarray(g != 0), kept & np.asarray(cot != 0))
  want = jnp.where(kept, cot / jnp.asarray(0.7, dtype), 0)
  np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(want, np.float32))


@pytest.mark.slow
def test_output_and_gradient_are_unbiased_over_keys():
  # E[mask / (1 - rate)] = 1: forward and gradient average to x and to cot.
  cot = jax.random.normal(jax.random.key(3), X.shape)
  keys = jax.random.split(jax.random.key(5), DRAWS)  # enough for a 1% bias (stats.py)
  one = lambda k: jax.vjp(lambda x: dropout(x, 0.25, key=k), X)[1](cot)[0]
  ys = over_keys(lambda k: dropout(X, 0.25, key=k), keys)
  gs = over_keys(one, keys)
  assert_unbiased(ys, X)
  assert_unbiased(gs, cot)


def test_the_only_residual_is_the_4_byte_seed():
  key = jax.random.key(6)
  res = residuals(lambda x: dropout(x, 0.5, key=key, name="drop1"), X)
  assert len(res) == 1
  ((a, desc),) = res
  assert a.shape == () and a.dtype == jnp.uint32 and "named 'drop1.seed'" in desc
  # also when the key is an argument of the differentiated function
  res = residuals(lambda x, k: dropout(x, 0.5, key=k), X, key)
  assert sum(a.size * a.dtype.itemsize for a, _ in res) == 4


@pytest.mark.slow
def test_broadcast_dims_share_the_mask():
  x = jnp.ones((8, 32, 64))
  y = dropout(x, 0.5, key=jax.random.key(7), broadcast_dims=(1,))
  np.testing.assert_array_equal(y, jnp.broadcast_to(y[:, :1], y.shape))
  assert 0 < float((y != 0).mean()) < 1
  y = dropout(x, 0.5, key=jax.random.key(7), broadcast_dims=(0, -1))
  np.testing.assert_array_equal(y, jnp.broadcast_to(y[:1, :, :1], y.shape))


def test_deterministic_and_zero_rate_are_identity():
  for kw in [dict(rate=0.5, deterministic=True), dict(rate=0.0)]:
    y, vjp = jax.vjp(
      lambda x: dropout(x, kw["rate"], key=None, deterministic=kw.get("deterministic", False)), X
    )
    np.testing.assert_array_equal(y, X)
    np.testing.assert_array_equal(vjp(jnp.ones_like(X))[0], 1.0)


def test_keep_mask_probability_resolution():
  # The uint32 threshold makes P(keep) = 1 - rate to 2**-32.
  for rate in [1e-3, 0.5, 0.999]:
    t = int(D._threshold(rate))
    assert abs((2**32 - t) / 2**32 - (1 - rate)) <= 2.0**-32


def test_errors():
  for bad in [1.5, -0.1]:  # rate 1.0 drops everything (tests/ops/test_indices_edges.py)
    with pytest.raises(ValueError, match=r"jact dropout rate must be in \[0, 1\]"):
      dropout(X, bad, key=jax.random.key(0))
  with pytest.raises(ValueError, match="needs a PRNG key"):
    dropout(X, 0.5, key=None)
  with pytest.raises(TypeError, match="static Python number"):
    jax.jit(lambda r: dropout(X, r, key=jax.random.key(0)))(0.5)
  with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
    dropout(jnp.ones(8, jnp.int32), 0.5, key=jax.random.key(0))
