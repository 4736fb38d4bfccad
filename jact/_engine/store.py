"""Storing one residual: `compress_residual` (the op's rounding, the active
plan's width or compressor, per-sample budgets) and its inverse
`restore_residual`. The ops reach them through `jact._engine.op.compressed_op`,
which also names the pieces, orders them and ties them to the cotangent;
the generic transform (`jact.compressed`) calls them per captured residual.
"""

from __future__ import annotations

import dataclasses
import math
import warnings

import jax
import jax.numpy as jnp

from jact import _compat
from jact._core.allocate import allocate_per_sample
from jact._core.persample import per_sample_capacity
from jact._core.quantize import SMALLEST_ROW, as_rows
from jact.compressors import BLPA, Division, Fixpoint, PerGroup, Stored
from jact._engine import context as _context
from jact._engine.derivatives import first_order_only
from jact._engine.probe import group_ranges_sq
from jact._engine.rounding import NoKey, Rounding, apply_plan_entry, site_seed
from jact._engine.sharding import pin_rows
from jact.kernels._per_sample.api import quantize_per_sample

__all__ = ["compress_residual", "restore_residual", "kept_symbolic"]


class SymbolicShapeWarning(UserWarning):
  """A residual with a symbolic dimension (`jax.export`) is kept uncompressed."""


def symbolic_batch_only(shape) -> bool:
  """Whether `shape` (with a symbolic dimension) has it on the leading (batch)
  axis alone and at least `SMALLEST_ROW` values per sample: the per-group
  quantizer's layout is then per sample (groups never span two samples), so
  the program stores exactly what a concrete batch stores."""
  shape = tuple(shape)
  return (
    len(shape) >= 2 and _compat.is_static_shape(shape[1:]) and math.prod(shape[1:]) >= SMALLEST_ROW
  )


# Compressors whose layout is per sample (or reduces over the batch), so a symbolic batch
# traces to what a concrete one stores; ZeroValue's top-k capacity spans the whole tensor.
BATCH_POLYMORPHIC = (PerGroup, Division, BLPA, Fixpoint)


def kept_symbolic(x, compressor=None, budget=None) -> bool:
  """Whether `x` has a symbolic dimension (traced for `jax.export` with
  `jax.export.symbolic_shape("b, ...")`) that its layout cannot be computed
  for: such a residual is kept exact, the safe layout (its gradient is plain
  JAX's), with a warning. A symbolic batch alone (`symbolic_batch_only`) is
  compressed as a concrete batch is, unless the compressor's layout spans
  samples (not in `BATCH_POLYMORPHIC`) or a plan gives a per-sample budget."""
  shape = jnp.shape(x)
  if _compat.is_static_shape(shape):
    return False
  if symbolic_batch_only(shape):
    if budget is None and (compressor is None or isinstance(compressor, BATCH_POLYMORPHIC)):
      return False
    why = f"its layout ({compressor!r}{', a per-sample budget' if budget else ''}) spans samples"
  else:
    why = (
      f"a symbolic dimension other than the batch, or fewer than {SMALLEST_ROW} values per sample"
    )
  warnings.warn(
    f"jact: a residual has symbolic shape {shape} (jax.export): {why}, so it is kept "
    "uncompressed: its gradient is plain JAX's and it saves no activation memory. Export "
    "with only the leading (batch) axis symbolic and a per-sample compressor, or with "
    "concrete sizes, to store it compressed.",
    SymbolicShapeWarning,
    stacklevel=2,
  )
  return True


def compress_residual(x: jax.Array, seed, site: int, rounding: Rounding, name: str | None = None):
  """Quantizes a float residual (or returns it unchanged when bits is None).

  `name` (the residual's name) lets the active bit plan change the width
  (`jact.use_plan`) and estimators find and re-seed the residual.

  `rounding.bits` may be a compressor (`jact.compressors`); a plan's integer
  entry changes its width, a compressor entry replaces it. The per-group
  quantizer quantizes a 1-D tensor, or samples of fewer than 8 values, as a
  single row (see `jact._core.quantize.as_rows`). A residual whose shape has
  a symbolic dimension (`jax.export` with a symbolic batch) is kept exact.
  """
  if kept_symbolic(x):
    return x
  budget = None
  if name is not None and rounding.bits is not None:
    bits = apply_plan_entry(rounding.bits, _context.planned_bits(name, rounding.bits))
    if bits != rounding.bits:
      rounding = dataclasses.replace(rounding, bits=bits)
    _context.record(name, x, rounding.bits)
    if bits is not None:
      budget = _context.planned_budget(name)
  compressor = rounding.compressor
  if compressor is None or kept_symbolic(x, compressor, budget):
    return x
  x = pin_rows(first_order_only(x, name, compressor))  # quantized where its rows are
  if budget is not None:
    if not isinstance(compressor, PerGroup):
      raise ValueError(
        f"the plan gives residual {name!r} a per-sample budget, which only the per-group "
        f"quantizer supports, but its compressor is {compressor!r}; drop the budget or "
        "give the residual an integer width."
      )
    rows = as_rows(tuple(x.shape), compressor.group_size)
    return _compress_per_sample(x.reshape(rows), site_seed(seed, site, name), rounding, budget)
  if not compressor.needs_key:
    return compressor.compress(x, None)
  if isinstance(seed, NoKey):
    raise ValueError(
      f"residual {name!r} is to be stored with {compressor!r}, which rounds stochastically "
      "and needs a PRNG key, but its op was called without one (its call site asked for "
      f"{rounding.bits if rounding.compressor is None else 'a deterministic method'}): pass "
      "key=jax.random.key(...) to the op (a Flax layer: an RNG stream named 'jact'), or "
      "give the residual a deterministic compressor in the plan."
    )
  return compressor.compress(x, site_seed(seed, site, name))


def _compress_per_sample(x, seed, rounding: Rounding, avg_bits: float):
  """ActNN L3 per-sample widths: samples with larger group ranges (per-sample
  sensitivity ||R_n||^2, the gradient factor being a per-layer moving average)
  get more bits; the widths are chosen here, inside the step, and the codes
  packed into a buffer sized for `avg_bits` on average."""
  ranges_sq, _, _ = group_ranges_sq(x, rounding.group_size)
  widths = allocate_per_sample(ranges_sq, avg_bits)
  capacity = per_sample_capacity(x.shape, avg_bits, rounding.group_size)
  return quantize_per_sample(
    x,
    widths,
    capacity_bytes=capacity,
    group_size=rounding.group_size,
    stochastic=rounding.stochastic,
    seed=seed,
  )


def restore_residual(r, shape=None, dtype=None):
  """Inverse of `compress_residual`: a `Stored` form's `decompress(dtype)` (a
  value kept exact: cast to `dtype`), reshaped to `shape` (a reconstruction's
  rows sharded as `jact.sharded_batch` says, when a block is active)."""
  stored = isinstance(r, Stored)
  if stored:
    r = r.decompress(dtype)
  elif dtype is not None:
    r = r.astype(dtype)
  r = r if shape is None else r.reshape(shape)
  return pin_rows(r) if stored else r  # a kept value (a kernel) keeps its own layout
