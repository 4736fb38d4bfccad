"""Compressed batch/layer/RMS norm against flax, and the statistics of their gradients."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jact.ops import _norm as N
from stats import DRAWS, assert_unbiased, over_keys, residual_bytes, saved_under_names

K = DRAWS  # draws per statistical test: enough to see a bias of 1% of a rounding step (stats.py)
C = 64
# 64 independent channels / rows: the input-gradient noise is shared within a
# channel (batch norm) or row (layer/RMS norm), so the z statistics average over 64 groups.
X4 = jax.random.normal(jax.random.key(0), (4, 4, 4, C)) * 3.0 + 1.0  # NHWC for batch norm
X2 = jax.random.normal(jax.random.key(1), (64, C)) * 2.0 - 0.5  # rows for layer / RMS norm
SCALE = 1.0 + 0.3 * jax.random.normal(jax.random.key(2), (C,))
BIAS = 0.1 * jax.random.normal(jax.random.key(4), (C,))


def flax_fn(kind, x, scale, bias, fast=True):
  """The flax module applied with the given parameters (train mode for batch norm)."""
  if kind == "batch":
    m = nn.BatchNorm(use_running_average=False, momentum=0.9, use_fast_variance=fast)
    v = {
      "params": {"scale": scale, "bias": bias},
      "batch_stats": {"mean": jnp.zeros(C), "var": jnp.ones(C)},
    }
    return m.apply(v, x, mutable=["batch_stats"])
  if kind == "layer":
    return nn.LayerNorm(use_fast_variance=fast).apply({"params": {"scale": scale, "bias": bias}}, x)
  return nn.RMSNorm().apply({"params": {"scale": scale}}, x)


def ours(kind, x, scale, bias, **kw):
  if kind == "batch":
    return N.batch_norm(x, scale, bias, **kw)[0]
  if kind == "layer":
    return N.layer_norm(x, scale, bias, **kw)
  return N.rms_norm(x, scale, **kw)


def ref(kind, x, scale, bias):
  out = flax_fn(kind, x, scale, bias)
  return out[0] if kind == "batch" else out


CASES = {"batch": X4, "layer": X2, "rms": X2}


def params(kind):
  return SCALE, BIAS


def grads(fn, x, scale, bias, cot):
  loss = lambda x, s, b: jnp.vdot(fn(x, s, b).astype(jnp.float32), cot)
  return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x, scale, bias)


def sampled_grads(kind, cot, keys, **kw):
  x = CASES[kind]
  scale, bias = params(kind)
  one = lambda key: grads(lambda x, s, b: ours(kind, x, s, b, key=key, **kw), x, scale, bias, cot)
  return over_keys(one, keys)


def normalized(kind):
  """(x_hat, inv_std, N) computed independently in numpy (float64)."""
  x = np.asarray(CASES[kind], np.float64)
  red = (0, 1, 2) if kind == "batch" else (-1,)
  n = x.size // x.shape[-1] if kind == "batch" else x.shape[-1]
  eps = 1e-5 if kind == "batch" else 1e-6
  mean = 0.0 if kind == "rms" else x.mean(red, keepdims=True)
  var = ((x - mean) ** 2).mean(red, keepdims=True)
  inv = 1 / np.sqrt(var + eps)
  return (x - mean) * inv, inv, n


def cotangent(kind):
  return jax.random.normal(jax.random.key(7), CASES[kind].shape)


# ----------------------------------------------------------------------------- forward


@pytest.mark.parametrize("fast", [True, False])
def test_batch_norm_forward_and_running_stats_match_flax(fast):
  scale, bias = params("batch")
  (y_ref, stats) = flax_fn("batch", X4, scale, bias, fast)
  y, mean, var = N.batch_norm(X4, scale, bias, key=jax.random.key(0), use_fast_variance=fast)
  np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
  assert mean.shape == var.shape == (C,) and mean.dtype == var.dtype == jnp.float32
  ra_mean, ra_var = N.update_running_stats(jnp.zeros(C), jnp.ones(C), mean, var, 0.9)
  np.testing.assert_allclose(ra_mean, stats["batch_stats"]["mean"], rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(ra_var, stats["batch_stats"]["var"], rtol=1e-5, atol=1e-6)


def test_batch_norm_feature_axis_and_no_params():
  # NCHW with axis=1 equals NHWC with the default axis, transposed.
  x = jnp.transpose(X4, (0, 3, 1, 2))
  y, mean, _ = N.batch_norm(x, axis=1, bits=None)
  y_ref, mean_ref, _ = N.batch_norm(X4, bits=None)
  np.testing.assert_allclose(y, jnp.transpose(y_ref, (0, 3, 1, 2)), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(mean, mean_ref, rtol=1e-6)
  np.testing.assert_allclose(y.mean((0, 2, 3)), 0.0, atol=1e-5)
  np.testing.assert_allclose(y.var((0, 2, 3)), 1.0, rtol=1e-3)


@pytest.mark.parametrize("kind", ["layer", "rms"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_layer_and_rms_forward_match_flax(kind, dtype):
  scale, bias = params(kind)
  x = CASES[kind].astype(dtype)
  y = ours(kind, x, scale, bias, key=jax.random.key(0), bits=2)
  assert y.dtype == dtype
  tol = 1e-5 if dtype == jnp.float32 else 1e-2
  np.testing.assert_allclose(
    np.asarray(y, np.float32), np.asarray(ref(kind, x, scale, bias), np.float32), rtol=tol, atol=tol
  )


# ----------------------------------------------------------------------------- gradients


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["batch", "layer", "rms"])
def test_uncompressed_backward_equals_autodiff_of_flax(kind):
  # bits=None keeps x_hat exactly: the closed-form backward must equal jax.grad of flax.
  x, (scale, bias), cot = CASES[kind], params(kind), cotangent(kind)
  got = grads(lambda x, s, b: ours(kind, x, s, b, bits=None), x, scale, bias, cot)
  want = grads(lambda x, s, b: ref(kind, x, s, b), x, scale, bias, cot)
  for a, b in zip(got, want):
    if kind == "rms" and b is want[2]:
      continue  # RMSNorm has no bias
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * float(jnp.abs(b).max()))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["batch", "layer", "rms"])
def test_gradients_at_8_bits_are_close(kind):
  # One 8-bit draw: relative L2 error of every gradient below 2% (x_hat has a
  # range of ~8, step 8/255, noise ~ step/sqrt(12) ~ 0.01 against |x_hat| ~ 1).
  x, (scale, bias), cot = CASES[kind], params(kind), cotangent(kind)
  got = sampled_grads(kind, cot, jax.random.split(jax.random.key(9), 1), bits=8)
  want = grads(lambda x, s, b: ours(kind, x, s, b, bits=None), x, scale, bias, cot)
  for a, b in zip(got, want):
    if kind != "rms" or b is not want[2]:
      assert np.linalg.norm(a[0] - b) <= 0.02 * np.linalg.norm(b)


def min_rounding_atol(xhat, cot, n):
  """Tolerance for elements that look deterministic in K draws.

  A group's minimum is stored rounded down to bfloat16 (<= 2**-7 relative), so
  that element rounds up only rarely and may never do so in K draws; the
  sample mean of a sum over n such products can then be off by n ulps.
  """
  return 2.0**-7 * float(jnp.abs(xhat).max()) * float(jnp.abs(cot).max()) * n


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["batch", "layer", "rms"])
def test_scale_and_bias_gradients_are_unbiased_at_2_bits(kind):
  # d_scale = sum(g * x_hat) is linear in the stored x_hat; d_bias is exact.
  x, (scale, bias), cot = CASES[kind], params(kind), cotangent(kind)
  keys = jax.random.split(jax.random.key(11), K)
  _, d_scale, d_bias = sampled_grads(kind, cot, keys, bits=2)
  _, e_scale, e_bias = grads(lambda x, s, b: ours(kind, x, s, b, bits=None), x, scale, bias, cot)
  assert_unbiased(d_scale, e_scale, atol=min_rounding_atol(normalized(kind)[0], cot, 2))
  if kind != "rms":
    assert_unbiased(d_bias, e_bias, atol=1e-5)  # deterministic elements: the exact sum


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["batch", "layer", "rms"])
def test_input_gradient_is_unbiased_at_8_bits(kind):
  # The bias of d_x, inv_std * scale * Var(x_hat) * g / N <= 1e-5 |g| at 8 bits,
  # is far below the standard error of K draws: default tolerances.
  x, (scale, bias), cot = CASES[kind], params(kind), cotangent(kind)
  keys = jax.random.split(jax.random.key(12), K)
  dx = sampled_grads(kind, cot, keys, bits=8)[0]
  exact = grads(lambda x, s, b: ours(kind, x, s, b, bits=None), x, scale, bias, cot)[0]
  assert_unbiased(dx, exact)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["batch", "layer", "rms"])
def test_input_gradient_bias_is_bounded_at_4_bits(kind):
  # With one stored copy, E[d_x] = exact - inv_std * scale * Var(x_hat) * g / N
  # (N = reduced size) and Var(x_hat) <= step^2 / 4, step <= 1.01 * range(x_hat) / 15.
  # Tolerance: the excess of |mean - exact| over that bound, in standard
  # errors, has mean square < 1 (about 0.5 when the bound holds, as for
  # assert_unbiased's mean z^2) and no element beyond 8 standard errors (the
  # standard error of elements whose noise comes from rare roundings is
  # poorly estimated, so single elements reach ~6).
  x, (scale, bias), cot = CASES[kind], params(kind), cotangent(kind)
  keys = jax.random.split(jax.random.key(13), K)
  dx = np.asarray(sampled_grads(kind, cot, keys, bits=4)[0], np.float64)
  exact = np.asarray(grads(lambda x, s, b: ours(kind, x, s, b, bits=None), x, scale, bias, cot)[0])
  xhat, inv, n = normalized(kind)
  step = 1.01 * float(xhat.max() - xhat.min()) / 15
  bound = np.abs(inv * np.asarray(scale) * np.asarray(cot)) * step**2 / 4 / n
  se = dx.std(0, ddof=1) / np.sqrt(K) + 1e-9
  excess = np.maximum(np.abs(dx.mean(0) - exact) - bound, 0) / se
  assert np.mean(excess**2) < 1.0 and excess.max() < 8, (np.mean(excess**2), excess.max())
  assert bound.max() < 0.05 * np.abs(exact).max()  # the tolerance is not vacuous
  # ...and needed: without it the single-copy bias is detected (measured 1.6-1.9).
  assert np.mean((np.abs(dx.mean(0) - exact) / se) ** 2) > 1.2


def test_batch_stats_carry_no_gradient():
  loss = lambda x: sum(jnp.sum(t) for t in N.batch_norm(x, key=jax.random.key(0))[1:])
  g = jax.jit(jax.grad(loss))(X4)
  np.testing.assert_array_equal(g, 0.0)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["batch", "layer", "rms"])
def test_bf16_input_gives_bf16_output_and_gradient(kind):
  x, (scale, bias), cot = CASES[kind].astype(jnp.bfloat16), params(kind), cotangent(kind)
  y = ours(kind, x, scale, bias, key=jax.random.key(0))
  assert y.dtype == jnp.bfloat16
  dx, ds, db = grads(
    lambda x, s, b: ours(kind, x, s, b, key=jax.random.key(0)), x, scale, bias, cot
  )
  assert dx.dtype == jnp.bfloat16 and ds.dtype == db.dtype == jnp.float32
  want = grads(lambda x, s, b: ours(kind, x, s, b, bits=None), CASES[kind], scale, bias, cot)[0]
  assert np.linalg.norm(np.asarray(dx, np.float32) - want) <= 0.2 * np.linalg.norm(want)
  if kind == "batch":
    _, mean, var = N.batch_norm(x, scale, bias, key=jax.random.key(0))
    assert mean.dtype == var.dtype == jnp.float32


# ----------------------------------------------------------------------------- residuals


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["batch", "layer", "rms"])
def test_residual_bytes_at_2_bits_are_an_eighth_of_flax(kind):
  x = jax.random.normal(jax.random.key(0), (16, 8, 64))
  c = 64
  scale, bias = jnp.ones(c), jnp.zeros(c)
  fn = lambda x, s, b: ours(kind, x, s, b, key=jax.random.key(0), bits=2)
  if kind == "batch":

    def plain(x, s, b):
      v = {
        "params": {"scale": s, "bias": b},
        "batch_stats": {"mean": jnp.zeros(c), "var": jnp.ones(c)},
      }
      return nn.BatchNorm(use_running_average=False).apply(v, x, mutable=["batch_stats"])[0]
  else:
    plain = lambda x, s, b: ref(kind, x, s, b)
  got, want = residual_bytes(fn, x, scale, bias), residual_bytes(plain, x, scale, bias)
  assert 0 < got <= want / 8, (got, want)
  name = {"batch": "batch_norm", "layer": "layer_norm", "rms": "rms_norm"}[kind]
  names = {f"{name}.xhat", f"{name}.inv_std"}
  if kind != "rms":  # the fast variance's clipping per row, 1 byte (issue 31)
    names.add(f"{name}.var_slope")
  assert saved_under_names(fn, names, x, scale, bias) == (names, got)


def test_one_dimensional_input_is_not_padded_per_element():
  # A 1-D input is quantized as one row, not as D samples of one value.
  x = jax.random.normal(jax.random.key(0), (1024,))
  got = residual_bytes(lambda x: N.layer_norm(x, key=jax.random.key(0), bits=2), x)
  assert got <= 1024 // 4 + 64


# ----------------------------------------------------------------------------- errors


def test_errors():
  with pytest.raises(ValueError, match="bits must be one of"):
    N.layer_norm(X2, bits=12, key=jax.random.key(0))
  with pytest.raises(ValueError, match="needs a PRNG key"):
    N.batch_norm(X4)
  with pytest.raises(ValueError, match="needs a PRNG key"):
    N.rms_norm(X2)
  with pytest.raises(ValueError, match="expected 64 values"):
    N.layer_norm(X2, jnp.ones(16), key=jax.random.key(0))
  with pytest.raises(ValueError, match="out of range"):
    N.batch_norm(X4, axis=4, key=jax.random.key(0))
  with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
    N.layer_norm(jnp.ones((4, 8), jnp.int32), key=jax.random.key(0))


# ------------------------------------------------------------------------- cross-device statistics

DEVICES = 4


@pytest.mark.slow
@pytest.mark.parametrize("fast_variance", [True, False])
def test_batch_norm_axis_name_is_the_whole_batch_and_matches_flax(fast_variance):
  """Data parallel as with pmap(grad(loss)), here a vmap naming the axis: with
  axis_name, forward, statistics and (at bits=None) every gradient equal batch
  norm of the whole, unsharded batch, and equal flax.linen.BatchNorm(axis_name=)
  under the same named axis; at 8 bits the gradients are within 3%."""
  shards = X4.reshape(DEVICES, -1, *X4.shape[1:])  # (devices, per-device batch, H, W, C)
  cot = jax.random.normal(jax.random.key(9), shards.shape)

  def per_device(norm):
    def local(x, scale, bias, cot):
      y, mu, var = norm(x, scale, bias)
      return jnp.sum(y * cot), (y, mu, var)

    grad = jax.grad(local, argnums=(0, 1, 2), has_aux=True)
    grads, out = jax.jit(jax.vmap(grad, in_axes=(0, None, None, 0), axis_name="devices"))(
      shards, SCALE, BIAS, cot
    )
    dx, dscale, dbias = grads  # parameter gradients are per device: sum them, as pmean/psum would
    return (dx, dscale.sum(0), dbias.sum(0)), out

  def jact_norm(bits):
    return lambda x, s, b: N.batch_norm(
      x,
      s,
      b,
      key=jax.random.key(3),
      bits=bits,
      axis_name="devices",
      use_fast_variance=fast_variance,
    )

  def whole(x, scale, bias):
    y, mu, var = N.batch_norm(
      x.reshape(X4.shape), scale, bias, bits=None, use_fast_variance=fast_variance
    )
    return jnp.sum(y.reshape(cot.shape) * cot), (y, mu, var)

  grads, (y, mu, var) = per_device(jact_norm(None))
  want_grads, (want_y, want_mu, want_var) = jax.jit(
    jax.grad(whole, argnums=(0, 1, 2), has_aux=True)
  )(shards, SCALE, BIAS)
  np.testing.assert_allclose(y.reshape(X4.shape), want_y, rtol=1e-5, atol=1e-5)
  for m, v in zip(mu, var):  # every device holds the global statistics
    np.testing.assert_allclose(m, want_mu, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(v, want_var, rtol=1e-5, atol=1e-6)
  for g, w in zip(grads, want_grads):
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4 * float(jnp.abs(w).max()))

  bn = nn.BatchNorm(
    use_running_average=False, axis_name="devices", epsilon=1e-5, use_fast_variance=fast_variance
  )
  variables = {"batch_stats": {"mean": jnp.zeros(C), "var": jnp.ones(C)}}

  def flax_norm(x, scale, bias):
    y, state = bn.apply(
      {**variables, "params": {"scale": scale, "bias": bias}}, x, mutable=["batch_stats"]
    )
    return y, state["batch_stats"]["mean"], state["batch_stats"]["var"]

  flax_grads, (flax_y, flax_mean, _) = per_device(flax_norm)
  np.testing.assert_allclose(y, flax_y, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(flax_mean[0], 0.01 * want_mu, rtol=1e-4, atol=1e-7)  # 0.99 momentum
  for g, w in zip(grads, flax_grads):
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4 * float(jnp.abs(w).max()))

  grads8, _ = per_device(jact_norm(8))
  for g, w in zip(grads8, want_grads):
    rel = float(jnp.linalg.norm(g - w) / jnp.linalg.norm(w))
    assert rel < 0.03, rel


def test_batch_norm_axis_name_outside_its_named_axis_is_jax_error():
  with pytest.raises(NameError, match="devices"):
    N.batch_norm(X4, SCALE, BIAS, bits=None, axis_name="devices")
