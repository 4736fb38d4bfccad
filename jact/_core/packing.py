"""Lossless bit packing: integer codes, masks and positions in dense uint8 bytes.

Codes < 2**bits are packed along the last axis in a planar layout: with
k = 8 // bits codes per byte and n // k bytes, byte j holds codes j, j + n//k,
j + 2n//k, ... (contiguous slices only, which fuse well in XLA and lower in
Triton). `pack_codes` packs any integer or boolean array losslessly, one
row (index of the leading axis) at a time, so that no byte mixes two samples
and a batch-sharded array packs without communication (the packed ReLU mask,
`jact.kernels._relu_mask`, is such a row-wise packing of x > 0).

>>> import jax.numpy as jnp
>>> codes = jnp.arange(16, dtype=jnp.uint8) % 4
>>> bool((unpack_bits(pack_bits(codes, 2), 2) == codes).all())
True
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

import numpy as np

from jact._core.stored import Stored

__all__ = [
  "SUPPORTED_BITS",
  "check_bits",
  "pack_bits",
  "unpack_bits",
  "PackedBits",
  "pack_codes",
  "unpack_codes",
  "packed_codes_bytes",
]


SUPPORTED_BITS = (1, 2, 4, 8)


def check_bits(bits: Any) -> int:
  """Validates a bit width; returns it as int."""
  if (
    isinstance(bits, bool)
    or not isinstance(bits, (int, np.integer))
    or int(bits) not in SUPPORTED_BITS
  ):
    raise ValueError(
      f"bits must be one of {SUPPORTED_BITS}, got {bits!r}. Pick 1, 2, 4 or 8 "
      "(use bits=None on an op to keep its residual uncompressed)."
    )
  return int(bits)


def pack_bits(codes: jax.Array, bits: int) -> jax.Array:
  """Packs uint codes < 2**bits along the last axis, planar layout.

  The last axis n must be a multiple of k = 8 // bits; the result has n // k
  bytes on that axis, byte j holding codes j, j + n//k, j + 2n//k, ...
  """
  bits = check_bits(bits)
  k = 8 // bits
  n = codes.shape[-1]
  if n % k:
    raise ValueError(f"last axis ({n}) must be a multiple of {k} to pack {bits}-bit codes")
  codes = codes.astype(jnp.uint8)
  if k == 1:
    # One code per byte: split it into two nibble planes so that packing is
    # still the reduction below (see there).
    planes = jnp.stack([codes & jnp.uint8(15), codes >> jnp.uint8(4)], axis=-2)
    shifts = jnp.array([0, 4], jnp.uint8)
  else:
    planes = codes.reshape(*codes.shape[:-1], k, n // k)
    shifts = jnp.arange(k, dtype=jnp.uint8) * jnp.uint8(bits)
  # Packing is a *reduction* over the plane axis (the fields are disjoint, so
  # the sum is their bitwise or). XLA never fuses a reduction into a consumer
  # that reads its elements several times, so the packed bytes are
  # materialized right here in the forward pass. Written as elementwise ors,
  # XLA:CPU (which expands optimization barriers before fusion) fused the
  # packing into the unpacking in the backward pass and kept the
  # full-precision input alive until then.
  return jnp.sum(planes << shifts[:, None], axis=-2, dtype=jnp.uint8)


def unpack_bits(data: jax.Array, bits: int) -> jax.Array:
  """Inverse of `pack_bits`: uint8 bytes -> uint8 codes (last axis grows k-fold)."""
  bits = check_bits(bits)
  k = 8 // bits
  if k == 1:
    return data
  mask = jnp.uint8((1 << bits) - 1)
  shifts = jnp.arange(k, dtype=jnp.uint8) * jnp.uint8(bits)
  # The bytes repeated over a new plane axis by a gather (every index in
  # range), not a broadcast: under automatic sharding the partitioner carries
  # the rows' sharding forward through a broadcast only after it has
  # propagated the weight gradients' layouts, so FSDP weights once gave every
  # reconstruction their layout (the global batch's codes all-gathered); a
  # gather keeps the rows' sharding early, and fuses into its consumer as the
  # broadcast did (a stack of k slices would be a concatenate, which XLA:CPU
  # never fuses).
  index = jnp.broadcast_to(jnp.arange(data.shape[-1]), (k, data.shape[-1]))
  planes = (jnp.take(data, index, axis=-1, mode="clip") >> shifts[:, None]) & mask
  return planes.reshape(*data.shape[:-1], k * data.shape[-1])


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedBits(Stored):
  """Integer codes < 2**bits (masks, arg-max positions) packed losslessly.

  Attributes:
    data: uint8 bytes, planar layout: [rows, bytes] over each row's flattened
      codes for arrays of two or more dimensions, [bytes] otherwise.
    shape: shape of the original code array (static).
    bits: width of one code (static).
  """

  data: jax.Array
  shape: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
  bits: int = dataclasses.field(metadata=dict(static=True))

  @property
  def nbytes(self) -> int:
    return int(self.data.size)

  def decompress(self, dtype=None) -> jax.Array:
    """The codes (`unpack_codes`), cast to `dtype` when given."""
    codes = unpack_codes(self)
    return codes if dtype is None else codes.astype(dtype)

  def map_ordered(self, fn) -> "PackedBits":
    """The bytes wait for the cotangent."""
    return dataclasses.replace(self, data=fn(self.data))


def pack_codes(codes: jax.Array, bits: int) -> PackedBits:
  """Packs an integer or boolean array of codes < 2**bits losslessly.

  An array of two or more dimensions is packed per row: its leading axis
  stays (data is uint8[rows, ceil(D / k)] for D values a row and k = 8 // bits
  codes a byte), so a byte never holds codes of two samples. Under data
  parallelism the packing then needs no collective and each device keeps only
  its own rows' bytes. Lower-dimensional arrays are packed as one flat row.

  >>> import jax.numpy as jnp
  >>> m = jnp.arange(10) % 3 == 0
  >>> p = pack_codes(m, 1)
  >>> p.nbytes, bool((unpack_codes(p) == m).all())
  (2, True)
  >>> pack_codes(jnp.ones((4, 3, 5), bool), 1).data.shape   # 4 rows of 15 bits
  (4, 2)
  """
  bits = check_bits(bits)
  k = 8 // bits
  codes = jnp.asarray(codes)
  rows = (
    codes.reshape(codes.shape[0], math.prod(codes.shape[1:]))
    if codes.ndim >= 2
    else jnp.ravel(codes)
  )
  d = rows.shape[-1]
  padded = -(-max(d, 1) // k) * k
  pad = [(0, 0)] * (rows.ndim - 1) + [(0, padded - d)]
  rows = jnp.pad(rows.astype(jnp.uint8), pad)
  return PackedBits(pack_bits(rows, bits), tuple(codes.shape), bits)


def packed_codes_bytes(shape: tuple[int, ...], bits: int) -> int:
  """Bytes `pack_codes` stores for codes of `shape`: ceil(D / k) per row of D
  values (k = 8 // bits codes a byte), at least one byte for a 0-d or 1-d array.

  >>> packed_codes_bytes((4, 3, 5), 1), packed_codes_bytes((10,), 1), packed_codes_bytes((), 2)
  (8, 2, 1)
  """
  shape, k = tuple(int(s) for s in shape), 8 // check_bits(bits)
  if len(shape) >= 2:
    return shape[0] * -(-max(math.prod(shape[1:]), 1) // k)
  return -(-max(math.prod(shape), 1) // k)


def unpack_codes(packed: PackedBits, dtype=None) -> jax.Array:
  """Inverse of `pack_codes` (booleans come back as bool when bits == 1 and dtype is None)."""
  if not isinstance(packed, PackedBits):
    raise TypeError(
      f"unpack_codes takes the jact.PackedBits that pack_codes returns, got "
      f"{type(packed).__name__}; pack the codes first "
      f"(packed = jact.pack_codes(codes, bits))."
    )
  shape = packed.shape
  d = math.prod(shape[1:]) if len(shape) >= 2 else math.prod(shape)
  flat = unpack_bits(packed.data, packed.bits)[..., :d].reshape(shape)
  if dtype is None:
    return flat.astype(jnp.bool_) if packed.bits == 1 else flat
  return flat.astype(dtype)
