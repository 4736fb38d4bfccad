"""BLPA: sign-preserving K-bit fixed-point codes of a batch-normalized value.

Chakrabarti & Moseley (NeurIPS 2019), eqs. (9)-(10): per channel, K-bit codes
on a grid of step 6 |gamma| / 2**K around the channel mean, so values are
clipped to about beta +- 3 gamma. jact keeps the sign of every value exact, so
a ReLU mask read from the codes equals the exact one. Deterministic (biased);
cannot carry NaN/inf. The grid, the deviations from the paper and the stored
bytes: docs/design.md, "BLPA".

>>> import jax, jax.numpy as jnp
>>> c = BLPA(bits=4)
>>> x = jnp.linspace(-3.0, 5.0, 4 * 8 * 16).reshape(4, 8, 16)
>>> stored = jax.jit(c.compress)(x, None)
>>> stored.nbytes == c.stored_bytes(x.shape, x.dtype) == 4 * 8 * 16 * 4 // 8 + 8 * 16
True
>>> bool(((jax.jit(c.decompress)(stored) > 0) == (x > 0)).all())
True
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jact.compressors._base import Compressed, Compressor, as_channel_rows, channels as _channels
from jact._core.quantize import FLOAT_DTYPES
from jact._core.packing import pack_codes, packed_codes_bytes, unpack_codes

__all__ = [
  "BLPA",
  "BLPA_BITS",
  "check_blpa_bits",
  "blpa_grid",
  "blpa_encode",
  "blpa_decode",
  "blpa_quantize",
  "blpa_dequantize",
]

BLPA_BITS = (2, 4, 8)
_MIN_STEP = 1e-30  # smallest step (a normal float32, also after * 0.5)
_REL_STEP = 2.0**-20  # smallest step relative to |beta|
_F32 = jnp.float32


def check_blpa_bits(bits: Any) -> int:
  """Validates a BLPA width (2, 4 or 8); returns it as int."""
  if (
    isinstance(bits, bool) or not isinstance(bits, (int, np.integer)) or int(bits) not in BLPA_BITS
  ):
    hint = (
      " 1 bit would keep only the sign (a ReLU mask) and no value; use bits=2 or "
      "more (or jact.ops.relu, whose residual is that 1-bit mask)."
      if bits == 1
      else ""
    )
    raise ValueError(
      f"BLPA needs bits in {BLPA_BITS} (the paper uses 4 or 8), got {bits!r}." + hint
    )
  return int(bits)


def blpa_grid(beta: jax.Array, gamma: jax.Array, bits: int) -> tuple[jax.Array, jax.Array]:
  """Per-channel step h (float32 > 0) and window start s (int32), eq. (9).

  h = max(6 |gamma| / 2**K, 2**-20 |beta|, 1e-30), s = floor(beta / h) - 2**(K-1);
  a window with s >= 0 or s + 2**K - 1 <= -1 spends one code on the other sign.
  """
  bits = check_blpa_bits(bits)
  levels = 2**bits
  beta = jnp.nan_to_num(jnp.asarray(beta, _F32))
  step = 6.0 * jnp.abs(jnp.asarray(gamma, _F32)) / levels
  step = jnp.maximum(jnp.maximum(step, jnp.abs(beta) * _REL_STEP), _MIN_STEP)
  start = jnp.floor(beta / step) - levels // 2  # |beta / step| <= 2**20
  return step, start.astype(jnp.int32)


def _sign_codes(start, levels: int):
  """(window all positive, window all negative): then code 0 (resp. L-1) is a sign code."""
  return start >= 0, start + (levels - 1) <= -1


def blpa_encode(a: jax.Array, step: jax.Array, start: jax.Array, bits: int) -> jax.Array:
  """uint8 codes in [0, 2**K) of `a` on the grid (step, start) (broadcast against a)."""
  bits = check_blpa_bits(bits)
  levels = 2**bits
  a = jnp.asarray(a).astype(_F32)
  pos = a > 0
  j = jnp.ceil(a / step) - 1.0  # bin (j h, (j+1) h]
  # Keep the bin on the side of a's sign (a / h may underflow to 0 or round).
  j = jnp.where(pos, jnp.maximum(j, 0.0), jnp.minimum(j, -1.0))
  all_pos, all_neg = _sign_codes(start, levels)
  # value codes: bins start+c (straddling window), start+c for c >= 1 (all positive),
  # start+1+c for c <= L-2 (all negative); the remaining code is the sign code.
  lo = jnp.where(all_pos, 1.0, 0.0)
  hi = jnp.where(all_neg, levels - 2.0, levels - 1.0)
  offset = jnp.where(all_neg, 1.0, 0.0)
  code = jnp.clip(jnp.nan_to_num(j - start.astype(_F32) - offset), lo, hi)
  code = jnp.where(all_pos & ~pos, 0.0, code)
  code = jnp.where(all_neg & pos, levels - 1.0, code)
  return code.astype(jnp.uint8)


def blpa_decode(
  codes: jax.Array, step: jax.Array, start: jax.Array, bits: int, dtype=_F32
) -> jax.Array:
  """Bin centres (bin + 0.5) * step of uint8 codes (see `blpa_encode` for the bins)."""
  levels = 2 ** check_blpa_bits(bits)
  codes = codes.astype(jnp.int32)
  all_pos, all_neg = _sign_codes(start, levels)
  b = start + codes + all_neg.astype(jnp.int32)
  b = jnp.where(all_pos & (codes == 0), -1, b)
  b = jnp.where(all_neg & (codes == levels - 1), 0, b)
  return ((b.astype(_F32) + 0.5) * step).astype(dtype)  # exact: |b| <= 2**20 + 2**8


def _broadcast_channels(v, shape):
  """A per-channel vector shaped to broadcast over `shape` (channels last)."""
  return v.reshape((1,) * (len(shape) - 1) + (-1,)) if len(shape) >= 2 else v.reshape(())


def blpa_quantize(a: jax.Array, beta: jax.Array, gamma: jax.Array, bits: int = 4) -> Compressed:
  """BLPA codes of `a` given its per-channel beta (mean) and gamma (std), eqs. (9)-(10).

  Returns a `Compressed` (packed codes, float32 step and int32 window start
  per channel) that `blpa_dequantize` or `.decompress()` reconstructs.

  >>> import jax, jax.numpy as jnp
  >>> a = jnp.array([[-2.0, 0.0], [0.3, 5.0]])
  >>> jax.jit(lambda a: blpa_dequantize(blpa_quantize(a, jnp.zeros(2), jnp.ones(2), 8)))(a) > 0
  Array([[False, False],
         [ True,  True]], dtype=bool)
  """
  bits = check_blpa_bits(bits)
  a = jnp.asarray(a)
  if jnp.dtype(a.dtype) not in FLOAT_DTYPES:
    raise TypeError(
      f"blpa_quantize takes a float32, bfloat16 or float16 array, got {a.dtype}; "
      "cast it first (a.astype(jnp.float32))."
    )
  shape = tuple(a.shape)
  channels = _channels(shape)
  beta, gamma = jnp.asarray(beta), jnp.asarray(gamma)
  if beta.size != channels or gamma.size != channels:
    raise ValueError(
      f"blpa_quantize: beta {beta.shape} and gamma {gamma.shape} need one value "
      f"per channel (the last axis of a {shape}: {channels})."
    )
  step, start = blpa_grid(beta.reshape(channels), gamma.reshape(channels), bits)
  codes = blpa_encode(a, _broadcast_channels(step, shape), _broadcast_channels(start, shape), bits)
  return Compressed(
    {"codes": pack_codes(codes, bits), "step": step, "start": start},
    BLPA(bits),
    shape,
    jnp.dtype(a.dtype),
  )


def blpa_dequantize(stored: Compressed, dtype=None) -> jax.Array:
  """Inverse of `blpa_quantize`: bin centres, shape of the input (its dtype unless given)."""
  arrays, shape = stored.arrays, tuple(stored.shape)
  codes = unpack_codes(arrays["codes"], jnp.uint8)
  out = blpa_decode(
    codes,
    _broadcast_channels(arrays["step"], shape),
    _broadcast_channels(arrays["start"], shape),
    stored.compressor.bits,
  )
  return out.astype(stored.dtype if dtype is None else dtype)


@dataclasses.dataclass(frozen=True)
class BLPA(Compressor):
  """BLPA K-bit codes (Chakrabarti & Moseley 2019), with the tensor's own channel statistics.

  Deterministic and biased; signs (so ReLU masks) are exact. See the module
  docstring for the grid and the deviations from the paper.

  Attributes:
    bits: 2, 4 or 8 bits per value (the paper uses 4 and 8).
  """

  bits: int = 4

  method = "blpa"

  def __post_init__(self):
    check_blpa_bits(self.bits)

  @property
  def unbiased(self) -> bool:
    return False

  def with_bits(self, bits: int) -> "BLPA":
    return dataclasses.replace(self, bits=bits)

  def compress(self, x: jax.Array, seed=None) -> Compressed:
    self.check_input(x)
    x32 = as_channel_rows(x.astype(_F32))
    if not x32.shape[0]:  # no values: no statistics (the mean of nothing is NaN)
      beta = gamma = jnp.zeros(x32.shape[1], _F32)
    else:  # from the finite values only: one sample's NaN must not reach the others
      finite = jnp.isfinite(x32)
      count = jnp.maximum(jnp.sum(finite, 0), 1).astype(_F32)
      beta = jnp.sum(jnp.where(finite, x32, 0.0), 0) / count
      gamma = jnp.sqrt(jnp.sum(jnp.where(finite, jnp.square(x32 - beta), 0.0), 0) / count)
    return blpa_quantize(x, beta, gamma, self.bits)

  def decompress(self, stored: Compressed, dtype=None) -> jax.Array:
    return blpa_dequantize(stored, dtype)

  def stored_bytes(self, shape: tuple[int, ...], dtype: Any = None) -> int:
    """Packed codes (`packed_codes_bytes`: ceil(D * bits / 8) a row of D values) + 8 bytes
    (float32 step, int32 start) per channel."""
    shape = tuple(int(s) for s in shape)
    return packed_codes_bytes(shape, self.bits) + 8 * _channels(shape)
