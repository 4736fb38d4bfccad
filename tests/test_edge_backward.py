"""Edge cases of the backward pass: non-finite cotangents and the order of
differentiation.

1. The ordering device of every backward rule (a select of the packed
   residuals by a predicate on one element of the incoming cotangent) must
   never change values: a NaN or an infinity in one sample's cotangent leaves
   every other sample's gradient exactly as it is, and a non-finite gradient
   that plain JAX shows stays non-finite.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jact
from jact import ops

N = 4  # samples
KEY = jax.random.key(7)
BAD_POSITIONS = (0, N // 2, N - 1)  # first, middle and last sample
BAD_VALUES = (np.nan, np.inf, -np.inf)


def _normal(seed, shape, scale=1.0):
  return scale * jax.random.normal(jax.random.key(seed), shape)


def _block(w, x):
  return jnp.tanh(x @ w) * jax.nn.sigmoid(x @ w)


def _ln(x, scale, bias):  # flax.linen.LayerNorm, fast variance
  mu = x.mean(-1, keepdims=True)
  var = jnp.maximum(0.0, jnp.mean(x * x, -1, keepdims=True) - mu * mu)
  return (x - mu) * jax.lax.rsqrt(var + 1e-6) * scale + bias


def _conv(x, w):
  return jax.lax.conv_general_dilated(x, w, (1, 1), "SAME",
                                      dimension_numbers=("NHWC", "HWIO", "NHWC"))


_compressed_block = jact.compressed(_block, bits=4, min_size=64, name="edge_block")

# name: (jact op, the same function in plain JAX, arguments); the gradient is
# taken with respect to every argument.
CASES = {
    "dense": (lambda x, w: ops.dense(x, w, key=KEY), lambda x, w: x @ w,
              (_normal(0, (N, 64)), _normal(1, (64, 16), 0.1))),
    "conv": (lambda x, w: ops.conv(x, w, key=KEY), _conv,
             (_normal(2, (N, 6, 6, 8)), _normal(3, (3, 3, 8, 8), 0.2))),
    "relu": (ops.relu, jax.nn.relu, (_normal(4, (N, 64)),)),
    "tanh": (lambda x: ops.tanh(x, key=KEY), jnp.tanh, (_normal(5, (N, 256)),)),
    "gelu": (lambda x: ops.gelu(x, key=KEY), jax.nn.gelu, (_normal(6, (N, 256)),)),
    "layer_norm": (lambda x, s, b: ops.layer_norm(x, s, b, key=KEY), _ln,
                   (_normal(7, (N, 64)), 1.0 + _normal(8, (64,), 0.1), _normal(9, (64,), 0.1))),
    "compressed": (lambda w, x: _compressed_block(w, x, key=KEY), _block,
                   (_normal(10, (64, 32), 0.1), _normal(11, (N, 64)))),
}


@functools.cache
def _vjp(name: str, plain: bool):
  """jit(cotangent -> gradients of every argument) for one case."""
  op = CASES[name][1 if plain else 0]
  args = CASES[name][2]
  return jax.jit(lambda ct: jax.vjp(op, *args)[1](ct))


def _cotangent(name: str, position: int, value: float) -> jax.Array:
  """A generic cotangent whose sample `position` starts with `value`."""
  op, _, args = CASES[name]
  shape = jax.eval_shape(op, *args).shape
  ct = _normal(100, shape)
  return ct.at[(position,) + (0,) * (len(shape) - 1)].set(value)


@pytest.mark.parametrize("value", BAD_VALUES, ids=("nan", "inf", "-inf"))
@pytest.mark.parametrize("name", CASES)
def test_one_non_finite_cotangent_leaves_other_gradients_unchanged(name, value):
  reached_any = False
  for position in BAD_POSITIONS:
    bad = _cotangent(name, position, value)
    clean = _cotangent(name, position, 0.0)
    got, ref = _vjp(name, False)(bad), _vjp(name, False)(clean)
    plain = _vjp(name, True)(bad)
    for g, r, p in zip(got, ref, plain):
      g, r, p = np.asarray(g), np.asarray(r), np.asarray(p)
      reached = ~np.isfinite(p)  # the entries the bad value reaches in plain JAX
      assert not reached.all(), (name, position)
      reached_any |= reached.any()
      # Gradients the bad value does not reach: bit for bit those of the clean run.
      np.testing.assert_array_equal(g[~reached], r[~reached], err_msg=f"{name} at {position}")
      assert np.abs(r[~reached]).max() > 0, (name, position)
      # Gradients it reaches: non-finite, as in plain JAX (not silently zero).
      assert not np.isfinite(g[reached]).any(), (name, position)
  assert reached_any, name  # the bad value reached some gradient (else the check is empty)


def _normalized_mlp(dense, relu, w1, w2, x):
  """ReLU, then L2 normalisation of each sample (floored norm): a sample whose
  ReLU output is all zero has a finite output and a NaN cotangent at the ReLU
  (0 * inf in the norm's derivative), which the ReLU's mask then drops."""
  h = relu(dense(x, w1, 0))
  h = h / jnp.maximum(jnp.linalg.norm(h, axis=-1, keepdims=True), 1e-6)
  return jnp.sum(dense(h, w2, 1) ** 2)


def test_relu_then_l2_normalisation_with_a_dead_sample_matches_plain_jax():
  w1, w2 = _normal(20, (32, 64), 0.2), _normal(21, (64, 8), 0.2)
  x = _normal(22, (N, 32)).at[0].set(0.0)  # sample 0: ReLU output all zero
  jact_dense = lambda x, w, i: ops.dense(x, w, key=jax.random.fold_in(KEY, i), bits=8)
  f_jact = functools.partial(_normalized_mlp, jact_dense, ops.relu)
  f_plain = functools.partial(_normalized_mlp, lambda x, w, i: x @ w, jax.nn.relu)
  loss, plain_loss = jax.jit(f_jact)(w1, w2, x), jax.jit(f_plain)(w1, w2, x)
  assert np.isfinite(plain_loss) and loss == plain_loss
  g = jax.jit(jax.grad(f_jact, (0, 1)))(w1, w2, x)
  p = jax.jit(jax.grad(f_plain, (0, 1)))(w1, w2, x)
  for a, b in zip(g, p):
    assert np.isfinite(b).all() and np.abs(b).max() > 0
    # 8-bit stochastic rounding of the dense inputs: a few tenths of a percent.
    assert np.linalg.norm(a - b) <= 0.02 * np.linalg.norm(b)


def test_overflowing_sample_keeps_healthy_input_gradients():
  """Sample 0 overflows to inf in the first dense layer; the layer norm turns it
  into NaN. Every other sample's input gradient is still that of plain JAX."""
  w1, w2 = _normal(30, (32, 64), 0.2), _normal(31, (64, 8), 0.2)
  x = _normal(32, (N, 32)).at[0].set(3e38)
  s, b = jnp.ones(64), jnp.zeros(64)

  def f(dense, ln, relu, x):
    h = relu(ln(dense(x, w1, 0), s, b))
    return jnp.sum(dense(h, w2, 1) ** 2, axis=-1)

  jact_dense = lambda x, w, i: ops.dense(x, w, key=jax.random.fold_in(KEY, i), bits=8)
  jact_ln = lambda x, s, b: ops.layer_norm(x, s, b, key=jax.random.fold_in(KEY, 2), bits=8)
  per_sample = lambda fn: jax.jit(lambda x: jax.vjp(fn, x)[1](jnp.ones(N))[0])
  got = np.asarray(per_sample(functools.partial(f, jact_dense, jact_ln, ops.relu))(x))
  ref = np.asarray(per_sample(functools.partial(f, lambda x, w, i: x @ w, _ln, jax.nn.relu))(x))
  assert not np.isfinite(ref[0]).all() and not np.isfinite(got[0]).all()
  assert np.isfinite(ref[1:]).all() and np.abs(ref[1:]).max() > 0
  np.testing.assert_allclose(got[1:], ref[1:], rtol=0.05, atol=0.02 * np.abs(ref[1:]).max())
