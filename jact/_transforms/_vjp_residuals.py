"""What `jact.compressed` keeps of a VJP's residuals, read from its jaxpr.

`plan_saved` decides, per residual variable, whether it is an input kept by
reference, a constant recomputed in the backward, a piece an inner jact op
already compressed, a mask packed to 1 bit, a float quantized, or a value
kept as it is; `store_saved` / `restore_saved` apply that decision.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from jact import _compat
from jact._core.packing import SUPPORTED_BITS, pack_codes
from jact._core.quantize import FLOAT_DTYPES
from jact.compressors import Compressor, PerGroup, Stored
from jact._engine import context as _context
from jact._engine.names import check_name, is_jact_name, tag
from jact._engine.rounding import apply_plan_entry
from jact._engine.scheduling import barrier, is_stored, materialize
from jact._engine.sharding import pin_rows
from jact._engine.store import compress_residual, kept_symbolic, restore_residual
from jact._engine.rows import fits_rows, store_rows
from jact._transforms._rows import normalization_rows


DEFAULT_MIN_SIZE = 1024
"""Floating residuals with fewer values than this are kept as they are."""


@dataclasses.dataclass(frozen=True)
class ResidualConfig:
  """Static settings of a `compressed` function.

  Attributes:
    compressor: how floating residuals are stored (a `jact.compressors`
      object, the value `jact._engine.rounding.resolve_compressor` gives), or
      None to keep them uncompressed (booleans are still bit-packed).
    min_size: floating residuals with fewer values are kept as they are.
    name: prefix of the residual names (`name.0`, `name.1`, ...).
    overrides: bit widths or compressors for particular residual names (a
      mapping, or any object with a `bits_for(name, default)` method, such as
      a plan); an integer applied to a compressor changes its width.
  """

  compressor: Compressor | None = PerGroup(4)
  min_size: int = DEFAULT_MIN_SIZE
  name: str = "compressed"
  overrides: Any = None

  def __post_init__(self):
    if self.compressor is not None and not isinstance(self.compressor, Compressor):
      raise TypeError(
        f"ResidualConfig.compressor takes a jact.compressors object or None, got "
        f"{self.compressor!r}; resolve a width first (resolve_compressor(bits, None, api))."
      )
    check_name(self.name)
    if not isinstance(self.min_size, int) or self.min_size < 1:
      raise ValueError(
        f"min_size must be a positive int (values), got {self.min_size!r}: "
        f"floating residuals with fewer values are kept exact (default "
        f"min_size={DEFAULT_MIN_SIZE}; min_size=1 compresses every one)"
      )
    if self.overrides is not None and not (
      isinstance(self.overrides, Mapping) or hasattr(self.overrides, "bits_for")
    ):
      raise TypeError(
        "overrides must be a mapping from residual names to bits, or an object "
        f"with a bits_for(name, default) method; got {type(self.overrides).__name__}"
      )
    if isinstance(self.overrides, Mapping):
      for name, entry in self.overrides.items():
        check_override(name, entry)

  def compressor_for(self, name: str) -> Compressor | None:
    """The compressor of residual `name`: `compressor` as `overrides` changes it."""
    c = self.compressor
    if isinstance(self.overrides, Mapping):
      c = apply_plan_entry(c, self.overrides.get(name, c))
    elif self.overrides is not None:
      c = apply_plan_entry(c, self.overrides.bits_for(name, c))
    return c

  @property
  def needs_key(self) -> bool:
    c = self.compressor
    if c is not None and c.needs_key:
      return True
    # a name might get an integer width: the per-group quantizer's rounding
    return self.overrides is not None and (not isinstance(c, PerGroup) or c.stochastic)


def is_array(x) -> bool:
  return isinstance(x, (np.ndarray, np.generic)) or _compat.is_jax_value(x)


def check_override(name, entry) -> None:
  """A clear error unless `overrides[name] = entry` names a residual and gives
  it a width (`SUPPORTED_BITS`: 1 to 8 or 16), None (kept uncompressed) or a compressor."""
  if not isinstance(name, str):
    raise TypeError(
      f"overrides keys must be residual names (str, e.g. 'compressed.3' as "
      f"jact.residual_report lists them), got {type(name).__name__} {name!r}"
    )
  if entry is None or isinstance(entry, Compressor):
    return
  if (
    isinstance(entry, numbers.Integral) and not isinstance(entry, bool) and entry in SUPPORTED_BITS
  ):
    return
  raise ValueError(
    f"overrides[{name!r}] = {entry!r} is not a residual width: use one of {SUPPORTED_BITS}, "
    f"None to keep the residual uncompressed, or a compressor from jact.compressors "
    f"(e.g. jact.compressors.PerGroup(4))."
  )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Saved:
  """What the forward pass keeps: the stored values and, statically, how to
  rebuild the VJP object from them.

  plan: one (kind, detail) per VJP leaf (see `plan_saved`); `index` maps each
    leaf to its entry of `values` (or -1).
  shapes, dtypes: of the VJP leaves, to reconstruct them.
  capture: the closed jaxpr of the forward pass (to recompute constants).
  vjp_layout: how to rebuild the VJP object from its leaves
    (`jact._compat.vjp_residuals`).
  """

  values: tuple
  plan: tuple = dataclasses.field(metadata=dict(static=True))
  index: tuple = dataclasses.field(metadata=dict(static=True))
  shapes: tuple = dataclasses.field(metadata=dict(static=True))
  dtypes: tuple = dataclasses.field(metadata=dict(static=True))
  capture: Any = dataclasses.field(metadata=dict(static=True))
  residual_vars: tuple = dataclasses.field(metadata=dict(static=True))
  vjp_layout: Any = dataclasses.field(metadata=dict(static=True))


def is_float(x) -> bool:
  dtype = x.dtype
  return not jax.dtypes.issubdtype(dtype, jax.dtypes.extended) and jnp.issubdtype(
    dtype, jnp.floating
  )


def is_byte_float(x) -> bool:
  """A float of at most one byte a value (float8, float4 kinds): kept as it is,
  no compressed form is smaller."""
  return jnp.dtype(x.dtype).itemsize <= 1


def check_compressible(leaf, name: str) -> None:
  """A clear error for a residual of a width no compressor takes (float64):
  the fixes that apply to a value inside the wrapped function."""
  if jnp.dtype(leaf.dtype) not in FLOAT_DTYPES:
    raise TypeError(
      f"residual {name!r} is {leaf.dtype}, which jact compresses only as float32, bfloat16 or "
      f"float16: call the function on float32 values (e.g. x.astype(jnp.float32)), or keep "
      f"its residuals exact with bits=None (this one alone: overrides={{{name!r}: None}})."
    )


def store_saved(leaf, name: str, seed, site: int, config: ResidualConfig, detail=None):
  """The stored form of one residual leaf (compressed, bit-packed or kept:
  float8 and other one-byte floats are kept exact, see `is_byte_float`);
  `detail` is its plan entry's: 'mask' (a float holding only 0 and 1,
  bit-packed) or ('rows', axes) (centered and scaled per normalization row
  before it is quantized: `jact._transforms._rows`). A leaf a checkpoint
  policy offloaded (`save_and_offload_only_these_names`,
  `offload_dot_with_no_batch_dims`) is kept where it is, as it is: it no
  longer takes device memory, and compressing it would bring it back."""
  if kept_symbolic(leaf) or not _compat.on_device(leaf):
    return leaf
  if leaf.dtype == jnp.bool_ or detail == "mask":
    return tag(pack_codes(pin_rows(leaf) != 0, 1), name)
  if is_float(leaf) and at_least(leaf.shape, config.min_size) and not is_byte_float(leaf):
    compressor = config.compressor_for(name)
    if compressor is not None:
      check_compressible(leaf, name)
      compress = lambda x: compress_residual(x, seed, site, compressor, name)
      if (
        isinstance(detail, tuple)
        and detail[0] == "rows"
        and fits_rows(leaf, detail[1])
        and isinstance(compressor, PerGroup)
      ):  # rows fix the shared group grid
        return tag(store_rows(leaf, detail[1], compress), name)
      return tag(compress(leaf), name)
  return leaf


def at_least(shape, min_size: int) -> bool:
  """Whether an array of `shape` holds at least `min_size` values. With a
  symbolic batch (`jax.export`) the answer is the one for the smallest batch
  the export allows (1, or the lower bound of a constraint such as
  `symbolic_shape("b", constraints=("b >= 16",))`): the decision a concrete
  call with that batch makes. A larger concrete batch may compress a residual
  the export keeps exact, never the reverse."""
  try:
    return bool(math.prod(shape) >= min_size)
  except jax.errors.InconclusiveDimensionOperation:
    return False


def check_overrides(config: ResidualConfig, names) -> None:
  """Reports `overrides` entries naming none of this call's stored residuals
  (a warning; an error inside a `use_plan(..., strict=True)` block)."""
  overrides = config.overrides
  if not isinstance(overrides, Mapping):
    return  # an object with only `bits_for` cannot list its names
  listed = set(overrides)
  if hasattr(overrides, "bits_for"):  # a whole-model plan: only the names of this call
    listed = {n for n in listed if n.startswith(config.name + ".")}
  _context.check_traced(
    listed,
    names,
    strict=_context.strict_plan(),
    what=f"the overrides mapping of jact.compressed(name={config.name!r})",
    fix="Use the names jact.residual_report lists for this call; residuals of jact ops "
    "inside the function take their widths from a plan (jact.use_plan), not overrides.",
  )


def restore_saved(value, shape, dtype):
  """A saved leaf's value for the backward: a `Stored` form (a packed mask
  too) restored, anything else as it is."""
  if isinstance(value, Stored):
    return restore_residual(value, shape, dtype)
  return value


def jact_named(var, producers) -> bool:
  """Whether `var` is a piece an inner jact op or `compressed` call stored
  compressed: a value carrying a name in jact's reserved namespace (see
  `jact._engine.names.tag`), possibly seen through other names, optimization
  barriers and the outputs of jitted calls and scans. A user's own `checkpoint_name` never
  qualifies."""
  while var in producers:
    eqn, i = producers[var]
    name = _compat.checkpoint_name(eqn)
    if is_jact_name(name):
      return True
    nested = _compat.nested_output(eqn, i) if name is None else None
    if nested is not None:  # e.g. pieces a compressed block in a scan stacked per iteration
      body, var = nested
      producers = {v: (e, k) for e in body.eqns for k, v in enumerate(e.outvars)}
      continue
    var = eqn.invars[0] if name is not None else _compat.barrier_operand(eqn, i)
    if var is None:
      return False
  return False


def input_dependent(jaxpr) -> set:
  """The variables of `jaxpr` that depend on one of its inputs."""
  dependent = set(jaxpr.invars)
  for eqn in jaxpr.eqns:
    if any(_compat.is_var(v) and v in dependent for v in eqn.invars):
      dependent.update(eqn.outvars)
  return dependent


REDUCTION = 8  # a reduction whose output is this many times smaller than its operand


def _size(var) -> int | None:
  """Values in `var`, None for a symbolic (jax.export) shape."""
  shape = var.aval.shape
  return math.prod(shape) if _compat.is_static_shape(shape) else None


def _at_most(size, factor: int, largest) -> bool:
  """`size * factor <= largest` for sizes that may be symbolic (None): a static
  size from a symbolic operand is a reduction over the symbolic batch; a
  symbolic size is never called small."""
  if size is None:
    return False
  return largest is None or size * factor <= largest


def reduced_values(jaxpr) -> set:
  """The variables of `jaxpr` holding reduced statistics: outputs of
  reductions at least `REDUCTION` times smaller than their operand (sums,
  maxima, a norm's mean and variance; also inside jitted calls such as
  `jnp.var`), and whatever is computed from such values alone without
  growing (the reciprocal of a row sum, rsqrt(var + eps)).

  Their values can span orders of magnitude across rows (a softmax row sum
  over 1 or 4096 keys), which a group's shared uniform grid cannot hold; they
  are small, so they are kept exact."""
  reduced, scalar = set(), set()
  for eqn in jaxpr.eqns:
    ins = [v for v in eqn.invars if _compat.is_var(v) and hasattr(v.aval, "shape")]
    # Scalars and what is computed from scalars and literals alone (a divisor n - ddof,
    # a broadcast fill value) neither make nor spoil a statistic: jnp.var divides by a
    # traced scalar, jnp.maximum's derivative selects between broadcast constants.
    if not ins:
      scalar.update(o for o in eqn.outvars if hasattr(o.aval, "shape") and _size(o) is not None)
      continue
    sizes = [_size(v) for v in ins]
    largest = None if None in sizes else max(sizes)  # None: a symbolic (jax.export) batch
    body = _compat.call_body(eqn)
    inner = reduced_values(body.jaxpr) if body is not None else set()
    neutral = [v in scalar or size == 1 for v, size in zip(ins, sizes)]
    if all(neutral):  # static shapes only: a symbolic (jax.export) batch is never neutral
      scalar.update(o for o in eqn.outvars if hasattr(o.aval, "shape") and _size(o) is not None)
    from_reduced = any(v in reduced for v in ins) and all(
      v in reduced or n for v, n in zip(ins, neutral)
    )
    # never larger than its statistics (a broadcast constant may be activation-sized)
    stat_sizes = [size for v, size in zip(ins, sizes) if v in reduced]
    largest_stat = None if None in stat_sizes else max(stat_sizes, default=0)
    for k, out in enumerate(eqn.outvars):
      if not hasattr(out.aval, "shape"):
        continue
      inner_out = body.jaxpr.outvars[k] if body is not None else None
      if (
        (_compat.is_reduction(eqn) and _at_most(_size(out), REDUCTION, largest))
        or (_compat.is_var(inner_out) and inner_out in inner)  # a Literal is unhashable
        or (from_reduced and _at_most(_size(out), 1, largest_stat))
      ):
        reduced.add(out)
  return reduced


def from_mask(var, producers) -> bool:
  """Whether float `var` is a boolean converted to a float (0 or 1 exactly:
  the location indicators of a max reduction's derivative): stored as 1 bit."""
  if var not in producers:
    return False
  eqn, _ = producers[var]
  return (
    len(eqn.invars) == 1
    and len(eqn.outvars) == 1
    and _compat.is_var(eqn.invars[0])
    and eqn.invars[0].aval.dtype == jnp.bool_
    and eqn.invars[0].aval.shape == var.aval.shape
  )


def plan_saved(jaxpr, residual_vars, compress_inputs, config: ResidualConfig):
  """How each residual (an output variable of the capture jaxpr) is kept.

  Returns one tuple per residual: (kind, detail) with kind
  'input' (detail: input index, kept by reference), 'compress' (quantize or
  bit-pack; detail 'mask' for a float holding a boolean, stored as 1 bit,
  or ('rows', axes) for a value a normalization works on row by row,
  stored centered and scaled per row: `jact._transforms._rows`),
  'keep' (as it is; detail 'reduced' for reduced statistics, see
  `reduced_values`), 'same' (detail: an earlier residual) or 'constant'
  (independent of the inputs: recomputed in the backward pass).
  """
  dependent = input_dependent(jaxpr)
  producers = {v: (e, i) for e in jaxpr.eqns for i, v in enumerate(e.outvars)}
  reduced = reduced_values(jaxpr)
  rows = normalization_rows(jaxpr, reduced)
  inputs = {v: k for k, v in enumerate(jaxpr.invars)}
  plan, first = [], {}
  for position, var in enumerate(residual_vars):
    if _compat.is_literal(var) or var not in dependent:
      plan.append(("constant", None))
    elif var in first:
      plan.append(("same", first[var]))
    else:
      first[var] = position
      if var in inputs:
        plan.append(("compress" if compress_inputs[inputs[var]] else "input", inputs[var]))
      elif jact_named(var, producers):
        plan.append(("keep", None))
      elif var in reduced and is_float(var.aval):
        plan.append(("keep", "reduced"))
      elif is_float(var.aval) and from_mask(var, producers):
        plan.append(("compress", "mask"))
      elif var in rows and is_float(var.aval):
        plan.append(("compress", ("rows", rows[var])))
      else:
        plan.append(("compress", None))
  return tuple(plan)


def eval_constants(jaxpr, consts, wanted):
  """Evaluates the input-independent variables `wanted` of `jaxpr`."""
  return _compat.eval_jaxpr(_compat.prune_jaxpr(jaxpr, wanted), consts)


def output_epilogue(out, values):
  """The output waits for the compressed residuals; float outputs are
  materialized once (see `jact._engine.scheduling.materialize`). Values kept by
  reference (inputs) do not go through the barrier, so that they stay the
  very objects an enclosing `compressed` recognises as its own inputs."""
  is_packed = [is_stored(v) for v in values]
  packed = [v for v, p in zip(values, is_packed) if p]
  out, packed = barrier(out, packed)
  it = iter(packed)
  values = tuple(next(it) if p else v for v, p in zip(values, is_packed))
  return materialize(out, packed), values
