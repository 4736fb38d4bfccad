"""AC-GC fixed point and zero-value compression: bytes, error bounds, exactness,
the dense fallback."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jact.compressors import Fixpoint, ZeroValue
from jact.compressors._fixed_point import (
  FIXPOINT_BITS,
  fixpoint_fields,
  pack_fixpoint_codes,
  unpack_fixpoint_codes,
)
from jact.compressors._zero_value import nonzeros

EPS32 = float(np.finfo(np.float32).eps)


def _normal(shape, seed=0):
  return np.random.default_rng(seed).normal(size=shape).astype(np.float32)


def _relu_like(shape, seed=0):
  return np.maximum(_normal(shape, seed) - 0.3, 0)  # ~62% zeros


def test_fixpoint_widths_are_2_to_16():
  assert FIXPOINT_BITS == tuple(range(2, 17))
  for bad in (1, 17, 8.0, True):
    with pytest.raises(ValueError, match="2 to 16"):
      Fixpoint(bad)


@pytest.mark.parametrize("bits", FIXPOINT_BITS)
def test_fixpoint_bytes_and_round_to_nearest_bound(bits):
  x = _normal((16, 6, 6, 12))
  x[..., 3] *= 1000.0  # one loud channel must not affect the others
  c = Fixpoint(bits)
  stored = jax.jit(c.compress)(jnp.asarray(x))
  # every width in exactly its bits (432 values a row: a multiple of every packing unit)
  assert stored.nbytes == c.stored_bytes(x.shape) == math.ceil(x.size * bits / 8) + 4 * 12
  x_hat = np.asarray(jax.jit(c.decompress)(stored))
  scale = np.abs(x).reshape(-1, 12).max(0)
  # half a step, plus float32 rounding of x * L / scale and of code * scale / L (measured at
  # 16 bits: up to 0.4% of the half step, which is 2^-16 of the scale)
  bound = scale / (2 * c.levels) + 4 * EPS32 * scale
  assert np.all(np.abs(x_hat - x) <= bound)
  quiet = [ch for ch in range(12) if ch != 3]
  assert np.abs(x_hat - x)[..., quiet].max() <= bound[quiet].max()
  # the codes come back bit-exact: compressing the reconstruction stores the same bytes
  again = jax.jit(c.compress)(jnp.asarray(x_hat))
  for a, b in zip(jax.tree.leaves(stored.arrays), jax.tree.leaves(again.arrays)):
    if a.dtype != jnp.float32:  # (the scales may move by an ulp)
      np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("bits", [3, 9, 11, 15, 16])
def test_fixpoint_codes_round_trip_every_code(bits):
  """Every code 0..2^bits - 1 (the non-finite code included) packs and unpacks
  exactly, in rows of a length that is no multiple of the packing unit."""
  codes = jnp.arange(1 << bits, dtype=jnp.int32).reshape(-1, 1 << min(bits, 4))[:, :-3]
  fields = pack_fixpoint_codes(codes, bits)
  assert [p.bits for p in fields] == [w for w, _ in fixpoint_fields(bits)]
  assert sum(p.bits for p in fields) == bits
  np.testing.assert_array_equal(unpack_fixpoint_codes(fields), codes)


@pytest.mark.slow
def test_fixpoint_zeros_exact_error_falls_and_non_finite_inputs():
  x = jnp.asarray(_relu_like((8, 64)))
  errs = []
  for b in FIXPOINT_BITS:
    x_hat = Fixpoint(b).decompress(Fixpoint(b).compress(x))
    assert bool(jnp.all(x_hat[x == 0] == 0))
    errs.append(float(jnp.mean((x_hat - x) ** 2)))
  assert all(a > b for a, b in zip(errs, errs[1:])), errs
  bad = jnp.array([[1.0, jnp.inf], [jnp.nan, -jnp.inf], [2.0, 0.5]])
  for b in FIXPOINT_BITS:
    x_hat = np.asarray(Fixpoint(b).decompress(Fixpoint(b).compress(bad)))
    # Non-finite exactly where the input is (channel 1 mixes +-inf: NaN), finite values on the
    # grid of the channel's largest finite |x|.
    np.testing.assert_array_equal(np.isfinite(x_hat), np.isfinite(np.asarray(bad)))
    assert np.isnan(x_hat[1, 0]) and np.isnan(x_hat[:2, 1]).all()
    np.testing.assert_allclose(x_hat[[0, 2], 0], [1.0, 2.0], atol=2.0 / (2**b - 2) * 1.0001)
    np.testing.assert_allclose(x_hat[2, 1], 0.5, rtol=1e-6)


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


@pytest.mark.parametrize("bits", [3, 12, 16])
def test_zvc_over_every_fixpoint_width_equals_fixpoint(bits):
  """Non-zero codes at widths that pack in bit planes (3), in two fields (12)
  and in 16 bits: ceil(K * bits / 8) value bytes, the inner Fixpoint's values."""
  x = jnp.asarray(_relu_like((8, 10, 10, 16), 2))
  inner = Fixpoint(bits)
  c = ZeroValue(inner, capacity=0.5)
  stored = jax.jit(c.compress)(x)
  k = math.ceil(0.5 * x.size)
  assert stored.nbytes == c.stored_bytes(x.shape) == x.size // 8 + k * bits // 8 + 4 * 16 + 4
  np.testing.assert_array_equal(jax.jit(c.decompress)(stored), inner.decompress(inner.compress(x)))


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
