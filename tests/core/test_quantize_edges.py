"""Edge cases of the quantizer's numerics, empty inputs and dtypes: float16 values
at +-65504, float32 groups spanning +-3e38, non-finite values under DIVISION,
zero-size tensors through every op and compressor, `jact.dequantize` of a plain
array, and float64 operands."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jact
from jact import compressors as C
from jact import ops
from jact.kernels._division import pallas_triton as division_kernels
from jact.kernels._division.reference import division_compress_reference
from jact.kernels._quantize import pallas_triton as pergroup_kernels
from jact.kernels._quantize.reference import dequantize_reference, quantize_reference
from kernel_checks import assert_same_bits, assert_same_packed
from stats import assert_unbiased, over_keys

BITS = (1, 2, 4, 8)
F16_MAX = float(np.finfo(np.float16).max)  # 65504
F32_MAX = float(np.finfo(np.float32).max)
BF16_MAX = float(jnp.finfo(jnp.bfloat16).max)  # 3.39e38
KEY = jax.random.key(0)


FAST_COMPILE = {"xla_backend_optimization_level": 0}
"""XLA:CPU options for the interpret-mode kernels (`_jitted(..., fast=True)`):
unoptimized, they compile a third faster. The references compile as users compile
them, so the comparisons also check that the kernels' bits do not depend on the
optimization level (as tests/kernels/test_kernel_contract.py does)."""


@functools.partial(jax.jit, static_argnames=("bits", "stochastic", "dtype"))
def _roundtrip(x, key, *, bits, stochastic=True, dtype=None):
  """(Packed, reconstruction) in one compile."""
  p = jact.quantize(x, key, bits=bits, stochastic=stochastic)
  return p, jact.dequantize(p, dtype)


def _jitted(fn, *args, fast=False, **static):
  """`fn(*args, **static)` compiled as one program (unoptimized with `fast`): op by
  op, the references and the interpret-mode kernels dispatch many small
  operations, each compiled on first use."""
  return jax.jit(functools.partial(fn, **static), compiler_options=FAST_COMPILE if fast else None)(
    *args
  )


def _per_element(stat, packed):
  """A per-group statistic [N, groups] broadcast to the elements [N, D] (float64)."""
  n, d = packed.shape[0], math.prod(packed.shape[1:])
  s = np.repeat(np.asarray(jnp.asarray(stat, jnp.float32), np.float64), packed.group_size, axis=1)
  return s[:, :d].reshape(n, d)


def _check_grid(x, packed, y, stochastic):
  """Each reconstruction is a grid point within one step (stochastic) or half a step
  (nearest) of the value clipped to the stored grid; returns (minimum, step, top)."""
  levels = (1 << packed.bits) - 1
  lo, step = _per_element(packed.minimum, packed), _per_element(packed.scale, packed)
  top = lo + levels * step
  x = np.asarray(jnp.asarray(x, jnp.float32), np.float64).reshape(lo.shape)
  y = np.asarray(jnp.asarray(y, jnp.float32), np.float64).reshape(lo.shape)
  err = np.abs(y - np.clip(x, lo, top))
  bound = step if stochastic else step / 2
  assert (err <= bound * (1 + 2.0**-20)).all(), (err / step).max()
  return lo, step, top


# --------------------------------------------------------------------------- 1: float16 at +-65504


def _f16_extremes():
  """Rows (one group each) at and near float16's largest finite values."""
  rng = np.random.default_rng(0)
  rows = [
    np.full(256, F16_MAX),
    np.full(256, -F16_MAX),
    np.tile([F16_MAX, -F16_MAX], 128),
    np.concatenate([[F16_MAX, -F16_MAX], rng.uniform(-1.0, 1.0, 254)]),
    np.concatenate([[F16_MAX], rng.uniform(60000.0, F16_MAX, 255)]),
    np.concatenate([[-F16_MAX, F16_MAX], rng.uniform(-F16_MAX, F16_MAX, 254)]),
  ]
  return jnp.asarray(np.stack(rows), jnp.float16)


