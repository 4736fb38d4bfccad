"""FP8 codes and per-block scales written in Triton's language, launched with jax-triton.

The contract and bits of `reference.float8_compress_reference` (registered as
the "jax_triton" implementation of "float8_compress"), without Pallas' Triton
backend. Each program reads `rows` blocks (a tile of rows x next_pow2(block_size)
values; the blocks of every row of the tensor are numbered one after another),
reduces each block's finite maximum to its scale (an E8M0 exponent or a
float32), and writes the blocks' codes and scales. The codes are assembled from
integers (`jact._core.float8.code_bits`), so no float8 type is involved; each
float operation is one IEEE operation (no contraction, `tl.div_rn`), the
stochastic noise `jact.rng`'s hash of the flat index. The sizes (blocks, blocks
a row, values a row) are runtime scalars: one compiled kernel serves every
tensor of a format, block size, scale kind and input dtype.

>>> import jax, jax.numpy as jnp
>>> from jact.kernels._float8.reference import float8_compress_reference
>>> x = jax.random.normal(jax.random.key(0), (3, 100))
>>> kw = dict(format="e4m3", block_size=32, scale="pow2", stochastic=True)
>>> got = float8_compress(x, jnp.uint32(5), **kw, interpret=True)
>>> want = float8_compress_reference(x, jnp.uint32(5), **kw)
>>> all(bool((a == b).all()) for a, b in zip(got, want)), got[1].shape
(True, (3, 4))
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import triton
import triton.language as tl

from jact._core.float8 import FORMATS, NAN_CODE, row_layout
from jact.kernels import _jax_triton
from jact.kernels._quantize.layout import check_int32, next_pow2
from jact.kernels._triton_rng import hash_uint32

__all__ = ["float8_compress", "float8_kernel", "kernel_constants", "compile_for_cuda", "PTX"]

_TILE = 4096  # values per program by default (a power of two)


@triton.jit
def float8_kernel(
  x_ptr,
  seed_ptr,
  n_blocks,
  blocks_per_row,
  d,
  codes_ptr,
  scale_ptr,
  BLOCK: tl.constexpr,
  WIDTH: tl.constexpr,
  ROWS: tl.constexpr,
  ALIGNED: tl.constexpr,
  IN_BF16: tl.constexpr,
  MANTISSA: tl.constexpr,
  EMIN: tl.constexpr,
  EMAX: tl.constexpr,
  MAX: tl.constexpr,
  INV_MAX: tl.constexpr,
  POS_INF: tl.constexpr,
  NEG_INF: tl.constexpr,
  NAN: tl.constexpr,
  POW2: tl.constexpr,
  STOCHASTIC: tl.constexpr,
):
  block1 = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # [ROWS] blocks, row-major
  block = block1[:, None]
  j = tl.arange(0, WIDTH)[None, :]
  if ALIGNED:  # blocks tile the rows: block b starts at b * BLOCK
    offset = block * BLOCK + j
    valid = (block < n_blocks) & (j < BLOCK)
  else:
    col = (block % blocks_per_row) * BLOCK + j
    offset = (block // blocks_per_row) * d + col
    valid = (block < n_blocks) & (j < BLOCK) & (col < d)
  if IN_BF16:  # bits as uint16
    raw = tl.load(x_ptr + offset, mask=valid, other=0).to(tl.uint32)
    v = (raw << 16).to(tl.float32, bitcast=True)
  else:
    v = tl.load(x_ptr + offset, mask=valid, other=0.0).to(tl.float32)
  finite = tl.abs(v) < float("inf")  # false for NaN
  amax = tl.max(tl.where(valid & finite, tl.abs(v), 0.0), axis=1)  # [ROWS]

  # the block's scale (`block_exponent` / amax / max), and the values scaled by it
  if POW2:
    u = amax.to(tl.uint32, bitcast=True)
    over = ((u & 0x7FFFFF) > 0x600000).to(tl.int32)  # mantissa above 1.75's
    e = ((u >> 23) & 0xFF).to(tl.int32) - 127 - EMAX + over
    e = tl.minimum(tl.maximum(e, -126), 127)
    stored = (e + 127).to(tl.uint8)
    inv = ((127 - e).to(tl.uint32) << 23).to(tl.float32, bitcast=True)  # 2^-e, exact
    scaled = v * inv[:, None]
  else:
    stored = amax * INV_MAX  # XLA's amax / max: times the float32 reciprocal, a constant
    s = tl.broadcast_to(stored[:, None], v.shape)
    positive = s > 0.0
    scaled = tl.where(positive, tl.div_rn(v, tl.where(positive, s, 1.0)), 0.0)
    scaled = tl.minimum(tl.maximum(scaled, -MAX), MAX)
  scaled = tl.where(finite, scaled, 0.0)

  # rounded onto the float8 grid in steps of 2^k (`rounded_steps`)
  a = tl.abs(scaled)
  k = tl.maximum(((a.to(tl.uint32, bitcast=True) >> 23) & 0xFF).to(tl.int32) - 127, EMIN)
  k = k - MANTISSA
  t = a * ((127 - k).to(tl.uint32) << 23).to(tl.float32, bitcast=True)  # exact
  whole = tl.floor(t)
  frac = t - whole  # exact
  steps = whole.to(tl.int32)
  if STOCHASTIC:  # 31 noise bits against frac in units of 2^-31, in int32
    noise = hash_uint32(tl.load(seed_ptr), offset.to(tl.uint32))
    up = (noise >> 1).to(tl.int32) < (frac * 2147483648.0).to(tl.int32)
  else:  # to nearest, ties to even
    up = (frac > 0.5) | ((frac == 0.5) & ((steps & 1) == 1))
  steps = steps + up.to(tl.int32)

  # the code from its integer fields (`code_bits`), fixed codes for non-finite values
  magnitude = ((k - (EMIN - MANTISSA)) << MANTISSA) + steps
  magnitude = tl.where(steps == 0, 0, magnitude)
  code = tl.where((scaled < 0.0) & (steps > 0), magnitude | 0x80, magnitude)
  special = tl.where(v != v, NAN, tl.where(v > 0.0, POS_INF, NEG_INF))
  code = tl.where(finite, code, special)
  tl.store(codes_ptr + offset, code.to(tl.uint8), mask=valid)
  tl.store(scale_ptr + block1, stored, mask=block1 < n_blocks)


def kernel_constants(
  shape, dtype, *, format: str, block_size: int, scale: str, stochastic: bool, rows=None
) -> tuple[tuple[int, int, int], int, dict]:
  """((blocks, blocks a row, values a row): the runtime sizes, grid, the kernel's
  constexpr arguments) for an input of `shape` and `dtype`."""
  fmt = FORMATS[format]
  n, d, nb = row_layout(shape, block_size)
  width = next_pow2(block_size)
  r = next_pow2(rows) if rows is not None else max(1, _TILE // width)
  constants = dict(
    BLOCK=block_size,
    WIDTH=width,
    ROWS=r,
    ALIGNED=d % block_size == 0,
    IN_BF16=jnp.dtype(dtype) == jnp.bfloat16,
    MANTISSA=fmt.mantissa,
    EMIN=fmt.emin,
    EMAX=fmt.emax,
    MAX=fmt.max,
    INV_MAX=float(np.float32(1.0) / np.float32(fmt.max)),
    POS_INF=fmt.inf_codes[0],
    NEG_INF=fmt.inf_codes[1],
    NAN=NAN_CODE,
    POW2=scale == "pow2",
    STOCHASTIC=bool(stochastic),
  )
  return (n * nb, nb, d), max(1, -(-(n * nb) // r)), constants


def float8_compress(
  x: jax.Array,
  seed,
  *,
  format: str,
  block_size: int,
  scale: str,
  stochastic: bool,
  interpret: bool | None = None,
  rows: int | None = None,
  initial=None,
) -> tuple[jax.Array, jax.Array]:
  """`reference.float8_compress_reference` in one Triton pass: (uint8 codes in
  x's shape, scales (rows, blocks a row), uint8 E8M0 or float32).

  `interpret` defaults to True off GPU (Triton's interpreter, slow); `rows`
  (blocks per program, rounded up to a power of two) bounds the tile in tests;
  `initial` pre-fills the outputs (tests)."""
  if interpret is None:
    interpret = not _jax_triton.on_gpu()
  shape = tuple(x.shape)
  n, d, nb = row_layout(shape, block_size)
  check_int32(n * d, "the input")
  scale_dtype = jnp.uint8 if scale == "pow2" else jnp.float32
  if n * d == 0:  # nothing to run a program on
    return jnp.zeros(shape, jnp.uint8), jnp.zeros((n, nb), scale_dtype)
  sizes, grid, constants = kernel_constants(
    shape,
    x.dtype,
    format=format,
    block_size=block_size,
    scale=scale,
    stochastic=stochastic,
    rows=rows,
  )
  flat = _jax_triton.flat_operand(x)
  seed = jnp.asarray(seed if stochastic else 0, jnp.uint32).reshape(1)
  codes, stored = _jax_triton.call(
    float8_kernel,
    flat,
    seed,
    *sizes,
    grid=grid,
    out_shape=(
      jax.ShapeDtypeStruct((n * d,), jnp.uint8),
      jax.ShapeDtypeStruct((n * nb,), scale_dtype),
    ),
    name="jact_float8_compress_jax_triton",
    interpret=interpret,
    initial=initial,
    **constants,
  )
  return codes.reshape(shape), stored.reshape(n, nb)


def compile_for_cuda(
  x: jax.ShapeDtypeStruct,
  seed,
  *,
  format: str,
  block_size: int,
  scale: str,
  stochastic: bool,
  rows: int | None = None,
  arch: int = 90,
) -> str:
  """The PTX `float8_compress` runs for an input like `x` on an sm_`arch` GPU,
  compiled here by the `triton` package (any host; `seed` is unused: in the
  kernel's signature it is one uint32)."""
  del seed
  _, _, constants = kernel_constants(
    x.shape,
    x.dtype,
    format=format,
    block_size=block_size,
    scale=scale,
    stochastic=stochastic,
    rows=rows,
  )
  x_type = _jax_triton.operand_type(x.dtype)
  scale_type = jnp.uint8 if scale == "pow2" else jnp.float32
  return _jax_triton.compile_ptx(
    float8_kernel,
    [x_type, jnp.uint32, "i32", "i32", "i32", jnp.uint8, scale_type],
    arch=arch,
    **constants,
  )


PTX = {"float8_compress": compile_for_cuda}
"""op -> the function compiling its kernel for sm_90 here (the kernel contract tests)."""
