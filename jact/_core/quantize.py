"""Per-group quantization with stochastic rounding, and dense bit packing.

ActNN's layout: each sample split into groups of G values, each group
stored as a bfloat16 minimum and step (rounded outward, so rounding stays
unbiased) plus one packed `bits`-wide code per value. NaN/inf come
back exactly where they were (flagged groups); every finite float32 group is
covered. The layout, the non-finite flags and the range handling:
docs/design.md, "Per-group quantization". The XLA reference is
`jact.kernels._quantize.reference`; the entry points are `jact.quantize` /
`jact.dequantize`.

>>> import jax, jax.numpy as jnp
>>> from jact._core import rng
>>> x = jnp.linspace(-1.0, 1.0, 2 * 320).reshape(2, 320)
>>> g, (n, groups, d) = grouped(x, 160)
>>> minimum, stored, codes = group_codes(g, 15.0, rng.seed_from_key(jax.random.key(0)), d)
>>> g.shape, minimum.dtype, codes.dtype
((2, 2, 160), dtype(bfloat16), dtype('uint8'))
>>> y = decode_groups(codes.astype(jnp.float32), minimum.astype(jnp.float32)[..., None],
...                   stored.astype(jnp.float32)[..., None], 15.0, jnp.float32)
>>> bool(jnp.abs(y.reshape(x.shape) - x).max() <= 2 / 15)
True
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jact._core import rng, xla_cpu
from jact._core.packing import SUPPORTED_BITS, check_bits
from jact._core.stored import Stored, decoder

__all__ = [
  "Packed",
  "check_bits",
  "check_group_size",
  "check_float_dtype",
  "effective_group_size",
  "as_rows",
  "group_ranges_sq",
  "grouped",
  "finite_min_max",
  "grid_scale",
  "finite_clamp",
  "group_values",
  "group_codes",
  "group_extremes",
  "decode_groups",
  "flag_step",
  "split_step",
  "kind_value",
  "nonfinite_kind",
  "flagged_levels",
  "round_to",
  "lattice_codes",
  "bf16_directed",
  "bf16_round_directed",
  "SUPPORTED_BITS",
  "FLOAT_DTYPES",
]


FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def check_group_size(group_size: Any) -> int:
  """Validates a group size (a positive multiple of 8); returns it as int."""
  if (
    isinstance(group_size, bool)
    or not isinstance(group_size, (int, np.integer))
    or group_size <= 0
    or group_size % 8
  ):
    raise ValueError(
      f"group_size must be a positive multiple of 8 (so 1-bit codes fill whole "
      f"bytes), got {group_size!r}; the usual value is 256."
    )
  return int(group_size)


def check_float_dtype(x) -> jnp.dtype:
  dtype = jnp.dtype(x.dtype)
  if dtype not in FLOAT_DTYPES:
    raise TypeError(
      f"quantize takes float32, bfloat16 or float16 arrays, got {dtype}. Cast "
      "the input (x.astype(jnp.float32)); integer and boolean residuals are "
      "stored exactly instead (see jact.pack_codes for masks)."
    )
  return dtype


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Packed(Stored):
  """A per-group quantized tensor.

  Attributes:
    data: uint8[N, groups, group_size * bits // 8] packed codes (each group's
      codes packed as `jact._core.packing.pack_bits` packs a row).
    minimum: bfloat16[N, groups] group minimum (rounded down).
    scale: bfloat16[N, groups] quantization step (rounded up).
    shape, dtype, bits, group_size: static description of the quantized tensor.
    view_shape: shape `dequantize` returns when the tensor was quantized as a
      reshaped view (small samples as one row), else None.
  """

  data: jax.Array
  minimum: jax.Array
  scale: jax.Array
  shape: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
  dtype: Any = dataclasses.field(metadata=dict(static=True))
  bits: int = dataclasses.field(metadata=dict(static=True))
  group_size: int = dataclasses.field(metadata=dict(static=True))
  view_shape: tuple[int, ...] | None = dataclasses.field(default=None, metadata=dict(static=True))

  @property
  def nbytes(self) -> int:
    """Bytes actually stored (codes + bf16 group statistics)."""
    return int(self.data.size + 2 * self.minimum.size + 2 * self.scale.size)

  def decompress(self, dtype=None) -> jax.Array:
    """`jact.dequantize(self, dtype)` (the kernel for the backend)."""
    return decoder(Packed)(self, dtype)

  def map_ordered(self, fn) -> "Packed":
    """The codes and steps wait for the cotangent (the minimum need not)."""
    return dataclasses.replace(self, data=fn(self.data), scale=fn(self.scale))


def bf16_round_directed(x: jax.Array, up: bool) -> jax.Array:
  """float32 -> the float32 value of x rounded to bfloat16 towards +inf (up) or
  -inf (down), exactly. Shared by the reference and the Pallas kernels."""
  u = jax.lax.bitcast_convert_type(x, jnp.uint32)
  truncated = u & jnp.uint32(0xFFFF0000)
  inexact = (u & jnp.uint32(0xFFFF)) != 0
  negative = (u >> 31) == 1
  # Truncation moves toward zero; move one bf16 ulp away from zero when that is the wrong way.
  bump = inexact & (negative if not up else ~negative)
  out = truncated + (bump.astype(jnp.uint32) << 16)
  return jax.lax.bitcast_convert_type(out, jnp.float32)


def bf16_directed(x: jax.Array, up: bool) -> jax.Array:
  """Rounds to bfloat16 towards +inf (up) or -inf (down), exactly."""
  return bf16_round_directed(x.astype(jnp.float32), up).astype(jnp.bfloat16)


def effective_group_size(sample_size: int, group_size: int) -> int:
  """The group size actually used for samples of `sample_size` values.

  Samples shorter than a group use one group of their own length rounded up
  to 8. Otherwise the requested size, except in a program for the CPU, where
  padding a sample costs a full copy of the tensor (XLA:CPU never fuses a
  pad): there a size that divides the sample is chosen when one is at least a
  quarter of the request (`jact._core.xla_cpu.pad_free_group_size`).

  >>> from jact._core.xla_cpu import traced_for
  >>> with traced_for("cpu"):
  ...   [effective_group_size(n, 256) for n in (32 * 32 * 64, 784, 10)]
  [256, 112, 16]
  >>> with traced_for("cuda"):
  ...   effective_group_size(784, 256)
  256
  """
  group_size = check_group_size(group_size)
  if sample_size <= group_size:
    return max(8, -(-sample_size // 8) * 8)
  return xla_cpu.pad_free_group_size(sample_size, group_size)


def grouped(x: jax.Array, group_size: int):
  """(N, ...) -> (N, groups, G) view in the input dtype, padded with NaN."""
  n = x.shape[0] if x.ndim else 1
  d = math.prod(x.shape[1:]) if x.ndim else 1
  groups = -(-d // group_size)
  flat = x.reshape(n, d)
  if groups * group_size != d:
    # NaN padding is ignored by the finite-aware min/max and coded as 0.
    flat = jnp.pad(flat, ((0, 0), (0, groups * group_size - d)), constant_values=jnp.nan)
  return flat.reshape(n, groups, group_size), (n, groups, d)


def finite_min_max(g: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Min and max over the last axis of the finite values (+inf/-inf if none).

  One variadic reduce with a finite-aware reducer: XLA keeps the producer
  (padding, dtype conversion) inside the reduce fusion, whereas a plain
  `jnp.min(jnp.where(...))` is lowered on CPU to a library reduction that
  materializes the masked tensor (a full f32 copy per statistic).

  The initial values pass through an optimization barrier, so the reduce
  never has only constant operands: residuals that are constants (the zeros
  a JVP instantiates for a `where` branch) were otherwise folded by XLA's
  constant folder, which interprets a custom reducer at tens of microseconds
  per element (13 s for one 262,144-value tensor).
  """

  def reducer(a, b):
    (a_lo, a_hi), (b_lo, b_hi) = a, b
    lo = jax.lax.select(jnp.isfinite(b_lo) & ~(b_lo >= a_lo), b_lo, a_lo)
    hi = jax.lax.select(jnp.isfinite(b_hi) & ~(b_hi <= a_hi), b_hi, a_hi)
    return lo, hi

  g = g.astype(jnp.float32)
  init = jax.lax.optimization_barrier((jnp.float32(jnp.inf), jnp.float32(-jnp.inf)))
  return jax.lax.reduce((g, g), init, reducer, (g.ndim - 1,))