@pytest.mark.slow
@pytest.mark.parametrize("stochastic", [True, False])
@pytest.mark.parametrize("bits", BITS)
def test_float16_extremes_reconstruct_finite(bits, stochastic):
  x = _f16_extremes()
  p, y = _roundtrip(x, KEY, bits=bits, stochastic=stochastic)
  assert y.dtype == jnp.float16 and bool(jnp.isfinite(y).all())
  # Within one step (half for nearest) of x, up to float16's own rounding of the
  # output: half an ulp, 16 at 2**15..2**16; the clamp only moves a grid point
  # beyond +-65504 towards x.
  levels = (1 << bits) - 1
  lo, step = _per_element(p.minimum, p), _per_element(p.scale, p)
  assert (lo + levels * step >= np.asarray(x, np.float64)).all()  # the grid covers the group
  err = np.abs(np.asarray(y, np.float64) - np.asarray(x, np.float64))
  assert (err <= (step if stochastic else step / 2) + 16.0).all(), (err - step).max()


@pytest.mark.slow
def test_float16_dense_two_bit_weight_gradient_is_finite():
  rng = np.random.default_rng(1)
  row0 = np.concatenate([np.tile([F16_MAX, -F16_MAX], 100), rng.standard_normal(56)])
  x = jnp.asarray(np.stack([row0, rng.standard_normal(256)]), jnp.float16)
  w = jnp.full((256, 3), 1e-4, jnp.float16)
  plain = jax.grad(lambda w: jnp.sum((x @ w).astype(jnp.float32)))(w)
  assert bool(jnp.isfinite(plain).all())  # the reference gradient is finite

  @jax.jit
  def grad(key):
    return jax.grad(lambda w: jnp.sum(ops.dense(x, w, key=key, bits=2).astype(jnp.float32)))(w)

  packed = _roundtrip(x, KEY, bits=2)[0]  # the residual's steps (same grid for every key)
  step = _per_element(packed.scale, packed)
  for key in jax.random.split(jax.random.key(1), 4):
    g = grad(key)
    assert bool(jnp.isfinite(g).all())
    # d loss / d w[i, j] = sum_n x[n, i]: off by at most one step per row, plus
    # float16 rounding of the sum (one ulp, 32 at 2**15..2**16).
    err = np.abs(np.asarray(g, np.float64) - np.asarray(plain, np.float64))
    assert (err <= step.sum(0)[:, None] + 32.0).all()


@pytest.mark.slow
def test_float16_rounding_stays_unbiased():
  """Extreme groups dequantized to float32 (no clamp needed) and normal groups in
  float16 both average to x over 256 keys."""
  rng = np.random.default_rng(2)
  extreme = _f16_extremes()[jnp.array([2, 5])]  # +-65504 alternating, and with values between
  normal = jnp.asarray(rng.standard_normal((2, 256)) * 1000, jnp.float16)
  keys = jax.random.split(jax.random.key(3), 256)
  wide = over_keys(lambda k: _roundtrip(extreme, k, bits=2, dtype=jnp.float32)[1], keys)
  # A value a hair off a grid point may draw the same level 256 times: such
  # elements only have to be within a step (here and below); the z-tests take the rest.
  step = float(jnp.max(_roundtrip(extreme, KEY, bits=2)[0].scale.astype(jnp.float32)))
  assert_unbiased(wide, np.asarray(extreme, np.float64), atol=step)
  near = over_keys(lambda k: _roundtrip(normal, k, bits=2)[1], keys)
  step = float(jnp.max(_roundtrip(normal, KEY, bits=2)[0].scale.astype(jnp.float32)))
  assert_unbiased(near, np.asarray(normal, np.float64), atol=step)


# ----------------------------------------------------------------------------- 2: float32 at +-3e38


