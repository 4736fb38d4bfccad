"""AC-GC fixed point and zero-value compression: bytes, error bounds, exactness,
the dense fallback."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jact.compressors import Fixpoint, ZeroValue
from jact.compressors._zero_value import nonzeros


def _normal(shape, seed=0):
  return np.random.default_rng(seed).normal(size=shape).astype(np.float32)


def _relu_like(shape, seed=0):
  return np.maximum(_normal(shape, seed) - 0.3, 0)  # ~62% zeros


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_fixpoint_bytes_and_round_to_nearest_bound(bits):
  x = _normal((16, 6, 6, 12))
  x[..., 3] *= 1000.0  # one loud channel must not affect the others
  c = Fixpoint(bits)
  stored = jax.jit(c.compress)(jnp.asarray(x))
  assert stored.nbytes == c.stored_bytes(x.shape) == math.ceil(x.size * bits / 8) + 4 * 12
  x_hat = np.asarray(jax.jit(c.decompress)(stored))
  scale = np.abs(x).reshape(-1, 12).max(0)
  bound = scale / (2 * c.levels)
  assert np.all(np.abs(x_hat - x) <= bound * (1 + 1e-5) + 1e-7)
  quiet = [ch for ch in range(12) if ch != 3]
  assert np.abs(x_hat - x)[..., quiet].max() <= (scale[quiet] / (2 * c.levels)).max() * 1.00001


@pytest.mark.slow
def test_fixpoint_zeros_exact_error_falls_and_non_finite_inputs():
  x = jnp.asarray(_relu_like((8, 64)))
  errs = []
  for b in (2, 4, 8):
    x_hat = Fixpoint(b).decompress(Fixpoint(b).compress(x))
    assert bool(jnp.all(x_hat[x == 0] == 0))
    errs.append(float(jnp.mean((x_hat - x) ** 2)))
  assert errs[0] > errs[1] > errs[2]
  bad = jnp.array([[1.0, jnp.inf], [jnp.nan, -jnp.inf], [2.0, 0.5]])
  x_hat = np.asarray(Fixpoint(8).decompress(Fixpoint(8).compress(bad)))
  # Non-finite exactly where the input is (channel 1 mixes +-inf: NaN), finite values on the
  # grid of the channel's largest finite |x|.
  np.testing.assert_array_equal(np.isfinite(x_hat), np.isfinite(np.asarray(bad)))
  assert np.isnan(x_hat[1, 0]) and np.isnan(x_hat[:2, 1]).all()
  np.testing.assert_allclose(x_hat[[0, 2], 0], [1.0, 2.0], rtol=1e-2)
  np.testing.assert_allclose(x_hat[2, 1], 0.5, rtol=1e-6)
  with pytest.raises(ValueError, match="2, 4 or 8"):
    Fixpoint(1)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_zvc_lossless_bytes_are_mask_plus_nonzeros(dtype):
  x = jnp.asarray(_relu_like((8, 10, 10, 16), 1), dtype)
  c = ZeroValue(capacity=0.5)
  stored = jax.jit(c.compress)(x)
  n = x.size
  k = math.ceil(0.5 * n)
  itemsize = jnp.dtype(dtype).itemsize
  assert (
    stored.nbytes == c.stored_bytes(x.shape, dtype) == math.ceil(n / 8) + k * itemsize + 4 * 16 + 4
  )
  assert int(nonzeros(stored)) == int(jnp.sum(x != 0)) <= k
  x_hat = jax.jit(c.decompress)(stored)
  assert x_hat.dtype == x.dtype and bool(jnp.array_equal(x_hat, x))


@pytest.mark.slow
def test_zvc_over_fixpoint_equals_fixpoint_and_stores_fewer_bytes():
  x = jnp.asarray(_relu_like((8, 10, 10, 16), 2))
  inner = Fixpoint(8)
  c = ZeroValue(inner, capacity=0.5)
  stored = jax.jit(c.compress)(x)
  k = math.ceil(0.5 * x.size)
  assert stored.nbytes == c.stored_bytes(x.shape) == math.ceil(x.size / 8) + k + 4 * 16 + 4
  assert stored.nbytes < inner.stored_bytes(x.shape)
  np.testing.assert_array_equal(c.decompress(stored), inner.decompress(inner.compress(x)))
  assert c.with_bits(4) == ZeroValue(Fixpoint(4), 0.5) and ZeroValue().with_bits(
    2
  ).inner == Fixpoint(2)


@pytest.mark.slow
@pytest.mark.parametrize("inner", [None, Fixpoint(8)], ids=["lossless", "fixpoint"])
def test_zvc_dense_tensor_falls_back_to_fixpoint(inner):
  x = jnp.asarray(_normal((8, 64), 3))  # no zeros at all
  c = ZeroValue(inner, capacity=0.5)
  stored = jax.jit(c.compress)(x)
  assert int(nonzeros(stored)) > math.ceil(0.5 * x.size)  # (a code may round to 0)
  # Buffer: 64 mask bytes + 256 value slots -> (lossless: 4 B each) 8-bit fallback,
  # (8-bit codes: 1 B each) 4-bit fallback.
  width = 8 if inner is None else 4
  x_hat = np.asarray(jax.jit(c.decompress)(stored))
  scale = np.abs(np.asarray(x)).max(0)
  assert np.all(np.abs(x_hat - np.asarray(x)) <= scale / (2 * (2 ** (width - 1) - 1)) * 1.00001)
  with pytest.raises(ValueError, match="raise the capacity"):
    ZeroValue(Fixpoint(2), capacity=0.1).compress(x)


def test_zvc_bad_settings():
  with pytest.raises(ValueError, match="capacity"):
    ZeroValue(capacity=0.0)
  with pytest.raises(TypeError, match="Fixpoint"):
    ZeroValue(inner="fixpoint")
  with pytest.raises(TypeError, match="astype"):
    ZeroValue().compress(jnp.ones((4, 4), jnp.int32))
