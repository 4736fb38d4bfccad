"""FP8 codes with a per-block scale: the numerics shared by the XLA reference,
the Pallas kernel (`jact.kernels._float8`) and `jact.compressors.Float8`.

Layout: the row view of a tensor (the leading axis, the rest flattened; a 0-D
or 1-D tensor is one row) is cut into blocks of `block_size` consecutive
values. A block's scale maps its largest finite magnitude to at most the
format's largest value; a power-of-two scale is stored as its biased exponent
(E8M0: e + 127, e in [-126, 120]), a float scale as float32. Every value is
one uint8 code: its scaled value rounded onto the float8 grid (to nearest
even, or stochastically), in integer arithmetic on float32 bits, so every
backend stores the same bytes. Non-finite values get fixed codes: e5m2's
own NaN (0x7F) and infinities (0x7C, 0xFC); e4m3fn has no infinities, so NaN
is 0x7F, +inf its other NaN pattern 0xFF and -inf its negative zero 0x80
(zeros are always stored as +0).

>>> import jax.numpy as jnp
>>> v = jnp.array([0.3, -1.0, 1.0625, 448.0])
>>> round_to_float8(v, FORMATS["e4m3"], None).tolist()
[0.3125, -1.0, 1.0, 448.0]
>>> steps, k = rounded_steps(v, FORMATS["e4m3"], None)
>>> [hex(int(c)) for c in code_bits(steps, k, v < 0, FORMATS["e4m3"])]
['0x2a', '0xb8', '0x38', '0x7e']
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

__all__ = [
  "Format",
  "FORMATS",
  "SCALES",
  "NAN_CODE",
  "row_layout",
  "pow2",
  "exponent",
  "block_exponent",
  "rounded_steps",
  "round_to_float8",
  "float8_codes",
  "code_bits",
  "special_codes",
  "float8_values",
]

_F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class Format:
  """A float8 format: its JAX dtype, mantissa bits, smallest normal and largest
  exponent, largest finite value (1.75 * 2^emax for both), and infinity codes
  (+inf, -inf)."""

  dtype: Any
  mantissa: int
  emin: int
  emax: int
  max: float
  inf_codes: tuple[int, int]


FORMATS = {
  "e4m3": Format(jnp.float8_e4m3fn, 3, -6, 8, 448.0, (0xFF, 0x80)),
  "e5m2": Format(jnp.float8_e5m2, 2, -14, 15, 57344.0, (0x7C, 0xFC)),
}
SCALES = ("pow2", "float")
NAN_CODE = 0x7F  # a NaN in both formats
_MANTISSA_175 = 0x600000  # the float32 mantissa field of 1.75 (either format's largest value)


def row_layout(shape, block_size: int) -> tuple[int, int, int]:
  """(rows, values a row, blocks a row) of a tensor of `shape`."""
  shape = tuple(int(s) for s in shape)
  n = shape[0] if len(shape) >= 2 else 1
  d = math.prod(shape[1:]) if len(shape) >= 2 else math.prod(shape)
  return n, d, -(-d // block_size)


def pow2(k: jax.Array) -> jax.Array:
  """2^k as float32 for int32 k in [-126, 127] (exact, built from its exponent bits)."""
  return jax.lax.bitcast_convert_type((k + 127).astype(jnp.uint32) << 23, _F32)


def exponent(a: jax.Array) -> jax.Array:
  """floor(log2(a)) of float32 a >= 0 as int32 (-127 for zero and subnormals)."""
  u = jax.lax.bitcast_convert_type(a, jnp.uint32)
  return ((u >> 23) & jnp.uint32(0xFF)).astype(jnp.int32) - 127


def block_exponent(amax: jax.Array, fmt: Format) -> jax.Array:
  """int32 e in [-126, 120]: the least with amax / 2^e <= fmt.max (-126 for tiny amax)."""
  over = (jax.lax.bitcast_convert_type(amax, jnp.uint32) & jnp.uint32(0x7FFFFF)) > _MANTISSA_175
  return jnp.clip(exponent(amax) - fmt.emax + over.astype(jnp.int32), -126, 127)


def rounded_steps(v: jax.Array, fmt: Format, noise: jax.Array | None, mul=jnp.multiply):
  """(int32 magnitude in grid steps, int32 log2 of the step) of v's rounding.

  `mul`: the float32 multiply (a kernel passes one that is never fused with the
  subtraction that follows; the product is exact, so either way the bits agree)."""
  a = jnp.abs(v)
  k = jnp.maximum(exponent(a), fmt.emin) - fmt.mantissa  # log2 of the grid step at a
  t = mul(a, pow2(-k))  # a in steps: exact, < 2^(mantissa + 1)
  i = jnp.floor(t)
  frac = t - i  # exact
  if noise is None:
    odd = (i.astype(jnp.int32) & 1) == 1
    up = (frac > 0.5) | ((frac == 0.5) & odd)
  else:
    # 31 noise bits against frac in units of 2^-31, in int32 (a float -> uint32
    # conversion lowers as a signed one in Triton, which saturates at 2^31)
    up = (noise >> 1).astype(jnp.int32) < mul(frac, _F32(2.0**31)).astype(jnp.int32)
  return i.astype(jnp.int32) + up.astype(jnp.int32), k


def round_to_float8(v: jax.Array, fmt: Format, noise: jax.Array | None) -> jax.Array:
  """float32 v (finite, |v| <= fmt.max) rounded onto the float8 grid, as float32.

  With `noise` (uint32 random bits, v's shape) the rounding is stochastic: up
  with probability equal to v's distance above the lower grid point in units
  of the local step (exactly, except below the format's smallest normal, where
  the probability is truncated to a multiple of 2^-31); without it, to nearest even. Zero
  comes back as +0.
  """
  steps, k = rounded_steps(v, fmt, noise)
  q = steps.astype(_F32) * pow2(k)
  return jnp.where((v < 0) & (q > 0), -q, q)


def float8_codes(v: jax.Array, x: jax.Array, fmt: Format) -> jax.Array:
  """uint8 codes of grid values v (`round_to_float8`) by the float8 dtype's
  cast, with the special codes (`special_codes`) where x is not finite."""
  finite = jnp.isfinite(x)
  codes = jax.lax.bitcast_convert_type(jnp.where(finite, v, 0.0).astype(fmt.dtype), jnp.uint8)
  return jnp.where(finite, codes, special_codes(x, fmt))


def code_bits(steps: jax.Array, k: jax.Array, negative: jax.Array, fmt: Format) -> jax.Array:
  """uint8 codes of rounded values (`rounded_steps`: steps of 2^k) assembled from
  integers, no float8 dtype involved (what the kernel stores): the sign, then
  (k - k_min) * 2^m + steps, which is the exponent field and the mantissa (k_min:
  the log2 of the subnormal step). Zero is +0."""
  magnitude = ((k - (fmt.emin - fmt.mantissa)) << fmt.mantissa) + steps
  magnitude = jnp.where(steps == 0, 0, magnitude)
  return jnp.where(negative & (steps > 0), magnitude | 0x80, magnitude).astype(jnp.uint8)


def special_codes(x: jax.Array, fmt: Format) -> jax.Array:
  """uint8 codes of non-finite x: NaN_CODE, or the format's +inf / -inf codes."""
  pos, neg = fmt.inf_codes
  return jnp.where(jnp.isnan(x), NAN_CODE, jnp.where(x > 0, pos, neg)).astype(jnp.uint8)


def float8_values(codes: jax.Array, fmt: Format) -> jax.Array:
  """float32 values of uint8 codes (`float8_codes`), non-finite ones included."""
  v = jax.lax.bitcast_convert_type(codes, fmt.dtype).astype(_F32)
  pos, neg = fmt.inf_codes
  v = jnp.where(codes == pos, jnp.inf, v)
  return jnp.where(codes == neg, -jnp.inf, v)
