"""The XLA reference of per-sample mixed precision: `quantize_per_sample_reference`
and `dequantize_per_sample_reference` (the "quantize_per_sample" /
"dequantize_per_sample" ops' "xla" implementations, the kernels' oracle).

The layout (`PackedPerSample`, one buffer, samples back to back) is described
in `jact._core.persample`; the validated entry points are
`jact.kernels._per_sample.api`.

>>> import jax.numpy as jnp
>>> x = jnp.linspace(-1.0, 1.0, 4 * 64).reshape(4, 64)
>>> p = quantize_per_sample_reference(x, jnp.array([1, 2, 4, 8], jnp.int32), capacity_bytes=120,
...                                   group_size=64, seed=None)
>>> p.data.shape, p.bits.tolist()
((120,), [1, 2, 4, 8])
>>> y = dequantize_per_sample_reference(p)
>>> bool(jnp.all(jnp.abs(y - x) <= p.scale.astype(jnp.float32)))
True
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jact._core.packing import unpack_bits
from jact._core.persample import PackedPerSample
from jact._core.quantize import decode_groups, group_codes, grouped

__all__ = ["quantize_per_sample_reference", "dequantize_per_sample_reference"]


def _scatter_rows(buf: jax.Array, rows: jax.Array, starts: jax.Array) -> jax.Array:
  """buf[starts[i] : starts[i] + rows.shape[1]] = rows[i]; out-of-bounds rows are dropped."""
  dnums = jax.lax.ScatterDimensionNumbers(
    update_window_dims=(1,), inserted_window_dims=(), scatter_dims_to_operand_dims=(0,)
  )
  return jax.lax.scatter(
    buf, starts[:, None], rows, dnums, mode=jax.lax.GatherScatterMode.FILL_OR_DROP
  )


def _offsets(bits: jax.Array, dp: int) -> jax.Array:
  """Byte offset of each sample's segment (exclusive prefix sum of b_n Dp / 8)."""
  size = bits.astype(jnp.int32) * (dp // 8)
  return jnp.cumsum(size) - size


def _planar(bits: jax.Array) -> jax.Array:
  """Whether each width is stored as bit planes (3, 5, 6, 7: not a divisor of 8)."""
  return (bits == 3) | ((bits >= 5) & (bits <= 7))


def _bit_planes(codes: jax.Array) -> jax.Array:
  """uint8[n, 8, unit] codes -> uint8[n, 8, unit] bit planes: byte j of plane p
  holds bit p of code (i, j) at bit i."""
  shifts = jnp.arange(8, dtype=jnp.uint8)
  fields = ((codes[:, None, :, :] >> shifts[None, :, None, None]) & jnp.uint8(1)) << shifts[
    None, None, :, None
  ]
  return jnp.sum(fields, axis=2, dtype=jnp.uint8)


def _from_bit_planes(planes: jax.Array, bits: jax.Array) -> jax.Array:
  """Inverse of `_bit_planes` for the first bits[n] planes of each sample (the
  others are the next samples' bytes and are ignored)."""
  shifts = jnp.arange(8, dtype=jnp.uint8)
  used = shifts[None, :] < bits[:, None].astype(jnp.uint8)  # (n, plane)
  planes = jnp.where(used[:, :, None], planes, jnp.uint8(0))
  fields = ((planes[:, :, None, :] >> shifts[None, None, :, None]) & jnp.uint8(1)) << shifts[
    None, :, None, None
  ]
  return jnp.sum(fields, axis=1, dtype=jnp.uint8)


def quantize_per_sample_reference(
  x: jax.Array, bits: jax.Array, *, capacity_bytes: int, group_size: int, seed: jax.Array | None
) -> PackedPerSample:
  """The XLA reference of `quantize_per_sample`: `bits` int32[N] already in
  1..8 and fitting `capacity_bytes`, `group_size` the effective one,
  `seed` a uint32 scalar or None (round to nearest)."""
  dtype = jnp.dtype(x.dtype)
  capacity = int(capacity_bytes)
  n = x.shape[0]
  d = math.prod(x.shape[1:])
  dp = -(-d // group_size) * group_size
  stochastic = seed is not None

  # Group statistics and codes as in jact.quantize, with per-sample levels.
  g, _ = grouped(x, group_size)
  levels = ((1 << bits) - 1).astype(jnp.float32)[:, None]
  minimum, scale, codes = group_codes(g, levels, seed if stochastic else None, d, dtype)
  codes = codes.reshape(n, dp)

  # Every width is packed for every sample (static shapes), in units of
  # Dp / 8 bytes: sample n's segment is its first bits[n] units, and one
  # scatter writes those at the sample's offset (the other units get an
  # out-of-bounds start and are dropped). The codes are first paired
  # losslessly into uint16 (values j and j + Dp/2) by a reduction, which XLA
  # materializes, so the noise is hashed once; the planar packings are then
  # cheap folds of the pairs: a fold halves a segment, or-ing its second half
  # in shifted by the new width (8 -> 4 -> 2 -> 1 bits keeps the order).
  unit = dp // 8
  if not n * unit:  # no values: nothing to pack
    return PackedPerSample(
      jnp.zeros((capacity,), jnp.uint8),
      bits.astype(jnp.uint8),
      minimum,
      scale,
      tuple(x.shape),
      dtype,
      group_size,
    )
  pairs = jnp.sum(
    codes.reshape(n, 2, 4 * unit).astype(jnp.uint16) << jnp.array([0, 8], jnp.uint16)[:, None],
    axis=1,
    dtype=jnp.uint16,
  )
  lo, hi = (pairs & 255).astype(jnp.uint8), (pairs >> 8).astype(jnp.uint8)
  f4 = (lo & 15) | (hi << 4)
  f2 = f4[:, : 2 * unit] | (f4[:, 2 * unit :] << 2)
  f1 = f2[:, :unit] | (f2[:, unit:] << 1)

  def units(a):  # (n, k units) -> (n, 4 units), repeated (units past k are dropped)
    k = a.shape[1] // unit
    return jnp.broadcast_to(a.reshape(n, 1, k, unit), (n, 4 // k, k, unit)).reshape(n, 4, unit)

  w = bits[:, None, None]
  first = jnp.select([w == 8, w == 4, w == 2], [units(lo), units(f4), units(f2)], units(f1))
  second = jax.lax.broadcasted_iota(jnp.int32, (n, 2, 4, unit), 1) == 1
  chunks = jnp.where(second, units(hi)[:, None], first[:, None]).reshape(n, 8, unit)
  # Widths 3, 5, 6, 7: unit p is bit plane p of the sample's 8 x unit codes
  # (`jact._core.packing.pack_bits`' layout), the same bytes for any width.
  planes = _bit_planes(codes.reshape(n, 8, unit))
  chunks = jnp.where(_planar(bits)[:, None, None], planes, chunks).reshape(n * 8, unit)
  k = jnp.arange(8, dtype=jnp.int32)
  starts = jnp.where(k < bits[:, None], _offsets(bits, dp)[:, None] + k * unit, capacity)
  data = _scatter_rows(jnp.zeros((capacity,), jnp.uint8), chunks, starts.reshape(-1))
  return PackedPerSample(
    data, bits.astype(jnp.uint8), minimum, scale, tuple(x.shape), dtype, group_size
  )


def dequantize_per_sample_reference(p: PackedPerSample, dtype=None) -> jax.Array:
  """The XLA reference of `dequantize_per_sample`."""
  n, groups = p.scale.shape
  group_size, dp = p.group_size, groups * p.group_size
  bits = p.bits.astype(jnp.int32)
  unit = dp // 8
  if not n * unit:
    return jnp.zeros(p.shape, dtype or p.dtype)
  starts = _offsets(bits, dp)[:, None] + jnp.arange(8, dtype=jnp.int32) * unit
  # Eight units per sample (clamped into the buffer; past bits[n] they are unused).
  seg = jax.vmap(lambda o: jax.lax.dynamic_slice(p.data, (o,), (unit,)))(starts.reshape(-1))
  seg = seg.reshape(n, dp)
  w = bits[:, None]
  codes = jnp.select(
    [w == 8, w == 4, w == 2, _planar(bits)[:, None]],
    [
      seg,
      unpack_bits(seg[:, : 4 * unit], 4),
      unpack_bits(seg[:, : 2 * unit], 2),
      _from_bit_planes(seg.reshape(n, 8, unit), bits).reshape(n, dp),
    ],
    unpack_bits(seg[:, :unit], 1),
  )
  codes = codes.reshape(n, groups, group_size).astype(jnp.float32)
  d = math.prod(p.shape[1:])
  dtype = jnp.dtype(dtype or p.dtype)
  levels = ((1 << bits) - 1).astype(jnp.float32)[:, None, None]
  g = decode_groups(
    codes,
    p.minimum.astype(jnp.float32)[..., None],
    p.scale.astype(jnp.float32)[..., None],
    levels,
    dtype,
    p.dtype,
  )
  return g.reshape(n, dp)[:, :d].reshape(p.shape).astype(dtype)
