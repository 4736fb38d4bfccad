"""ReLU / leaky ReLU output and its packed 1-bit mask in one pass, written in
Triton's language and launched with jax-triton (op "relu_mask").

The contract and bits of `reference.relu_mask_reference` (and of the Pallas
kernel `pallas_triton.relu_mask`), without Pallas' Triton backend: reads x once,
writes the activation and the mask packed per row of the leading axis (byte j
of a row of D values holds its values j, j + Q, ..., j + 7Q, Q = ceil(D / 8);
a 0-d or 1-d input is one row). The row count and length are runtime
arguments: one compiled kernel serves every input of a dtype, slope and tile.

>>> import jax, jax.numpy as jnp
>>> from jact.kernels._relu_mask.reference import relu_mask_reference
>>> x = jax.random.normal(jax.random.key(0), (3, 50), jnp.bfloat16)
>>> y, m = relu_mask(x, negative_slope=0.1, interpret=True)
>>> y_ref, m_ref = relu_mask_reference(x, negative_slope=0.1)
>>> bool((y == y_ref).all() & (m.data == m_ref.data).all()), m.data.shape
(True, (3, 7))
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import triton
import triton.language as tl

from jact._core.packing import PackedBits
from jact.kernels import _jax_triton
from jact.kernels._quantize.layout import check_int32, next_pow2

__all__ = ["relu_mask", "relu_mask_kernel", "kernel_constants", "compile_for_cuda", "PTX"]

_TILE = 1024  # mask bytes per program (8 planes of values each)
_DTYPE_CODE = {jnp.dtype(jnp.bfloat16): 1, jnp.dtype(jnp.float16): 2}


@triton.jit
def relu_mask_kernel(
  x_ptr,
  rows,
  d,
  q,
  tiles,
  y_ptr,
  mask_ptr,
  TILE: tl.constexpr,
  DTYPE: tl.constexpr,
  LEAKY: tl.constexpr,
  SLOPE: tl.constexpr,
):
  # DTYPE: 0 float32, 1 bfloat16 (read and written as its uint16 bits), 2 float16.
  # Program (row, t) writes mask bytes t * TILE ... of one row and their 8 planes of values.
  pid = tl.program_id(0)
  row = pid // tiles
  j = (pid % tiles) * TILE + tl.arange(0, TILE)
  # an empty batch still runs one (idle) row of programs; `row < rows` as a vector
  # comparison (Triton's interpreter mistypes a scalar condition broadcast into a mask)
  in_bytes = (j < q) & (row * q + j < rows * q)
  byte = tl.zeros((TILE,), tl.int32)
  for p in tl.static_range(8):
    col = j + p * q
    valid = in_bytes & (col < d)
    idx = row * d + col
    raw = tl.load(x_ptr + idx, mask=valid, other=0)
    if DTYPE == 1:
      x = (raw.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
      x = raw.to(tl.float32)
    nan = x != x
    if LEAKY:  # x where x >= 0 (or NaN, kept as it is), else slope * x rounded to the dtype
      bit = x >= 0.0
      scaled = x * SLOPE  # exact for bfloat16 / float16 operands: one rounding below
      if DTYPE == 1:
        u = scaled.to(tl.uint32, bitcast=True)
        y = tl.where(bit | nan, raw, ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).to(tl.uint16))
      elif DTYPE == 2:
        y = tl.where(bit | nan, raw, scaled.to(tl.float16))
      else:
        y = tl.where(bit | nan, raw, scaled)
    else:  # x where x > 0 (or NaN), else +0 (-0.0 too, as `jax.nn.relu`)
      bit = x > 0.0
      y = tl.where(bit | nan, raw, tl.zeros_like(raw))
    tl.store(y_ptr + idx, y, mask=valid)
    byte = byte | (tl.where(valid & bit, 1, 0) << p)
  tl.store(mask_ptr + row * q + j, byte.to(tl.uint8), mask=in_bytes)


def kernel_constants(
  shape, dtype, *, negative_slope: float | None = None, tile: int | None = None
) -> tuple[int, tuple[int, int, int, int], dict]:
  """(grid, runtime sizes (rows, values a row, mask bytes a row, programs a row),
  constexpr arguments) of `relu_mask_kernel` for an input of `shape` and `dtype`."""
  n = math.prod(shape)
  rows = shape[0] if len(shape) >= 2 else 1
  d = math.prod(shape[1:]) if len(shape) >= 2 else n
  q = -(-max(d, 1) // 8)
  tile = next_pow2(tile or min(_TILE, q))
  tiles = -(-q // tile)
  slope = 0.0
  if negative_slope is not None:  # the slope as the dtype holds it (`jax.nn.leaky_relu`)
    slope = float(np.asarray(negative_slope, jnp.dtype(dtype)).astype(np.float32))
  constants = dict(
    TILE=tile,
    DTYPE=_DTYPE_CODE.get(jnp.dtype(dtype), 0),
    LEAKY=negative_slope is not None,
    SLOPE=slope,
  )
  return max(rows, 1) * tiles, (rows, d, q, tiles), constants


def relu_mask(
  x: jax.Array,
  *,
  negative_slope: float | None = None,
  interpret: bool | None = None,
  tile: int | None = None,
  initial=None,
) -> tuple[jax.Array, PackedBits]:
  """(activation, packed mask) of x: relu and x > 0, or leaky_relu and x >= 0.

  `interpret` defaults to True off GPU (Triton's interpreter); `tile` (mask
  bytes per program, a power of two) bounds the grid in tests; `initial`
  pre-fills the outputs (tests).
  """
  if interpret is None:
    interpret = not _jax_triton.on_gpu()
  check_int32(x.size, "the input")
  grid, sizes, constants = kernel_constants(
    x.shape, x.dtype, negative_slope=negative_slope, tile=tile
  )
  rows, _, q, _ = sizes
  check_int32(rows * q, "the mask")
  flat = _jax_triton.flat_operand(x)
  y, mask = _jax_triton.call(
    relu_mask_kernel,
    flat,
    *sizes,
    grid=grid,
    out_shape=(
      jax.ShapeDtypeStruct((x.size,), flat.dtype),
      jax.ShapeDtypeStruct((rows * q,), jnp.uint8),
    ),
    name="jact_relu_mask_jax_triton",
    interpret=interpret,
    initial=initial,
    **constants,
  )
  if x.dtype == jnp.bfloat16:
    y = jax.lax.bitcast_convert_type(y, jnp.bfloat16)
  mask = mask.reshape((rows, q) if x.ndim >= 2 else (q,))
  return y.reshape(x.shape), PackedBits(mask, tuple(x.shape), 1)


def compile_for_cuda(
  x: jax.ShapeDtypeStruct,
  *,
  negative_slope: float | None = None,
  tile: int | None = None,
  arch: int = 90,
) -> str:
  """The PTX `relu_mask` runs for an input like `x` on an sm_`arch` GPU, compiled
  here by the `triton` package (any host)."""
  _, _, constants = kernel_constants(x.shape, x.dtype, negative_slope=negative_slope, tile=tile)
  x_type = _jax_triton.operand_type(x.dtype)
  return _jax_triton.compile_ptx(
    relu_mask_kernel,
    [x_type, "i32", "i32", "i32", "i32", x_type, jnp.uint8],
    arch=arch,
    **constants,
  )


PTX = {"relu_mask": compile_for_cuda}
"""op -> the function compiling its kernel for sm_90 here (the kernel contract tests)."""
