"""Storing a residual centered and scaled per row before it is rounded.

A per-group quantizer shares one grid (a bfloat16 minimum and step) among
`group_size` consecutive values: a group of `1000 + 0.01 * noise` keeps a
minimum off by up to 4, and rows of very different scale in one group lose
the small ones. `store_rows` keeps, per row (the axes a normalization
reduces), the float32 mean of the finite values and a bfloat16 scale (the
largest deviation), and compresses `(x - mean) / scale`; non-finite values
pass through as they are. The reconstruction `mean + scale * z` is unbiased
when `z` is, and its error is relative to each row's own spread.

>>> import jax, jax.numpy as jnp
>>> from jact.compressors import PerGroup
>>> x = 1000.0 + 0.01 * jax.random.normal(jax.random.key(0), (4, 256))
>>> to_nearest = PerGroup(8, stochastic=False)
>>> stored = store_rows(x, (-1,), lambda z: to_nearest.compress(z, None))
>>> float(jnp.abs(stored.decompress() - x).max()) < 1e-3   # spread/255, not bf16(1000)/2
True
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from jact.compressors import Compressed
from jact._engine.store import restore_residual

__all__ = ["RowNormalized", "store_rows", "fits_rows", "axes_from_end"]


def axes_from_end(axes, ndim: int) -> tuple[int, ...]:
  """Axes counted from the end (so they also name the axes of one scan
  iteration's value, which lacks the leading iteration axes)."""
  return tuple(sorted(a % ndim - ndim for a in axes))


@dataclasses.dataclass(frozen=True)
class RowNormalized:
  """How `store_rows` rebuilds a residual (the static part of its `Compressed`).

  Attributes:
    axes: the axes of a row (counted from the end).
  """

  axes: tuple[int, ...]

  def decompress(self, stored: Compressed, dtype=None) -> jax.Array:
    arrays = stored.arrays
    z = restore_residual(arrays["codes"], stored.shape, jnp.float32)
    x = arrays["mean"] + arrays["scale"].astype(jnp.float32) * z
    return x.astype(stored.dtype if dtype is None else dtype)


def fits_rows(leaf, axes) -> bool:
  """Whether `leaf` has the axes `axes` (counted from the end) and more than
  one row's worth of values in them."""
  return bool(axes) and all(-leaf.ndim <= a < 0 for a in axes) and leaf.size > 0


def store_rows(
  leaf: jax.Array, axes: tuple[int, ...], compress: Callable[[jax.Array], object]
) -> Compressed:
  """`leaf` stored as per-row mean (float32), scale (bfloat16) and
  `compress((leaf - mean) / scale)`; rows span `axes`. Statistics are of the
  finite values; non-finite values are compressed as they are."""
  x = leaf.astype(jnp.float32)
  finite = jnp.isfinite(x)
  count = jnp.maximum(jnp.sum(finite, axes, keepdims=True), 1).astype(jnp.float32)
  mean = jnp.sum(jnp.where(finite, x / count, 0.0), axes, keepdims=True)
  deviation = jnp.where(finite, x - mean, 0.0)
  scale = jnp.max(jnp.abs(deviation), axes, keepdims=True)
  scale = jnp.where(scale > 0, scale, 1.0).astype(jnp.bfloat16)
  z = jnp.where(finite, deviation / scale.astype(jnp.float32), x)
  return Compressed(
    {"codes": compress(z), "mean": mean, "scale": scale},
    RowNormalized(tuple(axes)),
    tuple(leaf.shape),
    leaf.dtype,
  )
