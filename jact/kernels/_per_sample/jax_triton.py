"""Per-sample mixed-precision kernels written in Triton's language, launched with jax-triton.

The contract, bits and layout of `reference.quantize_per_sample_reference` /
`dequantize_per_sample_reference` (registered as the "jax_triton"
implementations of "quantize_per_sample" / "dequantize_per_sample"), without
Pallas' Triton backend, which jax 0.12 deprecates. Quantization takes two
passes (group statistics, then codes packed at each sample's width and byte
offset), dequantization one. Sizes that vary per call site (samples, values
per sample, groups, buffer length) are runtime arguments: one compiled kernel
serves a shape class.

A sample of b bits is 8 x U codes (U = Dp / 8; row i holds values i U ..
i U + U - 1) packed into b byte planes of U bytes. Column j's 8 codes give
byte j of every plane, whatever the width: plane r is the or of the codes of
rows i = r (mod b) shifted by i - r when b divides 8, bit r of every row i in
bit i otherwise (3, 5, 6, 7 bits). So a program takes a tile of columns of
one sample and loops over the 8 possible planes, the width a runtime value.

>>> import jax, jax.numpy as jnp
>>> from jact.kernels._per_sample.reference import quantize_per_sample_reference
>>> x = jax.random.normal(jax.random.key(0), (4, 300))
>>> bits = jnp.array([1, 3, 4, 8], jnp.int32)
>>> args = dict(capacity_bytes=1200, group_size=152, seed=jnp.uint32(5))
>>> p = quantize_per_sample(x, bits, interpret=True, **args)
>>> r = quantize_per_sample_reference(x, bits, **args)
>>> bool((p.data == r.data).all() & (p.scale == r.scale).all() & (p.minimum == r.minimum).all())
True
>>> y = dequantize_per_sample(p, interpret=True)
>>> step = jnp.repeat(p.scale.astype(jnp.float32), 152, axis=1)[:, :300]
>>> bool((jnp.abs(y - x) <= step).all())
True
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from jact._core.persample import PackedPerSample
from jact.kernels import _jax_triton, _triton_rng
from jact.kernels._quantize.layout import check_int32, next_pow2, rows_per_program
from jact.kernels._per_sample.reference import (
  dequantize_per_sample_reference,
  quantize_per_sample_reference,
)
from jact.kernels._triton_groups import group_statistics

__all__ = [
  "quantize_per_sample",
  "dequantize_per_sample",
  "geometry",
  "compile_quantize_for_cuda",
  "compile_dequantize_for_cuda",
  "PTX",
]

_ZERO_TILE = 4096  # most tail bytes one program zeroes
_BF16_MAX = float(jnp.finfo(jnp.bfloat16).max)
_FORMATS = {jnp.dtype(jnp.float32): 0, jnp.dtype(jnp.bfloat16): 1, jnp.dtype(jnp.float16): 2}
"""Float dtype -> the kernels' format code (bfloat16 travels as its uint16 bits)."""


