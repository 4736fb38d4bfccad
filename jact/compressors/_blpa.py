"""BLPA: sign-preserving K-bit fixed-point codes of a batch-normalized value.

Chakrabarti & Moseley, "Backprop with Approximate Activations for
Memory-efficient Network Training" (NeurIPS 2019), eqs. (9)-(10). A value A
with per-channel (last axis) mean beta_c and standard deviation gamma_c is
stored as K-bit codes (L = 2**K) on a grid of step h_c = 6 |gamma_c| / L:

  j     = ceil(A / h_c) - 1                 absolute bin (j h, (j+1) h]
  s_c   = floor(beta_c / h_c) - L / 2       first bin of the window (paper)
  code  = clip(j - s_c, 0, L - 1)           K bits, densely packed
  A~    = (s_c + code + 0.5) * h_c          bin centres

so A is clipped to about beta +- 3 gamma and, where not clipped, is off by at
most h_c / 2 = 3 |gamma_c| / L. Bin boundaries sit on multiples of h_c, so 0
is one: sign(A~) == sign(A) for every value inside the window.

Deviations from the paper, all for an exact ReLU mask (A~ > 0) == (A > 0):

1. Windows that do not straddle 0. When beta > 3 gamma (s_c >= 0) every bin
   is positive and clipped negatives would come back positive; when
   beta < -3 gamma (s_c + L - 1 <= -1) clipped positives would come back
   negative. Such a window stays around beta but spends one code on the
   other sign: its values use bins s_c+1 .. s_c+L-1 (the paper's lowest bin,
   on the beta - 3 gamma side, merges into the next one) and the freed code
   means "A <= 0" (bin -1, reconstructed as -h/2; code 0) or "A > 0" (bin 0,
   +h/2; code L-1). Signs are then exact for every value, and values within
   beta +- (3 gamma - h) keep the h/2 error bound. (Shifting the window to
   always hold bins -1 and 0 would also keep signs, but clips a channel with
   beta = 10 gamma to [0, 6 gamma], every value off by about 4 gamma.)
2. Bins are closed on the right, (j h, (j+1) h], instead of the paper's
   floor bins [j h, (j+1) h): A == 0 goes to bin -1 (negative), matching
   ReLU'(0) = 0; j is also forced to the side of A's sign, so a quotient
   A / h that underflows or rounds cannot flip it.
3. The step is at least 2**-20 |beta_c| (and 1e-30): a channel with
   gamma == 0 (constant) still gets a fine grid around beta, and window
   indices stay within +-2**20 (exact in float32 and int32).

As a generic compressor (`BLPA(bits)`) beta_c and gamma_c are the channel
mean and standard deviation of the tensor itself (over all axes but the last;
a 0-D or 1-D tensor is one channel; finite values only); for a training-mode batch-norm output
these are BN's beta and |gamma| sqrt(var / (var + eps)). `blpa_quantize`
takes them explicitly (the fused `jact.ops._blpa.blpa_block` passes BN's
parameters). Stored: the packed codes, ceil(n K / 8) bytes, plus per channel
the float32 step and the int32 window start (8 bytes per channel).

Non-finite values: BLPA cannot carry them -- all 2**K codes are in use and
its grid is per channel across the whole batch, so marking a value would
spread to every sample. A NaN or inf is stored as a finite bin (NaN as the
lowest, +-inf clipped to the window's ends) and the generic compressor takes
its statistics from finite values only, so the other samples' values are
stored exactly as without it. This is a documented limit: the gradient of
the affected element is finite where plain JAX's may not be (in the fused
`jact.ops._blpa.blpa_block`, batch norm's own statistics are already
non-finite then, as in plain JAX).

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

__all__ = ["BLPA", "BLPA_BITS", "check_blpa_bits", "blpa_grid", "blpa_encode", "blpa_decode",
           "blpa_quantize", "blpa_dequantize"]

BLPA_BITS = (2, 4, 8)
_MIN_STEP = 1e-30  # smallest step (a normal float32, also after * 0.5)
_REL_STEP = 2.0 ** -20  # smallest step relative to |beta|
_F32 = jnp.float32


def check_blpa_bits(bits: Any) -> int:
  """Validates a BLPA width (2, 4 or 8); returns it as int."""
  if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)) or int(bits) not in BLPA_BITS:
    hint = (" 1 bit would keep only the sign (a ReLU mask) and no value; use bits=2 or "
            "more (or jact.ops.relu, whose residual is that 1-bit mask)." if bits == 1 else "")
    raise ValueError(f"BLPA needs bits in {BLPA_BITS} (the paper uses 4 or 8), got {bits!r}."
                     + hint)
  return int(bits)


def blpa_grid(beta: jax.Array, gamma: jax.Array, bits: int) -> tuple[jax.Array, jax.Array]:
  """Per-channel step h (float32 > 0) and window start s (int32), eq. (9).

  h = max(6 |gamma| / 2**K, 2**-20 |beta|, 1e-30), s = floor(beta / h) - 2**(K-1);
  a window with s >= 0 or s + 2**K - 1 <= -1 spends one code on the other sign.
  """
  bits = check_blpa_bits(bits)
  levels = 2 ** bits
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
  levels = 2 ** bits
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


def blpa_decode(codes: jax.Array, step: jax.Array, start: jax.Array, bits: int,
                dtype=_F32) -> jax.Array:
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
    raise TypeError(f"blpa_quantize takes a float32, bfloat16 or float16 array, got {a.dtype}; "
                    "cast it first (a.astype(jnp.float32)).")
  shape = tuple(a.shape)
  channels = _channels(shape)
  beta, gamma = jnp.asarray(beta), jnp.asarray(gamma)
  if beta.size != channels or gamma.size != channels:
    raise ValueError(f"blpa_quantize: beta {beta.shape} and gamma {gamma.shape} need one value "
                     f"per channel (the last axis of a {shape}: {channels}).")
  step, start = blpa_grid(beta.reshape(channels), gamma.reshape(channels), bits)
  codes = blpa_encode(a, _broadcast_channels(step, shape), _broadcast_channels(start, shape), bits)
  return Compressed({"codes": pack_codes(codes, bits), "step": step, "start": start},
                    BLPA(bits), shape, jnp.dtype(a.dtype))


def blpa_dequantize(stored: Compressed, dtype=None) -> jax.Array:
  """Inverse of `blpa_quantize`: bin centres, shape of the input (its dtype unless given)."""
  arrays, shape = stored.arrays, tuple(stored.shape)
  codes = unpack_codes(arrays["codes"], jnp.uint8)
  out = blpa_decode(codes, _broadcast_channels(arrays["step"], shape),
                    _broadcast_channels(arrays["start"], shape), stored.compressor.bits)
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
