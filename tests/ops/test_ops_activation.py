"""Compressed activations and softmax: exact forward, (nearly) unbiased backward."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jact.compressors import PerGroup
from jact.ops import _activation as A
from stats import assert_unbiased, over_keys, residual_bytes, saved_under_names

K = 2048  # draws for the statistical tests (a multiple of 128)
X = jax.random.normal(jax.random.key(0), (4, 128)) * 2.0
COT = jax.random.normal(jax.random.key(1), (4, 128))  # a fixed, generic cotangent

SMOOTH = {
  "gelu": (A.gelu, lambda x: jax.nn.gelu(x, approximate=True)),
  "gelu_erf": (
    functools.partial(A.gelu, approximate=False),
    lambda x: jax.nn.gelu(x, approximate=False),
  ),
  "silu": (A.silu, jax.nn.silu),
  "tanh": (A.tanh, jnp.tanh),
  "sigmoid": (A.sigmoid, jax.nn.sigmoid),
}


def input_grads(op, x, cot, keys, **kw):
  """Input gradient of <op(x), cot> for each key (jit + vmap over keys)."""

  def one(key):
    return jax.grad(lambda x: jnp.vdot(op(x, key=key, **kw).astype(jnp.float32), cot))(x)

  return over_keys(one, keys)


def min_rounding_atol(stored, cot):
  """Tolerance for elements that look deterministic in K draws.

  A group's minimum is stored rounded down to bfloat16 (<= 2**-7 relative),
  so the group's smallest value rounds up with a probability of only ~1e-3
  and may never do so in K draws: its sample mean is then off by up to one
  bf16 ulp of the stored value times the cotangent.
  """
  return 2.0**-7 * float(jnp.abs(stored).max()) * float(jnp.abs(cot).max())


def exact_grad(f, x, cot):
  return jax.jit(jax.grad(lambda x: jnp.vdot(f(x).astype(jnp.float32), cot)))(x)


# ----------------------------------------------------------------------------- forward


@pytest.mark.slow
@pytest.mark.parametrize("which", sorted(SMOOTH))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_smooth_forward_is_exact(which, dtype):
  op, ref = SMOOTH[which]
  x = X.astype(dtype)
  y, y_ref = jax.jit(lambda x: (op(x, key=jax.random.key(3), bits=2), ref(x)))(x)  # one compile
  assert y.dtype == dtype
  np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(y_ref, np.float32))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_mask_activations_forward_and_gradient_are_exact(dtype):
  # Exact zeros in the input check the convention at the kink (relu: 0, leaky: slope 1).
  x = jnp.concatenate([X[:, :120], jnp.zeros((4, 8))], axis=1).astype(dtype)
  cot = COT.astype(dtype)
  for op, ref in [
    (A.relu, jax.nn.relu),
    (lambda x: A.leaky_relu(x, 0.2), lambda x: jax.nn.leaky_relu(x, 0.2)),
  ]:
    fwd_bwd = lambda f: jax.jit(lambda x, c: (f(x), jax.vjp(f, x)[1](c)[0]))(x, cot)
    (y, g), (y_ref, g_ref) = fwd_bwd(op), fwd_bwd(ref)
    assert y.dtype == dtype
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(y_ref, np.float32))
    assert g.dtype == dtype
    np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(g_ref, np.float32))


def test_softmax_forward_is_exact():
  for axis in (-1, 0):
    y, y_ref = jax.jit(
      lambda x: (A.softmax(x, axis, key=jax.random.key(0)), jax.nn.softmax(x, axis=axis))
    )(X)  # one compile
    np.testing.assert_array_equal(y, y_ref)


# ----------------------------------------------------------------------------- gradients


@pytest.mark.slow
@pytest.mark.parametrize("which", sorted(SMOOTH))
def test_smooth_input_gradient_is_unbiased_at_2_bits(which):
  # The gradient g * Q(f'(x)) is linear in the stored derivative: unbiased.
  # Tolerances: assert_unbiased defaults (pooled |z| < 4, mean z^2 < 1.6).
  op, ref = SMOOTH[which]
  keys = jax.random.split(jax.random.key(10), K)
  samples = input_grads(op, X, COT, keys, bits=2)
  dydx = jax.vmap(jax.grad(ref))(X.ravel())
  assert_unbiased(samples, exact_grad(ref, X, COT), atol=min_rounding_atol(dydx, COT))


def test_unbiasedness_check_has_power():
  # Round-to-nearest at 2 bits is biased; the same check must reject it.
  op, ref = SMOOTH["gelu"]
  keys = jax.random.split(jax.random.key(10), K)
  samples = input_grads(op, X, COT, keys, compressor=PerGroup(2, stochastic=False))
  with pytest.raises(AssertionError, match="differ"):
    assert_unbiased(samples, exact_grad(ref, X, COT))


@pytest.mark.slow
@pytest.mark.parametrize("which", sorted(SMOOTH))
def test_smooth_gradient_at_8_bits_is_close(which):
  # A stochastically rounded value lands on a neighbouring grid point, so
  # |Q(d) - d| < step = range(d) / 255 (x 1.01 for the bf16 step rounded up).
  op, ref = SMOOTH[which]
  x32 = X.astype(jnp.float32)
  d = jax.vmap(jax.grad(ref))(x32.ravel())
  step = 1.01 * float(d.max() - d.min()) / 255
  g = input_grads(op, X, COT, jax.random.split(jax.random.key(4), 1), bits=8)[0]
  exact = exact_grad(ref, X, COT)
  assert np.all(np.abs(g - exact) <= step * np.abs(COT) + 1e-6)
  assert not np.array_equal(g, exact)  # it is quantized


@pytest.mark.slow
@pytest.mark.parametrize("which", sorted(SMOOTH))
def test_uncompressed_needs_no_key_and_is_exact(which):
  op, ref = SMOOTH[which]
  g = jax.jit(jax.grad(lambda x: jnp.vdot(op(x, bits=None), COT)))(X)
  exact = exact_grad(ref, X, COT)  # same math, other op order: float32 rounding only
  np.testing.assert_allclose(g, exact, rtol=1e-5, atol=1e-6 * float(jnp.abs(exact).max()))


def test_softmax_gradient_is_unbiased_at_8_bits():
  # Bias -Var(y_hat) * g <= (1/255)^2 / 4 * |g| ~ 4e-6 |g|: far below the
  # standard error of K = 2000 draws, so the default tolerances apply.
  x = X * 0.5
  keys = jax.random.split(jax.random.key(20), K)
  samples = input_grads(A.softmax, x, COT, keys, bits=8)
  assert_unbiased(samples, exact_grad(jax.nn.softmax, x, COT))


@pytest.mark.slow
def test_softmax_gradient_bias_is_bounded_at_4_bits():
  # E[dx_i] = exact_i - Var(y_hat_i) * g_i and Var <= step^2 / 4 with
  # step <= 1.01 * max(y) / 15 (one group spans the sample; y >= 0). The
  # elementwise tolerance is that bound plus 5 standard errors. (Groups may
  # span rows, so the bound uses the largest y of the tensor.)
  x = X * 0.5
  keys = jax.random.split(jax.random.key(21), K)
  samples = np.asarray(input_grads(A.softmax, x, COT, keys, bits=4), np.float64)
  exact = np.asarray(exact_grad(jax.nn.softmax, x, COT))
  y = np.asarray(jax.nn.softmax(x))
  step = 1.01 * y.max() / 15
  bound = step**2 / 4 * np.abs(np.asarray(COT))
  se = samples.std(0, ddof=1) / np.sqrt(K)
  assert np.all(np.abs(samples.mean(0) - exact) <= bound + 5 * se + 1e-9)
  assert bound.max() < 0.05 * np.abs(exact).max()  # the tolerance is not vacuous


def test_softmax_gradient_at_8_bits_is_close():
  # With y_hat = y + e, |e| < step = 1.01 * max(y) / 255, and s = sum(g * y) per row:
  # |dx_hat - dx| = |e_i (g_i - s) - y_hat_i sum(g e)| <= step (|g_i - s| + (y_i + step) sum|g|).
  g = input_grads(A.softmax, X, COT, jax.random.split(jax.random.key(5), 1), bits=8)[0]
  exact = exact_grad(jax.nn.softmax, X, COT)
  y, cot = np.asarray(jax.nn.softmax(X)), np.asarray(COT)
  step = 1.01 * y.max() / 255
  s = (cot * y).sum(1, keepdims=True)
  bound = step * (np.abs(cot - s) + (y + step) * np.abs(cot).sum(1, keepdims=True))
  assert np.all(np.abs(g - exact) <= bound + 1e-6)
  assert np.linalg.norm(bound) < 0.2 * np.linalg.norm(exact)  # a meaningful bound


def _bf16_grad(op, x, **kw):
  g = jax.jit(jax.grad(lambda x: jnp.vdot(op(x, **kw).astype(jnp.float32), COT)))(x)
  assert g.dtype == jnp.bfloat16
  return np.asarray(g, np.float32)


@pytest.mark.slow
@pytest.mark.parametrize("which", sorted(SMOOTH))
def test_bf16_smooth_gradient_is_the_float32_one_within_8_bit_and_bf16_rounding(which):
  # Against the float32 gradient at the same (bf16) inputs: the 8-bit step of
  # the stored derivative (as at float32), plus the derivative's evaluation in
  # bf16 (2 ulps, 2**-8 each, of its largest value) and the bf16 rounding of
  # the result (2**-8 relative, rounding up).
  op, ref = SMOOTH[which]
  x = X.astype(jnp.bfloat16)
  x32 = x.astype(jnp.float32)
  d = np.asarray(jax.vmap(jax.grad(ref))(x32.ravel()))
  step = 1.01 * float(d.max() - d.min()) / 255
  g = _bf16_grad(op, x, key=jax.random.key(0), bits=8)
  exact = np.asarray(exact_grad(ref, x32, COT))
  eps = 2.0**-8
  bound = np.abs(COT) * (step + 2 * eps * np.abs(d).max()) + eps * np.abs(exact)
  assert np.all(np.abs(g - exact) <= bound), float((np.abs(g - exact) / bound).max())


def test_bf16_softmax_gradient_is_the_float32_one_within_8_bit_and_bf16_rounding():
  # The float32 8-bit bound of test_softmax_gradient_at_8_bits_is_close, plus
  # 2 bf16 ulps (2**-8) of each term of y (g - s) and of the result.
  x = X.astype(jnp.bfloat16)
  x32 = x.astype(jnp.float32)
  g = _bf16_grad(A.softmax, x, key=jax.random.key(0), bits=8)
  exact = np.asarray(exact_grad(jax.nn.softmax, x32, COT))
  y, cot = np.asarray(jax.nn.softmax(x32)), np.asarray(COT)
  step, eps = 1.01 * y.max() / 255, 2.0**-8
  s = (cot * y).sum(1, keepdims=True)
  l1 = np.abs(cot).sum(1, keepdims=True)
  bound = (
    step * (np.abs(cot - s) + (y + step) * l1)
    + 2 * eps * y * (np.abs(cot - s) + y * l1)
    + eps * np.abs(exact)
  )
  assert np.all(np.abs(g - exact) <= bound), float((np.abs(g - exact) / bound).max())


# ----------------------------------------------------------------------------- residuals


@pytest.mark.parametrize("which", sorted(SMOOTH) + ["softmax"])
def test_residual_bytes_at_2_bits_are_an_eighth_of_plain(which):
  x = jax.random.normal(jax.random.key(0), (16, 512))
  key = jax.random.key(0)
  if which == "softmax":
    op, ref, role = A.softmax, jax.nn.softmax, "y"
  else:
    (op, ref), role = SMOOTH[which], "dydx"
  ours = residual_bytes(lambda x: op(x, key=key, bits=2), x)
  plain = residual_bytes(ref, x)
  assert 0 < ours <= plain / 8, (ours, plain)
  name = which.split("_")[0]
  # the tagged pieces are all there is: a remat policy keeping them saves the same bytes
  f = lambda x: op(x, key=key, bits=2)
  assert saved_under_names(f, [f"{name}.{role}"], x) == ({f"{name}.{role}"}, ours)


def test_mask_residual_is_one_bit_per_element():
  x = jax.random.normal(jax.random.key(0), (16, 512))
  for op, ref, name in [
    (A.relu, jax.nn.relu, "relu.mask"),
    (A.leaky_relu, jax.nn.leaky_relu, "leaky_relu.mask"),
  ]:
    assert residual_bytes(op, x) == x.size // 8
    assert residual_bytes(op, x) <= residual_bytes(ref, x) / 8
    assert saved_under_names(op, [name], x) == ({name}, x.size // 8)


def test_custom_name_and_remat_policy():
  # Under save_only_these_names(name) exactly the tagged residual is saved, and
  # the rematerialized function still has the right gradient.
  key = jax.random.key(0)
  f = lambda x: A.tanh(x, key=key, bits=2, name="blk.act")
  assert saved_under_names(f, ["blk.act.dydx"], X) == ({"blk.act.dydx"}, residual_bytes(f, X))
  # other names: nothing but the closed-over PRNG key (8 bytes) is saved
  assert saved_under_names(f, ["other"], X) == (set(), 8)
  pol = jax.checkpoint_policies.save_only_these_names("blk.act.dydx")
  g_remat = jax.jit(jax.grad(lambda x: jnp.vdot(jax.checkpoint(f, policy=pol)(x), COT)))(X)
  np.testing.assert_array_equal(g_remat, jax.jit(jax.grad(lambda x: jnp.vdot(f(x), COT)))(X))


# ----------------------------------------------------------------------------- errors


def test_errors():
  with pytest.raises(ValueError, match="bits must be one of"):
    A.gelu(X, key=jax.random.key(0), bits=9)
  with pytest.raises(ValueError, match="needs a PRNG key"):
    A.tanh(X)
  with pytest.raises(ValueError, match="needs a PRNG key"):
    A.softmax(X)
  with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
    A.sigmoid(jnp.arange(8), key=jax.random.key(0))
  with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
    A.relu(jnp.arange(8))
  with pytest.raises(ValueError, match="non-empty string"):
    A.relu(X, name="")
