"""DIVISION's frequency split (reference numerics): average-pooled low-frequency
component (LFC) and the quantized high-frequency remainder (HFC).

The pieces the XLA reference (`jact.kernels._division.reference`) and the Pallas
kernel (`jact.kernels._division.pallas_triton`) share: pooling blocks, the
fixed-order pooled sum, the stored LFC and its upsampling.
`jact.compressors.Division` is the compressor built on them.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["check_rank", "pool_blocks", "block_counts", "pool", "stored_lfc", "upsample"]


_F32 = jnp.float32


def check_rank(shape: tuple[int, ...]) -> None:
  if not 2 <= len(shape) <= 5:
    raise ValueError(
      f"Division takes channels-last inputs of rank 2 to 5 ((N, C), (N, L, C), "
      f"(N, H, W, C) or (N, D, H, W, C)), got shape {tuple(shape)}; reshape the "
      "residual to one of these layouts or use PerGroup for other shapes."
    )


def pool_blocks(spatial: tuple[int, ...], block: int) -> tuple[int, ...]:
  """Block size per spatial axis: B, or the whole axis when it is shorter (1 for an empty axis)."""
  return tuple(max(1, min(block, s)) for s in spatial)


def block_counts(spatial: tuple[int, ...], blocks: tuple[int, ...]) -> np.ndarray:
  """Valid elements in each pooling block, shape (n_1, ..., n_k) (static)."""
  count = np.ones((), np.float32)
  for s, b in zip(spatial, blocks):
    n = -(-s // b)
    per_axis = np.minimum(b, s - b * np.arange(n)).astype(np.float32)
    count = np.multiply.outer(count, per_axis)
  return count


def pool(x: jax.Array, blocks: tuple[int, ...]) -> jax.Array:
  """Average pooling (float32) of the finite values over the spatial axes, partial
  blocks over valid elements, 0.0 for a block without finite values.

  The float32 sum has a fixed order, so a kernel can reproduce it bit for bit:
  the block's offsets in row-major order, acc = x[offset 0]; acc = acc +
  x[offset] (a non-finite value adds 0.0, as does an offset out of range of a
  partial block), then acc * (1 / count), count the block's finite values and
  the reciprocal a correctly rounded float32 division.
  """
  spatial = x.shape[1:-1]
  n = tuple(-(-s // b) for s, b in zip(spatial, blocks))
  x = x.astype(jnp.float32)
  acc = bad = None
  for offset in itertools.product(*map(range, blocks)):
    part = x[(slice(None), *(slice(o, None, b) for o, b in zip(offset, blocks)), slice(None))]
    short = [m - p for m, p in zip(n, part.shape[1:-1])]
    if any(short):  # a partial last block has no element at this offset: adds 0.0
      part = jax.lax.pad(
        part, jnp.float32(0.0), ((0, 0, 0), *((0, k, 0) for k in short), (0, 0, 0))
      )
    finite = jnp.isfinite(part)
    part, miss = jnp.where(finite, part, 0.0), jnp.where(finite, _F32(0.0), _F32(1.0))
    acc, bad = (part, miss) if acc is None else (acc + part, bad + miss)
  count = jnp.asarray(block_counts(spatial, blocks))[None, ..., None] - bad
  return acc * jnp.where(count > 0, 1.0 / jnp.maximum(count, 1.0), 0.0)


def stored_lfc(x: jax.Array, blocks: tuple[int, ...], lfc_dtype) -> jax.Array:
  """The LFC as stored: the pooled map in `lfc_dtype`, 0 where that is not finite
  (a float32 sum or a narrow `lfc_dtype` overflowed): the HFC then holds x itself."""
  lfc = pool(x, blocks).astype(lfc_dtype)
  return jnp.where(jnp.isfinite(lfc), lfc, jnp.zeros((), lfc_dtype))


def upsample(lfc: jax.Array, blocks: tuple[int, ...], spatial: tuple[int, ...]) -> jax.Array:
  """Nearest-neighbour upsampling of the pooled map back to `spatial` (float32)."""
  lfc = lfc.astype(jnp.float32)
  n = lfc.shape[1:-1]
  expanded, tiled = [lfc.shape[0]], [lfc.shape[0]]
  for m, b in zip(n, blocks):
    expanded += [m, 1]
    tiled += [m, b]
  expanded.append(lfc.shape[-1])
  tiled.append(lfc.shape[-1])
  up = jnp.broadcast_to(lfc.reshape(expanded), tiled)
  up = up.reshape((lfc.shape[0],) + tuple(m * b for m, b in zip(n, blocks)) + (lfc.shape[-1],))
  if up.shape[1:-1] != tuple(spatial):
    up = up[(slice(None),) + tuple(slice(0, s) for s in spatial)]
  return up
