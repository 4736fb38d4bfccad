"""Storing one residual: `compress_residual` (`compressor.compress(x, seed)`
with the call site's compressor as the active plan changes it) and its
inverse `restore_residual` (`stored.decompress(dtype)`). The ops reach them
through `jact._engine.op.compressed_op`, which also names the pieces, orders
them and ties them to the cotangent; the generic transform (`jact.compressed`)
calls them per captured residual.
"""

from __future__ import annotations

import math
import warnings

import jax
import jax.numpy as jnp

from jact import _compat
from jact._core.quantize import SMALLEST_ROW
from jact.compressors import BLPA, Compressor, Division, Fixpoint, PerGroup, Stored
from jact._engine import context as _context
from jact._engine.derivatives import first_order_only
from jact._engine.rounding import NoKey, apply_plan_entry, site_seed, site_width
from jact._engine.sharding import pin_rows

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
# traces to what a concrete one stores; ZeroValue's top-k capacity spans the whole tensor,
# PerSample's budget the whole batch.
BATCH_POLYMORPHIC = (PerGroup, Division, BLPA, Fixpoint)


def kept_symbolic(x, compressor=None) -> bool:
  """Whether `x` has a symbolic dimension (traced for `jax.export` with
  `jax.export.symbolic_shape("b, ...")`) that its layout cannot be computed
  for: such a residual is kept exact, the safe layout (its gradient is plain
  JAX's), with a warning. A symbolic batch alone (`symbolic_batch_only`) is
  compressed as a concrete batch is, unless the compressor's layout spans
  samples (not in `BATCH_POLYMORPHIC`: ZeroValue, a plan's per-sample budget)."""
  shape = jnp.shape(x)
  if _compat.is_static_shape(shape):
    return False
  if symbolic_batch_only(shape):
    if compressor is None or isinstance(compressor, BATCH_POLYMORPHIC):
      return False
    why = f"its layout ({compressor!r}) spans samples"
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


def compress_residual(
  x: jax.Array, seed, site: int, compressor: Compressor | None, name: str | None = None
):
  """`compressor.compress(x, seed)` for one float residual (x itself when the
  compressor is None), after the active plan had its say.

  `name` (the residual's name) lets the active bit plan change the call
  site's compressor (`jact.use_plan`: an integer entry is
  `compressor.with_bits(n)`, a compressor entry replaces it, a per-sample
  budget is `compressor.with_budget(avg_bits)`) and estimators find and
  re-seed the residual. A residual whose shape has a symbolic dimension
  (`jax.export` with a symbolic batch) is kept exact when its layout cannot be
  computed (`kept_symbolic`).
  """
  if kept_symbolic(x):
    return x
  call = compressor
  if name is not None and compressor is not None:
    compressor = apply_plan_entry(compressor, _context.planned_bits(name, compressor))
    _context.record(name, x, site_width(compressor))
    budget = None if compressor is None else _context.planned_budget(name)
    if budget is not None:
      try:
        compressor = compressor.with_budget(budget)
      except ValueError as e:
        raise ValueError(f"the plan gives residual {name!r} a per-sample budget: {e}") from None
  if compressor is None or kept_symbolic(x, compressor):
    return x
  x = pin_rows(first_order_only(x, name, compressor))  # quantized where its rows are
  if not compressor.needs_key:
    return compressor.compress(x, None)
  if isinstance(seed, NoKey):
    raise ValueError(
      f"residual {name!r} is to be stored with {compressor!r}, which rounds stochastically "
      f"and needs a PRNG key, but its op was called without one (its call site asked for "
      f"{call!r}): pass key=jax.random.key(...) to the op (a Flax layer: an RNG stream "
      "named 'jact'), or give the residual a deterministic compressor in the plan."
    )
  return compressor.compress(x, site_seed(seed, site, name))


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