def _f32_wide():
  """Rows (one group each) whose range or step leaves float32's comfortable range."""
  rng = np.random.default_rng(4)
  u = lambda a, b: rng.uniform(a, b, 254)
  rows = [
    np.concatenate([[-3e38, 3e38], u(-3e38, 3e38)]),  # range 6e38 > float32 max
    np.concatenate([[-F32_MAX, F32_MAX], u(-F32_MAX, F32_MAX)]),
    np.concatenate([[0.0, 3e38], u(0.0, 3e38)]),  # step > 8.5e37 at 1 and 2 bits
    np.concatenate([[1e38, 3e38], u(1e38, 3e38)]),
    np.concatenate([[-1e-30, 2e38], np.zeros(254)]),  # tiny values in a wide group
    np.concatenate([[3e38, -3e38], rng.standard_normal(254)]),
  ]
  return jnp.asarray(np.stack(rows), jnp.float32)


@pytest.mark.slow
@pytest.mark.parametrize("stochastic", [True, False])
@pytest.mark.parametrize("bits", BITS)
def test_extreme_float32_groups_are_covered(bits, stochastic):
  x = _f32_wide()
  p, y = _roundtrip(x, KEY, bits=bits, stochastic=stochastic)
  assert bool(jnp.isfinite(y).all())
  lo, step, top = _check_grid(x, p, y, stochastic)
  x64 = np.asarray(x, np.float64)
  span = x64.max(1, keepdims=True) - x64.min(1, keepdims=True)
  # Every group is covered, except at 1 bit a range above bf16's largest value
  # (the step would not fit): documented to clip at minimum + 3.39e38.
  clipped = (bits == 1) & (span > BF16_MAX)
  assert ((top >= x64) | clipped).all()
  assert (step[clipped[:, 0]] == BF16_MAX).all()


@pytest.mark.slow
def test_extreme_float32_rounding_is_unbiased():
  x = _f32_wide()[jnp.array([0, 2, 3])]
  keys = jax.random.split(jax.random.key(5), 256)
  for bits in (1, 2):
    rows = x if bits == 2 else x[1:]  # at 1 bit row 0's range (6e38) is clipped (see above)
    samples = over_keys(lambda k: _roundtrip(rows, k, bits=bits)[1], keys)
    step = float(jnp.max(_roundtrip(rows, KEY, bits=bits)[0].scale.astype(jnp.float32)))
    assert_unbiased(samples, np.asarray(rows, np.float64), atol=step)


@pytest.mark.slow
@pytest.mark.parametrize("bits", [1, 8])
def test_extreme_groups_kernels_are_bit_exact(bits):
  """The Pallas kernels (interpret mode) store and reconstruct the reference's bits."""
  for x in (_f32_wide(), _f16_extremes()):
    seed = jnp.uint32(11)
    ref = _jitted(quantize_reference, x, seed, bits=bits, group_size=256)
    got = _jitted(
      pergroup_kernels.quantize, x, seed, bits=bits, group_size=256, interpret=True, fast=True
    )
    assert_same_packed(got, ref)
    y = _jitted(dequantize_reference, ref)
    assert_same_bits(_jitted(pergroup_kernels.dequantize, ref, interpret=True, fast=True), y)
    assert bool(jnp.isfinite(y).all())


@pytest.mark.slow
def test_per_sample_widths_reconstruct_finite_at_the_range_ends():
  """The per-sample quantizer (one width per sample) shares the group math: finite
  too, and its Pallas kernels (interpret mode) store and reconstruct the same bits."""
  from jact._core import persample
  from jact.kernels._per_sample import pallas_triton as persample_kernels
  from jact.kernels._per_sample import reference

  for x in (_f16_extremes(), _f32_wide()):
    widths = jnp.array([1, 2, 4, 8, 2, 1], jnp.int32)
    args = dict(capacity_bytes=persample.per_sample_capacity(x.shape, 4, 256), group_size=256)
    seed = jnp.uint32(5)
    ref = _jitted(
      lambda x, w, seed: reference.quantize_per_sample_reference(x, w, seed=seed, **args),
      x,
      widths,
      seed,
    )
    y = _jitted(reference.dequantize_per_sample_reference, ref)
    assert y.dtype == x.dtype and bool(jnp.isfinite(y).all())
    got = _jitted(
      lambda x, w, seed: persample_kernels.quantize_per_sample(
        x, w, seed=seed, interpret=True, **args
      ),
      x,
      widths,
      seed,
      fast=True,
    )
    for field in ("data", "bits", "minimum", "scale"):
      assert_same_bits(getattr(got, field), getattr(ref, field))
    assert_same_bits(
      _jitted(persample_kernels.dequantize_per_sample, ref, interpret=True, fast=True), y
    )