_WIDE = 2.0**100  # group ranges (and steps) from here on use the grid scaled by 1/4


def grid_scale(span: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(s, 1 / s): (0.25, 4) where `span` (a range or step, maybe inf) is at least
  2**100, else (1, 1). Scaling by a power of two is exact, so the scaled
  formulas give the unscaled bits wherever those do not overflow or flush."""
  wide = span >= jnp.float32(_WIDE)
  # lax.select, not jnp.where (a nested jit call per quantized residual) nor
  # arithmetic on the flag (1 - 0.75 * wide): Triton contracts that into a
  # fused multiply-add, which the kernels' exactness checks forbid.
  one = jnp.ones_like(span, jnp.float32)
  return (
    jax.lax.select(wide, jnp.full_like(one, 0.25), one),
    jax.lax.select(wide, jnp.full_like(one, 4.0), one),
  )


def finite_clamp(v: jax.Array, dtype) -> jax.Array:
  """float32 v clamped into the finite range of `dtype` (so casting cannot overflow)."""
  big = float(jnp.finfo(dtype).max)
  return jnp.minimum(jnp.maximum(v, -big), big)


def group_values(codes: jax.Array, minimum: jax.Array, step: jax.Array) -> jax.Array:
  """float32 codes * step + minimum without intermediate overflow (statistics
  broadcast against codes; groups with step >= 2**100 on the 1/4 grid)."""
  s, inv_s = grid_scale(step)
  return (codes * (step * s) + minimum * s) * inv_s


# Non-finite kinds of a flagged group (the two lowest mantissa bits of its bf16 step).
KIND_NAN, KIND_POS_INF, KIND_NEG_INF = 1, 2, 3
_SIGN = 0x80000000  # float32 bits of a bf16 value: bf16 bit i is float32 bit i + 16
_KIND_BITS = 0x30000
_SMALLEST_NORMAL = 0x00800000
_LARGEST_FLAGGED = 0x7F7C0000  # the largest bf16 whose two lowest mantissa bits are clear


def nonfinite_kind(has_nan, has_pos_inf, has_neg_inf) -> jax.Array:
  """int32 kind of a group from what it holds: 0 (all finite), NaN (any NaN, or
  both infinities), +inf or -inf."""
  # arithmetic on the flags, not selects between new constants: the result
  # keeps the flags' sharding (an Explicit mesh refuses unsharded cases)
  as_int = lambda flag: jnp.asarray(flag).astype(jnp.int32)
  return kind_of_bits(as_int(has_nan) | as_int(has_pos_inf) << 1 | as_int(has_neg_inf) << 2)


def flag_step(step: jax.Array, kind: jax.Array) -> jax.Array:
  """The stored step (float32 holding a bf16 value): `step` where kind is 0,
  else `step` rounded up to a multiple of 4 bf16 ulps (at least the smallest
  normal, at most 0x7F7C), with the kind in its two lowest mantissa bits and
  the sign bit set (the group's flag). Pure bit operations: shared by the
  reference and the kernels."""
  u = jax.lax.bitcast_convert_type(step, jnp.uint32)
  up = (u + jnp.uint32(_KIND_BITS)) & jnp.uint32(~_KIND_BITS & 0xFFFFFFFF)
  up = jnp.minimum(jnp.maximum(up, jnp.uint32(_SMALLEST_NORMAL)), jnp.uint32(_LARGEST_FLAGGED))
  flagged = up | (kind.astype(jnp.uint32) << 16) | jnp.uint32(_SIGN)
  return jax.lax.bitcast_convert_type(jax.lax.select(kind != 0, flagged, u), jnp.float32)


def split_step(stored: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(step, flagged, kind) of a stored step (float32 holding a bf16 value): the
  grid step with the flag and kind bits cleared, whether the group holds
  non-finite values (its sign bit: -0.0 would count, but is never stored), and
  the int32 kind (0 when not flagged)."""
  u = jax.lax.bitcast_convert_type(stored, jnp.uint32)
  flagged = (u >> 31) == 1
  step = jax.lax.select(flagged, u & jnp.uint32(0x7FFC0000), u)
  kind = jax.lax.select(flagged, ((u >> 16) & 3).astype(jnp.int32), jnp.zeros_like(u, jnp.int32))
  return jax.lax.bitcast_convert_type(step, jnp.float32), flagged, kind


def kind_value(kind: jax.Array) -> jax.Array:
  """float32 NaN, +inf or -inf for kinds 1, 2, 3 (NaN for any other)."""
  # *_like constants keep `kind`'s sharding (an Explicit mesh refuses unsharded cases)
  nan = jnp.full_like(kind, jnp.nan, jnp.float32)
  value = jax.lax.select(kind == KIND_POS_INF, jnp.full_like(kind, jnp.inf, jnp.float32), nan)
  return jax.lax.select(kind == KIND_NEG_INF, jnp.full_like(kind, -jnp.inf, jnp.float32), value)


def flagged_levels(levels: jax.Array, flagged: jax.Array) -> jax.Array:
  """The largest code a group's *finite* values take: levels (2**bits - 1), one
  less in a flagged group (the top code means "non-finite")."""
  return levels - flagged.astype(jnp.float32)  # arithmetic keeps `flagged`'s sharding


def round_to(v: jax.Array, dtype) -> jax.Array:
  """float32 v rounded to nearest-even in `dtype` (finite values in its range), as float32.

  Bit arithmetic, not a float32 -> dtype -> float32 convert pair: XLA:GPU may
  drop such a pair (excess precision is allowed by default), which on an H200
  made the XLA quantizer round bfloat16 values between unrounded grid points
  (137 codes of 1M differed from the CPU's). The same code runs in the kernels.
  """
  dtype = jnp.dtype(dtype)
  if dtype == jnp.float32:
    return v
  if dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    return v.astype(dtype).astype(jnp.float32)
  drop = 16 if dtype == jnp.bfloat16 else 13  # float32 significand bits the dtype lacks
  bits = jax.lax.bitcast_convert_type(v, jnp.uint32)
  odd = (bits >> drop) & jnp.uint32(1)
  kept = jnp.uint32((0xFFFFFFFF << drop) & 0xFFFFFFFF)
  rounded = jax.lax.bitcast_convert_type(
    (bits + jnp.uint32((1 << (drop - 1)) - 1) + odd) & kept, jnp.float32
  )
  if dtype == jnp.bfloat16:  # same exponent range as float32: no subnormals of its own
    return rounded
  # float16 subnormals (|v| < 2**-14) lie on a 2**-24 grid: round |v| * 2**24 (exact,
  # < 1024) to an integer, ties to even, in integer arithmetic.
  scaled = jnp.abs(v) * jnp.float32(2.0**24)
  whole = scaled.astype(jnp.int32)
  frac = scaled - whole.astype(jnp.float32)
  up = (frac > 0.5) | ((frac == 0.5) & ((whole & 1) == 1))
  tiny = (whole + up.astype(jnp.int32)).astype(jnp.float32) * jnp.float32(2.0**-24)
  tiny = jax.lax.select((bits >> 31) == 1, -tiny, tiny)  # -0.0 stays -0.0
  return jax.lax.select(jnp.abs(v) < jnp.float32(2.0**-14), tiny, rounded)


def decode_groups(
  codes: jax.Array, minimum: jax.Array, stored: jax.Array, levels, dtype, through=None
) -> jax.Array:
  """float32 reconstruction of codes (float32) with their groups' bf16 minimum
  and stored step as float32 (broadcast against codes): the grid value,
  clamped into the finite range of `through` (the quantized tensor's dtype;
  default `dtype`) and rounded to it, then clamped into `dtype`'s; or the
  group's non-finite kind for the top code of a flagged group."""
  through = jnp.dtype(through or dtype)
  step, flagged, kind = split_step(stored)
  value = round_to(finite_clamp(group_values(codes, minimum, step), through), through)
  if jnp.dtype(dtype) != through:
    value = finite_clamp(value, dtype)
  full = lambda a: jnp.broadcast_to(a, value.shape)
  top = codes == jnp.asarray(levels, jnp.float32)
  return jax.lax.select(full(flagged) & top, full(kind_value(kind)), value)


def lattice_codes(x, k_low, top, noise, minimum, stored, dtype, levels, divide=None):
  """Codes of float32 values x (of a float16 / bfloat16 tensor) rounded
  stochastically between the two *decoded* neighbours a <= x <= b (grid points
  k_low and k_low + 1 as `decode_groups` returns them in `dtype`): code
  k_low + 1 with probability (x - a) / (b - a). Decoding rounds grid points to
  the tensor's dtype, so rounding onto those points (not the float32 grid)
  keeps the reconstruction unbiased. `divide` is the float32 division (the
  kernels pass their correctly rounded one)."""
  divide = divide or (lambda a, b: a / b)
  a = decode_groups(k_low, minimum, stored, levels, dtype)
  b = decode_groups(k_low + 1.0, minimum, stored, levels, dtype)
  gap = b - a
  positive = gap > 0
  p = jax.lax.select(
    positive, divide(x - a, jax.lax.select(positive, gap, jnp.ones_like(gap))), jnp.zeros_like(gap)
  )
  up = jax.lax.select(noise < p, jnp.ones_like(p), jnp.zeros_like(p))
  return jnp.minimum(k_low + up, top)


def group_extremes(g: jax.Array, size: int | None = None):
  """(finite minimum, finite maximum, non-finite kind) of each group of g[..., G]
  (+inf, -inf, 0 without finite values). Only the first `size` values of each
  row of groups count (the rest is padding); all when None. One variadic
  reduce, as `finite_min_max`."""
  g = g.astype(jnp.float32)
  bits = jnp.where(g != g, 1, 0) | jnp.where(g == jnp.inf, 2, 0) | jnp.where(g == -jnp.inf, 4, 0)
  if size is not None and g.shape[-2] * g.shape[-1] != size:
    position = jax.lax.broadcasted_iota(jnp.int32, g.shape[-2:], 0) * g.shape[
      -1
    ] + jax.lax.broadcasted_iota(jnp.int32, g.shape[-2:], 1)
    bits = jnp.where(position < size, bits, 0)
  bits = bits.astype(jnp.int32)

  def reducer(a, b):
    (a_lo, a_hi, a_k), (b_lo, b_hi, b_k) = a, b
    lo = jax.lax.select(jnp.isfinite(b_lo) & ~(b_lo >= a_lo), b_lo, a_lo)
    hi = jax.lax.select(jnp.isfinite(b_hi) & ~(b_hi <= a_hi), b_hi, a_hi)
    return lo, hi, a_k | b_k

  init = jax.lax.optimization_barrier((jnp.float32(jnp.inf), jnp.float32(-jnp.inf), jnp.int32(0)))
  lo, hi, k = jax.lax.reduce((g, g, bits), init, reducer, (g.ndim - 1,))
  return lo, hi, kind_of_bits(k)


# kind of each or-ed bit set nan | 2 * (+inf) | 4 * (-inf), one nibble per set:
# 0 -> 0, only +inf -> KIND_POS_INF, only -inf -> KIND_NEG_INF, anything else -> KIND_NAN
_KIND_TABLE = 0x11131210


def kind_of_bits(k: jax.Array) -> jax.Array:
  """`nonfinite_kind` of int32 bit sets k = nan | 2 * (+inf) | 4 * (-inf), by a table
  lookup in one constant (3 operations instead of ~25: the statistics feed several
  fusions, each of which recomputes them)."""
  return (jnp.int32(_KIND_TABLE) >> (k * 4)) & 15


def group_codes(
  g: jax.Array,
  levels,
  seed: jax.Array | None,
  size: int | None = None,
  dtype=None,
  codes_dtype=None,
):
  """Group statistics and integer codes of grouped values g[N, groups, G].

  `levels` (2**bits - 1) is a number or an array broadcasting against the
  statistics [N, groups] (one per sample: `jact._core.persample`). With a `seed`
  the rounding is stochastic (noise hashed from each value's flat index),
  without it round-to-nearest. `size` is the number of values per sample
  (the rest of the last group is padding, coded 0). `dtype` is the tensor's
  dtype: float16 / bfloat16 values are rounded between decoded neighbours
  (`lattice_codes`). Returns (minimum, stored step) in bf16 and the codes in
  `codes_dtype` (default: uint16 when `levels` is a number above 255, i.e.
  16 bits, else uint8; pass uint16 with per-sample levels that reach 16 bits).
  """
  if codes_dtype is None:
    wide = isinstance(levels, (int, float, np.integer, np.floating)) and levels > 255
    codes_dtype = jnp.uint16 if wide else jnp.uint8
  levels = jnp.asarray(levels, jnp.float32)
  lo, hi, kind = group_extremes(g, size)
  flagged = kind != 0
  levels = levels + jnp.zeros_like(lo)  # broadcast with `lo`'s sharding (exact: + 0)
  finite_levels = flagged_levels(levels, flagged)
  single = finite_levels == 0  # 1 bit, flagged: one level for the finite values
  any_finite = lo <= hi
  zero = jnp.zeros_like(lo)
  # jax.lax.select rather than jnp.where / jnp.clip (each a nested jit call),
  # here and below: a model has one quantizer per residual, so its size is
  # multiplied by hundreds in tracing, lowering and XLA's passes.
  lo = jax.lax.select(any_finite & (lo != 0), lo, zero)  # a zero minimum is +0, whatever the order
  hi = jax.lax.select(any_finite & (hi != 0), hi, zero)
  lo = jax.lax.select(single, lo * 0.5 + hi * 0.5, lo)  # the single level: the midpoint
  # A minimum below -3.39e38 has no finite bf16 below it: values there are clipped.
  minimum = jnp.maximum(bf16_directed(lo, up=False), -jnp.finfo(jnp.bfloat16).max)
  lo_b = minimum.astype(jnp.float32)
  # Wide groups (range >= 2**100) work on the grid scaled by s = 1/4 (see the
  # module docstring); elsewhere s = 1 and the products below are exact no-ops.
  s, inv_s = grid_scale(hi - lo_b)
  # Multiply by 1/levels (an exact division of constants) rather than divide:
  # XLA rewrites a division by a constant into exactly this product, so the
  # step is the same whether `levels` is a constant or computed (per sample),
  # and GPU kernels reproduce it with one correctly rounded multiply.
  inv_levels = jax.lax.select(
    single,
    zero,
    jax.lax.select(
      flagged, jnp.float32(1.0) / jnp.maximum(levels - 1.0, 1.0), jnp.float32(1.0) / levels
    ),
  )
  scale = bf16_directed((hi * s - lo_b * s) * inv_levels * inv_s, up=True)
  scale = jnp.minimum(scale, jnp.finfo(jnp.bfloat16).max)  # 1 bit, range > 3.39e38: clipped
  stored = flag_step(scale.astype(jnp.float32), kind)
  step, _, _ = split_step(stored)
  positive = step > 0
  inv_step = jax.lax.select(
    positive, 1.0 / jax.lax.select(positive, step * s, jnp.ones_like(step)), zero
  )

  g = g.astype(jnp.float32)
  full = lambda a: jax.lax.broadcast_in_dim(a, g.shape, tuple(range(a.ndim)))
  lo_g = full(lo_b)
  clipped = jax.lax.select(
    g != g, lo_g, jnp.minimum(jnp.maximum(g, lo_g), full(hi))
  )  # NaN -> minimum
  v = (clipped * full(s) - full(lo_b * s)) * full(inv_step)
  if seed is not None:
    noise = rng.uniform_from_bits(rng.element_bits(seed, g.shape))  # 64-bit-safe flat index
  else:
    noise = jnp.float32(0.5)
  top = full(finite_levels)
  if dtype is None or jnp.dtype(dtype) == jnp.float32:
    # max(v, 0) is a no-op here (v >= 0) that keeps v + noise from being contracted into
    # one fused multiply-add with v's product: XLA:CPU does that, Triton's explicitly
    # rounded kernels do not, and the two roundings differ where v + noise is near an integer.
    codes = jnp.minimum(jnp.floor(jnp.maximum(v, 0.0) + noise), top)
  else:  # grid points decode rounded to dtype: round between those (see `lattice_codes`)
    k_low = jnp.minimum(jnp.maximum(jnp.floor(v), 0.0), jnp.maximum(top - 1.0, 0.0))
    codes = lattice_codes(
      clipped, k_low, top, jnp.broadcast_to(noise, g.shape), lo_g, full(stored), dtype, full(levels)
    )
  nonfinite = ~jnp.isfinite(g)
  if size is not None and g.shape[-2] * g.shape[-1] != size:
    position = jax.lax.broadcasted_iota(jnp.int32, g.shape, g.ndim - 2) * g.shape[
      -1
    ] + jax.lax.broadcasted_iota(jnp.int32, g.shape, g.ndim - 1)
    nonfinite = nonfinite & (position < size)
  codes = jax.lax.select(nonfinite, full(levels), codes)
  return minimum, stored.astype(jnp.bfloat16), codes.astype(codes_dtype)


SMALLEST_ROW = 8


def as_rows(shape: tuple[int, ...], group_size: int) -> tuple[int, ...]:
  """The shape quantized: the input's (a sample shorter than a group is a group
  of its own), or one row when the input is 1-D or its samples hold fewer than
  `SMALLEST_ROW` values, whose group statistics would cost more than their
  codes. Groups never span two samples otherwise: under data parallelism they
  would span devices, and their statistics would need collectives.

  >>> as_rows((64, 100), 256), as_rows((64, 4), 256), as_rows((10,), 256)
  ((64, 100), (1, 256), (1, 10))
  """
  d = math.prod(shape[1:]) if len(shape) else 1
  if len(shape) <= 1 or (d < group_size and d < SMALLEST_ROW):
    return (1, math.prod(shape))
  return tuple(shape)


def group_ranges_sq(x: jax.Array, group_size: int) -> jax.Array:
  """Per-sample sum over quantization groups of (group range)^2 and the largest
  group range, with x grouped as `jact.quantize` groups it."""
  x = jax.lax.stop_gradient(x)
  x = x.reshape(as_rows(tuple(x.shape), group_size))
  d = math.prod(x.shape[1:])
  g, _ = grouped(x, effective_group_size(d, group_size))
  lo, hi = finite_min_max(g)
  r = jnp.where(hi >= lo, hi - lo, 0.0)
  return jnp.sum(r * r, axis=-1), jnp.max(r), effective_group_size(d, group_size)
