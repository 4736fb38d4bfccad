"""Embedding lookup that keeps only the integer ids for its backward.

The gradient of `table[ids]` with respect to the table is a scatter-add of
the output cotangent into the rows named by `ids`; the table itself is never
needed, so the only residual is `ids` (tagged `f"{name}.ids"`). Exact: same
forward and gradient as `flax.linen.Embed` / `jnp.take(table, ids, axis=0)`.

>>> import jax, jax.numpy as jnp
>>> table = jnp.arange(6.0).reshape(3, 2)
>>> embed(jnp.array([2, 0, 2]), table)
Array([[4., 5.],
       [0., 1.],
       [4., 5.]], dtype=float32)
>>> jax.grad(lambda t: embed(jnp.array([2, 0, 2]), t).sum())(table)
Array([[1., 1.],
       [0., 0.],
       [2., 2.]], dtype=float32)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jact._engine.names import check_name
from jact._engine.op import Save, compressed_op

__all__ = ["embed"]


def embed(ids: jax.Array, table: jax.Array, *, name: str = "embed") -> jax.Array:
  """Looks up rows of `table`: `jnp.take(table, ids, axis=0)`, saving only `ids`.

  Args:
    ids: integer array of any shape (row indices into the table).
    table: float array (num_embeddings, features...).
    name: residual name prefix; the saved ids are tagged `f"{name}.ids"`.

  Returns:
    The rows, shaped `ids.shape` followed by the table's trailing axes, in
    the table's dtype. Out-of-range
    ids give NaN rows (`jnp.take`'s default) and contribute no gradient.
  """
  name = check_name(name)
  ids = jnp.asarray(ids)
  table = jnp.asarray(table)
  if not jnp.issubdtype(ids.dtype, jnp.integer):
    raise TypeError(
      f"jact.ops.embed takes integer ids, got {ids.dtype}; cast token ids with "
      f"ids.astype(jnp.int32) (float ids would be truncated silently)."
    )
  if not jnp.issubdtype(table.dtype, jnp.floating):
    raise TypeError(
      f"jact.ops.embed takes a floating-point table, got {table.dtype}; cast it "
      f"(table.astype(jnp.float32))."
    )
  if table.ndim < 1:
    raise ValueError("jact.ops.embed needs a table with at least one axis (rows)")
  shape, dtype = table.shape, table.dtype

  def lookup(ids, table):
    return jnp.take(table, ids, axis=0)

  def backward(res, g):
    # Same scatter-add as the transpose of jnp.take (out-of-range ids dropped).
    return None, jnp.zeros(shape, dtype).at[res["ids"]].add(g, mode="drop")

  return compressed_op(
    lambda ids, table: (lookup(ids, table), {"ids": Save(ids)}),
    backward,
    op="embed",
    name=name,
    primal=lookup,
  )(ids, table)
