"""Per-group quantization in Triton's language, for the kernels launched with
jax-triton.

`group_tile` lays a program's groups out as a [ROWS, K, Q_PAD] tile;
`group_statistics(v, mask, ...)` is the statistics half of
`jact._core.quantize.group_codes` for a [ROWS, K, Q_PAD] tile of groups (the
quantize, DIVISION and per-sample kernels call it, so their groups get the
same bits); `store_groups` packs the tile's codes into the packing's byte
planes and stores the statistics (quantize and DIVISION). Every float
operation is one IEEE operation rounded to nearest (the callers compile
without contraction); the kernels' contract tests
(tests/kernels/test_kernel_contract.py) check the results against the
reference through those kernels.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["group_tile", "group_statistics", "store_groups"]


@triton.jit
def group_tile(
  n_rows,
  groups,
  d,
  GROUP_SIZE: tl.constexpr,
  BITS: tl.constexpr,
  ROWS: tl.constexpr,
  Q_PAD: tl.constexpr,
  ALIGNED: tl.constexpr,
):
  """The [ROWS, K, Q_PAD] tile of this program's group rows of an (n, d) input
  (`n_rows` = n * `groups` groups of GROUP_SIZE, the last of a sample partial
  unless ALIGNED, d % GROUP_SIZE == 0): its K value planes of M values
  (`jact.kernels._quantize.layout.plane_layout`). Returns (row1 [ROWS] the group
  rows, within each value's position in its group, mask its own values, offset
  their flat offsets in the input)."""
  K: tl.constexpr = 1 if BITS == 16 else (8 // BITS if 8 % BITS == 0 else 8)
  M: tl.constexpr = GROUP_SIZE // K
  row1 = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
  row = row1[:, None, None]
  j = tl.arange(0, Q_PAD)[None, None, :]
  within = tl.arange(0, K)[None, :, None] * M + j
  if ALIGNED:  # a mask of whole planes: vector loads
    mask = (row < n_rows) & (j < M)
    offset = row * GROUP_SIZE + within
  else:
    col = (row % groups) * GROUP_SIZE + within
    mask = (row < n_rows) & (j < M) & (col < d)
    offset = (row // groups) * d + col
  return row1, within, mask, offset


@triton.jit
def group_statistics(v, mask, LEVELS, INV_LEVELS, INV_FLAGGED, BF16_MAX):
  """The statistics of the groups of v [ROWS, K, Q_PAD] (float32, NaN where not
  `mask`, a group a row).

  LEVELS is 2**bits - 1 and INV_LEVELS, INV_FLAGGED the float32 1 / LEVELS and
  1 / max(LEVELS - 1, 1): constexprs, or float32 [ROWS] where each group has
  its own width. Returns (finite [ROWS, K, Q_PAD], then per group [ROWS]: hi the
  finite maximum (0 where none), finite_levels the finite values' largest code,
  minimum rounded down to bf16, s the grid scale (1/4 for ranges >= 2**100),
  step (bf16, flagged rounded up to 4 ulps), stored its float32 bits with the
  non-finite kind and flag, inv_step 1 / (step * s) or 0)."""
  finite = (v == v) & (tl.abs(v) != float("inf"))
  lo = tl.min(tl.min(tl.where(finite, v, float("inf")), axis=2), axis=1)  # [ROWS]
  hi = tl.max(tl.max(tl.where(finite, v, -float("inf")), axis=2), axis=1)
  # the non-finite kind (`nonfinite_kind`): NaN 1, +inf 2, -inf 3, NaN for both infinities
  has_nan = tl.max(tl.max(((v != v) & mask).to(tl.int32), axis=2), axis=1) > 0
  has_pos = tl.max(tl.max((v == float("inf")).to(tl.int32), axis=2), axis=1) > 0
  has_neg = tl.max(tl.max((v == -float("inf")).to(tl.int32), axis=2), axis=1) > 0
  kind = tl.where(has_neg, 3, 0)
  kind = tl.where(has_pos, 2, kind)
  kind = tl.where(has_nan | (has_pos & has_neg), 1, kind)
  flagged = kind != 0
  finite_levels = tl.where(flagged, LEVELS - 1.0, LEVELS * 1.0)  # the top code means non-finite
  single = finite_levels == 0.0  # 1 bit, flagged: one level, the midpoint
  any_finite = lo <= hi
  lo = tl.where(any_finite & (lo != 0.0), lo, 0.0)
  hi = tl.where(any_finite & (hi != 0.0), hi, 0.0)
  lo = tl.where(single, lo * 0.5 + hi * 0.5, lo)
  u = lo.to(tl.uint32, bitcast=True)  # rounded down to bf16 (`bf16_round_directed`)
  down = ((u & 0xFFFF) != 0) & ((u >> 31) == 1)
  minimum = ((u & 0xFFFF0000) + (down.to(tl.uint32) << 16)).to(tl.float32, bitcast=True)
  minimum = tl.maximum(minimum, -BF16_MAX)
  wide = (hi - minimum) >= 1.2676506002282294e30  # 2**100: the grid scaled by 1/4
  s = tl.where(wide, 0.25, 1.0)
  inv_s = tl.where(wide, 4.0, 1.0)
  span = hi * s - minimum * s
  inv_levels = tl.where(single, 0.0, tl.where(flagged, INV_FLAGGED, INV_LEVELS))
  u = (span * inv_levels * inv_s).to(tl.uint32, bitcast=True)  # rounded up to bf16
  up = ((u & 0xFFFF) != 0) & ((u >> 31) == 0)
  step = ((u & 0xFFFF0000) + (up.to(tl.uint32) << 16)).to(tl.float32, bitcast=True)
  step = tl.minimum(step, BF16_MAX)
  # flagged groups (`flag_step`): the step rounded up to 4 bf16 ulps, kind and sign bit added
  u = step.to(tl.uint32, bitcast=True)
  rounded = (u + 0x30000) & 0xFFFCFFFF
  rounded = tl.minimum(tl.maximum(rounded, 0x00800000), 0x7F7C0000)
  stored = tl.where(flagged, rounded | (kind.to(tl.uint32) << 16) | 0x80000000, u)
  step = tl.where(flagged, rounded, u).to(tl.float32, bitcast=True)
  positive = step > 0.0
  inv_step = tl.where(
    positive,
    tl.div_rn(tl.full(step.shape, 1.0, tl.float32), tl.where(positive, step * s, 1.0)),
    0.0,
  )
  return finite, hi, finite_levels, minimum, s, step, stored, inv_step


@triton.jit
def store_groups(
  code,
  minimum,
  stored,
  row1,
  n_rows,
  data_ptr,
  min_ptr,
  scale_ptr,
  GROUP_SIZE: tl.constexpr,
  BITS: tl.constexpr,
  Q_PAD: tl.constexpr,
):
  """Stores the int32 codes [ROWS, K, Q_PAD] of the groups `row1` [ROWS] (those
  below `n_rows`) packed plane by plane into their Q bytes (`jact._core.packing`,
  the layout of `jact.kernels._quantize.layout.plane_layout`), and their
  statistics, bf16 values, as uint16 bits: `minimum` and `stored` from
  `group_statistics`."""
  K: tl.constexpr = 1 if BITS == 16 else (8 // BITS if 8 % BITS == 0 else 8)
  M: tl.constexpr = GROUP_SIZE // K
  Q: tl.constexpr = GROUP_SIZE * BITS // 8
  p = tl.arange(0, K)[None, :, None]
  row2, j2 = row1[:, None], tl.arange(0, Q_PAD)[None, :]
  out = data_ptr + row2 * Q + j2
  keep = (row2 < n_rows) & (j2 < M)
  if BITS == 16:  # the low bytes, then the high bytes
    both = tl.sum(code, axis=1)  # one plane
    tl.store(out, (both & 255).to(tl.uint8), mask=keep)
    tl.store(out + M, (both >> 8).to(tl.uint8), mask=keep)
  elif 8 % BITS == 0:
    packed = tl.sum(code << (p * BITS), axis=1)  # planes hold disjoint bits: sum == or
    tl.store(out, packed.to(tl.uint8), mask=keep)
  else:  # byte plane b: bit b of value plane i in its bit i
    for b in tl.static_range(BITS):
      packed = tl.sum(((code >> b) & 1) << p, axis=1)
      tl.store(out + b * M, packed.to(tl.uint8), mask=keep)
  # the statistics hold bf16 values: their bf16 bits are the float32's high half
  ok = row1 < n_rows
  tl.store(min_ptr + row1, (minimum.to(tl.uint32, bitcast=True) >> 16).to(tl.uint16), mask=ok)
  tl.store(scale_ptr + row1, (stored >> 16).to(tl.uint16), mask=ok)
