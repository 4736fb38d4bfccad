"""DIVISION compression written in Triton's language, launched with jax-triton.

The contract and bits of `reference.division_compress_reference` (registered
as the "jax_triton" implementation of "division_compress"), without Pallas'
Triton backend, in two launches:

* `pool_kernel`: each program averages a tile of pooled values (the LFC, in
  the order (n, od, oh, ow, c)) over their blocks in `jact._core.division.pool`'s
  fixed order, and stores them in the LFC's dtype (0 where not finite);
* `residual_kernel`: each program quantizes `rows` groups of the HFC, each
  value x - its block's stored LFC, per group as `PerGroup(bits, group_size)`
  stores a float32 tensor (`quantize_groups`: every width 1-8 and 16).

The map's extents, pooling blocks and group counts are runtime scalars: one
compiled pair of kernels serves every map of a width, group size, input dtype
and LFC dtype. An element's block is found by dividing its offset by those
sizes with multiply-and-shift constants computed on the host (`magic`), not
with division instructions.

>>> import jax, jax.numpy as jnp
>>> from jact.kernels._division.reference import division_compress_reference
>>> x = jax.random.normal(jax.random.key(0), (2, 8, 8, 16))
>>> args = dict(block=4, bits=2, group_size=256, lfc_dtype=jnp.bfloat16)
>>> lfc, hfc = division_compress(x, jnp.uint32(3), interpret=True, **args)
>>> ref_lfc, ref_hfc = division_compress_reference(x, jnp.uint32(3), **args)
>>> lfc.shape, bool((lfc == ref_lfc).all() & (hfc.data == ref_hfc.data).all())
((2, 2, 2, 16), True)
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import triton
import triton.language as tl

from jact._core.packing import check_bits
from jact._core.quantize import Packed, as_rows, check_group_size, effective_group_size
from jact.kernels import _jax_triton
from jact.kernels._division.reference import division_compress_reference
from jact.kernels._quantize.layout import check_int32, next_pow2, packing_geometry
from jact.kernels._triton_groups import group_statistics, group_tile, store_groups
from jact.kernels._triton_rng import uniform

__all__ = [
  "division_compress",
  "pool_kernel",
  "residual_kernel",
  "quantize_groups",
  "map_sizes",
  "magic",
  "compile_for_cuda",
  "PTX",
]

_LFC_TILE = 1024  # pooled values per program by default (a power of two)
_BF16_MAX = float(jnp.finfo(jnp.bfloat16).max)


@triton.jit
def _load_float(ptr, offset, mask, BF16: tl.constexpr):
  """float32 values at `offset` (0.0 where not `mask`); bfloat16 arrays come as uint16 bits."""
  if BF16:
    raw = tl.load(ptr + offset, mask=mask, other=0).to(tl.uint32)
    return (raw << 16).to(tl.float32, bitcast=True)
  else:
    return tl.load(ptr + offset, mask=mask, other=0.0).to(tl.float32)


def magic(d: int) -> tuple[int, int]:
  """(m, shift) with x // d == (x * m) >> shift for every int 0 <= x < 2**31 and
  0 < d < 2**31 (the product in 64 bits; m < 2**32, passed as the int32 of its bits):
  how a kernel divides by a size known only at run time without a division
  instruction (a compiler does the same for a divisor it knows).

  With l = ceil(log2(d)) and m = ceil(2**(31 + l) / d), m * d = 2**(31 + l) + e with
  0 <= e < d, so x * m / 2**(31 + l) = x / d + x * e / (d * 2**(31 + l)) < x / d + 1 / d:
  it never reaches the next integer above x / d."""
  shift = 31 + (d - 1).bit_length()
  m = -(-(1 << shift) // d)
  return (m - (1 << 32) if m >= 1 << 31 else m), shift


@triton.jit
def _divide(x, m, shift):
  """x // d for int32 0 <= x < 2**31, (m, shift) = `magic(d)`."""
  wide = x.to(tl.uint32, bitcast=True).to(tl.uint64) * m.to(tl.uint32, bitcast=True).to(tl.uint64)
  return (wide >> shift.to(tl.uint64)).to(tl.int32)


