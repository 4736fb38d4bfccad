"""DIVISION compressor: stored bytes, unbiasedness, LFC layout, ops integration."""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jact
from jact.compressors import PerGroup
from jact.compressors._base import from_dict
from jact.compressors._division import Division
from stats import DRAWS, assert_unbiased, over_keys


def ref_pool(x, block):
  """LFC reference: mean over each block's valid elements, blocks of min(B, S)."""
  x = np.asarray(x, np.float64)
  spatial = x.shape[1:-1]
  blocks = [min(block, s) for s in spatial]
  n = [-(-s // b) for s, b in zip(spatial, blocks)]
  out = np.zeros((x.shape[0], *n, x.shape[-1]))
  for idx in itertools.product(*map(range, n)):
    sl = tuple(slice(i * b, min((i + 1) * b, s)) for i, b, s in zip(idx, blocks, spatial))
    out[(slice(None), *idx)] = x[(slice(None), *sl)].mean(axis=tuple(range(1, len(spatial) + 1)))
  return out


def ref_upsample(lfc, block, spatial):
  up = np.asarray(lfc)
  for axis, s in enumerate(spatial, start=1):
    up = np.repeat(up, min(block, s), axis=axis).take(np.arange(s), axis=axis)
  return up


@functools.partial(jax.jit, static_argnums=0)
def roundtrip(c, x, seed):
  """(stored, reconstruction), jitted: eager dispatch compiles every primitive apart (slow)."""
  stored = c.compress(x, seed)
  return stored, c.decompress(stored)


def stored_nbytes(c, shape, dtype=jnp.float32):
  """Bytes of the pytree `compress` returns, from its shapes alone (nothing runs)."""
  x = jax.ShapeDtypeStruct(shape, dtype)
  return jax.eval_shape(c.compress, x, jax.ShapeDtypeStruct((), jnp.uint32)).nbytes


def randn(shape, seed=0, dtype=jnp.float32):
  """Host-made normals (eager jax.random would compile per shape)."""
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, np.float32).astype(dtype))


SHAPES = [
  (2, 20, 8),  # 1-D, 20 not divisible by 8
  (2, 5, 16),  # 1-D map shorter than B
  (2, 12, 6, 16),  # 2-D: H partial, W shorter than B
  (2, 16, 16, 32),  # 2-D divisible
  (1, 9, 4, 10, 8),  # 3-D mixed
  (4, 3, 3, 8),  # sample shorter than a group (a group of its own)
  (4, 1, 1, 4),  # samples of 4 values: one row
  (3, 40),  # rank 2: no LFC
]


@pytest.mark.slow
@pytest.mark.parametrize("shape", SHAPES)
def test_stored_bytes_match_compressed(shape):
  for c in (Division(), Division(block=4, bits=1, lfc_dtype=jnp.float32)):
    for dtype in (jnp.float32, jnp.bfloat16):
      assert c.stored_bytes(shape, dtype) == stored_nbytes(c, shape, dtype), (c, shape)


@pytest.mark.parametrize("block,bits", [(8, 2), (4, 4)])
def test_compression_ratio_matches_paper(block, bits):
  x = jax.ShapeDtypeStruct((8, 32, 32, 64), jnp.float32)
  nbytes = x.size * 4
  # Per value, in units of a float32 (4 bytes): LFC 4/B^2 bytes -> B^-2; HFC codes Q/8 bytes ->
  # Q/32;
  # group statistics 4 bytes (bf16 minimum + step) per 256 values -> 32/(32*256). A bf16 LFC halves
  # B^-2.
  for lfc_dtype, lfc_term in ((jnp.float32, block**-2), (jnp.bfloat16, block**-2 / 2)):
    c = Division(block=block, bits=bits, lfc_dtype=lfc_dtype)
    stored = stored_nbytes(c, x.shape, x.dtype)
    assert stored == c.stored_bytes(x.shape, x.dtype)
    expected = 1.0 / (lfc_term + bits / 32 + 32 / (32 * 256))
    assert nbytes / stored == pytest.approx(expected, rel=1e-9)


