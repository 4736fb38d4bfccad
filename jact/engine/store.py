"""The engine shared by the compressed ops.

`vjp_with_compressed_inputs(fn, *args, compress=...)` evaluates `fn(*args)` exactly and
keeps, for the backward pass, a quantized copy of each argument marked in
`compress` (the others are kept as they are: weights are alive anyway). The
backward starts with an optimization barrier that ties the residuals to the
incoming cotangent -- without it XLA hoists every dequantization into the
forward pass and the compiled step uses more memory than plain training --
and then runs the exact VJP of `fn` at the reconstructed arguments. For a
function that is linear in each compressed argument (matmul, convolution)
the resulting gradients are unbiased.

Every residual piece is tagged with `jax.ad_checkpoint.checkpoint_name`, so
`jax.checkpoint` policies such as `save_only_these_names` can select it.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from jact import _compat
from jact.core.allocate import allocate_per_sample
from jact.core.persample import PackedPerSample, per_sample_capacity
from jact.core.quantize import Packed, as_rows
from jact.compressors import Compressed, PerGroup
from jact.engine import context as _context
from jact.engine.derivatives import first_order_only, reverse_only
from jact.engine.names import tag
from jact.engine.probe import group_ranges_sq
from jact.engine.rounding import NoKey, Rounding, apply_plan_entry, site_seed
from jact.engine.scheduling import barrier, finish_forward, kept_until_cotangent
from jact.engine.sharding import pin_rows
from jact.kernels.per_sample.api import dequantize_per_sample, quantize_per_sample
from jact.kernels.quantize.api import dequantize

__all__ = ["compress_residual", "restore_residual", "vjp_with_compressed_inputs", "same_varying_axes"]


class SymbolicShapeWarning(UserWarning):
  """A residual with a symbolic dimension (`jax.export`) is kept uncompressed."""


def kept_symbolic(x) -> bool:
  """Whether `x` has a symbolic dimension (traced for `jax.export` with
  `jax.export.symbolic_shape("b, ...")`), which the quantizers' layouts
  (groups, padding, per-row flags) cannot be computed for: such a residual is
  kept exact, the safe layout (the gradients are plain JAX's), with a
  warning; export with a concrete batch size to store it compressed."""
  if _compat.is_static_shape(jnp.shape(x)):
    return False
  warnings.warn(
      "jact: a residual has a symbolic shape (jax.export with a symbolic dimension); it is "
      "kept uncompressed, so the exported function's gradients are plain JAX's and it saves "
      "no activation memory. Export with a concrete batch size to store residuals "
      "compressed.", SymbolicShapeWarning, stacklevel=2)
  return True


def compress_residual(x: jax.Array, seed, site: int, rounding: Rounding, name: str | None = None):
  """Quantizes a float residual (or returns it unchanged when bits is None).

  `name` (the residual's name) lets the active bit plan change the width
  (`jact.use_plan`) and estimators find and re-seed the residual.

  `rounding.bits` may be a compressor (`jact.compressors`); a plan's integer
  entry changes its width, a compressor entry replaces it. The per-group
  quantizer quantizes a 1-D tensor, or samples of fewer than 8 values, as a
  single row (see `jact.core.quantize.as_rows`). A residual whose shape has
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
  if compressor is None:
    return x
  x = pin_rows(first_order_only(x, name, compressor))  # quantized where its rows are
  if budget is not None:
    if not isinstance(compressor, PerGroup):
      raise ValueError(
          f"the plan gives residual {name!r} a per-sample budget, which only the per-group "
          f"quantizer supports, but its compressor is {compressor!r}; drop the budget or "
          "give the residual an integer width.")
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
        "give the residual a deterministic compressor in the plan.")
  return compressor.compress(x, site_seed(seed, site, name))


def _compress_per_sample(x, seed, rounding: Rounding, avg_bits: float):
  """ActNN L3 per-sample widths: samples with larger group ranges (per-sample
  sensitivity ||R_n||^2, the gradient factor being a per-layer moving average)
  get more bits; the widths are chosen here, inside the step, and the codes
  packed into a buffer sized for `avg_bits` on average."""
  ranges_sq, _, _ = group_ranges_sq(x, rounding.group_size)
  widths = allocate_per_sample(ranges_sq, avg_bits)
  capacity = per_sample_capacity(x.shape, avg_bits, rounding.group_size)
  return quantize_per_sample(x, widths, capacity_bytes=capacity,
                                       group_size=rounding.group_size,
                                       stochastic=rounding.stochastic, seed=seed)


def restore_residual(r, shape=None, dtype=None):
  """Inverse of `compress_residual`: the reconstruction, reshaped to `shape`
  (a reconstruction's rows sharded as `jact.sharded_batch` says, when a block
  is active)."""
  stored = isinstance(r, (PackedPerSample, Packed, Compressed))
  if isinstance(r, PackedPerSample):
    r = dequantize_per_sample(r, dtype)
  elif isinstance(r, Packed):
    r = dequantize(r, dtype)
  elif isinstance(r, Compressed):
    r = r.decompress(dtype)
  elif dtype is not None:
    r = r.astype(dtype)
  r = r if shape is None else r.reshape(shape)
  return pin_rows(r) if stored else r  # a kept value (a kernel) keeps its own layout


def vjp_with_compressed_inputs(fn: Callable[..., Any], *args: jax.Array, compress: Sequence[bool],
                    seed: jax.Array, rounding: Rounding, names: Sequence[str],
                    op: str = "vjp_with_compressed_inputs") -> Any:
  """Evaluates `fn(*args)` exactly, saving compressed copies of marked arguments.

  Args:
    fn: the primal function, differentiable in all of `args`.
    *args: floating-point arrays.
    compress: one flag per argument: quantize it (True) or keep it (False).
    seed: uint32 scalar seed (from `make_seed`).
    rounding: the compression settings.
    names: one residual name per argument (used for the compressed ones).
    op: the op's name, for error messages (`jact.ops.<op>`).

  Returns:
    `fn(*args)`, whose VJP uses the reconstructed arguments.
  """
  compress = tuple(bool(c) for c in compress)
  if len(compress) != len(args) or len(names) != len(args):
    raise ValueError("compress and names need one entry per argument")

  shapes = tuple(jnp.shape(a) for a in args)

  @jax.custom_vjp
  def call(seed, *args):
    return fn(*args)

  def fwd(seed, *args):
    out = fn(*args)
    residuals = tuple(
        tag(compress_residual(a, seed, i, rounding, names[i]), names[i]) if c else a
        for i, (a, c) in enumerate(zip(args, compress)))
    return finish_forward(out, residuals)

  def bwd(residuals, g):
    residuals, g = barrier(residuals, g)
    residuals = kept_until_cotangent(residuals, g)
    restored = tuple(restore_residual(r, shape) for r, shape in zip(residuals, shapes))
    _, vjp = jax.vjp(fn, *restored)
    return (None, *vjp(g))

  call.defvjp(fwd, bwd)
  return reverse_only(call, f"jact.ops.{op}")(seed, *same_varying_axes(args))


def same_varying_axes(args: Sequence[jax.Array]) -> tuple:
  """`args` cast to vary over every manual mesh axis any of them varies over.

  Inside `jax.shard_map` (with `check_vma`), a custom VJP's backward must
  return cotangents of its inputs' types: a replicated weight meeting a
  sharded activation would get a per-device (varying) gradient. Casting the
  invariant inputs first, as JAX does for its own operations, makes the
  whole call varying; the cast's transpose then sums the weight's gradient
  over the devices, exactly as for the plain operation. None entries (an
  absent bias) pass through. Outside shard_map nothing changes.
  """
  axes = _compat.union_of_varying_axes(args)
  if not axes:
    return tuple(args)
  return tuple(a if a is None else _compat.cast_varying(a, axes) for a in args)
