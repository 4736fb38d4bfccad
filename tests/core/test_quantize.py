"""Tests for jact.quantize: bit packing, rounding error, unbiasedness, variance,
padding, non-finite inputs, sizes, errors and compiled memory."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jact
from jact._core.quantize import Packed, effective_group_size, split_step
from jact._core.packing import (
  SUPPORTED_BITS,
  PackedBits,
  code_dtype,
  pack_bits,
  pack_codes,
  packing_unit,
  unpack_bits,
  unpack_codes,
)
from jact.kernels._quantize.api import dequantize, quantize
from stats import assert_unbiased

BITS = SUPPORTED_BITS  # 1-8 and 16
DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
HYP = settings(max_examples=12, deadline=None, derandomize=True)

# Jitted entry points: eager dispatch compiles every small op separately, which dominates runtime.
# Unoptimized (level 0), they compile faster; the assertions are on codes, grids and statistics
# with float32 slack. (The code-boundary test below, whose point is the exact float32 rounding
# sequence, compiles as users do.)
_jit = functools.partial(jax.jit, compiler_options={"xla_backend_optimization_level": 0})
_quantize = _jit(quantize, static_argnames=("bits", "group_size", "stochastic"))
_dequantize = _jit(dequantize, static_argnums=1)
_pack_bits = _jit(pack_bits, static_argnums=1)
_unpack_bits = _jit(unpack_bits, static_argnums=1)
_pack_codes = _jit(pack_codes, static_argnums=1)
_unpack_codes = _jit(unpack_codes, static_argnums=1)


@functools.partial(_jit, static_argnames=("bits", "group_size", "stochastic"))
def _roundtrip(x, key=None, *, bits, group_size=256, stochastic=True):
  """(Packed, dequantized) in one compile."""
  p = quantize(x, key, bits=bits, group_size=group_size, stochastic=stochastic)
  return p, dequantize(p)


def _normal(shape, seed=0, dtype=jnp.float32):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def _per_element(stat, packed):
  """Broadcasts a per-group statistic [N, groups] to the elements [N, D] (float64)."""
  n = packed.shape[0]
  d = math.prod(packed.shape[1:])
  s = np.repeat(np.asarray(stat, np.float64), packed.group_size, axis=1)
  return s[:, :d].reshape(n, d)


# ----------------------------------------------------------------------------- bit packing


def _planar_reference(codes, bits):
  """Independent numpy packing. Widths dividing 8: byte j holds codes j, j+q, j+2q, ...
  (q = n // k); 3, 5, 6, 7 bits: byte j of plane p holds bit p of code i*m + j in its
  bit i (m = n // 8); 16 bits: the low bytes, then the high bytes."""
  if bits == 16:
    return np.concatenate([codes & 255, codes >> 8], axis=-1).astype(np.uint8)
  if 8 % bits:
    m = codes.shape[-1] // 8
    planes = [
      sum(((codes[..., i * m : (i + 1) * m].astype(np.uint16) >> p) & 1) << i for i in range(8))
      for p in range(bits)
    ]
    return np.concatenate(planes, axis=-1).astype(np.uint8)
  k = 8 // bits
  q = codes.shape[-1] // k
  out = np.zeros(codes.shape[:-1] + (q,), np.uint16)
  for i in range(k):
    out |= codes[..., i * q : (i + 1) * q].astype(np.uint16) << (bits * i)
  return out.astype(np.uint8)


@pytest.mark.slow
@HYP
@given(
  bits=st.sampled_from(BITS),
  lead=st.lists(st.integers(1, 4), max_size=2),
  n_units=st.integers(1, 40),
  seed=st.integers(0, 2**31),
)
def test_pack_bits_roundtrip_and_layout(bits, lead, n_units, seed):
  n = n_units * packing_unit(bits)
  shape = tuple(lead) + (n,)
  codes = np.random.default_rng(seed).integers(0, 2**bits, shape).astype(code_dtype(bits))
  packed = _pack_bits(jnp.asarray(codes), bits)
  assert packed.dtype == jnp.uint8 and packed.shape == tuple(lead) + (n * bits // 8,)
  np.testing.assert_array_equal(np.asarray(packed), _planar_reference(codes, bits))
  np.testing.assert_array_equal(np.asarray(_unpack_bits(packed, bits)), codes)


@pytest.mark.slow
@HYP
@given(
  bits=st.sampled_from(BITS),
  shape=st.lists(st.integers(0, 9), min_size=0, max_size=3),
  seed=st.integers(0, 2**31),
)
def test_pack_codes_roundtrip(bits, shape, seed):
  shape = tuple(shape)
  rng = np.random.default_rng(seed)
  n = math.prod(shape)
  if bits == 1:
    codes = rng.integers(0, 2, shape).astype(bool)
  else:
    codes = rng.integers(0, 2**bits, shape).astype(np.int32)
  p = _pack_codes(jnp.asarray(codes), bits)
  assert isinstance(p, PackedBits) and p.shape == shape and p.bits == bits
  # per row of the leading axis (a 0-d or 1-d array is one row), at least one byte a row
  rows, d = (shape[0], n // shape[0] if shape[0] else 0) if len(shape) >= 2 else (1, n)
  unit = packing_unit(bits)
  assert p.nbytes == rows * -(-max(1, d) // unit) * unit * bits // 8
  assert p.nbytes == sum(leaf.nbytes for leaf in jax.tree.leaves(p))
  back = _unpack_codes(p)
  assert back.shape == shape
  assert back.dtype == (jnp.bool_ if bits == 1 else code_dtype(bits))
  np.testing.assert_array_equal(np.asarray(back), codes)
  np.testing.assert_array_equal(np.asarray(_unpack_codes(p, jnp.int32)), codes.astype(np.int32))


def test_pack_bits_rejects_ragged_axis():
  with pytest.raises(ValueError, match="multiple of 4"):
    _pack_bits(jnp.zeros((3, 10), jnp.uint8), 2)


# ----------------------------------------------------------------------------- round to nearest


@pytest.mark.slow
@settings(HYP, max_examples=8)  # each example compiles a new shape
@given(
  bits=st.sampled_from(BITS),
  n=st.integers(1, 3),
  d=st.integers(1, 1200),
  group_size=st.sampled_from([64, 256]),
  seed=st.integers(0, 2**31),
)
def test_round_to_nearest_error_within_half_step(bits, n, d, group_size, seed):
  x = _normal((n, d), seed) * 3 + 1
  p, xh = _roundtrip(x, bits=bits, group_size=group_size, stochastic=False)
  xh = np.asarray(xh, np.float64)
  x64 = np.asarray(x, np.float64)
  step = _per_element(p.scale.astype(jnp.float32), p)
  lo = _per_element(p.minimum.astype(jnp.float32), p)
  levels = (1 << bits) - 1
  # The stored grid covers every value (minimum rounded down, step rounded up) ...
  assert (lo <= x64).all() and (x64 <= lo + levels * step * (1 + 1e-6)).all()
  # ... the step is the group's range / B, widened only by the bf16 roundings (the minimum
  # rounded down, the step rounded up: each at most 2^-7 relative) ...
  g = p.group_size
  groups = -(-d // g)
  padded = np.full((n, groups * g), np.nan)
  padded[:, :d] = np.asarray(x, np.float64)
  gmin = np.nanmin(padded.reshape(n, groups, g), -1)
  gmax = np.nanmax(padded.reshape(n, groups, g), -1)
  stored = np.asarray(p.scale, np.float64)
  assert (stored <= (gmax - gmin + 2**-7 * np.abs(gmin)) / levels * (1 + 2**-7) + 1e-30).all()
  # ... and the nearest grid point is within half a step (float32 arithmetic slack 1e-5).
  err = np.abs(xh - x64)
  assert (err <= step / 2 * (1 + 1e-5) + 1e-6 * np.abs(x64)).all(), err.max()


@pytest.mark.slow
@pytest.mark.parametrize(
  "bits, stochastic",
  [(1, True), (2, True), (3, True), (4, True), (7, True), (8, True), (16, True), (2, False)],
)
def test_constant_groups_are_exact(bits, stochastic):
  # Every group of 256 holds one bf16-representable value; a zero sample too.
  consts = np.asarray(jnp.asarray(_normal((3, 4), 1) * 10, jnp.bfloat16), np.float32)
  consts[2] = 0.0
  x = jnp.asarray(np.repeat(consts, 256, axis=1))
  p, xh = _roundtrip(x, jax.random.key(3), bits=bits, stochastic=stochastic)
  np.testing.assert_array_equal(np.asarray(xh), np.asarray(x))
  np.testing.assert_array_equal(np.asarray(p.scale, np.float32), 0.0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_bf16_representable_constants_exact_in_every_dtype(dtype):
  vals = np.asarray([-3.5, 0.0, 1.0, 0.15625, 1024.0, -1e-3], np.float32)
  vals = np.asarray(jnp.asarray(vals, jnp.bfloat16).astype(jnp.float32))
  x = jnp.asarray(np.repeat(vals[:, None], 100, axis=1), dtype)
  p, xh = _roundtrip(x, jax.random.key(0), bits=2)
  # Output dtype equals the input dtype; statistics are bf16, codes uint8.
  assert xh.dtype == dtype and p.dtype == dtype and p.shape == x.shape
  assert p.data.dtype == jnp.uint8
  assert p.minimum.dtype == jnp.bfloat16 and p.scale.dtype == jnp.bfloat16
  assert jax.eval_shape(lambda p: dequantize(p, jnp.float32), p).dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(xh, np.float32), np.asarray(x, np.float32))


def test_non_bf16_constant_within_one_bf16_ulp():
  c = np.float32(1.0 + 2**-10)  # not representable in bf16
  x = jnp.full((2, 256), c)
  for bits in BITS:
    xh = np.asarray(_roundtrip(x, bits=bits, stochastic=False)[1])
    assert np.isfinite(xh).all() and np.abs(xh - c).max() <= 2**-7 * c


# ---------------------------------------------------------------------- one rounding per operation


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_round_to_equals_the_dtype_conversion(dtype):
  """`round_to` (bit arithmetic / reduce_precision, which XLA:GPU cannot drop as excess
  precision) rounds as the conversion does: every finite value of the dtype, its float32
  neighbours, the midpoints between consecutive values (ties to even) and subnormals."""
  from jact._core.quantize import round_to

  v = np.asarray(jnp.asarray(np.arange(2**16, dtype=np.uint16).view(dtype)).astype(jnp.float32))
  v = np.sort(v[np.isfinite(v)])
  mid = ((v[:-1].astype(np.float64) + v[1:]) / 2).astype(np.float32)
  r = np.random.default_rng(0).standard_normal(100_000).astype(np.float32)
  w = np.concatenate(
    [
      v,
      np.nextafter(v, np.float32(np.inf)),
      np.nextafter(v, np.float32(-np.inf)),
      mid,
      r,
      r * 1e-5,
      r * 1e-7,
    ]
  )
  big = float(jnp.finfo(dtype).max)
  w = np.clip(w, -big, big)
  expected = np.asarray(jnp.asarray(w).astype(dtype).astype(jnp.float32))
  got = np.asarray(jax.jit(lambda t: round_to(t, dtype))(w))
  np.testing.assert_array_equal(got.view(np.uint32), expected.view(np.uint32))


def test_stochastic_codes_round_once_per_operation():
  """code = floor(fl(fl(offset * 1/step) + u)): the noise is added to the rounded product,
  never fused with it into one multiply-add (XLA:CPU contracts freely, the GPU kernels
  round every operation). Values are placed just under a code boundary, where the two
  differ: the test asserts that many of them do."""
  from jact._core import rng
  from jact.kernels._quantize.reference import quantize_reference

  n, groups, g, bits = 8, 16, 256, 8
  seed = jnp.uint32(77)
  quantize8 = jax.jit(lambda x: quantize_reference(x, seed, bits=bits, group_size=g))
  ends = np.zeros((n, groups, g), np.float32)
  ends[..., 1] = 3.9375  # each group holds 0 and this maximum: its step is not a power of two
  step = np.asarray(quantize8(jnp.asarray(ends.reshape(n, -1))).scale, np.float32)[..., None]
  u = np.asarray(rng.uniform_from_bits(rng.element_bits(seed, (n, groups, g))), np.float64)
  k = np.random.default_rng(3).integers(1, 254, (n, groups, g))
  x = ((k - u - 2e-6) * step).astype(np.float32)  # exact v + u just under the boundary k
  x[..., :2] = ends[..., :2]
  p = quantize8(jnp.asarray(x.reshape(n, -1)))
  assert (np.asarray(p.minimum, np.float32) == 0).all()
  assert (np.asarray(p.scale, np.float32)[..., None] == step).all()
  codes = np.asarray(unpack_bits(p.data, bits))
  inv = np.float32(1) / step
  separate = np.minimum(np.floor(x * inv + u.astype(np.float32)), 255)  # float32: two roundings
  fused = np.minimum(np.floor((x.astype(np.float64) * inv + u).astype(np.float32)), 255)  # one
  assert (separate != fused).sum() >= 20  # the input does probe the difference
  np.testing.assert_array_equal(codes, separate)


# ----------------------------------------------------------------------- unbiasedness and variance


_K = 4000  # draws per unbiasedness test


@functools.lru_cache(maxsize=None)
def _draws(dtype):
  """x and, per bit width, K dequantized float32 copies under independent keys with the group
  statistics of every draw. One compile per dtype for all bit widths (vmap over keys)."""
  x = _normal((3, 300), seed=1, dtype=dtype) * 2 - 0.5  # 300 values: padded to 2 groups of 256
  keys = jax.random.split(jax.random.key(1234), _K)

  def one_key(key):
    out = {}
    for bits in BITS:
      p = quantize(x, key, bits=bits)
      out[bits] = (
        dequantize(p, jnp.float32),
        p.minimum.astype(jnp.float32),
        p.scale.astype(jnp.float32),
      )
    return out

  out = _jit(jax.vmap(one_key))(keys)
  return x, {b: tuple(np.asarray(a, np.float64) for a in v) for b, v in out.items()}


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", BITS)
def test_stochastic_rounding_is_unbiased_and_variance_bounded(bits, dtype):
  x, out = _draws(dtype)
  samples, minimum, scale = out[bits]
  samples = samples.reshape(_K, -1)
  exact = np.asarray(x, np.float64).reshape(-1)
  # The group statistics do not depend on the key.
  assert (minimum == minimum[0]).all() and (scale == scale[0]).all()
  lo = np.repeat(minimum[0], 256, axis=1)[:, :300].reshape(-1)
  step = np.repeat(scale[0], 256, axis=1)[:, :300].reshape(-1)

  # Every draw is one of the two grid points around x -- for float16 / bfloat16 the grid
  # points as decoding rounds them to the dtype (the rounding is onto those, unbiased).
  pos = (exact - lo) / step
  rounded = lambda v: np.asarray(jnp.asarray(v, jnp.float32).astype(dtype), np.float64)
  below = rounded(lo + np.floor(pos) * step)
  above = rounded(lo + (np.floor(pos) + 1) * step)
  tol = 1e-6 * step
  on_grid = (np.abs(samples - below) <= tol) | (np.abs(samples - above) <= tol)
  # The quantizer finds the neighbours from x's position computed in float32, off by up to
  # ~2 float32 ulps of it (1/128 of a step at 16 bits, 1/32768 at 8): next to a grid point
  # that can pick the pair on the other side of it.
  step32, lo32 = step.astype(np.float32), lo.astype(np.float32)
  pos32 = np.floor((exact.astype(np.float32) - lo32) * (np.float32(1) / step32))
  near = lambda k: np.abs(samples - rounded(lo + k * step)) <= tol
  assert (on_grid | near(pos32) | near(pos32 + 1)).all()
  assert on_grid.mean() > 1 - 1e-4

  # Unbiasedness (tests/stats.py tolerances: pooled |z| < 4, mean z^2 < 1.6). Elements whose
  # rounding probability is below 25/K would often show no spread in K draws; they are left
  # out of the check (at most 10% of them) -- elements exactly on the grid stay in as
  # deterministic ones.
  gap = np.maximum(above - below, 1e-30)
  frac = np.clip((exact - below) / gap, 0.0, 1.0)
  margin = np.minimum(frac, 1 - frac)
  keep = (margin >= 25 / _K) | (margin <= 1e-7)
  assert keep.mean() > 0.9
  assert_unbiased(samples[:, keep], exact[keep])

  # Variance: a two-point distribution has sample variance p(1-p) gap^2 K/(K-1) <= gap^2/4
  # * K/(K-1); slack 1e-3 covers the K/(K-1) factor and float32 rounding.
  var = samples.var(0, ddof=1)
  assert (var <= gap**2 / 4 * (1 + 1e-3)).all()
  # ... and matches the stochastic-rounding variance frac(1-frac) gap^2 in total (within 5%).
  expected_var = (frac * (1 - frac) * gap**2).sum()
  assert abs(var.sum() / expected_var - 1) < 0.05


def test_noise_depends_on_key_only_when_stochastic():
  x = _normal((4, 512))
  a = _quantize(x, jax.random.key(0), bits=2)
  b = _quantize(x, jax.random.key(0), bits=2)
  c = _quantize(x, jax.random.key(1), bits=2)
  np.testing.assert_array_equal(np.asarray(a.data), np.asarray(b.data))
  assert (np.asarray(a.data) != np.asarray(c.data)).mean() > 0.5
  np.testing.assert_array_equal(np.asarray(a.minimum), np.asarray(c.minimum))
  r1 = _quantize(x, jax.random.key(0), bits=2, stochastic=False)
  r2 = _quantize(x, bits=2, stochastic=False)
  np.testing.assert_array_equal(np.asarray(r1.data), np.asarray(r2.data))
  # seed= is the same as the key it comes from.
  s = _quantize(x, bits=2, seed=jact.rng.seed_from_key(jax.random.key(0)))
  np.testing.assert_array_equal(np.asarray(a.data), np.asarray(s.data))


# -------------------------------------------------------------------------- dtypes, padding, sizes


@pytest.mark.parametrize(
  "d, group_size, expected",
  [
    (10, 256, 16),  # shorter than a group: one group, rounded up to 8
    (256, 256, 256),
    (300, 256, 256),  # no multiple of 8 divides 300: padded to 512
    (784, 256, 112),  # 784 = 7 * 112
    (1001, 256, 256),  # odd: padded to 1024
    (2000, 256, 200),  # 2000 = 10 * 200
    (65536, 256, 256),
    (262016, 256, 184),  # 262016 = 2^7 * 23 * 89: 184 = 8 * 23 is the largest
    (257, 256, 256),  # prime: padded
    (100, 64, 64),  # 100 = 4 * 25: padded
    (24, 8, 8),
  ],
)
def test_effective_group_size(d, group_size, expected):
  assert effective_group_size(d, group_size) == expected


@pytest.mark.slow
@pytest.mark.parametrize(
  "shape, bits",
  [((4, 10), 1), ((3, 300), 4), ((2, 28, 28), 2), ((2, 1001), 8), ((5,), 4), ((1, 7, 11, 13), 1)],
)
def test_padding_shapes_and_stats_ignore_padding(shape, bits):
  # Values in [1, 2]: a zero from the padding would pull the last group's minimum to 0.
  x = jnp.asarray(1.0 + np.random.default_rng(0).random(shape), jnp.float32)
  p, xh = _roundtrip(x, jax.random.key(0), bits=bits)
  n = shape[0]
  d = math.prod(shape[1:])
  g = effective_group_size(d, 256)
  groups = -(-d // g)
  assert p.group_size == g
  assert p.data.shape == (n, groups, g * bits // 8)
  assert p.minimum.shape == p.scale.shape == (n, groups)
  assert (np.asarray(p.minimum, np.float32) >= 0.99).all()
  assert xh.shape == x.shape
  step = _per_element(p.scale.astype(jnp.float32), p).reshape(x.shape)
  assert (np.abs(np.asarray(xh, np.float64) - np.asarray(x, np.float64)) <= step * (1 + 1e-5)).all()


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("shape", [(8, 1024), (4, 300), (2, 784), (64, 262016)])
def test_nbytes(bits, shape):
  # Shapes only (jax.eval_shape): the sizes are static.
  p = jax.eval_shape(
    functools.partial(quantize, bits=bits),
    jax.ShapeDtypeStruct(shape, jnp.float32),
    jax.random.key(0),
  )
  assert isinstance(p, Packed)
  assert p.nbytes == sum(math.prod(leaf.shape) * leaf.dtype.itemsize for leaf in jax.tree.leaves(p))
  n, d = shape
  groups = -(-d // p.group_size)
  # codes: bits/8 bytes per (padded) value; bf16 minimum + bf16 scale: 4 bytes per group.
  assert p.nbytes == n * groups * p.group_size * bits // 8 + 4 * n * groups
  if d % p.group_size == 0:
    assert p.nbytes == n * d * bits // 8 + 4 * n * d // p.group_size
  # Close to N*D*bits/8 + 4 bytes per group: without padding the group is never smaller than a
  # quarter of the request (64 values); padding adds less than one group per sample.
  if d % p.group_size == 0:
    assert p.group_size >= 64
  else:
    assert p.nbytes < n * (d + p.group_size) * bits / 8 + 4 * n * (d / p.group_size + 1)


def test_nbytes_of_concrete_packed_equals_leaves():
  p = _quantize(_normal((4, 300)), jax.random.key(0), bits=2)
  assert p.nbytes == sum(leaf.nbytes for leaf in jax.tree.leaves(p))


# ----------------------------------------------------------------------------- non-finite values


@pytest.mark.parametrize("stochastic", [False, True])
def test_non_finite_values_propagate_without_poisoning_their_group(stochastic):
  rng = np.random.default_rng(5)
  clean = rng.uniform(-1.0, 1.0, (2, 1024)).astype(np.float32)
  clean[0, 0:256] = np.linspace(-1, 1, 256)  # group 0 has range exactly [-1, 1]
  dirty = clean.copy()
  dirty[0, 10], dirty[0, 20], dirty[0, 30] = np.inf, -np.inf, np.nan  # group 0: mixed kinds
  dirty[1, 256:512] = np.nan  # group 1 of sample 1: nothing finite
  dirty[1, 600] = np.inf  # group 2 of sample 1: one +inf
  dirty[1, 800] = -np.inf  # group 3 of sample 1: one -inf
  key = jax.random.key(7)
  p = _quantize(jnp.asarray(dirty), key, bits=4, stochastic=stochastic)
  p_clean = _quantize(jnp.asarray(clean), key, bits=4, stochastic=stochastic)
  xh = np.asarray(_dequantize(p))
  # Non-finite exactly where the input is, each value of its own kind where a group has one kind.
  np.testing.assert_array_equal(np.isfinite(xh), np.isfinite(dirty))
  assert np.isnan(xh[0, [10, 20, 30]]).all() and np.isnan(xh[1, 256:512]).all()
  assert xh[1, 600] == np.inf and xh[1, 800] == -np.inf
  # Flagged groups: sign bit of the step set; the finite values use 14 steps of
  # their own finite range ([-1, 1] in group 0), the step rounded up to 4 bf16 ulps.
  scale = np.asarray(p.scale.astype(jnp.float32))
  assert np.signbit(scale[0, 0]) and np.signbit(scale[1, 1:]).all()
  assert not np.signbit(scale[0, 1:]).any() and not np.signbit(scale[1, 0])
  assert float(p.minimum[0, 0]) == -1.0
  step = float(split_step(jnp.float32(scale[0, 0]))[0])
  assert 2 / 14 <= step <= 2 / 14 * (1 + 2**-4)
  finite = np.isfinite(dirty[0, :256])
  assert (np.abs(xh[0, :256][finite] - dirty[0, :256][finite]) <= step * (1 + 1e-5)).all()
  # Groups without non-finite values are bit-identical to the clean tensor's (same noise).
  untouched = [(0, 1), (0, 2), (0, 3), (1, 0)]
  for s, g in untouched:
    np.testing.assert_array_equal(np.asarray(p.data[s, g]), np.asarray(p_clean.data[s, g]))
    assert float(p.scale[s, g]) == float(p_clean.scale[s, g])
  # The group with one +inf keeps the finite range of its other values.
  others = np.delete(dirty[1, 512:768], 600 - 512)
  step = float(split_step(jnp.float32(scale[1, 2]))[0])
  assert float(p.minimum[1, 2]) <= others.min() and float(p.minimum[1, 2]) > others.min() - 0.01
  assert float(p.minimum[1, 2]) + 14 * step >= others.max()
  assert step <= (others.max() - others.min()) / 14 * 1.07


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize("bits", [0, 9, 12, 32, True, 2.0, 2.5])
def test_bad_bits(bits):
  with pytest.raises(ValueError, match=r"bits must be one of \(1, 2, 3, 4, 5, 6, 7, 8, 16\)"):
    quantize(jnp.ones((2, 8)), jax.random.key(0), bits=bits)
  with pytest.raises(ValueError, match="bits must be one of"):
    pack_codes(jnp.ones((8,), jnp.uint8), bits)


@pytest.mark.parametrize("group_size", [0, 12, -8, 2.5])
def test_bad_group_size(group_size):
  with pytest.raises(ValueError, match="group_size must be a positive multiple of 8"):
    quantize(jnp.ones((2, 8)), jax.random.key(0), bits=4, group_size=group_size)


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.bool_, jnp.uint8])
def test_bad_dtype(dtype):
  with pytest.raises(TypeError, match=r"float32, bfloat16 or float16.*pack_codes"):
    quantize(jnp.ones((2, 8), dtype), jax.random.key(0), bits=4)


def test_missing_key():
  with pytest.raises(ValueError, match="needs a PRNG key.*stochastic=False"):
    quantize(jnp.ones((2, 8)), bits=4)
  with pytest.raises(TypeError, match="expected a JAX PRNG key"):
    quantize(jnp.ones((2, 8)), 3, bits=4)
  _quantize(jnp.ones((2, 8)), bits=4, stochastic=False)  # no key needed


# ----------------------------------------------------------------------------- compiled memory


@pytest.mark.slow
@pytest.mark.parametrize(
  "shape, bits",
  [((64, 262144), 1), ((64, 262144), 4), ((64, 262016), 2), ((64, 262144), 3), ((64, 262144), 16)],
)
def test_compiled_temp_memory_is_small(shape, bits):
  """Regression: no tensor-sized temporaries (noise, padding, masks) -- residual bytes are
  not compiled memory unless XLA keeps none of these alive.

  quantize alone: temp < 5% of the input. quantize+dequantize: the packed codes
  are materialized between the two halves (by design: in a training step they
  are the residual), so the bound is 5% of the input plus the packed size.
  """
  x = jax.ShapeDtypeStruct(shape, jnp.float32)  # 64 MiB (63.97 MiB for the second), compile only
  key = jax.random.key(0)
  n, d = shape
  size = n * d * 4
  g = effective_group_size(d, 256)
  if d % 256:
    assert d % g == 0  # the case that needs an effective group size instead of padding
  packed = n * d * bits // 8 + 4 * n * (d // g)

  def temp(fn):
    return jax.jit(fn).lower(x, key).compile().memory_analysis().temp_size_in_bytes

  q_temp = temp(lambda x, k: quantize(x, k, bits=bits))
  qd_temp = temp(lambda x, k: dequantize(quantize(x, k, bits=bits)))
  assert q_temp < 0.05 * size, q_temp
  assert qd_temp < 0.05 * size + packed, (qd_temp, packed)
