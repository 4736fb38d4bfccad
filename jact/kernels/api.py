"""The entry points that run a registered kernel: `jact.quantize`, `jact.dequantize`,
per-sample packing. Each validates its arguments, then runs the implementation
`jact.kernels.dispatch` picks (or the one named by `implementation=`).

>>> import jax, jax.numpy as jnp
>>> x = jnp.linspace(-1.0, 1.0, 2 * 320).reshape(2, 320)
>>> p = quantize(x, jax.random.key(0), bits=4)
>>> p.data.shape, p.data.dtype, p.nbytes, p.group_size
((2, 2, 80), dtype('uint8'), 336, 160)
>>> bool(jnp.abs(dequantize(p) - x).max() <= 2 / 15)
True
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jact import kernels
from jact.core import rng
from jact.core.persample import PackedPerSample, _layout
from jact.core.quantize import (Packed, check_bits, check_float_dtype, check_group_size,
                                effective_group_size)

__all__ = ["quantize", "dequantize", "quantize_per_sample", "dequantize_per_sample"]


def quantize(x: jax.Array, key=None, *, bits: int = 4, group_size: int = 256,
             stochastic: bool = True, seed: jax.Array | None = None,
             implementation: str | None = None) -> Packed:
  """Quantizes `x` per sample and per group of `group_size` values.

  Args:
    x: float32, bfloat16 or float16 array; axis 0 is the sample axis.
    key: JAX PRNG key for the rounding noise (required when stochastic and
      `seed` is not given).
    bits: 1, 2, 4 or 8.
    group_size: values per group, a positive multiple of 8.
    stochastic: unbiased stochastic rounding (default) or round-to-nearest.
    seed: a uint32 scalar seed (see `jact.rng.seed_from_key`) used instead of key.
    implementation: kernel to run ("xla", "pallas_triton", see
      `jact.kernels.available("quantize")`); default: the best one for the
      backend, or the one chosen with `jact.kernels.use(quantize=...)`.

  Returns:
    A `Packed` pytree; `dequantize` reverses it, E[dequantize(quantize(x))] = x.
    Every implementation returns the same bits for the same seed.
  """
  bits = check_bits(bits)
  group_size = check_group_size(group_size)
  check_float_dtype(x)
  if stochastic and seed is None:
    seed = rng.seed_from_key(key)
  d = math.prod(x.shape[1:]) if x.ndim else 1
  group_size = effective_group_size(d, group_size)
  quantize_fn = kernels.dispatch("quantize", implementation, size=x.size)
  return quantize_fn(x, seed if stochastic else None, bits=bits, group_size=group_size,
                     stochastic=bool(stochastic))


def dequantize(packed: Packed, dtype=None, *, implementation: str | None = None) -> jax.Array:
  """Reconstructs the tensor from a `Packed` (in its own dtype unless `dtype` is given).

  `implementation` picks the kernel as in `quantize`.
  """
  if not isinstance(packed, Packed):
    raise TypeError(
        f"jact.dequantize takes the jact.Packed that jact.quantize returns, got "
        f"{'an array' if isinstance(packed, (jax.Array, np.ndarray)) else type(packed).__name__}"
        "; quantize the array first (p = jact.quantize(x, key, bits=4), "
        "then jact.dequantize(p)). A compressor's stored residual is restored with "
        "compressor.decompress(stored), packed codes with jact.unpack_codes.")
  return kernels.dispatch("dequantize", implementation, size=packed.data.size)(packed, dtype)


def quantize_per_sample(x: jax.Array, bits: jax.Array, *, capacity_bytes: int, group_size: int = 256,
                        stochastic: bool = True, seed: jax.Array | None = None,
                        key=None, implementation: str | None = None) -> PackedPerSample:
  """Quantizes each sample n of `x` at its own width `bits[n]` into one buffer.

  Args:
    x: float32, bfloat16 or float16 array, shape (N, ...).
    bits: int[N] widths in (1, 2, 4, 8); may be traced (decided under jit).
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
  if (isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, (int, np.integer))
      or capacity_bytes < n * dp // 8):
    raise ValueError(f"capacity_bytes={capacity_bytes!r} cannot hold {n} samples of {dp} values at "
                     f"even 1 bit each ({n * dp // 8} bytes); size the buffer with "
                     f"per_sample_capacity(x.shape, avg_bits) for an average of at least 1 bit.")
  capacity = int(capacity_bytes)
  if capacity + n * dp >= 2**31:
    raise ValueError(f"tensor too large for int32 byte offsets ({n} x {dp} values, capacity {capacity}).")
  if stochastic and seed is None:
    seed = rng.seed_from_key(key)
  bits = jnp.asarray(bits)
  if bits.shape != (n,) or not jnp.issubdtype(bits.dtype, jnp.integer):
    raise ValueError(f"bits must be an integer array of shape ({n},) (one width per sample), got "
                     f"{bits.dtype}{list(bits.shape)}.")
  bits = bits.astype(jnp.int32)
  bits = jnp.select([bits >= 8, bits >= 4, bits >= 2], [8, 4, 2], 1)
  bits = jnp.where(jnp.sum(bits) * (dp // 8) > capacity, 1, bits)
  quantize_fn = kernels.dispatch("quantize_per_sample", implementation, size=x.size)
  return quantize_fn(x, bits, capacity_bytes=capacity, group_size=group_size,
                     seed=seed if stochastic else None)


def dequantize_per_sample(p: PackedPerSample, dtype=None, *,
                          implementation: str | None = None) -> jax.Array:
  """Reconstructs the tensor from a `PackedPerSample` (its own dtype unless given);
  `implementation` picks the kernel as in `quantize_per_sample`."""
  return kernels.dispatch("dequantize_per_sample", implementation, size=p.data.size)(p, dtype)
