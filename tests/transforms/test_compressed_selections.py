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
from jact._transforms._vjp_residuals import reduced_values


def _grads(fn, x, bits, key=1):
  plain = jax.grad(lambda x: (fn(x) * jnp.cos(fn(x))).sum())(x)
  block = jact.compressed(fn, bits=bits, compress_argnums=(0,))
  ours = jax.grad(
    lambda x: (block(x, key=jax.random.key(key)) * jnp.cos(block(x, key=jax.random.key(key)))).sum()
  )(x)
  return plain, ours


@pytest.mark.parametrize(
  "window,strides,padding", [((2, 2), (2, 2), "VALID"), ((3, 3), (2, 2), "SAME")]
)
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


@pytest.mark.parametrize(
  "statistic",
  [
    lambda x: x.var(-1, keepdims=True),  # divides by n - ddof, a traced scalar, inside jit
    lambda x: x.std(-1, ddof=1, keepdims=True),
    lambda x: jax.lax.rsqrt(jnp.var(x, axis=-1, keepdims=True) + 1e-6),
    lambda x: jnp.maximum(0.0, jnp.var(x, axis=-1, keepdims=True)),
  ],
)  # Equinox's LayerNorm
def test_statistics_through_traced_scalars_are_reduced_values(statistic):
  """jnp.var's divisor is a scalar computed inside its jit: a scalar (or a value made
  from scalars alone) does not stop a statistic from being one, so it is kept exact
  instead of quantized on a grid shared by 256 rows."""
  jaxpr = jax.make_jaxpr(statistic)(jnp.ones((32, 64))).jaxpr
  assert all(v in reduced_values(jaxpr) for v in jaxpr.outvars)
  grown = jax.make_jaxpr(lambda x: x * statistic(x))(jnp.ones((32, 64))).jaxpr
  assert not any(v in reduced_values(grown) for v in grown.outvars)  # an activation again


def test_layer_norm_with_jnp_var_stores_its_statistics_exactly():
  def layer_norm(x):
    return (x - x.mean(-1, keepdims=True)) * jax.lax.rsqrt(x.var(-1, keepdims=True) + 1e-6)

  x = jax.random.normal(jax.random.key(0), (16, 32, 256)) * jnp.linspace(0.1, 10.0, 32)[:, None]
  block = jact.compressed(layer_norm, bits=2, compress_argnums=(0,))
  report = jact.residual_report(lambda x: block(x, key=jax.random.key(1)).sum(), x)
  exact = [r for r in report.residuals if r.name is None and tuple(r.shape) == (16, 32, 1)]
  assert len(exact) == 3 and all(r.dtype == jnp.float32 for r in exact)  # variance, rsqrt, x̂'s
  quantized = [r for r in report.residuals if r.dtype == jnp.uint8]
  # activation-sized codes, and one byte: jnp.var's n - ddof > 0 flag, a packed bool
  assert quantized and all(r.bytes >= 2**12 or r.shape == (1,) for r in quantized)


def test_equinox_layer_norm_keeps_its_statistics_exact():
  """eqx.nn.LayerNorm (jnp.var, then jnp.maximum(0, var)) applied per token by vmap,
  inside a whole-model wrap: no statistic is quantized."""
  eqx = pytest.importorskip("equinox", reason="the Equinox recipes need equinox (test extras)")
  norm = eqx.nn.LayerNorm(256)
  block = jact.compressed(lambda x: jax.vmap(jax.vmap(norm))(x), bits=4, compress_argnums=(0,))
  x = jax.random.normal(jax.random.key(0), (16, 64, 256))  # statistics: 1024 values, min_size
  report = jact.residual_report(lambda x: block(x, key=jax.random.key(1)).sum(), x)
  quantized = [r for r in report.residuals if r.dtype == jnp.uint8]
  assert quantized and all(r.bytes >= 2**12 or r.shape == (1,) for r in quantized)
  assert len([r for r in report.residuals if r.name is None and r.shape == (16, 64, 1)]) >= 2


def test_outer_wrap_keeps_the_pieces_a_scanned_inner_block_stored():
  """A compressed model around a scan over compressed blocks: the blocks'
  pieces leave the scan stacked (uint8 codes, bf16 group statistics); the
  model keeps them as they are instead of quantizing the statistics again."""

  def plain_block(w, x):
    return jnp.tanh(x @ w)

  block = jact.compressed(plain_block, bits=4, compress_argnums=(1,), name="block")

  def stack(ws, x, key):
    def body(h, wk):
      w, k = wk
      return block(w, h, key=k), None

    return jax.lax.scan(body, x, (ws, jax.random.split(key, ws.shape[0])))[0]

  ws = jax.random.normal(jax.random.key(0), (8, 512, 512)) / 512**0.5
  x = jax.random.normal(jax.random.key(1), (64, 512))
  key = jax.random.key(2)
  outer = jact.compressed(lambda ws, x: stack(ws, x, key), bits=2, name="model")
  inner_only = lambda ws: stack(ws, x, key).sum()
  wrapped = lambda ws: outer(ws, x, key=jax.random.key(3)).sum()
  np.testing.assert_array_equal(jax.grad(wrapped)(ws), jax.grad(inner_only)(ws))
  assert (
    jact.residual_report(wrapped, ws).total_bytes
    <= jact.residual_report(inner_only, ws).total_bytes
  )


def test_a_small_batch_matmul_output_is_not_a_statistic():
  # the output is 128x smaller than the weight, but it is an activation: compressed
  jaxpr = jax.make_jaxpr(lambda x, w: jnp.tanh(x @ w))(
    jnp.ones((8, 1024)), jnp.ones((1024, 1024))
  ).jaxpr
  assert not reduced_values(jaxpr)
