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
bytes: the layout and numerics are `jact._core.float8`'s, run by the
"float8_compress" kernel op (the XLA reference, or the Pallas kernel on a
GPU); decoding is plain XLA.

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

from jact._core.float8 import FORMATS, SCALES, Format, float8_values, pow2, row_layout
from jact.compressors._base import Compressed, Compressor, check_implementation
from jact.kernels._float8.api import float8_compress

__all__ = ["Float8"]


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
    implementation: the kernel ("xla", "jax_triton", "pallas_triton"; see `jact.kernels`),
      or None for the best one on the backend. Every kernel stores the same bits.

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
  implementation: str | None = None

  method = "float8"

  def __post_init__(self):
    _check_choice("format", self.format, FORMATS)
    _check_choice("scale", self.scale, SCALES)
    b = self.block_size
    if isinstance(b, bool) or not isinstance(b, (int, np.integer)) or b <= 0:
      raise ValueError(f"Float8 block_size must be a positive int (MXFP8 uses 32), got {b!r}.")
    if not isinstance(self.stochastic, (bool, np.bool_)):
      raise TypeError(
        f"stochastic must be True (unbiased stochastic rounding, needs a key) or False "
        f"(round to nearest even), got {type(self.stochastic).__name__} {self.stochastic!r}."
      )
    check_implementation(self.implementation, "float8_compress")

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

  def compress(self, x: jax.Array, seed) -> Compressed:
    self.check_input(x)
    codes, scale = float8_compress(
      x,
      seed,
      format=self.format,
      block_size=self.block_size,
      scale=self.scale,
      stochastic=self.stochastic,
      implementation=self.implementation,
    )
    return Compressed({"codes": codes, "scale": scale}, self, tuple(x.shape), x.dtype)

  def decompress(self, stored: Compressed, dtype=None) -> jax.Array:
    n, d, _ = row_layout(stored.shape, self.block_size)
    q = float8_values(stored.arrays["codes"].reshape(n, d), self.fmt)
    scale = stored.arrays["scale"]
    if self.scale == "pow2":
      scale = pow2(scale.astype(jnp.int32) - 127)
    per_value = jnp.repeat(scale, self.block_size, axis=1)[:, :d]
    out = jnp.where(jnp.isfinite(q), q * per_value, q)
    return out.reshape(stored.shape).astype(dtype or stored.dtype)

  def stored_bytes(self, shape: tuple[int, ...], dtype: Any = None) -> int:
    """One byte a value + `scale_bytes` a block of each sample's row."""
    shape = tuple(int(s) for s in shape)
    n, _, nb = row_layout(shape, self.block_size)
    return math.prod(shape) + n * nb * self.scale_bytes
