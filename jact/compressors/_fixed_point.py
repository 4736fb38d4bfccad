"""AC-GC's scaled fixed point (AutoQuant) as a `Compressor`.

Per channel (the last axis) the scale is the largest finite abs(x) (non-finite
values are kept exactly: see `Fixpoint`); values are
rounded to the nearest of 2L + 1 levels -L..L (L = 2^(bits-1) - 1), so zero
stays exactly zero (which zero-value compression relies on) and every error
is at most scale / (2L). The width usually comes from an AC-GC plan
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
from jact._core.packing import pack_codes, packed_codes_bytes, unpack_codes
from jact._core.quantize import kind_value, nonfinite_kind

__all__ = ["Fixpoint", "FIXPOINT_BITS", "flag_scale", "split_scale"]


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


FIXPOINT_BITS = (2, 4, 8)


def _check_fixpoint_bits(bits: Any) -> int:
  if isinstance(bits, bool) or not isinstance(bits, int) or bits not in FIXPOINT_BITS:
    raise ValueError(
      f"Fixpoint bits must be one of {FIXPOINT_BITS}, got {bits!r}: signed "
      "fixed point needs 2 bits or more for a zero level (use 2, 4 or 8 bits)."
    )
  return bits


@dataclasses.dataclass(frozen=True)
class Fixpoint(Compressor):
  """Per-channel max-abs scaled fixed point, round-to-nearest (deterministic).

  Attributes:
    bits: 2, 4 or 8 (codes -L..L, L = 2^(bits-1) - 1, stored offset by L).

  Stored: `bits`-wide codes (densely packed) + float32 scale per channel.
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
    codes = pack_codes((q + self.levels).reshape(x.shape), self.bits)
    return Compressed({"codes": codes, "scale": scale}, self, tuple(x.shape), x.dtype)

  def decompress(self, stored: Compressed, dtype=None) -> jax.Array:
    q = as_channel_rows(unpack_codes(stored.arrays["codes"], jnp.int32)) - self.levels
    out = self.values(q, stored.arrays["scale"])
    return out.reshape(stored.shape).astype(dtype or stored.dtype)

  def stored_bytes(self, shape: tuple[int, ...], dtype: Any = None) -> int:
    """Packed codes (`packed_codes_bytes`: ceil(D / k) a row of D values) + 4 * C."""
    shape = tuple(int(s) for s in shape)
    return packed_codes_bytes(shape, self.bits) + 4 * channels(shape)
