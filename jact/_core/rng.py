"""Counter-based hash PRNG for rounding noise.

`jax.random.uniform` over a tensor materializes several tensor-sized
temporaries (threefry state). Rounding noise instead comes from a hash of
(seed, element index): a 32-bit seed is hashed once per call site from a JAX
key's data words, and every element hashes its own flat index inside the
quantize fusion.
Everything here is plain uint32 arithmetic, so the very same functions run
inside GPU kernels and give bit-identical noise.

The element index is the row-major flat index, which may exceed 32 bits: its
low word is hashed and its high word folded into the seed (`element_bits`).
The fold is the identity for a zero high word, so tensors of fewer than 2^32
elements hash exactly (seed, flat index), as the kernels do.

>>> import jax, jax.numpy as jnp
>>> seed = seed_from_key(jax.random.key(0))
>>> u = uniform_from_bits(hash_uint32(seed, jnp.arange(4, dtype=jnp.uint32)))
>>> bool(((u >= 0) & (u < 1)).all())
True
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

__all__ = [
  "seed_from_key",
  "hash_uint32",
  "uniform_from_bits",
  "split_seed",
  "element_bits",
  "element_bits_at",
  "index_words",
]

_GOLDEN = 0x9E3779B9
_MIX1 = 0x7FEB352D
_MIX2 = 0x846CA68B


def _as_key(key):
  if key is None:
    raise ValueError(
      "stochastic rounding needs a PRNG key: pass key=jax.random.key(...) "
      "(or, for Flax layers, an RNG stream named 'jact'), or use "
      "stochastic=False for deterministic round-to-nearest."
    )
  if isinstance(key, jax.Array) and jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
    return key
  try:
    arr = jnp.asarray(key)
  except TypeError:
    arr = None
  if arr is not None and arr.dtype == jnp.uint32 and arr.ndim and arr.shape[-1] == 2:
    return jax.random.wrap_key_data(arr)  # legacy uint32[..., 2] keys (jax.random.PRNGKey)
  raise TypeError(
    f"key: expected a JAX PRNG key (jax.random.key(...)), got {type(key).__name__} "
    f"with dtype {getattr(arr, 'dtype', None)} and shape {getattr(arr, 'shape', None)}; "
    f"pass key=jax.random.key(seed) (or a legacy uint32[2] jax.random.PRNGKey(seed)), "
    f"a fresh one per step."
  )


def single_key(key) -> jax.Array:
  """`key` as one typed PRNG key (a legacy uint32[2] key is wrapped); a clear
  error for None, a non-key, or a batch of keys."""
  key = _as_key(key)
  if key.shape:
    raise ValueError(
      f"key= takes one PRNG key, got a key array of shape {key.shape}; "
      "pass a single key (e.g. keys[i]), or jax.vmap over the keys."
    )
  return key


def seed_from_key(key, site: int = 0) -> jax.Array:
  """Derives a uint32 scalar seed for one call site from a JAX PRNG key.

  The seed is an integer hash of the key's data words and `site` -- no
  threefry: a `fold_in` plus `bits` is two rolled threefry loops on XLA:CPU,
  about a dozen small kernels per call site, which made compiled gradients
  with many compressed layers several times slower to compile. Distinct keys
  (or sites) give unrelated seeds; the key's own draws (`jax.random.*`) are
  a different function of the same words.

  Args:
    key: a scalar typed key (`jax.random.key`) or a legacy uint32[2] key.
    site: call-site index mixed into the seed, so one key can feed several
      independent compressions.

  Returns:
    A uint32 scalar.
  """
  key = single_key(key)
  words = jax.random.key_data(key).reshape(-1)
  x = _lowbias32(jnp.asarray(site, jnp.uint32) * jnp.uint32(_GOLDEN) + jnp.uint32(1))
  for i in range(
    words.shape[0]
  ):  # each step a bijection of the word: distinct keys, distinct chains
    x = _lowbias32(x ^ words[i].astype(jnp.uint32))
  return x


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


def _dim(d):
  """A dimension as an int, or as it is when symbolic (`jax.export`)."""
  return int(d) if _known(d) else d


def _known(d) -> bool:
  return not jax.export.is_symbolic_dim(d)


def _fits_32(shape) -> bool:
  """Whether every flat index of `shape` fits in 32 bits (False when a size is symbolic)."""
  return all(_known(d) for d in shape) and math.prod(shape) <= 2**32


def _wide_product(a: jax.Array, c: int) -> tuple[jax.Array, jax.Array]:
  """(high, low) 32-bit words of a * c for uint32 `a` and a constant c < 2^32 (16-bit limbs)."""
  a_lo, a_hi = a & jnp.uint32(0xFFFF), a >> 16
  c_lo, c_hi = jnp.uint32(c & 0xFFFF), jnp.uint32(c >> 16)
  low_part, high_part = a_lo * c_lo, a_hi * c_hi
  cross_a = a_hi * c_lo
  cross = cross_a + a_lo * c_hi
  cross_carry = (cross < cross_a).astype(jnp.uint32)
  low = low_part + (cross << 16)
  carry = (low < low_part).astype(jnp.uint32)
  return high_part + (cross >> 16) + (cross_carry << 16) + carry, low


def index_words(coords, shape) -> tuple[jax.Array | None, jax.Array]:
  """Row-major flat index of elements of an array of static `shape`, as uint32 words.

  Args:
    coords: one uint32 array per axis (broadcastable), each element's index
      along that axis.
    shape: the array's static shape; no axis may exceed 2^32 elements.

  Returns:
    (high, low) with flat index = high * 2^32 + low; high is None when the
    array has at most 2^32 elements (every index fits in low).
  """
  shape = tuple(_dim(s) for s in shape)
  if len(coords) != len(shape):
    raise ValueError(f"jact.rng.index_words: {len(coords)} coordinates for shape {shape}")
  if any(_known(s) and s > 2**32 for s in shape):
    raise ValueError(
      f"jact hashes each element's index with one uint32 per axis, so no axis may hold more "
      f"than 2**32 elements; got shape {shape}. Reshape the tensor (e.g. split its longest "
      f"axis in two) before this op."
    )
  strides = [math.prod(shape[a + 1 :]) for a in range(len(shape))]
  if not all(_known(s) for s in strides):
    raise ValueError(
      f"jact.rng.index_words: only the leading axis may have a symbolic size "
      f"(jax.export), got shape {shape}; export with the other sizes concrete."
    )
  coords = [jnp.asarray(c, jnp.uint32) for c in coords]
  if _fits_32(shape):  # the old 32-bit index, unchanged
    return None, sum(
      (c if s == 1 else c * jnp.uint32(s) for c, s in zip(coords, strides)), jnp.uint32(0)
    )
  # A symbolic size (`jax.export`) may or may not fit in 32 bits: the wide index,
  # whose high word is 0 (and whose low word is the 32-bit index) where it does.
  high, low = jnp.uint32(0), jnp.uint32(0)
  for c, s, n in zip(coords, strides, shape):
    if _known(n) and (n - 1) * (s % 2**32) < 2**32:
      h, l = jnp.uint32(0), c * jnp.uint32(s % 2**32)
    else:
      h, l = _wide_product(c, s % 2**32)
    if s >= 2**32:
      h = h + c * jnp.uint32(s >> 32)
    low = low + l
    high = high + h + (low < l).astype(jnp.uint32)
  return high, low


def element_bits_at(seed: jax.Array, coords, shape) -> jax.Array:
  """32 hash bits of (seed, flat index) for the elements at `coords` of an array of `shape`.

  The flat index's high word is folded into the seed (seed ^ mix(high), the
  identity for high = 0), so element i and element i + 2^32 get unrelated
  bits, and an array of at most 2^32 elements gets hash_uint32(seed, i).
  """
  high, low = index_words(coords, shape)
  seed = jnp.asarray(seed, jnp.uint32)
  if high is not None:
    seed = seed ^ _lowbias32(high)
  return hash_uint32(seed, low)


def element_bits(seed: jax.Array, shape) -> jax.Array:
  """`element_bits_at` for every element of an array of static `shape` (shape's result)."""
  shape = tuple(_dim(s) for s in shape)
  if _fits_32(shape):  # the flat index directly: one iota, not one per axis
    index = jax.lax.iota(jnp.uint32, math.prod(shape)).reshape(shape)
    return hash_uint32(seed, index)
  coords = [jax.lax.broadcasted_iota(jnp.uint32, shape, a) for a in range(len(shape))]
  return element_bits_at(seed, coords, shape)
