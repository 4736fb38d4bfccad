"""Edge cases of element indices and dropout rates (issue 14).

The noise and dropout hash takes each element's row-major flat index; arrays
of 2^32 or more elements need more than 32 bits of it. Nothing here allocates
a large array: index functions are evaluated on chosen coordinates, large ops
are only lowered, and the one large dropout that runs is sliced inside jit
(XLA then computes only the slice; the test checks that before running it).
"""

from __future__ import annotations

import importlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jact
from jact._core import rng

D = importlib.import_module("jact.ops._dropout")  # `jact.ops.dropout` is the function
X = jnp.asarray(np.random.default_rng(0).normal(size=(4, 33)), jnp.float32)
SEED = jnp.uint32(0x2545F491)


# ----------------------------------------------------------------------------- dropout rate 1


def test_dropout_rate_one_deterministic_is_identity():
  y, vjp = jax.vjp(lambda x: jact.ops.dropout(x, 1.0, key=None, deterministic=True), X)
  np.testing.assert_array_equal(y, X)
  np.testing.assert_array_equal(vjp(jnp.ones_like(X))[0], jnp.ones_like(X))


@pytest.mark.parametrize("key", [None, jax.random.key(3)])
def test_dropout_rate_one_drops_everything_like_flax(key):
  ref = nn.Dropout(rate=1.0).apply({}, X, deterministic=False)  # Flax needs no key either
  y, vjp = jax.vjp(lambda x: jact.ops.dropout(x, 1.0, key=key), X)
  np.testing.assert_array_equal(y, ref)
  np.testing.assert_array_equal(y, jnp.zeros_like(X))
  g = vjp(jnp.ones_like(X))[0]
  assert bool(jnp.all(jnp.isfinite(g))) and bool(jnp.all(g == 0))
  lin = jact.nn.Dropout(rate=1.0).apply({}, X, deterministic=False)
  np.testing.assert_array_equal(lin, ref)


@pytest.mark.parametrize("bad", [1.5, -0.1, float("nan")])
def test_dropout_rate_outside_unit_interval_is_a_clear_error(bad):
  for deterministic in (False, True):
    with pytest.raises(ValueError, match=r"jact dropout rate must be in \[0, 1\], got"):
      jact.ops.dropout(X, bad, key=jax.random.key(0), deterministic=deterministic)


# ----------------------------------------------------------------------------- 64-bit element index

# Shapes past 2^32 elements: dropout's (128, 8192, 8192), strides that are not
# powers of two (carries in the 16-bit limb products), quantize's grouped view of
# one sample of 2^33 values, and an axis of exactly 2^32 elements.
LARGE_SHAPES = [
  (128, 8192, 8192),
  (7, 65537, 65539),
  (1, 2**25, 256),
  (3, 2**32),
  (65537, 65521, 65519),
  (5, 2**20, 2**20, 3),
]


def _flat(coords, shape):
  """Row-major flat index in Python integers (the oracle)."""
  flat = [0] * len(coords[0])
  for axis, c in enumerate(coords):
    stride = int(np.prod(shape[axis + 1 :], dtype=object))
    flat = [f + int(v) * stride for f, v in zip(flat, c)]
  return flat


@pytest.mark.parametrize("shape", LARGE_SHAPES)
def test_index_words_match_python_integers(shape):
  r = np.random.default_rng(1)
  coords = [r.integers(0, n, size=300, dtype=np.uint64) for n in shape]
  for axis, n in enumerate(shape):  # the last element, the first, and mixed extremes
    coords[axis][:4] = [n - 1, 0, n - 1, 0 if axis % 2 else n - 1]
  hi, lo = rng.index_words([jnp.asarray(c.astype(np.uint32)) for c in coords], shape)
  flat = _flat(coords, shape)
  assert [int(h) for h in np.asarray(hi)] == [f >> 32 for f in flat]
  assert [int(v) for v in np.asarray(lo)] == [f % 2**32 for f in flat]


