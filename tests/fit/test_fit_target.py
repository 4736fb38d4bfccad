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
from jact._fit.segments import Layout
from jact._fit.steps import configure, step_cost

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


_D, _ROWS, _BLOCKS = 256, 2048, 3


def _marked_mlp_stack():
  def block(w, x):
    return x + jax.nn.gelu(x @ w[0]) @ w[1]

  segments = [jact.segment(block, name=f"block{i}", compress_argnums=(1,)) for i in range(_BLOCKS)]

  def loss(ws, x):
    for s, w in zip(segments, ws):
      x = s(w, x)
    return (x**2).mean()

  w = (
    jax.ShapeDtypeStruct((_D, 4 * _D), jnp.float32),
    jax.ShapeDtypeStruct((4 * _D, _D), jnp.float32),
  )
  return loss, [w] * _BLOCKS, jax.ShapeDtypeStruct((_ROWS, _D), jnp.float32)


def _fastest_within(fitted):
  eligible = [
    m
    for m in fitted.history
    if m.peak_bytes <= fitted.budget_bytes
    and (m.variance or 0.0) <= fitted.variance_bound * (1 + 1e-9)
  ]
  return min(m.predicted_seconds for m in eligible)


@needs_plugin
@pytest.mark.slow
def test_fit_for_a_gpu_returns_jax_remat_where_it_fits_and_is_faster():
  loss, ws, x = _marked_mlp_stack()
  m = jact.compiled_memory(jax.grad(loss), ws, x, target="h200")
  plain = m.argument_bytes + m.output_bytes + m.temp_bytes
  fitted = jact.fit(loss, ws, x, budget_bytes=int(0.6 * plain), target="h200", max_candidates=2)
  assert fitted.target == "h200" and fitted.policy is not None, fitted.report()
  assert fitted.peak_bytes <= fitted.budget_bytes and fitted.predicted_variance == 0.0
  assert fitted.predicted_seconds == _fastest_within(fitted)
  policies = [h for h in fitted.history if h.what.startswith("jax.checkpoint(")]
  assert len(policies) >= 3  # JAX's policies were compiled and weighed
  assert "not a measurement" in fitted.report() and "jax.checkpoint" in fitted.report()
  # the policy's step is what fit measured: compiled again for the GPU, it fits
  again = jact.compiled_memory(
    lambda ws, x, k: jax.grad(lambda ws: fitted.loss_fn(ws, x, key=k))(ws),
    ws,
    x,
    jax.random.key(0),
    target="h200",
  )
  assert again.argument_bytes + again.output_bytes + again.temp_bytes <= fitted.budget_bytes


@needs_plugin
@pytest.mark.slow
def test_fit_for_a_gpu_goes_below_every_jax_policy_with_jact():
  loss, ws, x = _marked_mlp_stack()
  policy_peaks = []
  for policy in ("nothing_saveable", "dots_saveable", "dots_with_no_batch_dims_saveable"):
    configured = configure(loss, Layout(policy=policy), None)
    policy_peaks.append(step_cost(configured, (ws, x), (0,), "h200").peak)
  budget = int(0.9 * min(policy_peaks))
  fitted = jact.fit(
    loss, ws, x, budget_bytes=budget, target="h200", max_candidates=3, variance_bound=1e30
  )
  assert fitted.policy is None and fitted.peak_bytes <= budget
  assert fitted.plan.entries, fitted.report()
