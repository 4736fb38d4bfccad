"""`jact.fit` on an ordinary loss -- no `jact.segment`, no converted model -- compresses the
whole loss (one generic segment, as `jact.compressed` would) on the default path."""

import jax
import jax.numpy as jnp
from jax import lax

import jact

CHANNELS = (3, 32, 32, 64, 64, 64, 64)


def conv(x, w):
  return lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))


def loss(params, x):
  for w in params:
    x = jax.nn.gelu(conv(x, w))
  return jnp.mean(x**2)


def _peak(m):
  return m.argument_bytes + m.output_bytes + m.temp_bytes


def test_an_unmarked_conv_net_fits_a_third_of_its_plain_peak():
  keys = jax.random.split(jax.random.key(0), 7)
  params = [jax.random.normal(keys[i], (3, 3, CHANNELS[i], CHANNELS[i + 1])) / 8 for i in range(6)]
  x = jax.random.normal(keys[6], (16, 32, 32, 3))
  plain = _peak(jact.compiled_memory(jax.grad(loss), params, x))
  budget = plain // 3
  # the premise: jact.compressed of the whole loss at 2 bits reaches the budget
  whole = jact.compressed(loss, bits=2)
  two_bits = jact.compiled_memory(
    lambda p, x, k: jax.grad(lambda p: whole(p, x, key=k))(p), params, x, jax.random.key(1)
  )
  assert _peak(two_bits) <= budget < plain
  fitted = jact.fit(loss, params, x, budget_bytes=budget, max_candidates=3)
  assert fitted.peak_bytes <= budget < fitted.written_peak_bytes
  assert fitted.segments == () and len(fitted.plan) > 0
  # the configured step, compiled again by the helper, is within the budget too
  step = lambda p, x, k: jax.grad(lambda p: fitted.loss_fn(p, x, key=k))(p)
  assert _peak(jact.compiled_memory(step, params, x, jax.random.key(2))) <= budget
  # and its gradient is finite and close to the exact one (relative error < 0.2 at one key)
  exact = jax.grad(loss)(params, x)
  got = jax.jit(step)(params, x, jax.random.key(3))
  num = sum(float(jnp.sum((a - b) ** 2)) for a, b in zip(got, exact))
  assert (num / sum(float(jnp.sum(b**2)) for b in exact)) ** 0.5 < 0.2