@pytest.mark.slow
@pytest.mark.parametrize(
  "lfc_dtype,offset", [(jnp.bfloat16, False), (jnp.float32, False), (jnp.bfloat16, True)]
)
def test_unbiased_and_lfc_deterministic(lfc_dtype, offset):
  c, k = Division(block=4, bits=2, lfc_dtype=lfc_dtype), DRAWS  # a 1% bias shows (stats.py)
  x = randn((2, 10, 12, 8), seed=1)
  if offset:
    # Every block mean is 1/3, which bf16 rounds up (0.333984375): a residual taken against
    # the unrounded LFC would be biased by the same -6.5e-4 everywhere (|pooled z| ~ 50).
    x = 0.01 * (x - ref_upsample(ref_pool(x, 4), 4, x.shape[1:-1])) + 1 / 3
    x = jnp.asarray(x, jnp.float32)
  seeds = jnp.arange(k, dtype=jnp.uint32)

  def one(seed):
    stored = c.compress(x, seed)
    return c.decompress(stored), stored.arrays

  samples, arrays = over_keys(one, seeds)
  samples = np.asarray(samples)
  assert samples.shape == (k, *x.shape)

  # The LFC and the HFC's group statistics do not depend on the seed.
  lfc, hfc = arrays["lfc"], arrays["hfc"]
  for a in (lfc, hfc.minimum, hfc.scale):
    a = np.asarray(a, np.float32)
    np.testing.assert_array_equal(a, np.broadcast_to(a[0], a.shape))
  np.testing.assert_allclose(
    np.asarray(lfc[0], np.float64),
    ref_pool(x, 4),
    rtol=1e-2 if lfc_dtype == jnp.bfloat16 else 1e-6,
    atol=1e-6,
  )

  # Unbiased (tests/stats.py tolerances: pooled |z| < 4, mean z^2 < 1.6). As in
  # test_quantize, HFC values whose rounding probability is below 10/K could show no spread
  # in K draws ((1 - 10/K)^K ~ 5e-5); they are left out (~10%), values on the grid stay in.
  d, g = x[0].size, hfc.group_size
  residual = np.asarray(x) - ref_upsample(np.asarray(lfc[0], np.float32), 4, x.shape[1:-1])
  lo = np.repeat(np.asarray(hfc.minimum[0], np.float32), g, axis=1)[:, :d].reshape(x.shape)
  step = np.repeat(np.asarray(hfc.scale[0], np.float32), g, axis=1)[:, :d].reshape(x.shape)
  pos = (residual - lo) / step
  margin = np.minimum(pos - np.floor(pos), np.ceil(pos) - pos)
  keep = (margin >= 10 / k) | (margin <= 1e-7)
  assert keep.mean() > 0.85
  assert_unbiased(samples[:, keep], np.asarray(x)[keep])


@pytest.mark.slow
def test_error_falls_with_bits():
  x = randn((4, 16, 16, 16), seed=2)
  seeds = jnp.arange(4, dtype=jnp.uint32)

  @jax.jit
  def mse(x):
    out = []
    for q in (1, 2, 4, 8):
      c = Division(bits=q)
      err = jax.vmap(lambda s: jnp.mean((c.decompress(c.compress(x, s)) - x) ** 2))(seeds)
      out.append(err.mean())
    return jnp.stack(out)

  m = np.asarray(mse(x))
  assert (np.diff(m) < 0).all(), m
  assert m[-1] < 1e-4 * float(np.mean(np.asarray(x) ** 2)), m  # 8 bits: step ~ range / 255


@pytest.mark.parametrize("lfc_dtype", [jnp.float32, jnp.bfloat16])
def test_blockwise_constant_is_exact(lfc_dtype):
  # Constant within every 4x4 block, including the partial ones: HFC = 0, so decompress == x.
  values = np.random.default_rng(3).integers(-8, 9, (2, 3, 3, 4)).astype(np.float32) / 4
  x = jnp.asarray(ref_upsample(values, 4, (10, 12)), jnp.float32)
  stored, out = roundtrip(Division(block=4, lfc_dtype=lfc_dtype), x, jnp.uint32(9))
  np.testing.assert_array_equal(np.asarray(stored.arrays["lfc"], np.float32), values)
  np.testing.assert_array_equal(out, x)


@pytest.mark.parametrize(
  "shape,lfc_shape",
  [
    ((2, 13, 3), (2, 4, 3)),  # 1-D: partial last block (13 = 3*4 + 1)
    ((2, 5, 9, 3, 2), (2, 2, 3, 1, 2)),  # 3-D: partial, partial, shorter than B
    ((3, 6, 7, 5), (3, 2, 2, 5)),  # 2-D: both partial
  ],
)
@pytest.mark.slow
def test_layouts_and_partial_blocks(shape, lfc_shape):
  c = Division(block=4, lfc_dtype=jnp.float32)
  x = randn(shape, seed=4)
  stored, out = roundtrip(c, x, jnp.uint32(2))
  lfc = stored.arrays["lfc"]
  assert lfc.shape == lfc_shape and lfc.dtype == jnp.float32
  assert stored.nbytes == c.stored_bytes(shape, x.dtype)
  np.testing.assert_allclose(lfc, ref_pool(x, 4), rtol=1e-6, atol=1e-6)
  assert out.shape == x.shape and out.dtype == x.dtype
  # The reconstruction error is the HFC's quantization error only: within one step of its group.
  hfc = np.asarray(x) - ref_upsample(lfc, 4, shape[1:-1])
  assert np.abs(np.asarray(out) - np.asarray(x)).max() <= np.ptp(hfc) / 3 * 1.05 + 1e-6


