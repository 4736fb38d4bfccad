"""The host-side model `jact.fit` searches with: residuals, their stored bytes, the predicted
gradient variance of a configuration and its bit allocation under a byte target.

Pure Python over small tables: no tracing, no compiling. A configuration is a
`Layout` (which segments are rematerialized) plus a width per residual; its
predicted peak is `base[layout] + stored bytes`, the base calibrated from
compiled steps (`search`), and its predicted variance is
`sum_l c_l S(b_l)` (ActNN's model, the sensitivities `c_l` estimated by
`jact.sensitivity`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

from jact._core.allocate import UNCOMPRESSED, greedy_allocate, variance_factor
from jact._fit.segments import Layout

__all__ = ["Residual", "Candidate", "TRANSIENT_BITS", "stored_bytes", "allocate", "layouts"]

GROUP_SIZE = 256
_STATS_BYTES = 4  # bf16 minimum + bf16 step per group


@dataclasses.dataclass(frozen=True)
class Residual:
  """One residual fit can give a width.

  Attributes:
    name: its residual name.
    size: number of values.
    itemsize: bytes per value when kept uncompressed.
    segment: the segment it belongs to, or None (outside every segment).
    remat_input: a rematerialized segment's compressed input (never kept
      uncompressed: that would be plain `jax.checkpoint`).
    sensitivity: c_l, its share of the gradient's variance per S(b).
  """

  name: str
  size: int
  itemsize: int
  segment: str | None
  remat_input: bool
  sensitivity: float


def stored_bytes(r: Residual, bits: int | None) -> int:
  """Bytes a residual occupies at `bits` (None: uncompressed): codes plus group statistics."""
  if bits is None:
    return r.size * r.itemsize
  return math.ceil(r.size * bits / 8) + _STATS_BYTES * math.ceil(r.size / GROUP_SIZE)


@dataclasses.dataclass(frozen=True)
class Candidate:
  """A configuration and what the model predicts for it."""

  layout: Layout
  widths: tuple[tuple[str, int | None], ...]  # allocated residuals, in table order
  transient: tuple[str, ...]  # residuals of rematerialized segments' recomputation
  stored: int
  variance: float
  recompute: int  # values of the rematerialized segments' residuals (recomputed work)

  def describe(self) -> str:
    remat = ", ".join(sorted(self.layout.remat)) or "none"
    counts: dict[str, int] = {}
    for _, b in self.widths:
      counts[str(b or "exact")] = counts.get(str(b or "exact"), 0) + 1
    widths = " ".join(f"{k}:{v}" for k, v in sorted(counts.items()))
    return f"remat [{remat}]; widths {widths}"


def in_layout(table: Sequence[Residual], layout: Layout) -> list[Residual]:
  """The residuals a layout stores: remat inputs of its rematerialized segments, the
  others' own residuals and everything outside segments."""
  keep = []
  for r in table:
    remat = r.segment in layout.remat
    if r.segment is None or remat == r.remat_input:
      keep.append(r)
  return keep


TRANSIENT_BITS = 8


def transient(table: Sequence[Residual], inner: dict[str, list[str]], layout: Layout):
  """Residual names recorded inside rematerialized segments' recomputation: alive only in
  the segment's own backward pass, stored at `TRANSIENT_BITS`."""
  return tuple(sorted(n for s in layout.remat for n in inner.get(s, ())))


def allocate(
  table: Sequence[Residual],
  inner: dict[str, list[str]],
  layout: Layout,
  target_bytes: float,
  widths: Sequence[int | None],
) -> Candidate | None:
  """The least-variance widths whose stored bytes are <= `target_bytes`, or None.

  ActNN's greedy (`jact.allocate.greedy_allocate`) over the layout's residuals,
  its bit budget the target less the group statistics (uncompressed values
  cost 32 bits there: conservative for 16-bit residuals); the result is checked
  against the exact byte model and the bit budget lowered until it holds.
  """
  rs = in_layout(table, layout)
  allowed = tuple(sorted(UNCOMPRESSED if w is None else w for w in widths))
  recompute = sum(r.size for r in table if r.segment in layout.remat and not r.remat_input)
  passing = transient(table, inner, layout)
  # A recomputed segment's residuals are its compressed residuals' tensors (same VJP
  # positions): their sensitivities, at TRANSIENT_BITS.
  passing_variance = variance_factor(TRANSIENT_BITS) * sum(
    r.sensitivity for r in table if r.segment in layout.remat and not r.remat_input
  )
  if not rs:
    return (
      Candidate(layout, (), passing, 0, passing_variance, recompute) if target_bytes >= 0 else None
    )
  lowest = min(w for w in allowed)
  floor = sum(stored_bytes(r, lowest) for r in rs)
  if floor > target_bytes:
    return None
  overhead = sum(_STATS_BYTES * math.ceil(r.size / GROUP_SIZE) for r in rs)
  budget_bits = int(8 * (min(target_bytes, 2**62) - overhead))
  for _ in range(8):
    budget_bits = max(budget_bits, lowest * sum(r.size for r in rs))
    bits = greedy_allocate(
      [max(r.sensitivity, 0.0) for r in rs], [r.size for r in rs], budget_bits, allowed
    )
    chosen = [
      (None if b == UNCOMPRESSED and not r.remat_input else min(b, 8)) for r, b in zip(rs, bits)
    ]
    stored = sum(stored_bytes(r, b) for r, b in zip(rs, chosen))
    if stored <= target_bytes:
      variance = sum(
        r.sensitivity * variance_factor(UNCOMPRESSED if b is None else b)
        for r, b in zip(rs, chosen)
      )
      named = tuple((r.name, b) for r, b in zip(rs, chosen))
      return Candidate(
        layout, named, passing, stored, float(variance + passing_variance), recompute
      )
    budget_bits -= int(8 * (stored - target_bytes)) + 8
  return None


def layouts(order: Sequence[str]) -> list[Layout]:
  """The layouts searched: the first k segments of `order` rematerialized, k = 0..n."""
  return [Layout(frozenset(order[:k])) for k in range(len(order) + 1)]
