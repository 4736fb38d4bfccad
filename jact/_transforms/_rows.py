"""Residuals of normalizations, stored centered and scaled per row.

A per-group grid fits neither values with a large offset nor rows of very
different scale sharing a group (a ViT's class token beside its patches in a
LayerNorm's input). `normalization_rows(jaxpr, reduced)` finds, from the
jaxpr alone, the residuals whose backward works on such rows;
`jact._engine.rows.store_rows` stores them per row. Which residuals qualify:
docs/design.md, "Normalization rows".

>>> import jax, jax.numpy as jnp
>>> from jact._transforms._vjp_residuals import reduced_values
>>> def norm(x):
...   xc = x - x.mean(-1, keepdims=True)
...   return xc * jax.lax.rsqrt((xc * xc).mean(-1, keepdims=True) + 1e-6)
>>> closed = jax.make_jaxpr(norm)(jnp.ones((4, 64)))
>>> rows = normalization_rows(closed.jaxpr, reduced_values(closed.jaxpr))
>>> sorted(set(rows.values()))
[(-1,)]
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jact import _compat
from jact._engine.rows import axes_from_end

__all__ = ["normalization_rows"]

REDUCTION = 8  # a statistic is at least this many times smaller than its rows' tensor


def _shape(v) -> tuple[int, ...]:
  return tuple(getattr(v.aval, "shape", ()))


def _size(v) -> int:
  return math.prod(_shape(v))


def _float_var(v) -> bool:
  if not _compat.is_var(v) or not hasattr(v.aval, "shape"):
    return False
  dtype = v.aval.dtype
  return not jax.dtypes.issubdtype(dtype, jax.dtypes.extended) and jnp.issubdtype(
    dtype, jnp.floating
  )


def _statistics(jaxpr, reduced) -> set:
  """`reduced` and what is computed from such values alone (broadcasts,
  reshapes, rsqrt(var + eps), ...)."""
  stat = set(reduced)
  for eqn in jaxpr.eqns:
    ins = [v for v in eqn.invars if _compat.is_var(v)]
    if ins and all(v in stat for v in ins):
      stat.update(v for v in eqn.outvars if _compat.is_var(v))
  return stat


def _row_axes(axes, shape) -> tuple[int, ...]:
  """The axes of a row, counted from the end. () -- no rows -- when the
  statistic spans a tensor's leading (batch) axis (a batch norm's
  per-channel statistics, a loss's total): its residuals are centered over
  the batch already, and per-sample rows of a small feature map would cost
  more bits than they save (6 bytes per 64 values of an 8x8 map at 2 bits);
  and when a row would hold fewer than `REDUCTION` values."""
  ndim = len(shape)
  if ndim > 1 and any(a % ndim == 0 for a in axes):
    return ()
  kept = [a % ndim for a in axes]
  if not kept or math.prod(shape[a] for a in kept) < REDUCTION:
    return ()
  return axes_from_end(kept, ndim)


def _reduced_inputs(jaxpr) -> dict:
  """`{invar: axes}`: inputs of `jaxpr` that (through elementwise links)
  feed a reduction, with its axes."""
  rows = normalization_rows(jaxpr, set(), broadcasts=False)
  return {v: rows[v] for v in jaxpr.invars if v in rows}


def normalization_rows(jaxpr, reduced, broadcasts: bool = True) -> dict:
  """`{var: axes}` (axes counted from the end) for the float variables of
  `jaxpr` whose backward works on normalization rows (see the module
  docstring); `reduced` holds the reduced statistics (`reduced_values`).
  With `broadcasts`, a combination with a broadcast statistic also names
  rows, not only a reduction."""
  stat = _statistics(jaxpr, reduced)
  parent = {}

  def find(v):
    while parent.get(v, v) is not v:
      v = parent[v]
    return v

  def link(a, b):
    ra, rb = find(a), find(b)
    if ra is not rb:
      parent[ra] = rb

  from_reduction, from_broadcast = {}, {}
  for eqn in jaxpr.eqns:
    ins = [v for v in eqn.invars if _float_var(v)]
    axes = _compat.reduced_axes(eqn)
    if axes is not None:
      if ins and axes and all(_size(o) * REDUCTION <= _size(ins[0]) for o in eqn.outvars):
        rows = _row_axes(axes, _shape(ins[0]))
        if rows:
          from_reduction.setdefault(ins[0], rows)
      continue
    body = _compat.call_body(eqn)
    if body is not None:
      inner = _reduced_inputs(body.jaxpr)
      for outer, v in zip(eqn.invars, body.jaxpr.invars):
        if v in inner and _float_var(outer) and _shape(outer) == _shape(v):
          from_reduction.setdefault(outer, inner[v])
      continue
    if not _compat.is_row_link(eqn) or len(eqn.outvars) != 1 or not _float_var(eqn.outvars[0]):
      continue
    out = eqn.outvars[0]
    shape = _shape(out)
    same = {v for v in ins if _shape(v) == shape and v not in stat}
    if len(same) == 1:
      link(out, next(iter(same)))
    if not broadcasts:
      continue
    if not _compat.is_static_shape(shape):  # a symbolic (jax.export) batch: no row hints
      continue
    for w in ins:
      if (
        w in stat
        and len(_shape(w)) == len(shape)
        and w not in same
        and _size(w) * REDUCTION <= _size(out)
      ):
        axes = [i for i, (a, b) in enumerate(zip(_shape(w), shape)) if a == 1 and b > 1]
        rows = _row_axes(axes, shape)
        if rows:
          from_broadcast.setdefault(out, rows)
  family_axes = {}
  for hints in (from_reduction, from_broadcast):  # a reduction's axes first
    for v, axes in hints.items():
      family_axes.setdefault(find(v), axes)
  members = set(parent) | set(from_reduction) | set(from_broadcast)
  return {v: family_axes[find(v)] for v in members if find(v) in family_axes}
