"""Compiled memory of converted linen models (XLA:CPU, compile only): dropout
does not cost what it saves, a model's own `nn.remat` does not fight convert."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jact

pytestmark = pytest.mark.slow  # every test compiles whole train steps

KEY = jax.ShapeDtypeStruct((), jax.random.key(0).dtype)


def _temp(model, x, **apply_kwargs) -> int:
  """Compiled temp bytes of a gradient step of `model` on `x` (abstract: nothing runs)."""
  variables = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros(x.shape, x.dtype)))

  def step(v, x, k):
    rngs = {"dropout": k, "jact": jax.random.fold_in(k, 1)}
    return jax.grad(lambda v: jnp.mean(model.apply(v, x, rngs=rngs, **apply_kwargs) ** 2))(v)

  return jact.compiled_memory(step, variables, x, KEY).temp_bytes


class DropoutMLP(nn.Module):
  rate: float = 0.1

  @nn.compact
  def __call__(self, x):
    for _ in range(4):
      x = nn.Dropout(self.rate, deterministic=False)(nn.relu(nn.Dense(512)(x)))
    return nn.Dense(10)(x)


def test_dropout_costs_convert_no_more_than_plain():
  # The twin keeps the mask packed to 1 bit and draws it once, after its input:
  # drawn again in the backward from the key, XLA:CPU kept every layer's random
  # bits alive (measured at this size: 2 bits above plain at rate 0.1).
  x = jax.ShapeDtypeStruct((512, 512), jnp.float32)
  saving = {}
  for rate in (0.0, 0.1, 0.5):
    plain = _temp(DropoutMLP(rate), x)
    converted = _temp(jact.convert(DropoutMLP(rate), bits=2), x)
    assert converted <= plain, (rate, converted, plain)
    saving[rate] = plain / converted
  # measured: 2.6x without dropout, 3.0x at 0.1 and 0.5
  assert saving[0.1] >= 0.8 * saving[0.0], saving
  assert saving[0.5] >= 0.8 * saving[0.0], saving


def test_dropout_twin_is_flax_and_keeps_a_packed_mask():
  x = jnp.asarray(np.random.default_rng(0).standard_normal((64, 256)), jnp.float32)
  model = DropoutMLP(0.3)
  variables = model.init(jax.random.key(0), x)
  rngs = {"dropout": jax.random.key(3), "jact": jax.random.key(4)}
  converted = jact.convert(model, bits=8)
  # the same rng consumption as plain Flax: the forward is bit-identical
  np.testing.assert_array_equal(
    converted.apply(variables, x, rngs=rngs), model.apply(variables, x, rngs=rngs)
  )
  report = jact.residual_report(
    lambda v: jnp.sum(converted.apply(v, x, rngs=rngs)), variables
  ).by_name()
  for i in range(4):
    assert report[f"Dropout_{i}.mask"].bytes == 64 * 512 // 8  # 1 bit a value
