"""The entry point of the "division_compress" op: `division_compress` validates
its arguments, then runs the implementation the kernel table picks (the XLA
reference, the one-pass Pallas kernel on a GPU, or the one named by
`implementation=` or `jact.kernels.use(division_compress=...)`).
`jact.compressors.Division` stores what it returns.

>>> import jax, jax.numpy as jnp
>>> x = jax.random.normal(jax.random.key(0), (2, 8, 8, 16))
>>> lfc, hfc = jax.jit(lambda x: division_compress(x, jnp.uint32(3), block=4, bits=2))(x)
>>> lfc.shape, lfc.dtype, hfc.bits
((2, 2, 2, 16), dtype(bfloat16), 2)
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jact import kernels
from jact._core.packing import check_bits
from jact._core.quantize import FLOAT_DTYPES, Packed, check_group_size

__all__ = ["division_compress"]


def division_compress(
  x: jax.Array,
  seed: jax.Array,
  *,
  block: int,
  bits: int,
  group_size: int = 256,
  lfc_dtype: Any = jnp.bfloat16,
  implementation: str | None = None,
) -> tuple[jax.Array, Packed]:
  """DIVISION's (LFC, packed HFC) of a channels-last map `x`.

  Args:
    x: float32, bfloat16 or float16 array of rank 3 to 5: (N, L, C),
      (N, H, W, C) or (N, D, H, W, C).
    seed: uint32 scalar seed of the HFC's stochastic rounding.
    block: pooling block and stride over each spatial axis (positive int).
    bits: HFC width: an integer 1 to 8, or 16.
    group_size: HFC values per group, a positive multiple of 8.
    lfc_dtype: LFC storage dtype: bfloat16, float32 or float16.
    implementation: the kernel ("xla", "jax_triton", "pallas_triton"; see
      `jact.kernels.available("division_compress")`); default: the best one
      for the backend, or the one chosen with `jact.kernels.use(...)`.

  Returns:
    The pooled map in `lfc_dtype` (N, ceil(S_i / B)..., C) and the HFC
    x - upsample(LFC) as `jact.compressors.PerGroup(bits, group_size)` stores it.
  """
  x = jnp.asarray(x)
  if jnp.dtype(x.dtype) not in FLOAT_DTYPES:
    raise TypeError(
      f"division_compress takes a float32, bfloat16 or float16 array, got "
      f"{x.dtype}; cast it first (x.astype(jnp.float32))."
    )
  if not 3 <= x.ndim <= 5:
    raise ValueError(
      f"division_compress takes channels-last inputs of rank 3 to 5 ((N, L, C), "
      f"(N, H, W, C) or (N, D, H, W, C)), got shape {tuple(x.shape)}; a rank-2 "
      f"input has no spatial axes: quantize it with jact.quantize instead."
    )
  if isinstance(block, bool) or not isinstance(block, (int, np.integer)) or block <= 0:
    raise ValueError(
      f"division_compress: block must be a positive int (the pooling block and "
      f"stride, e.g. 8), got {block!r}."
    )
  try:
    lfc = jnp.dtype(lfc_dtype)
  except TypeError:
    lfc = None
  if lfc not in FLOAT_DTYPES:
    raise ValueError(
      f"division_compress: lfc_dtype must be float32, bfloat16 or float16, got "
      f"{lfc_dtype!r}; use jnp.bfloat16 (default) or jnp.float32."
    )
  if seed is None:
    raise ValueError(
      "division_compress needs a uint32 seed for the HFC's stochastic rounding, "
      "got None; draw one with jact.rng.seed_from_key(key)."
    )
  fn = kernels.dispatch("division_compress", implementation, size=x.size)
  return fn(
    x,
    seed,
    block=int(block),
    bits=check_bits(bits),
    group_size=check_group_size(group_size),
    lfc_dtype=lfc_dtype,
  )
