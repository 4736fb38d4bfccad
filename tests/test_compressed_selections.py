"""Residuals that select or hold reduced statistics inside `jact.compressed`.

Max pooling stores its arg-max exactly (through `jact.ops.max_pool`), a max
reduction's location indicators are stored as 1 bit, and reduced statistics
(row sums, norms' statistics) are kept exact: their gradients do not depend
on the bit width at all.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jact
from jact.transforms._vjp_residuals import reduced_values


def _grads(fn, x, bits, key=1):
  plain = jax.grad(lambda x: (fn(x) * jnp.cos(fn(x))).sum())(x)
  block = jact.compressed(fn, bits=bits, compress_argnums=(0,))
  ours = jax.grad(lambda x: (block(x, key=jax.random.key(key))
                             * jnp.cos(block(x, key=jax.random.key(key)))).sum())(x)
  return plain, ours


@pytest.mark.parametrize("window,strides,padding", [((2, 2), (2, 2), "VALID"),
                                                    ((3, 3), (2, 2), "SAME")])
def test_max_pool_gradient_is_exact_at_2_bits(window, strides, padding):
  x = jax.random.normal(jax.random.key(0), (2, 8, 8, 3))
  pool = lambda x: nn.max_pool(x, window, strides=strides, padding=padding)
  plain, ours = _grads(pool, x, bits=2)
  np.testing.assert_array_equal(ours, plain)


def test_max_pool_keeps_only_the_argmax():
  x = jax.random.normal(jax.random.key(0), (4, 16, 16, 8))
  loss = lambda x: nn.max_pool(x, (2, 2), strides=(2, 2)).sum()
  block = jact.compressed(loss, bits=2, compress_argnums=(0,))
  saved = jact.residual_report(lambda x: block(x, key=jax.random.key(0)), x).total_bytes
  # one 2-bit position per window: 4*8*8*8 windows / 4 per byte
  assert saved <= 4 * 8 * 8 * 8 // 4 + 64, saved


def test_max_reduction_gradient_is_exact_at_2_bits():
  x = jax.random.normal(jax.random.key(0), (64, 128))
  x = x.at[:, 5].set(x[:, 7])  # ties: the gradient is shared between equal maxima
  plain, ours = _grads(lambda x: x.max(-1), x, bits=2)
  np.testing.assert_array_equal(ours, plain)


def test_row_sums_spanning_orders_of_magnitude_stay_exact():
  # 2048 row sums (above min_size, so they would be quantized if not kept)
  scales = jnp.logspace(-3, 3, 2048)[:, None]
  x = (jnp.abs(jax.random.normal(jax.random.key(0), (2048, 16))) + 0.1) * scales
  inverse_sums = lambda x: 1.0 / x.sum(-1)  # its gradient reads only the row sums
  plain, ours = _grads(inverse_sums, x, bits=2)
  np.testing.assert_array_equal(ours, plain)


def test_reduced_values_follow_statistics_not_activations():
  def layer_norm(x):
    mean = x.mean(-1, keepdims=True)
    inv = jax.lax.rsqrt(((x - mean) ** 2).mean(-1, keepdims=True) + 1e-6)
    return (x - mean) * inv

  jaxpr = jax.make_jaxpr(layer_norm)(jnp.ones((32, 64))).jaxpr
  reduced = reduced_values(jaxpr)
  shapes = {tuple(v.aval.shape) for v in reduced}
  assert (32, 1) in shapes  # mean, variance, rsqrt
  assert (32, 64) not in shapes  # centred and normalized activations are not statistics