# --------------------------------------------------------------------- 5: dequantize a plain array


@pytest.mark.parametrize(
  "value", [jnp.ones((2, 8)), np.ones(3), C.Fixpoint(8).compress(jnp.ones((2, 8)))]
)
def test_dequantize_names_the_expected_type(value):
  with pytest.raises(TypeError, match=r"jact\.dequantize takes the jact\.Packed .*jact\.quantize"):
    jact.dequantize(value)


# --------------------------------------------------------------------------- 4: zero-size quantize


@pytest.mark.slow
@pytest.mark.parametrize("shape", [(0, 256), (0, 3, 5), (4, 0), (0,), (2, 0, 3)])
@pytest.mark.parametrize("bits", [1, 8])
def test_quantize_and_dequantize_zero_size(shape, bits):
  x = jnp.zeros(shape, jnp.bfloat16)
  p, y = _roundtrip(x, KEY, bits=bits)
  assert y.shape == shape and y.dtype == jnp.bfloat16
  assert p.nbytes == 0


# -------------------------------------------------------------------------- 3: DIVISION non-finite


def _hfc_steps(stored):
  """Per-element HFC step of a Division-stored (N, ...) map, shape (N, D)."""
  return np.abs(_per_element(stored.arrays["hfc"].scale, stored.arrays["hfc"]))  # flag: sign


@pytest.mark.slow
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("lfc_dtype", [jnp.bfloat16, jnp.float32])
def test_division_isolates_non_finite_values(bad, lfc_dtype):
  x = np.random.default_rng(6).standard_normal((2, 8, 8, 16)).astype(np.float32)
  x[0, 1, 2, 3] = bad  # block (0, 0) of sample 0
  c = C.Division(block=4, bits=8, lfc_dtype=lfc_dtype)
  stored = jax.jit(c.compress)(jnp.asarray(x), jnp.uint32(7))
  y = np.asarray(jax.jit(c.decompress)(stored), np.float64)
  # Non-finite exactly where x is (the per-group quantizer's flagged groups), of the same kind.
  np.testing.assert_array_equal(np.isfinite(y), np.isfinite(x))
  np.testing.assert_array_equal(y[0, 1, 2, 3], bad)
  assert np.isfinite(np.asarray(stored.arrays["lfc"], np.float32)).all()
  finite = np.isfinite(x)
  err = np.abs(np.where(finite, y - x, 0.0)).reshape(2, -1)
  bound = _hfc_steps(stored) * (1 + 1e-3) + 1e-6  # one HFC step (x - LFC is exact in float32)
  assert (err[finite.reshape(2, -1)] <= bound[finite.reshape(2, -1)]).all()
  # The LFC of the poisoned block is the mean of its 15 finite values (bf16: 2**-8 relative).
  lfc = np.asarray(jnp.asarray(stored.arrays["lfc"], jnp.float32), np.float64)
  block = x[0, :4, :4, 3]
  assert abs(lfc[0, 0, 0, 3] - block[np.isfinite(block)].mean()) <= 1e-2


@pytest.mark.slow
def test_division_unbiased_around_a_nan():
  x = np.random.default_rng(7).standard_normal((1, 8, 8, 4)).astype(np.float32)
  x[0, 2, 1, 0] = np.nan
  c = C.Division(block=4, bits=2)
  xj = jnp.asarray(x)
  samples = over_keys(
    lambda k: c.decompress(c.compress(xj, jact.rng.seed_from_key(k))),
    jax.random.split(jax.random.key(8), 256),
  )
  finite = np.isfinite(x)
  np.testing.assert_array_equal(
    np.isfinite(np.asarray(samples)), np.broadcast_to(finite, np.shape(samples))
  )
  step = float(_hfc_steps(jax.jit(c.compress)(xj, jnp.uint32(0))).max())
  assert_unbiased(np.asarray(samples)[:, finite], x[finite].astype(np.float64), atol=step)