@triton.jit
def pool_kernel(
  x_ptr,
  n_pooled,
  depth,
  height,
  width,
  channels,
  pooled_d,
  pooled_h,
  pooled_w,
  block_d,
  block_h,
  block_w,
  m_channels,
  s_channels,
  m_pooled_w,
  s_pooled_w,
  m_pooled_h,
  s_pooled_h,
  m_pooled_d,
  s_pooled_d,
  lfc_ptr,
  TILE: tl.constexpr,
  IN_BF16: tl.constexpr,
  LFC: tl.constexpr,
):
  """The stored LFC (`jact._core.division.stored_lfc`) of pooled values
  pid * TILE ...: LFC 0 float32, 1 bfloat16 (stored as its bits), 2 float16."""
  t = tl.program_id(0) * TILE + tl.arange(0, TILE)
  valid = t < n_pooled
  r = _divide(t, m_channels, s_channels)  # (n, od, oh, ow, c) of t, dividing by `magic`
  c = t - r * channels
  q = _divide(r, m_pooled_w, s_pooled_w)
  zw0 = (r - q * pooled_w) * block_w
  r = _divide(q, m_pooled_h, s_pooled_h)
  zh0 = (q - r * pooled_h) * block_h
  n = _divide(r, m_pooled_d, s_pooled_d)
  zd0 = (r - n * pooled_d) * block_d
  base = n * depth
  # the block's offsets in row-major order: acc = value 0, then acc + each further
  # value (0.0 past a partial block's end and for a non-finite value)
  ok = valid & (zd0 < depth) & (zh0 < height) & (zw0 < width)
  v = _load_float(x_ptr, (((base + zd0) * height + zh0) * width + zw0) * channels + c, ok, IN_BF16)
  finite = tl.abs(v) < float("inf")
  acc = tl.where(finite, v, 0.0)
  bad = tl.where(ok & ~finite, 1.0, 0.0)
  plane = block_h * block_w
  for o in range(1, block_d * plane):
    zd = zd0 + o // plane
    zh = zh0 + (o // block_w) % block_h
    zw = zw0 + o % block_w
    ok = valid & (zd < depth) & (zh < height) & (zw < width)
    v = _load_float(x_ptr, (((base + zd) * height + zh) * width + zw) * channels + c, ok, IN_BF16)
    finite = tl.abs(v) < float("inf")
    acc = acc + tl.where(finite, v, 0.0)
    bad = bad + tl.where(ok & ~finite, 1.0, 0.0)
  count = (tl.minimum(block_d, depth - zd0) * tl.minimum(block_h, height - zh0)) * tl.minimum(
    block_w, width - zw0
  )
  count = tl.where(valid, count, 1).to(tl.float32) - bad
  inv = tl.div_rn(tl.full(count.shape, 1.0, tl.float32), tl.maximum(count, 1.0))
  mean = acc * tl.where(count > 0.0, inv, 0.0)
  if LFC == 1:  # rounded to nearest even bfloat16 by its bits, 0 where that is not finite
    u = mean.to(tl.uint32, bitcast=True)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    u = tl.where((u & 0x7F80) == 0x7F80, 0, u)
    tl.store(lfc_ptr + t, u.to(tl.uint16), mask=valid)
  elif LFC == 2:
    h = mean.to(tl.float16)
    tl.store(lfc_ptr + t, tl.where(tl.abs(h) < float("inf"), h, 0.0).to(tl.float16), mask=valid)
  else:
    tl.store(lfc_ptr + t, tl.where(tl.abs(mean) < float("inf"), mean, 0.0), mask=valid)


@triton.jit
def quantize_groups(
  v,
  mask,
  row1,
  seed,
  n_rows,
  data_ptr,
  min_ptr,
  scale_ptr,
  GROUP_SIZE: tl.constexpr,
  BITS: tl.constexpr,
  Q_PAD: tl.constexpr,
  INV_LEVELS: tl.constexpr,
  INV_FLAGGED: tl.constexpr,
  BF16_MAX: tl.constexpr,
):
  """Quantizes float32 groups as `quantize_reference` does a float32 tensor, and
  stores their packed codes and bf16 statistics (as uint16 bits).

  v [ROWS, K, Q_PAD]: the groups `row1` [ROWS] as the packing's K value planes
  (`jact.kernels._quantize.layout.plane_layout`) of M values; `mask` marks the
  groups' own values (v is NaN elsewhere). `seed` is the uint32 seed."""
  K: tl.constexpr = 1 if BITS == 16 else (8 // BITS if 8 % BITS == 0 else 8)
  M: tl.constexpr = GROUP_SIZE // K
  LEVELS: tl.constexpr = (1 << BITS) - 1
  row = row1[:, None, None]
  p = tl.arange(0, K)[None, :, None]
  within = p * M + tl.arange(0, Q_PAD)[None, None, :]

  # group statistics (`jact._core.quantize.group_codes`)
  finite, hi, finite_levels, minimum, s, _, stored, inv_step = group_statistics(
    v, mask, LEVELS, INV_LEVELS, INV_FLAGGED, BF16_MAX
  )

  # codes, stochastically rounded (the noise of each value's index in the groups)
  mn, hi3 = minimum[:, None, None], hi[:, None, None]
  clipped = tl.where(v != v, mn, tl.minimum(tl.maximum(v, mn), hi3))
  scaled = (clipped * s[:, None, None] - mn * s[:, None, None]) * inv_step[:, None, None]
  noise = uniform(seed, row.to(tl.uint32) * GROUP_SIZE + within.to(tl.uint32))
  code = tl.minimum(tl.maximum(tl.floor(scaled + noise), 0.0), finite_levels[:, None, None])
  code = tl.where(mask & ~finite, LEVELS, code.to(tl.int32))

  # packed plane by plane into bytes (`jact._core.packing`), then the statistics
  store_groups(
    code, minimum, stored, row1, n_rows, data_ptr, min_ptr, scale_ptr, GROUP_SIZE, BITS, Q_PAD
  )


@triton.jit
def residual_kernel(
  x_ptr,
  lfc_ptr,
  seed_ptr,
  n_rows,
  groups,
  d,
  depth,
  height,
  width,
  channels,
  pooled_d,
  pooled_h,
  pooled_w,
  block_d,
  block_h,
  block_w,
  m_channels,
  s_channels,
  m_width,
  s_width,
  m_height,
  s_height,
  m_depth,
  s_depth,
  m_block_d,
  s_block_d,
  m_block_h,
  s_block_h,
  m_block_w,
  s_block_w,
  data_ptr,
  min_ptr,
  scale_ptr,
  GROUP_SIZE: tl.constexpr,
  BITS: tl.constexpr,
  ROWS: tl.constexpr,
  Q_PAD: tl.constexpr,
  ALIGNED: tl.constexpr,
  IN_BF16: tl.constexpr,
  LFC_BF16: tl.constexpr,
  INV_LEVELS: tl.constexpr,
  INV_FLAGGED: tl.constexpr,
  BF16_MAX: tl.constexpr,
):
  """The packed HFC of group rows pid * ROWS ... of the (rows, d) view of x."""
  row1, _, mask, offset = group_tile(n_rows, groups, d, GROUP_SIZE, BITS, ROWS, Q_PAD, ALIGNED)
  v = _load_float(x_ptr, offset, mask, IN_BF16)
  # the LFC value of the block holding each element (x's flat offset -> (n, z_d, z_h, z_w, c))
  # (dividing by `magic`: no division instruction)
  r = _divide(offset, m_channels, s_channels)
  c = offset - r * channels
  q = _divide(r, m_width, s_width)
  ow = _divide(r - q * width, m_block_w, s_block_w)
  r = _divide(q, m_height, s_height)
  oh = _divide(q - r * height, m_block_h, s_block_h)
  n = _divide(r, m_depth, s_depth)
  od = _divide(r - n * depth, m_block_d, s_block_d)
  up = _load_float(
    lfc_ptr, (((n * pooled_d + od) * pooled_h + oh) * pooled_w + ow) * channels + c, mask, LFC_BF16
  )
  v = tl.where(mask, v - up, float("nan"))
  quantize_groups(
    v,
    mask,
    row1,
    tl.load(seed_ptr),
    n_rows,
    data_ptr,
    min_ptr,
    scale_ptr,
    GROUP_SIZE,
    BITS,
    Q_PAD,
    INV_LEVELS,
    INV_FLAGGED,
    BF16_MAX,
  )


def map_sizes(shape: tuple[int, ...], block: int) -> tuple[int, ...]:
  """(depth, height, width, channels, pooled depth, height, width, block depth,
  height, width) of a channels-last map of rank 3 to 5 (absent spatial axes: 1)."""
  spatial = tuple(shape[1:-1])
  dims = {1: (1, *spatial, 1), 2: (1, *spatial), 3: spatial}[len(spatial)]
  blocks = tuple(max(1, min(block, s)) for s in dims)
  pooled = tuple(-(-s // b) for s, b in zip(dims, blocks))
  return (*dims, shape[-1], *pooled, *blocks)


def _magics(sizes, which) -> tuple[int, ...]:
  """`magic` (m, shift) of sizes[i] for each i in `which`, flattened."""
  return tuple(v for i in which for v in magic(sizes[i]))


def _lfc_type(dtype) -> int:
  return {jnp.dtype(jnp.bfloat16): 1, jnp.dtype(jnp.float16): 2}.get(jnp.dtype(dtype), 0)


def _plan(shape, dtype, *, block, bits, group_size, lfc_dtype, rows, tile):
  """Everything the two launches take: sizes (runtime) and constants of each, grids,
  and the HFC's layout (view, effective group size, groups, group rows, bytes a group)."""
  if not 3 <= len(shape) <= 5:
    raise ValueError(
      f"division_compress takes (N, L, C), (N, H, W, C) or (N, D, H, W, C) "
      f"inputs, got shape {tuple(shape)}."
    )
  check_bits(bits)
  check_group_size(group_size)
  sizes = map_sizes(shape, block)
  n_pooled = shape[0] * math.prod(sizes[4:7]) * shape[-1]
  view = as_rows(tuple(shape), group_size)
  n_view, d = view[0], math.prod(view[1:])
  g = effective_group_size(d, group_size)
  groups, n_rows, q, q_pad, r = packing_geometry(n_view, d, g, bits, rows)
  levels = np.float32((1 << bits) - 1)
  t = next_pow2(tile) if tile is not None else _LFC_TILE  # not the map's: one compile serves all
  pool = dict(TILE=t, IN_BF16=jnp.dtype(dtype) == jnp.bfloat16, LFC=_lfc_type(lfc_dtype))
  residual = dict(
    GROUP_SIZE=g,
    BITS=bits,
    ROWS=r,
    Q_PAD=q_pad,
    ALIGNED=d % g == 0,
    IN_BF16=jnp.dtype(dtype) == jnp.bfloat16,
    LFC_BF16=_lfc_type(lfc_dtype) == 1,
    INV_LEVELS=float(np.float32(1.0) / levels),
    INV_FLAGGED=float(np.float32(1.0) / max(levels - np.float32(1.0), np.float32(1.0))),
    BF16_MAX=_BF16_MAX,
  )
  return dict(
    pool_sizes=(n_pooled, *sizes, *_magics(sizes, (3, 6, 5, 4))),
    pool=pool,
    pool_grid=max(1, -(-n_pooled // t)),
    residual_sizes=(n_rows, groups, d, *sizes, *_magics(sizes, (3, 2, 1, 0, 7, 8, 9))),
    residual=residual,
    residual_grid=max(1, -(-n_rows // r)),
    view=view,
    group_size=g,
    groups=groups,
    n_rows=n_rows,
    q=q,
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
  tile: int | None = None,
) -> tuple[jax.Array, Packed]:
  """(LFC, packed HFC) of x (rank 3 to 5), bit-exact with the XLA reference
  (same contract as `reference.division_compress_reference`).

  `interpret` defaults to True off GPU (Triton's interpreter, slow); `rows`
  (groups a program) and `tile` (pooled values a program) bound the grids in
  tests."""
  if interpret is None:
    interpret = not _jax_triton.on_gpu()
  shape = tuple(x.shape)
  lfc_dtype = jnp.dtype(lfc_dtype)
  if x.size == 0:  # nothing to run a program on
    return division_compress_reference(
      x, seed, block=block, bits=bits, group_size=group_size, lfc_dtype=lfc_dtype
    )
  check_int32(x.size, "the input")
  plan = _plan(
    shape,
    x.dtype,
    block=block,
    bits=bits,
    group_size=group_size,
    lfc_dtype=lfc_dtype,
    rows=rows,
    tile=tile,
  )
  flat = _jax_triton.flat_operand(x)
  n_pooled = plan["pool_sizes"][0]
  (lfc,) = _jax_triton.call(
    pool_kernel,
    flat,
    *plan["pool_sizes"],
    grid=plan["pool_grid"],
    out_shape=(jax.ShapeDtypeStruct((n_pooled,), _jax_triton.operand_type(lfc_dtype)),),
    name="jact_division_pool_jax_triton",
    interpret=interpret,
    **plan["pool"],
  )
  n_rows, q = plan["n_rows"], plan["q"]
  data, minimum, scale = _jax_triton.call(
    residual_kernel,
    flat,
    lfc,
    jnp.asarray(seed, jnp.uint32).reshape(1),
    *plan["residual_sizes"],
    grid=plan["residual_grid"],
    out_shape=(
      jax.ShapeDtypeStruct((n_rows * q,), jnp.uint8),
      jax.ShapeDtypeStruct((n_rows,), jnp.uint16),
      jax.ShapeDtypeStruct((n_rows,), jnp.uint16),
    ),
    name="jact_division_residual_jax_triton",
    interpret=interpret,
    **plan["residual"],
  )
  if lfc_dtype == jnp.bfloat16:
    lfc = jax.lax.bitcast_convert_type(lfc, jnp.bfloat16)
  view, groups = plan["view"], plan["groups"]
  as_bf16 = lambda b: jax.lax.bitcast_convert_type(b, jnp.bfloat16).reshape(view[0], groups)
  packed = Packed(
    data.reshape(view[0], groups, q),
    as_bf16(minimum),
    as_bf16(scale),
    view,
    jnp.dtype(jnp.float32),
    bits,
    plan["group_size"],
    shape if view != shape else None,
  )
  pooled = tuple(-(-s // min(block, s)) for s in shape[1:-1])
  return lfc.reshape(shape[0], *pooled, shape[-1]), packed


def compile_for_cuda(
  x: jax.ShapeDtypeStruct,
  seed,
  *,
  block: int,
  bits: int,
  group_size: int,
  lfc_dtype: Any,
  rows: int | None = None,
  tile: int | None = None,
  arch: int = 90,
) -> str:
  """The PTX of both kernels `division_compress` runs for an input like `x` on an
  sm_`arch` GPU (the pooling kernel's, then the residual kernel's), compiled here
  by the `triton` package (any host; `seed` is unused: one uint32 in the kernel)."""
  del seed
  plan = _plan(
    tuple(x.shape),
    x.dtype,
    block=block,
    bits=bits,
    group_size=group_size,
    lfc_dtype=lfc_dtype,
    rows=rows,
    tile=tile,
  )
  x_type, lfc_type = _jax_triton.operand_type(x.dtype), _jax_triton.operand_type(lfc_dtype)
  pool = _jax_triton.compile_ptx(
    pool_kernel, [x_type, *["i32"] * 19, lfc_type], arch=arch, **plan["pool"]
  )
  residual = _jax_triton.compile_ptx(
    residual_kernel,
    [x_type, lfc_type, jnp.uint32, *["i32"] * 27, jnp.uint8, jnp.uint16, jnp.uint16],
    arch=arch,
    **plan["residual"],
  )
  return pool + residual


PTX = {"division_compress": compile_for_cuda}
"""op -> the function compiling its kernels for sm_90 here (the kernel contract tests)."""
