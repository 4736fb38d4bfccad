"""FP8 residual storage (as COAT, TransformerEngine's MXFP8 and PyTorch's FP8
activation offload store them) as a `Compressor`.

Each sample's values (the row view: the leading axis, the rest flattened) are
split into blocks of `block_size` consecutive values; a block keeps one scale,
chosen so that its largest finite magnitude maps to at most the format's
largest value (no overflow), and every value becomes one float8 code
(`float8_e4m3fn` or `float8_e5m2`, stored as its uint8 bit pattern). The
scale is a power of two stored as a biased exponent byte (MXFP8's E8M0:
1 byte a block, decoding is exact) or a float32 (4 bytes a block). Values are
rounded to the float8 grid to nearest even, or stochastically (unbiased),
in integer arithmetic on the float32 bits, so every backend stores the same
bytes: the XLA code here is the reference (there is no Pallas kernel).

>>> import jax.numpy as jnp
>>> from jact.compressors import Float8
>>> x = jnp.array([[0.0, 1.0, -3.0, 448.0], [0.5, -0.25, 2.0, 7.0]])
>>> c = Float8("e4m3", block_size=4)
>>> stored = c.compress(x, None)
>>> c.decompress(stored).tolist() == x.tolist(), stored.nbytes, c.stored_bytes(x.shape)
(True, 10, 10)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jact._core import rng
from jact.compressors._base import Compressed, Compressor

__all__ = ["Float8", "FORMATS", "Format", "round_to_float8", "float8_codes", "float8_values"]

_F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class Format:
  """A float8 format: its JAX dtype, mantissa bits, smallest normal and largest
  exponent, and largest finite value (1.75 * 2^emax for both)."""

  dtype: Any
  mantissa: int
  emin: int
  emax: int
  max: float


FORMATS = {
  "e4m3": Format(jnp.float8_e4m3fn, 3, -6, 8, 448.0),
  "e5m2": Format(jnp.float8_e5m2, 2, -14, 15, 57344.0),
}

# e4m3fn has NaN (0x7F, 0xFF) but no infinities: +inf is stored in 0xFF (its
# second NaN pattern) and -inf in 0x80 (its negative zero: zeros are stored as +0).
_E4M3_NAN, _E4M3_POS_INF, _E4M3_NEG_INF = 0x7F, 0xFF, 0x80
_MANTISSA_175 = 0x600000  # the float32 mantissa field of 1.75 (either format's largest value)


def _pow2(k: jax.Array) -> jax.Array:
  """2^k as float32 for int32 k in [-126, 127] (exact, built from its exponent bits)."""
  return jax.lax.bitcast_convert_type((k + 127).astype(jnp.uint32) << 23, _F32)


def _exponent(a: jax.Array) -> jax.Array:
  """floor(log2(a)) of float32 a >= 0 as int32 (-127 for zero and subnormals)."""
  u = jax.lax.bitcast_convert_type(a, jnp.uint32)
  return ((u >> 23) & jnp.uint32(0xFF)).astype(jnp.int32) - 127


def round_to_float8(v: jax.Array, fmt: Format, noise: jax.Array | None) -> jax.Array:
  """float32 v (finite, |v| <= fmt.max) rounded onto the float8 grid, as float32.

  With `noise` (uint32 random bits, v's shape) the rounding is stochastic: up
  with probability equal to v's distance above the lower grid point in units
  of the local step (exactly, except below the format's smallest normal, where
  the probability is truncated to 2^-32); without it, to nearest even. Zero
  comes back as +0.
  """
  a = jnp.abs(v)
  k = jnp.maximum(_exponent(a), fmt.emin) - fmt.mantissa  # log2 of the grid step at a
  t = a * _pow2(-k)  # a in steps: exact, < 2^(mantissa + 1)
  i = jnp.floor(t)
  frac = t - i  # exact
  if noise is None:
    odd = (i.astype(jnp.int32) & 1) == 1
    up = (frac > 0.5) | ((frac == 0.5) & odd)
  else:
    up = noise < (frac * _F32(2.0**32)).astype(jnp.uint32)
  q = (i + up.astype(_F32)) * _pow2(k)
  return jnp.where((v < 0) & (q > 0), -q, q)


def float8_codes(v: jax.Array, x: jax.Array, fmt: Format) -> jax.Array:
  """uint8 codes of grid values v (`round_to_float8`), with x's non-finite
  values where x has them (e5m2 natively; e4m3 in its spare patterns)."""
  finite = jnp.isfinite(x)
  if fmt.dtype == jnp.float8_e5m2:
    return jax.lax.bitcast_convert_type(jnp.where(finite, v, x).astype(fmt.dtype), jnp.uint8)
  codes = jax.lax.bitcast_convert_type(jnp.where(finite, v, 0.0).astype(fmt.dtype), jnp.uint8)
  special = jnp.where(
    jnp.isnan(x), _E4M3_NAN, jnp.where(x > 0, _E4M3_POS_INF, _E4M3_NEG_INF)
  ).astype(jnp.uint8)
  return jnp.where(finite, codes, special)


def float8_values(codes: jax.Array, fmt: Format) -> jax.Array:
  """float32 values of uint8 codes (`float8_codes`), non-finite ones included."""
  v = jax.lax.bitcast_convert_type(codes, fmt.dtype).astype(_F32)
  if fmt.dtype == jnp.float8_e4m3fn:
    v = jnp.where(codes == _E4M3_POS_INF, jnp.inf, v)
    v = jnp.where(codes == _E4M3_NEG_INF, -jnp.inf, v)
  return v


def _check_choice(name: str, value: Any, choices) -> None:
  if not isinstance(value, str) or value not in choices:
    raise ValueError(f"Float8 {name} must be one of {sorted(choices)}, got {value!r}.")


@dataclasses.dataclass(frozen=True)
class Float8(Compressor):
  """FP8 codes with a per-block scale (MXFP8 by default).

  Attributes:
    format: "e4m3" (float8_e4m3fn: 3 mantissa bits, largest 448) or "e5m2"
      (float8_e5m2: 2 mantissa bits, largest 57344, native infinities).
    block_size: values per scale, consecutive in each sample's flattened row
      (32 in MXFP8).
    scale: "pow2" (a power of two a block, one E8M0 byte; decoding is exact)
      or "float" (the block's largest finite magnitude / the format's largest
      value, one float32).
    stochastic: unbiased stochastic rounding (needs a key), or round to
      nearest even.

  Stored: one uint8 code per value (in the input's shape) + one scale a block
  (uint8 or float32, per sample). Non-finite values come back exactly where
  they were: the scale is taken over finite values only; e5m2 stores NaN and
  +-inf natively, e4m3 stores NaN as its NaN code, +inf in 0xFF (its other
  NaN pattern) and -inf in 0x80 (its negative zero: zeros are stored as +0).
  A power-of-two scale is at least 2^-126, so a block whose largest value is
  below about 2^-118 keeps fewer significant bits (float8 subnormals).
  """

  format: str = "e4m3"
  block_size: int = 32
  scale: str = "pow2"
  stochastic: bool = False

  method = "float8"

  def __post_init__(self):
    _check_choice("format", self.format, FORMATS)
    _check_choice("scale", self.scale, ("pow2", "float"))
    b = self.block_size
    if isinstance(b, bool) or not isinstance(b, (int, np.integer)) or b <= 0:
      raise ValueError(f"Float8 block_size must be a positive int (MXFP8 uses 32), got {b!r}.")
    if not isinstance(self.stochastic, (bool, np.bool_)):
      raise TypeError(
        f"stochastic must be True (unbiased stochastic rounding, needs a key) or False "
        f"(round to nearest even), got {type(self.stochastic).__name__} {self.stochastic!r}."
      )

  @property
  def fmt(self) -> Format:
    """The float8 format's constants."""
    return FORMATS[self.format]

  @property
  def unbiased(self) -> bool:
    return bool(self.stochastic)

  @property
  def needs_key(self) -> bool:
    return bool(self.stochastic)

  @property
  def bits(self) -> int:
    return 8

  @property
  def scale_bytes(self) -> int:
    """Bytes of one block's scale."""
    return 1 if self.scale == "pow2" else 4

  @property
  def average_bits(self) -> float:
    return 8.0 + 8.0 * self.scale_bytes / self.block_size

  def with_bits(self, bits: int) -> "Float8":
    if bits == 8 and not isinstance(bits, bool):
      return self
    raise ValueError(
      f"{self!r} stores 8-bit float codes only, so a plan cannot give it {bits!r} bits: "
      f"give this residual a compressor entry instead (e.g. jact.compressors.PerGroup({bits!r}) "
      "or Fixpoint), or the width 8."
    )

  def _rows(self, shape: tuple[int, ...]) -> tuple[int, int, int]:
    """(samples, values a sample, blocks a sample) of the row view."""
    n = int(shape[0]) if len(shape) >= 2 else 1
    d = math.prod(shape[1:]) if len(shape) >= 2 else math.prod(shape)
    return n, d, -(-d // self.block_size)

  def _blocks(self, v: jax.Array, n: int, d: int, nb: int) -> jax.Array:
    """(n, d) values as (n, nb, block_size), zero-padded."""
    return jnp.pad(v, ((0, 0), (0, nb * self.block_size - d))).reshape(n, nb, self.block_size)

  def _per_value(self, s: jax.Array, n: int, d: int) -> jax.Array:
    """(n, nb) block values broadcast to (n, d)."""
    return jnp.repeat(s, self.block_size, axis=1)[:, :d]

  def compress(self, x: jax.Array, seed) -> Compressed:
    self.check_input(x)
    fmt, shape = self.fmt, tuple(x.shape)
    n, d, nb = self._rows(shape)
    v = x.astype(_F32).reshape(n, d)
    a = jnp.abs(self._blocks(v, n, d, nb))
    amax = jnp.max(jnp.where(jnp.isfinite(a), a, 0.0), axis=-1, initial=0.0)
    if self.scale == "pow2":  # the least 2^e with amax / 2^e <= fmt.max
      over = (jax.lax.bitcast_convert_type(amax, jnp.uint32) & 0x7FFFFF) > _MANTISSA_175
      e = jnp.clip(_exponent(amax) - fmt.emax + over.astype(jnp.int32), -126, 127)
      scale = (e + 127).astype(jnp.uint8)
      scaled = v * self._per_value(_pow2(-e), n, d)
    else:
      scale = amax / _F32(fmt.max)
      s = self._per_value(scale, n, d)
      scaled = jnp.clip(jnp.where(s > 0, v / jnp.where(s > 0, s, 1.0), 0.0), -fmt.max, fmt.max)
    finite = jnp.isfinite(v)
    scaled = jnp.where(finite, scaled, 0.0)
    noise = rng.element_bits(seed, shape).reshape(n, d) if self.stochastic else None
    codes = float8_codes(round_to_float8(scaled, fmt, noise), v, fmt)
    return Compressed({"codes": codes.reshape(shape), "scale": scale}, self, shape, x.dtype)

  def decompress(self, stored: Compressed, dtype=None) -> jax.Array:
    n, d, _ = self._rows(stored.shape)
    q = float8_values(stored.arrays["codes"].reshape(n, d), self.fmt)
    scale = stored.arrays["scale"]
    if self.scale == "pow2":
      scale = _pow2(scale.astype(jnp.int32) - 127)
    out = jnp.where(jnp.isfinite(q), q * self._per_value(scale, n, d), q)
    return out.reshape(stored.shape).astype(dtype or stored.dtype)

  def stored_bytes(self, shape: tuple[int, ...], dtype: Any = None) -> int:
    """One byte a value + `scale_bytes` a block of each sample's row."""
    shape = tuple(int(s) for s in shape)
    n, _, nb = self._rows(shape)
    return math.prod(shape) + n * nb * self.scale_bytes
