"""Lossless bit packing: integer codes, masks and positions in dense uint8 bytes.

Codes < 2**bits are packed along the last axis, in one of three layouts (a
row of n codes always takes n * bits / 8 bytes, n a multiple of the layout's
unit, `packing_unit`):

* widths dividing 8 (1, 2, 4, 8), planar: with k = 8 // bits codes a byte,
  byte j holds codes j, j + n//k, j + 2n//k, ... (unit k);
* 3, 5, 6 and 7 bits, bit planes: the codes as 8 planes of m = n // 8
  (code (i, j) is code i*m + j) give `bits` planes of m bytes, byte j of
  plane p holding bit p of code (i, j) in its bit i (unit 8);
* 16 bits: two byte planes of n bytes, the uint16 codes' low bytes then their
  high bytes (unit 1).

All use contiguous slices only, which fuse well in XLA and lower in Triton.
`pack_codes` packs any integer or boolean array losslessly, one
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
  "code_dtype",
  "packing_unit",
  "pack_bits",
  "unpack_bits",
  "PackedBits",
  "pack_codes",
  "unpack_codes",
  "packed_codes_bytes",
]


SUPPORTED_BITS = (1, 2, 3, 4, 5, 6, 7, 8, 16)


def check_bits(bits: Any) -> int:
  """Validates a bit width; returns it as int."""
  if (
    isinstance(bits, bool)
    or not isinstance(bits, (int, np.integer))
    or int(bits) not in SUPPORTED_BITS
  ):
    raise ValueError(
      f"bits must be one of {SUPPORTED_BITS}, got {bits!r}. Pick an integer width "
      "1 to 8 or 16 (use bits=None on an op to keep its residual uncompressed)."
    )
  return int(bits)


def packing_unit(bits: int) -> int:
  """Codes a packed row holds a multiple of: 8 // bits for widths dividing 8,
  8 for the bit-plane widths 3, 5, 6, 7, and 1 for 16 bits."""
  bits = check_bits(bits)
  if bits == 16:
    return 1
  return 8 // bits if 8 % bits == 0 else 8


def code_dtype(bits: int):
  """The unsigned dtype of unpacked `bits`-wide codes: uint16 for 16 bits, else uint8."""
  return jnp.dtype(jnp.uint16) if check_bits(bits) == 16 else jnp.dtype(jnp.uint8)


# Packing is a *reduction* over a plane axis in every layout (the fields are
# disjoint, so the sum is their bitwise or). XLA never fuses a reduction into a
# consumer that reads its elements several times, so the packed bytes are
# materialized right where they are packed, in the forward pass. Written as
# elementwise ors, XLA:CPU (which expands optimization barriers before fusion)
# fused the packing into the unpacking in the backward pass and kept the
# full-precision input alive until then.


def pack_bits(codes: jax.Array, bits: int) -> jax.Array:
  """Packs uint codes < 2**bits along the last axis (layouts: module docstring).

  The last axis n must be a multiple of `packing_unit(bits)`; the result has
  n * bits // 8 bytes on that axis.
  """
  bits = check_bits(bits)
  unit = packing_unit(bits)
  n = codes.shape[-1]
  if n % unit:
    raise ValueError(f"last axis ({n}) must be a multiple of {unit} to pack {bits}-bit codes")
  lead = codes.shape[:-1]
  if bits == 16:
    # Four nibble planes summed in pairs: low byte = n0 + n1 << 4, high = n2 + n3 << 4.
    codes = codes.astype(jnp.uint16)
    nibbles = [((codes >> jnp.uint16(4 * i)) & jnp.uint16(15)).astype(jnp.uint8) for i in range(4)]
    planes = jnp.stack([jnp.stack(nibbles[0::2], -2), jnp.stack(nibbles[1::2], -2)], axis=-3)
    shifts = jnp.array([0, 4], jnp.uint8)[:, None, None]
    return jnp.sum(planes << shifts, axis=-3, dtype=jnp.uint8).reshape(*lead, 2 * n)
  codes = codes.astype(jnp.uint8)
  if 8 % bits:
    # Bit planes: plane p of byte (., j) sums bit p of code (i, j) shifted to bit i.
    m = n // 8
    planes = codes.reshape(*lead, 8, 1, m)
    bit = jnp.arange(bits, dtype=jnp.uint8)[:, None]
    shifts = jnp.arange(8, dtype=jnp.uint8)[:, None, None]
    fields = ((planes >> bit) & jnp.uint8(1)) << shifts
    return jnp.sum(fields, axis=-3, dtype=jnp.uint8).reshape(*lead, bits * m)
  k = 8 // bits
  if k == 1:
    # One code per byte: split it into two nibble planes so that packing is
    # still a reduction.
    planes = jnp.stack([codes & jnp.uint8(15), codes >> jnp.uint8(4)], axis=-2)
    shifts = jnp.array([0, 4], jnp.uint8)
  else:
    planes = codes.reshape(*lead, k, n // k)
    shifts = jnp.arange(k, dtype=jnp.uint8) * jnp.uint8(bits)
  return jnp.sum(planes << shifts[:, None], axis=-2, dtype=jnp.uint8)


def unpack_bits(data: jax.Array, bits: int) -> jax.Array:
  """Inverse of `pack_bits`: uint8 bytes -> codes (`code_dtype(bits)`), the last
  axis growing by 8 / bits."""
  bits = check_bits(bits)
  lead, size = data.shape[:-1], data.shape[-1]
  if bits == 16:
    n = size // 2
    low, high = data[..., :n], data[..., n:]
    return low.astype(jnp.uint16) | (high.astype(jnp.uint16) << jnp.uint16(8))
  if bits == 8:
    return data
  # The bytes repeated over a new plane axis by a gather (every index in
  # range), not a broadcast: under automatic sharding the partitioner carries
  # the rows' sharding forward through a broadcast only after it has
  # propagated the weight gradients' layouts, so FSDP weights once gave every
  # reconstruction their layout (the global batch's codes all-gathered); a
  # gather keeps the rows' sharding early, and fuses into its consumer as the
  # broadcast did (a stack of k slices would be a concatenate, which XLA:CPU
  # never fuses).
  if 8 % bits:
    m = size // bits
    index = jnp.broadcast_to(jnp.arange(size), (8, size))
    repeated = jnp.take(data, index, axis=-1, mode="clip").reshape(*lead, 8, bits, m)
    shifts = jnp.arange(8, dtype=jnp.uint8)[:, None]
    codes = None
    for p in range(bits):  # code (i, j) = sum over planes p of bit i of byte (p, j), at bit p
      field = ((repeated[..., p, :] >> shifts) & jnp.uint8(1)) << jnp.uint8(p)
      codes = field if codes is None else codes | field
    return codes.reshape(*lead, 8 * m)
  k = 8 // bits
  mask = jnp.uint8((1 << bits) - 1)
  shifts = jnp.arange(k, dtype=jnp.uint8) * jnp.uint8(bits)
  index = jnp.broadcast_to(jnp.arange(size), (k, size))
  planes = (jnp.take(data, index, axis=-1, mode="clip") >> shifts[:, None]) & mask
  return planes.reshape(*lead, k * size)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedBits(Stored):
  """Integer codes < 2**bits (masks, arg-max positions) packed losslessly.

  Attributes:
    data: uint8 bytes (`pack_bits` layout): [rows, bytes] over each row's
      flattened codes for arrays of two or more dimensions, [bytes] otherwise.
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
  stays (data is uint8[rows, ceil(D / u) * u * bits / 8] for D values a row
  and u = `packing_unit(bits)`), so a byte never holds codes of two samples.
  Under data parallelism the packing then needs no collective and each
  device keeps only its own rows' bytes. Lower-dimensional arrays are packed
  as one flat row.

  >>> import jax.numpy as jnp
  >>> m = jnp.arange(10) % 3 == 0
  >>> p = pack_codes(m, 1)
  >>> p.nbytes, bool((unpack_codes(p) == m).all())
  (2, True)
  >>> pack_codes(jnp.ones((4, 3, 5), bool), 1).data.shape   # 4 rows of 15 bits
  (4, 2)
  >>> pack_codes(jnp.arange(10) % 7, 3).data.shape   # 10 codes -> 16, 3 bits each
  (6,)
  """
  bits = check_bits(bits)
  unit = packing_unit(bits)
  codes = jnp.asarray(codes)
  rows = (
    codes.reshape(codes.shape[0], math.prod(codes.shape[1:]))
    if codes.ndim >= 2
    else jnp.ravel(codes)
  )
  d = rows.shape[-1]
  padded = -(-max(d, 1) // unit) * unit
  pad = [(0, 0)] * (rows.ndim - 1) + [(0, padded - d)]
  rows = jnp.pad(rows.astype(code_dtype(bits)), pad)
  return PackedBits(pack_bits(rows, bits), tuple(codes.shape), bits)


def packed_codes_bytes(shape: tuple[int, ...], bits: int) -> int:
  """Bytes `pack_codes` stores for codes of `shape`: ceil(D / u) * u * bits / 8
  per row of D values (u = `packing_unit(bits)`), at least one unit for a 0-d
  or 1-d array.

  >>> packed_codes_bytes((4, 3, 5), 1), packed_codes_bytes((10,), 1), packed_codes_bytes((), 2)
  (8, 2, 1)
  >>> packed_codes_bytes((2, 10), 3), packed_codes_bytes((2, 10), 16)
  (12, 40)
  """
  shape, unit = tuple(int(s) for s in shape), packing_unit(bits)
  per_unit = unit * bits // 8
  if len(shape) >= 2:
    return shape[0] * -(-max(math.prod(shape[1:]), 1) // unit) * per_unit
  return -(-max(math.prod(shape), 1) // unit) * per_unit


def unpack_codes(packed: PackedBits, dtype=None) -> jax.Array:
  """Inverse of `pack_codes`: codes of `code_dtype(packed.bits)` (uint8, or uint16
  for 16 bits), or bool when bits == 1, unless `dtype` is given."""
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
