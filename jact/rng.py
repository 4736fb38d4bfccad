"""Counter-based hash random bits for the rounding noise (no tensor-sized PRNG state).

The public names of `jact._core.rng` (an internal module).
"""

from jact._core.rng import (
  seed_from_key as seed_from_key,
  hash_uint32 as hash_uint32,
  uniform_from_bits as uniform_from_bits,
  split_seed as split_seed,
  element_bits as element_bits,
  element_bits_at as element_bits_at,
  index_words as index_words,
)

__all__ = [
  "seed_from_key",
  "hash_uint32",
  "uniform_from_bits",
  "split_seed",
  "element_bits",
  "element_bits_at",
  "index_words",
]
