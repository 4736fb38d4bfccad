"""The entry points of per-sample mixed precision (`jact._core.persample`):
`quantize_per_sample` and `dequantize_per_sample` validate their arguments,
then run the implementation the kernel table picks for their op
("quantize_per_sample" / "dequantize_per_sample").

>>> import jax, jax.numpy as jnp
>>> from jact._core.persample import per_sample_capacity
>>> x = jnp.linspace(-1.0, 1.0, 4 * 64).reshape(4, 64)
>>> cap = per_sample_capacity(x.shape, avg_bits=4.0)
>>> @jax.jit
... def roundtrip(x, bits, key):
...   p = quantize_per_sample(x, bits, capacity_bytes=cap, key=key)
...   return p.bits, dequantize_per_sample(p)
>>> bits, y = roundtrip(x, jnp.array([1, 2, 4, 8]), jax.random.key(0))
>>> bits.tolist(), y.shape
([1, 2, 4, 8], (4, 64))
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jact import kernels
from jact._core import rng
from jact._core.stored import register_decoder
from jact._core.persample import PackedPerSample, _layout
from jact._core.quantize import check_float_dtype

__all__ = ["quantize_per_sample", "dequantize_per_sample"]


def quantize_per_sample(
  x: jax.Array,
  bits: jax.Array,
  *,
  capacity_bytes: int,
  group_size: int = 256,
  stochastic: bool = True,
  seed: jax.Array | None = None,
  key=None,
  implementation: str | None = None,
) -> PackedPerSample:
  """Quantizes each sample n of `x` at its own width `bits[n]` into one buffer.

  Args:
    x: float32, bfloat16 or float16 array, shape (N, ...).
    bits: int[N] widths in 1..8 (values outside are clipped into it); may
      be traced (decided under jit). Widths dividing 8 are packed planar, 3,
      5, 6 and 7 as bit planes (`jact._core.packing.pack_bits`' layouts).
    capacity_bytes: static buffer length, at least N * Dp / 8 (1 bit per
      value); see `per_sample_capacity`. Widths needing more than this make
      every sample fall back to 1 bit.
    group_size: values per group, a positive multiple of 8 (adapted to the
      sample size exactly as in `jact.quantize`).
    stochastic: unbiased stochastic rounding (default) or round-to-nearest.
    seed: uint32 scalar seed for the hash noise; drawn from `key` when None.
    key: JAX PRNG key (needed when stochastic and no seed is given).
    implementation: the kernel (see `jact.kernels`); default: the best one
      for the backend. All return the same bits.

  Returns:
    A `PackedPerSample`; `dequantize_per_sample` reverses it, unbiased.
  """
  check_float_dtype(x)
  n, group_size, dp = _layout(tuple(x.shape), group_size)
  if (
    isinstance(capacity_bytes, bool)
    or not isinstance(capacity_bytes, (int, np.integer))
    or capacity_bytes < n * dp // 8
  ):
    raise ValueError(
      f"capacity_bytes={capacity_bytes!r} cannot hold {n} samples of {dp} values at "
      f"even 1 bit each ({n * dp // 8} bytes); size the buffer with "
      f"per_sample_capacity(x.shape, avg_bits) for an average of at least 1 bit."
    )
  capacity = int(capacity_bytes)
  if capacity + n * dp >= 2**31:
    raise ValueError(
      f"tensor too large for int32 byte offsets ({n} x {dp} values, capacity {capacity})."
    )
  if stochastic and seed is None:
    seed = rng.seed_from_key(key)
  bits = jnp.asarray(bits)
  if bits.shape != (n,) or not jnp.issubdtype(bits.dtype, jnp.integer):
    raise ValueError(
      f"bits must be an integer array of shape ({n},) (one width per sample), got "
      f"{bits.dtype}{list(bits.shape)}."
    )
  bits = bits.astype(jnp.int32)
  bits = jnp.clip(bits, 1, 8)
  bits = jnp.where(jnp.sum(bits) * (dp // 8) > capacity, 1, bits)
  quantize_fn = kernels.dispatch("quantize_per_sample", implementation, size=x.size)
  return quantize_fn(
    x, bits, capacity_bytes=capacity, group_size=group_size, seed=seed if stochastic else None
  )


def dequantize_per_sample(
  p: PackedPerSample, dtype=None, *, implementation: str | None = None
) -> jax.Array:
  """Reconstructs the tensor from a `PackedPerSample` (its own dtype unless given);
  `implementation` picks the kernel as in `quantize_per_sample`."""
  if not isinstance(p, PackedPerSample):
    raise TypeError(
      f"dequantize_per_sample takes the PackedPerSample that quantize_per_sample "
      f"returns, got {type(p).__name__}; quantize the array first "
      f"(p = quantize_per_sample(x, bits, capacity_bytes=..., key=key))."
    )
  # the kernel addresses every value of the tensor it writes, not the buffer's bytes
  size = max(math.prod(p.shape), p.data.size)
  return kernels.dispatch("dequantize_per_sample", implementation, size=size)(p, dtype)


register_decoder(PackedPerSample, dequantize_per_sample)  # `PackedPerSample.decompress`