@pytest.mark.slow
@pytest.mark.parametrize("shape", [(2, 8, 8, 16), (2, 6, 5, 3)])  # one-pass and two-kernel paths
def test_division_kernel_matches_reference_on_non_finite_input(shape):
  x = np.random.default_rng(9).standard_normal(shape).astype(np.float32)
  flat = x.reshape(-1)
  flat[[3, 40, 77]] = [np.nan, np.inf, -np.inf]
  flat[100:116] = 3e38  # a block whose float32 sum overflows: its LFC is stored as 0
  args = dict(block=4, bits=2, group_size=256, lfc_dtype=jnp.float16)
  x = jnp.asarray(x)
  lfc, hfc = _jitted(
    division_kernels.division_compress, x, jnp.uint32(3), interpret=True, fast=True, **args
  )
  ref_lfc, ref_hfc = _jitted(division_compress_reference, x, jnp.uint32(3), **args)
  assert_same_bits(lfc, ref_lfc)
  assert_same_packed(hfc, ref_hfc)
  assert bool(jnp.isfinite(ref_lfc).all())


# ---------------------------------------------------------------- 4: zero-size compressors and ops


COMPRESSORS = [
  C.PerGroup(2),
  C.Division(block=4, bits=2),
  C.Division(block=4, keep="lfc"),
  C.Division(block=4, keep="hfc"),
  C.BLPA(4),
  C.Fixpoint(8),
  C.ZeroValue(),
  C.ZeroValue(inner=C.Fixpoint(4)),
]


@pytest.mark.slow
@pytest.mark.parametrize("shape", [(0, 8, 8, 4), (3, 0, 8, 4), (2, 4, 4, 0), (0, 16)])
@pytest.mark.parametrize("compressor", COMPRESSORS, ids=repr)
def test_compressors_take_zero_size_inputs(compressor, shape):
  if len(shape) == 2 and getattr(compressor, "keep", None) == "lfc":
    shape = (0, 4, 16)  # keep='lfc' needs spatial axes (rank 2 is an error by design)
  x = jnp.zeros(shape, jnp.float16)
  stored = jax.jit(compressor.compress)(x, jnp.uint32(1))
  y = jax.jit(compressor.decompress)(stored)
  assert y.shape == shape and y.dtype == jnp.float16
  assert stored.nbytes == compressor.stored_bytes(shape, x.dtype)


def _layer_norm(x, scale, bias, eps=1e-6):
  mu = x.mean(-1, keepdims=True)
  return (x - mu) * lax.rsqrt(((x - mu) ** 2).mean(-1, keepdims=True) + eps) * scale + bias


