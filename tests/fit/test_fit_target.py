"""`jact.fit` beyond bits: an unmarked loss taken as one segment, and, for a GPU target,
JAX's own `jax.checkpoint` policies among the candidates, the fastest predicted step chosen.

The GPU-target tests compile with XLA:GPU for an H200 on this CPU (the CUDA PJRT plugin, the
`gpu-aot` extra in the test extra); they are skipped, naming the install, where it is missing.
"""

from __future__ import annotations

import importlib.util

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest

import jact
from jact import _gpu_target

needs_plugin = pytest.mark.skipif(
  importlib.util.find_spec("jax_plugins.xla_cuda12") is None
  and importlib.util.find_spec("jax_plugins.xla_cuda13") is None,
  reason=f"no CUDA PJRT plugin to compile for a GPU: {_gpu_target.install_hint()}",
)


class _ConvNet(nn.Module):
  """An ordinary Flax conv net: nothing marked, nothing converted."""

  @nn.compact
  def __call__(self, x):
    for features in (32, 64, 64):
      x = nn.relu(nn.Conv(features, (3, 3))(x))
      x = jax.nn.gelu(nn.Conv(features, (3, 3))(x))
    return nn.Dense(10)(x.mean((1, 2)))


@pytest.mark.slow
def test_fit_on_an_unmarked_conv_net_meets_a_third_of_its_plain_peak():
  model = _ConvNet()
  x = jax.ShapeDtypeStruct((32, 32, 32, 3), jnp.float32)
  y = jax.ShapeDtypeStruct((32,), jnp.int32)
  params = jax.eval_shape(model.init, jax.random.key(0), x)

  def loss(p, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(model.apply(p, x), y).mean()

  plain = jact.compiled_memory(jax.grad(loss), params, x, y)
  plain_peak = plain.argument_bytes + plain.output_bytes + plain.temp_bytes
  budget = plain_peak // 3
  fitted = jact.fit(loss, params, x, y, budget_bytes=budget)
  assert fitted.peak_bytes <= budget < fitted.written_peak_bytes
  assert fitted.segments == () and len(fitted.plan.entries) > 0
  # the configured step is the one measured: compiled again, it is within the budget
  step = lambda p, x, y, k: jax.grad(lambda p: fitted.loss_fn(p, x, y, key=k))(p)
  again = jact.compiled_memory(step, params, x, y, jax.random.key(0))
  assert again.argument_bytes + again.output_bytes + again.temp_bytes <= budget


def test_fit_rejects_unknown_policies():
  with pytest.raises(ValueError, match="unknown JAX policies"):
    jact.fit(lambda w: (w**2).sum(), jnp.ones(4), budget_bytes=10**6, policies=("dots",))
