"""Pallas (Triton backend) kernel for DIVISION compression (`jact.compressors.Division`).

`division_compress` returns the pooled LFC and the per-group quantized HFC,
bit-exact with `reference.division_compress_reference`: one pass per pooled
row when rows start on group boundaries, a pooling kernel and a residual
kernel otherwise. The paths and their traffic: docs/design.md, "The DIVISION
kernel".

>>> import jax, jax.numpy as jnp
>>> from jact.kernels._division.reference import division_compress_reference
>>> x = jax.random.normal(jax.random.key(0), (2, 8, 8, 16))
>>> args = dict(block=4, bits=2, group_size=256, lfc_dtype=jnp.bfloat16)
>>> lfc, hfc = division_compress(x, jnp.uint32(3), interpret=True, **args)
>>> ref_lfc, ref_hfc = division_compress_reference(x, jnp.uint32(3), **args)
>>> lfc.shape, bool((lfc == ref_lfc).all() & (hfc.data == ref_hfc.data).all())
((2, 2, 2, 16), True)
>>> fused(x.shape, 4, 256)
True
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jact._core.quantize import as_rows
from jact.kernels import _triton as T
from jact.kernels._quantize.pallas_triton import (
  encode_codes,
  pack_planes,
  packed_out_shape,
  packing_geometry,
  plane_layout,
)
from jact._core.quantize import Packed, check_group_size, effective_group_size
from jact._core.packing import check_bits

__all__ = ["division_compress", "fused"]

_LFC_TILE = 1024  # pooled values per chunk of a band (a power of two)


@dataclasses.dataclass(frozen=True)
class _Map:
  """The map viewed as (n, d, h, w, c) with blocks (bd, bh, bw) and pooled extents."""

  n: int
  d: int
  h: int
  w: int
  c: int
  bd: int
  bh: int
  bw: int

  @property
  def pooled(self) -> tuple[int, int, int]:
    return (-(-self.d // self.bd), -(-self.h // self.bh), -(-self.w // self.bw))

  @property
  def bands(self) -> int:
    """Pooled rows (n, od, oh) per sample."""
    nd, nh, _ = self.pooled
    return nd * nh

  def band_start(self, od, oh):
    """Flat offset of band (od, oh) inside its sample."""
    return (od * self.bd * self.h + oh * self.bh) * self.w * self.c


def _map(shape: tuple[int, ...], block: int) -> _Map:
  spatial = tuple(shape[1:-1])
  dims = {1: (1, *spatial, 1), 2: (1, *spatial), 3: spatial}[len(spatial)]
  return _Map(shape[0], *dims, shape[-1], *(min(block, s) for s in dims))


def _check(shape, bits, group_size) -> None:
  if not 3 <= len(shape) <= 5:
    raise ValueError(
      f"division_compress takes (N, L, C), (N, H, W, C) or (N, D, H, W, C) "
      f"inputs, got shape {tuple(shape)}."
    )
  check_bits(bits)
  check_group_size(group_size)


def fused(shape: tuple[int, ...], block: int, group_size: int) -> bool:
  """Whether `division_compress` takes the one-pass path for this input: every band
  is contiguous in x and starts on a group boundary (and samples are not packed
  into one row)."""
  m = _map(tuple(shape), block)
  rows = as_rows(tuple(shape), group_size)
  if rows != tuple(shape):
    return False
  g = effective_group_size(math.prod(rows[1:]), group_size)
  nd, nh, _ = m.pooled
  contiguous = m.bd == 1 or nh == 1
  return contiguous and all(m.band_start(od, oh) % g == 0 for od in range(nd) for oh in range(nh))


def _div(a, b):
  """a // b for non-negative int32 a and b (truncating: what Triton lowers simply)."""
  return jax.lax.div(a, jnp.asarray(b, jnp.int32))


def _rem(a, b):
  """a % b for non-negative int32 a and b."""
  return jax.lax.rem(a, jnp.asarray(b, jnp.int32))


def _band(band, m: _Map):
  """(n, od, oh) of a band index."""
  nd, nh, _ = m.pooled
  return _div(band, nd * nh), _rem(_div(band, nh), nd), _rem(band, nh)


def _lfc_offset(flat, m: _Map):
  """Flat LFC offset of the block holding each flat element offset of x."""
  nd, nh, nw = m.pooled
  c, rest = _rem(flat, m.c), _div(flat, m.c)
  zw, rest = _rem(rest, m.w), _div(rest, m.w)
  zh, rest = _rem(rest, m.h), _div(rest, m.h)
  zd, n = _rem(rest, m.d), _div(rest, m.d)
  return (((n * nd + _div(zd, m.bd)) * nh + _div(zh, m.bh)) * nw + _div(zw, m.bw)) * m.c + c