def test_rank2_is_plain_per_group():
  x = randn((5, 300), seed=5)
  c = Division(bits=4)
  stored, out = roundtrip(c, x, jnp.uint32(7))
  assert set(stored.arrays) == {"hfc"} and out.shape == x.shape
  ref = PerGroup(4, 256, True)
  np.testing.assert_array_equal(
    out, jax.jit(lambda x: ref.decompress(ref.compress(x, jnp.uint32(7))))(x)
  )
  assert c.stored_bytes(x.shape, x.dtype) == ref.stored_bytes(x.shape, x.dtype) == stored.nbytes


def test_dtypes_and_settings():
  x = randn((2, 8, 8, 16), seed=6, dtype=jnp.bfloat16)
  c = Division(block=4)
  stored, out = roundtrip(c, x, jnp.uint32(1))
  assert out.dtype == jnp.bfloat16
  assert jax.eval_shape(lambda s: c.decompress(s, jnp.float32), stored).dtype == jnp.float32
  assert stored.nbytes == c.stored_bytes(x.shape, x.dtype)
  assert c.unbiased and c.needs_key and c.bits == 2
  assert c.with_bits(4) == Division(block=4, bits=4) and c.with_bits(4).bits == 4
  assert c.average_bits == pytest.approx(2 + 32 / 256 + 16 / 16)
  assert Division(lfc_dtype="float32").average_bits == pytest.approx(2 + 1 / 8 + 32 / 64)
  assert from_dict(c.to_dict()) == c and hash(from_dict(c.to_dict())) == hash(c)
  assert Division(lfc_dtype="bfloat16") == Division()


@pytest.mark.slow
def test_conv_grad_and_residual_report():
  x = randn((2, 16, 16, 8), seed=7)
  kernel = jnp.asarray(np.asarray(randn((3, 3, 8, 4), seed=8)) / 8)
  c = Division()

  def loss(x, kernel, key):
    return jnp.sum(jact.ops.conv(x, kernel, key=key, compressor=c, name="c") ** 2)

  key = jax.random.key(0)
  gx, gk = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, kernel, key)
  assert gx.shape == x.shape and gk.shape == kernel.shape
  gx, gk = np.asarray(gx), np.asarray(gk)
  assert np.isfinite(gx).all() and np.isfinite(gk).all()
  conv = lambda x, k: jax.lax.conv_general_dilated(
    x, k, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
  )
  # The kernel is kept exact, so the input gradient is the exact one; the
  # kernel gradient is the exact formula at the reconstruction x_hat (same
  # seed as the op), with the exact output's cotangent 2 y.
  exact_gx = jax.grad(lambda x: jnp.sum(conv(x, kernel) ** 2))(x)
  np.testing.assert_allclose(gx, exact_gx, rtol=1e-5, atol=1e-5 * float(jnp.abs(exact_gx).max()))
  site = jact._engine.rounding.site_seed(jact.rng.seed_from_key(key), 0, "c.lhs")
  x_hat = c.decompress(c.compress(x, site))
  _, vjp = jax.vjp(lambda k: conv(x_hat, k), kernel)
  (want,) = vjp(2 * conv(x, kernel))
  np.testing.assert_allclose(gk, want, rtol=2e-4, atol=2e-4 * float(jnp.abs(want).max()))
  assert not np.allclose(x_hat, x, atol=1e-3)  # the reconstruction is lossy
  report = jact.residual_report(loss, x, kernel, key)
  assert report.by_name()["c.lhs"].bytes == c.stored_bytes(x.shape, x.dtype)


@pytest.mark.parametrize(
  "kwargs,match",
  [
    (dict(block=0), "block must be a positive int"),
    (dict(block=2.5), "block must be a positive int"),
    (dict(block=True), "block must be a positive int"),
    (dict(bits=9), "bits must be one of"),
    (dict(group_size=100), "multiple of 8"),
    (dict(lfc_dtype=jnp.int8), "lfc_dtype must be float32, bfloat16 or float16"),
    (dict(lfc_dtype="nonsense"), "lfc_dtype must be"),
  ],
)
def test_bad_settings(kwargs, match):
  with pytest.raises(ValueError, match=match):
    Division(**kwargs)


def test_bad_inputs():
  c = Division()
  with pytest.raises(TypeError, match="cast it first"):
    c.compress(jnp.ones((2, 8, 8, 3), jnp.int32), jnp.uint32(0))
  for shape in ((16,), (1, 2, 2, 2, 2, 2)):
    with pytest.raises(ValueError, match="rank 2 to 5"):
      c.compress(jnp.ones(shape), jnp.uint32(0))
    with pytest.raises(ValueError, match="rank 2 to 5"):
      c.stored_bytes(shape, jnp.float32)
