"""The entry points of per-group quantization, `jact.quantize` and
`jact.dequantize`: each validates its arguments, then runs the implementation
the kernel table picks for its op ("quantize" / "dequantize": the XLA
reference, the Pallas kernel on a GPU, or the one named by `implementation=`
or `jact.kernels.use`).

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
import numpy as np

from jact import kernels
from jact._core import rng
from jact._core.stored import register_decoder
from jact._core.quantize import (
  Packed,
  check_bits,
  check_float_dtype,
  check_group_size,
  effective_group_size,
)

__all__ = ["quantize", "dequantize"]


def quantize(
  x: jax.Array,
  key=None,
  *,
  bits: int = 4,
  group_size: int = 256,
  stochastic: bool = True,
  seed: jax.Array | None = None,
  implementation: str | None = None,
) -> Packed:
  """Quantizes `x` per sample and per group of `group_size` values.

  Args:
    x: float32, bfloat16 or float16 array; axis 0 is the sample axis.
    key: JAX PRNG key for the rounding noise (required when stochastic and
      `seed` is not given).
    bits: an integer width 1 to 8, or 16 (`jact._core.packing.SUPPORTED_BITS`).
    group_size: values per group, a positive multiple of 8.
    stochastic: unbiased stochastic rounding (default) or round-to-nearest.
    seed: a uint32 scalar seed (see `jact.rng.seed_from_key`) used instead of key.
    implementation: kernel to run ("xla", "jax_triton", "pallas_triton", see
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
  return quantize_fn(
    x, seed if stochastic else None, bits=bits, group_size=group_size, stochastic=bool(stochastic)
  )


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
      "compressor.decompress(stored), packed codes with jact.unpack_codes."
    )
  # the kernel addresses every value of the padded groups it writes, not the packed bytes
  n, groups = packed.data.shape[0], packed.data.shape[1]
  size = max(math.prod(packed.shape), n * groups * packed.group_size)
  return kernels.dispatch("dequantize", implementation, size=size)(packed, dtype)


register_decoder(Packed, dequantize)  # `Packed.decompress`
