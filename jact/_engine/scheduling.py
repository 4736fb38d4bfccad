"""Ordering: when the compiler may compute, free and reconstruct residuals.

`barrier` ties the reconstruction of residuals to the incoming cotangent (so
XLA cannot hoist it into the forward pass), `finish_forward` /
`materialize` / `after_residuals` make the forward output wait for the
compressed residuals (so the full-precision value can be freed early).

Two devices do this. `jax.lax.optimization_barrier`, on every platform. And,
because XLA:CPU expands optimization barriers before it fuses and schedules,
data dependencies XLA cannot fold (always-true flags selecting a value, a
division by a runtime 1.0): these are XLA:CPU workarounds, so they are
emitted through `jact._core.xla_cpu.on_cpu`, one primitive whose rule is
lowered only in programs for the CPU -- a program lowered for cuda, rocm or
tpu holds the values themselves, unchanged, and not one flag
(tests/core/test_platform_ordering.py lowers for cuda from the CPU and checks).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jact import _compat
from jact._core import xla_cpu
from jact.compressors import Stored
from jact._engine.sharding import batch_is_sharded

__all__ = [
  "barrier",
  "after_residuals",
  "materialize",
  "finish_forward",
  "wait_for_all",
  "is_stored",
  "kept_until_cotangent",
  "Stacked",
]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Stacked:
  """The stored form of a residual a `lax.scan` produced one iteration at a
  time, stored inside the loop: `pieces` is the stored form of one
  iteration's value (packed pieces, or `Stacked` again for a nested scan)
  with every leaf stacked along a new leading (iteration) axis.

  >>> import jax.numpy as jnp
  >>> from jact._core.packing import pack_codes
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
  """Whether `value` is the stored form of a residual (a `Stored`: packed or
  compressed pieces, a user compressor's own form; or such pieces stacked
  over a scan's iterations)."""
  return isinstance(value, (Stored, Stacked))


def barrier(residuals, cotangent):
  """Orders a backward rule's decompression after the arrival of its cotangent.

  Two mechanisms, because one is not enough everywhere:
    * `jax.lax.optimization_barrier` ties the residuals to the cotangent;
    * XLA:CPU expands optimization barriers before fusion and scheduling, so
      the packed residuals (bytes and group statistics) are also given a real data
      dependency on the cotangent: they are selected by `xla_cpu.always(g0)` (g0 one
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
  head = _cotangent_head(cotangent)
  if head is None:
    return residuals, cotangent

  def tie(r, select):
    if isinstance(r, Stored):
      return r.map_ordered(select)
    if isinstance(r, Stacked):
      return Stacked(jax.tree.map(lambda p: tie(p, select), r.pieces, is_leaf=is_stored))
    return r

  arrays = []
  jax.tree.map(lambda r: tie(r, lambda a: arrays.append(a) or a), residuals, is_leaf=is_stored)
  tied = iter(xla_cpu.on_cpu(xla_cpu.select_after_arrival, arrays, [head]))
  residuals = jax.tree.map(lambda r: tie(r, lambda a: next(tied)), residuals, is_leaf=is_stored)
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
  (ResNet-18 of experiments/lib/zoo.py, `jact.convert` at 2 bits: 5 MiB of
  flipped kernels, temp 3.6 -> 1.7 MiB without them). Each floating-point
  array is selected by the always-true flag `barrier` uses, reduced over
  the cotangent's rows (kept values are parameters, not rows of the batch);
  the select fuses into its consumer. In a program XLA partitions over
  devices (`jax.jit` with shardings; decided when it is lowered, see
  `jact._core.xla_cpu.select_after_any_arrival`) and inside
  `jact.sharded_batch` values are not tied: reading the first row there is a
  one-element all-reduce per op, and the program keeps exactly the plain
  model's collectives (4-layer stack of 512 on 8 CPU devices: 6.2 MiB per
  device with ties, 8.2 without, plain 16.0).
  Stored forms and non-float values pass unchanged.

  >>> import jax.numpy as jnp
  >>> w, g = jnp.arange(3.0), jnp.ones(2)
  >>> kept_until_cotangent((w, None), g)[0]
  Array([0., 1., 2.], dtype=float32)
  """
  head = _cotangent_head(cotangent)
  if head is None or batch_is_sharded():
    return values
  floating = lambda v: not is_stored(v) and jnp.issubdtype(jnp.result_type(v), jnp.floating)
  return _leaves_on_cpu(
    xla_cpu.select_after_any_arrival, values, [head], floating, is_leaf=is_stored
  )


def _cotangent_head(cotangent):
  """The cotangent's first non-empty array, whose rows' first elements say it
  arrived; None when it has none (nothing to order after)."""
  leaves = [c for c in jax.tree.leaves(cotangent) if jnp.size(c) and c.dtype != jax.dtypes.float0]
  return leaves[0] if leaves else None


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
  packed = _packed_bytes(residuals)
  return _tree_on_cpu(xla_cpu.select_when_ready, out, packed)


def _packed_bytes(residuals) -> list:
  """The non-empty packed byte arrays of `residuals` (what ready flags read)."""
  return [r for r in jax.tree.leaves(residuals) if jnp.size(r) and r.dtype == jnp.uint8]


def _tree_on_cpu(rule, tree, packed: list):
  """`tree` with every array leaf that may wait for `packed` passed through
  `rule` in one CPU-only equation (unchanged where nothing is packed). Inside
  `jax.shard_map` a value invariant over a manual axis the bytes vary over (a
  statistic averaged over it, its cotangent) is left untied, keeping its type
  (it is small: a tie only matters for activations)."""
  if not packed:
    return tree
  axes = frozenset().union(*(_compat.varying_axes(r) for r in packed))
  may_wait = lambda o: _compat.is_jax_value(o) and axes <= _compat.varying_axes(o)
  return _leaves_on_cpu(rule, tree, packed, may_wait)


def _leaves_on_cpu(rule, tree, anchors: list, chosen, is_leaf=None):
  """`tree` with the leaves `chosen(leaf)` accepts passed through the CPU-only
  `rule` together, in one equation (`jact._core.xla_cpu.on_cpu`)."""
  leaves, treedef = jax.tree.flatten(tree, is_leaf=is_leaf)
  picked = [i for i, v in enumerate(leaves) if chosen(v)]
  for i, v in zip(picked, xla_cpu.on_cpu(rule, [leaves[i] for i in picked], anchors)):
    leaves[i] = v
  return jax.tree.unflatten(treedef, leaves)


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
  return _tree_on_cpu(xla_cpu.wait_when_ready, x, _packed_bytes(residuals))


def wait_for_all(values: list, residuals) -> list:
  """`values` (arrays), each computed only after the packed residuals
  `residuals` (`materialize` of each, in one equation)."""
  return list(materialize(list(values), residuals))


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
