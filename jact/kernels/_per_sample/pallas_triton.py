"""Pallas (Triton backend) kernels for per-sample mixed-precision quantization.

Bit-exact with `reference.quantize_per_sample_reference` /
`dequantize_per_sample_reference` for the same seed. Quantization takes two
passes (group statistics, then packing at each sample's width and offset);
dequantization one. Passes and memory traffic: docs/design.md, "The
per-sample kernels".

>>> import jax, jax.numpy as jnp
>>> from jact.kernels._per_sample.reference import quantize_per_sample_reference
>>> @jax.jit
... def both(x, bits, seed):
...   args = dict(capacity_bytes=1200, group_size=152, seed=seed)
...   p = quantize_per_sample(x, bits, interpret=True, **args)
...   reference = quantize_per_sample_reference(x, bits, **args)
...   return p, reference, dequantize_per_sample(p, interpret=True)
>>> x = jax.random.normal(jax.random.key(0), (4, 300))
>>> p, r, y = both(x, jnp.array([1, 2, 4, 8], jnp.int32), jnp.uint32(5))
>>> bool((p.data == r.data).all() & (p.scale == r.scale).all() & (p.minimum == r.minimum).all())
True
>>> step = jnp.repeat(p.scale.astype(jnp.float32), 152, axis=1)[:, :300]
>>> bool((jnp.abs(y - x) <= step).all())
True
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jact.kernels import _triton as T
from jact.kernels._quantize.pallas_triton import decode_values, encode_values, group_stats
from jact._core.quantize import flagged_levels, split_step
from jact._core.persample import PackedPerSample
from jact.kernels._per_sample.reference import (
  dequantize_per_sample_reference,
  quantize_per_sample_reference,
)

__all__ = ["quantize_per_sample", "dequantize_per_sample"]

_TILE = 4096  # values per program (a power of two)
_ZERO_TILE = 4096  # largest run of tail bytes zeroed by one program
_WIDTHS = (1, 2, 3, 4, 5, 6, 7, 8)  # the switch's branches: width index i is i + 1 bits


def _geometry(d: int, group_size: int, rows: int | None):
  """(groups, Dp, groups per stats program, values V per pack program, pack programs per sample)."""
  groups = -(-d // group_size)
  dp = groups * group_size
  gp = T.next_pow2(group_size)
  r = T.next_pow2(rows) if rows is not None else max(1, _TILE // gp)
  values = min(r * gp, T.next_pow2(dp))
  return groups, dp, r, values, -(-dp // values)


def _width_index(bits: jax.Array) -> jax.Array:
  """int32 switch index of each width as the reference decodes it (1..8, else 1 bit)."""
  w = bits.astype(jnp.int32)
  return jnp.where((w >= 1) & (w <= 8), w - 1, 0).astype(jnp.int32)


def _offsets(bits: jax.Array, dp: int) -> jax.Array:
  """Byte offset of each sample's segment (exclusive prefix sum of b_n Dp / 8)."""
  size = bits.astype(jnp.int32) * (dp // 8)
  return jnp.cumsum(size) - size


# ----------------------------------------------------------------------------- pass 1: statistics


def _stats_kernel(
  x_ref,
  width_ref,
  min_ref,
  scale_ref,
  hi_ref,
  inv_ref,
  *,
  n_rows,
  groups,
  d,
  group_size,
  rows,
  gp,
  interpret,
):
  pid = pl.program_id(0)
  row = pid * rows + jax.lax.broadcasted_iota(jnp.int32, (rows, gp), 0)
  col = jax.lax.broadcasted_iota(jnp.int32, (rows, gp), 1)
  pos = (row % groups) * group_size + col
  mask = (row < n_rows) & (col < group_size) & (pos < d)
  nan = jnp.array(jnp.nan, x_ref.dtype)
  v = T.load(x_ref, (row // groups) * d + pos, mask, nan).astype(jnp.float32)
  r = pid * rows + jax.lax.broadcasted_iota(jnp.int32, (rows,), 0)
  ok = r < n_rows
  levels = ((1 << (T.load(width_ref, r // groups, ok, 0) + 1)) - 1).astype(jnp.float32)
  minimum, step, hi, inv_step, _ = group_stats([v], levels, interpret=interpret, valid=[mask])
  T.store(min_ref, r, minimum.astype(jnp.bfloat16), ok)
  T.store(scale_ref, r, step.astype(jnp.bfloat16), ok)
  T.store(hi_ref, r, hi, ok)
  T.store(inv_ref, r, inv_step, ok)


def _statistics(x, width, *, groups, group_size, rows, interpret):
  """Per-group bf16 minimum and step, float32 finite maximum and 1 / step, each [N * groups]."""
  n, d = x.shape
  n_rows = n * groups
  gp = T.next_pow2(group_size)
  kernel = functools.partial(
    _stats_kernel,
    n_rows=n_rows,
    groups=groups,
    d=d,
    group_size=group_size,
    rows=rows,
    gp=gp,
    interpret=interpret,
  )
  out_shape = (
    jax.ShapeDtypeStruct((n_rows,), jnp.bfloat16),
    jax.ShapeDtypeStruct((n_rows,), jnp.bfloat16),
    jax.ShapeDtypeStruct((n_rows,), jnp.float32),
    jax.ShapeDtypeStruct((n_rows,), jnp.float32),
  )
  return T.call(
    kernel,
    grid=-(-n_rows // rows),
    out_shape=out_shape,
    name="jact_per_sample_stats",
    interpret=interpret,
  )(x.reshape(-1), width)


# ----------------------------------------------------------------------------- pass 2: codes


def _pack_width(
  x_ref,
  min_ref,
  scale_ref,
  hi_ref,
  inv_ref,
  data_ref,
  seed,
  sample,
  t,
  offset,
  *,
  bits,
  d,
  groups,
  group_size,
  unit,
  values,
  interpret,
):
  """Packs sample `sample`'s bytes of program tile t at a static width `bits`."""
  k, q, tb = 8 // bits, bits * unit, values * bits // 8
  j = t * tb + jax.lax.broadcasted_iota(jnp.int32, (tb,), 0)
  in_sample = j < q
  packed = None
  for p in range(k):
    code = _encode_at(
      x_ref,
      min_ref,
      scale_ref,
      hi_ref,
      inv_ref,
      seed,
      sample,
      p * q + j,
      in_sample,
      bits=bits,
      d=d,
      groups=groups,
      group_size=group_size,
      interpret=interpret,
    ) << (p * bits)
    packed = code if packed is None else packed | code
  T.store(data_ref, offset + j, packed.astype(jnp.uint8), in_sample)


def _encode_at(
  x_ref,
  min_ref,
  scale_ref,
  hi_ref,
  inv_ref,
  seed,
  sample,
  pos,
  in_sample,
  *,
  bits,
  d,
  groups,
  group_size,
  interpret,
):
  """The `bits`-bit codes of sample `sample` at positions `pos` (int32)."""
  own = in_sample & (pos < d)
  nan = jnp.array(jnp.nan, x_ref.dtype)
  levels = jnp.float32((1 << bits) - 1)
  v = T.load(x_ref, sample * d + pos, own, nan).astype(jnp.float32)
  r = sample * groups + pos // group_size
  minimum = T.load(min_ref, r, in_sample, jnp.bfloat16(0)).astype(jnp.float32)
  stored = T.load(scale_ref, r, in_sample, jnp.bfloat16(0)).astype(jnp.float32)
  hi = T.load(hi_ref, r, in_sample, jnp.float32(0))
  inv_step = T.load(inv_ref, r, in_sample, jnp.float32(0))
  index = (sample * (groups * group_size) + pos).astype(jnp.uint32)
  finite_levels = flagged_levels(jnp.full(v.shape, levels), split_step(stored)[1])
  return encode_values(
    v,
    minimum,
    hi,
    inv_step,
    levels,
    seed,
    index,
    interpret=interpret,
    finite_levels=finite_levels,
    valid=own,
    dtype=x_ref.dtype,
    stored=stored,
  )


def _pack_planes(
  x_ref,
  min_ref,
  scale_ref,
  hi_ref,
  inv_ref,
  data_ref,
  seed,
  sample,
  t,
  offset,
  *,
  bits,
  d,
  groups,
  group_size,
  unit,
  values,
  interpret,
):
  """Packs a 3/5/6/7-bit sample as bit planes: program tile t takes columns j of
  the sample's 8 x unit codes (`values` codes) and writes byte j of each plane."""
  tb = values // 8
  j = t * tb + jax.lax.broadcasted_iota(jnp.int32, (tb,), 0)
  in_sample = j < unit
  encode = functools.partial(
    _encode_at,
    x_ref,
    min_ref,
    scale_ref,
    hi_ref,
    inv_ref,
    seed,
    sample,
    bits=bits,
    d=d,
    groups=groups,
    group_size=group_size,
    interpret=interpret,
  )
  codes = [encode(i * unit + j, in_sample) for i in range(8)]
  for p in range(bits):
    plane = None
    for i, code in enumerate(codes):
      field = ((code >> p) & 1) << i
      plane = field if plane is None else plane | field
    T.store(data_ref, offset + p * unit + j, plane.astype(jnp.uint8), in_sample)


def _pack_kernel(
  *refs, n, d, groups, group_size, tiles, values, zero_tile, capacity, stochastic, interpret
):
  if stochastic:
    (
      x_ref,
      width_ref,
      offset_ref,
      used_ref,
      min_ref,
      scale_ref,
      hi_ref,
      inv_ref,
      seed_ref,
      data_ref,
    ) = refs
    seed = seed_ref[0]
  else:
    x_ref, width_ref, offset_ref, used_ref, min_ref, scale_ref, hi_ref, inv_ref, data_ref = refs
    seed = None
  pid = pl.program_id(0)
  z = pid * zero_tile + jax.lax.broadcasted_iota(jnp.int32, (zero_tile,), 0)
  T.store(data_ref, z, jnp.zeros((zero_tile,), jnp.uint8), (z >= used_ref[0]) & (z < capacity))
  sample, t = pid // tiles, pid % tiles

  @pl.when(sample < n)
  def _():
    branches = [
      functools.partial(
        pack,
        x_ref,
        min_ref,
        scale_ref,
        hi_ref,
        inv_ref,
        data_ref,
        seed,
        bits=b,
        d=d,
        groups=groups,
        group_size=group_size,
        unit=groups * group_size // 8,
        values=values,
        interpret=interpret,
      )
      for b, pack in zip(_WIDTHS, _PACKERS)
    ]
    jax.lax.switch(width_ref[sample], branches, sample, t, offset_ref[sample])


def quantize_per_sample(
  x: jax.Array,
  bits: jax.Array,
  *,
  capacity_bytes: int,
  group_size: int,
  seed: jax.Array | None,
  interpret: bool | None = None,
  rows: int | None = None,
) -> PackedPerSample:
  """Per-sample mixed-precision quantization of x (N, ...) in two Pallas passes.

  Same contract as `reference.quantize_per_sample_reference`: `bits`
  int32[N] in 1..8 fitting `capacity_bytes`, `group_size` the
  effective one, `seed` a uint32 scalar or None (round to nearest).
  `interpret` defaults to True off GPU; `rows` (groups per statistics
  program; the packing programs take as many values) bounds the grid in tests.
  """
  if interpret is None:
    interpret = not T.on_gpu()
  n, d = x.shape[0], math.prod(x.shape[1:])
  capacity = int(capacity_bytes)
  if not n * d:
    return quantize_per_sample_reference(
      x, bits, capacity_bytes=capacity, group_size=group_size, seed=seed
    )
  T.check_int32(n * d, "the input")
  T.check_int32(capacity, "the buffer")
  groups, dp, r, values, tiles = _geometry(d, group_size, rows)
  bits = jnp.asarray(bits, jnp.int32)
  width = _width_index(bits)
  minimum, scale, hi, inv_step = _statistics(
    x.reshape(n, d), width, groups=groups, group_size=group_size, rows=r, interpret=interpret
  )
  offsets = _offsets(bits, dp)
  used = (jnp.sum(bits) * (dp // 8)).reshape(1).astype(jnp.int32)
  zero_tile = min(_ZERO_TILE, T.next_pow2(-(-capacity // (n * tiles))))
  grid = max(n * tiles, -(-capacity // zero_tile))
  stochastic = seed is not None
  kernel = functools.partial(
    _pack_kernel,
    n=n,
    d=d,
    groups=groups,
    group_size=group_size,
    tiles=tiles,
    values=values,
    zero_tile=zero_tile,
    capacity=capacity,
    stochastic=stochastic,
    interpret=interpret,
  )
  args = [x.reshape(-1), width, offsets, used, minimum, scale, hi, inv_step]
  if stochastic:
    args.append(jnp.asarray(seed, jnp.uint32).reshape(1))
  data = T.call(
    kernel,
    grid=grid,
    out_shape=jax.ShapeDtypeStruct((capacity,), jnp.uint8),
    name="jact_per_sample_pack",
    interpret=interpret,
  )(*args)
  return PackedPerSample(
    data,
    bits.astype(jnp.uint8),
    minimum.reshape(n, groups),
    scale.reshape(n, groups),
    tuple(x.shape),
    jnp.dtype(x.dtype),
    group_size,
  )


# ----------------------------------------------------------------------------- dequantize


def _unpack_width(
  data_ref,
  min_ref,
  scale_ref,
  out_ref,
  sample,
  t,
  offset,
  *,
  bits,
  d,
  groups,
  group_size,
  unit,
  values,
  capacity,
  through,
  interpret,
):
  """Decodes sample `sample`'s values of program tile t at a static width `bits`."""
  k, q, tb = 8 // bits, bits * unit, values * bits // 8
  j = t * tb + jax.lax.broadcasted_iota(jnp.int32, (tb,), 0)
  in_sample = j < q
  byte = T.load(data_ref, offset + j, in_sample & (offset + j < capacity), jnp.uint8(0)).astype(
    jnp.int32
  )
  for p in range(k):
    pos = p * q + j
    r = sample * groups + pos // group_size
    minimum = T.load(min_ref, r, in_sample, jnp.bfloat16(0)).astype(jnp.float32)
    step = T.load(scale_ref, r, in_sample, jnp.bfloat16(0)).astype(jnp.float32)
    code = ((byte >> (p * bits)) & ((1 << bits) - 1)).astype(jnp.float32)
    value = decode_values(
      code,
      minimum,
      step,
      out_ref.dtype,
      levels=float((1 << bits) - 1),
      interpret=interpret,
      through=through,
    )
    T.store(out_ref, sample * d + pos, value.astype(out_ref.dtype), in_sample & (pos < d))


def _unpack_planes(
  data_ref,
  min_ref,
  scale_ref,
  out_ref,
  sample,
  t,
  offset,
  *,
  bits,
  d,
  groups,
  group_size,
  unit,
  values,
  capacity,
  through,
  interpret,
):
  """Decodes a 3/5/6/7-bit sample's bit planes: columns j of program tile t."""
  tb = values // 8
  j = t * tb + jax.lax.broadcasted_iota(jnp.int32, (tb,), 0)
  in_sample = j < unit
  planes = []
  for p in range(bits):
    at = offset + p * unit + j
    planes.append(T.load(data_ref, at, in_sample & (at < capacity), jnp.uint8(0)).astype(jnp.int32))
  for i in range(8):
    code = None
    for p, plane in enumerate(planes):
      field = ((plane >> i) & 1) << p
      code = field if code is None else code | field
    pos = i * unit + j
    r = sample * groups + pos // group_size
    minimum = T.load(min_ref, r, in_sample, jnp.bfloat16(0)).astype(jnp.float32)
    step = T.load(scale_ref, r, in_sample, jnp.bfloat16(0)).astype(jnp.float32)
    value = decode_values(
      code.astype(jnp.float32),
      minimum,
      step,
      out_ref.dtype,
      levels=float((1 << bits) - 1),
      interpret=interpret,
      through=through,
    )
    T.store(out_ref, sample * d + pos, value.astype(out_ref.dtype), in_sample & (pos < d))


def _unpack_kernel(
  data_ref,
  width_ref,
  offset_ref,
  min_ref,
  scale_ref,
  out_ref,
  *,
  d,
  groups,
  group_size,
  tiles,
  values,
  capacity,
  through,
  interpret,
):
  pid = pl.program_id(0)
  sample, t = pid // tiles, pid % tiles
  branches = [
    functools.partial(
      unpack,
      data_ref,
      min_ref,
      scale_ref,
      out_ref,
      bits=b,
      d=d,
      groups=groups,
      group_size=group_size,
      unit=groups * group_size // 8,
      values=values,
      capacity=capacity,
      through=through,
      interpret=interpret,
    )
    for b, unpack in zip(_WIDTHS, _UNPACKERS)
  ]
  jax.lax.switch(width_ref[sample], branches, sample, t, offset_ref[sample])


def dequantize_per_sample(
  p: PackedPerSample, dtype=None, *, interpret: bool | None = None, rows: int | None = None
) -> jax.Array:
  """Inverse of `quantize_per_sample` in one Pallas pass (same contract as the
  reference; widths must fit the buffer, as `quantize_per_sample` ensures)."""
  if interpret is None:
    interpret = not T.on_gpu()
  dtype = jnp.dtype(dtype or p.dtype)
  n, groups = p.scale.shape
  d = math.prod(p.shape[1:])
  if not n * d:
    return dequantize_per_sample_reference(p, dtype)
  T.check_int32(n * d, "the tensor")
  T.check_int32(p.data.size, "the buffer")
  _, dp, _, values, tiles = _geometry(d, p.group_size, rows)
  kernel = functools.partial(
    _unpack_kernel,
    d=d,
    groups=groups,
    group_size=p.group_size,
    tiles=tiles,
    values=values,
    capacity=p.data.size,
    through=jnp.dtype(p.dtype),
    interpret=interpret,
  )
  out = T.call(
    kernel,
    grid=n * tiles,
    out_shape=jax.ShapeDtypeStruct((n * d,), dtype),
    name="jact_per_sample_unpack",
    interpret=interpret,
  )(p.data, _width_index(p.bits), _offsets(p.bits, dp), p.minimum.reshape(-1), p.scale.reshape(-1))
  return out.reshape(p.shape)


# The switch's branch per width: planar for divisors of 8, bit planes otherwise.
_PACKERS = tuple(_pack_width if 8 % b == 0 else _pack_planes for b in _WIDTHS)
_UNPACKERS = tuple(_unpack_width if 8 % b == 0 else _unpack_planes for b in _WIDTHS)