@pytest.mark.slow
@pytest.mark.parametrize("shape", [(3, 5, 7), (2, 4, 256), (17,), ()])
def test_small_arrays_hash_their_32_bit_index(shape):
  """Arrays below 2^32 elements keep the bits the kernels reproduce: hash(seed, i)."""
  n = int(np.prod(shape))
  ref = rng.hash_uint32(SEED, jnp.arange(n, dtype=jnp.uint32).reshape(shape))
  np.testing.assert_array_equal(rng.element_bits(SEED, shape), ref)
  np.testing.assert_array_equal(D.keep_mask(SEED, shape, 0.3), ref >= D._threshold(0.3))


@pytest.mark.parametrize("shape", [(128, 8192, 8192), (1, 2**25, 256)])
def test_element_i_and_i_plus_2_32_get_different_bits(shape):
  """Element i and i + 2^32 (sample n and n + 2^32 / sample size) hash differently,
  while the first 2^32 elements keep hash(seed, i)."""
  r = np.random.default_rng(2)
  i = r.integers(0, 2**32, size=4096, dtype=np.uint64)

  def coords(flat):
    out = []
    for axis in range(len(shape)):
      stride = int(np.prod(shape[axis + 1 :]))
      out.append(
        jnp.asarray(((flat // np.uint64(stride)) % np.uint64(shape[axis])).astype(np.uint32))
      )
    return out

  a = rng.element_bits_at(SEED, coords(i), shape)
  b = rng.element_bits_at(SEED, coords(i + np.uint64(2**32)), shape)
  np.testing.assert_array_equal(a, rng.hash_uint32(SEED, jnp.asarray(i.astype(np.uint32))))
  assert int(jnp.sum(a == b)) == 0  # equal by chance with probability 2^-32 each
  # Keep decisions at rate 0.5 agree about half the time (old wrap: always).
  agree = float(jnp.mean((a >= D._threshold(0.5)) == (b >= D._threshold(0.5))))
  assert abs(agree - 0.5) < 5 * 0.5 / np.sqrt(i.size), agree


def test_dropout_samples_past_2_32_elements_get_their_own_masks():
  """Public dropout on (128, 8192, 8192): sample 64 starts at element 2^32 and
  must not repeat sample 0's mask. Only a slice is computed (checked first)."""
  f = jax.jit(lambda k: jact.ops.dropout(jnp.ones((128, 8192, 8192)), 0.5, key=k)[::64, :8, :128])
  compiled = f.lower(jax.random.key(0)).compile()
  assert compiled.memory_analysis().temp_size_in_bytes < 2**20  # no 2^33-element temporary
  y = compiled(jax.random.key(0))
  assert y.shape == (2, 8, 128)
  agree = float(jnp.mean(y[0] == y[1]))
  assert abs(agree - 0.5) < 5 * 0.5 / np.sqrt(y[0].size), agree


KEY = jax.random.key(0)


@pytest.mark.parametrize("case", ["quantize", "dequantize", "dropout", "dropout_grad"])
def test_single_sample_of_2_32_values_lowers(case):
  """One sample of more than 2^32 values traces and lowers (compile-free, no allocation)."""
  big = jax.ShapeDtypeStruct((1, 2**32 + 256), jnp.float32)
  odd = jax.ShapeDtypeStruct((2, 2**16, 2**16 + 1), jnp.float32)  # strides above 2^32
  fns = {
    "quantize": (lambda x: jact.quantize(x, KEY, bits=2), big),
    "dequantize": (lambda x: jact.dequantize(jact.quantize(x, KEY, bits=4)), big),
    "dropout": (lambda x: jact.ops.dropout(x, 0.25, key=KEY), odd),
    "dropout_grad": (jax.grad(lambda x: jnp.sum(jact.ops.dropout(x, 0.25, key=KEY))), odd),
  }
  fn, arg = fns[case]
  out = jax.eval_shape(fn, arg)
  text = jax.jit(fn).trace(arg).lower().as_text()
  assert "stablehlo" in text
  if case in ("dequantize", "dropout", "dropout_grad"):
    assert out.shape == arg.shape


def test_axis_longer_than_2_32_is_a_clear_error():
  x = jax.ShapeDtypeStruct((2**32 + 8,), jnp.float32)
  with pytest.raises(ValueError, match=r"jact .*no axis may hold more than 2\*\*32.*Reshape"):
    jax.eval_shape(lambda x: jact.ops.dropout(x, 0.5, key=KEY), x)
