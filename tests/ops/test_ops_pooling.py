"""Tests of max_pool / avg_pool (jact/ops/_pooling.py).

These ops are lossless, so every comparison with Flax is exact (bit for bit):
forward values and gradients equal `flax.linen.max_pool` / `avg_pool` and
jax's own gradient of them, ties included (both send the gradient to the
first maximal position of a window).
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jact.ops import _pooling as P

from jact._compat.testing import saved_residuals


def _data(seed, shape, dtype=jnp.float32, ties=False):
  r = np.random.default_rng(seed)
  v = r.integers(0, 3, size=shape) if ties else r.normal(size=shape)
  return jnp.asarray(v, dtype)


def _value_and_grad(pool, x, ct, *args):
  """Forward and input gradient for a fixed output cotangent, jitted."""

  def run(x):
    y, vjp = jax.vjp(lambda x: pool(x, *args), x)
    return y, vjp(ct)[0]

  return jax.jit(run)(x)


def _saved(fn, *args):
  """(aval, description) of saved residuals that are not arguments, constants or literals."""
  outside = ("from the argument", "from a constant", "from a literal")
  return [(a, d) for a, d in saved_residuals(fn, *args) if not d.startswith(outside)]


POOL_CASES = {
  # name: (input shape, window, strides, padding)
  "2d_2x2_s2_valid": ((2, 8, 8, 3), (2, 2), (2, 2), "VALID"),
  "2d_3x3_s2_same": ((2, 7, 9, 3), (3, 3), (2, 2), "SAME"),
  "2d_3x3_s1_same_overlap": ((2, 6, 7, 2), (3, 3), None, "SAME"),
  "2d_explicit_pad": ((2, 7, 9, 3), (3, 2), (1, 2), ((1, 2), (0, 1))),
  "2d_pad_only_windows": ((1, 6, 6, 2), (3, 3), (3, 3), ((3, 3), (0, 0))),
  "2d_no_batch": ((7, 9, 3), (3, 2), (2, 1), "SAME"),
  "2d_two_batch_dims": ((2, 2, 5, 6, 3), (2, 3), (1, 2), "SAME"),
  "1d": ((2, 10, 3), (4,), (3,), "SAME"),
  "3d": ((1, 5, 6, 4, 2), (2, 2, 2), (2, 1, 2), "SAME"),
}


TIE_CASES = ["2d_2x2_s2_valid", "2d_3x3_s1_same_overlap", "2d_pad_only_windows", "3d"]


@pytest.mark.slow
@pytest.mark.parametrize(
  "case, ties", [(c, False) for c in POOL_CASES] + [(c, True) for c in TIE_CASES]
)
def test_max_pool_matches_flax_exactly(case, ties):
  shape, window, strides, padding = POOL_CASES[case]
  x = _data(0, shape, ties=ties)
  ct = _data(1, jax.eval_shape(lambda x: nn.max_pool(x, window, strides, padding), x).shape)
  y, g = _value_and_grad(P.max_pool, x, ct, window, strides, padding)
  y_ref, g_ref = _value_and_grad(nn.max_pool, x, ct, window, strides, padding)
  assert y.dtype == x.dtype and g.dtype == x.dtype
  np.testing.assert_array_equal(y, y_ref)
  np.testing.assert_array_equal(g, g_ref)
  # Each output passes its cotangent to exactly one input position (or to padding).
  assert float(jnp.abs(g).sum()) <= float(jnp.abs(ct).sum()) * (1 + 1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("count_include_pad", [True, False])
@pytest.mark.parametrize("case", ["2d_3x3_s2_same", "2d_explicit_pad", "2d_two_batch_dims", "3d"])
def test_avg_pool_matches_flax_exactly(case, count_include_pad):
  shape, window, strides, padding = POOL_CASES[case]
  x = _data(2, shape)
  ct = _data(3, jax.eval_shape(lambda x: nn.avg_pool(x, window, strides, padding), x).shape)
  y, g = _value_and_grad(P.avg_pool, x, ct, window, strides, padding, count_include_pad)
  y_ref, g_ref = _value_and_grad(nn.avg_pool, x, ct, window, strides, padding, count_include_pad)
  np.testing.assert_array_equal(y, y_ref)
  np.testing.assert_array_equal(g, g_ref)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_low_precision_dtypes(dtype):
  x = _data(4, (2, 8, 8, 3), dtype)
  ct = jnp.ones((2, 4, 4, 3), dtype)
  y, g = _value_and_grad(P.max_pool, x, ct, (2, 2), (2, 2))
  y_ref, g_ref = _value_and_grad(nn.max_pool, x, ct, (2, 2), (2, 2))
  assert y.dtype == dtype and g.dtype == dtype
  np.testing.assert_array_equal(y, y_ref)
  np.testing.assert_array_equal(g, g_ref)
  for cip in (True, False):
    y, g = _value_and_grad(P.avg_pool, x, ct, (2, 2), (2, 2), "VALID", cip)
    assert y.dtype == dtype and g.dtype == dtype
    # Flax divides by a float32 count when count_include_pad=False (float32 result).
    np.testing.assert_array_equal(y, nn.avg_pool(x, (2, 2), (2, 2), "VALID", cip).astype(dtype))
    np.testing.assert_array_equal(g, jnp.full(x.shape, 0.25, dtype))


def test_argmax_bits():
  got = [P.argmax_bits(k) for k in (1, 2, 3, 4, 5, 8, 9, 16, 17, 25, 33, 65, 128, 129, 256)]
  assert got == [1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 7, 7, 8, 8]
  with pytest.raises(ValueError, match="at most 256"):
    P.argmax_bits(257)


@pytest.mark.parametrize(
  "window, strides, bits",
  [
    ((2, 2), (2, 2), 2),
    ((3, 3), (2, 2), 4),
    ((3, 3), (1, 1), 4),
    ((1, 2), (1, 2), 1),
    ((5, 5), (3, 3), 5),
    ((2, 3), (2, 2), 3),
  ],
)
def test_max_pool_residual_is_packed_argmax(window, strides, bits):
  x = _data(5, (3, 15, 15, 5))
  f = lambda x: P.max_pool(2.0 * x, window, strides, "SAME")  # an activation made inside
  out_shape = jax.eval_shape(f, x).shape
  saved = _saved(f, x)
  assert [a.dtype for a, _ in saved] == [jnp.uint8]
  # packed per sample: each of the 3 samples' arg-max codes in whole bytes (3, 5, 6, 7 bits
  # pack units of 8 codes)
  unit = 8 // bits if 8 % bits == 0 else 8
  per_row = math.ceil(math.prod(out_shape[1:]) / unit) * unit * bits // 8
  assert saved[0][0].shape == (3, per_row)
  # The very same bytes are what a policy keeping only the name keeps.
  policy = jax.checkpoint_policies.save_only_these_names("max_pool.argmax")
  kept = _saved(jax.checkpoint(f, policy=policy), x)
  assert [a for a, _ in kept] == [saved[0][0]] and "named 'max_pool.argmax'" in kept[0][1]
  # Flax keeps the full-precision input instead.
  ref = [a for a, _ in _saved(lambda x: nn.max_pool(2.0 * x, window, strides, "SAME"), x)]
  assert sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in ref) >= x.nbytes


def test_max_pool_checkpoint_policy_keeps_only_codes():
  x = _data(6, (2, 8, 8, 4))
  f = lambda x: jnp.sum(jnp.sin(P.max_pool(jnp.cos(x), (2, 2), (2, 2), name="stem.pool")))
  policy = jax.checkpoint_policies.save_only_these_names("stem.pool.argmax")
  kept = _saved(jax.checkpoint(f, policy=policy), x)
  assert len(kept) == 1 and kept[0][0].dtype == jnp.uint8 and "stem.pool.argmax" in kept[0][1]
  g = jax.jit(jax.grad(jax.checkpoint(f, policy=policy)))(x)
  g_ref = jax.jit(jax.grad(lambda x: jnp.sum(jnp.sin(nn.max_pool(jnp.cos(x), (2, 2), (2, 2))))))(x)
  np.testing.assert_allclose(g, g_ref, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("count_include_pad", [True, False])
def test_avg_pool_saves_nothing(count_include_pad):
  x = _data(7, (2, 9, 9, 3))
  f = lambda x: P.avg_pool(2.0 * x, (3, 3), (2, 2), "SAME", count_include_pad)
  assert _saved(f, x) == []
  # not even the input argument
  assert [d for _, d in saved_residuals(lambda x: P.avg_pool(x, (3, 3)), x)] == []


@pytest.mark.slow
@pytest.mark.parametrize(
  "window, strides, padding", [((3, 3), (2, 2), "SAME"), ((3, 3), (1, 1), "SAME")]
)
def test_max_pool_compiled_memory_below_flax(window, strides, padding):
  """Compile-only: the training step's temporaries stay below Flax's and within a
  few input copies (the backward upsamples the cotangent onto the input grid once)."""
  x = jax.ShapeDtypeStruct((8, 32, 32, 32), jnp.float32)  # 1 MiB

  def temp(pool):
    step = jax.jit(jax.grad(lambda x: jnp.sum(jnp.sin(pool(x, window, strides, padding)))))
    return step.lower(x).compile().memory_analysis().temp_size_in_bytes

  ours, flax_temp = temp(P.max_pool), temp(nn.max_pool)
  n_out = math.prod(jax.eval_shape(lambda x: P.max_pool(x, window, strides, padding), x).shape)
  # Beyond sin's output-sized cotangent/residual and the uint8 codes, the backward
  # holds one upsampled cotangent (input-sized float32) and its upsampled codes;
  # it never holds one tensor per window offset (9 here), which is what a
  # transposed-slices backward did inside a ResNet stem (see bench_memory).
  n_in = math.prod(x.shape)
  assert ours <= 2 * 4 * n_out + 2 * n_out + 5 * n_in + 4096, (ours, n_out, n_in)
  assert ours < flax_temp, (ours, flax_temp)


def test_errors():
  x = _data(8, (1, 20, 20, 2))
  with pytest.raises(ValueError, match="at most 256 positions"):
    P.max_pool(x, (17, 17))
  with pytest.raises(TypeError, match=r"astype\(jnp.float32\)"):
    P.max_pool(jnp.ones((1, 4, 4, 1), jnp.int32), (2, 2))
  with pytest.raises(TypeError, match="floating-point"):
    P.avg_pool(jnp.ones((1, 4, 4, 1), jnp.int32), (2, 2))
  with pytest.raises(ValueError, match="same length"):
    P.max_pool(x, (2, 2), strides=(2,))
  with pytest.raises(ValueError, match=r"\(low, high\) pairs"):
    P.avg_pool(x, (2, 2), padding=((1, 1),))
  with pytest.raises(ValueError, match="spatial dims"):
    P.max_pool(jnp.ones((4, 4)), (2, 2))
  with pytest.raises(ValueError, match="non-empty string"):
    P.max_pool(x, (2, 2), name="")
