"""The XLA reference of per-group quantization: `quantize_reference`,
`dequantize_reference` (the "quantize" / "dequantize" ops' "xla"
implementations, the oracle every kernel is checked against) and
`quantize_rows_reference` (what `jact.compressors.PerGroup` stores).

The layout and the group math they share with the kernels (`Packed`,
`grouped`, `group_codes`, `decode_groups`, ...) are in `jact._core.quantize`;
the validated entry points are `jact.kernels._quantize.api`.

>>> import jax, jax.numpy as jnp
>>> from jact._core import rng
>>> x = jnp.linspace(-1.0, 1.0, 2 * 320).reshape(2, 320)
>>> p = quantize_reference(x, rng.seed_from_key(jax.random.key(0)), bits=4, group_size=160)
>>> p.data.shape, p.data.dtype, p.nbytes, p.group_size
((2, 2, 80), dtype('uint8'), 336, 160)
>>> bool(jnp.abs(dequantize_reference(p) - x).max() <= 2 / 15)
True
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from jact._core.packing import pack_bits, unpack_bits
from jact._core.quantize import (
  Packed,
  as_rows,
  decode_groups,
  effective_group_size,
  group_codes,
  grouped,
)

__all__ = ["quantize_reference", "dequantize_reference", "quantize_rows_reference"]


def quantize_reference(
  x: jax.Array, seed: jax.Array | None, *, bits: int, group_size: int, stochastic: bool = True
) -> Packed:
  """The XLA reference of `quantize` (validated arguments; `group_size` already
  the effective one, `seed` a uint32 scalar or None when not stochastic)."""
  levels = float((1 << bits) - 1)
  g, (n, groups, d) = grouped(x, group_size)
  minimum, scale, codes = group_codes(g, levels, seed if stochastic else None, d, x.dtype)
  data = pack_bits(codes, bits)
  return Packed(data, minimum, scale, tuple(x.shape), jnp.dtype(x.dtype), bits, group_size)


def dequantize_reference(packed: Packed, dtype=None) -> jax.Array:
  """The XLA reference of `dequantize`."""
  dtype = jnp.dtype(dtype or packed.dtype)
  codes = unpack_bits(packed.data, packed.bits).astype(jnp.float32)
  g = decode_groups(
    codes,
    packed.minimum.astype(jnp.float32)[..., None],
    packed.scale.astype(jnp.float32)[..., None],
    float((1 << packed.bits) - 1),
    dtype,
    packed.dtype,
  )
  n, groups, group_size = g.shape
  d = math.prod(packed.shape[1:]) if packed.shape else 1
  flat = g.reshape(n, groups * group_size)  # explicit: -1 is ambiguous for empty tensors
  if flat.shape[1] != d:
    flat = flat[:, :d]
  return flat.reshape(packed.view_shape or packed.shape).astype(dtype)


def quantize_rows_reference(
  x: jax.Array, seed: jax.Array | None, *, bits: int, group_size: int, stochastic: bool = True
) -> Packed:
  """`quantize_reference` of `x` viewed as rows (`as_rows`), with the effective
  group size: exactly what `jact.compressors.PerGroup(bits, group_size).compress`
  stores for `x`."""
  rows = as_rows(tuple(x.shape), group_size)
  g = effective_group_size(math.prod(rows[1:]), group_size)
  packed = quantize_reference(
    x.reshape(rows), seed if stochastic else None, bits=bits, group_size=g, stochastic=stochastic
  )
  if rows != tuple(x.shape):
    packed = dataclasses.replace(packed, view_shape=tuple(x.shape))
  return packed
