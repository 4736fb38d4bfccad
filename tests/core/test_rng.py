"""Tests for jact.rng: uniformity, independence of streams, determinism, key errors."""

import doctest
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats as sps

from jact._core.rng import hash_uint32, seed_from_key, split_seed, uniform_from_bits

N = 1_000_000
P_MIN = 1e-4  # chi-square p-value threshold (fixed seeds: a pass is reproducible)

_bits = jax.jit(lambda seed: hash_uint32(seed, jnp.arange(N, dtype=jnp.uint32)))
_uniform = jax.jit(
  lambda seed: uniform_from_bits(hash_uint32(seed, jnp.arange(N, dtype=jnp.uint32)))
)


def test_doctests():
  result = doctest.testmod(importlib.import_module("jact._core.rng"))
  assert result.attempted >= 3 and result.failed == 0


@pytest.mark.parametrize("seed", [0, 1, 0xFFFFFFFF, 0x9E3779B9])
def test_hash_bytes_are_uniform(seed):
  """Chi-square over 256 bins of 1e6 hashes of consecutive indices, top and bottom byte."""
  h = np.asarray(_bits(jnp.uint32(seed)))
  for byte in (h >> 24, h & 0xFF, (h >> 12) & 0xFF):
    counts = np.bincount(byte.astype(np.int64), minlength=256)
    p = sps.chisquare(counts).pvalue
    assert p > P_MIN, (seed, p)


def test_uniform_from_bits_is_uniform_in_unit_interval():
  u = np.asarray(_uniform(jnp.uint32(42)))
  assert u.dtype == np.float32
  assert (u >= 0).all() and (u < 1).all()
  counts = np.histogram(u, bins=256, range=(0.0, 1.0))[0]
  assert sps.chisquare(counts).pvalue > P_MIN
  # Kolmogorov-Smirnov against U(0, 1) on a subsample.
  assert sps.kstest(u[:100_000], "uniform").pvalue > P_MIN
  # The 2^-24 grid: every value times 2^24 is an integer.
  scaled = u.astype(np.float64) * 2**24
  np.testing.assert_array_equal(scaled, np.floor(scaled))


def test_uniform_from_bits_edges():
  b = jnp.asarray([0, 0xFF, 0x100, 0xFFFFFFFF], jnp.uint32)
  u = np.asarray(uniform_from_bits(b), np.float64)
  np.testing.assert_array_equal(u, [0.0, 0.0, 2.0**-24, 1.0 - 2.0**-24])


def test_each_bit_is_balanced_and_avalanche():
  h = np.asarray(_bits(jnp.uint32(7)))[:200_000]
  ones = np.array([((h >> b) & 1).mean() for b in range(32)])
  # Binomial(200k, 1/2): sd of the frequency = 0.0011; 5 sd.
  assert np.abs(ones - 0.5).max() < 5 * 0.5 / np.sqrt(h.size)
  # Flipping one input bit flips 16 of 32 output bits on average (sd over 4096 pairs ~ 0.04).
  idx = jnp.arange(4096, dtype=jnp.uint32) * jnp.uint32(2654435761)
  for bit in (0, 1, 7, 16, 31):
    a = np.asarray(hash_uint32(jnp.uint32(3), idx))
    b = np.asarray(hash_uint32(jnp.uint32(3), idx ^ jnp.uint32(1 << bit)))
    flips = np.unpackbits((a ^ b).view(np.uint8)).reshape(-1, 32).sum(1)
    assert abs(flips.mean() - 16) < 0.5, (bit, flips.mean())


def _corr(a, b):
  return float(np.corrcoef(np.asarray(a, np.float64), np.asarray(b, np.float64))[0, 1])


def test_streams_are_uncorrelated():
  """|r| < 5/sqrt(N) between streams that share indices (5 sd for independent streams)."""
  bound = 5 / np.sqrt(N)
  key = jax.random.key(0)
  seeds = {
    "adjacent seeds": (jnp.uint32(1000), jnp.uint32(1001)),
    "sites 0 and 1": (seed_from_key(key, 0), seed_from_key(key, 1)),
    "split sites": (split_seed(jnp.uint32(5), 0), split_seed(jnp.uint32(5), 1)),
    "seed and its split": (jnp.uint32(5), split_seed(jnp.uint32(5), 0)),
    "keys 0 and 1": (seed_from_key(jax.random.key(0)), seed_from_key(jax.random.key(1))),
  }
  for what, (s1, s2) in seeds.items():
    assert int(s1) != int(s2), what
    r = _corr(_uniform(s1), _uniform(s2))
    assert abs(r) < bound, (what, r)
  # Within a stream: neighbouring indices are uncorrelated (lag 1 and lag 256 = a group).
  u = np.asarray(_uniform(jnp.uint32(9)))
  for lag in (1, 256):
    assert abs(_corr(u[:-lag], u[lag:])) < bound, lag


def test_seed_is_deterministic_per_key_and_site():
  key = jax.random.key(123)
  s = seed_from_key(key)
  assert s.dtype == jnp.uint32 and s.shape == ()
  assert int(s) == int(seed_from_key(jax.random.key(123)))
  assert int(s) == int(jax.jit(seed_from_key)(key))  # same under jit
  assert int(seed_from_key(key, 3)) == int(seed_from_key(key, 3))
  # The 32-bit seed depends on the key and the site: 64 keys x 4 sites, all distinct.
  seeds = {int(seed_from_key(jax.random.key(k), site)) for k in range(64) for site in range(4)}
  assert len(seeds) == 256
  # A legacy uint32[2] key gives the same seed as the typed key with the same data.
  legacy = jax.random.PRNGKey(123)
  assert int(seed_from_key(legacy)) == int(seed_from_key(jax.random.wrap_key_data(legacy)))
  # split_seed is a function of (seed, site).
  assert int(split_seed(s, 2)) == int(split_seed(s, 2)) != int(split_seed(s, 3))


def test_hash_is_deterministic_and_broadcasts():
  idx = jnp.arange(12, dtype=jnp.uint32).reshape(3, 4)
  a = hash_uint32(jnp.uint32(5), idx)
  assert a.shape == (3, 4) and a.dtype == jnp.uint32
  np.testing.assert_array_equal(np.asarray(a), np.asarray(jax.jit(hash_uint32)(jnp.uint32(5), idx)))
  # A seed per row broadcasts against the indices.
  rows = hash_uint32(jnp.asarray([5, 6, 7], jnp.uint32)[:, None], idx)
  np.testing.assert_array_equal(np.asarray(rows[0]), np.asarray(a[0]))
  assert (np.asarray(rows[1]) != np.asarray(hash_uint32(jnp.uint32(5), idx[1]))).all()
  # Python ints are accepted as seeds and indices.
  assert int(hash_uint32(5, 0)) == int(a[0, 0])


def test_missing_key_raises_documented_error():
  with pytest.raises(ValueError, match=r"needs a PRNG key.*jax\.random\.key.*stochastic=False"):
    seed_from_key(None)


@pytest.mark.parametrize(
  "bad",
  [3, 1.5, jnp.zeros((2,), jnp.float32), jnp.zeros((3,), jnp.uint32), np.zeros((2,), np.int32)],
)
def test_invalid_key_raises_documented_error(bad):
  with pytest.raises(TypeError, match=r"expected a JAX PRNG key \(jax\.random\.key\(\.\.\.\)\)"):
    seed_from_key(bad)
