"""The per-group packing's program layout, shared by every backend's kernels.

Which planes a group's codes are packed into (`plane_layout`) and how groups
are tiled into programs (`packing_geometry`, `rows_per_program`): plain
Python on static sizes, importing no kernel language, so the Pallas kernels
and the ones written in Triton's language (launched with jax-triton) read
the same layout from here.

>>> plane_layout(2), plane_layout(3), plane_layout(16)
((4, 1), (8, 3), (1, 2))
>>> packing_geometry(4, 300, 152, 2)  # groups, rows, bytes a group, padded plane, rows a program
(2, 8, 38, 64, 16)
"""

from __future__ import annotations

import math

__all__ = ["plane_layout", "packing_geometry", "rows_per_program", "next_pow2", "check_int32"]

TILE = 4096
"""Values a program handles by default (a power of two)."""


def next_pow2(n: int) -> int:
  """The smallest power of two >= n (1 for n <= 1)."""
  return 1 << max(0, math.ceil(math.log2(max(1, n))))


def check_int32(n: int, what: str) -> None:
  """Raises if `n` elements cannot be addressed with int32 offsets, as the kernels do."""
  if n >= 2**31:
    raise ValueError(
      f"{what} has {n} elements; the GPU kernels address with int32 offsets "
      "(< 2**31). Use implementation='xla' for tensors this large."
    )


def rows_per_program(group_size: int, rows: int | None = None) -> int:
  """Groups per program: `rows` (rounded up to a power of two) or ~`TILE` values."""
  if rows is not None:
    return next_pow2(rows)
  return max(1, TILE // next_pow2(group_size))


def plane_layout(bits: int) -> tuple[int, int]:
  """(value planes V, byte planes B) of a group in the `jact._core.packing` layout:
  a group of G values is V planes of M = G // V values packed into B planes of
  M bytes each (8 // bits and 1 for widths dividing 8, 8 and `bits` for 3, 5, 6,
  7 bits, 1 and 2 for 16 bits)."""
  if bits == 16:
    return 1, 2
  if 8 % bits:
    return 8, bits
  return 8 // bits, 1


def packing_geometry(n: int, d: int, group_size: int, bits: int, rows: int | None = None):
  """(groups per sample, group rows N * groups, bytes Q per group, values M per
  plane (`plane_layout`) padded to a power of two, groups per program) of N
  samples of d values quantized per group. For widths dividing 8, Q == M."""
  groups = -(-d // group_size)
  v, _ = plane_layout(bits)
  q = group_size * bits // 8
  q_pad = next_pow2(group_size // v)
  return groups, n * groups, q, q_pad, rows_per_program(v * q_pad, rows)
