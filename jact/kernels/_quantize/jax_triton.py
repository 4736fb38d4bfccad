"""Per-group quantize-and-pack and its inverse, written in Triton's language and
launched with jax-triton.

The same contracts, bits and layout as the Pallas kernels
`pallas_triton.quantize` / `dequantize` (registered as the "jax_triton"
implementations of "quantize" and "dequantize"), without Pallas' Triton
backend, which jax 0.12 deprecates: this module imports no Pallas module (the
layout comes from `layout`). The sizes that vary per call site (group rows,
groups and values per sample) are runtime arguments, so one compiled kernel
serves every tensor of a width, group size, dtype and tile. How it stays
bit-exact: docs/design.md, "The jax-triton quantize kernel".

>>> import jax, jax.numpy as jnp
>>> from jact.kernels._quantize.reference import dequantize_reference, quantize_reference
>>> x = jax.random.normal(jax.random.key(0), (4, 300))
>>> p = quantize(x, jnp.uint32(5), bits=2, group_size=152, interpret=True)
>>> r = quantize_reference(x, jnp.uint32(5), bits=2, group_size=152)
>>> bool((p.data == r.data).all() & (p.scale == r.scale).all() & (p.minimum == r.minimum).all())
True
>>> y = dequantize(r, jnp.bfloat16, interpret=True)
>>> y.dtype, bool((y == dequantize_reference(r, jnp.bfloat16)).all())
(dtype(bfloat16), True)
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import triton
import triton.language as tl

from jact._core.quantize import Packed
from jact.kernels import _jax_triton
from jact.kernels._quantize.layout import check_int32, packing_geometry
from jact.kernels._triton_groups import group_statistics, group_tile, store_groups
from jact.kernels._triton_rng import uniform

__all__ = [
  "quantize",
  "quantize_kernel",
  "kernel_constants",
  "compile_for_cuda",
  "dequantize",
  "dequantize_kernel",
  "dequantize_constants",
  "compile_dequantize_for_cuda",
  "PTX",
]

_BF16_MAX = float(jnp.finfo(jnp.bfloat16).max)
_DTYPE_CODE = {jnp.dtype(jnp.bfloat16): 1, jnp.dtype(jnp.float16): 2}
"""A low-precision dtype's number in the kernels' constexprs (float32: 0)."""


@triton.jit
def quantize_kernel(
  x_ptr,
  seed_ptr,
  n_rows,
  groups,
  d,
  data_ptr,
  min_ptr,
  scale_ptr,
  GROUP_SIZE: tl.constexpr,
  BITS: tl.constexpr,
  ROWS: tl.constexpr,
  Q_PAD: tl.constexpr,
  ALIGNED: tl.constexpr,
  STOCHASTIC: tl.constexpr,
  IN_BF16: tl.constexpr,
  INV_LEVELS: tl.constexpr,
  INV_FLAGGED: tl.constexpr,
  BF16_MAX: tl.constexpr,
  LATTICE: tl.constexpr,
  DTYPE_MAX: tl.constexpr,
):
  # the groups as the packing's K value planes of M values (`group_tile`)
  LEVELS: tl.constexpr = (1 << BITS) - 1
  row1, within, mask, offset = group_tile(n_rows, groups, d, GROUP_SIZE, BITS, ROWS, Q_PAD, ALIGNED)
  if IN_BF16:  # bits as uint16
    raw = tl.load(x_ptr + offset, mask=mask, other=0).to(tl.uint32)
    v = (raw << 16).to(tl.float32, bitcast=True)
  else:
    v = tl.load(x_ptr + offset, mask=mask, other=0.0).to(tl.float32)
  v = tl.where(mask, v, float("nan"))

  # group statistics (`jact._core.quantize.group_codes`)
  finite, hi, finite_levels, minimum, s, step, stored, inv_step = group_statistics(
    v, mask, LEVELS, INV_LEVELS, INV_FLAGGED, BF16_MAX
  )

  # codes, stochastically rounded, packed plane by plane into bytes
  mn, hi3 = minimum[:, None, None], hi[:, None, None]
  s3, inv_step3 = s[:, None, None], inv_step[:, None, None]
  clipped = tl.where(v != v, mn, tl.minimum(tl.maximum(v, mn), hi3))
  scaled = (clipped * s3 - mn * s3) * inv_step3
  if STOCHASTIC:  # jact._core.rng's uniform of the hash of (seed, flat index)
    index = row1[:, None, None].to(tl.uint32) * GROUP_SIZE + within.to(tl.uint32)  # flat
    noise = uniform(tl.load(seed_ptr), index)
  else:
    noise = 0.5
  top = finite_levels[:, None, None]
  if LATTICE == 0:  # float32: the grid itself
    code = tl.minimum(tl.maximum(tl.floor(scaled + noise), 0.0), top)
  else:  # between the decoded neighbours, rounded to the dtype (`lattice_codes`)
    k_low = tl.minimum(tl.maximum(tl.floor(scaled), 0.0), tl.maximum(top - 1.0, 0.0))
    wide_d = step >= 1.2676506002282294e30  # the decoder's grid scale (of the step)
    sd = tl.where(wide_d, 0.25, 1.0)
    inv_sd = tl.where(wide_d, 4.0, 1.0)[:, None, None]
    st, mn_s = (step * sd)[:, None, None], (minimum * sd)[:, None, None]
    a = tl.minimum(tl.maximum((k_low * st + mn_s) * inv_sd, -DTYPE_MAX), DTYPE_MAX)
    b = tl.minimum(tl.maximum(((k_low + 1.0) * st + mn_s) * inv_sd, -DTYPE_MAX), DTYPE_MAX)
    if LATTICE == 1:  # round to nearest even bfloat16, by the bits
      ua = a.to(tl.uint32, bitcast=True)
      a = ((ua + 0x7FFF + ((ua >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
      ub = b.to(tl.uint32, bitcast=True)
      b = ((ub + 0x7FFF + ((ub >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    else:
      a = a.to(tl.float16).to(tl.float32)
      b = b.to(tl.float16).to(tl.float32)
    gap = b - a
    positive = gap > 0.0
    prob = tl.where(positive, tl.div_rn(clipped - a, tl.where(positive, gap, 1.0)), 0.0)
    code = tl.minimum(k_low + tl.where(noise < prob, 1.0, 0.0), top)
  code = tl.where(mask & ~finite, LEVELS, code.to(tl.int32))
  # packed plane by plane into bytes (`jact._core.packing`), then the statistics
  store_groups(
    code, minimum, stored, row1, n_rows, data_ptr, min_ptr, scale_ptr, GROUP_SIZE, BITS, Q_PAD
  )


def kernel_constants(
  shape, dtype, *, bits: int, group_size: int, stochastic: bool, rows: int | None = None
) -> tuple[int, tuple[int, int, int], dict]:
  """(grid, the kernel's runtime sizes (group rows, groups per sample, values
  per sample), its constexpr arguments) for an input of `shape` and `dtype`.
  The constexprs depend on the width, group size, dtype, rounding, tile and
  whether groups tile the samples, not on the number of samples or groups:
  one compiled kernel serves every input of that class."""
  n = shape[0] if len(shape) else 1
  d = int(np.prod(shape[1:])) if len(shape) > 1 else 1
  groups, n_rows, _, q_pad, r = packing_geometry(n, d, group_size, bits, rows)
  levels = np.float32((1 << bits) - 1)
  constants = dict(
    GROUP_SIZE=group_size,
    BITS=bits,
    ROWS=r,
    Q_PAD=q_pad,
    ALIGNED=d % group_size == 0,
    STOCHASTIC=bool(stochastic),
    IN_BF16=jnp.dtype(dtype) == jnp.bfloat16,
    INV_LEVELS=float(np.float32(1.0) / levels),
    INV_FLAGGED=float(np.float32(1.0) / max(levels - np.float32(1.0), np.float32(1.0))),
    BF16_MAX=_BF16_MAX,
    LATTICE=_DTYPE_CODE.get(jnp.dtype(dtype), 0),
    DTYPE_MAX=float(jnp.finfo(dtype).max),
  )
  return max(1, -(-n_rows // r)), (n_rows, groups, d), constants


def quantize(
  x: jax.Array,
  seed: jax.Array | None,
  *,
  bits: int,
  group_size: int,
  stochastic: bool = True,
  interpret: bool | None = None,
  rows: int | None = None,
  initial=None,
) -> Packed:
  """Per-group quantization of x (N, ...) in one Triton pass; the contract of
  `reference.quantize_reference` (and `pallas_triton.quantize`).
  `interpret` defaults to True off GPU (Triton's interpreter, slow); `rows`
  sets the groups per program; `initial` pre-fills the outputs (tests)."""
  if interpret is None:
    interpret = not _jax_triton.on_gpu()
  n = x.shape[0] if x.ndim else 1
  d = int(np.prod(x.shape[1:])) if x.ndim > 1 else 1
  check_int32(n * d, "the input")
  groups, n_rows, q, _, _ = packing_geometry(n, d, group_size, bits, rows)
  grid, sizes, constants = kernel_constants(
    x.shape, x.dtype, bits=bits, group_size=group_size, stochastic=stochastic, rows=rows
  )
  flat = _jax_triton.flat_operand(x)
  seed = jnp.asarray(seed if stochastic else 0, jnp.uint32).reshape(1)
  out_shape = (
    jax.ShapeDtypeStruct((n_rows * q,), jnp.uint8),
    jax.ShapeDtypeStruct((n_rows,), jnp.uint16),
    jax.ShapeDtypeStruct((n_rows,), jnp.uint16),
  )
  data, minimum, scale = _jax_triton.call(
    quantize_kernel,
    flat,
    seed,
    *sizes,
    grid=grid,
    out_shape=out_shape,
    name="jact_quantize_jax_triton",
    interpret=interpret,
    initial=initial,
    **constants,
  )
  as_bf16 = lambda bits16: jax.lax.bitcast_convert_type(bits16, jnp.bfloat16).reshape(n, groups)
  return Packed(
    data.reshape(n, groups, q),
    as_bf16(minimum),
    as_bf16(scale),
    tuple(x.shape),
    jnp.dtype(x.dtype),
    bits,
    group_size,
  )


def compile_for_cuda(
  x: jax.ShapeDtypeStruct,
  seed,
  *,
  bits: int,
  group_size: int,
  stochastic: bool = True,
  rows: int | None = None,
  arch: int = 90,
) -> str:
  """The PTX `quantize` runs for an input like `x` on an sm_`arch` GPU, compiled
  here by the `triton` package (any host; `seed` is unused, as in the kernel's
  signature it is one uint32)."""
  del seed
  _, _, constants = kernel_constants(
    x.shape, x.dtype, bits=bits, group_size=group_size, stochastic=stochastic, rows=rows
  )
  x_type = _jax_triton.operand_type(x.dtype)
  return _jax_triton.compile_ptx(
    quantize_kernel,
    [x_type, jnp.uint32, "i32", "i32", "i32", jnp.uint8, jnp.uint16, jnp.uint16],
    arch=arch,
    **constants,
  )


# ----------------------------------------------------------------------------- dequantize


@triton.jit
def dequantize_kernel(
  data_ptr,
  min_ptr,
  scale_ptr,
  n_rows,
  groups,
  d,
  out_ptr,
  GROUP_SIZE: tl.constexpr,
  BITS: tl.constexpr,
  ROWS: tl.constexpr,
  Q_PAD: tl.constexpr,
  ALIGNED: tl.constexpr,
  THROUGH: tl.constexpr,
  THROUGH_MAX: tl.constexpr,
  OUT: tl.constexpr,
  OUT_MAX: tl.constexpr,
):
  # THROUGH / OUT: the quantized tensor's / the output's dtype (`_DTYPE_CODE`: 0 float32,
  # 1 bfloat16, written as its uint16 bits, 2 float16); the layout as in `quantize_kernel`
  K: tl.constexpr = 1 if BITS == 16 else (8 // BITS if 8 % BITS == 0 else 8)
  M: tl.constexpr = GROUP_SIZE // K
  Q: tl.constexpr = GROUP_SIZE * BITS // 8
  LEVELS: tl.constexpr = (1 << BITS) - 1
  row1 = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # [ROWS]
  row = row1[:, None, None]
  p = tl.arange(0, K)[None, :, None]
  j = tl.arange(0, Q_PAD)[None, None, :]
  in_group = (row < n_rows) & (j < M)
  src = data_ptr + row * Q + j
  if BITS == 16:  # the low bytes, then the high bytes
    low = tl.load(src, mask=in_group, other=0).to(tl.int32)
    code = low | (tl.load(src + M, mask=in_group, other=0).to(tl.int32) << 8)
  elif 8 % BITS == 0:  # value plane p at bits p * BITS of each byte
    code = (tl.load(src, mask=in_group, other=0).to(tl.int32) >> (p * BITS)) & LEVELS
  else:  # bit b of value plane p in bit p of byte plane b
    code = tl.zeros((ROWS, K, Q_PAD), tl.int32)
    for b in tl.static_range(BITS):
      byte = tl.load(src + b * M, mask=in_group, other=0).to(tl.int32)
      code = code | (((byte >> p) & 1) << b)

  # the group's statistics (bf16 bits), the stored step split (`split_step`)
  ok = row1 < n_rows
  minimum = (tl.load(min_ptr + row1, mask=ok, other=0).to(tl.uint32) << 16).to(
    tl.float32, bitcast=True
  )
  u = tl.load(scale_ptr + row1, mask=ok, other=0).to(tl.uint32) << 16
  flagged = (u >> 31) == 1
  step = tl.where(flagged, u & 0x7FFC0000, u).to(tl.float32, bitcast=True)
  kind = tl.where(flagged, (u >> 16) & 3, 0)
  wide = step >= 1.2676506002282294e30  # 2**100: the grid scaled by 1/4 (`grid_scale`)
  s = tl.where(wide, 0.25, 1.0)
  inv_s = tl.where(wide, 4.0, 1.0)[:, None, None]
  st, mn = (step * s)[:, None, None], (minimum * s)[:, None, None]

  # `decode_groups`: the grid value, clamped and rounded to THROUGH, clamped to OUT
  value = (code.to(tl.float32) * st + mn) * inv_s
  value = tl.minimum(tl.maximum(value, -THROUGH_MAX), THROUGH_MAX)
  if THROUGH == 1:  # round to nearest even bfloat16, by the bits (`round_to`)
    ub = value.to(tl.uint32, bitcast=True)
    value = ((ub + 0x7FFF + ((ub >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
  elif THROUGH == 2:  # float16: the bits, then subnormals on their 2**-24 grid
    ub = value.to(tl.uint32, bitcast=True)
    rounded = ((ub + 0xFFF + ((ub >> 13) & 1)) & 0xFFFFE000).to(tl.float32, bitcast=True)
    tiny = tl.abs(value) < 6.103515625e-05  # 2**-14
    scaled = tl.minimum(tl.abs(value), 6.103515625e-05) * 16777216.0  # exact, <= 1024
    whole = scaled.to(tl.int32)
    frac = scaled - whole.to(tl.float32)
    up = (frac > 0.5) | ((frac == 0.5) & ((whole & 1) == 1))
    small = (whole + up.to(tl.int32)).to(tl.float32) * 5.9604644775390625e-08  # 2**-24
    small = tl.where((ub >> 31) == 1, -small, small)
    value = tl.where(tiny, small, rounded)
  if OUT != THROUGH:
    value = tl.minimum(tl.maximum(value, -OUT_MAX), OUT_MAX)
  special = tl.where(kind == 2, float("inf"), float("nan"))  # `kind_value`
  special = tl.where(kind == 3, -float("inf"), special)[:, None, None]
  value = tl.where(flagged[:, None, None] & (code == LEVELS), special, value)

  within = p * M + j
  if ALIGNED:
    keep = in_group
    dst = out_ptr + row * GROUP_SIZE + within
  else:
    col = (row % groups) * GROUP_SIZE + within
    keep = in_group & (col < d)
    dst = out_ptr + (row // groups) * d + col
  if OUT == 1:  # bfloat16, rounded to nearest even by the bits (NaN stays quiet)
    ub = value.to(tl.uint32, bitcast=True)
    tl.store(dst, ((ub + 0x7FFF + ((ub >> 16) & 1)) >> 16).to(tl.uint16), mask=keep)
  elif OUT == 2:
    tl.store(dst, value.to(tl.float16), mask=keep)
  else:
    tl.store(dst, value, mask=keep)


def dequantize_constants(
  packed, dtype=None, *, rows: int | None = None
) -> tuple[int, tuple[int, int, int], dict]:
  """(grid, runtime sizes (group rows, groups per sample, values per sample),
  constexpr arguments) of `dequantize_kernel` for a `Packed` (or one of
  `jax.ShapeDtypeStruct` leaves) decoded to `dtype`."""
  dtype = jnp.dtype(dtype or packed.dtype)
  n, groups, _ = packed.data.shape
  d = math.prod(packed.shape[1:]) if len(packed.shape) > 1 else 1
  _, _, _, q_pad, r = packing_geometry(n, d, packed.group_size, packed.bits, rows)
  constants = dict(
    GROUP_SIZE=packed.group_size,
    BITS=packed.bits,
    ROWS=r,
    Q_PAD=q_pad,
    ALIGNED=d == groups * packed.group_size,
    THROUGH=_DTYPE_CODE.get(jnp.dtype(packed.dtype), 0),
    THROUGH_MAX=float(jnp.finfo(packed.dtype).max),
    OUT=_DTYPE_CODE.get(dtype, 0),
    OUT_MAX=float(jnp.finfo(dtype).max),
  )
  n_rows = n * groups
  return max(1, -(-n_rows // r)), (n_rows, groups, d), constants


def dequantize(
  packed: Packed,
  dtype=None,
  *,
  interpret: bool | None = None,
  rows: int | None = None,
  initial=None,
) -> jax.Array:
  """Inverse of `quantize` in one Triton pass: the contract of
  `reference.dequantize_reference` (and `pallas_triton.dequantize`).
  `interpret`, `rows` and `initial` as in `quantize`."""
  if interpret is None:
    interpret = not _jax_triton.on_gpu()
  dtype = jnp.dtype(dtype or packed.dtype)
  n, groups, _ = packed.data.shape
  check_int32(n * groups * packed.group_size, "the tensor")
  grid, sizes, constants = dequantize_constants(packed, dtype, rows=rows)
  as_bits = lambda a: jax.lax.bitcast_convert_type(a.reshape(-1), jnp.uint16)
  (out,) = _jax_triton.call(
    dequantize_kernel,
    packed.data.reshape(-1),
    as_bits(packed.minimum),
    as_bits(packed.scale),
    *sizes,
    grid=grid,
    out_shape=(jax.ShapeDtypeStruct((n * sizes[2],), _jax_triton.operand_type(dtype)),),
    name="jact_dequantize_jax_triton",
    interpret=interpret,
    initial=initial,
    **constants,
  )
  if dtype == jnp.bfloat16:
    out = jax.lax.bitcast_convert_type(out, jnp.bfloat16)
  return out.reshape(packed.view_shape or packed.shape)


def compile_dequantize_for_cuda(
  packed, dtype=None, *, rows: int | None = None, arch: int = 90
) -> str:
  """The PTX `dequantize` runs for a `Packed` like `packed` (`jax.ShapeDtypeStruct`
  leaves will do) on an sm_`arch` GPU, compiled here by the `triton` package."""
  _, _, constants = dequantize_constants(packed, dtype, rows=rows)
  out = _jax_triton.operand_type(jnp.dtype(dtype or packed.dtype))
  return _jax_triton.compile_ptx(
    dequantize_kernel,
    [jnp.uint8, jnp.uint16, jnp.uint16, "i32", "i32", "i32", out],
    arch=arch,
    **constants,
  )


PTX = {"quantize": compile_for_cuda, "dequantize": compile_dequantize_for_cuda}
"""op -> the function compiling its kernel for sm_90 here (the kernel contract tests)."""