def geometry(d: int, group_size: int, rows: int | None = None) -> tuple[int, int, int, int, int]:
  """(groups per sample, Dp, groups per statistics program, columns per packing
  program, packing programs per sample) for samples of `d` values. `rows`
  (rounded up to a power of two) bounds the programs in tests; a packing
  program takes as many values as a statistics program, 8 per column."""
  groups = -(-d // group_size)
  dp = groups * group_size
  gp = next_pow2(group_size)
  r = rows_per_program(group_size, rows)
  columns = max(1, min(r * gp, next_pow2(dp)) // 8)
  return groups, dp, r, columns, -(-(dp // 8) // columns)


def _offsets(bits: jax.Array, dp: int) -> jax.Array:
  """int32 byte offset of each sample's segment (exclusive prefix sum of b_n Dp / 8)."""
  size = bits.astype(jnp.int32) * (dp // 8)
  return jnp.cumsum(size) - size


# ----------------------------------------------------------------------------- shared pieces


@triton.jit
def _load_float(ptr, offset, mask, FORMAT: tl.constexpr):
  """float32 values of a float32 / bfloat16 (uint16 bits) / float16 array, NaN where not `mask`."""
  if FORMAT == 1:
    raw = tl.load(ptr + offset, mask=mask, other=0).to(tl.uint32)
    v = (raw << 16).to(tl.float32, bitcast=True)
  else:
    v = tl.load(ptr + offset, mask=mask, other=0.0).to(tl.float32)
  return tl.where(mask, v, float("nan"))


@triton.jit
def _round_to(v, FORMAT: tl.constexpr):
  """float32 v (finite, in the format's range) rounded to nearest even in the format
  (`jact._core.quantize.round_to`), as float32."""
  if FORMAT == 1:  # bfloat16, by the bits
    u = v.to(tl.uint32, bitcast=True)
    v = ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
  elif FORMAT == 2:
    v = v.to(tl.float16).to(tl.float32)
  return v


@triton.jit
def _grid_values(k, minimum, step, FORMAT: tl.constexpr, DTYPE_MAX: tl.constexpr):
  """Codes k decoded (`jact._core.quantize.group_values`), clamped into the format's
  finite range and rounded to it (`decode_groups` without the non-finite kinds)."""
  wide = step >= 1.2676506002282294e30  # 2**100: the grid scaled by 1/4
  s = tl.where(wide, 0.25, 1.0)
  inv_s = tl.where(wide, 4.0, 1.0)
  value = (k * (step * s) + minimum * s) * inv_s
  return _round_to(tl.minimum(tl.maximum(value, -DTYPE_MAX), DTYPE_MAX), FORMAT)


# ----------------------------------------------------------------------------- pass 1: statistics


@triton.jit
def _stats_kernel(
  x_ptr,
  bits_ptr,
  n_rows,
  groups,
  d,
  min_ptr,
  scale_ptr,
  hi_ptr,
  inv_ptr,
  GROUP_SIZE: tl.constexpr,
  GP: tl.constexpr,
  ROWS: tl.constexpr,
  ALIGNED: tl.constexpr,
  FORMAT: tl.constexpr,
  BF16_MAX: tl.constexpr,
):
  """Each group's bf16 minimum and stored step (as uint16 bits), finite maximum and
  1 / (step * s), at its sample's width (`jact._core.quantize.group_codes`)."""
  row1 = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # group rows [ROWS]
  row, col = row1[:, None], tl.arange(0, GP)[None, :]
  pos = (row % groups) * GROUP_SIZE + col  # position in the sample
  mask = (row < n_rows) & (col < GROUP_SIZE) & (pos < d)
  if ALIGNED:  # groups tile the samples
    offset = row * GROUP_SIZE + col
  else:
    offset = (row // groups) * d + pos
  v = _load_float(x_ptr, offset, mask, FORMAT)
  ok = row1 < n_rows
  levels = ((1 << tl.load(bits_ptr + row1 // groups, mask=ok, other=1)) - 1).to(tl.float32)

  one = tl.full(levels.shape, 1.0, tl.float32)
  _, hi, _, minimum, _, _, stored, inv_step = group_statistics(
    v[:, None, :],  # a group a row, in one plane
    mask[:, None, :],
    levels,
    tl.div_rn(one, levels),
    tl.div_rn(one, tl.maximum(levels - 1.0, 1.0)),
    BF16_MAX,
  )
  # the statistics hold bf16 values: their bf16 bits are the float32's high half
  tl.store(min_ptr + row1, (minimum.to(tl.uint32, bitcast=True) >> 16).to(tl.uint16), mask=ok)
  tl.store(scale_ptr + row1, (stored >> 16).to(tl.uint16), mask=ok)
  tl.store(hi_ptr + row1, hi, mask=ok)
  tl.store(inv_ptr + row1, inv_step, mask=ok)


# ----------------------------------------------------------------------------- pass 2: codes


@triton.jit
def _pack_kernel(
  x_ptr,
  bits_ptr,
  offsets_ptr,
  min_ptr,
  scale_ptr,
  hi_ptr,
  inv_ptr,
  seed_ptr,
  n,
  d,
  groups,
  tiles,
  capacity,
  data_ptr,
  GROUP_SIZE: tl.constexpr,
  COLUMNS: tl.constexpr,
  ZERO_TILE: tl.constexpr,
  STOCHASTIC: tl.constexpr,
  FORMAT: tl.constexpr,
  DTYPE_MAX: tl.constexpr,
):
  """Program (sample, tile t): the codes of columns t * COLUMNS ... of the sample's
  8 x U codes, packed into its byte planes at its offset; and the buffer's tail
  past the used bytes zeroed, ZERO_TILE bytes a program (some programs only that)."""
  pid = tl.program_id(0)
  unit = groups * (GROUP_SIZE // 8)  # U: bytes per byte plane
  used = tl.load(offsets_ptr + n - 1) + tl.load(bits_ptr + n - 1) * unit
  z = pid * ZERO_TILE + tl.arange(0, ZERO_TILE)
  tl.store(data_ptr + z, tl.zeros([ZERO_TILE], tl.uint8), mask=(z >= used) & (z < capacity))
  sample = pid // tiles
  if sample < n:
    bits = tl.load(bits_ptr + sample)
    offset = tl.load(offsets_ptr + sample)
    jj = (pid % tiles) * COLUMNS + tl.arange(0, COLUMNS)  # columns [COLUMNS]
    i, j = tl.arange(0, 8)[:, None], jj[None, :]  # code rows, columns
    pos = i * unit + j  # position in the sample
    in_sample = (i < 8) & (j < unit)
    own = in_sample & (pos < d)
    v = _load_float(x_ptr, sample * d + pos, own, FORMAT)
    r = sample * groups + pos // GROUP_SIZE  # group rows
    minimum = (tl.load(min_ptr + r, mask=in_sample, other=0).to(tl.uint32) << 16).to(
      tl.float32, bitcast=True
    )
    stored = tl.load(scale_ptr + r, mask=in_sample, other=0).to(tl.uint32) << 16
    hi = tl.load(hi_ptr + r, mask=in_sample, other=0.0)
    inv_step = tl.load(inv_ptr + r, mask=in_sample, other=0.0)
    flagged = (stored >> 31) == 1
    step = tl.where(flagged, stored & 0x7FFC0000, stored).to(tl.float32, bitcast=True)
    levels = ((1 << bits) - 1).to(tl.float32)
    top = levels - flagged.to(tl.float32)  # the finite values' largest code

    # codes (`jact._core.quantize.group_codes`), stochastically rounded
    wide = (hi - minimum) >= 1.2676506002282294e30  # 2**100: the grid scaled by 1/4
    s = tl.where(wide, 0.25, 1.0)
    clipped = tl.where(v != v, minimum, tl.minimum(tl.maximum(v, minimum), hi))
    scaled = (clipped * s - minimum * s) * inv_step
    if STOCHASTIC:
      index = (sample * groups * GROUP_SIZE + pos).to(tl.uint32)  # the flat index
      noise = _triton_rng.uniform(tl.load(seed_ptr), index)
    else:
      noise = 0.5
    if FORMAT == 0:  # float32: the grid itself
      code = tl.minimum(tl.floor(tl.maximum(scaled, 0.0) + noise), top)
    else:  # between the decoded neighbours, rounded to the dtype (`lattice_codes`)
      k_low = tl.minimum(tl.maximum(tl.floor(scaled), 0.0), tl.maximum(top - 1.0, 0.0))
      a = _grid_values(k_low, minimum, step, FORMAT, DTYPE_MAX)
      b = _grid_values(k_low + 1.0, minimum, step, FORMAT, DTYPE_MAX)
      gap = b - a
      positive = gap > 0.0
      prob = tl.where(positive, tl.div_rn(clipped - a, tl.where(positive, gap, 1.0)), 0.0)
      code = tl.minimum(k_low + tl.where(noise < prob, 1.0, 0.0), top)
    finite = (v == v) & (tl.abs(v) != float("inf"))
    code = tl.where(own & ~finite, (1 << bits) - 1, code.to(tl.int32))

    # byte plane p (of `bits`) holds, for every column, the or of the codes of
    # rows p, p + bits, ... shifted to their place when `bits` divides 8, else
    # bit p of row i's code in its bit i
    planar = (8 % bits) == 0
    shift = (i // bits) * bits
    for p in tl.static_range(8):
      if p < bits:
        if planar:
          byte = tl.sum(tl.where(i % bits == p, code << shift, 0), axis=0)
        else:
          byte = tl.sum(((code >> p) & 1) << i, axis=0)
        tl.store(data_ptr + offset + p * unit + jj, byte.to(tl.uint8), mask=jj < unit)


def quantize_per_sample(
  x: jax.Array,
  bits: jax.Array,
  *,
  capacity_bytes: int,
  group_size: int,
  seed: jax.Array | None,
  interpret: bool | None = None,
  rows: int | None = None,
  initial=None,
) -> PackedPerSample:
  """Per-sample mixed-precision quantization of x (N, ...) in two Triton passes.

  The contract of `reference.quantize_per_sample_reference`: `bits` int32[N]
  in 1..8 fitting `capacity_bytes`, `group_size` the effective one, `seed` a
  uint32 scalar or None (round to nearest). `interpret` defaults to True off
  GPU (Triton's interpreter, slow); `rows` (groups per statistics program,
  the packing programs take as many values) bounds the grid in tests;
  `initial` pre-fills the outputs (tests).
  """
  if interpret is None:
    interpret = not _jax_triton.on_gpu()
  n, d = x.shape[0], math.prod(x.shape[1:])
  capacity = int(capacity_bytes)
  if not n * d:
    return quantize_per_sample_reference(
      x, bits, capacity_bytes=capacity, group_size=group_size, seed=seed
    )
  check_int32(n * d, "the input")
  check_int32(capacity, "the buffer")
  groups, dp, _, _, tiles = geometry(d, group_size, rows)
  stats, pack = _constants(x.shape, x.dtype, capacity, group_size, seed is not None, rows)
  bits = jnp.asarray(bits, jnp.int32)
  flat = _jax_triton.flat_operand(x)
  calls = dict(interpret=interpret, initial=initial)
  n_rows = n * groups
  minimum, scale, hi, inv_step = _jax_triton.call(
    _stats_kernel,
    flat,
    bits,
    n_rows,
    groups,
    d,
    grid=-(-n_rows // stats["ROWS"]),
    out_shape=(
      jax.ShapeDtypeStruct((n_rows,), jnp.uint16),
      jax.ShapeDtypeStruct((n_rows,), jnp.uint16),
      jax.ShapeDtypeStruct((n_rows,), jnp.float32),
      jax.ShapeDtypeStruct((n_rows,), jnp.float32),
    ),
    name="jact_per_sample_stats_jax_triton",
    **calls,
    **stats,
  )
  seed = jnp.asarray(0 if seed is None else seed, jnp.uint32).reshape(1)
  (data,) = _jax_triton.call(
    _pack_kernel,
    flat,
    bits,
    _offsets(bits, dp),
    minimum,
    scale,
    hi,
    inv_step,
    seed,
    n,
    d,
    groups,
    tiles,
    capacity,
    grid=max(n * tiles, -(-capacity // pack["ZERO_TILE"])),
    out_shape=(jax.ShapeDtypeStruct((capacity,), jnp.uint8),),
    name="jact_per_sample_pack_jax_triton",
    **calls,
    **pack,
  )
  as_bf16 = lambda b16: jax.lax.bitcast_convert_type(b16, jnp.bfloat16).reshape(n, groups)
  return PackedPerSample(
    data,
    bits.astype(jnp.uint8),
    as_bf16(minimum),
    as_bf16(scale),
    tuple(x.shape),
    jnp.dtype(x.dtype),
    group_size,
  )


def _constants(shape, dtype, capacity, group_size, stochastic, rows):
  """The statistics and packing kernels' constexpr arguments."""
  n, d = shape[0], math.prod(shape[1:])
  _, _, r, columns, tiles = geometry(d, group_size, rows)
  dtype = jnp.dtype(dtype)
  stats = dict(
    GROUP_SIZE=group_size,
    GP=next_pow2(group_size),
    ROWS=r,
    ALIGNED=d % group_size == 0,
    FORMAT=_FORMATS[dtype],
    BF16_MAX=_BF16_MAX,
  )
  pack = dict(
    GROUP_SIZE=group_size,
    COLUMNS=columns,
    ZERO_TILE=min(_ZERO_TILE, next_pow2(-(-capacity // (n * tiles)))),
    STOCHASTIC=bool(stochastic),
    FORMAT=_FORMATS[dtype],
    DTYPE_MAX=float(jnp.finfo(dtype).max),
  )
  return stats, pack


# ----------------------------------------------------------------------------- dequantize


@triton.jit
def _unpack_kernel(
  data_ptr,
  bits_ptr,
  offsets_ptr,
  min_ptr,
  scale_ptr,
  d,
  groups,
  tiles,
  capacity,
  out_ptr,
  GROUP_SIZE: tl.constexpr,
  COLUMNS: tl.constexpr,
  THROUGH: tl.constexpr,
  THROUGH_MAX: tl.constexpr,
  OUT: tl.constexpr,
  OUT_MAX: tl.constexpr,
):
  """Program (sample, tile t): the values of columns t * COLUMNS ... of the
  sample's 8 x U codes, decoded (`jact._core.quantize.decode_groups`) through the
  quantized tensor's format THROUGH into the output's OUT."""
  pid = tl.program_id(0)
  sample = pid // tiles
  unit = groups * (GROUP_SIZE // 8)
  bits = tl.load(bits_ptr + sample).to(tl.int32)
  offset = tl.load(offsets_ptr + sample)
  jj = (pid % tiles) * COLUMNS + tl.arange(0, COLUMNS)
  i, j = tl.arange(0, 8)[:, None], jj[None, :]
  planar = (8 % bits) == 0
  shift = (i // bits) * bits
  code = tl.zeros([8, COLUMNS], tl.int32)
  for p in tl.static_range(8):  # the inverse of the packing kernel's planes
    if p < bits:
      at = offset + p * unit + jj
      byte = tl.load(data_ptr + at, mask=(jj < unit) & (at < capacity), other=0)
      byte = byte.to(tl.int32)[None, :]
      if planar:
        code += tl.where(i % bits == p, (byte >> shift) & ((1 << bits) - 1), 0)
      else:
        code += ((byte >> i) & 1) << p
  pos = i * unit + j
  in_sample = (i < 8) & (j < unit)
  r = sample * groups + pos // GROUP_SIZE
  minimum = (tl.load(min_ptr + r, mask=in_sample, other=0).to(tl.uint32) << 16).to(
    tl.float32, bitcast=True
  )
  stored = tl.load(scale_ptr + r, mask=in_sample, other=0).to(tl.uint32) << 16
  flagged = (stored >> 31) == 1
  step = tl.where(flagged, stored & 0x7FFC0000, stored).to(tl.float32, bitcast=True)
  code = code.to(tl.float32)
  value = _grid_values(code, minimum, step, THROUGH, THROUGH_MAX)
  if OUT != THROUGH:
    value = tl.minimum(tl.maximum(value, -OUT_MAX), OUT_MAX)
  kind = (stored >> 16) & 3  # NaN 1, +inf 2, -inf 3 (`kind_value`)
  special = tl.where(kind == 2, float("inf"), float("nan"))
  special = tl.where(kind == 3, -float("inf"), special)
  value = tl.where(flagged & (code == ((1 << bits) - 1).to(tl.float32)), special, value)
  own = in_sample & (pos < d)
  if OUT == 1:  # bfloat16 bits, rounded to nearest even
    u = value.to(tl.uint32, bitcast=True)
    value = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).to(tl.uint16)
  else:
    value = value.to(out_ptr.dtype.element_ty)
  tl.store(out_ptr + sample * d + pos, value, mask=own)


def dequantize_per_sample(
  p: PackedPerSample,
  dtype=None,
  *,
  interpret: bool | None = None,
  rows: int | None = None,
  initial=None,
) -> jax.Array:
  """Inverse of `quantize_per_sample` in one Triton pass (the contract of the
  reference; widths must fit the buffer, as `api.quantize_per_sample` ensures).
  `interpret`, `rows` and `initial` as in `quantize_per_sample`."""
  if interpret is None:
    interpret = not _jax_triton.on_gpu()
  dtype = jnp.dtype(dtype or p.dtype)
  n, groups = p.scale.shape
  d = math.prod(p.shape[1:])
  if not n * d:
    return dequantize_per_sample_reference(p, dtype)
  check_int32(n * d, "the tensor")
  check_int32(p.data.size, "the buffer")
  _, dp, _, _, tiles = geometry(d, p.group_size, rows)
  as_bits = lambda a: jax.lax.bitcast_convert_type(a, jnp.uint16).reshape(-1)
  (out,) = _jax_triton.call(
    _unpack_kernel,
    p.data,
    p.bits,
    _offsets(p.bits, dp),
    as_bits(p.minimum),
    as_bits(p.scale),
    d,
    groups,
    tiles,
    p.data.size,
    grid=n * tiles,
    out_shape=(jax.ShapeDtypeStruct((n * d,), jnp.uint16 if dtype == jnp.bfloat16 else dtype),),
    name="jact_per_sample_unpack_jax_triton",
    interpret=interpret,
    initial=initial,
    **_unpack_constants(p, dtype, rows),
  )
  if dtype == jnp.bfloat16:
    out = jax.lax.bitcast_convert_type(out, jnp.bfloat16)
  return out.reshape(p.shape)


def _unpack_constants(p: PackedPerSample, dtype, rows) -> dict:
  _, _, _, columns, _ = geometry(math.prod(p.shape[1:]), p.group_size, rows)
  through, out = jnp.dtype(p.dtype), jnp.dtype(dtype)
  return dict(
    GROUP_SIZE=p.group_size,
    COLUMNS=columns,
    THROUGH=_FORMATS[through],
    THROUGH_MAX=float(jnp.finfo(through).max),
    OUT=_FORMATS[out],
    OUT_MAX=float(jnp.finfo(out).max),
  )


# ----------------------------------------------------------------------------- PTX


def compile_quantize_for_cuda(
  x: jax.ShapeDtypeStruct,
  bits,
  *,
  capacity_bytes: int,
  group_size: int,
  seed,
  rows: int | None = None,
  arch: int = 90,
) -> str:
  """The PTX of both kernels `quantize_per_sample` runs for an input like `x` on an
  sm_`arch` GPU (the statistics pass, then the packing pass), compiled here by
  the `triton` package (any host; `bits` is unused: int32[N] in the kernels)."""
  del bits
  stats, pack = _constants(x.shape, x.dtype, capacity_bytes, group_size, seed is not None, rows)
  x_type, i32 = _jax_triton.operand_type(x.dtype), "i32"
  u16, f32, u8 = jnp.uint16, jnp.float32, jnp.uint8
  stats_types = [x_type, jnp.int32, i32, i32, i32, u16, u16, f32, f32]
  pack_types = [x_type, jnp.int32, jnp.int32, u16, u16, f32, f32, jnp.uint32]
  pack_types += [i32] * 5 + [u8]
  return "\n".join(
    _jax_triton.compile_ptx(kernel, types, arch=arch, **constants)
    for kernel, types, constants in (
      (_stats_kernel, stats_types, stats),
      (_pack_kernel, pack_types, pack),
    )
  )


def compile_dequantize_for_cuda(
  p: PackedPerSample, dtype=None, *, rows: int | None = None, arch: int = 90
) -> str:
  """The PTX `dequantize_per_sample` runs for a `PackedPerSample` like `p` (leaves
  of any array-like with a dtype) on an sm_`arch` GPU, compiled here."""
  dtype = jnp.dtype(dtype or p.dtype)
  types = [jnp.uint8, jnp.uint8, jnp.int32, jnp.uint16, jnp.uint16] + ["i32"] * 4
  types.append(_jax_triton.operand_type(dtype))
  return _jax_triton.compile_ptx(
    _unpack_kernel, types, arch=arch, **_unpack_constants(p, dtype, rows)
  )


PTX = {
  "quantize_per_sample": compile_quantize_for_cuda,
  "dequantize_per_sample": compile_dequantize_for_cuda,
}
"""op -> the function compiling its kernels for sm_90 here (the kernel contract tests)."""