_CONV = dict(window_strides=(1, 1), padding="SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
# name -> (jact op, plain JAX op, shapes of (input, parameter))
OPS = {
  "dense": (
    lambda x, w, k: ops.dense(x, w, key=k, bits=2),
    lambda x, w: x @ w,
    ((0, 256), (256, 3)),
  ),
  "dense_division": (
    lambda x, w, k: ops.dense(x, w, key=k, compressor=C.Division(block=4)),
    lambda x, w: x @ w,
    ((0, 256), (256, 3)),
  ),
  "dense_fixpoint": (
    lambda x, w, k: ops.dense(x, w, compressor=C.Fixpoint(8)),
    lambda x, w: x @ w,
    ((0, 256), (256, 3)),
  ),
  "conv": (
    lambda x, w, k: ops.conv(x, w, key=k, bits=2),
    lambda x, w: lax.conv_general_dilated(x, w, **_CONV),
    ((0, 8, 8, 4), (3, 3, 4, 5)),
  ),
  "conv_division": (
    lambda x, w, k: ops.conv(x, w, key=k, compressor=C.Division(block=4)),
    lambda x, w: lax.conv_general_dilated(x, w, **_CONV),
    ((0, 8, 8, 4), (3, 3, 4, 5)),
  ),
  "gelu": (
    lambda x, w, k: ops.gelu(x, key=k, bits=2) * w,
    lambda x, w: jax.nn.gelu(x) * w,
    ((0, 256), (256,)),
  ),
  "softmax": (
    lambda x, w, k: ops.softmax(x, key=k, bits=2) * w,
    lambda x, w: jax.nn.softmax(x) * w,
    ((0, 256), (256,)),
  ),
  "layer_norm": (
    lambda x, w, k: ops.layer_norm(x, w, jnp.zeros(256), key=k, bits=2),
    lambda x, w: _layer_norm(x, w, 0.0),
    ((0, 256), (256,)),
  ),
  "compressed": (
    lambda x, w, k: jact.compressed(lambda x, w: jnp.tanh(x @ w), bits=2, compress_argnums=(0,))(
      x, w, key=k
    ),
    lambda x, w: jnp.tanh(x @ w),
    ((0, 256), (256, 3)),
  ),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(OPS))
def test_ops_take_an_empty_batch(name):
  op, plain, (x_shape, w_shape) = OPS[name]
  x = jnp.zeros(x_shape)
  w = jnp.asarray(np.random.default_rng(10).standard_normal(w_shape), jnp.float32)
  y = jax.jit(lambda x, w: op(x, w, KEY))(x, w)
  y_plain = plain(x, w)
  assert y.shape == y_plain.shape and y.dtype == y_plain.dtype
  loss = lambda f: lambda x, w: jnp.sum(f(x, w) ** 2)
  gx, gw = jax.jit(jax.grad(loss(lambda x, w: op(x, w, KEY)), (0, 1)))(x, w)
  px, pw = jax.grad(loss(plain), (0, 1))(x, w)
  assert gx.shape == px.shape == x.shape and gw.shape == pw.shape == w.shape
  np.testing.assert_array_equal(np.asarray(gw), np.asarray(pw))  # zeros: nothing to sum


# ----------------------------------------------------------------------------- 6: float64


F64_OPS = {
  "dense": lambda x, w, k: ops.dense(x, w, key=k, bits=2),
  "dot_general": lambda x, w, k: ops.dot_general(
    x, w, (((1,), (0,)), ((), ())), key=k, bits=2, compress=(True, False)
  ),
  "einsum": lambda x, w, k: ops.einsum("nd,dk->nk", x, w, key=k, bits=2),
  "conv": lambda x, w, k: ops.conv(
    x.reshape(4, 8, 8, 4), w[:36].reshape(3, 3, 4, 3), key=k, bits=2
  ),
  "conv_transpose": lambda x, w, k: ops.conv_transpose(
    x.reshape(4, 8, 8, 4), w[:36].reshape(3, 3, 4, 3), (1, 1), "SAME", key=k, bits=2
  ),
  "gelu": lambda x, w, k: ops.gelu(x, key=k, bits=2),
  "softmax": lambda x, w, k: ops.softmax(x, key=k, bits=2),
  "layer_norm": lambda x, w, k: ops.layer_norm(x, jnp.ones(256, x.dtype), None, key=k, bits=2),
}


@pytest.mark.parametrize("name", sorted(F64_OPS))
def test_float64_is_rejected_at_the_op_call(name):
  with jax.enable_x64(True):
    x = jnp.ones((4, 256), jnp.float64)
    w = jnp.ones((256, 3), jnp.float64)
    assert x.dtype == jnp.float64
    with pytest.raises(
      TypeError,
      match=r"jact\.ops\.\w+ .*float32, bfloat16 or float16.*"
      r"got float64.*astype\(jnp\.float32\)",
    ):
      F64_OPS[name](x, w, KEY)  # the forward call itself, no grad needed


def test_float64_uncompressed_dense_still_differentiates():
  """bits=None stores nothing compressed, so float64 is fine there."""
  with jax.enable_x64(True):
    x = jnp.linspace(-1.0, 1.0, 4 * 8, dtype=jnp.float64).reshape(4, 8)
    w = jnp.ones((8, 3), jnp.float64)
    g = jax.grad(lambda w: ops.dense(x, w, bits=None).sum())(w)
    assert g.dtype == jnp.float64
    np.testing.assert_allclose(np.asarray(g), np.asarray(x).sum(0)[:, None] * np.ones((1, 3)))
