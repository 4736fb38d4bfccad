"""Per-sample mixed precision (ActNN L3): one width per sample, one static buffer.

Sample n of x (axis 0) is quantized per group exactly like `jact.quantize`
(same groups, bf16 statistics, non-finite flags and kinds, hash noise) but with
its own width b_n in (1, 2, 4, 8), decided at run time (e.g. by
`jact.allocate.allocate_per_sample` inside the same jit). Its codes are
packed at b_n bits per value -- planar within the sample: with k = 8 // b_n
codes per byte and Q = Dp // k bytes, byte j holds the sample's values j,
j+Q, j+2Q, ... (Dp = values per sample padded to whole groups) -- and the
samples lie back to back in ONE uint8 buffer of static length
`capacity_bytes`, sample n at byte sum_{m<n} b_m Dp / 8. Shapes never depend
on the widths, so the buffer is an ordinary jit value and residual.

Widths that do not fit the capacity are the caller's bug, but cannot be
reported from inside jit: every sample then falls back to 1 bit (which
always fits, checked at trace time), so memory is never overrun and no NaN
appears. Values outside (1, 2, 4, 8) are rounded down to one (at least 1).

>>> import jax, jax.numpy as jnp
>>> from jact.kernels.api import dequantize_per_sample, quantize_per_sample  # entry points
>>> x = jnp.linspace(-1.0, 1.0, 4 * 64).reshape(4, 64)
>>> cap = per_sample_capacity(x.shape, avg_bits=3.0)  # 12 bits per value in all
>>> @jax.jit
... def roundtrip(x, bits, key):
...   p = quantize_per_sample(x, bits, capacity_bytes=cap, key=key)
...   return p, dequantize_per_sample(p)
>>> p, y = roundtrip(x, jnp.array([1, 2, 4, 4]), jax.random.key(0))
>>> p.data.shape, p.nbytes, p.bits.tolist()
((96,), 116, [1, 2, 4, 4])
>>> bool(jnp.all(jnp.abs(y - x) <= p.scale.astype(jnp.float32)))
True
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jact.core.packing import unpack_bits
from jact.core.quantize import (check_group_size, decode_groups, effective_group_size,
                                group_codes, grouped)

__all__ = ["PackedPerSample", "per_sample_capacity", "quantize_per_sample_reference",
           "dequantize_per_sample_reference"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedPerSample:
  """A tensor quantized with one width per sample, packed into one buffer.

  Attributes:
    data: uint8[capacity] packed codes, samples back to back.
    bits: uint8[N] width used for each sample (after any fallback).
    minimum: bfloat16[N, groups] group minimum (rounded down).
    scale: bfloat16[N, groups] quantization step (rounded up).
    shape, dtype, group_size: static description of the original tensor.
  """
  data: jax.Array
  bits: jax.Array
  minimum: jax.Array
  scale: jax.Array
  shape: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
  dtype: Any = dataclasses.field(metadata=dict(static=True))
  group_size: int = dataclasses.field(metadata=dict(static=True))

  @property
  def nbytes(self) -> int:
    """Bytes stored (buffer + widths + bf16 group statistics); static."""
    return int(self.data.size + self.bits.size + 2 * self.minimum.size + 2 * self.scale.size)


def _layout(shape: tuple[int, ...], group_size: int) -> tuple[int, int, int]:
  """(N, effective group size, padded values per sample Dp) for a tensor shape."""
  if len(shape) < 1:
    raise ValueError("per-sample quantization needs a leading sample axis; got a scalar.")
  d = math.prod(shape[1:])
  g = effective_group_size(d, check_group_size(group_size))
  return shape[0], g, -(-d // g) * g


def per_sample_capacity(shape: tuple[int, ...], avg_bits: float, group_size: int = 256) -> int:
  """Static buffer bytes for `shape` at `avg_bits` bits per value on average.

  ceil(floor(avg_bits * N) * Dp / 8), with Dp the per-sample size padded to
  whole groups (as in `jact.quantize`); averages above 8 count as 8. Widths
  from `allocate_per_sample(w, avg_bits)` always fit it.

  >>> per_sample_capacity((16, 28, 28), 2.5), per_sample_capacity((16, 28, 28), 9.0)
  (3920, 12544)
  """
  n, _, dp = _layout(tuple(shape), group_size)
  if (isinstance(avg_bits, bool) or not isinstance(avg_bits, (int, float, np.integer, np.floating))
      or not math.isfinite(avg_bits) or avg_bits < 1):
    raise ValueError(f"avg_bits must be a finite number >= 1 (every value needs at least 1 bit), "
                     f"got {avg_bits!r}.")
  return -(-min(math.floor(avg_bits * n), 8 * n) * dp // 8)


def _scatter_rows(buf: jax.Array, rows: jax.Array, starts: jax.Array) -> jax.Array:
  """buf[starts[i] : starts[i] + rows.shape[1]] = rows[i]; out-of-bounds rows are dropped."""
  dnums = jax.lax.ScatterDimensionNumbers(
      update_window_dims=(1,), inserted_window_dims=(), scatter_dims_to_operand_dims=(0,))
  return jax.lax.scatter(buf, starts[:, None], rows, dnums,
                         mode=jax.lax.GatherScatterMode.FILL_OR_DROP)


def _offsets(bits: jax.Array, dp: int) -> jax.Array:
  """Byte offset of each sample's segment (exclusive prefix sum of b_n Dp / 8)."""
  size = bits.astype(jnp.int32) * (dp // 8)
  return jnp.cumsum(size) - size


def quantize_per_sample_reference(x: jax.Array, bits: jax.Array, *, capacity_bytes: int,
                                  group_size: int, seed: jax.Array | None) -> PackedPerSample:
  """The XLA reference of `quantize_per_sample`: `bits` int32[N] already in
  (1, 2, 4, 8) and fitting `capacity_bytes`, `group_size` the effective one,
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
    return PackedPerSample(jnp.zeros((capacity,), jnp.uint8), bits.astype(jnp.uint8), minimum, scale,
                           tuple(x.shape), dtype, group_size)
  pairs = jnp.sum(codes.reshape(n, 2, 4 * unit).astype(jnp.uint16)
                  << jnp.array([0, 8], jnp.uint16)[:, None], axis=1, dtype=jnp.uint16)
  lo, hi = (pairs & 255).astype(jnp.uint8), (pairs >> 8).astype(jnp.uint8)
  f4 = (lo & 15) | (hi << 4)
  f2 = f4[:, :2 * unit] | (f4[:, 2 * unit:] << 2)
  f1 = f2[:, :unit] | (f2[:, unit:] << 1)

  def units(a):  # (n, k units) -> (n, 4 units), repeated (units past k are dropped)
    k = a.shape[1] // unit
    return jnp.broadcast_to(a.reshape(n, 1, k, unit), (n, 4 // k, k, unit)).reshape(n, 4, unit)

  w = bits[:, None, None]
  first = jnp.select([w == 8, w == 4, w == 2], [units(lo), units(f4), units(f2)], units(f1))
  second = jax.lax.broadcasted_iota(jnp.int32, (n, 2, 4, unit), 1) == 1
  chunks = jnp.where(second, units(hi)[:, None], first[:, None]).reshape(n * 8, unit)
  k = jnp.arange(8, dtype=jnp.int32)
  starts = jnp.where(k < bits[:, None], _offsets(bits, dp)[:, None] + k * unit, capacity)
  data = _scatter_rows(jnp.zeros((capacity,), jnp.uint8), chunks, starts.reshape(-1))
  return PackedPerSample(data, bits.astype(jnp.uint8), minimum, scale, tuple(x.shape), dtype,
                         group_size)


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
  codes = jnp.select([w == 8, w == 4, w == 2],
                     [seg, unpack_bits(seg[:, :4 * unit], 4), unpack_bits(seg[:, :2 * unit], 2)],
                     unpack_bits(seg[:, :unit], 1))
  codes = codes.reshape(n, groups, group_size).astype(jnp.float32)
  d = math.prod(p.shape[1:])
  dtype = jnp.dtype(dtype or p.dtype)
  levels = ((1 << bits) - 1).astype(jnp.float32)[:, None, None]
  g = decode_groups(codes, p.minimum.astype(jnp.float32)[..., None],
                    p.scale.astype(jnp.float32)[..., None], levels, dtype, p.dtype)
  return g.reshape(n, dp)[:, :d].reshape(p.shape).astype(dtype)
