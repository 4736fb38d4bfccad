"""Ordering: when the compiler may compute, free and reconstruct residuals.

`barrier` ties the reconstruction of residuals to the incoming cotangent (so
XLA cannot hoist it into the forward pass), `finish_forward` /
`materialize` / `after_residuals` make the forward output wait for the
compressed residuals (so the full-precision value can be freed early).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jact import _compat
from jact.core.packing import PackedBits
from jact.core.persample import PackedPerSample
from jact.core.quantize import Packed
from jact.compressors import Compressed
from jact.engine.sharding import batch_is_sharded

__all__ = ["barrier", "after_residuals", "materialize", "finish_forward", "ready_flag",
           "is_stored", "wait_for", "kept_until_cotangent", "Stacked"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Stacked:
  """The stored form of a residual a `lax.scan` produced one iteration at a
  time, stored inside the loop: `pieces` is the stored form of one
  iteration's value (packed pieces, or `Stacked` again for a nested scan)
  with every leaf stacked along a new leading (iteration) axis.

  >>> import jax.numpy as jnp
  >>> from jact.core.packing import pack_codes
  >>> step = pack_codes(jnp.ones((4, 16), bool), 1)
  >>> s = Stacked(jax.tree.map(lambda a: jnp.stack([a] * 3), step))
  >>> is_stored(s), s.length
  (True, 3)
  """
  pieces: Any

  @property
  def length(self) -> int:
    """Number of iterations stacked."""
    return int(jax.tree.leaves(self.pieces)[0].shape[0])


def is_stored(value) -> bool:
  """Whether `value` is the stored form of a residual (packed or compressed
  pieces, or such pieces stacked over a scan's iterations)."""
  return isinstance(value, (Packed, PackedBits, PackedPerSample, Compressed, Stacked))


def barrier(residuals, cotangent):
  """Orders a backward rule's decompression after the arrival of its cotangent.

  Two mechanisms, because one is not enough everywhere:
    * `jax.lax.optimization_barrier` ties the residuals to the cotangent;
    * XLA:CPU expands optimization barriers before fusion and scheduling, so
      the packed residuals (bytes and group statistics) are also given a real data
      dependency on the cotangent: they are selected by `_always(g0)` (g0 one
      element of the cotangent), which is True for every value g0 can hold
      (NaN and infinities included) and which XLA cannot fold. Without it
      the scheduler hoists every dequantization to the start of the
      backward pass and all reconstructions are alive at once.
  The flag is per row: row n of a stored residual waits for row n of the
  cotangent (its first element), so under data parallelism (both sharded
  on the batch axis) the tie is local to each device and adds no collective.
  A stored form whose leading axis is not the cotangent's waits for all rows
  (a one-element all-reduce when the batch is sharded).
  The values are never changed: a NaN or infinite gradient of one sample
  leaves the reconstructions of every sample intact.
  """
  residuals, cotangent = _optimization_barrier((residuals, cotangent))
  arrived = _arrived(cotangent)
  if arrived is None:
    return residuals, cotangent

  def select(a):
    return jnp.where(_flag_for(arrived, a), a, jnp.zeros_like(a))

  def tie(r):
    if isinstance(r, Packed):
      return dataclasses.replace(r, data=select(r.data), scale=select(r.scale))
    if isinstance(r, (PackedBits, PackedPerSample)):
      return dataclasses.replace(r, data=select(r.data))
    if isinstance(r, Compressed):
      return dataclasses.replace(r, arrays=jax.tree.map(select, r.arrays))
    if isinstance(r, Stacked):
      return Stacked(jax.tree.map(tie, r.pieces, is_leaf=is_stored))
    return r

  residuals = jax.tree.map(
      tie, residuals, is_leaf=is_stored)
  return residuals, cotangent


def _optimization_barrier(tree):
  """`jax.lax.optimization_barrier` of `tree`'s arrays. Inside `jax.shard_map`
  the barrier's outputs vary over every manual axis any operand varies over,
  so arrays invariant over some of them (statistics averaged over an axis)
  stay outside it, keeping their types."""
  leaves, treedef = jax.tree.flatten(tree)
  axes = [_compat.varying_axes(v) if _compat.is_jax_value(v) else None for v in leaves]
  union = frozenset().union(*(a for a in axes if a is not None))
  if not union:
    return jax.lax.optimization_barrier(tree)
  tied = [i for i, a in enumerate(axes) if a == union]
  for i, v in zip(tied, jax.lax.optimization_barrier([leaves[i] for i in tied])):
    leaves[i] = v
  return jax.tree.unflatten(treedef, leaves)


def kept_until_cotangent(values, cotangent):
  """Values a backward rule kept as they are (a kernel, exact statistics),
  made to depend on the arrival of its cotangent.

  What the backward pass derives from such values alone -- the flipped
  kernel of a convolution's input gradient, a transposed weight -- depends
  on nothing the forward pass computes, and XLA:CPU schedules it at the
  start of the program, where it stays alive through the whole forward pass
  (ResNet-18 of experiments/zoo.py, `jact.convert` at 2 bits: 5 MiB of
  flipped kernels, temp 3.6 -> 1.7 MiB without them). Each floating-point
  array is selected by the always-true flag `barrier` uses, reduced over
  the cotangent's rows (kept values are parameters, not rows of the batch:
  under data parallelism this is a one-element all-reduce, a global sync per
  op: inside `jact.sharded_batch`, which says the batch is split over
  devices, values are not tied, and the program has exactly the plain
  model's collectives -- 3-layer stack on 8 CPU devices: 6.2 MiB per device
  with ties, 8.1 without, plain 12.0); the select fuses into its consumer.
  Stored forms and non-float values pass unchanged.

  >>> import jax.numpy as jnp
  >>> w, g = jnp.arange(3.0), jnp.ones(2)
  >>> kept_until_cotangent((w, None), g)[0]
  Array([0., 1., 2.], dtype=float32)
  """
  arrived = _arrived(cotangent)
  if arrived is None or batch_is_sharded():
    return values

  arrived = _first(arrived)

  def tie(v):
    if is_stored(v) or not jnp.issubdtype(jnp.result_type(v), jnp.floating):
      return v
    return jnp.where(arrived, v, jnp.zeros_like(v))

  return jax.tree.map(tie, values, is_leaf=is_stored)


def _arrived(cotangent):
  """The always-true flag that depends on the cotangent's first non-empty
  array: per row of its leading axis (one element a row, shape [rows]), or a
  scalar for a 0-d cotangent; None when it has none (nothing to order after)."""
  leaves = [c for c in jax.tree.leaves(cotangent)
            if jnp.size(c) and c.dtype != jax.dtypes.float0]
  return _always(_row_heads(leaves[0])) if leaves else None


def _row_heads(a: jax.Array) -> jax.Array:
  """The first element of each row of `a`'s leading axis (a scalar for 0-d a):
  under batch sharding every device reads only its own rows."""
  return a if a.ndim == 0 else jnp.reshape(a, (a.shape[0], -1))[:, 0]


def _first(flag: jax.Array) -> jax.Array:
  """A per-row flag reduced to a scalar (the flag of a value that has no rows):
  the first row's flag, or, when the rows are sharded in explicit sharding
  mode (which rejects reading one element of a sharded axis), all rows' flags.
  Not always the reduction: on XLA:CPU a kernel tied to it was again flipped
  at the start of the program (tests/test_memory.py flipped-kernel test)."""
  if flag.ndim == 0:
    return flag
  if _compat.leading_axis_sharded(flag):
    return jnp.all(flag)
  return flag[0]


def _flag_for(flag: jax.Array, value: jax.Array) -> jax.Array:
  """`flag` shaped to select `value`: per row when `value`'s leading axis is the
  flag's rows, else reduced to a scalar."""
  if flag.ndim == 1 and value.ndim >= 1 and value.shape[0] == flag.shape[0]:
    return jnp.reshape(flag, flag.shape + (1,) * (value.ndim - 1))
  return _first(flag)


def _always(v: jax.Array) -> jax.Array:
  """Booleans, elementwise, that are True for every value of `v` (NaN and
  infinities included) but depend on it, so XLA keeps the data dependency:
  no float exceeds +inf, and `v == v` holds for any other dtype."""
  if jnp.issubdtype(v.dtype, jnp.complexfloating):
    v = jnp.real(v)
  if jnp.issubdtype(v.dtype, jnp.floating):
    return jnp.logical_not(v > jnp.asarray(jnp.inf, v.dtype))
  return v == v  # pylint: disable=comparison-with-itself


def after_residuals(out, residuals):
  """Makes a forward output depend on its op's compressed residuals.

  XLA schedules a computation whose result is only needed in the backward
  pass as late as it can, so the compression of a residual would run after
  the forward pass and keep the full-precision input alive until then (the
  optimization barrier that says otherwise is expanded away by XLA:CPU
  before scheduling). Selecting the output by `t == t`, with `t` a float made
  from one packed byte of every residual (never NaN, and not foldable),
  forces compression to finish before the output is used. The select fuses
  into the output's consumer: no extra memory pass.
  """
  ready = ready_flag(residuals)
  return jax.tree.map(lambda o: jnp.where(_flag_for(ready, o), o, jnp.zeros_like(o))
                      if _may_wait(o, ready) else o, out)


def ready_flag(residuals) -> jax.Array:
  """An always-true flag that depends on every packed residual: per row
  (shape [rows]) when all packed bytes share their leading axis -- row n
  waits for row n of each, so under data parallelism the flag is local to
  each device -- else a scalar from the rows' first bytes of each."""
  packed = [r for r in jax.tree.leaves(residuals) if jnp.size(r) and r.dtype == jnp.uint8]
  if not packed:
    return jnp.bool_(True)
  leading = {r.shape[0] if r.ndim else None for r in packed}
  if len(leading) == 1 and None not in leading:
    t = sum(_row_heads(r).astype(jnp.float32) for r in packed)
  else:  # one byte of each (a sum over its rows where explicit sharding mode needs it)
    t = sum(jnp.sum(_row_heads(r).astype(jnp.float32)) if _compat.leading_axis_sharded(r)
            else jnp.reshape(r, (-1,))[0].astype(jnp.float32) for r in packed)
  return t == t  # pylint: disable=comparison-with-itself


def materialize(x: jax.Array, residuals) -> jax.Array:
  """Returns x, as a value XLA materializes once instead of re-fusing it.

  XLA duplicates cheap elementwise producers into every consumer fusion; a
  residual stream such as x_i = relu(h_i + x_{i-1}) then gets recomputed from
  all earlier layer outputs inside later compression fusions, keeping all of
  them alive. XLA does not duplicate *expensive* producers, so an elementwise
  op whose output is materialized anyway (it feeds a matmul or convolution)
  divides it elementwise by a runtime 1.0 -- exact, not foldable (it is selected by a
  byte of the op's packed residuals, which also orders it after compression),
  and fused into the op's own single memory pass.
  """
  ready = ready_flag(residuals)
  return jax.tree.map(lambda o: wait_for(o, ready), x)


def wait_for(value: jax.Array, ready: jax.Array) -> jax.Array:
  """`value`, computed only after the always-true flag `ready` (`ready_flag`):
  a float is divided elementwise by a runtime 1.0 (see `materialize`; a
  scalar divisor is rewritten by XLA into a cheap multiplication by its
  reciprocal), anything else selected by the flag."""
  if not _may_wait(value, ready):
    return value
  ready = _flag_for(ready, value)
  if jnp.issubdtype(value.dtype, jnp.floating):
    return value / jnp.where(ready, jnp.ones_like(value), value)
  return jnp.where(ready, value, jnp.zeros_like(value))


def _may_wait(value, flag) -> bool:
  """Whether `value` can be tied to `flag` without changing its type: inside
  `jax.shard_map` a value invariant over a manual axis (a statistic averaged
  over it, its cotangent) cannot wait for a flag that varies over that axis;
  it is left untied (it is small: a tie only matters for activations)."""
  return _compat.varying_axes(flag) <= _compat.varying_axes(value)


def _is_stored(r) -> bool:
  """A stored form: packed or compressed pieces, or raw packed bytes."""
  return is_stored(r) or getattr(r, "dtype", None) == jnp.uint8


def finish_forward(out, residuals, *, elementwise: bool = False):
  """Forward epilogue of every compressed op: the output waits for the
  compressed residuals (`barrier`, `after_residuals`), so the full-precision
  input dies in the forward pass. Elementwise outputs, which are materialized
  anyway, are emitted through `materialize` instead.

  Only the stored (packed) residuals go through the barrier: values kept as
  they are (a kernel, an input kept by reference) stay the very values the op
  was given, which an enclosing `jact.compressed` recognises as its own
  inputs and keeps by reference instead of compressing them again."""
  leaves, treedef = jax.tree.flatten(residuals, is_leaf=_is_stored)
  stored = [_is_stored(r) for r in leaves]
  out, packed = barrier(out, [r for r, s in zip(leaves, stored) if s])
  it = iter(packed)
  residuals = jax.tree.unflatten(treedef, [next(it) if s else r for r, s in zip(leaves, stored)])
  if elementwise:
    return materialize(out, packed), residuals
  return after_residuals(out, packed), residuals
