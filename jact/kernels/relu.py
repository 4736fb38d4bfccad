"""Pallas (Triton backend) kernel: ReLU / leaky ReLU output and its 1-bit mask in one pass.

Reads x once and writes the activation and the packed mask (1/8 byte a
value) together, bit-exact with `jact.ops.activation.relu_mask_reference`:
the mask is `jact.pack_codes(mask, 1)`, packed per row of the leading axis
(k = 8 planes: byte j of a row of D values holds its values j, j + Q, ...,
j + 7Q with Q = ceil(D / 8); a 0-d or 1-d input is one row).

>>> import jax, jax.numpy as jnp
>>> from jact.core.packing import relu_mask_reference
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
from jact.core.packing import PackedBits

__all__ = ["relu_mask"]

_TILE = 1024  # mask bytes per program (8 planes of values each)


def _activation(x, negative_slope, interpret):
  if negative_slope is None:
    return jnp.maximum(x, jnp.zeros((), x.dtype)), x > 0
  slope = jnp.array(negative_slope, x.dtype)
  scaled = x * slope if x.dtype != jnp.float32 else T.mul(x, slope, interpret)
  return jnp.where(x >= 0, x, scaled), x >= 0


def _kernel(x_ref, y_ref, mask_ref, *, d, q, total, tile, negative_slope, interpret):
  b = pl.program_id(0) * tile + jax.lax.broadcasted_iota(jnp.int32, (tile,), 0)
  in_bytes = b < total
  row = b // q
  j = b - row * q
  byte = jnp.zeros((tile,), jnp.int32)
  for p in range(8):
    col = j + p * q
    valid = in_bytes & (col < d)
    idx = row * d + col
    x = T.load(x_ref, idx, valid, jnp.zeros((), x_ref.dtype))
    y, bit = _activation(x, negative_slope, interpret)
    T.store(y_ref, idx, y, valid)
    byte = byte | (jnp.where(valid & bit, 1, 0) << p)
  T.store(mask_ref, b, byte.astype(jnp.uint8), in_bytes)


def relu_mask(x: jax.Array, *, negative_slope: float | None = None, interpret: bool | None = None,
              tile: int | None = None) -> tuple[jax.Array, PackedBits]:
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
  total = rows * q
  tile = T.next_pow2(tile or min(_TILE, max(total, 1)))
  kernel = functools.partial(_kernel, d=d, q=q, total=total, tile=tile,
                             negative_slope=negative_slope, interpret=interpret)
  y, mask = T.call(kernel, grid=max(-(-total // tile), 1), name="jact_relu_mask",
                   interpret=interpret,
                   out_shape=(jax.ShapeDtypeStruct((n,), x.dtype),
                              jax.ShapeDtypeStruct((total,), jnp.uint8)))(x.reshape(-1))
  mask = mask.reshape((rows, q) if x.ndim >= 2 else (q,))
  return y.reshape(x.shape), PackedBits(mask, tuple(x.shape), 1)
