"""The XLA reference of the "float8_compress" op: a tensor's float8 codes and
per-block scales (`jact._core.float8`), the oracle of the Pallas kernel
(`jact.kernels._float8.pallas_triton`). The validated entry point is
`jact.kernels._float8.api.float8_compress`.

>>> import jax.numpy as jnp
>>> codes, scale = float8_compress_reference(
...   jnp.array([[1.0, -2.0, 3.0, 448.0]]), None, format="e4m3", block_size=2, scale="pow2",
...   stochastic=False)
>>> [hex(int(c)) for c in codes[0]], scale.tolist()
(['0x70', '0xf8', '0x44', '0x7e'], [[120, 127]])
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jact._core import rng
from jact._core.float8 import (
  FORMATS,
  block_exponent,
  float8_codes,
  pow2,
  round_to_float8,
  row_layout,
)

__all__ = ["float8_compress_reference"]


def float8_compress_reference(
  x: jax.Array, seed, *, format: str, block_size: int, scale: str, stochastic: bool
) -> tuple[jax.Array, jax.Array]:
  """(uint8 codes in x's shape, scales (rows, blocks a row)): E8M0 uint8 for
  scale="pow2", float32 for "float". `seed`: a uint32 scalar when stochastic
  (the noise is `jact.rng.element_bits` of x's flat index), else ignored."""
  fmt = FORMATS[format]
  shape = tuple(x.shape)
  n, d, nb = row_layout(shape, block_size)
  v = x.astype(jnp.float32).reshape(n, d)
  padded = jnp.pad(v, ((0, 0), (0, nb * block_size - d))).reshape(n, nb, block_size)
  a = jnp.abs(padded)
  amax = jnp.max(jnp.where(jnp.isfinite(a), a, 0.0), axis=-1, initial=0.0)
  per_value = lambda s: jnp.repeat(s, block_size, axis=1)[:, :d]
  if scale == "pow2":
    e = block_exponent(amax, fmt)
    stored = (e + 127).astype(jnp.uint8)
    scaled = v * per_value(pow2(-e))
  else:
    # amax times the float32 reciprocal of the format's max, written out: XLA rewrites a
    # division by a constant into that product on every backend, so the kernels (whose
    # division would be exact) multiply by the same constant
    stored = amax * (np.float32(1.0) / np.float32(fmt.max))
    s = per_value(stored)
    scaled = jnp.clip(jnp.where(s > 0, v / jnp.where(s > 0, s, 1.0), 0.0), -fmt.max, fmt.max)
  scaled = jnp.where(jnp.isfinite(v), scaled, 0.0)
  noise = rng.element_bits(seed, shape).reshape(n, d) if stochastic else None
  codes = float8_codes(round_to_float8(scaled, fmt, noise), v, fmt)
  return codes.reshape(shape), stored
