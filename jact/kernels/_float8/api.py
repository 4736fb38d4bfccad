"""The entry point of the "float8_compress" op: `float8_compress` validates its
arguments, then runs the implementation the kernel table picks (the XLA
reference, the Pallas kernel on a GPU, or the one named by `implementation=`
or `jact.kernels.use(float8_compress=...)`). `jact.compressors.Float8` stores
what it returns.

>>> import jax.numpy as jnp
>>> codes, scale = float8_compress(jnp.ones((2, 40)), None, format="e5m2")
>>> codes.shape, codes.dtype, scale.shape, scale.dtype
((2, 40), dtype('uint8'), (2, 2), dtype('uint8'))
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jact import kernels
from jact._core.float8 import FORMATS, SCALES
from jact._core.quantize import FLOAT_DTYPES

__all__ = ["float8_compress"]


def float8_compress(
  x: jax.Array,
  seed,
  *,
  format: str = "e4m3",
  block_size: int = 32,
  scale: str = "pow2",
  stochastic: bool = False,
  implementation: str | None = None,
) -> tuple[jax.Array, jax.Array]:
  """(uint8 float8 codes in x's shape, per-block scales) of x (`jact._core.float8`).

  Args:
    x: float32, bfloat16 or float16 array; blocks run along each row of the
      leading axis (a 0-D or 1-D array is one row).
    seed: uint32 scalar seed of the stochastic rounding (None when not stochastic).
    format: "e4m3" or "e5m2".
    block_size: values per block (a positive int).
    scale: "pow2" (E8M0 uint8 exponents) or "float" (float32 scales).
    stochastic: unbiased stochastic rounding, or round to nearest even.
    implementation: the kernel ("xla", "jax_triton", "pallas_triton"; see
      `jact.kernels.available("float8_compress")`); default: the best one for
      the backend, or the one chosen with `jact.kernels.use(...)`.
  """
  x = jnp.asarray(x)
  if jnp.dtype(x.dtype) not in FLOAT_DTYPES:
    raise TypeError(
      f"float8_compress takes a float32, bfloat16 or float16 array, got {x.dtype}; "
      "cast it first (x.astype(jnp.float32))."
    )
  if format not in FORMATS or scale not in SCALES:
    raise ValueError(
      f"float8_compress: format must be one of {sorted(FORMATS)} and scale one of "
      f"{list(SCALES)}, got format={format!r}, scale={scale!r}."
    )
  if (
    isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)) or block_size <= 0
  ):
    raise ValueError(
      f"float8_compress: block_size must be a positive int (MXFP8 uses 32), got {block_size!r}."
    )
  if stochastic and seed is None:
    raise ValueError(
      "float8_compress: stochastic rounding needs a uint32 seed (jact.rng.seed_from_key(key)), "
      "or pass stochastic=False for round to nearest even."
    )
  fn = kernels.dispatch("float8_compress", implementation, size=x.size)
  return fn(
    x, seed, format=format, block_size=int(block_size), scale=scale, stochastic=bool(stochastic)
  )
