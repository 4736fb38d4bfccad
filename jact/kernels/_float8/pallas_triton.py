"""Pallas (Triton backend) kernel: float8 codes and per-block scales in one pass.

Each program reads `rows` blocks of one row (a tile of rows x next_pow2(block_size)
values), reduces each block's finite maximum to its scale, and writes the
blocks' codes and scales, bit-exact with `reference.float8_compress_reference`.
The codes are assembled from integers (`jact._core.float8.code_bits`), so the
kernel needs no float8 type; the float operations are single IEEE operations
(`jact.kernels._triton`), the noise `jact.rng`'s hash of the flat index.

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

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from jact._core import rng
from jact._core.float8 import (
  FORMATS,
  block_exponent,
  code_bits,
  pow2,
  rounded_steps,
  row_layout,
  special_codes,
)
from jact.kernels import _triton as T

__all__ = ["float8_compress"]

_TILE = 4096  # values per program (a power of two)


def _kernel(*refs, n, d, nb, block_size, width, rows, format, scale, stochastic, interpret):
  if stochastic:
    x_ref, seed_ref, codes_ref, scale_ref = refs
    seed = seed_ref[0]
  else:
    x_ref, codes_ref, scale_ref = refs
  fmt = FORMATS[format]
  row = pl.program_id(0)
  block = pl.program_id(1) * rows + jax.lax.broadcasted_iota(jnp.int32, (rows, width), 0)
  j = jax.lax.broadcasted_iota(jnp.int32, (rows, width), 1)
  col = block * block_size + j
  valid = (row < n) & (block < nb) & (j < block_size) & (col < d)
  offset = row * d + col
  v = T.load(x_ref, offset, valid, jnp.zeros((), x_ref.dtype)).astype(jnp.float32)
  finite = jnp.isfinite(v)
  amax = jnp.max(jnp.where(valid & finite, jnp.abs(v), 0.0), axis=1)
  if scale == "pow2":
    e = block_exponent(amax, fmt)
    stored = (e + 127).astype(jnp.uint8)
    scaled = T.mul(v, pow2(-e)[:, None], interpret)
  else:
    stored = T.mul(amax, jnp.float32(np.float32(1.0) / np.float32(fmt.max)), interpret)
    s = jnp.broadcast_to(stored[:, None], v.shape)
    positive = s > 0
    scaled = jnp.where(positive, T.div(v, jnp.where(positive, s, 1.0), interpret), 0.0)
    scaled = jnp.clip(scaled, -fmt.max, fmt.max)
  scaled = jnp.where(finite, scaled, 0.0)
  noise = rng.hash_uint32(seed, offset.astype(jnp.uint32)) if stochastic else None
  steps, k = rounded_steps(scaled, fmt, noise, functools.partial(T.mul, interpret=interpret))
  codes = code_bits(steps, k, scaled < 0, fmt)
  codes = jnp.where(finite, codes, special_codes(v, fmt))
  T.store(codes_ref, offset, codes, valid)
  b = pl.program_id(1) * rows + jax.lax.broadcasted_iota(jnp.int32, (rows,), 0)
  T.store(scale_ref, row * nb + b, stored, (row < n) & (b < nb))


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
) -> tuple[jax.Array, jax.Array]:
  """`reference.float8_compress_reference` in one Pallas pass.

  `interpret` defaults to True off GPU; `rows` (blocks per program, rounded
  up to a power of two) bounds the grid in tests.
  """
  if interpret is None:
    interpret = not T.on_gpu()
  shape = tuple(x.shape)
  n, d, nb = row_layout(shape, block_size)
  T.check_int32(n * d, "the input")
  scale_dtype = jnp.uint8 if scale == "pow2" else jnp.float32
  if n * d == 0:  # nothing to run a program on
    return jnp.zeros(shape, jnp.uint8), jnp.zeros((n, nb), scale_dtype)
  width = T.next_pow2(block_size)
  r = T.next_pow2(rows) if rows is not None else max(1, min(_TILE // width, T.next_pow2(nb)))
  kernel = functools.partial(
    _kernel,
    n=n,
    d=d,
    nb=nb,
    block_size=block_size,
    width=width,
    rows=r,
    format=format,
    scale=scale,
    stochastic=stochastic,
    interpret=interpret,
  )
  args = [x.reshape(-1)]
  if stochastic:
    args.append(jnp.asarray(seed, jnp.uint32).reshape(1))
  codes, stored = T.call(
    kernel,
    grid=(n, -(-nb // r)),
    name="jact_float8_compress",
    interpret=interpret,
    out_shape=(
      jax.ShapeDtypeStruct((n * d,), jnp.uint8),
      jax.ShapeDtypeStruct((n * nb,), scale_dtype),
    ),
  )(*args)
  return codes.reshape(shape), stored.reshape(n, nb)
