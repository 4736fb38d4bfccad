"""Counter-based hash PRNG for rounding noise.

`jax.random.uniform` over a tensor materializes several tensor-sized
temporaries (threefry state). Rounding noise instead comes from a hash of
(seed, element index): a 32-bit seed is drawn once per call site from a JAX
key, and every element hashes its own flat index inside the quantize fusion.
Everything here is plain uint32 arithmetic, so the very same functions run
inside GPU kernels and give bit-identical noise.

>>> import jax, jax.numpy as jnp
>>> seed = seed_from_key(jax.random.key(0))
>>> u = uniform_from_bits(hash_uint32(seed, jnp.arange(4, dtype=jnp.uint32)))
>>> bool(((u >= 0) & (u < 1)).all())
True
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["seed_from_key", "hash_uint32", "uniform_from_bits", "split_seed"]

_GOLDEN = 0x9E3779B9
_MIX1 = 0x7FEB352D
_MIX2 = 0x846CA68B


def _as_key(key):
  if key is None:
    raise ValueError(
        "stochastic rounding needs a PRNG key: pass key=jax.random.key(...) "
        "(or, for Flax layers, an RNG stream named 'jact'), or use "
        "stochastic=False for deterministic round-to-nearest.")
  if isinstance(key, jax.Array) and jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
    return key
  arr = jnp.asarray(key)
  if arr.dtype == jnp.uint32 and arr.shape == (2,):
    return jax.random.wrap_key_data(arr)
  raise TypeError(
      f"expected a JAX PRNG key (jax.random.key(...)), got {type(key).__name__} "
      f"with dtype {getattr(arr, 'dtype', None)} and shape {getattr(arr, 'shape', None)}.")


def seed_from_key(key, site: int = 0) -> jax.Array:
  """Draws a uint32 scalar seed for one call site from a JAX PRNG key.

  Args:
    key: a typed key (`jax.random.key`) or a legacy uint32[2] key.
    site: call-site index folded into the key, so one key can feed several
      independent compressions.

  Returns:
    A uint32 scalar.
  """
  key = jax.random.fold_in(_as_key(key), site)
  return jax.random.bits(key, (), jnp.uint32)


def _lowbias32(x: jax.Array) -> jax.Array:
  # A 32-bit integer finalizer with low avalanche bias (two multiply-xorshift rounds).
  x = x ^ (x >> 16)
  x = x * jnp.uint32(_MIX1)
  x = x ^ (x >> 15)
  x = x * jnp.uint32(_MIX2)
  x = x ^ (x >> 16)
  return x


def hash_uint32(seed: jax.Array, index: jax.Array) -> jax.Array:
  """Hashes (seed, element index) to 32 well-mixed bits.

  Both arguments are uint32 (broadcastable); the result has index's shape.
  """
  seed = jnp.asarray(seed, jnp.uint32)
  index = jnp.asarray(index, jnp.uint32)
  x = index * jnp.uint32(_GOLDEN) + _lowbias32(seed)
  x = _lowbias32(x)
  x = x ^ seed
  return _lowbias32(x)


def uniform_from_bits(bits: jax.Array) -> jax.Array:
  """Maps uint32 random bits to float32 uniform in [0, 1) on a 2^-24 grid."""
  return (bits >> 8).astype(jnp.float32) * jnp.float32(2.0**-24)


def split_seed(seed: jax.Array, site: int) -> jax.Array:
  """Derives an independent uint32 seed for sub-site `site` from `seed`."""
  return _lowbias32(jnp.asarray(seed, jnp.uint32) ^ _lowbias32(jnp.uint32(site + 1)))