def _pool_band(x_ref, lfc_ref, band, m: _Map, *, tile: int, interpret: bool) -> None:
  """Pools band (n, od, oh) into its nw * C LFC values (chunks of `tile`)."""
  nw = m.pooled[2]
  n, od, oh = _band(band, m)
  row_len = nw * m.c
  zd0, zh0 = od * m.bd, oh * m.bh
  count_dh = jnp.minimum(m.bd, m.d - zd0) * jnp.minimum(m.bh, m.h - zh0)
  offsets = m.bd * m.bh * m.bw

  def chunk(i, carry):
    t = i * tile + jax.lax.broadcasted_iota(jnp.int32, (tile,), 0)
    valid = t < row_len
    c = _rem(t, m.c)
    zw0 = _div(t, m.c) * m.bw

    def value(o):  # the block's element at offset o (row-major over (dd, di, dj)), or 0.0
      zd = zd0 + _div(o, m.bh * m.bw)
      zh = zh0 + _rem(_div(o, m.bw), m.bh)
      zw = zw0 + _rem(o, m.bw)
      ok = valid & (zd < m.d) & (zh < m.h) & (zw < m.w)
      offset = (((n * m.d + zd) * m.h + zh) * m.w + zw) * m.c + c
      return T.load(x_ref, offset, ok, jnp.zeros((), x_ref.dtype)).astype(jnp.float32)

    def finite(v):  # (v or 0.0, 1.0 where v is not finite): the reference's finite-only mean
      ok = jnp.isfinite(v)
      return jnp.where(ok, v, 0.0), jnp.where(ok, jnp.float32(0.0), jnp.float32(1.0))

    def add(o, sums):
      v, miss = finite(value(o))
      return T.add(sums[0], v, interpret), sums[1] + miss

    acc, bad = jax.lax.fori_loop(1, offsets, add, finite(value(0)))
    count = jnp.where(valid, count_dh * jnp.minimum(m.bw, m.w - zw0), 1).astype(jnp.float32) - bad
    inv = T.div(jnp.float32(1.0), jnp.maximum(count, 1.0), interpret)
    mean = T.mul(acc, jnp.where(count > 0, inv, 0.0), interpret).astype(lfc_ref.dtype)
    lfc = jnp.where(jnp.isfinite(mean.astype(jnp.float32)), mean, jnp.zeros((), lfc_ref.dtype))
    T.store(lfc_ref, band * row_len + t, lfc, valid)
    return carry

  jax.lax.fori_loop(0, -(-row_len // tile), chunk, 0)


def _encode_rows(
  x_ref,
  lfc_ref,
  seed,
  data_ref,
  min_ref,
  scale_ref,
  row,
  row_ok,
  m: _Map,
  *,
  groups: int,
  d: int,
  group_size: int,
  bits: int,
  q_pad: int,
  interpret: bool,
) -> None:
  """Quantizes the HFC of group rows `row` [R] (row = sample * groups + group of the
  (rows, d) view), subtracting each element's LFC value as stored."""
  k, _ = plane_layout(bits)
  q = group_size // k  # values per plane (and bytes per byte plane)
  rr = row[:, None]
  j = jax.lax.broadcasted_iota(jnp.int32, (row.shape[0], q_pad), 1)
  sample, group = _div(rr, groups), _rem(rr, groups)
  ok = row_ok[:, None] & (j < q)
  planes, index, valid = [], [], []
  for p in range(k):
    col = group * group_size + p * q + j
    mask = ok & (col < d)
    flat = sample * d + col
    v = T.load(x_ref, flat, mask, jnp.array(jnp.nan, x_ref.dtype)).astype(jnp.float32)
    up = T.load(lfc_ref, _lfc_offset(flat, m), mask, jnp.zeros((), lfc_ref.dtype))
    planes.append(T.add(v, -up.astype(jnp.float32), interpret))
    valid.append(mask)
    index.append(rr.astype(jnp.uint32) * jnp.uint32(group_size) + (j + p * q).astype(jnp.uint32))
  levels = float((1 << bits) - 1)  # static: the reciprocal is a constant, as in XLA
  minimum, step, codes = encode_codes(planes, levels, seed, index, interpret=interpret, valid=valid)
  for b, byte in enumerate(pack_planes(codes, bits)):  # the packing's byte planes
    T.store(data_ref, rr * (group_size * bits // 8) + b * q + j, byte.astype(jnp.uint8), ok)
  T.store(min_ref, row, minimum.astype(jnp.bfloat16), row_ok)
  T.store(scale_ref, row, step.astype(jnp.bfloat16), row_ok)


def _fused_kernel(
  x_ref,
  seed_ref,
  lfc_ref,
  data_ref,
  min_ref,
  scale_ref,
  *,
  m: _Map,
  groups,
  d,
  group_size,
  bits,
  rows,
  q_pad,
  tile,
  interpret,
):
  """One band: its LFC, then the HFC of the groups it owns."""
  band = pl.program_id(0)
  _pool_band(x_ref, lfc_ref, band, m, tile=tile, interpret=interpret)
  if not interpret:
    pltriton.debug_barrier()  # the band's LFC stores are visible to all its threads
  n, od, oh = _band(band, m)
  length = jnp.minimum(m.bd, m.d - od * m.bd) * jnp.minimum(m.bh, m.h - oh * m.bh) * (m.w * m.c)
  owned = _div(length + group_size - 1, group_size)
  first = n * groups + _div(m.band_start(od, oh), group_size)
  seed = seed_ref[0]

  def chunk(i, carry):
    r = i * rows + jax.lax.broadcasted_iota(jnp.int32, (rows,), 0)
    _encode_rows(
      x_ref,
      lfc_ref,
      seed,
      data_ref,
      min_ref,
      scale_ref,
      first + r,
      r < owned,
      m,
      groups=groups,
      d=d,
      group_size=group_size,
      bits=bits,
      q_pad=q_pad,
      interpret=interpret,
    )
    return carry

  most = -(-(m.bd * m.bh * m.w * m.c) // group_size)
  jax.lax.fori_loop(0, -(-most // rows), chunk, 0)


def _pool_kernel(x_ref, lfc_ref, *, m: _Map, tile, interpret):
  _pool_band(x_ref, lfc_ref, pl.program_id(0), m, tile=tile, interpret=interpret)


def _residual_kernel(
  x_ref,
  lfc_ref,
  seed_ref,
  data_ref,
  min_ref,
  scale_ref,
  *,
  m: _Map,
  n_rows,
  groups,
  d,
  group_size,
  bits,
  rows,
  q_pad,
  interpret,
):
  row = pl.program_id(0) * rows + jax.lax.broadcasted_iota(jnp.int32, (rows,), 0)
  _encode_rows(
    x_ref,
    lfc_ref,
    seed_ref[0],
    data_ref,
    min_ref,
    scale_ref,
    row,
    row < n_rows,
    m,
    groups=groups,
    d=d,
    group_size=group_size,
    bits=bits,
    q_pad=q_pad,
    interpret=interpret,
  )


def division_compress(
  x: jax.Array,
  seed: jax.Array,
  *,
  block: int,
  bits: int,
  group_size: int,
  lfc_dtype: Any,
  interpret: bool | None = None,
  rows: int | None = None,
) -> tuple[jax.Array, Packed]:
  """(LFC, packed HFC) of x (rank 3 to 5), bit-exact with the XLA reference.

  Same contract as `reference.division_compress_reference`.
  `interpret` defaults to True off GPU; `rows` sets the groups per tile (tests
  use it to bound the grid of the two-kernel path).
  """
  if interpret is None:
    interpret = not T.on_gpu()
  shape = tuple(x.shape)
  _check(shape, bits, group_size)
  T.check_int32(x.size, "the input")
  lfc_dtype = jnp.dtype(lfc_dtype)
  m = _map(shape, block)
  nw = m.pooled[2]
  view = as_rows(shape, group_size)
  n_view, d = view[0], math.prod(view[1:])
  g = effective_group_size(d, group_size)
  groups, n_rows, q, q_pad, r = packing_geometry(n_view, d, g, bits, rows)
  tile = min(_LFC_TILE, T.next_pow2(nw * m.c))
  bands = m.n * m.bands
  flat = x.reshape(-1)
  seed = jnp.asarray(seed, jnp.uint32).reshape(1)
  lfc_shape = jax.ShapeDtypeStruct((bands * nw * m.c,), lfc_dtype)
  packed_shape = packed_out_shape(n_rows, q)
  common = dict(
    m=m, groups=groups, d=d, group_size=g, bits=bits, rows=r, q_pad=q_pad, interpret=interpret
  )
  if fused(shape, block, group_size):
    kernel = functools.partial(_fused_kernel, tile=tile, **common)
    lfc, data, minimum, scale = T.call(
      kernel,
      grid=bands,
      out_shape=(lfc_shape, *packed_shape),
      name="jact_division",
      interpret=interpret,
    )(flat, seed)
  else:
    lfc = T.call(
      functools.partial(_pool_kernel, m=m, tile=tile, interpret=interpret),
      grid=bands,
      out_shape=lfc_shape,
      name="jact_division_pool",
      interpret=interpret,
    )(flat)
    kernel = functools.partial(_residual_kernel, n_rows=n_rows, **common)
    data, minimum, scale = T.call(
      kernel,
      grid=max(1, -(-n_rows // r)),
      out_shape=packed_shape,
      name="jact_division_residual",
      interpret=interpret,
    )(flat, lfc, seed)
  pooled = tuple(-(-s // min(block, s)) for s in shape[1:-1])
  packed = Packed(
    data.reshape(n_view, groups, q),
    minimum.reshape(n_view, groups),
    scale.reshape(n_view, groups),
    view,
    jnp.dtype(jnp.float32),
    bits,
    g,
    shape if view != shape else None,
  )
  return lfc.reshape(shape[0], *pooled, shape[-1]), packed
