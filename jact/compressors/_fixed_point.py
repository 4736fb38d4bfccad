"""AC-GC's scaled fixed point (AutoQuant) as a `Compressor`.

Per channel (the last axis) the scale is the largest finite abs(x) (non-finite
values are kept exactly: see `Fixpoint`); values are
rounded to the nearest of 2L + 1 levels -L..L (L = 2^(bits-1) - 1), so zero
stays exactly zero (which zero-value compression relies on) and every error
is at most scale / (2L). Every width 2..16 is stored in exactly its bits
(`fixpoint_codes_bytes`), as AC-GC's bounds ask for integer widths up to 16.
The width usually comes from an AC-GC plan
(`jact.acgc.error_bounded(..., compressor=Fixpoint())`).

>>> import jax.numpy as jnp
>>> from jact.compressors import Fixpoint
>>> x = jnp.array([[0.0, 1.0], [-0.5, 3.5]])
>>> c = Fixpoint(bits=4)
>>> stored = c.compress(x, None)
>>> c.decompress(stored).tolist(), stored.nbytes == c.stored_bytes(x.shape)
([[0.0, 1.0], [-0.5, 3.5]], True)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jact.compressors._base import Compressed, Compressor, as_channel_rows, channels
from jact._core.packing import PackedBits, pack_codes, packed_codes_bytes, unpack_codes
from jact._core.quantize import kind_value, nonfinite_kind

__all__ = [
  "Fixpoint",
  "FIXPOINT_BITS",
  "flag_scale",
  "split_scale",
  "fixpoint_fields",
  "pack_fixpoint_codes",
  "unpack_fixpoint_codes",
  "fixpoint_codes_bytes",
]


def flag_scale(scale: jax.Array, kind: jax.Array) -> jax.Array:
  """float32 scales: unchanged where kind is 0, else rounded up to a multiple
  of 4 ulps with the kind (1 NaN, 2 +inf, 3 -inf) in the two lowest mantissa
  bits and the sign bit set."""
  u = jax.lax.bitcast_convert_type(scale.astype(jnp.float32), jnp.uint32)
  up = jnp.minimum((u + jnp.uint32(3)) & jnp.uint32(0xFFFFFFFC), jnp.uint32(0x7F7FFFFC))
  flagged = up | kind.astype(jnp.uint32) | jnp.uint32(0x80000000)
  return jax.lax.bitcast_convert_type(jnp.where(kind != 0, flagged, u), jnp.float32)


def split_scale(scale: jax.Array):
  """(scale, flagged, kind) of a stored scale (see `flag_scale`)."""
  u = jax.lax.bitcast_convert_type(scale, jnp.uint32)
  flagged = (u >> 31) == 1
  magnitude = jnp.where(flagged, u & jnp.uint32(0x7FFFFFFC), u)
  kind = jnp.where(flagged, (u & 3).astype(jnp.int32), 0)
  return jax.lax.bitcast_convert_type(magnitude, jnp.float32), flagged, kind


FIXPOINT_BITS = tuple(range(2, 17))


def _check_fixpoint_bits(bits: Any) -> int:
  if isinstance(bits, bool) or not isinstance(bits, int) or bits not in FIXPOINT_BITS:
    raise ValueError(
      f"Fixpoint bits must be an int from 2 to 16, got {bits!r}: signed fixed point "
      "needs 2 bits or more for a zero level, and codes are at most 16 bits wide "
      "(use 2..16 bits, or bits=None on the op to keep the residual exact)."
    )
  return bits


def fixpoint_fields(bits: int) -> tuple[tuple[int, int], ...]:
  """(width, shift) of each packed field of `bits`-wide codes: one field for
  the widths `pack_codes` packs (2..8 and 16); 9..15 a low byte plus the
  (bits - 8) high bits, so that a code takes exactly `bits` bits.

  >>> fixpoint_fields(4), fixpoint_fields(11)
  (((4, 0),), ((8, 0), (3, 8)))
  """
  bits = _check_fixpoint_bits(bits)
  return ((bits, 0),) if bits <= 8 or bits == 16 else ((8, 0), (bits - 8, 8))


def pack_fixpoint_codes(codes: jax.Array, bits: int) -> tuple[PackedBits, ...]:
  """Non-negative codes < 2^bits, packed losslessly per row (`pack_codes`) in
  the fields of `fixpoint_fields`."""
  codes = jnp.asarray(codes).astype(jnp.uint32)
  return tuple(
    pack_codes(((codes >> s) & ((1 << w) - 1)).astype(jnp.uint16 if w > 8 else jnp.uint8), w)
    for w, s in fixpoint_fields(bits)
  )


def unpack_fixpoint_codes(fields) -> jax.Array:
  """Inverse of `pack_fixpoint_codes`: int32 codes in the packed shape."""
  out = None
  for packed, (_, shift) in zip(fields, fixpoint_fields(_fields_bits(fields))):
    part = unpack_codes(packed, jnp.int32) << shift
    out = part if out is None else out | part
  return out


def _fields_bits(fields) -> int:
  """The code width of packed fields (their widths summed)."""
  return sum(p.bits for p in fields)


def fixpoint_codes_bytes(shape: tuple[int, ...], bits: int) -> int:
  """Bytes `pack_fixpoint_codes` stores for codes of `shape` (`packed_codes_bytes`
  of each field: ceil(D * bits / 8) a row of D values, D rounded up to the
  packing's unit).

  >>> fixpoint_codes_bytes((4, 64), 11), fixpoint_codes_bytes((4, 64), 16)
  (352, 512)
  """
  return sum(packed_codes_bytes(shape, w) for w, _ in fixpoint_fields(bits))


@dataclasses.dataclass(frozen=True)
class Fixpoint(Compressor):
  """Per-channel max-abs scaled fixed point, round-to-nearest (deterministic).

  Attributes:
    bits: 2..16 (codes -L..L, L = 2^(bits-1) - 1, stored offset by L).

  Stored: `bits`-wide codes (densely packed, `pack_fixpoint_codes`) + float32
  scale per channel.
  Non-finite inputs come back exactly where they were: the scale is the
  largest *finite* abs(x) of the channel; a non-finite value gets the spare
  stored code 2^bits - 1 (code L + 1), and a channel holding one is flagged
  by the sign bit of its scale, whose two lowest mantissa bits (after
  rounding the scale up to a multiple of 4 ulps) say what that code decodes
  to: NaN, +inf or -inf (NaN when the channel mixes kinds), as in
  `jact._core.quantize`.
  """

  bits: int = 8

  method = "fixpoint"

  def __post_init__(self):
    _check_fixpoint_bits(self.bits)

  @property
  def unbiased(self) -> bool:
    return False

  @property
  def levels(self) -> int:
    """L: the largest code magnitude."""
    return (1 << (self.bits - 1)) - 1

  def with_bits(self, bits: int) -> "Fixpoint":
    return Fixpoint(_check_fixpoint_bits(bits))

  def scales(self, x: jax.Array) -> jax.Array:
    """float32[C]: the largest finite abs(x) per channel, flagged with the channel's
    non-finite kind (`flag_scale`) where it holds a non-finite value."""
    v = as_channel_rows(x.astype(jnp.float32))
    a = jnp.abs(v)
    scale = jnp.max(jnp.where(jnp.isfinite(a), a, 0.0), axis=0, initial=0.0)  # 0 for no values
    any_of = lambda m: jnp.any(m, axis=0)
    kind = nonfinite_kind(any_of(jnp.isnan(v)), any_of(v == jnp.inf), any_of(v == -jnp.inf))
    return flag_scale(scale, kind)

  def codes(self, x: jax.Array, scale: jax.Array) -> jax.Array:
    """int32 codes in [-L, L] (L + 1 for a non-finite value), shaped (values / C, C)."""
    scale, _, _ = split_scale(scale)
    v = as_channel_rows(x.astype(jnp.float32))
    clipped = jnp.where(jnp.isnan(v), 0.0, jnp.clip(v, -scale, scale))
    inv = jnp.where(scale > 0, self.levels / jnp.where(scale > 0, scale, 1.0), 0.0)
    q = jnp.clip(jnp.round(clipped * inv), -self.levels, self.levels).astype(jnp.int32)
    return jnp.where(jnp.isfinite(v), q, self.levels + 1)

  def values(self, codes: jax.Array, scale: jax.Array) -> jax.Array:
    """float32 reconstruction of (values / C, C) codes."""
    scale, flagged, kind = split_scale(scale)
    out = codes.astype(jnp.float32) * (scale / self.levels)
    special = jnp.broadcast_to(flagged, out.shape) & (codes == self.levels + 1)
    return jnp.where(special, jnp.broadcast_to(kind_value(kind), out.shape), out)

  def compress(self, x: jax.Array, seed=None) -> Compressed:
    self.check_input(x)
    scale = self.scales(x)
    q = self.codes(x, scale)
    # packed in the input's shape: one row of codes a sample (see `pack_codes`)
    fields = pack_fixpoint_codes((q + self.levels).reshape(x.shape), self.bits)
    arrays = {"codes": fields[0], "scale": scale}
    if len(fields) > 1:  # 9..15 bits: the high bits beside the low byte
      arrays["high"] = fields[1]
    return Compressed(arrays, self, tuple(x.shape), x.dtype)

  def decompress(self, stored: Compressed, dtype=None) -> jax.Array:
    fields = (stored.arrays["codes"],) + (
      (stored.arrays["high"],) if "high" in stored.arrays else ()
    )
    q = as_channel_rows(unpack_fixpoint_codes(fields)) - self.levels
    out = self.values(q, stored.arrays["scale"])
    return out.reshape(stored.shape).astype(dtype or stored.dtype)

  def stored_bytes(self, shape: tuple[int, ...], dtype: Any = None) -> int:
    """Packed codes (`fixpoint_codes_bytes`: ceil(D * bits / 8) a row of D values,
    D rounded up to the packing's unit) + 4 * C."""
    shape = tuple(int(s) for s in shape)
    return fixpoint_codes_bytes(shape, self.bits) + 4 * channels(shape)
