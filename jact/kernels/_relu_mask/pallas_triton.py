"""Pallas (Triton backend) kernel: ReLU / leaky ReLU output and its 1-bit mask in one pass.

Reads x once and writes the activation and the packed mask (1/8 byte a
value) together, bit-exact with `reference.relu_mask_reference`:
the mask is `jact.pack_codes(mask, 1)`, packed per row of the leading axis
(k = 8 planes: byte j of a row of D values holds its values j, j + Q, ...,
j + 7Q with Q = ceil(D / 8); a 0-d or 1-d input is one row).

>>> import jax, jax.numpy as jnp
>>> from jact.kernels._relu_mask.reference import relu_mask_reference
>>> x = jax.random.normal(jax.random.key(0), (3, 50))
>>> y, m = relu_mask(x, interpret=True)
>>> y_ref, m_ref = relu_mask_reference(x)
>>> bool((y == y_ref).all() & (m.data == m_ref.data).all()), m.data.shape
(True, (3, 7))
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jact.kernels import _triton as T
from jact._core.packing import PackedBits

__all__ = ["relu_mask"]

_TILE = 1024  # mask bytes per program (8 planes of values each)


def _activation(x, negative_slope, interpret):
  if negative_slope is None:
    return jnp.maximum(x, jnp.zeros((), x.dtype)), x > 0
  slope = jnp.array(negative_slope, x.dtype)
  scaled = x * slope if x.dtype != jnp.float32 else T.mul(x, slope, interpret)
  return jnp.where(x >= 0, x, scaled), x >= 0


def _kernel(x_ref, y_ref, mask_ref, *, rows, d, q, tile, negative_slope, interpret):
  # Program (row, t) writes bytes t*tile ... of one row: the row's offset is a
  # multiple of the static d, so loads and stores stay contiguous and aligned
  # (16-byte vectors) as in a flat layout.
  row = pl.program_id(0)
  j = pl.program_id(1) * tile + jax.lax.broadcasted_iota(jnp.int32, (tile,), 0)
  in_bytes = (j < q) & (row < rows)  # an empty batch still runs one (idle) row of programs
  byte = jnp.zeros((tile,), jnp.int32)
  for p in range(8):
    col = j + p * q
    valid = in_bytes & (col < d)
    idx = row * d + col
    x = T.load(x_ref, idx, valid, jnp.zeros((), x_ref.dtype))
    y, bit = _activation(x, negative_slope, interpret)
    T.store(y_ref, idx, y, valid)
    byte = byte | (jnp.where(valid & bit, 1, 0) << p)
  T.store(mask_ref, row * q + j, byte.astype(jnp.uint8), in_bytes)


def relu_mask(
  x: jax.Array,
  *,
  negative_slope: float | None = None,
  interpret: bool | None = None,
  tile: int | None = None,
) -> tuple[jax.Array, PackedBits]:
  """(activation, packed mask) of x: relu and x > 0, or leaky_relu and x >= 0.

  `tile` (mask bytes per program, a power of two) bounds the grid in tests.
  """
  if interpret is None:
    interpret = not T.on_gpu()
  n = x.size
  T.check_int32(n, "the input")
  rows = x.shape[0] if x.ndim >= 2 else 1
  d = math.prod(x.shape[1:]) if x.ndim >= 2 else n
  q = -(-max(d, 1) // 8)
  T.check_int32(rows * q, "the mask")
  tile = T.next_pow2(tile or min(_TILE, q))
  kernel = functools.partial(
    _kernel, rows=rows, d=d, q=q, tile=tile, negative_slope=negative_slope, interpret=interpret
  )
  y, mask = T.call(
    kernel,
    grid=(max(rows, 1), -(-q // tile)),
    name="jact_relu_mask",
    interpret=interpret,
    out_shape=(jax.ShapeDtypeStruct((n,), x.dtype), jax.ShapeDtypeStruct((rows * q,), jnp.uint8)),
  )(x.reshape(-1))
  mask = mask.reshape((rows, q) if x.ndim >= 2 else (q,))
  return y.reshape(x.shape), PackedBits(mask, tuple(x.shape), 1)
