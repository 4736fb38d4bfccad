"""Pallas (Triton backend) kernels for per-group quantization.

`quantize` reads each value once and writes its packed code and its group's
bf16 statistics in one pass; `dequantize` is the inverse. Both are bit-exact
with `reference.quantize_reference` / `dequantize_reference` for the same
seed, non-finite values included. The program layout: docs/design.md, "The
per-group quantize kernels".

>>> import jax, jax.numpy as jnp
>>> from jact.kernels._quantize.reference import quantize_reference
>>> x = jax.random.normal(jax.random.key(0), (4, 300))
>>> seed = jnp.uint32(5)
>>> p = quantize(x, seed, bits=2, group_size=152, stochastic=True, interpret=True)
>>> r = quantize_reference(x, seed, bits=2, group_size=152, stochastic=True)
>>> bool((p.data == r.data).all() & (p.scale == r.scale).all() & (p.minimum == r.minimum).all())
True
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from jact.kernels import _triton as T
from jact._core import quantize as Q
from jact._core.quantize import Packed, grid_scale
from jact.kernels._quantize.layout import packing_geometry, plane_layout, rows_per_program

__all__ = [
  "quantize",
  "dequantize",
  "encode_tile",
  "encode_codes",
  "plane_layout",
  "pack_planes",
  "unpack_planes",
  "group_stats",
  "encode_values",
  "decode_values",
  "inverse_step",
  "packing_geometry",
  "packed_out_shape",
]


def pack_planes(codes, bits: int) -> list:
  """The B int32 byte planes (`plane_layout`) of V int32 code planes (same shapes)."""
  if bits == 16:
    return [codes[0] & 255, codes[0] >> 8]
  if 8 % bits:  # byte plane p holds bit p of value plane i in its bit i
    planes = []
    for p in range(bits):
      byte = None
      for i, code in enumerate(codes):
        field = ((code >> p) & 1) << i
        byte = field if byte is None else byte | field
      planes.append(byte)
    return planes
  packed = None
  for p, code in enumerate(codes):
    packed = code << (p * bits) if packed is None else packed | code << (p * bits)
  return [packed]


def unpack_planes(planes, bits: int) -> list:
  """The V int32 code planes of B int32 byte planes (inverse of `pack_planes`)."""
  if bits == 16:
    return [planes[0] | planes[1] << 8]
  if 8 % bits:
    codes = []
    for i in range(8):
      code = None
      for p, byte in enumerate(planes):
        field = ((byte >> i) & 1) << p
        code = field if code is None else code | field
      codes.append(code)
    return codes
  mask = (1 << bits) - 1
  return [(planes[0] >> (p * bits)) & mask for p in range(8 // bits)]


def packed_out_shape(n_rows: int, q: int) -> tuple[jax.ShapeDtypeStruct, ...]:
  """Kernel outputs of `n_rows` groups: flat packed bytes, bf16 minima and steps."""
  return (
    jax.ShapeDtypeStruct((n_rows * q,), jnp.uint8),
    jax.ShapeDtypeStruct((n_rows,), jnp.bfloat16),
    jax.ShapeDtypeStruct((n_rows,), jnp.bfloat16),
  )


def _layout(shape) -> tuple[int, int]:
  """(N, values per sample) of a tensor quantized per sample."""
  n = shape[0] if len(shape) else 1
  d = math.prod(shape[1:]) if len(shape) > 1 else 1
  return n, d


def group_stats(planes, levels, *, interpret: bool, valid=None):
  """The reference's group statistics from the k planes [R, P] of a tile of groups.

  `valid` (k bool arrays [R, P], or None: all) marks the group's own values;
  the others (padding, loaded as NaN) are ignored. `levels` is float32
  2**bits - 1, a scalar or [R]. Returns float32 [R] arrays: the minimum (a
  bf16 value, rounded down), the stored step (bf16 value: rounded up, flagged
  with its non-finite kind, `jact._core.quantize.flag_step`), the finite maximum,
  1 / (step * s) (0 if step is 0; s the grid scale of the group's range,
  `jact._core.quantize.grid_scale`) and the largest code of finite values.
  """
  lo = hi = nan = pos = neg = None
  for i, v in enumerate(planes):
    finite = jnp.isfinite(v)
    ok = True if valid is None else valid[i]
    p_lo = jnp.min(jnp.where(finite, v, jnp.inf), axis=1)
    p_hi = jnp.max(jnp.where(finite, v, -jnp.inf), axis=1)
    p_nan = jnp.max(jnp.where(jnp.isnan(v) & ok, 1, 0), axis=1)
    p_pos = jnp.max(jnp.where(v == jnp.inf, 1, 0), axis=1)
    p_neg = jnp.max(jnp.where(v == -jnp.inf, 1, 0), axis=1)
    if lo is None:
      lo, hi, nan, pos, neg = p_lo, p_hi, p_nan, p_pos, p_neg
    else:
      lo, hi = jnp.minimum(lo, p_lo), jnp.maximum(hi, p_hi)
      nan, pos, neg = jnp.maximum(nan, p_nan), jnp.maximum(pos, p_pos), jnp.maximum(neg, p_neg)
  kind = Q.nonfinite_kind(nan > 0, pos > 0, neg > 0)
  flagged = kind != 0
  static = float(levels) if isinstance(levels, (int, float)) else None
  levels = jnp.broadcast_to(jnp.asarray(levels, jnp.float32), lo.shape)
  finite_levels = Q.flagged_levels(levels, flagged)
  single = finite_levels == 0
  any_finite = lo <= hi
  lo = jnp.where(any_finite & (lo != 0), lo, 0.0)
  hi = jnp.where(any_finite & (hi != 0), hi, 0.0)
  mid = T.add(
    T.mul(lo, jnp.float32(0.5), interpret), T.mul(hi, jnp.float32(0.5), interpret), interpret
  )
  lo = jnp.where(single, mid, lo)
  minimum = jnp.maximum(T.bf16_down(lo), jnp.float32(-jnp.finfo(jnp.bfloat16).max))
  s, inv_s = grid_scale(hi - minimum)
  if static is not None:  # the reciprocals are constants, as in XLA
    inv_plain = jnp.float32(np.float32(1.0) / np.float32(static))
    inv_flagged = jnp.float32(np.float32(1.0) / np.float32(max(static - 1.0, 1.0)))
  else:
    inv_plain = T.div(jnp.float32(1.0), levels, interpret)
    inv_flagged = T.div(jnp.float32(1.0), jnp.maximum(levels - 1.0, 1.0), interpret)
  inv_levels = jnp.where(single, 0.0, jnp.where(flagged, inv_flagged, inv_plain))
  span = T.mul(hi, s, interpret) - T.mul(minimum, s, interpret)
  step = T.bf16_up(T.mul(T.mul(span, inv_levels, interpret), inv_s, interpret))
  step = jnp.minimum(step, jnp.float32(jnp.finfo(jnp.bfloat16).max))
  stored = Q.flag_step(step, kind)
  step, _, _ = Q.split_step(stored)
  return (
    minimum,
    stored,
    hi,
    inverse_step(T.mul(step, s, interpret), interpret=interpret),
    finite_levels,
  )


def inverse_step(step, *, interpret: bool):
  """1 / step where step > 0, else 0 (as the reference)."""
  positive = step > 0
  return jnp.where(
    positive, T.div(jnp.float32(1.0), jnp.where(positive, step, 1.0), interpret), 0.0
  )


def encode_values(
  v,
  minimum,
  hi,
  inv_step,
  levels,
  seed,
  index,
  *,
  interpret: bool,
  finite_levels=None,
  valid=None,
  dtype=None,
  stored=None,
):
  """Integer codes (int32) of values v given their groups' statistics (broadcast
  against v; `inv_step`, `finite_levels` and the `stored` step as `group_stats`
  returns them): clipped to [minimum, hi], hashed stochastic rounding with the
  flat `index` (round to nearest when seed is None) onto codes
  0 .. finite_levels -- for a float16 / bfloat16 `dtype` between the decoded
  neighbours (`jact._core.quantize.lattice_codes`); a non-finite value where
  `valid` (None: everywhere) gets the top code `levels`, padding (NaN, not
  valid) code 0."""
  clipped = jnp.where(jnp.isnan(v), minimum, jnp.clip(v, minimum, hi))
  s, _ = grid_scale(hi - minimum)
  offset = T.mul(clipped, s, interpret) - T.mul(minimum, s, interpret)
  scaled = T.mul(offset, inv_step, interpret)
  u = jnp.float32(0.5) if seed is None else T.noise(seed, index)
  top = jnp.broadcast_to(
    jnp.asarray(levels if finite_levels is None else finite_levels, jnp.float32), scaled.shape
  )
  if dtype is None or jnp.dtype(dtype) == jnp.float32:
    code = jnp.minimum(
      jnp.floor(T.add(jnp.maximum(scaled, 0.0), u, interpret)), top
    )  # as the reference
  else:
    k_low = jnp.minimum(jnp.maximum(jnp.floor(scaled), 0.0), jnp.maximum(top - 1.0, 0.0))
    decode = functools.partial(
      decode_values, minimum=minimum, stored=stored, dtype=dtype, levels=levels, interpret=interpret
    )
    a, b = decode(k_low), decode(k_low + 1.0)
    gap = T.add(b, -a, interpret)
    positive = gap > 0
    p = jnp.where(
      positive, T.div(T.add(clipped, -a, interpret), jnp.where(positive, gap, 1.0), interpret), 0.0
    )
    code = jnp.minimum(k_low + jnp.where(u < p, 1.0, 0.0), top)
  nonfinite = ~jnp.isfinite(v) if valid is None else ~jnp.isfinite(v) & valid
  return jnp.where(nonfinite, levels, code).astype(jnp.int32)


def decode_values(code, minimum, stored, dtype, *, levels, interpret: bool, through=None):
  """float32 code * step + minimum, as `jact._core.quantize.decode_groups` computes
  it: clamped into the finite range of `through` (the quantized tensor's dtype,
  default `dtype`) and rounded to it, then clamped into `dtype`'s; the group's
  non-finite kind for the top code `levels` of a flagged group."""
  through = jnp.dtype(through or dtype)
  step, flagged, kind = Q.split_step(stored)
  s, inv_s = grid_scale(step)
  value = T.add(
    T.mul(code, T.mul(step, s, interpret), interpret), T.mul(minimum, s, interpret), interpret
  )
  big = float(jnp.finfo(through).max)
  value = Q.round_to(jnp.clip(T.mul(value, inv_s, interpret), -big, big), through)
  if jnp.dtype(dtype) != through:
    big = float(jnp.finfo(dtype).max)
    value = jnp.clip(value, -big, big)
  return jnp.where(flagged & (code == levels), Q.kind_value(kind), value)


def encode_codes(planes, levels, seed, index, *, interpret: bool, valid=None, dtype=None):
  """Statistics and int32 codes for a tile of R groups (the reference's math).

  Args:
    planes: float32 arrays [R, P], the groups' values in planes
      (`plane_layout`): plane p holds values p*M .. p*M + M - 1 in its first M
      columns, NaN elsewhere (ignored by the statistics and coded 0, like the
      reference's padding).
    levels: float32 2**bits - 1 (a scalar).
    seed: uint32 scalar, or None for round-to-nearest.
    index: uint32 arrays [R, P], the flat index of each value (the hash input).
    valid: bool arrays [R, P] marking the groups' own values (the rest is
      padding); None when every NaN is padding.
    dtype: the tensor's dtype (float16 / bfloat16 values round between decoded
      neighbours); None for float32.

  Returns:
    (minimum, stored step) float32 [R] holding bf16 values, and the int32 codes
    of each plane [R, P].
  """
  minimum, step, hi, inv_step, finite_levels = group_stats(
    planes, levels, interpret=interpret, valid=valid
  )
  codes = [
    encode_values(
      v,
      minimum[:, None],
      hi[:, None],
      inv_step[:, None],
      levels,
      seed,
      idx,
      interpret=interpret,
      finite_levels=finite_levels[:, None],
      valid=None if valid is None else valid[p],
      dtype=dtype,
      stored=step[:, None],
    )
    for p, (v, idx) in enumerate(zip(planes, index))
  ]
  return minimum, step, codes


def encode_tile(planes, levels, seed, index, *, bits: int, interpret: bool, valid=None, dtype=None):
  """`encode_codes` packed for a width dividing 8: the k = 8 // bits planes give
  one plane of bytes int32 [R, P] (byte j of a group is the or of
  code_p(j) << p * bits). Other widths pack into several byte planes:
  `encode_codes`, then `pack_planes`."""
  if 8 % bits:
    raise ValueError(
      f"encode_tile packs widths dividing 8 into one byte plane, got bits={bits}; "
      "use encode_codes and pack_planes, which pack every width."
    )
  minimum, step, codes = encode_codes(
    planes, levels, seed, index, interpret=interpret, valid=valid, dtype=dtype
  )
  return minimum, step, pack_planes(codes, bits)[0]


def _quantize_kernel(
  *refs, n_rows, groups, d, group_size, bits, rows, q_pad, stochastic, interpret
):
  if stochastic:
    x_ref, seed_ref, data_ref, min_ref, scale_ref = refs
    seed = seed_ref[0]
  else:
    x_ref, data_ref, min_ref, scale_ref = refs
    seed = None
  v_planes, _ = plane_layout(bits)
  m = group_size // v_planes  # values per plane, and bytes per byte plane
  q = group_size * bits // 8  # bytes per group
  pid = pl.program_id(0)
  row = pid * rows + jax.lax.broadcasted_iota(jnp.int32, (rows, q_pad), 0)
  j = jax.lax.broadcasted_iota(jnp.int32, (rows, q_pad), 1)
  sample, group = row // groups, row % groups
  row_ok = row < n_rows
  nan = jnp.array(jnp.nan, x_ref.dtype)
  planes, index, valid = [], [], []
  aligned = d % group_size == 0  # groups tile the samples: flat offset row * G + column
  for p in range(v_planes):
    col = group * group_size + p * m + j
    mask = row_ok & (j < m) & (col < d)
    offset = row * group_size + p * m + j if aligned else sample * d + col
    planes.append(T.load(x_ref, offset, mask, nan).astype(jnp.float32))
    valid.append(mask)
    index.append(row.astype(jnp.uint32) * jnp.uint32(group_size) + (j + p * m).astype(jnp.uint32))
  levels = float((1 << bits) - 1)
  minimum, step, codes = encode_codes(
    planes, levels, seed, index, interpret=interpret, valid=valid, dtype=x_ref.dtype
  )
  for b, byte in enumerate(pack_planes(codes, bits)):
    T.store(data_ref, row * q + b * m + j, byte.astype(jnp.uint8), row_ok & (j < m))
  r = pid * rows + jax.lax.broadcasted_iota(jnp.int32, (rows,), 0)
  T.store(min_ref, r, minimum.astype(jnp.bfloat16), r < n_rows)
  T.store(scale_ref, r, step.astype(jnp.bfloat16), r < n_rows)


def quantize(
  x: jax.Array,
  seed: jax.Array | None,
  *,
  bits: int,
  group_size: int,
  stochastic: bool = True,
  interpret: bool | None = None,
  rows: int | None = None,
) -> Packed:
  """Per-group quantization of x (N, ...) in one Pallas pass.

  Same contract as `reference.quantize_reference`: `group_size` is the
  effective group size (a multiple of 8), `seed` a uint32 scalar (ignored
  when not stochastic). `interpret` defaults to True off GPU; `rows` sets
  the groups per program (tests use it to bound the grid).
  """
  if interpret is None:
    interpret = not T.on_gpu()
  n, d = _layout(x.shape)
  T.check_int32(n * d, "the input")
  groups, n_rows, q, q_pad, r = packing_geometry(n, d, group_size, bits, rows)
  grid = max(1, -(-n_rows // r))
  kernel = functools.partial(
    _quantize_kernel,
    n_rows=n_rows,
    groups=groups,
    d=d,
    group_size=group_size,
    bits=bits,
    rows=r,
    q_pad=q_pad,
    stochastic=stochastic,
    interpret=interpret,
  )
  out_shape = packed_out_shape(n_rows, q)
  args = [x.reshape(-1)]
  if stochastic:
    args.append(jnp.asarray(seed, jnp.uint32).reshape(1))
  data, minimum, scale = T.call(
    kernel, grid=grid, out_shape=out_shape, name="jact_quantize", interpret=interpret
  )(*args)
  return Packed(
    data.reshape(n, groups, q),
    minimum.reshape(n, groups),
    scale.reshape(n, groups),
    tuple(x.shape),
    jnp.dtype(x.dtype),
    bits,
    group_size,
  )


def _dequantize_kernel(
  data_ref,
  min_ref,
  scale_ref,
  out_ref,
  *,
  n_rows,
  groups,
  d,
  group_size,
  bits,
  rows,
  q_pad,
  through,
  interpret,
):
  v_planes, b_planes = plane_layout(bits)
  m = group_size // v_planes  # values per plane, and bytes per byte plane
  q = group_size * bits // 8  # bytes per group
  pid = pl.program_id(0)
  row = pid * rows + jax.lax.broadcasted_iota(jnp.int32, (rows, q_pad), 0)
  j = jax.lax.broadcasted_iota(jnp.int32, (rows, q_pad), 1)
  sample, group = row // groups, row % groups
  in_group = (row < n_rows) & (j < m)
  bytes_ = [
    T.load(data_ref, row * q + b * m + j, in_group, jnp.uint8(0)).astype(jnp.int32)
    for b in range(b_planes)
  ]
  r = pid * rows + jax.lax.broadcasted_iota(jnp.int32, (rows,), 0)
  minimum = T.load(min_ref, r, r < n_rows, jnp.bfloat16(0)).astype(jnp.float32)[:, None]
  step = T.load(scale_ref, r, r < n_rows, jnp.bfloat16(0)).astype(jnp.float32)[:, None]
  levels = float((1 << bits) - 1)
  for p, code in enumerate(unpack_planes(bytes_, bits)):
    value = decode_values(
      code.astype(jnp.float32),
      minimum,
      step,
      out_ref.dtype,
      levels=levels,
      interpret=interpret,
      through=through,
    )
    col = group * group_size + p * m + j
    offset = row * group_size + p * m + j if d % group_size == 0 else sample * d + col
    T.store(out_ref, offset, value.astype(out_ref.dtype), in_group & (col < d))


def dequantize(
  packed: Packed, dtype=None, *, interpret: bool | None = None, rows: int | None = None
) -> jax.Array:
  """Inverse of `quantize` in one Pallas pass (same contract as the reference)."""
  if interpret is None:
    interpret = not T.on_gpu()
  dtype = jnp.dtype(dtype or packed.dtype)
  n, groups, q = packed.data.shape
  d = math.prod(packed.shape[1:]) if len(packed.shape) > 1 else 1
  T.check_int32(n * groups * packed.group_size, "the tensor")
  n_rows = n * groups
  v_planes, _ = plane_layout(packed.bits)
  m_pad = T.next_pow2(packed.group_size // v_planes)
  r = rows_per_program(v_planes * m_pad, rows)
  kernel = functools.partial(
    _dequantize_kernel,
    n_rows=n_rows,
    groups=groups,
    d=d,
    group_size=packed.group_size,
    bits=packed.bits,
    rows=r,
    q_pad=m_pad,
    through=jnp.dtype(packed.dtype),
    interpret=interpret,
  )
  out = T.call(
    kernel,
    grid=max(1, -(-n_rows // r)),
    out_shape=jax.ShapeDtypeStruct((n * d,), dtype),
    name="jact_dequantize",
    interpret=interpret,
  )(packed.data.reshape(-1), packed.minimum.reshape(-1), packed.scale.reshape(-1))
  return out.reshape(packed.view_shape or packed.shape)
