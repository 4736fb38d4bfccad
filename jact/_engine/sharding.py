"""Where the backward passes' reconstructions live on a device mesh.

Under automatic sharding (`jax.jit` with `NamedSharding` inputs) a value the
backward pass reconstructs from packed codes is a new value whose sharding
the partitioner chooses. The codes are unpacked by a gather
(`jact._core.packing.unpack_bits`), which carries the rows' sharding into
the reconstruction early enough that it stays where the plain model's
activation is, with sharded weights too (FSDP, tensor parallelism).
`sharded_batch` says it explicitly: which mesh axes the batch is sharded
over; every reconstruction whose leading axis is the batch is then
constrained to rows sharded over them (the other dimensions left to the
partitioner).
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterator

import jax
from jax.sharding import NamedSharding, PartitionSpec

from jact._engine import context as _context

__all__ = ["sharded_batch", "pin_rows", "batch_is_sharded"]


@contextlib.contextmanager
def sharded_batch(axes, mesh: jax.sharding.Mesh | None = None) -> Iterator[None]:
  """Traces inside the block keep each reconstructed activation sharded over
  `axes` on its leading (batch) axis, as the plain model's activation is.

  Not needed for data parallelism, FSDP or the tensor parallelism tested
  (`docs/distributed.md`): plain `jax.jit` with shardings keeps
  reconstructions on their rows and leaves kept kernels untied
  (`jact._engine.scheduling.kept_until_cotangent`); the block states the
  batch's layout where a model's partitioning would otherwise be left to
  the partitioner's choice. Inside `shard_map` over these axes, and in explicit
  sharding mode (a mesh with Explicit axes, `jax.make_mesh`'s default), the
  constraint does nothing (there the layout is known).
  `mesh` may be left out inside `jax.set_mesh(mesh)`.

  >>> import jax, jax.numpy as jnp, jact
  >>> mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  >>> x, w = jnp.ones((4, 8)), jnp.ones((8, 8))
  >>> loss = lambda w, x: jnp.sum(jact.ops.dense(x, w, key=jax.random.key(0), bits=4) ** 2)
  >>> with jact.sharded_batch("data", mesh):
  ...   g = jax.jit(jax.grad(loss))(w, x)
  >>> g.shape
  (8, 8)
  """
  names = (
    (axes,) if isinstance(axes, str) else tuple(axes) if isinstance(axes, (tuple, list)) else ()
  )
  if not names or not all(isinstance(a, str) for a in names):
    raise ValueError(
      f"jact.sharded_batch: axes must be mesh axis names (a string or a tuple "
      f"of strings), got {axes!r}"
    )
  if mesh is not None:
    missing = [a for a in names if a not in mesh.shape]
    if missing:
      raise ValueError(
        f"jact.sharded_batch: the mesh has no axis {missing[0]!r} "
        f"(its axes: {tuple(mesh.shape)}); name axes of the mesh the batch "
        "is sharded over"
      )
  with _context._pushed("batch", (names, mesh)):  # pylint: disable=protected-access
    yield


def pin_rows(x):
  """`x` constrained to rows sharded as `sharded_batch` says, or unchanged
  (no block active, a 0-d value, rows that do not divide evenly, axes that
  are manual here or explicit in `x`'s type)."""
  setting = _context.current("batch")
  if setting is None or not hasattr(x, "ndim") or x.ndim == 0:
    return x
  axes, mesh = setting
  context_mesh = jax.sharding.get_abstract_mesh()
  shape = dict(mesh.shape) if mesh is not None else dict(getattr(context_mesh, "shape", {}))
  if any(a not in shape for a in axes):
    raise ValueError(
      f"jact.sharded_batch({axes!r}): no mesh with these axes is known while tracing; "
      "pass the mesh (jact.sharded_batch(axes, mesh)) or trace inside jax.set_mesh(mesh)"
    )
  if _layout_known(axes, mesh, context_mesh):
    return x
  if x.shape[0] % math.prod(shape[a] for a in axes):
    return x
  spec = PartitionSpec(axes, *[PartitionSpec.UNCONSTRAINED] * (x.ndim - 1))
  return jax.lax.with_sharding_constraint(
    x, NamedSharding(mesh, spec) if mesh is not None else spec
  )


def _axis_types(mesh) -> dict:
  return dict(zip(getattr(mesh, "axis_names", ()), getattr(mesh, "axis_types", ())))


def _layout_known(axes, mesh, context_mesh) -> bool:
  """Whether the layout of `axes` is already fixed where this is traced: a
  batch axis manual here (inside `shard_map`) or explicit (explicit sharding
  mode: the sharding is in the value's type), in the mesh given to
  `sharded_batch` or the context mesh, or any explicit axis in the mesh the
  constraint would name (`jax.make_mesh` makes every axis Explicit by default,
  and an unconstrained dimension cannot be stated over such a mesh)."""
  fixed = (jax.sharding.AxisType.Manual, jax.sharding.AxisType.Explicit)
  for m in (mesh, context_mesh):
    types = _axis_types(m)
    if any(types.get(a) in fixed for a in axes):
      return True
  named = _axis_types(mesh if mesh is not None else context_mesh)
  return any(t == jax.sharding.AxisType.Explicit for t in named.values())


def batch_is_sharded() -> bool:
  """Whether a `sharded_batch` block is active: the batch is known to be split
  over devices, so a value tied to one row of it would need a collective."""
  return _context.current("batch") is not None
