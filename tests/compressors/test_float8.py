"""FP8 residual storage (`jact.compressors.Float8`): codes bit-exact against an
independent NumPy/ml_dtypes reference, the error bounds of rounding to the
float8 grid, unbiased stochastic rounding, non-finite values where they were,
the stored bytes, and gradients through an op."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jact
from jact import compressors as C
from jact._core.float8 import FORMATS, round_to_float8
from stats import DRAWS, assert_unbiased

ML = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}
FMT = sorted(FORMATS)


def _values(seed, shape, spread=12.0):
  """Signed values whose magnitudes span 2^-spread..2^spread (log-uniform), zeros included."""
  r = np.random.default_rng(seed)
  x = np.exp2(r.uniform(-spread, spread, size=shape)) * r.choice([-1.0, 1.0], size=shape)
  x[r.random(size=shape) < 0.05] = 0.0
  return x.astype(np.float32)


def _round_trip(c, x, seed):
  """decompress(compress(x)), jitted (op by op, a compression dispatches for seconds)."""
  return jax.jit(lambda x, s: c.decompress(c.compress(x, s)))(x, seed)


def _grid(fmt):
  """Every finite value of the format, ascending, as float32."""
  v = np.arange(256, dtype=np.uint8).view(ML[fmt]).astype(np.float32)
  return np.unique(v[np.isfinite(v)])


def _reference_pow2(x, fmt, block):
  """NumPy codes and E8M0 scales of Float8(fmt, block, "pow2"), from ml_dtypes' casts."""
  f = FORMATS[fmt]
  n = x.shape[0] if x.ndim >= 2 else 1
  v = x.reshape(n, -1).astype(np.float64)
  d = v.shape[1]
  nb = -(-d // block)
  a = np.abs(np.pad(v, ((0, 0), (0, nb * block - d)))).reshape(n, nb, block)
  amax = np.where(np.isfinite(a), a, 0).max(-1)
  # the least e with amax / 2^e <= max
  e = np.ceil(np.log2(np.where(amax > 0, amax, 1.0) / f.max))
  e = np.where(amax > 0, e, -126)
  e = np.where(amax / np.exp2(e - 1) <= f.max, e - 1, e)  # log2's rounding, either way
  e = np.where(amax / np.exp2(e) > f.max, e + 1, e)
  e = np.clip(e, -126, 127).astype(np.int64)
  scaled = (v / np.repeat(np.exp2(e), block, axis=1)[:, :d]).astype(np.float32)
  codes = scaled.astype(ML[fmt]).view(np.uint8)
  codes = np.where(codes == 0x80, 0, codes)  # zeros are stored as +0
  return codes.reshape(x.shape), (e + 127).astype(np.uint8)


@pytest.mark.parametrize("fmt", FMT)
def test_round_to_nearest_matches_ml_dtypes_on_every_grid_midpoint(fmt):
  """Round to nearest even, on the ties too, equals ml_dtypes' float32 -> float8 cast."""
  g = _grid(fmt)
  mids = (g[:-1].astype(np.float64) + g[1:]) / 2  # exact in float32: one bit more than float8
  near = np.concatenate(
    [
      np.nextafter(mids.astype(np.float32), np.float32(np.inf)),
      np.nextafter(mids.astype(np.float32), np.float32(-np.inf)),
    ]
  )
  v = np.concatenate([g, mids.astype(np.float32), near, _values(0, 4096, 8.0)])
  v = np.clip(v, -FORMATS[fmt].max, FORMATS[fmt].max).astype(np.float32)
  got = np.asarray(jax.jit(lambda v: round_to_float8(v, FORMATS[fmt], None))(v))
  want = v.astype(ML[fmt]).astype(np.float32)
  np.testing.assert_array_equal(got, want + 0.0)  # +0.0: zeros as +0


@pytest.mark.parametrize("fmt", FMT)
def test_stochastic_rounding_picks_a_neighbor_with_the_exact_probability(fmt):
  """Each value rounds to one of its two grid neighbors; with the noise swept over
  a lattice of 2^12 values in [0, 2^32), the fraction rounded up is the value's
  position between them (a step on the lattice: 2^-12)."""
  f = FORMATS[fmt]
  g = _grid(fmt)
  g = g[g >= 0]
  r = np.random.default_rng(1)
  i = r.integers(0, len(g) - 1, size=64)
  pos = r.random(64)
  v = (g[i] + pos * (g[i + 1] - g[i])).astype(np.float32)
  noise = (np.arange(4096, dtype=np.uint64) << 20).astype(np.uint32)
  got = np.asarray(
    jax.jit(jax.vmap(lambda u: round_to_float8(jnp.asarray(v), f, jnp.full(v.shape, u))))(noise)
  )
  lo, hi = g[i], g[i + 1]
  assert np.all((got == lo) | (got == hi))
  exact = (v.astype(np.float64) - lo) / (hi - lo)
  np.testing.assert_allclose((got == hi).mean(0), exact, atol=2.0**-12)


@pytest.mark.parametrize("fmt", FMT)
@pytest.mark.parametrize("shape", [(4, 256), (3, 5, 7), (100,), (2, 40)], ids=str)
def test_round_to_nearest_codes_and_scales_are_bit_exact(fmt, shape):
  """The codes and E8M0 scales equal the NumPy/ml_dtypes reference's, jitted or not,
  call after call (blocks not dividing the row included)."""
  x = _values(2, shape)
  c = C.Float8(fmt)
  stored = jax.jit(c.compress)(jnp.asarray(x), None)
  codes, scale = _reference_pow2(x, fmt, 32)
  np.testing.assert_array_equal(np.asarray(stored.arrays["codes"]), codes)
  np.testing.assert_array_equal(np.asarray(stored.arrays["scale"]), scale)
  again = jax.jit(c.compress)(jnp.asarray(x), None)
  for k in ("codes", "scale"):
    np.testing.assert_array_equal(np.asarray(again.arrays[k]), np.asarray(stored.arrays[k]))


def _bound(c, x, ulps):
  """`ulps` float8 steps at each value, in x's units, per the pow2 block scale."""
  f, c = c.fmt, dataclasses.replace(c, stochastic=False)  # the same scales
  stored = jax.jit(c.compress)(jnp.asarray(x), None)
  scale = np.exp2(np.asarray(stored.arrays["scale"], np.float64) - 127)
  n = x.shape[0] if x.ndim >= 2 else 1
  s = np.repeat(scale, c.block_size, axis=1)[:, : x.size // n].reshape(x.shape)
  scaled = np.abs(x.astype(np.float64)) / s
  step = np.exp2(np.floor(np.log2(np.maximum(scaled, 2.0**f.emin))) - f.mantissa)
  return ulps * step * s, scaled


@pytest.mark.parametrize("fmt", FMT)
@pytest.mark.parametrize("stochastic", [False, True], ids=["rtn", "sr"])
def test_round_trip_error_bounds(fmt, stochastic):
  """RTN: within half a float8 step (relative 2^-(m+1) of the scale-normalized value
  in the normal range); stochastic: within one step. No value overflows the format."""
  x = _values(3, (8, 512))
  c = C.Float8(fmt, stochastic=stochastic)
  seed = jnp.uint32(11) if stochastic else None
  y = np.asarray(_round_trip(c, jnp.asarray(x), seed))
  bound, scaled = _bound(c, x, 1.0 if stochastic else 0.5)
  err = np.abs(y.astype(np.float64) - x)
  assert np.all(err <= bound), float(np.max(err / bound))
  assert scaled.max() <= c.fmt.max and np.isfinite(y).all()
  normal = scaled >= 2.0**c.fmt.emin
  rel = err[normal] / np.abs(x[normal])
  assert rel.max() <= 2.0 ** -(c.fmt.mantissa + (0 if stochastic else 1))


@pytest.mark.parametrize("fmt", FMT)
def test_float_scale_maps_the_block_maximum_to_the_format_maximum(fmt):
  """scale="float": amax / max a block (no overflow, even for values near float32's
  largest); the error stays within a float8 step of the normalized value."""
  x = _values(4, (4, 256))
  x[0, :32] *= 2.0**100  # huge
  x[1, 0] = 3.0e38
  c = C.Float8(fmt, scale="float")
  stored = jax.jit(c.compress)(jnp.asarray(x), None)
  y = np.asarray(jax.jit(c.decompress)(stored), np.float64)
  assert np.isfinite(y).all()
  amax = np.abs(x.astype(np.float64)).reshape(4, 8, 32).max(-1)
  s = np.asarray(stored.arrays["scale"], np.float64)
  np.testing.assert_allclose(s, amax / c.fmt.max, rtol=2**-23)
  f = c.fmt
  floor = np.repeat(s, 32, axis=1) * 2.0 ** (f.emin - f.mantissa - 1)  # half a subnormal step
  bound = np.maximum(np.abs(x) * 2.0 ** -(f.mantissa + 1), floor) * (1 + 2.0**-20)
  assert np.all(np.abs(y - x) <= bound)  # to nearest, up to float32's x / s and q * s
  assert stored.nbytes == c.stored_bytes(x.shape) == x.size + 4 * 4 * 8


@pytest.mark.parametrize("fmt", FMT)
def test_block_maxima_at_the_overflow_edge_and_zero_blocks(fmt):
  """A block whose largest value is just above max * 2^e moves to the next power of
  two (stored exactly when on the grid); an all-zero block decodes to zeros."""
  f = FORMATS[fmt]
  x = np.zeros((1, 96), np.float32)
  x[0, :32] = f.max * 4.0  # exactly max * 2^2
  x[0, 32:64] = np.nextafter(np.float32(f.max * 4.0), np.float32(np.inf))
  c = C.Float8(fmt)
  stored = jax.jit(c.compress)(jnp.asarray(x), None)
  assert np.asarray(stored.arrays["scale"]).tolist() == [[129, 130, 1]]
  y = np.asarray(jax.jit(c.decompress)(stored))
  np.testing.assert_array_equal(y[0, :32], x[0, :32])
  np.testing.assert_array_equal(y[0, 64:], 0.0)
  assert np.all(np.abs(y[0, 32:64] - x[0, 32:64]) <= f.max * 4.0 * 2.0 ** -(f.mantissa + 1))


@pytest.mark.parametrize("fmt", FMT)
@pytest.mark.parametrize("scale", ["pow2", "float"])
def test_stochastic_rounding_is_unbiased_over_seeds(fmt, scale):
  """E[x_hat] = x over DRAWS seeds (`stats.assert_unbiased`: pooled |z| < 4,
  mean z^2 < 1.6), float8 subnormals included; RTN is biased on the same values."""
  x = jnp.asarray(_values(5, (4, 256), 12.0))
  c = C.Float8(fmt, scale=scale, stochastic=True)
  draw = jax.jit(jax.vmap(lambda s: c.decompress(c.compress(x, s))))
  seeds = jnp.arange(DRAWS, dtype=jnp.uint32)
  samples = np.concatenate([np.asarray(draw(seeds[i : i + 512])) for i in range(0, DRAWS, 512)])
  assert_unbiased(samples, np.asarray(x))
  rtn = C.Float8(fmt, scale=scale)
  rtn_error = np.asarray(_round_trip(rtn, x, None)) - np.asarray(x)
  with pytest.raises(AssertionError, match="biased"):  # the check sees a bias of RTN's size
    assert_unbiased(samples + rtn_error, np.asarray(x))


@pytest.mark.parametrize("fmt", FMT)
@pytest.mark.parametrize("scale", ["pow2", "float"])
def test_non_finite_values_come_back_where_they_were_and_leave_the_block_alone(fmt, scale):
  x = _values(6, (2, 64))
  bad = x.copy()
  bad[0, 3], bad[0, 5], bad[0, 7], bad[1, 40] = np.nan, np.inf, -np.inf, np.inf
  bad[1, 32:64] = np.where(np.arange(32) == 8, np.inf, 0.0)  # inf in an otherwise zero block
  ref = np.where(np.isfinite(bad), bad, 0.0).astype(np.float32)
  for stochastic in (False, True):
    c = C.Float8(fmt, scale=scale, stochastic=stochastic)
    s = jnp.uint32(2) if stochastic else None
    y = np.asarray(_round_trip(c, jnp.asarray(bad), s))
    y_ref = np.asarray(_round_trip(c, jnp.asarray(ref), s))
    assert np.isnan(y[0, 3]) and y[0, 5] == np.inf and y[0, 7] == -np.inf
    assert y[1, 40] == np.inf
    ok = np.isfinite(bad)
    np.testing.assert_array_equal(np.isfinite(y), ok)
    np.testing.assert_array_equal(y[ok], y_ref[ok])  # the finite values as without them


@pytest.mark.parametrize(
  "dtype", [jnp.float32, jnp.bfloat16, jnp.float16], ids=lambda d: d.__name__
)
@pytest.mark.parametrize("fmt", FMT)
def test_low_precision_inputs(dtype, fmt):
  """bf16 / f16 inputs: the reconstruction has their dtype and float8's error bound
  (plus the input dtype's own rounding of the result)."""
  x = jnp.asarray(_values(7, (4, 128), 6.0)).astype(dtype)
  c = C.Float8(fmt)
  y = _round_trip(c, x, None)
  assert y.dtype == dtype and y.shape == x.shape
  xf, yf = np.asarray(x, np.float64), np.asarray(y, np.float64)
  eps = float(jnp.finfo(dtype).eps)
  assert np.all(np.abs(yf - xf) <= np.abs(xf) * (2.0 ** -(c.fmt.mantissa + 1) + eps) + 1e-30)


@pytest.mark.parametrize(
  "shape", [(4, 256), (3, 5, 7), (100,), (), (0, 8), (2, 0), (1, 33)], ids=str
)
@pytest.mark.parametrize("scale", ["pow2", "float"])
def test_stored_bytes_are_the_arrays(shape, scale):
  c = C.Float8(block_size=32, scale=scale)
  x = jnp.asarray(np.ones(shape, np.float32))
  stored = jax.jit(c.compress)(x, None)
  assert stored.nbytes == c.stored_bytes(shape) == sum(a.nbytes for a in jax.tree.leaves(stored))
  n = shape[0] if len(shape) >= 2 else 1
  per_row = int(np.prod(shape[1:] if len(shape) >= 2 else shape))
  assert c.stored_bytes(shape) == int(np.prod(shape)) + n * -(-per_row // 32) * c.scale_bytes
  assert jax.jit(c.decompress)(stored).shape == shape


def test_settings_are_checked_and_json_round_trips():
  c = C.Float8("e5m2", block_size=16, scale="float", stochastic=True)
  assert C.from_dict(json.loads(json.dumps(c.to_dict()))) == c
  assert c.unbiased and c.needs_key and not C.Float8().unbiased
  assert C.Float8().average_bits == 8.25 and c.average_bits == 10.0
  assert C.Float8().with_bits(8) == C.Float8()
  with pytest.raises(ValueError, match="PerGroup"):
    C.Float8().with_bits(4)
  with pytest.raises(ValueError, match="format"):
    C.Float8("e3m4")
  with pytest.raises(ValueError, match="scale"):
    C.Float8(scale="e8m0")
  with pytest.raises(ValueError, match="block_size"):
    C.Float8(block_size=0)
  with pytest.raises(TypeError, match="stochastic"):
    C.Float8(stochastic=1)


@pytest.mark.parametrize(
  "c, rtol",
  [(C.Float8(), 0.04), (C.Float8("e5m2"), 0.08), (C.Float8(stochastic=True), 0.06)],
  ids=repr,
)
def test_dense_gradients_close_to_exact(c, rtol):
  """One draw: the relative L2 error of dense's gradients (x_hat's relative error is
  about 2^-(m+1) / sqrt(3) a value, ~2% for e4m3, ~4% for e5m2)."""
  r = np.random.default_rng(8)
  x = jnp.asarray(r.normal(size=(32, 128)).astype(np.float32))
  w = jnp.asarray(r.normal(size=(128, 16)).astype(np.float32))
  cot = jnp.asarray(r.normal(size=(32, 16)).astype(np.float32))
  key = jax.random.key(3) if c.needs_key else None
  loss = lambda x, w: jnp.sum(jact.ops.dense(x, w, key=key, compressor=c, name="fc") * cot)
  exact = jax.grad(lambda x, w: jnp.sum((x @ w) * cot), argnums=(0, 1))(x, w)
  got = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w)
  for g, e in zip(got, exact):
    rel = float(np.linalg.norm(np.asarray(g) - e) / np.linalg.norm(e))
    assert rel < rtol, rel
  assert float(np.linalg.norm(got[1] - exact[1])) > 0  # the residual was stored in FP8
  report = jact.residual_report(loss, x, w)
  assert report.by_name()["fc.lhs"].bytes == c.stored_bytes(x.shape) == 32 * 128 + 32 * 4


def test_a_float8_input_to_an_op_names_a_fix_that_works():
  """ops take float32/bf16/f16: a float8 input is refused with a fix (cast up, and
  store the residual as FP8 with compressor=Float8()), and the fix runs."""
  x8 = jnp.asarray(_values(9, (8, 64), 4.0)).astype(jnp.float8_e4m3fn)
  w = jnp.asarray(np.random.default_rng(9).normal(size=(64, 4)).astype(np.float32))
  with pytest.raises(TypeError, match=r"Float8\(\)") as e:
    jact.ops.dense(x8, w, compressor=C.Float8())
  assert "astype(jnp.bfloat16)" in str(e.value)
  loss = lambda w: jnp.sum(
    jact.ops.dense(x8.astype(jnp.bfloat16), w.astype(jnp.bfloat16), compressor=C.Float8()).astype(
      jnp.float32
    )
  )
  g = jax.jit(jax.grad(loss))(w)
  # float8 values are on the e4m3 grid, the block scales powers of two: stored exactly
  want = jax.grad(lambda w: jnp.sum((x8.astype(jnp.float32) @ w)))(w)
  np.testing.assert_allclose(np.asarray(g), np.asarray(want), rtol=1e-2)


@pytest.mark.parametrize(
  "c", [C.Float8(), C.Float8("e5m2", scale="float", stochastic=True)], ids=repr
)
def test_the_pallas_kernel_stores_the_reference_bytes_through_the_compressor(c):
  """implementation="pallas_triton" (interpret mode here) stores what the XLA reference
  stores (the kernel contract checks more cases: tests/kernels/test_kernel_contract.py)."""
  x = jnp.asarray(_values(10, (3, 7, 20), 6.0))
  seed = jnp.uint32(4) if c.needs_key else None
  kernel = dataclasses.replace(c, implementation="pallas_triton")
  got, want = jax.jit(kernel.compress)(x, seed), jax.jit(c.compress)(x, seed)
  for k in ("codes", "scale"):
    np.testing.assert_array_equal(np.asarray(got.arrays[k]), np.asarray(want.arrays[k]))


def test_the_report_names_the_kernel_lowered_for_cuda():
  x, w = jnp.ones((8, 256)), jnp.ones((256, 4))
  loss = lambda w: jnp.sum(jact.ops.dense(x, w, compressor=C.Float8(), name="fc"))
  with jact.kernels.lowering_for("cuda"):
    report = jact.residual_report(loss, w)
  assert report.kernels()["fc.lhs"].startswith("jact_float8_compress")  # Pallas or jax-triton
  assert report.by_name()["fc.lhs"].bytes == C.Float8().stored_bytes(x.shape)
