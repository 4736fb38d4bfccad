"""Tests for jact.persample: per-sample widths match jact.quantize sample by
sample (values, layout, noise), the static buffer under jit, the fallback,
unbiasedness, the error bound, and errors."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jact
from jact._core.allocate import allocate_per_sample
from jact._core.persample import PackedPerSample, per_sample_capacity
from jact.kernels._per_sample.api import dequantize_per_sample, quantize_per_sample
from jact._core.quantize import effective_group_size
from jact._core.packing import pack_bits, unpack_bits
from stats import assert_unbiased


@functools.partial(jax.jit, static_argnames=("capacity", "stochastic"))
def _roundtrip(x, bits, seed=None, *, capacity, stochastic=True):
  p = quantize_per_sample(x, bits, capacity_bytes=capacity, stochastic=stochastic, seed=seed)
  return p, dequantize_per_sample(p)


@functools.partial(jax.jit, static_argnames=("bits",))
def _reference(x, *, bits):
  """For every sample n: dequantize(quantize(x[n:n+1], bits=bits[n])) and its
  codes packed planar over the whole sample at bits[n] (deterministic)."""

  def one(xn, b):
    q = jact.quantize(xn[None], bits=b, stochastic=False)
    return jact.dequantize(q)[0], pack_bits(unpack_bits(q.data, b).reshape(-1), b)

  out = {b: jax.vmap(functools.partial(one, b=b))(x) for b in set(bits)}
  return (
    jnp.stack([out[b][0][n] for n, b in enumerate(bits)]),
    jnp.concatenate([out[b][1][n] for n, b in enumerate(bits)]),
  )


def _normal(shape, seed=0, dtype=jnp.float32):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape).astype(dtype))


def _case(shape, dtype):
  """Inputs with ranges that differ per sample and a few non-finite values
  (built in numpy: eager jax ops would each compile)."""
  x = np.random.default_rng(len(shape)).standard_normal(shape)
  x *= np.arange(1, shape[0] + 1).reshape((-1,) + (1,) * (len(shape) - 1))
  x[1, 0], x[2, 0] = np.inf, np.nan
  return jnp.asarray(x.astype(dtype))


# (shape, dtype): samples shorter than a group (10 values: one group of 16);
# a per-sample size that is no multiple of the group size (300 values:
# padded to 2 x 256); 784 values (7 groups of 112).
CASES = [((6, 10), jnp.bfloat16), ((6, 3, 10, 10), jnp.float32), ((6, 784), jnp.bfloat16)]
BITS = (1, 2, 4, 8, 1, 2)  # 18 bits per value in all: exactly fills a 3-bit average
PLANES = (3, 5, 6, 7, 1, 2)  # bit-plane widths, 24 bits per value: a 4-bit average


@pytest.mark.slow
@pytest.mark.parametrize("shape,dtype", CASES)
@pytest.mark.parametrize("bits", [BITS, PLANES])
def test_matches_quantize_per_sample(shape, dtype, bits):
  x = _case(shape, dtype)
  cap = per_sample_capacity(shape, sum(bits) / 6)
  p, y = _roundtrip(x, jnp.array(bits, jnp.int32), capacity=cap, stochastic=False)
  want, data = _reference(x, bits=bits)
  assert p.data.shape == (cap,) and y.dtype == x.dtype and y.shape == x.shape
  np.testing.assert_array_equal(p.bits, bits)
  np.testing.assert_array_equal(
    np.asarray(y, np.float32), np.asarray(want, np.float32)
  )  # bit-exact
  # Segments lie back to back, exactly filling the buffer here; within one,
  # the sample's codes as `pack_bits` lays them out at its width (planar:
  # byte j holds values j, j+Q, ...; 3/5/6/7 bits: bit planes).
  np.testing.assert_array_equal(p.data, data)
  d = np.prod(shape[1:])
  g = effective_group_size(d, 256)
  assert p.group_size == g and p.minimum.shape == p.scale.shape == (6, -(-d // g))
  assert p.nbytes == cap + 6 + 4 * p.minimum.size


@pytest.mark.slow
def test_static_buffer_under_jit():
  traces = []

  @jax.jit
  def f(x, w, key):
    traces.append(1)
    bits = allocate_per_sample(w, 2.5)
    p = quantize_per_sample(x, bits, capacity_bytes=per_sample_capacity(x.shape, 2.5), key=key)
    # What jact.quantize gives every sample at 2 bits, with the same key.
    return p, dequantize_per_sample(p), jact.dequantize(jact.quantize(x, key, bits=2))

  x = _normal((8, 3, 10, 10), seed=3)
  cap = per_sample_capacity(x.shape, 2.5)
  rng = np.random.default_rng(0)
  widths, compared = set(), 0
  for i in range(3):
    w = jnp.asarray(rng.lognormal(0.0, 3.0, 8), jnp.float32)
    p, y, same_key = f(x, w, jax.random.key(i))
    assert isinstance(p, PackedPerSample) and p.data.shape == (cap,) and p.data.dtype == jnp.uint8
    assert p.nbytes == cap + 8 + 4 * 8 * 2
    assert int(p.bits.astype(jnp.int32).sum()) <= 20
    # A sample at 2 bits gets exactly the noise jact.quantize(x, bits=2) uses.
    for n in np.flatnonzero(np.asarray(p.bits) == 2):
      np.testing.assert_array_equal(y[n], same_key[n])
      compared += 1
    widths.add(tuple(p.bits.tolist()))
  assert len(traces) == 1 and len(widths) > 1 and compared
  assert len(jax.tree.leaves(p)) == 4


def test_fallback_to_one_bit():
  shape, dtype = CASES[0]
  x = _case(shape, dtype)
  cap = per_sample_capacity(shape, 3.0)  # 18 bits per value in all
  p1, y1 = _roundtrip(x, np.ones((6,), np.int32), capacity=cap, stochastic=False)
  for bits in ([8] * 6, [1, 2, 4, 8, 2, 2]):  # 48 and 19 bits per value: too many
    p, y = _roundtrip(x, jnp.array(bits, jnp.int32), capacity=cap, stochastic=False)
    np.testing.assert_array_equal(p.bits, 1)
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(y1, np.float32))
    np.testing.assert_array_equal(
      np.isfinite(np.asarray(y, np.float32)), np.isfinite(np.asarray(x, np.float32))
    )  # non-finite kept
  # Widths outside 1..8 are clipped into it (here 16 bits: they fit).
  p, _ = _roundtrip(x, jnp.array([0, 3, 2, 9, -7, 1], jnp.int32), capacity=cap, stochastic=False)
  np.testing.assert_array_equal(p.bits, [1, 3, 2, 8, 1, 1])


def test_unbiased_and_error_bound():
  scales = np.array([[0.1], [1.0], [3.0], [1e3], [0.5], [2.0], [7.0], [30.0]], np.float32)
  x = _normal((8, 40), seed=6) * scales
  bits = jnp.array([1, 2, 4, 8, 3, 5, 6, 7], jnp.int32)  # every width 1..8
  cap = per_sample_capacity(x.shape, 4.5)
  run = jax.jit(jax.vmap(lambda s: _roundtrip(x, bits, s, capacity=cap)))
  k = 1024
  p, y = run(jnp.arange(k, dtype=jnp.uint32))
  # Within one step (the group's stored scale) of the input, every draw.
  step = p.scale.astype(jnp.float32)[:, :, :1]  # one group per sample here
  assert bool((jnp.abs(y - x) <= step * (1 + 1e-6)).all())
  # Unbiased: pooled z within +-4 and mean z^2 < 1.6 over K = 1024 fixed seeds.
  assert_unbiased(y, x)


def test_errors():
  x = np.ones((4, 64), np.float32)  # numpy: no eager jax ops before the checks
  bits = np.full((4,), 2, np.int32)
  with pytest.raises(ValueError, match="per_sample_capacity"):
    quantize_per_sample(x, bits, capacity_bytes=31, stochastic=False)
  with pytest.raises(ValueError, match="capacity_bytes"):
    quantize_per_sample(x, bits, capacity_bytes=32.0, stochastic=False)
  with pytest.raises(ValueError, match="shape \\(4,\\)"):
    quantize_per_sample(x, bits[:3], capacity_bytes=64, stochastic=False)
  with pytest.raises(ValueError, match="integer array"):
    quantize_per_sample(x, bits.astype(jnp.float32), capacity_bytes=64, stochastic=False)
  with pytest.raises(ValueError, match="PRNG key"):
    quantize_per_sample(x, bits, capacity_bytes=64)
  with pytest.raises(TypeError, match="float32"):
    quantize_per_sample(x.astype(jnp.int32), bits, capacity_bytes=64, stochastic=False)
  with pytest.raises(ValueError, match="sample axis"):
    quantize_per_sample(np.float32(1.0), bits, capacity_bytes=64, stochastic=False)
  with pytest.raises(ValueError, match="group_size"):
    quantize_per_sample(x, bits, capacity_bytes=64, group_size=12, stochastic=False)
  for avg in (0.5, float("nan"), None):
    with pytest.raises(ValueError, match="avg_bits"):
      per_sample_capacity(x.shape, avg)


def test_per_sample_compressor_at_integer_widths():
  """`PerSample(widths=...)`: ActNN's 1..8 reach the store, JSON keeps them, a
  plan budget keeps them, and a bad set names the fix."""
  C = jact.compressors
  x = jnp.asarray(
    np.random.default_rng(4).standard_normal((8, 256)).astype(np.float32)
    * np.geomspace(0.01, 100.0, 8)[:, None].astype(np.float32)
  )
  actnn = C.PerSample(3.0, widths=range(8, 0, -1))
  assert actnn.widths == (1, 2, 3, 4, 5, 6, 7, 8)
  assert C.from_dict(actnn.to_dict()) == actnn
  assert actnn.with_budget(2.5) == C.PerSample(2.5, widths=actnn.widths)
  stored = jax.jit(actnn.compress)(x, jnp.uint32(1))
  bits = stored.bits.astype(np.int32)
  assert set(bits.tolist()) - {1, 2, 4, 8} and int(bits.sum()) <= 24
  assert stored.nbytes == actnn.stored_bytes(x.shape)
  # The default widths allocate as before (1, 2, 4, 8 only).
  default = jax.jit(C.PerSample(3.0).compress)(x, jnp.uint32(1)).bits
  assert set(default.tolist()) <= {1, 2, 4, 8}
  for bad in ((), (0, 2), (2, 9), "8", (1.0,)):
    with pytest.raises(ValueError, match="widths from 1..8"):
      C.PerSample(2.0, widths=bad)
  with pytest.raises(ValueError, match="narrowest width 3"):
    C.PerSample(2.0, widths=(3, 4))
